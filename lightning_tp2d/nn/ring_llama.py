"""Llama's layers on the ``"metp"`` ring (DESIGN 3.2): as for GPT-2 (:mod:`lightning_tp2d.nn.ring`), rank ``i``
holds its zigzag chunks ``i`` and ``2p-1-i`` of every sequence with the full hidden size, ``x_i [B, S, h]``,
``S = 2T/(2p)``, and ``1/p`` of every weight matrix; the weight blocks and K/V travel round the ring.

Parameter placements over ``(data_parallel, ring)`` (torch ``Linear`` stores ``weight [out, in]``; no biases):

=========================================  ===============  ===============================================
parameter                                  placement        travels in the ring kernel as
=========================================  ===============  ===============================================
self_attn.q_proj / k_proj / v_proj.weight  R, Shard(0)      output-row blocks (three weight-streaming passes)
self_attn.o_proj.weight                    R, Shard(1)      input-column block
mlp.gate_proj / up_proj.weight             R, Shard(0)      output-row blocks, travelling together with ...
mlp.down_proj.weight                       R, Shard(1)      ... the input-column block (one SwiGLU ring pass)
embed_tokens.weight, untied lm_head        R, Shard(0)      vocab-row blocks (zero-padded to ``ceil(V/p)``)
RMSNorm weights                            R, R             stay; gradients summed over ``ring`` in backward
=========================================  ===============  ===============================================

* **RMSNorm** is local (full hidden size): :func:`~lightning_tp2d.models.llama.rms_norm` with the replicated
  weight, whose gradient is summed over the ring (as :class:`~lightning_tp2d.nn.ring.RingLayerNorm`).
* **Attention**: ``q_proj``, ``k_proj``, ``v_proj`` are weight-streaming out-split ring linears writing q
  ``[B, nh, S, hs]`` and k, v ``[B, nkv, S, hs]`` of this rank's tokens (every head: heads are not split, so any
  head count fits); RoPE is applied locally with the *absolute* positions of the zigzag chunks; then
  :func:`ring_gqa_attention` rotates the ``n_kv_head`` key/value heads ``[2, B, nkv, S, hs]`` (never the
  expanded ``nh`` heads) and expands them to the query heads locally, block by block; its backward sums the
  expanded gradients back over each group before they travel. ``o_proj`` is an in-split ring linear.
* **SwiGLU** (:func:`ring_swiglu`): one ring pass in which ``gate_proj``'s and ``up_proj``'s row blocks and
  ``down_proj``'s column block travel together; ``silu(g) * u`` of one ``[N, I/p]`` block at a time, recomputed in
  backward; the ``[N, I]`` hidden activation never exists.
* **Embedding / head**: GPT-2's :class:`~lightning_tp2d.nn.ring.RingTokenEmbedding` and (tied)
  :class:`~lightning_tp2d.nn.ring.RingLMHead`; an untied head (:class:`UntiedRingLMHead`) shards its own weight
  by vocab rows like the embedding.

Sizes that must divide by ``p``: ``n_embd`` (q rows, ``o_proj`` columns), ``n_kv_head*head_size`` (k/v rows) and
``intermediate_size``; the sequence length by ``2p``. The two kernels here are registered custom ops
(:func:`~lightning_tp2d.ops.registered`), like the GPT-2 ring kernels.

Layout ``"2d-metp"`` (end of the module): Llama's ``"2d"`` layers with rows holding zigzag chunks; only the
attention (:class:`LlamaAttention2DMetp`, :func:`ring_gqa_attention` along ``row``) and the untied head
(:class:`UntiedLMHead2DMetp`) differ; embedding and tied head are GPT-2's ``"2d-metp"`` ones.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from lightning_tp2d import recompute
from lightning_tp2d.comm import axis_rank
from lightning_tp2d.metp import (RingOptions, acc_dtype, attend_block, attend_block_backward, ring_backward,
                                 ring_forward, ring_options, visible)
from lightning_tp2d.models.llama import apply_rope, rms_norm, rope_cache
from lightning_tp2d.nn.functional import autocast_operands, axis_index, shard_parameter, sum_grad_along
from lightning_tp2d.nn.grid_metp import LMHead2DMetp
from lightning_tp2d.nn.llama2d import LlamaAttention2D, UntiedLMHead2D
from lightning_tp2d.nn.ring import AXIS, REPLICATED, RingLinear, RingLMHead, refuse_attention_dropout
from lightning_tp2d.nn.ring_stream import HeadBlocks, ring_linear_out
from lightning_tp2d.nn.sequence import zigzag_positions
from lightning_tp2d.ops import registered

# ---- kernels ---------------------------------------------------------------------------------------------------


def _expand(t: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, nkv, L, d]`` -> ``[B, nkv*g, L, d]``: query head ``j`` reads key/value head ``j // g``."""
    if groups == 1:
        return t
    B, H, L, d = t.shape
    return t.unsqueeze(2).expand(B, H, groups, L, d).reshape(B, H * groups, L, d)


