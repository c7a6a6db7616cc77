"""``TP2DStrategy``: Lightning training with the package's tensor-parallel layouts (DESIGN 6).

Builds on Lightning's :class:`~lightning.pytorch.strategies.ModelParallelStrategy`, which brings the launcher,
process-group set-up, data-parallel sampler sharding and the DCP checkpoint plumbing. On top of it:

* ``setup_environment`` builds the layout's mesh, axes ``(data_parallel, row, col)`` or ``(data_parallel, ring)``;
* ``setup`` finds the :class:`~lightning_tp2d.models.GPT2` modules inside the LightningModule and parallelizes
  them (no ``configure_model`` parallel code needed); models built on the meta device are materialised shard by
  shard from one seed, eager models are first made identical on every rank (broadcast from rank 0);
* after each backward that ends an accumulation window, gradients are averaged over ``data_parallel`` (the tensor
  axes are already summed inside the layers' backward) by :mod:`lightning_tp2d.training`, which also holds the
  shard-aware clipping: Fabric and plain-torch loops use the same functions;
* ``Trainer(gradient_clip_val=...)`` clips by the norm of the *whole* gradient across all shards (Lightning clips
  through the precision plugin; ``setup`` points its two clipping methods at :func:`clip_grad_norm_` and
  :func:`clip_grad_value_`);
* checkpoints go through :mod:`lightning_tp2d.checkpoint` (sharded directory or one full file, layout-free).

Every rank of a tensor-parallel group is fed the same batch: the sampler shards over ``data_parallel`` only.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn as nn
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn

from lightning_tp2d import checkpoint as ckpt
from lightning_tp2d.layouts import STRATEGY_NAMES, Layout, get_layout, handle_of
from lightning_tp2d.mesh import ParallelDims, as_timeout, init_mesh
from lightning_tp2d.models.gpt2 import GPT2, GPT2Config
from lightning_tp2d.parallelize import ACTIVATION_CHECKPOINTING, checkpoint_activations, parallelize
from lightning_tp2d.training import GradientSync, broadcast_module_, clip_grad_norm_, clip_grad_value_

SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "bf16-true")


def compile_options(compile: bool | str | dict | None) -> dict | None:
    """``torch.compile`` keyword arguments for the strategy's ``compile`` argument (``None``: no compilation)."""
    if compile is None or compile is False:
        return None
    if compile is True:
        options: dict = {}
    elif isinstance(compile, str):
        options = {"backend": compile}
    elif isinstance(compile, Mapping):
        options = dict(compile)
    else:
        raise ValueError(f"compile must be a bool, a backend name or a dict of torch.compile arguments, "
                         f"got {compile!r}")
    options.setdefault("dynamic", False)
    return options


