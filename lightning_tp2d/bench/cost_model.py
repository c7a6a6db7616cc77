"""Analytic cost model of one training step, per tensor-parallel rank: communication, FLOPs, saved activations and
a projected step time.

The step is ``loss = model(idx, targets); loss.backward()`` with ``idx [batch, seq]``, dropout 0, one data-parallel
replica, the model in train mode. Notation: ``N = batch * seq`` tokens, ``h`` hidden, ``V`` vocabulary, ``L``
blocks, ``p`` tensor-parallel ranks, ``q = sqrt(p)`` the grid side of the 2-D layouts.

Element sizes. ``elem`` is the size of the matmul operands and activations (4: float32; 2: bfloat16 *autocast* with
float32 parameters, as the benchmarks and Lightning's ``bf16-mixed`` run; 8: float64). The code keeps some tensors
in float32 whatever ``elem`` (float64 when ``elem`` is 8), written ``ep`` below: parameters and their gradients,
the token/position embeddings and the residual stream they start, LayerNorm and cross-entropy statistics, and the
ring kernels' gradient accumulators (``metp.acc_dtype``).

Communication (:func:`comm_events`) is exact: the list of :class:`~lightning_tp2d.bench.events.Comm` events sums
(:func:`~lightning_tp2d.bench.events.totals`) to what :data:`lightning_tp2d.comm.STATS` counts on that rank for
the step (``tests/test_cost_model.py`` checks it call for call and byte for byte on gloo, float32 and bf16
autocast). ``"single"`` sends nothing; ``"tp1d"`` is :func:`lightning_tp2d.bench.tp1d.tp1d_comm_events`. Per layout
(``elem`` bytes unless marked ``ep``), with
``n`` the rank's tokens and ``Vr = ceil(V/q)`` (grid) or ``Vb = ceil(V/p)`` (ring) the padded vocabulary block:

``"2d"`` (``n = N/q``; every activation block ``[n, h/q]``)
    * token embedding: forward ``q`` reduces along ``row`` of ``[n, h/q]`` (``ep``), backward ``q`` broadcasts of
      the same; position embedding: backward one all-reduce along ``row`` of the *whole* table
      ``[block_size, h/q]`` (``ep``).
    * each linear ``in -> out`` (SUMMA ``C = A B``): forward ``q`` broadcasts along ``col`` of the ``X`` panel
      ``[n, in/q]`` and ``q`` along ``row`` of the ``W`` panel ``[in/q, out/q]``; backward ``dX = dY Wᵀ`` (``q``
      broadcasts of ``W`` along ``row``, ``q`` reduces of ``[n, in/q]`` along ``col``) and ``dW = Xᵀ dY`` (``q``
      broadcasts of ``X`` along ``col``, ``q`` reduces of ``[in/q, out/q]`` along ``row``); its bias gradient: one
      all-reduce along ``row`` of ``out/q`` (``ep``). Four linears per block: ``h->3h``, ``h->h``, ``h->4h``,
      ``4h->h``.
    * each LayerNorm: one all-reduce along ``col`` of ``[2, n]`` forward and one backward (``ep``), one all-reduce
      along ``row`` of ``h/q`` per parameter vector (weight, bias) backward.
    * LM head: a SUMMA ``X Eᵀ`` as a linear ``h -> q*Vr`` (the vocabulary padded); forward and backward one swap
      (a ``send`` and a ``recv`` of ``[Vr, h/q]``, group ``"tp"`` of all ``p`` ranks) with the mirror rank
      ``(c, r)``, none on the diagonal ``r == c``;
      loss: all-reduces along ``col`` of ``[n]`` (max) and ``[2, n]`` (sum-exp, target logit), along ``row`` of 2
      numbers (``ep``); its backward is local.
``"2d-metp"``
    As ``"2d"`` with ``n = batch * seq/q`` (grid rows hold zigzag sequence chunks), plus per block the ring
    attention along ``row`` over ``q`` ranks: forward ``q-1`` exchanges of ``K|V`` ``[2, n, h/q]`` (``elem``),
    backward ``q-1`` of ``K|V`` and ``q`` of ``dK|dV`` (``ep``).
``"metp"`` (``n = N/p``, full hidden ``h``; every event along ``ring``)
    One ring pass per weight-streaming operation, forward ``p-1`` exchanges of the travelling block, backward
    ``p-1`` of the block and ``p`` of its gradient accumulator (``ep``): per block ``c_attn`` (``[3h/p, h]``), the
    attention's ``K|V`` (``[2, n, h]``), ``c_proj`` (``[h, h/p]``), the MLP (``[4h/p, h]`` and ``[h, 4h/p]`` in one
    exchange); the LM head + loss (``[Vb, h]``, plus one all-reduce of 2 numbers). The token embedding streams
    ``[Vb, h]`` forward (``p-1``, ``ep``) and only its gradient backward (``p-1``). Every replicated vector (biases,
    LayerNorms, and the whole position table ``[block_size, h]``) has its gradient all-reduced over the ring.

``overlap_flops`` is the compute a transfer runs behind. SUMMA: the broadcast of panel ``l+1`` is posted before the
multiply of panel ``l`` and the reduce of panel ``l`` runs during the multiply of panel ``l+1``, so of the ``q``
calls per operand the first broadcast and the last reduce overlap nothing; the transfers in flight during one
panel multiply share its FLOPs in proportion to their bytes. Ring: the exchange posted at step ``t`` runs during
step ``t``'s compute (backward: with the gradient exchange posted at the end of step ``t-1``, sharing the FLOPs
the same way; the last gradient exchange overlaps nothing). Embedding lookups, scatter-adds and every all-reduce
count as overlapping nothing.

FLOPs (:func:`flops`) count matmuls (``2 m k n``) and attention (``4 d`` per visible score forward, ``10 d``
backward, as flash kernels recompute the scores), nothing elementwise. Causal attention counts the visible scores
``T (T+1)/2`` per sequence and head; the METP ring (:func:`lightning_tp2d.metp.visible`) computes exactly the
visible blocks: on every off-diagonal step ``2c²`` scores (``c = seq/(2p)``), on its own diagonal block
``c (2c+1)``, never a fully masked block, and in total exactly the causal count. METP's MLP recomputes
``X W1`` in backward (40 instead of 32 ``n h²`` FLOPs per block) and its LM head recomputes the logits (``6 n h V``
instead of ``4``); the 2-D LM head multiplies the padded vocabulary ``q * Vr``.

The time model (:class:`Hardware`, :func:`step_time`) turns events into seconds per call with textbook
collective costs on the link the group uses, and charges each call only what its overlapped compute does not
hide. Tensor-parallel groups are contiguous global ranks (grid rank ``r*q + c``): a ``col`` group (same row) is
``q`` consecutive ranks, a ``row`` group has stride ``q``; a group whose ranks lie on more than one node of
``gpus_per_node`` uses the inter-node link.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_tp2d.bench.events import Comm
from lightning_tp2d.models.gpt2 import GPT2Config

LAYOUTS = ("single", "tp1d", "2d", "metp", "2d-metp")
GRID = ("2d", "2d-metp")

__all__ = ["LAYOUTS", "Link", "Hardware", "H100_NVLINK4_NDR", "A100_NVLINK3_HDR", "comm_events", "flops",
           "activation_bytes", "collective_time", "step_time", "projected_speedup", "metp_overlap_threshold"]


def _ep(elem: int) -> int:
    """Bytes of what the code keeps in float32 whatever the compute dtype (float64 stays float64)."""
    return 8 if elem == 8 else 4


def _check(layout: str, cfg: GPT2Config, batch: int, seq: int, p: int) -> int:
    """Validate the shapes the layout needs (those that decide byte counts); return ``q`` (grid) or ``p``."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {list(LAYOUTS)}")
    if not isinstance(p, int) or p < 1:
        raise ValueError(f"p must be a positive int, got {p!r}")
    if batch < 1 or seq < 1:
        raise ValueError(f"batch and seq must be positive, got batch={batch} seq={seq}")
    if seq > cfg.block_size:
        raise ValueError(f"seq {seq} exceeds block_size {cfg.block_size}")
    h = cfg.n_embd
    if layout == "single":
        if p != 1:
            raise ValueError(f"layout 'single' runs on one rank, got p={p}")
        return 1
    if layout in GRID:
        q = math.isqrt(p)
        if q * q != p:
            raise ValueError(f"layout {layout!r} needs a square p (q x q grid), got p={p}")
        if h % q:
            raise ValueError(f"layout {layout!r}: n_embd={h} is not divisible by q={q}")
        if layout == "2d" and batch % q:
            raise ValueError(f"layout '2d': batch {batch} is not divisible by q={q} (use a multiple of {q})")
        if layout == "2d-metp" and seq % (2 * q):
            raise ValueError(f"layout '2d-metp': sequence length {seq} is not divisible by 2*q={2 * q}")
        return q
    if h % p:
        raise ValueError(f"layout {layout!r}: n_embd={h} is not divisible by p={p}")
    if layout == "metp" and seq % (2 * p):
        raise ValueError(f"layout 'metp': sequence length {seq} is not divisible by 2*p={2 * p}")
    return p


