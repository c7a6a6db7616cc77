"""Weight-streaming instances of the METP ring kernel (:mod:`lightning_tp2d.metp`, docs/layouts.md, "metp"): ``f``
is the identity (linears) or a softmax over the streamed dimension (the LM head's cross-entropy), and the travelling
operand is a weight block while the activations stay put. ``N`` local tokens, ``p`` ring ranks.

* Linear, out-split (``c_attn``, LM-head logits): ``W [out, in]`` split by output rows; block ``j`` of
  ``Y = X Wᵀ + b`` is written where a layout (:class:`ColumnBlocks`, :class:`HeadBlocks`) puts it.
* Linear, in-split (attention ``c_proj``): ``W`` split by input columns; ``Y = Σ_j X_j W_jᵀ + b``.
* Token embedding ``E [V, h]`` split by vocab rows, ``Vb = ceil(V/p)`` per rank (the last blocks zero-padded
  to ``Vb`` so every block has one shape): the ``E_j`` stream past the resident ids and each token is copied
  from the one block that holds it. Backward: the accumulators ``dE_j`` (scatter-adds of this rank's output
  gradient rows) travel alone, ``p-1`` exchanges, ending at their owners.
* LM head + cross-entropy: ``loss = mean_t (logsumexp_v z_tv - z_t,target)``, ``z = X Eᵀ``. Per step the
  logits block of ``E_j`` is folded into a running log-sum-exp and the target logit ``options.tile_tokens`` rows
  at a time (``[tile, Vb]``, float32; untiled ``[N, Vb]``), so no rank ever holds ``[N, V]`` logits, nor at long
  sequences ``[N, Vb]`` (at Llama 3.1's vocabulary on a ring of 8, 131072 tokens per rank: 8 GiB in float32, four
  times ``X`` in float32); one all-reduce of ``[loss sum, count]`` (two numbers). Backward recomputes each block,
  tile by tile: ``dZ_j = softmax - onehot``; ``dX += dZ_j E_j`` locally, ``dE_j += dZ_jᵀ X_i`` travelling with
  ``E_j``. The tiles change no exchange: they loop inside one ring step.

Forward: ``p-1`` exchanges of the weight block. Backward: ``p-1`` of the block and ``p`` of its gradient
(embedding: ``p-1`` of the gradient only). Every function takes ``options`` (:class:`~lightning_tp2d.metp.RingOptions`;
``double_buffer`` matters here, and ``tile_tokens`` to the cross-entropy). Vocab hits are masks, never ``nonzero()``: no host sync, no data-dependent
shape, so the functions also run on the ``meta`` device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from lightning_tp2d import float8 as f8
from lightning_tp2d.comm import FLOAT8_DTYPES, all_reduce_along, axis_rank, summed_later
from lightning_tp2d.metp import (RingOptions, acc_dtype, mm_into, ring_backward, ring_forward, ring_options,
                                tile_rows)
from lightning_tp2d.nn.cross_entropy import IGNORE_INDEX
from lightning_tp2d.ops import registered


@dataclass(frozen=True)
class ColumnBlocks:
    """Block ``j`` of an ``[N, n*w]`` matrix is its columns ``[j*w, (j+1)*w)`` (read as a view). A value (frozen
    dataclass), so a compiled graph specialises on it rather than on an object's identity."""

    rows: int
    n: int
    width: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.n * self.width

    def read(self, t: torch.Tensor, j: int) -> torch.Tensor:
        return t[:, j * self.width:(j + 1) * self.width]

    def write(self, t: torch.Tensor, j: int, block: torch.Tensor) -> None:
        self.read(t, j).copy_(block)

    def bias_rows(self, bias: torch.Tensor) -> torch.Tensor:
        """``[n, width]``: row ``j`` is block ``j``'s bias (a view)."""
        return bias.view(self.n, self.width)

    def bias_grad(self, dt: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return dt.sum(0, dtype=dtype)


@dataclass(frozen=True)
class HeadBlocks:
    """A ``[g, B, H, S, d]`` tensor (``g = 3`` for q|k|v, ``1`` for an attention output) whose block ``j`` is
    columns ``[j*w, (j+1)*w)``, ``w = H*d/n``, of each group's ``[B*S, H*d]`` matrix (torch's ``Linear`` order;
    ``c_attn`` rows regrouped as ``[q_j | k_j | v_j]``), read as the ``[B*S, g*w]`` matrix. When ``n`` divides the
    heads a block is whole heads; otherwise blocks cut through heads (any head count fits a ring that divides the
    width), and ``read`` / ``write`` go head by head over the few heads a block touches. A value, like
    :class:`ColumnBlocks`."""

    groups: int
    batch: int
    seq: int
    heads: int
    head_size: int
    n: int

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return self.groups, self.batch, self.heads, self.seq, self.head_size

    @property
    def width(self) -> int:
        return self.heads * self.head_size // self.n

    def _touched(self, j: int):
        """``(head, first column in it, last + 1, column of the block)`` for each head block ``j`` touches."""
        d = self.shape[4]
        start, stop = j * self.width, (j + 1) * self.width
        for head in range(start // d, -(-stop // d)):
            lo, hi = max(start, head * d), min(stop, (head + 1) * d)
            yield head, lo - head * d, hi - head * d, lo - start

    def read(self, t: torch.Tensor, j: int) -> torch.Tensor:
        g, B, _, S, d = self.shape
        if self.width % d == 0:  # whole heads: one strided read
            per = self.width // d
            block = t[:, :, j * per:(j + 1) * per]  # (g, B, H/n, S, d)
            return block.permute(1, 3, 0, 2, 4).reshape(B * S, g * self.width)
        parts = [t[:, :, head, :, lo:hi] for head, lo, hi, _ in self._touched(j)]  # each (g, B, S, cols)
        if t.dtype in FLOAT8_DTYPES:  # float8 blocks: cat their bytes (autocast's cat rule has no float8 type)
            parts = [part.view(torch.uint8) for part in parts]
            return torch.cat(parts, dim=-1).view(t.dtype).permute(1, 2, 0, 3).reshape(B * S, g * self.width)
        return torch.cat(parts, dim=-1).permute(1, 2, 0, 3).reshape(B * S, g * self.width)

    def write(self, t: torch.Tensor, j: int, block: torch.Tensor) -> None:
        g, B, _, S, d = self.shape
        if self.width % d == 0:
            per = self.width // d
            t[:, :, j * per:(j + 1) * per].copy_(block.view(B, S, g, per, d).permute(2, 0, 3, 1, 4))
            return
        cols = block.view(B, S, g, self.width)
        for head, lo, hi, at in self._touched(j):
            t[:, :, head, :, lo:hi].copy_(cols[..., at:at + hi - lo].permute(2, 0, 1, 3))

    def bias_rows(self, bias: torch.Tensor) -> torch.Tensor:
        """``[n, g*w]``: row ``j`` is block ``j``'s bias, ``[q_j | k_j | v_j]`` (one small copy per call)."""
        g = self.shape[0]
        return bias.view(g, self.n, -1).transpose(0, 1).reshape(self.n, -1)

    def bias_grad(self, dt: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return dt.sum((1, 3), dtype=dtype).reshape(-1)  # (g, H, d) in torch's order


def _stream_casts(ctx, x, w, float8, axis, mesh):
    """``(x, w, gemm, scales)``: a linear's operands and its forward GEMMs, in high precision or by the ``float8``
    recipe (:func:`lightning_tp2d.float8.forward_products`; tensorwise: ``x`` and ``w`` cast with their amaxes over
    the ring, and ``w``'s blocks travel as float8). Keeps on ``ctx`` what the backward needs to know of them."""
    ctx.float8, ctx.dtype, ctx.w_dtype = float8, x.dtype, w.dtype
    if float8 is None:
        return x, w, f8.HIGH, ()
    return f8.forward_products(float8, x, w, mesh, (axis,), ctx.dtype)


def _stream_grad_casts(ctx, dy, scales):
    """``(dy, dX gemm, dW gemm)`` of a linear's backward: high precision, or by the recipe
    (:func:`lightning_tp2d.float8.backward_products`); the weight gradient's GEMM writes the ring's float32
    accumulation dtype."""
    if ctx.float8 is None:
        return dy, f8.HIGH, f8.HIGH
    dy, (gemm_x, gemm_w) = f8.backward_products(ctx.float8, dy, scales, ctx.mesh, (ctx.axis,), ctx.dtype,
                                                acc_dtype(ctx.dtype))
    return dy, gemm_x, gemm_w


def _stream_forward(ctx, x, w, bias, mesh, axis, layout, options, step, scales=()) -> None:
    """The forward pass shared by both linears: stream ``w`` round the ring calling ``step``; keep ``x`` and ``w``
    (float8 under a tensorwise recipe, with their ``scales``)."""
    ring_forward((w,), mesh, axis, step, double_buffer=options.double_buffer)
    ctx.save_for_backward(x, w, *scales)
    ctx.mesh, ctx.axis, ctx.layout, ctx.has_bias, ctx.options = mesh, axis, layout, bias is not None, options
    ctx.bias_dtype = None if bias is None else bias.dtype


def summed_bias_grad(ctx, grad: Callable[[torch.dtype], torch.Tensor]) -> Callable[[], torch.Tensor | None]:
    """A replicated bias' gradient (``grad(dtype)``: this rank's tokens' sum, in the bias' dtype), summed over the
    ring while the kernel's ring passes run (:func:`~lightning_tp2d.comm.summed_later`): ``finish`` returns it;
    ``None`` without a bias."""
    if not ctx.has_bias:
        return lambda: None
    return summed_later(grad(ctx.bias_dtype), ctx.mesh, ctx.axis)


def _stream_backward(ctx, w, step) -> torch.Tensor:
    """The backward pass shared by both linears: ``dW`` summed round the ring from ``step``'s contributions (in the
    weight's own dtype's wire and result dtypes, also when its blocks travel as float8)."""
    (dw,) = ring_backward((w,), ctx.mesh, ctx.axis, step, double_buffer=ctx.options.double_buffer,
                          wire_dtype=ctx.options.wire_dtype(ctx.w_dtype))
    return dw.to(ctx.w_dtype)


@registered("ring_linear_out")
class _RingLinearOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, mesh, axis, layout, options, float8):
        # x (N, in) local rows; w (out/p, in) this rank's output rows; bias (out,) replicated or None
        y = x.new_empty(layout.shape)
        # each block's bias as a row, in the product's dtype (as autocast gives a plain linear its bias), once per call
        bias_rows = None if bias is None else layout.bias_rows(bias.to(x.dtype))
        x, w, gemm, scales = _stream_casts(ctx, x, w, float8, axis, mesh)

        def step(j, blocks):
            (w_j,) = blocks
            y_j = gemm.first(x, w_j.t(), None if bias_rows is None else bias_rows[j])  # one op, not mm + add_
            layout.write(y, j, y_j)

        _stream_forward(ctx, x, w, bias, mesh, axis, layout, options, step, scales)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, *scales = ctx.saved_tensors
        acc = acc_dtype(ctx.dtype)
        dx = x.new_empty(x.shape, dtype=ctx.dtype)  # written by the first step's GEMM (j == i)
        i = axis_rank(ctx.mesh, ctx.axis)
        db = summed_bias_grad(ctx, lambda dtype: ctx.layout.bias_grad(dy, dtype))
        dy, gemm_x, gemm_w = _stream_grad_casts(ctx, dy, scales)

        def step(j, blocks):
            (w_j,) = blocks
            g = ctx.layout.read(dy, j)  # (N, out/p)
            mm_into(dx, g, w_j, first=j == i, gemm=gemm_x)  # dX += dY_j W_j
            return (gemm_w.mm(g.t(), x).to(acc),)  # dW_j += dY_jᵀ X

        dw = _stream_backward(ctx, w, step)
        return dx, dw, db(), None, None, None, None, None


@registered("ring_linear_in")
class _RingLinearIn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, mesh, axis, layout, options, float8):
        # x: input whose block j (layout) is the in-columns of ring rank j; w (out, in/p) this rank's columns
        out = None  # written by the first step's GEMM (j == i), with the bias
        bias_x, i = None if bias is None else bias.to(x.dtype), axis_rank(mesh, axis)
        x, w, gemm, scales = _stream_casts(ctx, x, w, float8, axis, mesh)

        def step(j, blocks):
            nonlocal out
            (w_j,) = blocks
            x_j = layout.read(x, j)
            if out is None:
                out = x_j.new_empty((x_j.shape[0], w_j.shape[0]), dtype=ctx.dtype)
            mm_into(out, x_j, w_j.t(), first=j == i, bias=bias_x, gemm=gemm)

        _stream_forward(ctx, x, w, bias, mesh, axis, layout, options, step, scales)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, w, *scales = ctx.saved_tensors
        acc = acc_dtype(ctx.dtype)
        dout = dout.contiguous()
        dx = x.new_empty(ctx.layout.shape, dtype=ctx.dtype)
        db = summed_bias_grad(ctx, lambda dtype: dout.sum(0, dtype=dtype))
        dout, gemm_x, gemm_w = _stream_grad_casts(ctx, dout, scales)

        def step(j, blocks):
            (w_j,) = blocks
            ctx.layout.write(dx, j, gemm_x.mm(dout, w_j))  # dX_j = dY W_j
            return (gemm_w.mm(dout.t(), ctx.layout.read(x, j)).to(acc),)  # dW_j += dYᵀ X_j

        dw = _stream_backward(ctx, w, step)
        return dx, dw, db(), None, None, None, None, None


def ring_linear_out(x, w, bias, mesh: DeviceMesh, axis: str, layout, *,
                    options: RingOptions | None = None, float8: str | None = None) -> torch.Tensor:
    """``Y = X Wᵀ + b`` with ``W [out, in]`` split by output rows over the ring (``w [out/p, in]``, block ``i``):
    the blocks stream past the resident ``X [N, in]`` and block ``j`` of ``Y`` is written where ``layout``
    puts it (:class:`ColumnBlocks` or :class:`HeadBlocks`). Forward ``p-1`` exchanges of ``w``; backward
    ``dX = Σ_j dY_j W_j`` locally and ``dW_j = Σ_i dY_ijᵀ X_i`` travelling: ``p-1`` + ``p`` exchanges. ``float8``:
    every GEMM by that torchao recipe (:mod:`lightning_tp2d.float8`; tensorwise: the weight blocks travel as float8,
    the gradient sums in high precision)."""
    return _RingLinearOut.apply(x, w, bias, mesh, axis, layout, ring_options(options), f8.check_recipe(float8))


def ring_linear_in(x, w, bias, mesh: DeviceMesh, axis: str, layout, *,
                   options: RingOptions | None = None, float8: str | None = None) -> torch.Tensor:
    """``Y = Σ_j X_j W_jᵀ + b`` with ``W [out, in]`` split by input columns over the ring (``w [out, in/p]``) and
    ``X``'s column block ``j`` read through ``layout``; ``Y [N, out]``. Forward ``p-1`` exchanges of ``w``;
    backward ``dX_j = dY W_j`` written back through ``layout``, ``dW_j = Σ_i dYᵢᵀ X_ij`` travelling. ``float8``: as
    :func:`ring_linear_out`."""
    return _RingLinearIn.apply(x, w, bias, mesh, axis, layout, ring_options(options), f8.check_recipe(float8))


# ---- vocabulary: embedding and LM-head cross-entropy -----------------------------------------------


def _vocab_split(ids: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block, offset)`` of each id for vocab blocks of ``rows`` ids: which block holds it and its row there, in
    ``[0, rows)`` for any id (an ignored ``-100`` is in a negative block, which no rank holds). Two elementwise ops
    once per call, so a ring step's hits are one comparison (``block == j``) and its gather indices need no
    arithmetic; no host sync, the same shapes whatever the ids."""
    block = torch.div(ids, rows, rounding_mode="floor")
    return block, torch.remainder(ids, rows)


@registered("ring_embedding")
class _RingEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, ids, mesh, axis, options):
        # weight (Vb, h) vocab block i, zero-padded; ids (B, S) global token ids of this rank's chunks
        out = weight.new_zeros((*ids.shape, weight.shape[1]))
        block, local = _vocab_split(ids, weight.shape[0])
        block = block.unsqueeze(-1)

        def step(j, blocks):
            torch.where(block == j, blocks[0][local], out, out=out)  # (B, S, h): each token hits once

        ring_forward((weight,), mesh, axis, step, double_buffer=options.double_buffer)
        ctx.save_for_backward(ids)
        ctx.mesh, ctx.axis, ctx.shape, ctx.dtype, ctx.options = mesh, axis, weight.shape, weight.dtype, options
        return out

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        grad = grad.to(acc_dtype(ctx.dtype)).reshape(-1, ctx.shape[1])  # (B*S, h)
        block, local = _vocab_split(ids.reshape(-1), ctx.shape[0])
        block = block.unsqueeze(-1)

        def step(j, _):
            mine = torch.where(block == j, grad, 0.0)  # misses add an exact zero to their row
            return (grad.new_zeros(ctx.shape).index_add_(0, local, mine),)

        (dweight,) = ring_backward((), ctx.mesh, ctx.axis, step, double_buffer=ctx.options.double_buffer)
        return dweight.to(ctx.dtype), None, None, None, None


def _vocab_block(block: torch.Tensor, valid: int, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rows of a streamed vocab block the loss multiplies, and the mask of its padding columns: the ``valid``
    ids alone for a block of ``rows`` ids (no mask), or the whole GPU-shaped block (more rows than ids: its
    product keeps its padded width, and the columns past ``valid`` are masked)."""
    if block.shape[0] == rows:
        return tile_rows(block, slice(0, valid)), None
    return block, torch.arange(block.shape[0], device=block.device) >= valid


def _block_targets(block: torch.Tensor, offset: torch.Tensor, j: int, valid: int,
                   rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index, hit)`` of the targets in vocab block ``j`` of ``valid`` loss columns: the offsets (safe to gather with
    from ``valid`` columns everywhere, meaningful where ``hit``) and the mask. A target always lies in its block's
    valid columns; only a short last block (``valid < rows``) clamps the other targets' offsets, one op."""
    return (offset if valid == rows else offset.clamp(max=valid - 1)), block == j


@registered("ring_cross_entropy")
class _RingCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, mesh, axis, vocab_size, options, block_vocab=None):
        # x (N, h); weight (Vb, h) vocab block i: its ids [i, i + 1) * block_vocab (None: Vb) in the first rows, zero
        # rows after (the last block's past V; a GPU-shaped block's tail); targets (N,) global ids or -100
        acc = acc_dtype(x.dtype)
        rows = weight.shape[0] if block_vocab is None else block_vocab
        lse = torch.full((x.shape[0],), float("-inf"), dtype=acc, device=x.device)
        target_logit = torch.zeros_like(lse)
        keep = targets != IGNORE_INDEX
        block, offset = _vocab_split(targets, rows)
        tiles = options.row_tiles(x.shape[0])

        def step(j, blocks):
            valid = max(0, min(rows, vocab_size - j * rows))  # columns past V are padding
            if valid == 0:
                return
            w_j, pad = _vocab_block(blocks[0], valid, rows)
            local, hit = _block_targets(block, offset, j, valid, rows)
            for r in tiles:  # [tile, valid] logits at a time (options.tile_tokens)
                lse_r, target_r = tile_rows(lse, r), tile_rows(target_logit, r)
                z = (tile_rows(x, r) @ w_j.t()).to(acc)  # (tile, valid), or the GPU-shaped block, padding masked
                if pad is not None:
                    z.masked_fill_(pad, float("-inf"))
                torch.logaddexp(lse_r, torch.logsumexp(z, -1), out=lse_r)
                torch.where(tile_rows(hit, r), z.gather(1, tile_rows(local, r).unsqueeze(1)).squeeze(1), target_r,
                            out=target_r)

        ring_forward((weight,), mesh, axis, step, double_buffer=options.double_buffer)
        per_token = torch.where(keep, lse - target_logit, lse.new_zeros(()))
        totals = torch.stack([per_token.sum(), keep.sum().to(acc)])
        all_reduce_along(totals, mesh, axis)
        ctx.save_for_backward(x, weight, targets, lse)
        ctx.mesh, ctx.axis, ctx.vocab_size, ctx.count, ctx.options = mesh, axis, vocab_size, totals[1], options
        ctx.rows = rows
        return totals[0] / totals[1]  # float32 under bf16 autocast, like F.cross_entropy

    @staticmethod
    def backward(ctx, grad):
        x, weight, targets, lse = ctx.saved_tensors
        rows, acc = ctx.rows, lse.dtype
        scale = ((targets != IGNORE_INDEX).to(acc) * (grad.to(acc) / ctx.count)).unsqueeze(-1)  # (N, 1)
        dx = torch.zeros_like(x)
        block, offset = _vocab_split(targets, rows)
        tiles = ctx.options.row_tiles(x.shape[0])

        def step(j, blocks):
            valid = max(0, min(rows, ctx.vocab_size - j * rows))
            if valid == 0:
                return (torch.zeros(weight.shape, dtype=acc, device=x.device),)
            w_j, pad = _vocab_block(blocks[0], valid, rows)
            local, hit = _block_targets(block, offset, j, valid, rows)
            miss = hit.to(acc).neg_().unsqueeze(1)  # - onehot where hit; misses add -0
            # float32 sum of the tiles' products; one tile of the whole block: exactly its product
            whole = len(tiles) == 1 and w_j.shape[0] == weight.shape[0]
            dweight = None if whole else torch.zeros(weight.shape, dtype=acc, device=x.device)
            for r in tiles:  # [tile, valid] at a time (options.tile_tokens)
                x_r = tile_rows(x, r)
                dz = (x_r @ w_j.t()).to(acc)
                if pad is not None:
                    dz.masked_fill_(pad, float("-inf"))  # padding: softmax 0
                dz = dz.sub_(tile_rows(lse, r).unsqueeze(-1)).exp_()  # softmax block (tile, valid)
                dz.scatter_add_(1, tile_rows(local, r).unsqueeze(1), tile_rows(miss, r))
                dz = dz.mul_(tile_rows(scale, r)).to(x.dtype)
                tile_rows(dx, r).addmm_(dz, w_j)
                if whole:
                    dweight = (dz.t() @ x_r).to(acc)
                else:
                    tile_rows(dweight, slice(0, w_j.shape[0])).add_(dz.t() @ x_r)
            return (dweight,)

        (dweight,) = ring_backward((weight,), ctx.mesh, ctx.axis, step, double_buffer=ctx.options.double_buffer,
                                   wire_dtype=ctx.options.wire_dtype(weight.dtype))
        return dx, dweight.to(weight.dtype), None, None, None, None, None, None


def ring_embedding(weight: torch.Tensor, ids: torch.Tensor, mesh: DeviceMesh, axis: str, *,
                   options: RingOptions | None = None) -> torch.Tensor:
    """``E[ids]`` for ids ``[B, S]`` with ``E``'s vocab rows split over the ring (``weight [Vb, h]``, zero-padded):
    ``[B, S, h]``."""
    return _RingEmbedding.apply(weight, ids, mesh, axis, ring_options(options))


def ring_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, mesh: DeviceMesh, axis: str,
                       vocab_size: int, *, options: RingOptions | None = None,
                       block_vocab: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of the logits ``X Eᵀ`` (targets ``-100`` ignored) with ``E``'s vocab rows split over the
    ring (``weight [Vb, h]``, zero-padded; columns ``>= vocab_size`` are masked); the same scalar on every rank.
    ``block_vocab``: the ids a block holds (``None``: ``Vb``); a block of more rows is GPU-shaped, its product runs
    over all of them and the rest are masked."""
    return _RingCrossEntropy.apply(x, weight, targets, mesh, axis, vocab_size, ring_options(options), block_vocab)
