"""``LMHead2D``: the tied LM head and its loss on the grid.

``logits = X Eᵀ`` with ``X_rc = X[N_r, h_c]``. As a SUMMA ``A B`` with ``B = Eᵀ [h, V]``, rank ``(r, c)``
needs block ``Eᵀ[h_r, V_c]``, i.e. ``E[V_c, h_r]``: the block that the token embedding's layout (vocab over
``row``, hidden over ``col``) keeps on the mirror rank ``(c, r)``. One point-to-point swap with the mirror
(``V h / p`` numbers) turns the embedding's blocks into the head's, and the product is then an ``A B`` SUMMA:
``q`` broadcasts of ``X`` panels and of weight panels forward, the sibling products backward, and a swap
back of the weight gradient. The alternative ``A Bᵀ`` SUMMA on the embedding's own blocks would reduce
``[N/q, V/q]`` logit partials ``q`` times forward and broadcast logit-gradient panels twice backward:
``3 N V / q`` numbers against ``N h / q + 3 V h / q + 2 V h / p`` here (7x less for GPT-2 at N = 8192, q = 2).

Vocab blocks are zero-padded to ``ceil(V/q)`` rows so every block has one shape (and further, to a multiple of the
config's ``pad_vocab_multiple``, GPU-shaped); the padded logit columns are masked in the loss and dropped when logits
are gathered. With targets the vocab-parallel cross-entropy returns the mean loss and no rank ever holds more than
its ``[N/q, V/q]`` block; without targets the full ``[B, T, V]`` logits are gathered on every rank, or with
``logits_at`` only one position's ``[B, 1, V]``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_tp2d import recompute
from lightning_tp2d.comm import exchange_with
from lightning_tp2d.models.gpt2 import lm_head, padded_rows
from lightning_tp2d.mesh import transpose_peer
from lightning_tp2d.nn import traced
from lightning_tp2d.nn.cross_entropy import vocab_parallel_cross_entropy
from lightning_tp2d.nn.embedding import shard_batch
from lightning_tp2d.nn.functional import (autocast_operands, axis_index, gather_grid, is_local_grid, local_param,
                                          pad_rows, transpose_grid)
from lightning_tp2d.options import tp_options
from lightning_tp2d.summa import summa_ab


class LMHead2D(nn.Module):
    """``x_rc [B/q, T, h/q]`` -> mean loss (with ``targets [B, T]``, the full batch) or logits ``[B, T, V]``.
    ``options`` (:class:`~lightning_tp2d.options.TPOptions`): the SUMMA fields."""

    def __init__(self, weight: nn.Parameter, mesh: DeviceMesh, *, options=None) -> None:
        super().__init__()
        self.mesh, self.options = mesh, tp_options(options)
        self.weight = weight  # the token embedding's DTensor parameter (tied)
        self.vocab_size = weight.shape[0]

    pad_multiple = 1  # the plain head's (the config's pad_vocab_multiple), handed on by parallelize

    @property
    def vocab_rows(self) -> int:
        """Vocabulary rows of a block, ``ceil(V/q)``: block ``c`` holds token ids ``[c, c + 1) * vocab_rows``."""
        return -(-self.vocab_size // axis_index(self.mesh, "row")[1])

    @property
    def block_rows(self) -> int:
        """Rows of a block as the product runs: :attr:`vocab_rows` padded to a multiple of ``pad_multiple`` (zero
        rows at the block's end; their logit columns are masked in the loss and dropped from gathered logits)."""
        return padded_rows(self.vocab_rows, self.pad_multiple)

    def _vocab_columns(self, full: torch.Tensor) -> torch.Tensor:
        """The gathered ``[rows, q * block_rows]`` logits without the padding: ``[rows, V]``."""
        rows, q = full.shape[0], axis_index(self.mesh, "row")[1]
        if self.block_rows != self.vocab_rows:
            full = full.view(rows, q, self.block_rows)[..., : self.vocab_rows].reshape(rows, q * self.vocab_rows)
        return full[:, : self.vocab_size]

    @property
    def local(self) -> bool:
        """A 1x1 grid: the plain model's head (one ``F.linear``, ``F.cross_entropy``)."""
        return is_local_grid(self.mesh)

    def local_logits(self, x: torch.Tensor) -> torch.Tensor:
        """``[N/q, ceil(V/q)]`` logits block of this rank (padding columns hold zeros)."""
        x2d, weight = autocast_operands(x.reshape(-1, x.shape[-1]), local_param(self, "weight"))  # E[V_r, h_c]
        mirrored = transpose_grid(pad_rows(weight, self.block_rows), self.mesh)  # E[V_c, h_r]: (ceil(V/q), h/q)
        recompute.mark(mirrored, lambda dtype=weight.dtype: self._mirror(dtype))  # selective: swapped again
        return summa_ab(x2d, mirrored.t(), self.mesh, self.options)  # B block Eᵀ[h_r, V_c], travels as stored

    def _mirror(self, dtype: torch.dtype) -> torch.Tensor:
        """The mirror rank's embedding block, fetched again (selective recomputation, in the backward: every rank
        of the grid unpacks it at the same point of the head's backward, so the pairwise swaps meet)."""
        block = pad_rows(self.weight.to_local().detach().to(dtype), self.block_rows).contiguous()
        return exchange_with(block, transpose_peer(self.mesh)).view_as(block)

    def local_targets(self, targets: torch.Tensor) -> torch.Tensor:
        """Targets of this rank's tokens, flattened in the order of its logits rows (batch shard ``r``)."""
        return shard_batch(targets, self.mesh).reshape(-1)

    def full_logits(self, full: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, V]`` from the gathered ``[B*T, V]`` rows (row blocks in grid-row order)."""
        q = axis_index(self.mesh, "row")[1]
        return full.view(x.shape[0] * q, x.shape[1], self.vocab_size)

    def position_rows(self, x: torch.Tensor, at: int) -> tuple[torch.Tensor, int]:
        """``(rows of x to compute logits for, index of position at among their gathered logits)``: here every
        rank holds the whole sequence of its batch shard, so the one row ``at``."""
        return x[:, at:at + 1], 0

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None,
                logits_at: int | None = None) -> torch.Tensor:
        """``logits_at`` (a position ``0 <= t < T``, no targets): the logits ``[B, 1, V]`` of that position only,
        from the few rows :meth:`position_rows` picks (every rank computes and gathers those, not ``[N/q, V/q]``)."""
        if self.local:
            return lm_head(x, local_param(self, "weight"), targets, logits_at, self.pad_multiple)
        if logits_at is not None:
            x, index = self.position_rows(x, logits_at)
        if targets is not None:
            local_targets = self.local_targets(targets)
        logits = self.local_logits(x)
        if targets is None:
            full = self.full_logits(self._vocab_columns(gather_grid(logits, self.mesh)), x)  # (B, rows, V)
            return full if logits_at is None else full[:, index:index + 1]
        if torch.compiler.is_compiling():  # plain torch the compiler fuses, the logits not copied (nn.traced)
            return traced.vocab_parallel_cross_entropy(logits, local_targets, self.mesh, self.vocab_size,
                                                       self.vocab_rows)
        return vocab_parallel_cross_entropy(logits, local_targets, self.mesh, self.vocab_size, self.vocab_rows)

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, tied to transformer.wte.weight"

