"""SUMMA matrix products on the ``q x q`` grid, as autograd functions, in two algorithms.

Every operand is a matrix cut into ``q x q`` equal blocks, block ``(i, j)`` held by grid rank ``(i, j)``
(``row`` coordinate ``i``, ``col`` coordinate ``j``). The ranks of one grid row form the ``col`` axis, those of
one grid column the ``row`` axis.

**Broadcast** (``TPOptions(summa="broadcast")``; Optimus, Xu et al. 2021). Per step ``l = 0..q-1``:

=================  =========================================================  ================================
product            rank (i, j) at step l                                      result block at (i, j)
=================  =========================================================  ================================
``C = A B``        bcast ``A_il`` along col, ``B_lj`` along row; ``C_ij += A_il B_lj``   ``C_ij``
``C = A Bᵀ``       bcast ``B_lj`` along row; ``P = A_ij B_ljᵀ``; reduce P along col to col l  ``C_ij``
``C = Aᵀ B``       bcast ``A_il`` along col; ``P = A_ilᵀ B_ij``; reduce P along row to row l  ``C_ij``
=================  =========================================================  ================================

The broadcast for step ``l+1`` is posted before the multiply of step ``l`` (double-buffered panels); the reduce of
step ``l`` runs while step ``l+1`` multiplies. A ``q = 2`` broadcast is a one-way transfer, and the first panel's
broadcast and the last reduce of every product are exposed.

**Collective** (the default; collective matmul, Wang et al. 2023, on the grid's rows). The activation-sized
operand travels point-to-point round the ``col`` ring in *both* directions; the weight-sized operand moves in one
async collective along ``row``:

* ``C = A B``: all-gather the column ``B_kj`` (all ``k``) along ``row``; ``A``'s blocks arrive from both neighbours,
  ``A_i,j-s`` from the left and ``A_i,j+s`` from the right at step ``s = 1..q//2`` (a rank relays what it received
  the step before), so every block travels the shorter way round and every rank sends and receives at every step.
  Step 0 multiplies the rank's own block while step 1's transfers fly: only the weight gather is exposed.
* ``C = A Bᵀ`` (``dX = dY Wᵀ``): gather the column of ``B`` along ``row``; the partial products ``A_ij B_kjᵀ`` for
  every target ``k`` are reduce-scattered round the ``col`` ring in both directions: a partial sum starts ``q//2``
  ranks left (or ``(q-1)//2`` right) of its target and picks up each rank's contribution on the way, the next
  contribution computed while the sum travels; the own block's contribution is computed last.
* ``C = Aᵀ B`` (``dW = Xᵀ dY``): ``A``'s blocks travel as in ``A B``; the partials ``A_ikᵀ B_ij`` are stacked and
  reduce-scattered along ``row`` in one async call (weight-sized).

``C = A B`` also has a *scatter* form (:func:`scatter_ab`), chosen per linear by :func:`ab_form` when the output
is narrower than the input: rank ``(r, k)`` swaps its weight block with its mirror and gathers row ``k`` of ``B``
along ``row``, then reduce-scatters the partials ``A_rk B_kc`` round the ring; its backward passes ``dC``'s blocks
round once, feeding both ``dA`` (accumulated locally) and the ``dB`` partials.

The backward of ``A B`` (gather form) runs ``dA`` and ``dB`` in one loop, so the gradient ring's transfers overlap the weight
gradient's multiplies and the operand ring's transfers overlap the gradient's. Per rank and product the
activation bytes sent are those of the broadcast form (``(q-1)`` blocks), but both directions of every link work
and nothing of the ring is exposed when a block's multiply outlasts its transfer.

``keep_panels`` (``TPOptions(keep_panels=True)``, either algorithm, product ``A B``): the forward keeps the ``A``
blocks and ``B`` panels it gathered for the backward, so the weight gradient needs no second gather of ``A``; it
costs ``q - 1`` more ``A``-sized blocks of saved activations per product.

Blocks may be passed as transposed views of contiguous storage (``w_local.t()`` for a torch ``Linear`` weight
stored ``[out, in]``): the storage is what travels, and the receiver transposes its view. All ranks must pass
blocks of the same shape and layout.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from lightning_tp2d import float8 as f8
from lightning_tp2d.comm import (BroadcastPipeline, ReducePipeline, all_gather_blocks, axis_rank, axis_size,
                                 exchange_with, neighbour_exchange, reduce_scatter_blocks, summed_later)
from lightning_tp2d.mesh import transpose_peer
from lightning_tp2d.ops import registered
from lightning_tp2d.options import TPOptions, tp_options

_GATHER, _REDUCE = 0, 1  # point-to-point tags of the two rings the collective backward keeps in flight


def _is_transposed(t: torch.Tensor) -> bool:
    """True for a 2-D transposed view of contiguous storage (``x.t()`` of a contiguous ``x``), read from the strides
    (``t.t().is_contiguous()`` would dispatch a view op per operand and product)."""
    if t.dim() != 2 or t.is_contiguous():
        return False
    (rows, cols), (row_stride, col_stride) = t.shape, t.stride()
    return (rows <= 1 or row_stride == 1) and (cols <= 1 or col_stride == rows)


def _wire(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The contiguous tensor to send for block ``t``, and whether the receiver must transpose it back."""
    if _is_transposed(t):
        return t.t(), True
    return t.contiguous(), False


