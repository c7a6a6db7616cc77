"""Llama's layers on the ``"metp"`` ring (docs/layouts.md, "metp"): as for GPT-2 (:mod:`lightning_tp2d.nn.ring`),
rank ``i`` holds its zigzag chunks ``i`` and ``2p-1-i`` of every sequence with the full hidden size, ``x_i [B, S, h]``,
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
  the one ring attention kernel (:func:`~lightning_tp2d.metp.ring_attention`, ``groups = nh / nkv``) rotates
  the ``n_kv_head`` key/value heads ``[2, B, nkv, S, hs]`` (never ``nh`` heads) and every query head of a group
  attends to the block it holds; its backward sums the gradients over each group before they travel. ``o_proj``
  is an in-split ring linear.
* **SwiGLU**: the one-pass ring MLP (:func:`~lightning_tp2d.metp.ring_mlp` with ``activation="swiglu"``), in
  which ``gate_proj``'s and ``up_proj``'s row blocks and ``down_proj``'s column block travel together;
  ``silu(g) * u`` of one ``[N, I/p]`` block at a time, recomputed in backward; the ``[N, I]`` hidden activation
  never exists.
* **Embedding / head**: GPT-2's :class:`~lightning_tp2d.nn.ring.RingTokenEmbedding` and (tied)
  :class:`~lightning_tp2d.nn.ring.RingLMHead`; an untied head (:class:`UntiedRingLMHead`) shards its own weight
  by vocab rows like the embedding.

Sizes that must divide by ``p``: ``n_embd`` (q rows, ``o_proj`` columns), ``n_kv_head*head_size`` (k/v rows) and
``intermediate_size``; the sequence length by ``2p``. No kernel of its own: the ring kernels are GPT-2's
(:mod:`lightning_tp2d.metp`, :mod:`lightning_tp2d.nn.ring_stream`).

Layout ``"2d-metp"`` (end of the module): Llama's ``"2d"`` layers with rows holding zigzag chunks; only the
attention (:class:`LlamaAttention2DMetp`, the grouped ring attention along ``row``) and the untied head
(:class:`UntiedLMHead2DMetp`) differ; embedding and tied head are GPT-2's ``"2d-metp"`` ones.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from lightning_tp2d import recompute
from lightning_tp2d.metp import RingOptions, group_queries, ring_attention, ring_mlp, ring_options
from lightning_tp2d.models.llama import apply_rope, rms_norm, rope_attention, rope_cache, swiglu
from lightning_tp2d.nn.functional import autocast_operands, axis_index, local_param, shard_parameter, sum_grad_along
from lightning_tp2d.nn.grid_metp import LMHead2DMetp
from lightning_tp2d.nn.llama2d import LlamaAttention2D, UntiedLMHead2D
from lightning_tp2d.nn.ring import (AXIS, REPLICATED, RingLinear, RingLMHead, is_local_ring, one_tile,
                                    refuse_attention_dropout)
from lightning_tp2d.nn.ring_stream import HeadBlocks, ring_linear_out
from lightning_tp2d.nn.sequence import zigzag_positions

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
        w = sum_grad_along(local_param(self, "weight"), self.mesh, AXIS)
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
        self.head_size, self.rope, self.dropout = attn.head_size, attn.rope, attn.dropout
        self.n_head = attn.q_proj.out_features // self.head_size
        self.n_kv_head = attn.k_proj.out_features // self.head_size
        self.q_proj = RingLinear(attn.q_proj, mesh, "out")
        self.k_proj = RingLinear(attn.k_proj, mesh, "out")
        self.v_proj = RingLinear(attn.v_proj, mesh, "out")
        self.o_proj = RingLinear(attn.o_proj, mesh, "in")
        self.local = is_local_ring(mesh)

    def forward(self, x: torch.Tensor, documents=None) -> torch.Tensor:
        """``documents``: the full batch's packed documents (:func:`~lightning_tp2d.metp.ring_attention`)."""
        refuse_attention_dropout(self)
        if (self.local and documents is None and self.options.attention_kernel == "auto"
                and self.options.float8 is None):  # plain attention, fused (float8: the ring kernels, on one rank)
            wq, wk, wv, wo = (proj.local()[0] for proj in (self.q_proj, self.k_proj, self.v_proj, self.o_proj))
            y = rope_attention(F.linear(x, wq), F.linear(x, wk), F.linear(x, wv), self.head_size, self.rope)
            return F.linear(y, wo)
        B, S, h = x.shape
        i, p = axis_index(self.mesh, AXIS)
        hs = self.head_size
        x2d = x.reshape(B * S, h)
        q = self.q_proj(x2d, HeadBlocks(1, B, S, self.n_head, hs, p), self.options)[0]  # (B, nh, S, hs)
        # k and v in one ring pass: each rank's weight block is its k rows then its v rows (as GPT-2's c_attn)
        (wk, _), (wv, _) = self.k_proj.local(), self.v_proj.local()
        x2d, wkv = autocast_operands(x2d, torch.cat([wk, wv]))  # as RingLinear does for q
        k, v = ring_linear_out(x2d, wkv, None, self.mesh, AXIS,
                               HeadBlocks(2, B, S, self.n_kv_head, hs, p), options=self.options,
                               float8=self.options.float8)  # (B, nkv, S, hs); float8: one scale for k and v
        cos, sin = rope_cache(zigzag_positions(S * p, p, i, x.device), hs, self.rope)  # absolute positions
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = ring_attention(group_queries(q, k, v), self.mesh, AXIS, groups=self.n_head // self.n_kv_head,
                           options=self.options, documents=documents)  # (B, nh, S, hs)
        out = self.o_proj(y.unsqueeze(0), HeadBlocks(1, B, S, self.n_head, hs, p), self.options)  # (B*S, h)
        return out.view(B, S, h)

    def extra_repr(self) -> str:
        return f"n_head={self.n_head}, n_kv_head={self.n_kv_head}, head_size={self.head_size}"