# ---- communication events ----------------------------------------------------------------------------------


class _Events:
    """Events keyed by everything but ``calls`` (identical calls merge), each tagged with the rate (``"matmul"``
    or ``"attention"``) that turns its ``overlap_flops`` into seconds."""

    def __init__(self) -> None:
        self.calls: dict[tuple, int] = {}

    def add(self, kind: str, group: str, size: int, nbytes: int, calls: int = 1, overlap: float = 0.0,
            phase: str = "forward", rate: str = "matmul") -> None:
        if size <= 1 or calls <= 0:  # comm.py bypasses axes of one rank: nothing sent, nothing counted
            return
        key = (kind, group, size, int(nbytes), float(overlap), phase, rate if overlap else "matmul")
        self.calls[key] = self.calls.get(key, 0) + calls

    def extend(self, other: "_Events", times: int = 1) -> None:
        for key, calls in other.calls.items():
            self.calls[key] = self.calls.get(key, 0) + calls * times

    def tagged(self) -> list[tuple[Comm, str]]:
        return [(Comm(kind, group, size, nbytes, calls, overlap, phase), rate)
                for (kind, group, size, nbytes, overlap, phase, rate), calls in self.calls.items()]


def _share(ev: _Events, flops: float, transfers: list[tuple[str, str, int, int]], phase: str, rate: str) -> None:
    """``transfers`` (kind, group, size, nbytes) in flight together during ``flops`` of compute: each gets a share
    of the FLOPs in proportion to its bytes."""
    total = sum(t[3] for t in transfers)
    for kind, group, size, nbytes in transfers:
        ev.add(kind, group, size, nbytes, 1, flops * nbytes / total if total else 0.0, phase, rate)