# ---- broadcast SUMMA ----------------------------------------------------------------------------------------------


class _Panels:
    """Double-buffered broadcasts of one operand's blocks along ``axis`` (see :class:`BroadcastPipeline`),
    sending transposed views as their contiguous storage; with ``panels`` given, those (kept) blocks instead."""

    def __init__(self, block: torch.Tensor, mesh: DeviceMesh, axis: str, panels=None) -> None:
        self.panels = panels
        if panels is None:
            wire, self.transposed = _wire(block)
            self.pipeline = BroadcastPipeline(wire, mesh, axis)

    def get(self, l: int) -> torch.Tensor:
        if self.panels is not None:
            return self.panels[l]
        buf = self.pipeline.get(l)
        return buf.t() if self.transposed else buf


def broadcast_ab(a: torch.Tensor, b: torch.Tensor, mesh: DeviceMesh, keep: bool = False,
                 bias: torch.Tensor | None = None, gemm: f8.Gemm = f8.HIGH):
    """``C = A B [+ bias]`` on local blocks, no autograd: ``(c, a_panels, b_panels)``, the panels as lists when
    ``keep``; ``bias`` (``C``'s columns) added by the first panel product. ``gemm`` multiplies each partial (high
    precision, or float8: :mod:`lightning_tp2d.float8`), here and in every algorithm below."""
    q = axis_size(mesh, "col")
    a_panels, b_panels = _Panels(a, mesh, "col"), _Panels(b, mesh, "row")
    out, kept_a, kept_b = None, [], []
    for l in range(q):
        a_l, b_l = a_panels.get(l), b_panels.get(l)
        out = gemm.first(a_l, b_l, bias) if out is None else gemm.addmm_(out, a_l, b_l)
        if keep:
            kept_a.append(a_l)
            kept_b.append(b_l)
    return out, (kept_a if keep else None), (kept_b if keep else None)


def broadcast_abt(a: torch.Tensor, b: torch.Tensor, mesh: DeviceMesh, b_panels=None,
                  gemm: f8.Gemm = f8.HIGH) -> torch.Tensor:
    """``C = A Bᵀ`` on local blocks, no autograd. ``a`` [M/q, K/q], ``b`` [N/q, K/q] -> [M/q, N/q]."""
    q = axis_size(mesh, "col")
    panels, reducer = _Panels(b, mesh, "row", b_panels), ReducePipeline(mesh, "col")
    for l in range(q):
        reducer.push(gemm.mm(a, panels.get(l).t()), dst=l)
    return reducer.finish()


def broadcast_atb(a: torch.Tensor, b: torch.Tensor, mesh: DeviceMesh, out_transposed: bool = False,
                  a_panels=None, gemm: f8.Gemm = f8.HIGH) -> torch.Tensor:
    """``C = Aᵀ B`` on local blocks, no autograd. ``a`` [M/q, K/q], ``b`` [M/q, N/q] -> [K/q, N/q].

    With ``out_transposed`` the result is returned as the transposed view of a contiguous ``[N/q, K/q]``
    block (the layout of a torch ``Linear`` weight gradient), computed as ``Bᵀ A`` with no extra copy.
    """
    q = axis_size(mesh, "col")
    panels, reducer = _Panels(a, mesh, "col", a_panels), ReducePipeline(mesh, "row")
    for l in range(q):
        a_l = panels.get(l)
        reducer.push(gemm.mm(b.t(), a_l) if out_transposed else gemm.mm(a_l.t(), b), dst=l)
    out = reducer.finish()
    return out.t() if out_transposed else out


