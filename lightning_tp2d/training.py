"""Framework-free training helpers for a parallelized model: data-parallel gradient averaging, the global gradient
norm across shards and clipping by it, and making an eager model identical on every rank.

Trainer (:class:`~lightning_tp2d.strategy.TP2DStrategy`), Fabric and plain-torch loops share them:

.. code-block:: python

    loss = model(idx, targets); loss.backward()
    average_gradients_(model, mesh)            # mean over data_parallel (tensor axes are summed by the layers)
    clip_grad_norm_(model.parameters(), 1.0, mesh)
    optimizer.step()

or, overlapping the data-parallel all-reduces with the backward (DDP-style buckets; what the strategy runs):

.. code-block:: python

    sync = GradientSync(model, mesh)           # once
    loss = model(idx, targets); loss.backward()
    sync.finish()                              # wait for the buckets posted during the backward; mean

Nothing here imports Lightning.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from lightning_tp2d.comm import all_reduce_along, broadcast_along
from lightning_tp2d.layouts import DATA_AXIS

__all__ = ["GradientSync", "average_gradients_", "broadcast_module_", "clip_grad_norm_", "clip_grad_value_",
           "grad_norm"]


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


class _Bucket:
    __slots__ = ("params", "waiting", "flat", "handle")

    def __init__(self, params: list) -> None:
        self.params, self.waiting, self.flat, self.handle = params, len(params), None, None


class GradientSync:
    """Averages gradients over ``data_parallel`` while the backward runs, as DDP does: the parameters are grouped
    into buckets of about ``bucket_mib`` in reverse registration order (the order the backward produces their
    gradients), one dtype per bucket; when the last gradient of a bucket has been accumulated its flattened local
    shards go out in one async all-reduce, overlapping the rest of the backward. :meth:`finish` waits for them,
    divides by ``dp``, copies back, and reduces synchronously whatever bucket did not fill (a parameter without a
    gradient this step). While :attr:`enabled` is False (gradient accumulation) nothing is posted and
    :meth:`finish` must not be called. On ``dp = 1`` it installs nothing and :meth:`finish` returns at once.
    Every replica must run the same backward (the buckets are posted in the same order on every rank)."""

    def __init__(self, module: nn.Module, mesh, bucket_mib: float = 25.0) -> None:
        self.mesh, self.enabled = mesh, True
        self.dp = mesh.size(mesh.mesh_dim_names.index(DATA_AXIS))
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        self._hooks = []
        if self.dp == 1:
            return
        params = [p for p in module.parameters() if p.requires_grad]
        limit = bucket_mib * 2 ** 20
        for dtype in sorted({p.dtype for p in params}, key=str):
            current, size = [], 0
            for p in reversed([p for p in params if p.dtype == dtype]):
                current.append(p)
                size += _local(p).numel() * p.element_size()
                if size >= limit:
                    self.buckets.append(_Bucket(current))
                    current, size = [], 0
            if current:
                self.buckets.append(_Bucket(current))
        for bucket in self.buckets:
            for p in bucket.params:
                self._bucket_of[id(p)] = bucket
                self._hooks.append(p.register_post_accumulate_grad_hook(self._accumulated))

    def _accumulated(self, param: torch.Tensor) -> None:
        if not self.enabled:
            return
        bucket = self._bucket_of[id(param)]
        bucket.waiting -= 1
        if bucket.waiting == 0:
            self._post(bucket)

    def _post(self, bucket: _Bucket) -> None:
        grads = [_local(p.grad) for p in bucket.params if p.grad is not None]
        if not grads:
            return
        bucket.flat = torch.cat([g.reshape(-1) for g in grads])
        bucket.handle = all_reduce_along(bucket.flat, self.mesh, DATA_AXIS, async_op=True)

    @torch.no_grad()
    def finish(self) -> None:
        """Complete this step's averaging (every rank calls it after the backward)."""
        for bucket in self.buckets:
            if bucket.handle is None:  # some parameter got no gradient this step: reduce what there is now
                self._post(bucket)
            if bucket.handle is not None:
                bucket.handle.wait()
                bucket.flat.div_(self.dp)
                offset = 0
                for p in bucket.params:
                    if p.grad is None:
                        continue
                    g = _local(p.grad)
                    g.copy_(bucket.flat[offset:offset + g.numel()].view_as(g))
                    offset += g.numel()
            bucket.waiting, bucket.flat, bucket.handle = len(bucket.params), None, None

    def remove(self) -> None:
        """Remove the hooks (the module is back to plain accumulation)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


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
