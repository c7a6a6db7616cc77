"""``LayerNorm2D``: LayerNorm over a hidden dimension split across ``col``.

Rank ``(r, c)`` holds ``x_rc [N/q, h/q]``. Statistics come from local sums ``Σx`` and ``Σx²`` all-reduced
along ``col`` (one call of ``2 * N/q`` numbers); the backward needs ``Σ dx̂`` and ``Σ dx̂·x̂`` over the full
hidden size, again one all-reduce along ``col``. Weight and bias ``[h]`` are split over ``col`` and replicated
over ``row``; their gradients are summed over ``row`` in one all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from lightning_tp2d import recompute
from lightning_tp2d.comm import all_reduce_along
from lightning_tp2d.models.gpt2 import layer_norm
from lightning_tp2d.nn.functional import is_local_grid, local_view, shard_bias, shard_parameter, sum_grads_along
from lightning_tp2d.ops import registered


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _affine(x, mean, rstd, weight, bias) -> torch.Tensor:
    """``((x - μ) · rstd) · w + b`` in the statistics' dtype, returned in ``x``'s."""
    xhat = (x.to(mean.dtype) - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    y = xhat * weight
    if bias is not None:
        y = y + bias
    return y.to(x.dtype)


@registered("layer_norm_2d")
class _LayerNormAlongCol(torch.autograd.Function):
    """``y = (x - μ) / sqrt(σ² + eps) * w + b`` with μ, σ² over the hidden dim split along ``col``."""

    @staticmethod
    def forward(ctx, x, weight, bias, mesh, hidden, eps):
        xf = x.to(_stat_dtype(x.dtype))
        sums = torch.stack([xf.sum(-1), (xf * xf).sum(-1)])  # (2, N/q)
        all_reduce_along(sums, mesh, "col")
        mean = sums[0] / hidden
        var = (sums[1] / hidden - mean * mean).clamp_min(0)
        rstd = torch.rsqrt(var + eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.mesh, ctx.hidden, ctx.has_bias = mesh, hidden, bias is not None
        y = _affine(x, mean, rstd, weight, bias)
        # selective recomputation: rebuilt from what the backward keeps anyway, locally (no all-reduce)
        return recompute.mark(y, lambda: _affine(x, mean, rstd, weight, bias))

    @staticmethod
    def backward(ctx, grad):
        x, weight, mean, rstd = ctx.saved_tensors
        g = grad.to(mean.dtype)
        xhat = (x.to(mean.dtype) - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
        dxhat = g * weight
        sums = torch.stack([dxhat.sum(-1), (dxhat * xhat).sum(-1)])  # (2, N/q)
        all_reduce_along(sums, ctx.mesh, "col")
        mean_d, mean_dx = sums[0] / ctx.hidden, sums[1] / ctx.hidden
        dx = (dxhat - mean_d.unsqueeze(-1) - xhat * mean_dx.unsqueeze(-1)) * rstd.unsqueeze(-1)
        flat = (-1, g.shape[-1])
        dw = (g * xhat).reshape(flat).sum(0).to(weight.dtype)
        db = g.reshape(flat).sum(0).to(weight.dtype) if ctx.has_bias else None
        return dx.to(x.dtype), dw, db, None, None, None


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
            w, b = local_view(self.weight), None if self.bias is None else local_view(self.bias)
            y = layer_norm(x, (self.hidden,), w, b, self.eps)
            return recompute.mark(y, lambda: layer_norm(x, (self.hidden,), w, b, self.eps))
        local = [local_view(self.weight)] + ([local_view(self.bias)] if self.bias is not None else [])
        w, *b = sum_grads_along(local, self.mesh, "row")  # both gradients in one all-reduce over row
        return _LayerNormAlongCol.apply(x, w, b[0] if b else None, self.mesh, self.hidden, self.eps)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, eps={self.eps}"
