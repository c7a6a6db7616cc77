"""Layers of the ``"2d-metp"`` layout (docs/layouts.md, "2d-metp"): the ``"2d"`` grid with rows splitting the
*sequence*.

Rank ``(r, c)`` holds, for every sequence of the batch, the zigzag chunks ``r`` and ``2q-1-r`` (``S = 2T/(2q)``
rows) and hidden block ``c``: ``x_rc [B, S, h/q]``. So batch 1 works and the sequence length scales with ``p``.
Linears stay SUMMA and LayerNorm stays as in "2d" (both are per-token, indifferent to which tokens a row
holds); attention for head group ``c`` runs the METP ring along ``row`` (the ranks holding the other chunks of
the same heads); the embeddings and the loss pick this row's zigzag tokens instead of its batch shard.
Parameters are placed exactly as in "2d". Every layer takes ``options`` (:class:`~lightning_tp2d.options.TPOptions`,
``None``: the defaults) and keeps it as ``self.options``: the SUMMA linears and the head read its SUMMA fields, the
attention's ring its ring fields.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from lightning_tp2d.layouts import GridRing
from lightning_tp2d.metp import RingOptions, ring_attention, ring_options
from lightning_tp2d.nn.attention import Attention2D
from lightning_tp2d.nn.embedding import PositionEmbedding2D, TokenEmbedding2D, _EmbedToOwner
from lightning_tp2d.nn.functional import axis_index, local_param
from lightning_tp2d.nn.head import LMHead2D
from lightning_tp2d.nn.ring import refuse_attention_dropout
from lightning_tp2d.nn.sequence import check_sequence_length, zigzag_inverse, zigzag_positions

LAYOUT = GridRing()  # the layout these layers serve: its rules check their input


def _row_positions(seq: int, mesh: DeviceMesh, device) -> torch.Tensor | None:
    """The positions of this grid row's zigzag chunks (``T % 2q`` checked); ``None`` on a 1x1 grid, whose one row
    holds the whole sequence in order."""
    r, q = axis_index(mesh, "row")
    check_sequence_length(seq, LAYOUT, q * q)
    return None if q == 1 else zigzag_positions(seq, q, r, device)


class TokenEmbedding2DMetp(TokenEmbedding2D):
    """``idx [B, T]`` -> ``x_rc [B, S, h/q]``. As in "2d", the ranks of column ``c`` look up the ids of every
    token shard in their vocab block and reduce the partial rows to the shard's owner row; the shard of row
    ``t`` is now its zigzag chunks ``idx[:, chunks(t)]`` (stacked along the batch dim for the reduce loop)."""

    def __init__(self, embedding: torch.nn.Embedding, mesh: DeviceMesh, *, options: RingOptions | None = None) -> None:
        super().__init__(embedding, mesh)
        self.options = ring_options(options)  # no ring pass here; kept for a uniform constructor

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        q = axis_index(self.mesh, "row")[1]
        _row_positions(idx.shape[1], self.mesh, idx.device)  # validates T % 2q before any communication
        if self.local:  # a 1x1 grid: the whole sequence in order, the whole vocabulary
            return super().forward(idx)
        shards = torch.cat([idx[:, zigzag_positions(idx.shape[1], q, t, idx.device)] for t in range(q)])
        return _EmbedToOwner.apply(local_param(self, "weight"), shards, self.mesh, self.vocab_start)


class PositionEmbedding2DMetp(PositionEmbedding2D):
    """``pos [T]`` -> ``[S, h/q]``: the rows of this grid row's zigzag chunks (gradient summed over ``row``)."""

    def __init__(self, embedding: torch.nn.Embedding, mesh: DeviceMesh, *, options: RingOptions | None = None) -> None:
        super().__init__(embedding, mesh)
        self.options = ring_options(options)  # no ring pass here; kept for a uniform constructor

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        mine = _row_positions(pos.shape[0], self.mesh, pos.device)
        return super().forward(pos if mine is None else pos[mine])


class Attention2DMetp(Attention2D):
    """SUMMA QKV, ring attention of head group ``c`` along ``row``, SUMMA output projection."""

    def __init__(self, attn: torch.nn.Module, mesh: DeviceMesh, *, options: RingOptions | None = None) -> None:
        super().__init__(attn, mesh, options=options)
        self.mesh, self.options = mesh, ring_options(options)

    def forward(self, x: torch.Tensor, documents=None) -> torch.Tensor:
        """``documents``: the full batch's packed documents; the ring along ``row`` masks and skips by them."""
        refuse_attention_dropout(self)
        if self.local and documents is None and self.options.attention_kernel == "auto":  # 1x1: as in "2d"
            return Attention2D.forward(self, x)
        B, S, _ = x.shape  # (B, S, h/q): zigzag chunks of row r, hidden block c
        hs = self.n_embd // self.n_head
        qkv = self.c_attn(x).view(B, S, 3, self.local_heads, hs).permute(2, 0, 3, 1, 4)  # (3, B, nh/q, S, hs)
        y = ring_attention(qkv, self.mesh, "row", options=self.options, documents=documents)  # (B, nh/q, S, hs)
        y = y.transpose(1, 2).reshape(B, S, self.local_heads * hs)
        return self.resid_dropout(self.c_proj(y))


class LMHead2DMetp(LMHead2D):
    """As :class:`LMHead2D`; rows hold zigzag sequence chunks, so targets and gathered logits follow them."""

    def __init__(self, weight: torch.nn.Parameter, mesh: DeviceMesh, *, options: RingOptions | None = None) -> None:
        super().__init__(weight, mesh, options=options)

    def local_targets(self, targets: torch.Tensor) -> torch.Tensor:
        mine = _row_positions(targets.shape[1], self.mesh, targets.device)
        return (targets if mine is None else targets[:, mine]).reshape(-1)

    def position_rows(self, x: torch.Tensor, at: int) -> tuple[torch.Tensor, int]:
        """Position ``at`` lies in zigzag chunk ``k = at // c`` at offset ``m`` (``c = S/2``), held by one grid row:
        every row takes offset ``m`` of both its chunks (``[B, 2, h/q]``), so the gathered logits ``[B, 2q, V]``
        are offset ``m`` of every chunk in chunk order, and position ``at`` is entry ``k``."""
        c = x.shape[1] // 2
        m = at % c
        return x[:, [m, c + m]], at // c

    def full_logits(self, full: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q = axis_index(self.mesh, "row")[1]
        B, S = x.shape[:2]
        by_row = full.view(q, B, S, self.vocab_size).transpose(0, 1).reshape(B, q * S, self.vocab_size)
        return by_row.index_select(1, zigzag_inverse(q * S, q, full.device))
