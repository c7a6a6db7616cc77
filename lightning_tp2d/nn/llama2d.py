"""Llama's sublayers on the ``q x q`` grid (layout ``"2d"``): ``RMSNorm2D``, ``LlamaAttention2D``, ``SwiGLU2D`` and
the untied vocab-parallel head ``UntiedLMHead2D``. The token embedding and a tied head are GPT-2's
(:class:`~lightning_tp2d.nn.embedding.TokenEmbedding2D`, :class:`~lightning_tp2d.nn.head.LMHead2D`).

As everywhere in ``"2d"``, rank ``(r, c)`` holds ``x_rc [B/q, T, h/q]``: batch shard ``r``, hidden block ``c``.

* **RMSNorm**: ``y = w · x / sqrt(mean(x²) + eps)`` over the full hidden size: one all-reduce along ``col`` of
  the local ``Σx²`` forward and one of ``Σ dŷ·x̂`` backward; the weight ``[h]`` is split over ``col`` and
  replicated over ``row`` (gradient summed over ``row``), as :class:`~lightning_tp2d.nn.layernorm.LayerNorm2D`.
* **Attention**: ``q_proj``, ``k_proj`` and ``v_proj`` are separate SUMMA linears whose output columns are split
  over ``col`` (plain ``Shard``: no regrouping as for GPT-2's fused ``c_attn``), so rank ``(r, c)`` holds query
  heads ``[c nh/q, (c+1) nh/q)`` and key/value heads ``[c nkv/q, (c+1) nkv/q)``: exactly the key/value heads its
  query heads read (contiguous GQA groups), hence ``n_kv_head % q == 0``. RoPE is applied locally (rows split the
  batch, so positions are ``0 .. T-1``), attention is local SDPA (``enable_gqa``), ``o_proj`` a SUMMA linear.
* **SwiGLU**: ``gate_proj`` and ``up_proj`` SUMMA linears split their outputs the same way, so ``silu(g) * u``
  is local; ``down_proj`` a SUMMA linear.
* **Untied head**: its own weight ``[V, h]`` is stored directly in the block the ``A B`` SUMMA multiplies,
  ``W[V_c, h_r]`` on rank ``(r, c)`` (``Shard(1)`` over ``row``, ``Shard(0)`` over ``col``), so unlike the tied
  head no block is swapped with the mirror rank; loss and logits as the tied head.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from lightning_tp2d import recompute
from lightning_tp2d.comm import all_reduce_along
from lightning_tp2d.models.llama import rms_norm, rope_attention
from lightning_tp2d.nn.attention import LAYOUT, refuse_documents
from lightning_tp2d.nn import traced
from lightning_tp2d.nn.functional import (autocast_operands, axis_index, is_local_grid, local_param, pad_rows,
                                          shard_parameter, sum_grad_along)
from lightning_tp2d.nn.head import LMHead2D
from lightning_tp2d.nn.layernorm import _stat_dtype, param_grads
from lightning_tp2d.nn.linear import Linear2D
from lightning_tp2d.ops import registered
from lightning_tp2d.options import tp_options
from lightning_tp2d.summa import summa_ab


def _scale(x, rstd, weight) -> torch.Tensor:
    """``w · (x · rstd)``, normalised in the statistics' dtype and cast back to ``x``'s before the weight multiplies
    (as :func:`~lightning_tp2d.models.llama.rms_norm`); ``rstd`` ``[..., 1]``."""
    return weight * (x.to(rstd.dtype) * rstd).to(x.dtype)


@registered("rms_norm_2d")
class _RMSNormAlongCol(torch.autograd.Function):
    """``y = w · x / sqrt(mean(x²) + eps)`` with the mean over the hidden dim split along ``col``; the statistics
    stay ``[..., 1]`` and are finished in place (``tests/test_lean_grid.py`` holds the layer's op counts)."""

    @staticmethod
    def forward(ctx, x, weight, mesh, hidden, eps):
        xf = x.to(_stat_dtype(x.dtype))
        rstd = (xf * xf).sum(-1, keepdim=True).div_(hidden)  # (N/q, 1): this shard's part of mean(x²)
        all_reduce_along(rstd, mesh, "col")
        rstd.add_(eps).rsqrt_()
        ctx.save_for_backward(x, weight, rstd)
        ctx.mesh, ctx.hidden = mesh, hidden
        y = _scale(x, rstd, weight)
        return recompute.mark(y, lambda: _scale(x, rstd, weight))  # selective: rebuilt locally

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.to(rstd.dtype) * rstd
        g = grad.to(rstd.dtype)
        # the weight's gradient (x̂ rounded to x's dtype, as the plain norm's), summed over row while dx is made
        params = param_grads(g, xhat.to(x.dtype).to(rstd.dtype), False, ctx.mesh)
        dxhat = g * weight.to(rstd.dtype)
        dot = (dxhat * xhat).sum(-1, keepdim=True).div_(ctx.hidden)  # (N/q, 1)
        all_reduce_along(dot, ctx.mesh, "col")
        dx = torch.addcmul(dxhat, xhat, dot, value=-1).mul_(rstd)
        dw, _ = params()
        return dx.to(x.dtype), dw.to(weight.dtype), None, None, None


class RMSNorm2D(nn.Module):
    """RMSNorm of ``[..., h/q]`` local features of an ``h``-wide hidden state split over ``col``. ``options``:
    accepted and ignored."""

    def __init__(self, norm: nn.Module, mesh: DeviceMesh, *, options=None) -> None:
        super().__init__()
        self.mesh = mesh
        self.hidden = norm.weight.shape[0]
        self.eps = norm.eps
        self.weight = shard_parameter(norm.weight, mesh, [Replicate(), Replicate(), Shard(0)])
        self.local = is_local_grid(mesh)  # a 1x1 grid: the plain model's norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.local:
            w = local_param(self, "weight")
            y = rms_norm(x, w, self.eps)
            return recompute.mark(y, lambda: rms_norm(x, w, self.eps))
        w = local_param(self, "weight")
        if torch.compiler.is_compiling():  # plain torch the compiler fuses (lightning_tp2d.nn.traced)
            return traced.rms_norm(x, sum_grad_along(w, self.mesh, "row"), self.mesh, self.hidden, self.eps)
        return _RMSNormAlongCol.apply(x, w, self.mesh, self.hidden, self.eps)  # (its gradient summed over row inside)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, eps={self.eps}"


class LlamaAttention2D(nn.Module):
    """SUMMA q/k/v projections, local RoPE and causal GQA attention of head group ``c``, SUMMA output projection.
    ``options`` (:class:`~lightning_tp2d.options.TPOptions`): the SUMMA fields, for all four linears."""

    def __init__(self, attn: nn.Module, mesh: DeviceMesh, *, options=None) -> None:
        super().__init__()
        q = axis_index(mesh, "col")[1]
        self.head_size, self.rope, self.dropout = attn.head_size, attn.rope, attn.dropout
        n_head, n_kv_head = attn.q_proj.out_features // self.head_size, attn.k_proj.out_features // self.head_size
        # heads and key/value heads divide by q: the family's size rule, checked before any layer is built
        # (families.ModelFamily.check_model in parallelize)
        self.local_heads, self.local_kv_heads = n_head // q, n_kv_head // q
        self.q_proj = Linear2D(attn.q_proj, mesh, options=options)
        self.k_proj = Linear2D(attn.k_proj, mesh, options=options)
        self.v_proj = Linear2D(attn.v_proj, mesh, options=options)
        self.o_proj = Linear2D(attn.o_proj, mesh, options=options)
        self.local = is_local_grid(mesh)  # (read by "2d-metp"'s attention: a 1x1 grid needs no ring)

    def forward(self, x: torch.Tensor, documents=None) -> torch.Tensor:
        refuse_documents(documents, LAYOUT)
        # head group c of batch shard r: (B/q, T, nh*hs/q) queries, (B/q, T, nkv*hs/q) keys and values
        y = rope_attention(self.q_proj(x), self.k_proj(x), self.v_proj(x), self.head_size, self.rope,
                           self.dropout if self.training else 0.0)  # (B/q, T, nh*hs/q)
        return self.o_proj(y)


class SwiGLU2D(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``: three SUMMA linears around a local ``silu * mul``.
    ``options``: as in :class:`LlamaAttention2D`."""

    def __init__(self, mlp: nn.Module, mesh: DeviceMesh, *, options=None) -> None:
        super().__init__()
        self.gate_proj = Linear2D(mlp.gate_proj, mesh, options=options)
        self.up_proj = Linear2D(mlp.up_proj, mesh, options=options)
        self.down_proj = Linear2D(mlp.down_proj, mesh, options=options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_proj(x), self.up_proj(x)
        h = recompute.mark(F.silu(g) * u, lambda: F.silu(g) * u)
        return self.down_proj(h)


class UntiedLMHead2D(LMHead2D):
    """An LM head with its own weight (untied): ``x_rc [B/q, T, h/q]`` -> mean loss or logits ``[B, T, V]``, as
    :class:`~lightning_tp2d.nn.head.LMHead2D`, with the weight stored as the SUMMA's ``B`` block ``W[V_c, h_r]``."""

    def __init__(self, head: nn.Module, mesh: DeviceMesh, *, options=None) -> None:
        nn.Module.__init__(self)
        self.mesh, self.options = mesh, tp_options(options)
        self.weight = shard_parameter(head.weight, mesh, [Replicate(), Shard(1), Shard(0)])  # W[V_c, h_r]
        self.vocab_size = head.weight.shape[0]

    def local_logits(self, x: torch.Tensor) -> torch.Tensor:
        x2d, weight = autocast_operands(x.reshape(-1, x.shape[-1]), local_param(self, "weight"))  # W[V_c, h_r]
        return summa_ab(x2d, pad_rows(weight, self.block_rows).t(), self.mesh, self.options)

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, untied"


__all__ = ["LlamaAttention2D", "RMSNorm2D", "SwiGLU2D", "UntiedLMHead2D"]