# ---- collective SUMMA -------------------------------------------------------------------------------------------


def ring_steps(n: int) -> int:
    """Steps of a bidirectional ring pass over ``n`` ranks: the own block, then ``n // 2`` transfers."""
    return n // 2 + 1


def ring_order(n: int, i: int) -> list[list[int]]:
    """The coordinates whose blocks rank ``i`` holds at each step of :class:`_RingGather`: ``[i]``, then
    ``[i-s, i+s]`` (``i+s`` only while ``s <= (n-1)//2``), mod ``n``."""
    left, right = n // 2, (n - 1) // 2
    return [[i]] + [[(i - s) % n] + ([(i + s) % n] if s <= right else []) for s in range(1, left + 1)]


class _Column:
    """The ``row`` axis' blocks of a weight-sized operand, gathered in one async all-gather (transposed views
    travel as their storage): ``get(k)`` is block ``k``, waiting for the gather the first time."""

    def __init__(self, blocks: torch.Tensor, transposed: bool, handle=None) -> None:
        self.blocks, self.transposed, self.handle = blocks, transposed, handle
        self.views: dict[bool, tuple[torch.Tensor, ...]] = {}  # every block's view, cut once (not two ops per get)

    @classmethod
    def gather(cls, b: torch.Tensor, mesh: DeviceMesh) -> _Column:
        wire, transposed = _wire(b)
        blocks, handle = all_gather_blocks(wire, mesh, "row")
        return cls(blocks, transposed, handle)

    def get(self, k: int, t: bool = False) -> torch.Tensor:
        """Block ``k`` (``t``: its transpose, the stored block itself when transposed views travel)."""
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
        flip = self.transposed != t
        if flip not in self.views:
            self.views[flip] = (self.blocks.transpose(-1, -2) if flip else self.blocks).unbind(0)
        return self.views[flip][k]


def reduce_order(n: int, i: int) -> list[int]:
    """The targets :class:`_RingReduce` computes partials for on rank ``i``, in order: each step's rightward sum's
    target, then its leftward one's, the own block last."""
    right, left = n // 2, (n - 1) // 2
    order = []
    for s in range(right):
        order.append((i + right - s) % n)
        if s < left:
            order.append((i - left + s) % n)
    return order + [i]


class _ColumnStream:
    """The ``row`` axis' blocks of a weight-sized operand one broadcast each (:class:`BroadcastPipeline`), in the
    order ``get`` will ask for them (the same on every rank of the axis: it depends on the ``col`` coordinate only),
    two ahead. For a weight column larger than the activation block that travels (the LM head at a few thousand
    tokens), ``q`` blocks at once would cost more memory than one call saves; the stream holds three."""

    def __init__(self, b: torch.Tensor, mesh: DeviceMesh, order, mirrored: bool = True) -> None:
        wire, self.transposed = _wire(b)
        if not mirrored:
            wire = exchange_with(wire, transpose_peer(mesh))
        self.pipeline = BroadcastPipeline(wire, mesh, "row", order=order, ahead=2)

    def get(self, k: int, t: bool = False) -> torch.Tensor:
        """Block ``k`` (``t``: its transpose), as :meth:`_Column.get`."""
        buf = self.pipeline.get(k)
        return buf.t() if self.transposed != t else buf


def _streams(a: torch.Tensor, b: torch.Tensor, mesh: DeviceMesh, keep: bool) -> bool:
    """Stream the weight column (:class:`_ColumnStream`) rather than gather it: when it outweighs the block ``a`` and
    is not kept for the backward."""
    return not keep and axis_size(mesh, "row") * b.numel() * b.element_size() > a.numel() * a.element_size()


def _flat(order: list[list[int]]) -> list[int]:
    return [k for step in order for k in step]


