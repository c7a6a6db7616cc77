"""The training step, built once from a :class:`~lightning_tp2d.train_plan.TrainPlan`: the model side
(:func:`prepare_model`) and the data-parallel machinery (:func:`assemble_step`), or both at once (:func:`build_step`).

:func:`prepare_model` is the one place that turns a plan's layout and checkpointing into a model: it parallelizes the
model for ``plan.layout`` on the mesh (:func:`lightning_tp2d.parallelize`, block by block with ``on_block`` for a
meta-device model) and checkpoints its blocks' activations as ``plan.activation_checkpointing`` and
``plan.activation_offload`` say (:func:`lightning_tp2d.parallelize.checkpoint_activations`). The strategies, the
planner's tracer and memory model and the benchmark's scenarios call it; a step's other hooks (the tracer's recorder,
the memory model's shard reads) go between it and :func:`assemble_step`.

:func:`assemble_step` is the one place that turns a plan's ZeRO stage into a step: the Trainer and Fabric strategies
call it, and so do the planner's schedule tracer (:mod:`lightning_tp2d.planning.trace`), its memory model
(:mod:`lightning_tp2d.planning.memory_model`) and the benchmark's measured step, so what is priced is what runs.
Given a model parallelized on ``mesh`` (``dp x p``), it

* wraps every model of a registered family inside it with FSDP2 over ``data_parallel`` when :attr:`TrainPlan.fsdp`
  (:func:`lightning_tp2d.fsdp.shard_data_parallel`: one group per block and one at the root, reshard after forward
  at stage 3, FSDP's mixed precision for the run's precision); before any optimizer holds the parameters;
* installs :class:`~lightning_tp2d.training.GradientSync` on the whole module when :attr:`TrainPlan.gradient_sync`
  (stages 0/1, ``dp > 1``: buckets all-reduced during the backward; the loop calls ``finish()`` after it);
* lets every DTensor parameter that FSDP does not split hand the layers its local shard as an autograd leaf of its
  own (:func:`lightning_tp2d.nn.functional.own_leaf_grads`), again for those a cast or a move replaced after
  :func:`~lightning_tp2d.parallelize` (which does it for the parameters it makes): gradients accumulate as plain
  tensors and become the parameters' DTensor ``.grad`` after each backward;

and returns an :class:`AssembledStep` that also says how to shard an optimizer built afterwards
(:meth:`AssembledStep.shard_optimizer`: ZeRO-1's slices when :attr:`TrainPlan.optimizer_sharded`) and how to clip
(:meth:`AssembledStep.clip_grad_norm_`: :func:`lightning_tp2d.fsdp.clip_grad_norm_` at stages 2/3, else
:func:`lightning_tp2d.training.clip_grad_norm_`). A loop:

.. code-block:: python

    step = build_step(model, mesh, TrainPlan("metp", 2, 2, zero_stage=1))  # prepare_model, then assemble_step
    optimizer = step.shard_optimizer(torch.optim.AdamW(model.parameters())) or optimizer
    loss = model(idx, targets); loss.backward()
    if step.gradient_sync is not None:
        step.gradient_sync.finish()
    step.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step(); optimizer.zero_grad()

A meta-device model built block by block is cut over ``data_parallel`` as each block is materialised by
:func:`block_sharder`'s function (``parallelize(..., on_block=...)``), with the stage and policy
:func:`assemble_step` then uses for the root.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from lightning_tp2d import fsdp, training, zero
from lightning_tp2d.families import family_of
from lightning_tp2d.layouts import handle_of
from lightning_tp2d.nn.functional import own_leaf_grads
from lightning_tp2d.parallelize import checkpoint_activations, parallelize
from lightning_tp2d.pipeline import pipeline_of
from lightning_tp2d.train_plan import FSDP_STAGES, PIPELINE_AXIS, TrainPlan

__all__ = ["AssembledStep", "assemble_step", "block_sharder", "build_step", "clip_grad_norm_", "is_prepared",
           "prepare_model", "shard_optimizer"]


def _precision(plan: TrainPlan, precision: str | None) -> str:
    """The run's precision: ``precision`` if given (it must agree with the plan's, when the plan names one), else the
    plan's, else ``"32-true"``."""
    if precision is not None and plan.precision is not None and precision != plan.precision:
        raise ValueError(f"assemble_step: precision={precision!r} disagrees with the plan's precision="
                         f"{plan.precision!r}")
    return precision or plan.precision or "32-true"


