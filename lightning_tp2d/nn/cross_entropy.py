"""Vocab-parallel cross-entropy: the loss of logits that exist only as ``[N/q, V/q]`` blocks.

Rank ``(r, c)`` holds logits of tokens ``N_r`` for vocab block ``c`` (padded to ``Vp = q * ceil(V/q)``;
columns ``>= V`` are padding and are masked out of the softmax). Per token:
``loss = log Σ_v exp(z_v) - z_target``, computed as ``m = max_v z_v`` (all-reduce MAX along ``col``), then
``Σ exp(z - m)`` and the target logit (one all-reduce SUM along ``col`` of both), and the mean over the
non-ignored tokens of all rows (one all-reduce SUM along ``row`` of ``[loss sum, count]``). The backward is
local: ``(softmax - onehot) / count``. The full ``[N, V]`` logits never exist; the local block is turned into
the softmax in place.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from lightning_tp2d.comm import all_reduce_along
from lightning_tp2d.nn.functional import axis_index
from lightning_tp2d.ops import registered

IGNORE_INDEX = -100


@registered("vocab_parallel_cross_entropy", mutates=(0,))
class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, mesh, vocab_size):
        # logits: (N/q, Vp/q) local block, consumed in place; targets: (N/q,) global ids or -100
        ctx.dtype = logits.dtype
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # the softmax and its sums in float32
        c, _ = axis_index(mesh, "col")
        width = logits.shape[-1]
        start = c * width
        valid_cols = max(0, min(width, vocab_size - start))
        if valid_cols < width:
            logits[:, valid_cols:] = float("-inf")

        local_max = logits.max(dim=-1).values
        all_reduce_along(local_max, mesh, "col", op="max")
        logits.sub_(local_max.unsqueeze(-1))

        local_t = targets - start
        mine = (targets != IGNORE_INDEX) & (local_t >= 0) & (local_t < width)
        rows = torch.arange(logits.shape[0], device=logits.device)
        picked = torch.where(mine, logits[rows, local_t.clamp(0, width - 1)], logits.new_zeros(()))
        exp = logits.exp_()
        sums = torch.stack([exp.sum(-1), picked])  # (2, N/q)
        all_reduce_along(sums, mesh, "col")
        sum_exp, target_logit = sums[0], sums[1]

        keep = targets != IGNORE_INDEX
        per_token = torch.where(keep, torch.log(sum_exp) - target_logit, logits.new_zeros(()))
        totals = torch.stack([per_token.sum(), keep.sum().to(per_token.dtype)])
        all_reduce_along(totals, mesh, "row")

        exp.div_(sum_exp.unsqueeze(-1))  # softmax, in place
        ctx.save_for_backward(exp, local_t, mine, keep)
        ctx.count = totals[1]
        return totals[0] / totals[1]

    @staticmethod
    def backward(ctx, grad):
        softmax, local_t, mine, keep = ctx.saved_tensors
        dlogits = softmax * keep.unsqueeze(-1).to(softmax.dtype)
        col = local_t.clamp(0, dlogits.shape[1] - 1).unsqueeze(1)
        dlogits.scatter_add_(1, col, mine.to(dlogits.dtype).neg_().unsqueeze(1))  # - onehot; misses add -0
        dlogits.mul_(grad / ctx.count)
        return dlogits.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, mesh: DeviceMesh,
                                 vocab_size: int) -> torch.Tensor:
    """Mean cross-entropy (targets ``-100`` ignored) of vocab-split logits; the same scalar on every rank.
    ``logits`` ``[N/q, Vp/q]`` is overwritten (it becomes the softmax kept for backward)."""
    return _VocabParallelCrossEntropy.apply(logits, targets, mesh, vocab_size)
