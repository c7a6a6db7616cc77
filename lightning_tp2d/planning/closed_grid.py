"""The traced step (:class:`~lightning_tp2d.planning.steps.TracedStep`) of the grid layouts (``"2d"``: SUMMA on a
``q x q`` grid; ``"2d-metp"``: the same layers with a METP ring attention along ``row``) as arithmetic on the config,
as :mod:`lightning_tp2d.planning.closed_step` does for the ring.

How: each layer's schedule on one rank is written here as the stream of operations its code runs -- post a call
(kind, mesh axis, group ranks, bytes), wait for it, compute ``F`` matmul or attention FLOPs -- by small replicas of
the drivers in :mod:`lightning_tp2d.summa` and :mod:`lightning_tp2d.comm` (:class:`_Column` for ``_Column`` and
``_ColumnStream``, :class:`_RingGather`, :class:`_RingReduce`, the broadcast and reduce pipelines), and priced by the
tracer's rule: every FLOP computed while calls are in flight is shared among them in proportion to their bytes; a
blocking call overlaps nothing. A model of ``L`` blocks is the root's stream plus ``L`` times one block's; ``"full"``
checkpointing runs the block's forward again in the backward.

Modelled: :func:`models` -- a square layout whose ranks form a ``"grid"`` (:attr:`~lightning_tp2d.layouts.Layout.
square`, :attr:`~lightning_tp2d.layouts.Layout.arrangement`) with the default
:class:`~lightning_tp2d.options.TPOptions` (collective SUMMA, no kept panels), its batch split over the grid rows
(``"2d"``, :attr:`~lightning_tp2d.layouts.Layout.splits_batch`) or its sequence cut into zigzag chunks with the
attention a ring along ``row`` (``"2d-metp"``, :attr:`~lightning_tp2d.layouts.Layout.zigzag`); GPT-2 (biases on or
off) and Llama (GQA, tied or untied head) whose sizes the grid splits; any vocabulary (short last block);
``checkpointing`` ``"none"`` / ``"selective"`` / ``"full"``; ``elem`` 2 (bf16 autocast) and 4; one replica; every
rank; ``parallel.float8`` (:attr:`_Grid.wire`): under tensorwise each linear's operand blocks and weight column travel
as float8 (one byte per element: the forward's activation and weight panels, the backward's saved ones and the
scatter form's output-gradient blocks), its partial sums and weight-gradient reduce-scatter in the compute dtype, and
each product blocks on two amax all-reduces per pass (``row`` then ``col``; A's and B's forward, dC's backward); the
LM head stays in high precision; rowwise sends what high precision does. Saved activation bytes:
:func:`_activation_bytes`, exact for all of these but tensorwise float8, whose saved float8 operands are not modelled
(the high-precision layout's are returned: fewer without checkpointing, more under ``"selective"``, where the float8
casts of recomputable outputs are kept).

The layers' schedules, rank ``(r, c)``, ``N`` local tokens (``"2d"``: ``B/q`` sequences of ``T``; ``"2d-metp"``:
``B`` sequences of ``S = T/q`` zigzag rows):

* a linear ``[N, in] @ [in, out]`` (:class:`~lightning_tp2d.nn.linear.Linear2D`) runs the collective SUMMA in the
  form :func:`~lightning_tp2d.summa.ab_form` picks (fused q|k|v: gather); its weight column travels as one
  all-gather along ``row`` or, when it outweighs the activation block, as a stream of broadcasts two ahead;
  the activation blocks (gather form) or partial sums (scatter form) go round ``col`` both ways;
  the backward's weight-gradient partials are reduce-scattered along ``row``; a bias' gradient is all-reduced
  along ``row`` (float32);
* a norm all-reduces its statistics along ``col`` (float32, blocking) forward and backward, its weight (and bias)
  gradient along ``row``;
* the token embedding reduces ``q`` partial lookups along ``row`` (float32) and broadcasts ``q`` gradient blocks
  back; GPT-2's position table's gradient is all-reduced along ``row``;
* the head swaps its tied block with the mirror rank (none on the diagonal; again in the backward under
  ``"selective"``), multiplies in the gather form and all-reduces the cross-entropy's max, sums and totals;
* attention is local (``"2d"``: causal SDPA, ``T(T+1)/2`` scores per head) or the METP ring of ``q`` along ``row``
  (``"2d-metp"``: :func:`~lightning_tp2d.metp.ring_attention`, K|V of the local key/value heads travelling).
"""

