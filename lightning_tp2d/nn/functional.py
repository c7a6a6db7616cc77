"""Small autograd duals shared by the parallel layers (forward/backward pairs of :mod:`lightning_tp2d.comm`)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_global_tensor_info  # private: see lightning_tp2d._private_api

from lightning_tp2d import recompute
from lightning_tp2d.nn import traced
from lightning_tp2d.comm import all_gather_along, all_reduce_along, axis_rank, axis_size, exchange_with
from lightning_tp2d.mesh import transpose_peer
from lightning_tp2d.ops import registered


class _LocalView(torch.autograd.Function):
    """A DTensor parameter -> a view of its local shard; backward: the shard's gradient as a DTensor of the
    parameter's own placements. What ``DTensor.to_local()`` does, without its backward's ``DTensor.from_local``
    (a second autograd function and a checked spec: ~120 us per parameter and step on CPU, 5 of the 6 ms that a
    1x1 grid's gpt2-tiny step spent beyond the plain model's before this), and with one gradient spec per
    parameter (:func:`_grad_spec`)."""

    @staticmethod
    def forward(ctx, param):
        ctx.spec = _grad_spec(param)
        ctx.set_materialize_grads(False)
        local = param._local_tensor
        ctx.stride = local.stride()
        return local.view_as(local)  # a fresh tensor: autograd's metadata must not land on the stored shard

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None
        spec = ctx.spec
        if grad.stride() == ctx.stride:  # laid out as the shard itself: the parameter's own global stride
            return DTensor(grad, spec, requires_grad=False)
        _, stride = compute_global_tensor_info(grad, spec.mesh, spec.placements)
        if tuple(stride) != spec.tensor_meta.stride:  # a gradient laid out otherwise: torch's own conversion
            return DTensor.from_local(grad, spec.mesh, spec.placements, shape=spec.shape, stride=tuple(stride))
        return DTensor(grad, spec, requires_grad=False)


_GRAD_SPEC = "_tp2d_grad_spec"


def _grad_spec(param: DTensor):
    """The spec of ``param``'s gradients: a copy of its own, made once per parameter (and again if its spec is
    replaced) and shared by every step's gradient. Torch's ``to_local`` copies the spec for every gradient, so that
    nothing that rewrites a gradient's spec reaches the parameter's; one copy per step cost 31 us per parameter on
    CPU (DTensor hashes a new spec), this costs nothing."""
    cached = getattr(param, _GRAD_SPEC, None)
    if cached is None or cached[0] is not param._spec:
        cached = (param._spec, copy.copy(param._spec))
        setattr(param, _GRAD_SPEC, cached)
    return cached[1]


def local_view(param: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor parameter, differentiable (:class:`_LocalView`); under ``torch.compile``
    (which traces ``to_local`` into the graph for free) and for a plain tensor, as ``to_local`` / itself."""
    if not isinstance(param, DTensor):
        return param
    if torch.compiler.is_compiling():
        return param.to_local()
    return _LocalView.apply(param)


@registered("sum_grad_along")
class _SumGradAlong(torch.autograd.Function):
    """Forward: identity. Backward: sum the gradient over ``axis``.

    For a parameter replicated over an axis whose ranks see different tokens (LayerNorm and bias vectors over
    ``row`` in "2d"): each replica's local gradient is a partial sum, and the true gradient is their sum.
    """

    @staticmethod
    def forward(ctx, x, mesh, axis):
        ctx.mesh, ctx.axis = mesh, axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        all_reduce_along(grad, ctx.mesh, ctx.axis)
        return grad, None, None


def sum_grad_along(x: torch.Tensor, mesh: DeviceMesh, axis: str) -> torch.Tensor:
    """Identity forward, gradient summed over ``axis`` backward (:class:`_SumGradAlong`); ``x`` itself when the axis
    has one rank (nothing to sum: no op at all)."""
    if axis_size(mesh, axis) == 1:
        return x
    if torch.compiler.is_compiling():  # traced: a functional all-reduce in the backward (lightning_tp2d.nn.traced)
        return traced.sum_gradient(x, mesh, axis)
    return _SumGradAlong.apply(x, mesh, axis)


@registered("sum_grads_along")
class _SumGradsAlong(torch.autograd.Function):
    """:class:`_SumGradAlong` for several tensors of one dtype with one all-reduce of their concatenated gradients
    (LayerNorm's weight and bias: one call instead of two)."""

    @staticmethod
    def forward(ctx, mesh, axis, *xs):
        ctx.mesh, ctx.axis, ctx.shapes = mesh, axis, [x.shape for x in xs]
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        flat = torch.cat([g.reshape(-1) for g in grads])
        all_reduce_along(flat, ctx.mesh, ctx.axis)
        parts = flat.split([shape.numel() for shape in ctx.shapes])  # one op for every part
        return (None, None, *(part.view(shape) for part, shape in zip(parts, ctx.shapes)))


