"""Token embedding, position embedding and the tied LM head for the ``"metp"`` ring (DESIGN 3.2).

The token embedding ``E [V, h]`` is split by vocab rows: ring rank ``j`` holds rows ``[j*Vb, (j+1)*Vb)`` with
``Vb = ceil(V/p)`` (the last blocks are zero-padded to ``Vb`` so every block has one shape). Rank ``i`` owns the
tokens of its zigzag chunks, ``N = B * 2T/(2p)`` of them, with the full hidden size.

* Embedding: the ``E_j`` stream past the resident ids; each token is copied from the one block that holds it.
  Forward ``p-1`` exchanges of ``[Vb, h]``. Backward: gradient accumulators ``dE_j`` (scatter-adds of this
  rank's output gradient rows) travel alone, ``p-1`` exchanges, ending at their owners.
* LM head + cross-entropy: ``loss = mean_t (logsumexp_v z_tv - z_t,target)`` with ``z = X Eᵀ``. The ``E_j``
  stream past ``X_i``; per step the ``[N, Vb]`` logits block is folded into a running log-sum-exp and the target
  logit, so no rank ever holds ``[N, V]`` logits. One all-reduce of ``[loss sum, count]`` (two numbers).
  Backward recomputes each block: ``dZ_j = softmax - onehot``; ``dX += dZ_j E_j`` locally and
  ``dE_j += dZ_jᵀ X_i`` travelling with ``E_j`` (``p-1`` + ``p`` exchanges).
* Without targets the head returns the full logits ``[B, T, V]`` on every rank (a weight-streaming linear, then
  an all-gather of the sequence): for evaluation, it needs ``[N, V]`` per rank by construction.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from lightning_tp2d.comm import all_reduce_along
from lightning_tp2d.metp import ColumnBlocks, acc_dtype, ring_backward, ring_forward, ring_linear_out
from lightning_tp2d.nn.cross_entropy import IGNORE_INDEX
from lightning_tp2d.nn.functional import autocast_operands, axis_index, pad_rows, shard_parameter, sum_grad_along
from lightning_tp2d.nn.sequence import check_sequence_length, gather_sequence, zigzag_positions

AXIS = "ring"


def _block_hits(ids: torch.Tensor, j: int, rows: int, valid: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids relative to vocab block ``j`` (``rows`` per block) and where they fall in its first ``valid`` rows."""
    local = ids - j * rows
    return local, (local >= 0) & (local < (rows if valid is None else valid))


class _RingEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, ids, mesh, axis):
        # weight (Vb, h) vocab block i, zero-padded; ids (B, S) global token ids of this rank's chunks
        out = weight.new_zeros((*ids.shape, weight.shape[1]))

        def step(j, blocks):
            local, hit = _block_hits(ids, j, weight.shape[0])
            out[hit] = blocks[0][local[hit]]

        ring_forward((weight,), mesh, axis, step)
        ctx.save_for_backward(ids)
        ctx.mesh, ctx.axis, ctx.shape, ctx.dtype = mesh, axis, weight.shape, weight.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        grad = grad.to(acc_dtype(ctx.dtype))

        def step(j, _):
            local, hit = _block_hits(ids, j, ctx.shape[0])
            return (grad.new_zeros(ctx.shape).index_add_(0, local[hit], grad[hit]),)

        (dweight,) = ring_backward((), ctx.mesh, ctx.axis, step)
        return dweight.to(ctx.dtype), None, None, None