def _summa(ev: _Events, q: int, phase: str, bcasts: list[tuple[str, int]], reduce: tuple[str, int] | None,
           panel_flops: float) -> None:
    """One SUMMA product (:mod:`lightning_tp2d.summa`): per panel ``l`` one broadcast of each operand in
    ``bcasts`` (axis, bytes) and, for ``A Bᵀ`` / ``Aᵀ B``, one reduce of the partial result. During the multiply of
    panel ``l`` the broadcasts of panel ``l+1`` and the reduce of panel ``l-1`` are in flight."""
    for l in range(q):
        flight = [("broadcast", g, q, b) for g, b in bcasts] if l + 1 < q else []
        if reduce is not None and l >= 1:
            flight.append(("reduce", reduce[0], q, reduce[1]))
        _share(ev, panel_flops, flight, phase, "matmul")
    for g, b in bcasts:  # panel 0: waited for before any multiply
        ev.add("broadcast", g, q, b, 1, 0.0, phase)
    if reduce is not None:  # the last partial: waited for after the last multiply
        ev.add("reduce", reduce[0], q, reduce[1], 1, 0.0, phase)


def _linear_2d(ev: _Events, q: int, n: int, in_q: int, out_q: int, e: int) -> None:
    """A SUMMA linear with local blocks ``X [n, in_q]``, ``W [in_q, out_q]`` (bias not included)."""
    x, w = n * in_q * e, in_q * out_q * e
    f = 2.0 * n * in_q * out_q  # one panel multiply, any of the three products
    _summa(ev, q, "forward", [("col", x), ("row", w)], None, f)  # Y = X W
    _summa(ev, q, "backward", [("row", w)], ("col", x), f)  # dX = dY Wᵀ
    _summa(ev, q, "backward", [("col", x)], ("row", w), f)  # dW = Xᵀ dY


