"""Vocab-parallel cross-entropy: the loss of logits that exist only as ``[N/q, V/q]`` blocks.

Rank ``(r, c)`` holds logits of tokens ``N_r`` for vocab block ``c``: ids ``[c, c + 1) * ceil(V/q)`` in its first
columns, then padding (the last block's ids past ``V``, and the columns a GPU-shaped block adds), masked out of the
softmax. Per token:
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
from lightning_tp2d.nn.traced import IGNORE_INDEX
from lightning_tp2d.ops import registered



@registered("vocab_parallel_cross_entropy", mutates=(0,))
class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token values stay ``[N/q, 1]`` columns (no unsqueeze); the target logit is one ``gather`` at the target's
    local column (0 where the target lies in another block, or is ignored: an ignored ``-100`` is below every
    block's start), then zeroed by the one mask "not in this block"; ignored tokens are weighted 0."""

    @staticmethod
    def forward(ctx, logits, targets, mesh, vocab_size, block_vocab):
        # logits: (N/q, width) local block, consumed in place; targets: (N/q,) global ids or -100; block c holds ids
        # [c, c + 1) * block_vocab in its first columns, padding after
        ctx.dtype = logits.dtype
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # the softmax and its sums in float32
        c, _ = axis_index(mesh, "col")
        width = logits.shape[-1]
        block_vocab = width if block_vocab is None else block_vocab
        start = c * block_vocab
        valid_cols = max(0, min(block_vocab, vocab_size - start))
        if valid_cols < width:
            logits[:, valid_cols:] = float("-inf")

        local_max = logits.amax(-1, keepdim=True)
        all_reduce_along(local_max, mesh, "col", op="max")
        logits.sub_(local_max)

        local_t = (targets - start).unsqueeze(-1)  # (N/q, 1)
        elsewhere = (local_t < 0) | (local_t >= block_vocab)  # another block's target, or ignored
        col = local_t.masked_fill_(elsewhere, 0)
        picked = logits.gather(-1, col).masked_fill_(elsewhere, 0)
        exp = logits.exp_()
        sums = torch.cat([exp.sum(-1, keepdim=True), picked], -1)  # (N/q, 2)
        all_reduce_along(sums, mesh, "col")
        sum_exp, target_logit = sums.split(1, -1)

        keep = (targets != IGNORE_INDEX).unsqueeze(-1)  # (N/q, 1): a counted token
        per_token = torch.log(sum_exp).sub_(target_logit).mul_(keep)
        totals = torch.cat([per_token, keep.to(per_token.dtype)], -1).sum(0)  # (2,): loss sum, token count
        all_reduce_along(totals, mesh, "row")

        exp.div_(sum_exp)  # softmax, in place
        ctx.save_for_backward(exp, col, elsewhere, keep)
        loss_sum, ctx.count = totals.unbind()
        return loss_sum / ctx.count

    @staticmethod
    def backward(ctx, grad):
        softmax, col, elsewhere, keep = ctx.saved_tensors
        scale = keep * (grad / ctx.count)  # (N/q, 1): d loss / d logit row
        dlogits = softmax * scale
        dlogits.scatter_add_(-1, col, scale.masked_fill(elsewhere, 0).neg_())  # - onehot; other blocks add -0
        return dlogits.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, mesh: DeviceMesh,
                                 vocab_size: int, block_vocab: int | None = None) -> torch.Tensor:
    """Mean cross-entropy (targets ``-100`` ignored) of vocab-split logits; the same scalar on every rank.
    ``logits`` ``[N/q, width]`` is overwritten (it becomes the softmax kept for backward). ``block_vocab``: the token
    ids a block holds, in its first columns (``None``: ``width``); the columns past them, and past ``vocab_size``,
    are padding."""
    return _VocabParallelCrossEntropy.apply(logits, targets, mesh, vocab_size, block_vocab)
