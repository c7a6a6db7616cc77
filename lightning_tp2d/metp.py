"""METP: the ring kernel ``O_i = ⊕_j f(A_i B_j) C_j`` and its attention, MLP and weight-streaming instances.

Memory-efficient tensor parallelism (Liang et al., FITEE 2025; docs/layouts.md, "metp"). The ``p`` ranks of a mesh
axis form a ring. Rank ``i`` keeps its row block ``A_i`` and starts with the pair ``(B_i, C_i)``; the pairs travel round
the ring, so at step ``t = 0..p-1`` rank ``i`` holds the pair of rank ``j = (i - t) mod p`` and folds
``f(A_i B_j) C_j`` into its output (``⊕``: a sum, or the online log-sum-exp merge of attention).

Schedule (:func:`ring_forward`): before computing with the pair it holds, a rank posts the send of that pair to
``i+1`` and the receive of the next one from ``i-1`` into a second buffer, and waits after computing: ``p``
steps, ``p-1`` exchanges, two pair buffers besides its own. The backward (:func:`ring_backward`) rotates the
pairs again (``p-1`` exchanges) together with gradient accumulators ``(dB_j, dC_j)``: each rank adds its
contribution for the block it holds and passes the sum on; after the last step one more exchange brings every
accumulator home (``p`` gradient exchanges, each overlapped with the next step's compute). Where the backward
needs no operand (the embedding), the accumulators start one rank early and arrive home in ``p-1`` exchanges.

Instances here (``N`` local tokens, ``h`` hidden, ``nkv`` key/value heads of width ``d``, ``S`` local sequence
rows, ``F`` the MLP's hidden width):

================  ===========================================  ==========================================
instance          travels (per exchange)                       rank i keeps
================  ===========================================  ==========================================
attention         ``K_j|V_j`` ``[2, B, nkv, S, d]``            ``Q_i`` (``g`` query heads per k/v head),
                                                               output, log-sum-exp
MLP               ``W1_j [f, h]`` (SwiGLU: and ``Wg_j``),      ``X_i [N, h]``; recomputes ``X_i W1_j``
                  ``W2_j [h, f]``, ``f = F/p``                 (``[tile, f]`` row tiles when ``f > h``)
================  ===========================================  ==========================================

One attention kernel (:func:`ring_attention`) serves multi-head (``groups=1``) and grouped-query attention: the
K/V blocks travel at their ``nkv`` heads and every query head of a group attends to the block as it arrives. One
MLP pass (:func:`ring_mlp`) serves GPT-2's GELU and Llama's SwiGLU (``activation``).

The weight-streaming instances (QKV and attention-out linears, token embedding, LM head + cross-entropy) use
the same drivers and live in :mod:`lightning_tp2d.nn.ring_stream`.

Options are arguments, never module state: every ring layer and function takes a :class:`RingOptions`.
``RingOptions(double_buffer=False)`` waits for each exchange before the compute instead of after it: the same
arithmetic in the same order, so bit-identical results.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from lightning_tp2d.comm import axis_rank, axis_size, ring_shift
from lightning_tp2d import comm
from lightning_tp2d import float8 as f8
from lightning_tp2d.models.documents import SKIPPED, WHOLE, Documents
from lightning_tp2d.options import ATTENTION_KERNELS, RingOptions, TPOptions, tp_options  # noqa: F401 (re-exported)
from lightning_tp2d.ops import registered

_OPERANDS, _GRADS = 0, 1  # point-to-point tags of the two shifts the backward keeps in flight




ring_options = tp_options  # ``options``, or the defaults for ``None``; anything else is a ``TypeError``


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 stays, everything else sums in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


Step = Callable[[int, tuple], object]


class _Rotation:
    """The blocks a rank holds as they travel: ``post()`` starts sending them to ``i+1`` while receiving the
    next ones from ``i-1`` into a spare buffer; ``advance()`` waits and swaps. ``own`` is never written; two
    buffers besides it suffice, since a buffer is reused once its send has completed. Without
    ``double_buffer`` the exchange is waited for in ``post()``, before the compute."""

    def __init__(self, own: Sequence[torch.Tensor], mesh: DeviceMesh, axis: str, double_buffer: bool = True) -> None:
        self.own = self.cur = tuple(t.contiguous() for t in own)
        self.mesh, self.axis, self.p = mesh, axis, axis_size(mesh, axis)
        self.double_buffer = double_buffer
        self.spare = self.pending = self.nxt = None
        self.posted = 0

    def post(self) -> None:
        self.posted += 1
        if not self.own or self.posted == self.p:  # the last block needs no successor
            return
        self.nxt = self.spare if self.spare is not None else tuple(torch.empty_like(x) for x in self.own)
        self.pending = ring_shift(self.cur, self.nxt, self.mesh, self.axis, tag=_OPERANDS, async_op=True)
        if not self.double_buffer:
            self.pending.wait()

    def advance(self) -> None:
        if self.pending is not None:
            self.pending.wait()
            self.spare = None if self.cur is self.own else self.cur
            self.cur, self.pending = self.nxt, None


def ring_forward(own: Sequence[torch.Tensor], mesh: DeviceMesh, axis: str, step: Step, *,
                 double_buffer: bool = True) -> None:
    """Call ``step(j, blocks)`` once for every ring rank ``j``, in the order ``j = i, i-1, ...``, where
    ``blocks`` are rank ``j``'s ``own`` tensors. ``p-1`` exchanges, each overlapped with a step's compute
    (``double_buffer``) or waited for before it."""
    i, p = axis_rank(mesh, axis), axis_size(mesh, axis)
    blocks = _Rotation(own, mesh, axis, double_buffer)
    for t in range(p):
        blocks.post()
        step((i - t) % p, blocks.cur)
        blocks.advance()


class _Arriving:
    """The sum arriving from ``i-1`` at a step of :func:`ring_backward` that folds it in itself (``folds_sum``):
    calling it waits for the transfer and returns the buffers (``None`` at a step where no sum arrives)."""

    def __init__(self, handle, buffers) -> None:
        self.handle, self.buffers, self.taken = handle, buffers, False

    def __call__(self) -> tuple[torch.Tensor, ...] | None:
        if self.handle is not None:
            self.handle.wait()  # also completes the send of the previous sum
            self.handle = None
        self.taken = True
        return self.buffers


def ring_backward(own: Sequence[torch.Tensor], mesh: DeviceMesh, axis: str, step: Step,
                  home: Sequence[torch.Tensor] | None = None, *, double_buffer: bool = True,
                  wire_dtype: torch.dtype | None = None, folds_sum: bool = False) -> tuple[torch.Tensor, ...]:
    """Rotate ``own`` again and sum gradients of the travelling blocks round the ring.

    ``step(j, blocks)`` returns fresh tensors: this rank's contribution to the gradients of rank ``j``'s blocks.
    The sum arriving from ``i-1`` (sent at the end of its previous step, so the transfer overlaps this step's
    compute) is added and the total sent on. Returns the complete gradients of this rank's own blocks (received
    into ``home`` if given). With operands: ``p-1`` operand and ``p`` gradient exchanges; with ``own == ()``
    the sums start one rank early and need ``p-1`` gradient exchanges only. ``double_buffer`` as in
    :func:`ring_forward`. ``wire_dtype``: the dtype the sums travel in (``None``: the contributions' own, float32
    for bf16 operands); each rank adds the arriving sum into its float32 contribution and sends the total on in
    ``wire_dtype`` (bf16 halves the bytes at one rounding per hop). ``folds_sum``: ``step(j, blocks, arriving)``
    returns the total itself, its contribution plus ``arriving()`` (:class:`_Arriving`: waits, then the sum, or
    ``None``), so the sum is added where the contribution is written (``torch.add(.., out=)``) rather than in a pass
    of its own after the step; the step calls it after its compute, which the transfer still overlaps.
    """
    i, p = axis_rank(mesh, axis), axis_size(mesh, axis)
    shift = 0 if own else 1
    blocks = _Rotation(own, mesh, axis, double_buffer)
    acc = acc_in = acc_wait = None
    for t in range(p):
        blocks.post()
        if folds_sum:
            arriving = _Arriving(acc_wait, acc_in)
            acc = tuple(step((i - t - shift) % p, blocks.cur, arriving))
            if acc_wait is not None and not arriving.taken:
                raise RuntimeError("ring_backward(folds_sum=True): the step returned without taking the arriving sum")
        else:
            acc = tuple(step((i - t - shift) % p, blocks.cur))
        free = None
        if acc_wait is not None:
            if not folds_sum:
                acc_wait.wait()  # also completes the send of the previous sum
                for a, b in zip(acc, acc_in):
                    a.add_(b)
            free = acc_in
        last = t == p - 1
        if not (shift and last):
            send = acc if wire_dtype is None else tuple(a.to(wire_dtype) for a in acc)
            homed = last and home is not None and all(h.dtype == s.dtype for h, s in zip(home, send))
            acc_in = tuple(home) if homed else (
                free if free is not None else tuple(torch.empty_like(s) for s in send))
            acc_wait = ring_shift(send, acc_in, mesh, axis, tag=_GRADS, async_op=True)
            if not double_buffer:
                acc_wait.wait()
        blocks.advance()
    if shift:
        return acc
    acc_wait.wait()
    if home is not None and not homed:
        for h, a in zip(home, acc_in):
            h.copy_(a)
        return tuple(home)
    return acc_in


# ---- attention blocks -------------------------------------------------------------------------------------


KERNELS = ("flash_cpu", "cudnn_cuda", "flash_cuda", "efficient_cuda", "math")
_VERIFIED: dict[tuple, bool] = {}  # (kernel, device, dtype, head size) -> the fused kernel matched the math one
_AUX: dict[tuple, tuple] = {}  # (kernel, device, dtype, shapes, causal) -> the forward's extra outputs (no dropout)


def block_kernel(q: torch.Tensor, options: RingOptions | None = None) -> str:
    """The per-block attention kernel :func:`attend_block` uses for ``q``: ``"math"`` when
    ``options.attention_kernel == "math"``; otherwise the fused kernel that returns the log-sum-exp: torch's CPU flash
    kernel on CPU; on CUDA, for fp16/bf16 and a head size that is a multiple of 8, cuDNN's fused attention on Hopper
    and newer (compute capability 9.0+, head size up to 128: what torch's own SDPA and its context parallelism run
    there; on an H200 its whole-sequence rate was about twice the flash kernel's ring blocks), else the flash
    kernel (head size up to 256), else the memory-efficient one. A CUDA kernel is first checked once per process
    (device, dtype, head size) against the math kernel on a small block, forward and backward; if it fails or
    disagrees, a warning says so and the next kernel is tried."""
    options = ring_options(options)
    if options.attention_kernel == "math":
        return "math"
    if q.device.type == "cpu":
        return "flash_cpu" if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu") else "math"
    if q.device.type == "cuda":
        d = q.shape[-1]
        half = q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0
        if half and d <= 128 and _hopper_or_newer(q.device) and _verified("cudnn_cuda", q):
            return "cudnn_cuda"
        if half and d <= 256 and _verified("flash_cuda", q):
            return "flash_cuda"
        if _verified("efficient_cuda", q):
            return "efficient_cuda"
    return "math"


# Both run eagerly, also while torch.compile traces a ring (their answers are constants of the graph): the check
# builds a generator and runs kernels, which Dynamo would not trace (a graph break in every ring attention).
@torch.compiler.assume_constant_result
def _hopper_or_newer(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (9, 0)


def _verified(kernel: str, q: torch.Tensor) -> bool:
    return _verified_for(kernel, q.device, q.dtype, q.shape[-1])


@torch.compiler.assume_constant_result
def _verified_for(kernel: str, device: torch.device, dtype: torch.dtype, d: int) -> bool:
    key = (kernel, device, dtype, d)
    if key not in _VERIFIED:
        _VERIFIED[key] = _check_kernel(kernel, device, dtype, d)
    return _VERIFIED[key]


def _check_kernel(kernel: str, device, dtype, d: int) -> bool:
    """Does ``kernel`` give the math kernel's output, log-sum-exp and block gradients (given a global output and
    log-sum-exp) on a small random block, causal and not?"""
    import warnings

    g = torch.Generator(device="cpu").manual_seed(0)
    tol = 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2
    try:
        for causal in (True, False):
            # causal: whole blocks; not: rows of longer blocks, not contiguous as a whole, as the ring's half blocks
            # pass their queries, keys, values and output gradients
            rows = slice(None) if causal else slice(64, None)
            q, k, v, dout = (torch.randn(1, 2, 64 if causal else 128, d, generator=g).to(device, dtype)[..., rows, :]
                             for _ in range(4))
            scale = d ** -0.5
            out, lse = _fused_forward(kernel, q, k, v, causal, scale)
            ref_out, ref_lse = attend_block(q, k, v, causal, scale, TPOptions(attention_kernel="math"))
            grads = _fused_backward(kernel, dout, q, k, v, ref_out, ref_lse, causal, scale)
            ref = attend_block_backward(dout, q, k, v, ref_out, ref_lse, causal, scale, TPOptions(attention_kernel="math"))
            pairs = [(out, ref_out), (lse, ref_lse), *zip(grads, ref)]
            for a, b in pairs:
                if a.shape != b.shape or ((a.float() - b.float()).abs().max() > tol * (1 + b.float().abs().max())):
                    raise ValueError(f"differs from the math kernel (shapes {tuple(a.shape)} vs {tuple(b.shape)})")
        return True
    except Exception as err:  # noqa: BLE001 - any failure means: do not use this kernel here
        warnings.warn(f"ring attention: the fused {kernel} kernel is not usable for {dtype} head size {d} on {device} "
                      f"({type(err).__name__}: {err}); using the math kernel", RuntimeWarning, stacklevel=3)
        return False


def _fused_forward(kernel: str, q, k, v, causal: bool, scale: float):
    aten = torch.ops.aten
    if kernel == "flash_cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse.to(acc_dtype(q.dtype))
    if kernel == "cudnn_cuda":  # its log-sum-exp comes as [.., Lq, 1]
        out, lse, *aux = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
        if lse.dim() == q.dim():
            lse = lse.squeeze(-1)
    elif kernel == "flash_cuda":
        out, lse, *aux = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    else:  # efficient_cuda
        out, lse, *aux = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
        lse = lse[..., : q.shape[-2]]  # some releases pad the rows to a multiple of 32
    _AUX[(kernel, q.device, q.dtype, q.shape, k.shape, causal)] = tuple(aux)
    return out, lse.float()


def _fused_backward(kernel: str, dout, q, k, v, out, lse, causal: bool, scale: float):
    aten = torch.ops.aten
    if kernel == "flash_cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.to(acc_dtype(q.dtype)), 0.0, causal, scale=scale)
    key = (kernel, q.device, q.dtype, q.shape, k.shape, causal)
    if key not in _AUX:  # the forward's bookkeeping outputs (no dropout: the same for any values)
        _fused_forward(kernel, q, k, v, causal, scale)
    aux = _AUX[key]
    lse = lse.float().contiguous()
    if kernel == "cudnn_cuda":
        cum_q, cum_k, max_q, max_k, seed, offset = aux[:6]
        return aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse.unsqueeze(-1), seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, causal,
            scale=scale)
    if kernel == "flash_cuda":
        cum_q, cum_k, max_q, max_k, seed, offset = aux[:6]
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)
    seed, offset = aux[:2]
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


def _causal_mask(r0: int, r1: int, cols: int, device) -> torch.Tensor:
    """True where key ``col > query row`` for query rows ``r0..r1`` of a square causal block."""
    return torch.arange(cols, device=device) > torch.arange(r0, r1, device=device).unsqueeze(-1)


def attend_block(q, k, v, causal: bool, scale: float,
                 options: RingOptions | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(softmax(q kᵀ·scale [+ causal]) v, logsumexp)`` of one block. ``q [.., Lq, d]``, ``k, v [.., Lk, d]``;
    ``causal`` needs ``Lq == Lk``. Output in ``q``'s dtype, log-sum-exp ``[.., Lq]`` in :func:`acc_dtype`.
    The kernel is :func:`block_kernel`'s choice: a fused one, or ``options.math_tile``-row score tiles."""
    options = ring_options(options)
    kernel = block_kernel(q, options)
    if kernel != "math":
        out, lse = _fused_forward(kernel, q, k, v, causal, scale)
        return out, lse.to(acc_dtype(q.dtype))
    acc = acc_dtype(q.dtype)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=acc, device=q.device)
    kt = k.to(acc).transpose(-1, -2)
    tile = options.math_tile
    for r0 in range(0, q.shape[-2], tile):
        r1 = min(r0 + tile, q.shape[-2])
        s = torch.matmul(q[..., r0:r1, :].to(acc), kt).mul_(scale)  # (.., tile, Lk)
        if causal:
            s.masked_fill_(_causal_mask(r0, r1, s.shape[-1], s.device), float("-inf"))
        l = torch.logsumexp(s, -1)
        out[..., r0:r1, :] = torch.matmul(s.sub_(l.unsqueeze(-1)).exp_(), v.to(acc))
        lse[..., r0:r1] = l
    return out, lse