class _RingGather:
    """An operand's ``col``-axis blocks, travelling both ways round the ring (:func:`ring_order`). ``step(s)``,
    called for ``s = 0 .. ring_steps - 1`` in order, returns ``[(k, block k)]`` after posting step ``s+1``'s
    transfers (the caller multiplies while they fly): send left-travelling blocks on to ``i+1``, right-travelling
    ones to ``i-1``."""

    def __init__(self, block: torch.Tensor, mesh: DeviceMesh, tag: int) -> None:
        self.mesh, self.tag = mesh, tag
        self.n, self.i = axis_size(mesh, "col"), axis_rank(mesh, "col")
        self.left_steps, self.right_steps = self.n // 2, (self.n - 1) // 2
        self.left = self.right = block.contiguous()
        self.handle = self.incoming = None

    def step(self, s: int) -> list[tuple[int, torch.Tensor]]:
        if s > 0:
            self.handle.wait()
            self.left, self.right = self.incoming
        if s < self.left_steps:
            from_prev = [torch.empty_like(self.left)]
            to_prev = [self.right] if s < self.right_steps else []
            from_next = [torch.empty_like(self.right)] if to_prev else []
            self.handle = neighbour_exchange(self.mesh, "col", to_next=[self.left], from_prev=from_prev,
                                             to_prev=to_prev, from_next=from_next, tag=self.tag)
            self.incoming = (from_prev[0], from_next[0] if from_next else None)
        if s == 0:
            return [(self.i, self.left)]
        held = [((self.i - s) % self.n, self.left)]
        if s <= self.right_steps:
            held.append(((self.i + s) % self.n, self.right))
        return held


class _RingReduce:
    """Reduce-scatter along ``col`` of partials computed on demand, both ways round the ring. ``step(s, compute)``
    for ``s = 0 .. ring_steps - 1``: ``compute(k)`` returns this rank's partial for target coordinate ``k`` (a fresh
    tensor, summed into in place). A sum for target ``k`` starts at ``k - n//2`` travelling right (or at
    ``k + (n-1)//2`` travelling left), each rank adding its partial before passing it on; the last step computes the
    own partial and returns the finished block."""

    def __init__(self, mesh: DeviceMesh, tag: int) -> None:
        self.mesh, self.tag = mesh, tag
        self.n, self.i = axis_size(mesh, "col"), axis_rank(mesh, "col")
        self.right_sends, self.left_sends = self.n // 2, (self.n - 1) // 2
        self.handle = self.from_prev = self.from_next = None

    def step(self, s: int, compute) -> torch.Tensor | None:
        n, i = self.n, self.i
        if s == self.right_sends:  # the last step: the own block
            own = compute(i)
            if self.handle is not None:
                self.handle.wait()
            if self.from_prev is not None:
                own += self.from_prev
            if self.from_next is not None:
                own += self.from_next
            return own
        rightward = compute((i + self.right_sends - s) % n)
        leftward = compute((i - self.left_sends + s) % n) if s < self.left_sends else None
        if self.handle is not None:
            self.handle.wait()
            rightward += self.from_prev
            if leftward is not None:
                leftward += self.from_next
        to_prev = [leftward] if leftward is not None else []
        from_next = [torch.empty_like(leftward)] if to_prev else []
        from_prev = [torch.empty_like(rightward)]
        self.handle = neighbour_exchange(self.mesh, "col", to_next=[rightward], from_prev=from_prev,
                                         to_prev=to_prev, from_next=from_next, tag=self.tag)
        self.from_prev = from_prev[0]
        if from_next:
            self.from_next = from_next[0]
        return None


def collective_ab(a: torch.Tensor, b: torch.Tensor, mesh: DeviceMesh, keep: bool = False,
                  bias: torch.Tensor | None = None, gemm: f8.Gemm = f8.HIGH):
    """``C = A B [+ bias]`` on local blocks, no autograd: ``(c, a_panels, column)``; with ``keep`` the ``A`` blocks
    in coordinate order and the gathered :class:`_Column` of ``B``, else ``None``. A weight column that outweighs
    ``A``'s block is streamed block by block instead (:class:`_ColumnStream`; never kept). ``bias`` as in
    :func:`broadcast_ab`."""
    if _streams(a, b, mesh, keep):
        column = _ColumnStream(b, mesh, _flat(ring_order(axis_size(mesh, "col"), axis_rank(mesh, "col"))))
    else:
        column = _Column.gather(b, mesh)
    ring = _RingGather(a, mesh, _GATHER)
    out, kept = None, {}
    for s in range(ring_steps(ring.n)):
        for k, a_k in ring.step(s):
            b_k = column.get(k)
            out = gemm.first(a_k, b_k, bias) if out is None else gemm.addmm_(out, a_k, b_k)
            if keep:
                kept[k] = a_k
    return out, ([kept[k] for k in range(ring.n)] if keep else None), (column if keep else None)