def _layernorm_2d(ev: _Events, q: int, n: int, h: int, ep: int, bias: bool) -> None:
    ev.add("all_reduce", "col", q, 2 * n * ep, 1, phase="forward")  # Σx, Σx² along the hidden dim
    ev.add("all_reduce", "col", q, 2 * n * ep, 1, phase="backward")  # Σdx̂, Σdx̂·x̂
    ev.add("all_reduce", "row", q, h // q * ep, 2 if bias else 1, phase="backward")  # weight (and bias) grads


def _ring_pass(ev: _Events, p: int, i: int, group: str, operand: int, grad: int | None, fwd_step, bwd_step,
               rate: str) -> None:
    """One ring kernel (:func:`~lightning_tp2d.metp.ring_forward` then :func:`~lightning_tp2d.metp.ring_backward`)
    on ring coordinate ``i``: ``operand`` bytes travel (forward ``p-1`` exchanges, each during the compute of its
    step), backward again with ``grad`` bytes of accumulators (``p`` exchanges). ``fwd_step(j)`` /
    ``bwd_step(j)`` are the FLOPs of the step that uses rank ``j``'s block. ``operand == 0``: the embedding's
    backward, where only the gradients travel (``p-1`` exchanges, starting one rank early)."""
    if operand:
        for t in range(p - 1):
            _share(ev, fwd_step((i - t) % p), [("ring_exchange", group, p, operand)], "forward", rate)
    if grad is None:
        return
    if not operand:  # gradients only: posted after steps 0..p-2, each runs during the next step's compute
        for t in range(1, p):
            _share(ev, bwd_step((i - t - 1) % p), [("ring_exchange", group, p, grad)], "backward", rate)
        return
    for t in range(p):
        flight = [("ring_exchange", group, p, operand)] if t < p - 1 else []
        if t >= 1:
            flight.append(("ring_exchange", group, p, grad))  # the sum posted at the end of step t-1
        _share(ev, bwd_step((i - t) % p), flight, "backward", rate)
    ev.add("ring_exchange", group, p, grad, 1, 0.0, "backward")  # brings the accumulators home: waited at once


def _ring_attention(ev: _Events, n_ring: int, i: int, group: str, batch: int, local_seq: int, width: int, e: int,
                    ep: int) -> None:
    """The METP ring attention over ``n_ring`` ranks: ``K|V`` of ``batch`` sequences of ``local_seq`` zigzag rows and
    ``width`` features (the local heads) travel."""
    c = local_seq // 2
    scores = lambda j: batch * (c * (2 * c + 1) if j == i else 2 * c * c)  # noqa: E731  (per feature column)
    kv = 2 * batch * local_seq * width
    _ring_pass(ev, n_ring, i, group, kv * e, kv * ep, lambda j: 4.0 * width * scores(j),
               lambda j: 10.0 * width * scores(j), "attention")


def _grid_events(layout: str, cfg: GPT2Config, batch: int, seq: int, q: int, rank: int, elem: int) -> _Events:
    h, V, e, ep = cfg.n_embd, cfg.vocab_size, elem, _ep(elem)
    hq = h // q
    r, c = divmod(rank, q)
    n = batch * seq // q  # local tokens: B/q sequences ("2d") or the zigzag chunks of every sequence ("2d-metp")
    ev = _Events()
    # token embedding: partial rows reduced to the token owner (forward), output gradient broadcast (backward)
    ev.add("reduce", "row", q, n * hq * ep, q, phase="forward")
    ev.add("broadcast", "row", q, n * hq * ep, q, phase="backward")
    ev.add("all_reduce", "row", q, cfg.block_size * hq * ep, 1, phase="backward")  # wpe gradient, whole table

    block = _Events()
    for k in range(2):  # ln_1, ln_2
        _layernorm_2d(block, q, n, h, ep, cfg.bias)
    for fan_in, fan_out in ((h, 3 * h), (h, h), (h, 4 * h), (4 * h, h)):  # c_attn, attn.c_proj, c_fc, mlp.c_proj
        _linear_2d(block, q, n, fan_in // q, fan_out // q, e)
        if cfg.bias:
            block.add("all_reduce", "row", q, fan_out // q * ep, 1, phase="backward")
    if layout == "2d-metp":
        _ring_attention(block, q, r, "row", batch, seq // q, hq, e, ep)
    ev.extend(block, cfg.n_layer)
    _layernorm_2d(ev, q, n, h, ep, cfg.bias)  # ln_f

    # LM head: swap with the mirror rank, SUMMA over the padded vocabulary, vocab-parallel loss
    rows = -(-V // q)
    if r != c:
        for phase in ("forward", "backward"):
            ev.add("send", "tp", q * q, rows * hq * e, 1, phase=phase)
            ev.add("recv", "tp", q * q, rows * hq * e, 1, phase=phase)
    _linear_2d(ev, q, n, hq, rows, e)
    ev.add("all_reduce", "col", q, n * ep, 1, phase="forward")  # max
    ev.add("all_reduce", "col", q, 2 * n * ep, 1, phase="forward")  # sum-exp, target logit
    ev.add("all_reduce", "row", q, 2 * ep, 1, phase="forward")  # loss sum, count
    return ev


def _metp_events(cfg: GPT2Config, batch: int, seq: int, p: int, i: int, elem: int) -> _Events:
    h, V, e, ep = cfg.n_embd, cfg.vocab_size, elem, _ep(elem)
    S = seq // p  # this rank's rows of every sequence (zigzag chunks i and 2p-1-i)
    n = batch * S
    Vb = -(-V // p)
    ev = _Events()
    # token embedding: vocab blocks stream past the ids (a gather: no FLOPs), gradients stream home
    _ring_pass(ev, p, i, "ring", Vb * h * ep, None, lambda j: 0.0, None, "matmul")
    _ring_pass(ev, p, i, "ring", 0, Vb * h * ep, None, lambda j: 0.0, "matmul")
    replicated = [cfg.block_size * h]  # wpe
    block = _Events()
    for w, fwd, bwd in (
        (3 * h * h // p, 2.0 * n * h * 3 * h / p, 4.0 * n * h * 3 * h / p),  # c_attn, out-split
        (h * h // p, 2.0 * n * h * h / p, 4.0 * n * h * h / p),  # attn.c_proj, in-split
        (8 * h * h // p, 16.0 * n * h * h / p, 40.0 * n * h * h / p),  # MLP, X W1 recomputed in backward
    ):
        _ring_pass(block, p, i, "ring", w * e, w * ep, lambda j, f=fwd: f, lambda j, f=bwd: f, "matmul")
    _ring_attention(block, p, i, "ring", batch, S, h, e, ep)
    vectors = [h, h, h, h] if cfg.bias else [h, h]  # ln_1, ln_2 weight (and bias)
    if cfg.bias:
        vectors += [3 * h, h, 4 * h, h]  # c_attn, attn.c_proj, c_fc, mlp.c_proj biases
    for size in vectors:
        block.add("all_reduce", "ring", p, size * ep, 1, phase="backward")
    ev.extend(block, cfg.n_layer)
    replicated += [h, h] if cfg.bias else [h]  # ln_f
    for size in replicated:
        ev.add("all_reduce", "ring", p, size * ep, 1, phase="backward")

    # LM head + cross-entropy: vocab blocks stream, logits recomputed in backward; padded rows cost nothing
    valid = lambda j: max(0, min(Vb, V - j * Vb))  # noqa: E731
    _ring_pass(ev, p, i, "ring", Vb * h * e, Vb * h * ep, lambda j: 2.0 * n * h * valid(j),
               lambda j: 6.0 * n * h * valid(j), "matmul")
    ev.add("all_reduce", "ring", p, 2 * ep, 1, phase="forward")  # loss sum, count
    return ev


def _tagged_events(layout: str, cfg: GPT2Config, batch: int, seq: int, p: int, elem: int,
                   rank: int) -> list[tuple[Comm, str]]:
    q = _check(layout, cfg, batch, seq, p)
    if not 0 <= rank < p:
        raise ValueError(f"rank {rank} is not in [0, {p})")
    if layout == "tp1d":  # before the p == 1 shortcut: loss_parallel all-reduces even over one rank
        from lightning_tp2d.bench.tp1d import tp1d_comm_events

        return [(ev, "matmul") for ev in tp1d_comm_events(cfg, batch, seq, p, elem)]
    if layout == "single" or p == 1:
        return []
    if layout in GRID:
        return _grid_events(layout, cfg, batch, seq, q, rank, elem).tagged()
    return _metp_events(cfg, batch, seq, p, rank, elem).tagged()


def comm_events(layout: str, cfg: GPT2Config, batch: int, seq: int, p: int, elem: int = 4,
                rank: int = 0) -> list[Comm]:
    """The communication of one training step on tensor-parallel rank ``rank`` (see the module docstring for
    the schedule of each layout); ``totals()`` of it is what ``comm.STATS`` counts on that rank.

    ``"single"`` and ``p == 1`` send nothing (``[]``), except ``"tp1d"``, which is
    :func:`lightning_tp2d.bench.tp1d.tp1d_comm_events`. Events are merged where identical (same kind, group,
    bytes, overlap and phase). Only the shapes that decide byte counts are validated (hidden size, batch or
    sequence divisibility); head-count divisibility is not checked.
    """
    return [ev for ev, _ in _tagged_events(layout, cfg, batch, seq, p, elem, rank)]


# ---- FLOPs ----------------------------------------------------------------------------------------------------


def flops(layout: str, cfg: GPT2Config, batch: int, seq: int, p: int) -> dict:
    """FLOPs one rank computes in one training step: ``{"forward", "backward", "total", "matmul", "attention"}``
    (``matmul + attention == total``). Matmuls ``2 m k n``; attention ``4 d`` per visible score forward and ``10 d``
    backward (flash kernels recompute the scores), summed over local heads (``width`` = their ``H*d``).

    ================  ===============================  ==========================  ============================
    layout            linears (fwd / bwd) per block    attention (visible scores)  LM head (fwd / bwd)
    ================  ===============================  ==========================  ============================
    single            24 N h² / 48 N h²                N_seq T(T+1)/2, width h     2 N h V / 4 N h V
    tp1d              single / p                       width h/p                   with ceil(V/p) / same
    2d, 2d-metp       single / p (SUMMA panels)        width h/q, B/q sequences    2 (N/q) h ceil(V/q) / x2
    metp              24 n h² / 56 n h² (n = N/p)      zigzag ring, width h        2 n h V / 6 n h V
    ================  ===============================  ==========================  ============================

    METP recomputes ``X W1`` in the MLP backward and the logits in the LM-head backward; its ring attention
    computes exactly the visible scores (no fully masked block, the diagonal block causally), which sum to the
    causal count of the whole sequence. Elementwise work (LayerNorm, GELU, softmax of the loss) is not counted.
    Heads need not divide ``p`` here (widths are ``h/p``, ``h/q``).
    """
    q = _check(layout, cfg, batch, seq, p)
    h, V, L, T, B = cfg.n_embd, cfg.vocab_size, cfg.n_layer, seq, batch
    N = B * T
    causal = T * (T + 1) / 2  # visible scores per sequence and head
    if layout in ("single", "tp1d"):
        k = 1 if layout == "single" else p
        vocab = V if layout == "single" else -(-V // p)
        lin_f, lin_b = 24.0 * N * h * h / k, 48.0 * N * h * h / k
        att_f, att_b = 4.0 * (h / k) * B * causal, 10.0 * (h / k) * B * causal
        head_f, head_b = 2.0 * N * h * vocab, 4.0 * N * h * vocab
    elif layout in GRID:
        n, rows = N / q, -(-V // q)
        lin_f, lin_b = 24.0 * n * h * h / q, 48.0 * n * h * h / q
        if layout == "2d":
            scores = (B / q) * causal  # local sequences, full causal attention each
        else:
            c = T / (2 * q)  # ring along row: q steps per sequence
            scores = B * (c * (2 * c + 1) + (q - 1) * 2 * c * c)
        att_f, att_b = 4.0 * (h / q) * scores, 10.0 * (h / q) * scores
        head_f, head_b = 2.0 * n * h * rows, 4.0 * n * h * rows
    else:  # metp
        n, c = N / p, T / (2 * p)
        lin_f = 2.0 * n * h * (3 * h + h) + 16.0 * n * h * h
        lin_b = 4.0 * n * h * (3 * h + h) + 40.0 * n * h * h
        scores = B * (c * (2 * c + 1) + (p - 1) * 2 * c * c)
        att_f, att_b = 4.0 * h * scores, 10.0 * h * scores
        head_f, head_b = 2.0 * n * h * V, 6.0 * n * h * V
    fwd = L * (lin_f + att_f) + head_f
    bwd = L * (lin_b + att_b) + head_b
    attention = L * (att_f + att_b)
    return {"forward": fwd, "backward": bwd, "total": fwd + bwd, "matmul": fwd + bwd - attention,
            "attention": attention}


# ---- saved activations --------------------------------------------------------------------------------------


def activation_bytes(layout: str, cfg: GPT2Config, batch: int, seq: int, p: int, elem: int = 4,
                     rank: int | None = None) -> int:
    """Bytes the forward leaves alive for the backward on one rank (``rank=None``: the largest over the ranks):
    the tensors autograd saved that the forward created.

    Counted: every saved activation below, LayerNorm statistics, attention log-sum-exps (lse), saved index
    tensors the forward made, and, for ``elem`` 2 (bf16 autocast, float32 parameters), the bf16 copies of the
    weight blocks the matmuls saved. Not counted: parameters and their views, ``idx`` and ``targets`` and their
    views, scalars (the loss, counts), allocator rounding, kernels' internal scratch, and whatever is freed before
    the forward returns (ring receive buffers, SUMMA panels, score tiles, full-width logits that never exist).
    ``e = elem``; ``ep`` = 4 (8 for float64) for what stays float32 under autocast: the residual stream (it starts
    from the float32 embeddings), LayerNorm inputs and statistics, lse, the loss's softmax. Per block and rank:

    ``"single"`` (``N = B*T``)
        ``N h (2 ep + 14 e)``: the two LayerNorm inputs (``ep``); the two LayerNorm outputs, q|k|v (3), the
        attention output (1; SDPA lays it out ``[B, T, H, d]``, so the head merge is a view), the MLP
        pre-activation (4) and GELU output (4), all ``e``; plus ``4 N ep`` (mean, rstd) and ``B H T ep`` (lse).
    ``"tp1d"`` (Megatron without sequence parallelism: torch's ColwiseParallel / RowwiseParallel)
        ``N h (2 ep + 2 e) + 12 N h e / p``: LayerNorm inputs and outputs full on every rank, the column-parallel
        outputs (q|k|v, attention output, MLP pre-activation, GELU output) split; ``4 N ep``, ``B H T ep / p``.
    ``"2d"`` (``n = N/q`` tokens, ``h/q`` features)
        ``n h/q (2 ep + 14 e)`` -- every tensor of "single" split ``p`` ways; ``4 n ep``; ``B H T ep / p``.
    ``"2d-metp"``
        ``n h/q (2 ep + 15 e)``: as "2d", plus the copy that transposes the ring's ``[B, H, S, d]`` output for
        ``c_proj`` (the ring keeps q|k|v as one contiguous ``[3, B, H/q, S, d]``); ``4 n ep``; ``B H T ep / p``.
    ``"metp"`` (``n = N/p`` tokens, full ``h``)
        ``n h (2 ep + 6 e)``: LayerNorm inputs, LayerNorm outputs (2), q|k|v (3), attention output (1); the MLP
        keeps only its input (``X W1`` is recomputed in backward); ``4 n ep``; lse ``B H (T/p) ep``.

    Outside the blocks: the final LayerNorm's input, statistics and output (``n h ep + 2 n ep + n h e`` with the
    rank's ``n`` and width), position ids (``8 T``; the ring layouts ``8 T/p``, ``8 T/q``), and the loss:
    single the log-softmax ``N V ep``; tp1d the local log-softmax ``N ceil(V/p) ep`` and the embedding's
    masked ids ``8 N``; 2d / 2d-metp the softmax block ``n Vr ep`` (``Vr = ceil(V/q)``), shifted targets and
    two masks ``10 n``, and the mirror's weight block ``Vr h/q e`` the head's SUMMA keeps (off-diagonal ranks;
    diagonal ranks only when their block is padded, or under autocast); 2d-metp also the zigzag ids ``8 N``;
    metp the lse ``n ep``, zigzag ids and targets ``16 n``, and the padded vocabulary block ``Vb h e`` on the
    ranks whose block is short (every rank under autocast). With ``elem`` 2 every rank also keeps the bf16 copy
    of each weight block it multiplies: ``12 h² e / p`` per block (``12 h² e`` single) and the head's block.

    Checked against :class:`~lightning_tp2d.bench.measure.LiveTensorBytes` on CPU (gpt2-tiny shapes, float32 and
    bf16 autocast, ``tests/test_cost_model.py``): equal up to scalars once the tracker ignores parameter
    storages (within 0.5%). Two things the tracker adds that this estimate does not: it counts the storage of any
    tensor first seen inside it, so a saved *view* of a parameter (``weight.t()`` in ``F.linear``, the SUMMA and
    ring blocks) or of ``idx`` / ``targets`` (a batch-shard view) counts the whole parameter or input. On GPU,
    SDPA's memory-efficient kernel pads lse to a multiple of 32 rows and the allocator rounds to 512 bytes.
    """
    q = _check(layout, cfg, batch, seq, p)
    h, V, L, T, B, H = cfg.n_embd, cfg.vocab_size, cfg.n_layer, seq, batch, cfg.n_head
    N = B * T
    e, ep = elem, _ep(elem)
    autocast = elem < 4
    weights = 12 * h * h * e  # bf16 copies of one block's weights (autocast only)
    if rank is not None and not 0 <= rank < p:
        raise ValueError(f"rank {rank} is not in [0, {p})")
    ranks = range(p) if rank is None else [rank]

    def ln(tokens: float, width: float, out_e: int) -> float:
        """A LayerNorm: input (ep), mean and rstd (ep), output as the next matmul saves it."""
        return tokens * width * ep + 2 * tokens * ep + tokens * width * out_e

    if layout in ("single", "tp1d"):
        k = 1 if layout == "single" else p
        per_block = N * h * (2 * ep + 2 * e) + 12 * N * h * e / k + 4 * N * ep + B * H * T * ep / k
        vocab = V if layout == "single" else -(-V // p)
        total = L * per_block + ln(N, h, e) + N * vocab * ep + 8 * T
        if layout == "tp1d":
            total += 8 * N  # the embedding's masked copy of the ids (DTensor _MaskPartial)
        if autocast:
            total += L * weights / k + vocab * h * e
        return int(total)
    if layout in GRID:
        n, hq, rows = N // q, h // q, -(-V // q)
        copies = 14 if layout == "2d" else 15  # 2d-metp: the ring output [B, H, S, d] is transposed by a copy
        per_block = n * hq * (2 * ep + copies * e) + 4 * n * ep + B * H * T * ep / p
        total = L * per_block + ln(n, hq, e) + n * rows * ep + 10 * n
        if layout == "2d":
            total += 8 * T
        else:
            total += 8 * T // q + 8 * N  # position ids of the zigzag rows, zigzag token ids of every row
        if autocast:
            total += L * weights / p
        worst = 0
        for rk in ranks:
            r, c = divmod(rk, q)
            own_rows = _shard(V, q, r)
            keeps = r != c or own_rows < rows or autocast  # a new [Vr, h/q] tensor saved by the head's SUMMA
            worst = max(worst, rows * hq * e if keeps else 0)
        return int(total + worst)
    # metp
    n, Vb = N // p, -(-V // p)
    per_block = n * h * (2 * ep + 6 * e) + 4 * n * ep + B * H * (T // p) * ep
    total = L * per_block + ln(n, h, e) + n * ep + 16 * n + 8 * (T // p)
    if autocast:
        total += L * weights / p
    worst = max((Vb * h * e if (_shard(V, p, i) < Vb or autocast) else 0) for i in ranks)
    return int(total + worst)


def _shard(size: int, n: int, index: int) -> int:
    """Rows of chunk ``index`` when ``size`` is split DTensor-style (``ceil(size/n)`` each, the last ones short)."""
    chunk = -(-size // n)
    start = min(index * chunk, size)
    return min(start + chunk, size) - start


# ---- time model ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """A link's per-message latency and per-direction bandwidth (bytes per second) seen by one GPU."""

    latency_s: float
    bandwidth_Bps: float


@dataclass(frozen=True)
class Hardware:
    """Sustained dense rates of one GPU and its links inside and between nodes."""

    name: str
    matmul_flops_per_s: float
    attention_flops_per_s: float
    intra: Link
    inter: Link
    gpus_per_node: int


# Assumptions, not measurements: realistic sustained rates, not datasheet peaks. H100 SXM: bf16 dense peak
# ~989e12, large GEMMs sustain ~700e12; flash attention (FA2/FA3) ~500e12. NVLink 4: 900 GB/s total = ~450 GB/s
# per direction, ~3 us per message; NDR InfiniBand 400 Gb/s = 50 GB/s per GPU (one NIC each), ~5 us.
H100_NVLINK4_NDR = Hardware("H100 SXM, NVLink 4 (8/node), NDR 400G", 700e12, 500e12,
                            intra=Link(3e-6, 450e9), inter=Link(5e-6, 50e9), gpus_per_node=8)
# A100 SXM: bf16 dense peak 312e12, GEMMs ~230e12, FA2 ~190e12. NVLink 3: 600 GB/s total = ~300 GB/s per
# direction; HDR InfiniBand 200 Gb/s = 25 GB/s per GPU.
A100_NVLINK3_HDR = Hardware("A100 SXM, NVLink 3 (8/node), HDR 200G", 230e12, 190e12,
                            intra=Link(3e-6, 300e9), inter=Link(5e-6, 25e9), gpus_per_node=8)


def collective_time(kind: str, n: int, nbytes: float, link: Link) -> float:
    """Seconds for one call of ``kind`` over ``n`` ranks with ``nbytes`` payload (the ``Comm.nbytes`` convention).

    Broadcast / reduce (pipelined tree): ``latency * ceil(log2 n) + nbytes / bw``; ring all-reduce:
    ``2(n-1) latency + 2(n-1)/n * nbytes / bw``; all-gather (of the local input): ``(n-1)(latency + nbytes/bw)``;
    reduce-scatter (of the full input): ``(n-1)(latency + nbytes/(n bw))``; send and ring exchange:
    ``latency + nbytes / bw``. A ``recv`` costs nothing: it is the other direction of the matching ``send``
    (full-duplex links), so a swap is charged once.
    """
    lat, bw = link.latency_s, link.bandwidth_Bps
    if kind == "recv" or n <= 1:
        return 0.0
    if kind in ("broadcast", "reduce"):
        return lat * math.ceil(math.log2(n)) + nbytes / bw
    if kind == "all_reduce":
        return 2 * (n - 1) * lat + 2 * (n - 1) / n * nbytes / bw
    if kind == "all_gather":
        return (n - 1) * (lat + nbytes / bw)
    if kind == "reduce_scatter":
        return (n - 1) * (lat + nbytes / (n * bw))
    if kind in ("send", "ring_exchange"):
        return lat + nbytes / bw
    raise ValueError(f"unknown communication kind {kind!r}")


def _group_ranks(layout: str, event: Comm, rank: int, p: int) -> list[int]:
    """Global ranks (the tensor-parallel group starting at 0) that one call of ``event`` on ``rank`` involves."""
    if layout in GRID:
        q = math.isqrt(p)
        r, c = divmod(rank, q)
        if event.group == "col":  # same row: consecutive ranks
            return [r * q + k for k in range(q)]
        if event.group == "row":  # same column: stride q
            return [k * q + c for k in range(q)]
        if event.kind in ("send", "recv"):  # the LM head's swap with the mirror rank
            return [rank, c * q + r]
    return list(range(p))


def _link(hw: Hardware, ranks: list[int]) -> Link:
    return hw.intra if len({g // hw.gpus_per_node for g in ranks}) == 1 else hw.inter


def step_time(layout: str, cfg: GPT2Config, batch: int, seq: int, p: int, hw: Hardware, elem: int = 2) -> dict:
    """Projected seconds of one training step: ``compute_s = matmul FLOPs / matmul rate + attention FLOPs /
    attention rate``; per call ``t`` from :func:`collective_time` on its group's link, exposed
    ``max(0, t - overlap_flops / rate)``; ``total_s = compute_s + exposed_comm_s``. Ranks wait for each other, so
    the step is its slowest rank's (returned, with ``rank``); ``comm_bytes`` is that rank's payload as
    ``comm.STATS`` counts it. Also returned: ``flops`` (:func:`flops`)."""
    fl = flops(layout, cfg, batch, seq, p)
    rates = {"matmul": hw.matmul_flops_per_s, "attention": hw.attention_flops_per_s}
    compute = fl["matmul"] / rates["matmul"] + fl["attention"] / rates["attention"]
    worst = None
    for rank in _representative_ranks(layout, p):
        comm_s = exposed = 0.0
        nbytes = 0
        for ev, rate in _tagged_events(layout, cfg, batch, seq, p, elem, rank):
            t = collective_time(ev.kind, ev.group_size, ev.nbytes, _link(hw, _group_ranks(layout, ev, rank, p)))
            comm_s += ev.calls * t
            exposed += ev.calls * max(0.0, t - ev.overlap_flops / rates[rate])
            nbytes += ev.calls * ev.nbytes
        result = {"compute_s": compute, "comm_s": comm_s, "exposed_comm_s": exposed, "total_s": compute + exposed,
                  "comm_bytes": nbytes, "rank": rank, "flops": fl}
        if worst is None or result["total_s"] > worst["total_s"]:
            worst = result
    return worst


def _representative_ranks(layout: str, p: int) -> list[int]:
    """Every rank where ranks can differ; for tp1d and single all ranks are alike."""
    if layout in ("single", "tp1d"):
        return [0]
    return list(range(p))


def projected_speedup(cfg: GPT2Config, batch: int, seq: int, gpus=(4, 16, 64), hw: Hardware = H100_NVLINK4_NDR,
                      elem: int = 2) -> list[dict]:
    """For each GPU count ``N`` (one tensor-parallel group of ``p = N`` ranks, no data parallelism): the step
    time of ``"2d"`` (a ``sqrt(N) x sqrt(N)`` grid) and of ``"tp1d"``, and ``speedup = tp1d / 2d`` (> 1: 2d is
    faster). Each entry: ``gpus``, ``q``, ``nodes``, ``tp1d`` and ``2d`` (:func:`step_time` dicts), ``tp1d_s``,
    ``2d_s``, ``speedup``. Head-count divisibility is ignored (the model's widths are split, not its heads);
    ``batch`` must divide by every ``q`` and ``n_embd`` by every ``N``."""
    out = []
    for n in gpus:
        q = math.isqrt(n)
        if q * q != n:
            raise ValueError(f"the 2d layout needs a square number of GPUs, got {n}")
        t2d = step_time("2d", cfg, batch, seq, n, hw, elem)
        t1d = step_time("tp1d", cfg, batch, seq, n, hw, elem)
        out.append({"gpus": n, "q": q, "nodes": -(-n // hw.gpus_per_node), "tp1d": t1d, "2d": t2d,
                    "tp1d_s": t1d["total_s"], "2d_s": t2d["total_s"], "speedup": t1d["total_s"] / t2d["total_s"]})
    return out


def metp_overlap_threshold(cfg: GPT2Config, hw: Hardware, elem: int = 2, causal: bool = True) -> int:
    """Smallest per-rank sequence length ``S = seq/p`` (even: two zigzag chunks) for which one forward ring step's
    attention compute hides its ``K|V`` transfer on the intra-node link (DESIGN 3.2), one sequence:

    ``2 h S² / attention_rate >= latency + 2 S h elem / bandwidth``.

    Causal halving: with the zigzag split every off-diagonal step sees half of the ``S x S`` block (``S²/2``
    scores, ``4 h`` FLOPs per score per the full width, so ``2 h S²``). With ``causal=False`` (a full ``S x S``
    block, ``4 h S²``, DESIGN's ``seq/p >= elem * F / (2 bw)``) the threshold halves. Without latency the
    causal threshold is ``elem * rate / bw``: ~1.3k tokens on the A100 preset (DESIGN quotes ~1k from the
    312e12 peak and the non-causal block).
    """
    h, lat, bw = cfg.n_embd, hw.intra.latency_s, hw.intra.bandwidth_Bps
    a = (2.0 if causal else 4.0) * h / hw.attention_flops_per_s  # seconds per S²
    b = 2.0 * h * elem / bw  # seconds per S
    s = (b + math.sqrt(b * b + 4 * a * lat)) / (2 * a)  # root of a S² - b S - lat
    S = max(2, math.ceil(s - 1e-9))
    S += S % 2
    while S > 2 and a * (S - 2) ** 2 >= lat + b * (S - 2):  # guard against rounding
        S -= 2
    while a * S * S < lat + b * S:
        S += 2
    return S