class _RingCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, mesh, axis, vocab_size):
        # x (N, h); weight (Vb, h) vocab block i, zero-padded; targets (N,) global ids or -100
        acc = acc_dtype(x.dtype)
        rows = weight.shape[0]
        lse = torch.full((x.shape[0],), float("-inf"), dtype=acc, device=x.device)
        target_logit = torch.zeros_like(lse)
        keep = targets != IGNORE_INDEX

        def step(j, blocks):
            valid = max(0, min(rows, vocab_size - j * rows))  # columns past V are padding
            if valid == 0:
                return
            z = (x @ blocks[0][:valid].t()).to(acc)  # (N, valid)
            torch.logaddexp(lse, torch.logsumexp(z, -1), out=lse)
            local, hit = _block_hits(targets, j, rows, valid)
            where = hit.nonzero().squeeze(1)
            target_logit[where] = z[where, local[where]]

        ring_forward((weight,), mesh, axis, step)
        per_token = torch.where(keep, lse - target_logit, lse.new_zeros(()))
        totals = torch.stack([per_token.sum(), keep.sum().to(acc)])
        all_reduce_along(totals, mesh, axis)
        ctx.save_for_backward(x, weight, targets, lse)
        ctx.mesh, ctx.axis, ctx.vocab_size, ctx.count = mesh, axis, vocab_size, totals[1]
        return totals[0] / totals[1]  # float32 under bf16 autocast, like F.cross_entropy

    @staticmethod
    def backward(ctx, grad):
        x, weight, targets, lse = ctx.saved_tensors
        rows, acc = weight.shape[0], lse.dtype
        scale = ((targets != IGNORE_INDEX).to(acc) * (grad.to(acc) / ctx.count)).unsqueeze(-1)  # (N, 1)
        dx = torch.zeros_like(x)

        def step(j, blocks):
            dweight = torch.zeros(weight.shape, dtype=acc, device=x.device)
            valid = max(0, min(rows, ctx.vocab_size - j * rows))
            if valid == 0:
                return (dweight,)
            w_j = blocks[0][:valid]
            dz = (x @ w_j.t()).to(acc).sub_(lse.unsqueeze(-1)).exp_()  # softmax block (N, valid)
            local, hit = _block_hits(targets, j, rows, valid)
            where = hit.nonzero().squeeze(1)
            dz[where, local[where]] -= 1
            dz = dz.mul_(scale).to(x.dtype)
            dx.addmm_(dz, w_j)
            dweight[:valid] = dz.t() @ x
            return (dweight,)

        (dweight,) = ring_backward((weight,), ctx.mesh, ctx.axis, step)
        return dx, dweight.to(weight.dtype), None, None, None, None


class RingTokenEmbedding(nn.Module):
    """``idx [B, T]`` (the full batch, same on every ring rank) -> ``x_i [B, 2T/(2p), h]`` (zigzag chunks)."""

    def __init__(self, embedding: nn.Embedding, mesh: DeviceMesh) -> None:
        super().__init__()
        self.mesh = mesh
        self.num_embeddings, self.embedding_dim = embedding.weight.shape
        self.weight = shard_parameter(embedding.weight, mesh, [Replicate(), Shard(0)])
        self.block_rows = -(-self.num_embeddings // axis_index(mesh, AXIS)[1])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        i, p = axis_index(self.mesh, AXIS)
        check_sequence_length(idx.shape[1], p, "metp")
        ids = idx[:, zigzag_positions(idx.shape[1], p, i, idx.device)]
        return _RingEmbedding.apply(pad_rows(self.weight.to_local(), self.block_rows), ids, self.mesh, AXIS)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, vocab block of {self.block_rows} rows"


class RingPositionEmbedding(nn.Module):
    """``pos [T]`` -> ``[2T/(2p), h]``, the rows of this rank's zigzag chunks; the weight is replicated over the
    ring and its gradient summed over it."""

    def __init__(self, embedding: nn.Embedding, mesh: DeviceMesh) -> None:
        super().__init__()
        self.mesh = mesh
        self.weight = shard_parameter(embedding.weight, mesh, [Replicate(), Replicate()])

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        i, p = axis_index(self.mesh, AXIS)
        check_sequence_length(pos.shape[0], p, "metp")
        mine = pos[zigzag_positions(pos.shape[0], p, i, pos.device)]
        return F.embedding(mine, sum_grad_along(self.weight.to_local(), self.mesh, AXIS))


class RingLMHead(nn.Module):
    """``x_i [B, S, h]`` -> mean loss (with ``targets [B, T]``, the full batch; the same scalar on every rank)
    or the full logits ``[B, T, V]``."""

    def __init__(self, weight: nn.Parameter, mesh: DeviceMesh) -> None:
        super().__init__()
        self.mesh = mesh
        self.weight = weight  # the token embedding's DTensor parameter (tied)
        self.vocab_size = weight.shape[0]
        self.block_rows = -(-self.vocab_size // axis_index(mesh, AXIS)[1])

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        i, p = axis_index(self.mesh, AXIS)
        B, S, h = x.shape
        if targets is not None:
            check_sequence_length(targets.shape[1], p, "metp")
            targets = targets[:, zigzag_positions(targets.shape[1], p, i, targets.device)].reshape(-1)
        weight = pad_rows(self.weight.to_local(), self.block_rows)
        x2d, weight = autocast_operands(x.reshape(B * S, h), weight)
        if targets is not None:
            return _RingCrossEntropy.apply(x2d, weight, targets, self.mesh, AXIS, self.vocab_size)
        logits = ring_linear_out(x2d, weight, None, self.mesh, AXIS, ColumnBlocks(B * S, p, self.block_rows))
        return gather_sequence(logits[:, : self.vocab_size].reshape(B, S, self.vocab_size), self.mesh, AXIS)

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, tied to transformer.wte.weight"
