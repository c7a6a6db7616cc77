"""Framework-free training helpers for a parallelized model: data-parallel gradient averaging, the global gradient
norm across shards and clipping by it, and making an eager model identical on every rank.

Trainer (:class:`~lightning_tp2d.strategy.TP2DStrategy`), Fabric and plain-torch loops share them:

.. code-block:: python

    loss = model(idx, targets); loss.backward()
    average_gradients_(model, mesh)            # mean over data_parallel (tensor axes are summed by the layers)
    clip_grad_norm_(model.parameters(), 1.0, mesh)
    optimizer.step()

Nothing here imports Lightning.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from lightning_tp2d.comm import all_reduce_along, broadcast_along
from lightning_tp2d.layouts import DATA_AXIS

__all__ = ["average_gradients_", "broadcast_module_", "clip_grad_norm_", "clip_grad_value_", "grad_norm"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def broadcast_module_(module: nn.Module, mesh) -> None:
    """Make every parameter and buffer of ``module`` equal to global rank 0's: broadcast along each mesh axis in
    turn from coordinate 0 (after axis ``k`` every rank whose later coordinates are 0 holds rank 0's values)."""
    tensors = [t for t in list(module.parameters()) + list(module.buffers()) if t.is_floating_point()]
    for dtype in {t.dtype for t in tensors}:
        group = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        for axis in mesh.mesh_dim_names:
            broadcast_along(flat, mesh, axis, src=0)
        offset = 0
        for t in group:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


@torch.no_grad()
def average_gradients_(module: nn.Module, mesh) -> None:
    """``grad <- mean over data_parallel of grad`` for every parameter (local shards; one all-reduce per dtype)."""
    dp = mesh.size(mesh.mesh_dim_names.index(DATA_AXIS))
    if dp == 1:
        return
    grads = [_local(p.grad) for p in module.parameters() if p.grad is not None]
    for dtype in {g.dtype for g in grads}:
        group = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in group])
        all_reduce_along(flat, mesh, DATA_AXIS)
        flat.div_(dp)
        offset = 0
        for g in group:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def _counted_here(grad: torch.Tensor, mesh) -> bool:
    """Whether this rank's shard of ``grad`` enters the norm: on axes (other than data_parallel) where the
    gradient is replicated, only coordinate 0 counts, so every element is counted exactly once."""
    names = mesh.mesh_dim_names
    if isinstance(grad, DTensor):
        replicated = [names[i] for i, pl in enumerate(grad.placements) if pl.is_replicate()]
    else:
        replicated = list(names)
    return all(mesh.get_local_rank(a) == 0 for a in replicated if a != DATA_AXIS)


@torch.no_grad()
def grad_norm(parameters, mesh, norm_type: float = 2.0) -> torch.Tensor:
    """Norm of the whole gradient (all shards of all parameters), the same float32 scalar on every rank.
    Data-parallel replicas must already hold equal gradients (after :func:`average_gradients_`)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    device = _local(grads[0]).device if grads else torch.device("cpu")
    inf = math.isinf(norm_type)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        if not _counted_here(g, mesh):
            continue
        local = _local(g).float()
        if local.numel():
            total = torch.maximum(total, local.abs().max()) if inf else total + local.pow(norm_type).sum()
    for axis in mesh.mesh_dim_names:
        if axis != DATA_AXIS:
            all_reduce_along(total, mesh, axis, op="max" if inf else "sum")
    return total if inf else total.pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, mesh, norm_type: float = 2.0) -> torch.Tensor:
    """Scale every gradient by ``min(1, max_norm / (norm + 1e-6))`` with the global norm (as
    ``torch.nn.utils.clip_grad_norm_`` on the unsharded model); returns the norm before clipping."""
    parameters = [p for p in parameters if p.grad is not None]
    total = grad_norm(parameters, mesh, norm_type)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in parameters:
        _local(p.grad).mul_(coef.to(_local(p.grad).dtype))
    return total


@torch.no_grad()
def clip_grad_value_(parameters, clip_value: float) -> None:
    for p in parameters:
        if p.grad is not None:
            _local(p.grad).clamp_(-clip_value, clip_value)