from __future__ import annotations

import dataclasses

from lightning_tp2d.families import anatomy, family_of_config
from lightning_tp2d.layouts import Layout, get_layout
from lightning_tp2d.options import FLOAT8_RECIPES, TPOptions
from lightning_tp2d.planning.steps import (Stream, TracedStep, checked_entry, one_replica_problem, root_and_blocks,
                                          run_passes, split_problem)
from lightning_tp2d.summa import ab_form, reduce_order, ring_order, ring_steps

__all__ = ["closed_grid_step", "models"]

_F32 = 4  # statistics, embeddings, parameter gradients: float32 at elem 2 and 4


@dataclasses.dataclass(frozen=True)
class _Grid:
    """The numbers one rank's grid layers are made of."""

    q: int
    rank: int
    N: int  # local tokens
    B: int  # local sequences
    T: int  # rows per local sequence (T in "2d", S = T/q in "2d-metp")
    ring: bool  # attention is a ring along row ("2d-metp")
    h: int
    heads: int
    kv_heads: int
    d: int
    hidden: int  # MLP width (GPT-2 4h, Llama I)
    vocab: int
    e: int
    bias: bool
    llama: bool
    tied: bool
    block_size: int
    float8: str | None = None  # parallel.float8

    @property
    def wire(self) -> int:
        """Bytes per element of a linear's operands on the wire: one under tensorwise float8 (the blocks travel cast),
        else the compute element."""
        return 1 if self.float8 == "tensorwise" else self.e

    @property
    def r(self) -> int:
        return self.rank // self.q

    @property
    def c(self) -> int:
        return self.rank % self.q

    @property
    def row(self) -> tuple[int, ...]:
        """The ranks of this rank's ``row`` axis group (its grid column)."""
        return tuple(self.c + self.q * k for k in range(self.q))

    @property
    def col(self) -> tuple[int, ...]:
        """The ranks of this rank's ``col`` axis group (its grid row)."""
        return tuple(self.r * self.q + k for k in range(self.q))

    @property
    def mirror(self) -> int:
        return self.c * self.q + self.r

    @property
    def vb(self) -> int:
        return -(-self.vocab // self.q)  # vocab rows per block, zero-padded


# ---- the SUMMA drivers (lightning_tp2d.summa, lightning_tp2d.comm) -----------------------------------------------


class _Column:
    """A weight column along ``row``: one all-gather waited at the first ``get`` (``summa._Column``), or, when it
    streams, one broadcast per block in ``order``, two ahead (``summa._ColumnStream`` on a ``BroadcastPipeline``)."""

    def __init__(self, s: Stream, g: _Grid, nbytes: int, streams: bool, order: list[int]) -> None:
        self.s, self.g, self.nbytes = s, g, nbytes
        self.order, self.pending = iter(order), {}
        self.gather = None if streams else s.post("all_gather", "row", g.row, nbytes)
        if streams:
            for _ in range(2):
                self._post_next()

    def _post_next(self) -> None:
        k = next(self.order, None)
        if k is not None:
            self.pending[k] = self.s.post("broadcast", "row", self.g.row, self.nbytes)

    def get(self, k: int) -> None:
        if self.gather is not None:
            if self.gather[6] is None:  # waited for at the first block only
                self.s.wait(self.gather)
            return
        entry = self.pending.pop(k)
        self._post_next()
        self.s.wait(entry)


class _RingGather:
    """``summa._RingGather``: blocks of ``nbytes`` both ways round ``col``; ``step(s)`` returns the coordinates held."""

    def __init__(self, s: Stream, g: _Grid, nbytes: int) -> None:
        self.s, self.g, self.nbytes = s, g, nbytes
        self.left_steps, self.right_steps = g.q // 2, (g.q - 1) // 2
        self.handle = None
        self.order = ring_order(g.q, g.c)

    def step(self, s: int) -> list[int]:
        if s > 0:
            self.s.wait(self.handle)
        if s < self.left_steps:
            blocks = 1 + (s < self.right_steps)
            self.handle = self.s.post("ring_exchange", "col", self.g.col, blocks * self.nbytes)
        return self.order[s]


class _RingReduce:
    """``summa._RingReduce``: partial sums of ``nbytes`` both ways round ``col``; ``compute(k)`` runs a partial."""

    def __init__(self, s: Stream, g: _Grid, nbytes: int) -> None:
        self.s, self.g, self.nbytes = s, g, nbytes
        self.right_sends, self.left_sends = g.q // 2, (g.q - 1) // 2
        self.handle = None

    def step(self, s: int, compute) -> None:
        n, i = self.g.q, self.g.c
        if s == self.right_sends:
            compute(i)
            if self.handle is not None:
                self.s.wait(self.handle)
            return
        compute((i + self.right_sends - s) % n)
        leftward = s < self.left_sends
        if leftward:
            compute((i - self.left_sends + s) % n)
        if self.handle is not None:
            self.s.wait(self.handle)
        self.handle = self.s.post("ring_exchange", "col", self.g.col, (1 + leftward) * self.nbytes)


def _flat(order: list[list[int]]) -> list[int]:
    return [k for step in order for k in step]


def _summa(s: Stream, g: _Grid, n_in: int, n_out: int, form: str, backward: bool, head: bool = False) -> None:
    """One ``[N, n_in/q] @ [n_in/q, n_out/q]`` collective SUMMA product (``n_in``, ``n_out``: the local block widths
    times ``q``), forward (:func:`~lightning_tp2d.summa.collective_ab`, :func:`~lightning_tp2d.summa.scatter_ab`) or
    backward (:func:`~lightning_tp2d.summa.collective_ab_backward`, :func:`~lightning_tp2d.summa.scatter_ab_backward`,
    both gradients). ``head``: the LM head's product, which stays in high precision under ``parallel.float8``."""
    if head:
        g = dataclasses.replace(g, float8=None)
    q, e, o, N = g.q, g.e, g.wire, g.N
    bi, bo = n_in // q, n_out // q
    w_bytes, flops, steps = bi * bo * o, 2.0 * N * bi * bo, ring_steps(q)
    forward_order, reduce_targets = _flat(ring_order(q, g.c)), reduce_order(q, g.c)
    if g.float8 == "tensorwise":  # the global amaxes, blocking (float8.tensorwise_cast): A's and B's, then dC's
        for axis, group in (("row", g.row), ("col", g.col)):
            s.blocking("all_reduce", axis, group, (1 if backward else 2) * _F32)
    if not backward:
        streams = q * bi * bo > N * bi  # summa._streams(a, b): the column outweighs A's block
        if form == "gather":
            column = _Column(s, g, w_bytes, streams, forward_order)
            ring = _RingGather(s, g, N * bi * o)
            for step in range(steps):
                for k in ring.step(step):
                    column.get(k)
                    s.mm(flops)
        else:
            column = _Column(s, g, w_bytes, streams, reduce_targets)
            reduce = _RingReduce(s, g, N * bo * e)  # partial sums: high precision
            for step in range(steps):
                reduce.step(step, lambda k: (column.get(k), s.mm(flops)))
        return
    streams = q * bi * bo > N * bo  # summa._streams(grad, b)
    if form == "gather":
        column = _Column(s, g, w_bytes, streams, reduce_targets)
        gather, reduce = _RingGather(s, g, N * bi * o), _RingReduce(s, g, N * bi * e)
        scatter = None
        for step in range(steps):
            for _ in gather.step(step):
                s.mm(flops)
            if step == steps - 1:
                scatter = s.post("reduce_scatter", "row", g.row, q * bi * bo * e)
            reduce.step(step, lambda k: (column.get(k), s.mm(flops)))
    else:
        column = _Column(s, g, w_bytes, streams, forward_order)
        ring = _RingGather(s, g, N * bo * o)
        scatter = None
        for step in range(steps):
            held = ring.step(step)
            for _ in held:
                s.mm(flops)
            if step == steps - 1:
                scatter = s.post("reduce_scatter", "row", g.row, q * bi * bo * e)
            for k in held:
                column.get(k)
                s.mm(flops)
    s.wait(scatter)


def _linear(s: Stream, g: _Grid, n_in: int, n_out: int, backward: bool, *, fused: bool = False,
            bias: bool = False) -> None:
    """:class:`~lightning_tp2d.nn.linear.Linear2D` (``fused``: GPT-2's ``c_attn``, always the gather form); the
    bias' gradient all-reduced along ``row`` while the product's backward runs."""
    form = "gather" if fused else ab_form(n_in, n_out)
    summed = s.post("all_reduce", "row", g.row, n_out // g.q * _F32) if backward and bias else None
    _summa(s, g, n_in, n_out, form, backward)
    if summed is not None:
        s.wait(summed)


def _norm(s: Stream, g: _Grid, backward: bool) -> None:
    """:class:`~lightning_tp2d.nn.layernorm.LayerNorm2D` (``Σx``, ``Σx²``) or
    :class:`~lightning_tp2d.nn.llama2d.RMSNorm2D` (``Σx²``): statistics along ``col``; backward, the parameters'
    gradients in one all-reduce along ``row``, posted before the statistics' and waited on after them."""
    stats = 1 if g.llama else 2
    vectors = 1 if g.llama or not g.bias else 2
    summed = s.post("all_reduce", "row", g.row, vectors * (g.h // g.q) * _F32) if backward else None
    s.blocking("all_reduce", "col", g.col, stats * g.N * _F32)
    if summed is not None:
        s.wait(summed)


# ---- attention ---------------------------------------------------------------------------------------------------


def _ring_forward(s: Stream, g: _Grid, nbytes: int, step) -> None:
    """:func:`~lightning_tp2d.metp.ring_forward` along ``row`` (ring rank ``i = r``)."""
    p, i = g.q, g.r
    for t in range(p):
        pending = s.post("ring_exchange", "row", g.row, nbytes) if t < p - 1 else None
        step((i - t) % p)
        if pending is not None:
            s.wait(pending)


def _ring_backward(s: Stream, g: _Grid, nbytes: int, step) -> None:
    """:func:`~lightning_tp2d.metp.ring_backward` along ``row``: the operands as forward, the gradient sums sent
    after each step's compute and waited after the next one's."""
    p, i = g.q, g.r
    acc = None
    for t in range(p):
        pending = s.post("ring_exchange", "row", g.row, nbytes) if t < p - 1 else None
        step((i - t) % p)
        if acc is not None:
            s.wait(acc)
        acc = s.post("ring_exchange", "row", g.row, nbytes)
        if pending is not None:
            s.wait(pending)
    s.wait(acc)


def _attention_core(s: Stream, g: _Grid, backward: bool) -> None:
    """The attention between the projections: local causal SDPA of the ``heads/q`` local heads (``"2d"``), or the
    METP ring along ``row`` (``"2d-metp"``): step ``j == r`` is the causal diagonal block, others ``S²/2`` scores
    per query head; K|V of the ``kv_heads/q`` local key/value heads travel."""
    per_score = (10.0 if backward else 4.0) * g.d * g.B
    heads, kv = g.heads // g.q, g.kv_heads // g.q
    if not g.ring:  # the tracer's arithmetic, to the last bit: square scores, then the visible fraction
        scores = float(g.T * g.T) * g.B * heads
        scores *= (g.T * (g.T + 1) // 2) / (g.T * g.T)
        s.attention((10.0 if backward else 4.0) * g.d * scores)
        return
    S, c = g.T, g.T // 2

    def step(j: int) -> None:
        scores = S * (S + 1) / 2 if j == g.r else 2.0 * c * c
        for _ in range(heads // kv):
            s.attention(per_score * kv * scores)

    nbytes = 2 * g.B * kv * S * g.d * g.e
    (_ring_backward if backward else _ring_forward)(s, g, nbytes, step)


def _attention(s: Stream, g: _Grid, backward: bool) -> None:
    h, hd, kvd = g.h, g.heads * g.d, g.kv_heads * g.d
    if g.llama:
        projections = [lambda b: _linear(s, g, h, hd, b), lambda b: _linear(s, g, h, kvd, b),
                       lambda b: _linear(s, g, h, kvd, b)]
    else:
        projections = [lambda b: _linear(s, g, h, 3 * hd, b, fused=True, bias=g.bias)]
    parts = projections + [lambda b: _attention_core(s, g, b), lambda b: _linear(s, g, hd, h, b, bias=g.bias)]
    for run in (reversed(parts) if backward else parts):
        run(backward)


def _mlp(s: Stream, g: _Grid, backward: bool) -> None:
    """GPT-2's ``c_fc``, GELU, ``c_proj``; Llama's ``gate_proj``, ``up_proj``, SiLU-gate, ``down_proj``."""
    h, f = g.h, g.hidden
    ins = [lambda b: _linear(s, g, h, f, b, bias=g.bias)] * (2 if g.llama else 1)
    parts = ins + [lambda b: _linear(s, g, f, h, b, bias=g.bias)]
    for run in (reversed(parts) if backward else parts):
        run(backward)


def _block(s: Stream, g: _Grid, backward: bool) -> None:
    parts = [lambda b: _norm(s, g, b), lambda b: _attention(s, g, b), lambda b: _norm(s, g, b),
             lambda b: _mlp(s, g, b)]
    for run in (reversed(parts) if backward else parts):
        run(backward)


# ---- the root ----------------------------------------------------------------------------------------------------


def _embedding(s: Stream, g: _Grid, backward: bool) -> None:
    """:class:`~lightning_tp2d.nn.embedding.TokenEmbedding2D`: ``q`` float32 partial lookups reduced along ``row``
    (a ``ReducePipeline``: each waited after the next is posted; nothing computed between), the gradient's ``q``
    blocks broadcast back (a ``BroadcastPipeline``)."""
    nbytes = g.N * (g.h // g.q) * _F32
    entries = [s.post("reduce" if not backward else "broadcast", "row", g.row, nbytes) for _ in range(g.q)]
    for entry in entries:
        s.wait(entry)


def _mirror_swap(s: Stream, g: _Grid) -> None:
    """The tied head's swap of its padded block with the mirror rank (``exchange_with``: a send and a recv, blocking;
    nothing on the diagonal)."""
    if g.mirror != g.rank:
        for kind in ("send", "recv"):
            s.blocking(kind, "pair", (g.rank, g.mirror), g.vb * (g.h // g.q) * g.e)


def _head(s: Stream, g: _Grid, backward: bool, checkpointing: str) -> None:
    """The LM head (:class:`~lightning_tp2d.nn.head.LMHead2D`) and the vocab-parallel cross-entropy: forward the
    swap (tied), the product ``[N, h/q] @ [h/q, ceil(V/q)]``, the max, the sums and the totals; backward the swap
    again under ``"selective"`` (the mirrored block is a recipe), the product's backward and the swap of its
    gradient back."""
    if not backward:
        if g.tied:
            _mirror_swap(s, g)
        _summa(s, g, g.h, g.q * g.vb, "gather", False, head=True)
        s.blocking("all_reduce", "col", g.col, g.N * _F32)
        s.blocking("all_reduce", "col", g.col, 2 * g.N * _F32)
        s.blocking("all_reduce", "row", g.row, 2 * _F32)
        return
    if g.tied and checkpointing == "selective":
        _mirror_swap(s, g)
    _summa(s, g, g.h, g.q * g.vb, "gather", True, head=True)
    if g.tied:
        _mirror_swap(s, g)


def _root(s: Stream, g: _Grid, backward: bool, checkpointing: str) -> None:
    """Embeddings, final norm, head; the backward in reverse (its blocking calls overlap nothing, so their order
    changes no number)."""
    if not backward:
        _embedding(s, g, False)
        _norm(s, g, False)
        _head(s, g, False, checkpointing)
        return
    _head(s, g, True, checkpointing)
    _norm(s, g, True)
    if not g.llama:
        s.blocking("all_reduce", "row", g.row, g.block_size * (g.h // g.q) * _F32)  # the position table
    _embedding(s, g, True)


# ---- the model ---------------------------------------------------------------------------------------------------


def models(layout: str | Layout, cfg, p: int, elem: int, *, dp: int = 1, zero_stage: int = 0,
           clip: bool = False) -> str | None:
    """Why :func:`closed_grid_step` does not model this case (a sentence naming the numbers), or ``None`` when it
    does."""
    spec = get_layout(layout)
    if not spec.square or spec.arrangement != "grid":
        return f"layout {spec.name!r} ({spec.arrangement}) is not a square grid"
    if spec.splits_batch == spec.zigzag:
        return (f"layout {spec.name!r} splits_batch={spec.splits_batch}, zigzag={spec.zigzag}: closed forms cover a "
                f"grid whose rows split the batch or cut the sequence")
    if spec.options not in (None, TPOptions(), *(TPOptions(float8=r) for r in FLOAT8_RECIPES)):
        return f"options {spec.options!r} are traced; closed forms cover the defaults (and parallel.float8)"
    problem = one_replica_problem(cfg, elem, dp, zero_stage, clip)
    if problem:
        return problem
    if spec.size_problem(p) or p < 4:
        return f"p={p}: the grid needs a square p >= 4"
    return split_problem(spec, cfg, p)


def closed_grid_step(layout: str | Layout, cfg, batch: int, seq: int, p: int, elem: int, rank: int = 0, *,
                     checkpointing: str = "none") -> TracedStep:
    """The :class:`~lightning_tp2d.planning.steps.TracedStep` of grid rank ``rank`` (module docstring), equal to
    :func:`lightning_tp2d.planning.trace.trace_step`'s for one replica. ``ValueError`` naming the numbers for
    anything it does not model (:func:`models`) or an input the layout refuses."""
    spec = get_layout(layout)
    checked_entry("closed_grid_step", models(spec, cfg, p, elem), spec, p, batch, seq, rank, checkpointing)
    q = spec.side(p)
    llama, a = family_of_config(cfg).name == "llama", anatomy(cfg)
    sequences, rows = (batch // q, seq) if spec.splits_batch else (batch, seq // q)
    g = _Grid(q=q, rank=rank, N=sequences * rows, B=sequences, T=rows, ring=spec.zigzag, h=cfg.n_embd,
              heads=cfg.n_head, kv_heads=a.kv_heads, d=cfg.n_embd // cfg.n_head,
              hidden=a.mlp_width, vocab=cfg.vocab_size, e=elem,
              bias=bool(getattr(cfg, "bias", False)), llama=llama, tied=a.tied_head,
              block_size=cfg.block_size, float8=getattr(spec.options, "float8", None))
    activation = _activation_bytes(g, cfg.n_layer, checkpointing)
    root, block = Stream(), Stream()
    run_passes(root, block, lambda s, backward: _root(s, g, backward, checkpointing),
               lambda s, backward: _block(s, g, backward), checkpointing)
    return root_and_blocks(root, block, cfg.n_layer, activation)



def _activation_bytes(g: _Grid, layers: int, checkpointing: str) -> int:
    """Bytes of the storages one forward creates and autograd keeps on this rank (the tracer's count: a storage the
    forward creates -- a parameter is not one -- that a saved-tensor hook sees): the root's
    (:func:`_root_activation_bytes`) and ``layers`` times one block's (:func:`_block_activation_bytes`)."""
    return _root_activation_bytes(g, checkpointing) + layers * _block_activation_bytes(g, checkpointing)


def _block_activation_bytes(g: _Grid, checkpointing: str) -> int:
    """One block's saved bytes. ``hq = h/q``; the local widths ``hd = n_head d / q``, ``kvd = n_kv_head d / q``,
    ``f = hidden / q``; ``N`` local tokens of ``T`` rows per sequence (``"2d-metp"``: ``S``); ``e = elem``; the
    residual stream and every saved activation in the compute dtype, the statistics float32. Per local token:

    * the two residual sums (``2 hq``: the block's output is the next block's input, read by its first norm);
    * GPT-2: q|k|v (``3 hq``), the attention output (``hq``; ``"2d-metp"``'s too: the ring writes it token-major), the
      MLP's pre-activation and GELU output (``8 hq``, the GELU output recomputed under ``"selective"``), each
      LayerNorm's output (``2 hq``, recomputed under ``"selective"``) and its float32 mean and reciprocal deviation
      (``2 x 2 x 4`` bytes);
    * Llama ``"2d"``: q and k after RoPE and v (``hd + 2 kvd``) and the attention output (``hd``); ``"2d-metp"``:
      the ring's ``[g+2, B, kv, S, d]`` q|k|v (:func:`~lightning_tp2d.metp.group_queries`, ``hd + 2 kvd``) and its
      output (``hd``, token-major: the output projection reads it as a view); the MLP's gate and up
      (``2f``), SiLU(gate) (``f``) and the gated product (``f``, recomputed under ``"selective"``); each RMSNorm's
      float32 reciprocal root mean square (4 bytes) and its output -- under float32 the output itself (``2 hq``),
      under bf16 the bf16 copy each linear reading it makes (``autocast_operands``: q, k, v, gate, up, ``5 hq``),
      recomputed under ``"selective"`` either way;
    * the float32 log-sum-exp per local query head (``4 n_head / q`` bytes).

    Not per token: Llama's RoPE tables per local position (``T d``): float32 cos and sin once under float32, four
    bf16 copies (for q and for k) under bf16. Under bf16 every local weight block's bf16 copy (``autocast_operands``:
    GPT-2 ``12 h^2 / q^2``, Llama ``(2 n_head d + 2 n_kv_head d + 3 I) h / q^2`` elements). ``"full"`` keeps the
    block's input only (held by the checkpoint)."""
    hq, N, e, q = g.h // g.q, g.N, g.e, g.q
    if checkpointing == "full":
        return N * hq * e
    selective, half = checkpointing == "selective", e < 4
    per_token = 2 * hq * e + 4 * (g.heads // q)  # residuals; log-sum-exp
    if g.llama:
        hd, kvd, f = g.heads // q * g.d, g.kv_heads // q * g.d, g.hidden // q
        attention = 2 * hd + 2 * kvd
        norms = 0 if selective else (5 if half else 2) * hq
        per_token += e * (attention + (3 if selective else 4) * f + norms) + 2 * 4
        rope = (4 * g.T * g.d * e) if half else 2 * g.T * g.d * 4
        weights = (2 * g.heads * g.d + 2 * g.kv_heads * g.d + 3 * g.hidden) * g.h // (q * q) * e if half else 0
        return N * per_token + rope + weights
    per_token += e * (8 if selective else 14) * hq + 2 * 2 * 4
    weights = 12 * g.h * g.h // (q * q) * e if half else 0
    return N * per_token + weights


def _root_activation_bytes(g: _Grid, checkpointing: str) -> int:
    """The root's saved bytes, per local token: the embedding's output in the compute dtype (``hq``, the first
    block's input), the final norm's output as a block's norms keep it (``hq``: GPT-2's LayerNorm output, Llama's
    RMSNorm output under float32 or the head's bf16 copy of it under bf16; recomputed under ``"selective"``) and its
    float32 statistics (GPT-2 mean and reciprocal deviation, Llama the reciprocal root mean square), the float32
    softmax block ``[N, ceil(V/q)]``, the int64 target offsets and two bool masks; GPT-2 per local row its int64
    position id; ``"2d-metp"``: the ``q`` int64 zigzag shards of the token ids (``q N``). The head's weight block
    ``[ceil(V/q), hq]`` where it is a new storage: tied (the embedding's block of vocab rows ``r``; none under
    ``"selective"``, where the mirrored block is a recipe), off the diagonal the swapped block, on the diagonal the
    bf16 copy under bf16 or, under float32, the zero-padded copy of a short block; untied (vocab rows ``c``), the
    bf16 copy under bf16, the zero-padded copy of a short block under float32. ``"full"`` checkpoints the blocks
    only, so it keeps what ``"none"`` does."""
    hq, N, e, q = g.h // g.q, g.N, g.e, g.q
    selective, half = checkpointing == "selective", e < 4
    stats = 4 if g.llama else 8
    per_token = e * hq + (0 if selective else e * hq) + stats + 4 * g.vb + 8 + 2
    out = N * per_token + (0 if g.llama else 8 * g.T) + (q * N * 8 if g.ring else 0)
    block, owner = g.vb * hq * e, (g.r if g.tied else g.c)
    short = g.vocab - owner * g.vb < g.vb
    if g.tied and selective:
        return out  # the mirrored block is a recipe, swapped again in the backward
    if (g.tied and g.mirror != g.rank) or half or short:
        out += block
    return out