def sum_grads_along(xs, mesh: DeviceMesh, axis: str) -> tuple[torch.Tensor, ...]:
    """Identity on each of ``xs`` forward; backward sums all their gradients over ``axis`` in one all-reduce."""
    xs = tuple(xs)
    if len(xs) == 1 or axis_size(mesh, axis) == 1:
        return tuple(sum_grad_along(x, mesh, axis) for x in xs)
    if torch.compiler.is_compiling():
        return traced.sum_gradients(xs, mesh, axis)
    return _SumGradsAlong.apply(mesh, axis, *xs)


@registered("gather_grid")
class _GatherGrid(torch.autograd.Function):
    """Forward: all-gather a ``[rows/q, cols/q]`` block into the full ``[rows, cols]`` matrix on every rank
    (gather along ``col`` on the last dim, then along ``row`` on the first). Backward: keep the local block."""

    @staticmethod
    def forward(ctx, block, mesh):
        ctx.mesh = mesh
        ctx.shape = block.shape
        full = all_gather_along(block.contiguous(), mesh, "col", dim=-1)
        return all_gather_along(full, mesh, "row", dim=0)

    @staticmethod
    def backward(ctx, grad):
        rows, cols = ctx.shape
        r, c = axis_rank(ctx.mesh, "row"), axis_rank(ctx.mesh, "col")
        return grad[r * rows:(r + 1) * rows, c * cols:(c + 1) * cols], None


def gather_grid(block: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    if is_local_grid(mesh):
        return block
    return _GatherGrid.apply(block, mesh)


@registered("transpose_grid")
class _TransposeGrid(torch.autograd.Function):
    """Forward: rank ``(r, c)`` swaps its block with rank ``(c, r)`` (diagonal ranks keep theirs): a matrix
    whose block ``(i, j)`` sat on rank ``(i, j)`` now has it on rank ``(j, i)``. Backward: the same swap."""

    @staticmethod
    def forward(ctx, block, mesh):
        ctx.mesh = mesh
        return exchange_with(block, transpose_peer(mesh)).view_as(block)

    @staticmethod
    def backward(ctx, grad):
        return exchange_with(grad.contiguous(), transpose_peer(ctx.mesh)).view_as(grad), None


def transpose_grid(block: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    if is_local_grid(mesh):
        return block  # the one rank is its own mirror
    return _TransposeGrid.apply(block, mesh)


def is_local_grid(mesh: DeviceMesh) -> bool:
    """Whether the grid is ``1 x 1``: one rank holds every block, and each grid layer runs the plain model's ops
    (its fused kernel, one matmul per linear, ``F.cross_entropy``) instead of the distributed algorithm."""
    return axis_size(mesh, "row") == 1 and axis_size(mesh, "col") == 1


def shard_range(size: int, n: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``index`` when ``size`` is split into ``n`` chunks the way DTensor's ``Shard``
    does (``ceil(size/n)`` each, the last ones short or empty)."""
    chunk = -(-size // n)
    start = min(index * chunk, size)
    return start, min(start + chunk, size)


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero-pad dim 0 of ``x`` to ``rows`` (differentiable; a no-op view when already that size)."""
    missing = rows - x.shape[0]
    if missing == 0:
        return x
    return F.pad(x, (0, 0, 0, missing))


def axis_index(mesh: DeviceMesh, axis: str) -> tuple[int, int]:
    """``(coordinate, size)`` of this rank along ``axis``."""
    return axis_rank(mesh, axis), axis_size(mesh, axis)


def shard_parameter(tensor: torch.Tensor, mesh: DeviceMesh, placements) -> torch.nn.Parameter:
    """A DTensor parameter holding this rank's shard of ``tensor`` (a full copy that every rank holds alike).

    Each rank slices its own shard, with no communication (torch >= 2.7); older releases scatter the shards
    from global rank 0 instead.
    """
    tensor = tensor.detach()
    try:
        dt = distribute_tensor(tensor, mesh, placements, src_data_rank=None)
    except TypeError:
        dt = distribute_tensor(tensor, mesh, placements)
    return torch.nn.Parameter(dt)


def shard_bias(module: torch.nn.Module, bias: torch.Tensor | None, mesh: DeviceMesh, placements) -> None:
    """Set ``module.bias`` to :func:`shard_parameter` of ``bias``, or register it as ``None`` when there is none."""
    if bias is None:
        module.register_parameter("bias", None)
    else:
        module.bias = shard_parameter(bias, mesh, placements)


def autocast_operands(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Cast matmul operands to the autocast dtype when autocast is on (``bf16-mixed``), outside the SUMMA
    autograd functions, so their forward and backward see one dtype (the cast's backward restores the
    parameter's dtype for its gradient)."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(recompute.follow(t.to(dtype), t, lambda s: s.to(dtype)) for t in tensors)