def collective_abt(a: torch.Tensor, b: torch.Tensor, mesh: DeviceMesh, column: _Column | None = None,
                   gemm: f8.Gemm = f8.HIGH) -> torch.Tensor:
    """``C = A Bᵀ`` on local blocks, no autograd. ``a`` [M/q, K/q], ``b`` [N/q, K/q] -> [M/q, N/q]."""
    column = column or _Column.gather(b, mesh)
    ring = _RingReduce(mesh, _REDUCE)
    for s in range(ring_steps(ring.n)):
        out = ring.step(s, lambda k: gemm.mm(a, column.get(k, t=True)))
    return out


class _Partials:
    """The ``q`` weight-gradient partials of one product, written into one preallocated ``[q, ...]`` buffer as they
    are computed (no second copy to stack them), then reduce-scattered along ``row`` in one async call."""

    def __init__(self, n: int, gemm: f8.Gemm = f8.HIGH) -> None:
        self.n, self.gemm, self.buffer, self.slots = n, gemm, None, ()

    def put(self, k: int, lhs: torch.Tensor, rhs: torch.Tensor) -> None:
        """Partial ``k`` is ``lhs @ rhs``, multiplied straight into its slot (``out=``: no copy; the slots cut once)."""
        if self.buffer is None:
            self.buffer = lhs.new_empty((self.n, lhs.shape[0], rhs.shape[1]), dtype=self.gemm.out_dtype(lhs))
            self.slots = self.buffer.unbind(0)
        self.gemm.into(lhs, rhs, self.slots[k])

    def reduce(self, mesh: DeviceMesh):
        """Post the reduce-scatter (async): ``(out, handle)``."""
        return reduce_scatter_blocks(self.buffer, mesh, "row")


def collective_atb(a: torch.Tensor, b: torch.Tensor, mesh: DeviceMesh, out_transposed: bool = False,
                   a_panels=None, gemm: f8.Gemm = f8.HIGH) -> torch.Tensor:
    """``C = Aᵀ B`` on local blocks, no autograd. ``a`` [M/q, K/q], ``b`` [M/q, N/q] -> [K/q, N/q]
    (``out_transposed``: as :func:`broadcast_atb`). ``a_panels``: the kept ``A`` blocks, no ring pass."""
    n, i = axis_size(mesh, "col"), axis_rank(mesh, "col")
    parts = _Partials(n, gemm)
    ring = _RingGather(a, mesh, _GATHER) if a_panels is None else None
    b_t = b.t() if out_transposed else None  # the fixed operand transposed once, not per block
    for s, ks in enumerate(ring_order(n, i)):
        held = ring.step(s) if ring is not None else [(k, a_panels[k]) for k in ks]
        for k, a_k in held:
            parts.put(k, *((b_t, a_k) if out_transposed else (a_k.t(), b)))
    out, handle = parts.reduce(mesh)
    handle.wait()
    return out.t() if out_transposed else out


def collective_ab_backward(a: torch.Tensor, b: torch.Tensor, grad: torch.Tensor, mesh: DeviceMesh, need_a: bool,
                           need_b: bool, a_panels=None, column: _Column | None = None,
                           gemms: tuple[f8.Gemm, f8.Gemm] = (f8.HIGH, f8.HIGH)):
    """``(dA, dB)`` of ``C = A B`` in one loop: ``dA = dC Bᵀ`` (reduce ring) and ``dB = Aᵀ dC`` (gather ring, or the
    kept ``a_panels``) step together, so each ring's transfers fly behind the other's multiplies; ``dB``'s stacked
    reduce-scatter along ``row`` is posted before ``dA``'s last multiply. ``dB`` comes back in ``b``'s layout.
    ``gemms``: the ``dA`` and the ``dB`` products' partial GEMMs."""
    n, i = axis_size(mesh, "col"), axis_rank(mesh, "col")
    out_t = _is_transposed(b)
    if need_a and column is None:
        column = _ColumnStream(b, mesh, reduce_order(n, i)) if _streams(grad, b, mesh, False) else _Column.gather(b, mesh)
    gather = _RingGather(a, mesh, _GATHER) if need_b and a_panels is None else None
    reduce = _RingReduce(mesh, _REDUCE) if need_a else None
    parts = _Partials(n, gemms[1])
    da = db = db_handle = grad_t = None
    order = ring_order(n, i)
    for s in range(len(order)):
        if need_b:
            held = gather.step(s) if gather is not None else [(k, a_panels[k]) for k in order[s]]
            grad_t = grad.t() if out_t and grad_t is None else grad_t  # transposed once, not per block
            for k, a_k in held:
                parts.put(k, *((grad_t, a_k) if out_t else (a_k.t(), grad)))
            if s == len(order) - 1:
                db, db_handle = parts.reduce(mesh)
        if need_a:
            da = reduce.step(s, lambda k: gemms[0].mm(grad, column.get(k, t=True)))
    if db_handle is not None:
        db_handle.wait()
        db = db.t() if out_t else db
    return da, db


