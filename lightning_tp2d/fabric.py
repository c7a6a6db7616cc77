"""``TP2DFabricStrategy``: the package's tensor-parallel layouts under Lightning Fabric.

``Fabric(strategy="tp2d" | "metp" | "tp2d_metp")`` (registered on ``import lightning_tp2d``) or
``Fabric(strategy=TP2DFabricStrategy(layout=..., ...))``:

.. code-block:: python

    fabric = L.Fabric(strategy="tp2d", devices=4, accelerator="cpu")
    fabric.launch()
    with fabric.init_module(empty_init=True):      # meta device: each rank materialises only its shards
        model = GPT2(GPT2Config.from_name("gpt2"))
    model = fabric.setup(model)                    # parallelized on the layout's mesh
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-4))
    loss = model(idx, targets); fabric.backward(loss)   # data-parallel averaging overlapped with the backward
    fabric.clip_gradients(model, optimizer, max_norm=1.0)  # the global norm over every shard
    optimizer.step(); optimizer.zero_grad()
    fabric.save("ckpt", {"model": model, "optimizer": optimizer, "step": step})

It shares the Trainer strategy's core (:class:`~lightning_tp2d.core.TensorParallelCore`: sizes, the mesh, finding
and parallelizing the :class:`~lightning_tp2d.models.GPT2` modules, ZeRO 1 to 3 (FSDP's mixed precision from Fabric's
``precision``), compile, activation checkpointing and offload)
and its checkpoint code (:mod:`lightning_tp2d.checkpoint`): a ``fabric.save`` checkpoint is the same sharded
directory (or full file) a Trainer writes, loads under any layout, grid or data-parallel size, on one device
(:func:`~lightning_tp2d.export.load_gpt2`), and exports to transformers.

``fabric.setup(model, optimizer)`` also works when the optimizer was made before the model was parallelized: its
parameters are replaced by the sharded ones, by name.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch.optim import Optimizer

from lightning_tp2d import checkpoint as ckpt
from lightning_tp2d.core import TensorParallelCore
from lightning_tp2d.training import GradientSync, clip_grad_value_
from lightning_tp2d.zero import clipped_parameters

__all__ = ["TP2DFabricStrategy"]


class TP2DFabricStrategy(TensorParallelCore, ModelParallelStrategy):
    """Tensor-parallel GPT-2 under Fabric on a ``dp x p`` mesh; the arguments are
    :class:`~lightning_tp2d.strategy.TP2DStrategy`'s, ``plan`` (a
    :class:`~lightning_tp2d.train_plan.TrainPlan`) included."""

    strategy_name = "tp2d"

    # __init__: TensorParallelCore's (the one argument set of both strategies)

    def _base_arguments(self) -> dict:
        return {"parallelize_fn": self._parallelize_fn_unused}

    def _init_state(self) -> None:
        self._backward_sync_control = _GradientSyncControl(self)  # fabric.no_backward_sync
        self._grad_syncs: dict[int, GradientSync] = {}
        self._sync_blocked = False
        self._pipelined_modules: list[nn.Module] = []

    @staticmethod
    def _parallelize_fn_unused(module, mesh):  # setup_module parallelizes the GPT2 modules itself
        return module

    # ---- sizes and the mesh -------------------------------------------------------------------------------

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        self._check_precision_name(_precision_name(self.precision))
        self._resolve(None)

    def setup_environment(self) -> None:
        super(ModelParallelStrategy, self).setup_environment()  # the accelerator; the mesh is ours
        self._limit_cpu_threads()
        self._setup_distributed()
        self._mesh = self._build_mesh(self._resolve(None), None)  # the device_mesh property's (TensorParallelCore)

    # ---- module and optimizers ----------------------------------------------------------------------------

    def setup_module(self, module: nn.Module) -> nn.Module:
        self._check_model(module)
        self.parallelize_models(module)
        module.to(self.root_device)  # whatever lies outside the GPT2 modules (already on their device)
        # the plan's step (lightning_tp2d.step): zero_stage 2/3 FSDP2 over data_parallel (its reduce-scatter
        # averages); stages 0/1 (dp > 1) GradientSync, all-reduces in buckets overlapping the backward, once a module
        if self.train_plan.pipelined:  # (the stages average their gradients: backward)
            self._pipelined_modules.append(module)
        step = self.assemble(module, sync=id(module) not in self._grad_syncs and not self.train_plan.pipelined)
        if step.gradient_sync is not None:
            self._grad_syncs[id(module)] = step.gradient_sync
        return module

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer], scheduler=None):
        names = {id(p): n for n, p in module.named_parameters()}
        module = self.setup_module(module)
        params = dict(module.named_parameters())
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                if any(id(p) in names and names[id(p)] not in params for p in group["params"]):
                    raise ValueError("the optimizer holds parameters the model no longer has after parallelizing")
                group["params"] = [params[names[id(p)]] if id(p) in names else p for p in group["params"]]
            if optimizer.state:
                raise ValueError("the optimizer already has state for the model's unsharded parameters: set up the "
                                 "model first (fabric.setup(model)), then build the optimizer and call "
                                 "fabric.setup_optimizers(optimizer)")
        return module, [self.setup_optimizer(o) for o in optimizers], scheduler

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        self.shard_optimizer(optimizer)  # (stage 2/3: slices of the parameters FSDP keeps whole; its shards pass)
        return optimizer

    # ---- gradients ----------------------------------------------------------------------------------------

    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        if self.train_plan.pipelined:  # the model's call ran the schedule's backward: add its gradients
            self.precision.pre_backward(tensor, module)
            self.pipelined_backward(module if module is not None else self._pipelined_root(), tensor,
                                    average=not self._sync_blocked)
            self.precision.post_backward(tensor, module)
            return
        super().backward(tensor, module, *args, **kwargs)
        if not self._sync_blocked:
            for sync in self._syncs_of(module):
                sync.finish()  # the buckets went out during the backward

    @contextmanager
    def blocked_backward_sync(self, module: nn.Module) -> Generator[None, None, None]:
        """Gradients accumulate locally inside; the next backward outside averages the sum."""
        syncs, sharded = self._syncs_of(module), self.sharded_models(module)
        previous, self._sync_blocked = self._sync_blocked, True
        for sync in syncs:
            sync.enabled = False
        for m in sharded:  # FSDP keeps the unreduced gradients until a backward outside
            m.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self._sync_blocked = previous
            for sync in syncs:
                sync.enabled = not previous
            for m in sharded:
                m.set_requires_gradient_sync(not previous)

    def _pipelined_root(self) -> nn.Module:
        """A container of every module set up here with pipeline stages (``fabric.backward`` without a model)."""
        return nn.ModuleList(self._pipelined_modules)

    def _syncs_of(self, module: nn.Module | None) -> list[GradientSync]:
        if module is not None and id(module) in self._grad_syncs:
            return [self._grad_syncs[id(module)]]
        return list(self._grad_syncs.values())

    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: float | int,
                            norm_type: float | int = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        self.precision.unscale_gradients(optimizer)
        pipelines = self.pipelines(module)
        if len(pipelines) == 1:  # the whole model's norm, over every stage
            norm = pipelines[0].clip_grad_norm_(max_norm, norm_type)
        else:
            norm = self.clip_norm_(clipped_parameters(optimizer, self.precision.main_params(optimizer)), max_norm,
                                   norm_type)
        if error_if_nonfinite and not torch.isfinite(norm):  # as torch's clip_grad_norm_ (a host read)
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite")
        return norm

    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self.precision.unscale_gradients(optimizer)
        clip_grad_value_(clipped_parameters(optimizer, self.precision.main_params(optimizer)), clip_val)

    # ---- checkpoints (lightning_tp2d.checkpoint) ----------------------------------------------------------

    def save_checkpoint(self, path, state: dict[str, nn.Module | Optimizer | Any], storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        if storage_options is not None:
            raise TypeError("TP2DFabricStrategy.save_checkpoint(..., storage_options=...) is not supported")
        if filter is not None:
            raise NotImplementedError("TP2DFabricStrategy does not support fabric.save(..., filter=...)")
        path = Path(self.broadcast(str(path)))
        module_key, module, optimizers = _split_state(state)
        sharded = self._sharded_checkpoints
        checkpoint: dict[str, Any] = {
            "state_dict": (ckpt.sharded_model_state(module) if sharded
                           else ckpt.full_model_state(module, self.global_rank)),
            "optimizer_states": [ckpt.sharded_optimizer_state(module, o) if sharded
                                 else ckpt.full_optimizer_state(module, o, self.global_rank)
                                 for o in optimizers.values()],
            "fabric": {"module": module_key, "optimizers": list(optimizers)},
            "tp2d": self.checkpoint_info(module),
        }
        if self.pipelines(module):  # each stage writes its own part (checkpoint.load_into(partial=True))
            checkpoint["tp2d_partial"] = True
        for key, value in state.items():
            if key != module_key and key not in optimizers:
                checkpoint[key] = value.state_dict() if _has_state(value) else value
        ckpt.save(checkpoint, path, rank=self.global_rank, sharded=sharded, barrier=self.barrier)

    def load_checkpoint(self, path, state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
                        strict: bool = True, weights_only: bool | None = None) -> dict[str, Any]:
        if not state:
            raise ValueError("fabric.load(path, state) needs the state to restore, e.g. {'model': model, "
                             "'optimizer': optimizer}")
        path = Path(self.broadcast(str(path)))
        if isinstance(state, Optimizer):
            raise NotImplementedError("load a checkpoint into a model and its optimizers together: "
                                      "fabric.load(path, {'model': model, 'optimizer': optimizer})")
        if isinstance(state, nn.Module):
            ckpt.load_into(state, [], path, strict=strict, trust_checkpoint=weights_only is False,
                           partial=bool(self.pipelines(state)))
            return {}
        module_key, module, optimizers = _split_state(state)
        rest = ckpt.load_into(module, list(optimizers.values()), path, strict=strict,
                              trust_checkpoint=weights_only is False,  # False: the file's pickles may run code
                              partial=bool(self.pipelines(module)))
        saved = rest.pop("fabric", {})
        if strict and list(optimizers) != list(saved.get("optimizers", optimizers)):
            raise ValueError(f"checkpoint {str(path)!r} holds optimizers {saved.get('optimizers')}, the state to "
                             f"restore {list(optimizers)}")
        rest.pop("tp2d", None)
        for key in list(state):
            if key in (module_key, *optimizers):
                continue
            if key not in rest:
                if strict:
                    raise KeyError(f"checkpoint {str(path)!r} has no entry {key!r} (it has {sorted(rest)})")
                continue
            value = rest.pop(key)
            if _has_state(state[key]):
                state[key].load_state_dict(value)
            else:
                state[key] = value
        return rest


class _GradientSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: gradients accumulate locally; the backward after it averages the sum."""

    def __init__(self, strategy: TP2DFabricStrategy) -> None:
        self.strategy = strategy

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return self.strategy.blocked_backward_sync(module) if enabled else nullcontext()


def _split_state(state: dict[str, Any]) -> tuple[str, nn.Module, dict[str, Optimizer]]:
    modules = [(k, v) for k, v in state.items() if isinstance(v, nn.Module)]
    if len(modules) != 1:
        raise ValueError(f"TP2DFabricStrategy checkpoints hold exactly one model; the state has "
                         f"{len(modules)} ({[k for k, _ in modules]})")
    optimizers = {k: v for k, v in state.items() if isinstance(v, Optimizer)}
    return modules[0][0], modules[0][1], optimizers


def _has_state(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _precision_name(plugin) -> str:
    return getattr(plugin, "precision", "32-true")