def block_sharder(plan: TrainPlan, precision: str | None = None) -> Callable[[nn.Module], nn.Module] | None:
    """Under FSDP (:attr:`TrainPlan.fsdp`): what cuts one block over ``data_parallel`` as soon as it is
    materialised (:func:`lightning_tp2d.fsdp.shard_block` with the plan's stage and FSDP's mixed precision for
    ``precision``), for ``parallelize(..., on_block=...)``; :func:`assemble_step` then cuts the root. Else ``None``."""
    if not plan.fsdp:
        return None
    policy = fsdp.mixed_precision_policy(_precision(plan, precision))
    return functools.partial(fsdp.shard_block, stage=plan.zero_stage, mp_policy=policy)


def shard_optimizer(plan: TrainPlan, optimizer: torch.optim.Optimizer, mesh) -> zero.ShardedOptimizer | None:
    """ZeRO-1's slices of ``optimizer``'s state over ``mesh``'s ``data_parallel`` axis when
    :attr:`TrainPlan.optimizer_sharded` (:func:`lightning_tp2d.zero.shard_optimizer_state`, in place; at stages 2/3
    only the parameters FSDP keeps whole are sliced); else ``None`` and the optimizer is unchanged."""
    return zero.shard_optimizer_state(optimizer, stage_mesh(plan, mesh)) if plan.optimizer_sharded else None


def clip_grad_norm_(plan: TrainPlan, parameters, max_norm: float, mesh, norm_type: float = 2.0) -> torch.Tensor:
    """Clip by the norm of the whole gradient, over the tensor shards and, when :attr:`TrainPlan.clip_with_fsdp`,
    over the ``data_parallel`` shards too; returns the norm."""
    clip = fsdp.clip_grad_norm_ if plan.clip_with_fsdp else training.clip_grad_norm_
    return clip(parameters, max_norm, mesh, norm_type)


@dataclass
class AssembledStep:
    """What a training loop runs around ``loss.backward()`` for :attr:`plan` on :attr:`mesh` (module docstring)."""

    plan: TrainPlan
    mesh: object  # DeviceMesh (data_parallel, *tensor axes)
    precision: str  # the Lightning precision FSDP's mixed precision follows
    gradient_sync: training.GradientSync | None  # finish() it after each backward that ends an accumulation window

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> zero.ShardedOptimizer | None:
        """:func:`shard_optimizer` for this step's plan and mesh: call it right after building the optimizer."""
        return shard_optimizer(self.plan, optimizer, self.mesh)

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """:func:`clip_grad_norm_` for this step's plan and mesh."""
        return clip_grad_norm_(self.plan, parameters, max_norm, self.mesh, norm_type)


def stage_mesh(plan: TrainPlan, mesh):
    """The ``dp x p`` mesh of this rank's pipeline stage (``mesh`` without its ``pipeline`` axis), or ``mesh`` itself
    when ``plan`` has no stages: what the data-parallel side of a step (ZeRO-1's slices, the averages) runs over."""
    names = tuple(mesh.mesh_dim_names or ())
    if not plan.pipelined:
        return mesh
    if names[:1] != (PIPELINE_AXIS,) or mesh.shape[0] != plan.pipeline_parallel_size:
        raise ValueError(f"the plan has pipeline_parallel_size={plan.pipeline_parallel_size}, the mesh axes {names} "
                         f"of shape {tuple(mesh.shape)}")
    return mesh[names[1:]]


def _check_mesh(plan: TrainPlan, mesh) -> None:
    sizes = plan.spec.sizes_of_mesh(stage_mesh(plan, mesh))
    if sizes != (plan.tensor_parallel_size, plan.data_parallel_size):
        raise ValueError(f"assemble_step: the mesh holds p={sizes[0]} x dp={sizes[1]} ranks, the plan "
                         f"p={plan.tensor_parallel_size} x dp={plan.data_parallel_size}")


