"""``LayerNorm2D``: LayerNorm over a hidden dimension split across ``col``.

Rank ``(r, c)`` holds ``x_rc [N/q, h/q]``. Statistics come from the local moments ``E[x]`` and ``E[x²]`` of
one fused reduction, all-reduced along ``col`` (one call of ``2 * N/q`` numbers); the backward needs ``Σ dx̂`` and
``Σ dx̂·x̂`` over the full hidden size, again one all-reduce along ``col``. Weight and bias ``[h]`` are split over
``col`` and replicated over ``row``; their gradients are summed over ``row`` in one all-reduce, posted in the
layer's backward before the input gradient's work and waited on after it (:func:`param_grads`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from lightning_tp2d import recompute
from lightning_tp2d.comm import all_reduce_along, summed_later
from lightning_tp2d.models.gpt2 import layer_norm
from lightning_tp2d.nn import traced
from lightning_tp2d.nn.functional import is_local_grid, local_param, shard_bias, shard_parameter, sum_grads_along
from lightning_tp2d.ops import registered


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _affine(xhat: torch.Tensor, weight, bias, dtype: torch.dtype) -> torch.Tensor:
    """``x̂ · w + b`` (one ``addcmul``), in the statistics' dtype, returned in ``dtype``."""
    y = xhat * weight if bias is None else torch.addcmul(bias, xhat, weight)
    return y.to(dtype)