def _mirror_column(b: torch.Tensor, mesh: DeviceMesh, mirrored: bool = False) -> _Column:
    """Row ``k`` of ``B`` on the ranks of grid column ``k``: swap ``B``'s block with the mirror rank (rank ``(r, k)``
    then holds ``B_kr``; ``mirrored``: it already does), then all-gather along ``row`` (block ``c`` of the result is
    ``B_kc``)."""
    wire, transposed = _wire(b)
    if not mirrored:
        wire = exchange_with(wire, transpose_peer(mesh))
    blocks, handle = all_gather_blocks(wire, mesh, "row")
    return _Column(blocks, transposed, handle)


def scatter_ab(a: torch.Tensor, b: torch.Tensor, mesh: DeviceMesh, keep: bool = False, mirrored: bool = False,
               bias: torch.Tensor | None = None, gemm: f8.Gemm = f8.HIGH):
    """``C = A B [+ bias]`` in the *scatter* form, no autograd: ``(c, column)`` (the mirrored column when ``keep``;
    ``bias`` added by the own partial's GEMM, the one that stays on this rank). Rank
    ``(r, k)`` multiplies its own ``A_rk`` by row ``k`` of ``B`` and the partials ``A_rk B_kc`` are reduce-scattered
    round the ``col`` ring, so ``C``-sized blocks travel instead of ``A``-sized ones (the MLP's down projection:
    ``h``-wide instead of ``4h``-wide). ``mirrored``: ``b`` is already the mirror rank's block ``B_kr`` (a weight
    stored that way, :class:`~lightning_tp2d.nn.linear.Linear2D`), so no swap."""
    n, i = axis_size(mesh, "col"), axis_rank(mesh, "col")
    if _streams(a, b, mesh, keep):
        column = _ColumnStream(b, mesh, reduce_order(n, i), mirrored=mirrored)
    else:
        column = _mirror_column(b, mesh, mirrored)
    ring = _RingReduce(mesh, _REDUCE)
    for s in range(ring_steps(ring.n)):
        out = ring.step(s, lambda c: gemm.first(a, column.get(c), bias if c == i else None))
    return out, (column if keep else None)


def scatter_ab_backward(a: torch.Tensor, b: torch.Tensor, grad: torch.Tensor, mesh: DeviceMesh, need_a: bool,
                        need_b: bool, column: _Column | None = None, mirrored: bool = False,
                        gemms: tuple[f8.Gemm, f8.Gemm] = (f8.HIGH, f8.HIGH)):
    """``(dA, dB)`` of :func:`scatter_ab`: one ring pass of ``dC`` along ``col`` feeds both, ``dA_rk = sum_c dC_rc
    B_kcᵀ`` accumulated locally and ``dB_kc`` partials ``A_rkᵀ dC_rc`` stacked, reduce-scattered along ``row`` (posted
    before the last ``dA`` multiplies) and swapped back to the owner of ``B_kc`` (not when ``mirrored``: this rank
    owns it)."""
    n = axis_size(mesh, "col")
    out_t = _is_transposed(b)
    if need_a and column is None:
        if _streams(grad, b, mesh, False):
            column = _ColumnStream(b, mesh, _flat(ring_order(n, axis_rank(mesh, "col"))), mirrored=mirrored)
        else:
            column = _mirror_column(b, mesh, mirrored)
    ring = _RingGather(grad, mesh, _GATHER)
    parts = _Partials(n, gemms[1])
    da = db = db_handle = None
    a_t = None if out_t else a.t()  # the fixed operand transposed once, not per block
    steps = ring_steps(n)
    for s in range(steps):
        held = ring.step(s)
        if need_b:
            for c, g in held:
                parts.put(c, *((g.t(), a) if out_t else (a_t, g)))
            if s == steps - 1:
                db, db_handle = parts.reduce(mesh)
        if need_a:
            for c, g in held:
                b_c = column.get(c, t=True)
                da = gemms[0].mm(g, b_c) if da is None else gemms[0].addmm_(da, g, b_c)
    if db_handle is not None:
        db_handle.wait()
        if not mirrored:
            db = exchange_with(db, transpose_peer(mesh))
        db = db.t() if out_t else db
    return da, db