def assemble_step(model: nn.Module, mesh, plan: TrainPlan, *, precision: str | None = None,
                  sync: bool = True) -> AssembledStep:
    """Assemble the data-parallel side of ``plan``'s step on ``model`` (module docstring), in place: FSDP over
    ``data_parallel`` for every registered-family model inside ``model`` not sharded yet (those a
    :func:`block_sharder` cut block by block get their root cut here), then, with ``sync``,
    :class:`~lightning_tp2d.training.GradientSync` over all of ``model``'s parameters. ``precision``: the Lightning
    precision FSDP's mixed precision follows (default: the plan's, else ``"32-true"``). ``sync=False`` installs no
    gradient hooks (an evaluation, or a module that already has its sync). At stage 2 or 3 with one replica a
    ``UserWarning`` says nothing is sharded (the step runs as at stage 0, clipped as at stage 2/3). Call it after the
    model is parallelized, cast and on its device, before building optimizers. ``ValueError`` when the mesh's sizes
    are not the plan's."""
    _check_mesh(plan, mesh)
    precision = _precision(plan, precision)
    policy = fsdp.mixed_precision_policy(precision)
    if plan.fsdp:
        for m in [m for m in model.modules() if family_of(m) is not None and not fsdp.is_sharded(m)]:
            pipeline = pipeline_of(m)
            if pipeline is None:
                fsdp.shard_data_parallel(m, plan.zero_stage, mp_policy=policy)
            elif pipeline.zero_stage != plan.zero_stage:  # its stages, each an FSDP root (lightning_tp2d.pipeline)
                pipeline.shard_data_parallel(plan.zero_stage, policy)
    elif plan.zero_stage in FSDP_STAGES:
        warnings.warn(f"zero_stage={plan.zero_stage} with data_parallel_size=1: nothing to shard over "
                      "data_parallel; the model trains as at stage 0", UserWarning, stacklevel=2)
    gradient_sync = training.GradientSync(model, mesh) if sync and plan.gradient_sync else None
    own_leaf_grads(model)
    return AssembledStep(plan, mesh, precision, gradient_sync)


def prepare_model(model: nn.Module, mesh, plan: TrainPlan, *,
                  on_block: Callable[[nn.Module], object] | None = None) -> nn.Module:
    """The model side of ``plan``'s step on ``model``, in place (module docstring): parallelized for the plan's
    layout (:attr:`~lightning_tp2d.train_plan.TrainPlan.spec`, the Layout object with its options) on ``mesh``
    (``on_block``: as :func:`~lightning_tp2d.parallelize`'s, for a meta-device model cut block by block; a model
    already parallelized for this layout on this mesh is kept as it is), then its blocks' activations checkpointed in
    ``plan.activation_checkpointing`` mode, their kept inputs in host memory when ``plan.activation_offload``. Returns
    ``model``. ``ValueError`` when the mesh's sizes are not the plan's, or the model is already parallelized
    otherwise."""
    _check_mesh(plan, mesh)
    if not is_prepared(model, mesh, plan):
        parallelize(model, mesh, plan.spec, on_block=on_block)
    return checkpoint_activations(model, plan.activation_checkpointing, offload=plan.activation_offload)


def is_prepared(model: nn.Module, mesh, plan: TrainPlan, name: str | None = None) -> bool:
    """Whether ``model`` is parallelized for ``plan``'s layout on ``mesh`` already (``False``: not parallelized at
    all); ``ValueError`` when it is parallelized otherwise (another layout, or another mesh). ``name``: the model's
    name in the message. The one statement of the rule :func:`prepare_model` and the strategies keep."""
    done = handle_of(model)
    if done is None:
        return False
    if done.layout != plan.spec or done.mesh is not mesh:
        what = type(model).__name__ + ("" if name is None else f" {name!r}")
        raise ValueError(f"{what} is already parallelized with layout {done.layout.name!r} on another mesh, not "
                         f"{plan.layout!r} on this one")
    return True


def build_step(model: nn.Module, mesh, plan: TrainPlan, *, on_block: Callable[[nn.Module], object] | None = None,
               precision: str | None = None, sync: bool = True) -> AssembledStep:
    """``plan``'s whole step on a plain ``model``: :func:`prepare_model`, then :func:`assemble_step` (module
    docstring's loop). Call it before building optimizers."""
    prepare_model(model, mesh, plan, on_block=on_block)
    return assemble_step(model, mesh, plan, precision=precision, sync=sync)