def _reduce(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of :func:`_expand`: sum over each group of query heads."""
    if groups == 1:
        return t
    B, H, L, d = t.shape
    return t.view(B, H // groups, groups, L, d).sum(2)


@registered("ring_gqa_attention")
class _RingGQAAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, mesh, axis, scale, options):
        # q (B, nh, S, d) this rank's zigzag chunks; kv (2, B, nkv, S, d) travels; g = nh // nkv
        i = axis_rank(mesh, axis)
        g = q.shape[1] // kv.shape[2]
        c = q.shape[-2] // 2
        out = torch.empty(q.shape, dtype=acc_dtype(q.dtype), device=q.device)
        lse = torch.empty(q.shape[:-1], dtype=out.dtype, device=q.device)

        def step(j, blocks):
            (kv_j,) = blocks
            rows, cols, causal = visible(i, j, c)
            k_j, v_j = _expand(kv_j[0][..., cols, :], g), _expand(kv_j[1][..., cols, :], g)
            o_b, l_b = attend_block(q[..., rows, :], k_j, v_j, causal, scale, options)
            if j == i:
                out.copy_(o_b)
                lse.copy_(l_b)
                return
            o, l = out[..., rows, :], lse[..., rows]
            new = torch.logaddexp(l, l_b)
            o.mul_((l - new).exp_().unsqueeze(-1)).add_(o_b.to(o.dtype) * (l_b - new).exp_().unsqueeze(-1))
            l.copy_(new)

        ring_forward((kv,), mesh, axis, step, double_buffer=options.double_buffer)
        y = out.to(q.dtype)
        ctx.save_for_backward(q, kv, y, lse)
        ctx.mesh, ctx.axis, ctx.scale, ctx.options = mesh, axis, scale, options
        return y

    @staticmethod
    def backward(ctx, dy):
        q, kv, y, lse = ctx.saved_tensors
        i = axis_rank(ctx.mesh, ctx.axis)
        g = q.shape[1] // kv.shape[2]
        c = q.shape[-2] // 2
        dy = dy.contiguous()
        dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)
        dkv = torch.empty(kv.shape, dtype=lse.dtype, device=kv.device)

        def step(j, blocks):
            (kv_j,) = blocks
            rows, cols, causal = visible(i, j, c)
            k_j, v_j = _expand(kv_j[0][..., cols, :], g), _expand(kv_j[1][..., cols, :], g)
            dq_b, dk_b, dv_b = attend_block_backward(dy[..., rows, :], q[..., rows, :], k_j, v_j, y[..., rows, :],
                                                     lse[..., rows], causal, ctx.scale, ctx.options)
            dq[..., rows, :] += dq_b
            d = torch.zeros(kv.shape, dtype=lse.dtype, device=kv.device)
            d[0][..., cols, :] = _reduce(dk_b, g)  # the nkv heads travel, not the expanded nh
            d[1][..., cols, :] = _reduce(dv_b, g)
            return (d,)

        ring_backward((kv,), ctx.mesh, ctx.axis, step, home=(dkv,), double_buffer=ctx.options.double_buffer,
                      wire_dtype=ctx.options.wire_dtype(kv.dtype))
        return dq.to(q.dtype), dkv.to(kv.dtype), None, None, None, None


def ring_gqa_attention(q: torch.Tensor, kv: torch.Tensor, mesh: DeviceMesh, axis: str, scale: float | None = None,
                       *, options: RingOptions | None = None) -> torch.Tensor:
    """Causal grouped-query attention of a zigzag-sharded sequence: ``q [B, nh, S, d]`` stays, ``kv [2, B, nkv, S,
    d]`` (``nh % nkv == 0``) travels round the ring and is expanded to the ``nh`` query heads locally per block
    (:func:`~lightning_tp2d.metp.ring_attention`'s blocks and merge otherwise) -> ``y [B, nh, S, d]``. Forward
    ``p-1`` exchanges of ``K|V``; backward ``p-1`` of ``K|V`` and ``p`` of ``dK|dV``, all of ``nkv`` heads."""
    if q.dim() != 4 or kv.dim() != 5 or kv.shape[0] != 2 or q.shape[-2] % 2 or q.shape[1] % kv.shape[2] \
            or (q.shape[0], q.shape[2], q.shape[3]) != (kv.shape[1], kv.shape[3], kv.shape[4]):
        raise ValueError(f"ring_gqa_attention expects q [B, nh, S, d] and kv [2, B, nkv, S, d] with nh % nkv == 0 "
                         f"and S even (two zigzag chunks), got {tuple(q.shape)} and {tuple(kv.shape)}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingGQAAttention.apply(q.contiguous(), kv.contiguous(), mesh, axis, scale, ring_options(options))


def _silu_grad(g: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(g)
    return s * (1 + g * (1 - s))


@registered("ring_swiglu")
class _RingSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, mesh, axis, options):
        # x (N, h); w_gate, w_up (I/p, h) output rows of block i; w_down (h, I/p) input columns of block i
        out = x.new_zeros((x.shape[0], w_down.shape[0]))

        def step(j, blocks):
            wg_j, wu_j, wd_j = blocks
            out.addmm_(F.silu(x @ wg_j.t()) * (x @ wu_j.t()), wd_j.t())

        ring_forward((w_gate, w_up, w_down), mesh, axis, step, double_buffer=options.double_buffer)
        ctx.save_for_backward(x, w_gate, w_up, w_down)
        ctx.mesh, ctx.axis, ctx.options = mesh, axis, options
        return out

    @staticmethod
    def backward(ctx, dout):
        x, w_gate, w_up, w_down = ctx.saved_tensors
        acc = acc_dtype(x.dtype)
        dout = dout.contiguous()
        dx = torch.zeros_like(x)

        def step(j, blocks):
            wg_j, wu_j, wd_j = blocks
            gate, up = x @ wg_j.t(), x @ wu_j.t()  # recomputed, never stored
            act = F.silu(gate)
            dwd = (dout.t() @ (act * up)).to(acc)  # (h, I/p)
            dh = dout @ wd_j  # (N, I/p)
            dup = dh * act
            dgate = dh * up * _silu_grad(gate)
            dx.addmm_(dgate, wg_j).addmm_(dup, wu_j)
            return (dgate.t() @ x).to(acc), (dup.t() @ x).to(acc), dwd

        dwg, dwu, dwd = ring_backward((w_gate, w_up, w_down), ctx.mesh, ctx.axis, step,
                                      double_buffer=ctx.options.double_buffer,
                                      wire_dtype=ctx.options.wire_dtype(w_gate.dtype))
        return dx, dwg.to(w_gate.dtype), dwu.to(w_up.dtype), dwd.to(w_down.dtype), None, None, None


def ring_swiglu(x, w_gate, w_up, w_down, mesh: DeviceMesh, axis: str, *,
                options: RingOptions | None = None) -> torch.Tensor:
    """``(silu(X Wgᵀ) * (X Wuᵀ)) Wdᵀ`` with ``X [N, h]`` local rows, ``Wg``'s and ``Wu``'s output rows
    (``[I/p, h]``) and ``Wd``'s input columns (``[h, I/p]``) split over the ring: one pass, the three blocks
    travelling together. Forward ``p-1`` exchanges; backward ``p-1`` of the blocks and ``p`` of their
    gradients; ``[N, I/p]`` per step, recomputed in backward."""
    return _RingSwiGLU.apply(x, w_gate, w_up, w_down, mesh, axis, ring_options(options))


# ---- layers ----------------------------------------------------------------------------------------------------


class RingRMSNorm(nn.Module):
    """RMSNorm of ``[..., h]`` rows (local: every rank has the full hidden size); the weight is replicated over the
    ring and its gradient summed over it."""

    def __init__(self, norm: nn.Module, mesh: DeviceMesh, *, options: RingOptions | None = None) -> None:
        super().__init__()
        self.mesh, self.options = mesh, ring_options(options)  # no ring pass here; kept for a uniform constructor
        self.eps = norm.eps
        self.weight = shard_parameter(norm.weight, mesh, REPLICATED)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = sum_grad_along(self.weight.to_local(), self.mesh, AXIS)
        y = rms_norm(x, w, self.eps)
        return recompute.mark(y, lambda: rms_norm(x, w, self.eps))

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class RingLlamaAttention(nn.Module):
    """``x_i [B, S, h]`` -> ``o_proj(attention(rope(q), rope(k), v))`` of this rank's tokens, attending to the whole
    causal prefix through the ring. Forward: 5 ring passes (q, k, v weight rows; K|V of the ``nkv`` heads;
    ``o_proj`` columns)."""

    def __init__(self, attn: nn.Module, mesh: DeviceMesh, *, options: RingOptions | None = None) -> None:
        super().__init__()
        self.mesh, self.options = mesh, ring_options(options)
        self.head_size, self.rope_theta, self.dropout = attn.head_size, attn.rope_theta, attn.dropout
        self.n_head = attn.q_proj.out_features // self.head_size
        self.n_kv_head = attn.k_proj.out_features // self.head_size
        self.q_proj = RingLinear(attn.q_proj, mesh, "out")
        self.k_proj = RingLinear(attn.k_proj, mesh, "out")
        self.v_proj = RingLinear(attn.v_proj, mesh, "out")
        self.o_proj = RingLinear(attn.o_proj, mesh, "in")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        refuse_attention_dropout(self)
        B, S, h = x.shape
        i, p = axis_index(self.mesh, AXIS)
        hs = self.head_size
        x2d = x.reshape(B * S, h)
        q = self.q_proj(x2d, HeadBlocks(1, B, S, self.n_head, hs, p), self.options)[0]  # (B, nh, S, hs)
        # k and v in one ring pass: each rank's weight block is its k rows then its v rows (as GPT-2's c_attn)
        (wk, _), (wv, _) = self.k_proj.local(), self.v_proj.local()
        k, v = ring_linear_out(x2d, torch.cat([wk, wv]), None, self.mesh, AXIS,
                               HeadBlocks(2, B, S, self.n_kv_head, hs, p), options=self.options)  # (B, nkv, S, hs)
        cos, sin = rope_cache(zigzag_positions(S * p, p, i, x.device), hs, self.rope_theta)  # absolute positions
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = ring_gqa_attention(q, torch.stack([k, v]), self.mesh, AXIS, options=self.options)  # (B, nh, S, hs)
        out = self.o_proj(y.unsqueeze(0), HeadBlocks(1, B, S, self.n_head, hs, p), self.options)  # (B*S, h)
        return out.view(B, S, h)

    def extra_repr(self) -> str:
        return f"n_head={self.n_head}, n_kv_head={self.n_kv_head}, head_size={self.head_size}"


class RingSwiGLU(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` as one ring pass (:func:`ring_swiglu`)."""

    def __init__(self, mlp: nn.Module, mesh: DeviceMesh, *, options: RingOptions | None = None) -> None:
        super().__init__()
        self.mesh, self.options = mesh, ring_options(options)
        self.gate_proj = RingLinear(mlp.gate_proj, mesh, "out")
        self.up_proj = RingLinear(mlp.up_proj, mesh, "out")
        self.down_proj = RingLinear(mlp.down_proj, mesh, "in")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, h = x.shape
        (wg, _), (wu, _), (wd, _) = self.gate_proj.local(), self.up_proj.local(), self.down_proj.local()
        x2d, wg, wu, wd = autocast_operands(x.reshape(B * S, h), wg, wu, wd)
        return ring_swiglu(x2d, wg, wu, wd, self.mesh, AXIS, options=self.options).view(B, S, h)


class UntiedRingLMHead(RingLMHead):
    """An LM head with its own weight (untied): ``[V, h]`` sharded by vocab rows over the ring like the token
    embedding; loss and logits as :class:`~lightning_tp2d.nn.ring.RingLMHead`."""

    def __init__(self, head: nn.Module, mesh: DeviceMesh, *, options: RingOptions | None = None) -> None:
        super().__init__(shard_parameter(head.weight, mesh, [Replicate(), Shard(0)]), mesh, options=options)

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, untied, vocab block of {self.block_rows} rows"


# ---- "2d-metp": the grid with rows splitting the sequence -------------------------------------------------------


class LlamaAttention2DMetp(LlamaAttention2D):
    """Layout ``"2d-metp"`` (:mod:`lightning_tp2d.nn.grid_metp`): rank ``(r, c)`` holds ``x_rc [B, S, h/q]``, the
    zigzag chunks ``r`` and ``2q-1-r`` and hidden block ``c``. SUMMA q/k/v projections give query heads
    ``[c nh/q, (c+1) nh/q)`` and key/value heads ``[c nkv/q, (c+1) nkv/q)`` of the row's tokens, RoPE uses their
    absolute positions, and :func:`ring_gqa_attention` runs along ``row`` (the ranks holding the other chunks of
    the same head group); SUMMA output projection."""

    def __init__(self, attn: nn.Module, mesh: DeviceMesh, *, options: RingOptions | None = None) -> None:
        super().__init__(attn, mesh, options=options)
        self.mesh, self.options = mesh, ring_options(options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        refuse_attention_dropout(self)
        B, S, _ = x.shape  # (B, S, h/q)
        hs = self.head_size
        r, q = axis_index(self.mesh, "row")
        q_ = self.q_proj(x).view(B, S, self.local_heads, hs).transpose(1, 2)  # (B, nh/q, S, hs)
        k = self.k_proj(x).view(B, S, self.local_kv_heads, hs).transpose(1, 2)  # (B, nkv/q, S, hs)
        v = self.v_proj(x).view(B, S, self.local_kv_heads, hs).transpose(1, 2)
        cos, sin = rope_cache(zigzag_positions(S * q, q, r, x.device), hs, self.rope_theta)
        q_, k = apply_rope(q_, cos, sin), apply_rope(k, cos, sin)
        y = ring_gqa_attention(q_, torch.stack([k, v]), self.mesh, "row", options=self.options)
        return self.o_proj(y.transpose(1, 2).reshape(B, S, self.local_heads * hs))


class UntiedLMHead2DMetp(UntiedLMHead2D, LMHead2DMetp):
    """An untied head in ``"2d-metp"``: :class:`~lightning_tp2d.nn.llama2d.UntiedLMHead2D`'s weight and logits,
    :class:`~lightning_tp2d.nn.grid_metp.LMHead2DMetp`'s zigzag targets and gathered logits."""


__all__ = ["LlamaAttention2DMetp", "RingLlamaAttention", "RingRMSNorm", "RingSwiGLU", "UntiedLMHead2DMetp",
           "UntiedRingLMHead", "ring_gqa_attention", "ring_swiglu"]