def attend_block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, options: RingOptions | None = None):
    """``(dq, dk, dv)`` of one block given the *final* output rows ``out`` and log-sum-exp ``lse`` of these
    queries (so ``P = exp(q kᵀ·scale - lse)`` is this block's share of the full softmax); kernel as in
    :func:`attend_block`."""
    options = ring_options(options)
    kernel = block_kernel(q, options)
    if kernel != "math":
        return _fused_backward(kernel, dout, q, k, v, out, lse, causal, scale)
    acc = acc_dtype(q.dtype)
    q, k, v, dout = q.to(acc), k.to(acc), v.to(acc), dout.to(acc)
    delta = (dout * out.to(acc)).sum(-1)  # rowsum(dO ∘ O)
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    tile = options.math_tile
    for r0 in range(0, q.shape[-2], tile):
        r1 = min(r0 + tile, q.shape[-2])
        s = torch.matmul(q[..., r0:r1, :], k.transpose(-1, -2)).mul_(scale)
        if causal:
            s.masked_fill_(_causal_mask(r0, r1, s.shape[-1], s.device), float("-inf"))
        prob = s.sub_(lse[..., r0:r1].unsqueeze(-1)).exp_()  # (.., tile, Lk)
        do = dout[..., r0:r1, :]
        dv += torch.matmul(prob.transpose(-1, -2), do)
        ds = prob.mul_(torch.matmul(do, v.transpose(-1, -2)).sub_(delta[..., r0:r1].unsqueeze(-1)))
        dq[..., r0:r1, :] = torch.matmul(ds, k).mul_(scale)
        dk += torch.matmul(ds.transpose(-1, -2), q[..., r0:r1, :]).mul_(scale)
    return dq, dk, dv