# ---- autograd -----------------------------------------------------------------------------------------------------


_GRID = ("row", "col")  # a tensorwise float8 scale is the amax over the whole grid's blocks


@registered("summa_ab")
class _SummaAB(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, bias, mesh, options, form, mirrored, float8):
        ctx.mesh, ctx.algorithm, ctx.keep, ctx.form, ctx.mirrored = mesh, options.summa, options.keep_panels, form, mirrored
        ctx.has_bias, ctx.out_dtype, ctx.float8 = bias is not None, a.dtype, None
        if bias is not None:  # added in the products' dtype (bf16 under autocast); its gradient in the parameter's
            ctx.bias_dtype, bias = bias.dtype, bias.to(a.dtype)
        gemm, scales = f8.HIGH, ()
        if float8 is not None:  # tensorwise: the operands cast with their global scales travel and are saved as
            #                     float8, the scales saved last for the backward's GEMMs; rowwise: each partial casts
            ctx.float8 = float8
            a, b, gemm, scales = f8.forward_products(float8, a, b, mesh, _GRID, ctx.out_dtype)
        ctx.scales = len(scales)
        if ctx.algorithm == "broadcast":
            out, a_panels, b_panels = broadcast_ab(a, b, mesh, ctx.keep, bias, gemm)
            ctx.save_for_backward(a, b, *(a_panels + b_panels if ctx.keep else []), *scales)
            return out
        if ctx.form == "scatter":
            out, column = scatter_ab(a, b, mesh, ctx.keep, mirrored, bias, gemm)
            a_panels = []
        else:
            out, a_panels, column = collective_ab(a, b, mesh, ctx.keep, bias, gemm)
        ctx.transposed = column.transposed if ctx.keep else None
        ctx.save_for_backward(a, b, *(a_panels + [column.blocks] if ctx.keep else []), *scales)
        return out

    @staticmethod
    def backward(ctx, grad):
        a, b, *kept = ctx.saved_tensors
        scales = kept[len(kept) - ctx.scales:] if ctx.scales else ()
        kept = kept[:len(kept) - ctx.scales]
        grad = grad.contiguous()
        need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # the bias is replicated over row and each grid row sees its own tokens: its gradient is this row's token sum
        # (in the parameter's dtype), summed over row by an all-reduce that the products' work overlaps
        dbias = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            dbias = summed_later(grad.sum(0, dtype=ctx.bias_dtype), ctx.mesh, "row")
        gemms = (f8.HIGH, f8.HIGH)
        if ctx.float8 is not None:
            grad, gemms = f8.backward_products(ctx.float8, grad, scales, ctx.mesh, _GRID, ctx.out_dtype, ctx.out_dtype)
        if ctx.algorithm == "broadcast":
            q = len(kept) // 2
            a_panels, b_panels = (kept[:q], kept[q:]) if ctx.keep else (None, None)
            da = broadcast_abt(grad, b, ctx.mesh, b_panels, gemms[0]) if need_a else None  # dA = dC Bᵀ
            db = (broadcast_atb(a, grad, ctx.mesh, _is_transposed(b), a_panels, gemms[1])  # dB = Aᵀ dC
                  if need_b else None)
        else:
            a_panels, column = (kept[:-1], _Column(kept[-1], ctx.transposed)) if ctx.keep else (None, None)
            if ctx.form == "scatter":
                da, db = scatter_ab_backward(a, b, grad, ctx.mesh, need_a, need_b, column, ctx.mirrored, gemms)
            else:
                da, db = collective_ab_backward(a, b, grad, ctx.mesh, need_a, need_b, a_panels, column, gemms)
        return da, db, None if dbias is None else dbias(), None, None, None, None, None


def _abt(a, b, mesh, algorithm):
    return broadcast_abt(a, b, mesh) if algorithm == "broadcast" else collective_abt(a, b, mesh)


def _atb(a, b, mesh, algorithm, out_transposed=False):
    fn = broadcast_atb if algorithm == "broadcast" else collective_atb
    return fn(a, b, mesh, out_transposed)


def _ab(a, b, mesh, algorithm):
    fn = broadcast_ab if algorithm == "broadcast" else collective_ab
    return fn(a, b, mesh)[0]


