"""The traced step (:class:`~lightning_tp2d.planning.steps.TracedStep`) as arithmetic on the config: the same events,
FLOPs, GEMM count and saved bytes the tracer (:mod:`lightning_tp2d.planning.trace`) reads from the layers, in
milliseconds instead of minutes.

How: each layer's schedule, as its code runs it, is written here as a stream of operations on one rank -- post a call,
wait for it, compute ``F`` matmul or attention FLOPs -- and the stream is priced by the tracer's rule: every FLOP
computed while calls are in flight is shared among them in proportion to their bytes; a blocking call overlaps
nothing. Per-block streams repeat, so a model of ``L`` blocks is the root's stream plus ``L`` times one block's.

Modelled: the ring layout (:class:`~lightning_tp2d.layouts.Ring`, ``"metp"``, ``p >= 2``) with its default
:class:`~lightning_tp2d.metp.RingOptions`, GPT-2 (biases on or off) and Llama (GQA, tied or untied head) whose sizes
the ring splits, ``checkpointing`` ``"none"`` / ``"selective"`` / ``"full"``, ``elem`` 2 (bf16 autocast) and 4, one
replica. Everything else on the ring (``dp > 1``, other ring options, float64) is refused with a ``ValueError`` naming
the numbers, and callers trace instead; the grids are :mod:`lightning_tp2d.planning.closed_grid`'s (:func:`lightning_tp2d.planning.trace.closed_forms`).

The ring schedule (:mod:`lightning_tp2d.metp`): rank ``i`` at step ``t`` computes with the block of rank
``j = (i - t) mod p``. Forward (:func:`~lightning_tp2d.metp.ring_forward`): the exchange of the block it holds is
posted before step ``t``'s compute and waited after it, ``t < p - 1``. Backward
(:func:`~lightning_tp2d.metp.ring_backward`): the operand exchange as in the forward; the gradient sum is sent after
step ``t``'s compute and waited after step ``t + 1``'s (the last one after nothing); without operands (the embedding)
the sums start one rank early, ``p - 1`` of them. Operands travel in the compute dtype; gradient sums in it too
(``elem`` 2: bf16, ``ring_grad_dtype="activation"``), the embedding's in float32.

Saved bytes (``N = B T / p`` local tokens): see :func:`_block_activation_bytes` and :func:`_root_activation_bytes`;
they equal the tracer's count exactly, float32 and bf16, GPT-2 and Llama, every checkpointing mode.
"""

from __future__ import annotations

import dataclasses

from lightning_tp2d.families import anatomy, family_of_config
from lightning_tp2d.layouts import Layout, get_layout
from lightning_tp2d.metp import RingOptions
from lightning_tp2d.planning import closed_grid
from lightning_tp2d.planning.events import float32_bytes
from lightning_tp2d.planning.steps import (Stream, TracedStep, checked_entry, one_replica_problem, root_and_blocks,
                                          run_passes, split_problem)

__all__ = ["closed_step", "models"]


class _Stream(Stream):
    """The ring's :class:`~lightning_tp2d.planning.steps.Stream`: every call on the one axis and group it is made
    with."""

    def __init__(self, axis: str, ranks: tuple[int, ...]) -> None:
        super().__init__()
        self.axis, self.ranks = axis, ranks

    def post(self, kind: str, nbytes: int) -> list:  # type: ignore[override]
        return super().post(kind, self.axis, self.ranks, nbytes)

    def blocking(self, kind: str, nbytes: int) -> None:  # type: ignore[override]
        self.wait(self.post(kind, nbytes))


# ---- the ring drivers (lightning_tp2d.metp) ----------------------------------------------------------------------


def _ring_forward(s: _Stream, p: int, i: int, own_bytes: int, step) -> None:
    """:func:`~lightning_tp2d.metp.ring_forward`: ``step(j)`` runs its compute on ``s``."""
    for t in range(p):
        pending = s.post("ring_exchange", own_bytes) if own_bytes and t < p - 1 else None
        step((i - t) % p)
        if pending is not None:
            s.wait(pending)


