"""Token and position embeddings on the ``q x q`` grid.

Token embedding ``E [V, h]``: block ``(r, c)`` is ``E[V_r, h_c]`` (vocab over ``row``, hidden over ``col``;
``V`` need not divide by ``q``, the last vocab blocks are short as DTensor's ``Shard`` makes them). Every
rank of the grid is handed the same full ``idx [B, T]``; rank ``(r, c)`` owns the tokens of batch shard ``r``
and must produce ``x_rc = E[idx_r, h_c]``. Forward, for each token shard ``t``: every rank of column ``c``
looks up the ids of shard ``t`` that fall in its vocab block (zeros elsewhere) and the partial rows are summed
into the owner, row ``t``, by a reduce along ``row``. Backward, the dual: each owner broadcasts its output
gradient along ``row`` and every rank scatter-adds the rows of its vocab block. ``q`` reduces forward,
``q`` broadcasts backward, each of ``[B/q, T, h/q]``.

Position embedding ``[block_size, h]``: hidden over ``col``, replicated over ``row`` (gradient summed over
``row``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from lightning_tp2d.comm import BroadcastPipeline, ReducePipeline
from lightning_tp2d.layouts import Grid2D
from lightning_tp2d.nn.functional import (axis_index, is_local_grid, local_param, shard_parameter, shard_range,
                                          sum_grad_along)
from lightning_tp2d.ops import registered


def shard_batch(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Rank ``(r, c)``'s batch shard ``r`` of a full ``[B, ...]`` tensor; ``B`` must divide by ``q`` (the "2d"
    layout's rule, checked before any communication)."""
    r, q = axis_index(mesh, "row")
    problem = Grid2D().batch_problem(q * q, x.shape[0])
    if problem:
        raise ValueError(problem)
    n = x.shape[0] // q
    return x[r * n:(r + 1) * n]


def _block_ids(idx: torch.Tensor, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``idx``'s rows in the vocab block ``[start, start + rows)`` (clamped into it: an id elsewhere reads row 0 or
    the last) and ``[..., 1]`` whether each id is there: once per call for all token shards (a mask, not an index
    list: no host sync, static shapes)."""
    local = idx - start
    hit = ((local >= 0) & (local < rows)).unsqueeze(-1)
    return local.clamp_(0, rows - 1), hit


@registered("embed_to_owner")
class _EmbedToOwner(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, idx, mesh, start):
        q = axis_index(mesh, "row")[1]
        rows = weight.shape[0]
        reducer = ReducePipeline(mesh, "row")
        ctx.mesh, ctx.weight_shape, ctx.empty = mesh, weight.shape, rows == 0
        if ctx.empty:  # an empty vocab block (more grid rows than ids): zeros to every owner
            for t, ids in enumerate(idx.chunk(q, dim=0)):
                reducer.push(weight.new_zeros((*ids.shape, weight.shape[1])), dst=t)
            return reducer.finish()
        local, hit = _block_ids(idx, start, rows)
        mask = hit.to(weight.dtype)
        for t, (ids, m) in enumerate(zip(local.chunk(q, dim=0), mask.chunk(q, dim=0))):
            reducer.push(F.embedding(ids, weight).mul_(m), dst=t)  # zero where an id is another block's
        ctx.save_for_backward(idx)  # (the ids the model keeps anyway; their block rows are made again backward)
        ctx.start = start
        return reducer.finish()

    @staticmethod
    def backward(ctx, grad):
        q = axis_index(ctx.mesh, "row")[1]
        width = ctx.weight_shape[1]
        dweight = grad.new_zeros(ctx.weight_shape)
        grads = BroadcastPipeline(grad.contiguous(), ctx.mesh, "row")
        if ctx.empty:
            for t in range(q):
                grads.get(t)
            return dweight, None, None, None
        (idx,) = ctx.saved_tensors
        local, hit = _block_ids(idx, ctx.start, ctx.weight_shape[0])
        zero = grad.new_zeros(())
        for t, (ids, h) in enumerate(zip(local.chunk(q, dim=0), hit.chunk(q, dim=0))):
            mine = torch.where(h, grads.get(t), zero)  # misses add an exact zero to a row of the block
            dweight.index_add_(0, ids.reshape(-1), mine.view(-1, width))
        return dweight, None, None, None


class TokenEmbedding2D(nn.Module):
    """``idx [B, T]`` (the full batch, same on every grid rank) -> ``x_rc [B/q, T, h/q]``. ``options``: accepted and
    ignored, so a layout builds every layer as ``Cls(module, mesh, options=...)``."""

    def __init__(self, embedding: nn.Embedding, mesh: DeviceMesh, *, options=None) -> None:
        super().__init__()
        self.mesh = mesh
        self.num_embeddings, self.embedding_dim = embedding.weight.shape
        self.weight = shard_parameter(embedding.weight, mesh, [Replicate(), Shard(0), Shard(1)])
        r, q = axis_index(mesh, "row")
        self.vocab_start, self.vocab_stop = shard_range(self.num_embeddings, q, r)
        self.local = is_local_grid(mesh)  # a 1x1 grid: one F.embedding, as the plain model's

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.local:
            return F.embedding(idx, local_param(self, "weight"))
        shard_batch(idx, self.mesh)  # validates B % q before any communication
        return _EmbedToOwner.apply(local_param(self, "weight"), idx, self.mesh, self.vocab_start)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, local vocab [{self.vocab_start}, {self.vocab_stop})"


class PositionEmbedding2D(nn.Module):
    """``pos [T]`` -> ``[T, h/q]`` (hidden block ``c``); broadcasts against ``[B/q, T, h/q]``. ``options``: ignored."""

    def __init__(self, embedding: nn.Embedding, mesh: DeviceMesh, *, options=None) -> None:
        super().__init__()
        self.mesh = mesh
        self.weight = shard_parameter(embedding.weight, mesh, [Replicate(), Replicate(), Shard(1)])

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        return F.embedding(pos, sum_grad_along(local_param(self, "weight"), self.mesh, "row"))