def visible(i: int, j: int, c: int) -> tuple[slice, slice, bool]:
    """Which rows of rank ``i``'s queries see which rows of rank ``j``'s keys, and whether causally.

    Zigzag: rank ``r`` holds global chunks ``r`` (rows ``[0, c)``) and ``2p-1-r`` (rows ``[c, 2c)``). For
    ``j == i`` both sides are in increasing global order, so the mask is the plain causal one; for ``j < i``
    every query sees chunk ``j`` only (chunk ``2p-1-j`` lies after both of ``i``'s chunks); for ``j > i`` only
    the late chunk ``2p-1-i`` sees anything, and it sees both of ``j``'s chunks. Either way ``2c²`` scores.
    """
    if j == i:
        return slice(None), slice(None), True
    if j < i:
        return slice(None), slice(0, c), False
    return slice(c, None), slice(None), False


def document_blocks(i: int, j: int, n: int, c: int, documents: Documents) -> list[tuple[slice, slice, slice, bool]]:
    """The plain attention blocks that make up ring block ``(i, j)`` under packed documents: ``(batch rows, query
    rows, key rows, causal)``, rows local to the ``2c``-row zigzag shards of ranks ``i`` (queries) and ``j`` (keys).

    The block is cut into its ``[c, c]`` chunk pairs ``(a, b)`` (query chunk ``a`` of ``i``'s two, key chunk ``b``
    of ``j``'s two). By :meth:`~lightning_tp2d.models.documents.Documents.chunk_links` a pair in which no query of
    any row may see a key is left out (never computed); a pair inside one document in every row is one block over
    the whole batch (causal on the diagonal ``a == b``); a pair that crosses a document start is cut into
    :meth:`~lightning_tp2d.models.documents.Documents.segments`: each run of queries of one document with the run
    of keys of that document it sees, a plain block (causal on the diagonal, else full), over the whole batch when
    every row has the same runs, else row by row. Every other (query, key) combination is hidden and not computed,
    so no mask exists; a query row that sees no key of the pair gets no block (its output and log-sum-exp are left
    as they are). Diagonal blocks come first: they cover every query row once (each sees itself), so the merge of
    the later blocks starts from a finite log-sum-exp. Plain Python from the documents' host-side starts."""
    chunks = 2 * n
    links = documents.chunk_links(chunks)
    blocks = []
    for qa, a in enumerate((i, chunks - 1 - i)):
        for kb, b in enumerate((j, chunks - 1 - j)):
            kind, q0, k0 = links[a][b], qa * c, kb * c
            if kind == SKIPPED:
                continue
            if kind == WHOLE:
                blocks.append((slice(None), slice(q0, q0 + c), slice(k0, k0 + c), a == b))
                continue
            per_row = documents.segments(chunks, a, b)
            batches = ([(slice(None), per_row[0])] if all(runs == per_row[0] for runs in per_row)
                       else [(slice(r, r + 1), runs) for r, runs in enumerate(per_row)])
            for rows, runs in batches:
                blocks.extend((rows, slice(q0 + s0, q0 + s1), slice(k0 + t0, k0 + t1), a == b)
                              for s0, s1, t0, t1 in runs)
    return sorted(blocks, key=lambda block: not block[3])


