"""What a benchmark step measures on each rank: live tensor memory (:class:`lightning_tp2d.planning.live.LiveTensorBytes`,
the same mode the memory model profiles fake steps with) and (on GPU) the allocator's numbers.

:func:`step_peak_bytes` measures a whole training step that way, at a ZeRO stage, as the strategies run it: what
:mod:`lightning_tp2d.planning.memory_model` predicts (``tests/test_memory_model.py`` and
``recipes/benchmarks/memory_model.py`` compare the two).
"""

from __future__ import annotations

import warnings

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_tp2d import fsdp
from lightning_tp2d.baselines.tp1d import parallelize_1d
from lightning_tp2d.baselines.tp1d_sp import AXIS, DP_AXIS, init_tp_dp_mesh, shard_1d_data_parallel
from lightning_tp2d.families import family_of_config
from lightning_tp2d.layouts import Grid2D, GridRing, Ring, handle_of
from lightning_tp2d.mesh import init_mesh
from lightning_tp2d.models import GPT2Config, LlamaConfig
from lightning_tp2d.planning.live import LiveTensorBytes, adamw_kernel, resident_bytes
from lightning_tp2d.parallelize import checkpoint_activations, parallelize
from lightning_tp2d.step import assemble_step
from lightning_tp2d.train_plan import TrainPlan
from lightning_tp2d.zero import full_param_groups


def step_peak_bytes(model: torch.nn.Module, mesh, idx: torch.Tensor, *, zero_stage: int = 0,
                    max_norm: float = 1.0, fused: bool = False) -> dict[str, int]:
    """This rank's measured peak of one training step of ``model`` (parallelized on ``mesh``, with any activation
    checkpointing already applied) on the batch ``idx`` (inputs and targets, ``[batch, seq]`` per replica), at ZeRO
    ``zero_stage`` as the strategies run it, assembled by the same call (:func:`lightning_tp2d.step.assemble_step`):
    2 and 3 shard the model with :func:`~lightning_tp2d.fsdp.shard_data_parallel` (when ``data_parallel`` has more
    than one rank), 0 and 1 average gradients with :class:`~lightning_tp2d.training.GradientSync` and clip over every
    parameter, 1 shards the optimizer state (:func:`~lightning_tp2d.zero.shard_optimizer_state`). The optimizer is
    an AdamW with ``foreach`` (``fused``: the fused kernel, as ``CausalLMModule`` runs it on a GPU), weight decay on
    the matrices (``CausalLMModule``'s groups).

    A warm-up step first (the optimizer state and FSDP's lazy buffers exist after it), then ``zero_grad``, forward,
    backward, data-parallel averaging, global-norm clipping, ``step``: ``{"resident"`` (bytes before the measured
    step: :func:`resident_bytes`), ``"step"`` (the peak of the tensors the step allocates: :class:`LiveTensorBytes`
    with ``count_resizes``), ``"peak"`` (their sum), ``"largest"`` (the largest tensors alive at that peak:
    :attr:`LiveTensorBytes.largest`)``}``."""
    handle = handle_of(model)
    plan = TrainPlan(handle.layout.name, handle.tensor_parallel_size, handle.data_parallel_size, zero_stage)
    with warnings.catch_warnings():  # stage 2/3 on one replica: nothing to shard (assemble_step warns)
        warnings.simplefilter("ignore", UserWarning)
        assembled = assemble_step(model, mesh, plan)  # before the optimizer: it sees the dp shards
    decay = [q for q in model.parameters() if q.dim() >= 2]
    rest = [q for q in model.parameters() if q.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=1e-4, **adamw_kernel(fused))
    assembled.shard_optimizer(optimizer)  # (2/3: what FSDP keeps whole)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(idx, idx).backward()
        if assembled.gradient_sync is not None:
            assembled.gradient_sync.finish()
        # at stages 2/3 the dp shards of the gradients included
        assembled.clip_grad_norm_(model.parameters() if plan.clip_with_fsdp
                                  else [q for group in full_param_groups(optimizer) for q in group], max_norm)
        optimizer.step()

    return _warm_then_measured(step, model, optimizer)