class RingSwiGLU(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` as one ring pass (:func:`~lightning_tp2d.metp.ring_mlp` with
    ``activation="swiglu"``; rows in ``options.tile_tokens`` tiles when ``I/p > h``, so the hidden blocks are
    ``[tile, I/p]``, not ``[N, I/p]``)."""

    def __init__(self, mlp: nn.Module, mesh: DeviceMesh, *, options: RingOptions | None = None) -> None:
        super().__init__()
        self.mesh, self.options = mesh, ring_options(options)
        self.gate_proj = RingLinear(mlp.gate_proj, mesh, "out")
        self.up_proj = RingLinear(mlp.up_proj, mesh, "out")
        self.down_proj = RingLinear(mlp.down_proj, mesh, "in")
        self.local = is_local_ring(mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, h = x.shape
        (wg, _), (wu, _), (wd, _) = self.gate_proj.local(), self.up_proj.local(), self.down_proj.local()
        if self.local and one_tile(B * S, self.options) and self.options.float8 is None:  # the plain model's MLP
            return swiglu(x, wg, wu, wd)
        x2d, wg, wu, wd = autocast_operands(x.reshape(B * S, h), wg, wu, wd)
        out = ring_mlp(x2d, wu, None, wd, None, self.mesh, AXIS, activation="swiglu", w_gate=wg, options=self.options,
                       float8=self.options.float8)
        return out.view(B, S, h)


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
    absolute positions, and the grouped ring attention (:func:`~lightning_tp2d.metp.ring_attention`) runs along
    ``row`` (the ranks holding the other chunks of the same head group); SUMMA output projection."""

    def __init__(self, attn: nn.Module, mesh: DeviceMesh, *, options: RingOptions | None = None) -> None:
        super().__init__(attn, mesh, options=options)
        self.mesh, self.options = mesh, ring_options(options)

    def forward(self, x: torch.Tensor, documents=None) -> torch.Tensor:
        """``documents``: the full batch's packed documents; the ring along ``row`` masks and skips by them."""
        refuse_attention_dropout(self)
        if self.local and documents is None and self.options.attention_kernel == "auto":  # 1x1: as in "2d"
            return LlamaAttention2D.forward(self, x)
        B, S, _ = x.shape  # (B, S, h/q)
        hs = self.head_size
        r, q = axis_index(self.mesh, "row")
        q_ = self.q_proj(x).view(B, S, self.local_heads, hs).transpose(1, 2)  # (B, nh/q, S, hs)
        k = self.k_proj(x).view(B, S, self.local_kv_heads, hs).transpose(1, 2)  # (B, nkv/q, S, hs)
        v = self.v_proj(x).view(B, S, self.local_kv_heads, hs).transpose(1, 2)
        cos, sin = rope_cache(zigzag_positions(S * q, q, r, x.device), hs, self.rope)
        q_, k = apply_rope(q_, cos, sin), apply_rope(k, cos, sin)
        y = ring_attention(group_queries(q_, k, v), self.mesh, "row", groups=self.local_heads // self.local_kv_heads,
                           options=self.options, documents=documents)  # (B, nh/q, S, hs)
        return self.o_proj(y.transpose(1, 2).reshape(B, S, self.local_heads * hs))


class UntiedLMHead2DMetp(UntiedLMHead2D, LMHead2DMetp):
    """An untied head in ``"2d-metp"``: :class:`~lightning_tp2d.nn.llama2d.UntiedLMHead2D`'s weight and logits,
    :class:`~lightning_tp2d.nn.grid_metp.LMHead2DMetp`'s zigzag targets and gathered logits."""


__all__ = ["LlamaAttention2DMetp", "RingLlamaAttention", "RingRMSNorm", "RingSwiGLU", "UntiedLMHead2DMetp",
           "UntiedRingLMHead"]