def _op_documents(documents: Documents | None, doc_ids: torch.Tensor | None) -> Documents | None:
    """The packed documents a ring-attention op works with: ``documents`` (eager), or under ``torch.compile``
    (where an op's arguments are tensors or graph constants, and host data per batch would be a recompile per batch)
    rebuilt from the ids tensor (the batch's CPU copy, :func:`ring_attention`), whose starts are read once per call;
    ``None`` in the compiler's shape pass (fake ids cannot be read; the causal ring's shapes are the same)."""
    if documents is not None or doc_ids is None:
        return documents
    return None if comm._SHAPES_ONLY else Documents(doc_ids)


_ALL = slice(None)


def _rows(t: torch.Tensor, batch: slice, rows: slice, last: bool = False) -> torch.Tensor:
    """The view ``t[batch][..., rows, :]`` (``last``: ``t[batch][..., rows]``, for the log-sum-exp), with no op for a
    whole axis (``slice(None)``): the ring's blocks index their operands dozens of times a step."""
    if batch != _ALL:
        t = t[batch]
    if rows == _ALL:
        return t
    return t[..., rows] if last else t[..., rows, :]


def _kv_rows(kv: torch.Tensor, batch: slice, cols: slice) -> tuple[torch.Tensor, ...]:
    """``(k, v)``: views of the travelling ``K|V [2, B, nkv, S, d]`` at ``batch`` and key rows ``cols``, cut as one
    block and unbound (one op for the pair where two selects and two slices would be four)."""
    if batch != _ALL:
        kv = kv[:, batch]
    if cols != _ALL:
        kv = kv[..., cols, :]
    return kv.unbind(0)


class _RowViews:
    """Views ``_rows(t[r], batch, rows)`` of a call's fixed tensors (the queries, the output and its log-sum-exp, their
    gradients), each cut once per call: a rank's blocks ask for the same few (its two chunks' rows, a document's
    run) at every ring step. ``lse``-like tensors (no head-size axis) are named in ``last``."""

    def __init__(self, tensors: dict[str, torch.Tensor], last: dict[str, torch.Tensor]) -> None:
        self.tensors, self.last, self.cut = {**tensors, **last}, set(last), {}

    def __call__(self, name: str, r: int, batch: slice, rows: slice) -> torch.Tensor:
        key = (name, r, batch.start, batch.stop, rows.start, rows.stop)
        view = self.cut.get(key)
        if view is None:
            row = self.cut.get((name, r))
            if row is None:
                row = self.cut[name, r] = self.tensors[name][r]
            view = self.cut[key] = _rows(row, batch, rows, last=name in self.last)
        return view


def _merge(out: torch.Tensor, lse: torch.Tensor, o_b: torch.Tensor, l_b: torch.Tensor) -> None:
    """Fold one block's ``(o_b, l_b)`` into the running ``(out, lse)`` views in place (online log-sum-exp). The two
    weights ``exp(lse - new)`` and ``exp(l_b - new)`` sum to one, so the fold is one ``lerp_`` towards the block:
    ``out`` is read and written once (a scale, a product and a sum would pass over it and ``o_b`` seven times)."""
    torch.logaddexp(lse, l_b, out=lse)
    out.lerp_(o_b.to(out.dtype), (l_b - lse).exp_().unsqueeze(-1))