def _warm_then_measured(step, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """``step()`` once (the optimizer state and FSDP's lazy buffers exist after it), then again under
    :class:`LiveTensorBytes`: ``{"resident", "step", "peak", "largest"}``."""
    step()
    optimizer.zero_grad(set_to_none=True)
    resident = resident_bytes(model, optimizer)
    tracker = LiveTensorBytes(record_shapes=False, count_resizes=True)
    with tracker:
        step()
    return {"resident": resident, "step": tracker.peak, "peak": resident + tracker.peak, "largest": tracker.largest}


def measured_peaks(rank: int, world_size: int, cases, batch: int, seq: int,
                   fused: bool = False) -> list[dict[str, int]]:
    """:func:`step_peak_bytes` of each case on this rank (``fused``: its AdamW's fused kernel), every rank of a process
    group of ``world_size`` calling it with the same ``cases``: ``(cfg, layout, p, zero_stage, checkpointing)``, ``dp = world_size // p``; the model
    of ``cfg``'s family built on the meta device and parallelized (materialised from seed 0), each replica fed its
    own ``[batch, seq]`` ids. One mesh per layout and ``p``."""
    meshes, out = {}, []
    for cfg, layout, p, stage, checkpointing in cases:
        if (layout, p) not in meshes:
            meshes[(layout, p)] = init_mesh(layout, p, world_size // p)
        mesh = meshes[(layout, p)]
        with torch.device("meta"):
            model = family_of_config(cfg).model_class(cfg)
        torch.manual_seed(0)
        parallelize(model, mesh, layout)
        checkpoint_activations(model, checkpointing)
        torch.manual_seed(1 + mesh.get_local_rank("data_parallel"))
        idx = torch.randint(0, cfg.vocab_size, (batch, seq))
        out.append(step_peak_bytes(model, mesh, idx, zero_stage=stage, fused=fused))
        del model
    return out


def baseline_step_peak_bytes(model: torch.nn.Module, mesh, idx: torch.Tensor, *, zero_stage: int = 3,
                             precision: str = "32-true", max_norm: float = 1.0) -> dict[str, int]:
    """:func:`step_peak_bytes` for the 1-D baseline: ``model`` parallelized by
    :func:`~lightning_tp2d.baselines.tp1d.parallelize_1d` with sequence parallelism on the ``"tp"`` axis of ``mesh``
    (:func:`~lightning_tp2d.baselines.tp1d_sp.init_tp_dp_mesh`), any activation checkpointing applied, then sharded over
    ``"dp"`` at ``zero_stage`` 2 or 3 by :func:`~lightning_tp2d.baselines.tp1d_sp.shard_1d_data_parallel` (torchtitan's
    ``apply_fsdp``) with FSDP's policy for ``precision`` (``"bf16-mixed"``: bf16 parameters in the forward and
    backward, float32 reduction, no autocast, as torchtitan trains). An AdamW with ``foreach`` (one group per
    mesh: the foreach kernels take one mesh's DTensors), global-norm clipping as torchtitan's (each mesh's norm
    reduced, the total applied to every gradient). The same warm-up step, then the measured one:
    ``{"resident", "step", "peak", "largest"}``."""
    shard_1d_data_parallel(model, mesh[DP_AXIS], zero_stage, fsdp.mixed_precision_policy(precision))
    groups: dict = {}
    for q in model.parameters():
        groups.setdefault(q.device_mesh if isinstance(q, DTensor) else None, []).append(q)
    optimizer = torch.optim.AdamW([{"params": g} for g in groups.values()], lr=1e-4, foreach=True)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(idx, idx).backward()
        norms = [torch.nn.utils.get_total_norm([q.grad for q in g if q.grad is not None], foreach=True)
                 for g in groups.values()]
        total = torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]).norm()
        for g in groups.values():
            torch.nn.utils.clip_grads_with_norm_(g, max_norm, total, foreach=True)
        optimizer.step()

    return _warm_then_measured(step, model, optimizer)