@registered("summa_abt")
class _SummaABt(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, mesh, options):
        ctx.save_for_backward(a, b)
        ctx.mesh, ctx.algorithm = mesh, options.summa
        return _abt(a, b, mesh, ctx.algorithm)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad = grad.contiguous()
        da = _ab(grad, b, ctx.mesh, ctx.algorithm) if ctx.needs_input_grad[0] else None  # dA = dC B
        db = _atb(grad, a, ctx.mesh, ctx.algorithm, _is_transposed(b)) if ctx.needs_input_grad[1] else None  # dCᵀ A
        return da, db, None, None


@registered("summa_atb")
class _SummaAtB(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, mesh, options):
        ctx.save_for_backward(a, b)
        ctx.mesh, ctx.algorithm = mesh, options.summa
        return _atb(a, b, mesh, ctx.algorithm)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad = grad.contiguous()
        da = _abt(b, grad, ctx.mesh, ctx.algorithm) if ctx.needs_input_grad[0] else None  # dA = B dCᵀ
        db = _ab(a, grad, ctx.mesh, ctx.algorithm) if ctx.needs_input_grad[1] else None  # dB = A dC
        return da, db, None, None


FORMS = ("gather", "scatter")


def ab_form(in_features: int, out_features: int, keep_panels: bool = False) -> str:
    """The collective form that moves fewer activation bytes for ``[N, in] @ [in, out]``: ``"gather"`` sends
    ``in``-wide blocks three times per step (``A`` forward, the ``dA`` sums and ``A`` again backward; twice with kept
    panels), ``"scatter"`` sends ``out``-wide blocks twice (the ``C`` sums forward, ``dC`` backward)."""
    return "scatter" if 2 * out_features < (2 if keep_panels else 3) * in_features else "gather"


def summa_ab(a: torch.Tensor, b: torch.Tensor, mesh: DeviceMesh, options: TPOptions | None = None,
             form: str = "gather", b_mirrored: bool = False, bias: torch.Tensor | None = None,
             float8: str | None = None) -> torch.Tensor:
    """``C = A B [+ bias]`` with ``A``, ``B``, ``C`` block-distributed on the grid; differentiable. ``bias``: ``C``'s
    columns of this rank (``[N/q]`` of ``C [M/q, N/q]``, replicated over ``row``), cast to ``A``'s dtype and added
    inside the first GEMM; its gradient, in its own dtype, is the token sum over the whole grid column (each grid
    row's sum, all-reduced over ``row`` while the backward's products run). ``options``:
    :class:`~lightning_tp2d.options.TPOptions` (``summa`` algorithm, ``keep_panels``). ``form`` (collective
    algorithm only; :func:`ab_form` picks one): ``"gather"`` passes ``A``'s blocks round the ring,
    ``"scatter"`` the partial sums of ``C`` (module docstring). ``b_mirrored`` (scatter form only): rank ``(r, c)``
    passes block ``B_cr``, the mirror rank's, so the scatter form needs no swap (its gradient comes back the same
    way). ``float8`` (``"tensorwise"`` / ``"rowwise"``, :mod:`lightning_tp2d.float8`): every partial GEMM of the
    forward and backward in float8 by that recipe (the linears pass ``options.float8``; the heads do not)."""
    options = tp_options(options)
    if form not in FORMS:
        raise ValueError(f"form={form!r} is not one of {', '.join(map(repr, FORMS))}")
    if b_mirrored and (form != "scatter" or options.summa != "collective"):
        raise ValueError(f"b_mirrored needs the collective scatter form, got summa={options.summa!r} form={form!r}")
    return _SummaAB.apply(a, b, bias, mesh, options, form, b_mirrored, f8.check_recipe(float8))


def summa_abt(a: torch.Tensor, b: torch.Tensor, mesh: DeviceMesh, options: TPOptions | None = None) -> torch.Tensor:
    """``C = A Bᵀ`` with ``A``, ``B``, ``C`` block-distributed on the grid; differentiable."""
    return _SummaABt.apply(a, b, mesh, tp_options(options))


def summa_atb(a: torch.Tensor, b: torch.Tensor, mesh: DeviceMesh, options: TPOptions | None = None) -> torch.Tensor:
    """``C = Aᵀ B`` with ``A``, ``B``, ``C`` block-distributed on the grid; differentiable."""
    return _SummaAtB.apply(a, b, mesh, tp_options(options))
