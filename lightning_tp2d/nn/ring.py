"""Transformer-block layers of the ``"metp"`` ring (DESIGN 3.2): every rank holds its zigzag chunks of each
sequence with the full hidden size, ``x_i [B, S, h]`` with ``S = 2T/(2p)``, and ``1/p`` of every weight matrix.

Parameter placements over ``(data_parallel, ring)`` (torch ``Linear`` stores ``weight [out, in]``):

=====================  ===============================  ================================================
parameter              placement                        travels in the ring kernel as
=====================  ===============================  ================================================
attn.c_attn.weight     R, _StridedShard(0, 3)           ``[q_i | k_i | v_i]`` rows of head group ``i``
attn.c_proj.weight     R, Shard(1)                      input columns of head group ``i``
mlp.c_fc.weight        R, Shard(0)                      ``W1`` column block (output rows)
mlp.c_proj.weight      R, Shard(1)                      ``W2`` row block (input columns)
biases, ln_*           R, R                             stay; gradients summed over ``ring`` in backward
=====================  ===============================  ================================================

LayerNorm is local (full hidden size). Attention: the QKV weight blocks stream past ``x_i`` (out-split linear,
writing q|k|v of all heads for this rank's tokens), the ring attention rotates K|V, and the output projection
streams its input-column blocks (in-split linear). The MLP is one fused ring pass.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_tp2d.metp import HeadBlocks, ring_attention, ring_linear_in, ring_linear_out, ring_mlp
from lightning_tp2d.nn.functional import autocast_operands, axis_index, shard_parameter, sum_grad_along

AXIS = "ring"
REPLICATED = [Replicate(), Replicate()]


class RingLinear(nn.Module):
    """The parameters of one ``nn.Linear`` split over the ring: by output rows (``split="out"``; ``groups=3``
    keeps q, k and v of one head group on one rank) or by input columns (``split="in"``). Bias replicated."""

    def __init__(self, linear: nn.Linear, mesh: DeviceMesh, split: str, groups: int = 1) -> None:
        super().__init__()
        self.mesh, self.split = mesh, split
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if split == "out":
            place = Shard(0) if groups == 1 else _StridedShard(0, split_factor=groups)
        elif split == "in":
            place = Shard(1)
        else:
            raise ValueError(f"split must be 'out' or 'in', got {split!r}")
        self.weight = shard_parameter(linear.weight, mesh, [Replicate(), place])
        if linear.bias is not None:
            self.bias = shard_parameter(linear.bias, mesh, REPLICATED)
        else:
            self.register_parameter("bias", None)

    def local(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(weight block, full bias)`` of this rank, the bias wrapped so its gradient is summed over the ring."""
        bias = None if self.bias is None else sum_grad_along(self.bias.to_local(), self.mesh, AXIS)
        return self.weight.to_local(), bias

    def forward(self, x: torch.Tensor, layout) -> torch.Tensor:
        w, bias = self.local()
        x, w = autocast_operands(x, w)
        fn = ring_linear_out if self.split == "out" else ring_linear_in
        return fn(x, w, bias, self.mesh, AXIS, layout)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, split={self.split!r}"


class RingLayerNorm(nn.Module):
    """LayerNorm of ``[..., h]`` rows (local: every rank has the full hidden size); weight and bias replicated
    over the ring, their gradients summed over it."""

    def __init__(self, norm: nn.LayerNorm, mesh: DeviceMesh) -> None:
        super().__init__()
        self.mesh, self.normalized_shape, self.eps = mesh, tuple(norm.normalized_shape), norm.eps
        self.weight = shard_parameter(norm.weight, mesh, REPLICATED)
        if norm.bias is not None:
            self.bias = shard_parameter(norm.bias, mesh, REPLICATED)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = sum_grad_along(self.weight.to_local(), self.mesh, AXIS)
        b = None if self.bias is None else sum_grad_along(self.bias.to_local(), self.mesh, AXIS)
        return F.layer_norm(x, self.normalized_shape, w, b, self.eps)


def refuse_attention_dropout(module: nn.Module) -> None:
    if module.training and module.dropout > 0:
        raise NotImplementedError(f"ring attention has no attention-probability dropout (dropout={module.dropout}); "
                                  f"train with dropout=0.0, or use layout '2d'")


class RingAttention(nn.Module):
    """``x_i [B, S, h]`` -> ``c_proj(attention(c_attn(x)))`` of this rank's tokens, attending to the whole
    causal prefix through the ring. Forward: 3 ring passes (QKV weights, K|V, c_proj weights)."""

    def __init__(self, attn: nn.Module, mesh: DeviceMesh) -> None:
        super().__init__()
        self.mesh = mesh
        self.n_head, self.n_embd, self.dropout = attn.n_head, attn.n_embd, attn.dropout
        self.c_attn = RingLinear(attn.c_attn, mesh, "out", groups=3)
        self.c_proj = RingLinear(attn.c_proj, mesh, "in")
        self.resid_dropout = nn.Dropout(attn.resid_dropout.p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        refuse_attention_dropout(self)
        B, S, h = x.shape
        p = axis_index(self.mesh, AXIS)[1]
        heads = (B, S, self.n_head, h // self.n_head, p)
        qkv = self.c_attn(x.reshape(B * S, h), HeadBlocks(3, *heads))  # (3, B, nh, S, hs)
        y = ring_attention(qkv, self.mesh, AXIS)  # (B, nh, S, hs)
        out = self.c_proj(y.unsqueeze(0), HeadBlocks(1, *heads))  # (B*S, h)
        return self.resid_dropout(out.view(B, S, h))


class RingMLP(nn.Module):
    """``c_proj(gelu(c_fc(x)))`` as one ring pass: ``c_fc``'s output-row blocks and ``c_proj``'s input-column
    blocks travel together; the ``[N, 4h]`` hidden activation never exists."""

    def __init__(self, mlp: nn.Module, mesh: DeviceMesh) -> None:
        super().__init__()
        self.mesh = mesh
        self.c_fc = RingLinear(mlp.c_fc, mesh, "out")
        self.c_proj = RingLinear(mlp.c_proj, mesh, "in")
        self.dropout = nn.Dropout(mlp.dropout.p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, h = x.shape
        w1, b1 = self.c_fc.local()
        w2, b2 = self.c_proj.local()
        x2d, w1, w2 = autocast_operands(x.reshape(B * S, h), w1, w2)
        return self.dropout(ring_mlp(x2d, w1, b1, w2, b2, self.mesh, AXIS).view(B, S, h))