def _into(view: torch.Tensor, block: torch.Tensor, first: bool) -> None:
    """Write ``block`` into ``view`` (its first contribution) or add it (``add_`` on the view: ``view[...] += b``
    would copy it back)."""
    if first:
        view.copy_(block)
    else:
        view.add_(block)


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool,
            bias: torch.Tensor | None = None, gemm: f8.Gemm = f8.HIGH) -> None:
    """``out = [bias +] a @ b`` (``first``: a ring's first contribution, written by the GEMM itself; no zeroed buffer,
    no separate bias pass) or ``out += a @ b`` (the GEMM accumulates into ``out``). ``gemm``: float8 products
    (:mod:`lightning_tp2d.float8`) write a fresh result into ``out`` or add it."""
    if gemm is not f8.HIGH:
        if first:
            out.copy_(gemm.first(a, b, bias))
        else:
            out.add_(gemm.mm(a, b))
        return
    if not first:
        out.addmm_(a, b)
    elif bias is None:
        torch.mm(a, b, out=out)
    else:
        torch.addmm(bias, a, b, out=out)


def _fold(dkv: torch.Tensor, views: tuple, blocks: tuple, cols: slice, summed: tuple | None) -> None:
    """Write a ring step's first K|V gradient blocks into the fresh sum ``dkv`` at key rows ``cols`` (``views``: its
    ``dk, dv`` there), plus the sum arriving from ``i-1`` (``summed``, or ``None`` at the first step): one
    ``add(.., out=)`` per block where a copy and a later ``add_`` of the whole sum would be two passes more. Key rows
    the step leaves out (``cols`` = ``[0, c)``: ``[c, 2c)``) take the arriving sum, or zeros."""
    rest = None if cols == _ALL else dkv[..., cols.stop:, :]
    if summed is None:
        for view, block in zip(views, blocks):
            view.copy_(block)
        if rest is not None:
            rest.zero_()
        return
    for view, block, prior in zip(views, blocks, _kv_rows(summed[0], _ALL, cols)):
        torch.add(prior, block, out=view)
    if rest is not None:
        rest.copy_(summed[0][..., cols.stop:, :])


