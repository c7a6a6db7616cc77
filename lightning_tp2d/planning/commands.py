"""From a plan to a run: the command lines that train a :class:`~lightning_tp2d.planning.planner.PlanRow`.

* a package row: ``tp2d-train`` overrides (``conf/``): ``model=<name>`` (the ``conf/model`` option of the same
  name), ``parallel=<the layout's strategy name>`` and its sizes, ZeRO stage, checkpointing, offload and ``compile``,
  the row's micro-batch (``data.batch_size``) and accumulation (``trainer.accumulate_grad_batches``), the sequence
  length (``data.block_size``), the devices and nodes, and ``parallel.memory_gib`` so that ``tp2d-train`` checks the
  predicted peak before it launches (:func:`train_overrides`, :func:`train_command`); and the data: a token file,
  ``data=tokens data.path=YOUR_TOKENS.bin`` (:data:`TOKEN_FILE`, a placeholder), with the lines that say how many
  tokens it must hold (:func:`data_lines`: the least ``tp2d-train``'s pre-launch check accepts, by the data module's
  own rule, :func:`lightning_tp2d.token_need.least_tokens`; what one whole step and ``trainer.max_steps`` read): the
  default corpus (the Python documentation, ~466k byte tokens) holds too few for a planned run's batches;
* a 1-D baseline row (torch's 1-D TP + SP x FSDP2, or CP): torchtitan's settings (:func:`torchtitan_settings`),
  and for the TP rows the Lightning ``ModelParallelStrategy`` that runs the same mesh with a user's
  ``parallelize_fn`` (:func:`lightning_strategy`).

:func:`command_for` picks by the row. The rows are read by their fields only (nothing here imports the planner).
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

from lightning_tp2d.families import model_config
from lightning_tp2d.layouts import get_layout, strategy_name
from lightning_tp2d.planning.rivals import BASELINE
from lightning_tp2d.rivals import get_rival, is_rival, rivals
from lightning_tp2d.token_need import least_tokens, split_need, stream_need
from lightning_tp2d.train_plan import fsdp_shards

if TYPE_CHECKING:  # pragma: no cover
    from lightning_tp2d.planning.planner import PlanRow

__all__ = ["TOKEN_FILE", "command_for", "data_lines", "lightning_strategy", "torchtitan_settings", "train_command",
           "train_overrides"]

TOKEN_FILE = "YOUR_TOKENS.bin"  # the placeholder for the user's token file (Hydra's grammar refuses "<...>")
# The conf/ defaults that decide the tokens tp2d-train demands (tests/test_plan_command.py composes conf/ and checks
# that these are its values and that the number printed is the one tp2d-train's check demands):
VAL_FRACTION = 0.05  # conf/data/tokens.yaml data.val_fraction: the file's tail is the validation split
VALIDATES = True  # conf/config.yaml trainer.limit_val_batches=8: validation runs, in full batches per replica
MAX_STEPS = 300  # conf/config.yaml trainer.max_steps
UINT16_IDS = 1 << 16  # a raw .bin of uint16 ids (conf/data/tokens.yaml's data.dtype) holds ids below this


def _devices(row: PlanRow, gpus_per_node: int) -> tuple[int, int]:
    """``(devices per node, nodes)`` of the row's ``p x dp`` GPUs, whole nodes of ``gpus_per_node`` when it spans
    more than one."""
    pp = row.pipeline_parallel_size
    world = row.tensor_parallel_size * row.data_parallel_size * pp
    if world <= gpus_per_node:
        return world, 1
    if world % gpus_per_node:
        raise ValueError(f"{f'pp={pp} x ' if pp > 1 else ''}p={row.tensor_parallel_size} x dp="
                         f"{row.data_parallel_size} = {world} GPUs is not a whole number of nodes of {gpus_per_node}")
    return gpus_per_node, world // gpus_per_node


def train_overrides(row: PlanRow, model: str, seq: int, *, gpus_per_node: int, gpu_memory_gib: float | None = None,
                    compiled: bool = True) -> list[str]:
    """The ``tp2d-train`` overrides that run the package row ``row`` for the named size ``model`` on sequences of
    ``seq`` tokens. ``compiled``: the row was priced compiled; ``parallel.compile=true`` is added where the strategy
    compiles that configuration (not with selective checkpointing or offload, not with checkpointing on a layout
    whose checkpointed blocks do not compile). ``gpu_memory_gib``: the cap planned for, checked again by
    ``tp2d-train`` before launch."""
    if row.baseline:
        raise ValueError(f"{row.layout} is a baseline row; tp2d-train runs the package's layouts "
                         "(torchtitan_settings gives the baseline's settings)")
    spec = get_layout(row.layout)
    devices, nodes = _devices(row, gpus_per_node)
    out = [f"model={model}", f"parallel={strategy_name(spec)}",
           f"parallel.tensor_parallel_size={row.tensor_parallel_size}",
           f"parallel.data_parallel_size={row.data_parallel_size}", f"parallel.zero_stage={row.zero_stage}",
           f"parallel.activation_checkpointing={row.checkpointing}"]
    if row.activation_offload:
        out.append("parallel.activation_offload=true")
    if row.float8:
        out.append(f"parallel.float8={row.float8}")
    staged = row.pipeline_parallel_size > 1  # the schedule's micro-batches are the data's batch, split
    if staged:
        out += [f"parallel.pipeline_parallel_size={row.pipeline_parallel_size}",
                f"parallel.pp_schedule={row.pp_schedule}", f"parallel.microbatches={row.grad_accum}"]
        if row.virtual_stages > 1:
            out.append(f"parallel.virtual_stages={row.virtual_stages}")
    compiles = (row.checkpointing == "none" or (row.checkpointing == "full" and spec.compiles_checkpointed)) \
        and not row.activation_offload and not staged
    if compiled and compiles:
        out.append("parallel.compile=true")
    if gpu_memory_gib is not None:
        out.append(f"parallel.memory_gib={gpu_memory_gib:g}")
    out += ["trainer=gpu" if nodes == 1 else "trainer=multinode", f"trainer.devices={devices}",
            f"trainer.num_nodes={nodes}", f"trainer.accumulate_grad_batches={1 if staged else row.grad_accum}",
            "data=tokens", f"data.path={TOKEN_FILE}"]
    if model_config(model).vocab_size > UINT16_IDS:
        out.append("data.dtype=uint32")
    out += [f"data.batch_size={row.micro_batch * (row.grad_accum if staged else 1)}", f"data.block_size={seq}"]
    if seq > model_config(model).block_size:  # the data's windows are at most the model's block_size
        out.append(f"model.block_size={seq}")
    return out


def train_command(row: PlanRow, model: str, seq: int, **kwargs) -> str:
    """``tp2d-train`` and :func:`train_overrides`, quoted for a shell (every node runs the same command)."""
    return shlex.join(["tp2d-train", *train_overrides(row, model, seq, **kwargs)])


def data_lines(row: PlanRow, model: str, seq: int) -> list[str]:
    """What the token file of :func:`train_overrides` (:data:`TOKEN_FILE`) must hold, as lines to print under the
    command: the least tokens ``tp2d-train`` accepts before it launches (its train split and its validation split, the
    last :data:`VAL_FRACTION`, each ``micro_batch x dp`` windows of ``seq`` tokens:
    :func:`~lightning_tp2d.token_need.least_tokens`, the data module's own rule), the tokens whose train split holds
    one whole step of the row's ``micro_batch x grad_accum`` sequences per replica (with fewer, each epoch ends in a
    shorter step), and what :data:`MAX_STEPS` steps read (a smaller file is read again, epoch after epoch)."""
    dp, micro, accum = row.data_parallel_size, row.micro_batch, row.grad_accum
    if row.pipeline_parallel_size > 1:  # the schedule's micro-batches are one batch of the data, split
        micro, accum = micro * accum, 1
    ids = "uint32 ids, data.dtype=uint32" if model_config(model).vocab_size > UINT16_IDS else "uint16 ids"
    least = least_tokens(seq, micro, dp, validates=VALIDATES, val_fraction=VAL_FRACTION)
    val = split_need(seq, micro, dp)[0] if VALIDATES else split_need(seq)[0]
    whole = stream_need(split_need(seq, micro * accum, dp)[0], val, VAL_FRACTION)
    step = dp * micro * accum * seq
    return [f"data: replace {TOKEN_FILE} with your token file (raw {ids}, or a .npy) of at least {least:,} tokens: the "
            f"least tp2d-train accepts (its train split and its validation split, the last data.val_fraction="
            f"{VAL_FRACTION:g}, each data.batch_size={micro} x {dp} replica(s) = {micro * dp} windows of {seq} tokens)",
            ("data: that holds one whole step" if whole <= least else f"data: one whole step needs {whole:,}")
            + f" ({dp} replica(s) x {micro} x {accum} sequences = {step:,} tokens); trainer.max_steps={MAX_STEPS} "
            f"reads {MAX_STEPS * step:,} tokens: a smaller file is read again, epoch after epoch "
            "(trainer.max_steps=N stops sooner)"]


def torchtitan_settings(row: PlanRow, seq: int, *, compiled: bool = True) -> list[str]:
    """torchtitan's command-line settings for the baseline row ``row``: TP degree (inside each CP rank for CP rows),
    CP degree, FSDP's shard degree and HSDP's replicate degree (``row.shard_group``), FSDP2's resharding (stage 2:
    never after the forward), activation checkpointing (selective: per op, as the planner prices it), async TP (which
    torchtitan runs compiled), compile, the micro-batch and the sequence length; a global batch when the row
    accumulates. The model's own ``--model.*`` settings are the user's."""
    rival = get_rival(row.layout) if is_rival(row.layout) else None
    if not row.baseline or rival is None or not rival.torchtitan:
        ran = ", ".join(r.name for r in rivals(torchtitan=True))
        raise ValueError(f"{row.layout!r} is not a torchtitan configuration (its rows: {ran})")
    cp = row.context_parallel_size if rival.context_parallel else 1
    dp, shards = row.data_parallel_size, row.shard_group or row.data_parallel_size
    out = [f"--parallelism.tensor_parallel_degree={row.tensor_parallel_size // cp}"]
    if cp > 1:
        out.append(f"--parallelism.context_parallel_degree={cp}")
    out.append(f"--parallelism.data_parallel_shard_degree={shards}")
    if dp // shards > 1:
        out.append(f"--parallelism.data_parallel_replicate_degree={dp // shards}")
    if row.zero_stage == 2:
        out.append("--parallelism.fsdp_reshard_after_forward=never")
    out.append(f"--activation_checkpoint.mode={row.checkpointing}")
    if row.checkpointing == "selective":
        out.append("--activation_checkpoint.selective_ac_option=op")
    if row.async_tp:
        out.append("--parallelism.enable_async_tensor_parallel")
    if row.float8:  # torchao's recipe on every linear but the head (torchtitan's float8 converter)
        out += ["--model.converters=quantize.linear.float8", f"--quantize.linear.float8.recipe_name={row.float8}"]
        if row.float8 == "tensorwise" and fsdp_shards(row.zero_stage, shards * cp):  # (FSDP over dp_shard x cp)
            out += ["--quantize.linear.float8.enable_fsdp_float8_all_gather",
                    "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"]
    if compiled or row.async_tp:
        out.append("--compile.enable")
    out += [f"--training.local_batch_size={row.micro_batch}", f"--training.seq_len={seq}"]
    if row.pipeline_parallel_size > 1:  # torchtitan splits each local batch into micro-batches of this size
        schedule = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B"}[row.pp_schedule]
        out[-2] = f"--training.local_batch_size={row.micro_batch * row.grad_accum}"
        out += [f"--parallelism.pipeline_parallel_degree={row.pipeline_parallel_size}",
                f"--parallelism.pipeline_parallel_schedule={schedule}",
                f"--parallelism.pipeline_parallel_microbatch_size={row.micro_batch}"]
    elif row.grad_accum > 1:
        out.append(f"--training.global_batch_size={row.micro_batch * dp * row.grad_accum}")
    return out


def lightning_strategy(row: PlanRow) -> str:
    """The Lightning ``ModelParallelStrategy`` whose ``(data_parallel, tensor_parallel)`` mesh runs the baseline row
    with a user's ``parallelize_fn`` (torch's 1-D TP + SP plan, then FSDP2 over the data-parallel axis): TP rows only
    (it has no context-parallel axis)."""
    if not row.baseline or not (is_rival(row.layout) and get_rival(row.layout).planned):
        raise ValueError(f"{row.layout!r}: Lightning's ModelParallelStrategy runs the 1-D TP ({BASELINE}) rows only")
    return (f"ModelParallelStrategy(tensor_parallel_size={row.tensor_parallel_size}, "
            f"data_parallel_size={row.data_parallel_size})")


def command_for(row: PlanRow, model: str, seq: int, *, gpus_per_node: int, gpu_memory_gib: float | None = None,
                compiled: bool = True) -> str:
    """What runs ``row``, as lines to print: the ``tp2d-train`` command of a package row and what its token file must
    hold (:func:`data_lines`); torchtitan's launch and settings of a baseline row, and Lightning's strategy for a
    1-D TP one."""
    if not row.baseline:
        return "\n".join([train_command(row, model, seq, gpus_per_node=gpus_per_node, gpu_memory_gib=gpu_memory_gib,
                                        compiled=compiled), *data_lines(row, model, seq)])
    devices, nodes = _devices(row, gpus_per_node)
    lines = [f"torchrun --nnodes={nodes} --nproc_per_node={devices} -m torchtitan.train "
             f"--job.config_file=<{model}'s torchtitan toml> " + " ".join(torchtitan_settings(row, seq,
                                                                                               compiled=compiled))]
    if is_rival(row.layout) and get_rival(row.layout).planned:
        lines.append(f"Lightning: Trainer(devices={devices}, num_nodes={nodes}, strategy={lightning_strategy(row)}) "
                     "with torch's 1-D TP + SP plan and FSDP2 in its parallelize_fn"
                     + (f", the linears but the head converted by torchao's convert_to_float8_training "
                        f"({row.float8!r} recipe) before it" if row.float8 else ""))
    return "\n".join(lines)
