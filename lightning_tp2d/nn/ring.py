"""Transformer-block layers of the ``"metp"`` ring (docs/layouts.md, "metp"): every rank holds its zigzag chunks of each
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
streams its input-column blocks (in-split linear). The MLP is one fused ring pass. The token embedding
(``wte``: Shard(0), vocab rows) and the tied LM head stream vocab blocks (:mod:`~lightning_tp2d.nn.ring_stream`);
the position embedding (replicated) picks this rank's zigzag rows. Without targets the head returns the full
logits ``[B, T, V]`` on every rank (an all-gather of the sequence): for evaluation, ``[N, V]`` per rank; with
``logits_at`` one position's ``[B, 1, V]`` (generation), ``[2B, V]`` per rank.

Every layer is built as ``Cls(module, mesh, options=RingOptions(...))`` (``None``: the defaults) and passes its
:class:`~lightning_tp2d.metp.RingOptions` to every ring function it calls; layers that call none keep it too.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_tp2d import recompute
from lightning_tp2d.layouts import Ring
from lightning_tp2d.metp import RingOptions, ring_attention, ring_mlp, ring_options
from lightning_tp2d.models.gpt2 import causal_attention, layer_norm, lm_head, padded_rows
from lightning_tp2d.nn.functional import (autocast_operands, axis_index, local_param, pad_rows, shard_bias,
                                          shard_parameter, sum_grad_along, sum_grads_along)
from lightning_tp2d.nn.ring_stream import (ColumnBlocks, HeadBlocks, ring_cross_entropy, ring_embedding,
                                           ring_linear_in, ring_linear_out)
from lightning_tp2d.nn.sequence import check_sequence_length, gather_sequence, zigzag_positions

LAYOUT = Ring()  # the layout these layers serve: its rules check their input

AXIS = "ring"
REPLICATED = [Replicate(), Replicate()]


def is_local_ring(mesh: DeviceMesh) -> bool:
    """A ring of one rank: every block is local, and each ring layer runs the plain model's ops (its kernels, one
    matmul per linear, ``F.cross_entropy``) instead of a ring pass."""
    return axis_index(mesh, AXIS)[1] == 1


def one_tile(rows: int, options: RingOptions) -> bool:
    """Whether ``rows`` rows fit one of the ring kernels' row tiles (``options.tile_tokens``; ``0`` / ``None``:
    untiled), so that the plain computation holds no larger a block than the tiled ring pass would."""
    return not options.tile_tokens or rows <= options.tile_tokens


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
        shard_bias(self, linear.bias, mesh, REPLICATED)

    def local(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(weight block, full bias)`` of this rank (the bias ``None`` without one; not ``self.bias is None``: see
        ``local_param``). The ring kernels sum the bias' gradient over the ring in their own backward."""
        return local_param(self, "weight"), local_param(self, "bias")

    def forward(self, x: torch.Tensor, layout, options: RingOptions) -> torch.Tensor:
        """``options``: the owning layer's (one owner, so the two linears of a layer never disagree)."""
        w, bias = self.local()
        x, w = autocast_operands(x, w)
        fn = ring_linear_out if self.split == "out" else ring_linear_in
        return fn(x, w, bias, self.mesh, AXIS, layout, options=options, float8=options.float8)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, split={self.split!r}"


class RingLayerNorm(nn.Module):
    """LayerNorm of ``[..., h]`` rows (local: every rank has the full hidden size); weight and bias replicated
    over the ring, their gradients summed over it."""

    def __init__(self, norm: nn.LayerNorm, mesh: DeviceMesh, *, options: RingOptions | None = None) -> None:
        super().__init__()
        self.mesh, self.options = mesh, ring_options(options)  # no ring pass here; kept for a uniform constructor
        self.normalized_shape, self.eps = tuple(norm.normalized_shape), norm.eps
        self.weight = shard_parameter(norm.weight, mesh, REPLICATED)
        shard_bias(self, norm.bias, mesh, REPLICATED)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = local_param(self, "weight"), local_param(self, "bias")
        w, *b = sum_grads_along([w] if b is None else [w, b], self.mesh, AXIS)  # both gradients in one all-reduce
        b = b[0] if b else None
        y = layer_norm(x, self.normalized_shape, w, b, self.eps)  # in x's dtype (bf16 stays bf16)
        return recompute.mark(y, lambda: layer_norm(x, self.normalized_shape, w, b, self.eps))


def refuse_attention_dropout(module: nn.Module) -> None:
    if module.training and module.dropout > 0:
        raise NotImplementedError(f"ring attention has no attention-probability dropout (dropout={module.dropout}); "
                                  f"train with dropout=0.0, or a layout without a ring")


