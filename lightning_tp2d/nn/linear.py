"""``Linear2D``: ``Y = X W + b`` as one SUMMA product on the ``q x q`` grid.

Layout (docs/layouts.md, "2d"): ``X [N, in]`` block ``(r, c)`` is ``X[N_r, in_c]``; the weight ``W [in, out]`` block
``(r, c)`` is ``W[in_r, out_c]``. torch stores ``W`` transposed (``weight [out, in]``), so the local block
of the ``weight`` DTensor is ``weight[out_c, in_r]``: placements ``Shard(1)`` over ``row`` and ``Shard(0)``
over ``col``. A linear in the collective SUMMA's scatter form (output narrower than input: the output projections)
stores the mirror block instead, ``weight[out_r, in_c]`` (``Shard(0)`` over ``row``, ``Shard(1)`` over ``col``), which
is what that form multiplies, so no block is swapped at run time. The bias ``[out]`` is split over ``col`` and replicated over ``row``; its gradient is summed
over ``row`` (rows see different tokens).

``out_groups`` (GPT-2's fused ``c_attn`` has 3: q, k, v) makes ``col`` rank ``c`` own block ``c`` of *each*
group, so q, k and v of one head group land on one rank (``_StridedShard`` on the output dim).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_tp2d import float8
from lightning_tp2d.nn.functional import autocast_operands, is_local_grid, local_param, shard_parameter
from lightning_tp2d.options import tp_options
from lightning_tp2d.summa import ab_form, summa_ab


def _out_shard(out_groups: int):
    return Shard(0) if out_groups == 1 else _StridedShard(0, split_factor=out_groups)


class Linear2D(nn.Module):
    """SUMMA linear. Input ``[..., in/q]`` (tokens of row shard ``r``, features of col shard ``c``), output
    ``[..., out/q]``. ``options`` (:class:`~lightning_tp2d.options.TPOptions`) pick the SUMMA algorithm and
    whether panels are kept for the backward (see :mod:`lightning_tp2d.summa`)."""

    def __init__(self, linear: nn.Linear, mesh: DeviceMesh, out_groups: int = 1, *, options=None) -> None:
        super().__init__()
        self.mesh, self.options = mesh, tp_options(options)
        # collective SUMMA: pass the narrower of input and output round the ring (the MLP's down projection and the
        # attention's output projection reduce-scatter their output; the others gather their input)
        form = ab_form(linear.in_features, linear.out_features, self.options.keep_panels) if out_groups == 1 else "gather"
        self.form = form if self.options.summa == "collective" else "gather"
        self.in_features, self.out_features = linear.in_features, linear.out_features
        out = _out_shard(out_groups)
        if self.form == "scatter":  # the scatter form multiplies block W[in_c, out_r] on rank (r, c): out over row, in over col
            self.weight = shard_parameter(linear.weight, mesh, [Replicate(), Shard(0), Shard(1)])
        else:  # weight [out, in]: dim 1 (in) split over row, dim 0 (out) split over col
            self.weight = shard_parameter(linear.weight, mesh, [Replicate(), Shard(1), out])
        if linear.bias is not None:
            self.bias = shard_parameter(linear.bias, mesh, [Replicate(), Replicate(), out])
        else:
            self.register_parameter("bias", None)
        self.local = is_local_grid(mesh)  # a 1x1 grid: one F.linear, as the plain model's
        # a recipe's torchao configs, made (and torchao imported) now, not first inside a compiled forward
        self.float8_configs = None if self.options.float8 is None else float8.linear_configs(self.options.float8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.local:  # (the scatter form's mirror block of a 1x1 grid is the weight itself)
            if self.options.float8 is not None:  # torchao's own float8 linear, as the plain model converted by torchao
                return float8.linear(x, local_param(self, "weight"), local_param(self, "bias"), self.float8_configs)
            return F.linear(x, local_param(self, "weight"), local_param(self, "bias"))
        lead = x.shape[:-1]
        x2d, w_t = autocast_operands(x.reshape(-1, x.shape[-1]), local_param(self, "weight"))  # w_t [out/q, in/q] = W_rcᵀ
        # the bias (None without one; not `self.bias is None`: see local_param) is added by the SUMMA's first GEMM in
        # the products' dtype; its gradient is summed over row (rows see different tokens) inside the product's backward
        bias = local_param(self, "bias")
        y = summa_ab(x2d, w_t.t(), self.mesh, self.options, self.form, self.form == "scatter", bias,
                     self.options.float8)  # (N/q, out/q)
        return y.view(*lead, y.shape[-1])

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"summa={self.options.summa!r}" + (f", form={self.form!r}" if self.options.summa == "collective" else "")
                + (f", float8={self.options.float8!r}" if self.options.float8 else ""))