def _groups_first(t: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, nkv*g, S, d]`` (query head ``k*g + r``) -> the view ``[g, B, nkv, S, d]`` (row ``r``, head ``k``)."""
    return t.unflatten(1, (-1, groups)).permute(2, 0, 1, 3, 4)


@registered("ring_attention")
class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, mesh, axis, scale, groups, options, documents, doc_ids):
        # qkv (g+2, B, nkv, S, d) with S = 2c: this rank's zigzag chunks; the g query rows stay, k|v travel as one
        # tensor at the nkv heads; each query row attends to the same key/value block (no expanded copy).
        # documents: the full batch's packed documents (eager) or None; doc_ids: their (B, T) ids under
        # torch.compile instead (_op_documents), else None
        i, n = axis_rank(mesh, axis), axis_size(mesh, axis)
        docs = _op_documents(documents, doc_ids)
        q, kv = qkv[:groups], qkv[groups:]
        c = q.shape[-2] // 2
        out = torch.empty(q.shape, dtype=acc_dtype(q.dtype), device=q.device)  # (g, B, nkv, S, d)
        lse = torch.empty(q.shape[:-1], dtype=out.dtype, device=q.device)

        def step(j, blocks):
            (kv_j,) = blocks
            if docs is None:
                rows, cols, causal = visible(i, j, c)
                # step 0 is the diagonal block j == i: every query row sees at least itself
                attend(kv_j, slice(None), rows, cols, causal, first=j == i)
                return
            for batch, rows, cols, diagonal in document_blocks(i, j, n, c, docs):
                attend(kv_j, batch, rows, cols, diagonal, first=diagonal)  # diagonals: the first to reach their rows

        rows_of = _RowViews({"q": q, "out": out}, last={"lse": lse})

        def attend(kv_j, batch, rows, cols, causal, first):
            k_j, v_j = _kv_rows(kv_j, batch, cols)
            for r in range(groups):
                o_b, l_b = attend_block(rows_of("q", r, batch, rows), k_j, v_j, causal, scale, options)
                o, l = rows_of("out", r, batch, rows), rows_of("lse", r, batch, rows)  # views
                if first:
                    o.copy_(o_b)
                    l.copy_(l_b)
                else:
                    _merge(o, l, o_b, l_b)

        ring_forward((kv,), mesh, axis, step, double_buffer=options.double_buffer)
        g, B, nkv, S, d = q.shape
        # token-major storage [B, S, nkv*g, d] seen as [B, nkv*g, S, d]: the projection after it reads its [B*S, h]
        # rows (a ring's column blocks, a grid's row block) as views, not copies; flash kernels' own layout
        y = torch.empty_strided((B, nkv * g, S, d), (S * nkv * g * d, d, nkv * g * d, 1), dtype=qkv.dtype,
                                device=qkv.device)
        y.unflatten(1, (nkv, g)).copy_(out.permute(1, 2, 0, 3, 4))
        ctx.save_for_backward(qkv, y, lse, *(() if doc_ids is None else (doc_ids,)))
        ctx.mesh, ctx.axis, ctx.scale, ctx.groups, ctx.options = mesh, axis, scale, groups, options
        ctx.documents = documents  # host data, kept in eager only (under torch.compile: None, rebuilt from doc_ids)
        return y

    @staticmethod
    def backward(ctx, dy):
        qkv, y, lse, *ids = ctx.saved_tensors
        docs = _op_documents(ctx.documents, ids[0] if ids else None)
        i, n, g = axis_rank(ctx.mesh, ctx.axis), axis_size(ctx.mesh, ctx.axis), ctx.groups
        q, kv = qkv[:g], qkv[g:]
        c = q.shape[-2] // 2
        dy, y = _groups_first(dy.contiguous(), g), _groups_first(y, g)  # views (g, B, nkv, S, d)
        # written, not zeroed and summed into: the diagonal block (step 0, j == i; under documents the diagonal
        # blocks, sorted first) covers every query row once, and each step's first block fills the travelling sums
        dqkv = torch.empty(qkv.shape, dtype=lse.dtype, device=qkv.device)
        dq = dqkv[:g]

        def step(j, blocks, arriving):
            # the travelling K|V gradient sum (the nkv heads, summed over g): the sum arriving from i-1 plus this
            # rank's blocks, written into a fresh buffer by the first group's adds
            (kv_j,) = blocks
            dkv = torch.empty(kv.shape, dtype=lse.dtype, device=kv.device)
            if docs is None:
                rows, cols, causal = visible(i, j, c)
                add_block(dkv, kv_j, _ALL, rows, cols, causal, first_rows=j == i, arriving=arriving)
                return (dkv,)
            dkv.zero_()  # under documents the blocks overlap in keys: summed into, the arriving sum last
            for batch, rows, cols, diagonal in document_blocks(i, j, n, c, docs):
                add_block(dkv, kv_j, batch, rows, cols, diagonal, first_rows=diagonal, arriving=None)
            summed = arriving()
            if summed is not None:
                dkv.add_(summed[0])
            return (dkv,)

        rows_of = _RowViews({"dy": dy, "q": q, "y": y, "dq": dq}, last={"lse": lse})

        def add_block(dkv, kv_j, batch, rows, cols, causal, first_rows, arriving):
            k_j, v_j = _kv_rows(kv_j, batch, cols)
            dk_j, dv_j = _kv_rows(dkv, batch, cols)
            summed = None  # with `arriving`: the groups' K|V blocks, summed (in float32) before the one fold
            for r in range(g):
                dq_b, dk_b, dv_b = attend_block_backward(rows_of("dy", r, batch, rows), rows_of("q", r, batch, rows),
                                                         k_j, v_j, rows_of("y", r, batch, rows),
                                                         rows_of("lse", r, batch, rows), causal, ctx.scale,
                                                         ctx.options)
                _into(rows_of("dq", r, batch, rows), dq_b, first_rows)
                if arriving is None:
                    dk_j.add_(dk_b)
                    dv_j.add_(dv_b)
                elif summed is None:
                    summed = (dk_b, dv_b) if g == 1 else (dk_b.to(lse.dtype), dv_b.to(lse.dtype))
                else:
                    summed[0].add_(dk_b)
                    summed[1].add_(dv_b)
            if arriving is not None:  # after every group's kernel, so the arriving sum's transfer overlaps them all
                _fold(dkv, (dk_j, dv_j), summed, cols, arriving())

        ring_backward((kv,), ctx.mesh, ctx.axis, step, home=(dqkv[g:],), double_buffer=ctx.options.double_buffer,
                      wire_dtype=ctx.options.wire_dtype(kv.dtype), folds_sum=True)
        return dqkv.to(qkv.dtype), None, None, None, None, None, None, None


def group_queries(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``q [B, nh, S, d]``, ``k, v [B, nkv, S, d]`` (``nh = g * nkv``; query head ``k*g + r`` reads key/value head
    ``k``, as transformers' ``repeat_kv``) -> the ``qkv [g+2, B, nkv, S, d]`` :func:`ring_attention` takes: rows
    ``0..g-1`` the queries (row ``r``, head ``k`` = query head ``k*g + r``), then ``k`` and ``v``. One copy."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[1] % k.shape[1] \
            or (q.shape[0], q.shape[2], q.shape[3]) != (k.shape[0], k.shape[2], k.shape[3]):
        raise ValueError(f"group_queries expects q [B, nh, S, d] and k, v [B, nkv, S, d] with nh % nkv == 0, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)} and {tuple(v.shape)}")
    return torch.cat([_groups_first(q, q.shape[1] // k.shape[1]), k.unsqueeze(0), v.unsqueeze(0)])


def ring_attention(qkv: torch.Tensor, mesh: DeviceMesh, axis: str, scale: float | None = None, *, groups: int = 1,
                   options: RingOptions | None = None, documents=None) -> torch.Tensor:
    """Causal attention of a zigzag-sharded sequence, multi-head (``groups=1``) or grouped-query (``groups`` query
    heads per key/value head): ``qkv [groups+2, B, nkv, S, d]`` (rows ``0..groups-1`` the queries, row ``r`` of head
    ``k`` being query head ``k*groups + r`` (:func:`group_queries` builds it), then k and v, of this rank's chunks
    ``i`` and ``2p-1-i``, ``S = 2T/(2p)``) -> ``y [B, nkv*groups, S, d]``, stored token-major (``y.transpose(1, 2)``
    is contiguous: the output projection reads its rows as views). Only ``K|V [2, B, nkv, S, d]`` travels;
    each query row attends to the block it holds (no per-group copy of K/V, on the wire or locally), and the
    backward sums ``dK|dV`` over the groups before they travel. Per step and query row one ``[≤2c, ≤2c]`` block
    (the fused kernel of :func:`block_kernel` or ``options.math_tile``-row score tiles), never ``[T, T]``. Forward:
    ``p-1`` exchanges of ``K|V``; backward: ``p-1`` of ``K|V`` and ``p`` of ``dK|dV``.

    ``documents`` (:class:`~lightning_tp2d.models.documents.Documents` of the full ``[B, T]`` batch, which every
    rank of the ring holds): per-document causal attention with no mask. Each block is cut into its ``[c, c]``
    chunk pairs and those into plain blocks (:func:`document_blocks`): a pair in which no query may see any key in
    any row is skipped (never computed), a pair inside one document runs as the plain block, and a pair that
    crosses a document start runs as one plain block per (query run, key run) of the same document, the rest of
    it neither computed nor masked. All of it is decided on the host from the documents' start positions: no host
    sync in the step, no tensor beyond the plain kernel's. Under ``torch.compile`` the op receives the ids instead
    (host data per batch would be a recompile per batch): the CPU copy the batch came with
    (:attr:`~lightning_tp2d.models.documents.Documents.host_ids`), whose starts it reads once per call without a
    device sync; only ids that were never on the host (a user's device tensor) are read from the device."""
    if not isinstance(groups, int) or groups < 1 or qkv.dim() != 5 or qkv.shape[0] != groups + 2 \
            or qkv.shape[-2] % 2:
        raise ValueError(f"ring_attention expects qkv [groups+2, B, nkv, S, d] with S even (two zigzag chunks), "
                         f"got {tuple(qkv.shape)} with groups={groups!r}")
    scale = 1.0 / math.sqrt(qkv.shape[-1]) if scale is None else scale
    doc_ids = None
    if documents is not None:
        n = axis_size(mesh, axis)
        if tuple(documents.shape) != (qkv.shape[1], qkv.shape[-2] * n):
            raise ValueError(f"ring_attention: documents of shape {tuple(documents.shape)} do not cover the batch "
                             f"(B, T) = {(qkv.shape[1], qkv.shape[-2] * n)} of these shards")
        if torch.compiler.is_compiling():  # the ids as a tensor argument, on the host where the batch came from
            documents, doc_ids = None, documents.ids if documents.host_ids is None else documents.host_ids
    return _RingAttention.apply(qkv.contiguous(), mesh, axis, scale, groups, ring_options(options), documents, doc_ids)


# ---- MLP -------------------------------------------------------------------------------------------------


def tile_rows(t: torch.Tensor, rows: slice) -> torch.Tensor:
    """``t[rows]`` for a tile ``slice(start, stop)`` of ``t``'s first axis, or ``t`` itself when the tile is all of it:
    a slice is an op on the host even when it is the whole tensor, and an untiled ring step asks for dozens."""
    return t if rows.start == 0 and rows.stop >= t.shape[0] else t[rows]


def _gelu(dh, u):
    """GELU (tanh): ``(gelu(u), d/du given dh)``; ``dh`` ``None`` in the forward."""
    hidden = F.gelu(u, approximate="tanh")
    return hidden, None if dh is None else (torch.ops.aten.gelu_backward(dh, u, approximate="tanh"),)


def _swiglu(dh, gate, u):
    """SwiGLU: ``(silu(gate) * u, (d/dgate, d/du) given dh)``; ``dh`` ``None`` in the forward."""
    act = F.silu(gate)
    if dh is None:
        return act * u, None
    return act * u, (torch.ops.aten.silu_backward(dh * u, gate), dh * act)  # silu' in one pass, as autograd's


MLP_ACTIVATIONS = {"gelu_tanh": _gelu, "swiglu": _swiglu}  # name -> (dh, *pre-activations) -> (hidden, grads)


def _pre_activations(x, w_in, b1, j, gemms=None):
    """``X Wg_jᵀ`` (SwiGLU's gate) and ``X W1_jᵀ + b1_j``: the pre-activation blocks ``[N, f]`` of ring rank
    ``j``'s rows; ``w_in`` is ``(w1_j,)`` or ``(wg_j, w1_j)``; ``gemms``: one float8 product per ``w_in`` entry
    (``None``: high precision)."""
    if gemms is None:
        *gate, w1_j = w_in
        if b1 is None:
            return [x @ w.t() for w in w_in]
        f = w1_j.shape[0]
        return [*(x @ w.t() for w in gate), torch.addmm(b1[j * f:(j + 1) * f], x, w1_j.t())]  # one op, not mm + add_
    f = w_in[-1].shape[0]
    return [g.first(x, w.t(), b1[j * f:(j + 1) * f] if b1 is not None and k == len(w_in) - 1 else None)
            for k, (g, w) in enumerate(zip(gemms, w_in))]


def _bias_as(b1: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """``b1`` in the products' dtype, cast once per call (as autocast gives a plain linear its bias)."""
    return None if b1 is None else b1.to(x.dtype)


def _mlp_tiles(x: torch.Tensor, w1: torch.Tensor, options: RingOptions) -> list[slice]:
    """The row tiles of the ring MLP: ``options.tile_tokens`` rows each when the hidden block ``f`` (``w1``'s rows)
    is wider than ``x``'s ``h`` columns, so the ``[tile, f]`` pre-activations and their gradients stay below a few
    ``[tile, h]``; one tile of all ``N`` rows otherwise (the hidden block is no wider than the input)."""
    if w1.shape[0] <= x.shape[1]:
        return [slice(0, x.shape[0])]
    return options.row_tiles(x.shape[0])


def _mlp_float8_gemms(ctx, dout, scales):
    """``(dout, gemms)`` of :class:`_RingMLP`'s backward under ``ctx.float8``: ``dout`` cast (tensorwise: with its
    amax over the ring), and the GEMMs of the recomputed pre-activations (as in the forward), ``dhidden = dY W2_j`` (float8
    operands both), ``dX += dpre_k W_k,j`` and ``dW_k,j += dpre_kᵀ X`` (``dpre`` made per step, cast there as a
    gradient), ``dW2_j += dYᵀ hidden`` (``hidden`` cast there). ``scales``: the forward's (``x``, then the
    travelling blocks'; none under rowwise)."""
    recipe, n_in = ctx.float8, ctx.n_own - 1
    (dout,), grad_scale = f8.cast_global(recipe, [dout], ["grad"], ctx.mesh, (ctx.axis,))
    tensorwise = bool(grad_scale)
    s_x, *s_w = scales if tensorwise else [None] * (1 + ctx.n_own)
    s_g = grad_scale[0] if tensorwise else None
    pick = lambda *s: s if tensorwise else ()  # noqa: E731 - a product's float8 operands' scales (tensorwise)
    acc = acc_dtype(ctx.dtype)
    return dout, {
        "pre": [f8.product(recipe, pick(s_x, s), ctx.dtype) for s in s_w[:n_in]],
        "dhidden": f8.product(recipe, pick(s_g, s_w[-1]), ctx.dtype, "grad_input"),
        "dx": [f8.product(recipe, pick(s), ctx.dtype, "grad_input", cast_role="grad") for s in s_w[:n_in]],
        "dw_in": f8.product(recipe, pick(s_x), acc, "grad_weight", cast_role="grad"),
        "dw2": f8.product(recipe, pick(s_g), acc, "grad_weight", cast_role="input"),
    }


@registered("ring_mlp")
class _RingMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, w_gate, mesh, axis, activation, options, float8):
        # x (N, h); w1 (f, h) = c_fc / up_proj rows of block i (f = 4h/p or I/p); w2 (h, f) = c_proj / down_proj
        # columns of block i; w_gate (f, h) = gate_proj rows of block i (SwiGLU) or None; all blocks travel together
        act = MLP_ACTIVATIONS[activation]
        own = (w1, w2) if w_gate is None else (w_gate, w1, w2)
        out = x.new_empty((x.shape[0], w2.shape[0]))  # written by the first step's GEMM, with b2
        tiles = _mlp_tiles(x, w1, options)
        b1_x, b2_x, i = _bias_as(b1, x), _bias_as(b2, x), axis_rank(mesh, axis)
        ctx.float8, ctx.dtype, ctx.w_dtype, scales = float8, x.dtype, w1.dtype, ()
        gemms_in, gemm_out = None, f8.HIGH
        if float8 is not None:  # x and the travelling blocks cast once (tensorwise: amaxes over the ring; blocks
            #                     travel as float8); the hidden block, made per step, is cast where it is multiplied
            (x, *own), scales = f8.cast_global(float8, [x, *own], ["input"] + ["weight"] * len(own), mesh, (axis,))
            own = tuple(own)
            pick = lambda *s: s if scales else ()  # noqa: E731 - a product's float8 operands' scales (tensorwise)
            s_x, *s_w = scales if scales else [None] * (1 + len(own))
            gemms_in = [f8.product(float8, pick(s_x, s), ctx.dtype) for s in s_w[:-1]]
            gemm_out = f8.product(float8, pick(s_w[-1]), ctx.dtype, cast_role="input")

        def step(j, blocks):
            *w_in, w2_j = blocks
            for r in tiles:  # [tile, f] hidden blocks at a time when f > h (options.tile_tokens)
                hidden = act(None, *_pre_activations(tile_rows(x, r), w_in, b1_x, j, gemms_in))[0]
                mm_into(tile_rows(out, r), hidden, w2_j.t(), first=j == i, bias=b2_x, gemm=gemm_out)

        ring_forward(own, mesh, axis, step, double_buffer=options.double_buffer)
        # no None: the registered op saves tensors; the tensorwise scales last
        ctx.save_for_backward(x, *own, *(() if b1 is None else (b1,)), *scales)
        ctx.mesh, ctx.axis, ctx.activation, ctx.options = mesh, axis, activation, options
        ctx.n_own, ctx.has_b2, ctx.n_scales = len(own), b2 is not None, len(scales)
        ctx.b2_dtype = None if b2 is None else b2.dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        x, *own = ctx.saved_tensors
        scales = own[len(own) - ctx.n_scales:] if ctx.n_scales else ()
        own = own[:len(own) - ctx.n_scales]
        own, (b1,) = own[:ctx.n_own], (own[ctx.n_own:] or (None,))
        act = MLP_ACTIVATIONS[ctx.activation]
        acc = acc_dtype(ctx.dtype)
        dout = dout.contiguous()
        dx = x.new_empty(x.shape, dtype=ctx.dtype)  # written by the first step's GEMM (j == i)
        db1 = None if b1 is None else torch.zeros(b1.shape, dtype=acc, device=b1.device)
        f = own[0].shape[0]
        tiles = _mlp_tiles(x, own[0], ctx.options)
        b1_x, i = None if b1 is None else b1.to(ctx.dtype), axis_rank(ctx.mesh, ctx.axis)
        # the biases are replicated over the ring, each rank's tokens its own: their gradients are summed over it,
        # b2's (known now) while the ring runs, b1's (made block by block) after it
        db2 = None if not ctx.has_b2 else comm.summed_later(dout.sum(0, dtype=ctx.b2_dtype), ctx.mesh, ctx.axis)
        fg = None  # the float8 GEMMs (None: high precision)
        if ctx.float8 is not None:
            dout, fg = _mlp_float8_gemms(ctx, dout, scales)

        def step(j, blocks):
            *w_in, w2_j = blocks
            grads = None
            for r in tiles:  # [tile, f] at a time when f > h (options.tile_tokens)
                x_r, dout_r = tile_rows(x, r), tile_rows(dout, r)
                pres = _pre_activations(x_r, w_in, b1_x, j, None if fg is None else fg["pre"])  # recomputed, never stored
                hidden, dpres = act(dout_r @ w2_j if fg is None else fg["dhidden"].mm(dout_r, w2_j), *pres)  # (tile, f)
                del pres
                if db1 is not None:
                    db1[j * f:(j + 1) * f].add_(dpres[-1].sum(0))  # (a `+=` on the slice would copy it back)
                for k, (dpre, w_j) in enumerate(zip(dpres, w_in)):
                    mm_into(tile_rows(dx, r), dpre, w_j, first=j == i and k == 0,
                            gemm=f8.HIGH if fg is None else fg["dx"][k])
                if fg is None:
                    tile_grads = (*(dpre.t() @ x_r for dpre in dpres), dout_r.t() @ hidden)
                else:
                    tile_grads = (*(fg["dw_in"].mm(dpre.t(), x_r) for dpre in dpres), fg["dw2"].mm(dout_r.t(), hidden))
                del hidden, dpres
                if grads is None:
                    grads = tuple(g.to(acc) for g in tile_grads)
                else:
                    for g, t in zip(grads, tile_grads):
                        g.add_(t)
            return grads

        grads = ring_backward(own, ctx.mesh, ctx.axis, step, double_buffer=ctx.options.double_buffer,
                              wire_dtype=ctx.options.wire_dtype(ctx.w_dtype))
        *dw_in, dw2 = (gw.to(ctx.w_dtype) for gw in grads)
        if db1 is not None:
            db1 = comm.summed_later(db1, ctx.mesh, ctx.axis)().to(b1.dtype)
        db2 = None if db2 is None else db2()
        dw_gate = dw_in[0] if len(dw_in) == 2 else None
        return dx, dw_in[-1], db1, dw2, db2, dw_gate, None, None, None, None, None


def ring_mlp(x, w1, b1, w2, b2, mesh: DeviceMesh, axis: str, *, activation: str = "gelu_tanh",
             w_gate: torch.Tensor | None = None, options: RingOptions | None = None,
             float8: str | None = None) -> torch.Tensor:
    """``act(X W1ᵀ + b1) W2ᵀ + b2`` in one ring pass, with ``X [N, h]`` local rows, ``W1``'s output rows (``w1 [f,
    h]``, ``f = F/p`` of the ``F``-wide hidden layer) and ``W2``'s input columns (``w2 [h, f]``) split over the ring,
    biases full (replicated) or ``None``. ``activation``: ``"gelu_tanh"`` (GPT-2: ``gelu(X W1ᵀ + b1)``) or
    ``"swiglu"`` (Llama: ``silu(X Wgᵀ) * (X W1ᵀ + b1)``, with the gate's output rows ``w_gate [f, h]``, travelling
    with the others). Forward ``p-1`` exchanges of the weight blocks; backward ``p-1`` of the blocks and ``p`` of
    their gradients; the ``[N, F]`` hidden activation is never formed (``[N, f]`` per step, recomputed in
    backward). When the hidden block is wider than the input (``f > h``: few ranks, e.g. Llama 3.1 8B's ``I = 14336``
    at ``p <= 3``), each step runs ``options.tile_tokens`` rows at a time, forward and the recomputing backward, so
    the hidden blocks are ``[tile, f]`` (:func:`_mlp_tiles`); the weight gradients sum the tiles' contributions in
    float32; the exchanges are the same. ``float8``: every GEMM by that torchao recipe (:mod:`lightning_tp2d.float8`;
    tensorwise: ``X``, ``dY`` and the weight blocks with their amaxes over the ring, the blocks travelling as
    float8; the hidden block and its gradient, which exist a step at a time, with their own amax per step)."""
    if activation not in MLP_ACTIVATIONS or (w_gate is not None) != (activation == "swiglu"):
        raise ValueError(f"ring_mlp: activation={activation!r} with w_gate {'given' if w_gate is not None else 'None'};"
                         f" use 'gelu_tanh' without w_gate or 'swiglu' with it")
    return _RingMLP.apply(x, w1, b1, w2, b2, w_gate, mesh, axis, activation, ring_options(options),
                          f8.check_recipe(float8))