def _ring_backward(s: _Stream, p: int, i: int, own_bytes: int, grad_bytes: int, step) -> None:
    """:func:`~lightning_tp2d.metp.ring_backward` (``own_bytes`` 0: no operands, the sums start one rank early)."""
    shift = 0 if own_bytes else 1
    acc = None
    for t in range(p):
        pending = s.post("ring_exchange", own_bytes) if own_bytes and t < p - 1 else None
        step((i - t - shift) % p)
        if acc is not None:
            s.wait(acc)
        acc = None if (shift and t == p - 1) else s.post("ring_exchange", grad_bytes)
        if pending is not None:
            s.wait(pending)
    if acc is not None:
        s.wait(acc)


# ---- the model ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Shapes:
    """The numbers the ring layers' shapes are made of, for one rank."""

    p: int
    rank: int
    B: int  # sequences
    S: int  # local rows per sequence: 2 chunks of c
    h: int
    heads: int
    kv_heads: int
    d: int  # head size
    hidden: int  # MLP width F (GPT-2 4h, Llama I)
    gates: int  # MLP input blocks: 1 (GELU), 2 (SwiGLU)
    vocab: int
    e: int  # compute element bytes
    bias: bool  # GPT-2's biases
    llama: bool
    tile: int  # rows per tile of the cross-entropy and the wide MLP (RingOptions.tile_tokens)

    @property
    def N(self) -> int:
        return self.B * self.S

    @property
    def vb(self) -> int:
        return -(-self.vocab // self.p)  # vocab rows per block, zero-padded

    def tiles(self, rows: int) -> list[int]:
        tile = self.tile or rows
        return [min(tile, rows - r) for r in range(0, rows, max(tile, 1))] or [rows]


def _bias_sum(s: _Stream, m: _Shapes, n: int, backward: bool) -> list | None:
    """A GPT-2 bias' gradient (``n`` elements, the parameter's float32) all-reduced over the ring, posted when its
    kernel's backward starts (:func:`~lightning_tp2d.nn.ring_stream.summed_bias_grad`); ``None`` without one."""
    return s.post("all_reduce", n * float32_bytes(m.e)) if backward and m.bias else None


def _linear_out(s: _Stream, m: _Shapes, d_in: int, rows: int, backward: bool, bias: int = 0) -> None:
    """Out-split streaming linear (:func:`~lightning_tp2d.nn.ring_stream.ring_linear_out`): ``rows`` output rows per
    block travel; forward ``X W_jᵀ`` per step, backward ``dX += dY_j W_j`` and ``dY_jᵀ X``; a ``bias``-wide bias'
    gradient summed over the ring while the backward's ring runs."""
    nbytes, flops = rows * d_in * m.e, 2.0 * m.N * d_in * rows
    if not backward:
        _ring_forward(s, m.p, m.rank, nbytes, lambda j: s.mm(flops))
        return
    summed = _bias_sum(s, m, bias, bool(bias))
    _ring_backward(s, m.p, m.rank, nbytes, nbytes, lambda j: (s.mm(flops), s.mm(flops)))
    if summed is not None:
        s.wait(summed)


def _linear_in(s: _Stream, m: _Shapes, cols: int, d_out: int, backward: bool, bias: int = 0) -> None:
    """In-split streaming linear (:func:`~lightning_tp2d.nn.ring_stream.ring_linear_in`): ``cols`` input columns
    per block travel."""
    _linear_out(s, m, cols, d_out, backward, bias)  # the same block size, per-step products and bias sum


def _attention(s: _Stream, m: _Shapes, backward: bool) -> None:
    """:func:`~lightning_tp2d.metp.ring_attention`: K|V of the ``kv_heads`` travel; step ``j == i`` is the causal
    diagonal block (``S(S+1)/2`` visible scores), every other step ``S²/2`` scores, per query head."""
    per_score = (10.0 if backward else 4.0) * m.d * m.B
    groups = m.heads // m.kv_heads
    S, c = m.S, m.S // 2

    def step(j: int) -> None:
        scores = S * (S + 1) / 2 if j == m.rank else 2.0 * c * c
        for _ in range(groups):
            s.attention(per_score * m.kv_heads * scores)

    nbytes = 2 * m.B * m.kv_heads * S * m.d * m.e
    if backward:
        _ring_backward(s, m.p, m.rank, nbytes, nbytes, step)
    else:
        _ring_forward(s, m.p, m.rank, nbytes, step)


def _mlp(s: _Stream, m: _Shapes, backward: bool) -> None:
    """:func:`~lightning_tp2d.metp.ring_mlp`: ``gates`` input blocks ``[f, h]`` and the output block ``[h, f]``
    travel (``f = F/p``); row tiles when ``f > h``; the backward recomputes the pre-activations."""
    f, h = m.hidden // m.p, m.h
    tiles = m.tiles(m.N) if f > h else [m.N]
    nbytes = (m.gates + 1) * f * h * m.e
    per_tile = (3 * m.gates + 2) if backward else (m.gates + 1)

    def step(j: int) -> None:
        for rows in tiles:
            for _ in range(per_tile):
                s.mm(2.0 * rows * h * f)

    if not backward:
        _ring_forward(s, m.p, m.rank, nbytes, step)
        return
    summed = _bias_sum(s, m, h, True)  # b2's, while the ring runs; b1's after it, blocking
    _ring_backward(s, m.p, m.rank, nbytes, nbytes, step)
    if m.bias:
        s.wait(_bias_sum(s, m, m.hidden, True))
        s.wait(summed)


def _block(s: _Stream, m: _Shapes, backward: bool) -> None:
    """One transformer block's ring passes (the norms compute no counted FLOPs); the backward in reverse order,
    each replicated vector's gradient all-reduced (blocking) when its layer's backward reaches it."""
    h, hd, kvd = m.h, m.heads * m.d, m.kv_heads * m.d
    e32 = float32_bytes(m.e)
    vectors = _block_vectors(m)
    passes = ([lambda b: _linear_out(s, m, h, hd // m.p, b), lambda b: _linear_out(s, m, h, 2 * kvd // m.p, b)]
              if m.llama else [lambda b: _linear_out(s, m, h, 3 * hd // m.p, b, bias=3 * hd)])
    passes += [lambda b: _attention(s, m, b), lambda b: _linear_in(s, m, hd // m.p, h, b, bias=h),
               lambda b: _mlp(s, m, b)]
    if not backward:
        for run in passes:
            run(False)
        return
    for run in reversed(passes):
        run(True)
    for n in vectors:
        s.blocking("all_reduce", n * e32)


def _block_vectors(m: _Shapes) -> list[int]:
    """Elements of each call that sums a block's norms' gradients over the ring, blocking (a LayerNorm's weight and
    bias in one). The linears' biases are summed inside their kernels' backward (:func:`_bias_sum`)."""
    if m.llama or not m.bias:
        return [m.h, m.h]  # the two RMSNorm or LayerNorm weights
    return [2 * m.h] * 2  # the LayerNorms' weights and biases


def _head(s: _Stream, m: _Shapes, backward: bool) -> None:
    """The LM head + cross-entropy (:func:`~lightning_tp2d.nn.ring_stream.ring_cross_entropy`): vocab blocks of
    ``vb`` rows travel; block ``j`` has ``min(vb, V - j vb)`` real rows (none: no compute); one all-reduce of
    ``[loss sum, count]`` after the forward."""
    nbytes = m.vb * m.h * m.e
    tiles = m.tiles(m.N)

    def step(j: int) -> None:
        valid = max(0, min(m.vb, m.vocab - j * m.vb))
        if valid:
            for rows in tiles:
                for _ in range(3 if backward else 1):
                    s.mm(2.0 * rows * m.h * valid)

    if backward:
        _ring_backward(s, m.p, m.rank, nbytes, nbytes, step)
    else:
        _ring_forward(s, m.p, m.rank, nbytes, step)
        s.blocking("all_reduce", 2 * float32_bytes(m.e))


def _embedding(s: _Stream, m: _Shapes, backward: bool) -> None:
    """The token embedding (:func:`~lightning_tp2d.nn.ring_stream.ring_embedding`): float32 vocab blocks travel
    forward; the backward's float32 gradient sums travel alone (``p - 1`` exchanges); no counted FLOPs."""
    nbytes = m.vb * m.h * 4
    if backward:
        _ring_backward(s, m.p, m.rank, 0, nbytes, lambda j: None)
    else:
        _ring_forward(s, m.p, m.rank, nbytes, lambda j: None)


def _root(s: _Stream, m: _Shapes, cfg, backward: bool) -> None:
    """What is not a block: embeddings, final norm, head. The forward's order: embedding, (blocks), head; the
    backward's: head, the final norm's and the position table's gradient sums, (blocks), embedding -- the
    backward's blocking calls overlap nothing, so their order changes no number."""
    e32 = float32_bytes(m.e)
    if not backward:
        _embedding(s, m, False)
        _head(s, m, False)
        return
    _head(s, m, True)
    s.blocking("all_reduce", (2 if m.bias and not m.llama else 1) * m.h * e32)  # final norm weight (and bias)
    if not m.llama:
        s.blocking("all_reduce", cfg.block_size * m.h * e32)  # the position table
    _embedding(s, m, True)  # tied or untied: the same passes (the head streams its vocab block either way)


def models(layout: str | Layout, cfg, p: int, elem: int, *, dp: int = 1, zero_stage: int = 0,
           clip: bool = False) -> str | None:
    """Why :func:`closed_step` does not model this case (a sentence naming the numbers), or ``None`` when it
    does."""
    spec = get_layout(layout)
    if spec.square and spec.arrangement == "grid":  # the grids: lightning_tp2d.planning.closed_grid
        return closed_grid.models(spec, cfg, p, elem, dp=dp, zero_stage=zero_stage, clip=clip)
    if spec.square or spec.arrangement != "ring":
        return f"layout {spec.name!r} ({spec.arrangement}) is traced, not modelled: closed forms cover the ring"
    if spec.options not in (None, RingOptions()):
        return f"ring options {spec.options!r} are traced; closed forms cover the defaults"
    problem = one_replica_problem(cfg, elem, dp, zero_stage, clip)
    if problem:
        return problem
    if p < 2:
        return f"p={p}: the ring needs p >= 2"
    return split_problem(spec, cfg, p)


def closed_step(layout: str | Layout, cfg, batch: int, seq: int, p: int, elem: int, rank: int = 0, *,
                checkpointing: str = "none") -> TracedStep:
    """The :class:`~lightning_tp2d.planning.steps.TracedStep` of ring rank ``rank`` (module docstring), equal to
    :func:`lightning_tp2d.planning.trace.trace_step`'s for one replica. ``ValueError`` naming the numbers for
    anything it does not model (:func:`models`) or an input the layout refuses."""
    spec = get_layout(layout)
    if spec.square and spec.arrangement == "grid":
        return closed_grid.closed_grid_step(layout, cfg, batch, seq, p, elem, rank, checkpointing=checkpointing)
    checked_entry("closed_step", models(spec, cfg, p, elem), spec, p, batch, seq, rank, checkpointing)
    llama, a = family_of_config(cfg).name == "llama", anatomy(cfg)
    m = _Shapes(p=p, rank=rank, B=batch, S=seq // p, h=cfg.n_embd, heads=cfg.n_head, kv_heads=a.kv_heads,
                d=cfg.n_embd // cfg.n_head, hidden=a.mlp_width, gates=2 if a.gated_mlp else 1, vocab=cfg.vocab_size,
                e=elem, bias=bool(getattr(cfg, "bias", False)), llama=llama, tile=RingOptions().tile_tokens or 0)
    ranks = tuple(range(p))
    root, block = _Stream("ring", ranks), _Stream("ring", ranks)
    run_passes(root, block, lambda s, backward: _root(s, m, cfg, backward), lambda s, backward: _block(s, m, backward),
               checkpointing)
    L = cfg.n_layer
    activation = _root_activation_bytes(m, checkpointing) + L * _block_activation_bytes(m, checkpointing)
    return root_and_blocks(root, block, L, activation)



def _block_activation_bytes(m: _Shapes, checkpointing: str) -> int:
    """Bytes of the storages one block's forward creates and autograd keeps (the tracer's count: a storage the
    forward creates -- a parameter is not one -- that a saved-tensor hook sees). Per local token, ``e = elem``: the
    block's input and the residual after attention (``2h``, read again by the norms; the block's own input is the
    previous block's output, so one block counts its two residual sums), q|k|v as the ring attention holds them
    (GPT-2 ``3h``, Llama ``(n_head + 2 n_kv_head) d``), the attention output (``h``), and its float32 log-sum-exp per
    query head (``4 n_head``). Then the norms:

    * GPT-2, each of 2 LayerNorms: its output (``h``, recomputed under ``"selective"``) and mean and reciprocal
      deviation (2 elements of the compute dtype);
    * Llama, each of 2 RMSNorms: its float32 reciprocal root mean square (4 bytes) and, under float32, ``x r`` and
      the output (``2h``; the output recomputed under ``"selective"``), under bf16 the bf16 output only (``h``, also
      recomputed; :class:`~lightning_tp2d.models.llama._HalfRMSNorm` keeps the bf16 input it was given).

    Not per token: Llama's RoPE tables, per local position ``S d`` -- float32 cos and sin once under float32, their
    bf16 copies for q and for k (4 of them) under bf16; Llama's k|v weight block ``torch.cat([w_k, w_v])``
    (``2 n_kv_head d h / p``, a new storage in the compute dtype). Under bf16 every local weight matrix's bf16 copy
    is saved (``autocast_operands``: GPT-2 ``12 h^2 / p``, Llama ``(2 n_head d + 2 n_kv_head d + 3 I) h / p`` in place
    of the k|v block), and GPT-2's LayerNorm weights (and biases) as bf16 copies. ``"full"`` keeps the block's input
    only (held by the checkpoint)."""
    N, S, h, e, d = m.N, m.S, m.h, m.e, m.d
    if checkpointing == "full":
        return N * h * e
    selective = checkpointing == "selective"
    half = e < 4
    tokens = N * e * (2 * h + (m.heads + 2 * m.kv_heads) * d + h) + N * m.heads * 4  # residuals, attention
    if m.llama:
        per_norm = N * 4 + (0 if selective else N * h * e) + (0 if half else N * h * e)
        kv_block = 2 * m.kv_heads * d * h // m.p
        weights = ((2 * m.heads * d + 3 * m.hidden) * h // m.p + kv_block) if half else kv_block
        rope = (4 if half else 2) * S * d * (e if half else 4)
        return tokens + 2 * per_norm + weights * e + rope
    per_norm = N * 2 * e + (0 if selective else N * h * e)
    weights = ((4 * m.heads * d + 2 * m.hidden) * h // m.p + (4 if m.bias else 2) * h) if half else 0
    return tokens + 2 * per_norm + weights * e


def _root_activation_bytes(m: _Shapes, checkpointing: str) -> int:
    """Bytes the root keeps: per local token the embedding's output (``h``, the first block's input; under bf16 its
    bf16 copy), the final norm's as a block's (:func:`_block_activation_bytes`), the loss's float32 log-sum-exp
    and the int64 token ids and targets; GPT-2 per local position its int64 position id; under bf16 the head's
    ``[ceil(V/p), h]`` weight block as a bf16 copy (under float32 too where this rank's block is short of
    ``ceil(V/p)`` rows: its zero-padded copy) and GPT-2's final LayerNorm weight (and bias) as bf16 copies.
    ``checkpointing`` ``"full"`` checkpoints the blocks only, so it keeps what ``"none"`` does."""
    N, h, e = m.N, m.h, m.e
    half = e < 4
    selective = checkpointing == "selective"
    out = 0 if selective else N * h * e
    if m.llama:
        norm = N * 4 + out + (0 if half else N * h * e)
        extra = 0
    else:
        norm = N * 2 * e + out
        extra = 8 * m.S + ((2 if m.bias else 1) * h * e if half else 0)
    short = m.vocab - m.rank * m.vb < m.vb  # this rank's vocab block is zero-padded: a new storage
    head = m.vb * h * e if half or short else 0
    return N * h * e + norm + N * (4 + 16) + head + extra