class RingAttention(nn.Module):
    """``x_i [B, S, h]`` -> ``c_proj(attention(c_attn(x)))`` of this rank's tokens, attending to the whole
    causal prefix through the ring. Forward: 3 ring passes (QKV weights, K|V, c_proj weights)."""

    def __init__(self, attn: nn.Module, mesh: DeviceMesh, *, options: RingOptions | None = None) -> None:
        super().__init__()
        self.mesh, self.options = mesh, ring_options(options)
        self.n_head, self.n_embd, self.dropout = attn.n_head, attn.n_embd, attn.dropout
        self.c_attn = RingLinear(attn.c_attn, mesh, "out", groups=3)
        self.c_proj = RingLinear(attn.c_proj, mesh, "in")
        self.resid_dropout = nn.Dropout(attn.resid_dropout.p)
        self.local = is_local_ring(mesh)

    def forward(self, x: torch.Tensor, documents=None) -> torch.Tensor:
        """``documents``: the full batch's packed documents (:func:`~lightning_tp2d.metp.ring_attention`)."""
        refuse_attention_dropout(self)
        if (self.local and documents is None and self.options.attention_kernel == "auto"
                and self.options.float8 is None):  # plain attention, fused (float8: the ring kernels, on one rank)
            (w_attn, b_attn), (w_proj, b_proj) = self.c_attn.local(), self.c_proj.local()
            y = causal_attention(F.linear(x, w_attn, b_attn), self.n_head)
            return self.resid_dropout(F.linear(y, w_proj, b_proj))
        B, S, h = x.shape
        p = axis_index(self.mesh, AXIS)[1]
        heads = (B, S, self.n_head, h // self.n_head, p)
        qkv = self.c_attn(x.reshape(B * S, h), HeadBlocks(3, *heads), self.options)  # (3, B, nh, S, hs)
        y = ring_attention(qkv, self.mesh, AXIS, options=self.options, documents=documents)  # (B, nh, S, hs)
        out = self.c_proj(y.unsqueeze(0), HeadBlocks(1, *heads), self.options)  # (B*S, h)
        return self.resid_dropout(out.view(B, S, h))


class RingMLP(nn.Module):
    """``c_proj(gelu(c_fc(x)))`` as one ring pass: ``c_fc``'s output-row blocks and ``c_proj``'s input-column
    blocks travel together; the ``[N, 4h]`` hidden activation never exists."""

    def __init__(self, mlp: nn.Module, mesh: DeviceMesh, *, options: RingOptions | None = None) -> None:
        super().__init__()
        self.mesh, self.options = mesh, ring_options(options)
        self.c_fc = RingLinear(mlp.c_fc, mesh, "out")
        self.c_proj = RingLinear(mlp.c_proj, mesh, "in")
        self.dropout = nn.Dropout(mlp.dropout.p)
        self.local = is_local_ring(mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, h = x.shape
        w1, b1 = self.c_fc.local()
        w2, b2 = self.c_proj.local()
        if self.local and one_tile(B * S, self.options) and self.options.float8 is None:  # the plain model's MLP
            return self.dropout(F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2))
        x2d, w1, w2 = autocast_operands(x.reshape(B * S, h), w1, w2)
        out = ring_mlp(x2d, w1, b1, w2, b2, self.mesh, AXIS, options=self.options,
                       float8=self.options.float8)  # (B*S, h)
        return self.dropout(out.view(B, S, h))


# ---- embeddings and LM head ------------------------------------------------------------------------------


class RingTokenEmbedding(nn.Module):
    """``idx [B, T]`` (the full batch, same on every ring rank) -> ``x_i [B, 2T/(2p), h]`` (zigzag chunks)."""

    def __init__(self, embedding: nn.Embedding, mesh: DeviceMesh, *, options: RingOptions | None = None) -> None:
        super().__init__()
        self.mesh, self.options = mesh, ring_options(options)
        self.num_embeddings, self.embedding_dim = embedding.weight.shape
        self.weight = shard_parameter(embedding.weight, mesh, [Replicate(), Shard(0)])
        self.block_rows = -(-self.num_embeddings // axis_index(mesh, AXIS)[1])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        i, p = axis_index(self.mesh, AXIS)
        check_sequence_length(idx.shape[1], LAYOUT, p)
        if p == 1:  # a ring of one: the whole vocabulary and sequence are local
            return F.embedding(idx, local_param(self, "weight"))
        ids = idx[:, zigzag_positions(idx.shape[1], p, i, idx.device)]
        return ring_embedding(pad_rows(local_param(self, "weight"), self.block_rows), ids, self.mesh, AXIS,
                              options=self.options)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, vocab block of {self.block_rows} rows"


class RingPositionEmbedding(nn.Module):
    """``pos [T]`` -> ``[2T/(2p), h]``, the rows of this rank's zigzag chunks; the weight is replicated over the
    ring and its gradient summed over it."""

    def __init__(self, embedding: nn.Embedding, mesh: DeviceMesh, *, options: RingOptions | None = None) -> None:
        super().__init__()
        self.mesh, self.options = mesh, ring_options(options)  # no ring pass here; kept for a uniform constructor
        self.weight = shard_parameter(embedding.weight, mesh, [Replicate(), Replicate()])

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        i, p = axis_index(self.mesh, AXIS)
        check_sequence_length(pos.shape[0], LAYOUT, p)
        mine = pos if p == 1 else pos[zigzag_positions(pos.shape[0], p, i, pos.device)]
        return F.embedding(mine, sum_grad_along(local_param(self, "weight"), self.mesh, AXIS))


class RingLMHead(nn.Module):
    """``x_i [B, S, h]`` -> mean loss (with ``targets [B, T]``, the full batch; the same scalar on every rank)
    or the full logits ``[B, T, V]``, or with ``logits_at`` one position's logits ``[B, 1, V]`` (generation's
    prefill): position ``at`` lies in zigzag chunk ``k = at // c`` at offset ``m``; every rank streams the vocab
    blocks past offset ``m`` of both its chunks (``[2B, h]``, not ``[2cB, h]``), and the gathered ``[B, 2p, V]``
    logits (offset ``m`` of every chunk, in chunk order) give entry ``k``."""

    def __init__(self, weight: nn.Parameter, mesh: DeviceMesh, *, options: RingOptions | None = None) -> None:
        super().__init__()
        self.mesh, self.options = mesh, ring_options(options)
        self.weight = weight  # the token embedding's DTensor parameter (tied)
        self.vocab_size = weight.shape[0]
        self.vocab_rows = -(-self.vocab_size // axis_index(mesh, AXIS)[1])  # block i holds ids [i, i + 1) * this

    # the plain head's (the config's pad_vocab_multiple), handed on by parallelize: a ring of one pads its product,
    # a longer ring each streamed vocab block (zero rows after its ids, masked in the loss, dropped from logits)
    pad_multiple = 1

    @property
    def block_rows(self) -> int:
        """Rows of a streamed vocab block: :attr:`vocab_rows` padded to a multiple of ``pad_multiple``."""
        return padded_rows(self.vocab_rows, self.pad_multiple)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None,
                logits_at: int | None = None) -> torch.Tensor:
        i, p = axis_index(self.mesh, AXIS)
        if p == 1 and one_tile(x.shape[0] * x.shape[1], self.options):  # a ring of one: the plain model's head
            if targets is not None:
                check_sequence_length(targets.shape[1], LAYOUT, p)
            return lm_head(x, local_param(self, "weight"), targets, logits_at, self.pad_multiple)
        if logits_at is not None:
            c = x.shape[1] // 2
            x, index = x[:, [logits_at % c, c + logits_at % c]], logits_at // c  # (B, 2, h): offset m of each chunk
        B, S, h = x.shape
        if targets is not None:
            check_sequence_length(targets.shape[1], LAYOUT, p)
            targets = targets[:, zigzag_positions(targets.shape[1], p, i, targets.device)].reshape(-1)
        weight = pad_rows(local_param(self, "weight"), self.block_rows)
        x2d, weight = autocast_operands(x.reshape(B * S, h), weight)
        block_vocab = None if self.block_rows == self.vocab_rows else self.vocab_rows
        if targets is not None:
            return ring_cross_entropy(x2d, weight, targets, self.mesh, AXIS, self.vocab_size, options=self.options,
                                      block_vocab=block_vocab)
        logits = ring_linear_out(x2d, weight, None, self.mesh, AXIS, ColumnBlocks(B * S, p, self.block_rows),
                                 options=self.options)
        if block_vocab is not None:  # each block's padding columns out
            logits = logits.view(B * S, p, self.block_rows)[..., : self.vocab_rows].reshape(B * S, -1)
        full = gather_sequence(logits[:, : self.vocab_size].reshape(B, S, self.vocab_size), self.mesh, AXIS)
        return full if logits_at is None else full[:, index:index + 1]

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, tied to transformer.wte.weight"