def baseline_measured_peaks(rank: int, world_size: int, cases, batch: int, seq: int) -> list[dict[str, int]]:
    """:func:`baseline_step_peak_bytes` of each case on this rank (every rank of a process group of ``world_size``
    calling it with the same ``cases``: ``(cfg, tp, zero_stage, checkpointing, precision)``, ``dp = world_size //
    tp``): the model of ``cfg``'s family built from seed 0, parallelized with 1-D TP + SP, checkpointed, sharded;
    each replica fed its own ``[batch, seq]`` ids. One mesh per ``tp``."""
    meshes, out = {}, []
    for cfg, tp, stage, checkpointing, precision in cases:
        if tp not in meshes:
            meshes[tp] = init_tp_dp_mesh(tp, world_size // tp)
        mesh = meshes[tp]
        torch.manual_seed(0)
        model = family_of_config(cfg).model_class(cfg)
        parallelize_1d(model, mesh[AXIS], sequence_parallel=True)
        checkpoint_activations(model, checkpointing)
        torch.manual_seed(1 + mesh.get_local_rank(DP_AXIS))
        idx = torch.randint(0, cfg.vocab_size, (batch, seq))
        out.append(baseline_step_peak_bytes(model, mesh, idx, zero_stage=stage, precision=precision))
        del model
    return out


# ---- the baseline's checked grid (tests/test_memory_model.py, recipes/benchmarks/memory_model_baseline.py) ----------

BASELINE_BATCH, BASELINE_SEQ, BASELINE_TP = 4, 64, 2
BASELINE_WORLDS = (4, 8)  # tp 2 x dp 2 and tp 2 x dp 4
# (model, zero stage, checkpointing, precision, blocks): both families at 2 and 4 blocks, ZeRO stages 3 and 2,
# checkpointing none and full, float32 and bf16 mixed (FSDP's param_dtype, no autocast, as torchtitan trains)
BASELINE_GRID = [(name, stage, ck, precision, depth) for name in ("gpt2", "llama") for stage in (3, 2)
                 for ck in ("none", "full") for precision in ("32-true", "bf16-mixed") for depth in (2, 4)]


def baseline_grid_config(name: str, depth: int):
    """The grid's model ``name`` (``"gpt2"`` or ``"llama"``: width 192, 4 heads, vocabulary 512; Llama with 2 key /
    value heads and an MLP of 512) with ``depth`` blocks."""
    if name == "gpt2":
        return GPT2Config.from_name("gpt2-tiny", n_layer=depth, n_embd=192, n_head=4, vocab_size=512,
                                    block_size=BASELINE_SEQ, dropout=0.0)
    return LlamaConfig.from_name("llama-tiny", n_layer=depth, n_embd=192, n_head=4, n_kv_head=2,
                                 intermediate_size=512, vocab_size=512)


def baseline_grid_cases(cases) -> list[tuple]:
    """Grid ``cases`` as :func:`baseline_measured_peaks` takes them."""
    return [(baseline_grid_config(name, depth), BASELINE_TP, stage, ck, precision)
            for name, stage, ck, precision, depth in cases]


# ---- the layouts' checked grid (tests/test_memory_model.py, recipes/benchmarks/memory_model.py) ------------------

GRID_BATCH, GRID_SEQ, GRID_WORLD = 4, 64, 8  # dp = GRID_WORLD // p
# (model, layout, p, zero stage, checkpointing, blocks): the grid's two models (baseline_grid_config) on every layout
# with dp 2 x ZeRO stages 0, 1, 3 x checkpointing none and full; selective on the ring and the grid at stage 0; 8
# blocks (deeper than the 4 and 5 the memory model extrapolates from) on the ring at stages 0 and 3 and on the grid
# of rings at stage 3 with full checkpointing
GRID = [(name, layout, 4, stage, ck, 2) for name in ("gpt2", "llama")
        for layout in (Ring.name, Grid2D.name, GridRing.name) for stage in (0, 1, 3) for ck in ("none", "full")]
GRID += [(name, layout, 4, 0, "selective", 2) for name in ("gpt2", "llama") for layout in (Ring.name, Grid2D.name)]
GRID += [(name, Ring.name, 4, stage, ck, 8) for name in ("gpt2", "llama") for stage in (0, 3)
         for ck in ("none", "full")]
GRID += [(name, GridRing.name, 4, 3, "full", 8) for name in ("gpt2", "llama")]


def grid_config(case):
    """The model of a :data:`GRID` case (:func:`baseline_grid_config`'s, with the case's blocks)."""
    return baseline_grid_config(case[0], case[5])


# ops whose result the host must read from the device before it can go on (or whose output shape depends on data)
_SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "repeat_interleave")


class HostSyncCounter(TorchDispatchMode):
    """Counts the aten ops of a region that stop a device stream on the host: ``.item()`` / ``bool(t)``
    (``_local_scalar_dense``), ``nonzero``, ``masked_select``, ``unique``, ``repeat_interleave`` and indexing with a
    boolean mask (``index`` / ``index_put`` with bool indices). On CPU they cost nothing, but each one is a stall
    on a GPU and a graph break under ``torch.compile``; a training step should have none (``counts`` by op name,
    ``total``). DTensor operations are let through first, so the local ops they desugar into are seen."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _SYNC_OPS or (name in ("index", "index_put", "index_put_") and _bool_index(args)):
            key = name if name in _SYNC_OPS else f"{name}[bool]"
            self.counts[key] = self.counts.get(key, 0) + 1
        return func(*args, **kwargs)


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in (indices or ()))