def _normalized(x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """``x̂ = (x - μ) · rstd`` in the statistics' dtype (``mean``, ``rstd``: ``[..., 1]``)."""
    return (x.to(mean.dtype) - mean).mul_(rstd)


@registered("layer_norm_2d")
class _LayerNormAlongCol(torch.autograd.Function):
    """``y = (x - μ) / sqrt(σ² + eps) * w + b`` with μ, σ² over the hidden dim split along ``col``.

    Forward: one fused local reduction (``var_mean``) gives the shard's ``E[x]`` and ``E[x²]``, weighted by its share
    of the hidden size and all-reduced together along ``col``; ``σ² = E[x²] - μ²``. Backward: the two sums of the
    input gradient stacked into one all-reduce. Statistics stay ``[..., 1]`` (no unsqueeze), pairs are split by
    ``unbind`` (``tests/test_lean_grid.py`` holds the layer's op counts)."""

    @staticmethod
    def forward(ctx, x, weight, bias, mesh, hidden, eps):
        xf = x.to(_stat_dtype(x.dtype))
        var, mean = torch.var_mean(xf, -1, correction=0, keepdim=True)
        moments = torch.stack([mean, torch.addcmul(var, mean, mean)])  # (2, ..., 1): the shard's E[x], E[x²]
        if x.shape[-1] != hidden:
            moments.mul_(x.shape[-1] / hidden)  # its share of the hidden size: the sum over col is the mean
        all_reduce_along(moments, mesh, "col")
        mean, rstd = moments.unbind(0)  # rstd: E[x²], made 1 / sqrt(σ² + eps) in place (μ and it: one storage)
        rstd.addcmul_(mean, mean, value=-1).clamp_min_(0).add_(eps).rsqrt_()
        xhat = _normalized(xf, mean, rstd)
        # x̂ is kept in place of x where it costs no more (x already in the statistics' dtype); else x, rebuilt
        keep = (xhat,) if xf is x else (x, mean)
        ctx.save_for_backward(weight, rstd, *keep)
        ctx.mesh, ctx.hidden, ctx.has_bias, ctx.dtype = mesh, hidden, bias is not None, x.dtype
        y = _affine(xhat, weight, bias, x.dtype)
        if xf is x:  # selective recomputation: rebuilt from what the backward keeps anyway, locally (no all-reduce)
            return recompute.mark(y, lambda: _affine(xhat, weight, bias, x.dtype))
        return recompute.mark(y, lambda: _affine(_normalized(x, mean, rstd), weight, bias, x.dtype))

    @staticmethod
    def backward(ctx, grad):
        weight, rstd, *keep = ctx.saved_tensors
        x = keep[0]
        xhat = x if len(keep) == 1 else _normalized(x, keep[1], rstd)
        g = grad.to(rstd.dtype)
        params = param_grads(g, xhat, ctx.has_bias, ctx.mesh)  # (summed over row while dx is made)
        dxhat = g * weight
        sums = torch.stack([dxhat.sum(-1, keepdim=True), (dxhat * xhat).sum(-1, keepdim=True)]).div_(ctx.hidden)
        all_reduce_along(sums, ctx.mesh, "col")
        mean_d, mean_dx = sums.unbind(0)
        dx = (dxhat - torch.addcmul(mean_d, xhat, mean_dx)).mul_(rstd)
        dw, db = params()
        return dx.to(ctx.dtype), dw.to(weight.dtype), None if db is None else db.to(weight.dtype), None, None, None


def param_grads(g: torch.Tensor, xhat: torch.Tensor, has_bias: bool, mesh: DeviceMesh):
    """A grid norm's weight (and bias) gradient, ``Σ g·x̂`` (and ``Σ g``) over this grid row's tokens in the
    statistics' dtype, summed over ``row`` (its replicas see their own tokens) by one all-reduce, posted now: returns
    ``finish``, which waits for it and returns ``(dw, db or None)``. Each is handed on as a view the collective's work
    does not hold (else autograd, finding the tensor still referenced, would copy it): both written into one buffer
    and cut from it, or the weight's alone viewed afresh (:func:`~lightning_tp2d.comm.summed_later`)."""
    rows = tuple(range(g.dim() - 1))
    if not has_bias:
        weight = summed_later((g * xhat).sum(rows), mesh, "row")
        return lambda: (weight(), None)
    params = g.new_empty((2, g.shape[-1]))
    dw, db = params.unbind(0)
    torch.sum(g * xhat, rows, out=dw)
    torch.sum(g, rows, out=db)
    handle = all_reduce_along(params, mesh, "row", async_op=True)

    def finish() -> tuple[torch.Tensor, torch.Tensor]:
        handle.wait()
        return dw, db

    return finish


class LayerNorm2D(nn.Module):
    """LayerNorm of ``[..., h/q]`` local features of an ``h``-wide hidden state split over ``col``. ``options``:
    accepted and ignored, so a layout builds every layer as ``Cls(module, mesh, options=...)``."""

    def __init__(self, norm: nn.LayerNorm, mesh: DeviceMesh, *, options=None) -> None:
        super().__init__()
        self.mesh = mesh
        self.hidden = norm.normalized_shape[0]
        self.eps = norm.eps
        place = [Replicate(), Replicate(), Shard(0)]
        self.weight = shard_parameter(norm.weight, mesh, place)
        shard_bias(self, norm.bias, mesh, place)
        self.local = is_local_grid(mesh)  # a 1x1 grid: the plain model's fused kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.local:
            w, b = local_param(self, "weight"), local_param(self, "bias")
            y = layer_norm(x, (self.hidden,), w, b, self.eps)
            return recompute.mark(y, lambda: layer_norm(x, (self.hidden,), w, b, self.eps))
        w, b = local_param(self, "weight"), local_param(self, "bias")
        if torch.compiler.is_compiling():  # plain torch the compiler fuses (lightning_tp2d.nn.traced)
            w, *b = sum_grads_along([w] if b is None else [w, b], self.mesh, "row")  # one all-reduce over row
            return traced.layer_norm(x, w, b[0] if b else None, self.mesh, self.hidden, self.eps)
        # eager: the parameters' gradients are summed over row inside the layer's backward (param_grads)
        return _LayerNormAlongCol.apply(x, w, b, self.mesh, self.hidden, self.eps)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, eps={self.eps}"
