"""``TP2DStrategy``: Lightning training with the package's tensor-parallel layouts (docs/layouts.md, the Lightning
strategy).

Builds on Lightning's :class:`~lightning.pytorch.strategies.ModelParallelStrategy`, which brings the launcher,
process-group set-up, data-parallel sampler sharding and the DCP checkpoint plumbing. On top of it:

* ``setup_environment`` builds the layout's mesh, axes ``(data_parallel, row, col)`` or ``(data_parallel, ring)``;
  with ``layout="auto"`` it first asks the planner (:func:`lightning_tp2d.planning.planner.plan`) which layout, sizes,
  ZeRO stage and checkpointing train the model fastest in this job's devices and memory (:meth:`plan_layout`);
* ``setup`` finds the :class:`~lightning_tp2d.models.GPT2` modules inside the LightningModule and parallelizes
  them (no ``configure_model`` parallel code needed); models built on the meta device are materialised shard by
  shard from one seed, eager models are first made identical on every rank (broadcast from rank 0);
* after each backward that ends an accumulation window, gradients are averaged over ``data_parallel`` (the tensor
  axes are already summed inside the layers' backward) by :mod:`lightning_tp2d.training`, which also holds the
  shard-aware clipping: Fabric and plain-torch loops use the same functions;
* ``Trainer(gradient_clip_val=...)`` clips by the norm of the *whole* gradient across all shards (Lightning clips
  through the precision plugin; ``setup`` points its two clipping methods at :func:`clip_grad_norm_` and
  :func:`clip_grad_value_`), for fused optimizers too under ``bf16-mixed`` (:mod:`lightning_tp2d.precision`);
* checkpoints go through :mod:`lightning_tp2d.checkpoint` (sharded directory or one full file, layout-free).

Every rank of a tensor-parallel group is fed the same batch: the sampler shards over ``data_parallel`` only.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info

from lightning_tp2d import checkpoint as ckpt
from lightning_tp2d import families
from lightning_tp2d.comm import naming_failures
from lightning_tp2d.core import TensorParallelCore, find_model_config
from lightning_tp2d.precision import allow_clipping_without_scaler, precision_name
from lightning_tp2d.quiet import silence_known_noise
from lightning_tp2d.training import GradientSync, clip_grad_value_
from lightning_tp2d.zero import clipped_parameters

if TYPE_CHECKING:
    from lightning_tp2d.planning.planner import PlanRow


class TP2DStrategy(TensorParallelCore, ModelParallelStrategy):
    """Tensor-parallel GPT-2 training on a ``dp x p`` mesh.

    Args:
        layout: ``"2d"`` (SUMMA on a ``q x q`` grid), ``"metp"`` (ring of ``p``) or ``"2d-metp"``, or a
            :class:`~lightning_tp2d.layouts.Layout` object (which carries the layers' ``TPOptions``), or ``"auto"``:
            the planner's fastest configuration that fits (:meth:`plan_layout`), which also sets ``zero_stage`` and
            ``activation_checkpointing`` (leave those at their defaults; restrict them with ``plan_options``).
            ``tensor_parallel_size`` / ``data_parallel_size`` given as numbers restrict the plan to them.
        tensor_parallel_size: ranks per model replica ``p``, or ``"auto"``: the largest size valid for the layout
            (square for the grid layouts; dividing the model's heads and width when the model is known) that
            divides the devices of one node.
        data_parallel_size: model replicas, or ``"auto"``: the world size divided by ``p``.
        allow_fallback: when both sizes are ``"auto"`` and no replica larger than one device fits the devices of a
            node (3 devices under the square grid layouts, one device per node, a model whose heads no side
            divides), train data-parallel replicas of whole models (``p = 1``). ``False`` (default): a
            ``ValueError`` naming the sizes that fit, since "tensor parallel" training of whole models is rarely
            what was meant.
        save_distributed_checkpoint: ``True`` writes a sharded directory (torch.distributed.checkpoint), one file
            per rank; ``False`` gathers everything into one full file on rank 0.
        process_group_backend: ``"gloo"``, ``"nccl"`` ...; default from the device.
        timeout: how long any collective may wait for a rank (a ``timedelta`` or seconds): the default process group
            and every mesh axis group get it, so a stalled or dead rank ends the job within about this time, with an
            error naming the axis (:func:`~lightning_tp2d.mesh.init_mesh`).
        activation_checkpointing: ``"none"``, ``"full"`` (each transformer block recomputes its forward in the
            backward and keeps only its input) or ``"selective"`` (LayerNorm and GELU outputs and the mirrored head
            block are rebuilt in the backward; matmul outputs kept): :func:`~lightning_tp2d.parallelize.checkpoint_activations`.
        activation_offload: with full checkpointing, move the input each block keeps to host memory in the forward
            and bring it back, one block ahead, in the backward (:mod:`lightning_tp2d.offload`: pinned memory and a
            side stream on CUDA; plain host copies on CPU; tensors under 1 MiB stay on the device); gradients are
            bit-identical. With ``activation_checkpointing="none"`` it means ``"full"`` (a warning says so); with
            ``"selective"`` or ``compile`` it is a ``ValueError``. With ``layout="auto"`` the plan is restricted to
            full checkpointing (priced without offload).
        compile: ``torch.compile`` every parallelized ``GPT2`` in place (``nn.Module.compile``: parameter names and
            checkpoints unchanged) after sharding: ``False`` (default), ``True`` (the inductor backend), a backend
            name (``"aot_eager"`` ...) or a dict of ``torch.compile`` keyword arguments. Graphs specialise on
            shapes (``dynamic=False`` unless given); every communicating layer is one registered op
            (:mod:`lightning_tp2d.ops`), so the model compiles into one graph without breaks. At ``zero_stage`` 2
            and 3 (``dp > 1``) each transformer block is compiled alone instead (one graph for the equal blocks),
            so that FSDP's all-gathers and reduce-scatters run between them; the rest stays eager.
        zero_stage: ``1`` shards every optimizer's state over the ``data_parallel`` replicas (ZeRO-1,
            :mod:`lightning_tp2d.zero`): each keeps and updates the state of a 1/dp slice of every parameter and
            all-gathers them after the step. ``2`` and ``3`` shard the gradients, and at ``3`` the parameters, over
            ``data_parallel`` with torch's FSDP2 (:mod:`lightning_tp2d.fsdp`: each block's parameters gathered
            just before use, gradients reduce-scattered during the backward, the optimizer state of this rank's
            shard only; the parameters FSDP keeps whole, GPT-2's fused q/k/v bias on the grids, get ZeRO-1's
            slices); under ``precision="bf16-mixed"`` with FSDP's mixed precision (parameters float32 at rest,
            gathered and computed in bf16, gradients reduced in float32; ``"bf16-true"``: reduced in float32:
            :func:`~lightning_tp2d.fsdp.mixed_precision_policy`); with ``dp = 1`` a warning and no sharding. ``0``
            (default): each replica keeps the full state of its tensor shard.
        memory_gib: ``layout="auto"``: GiB of memory per device the plan may fill (90% of it: the planner's
            ``memory_fraction``). Default on CUDA: the device's total memory; required on CPU (a ``ValueError``
            without it).
        plan: a :class:`~lightning_tp2d.train_plan.TrainPlan` (``lightning_tp2d.TrainPlan``): layout, sizes,
            ``zero_stage``, ``activation_checkpointing`` and ``activation_offload`` in one object, e.g. a planner's
            choice, instead of those arguments (any of them given must equal the plan's: a ``ValueError`` names the
            ones that do not; a :class:`~lightning_tp2d.layouts.Layout` object of the plan's layout keeps its
            options). Its ``precision``, if set, must be the Trainer's; its ``micro_batch`` is advice. Its
            properties decide the step (:func:`~lightning_tp2d.step.assemble_step`).
        pipeline_parallel_size: pipeline stages of whole blocks (default 1: none; :mod:`lightning_tp2d.pipeline`): the
            mesh becomes ``pipeline x data_parallel x`` the layout's axes, ``pp`` dividing the machines (or, on one
            machine, its devices). The model's call in ``training_step`` runs the schedule's forward and backward and
            returns the loss (no graph: the strategy's backward adds the held gradients); validation runs the
            forward-only schedule; clipping is over every stage; each stage writes its own part of a sharded
            checkpoint. Not with ``compile``, ``activation_offload``, ``layout="auto"`` or
            ``save_distributed_checkpoint=False``; ``predict`` and generation across stages are refused.
        pp_schedule: ``"gpipe"``, ``"1f1b"`` (default; at least ``pp`` micro-batches) or ``"interleaved_1f1b"``
            (``virtual_stages`` per rank; micro-batches in multiples of ``pp``): torch's schedules.
        microbatches: micro-batches each batch is split into (default ``pp x virtual_stages``); the batch size must
            be a multiple. ``Trainer(accumulate_grad_batches=...)`` accumulates whole pipelined steps on top.
        virtual_stages: stages per pipeline rank (``interleaved_1f1b`` only).
        plan_options: ``layout="auto"``: further arguments of :func:`~lightning_tp2d.planning.planner.plan`
            (:data:`~lightning_tp2d.core.PLAN_OPTIONS`): ``seq`` (default: the model's ``block_size``),
            ``global_batch_tokens`` (default: one sequence per device), ``hardware`` (priced as, default
            ``"h100"``), ``layouts``, ``zero_stages``, ``checkpointing``, ``max_micro_batch``, ``memory_fraction``,
            ``compiled``.
    """

    strategy_name = "tp2d"
    plans_layout = True  # layout="auto": setup_environment knows the module before the process group starts

    # __init__: TensorParallelCore's (the one argument set of both strategies)

    def _check_arguments(self, *args) -> None:
        silence_known_noise()  # Lightning's known-harmless warnings and tips (lightning_tp2d.quiet)
        super()._check_arguments(*args)

    def _init_state(self) -> None:
        self._grad_sync_blocked = False
        self._grad_sync: GradientSync | None = None

    # ---- sizes, precision: checked when the Trainer is built, before any process group --------------------

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        self._check_precision()
        if self.layout_spec is None:  # layout="auto": planned in setup_environment, once the module is known
            self._device_memory_gib(early=True)
        else:
            self._resolve(None)
        launcher = self._launcher
        if launcher is not None:  # Lightning starts the other local ranks: check module and data once, before it does
            launch = launcher.launch

            def checked_launch(function, *args, **kwargs):
                trainer = kwargs.get("trainer")
                fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
                self._check_module_and_data(args, fitting)
                return launch(function, *args, **kwargs)

            launcher.launch = checked_launch

    def _check_module_and_data(self, args, fitting: bool) -> None:
        """In the launching process, before any other rank starts: the module's data sizes (its
        ``check_data_sizes``, e.g. a data ``block_size`` longer than the model's), packed documents on a layout
        without per-document attention and, for ``fit``, the training batch size the layout needs. A mismatch found after the launch stops every rank with its own traceback."""
        module = next((a for a in args if isinstance(a, LightningModule)), None)
        data = next((a for a in args if isinstance(a, LightningDataModule)), None)
        if data is None:
            return
        if module is not None and hasattr(module, "check_data_sizes"):
            module.check_data_sizes(data)
        if getattr(data, "pack_documents", False) is True and self.layout_spec is not None:
            problem = self.layout_spec.documents_problem()
            if problem:
                raise ValueError(problem)
        batch = getattr(data, "batch_size", None) if fitting and self.layout_spec is not None else None
        problem = self.batch_problem(batch) if batch else None
        if problem:
            raise ValueError(problem)

    def _check_precision(self) -> None:
        self._check_precision_name(precision_name(self.precision_plugin))

    # ---- environment and model ----------------------------------------------------------------------------

    def setup_environment(self) -> None:
        self._limit_cpu_threads()
        # layout="auto": rank 0 plans before the process group (the planner traces on a fake one of its own), and
        # every rank takes its row once the group exists
        planned = self._plan_once(self._plan_job) if self.layout_spec is None else None
        self._setup_distributed()
        if planned is not None:
            self.plan_layout(planned)
        plan = self._resolve(find_model_config(self.lightning_module))
        # validate/test after fit, or a second Trainer, reuse the mesh the module is parallelized on
        self._mesh = self._build_mesh(plan, self.lightning_module)
        self.lightning_module._device_mesh = self._mesh

    def _plan_job(self) -> list[PlanRow]:
        """The planner's rows for the LightningModule's model on this job's ``devices x num_nodes`` devices of
        :meth:`_device_memory_gib` GiB (:meth:`~lightning_tp2d.core.TensorParallelCore._plan`)."""
        config = find_model_config(self.lightning_module)
        if config is None:
            raise ValueError("layout='auto' plans for the model inside the LightningModule, but it holds no model of "
                             f"a registered family ({families.model_names()}) nor a `config` of one")
        return self._plan(config, self._device_memory_gib(), self.num_processes, self.num_nodes)

    def plan_layout(self, planned: tuple | None = None) -> PlanRow:
        """``layout="auto"``: take the fastest configuration (layout, sizes, ZeRO stage, checkpointing) of the plan
        for this job (:meth:`_plan_job`) and log it and the runner-up on rank 0; return it (also
        :attr:`chosen_plan`). The plan is made once, on rank 0, before the process group
        (:meth:`~lightning_tp2d.core.TensorParallelCore._plan_once`: ``planned``, as ``setup_environment`` passes
        it; ``None``: made here), and every rank takes rank 0's rows (sent once the group exists,
        :meth:`~lightning_tp2d.core.TensorParallelCore._share_plan`), so all ranks run one plan."""
        rows = self._share_plan(self._plan_once(self._plan_job) if planned is None else planned)
        self._take_plan(rows[0])
        runner_up = f"; runner-up: {rows[1].describe()}" if len(rows) > 1 else ""
        rank_zero_info(f"layout='auto' chose {rows[0].describe()} (predicted, of {len(rows)} that fit; "
                       f"micro-batch x accumulation is advice: the data and Trainer keep theirs){runner_up}")
        return rows[0]

    def _device_memory_gib(self, early: bool = False) -> float | None:
        """GiB per device for the plan: ``memory_gib``, else this CUDA device's total memory; on CPU ``memory_gib``
        is required. ``early`` (when the Trainer is built): only check that, touching no CUDA device yet."""
        if self.memory_gib is not None:
            return self.memory_gib
        if self.root_device.type != "cuda":
            raise ValueError(f"layout='auto' on {self.root_device.type} needs memory_gib=<GiB per device> (the memory "
                             "the plan may fill per process; CUDA devices report theirs)")
        return None if early else torch.cuda.mem_get_info(self.root_device)[1] / 2**30

    def setup(self, trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self.parallelize_models(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        # the plan's step (lightning_tp2d.step): zero_stage 2/3 FSDP2 over data_parallel, before the optimizers;
        # stages 0/1 when fitting (dp > 1): GradientSync's buckets overlapping the backward, once per module
        pipelined = self.train_plan.pipelined  # (the stages average their gradients themselves: backward below)
        step = self.assemble(self.model, sync=fitting and self._grad_sync is None and not pipelined)
        self._install_gradient_clipping()
        # evaluate under no_grad, never inference_mode (DTensor and gloo collectives; docs/layouts.md, the strategy)
        for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop, trainer.fit_loop.epoch_loop.val_loop):
            loop.inference_mode = False
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            for optimizer in self.optimizers:  # its state to the device, as Lightning does ("step" stays put)
                for fields in _unwrap(optimizer).state.values():
                    for key, value in fields.items() if isinstance(fields, dict) else ():
                        if key != "step":
                            fields[key] = move_data_to_device(value, self.root_device)
            for optimizer in self.optimizers:  # before a checkpoint is restored: each replica loads only its slices
                step.shard_optimizer(_unwrap(optimizer))  # (stage 2/3: of what FSDP keeps whole; its shards pass)
            if self._grad_sync is None:  # (stage 2/3: FSDP's reduce-scatter averages)
                self._grad_sync = step.gradient_sync

    # ---- gradients ----------------------------------------------------------------------------------------

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip the data-parallel all-reduce while gradients accumulate (the last micro-batch syncs the sum)."""
        previous, self._grad_sync_blocked = self._grad_sync_blocked, True
        sharded = self.sharded_models(self.model)
        if self._grad_sync is not None:
            self._grad_sync.enabled = False
        for m in sharded:  # FSDP keeps the unreduced gradients until a backward outside
            m.set_requires_gradient_sync(False)
        try:  # (pipeline stages: backward below averages only outside)
            yield None
        finally:
            self._grad_sync_blocked = previous
            if self._grad_sync is not None:
                self._grad_sync.enabled = not previous
            for m in sharded:
                m.set_requires_gradient_sync(not previous)

    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Lightning's backward; with pipeline stages the model's call in ``training_step`` already ran the
        schedule's forward and backward: its gradients are added here (scaled as Lightning scaled the loss, by
        ``accumulate_grad_batches``), after the loop zeroed the previous step's, and averaged over
        ``data_parallel`` when the backward ends an accumulation window (:meth:`pipelined_backward`)."""
        if not self.pipelines(self.model):
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self.pipelined_backward(self.model, closure_loss, average=not self._grad_sync_blocked)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if not self._grad_sync_blocked and self._grad_sync is not None:
            self._grad_sync.finish()  # the buckets went out during the backward

    def _install_gradient_clipping(self) -> None:
        # Lightning clips through the precision plugin; route it to the shard-aware versions (idempotent), and let
        # it clip for fused optimizers: no supported precision has a gradient scaler (lightning_tp2d.precision)
        plugin = allow_clipping_without_scaler(self.precision_plugin)
        def params(optimizer):
            return clipped_parameters(_unwrap(optimizer), plugin.main_params(optimizer))

        def by_norm(optimizer, clip_val):
            pipelines = self.pipelines(self.model)
            if pipelines:  # the whole model's norm, over every stage (the pipeline's own clip)
                return [pipeline.clip_grad_norm_(clip_val) for pipeline in pipelines]
            return self.clip_norm_(params(optimizer), clip_val)

        plugin.clip_grad_by_norm = lambda optimizer, clip_val: by_norm(optimizer, clip_val)  # (_private_api's patch)
        plugin.clip_grad_by_value = lambda optimizer, clip_val: clip_grad_value_(params(optimizer), clip_val)

    def on_train_start(self) -> None:
        super().on_train_start()
        for size in train_batch_sizes(self.lightning_module.trainer):
            problem = self.batch_problem(size)
            if problem:
                raise ValueError(problem)

    # ---- Lightning's own collectives: a dead or stalled rank is one CommError line, as in the layers ---------

    def barrier(self, name: str | None = None) -> None:
        with naming_failures(f"barrier {name!r}" if name else "barrier"):
            super().barrier(name)

    def broadcast(self, obj, src: int = 0):
        with naming_failures(f"broadcast of a {type(obj).__name__} from rank {src}"):
            return super().broadcast(obj, src)

    def reduce(self, tensor, group: Any | None = None, reduce_op: Any | None = "mean"):
        with naming_failures(f"all_reduce ({reduce_op}) of a logged value"):
            return super().reduce(tensor, group=group, reduce_op=reduce_op)

    # ---- checkpoints (lightning_tp2d.checkpoint) ----------------------------------------------------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        if self._sharded_checkpoints:
            return ckpt.sharded_model_state(self.model)  # live DTensors (tied ones recognised by identity)
        return ckpt.full_model_state(self.model, self.global_rank)

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        optimizer = _unwrap(optimizer)
        if self._sharded_checkpoints:
            return ckpt.sharded_optimizer_state(self.model, optimizer)
        return ckpt.full_optimizer_state(self.model, optimizer, self.global_rank)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("TP2DStrategy.save_checkpoint(..., storage_options=...) is not supported")
        # a rank that dies mid-save fails the others in DCP's collectives or the save's own: one line, as mid-step,
        # naming the save (its broadcast and barriers are Lightning's own, not the named ones below)
        with naming_failures(f"the save of checkpoint {str(filepath)!r}"):
            path = Path(super().broadcast(str(filepath)))
            checkpoint["tp2d"] = self.checkpoint_info(self.model)
            if self.pipelines(self.model):  # each stage writes its own part (checkpoint.load_into(partial=True))
                checkpoint["tp2d_partial"] = True
            ckpt.save(checkpoint, path, rank=self.global_rank, sharded=self._sharded_checkpoints,
                      barrier=super().barrier)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load into the live model and optimizers (:func:`~lightning_tp2d.checkpoint.load_into`: checksums checked,
        pickles read as data); ``weights_only=False`` (``trainer.fit(..., weights_only=False)``) trusts the file's
        pickles, which may run code: only for files you trust."""
        path = Path(self.broadcast(str(checkpoint_path)))
        optimizers = [_unwrap(o) for o in self.optimizers]
        return ckpt.load_into(self.model, optimizers, path, strict=self.lightning_module.strict_loading,
                              trust_checkpoint=weights_only is False, partial=bool(self.pipelines(self.model)))


# ---- helpers (no Lightning state) ---------------------------------------------------------------------------


def _unwrap(optimizer):
    """The torch optimizer behind Lightning's ``LightningOptimizer`` wrapper (or the optimizer itself)."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def train_batch_sizes(trainer) -> list[int]:
    loaders = trainer.train_dataloader
    if loaders is None:
        return []
    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    elif not isinstance(loaders, (list, tuple)):
        loaders = [loaders]
    return [dl.batch_size for dl in loaders if getattr(dl, "batch_size", None)]