class TP2DStrategy(ModelParallelStrategy):
    """Tensor-parallel GPT-2 training on a ``dp x p`` mesh.

    Args:
        layout: ``"2d"`` (SUMMA on a ``q x q`` grid), ``"metp"`` (ring of ``p``) or ``"2d-metp"``, or a
            :class:`~lightning_tp2d.layouts.Layout` object (which carries the layers' ``TPOptions``).
        tensor_parallel_size: ranks per model replica ``p``, or ``"auto"``: the largest size valid for the layout
            (square for the grid layouts; dividing the model's heads and width when the model is known) that
            divides the devices of one node.
        data_parallel_size: model replicas, or ``"auto"``: the world size divided by ``p``.
        save_distributed_checkpoint: ``True`` writes a sharded directory (torch.distributed.checkpoint), one file
            per rank; ``False`` gathers everything into one full file on rank 0.
        process_group_backend: ``"gloo"``, ``"nccl"`` ...; default from the device.
        timeout: how long any collective may wait for a rank (a ``timedelta`` or seconds): the default process group
            and every mesh axis group get it, so a stalled or dead rank ends the job within about this time, with an
            error naming the axis (:func:`~lightning_tp2d.mesh.init_mesh`).
        activation_checkpointing: ``"none"``, ``"full"`` (each transformer block recomputes its forward in the
            backward and keeps only its input) or ``"selective"`` (LayerNorm and GELU outputs and the mirrored head
            block are rebuilt in the backward; matmul outputs kept): :func:`~lightning_tp2d.parallelize.checkpoint_activations`.
        compile: ``torch.compile`` every parallelized ``GPT2`` in place (``nn.Module.compile``: parameter names and
            checkpoints unchanged) after sharding: ``False`` (default), ``True`` (the inductor backend), a backend
            name (``"aot_eager"`` ...) or a dict of ``torch.compile`` keyword arguments. Graphs specialise on
            shapes (``dynamic=False`` unless given); every communicating layer is one registered op
            (:mod:`lightning_tp2d.ops`), so the model compiles into one graph without breaks.
    """

    strategy_name = "tp2d"

    def __init__(self, layout: str | Layout = "2d", tensor_parallel_size: Literal["auto"] | int = "auto",
                 data_parallel_size: Literal["auto"] | int = "auto", save_distributed_checkpoint: bool = True,
                 process_group_backend: str | None = None, timeout: timedelta | float | None = default_pg_timeout,
                 activation_checkpointing: str = "none", compile: bool | str | dict = False) -> None:
        spec = get_layout(layout)
        if activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            raise ValueError(f"activation_checkpointing={activation_checkpointing!r} is not one of "
                             f"{', '.join(map(repr, ACTIVATION_CHECKPOINTING))}")
        self.activation_checkpointing = activation_checkpointing
        self.compile_options = compile_options(compile)
        if self.compile_options is not None and activation_checkpointing == "selective":
            raise ValueError("compile with activation_checkpointing='selective' is not supported: its saved-tensor "
                             "hooks and recipes run in eager mode only (use 'full', or no compile)")
        checkpointed = activation_checkpointing != "none"
        if self.compile_options is not None and checkpointed and not spec.compiles_checkpointed:
            raise ValueError(f"compile with activation_checkpointing={activation_checkpointing!r} is not supported "
                             f"for layout {spec.name!r} yet: torch 2.13's AOTAutograd fails to save the DTensor "
                             "parameters' metadata inside a checkpointed region (use one of them, or layout 'metp' / "
                             "'2d-metp')")
        for name, value in (("tensor_parallel_size", tensor_parallel_size), ("data_parallel_size", data_parallel_size)):
            if value != "auto" and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be 'auto' or a positive int, got {value!r}")
        self.timeout = as_timeout(timeout)
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=self.timeout)
        self.layout_spec = spec
        self.layout = spec.name
        self._requested = (tensor_parallel_size, data_parallel_size)
        self._dims: ParallelDims | None = None
        self._grad_sync_blocked = False
        self._grad_sync: GradientSync | None = None

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        for name, layout in STRATEGY_NAMES.items():
            strategy_registry.register(name, cls, description=f"tensor-parallel GPT-2, layout {layout!r}",
                                       layout=layout, override=True)

    # ---- sizes, precision: checked when the Trainer is built, before any process group --------------------

    @property
    def parallel_dims(self) -> ParallelDims:
        if self._dims is None:
            raise RuntimeError("TP2DStrategy sizes are resolved when the Trainer is built")
        return self._dims

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        self._check_precision()
        self._dims = self._resolve_dims(None)

    def _check_precision(self) -> None:
        name = precision_name(self.precision_plugin)
        if name not in SUPPORTED_PRECISION:
            raise ValueError(f"TP2DStrategy supports precision {list(SUPPORTED_PRECISION)}, got {name!r}")

    def _resolve_dims(self, config: GPT2Config | None) -> ParallelDims:
        world, per_node = self.num_nodes * self.num_processes, self.num_processes
        tp, dp = self._requested
        if tp == "auto" and dp == "auto":
            tp = self.layout_spec.auto_tensor_parallel_size(per_node, world, config)
        elif tp == "auto":
            if world % dp:
                raise ValueError(f"data_parallel_size={dp} does not divide the world size {world} "
                                 f"({self.num_nodes} nodes x {per_node} devices)")
            tp = world // dp
        if dp == "auto":
            if world % tp:
                raise ValueError(f"tensor_parallel_size={tp} does not divide the world size {world} "
                                 f"({self.num_nodes} nodes x {per_node} devices)")
            dp = world // tp
        dims = ParallelDims(self.layout_spec, tp, dp)
        dims.check_world_size(world)
        if config is not None:
            dims.check_model(config.n_head, config.n_embd)
        return dims

    # ---- environment and model ----------------------------------------------------------------------------

    def setup_environment(self) -> None:
        if self.root_device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # CPU ranks share the node's cores; more threads than cores makes every collective wait (torchrun
            # sets OMP_NUM_THREADS=1 for the same reason)
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.num_processes))
        self._setup_distributed()
        dims = self._resolve_dims(find_gpt2_config(self.lightning_module))
        self._dims = dims
        self._data_parallel_size, self._tensor_parallel_size = dims.data_parallel_size, dims.tensor_parallel_size
        self._device_mesh = self._reusable_mesh(dims) or init_mesh(
            self.layout_spec, dims.tensor_parallel_size, dims.data_parallel_size, device_type=self.root_device.type,
            timeout=self.timeout)
        self.lightning_module._device_mesh = self._device_mesh

    def _reusable_mesh(self, dims: ParallelDims):
        """The mesh a GPT2 inside the module is already parallelized on, when it is this layout and these sizes:
        ``trainer.validate/test`` after ``fit``, or a second Trainer on the same module, then keep its shards (a new
        mesh would make them foreign). ``None`` when there is none, or it does not fit (then parallelizing
        refuses, naming both)."""
        for module in self.lightning_module.modules():
            handle = handle_of(module) if isinstance(module, GPT2) else None
            if handle is None or handle.layout != self.layout_spec:
                continue
            if (handle.tensor_parallel_size, handle.data_parallel_size) == (dims.tensor_parallel_size,
                                                                           dims.data_parallel_size):
                return handle.mesh
        return None

    def setup(self, trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self.parallelize_gpt2_modules(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._install_gradient_clipping()
        # DESIGN 6: evaluate under no_grad, never inference_mode (DTensor and gloo collectives).
        for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop, trainer.fit_loop.epoch_loop.val_loop):
            loop.inference_mode = False
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
            if self._grad_sync is None:  # data-parallel all-reduces in buckets, overlapping the backward
                self._grad_sync = GradientSync(self.model, self.device_mesh)

    def parallelize_gpt2_modules(self, module: nn.Module) -> None:
        """Parallelize every not yet parallel :class:`GPT2` inside ``module`` on this strategy's mesh."""
        found = [(name, m) for name, m in module.named_modules() if isinstance(m, GPT2)]
        if not found:
            raise TypeError(
                f"{type(module).__name__} holds no lightning_tp2d.models.GPT2: TP2DStrategy parallelizes the GPT2 "
                "modules it finds inside the LightningModule (build one in __init__ or configure_model)")
        seed = None
        for index, (name, gpt) in enumerate(found):
            done = handle_of(gpt)
            if done is not None:
                if done.layout != self.layout_spec or done.mesh is not self.device_mesh:
                    raise ValueError(f"GPT2 {name!r} is already parallelized with layout {done.layout.name!r} on "
                                     "another mesh")
                continue
            if any(p.is_meta for p in gpt.parameters()):
                seed = self._init_seed() if seed is None else seed
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed + index)  # the same full weights on every rank, whatever the layout
                    parallelize(gpt, self.device_mesh, self.layout_spec)
            else:
                broadcast_module_(gpt, self.device_mesh)
                parallelize(gpt, self.device_mesh, self.layout_spec)
            checkpoint_activations(gpt, self.activation_checkpointing)
            if self.compile_options is not None:
                gpt.compile(**self.compile_options)
        left = [n for n, p in module.named_parameters() if p.is_meta]
        if left:
            raise ValueError(f"parameters outside the GPT2 modules are still on the meta device: {left[:5]}")

    def _init_seed(self) -> int:
        """The seed meta-device GPT2s are drawn from (the i-th from ``seed + i``): the LightningModule's
        ``init_seed`` attribute if it has one, else rank 0's current seed."""
        seed = getattr(self.lightning_module, "init_seed", None)
        if seed is None:  # rank 0's seed, so that a meta model materialises alike everywhere
            seed = self.broadcast(torch.initial_seed())
        return int(seed)

    # ---- gradients ----------------------------------------------------------------------------------------

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip the data-parallel all-reduce while gradients accumulate (the last micro-batch syncs the sum)."""
        previous, self._grad_sync_blocked = self._grad_sync_blocked, True
        if self._grad_sync is not None:
            self._grad_sync.enabled = False
        try:
            yield None
        finally:
            self._grad_sync_blocked = previous
            if self._grad_sync is not None:
                self._grad_sync.enabled = not previous

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if not self._grad_sync_blocked and self._grad_sync is not None:
            self._grad_sync.finish()  # the buckets went out during the backward

    def _install_gradient_clipping(self) -> None:
        # Lightning clips through the precision plugin; route it to the shard-aware versions (idempotent).
        plugin = self.precision_plugin
        plugin.clip_grad_by_norm = lambda optimizer, clip_val: clip_grad_norm_(
            plugin.main_params(optimizer), clip_val, self.device_mesh)
        plugin.clip_grad_by_value = lambda optimizer, clip_val: clip_grad_value_(plugin.main_params(optimizer), clip_val)

    def on_train_start(self) -> None:
        super().on_train_start()
        p = self.parallel_dims.tensor_parallel_size
        for size in train_batch_sizes(self.lightning_module.trainer):
            problem = self.layout_spec.batch_problem(p, size)
            if problem:
                raise ValueError(problem)

    # ---- checkpoints (lightning_tp2d.checkpoint) ----------------------------------------------------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        if self._save_distributed_checkpoint:
            return self.model.state_dict(keep_vars=True)  # live DTensors (tied ones recognised by identity)
        return ckpt.full_model_state(self.model, self.global_rank)

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        optimizer = _unwrap(optimizer)
        if self._save_distributed_checkpoint:
            return ckpt.sharded_optimizer_state(self.model, optimizer)
        return ckpt.full_optimizer_state(self.model, optimizer, self.global_rank)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("TP2DStrategy.save_checkpoint(..., storage_options=...) is not supported")
        path = Path(self.broadcast(str(filepath)))
        checkpoint["tp2d"] = self.checkpoint_info()
        ckpt.save(checkpoint, path, rank=self.global_rank, sharded=self._save_distributed_checkpoint,
                  barrier=self.barrier)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        optimizers = [_unwrap(o) for o in self.optimizers]
        return ckpt.load_into(self.model, optimizers, path, strict=self.lightning_module.strict_loading)

    def checkpoint_info(self) -> dict[str, Any]:
        """What a checkpoint records about the run that wrote it (informative; loading needs none of it)."""
        dims = self.parallel_dims
        configs = {name: vars(m.config) for name, m in self.model.named_modules() if isinstance(m, GPT2)}
        return {"layout": dims.layout, "tensor_parallel_size": dims.tensor_parallel_size,
                "data_parallel_size": dims.data_parallel_size, "gpt2_configs": configs}


# ---- helpers (no Lightning state) ---------------------------------------------------------------------------


def _unwrap(optimizer):
    """The torch optimizer behind Lightning's ``LightningOptimizer`` wrapper (or the optimizer itself)."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def precision_name(plugin: Precision) -> str:
    """The Trainer ``precision`` string a plugin stands for (the class name when it is none we know)."""
    if isinstance(plugin, (MixedPrecision, HalfPrecision)):
        return plugin.precision
    if type(plugin) is Precision:
        return "32-true"
    return getattr(plugin, "precision", type(plugin).__name__)


def auto_tensor_parallel_size(layout: str | Layout, per_node: int, world: int, config: GPT2Config | None) -> int:
    """Largest ``p`` dividing the devices of one node (and so the world) that is valid for ``layout`` and, if
    known, splits the model's heads and width (the layout's rule)."""
    return get_layout(layout).auto_tensor_parallel_size(per_node, world, config)


def find_gpt2_config(module: nn.Module | None) -> GPT2Config | None:
    """The config of the (first) GPT2 inside ``module``, or of a ``config`` attribute before it is built."""
    if module is None:
        return None
    for m in module.modules():
        if isinstance(m, GPT2):
            return m.config
    config = getattr(module, "config", None)
    return config if isinstance(config, GPT2Config) else None


def train_batch_sizes(trainer) -> list[int]:
    loaders = trainer.train_dataloader
    if loaders is None:
        return []
    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    elif not isinstance(loaders, (list, tuple)):
        loaders = [loaders]
    return [dl.batch_size for dl in loaders if getattr(dl, "batch_size", None)]
