"""Analytic cost model of one training step, per tensor-parallel rank: communication, FLOPs, saved activations and
a projected step time.

The step is ``loss = model(idx, targets); loss.backward()`` with ``idx [batch, seq]``, dropout 0, one data-parallel
replica, the model in train mode. :func:`comm_events` and :func:`step_time` also trace ``dp`` replicas at ZeRO
``zero_stage`` 0 to 3, with ``clip`` (keyword arguments): GradientSync's all-reduces (and at stage 1 the
all-gather of the optimizer's slices) or FSDP's all-gathers and reduce-scatters over ``data_parallel``, and the clipping norm's all-reduces, each rank's calls equal to
``count_comm``'s (:mod:`lightning_tp2d.planning.trace` says what is assumed about FSDP's streams). Notation:
``N = batch * seq`` tokens, ``h`` hidden, ``V`` vocabulary, ``L`` blocks, ``p`` tensor-parallel ranks, ``q = sqrt(p)``
the grid side of the 2-D layouts.

Element sizes. ``elem`` is the size of the matmul operands and activations (4: float32; 2: bfloat16 *autocast* with
float32 parameters, as the benchmarks and Lightning's ``bf16-mixed`` run; 8: float64). The code keeps some tensors
in float32 whatever ``elem`` (float64 when ``elem`` is 8), written ``ep`` below: parameters and their gradients,
the token/position embeddings and the residual stream they start, LayerNorm and cross-entropy statistics, and the
ring kernels' gradient accumulators (``metp.acc_dtype``).

Communication (:func:`comm_events`) is read from the code: :mod:`lightning_tp2d.planning.trace` runs one step of the
real layers of the layout on torch's fake process group with fake tensors and records every call of
:mod:`lightning_tp2d.comm` in order (kind, axis, the group's ranks, payload bytes, phase) together with the FLOPs
computed while it is in flight, so ``totals(comm_events(...))`` is what :func:`lightning_tp2d.comm.count_comm`
counts on that rank by construction (``tests/test_cost_model.py`` still checks it against real gloo runs, float32 and
bf16 autocast). There is no hand-written event list: a schedule change in a layer (a prefetch, double buffering, a
new collective) changes the model with no edit here. ``"single"`` sends nothing; ``"tp1d"`` (torch's own tensor
parallelism, the baseline) is :func:`lightning_tp2d.planning.rivals.tp1d_comm_events`, and ``"tp1d-sp"`` (the same with
sequence parallelism) :func:`lightning_tp2d.planning.rivals.tp1d_sp_comm_events`; torch's context parallelism
(``"cp"``, not a layout: :func:`cp_step_time`) its declared schedule,
:func:`lightning_tp2d.planning.rivals.cp_comm_events`.

``overlap_flops`` is the compute a transfer runs behind: every FLOP computed between posting a call and waiting for it
is shared among the calls in flight in proportion to their bytes (SUMMA: the broadcast of panel ``l+1`` is posted
before the multiply of panel ``l``; ring: the exchange posted at step ``t`` runs during step ``t``'s compute), priced at
the rate of the kernel that computed it (matmul or attention). Blocking calls overlap nothing.

FLOPs (:func:`flops`) count matmuls (``2 m k n``) and attention (``4 d`` per visible score forward, ``10 d``
backward, as flash kernels recompute the scores), nothing elementwise. Causal attention counts the visible scores
``T (T+1)/2`` per sequence and head; the METP ring (:func:`lightning_tp2d.metp.visible`) computes exactly the
visible blocks: on every off-diagonal step ``2c²`` scores (``c = seq/(2p)``), on its own diagonal block
``c (2c+1)``, never a fully masked block, and in total exactly the causal count. METP's MLP recomputes
``X W1`` in backward (40 instead of 32 ``n h²`` FLOPs per block) and its LM head recomputes the logits (``6 n h V``
instead of ``4``); the 2-D LM head multiplies the padded vocabulary ``q * Vr``.

The time model (:class:`Hardware`, :func:`step_time`) turns events into seconds per call with textbook
collective costs on the link the group uses, and charges each call only what its overlapped compute does not
hide. The trace records each call's global ranks (one tensor-parallel group starting at rank 0): a group whose ranks
lie on more than one node of ``gpus_per_node`` uses the inter-node link.
"""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass

from lightning_tp2d.families import anatomy
from lightning_tp2d.planning.events import Comm, float32_bytes
from lightning_tp2d.planning.gemm_rates import H200_BF16, GemmPoint, aligned, unaligned_slowdown
from lightning_tp2d.planning.gemm_rates import fit as fit_gemm_rates
from lightning_tp2d.planning.memory_model import baseline_activation_bytes, parameter_split
from lightning_tp2d.planning.rivals import AXIS as TP_AXIS
from lightning_tp2d.planning.rivals import (CHUNK_TOKENS, LOSSES, RING_AXIS, block_linears, check_sequence_parallel,
                                            cp_comm_events, recomputed_sp_events, tp1d_comm_events,
                                            tp1d_sp_comm_events)
from lightning_tp2d.planning.trace import trace_step, trace_steps
from lightning_tp2d import rivals as rv
from lightning_tp2d.layouts import Grid2D, Layout, get_layout, layout_names
from lightning_tp2d.rivals import is_rival
from lightning_tp2d.models.config import max_seq_len
from lightning_tp2d.models.gpt2 import GPT2Config
from lightning_tp2d.parallelize import ACTIVATION_CHECKPOINTING

GRID_2D = Grid2D.name  # the layout the projection compares with 1-D tensor parallelism
ONE_D = rv.TP1D.name  # the projection's other side: torch's 1-D tensor parallelism (its rows' key)
# not layouts of this package: the plain model and torch's 1-D tensor parallelism, without and with sequence parallelism
BASELINES = (rv.SINGLE.name, rv.TP1D.name, rv.TP1D_SP.name)


def _layouts() -> tuple[str, ...]:
    return BASELINES + layout_names()


def _rival(layout) -> rv.Rival | None:
    return rv.get_rival(layout) if is_rival(layout) else None


def _one_device(layout) -> bool:
    """The plain model on one rank (``"single"``)."""
    rival = _rival(layout)
    return rival is not None and rival.one_device


def _one_dimensional(layout) -> bool:
    """torch's 1-D TP, with or without sequence parallelism (``"tp1d"``, ``"tp1d-sp"``)."""
    rival = _rival(layout)
    return rival is not None and rival.tensor_parallel


def _sequence_parallel(layout) -> bool:
    """torch's 1-D TP + SP (``"tp1d-sp"``)."""
    return _one_dimensional(layout) and _rival(layout).sequence_parallel


__all__ = ["Link", "Hardware", "H100_NVLINK4_NDR", "H200_NVLINK4_NDR", "H100_GRAND_TETON", "A100_NVLINK3_HDR",
           "comm_events", "flops", "activation_bytes", "collective_time", "step_time", "cp_step_time",
           "OVERLAP", "OVERLAP_KINDS", "FITTED_OVERLAP", "overlap_rule",
           "with_measured_rates", "projected_speedup", "metp_overlap_threshold"]


def _check(layout: str | Layout, cfg: GPT2Config, batch: int, seq: int, p: int) -> int:
    """Validate the shapes the layout needs (those that decide byte counts); return its side (``q`` or ``p``).
    Head counts are not checked: bytes and FLOPs depend on the width only. ``layout`` is a baseline name, a layout
    name or a :class:`~lightning_tp2d.layouts.Layout` object (whose options, e.g. the ring kernels' double
    buffering, the trace runs with)."""
    if not isinstance(layout, Layout) and layout not in _layouts():
        raise ValueError(f"unknown layout {layout!r}; choose one of {list(_layouts())}")
    if not isinstance(p, int) or p < 1:
        raise ValueError(f"p must be a positive int, got {p!r}")
    if batch < 1 or seq < 1:
        raise ValueError(f"batch and seq must be positive, got batch={batch} seq={seq}")
    if max_seq_len(cfg) is not None and seq > cfg.block_size:  # (None: RoPE, any length)
        raise ValueError(f"seq {seq} exceeds block_size {cfg.block_size}")
    h = cfg.n_embd
    if _one_device(layout):
        if p != 1:
            raise ValueError(f"layout 'single' runs on one rank, got p={p}")
        return 1
    if _one_dimensional(layout):
        if h % p:
            raise ValueError(f"layout {layout!r}: n_embd={h} is not divisible by p={p}")
        if _sequence_parallel(layout):
            check_sequence_parallel(seq, p)
        return p
    spec = get_layout(layout)
    spec.check_tensor_parallel_size(p)
    side = spec.side(p)
    if h % side:
        raise ValueError(f"layout {spec.name!r}: n_embd={h} is not divisible by {spec.side_symbol}={side}")
    spec.check_input(p, batch, seq)
    return side


# ---- communication events (traced) ------------------------------------------------------------------------------


def _traced(layout: str, cfg: GPT2Config, batch: int, seq: int, p: int, elem: int, rank: int, **data):
    return trace_step(layout, cfg, batch, seq, p, elem, rank, **data)


def _check_checkpointing(checkpointing: str) -> None:
    if checkpointing not in ACTIVATION_CHECKPOINTING:
        raise ValueError(f"checkpointing={checkpointing!r} is not one of {ACTIVATION_CHECKPOINTING}")


def recomputed_linears(cfg, checkpointing: str) -> tuple[int, ...]:
    """Indices into a block's linears (:func:`~lightning_tp2d.planning.rivals.block_linears`, flattened, in forward
    order) whose forward product a baseline block runs again in its backward: ``"full"`` all of them; ``"selective"``
    every second one (torchtitan's per-op selective checkpointing saves the outputs of matmuls 1, 3, 5, ... of each
    block, of its attention kernel and of its reduce-scatters, and recomputes the rest); ``"none"`` none."""
    _check_checkpointing(checkpointing)
    n = sum(len(group) for group in block_linears(cfg))
    if checkpointing == "full":
        return tuple(range(n))
    if checkpointing == "selective":
        return tuple(range(1, n, 2))
    return ()


def _ranks_to_price(layout: str, cfg: GPT2Config, batch: int, seq: int, p: int, elem: int, **data) -> list[int]:
    """:func:`_representative_ranks`, traced in one request for a layout (later per-rank calls hit the cache)."""
    ranks = _representative_ranks(layout, p)
    if not is_rival(layout) and (p > 1 or data.get("dp", 1) > 1):
        trace_steps(layout, cfg, batch, seq, p, elem, ranks, **data)
    return ranks


def _timed_events(layout: str, cfg: GPT2Config, batch: int, seq: int, p: int, elem: int,
                  rank: int, async_tp: bool = False, lean_wire: bool = False, *, dp: int = 1, zero_stage: int = 0,
                  clip: bool = False, checkpointing: str = "none") -> list[tuple[Comm, float, float, tuple[int, ...]]]:
    """``(event, overlapped matmul FLOPs, overlapped attention FLOPs, the group's global ranks)`` per call kind.
    ``async_tp`` (``"tp1d-sp"`` only): the events carry the FLOPs of the matmul async TP would fuse them with.
    ``dp``, ``zero_stage``, ``clip``: the data-parallel part of the traced step (the package's layouts only)."""
    _check(layout, cfg, batch, seq, p)
    if not 0 <= rank < p:
        raise ValueError(f"rank {rank} is not in [0, {p})")
    if is_rival(layout) and (dp, zero_stage, clip) != (1, 0, False):
        raise ValueError(f"dp, zero_stage and clip are traced for the package's layouts, not for {layout!r} "
                         f"(got dp={dp}, zero_stage={zero_stage}, clip={clip})")
    _check_checkpointing(checkpointing)
    if is_rival(layout) and checkpointing != "none" and not _sequence_parallel(layout) and p > 1:
        raise ValueError(f"checkpointing is priced for the 'tp1d-sp' and 'single' baselines, not {layout!r}")
    # 1-D TP without SP, before the p == 1 shortcut: loss_parallel all-reduces even over one rank
    if _one_dimensional(layout) and not _sequence_parallel(layout):
        return [(ev, 0.0, 0.0, tuple(range(p))) for ev in tp1d_comm_events(cfg, batch, seq, p, elem)]
    if _sequence_parallel(layout):
        kw = dict(batch=batch, seq=seq, p=p, elem=elem, async_tp=async_tp, lean_wire=lean_wire)
        events = tp1d_sp_comm_events(cfg, **kw)
        events += recomputed_sp_events(cfg, events, checkpointing, **kw)
        return [(ev, ev.overlap_flops, 0.0, tuple(range(p))) for ev in events]
    if _one_device(layout) or (p == 1 and dp == 1):
        return []
    return list(_traced(layout, cfg, batch, seq, p, elem, rank, dp=dp, zero_stage=zero_stage, clip=clip,
                        checkpointing=checkpointing).events)


def comm_events(layout: str, cfg: GPT2Config, batch: int, seq: int, p: int, elem: int = 4,
                rank: int = 0, *, dp: int = 1, zero_stage: int = 0, clip: bool = False,
                checkpointing: str = "none") -> list[Comm]:
    """The communication of one training step on tensor-parallel rank ``rank``, traced from the layers (module
    docstring); ``totals()`` of it is what :func:`lightning_tp2d.comm.count_comm` counts on that rank (on every
    replica's rank ``rank``, when ``dp > 1``: ``dp`` replicas at ZeRO ``zero_stage`` 0 to 3; ``clip``: the
    step clips the gradients by their global norm; :mod:`lightning_tp2d.planning.trace`). ``cfg``: a GPT-2 or Llama
    config (any registered family's).

    ``"single"`` and ``p == 1`` on one replica send nothing (``[]``), except ``"tp1d"`` and ``"tp1d-sp"``, which are
    :func:`lightning_tp2d.planning.rivals.tp1d_comm_events` and :func:`lightning_tp2d.planning.rivals.tp1d_sp_comm_events`
    (as the code runs them: blocking, no overlap). Events are merged where identical (same kind, group,
    bytes, overlap and phase). Only the shapes that decide byte counts are validated (hidden size, batch or
    sequence divisibility); head-count divisibility is not checked.
    """
    timed = _timed_events(layout, cfg, batch, seq, p, elem, rank, dp=dp, zero_stage=zero_stage, clip=clip,
                          checkpointing=checkpointing)
    if _one_dimensional(layout):
        return [ev for ev, _, _, _ in timed]
    merged: dict[Comm, int] = {}
    for ev, _, _, _ in timed:
        key = Comm(ev.kind, ev.group, ev.group_size, ev.nbytes, 1, ev.overlap_flops, ev.phase)
        merged[key] = merged.get(key, 0) + ev.calls
    return [Comm(k.kind, k.group, k.group_size, k.nbytes, n, k.overlap_flops, k.phase) for k, n in merged.items()]


# ---- FLOPs ----------------------------------------------------------------------------------------------------


def flops(layout: str, cfg: GPT2Config, batch: int, seq: int, p: int, checkpointing: str = "none",
          elem: int = 4) -> dict:
    """FLOPs one rank computes in one training step: ``{"forward", "backward", "total", "matmul", "attention"}``
    (``matmul + attention == total``; ``attention_forward``: the forward's part of ``attention``). Matmuls ``2 m k n``; attention ``4 d`` per visible score forward and ``10 d``
    backward (flash kernels recompute the scores). Elementwise work is not counted.

    The package's layouts: traced from the layers (every ``mm``/``addmm``/``bmm`` and fused attention kernel they
    run, causal blocks counting their visible scores), so METP's recomputations (``X W1`` in the MLP backward, the
    logits in the LM-head backward) and the 2-D LM head's padded vocabulary are whatever the code does.
    ``tests/test_cost_model.py`` checks them against closed forms. The baselines: linears ``24 N h²`` forward and
    ``48 N h²`` backward per GPT-2 block (a Llama block: ``2 N`` times its weights' entries forward,
    :func:`~lightning_tp2d.planning.rivals.block_linears`, twice that backward; ``/p`` for tp1d and tp1d-sp, which
    compute the same), attention over ``T(T+1)/2`` scores per sequence and head, LM head ``2 N h V`` / ``4 N h V``
    (tp1d, tp1d-sp: ``ceil(V/p)``).

    ``gemms``: matrix-product kernels launched (traced: every ``mm``/``addmm``/``bmm``; a SUMMA product is ``q`` panel
    products forward and ``2q`` backward; the baselines ``12 L + 3``, Llama ``21 L + 3``), each charged the hardware's
    GEMM overhead.

    ``checkpointing``: the backward also runs what the checkpointed blocks recompute; traced for the package's
    layouts (as :func:`~lightning_tp2d.parallelize.checkpoint_activations` applies it), for the baselines
    :func:`recomputed_linears` (and ``"full"`` the block's attention forward again). ``elem``: the element size of
    the trace to read them from (FLOPs do not depend on it; the one :func:`step_time` traces anyway is reused).
    """
    _check(layout, cfg, batch, seq, p)
    _check_checkpointing(checkpointing)
    h, V, L, T, B = cfg.n_embd, cfg.vocab_size, cfg.n_layer, seq, batch
    if not is_rival(layout):
        # what the layers compute, traced (any rank: every rank of a layout computes the same)
        traced = _traced(layout, cfg, batch, seq, p, elem, 0, checkpointing=checkpointing)
        fl = traced.flops
        fwd, bwd = sum(fl["forward"].values()), sum(fl["backward"].values())
        attention = fl["forward"]["attention"] + fl["backward"]["attention"]
        return {"forward": fwd, "backward": bwd, "total": fwd + bwd, "matmul": fwd + bwd - attention,
                "attention": attention, "attention_forward": fl["forward"]["attention"],
                "gemms": sum(traced.gemms.values())}
    N = B * T
    causal = T * (T + 1) / 2  # visible scores per sequence and head
    k = 1 if _one_device(layout) else p
    vocab = V if _one_device(layout) else -(-V // p)
    linears = [shape for group in block_linears(cfg) for shape in group]  # GPT-2: 12 h² weights; Llama's own
    lin_f = 2.0 * N * sum(o * i for o, i in linears) / k
    lin_b = 2 * lin_f
    att_f, att_b = 4.0 * (h / k) * B * causal, 10.0 * (h / k) * B * causal
    head_f, head_b = 2.0 * N * h * vocab, 4.0 * N * h * vocab
    again = recomputed_linears(cfg, checkpointing)
    re_lin = 2.0 * N * sum(linears[i][0] * linears[i][1] for i in again) / k
    re_att = att_f if checkpointing == "full" else 0.0
    fwd = L * (lin_f + att_f) + head_f
    bwd = L * (lin_b + att_b + re_lin + re_att) + head_b
    attention = L * (att_f + att_b + re_att)
    gemms = L * (3 * len(linears) + len(again)) + 3  # per block each linear forward, its dX and dW backward; the head 1 + 2
    return {"forward": fwd, "backward": bwd, "total": fwd + bwd, "matmul": fwd + bwd - attention,
            "attention": attention, "attention_forward": L * att_f, "gemms": gemms}


# ---- saved activations --------------------------------------------------------------------------------------


def activation_bytes(layout: str, cfg: GPT2Config, batch: int, seq: int, p: int, elem: int = 4,
                     rank: int | None = None) -> int:
    """Bytes the forward leaves alive for the backward on one rank (``rank=None``: the largest over the ranks).

    The package's layouts: traced (:mod:`lightning_tp2d.planning.trace`), the bytes of every storage the forward
    creates that autograd saves for the backward -- saved activations, LayerNorm statistics, attention
    log-sum-exps, saved index tensors and, under bf16 autocast (``elem`` 2), the bf16 copies of the weight blocks
    the matmuls saved. Not counted: parameters and views of them, ``idx`` and ``targets``, whatever is freed before
    the forward returns (ring receive buffers, SUMMA panels, score tiles) and small tensors a layer keeps outside
    autograd's saved tensors (a few index vectors, tens of bytes). Checked against
    :class:`~lightning_tp2d.planning.live.LiveTensorBytes` on real gloo runs (``tests/test_cost_model.py``).

    The baselines, from their (torch-owned) code's saved tensors, per block and rank (``e = elem``; ``ep`` = 4, or 8
    for float64, for what stays float32 under autocast: the residual stream, LayerNorm inputs and statistics, lse,
    the loss's softmax; ``N = B*T``):

    ``"single"``
        ``N h (2 ep + 14 e)``: the two LayerNorm inputs (``ep``); the two LayerNorm outputs, q|k|v (3), the
        attention output (1), the MLP pre-activation (4) and GELU output (4), all ``e``; plus ``4 N ep`` (mean, rstd)
        and ``B H T ep`` (lse). Outside the blocks: the final LayerNorm, position ids ``8 T`` and the log-softmax
        ``N V ep``; with ``elem`` 2 the bf16 weight copies ``12 h² e`` per block and the head's.
    ``"tp1d"`` (Megatron without sequence parallelism: torch's ColwiseParallel / RowwiseParallel)
        ``N h (2 ep + 2 e) + 12 N h e / p``: LayerNorm inputs and outputs full on every rank, the column-parallel
        outputs split; ``4 N ep``, ``B H T ep / p``; the local log-softmax ``N ceil(V/p) ep`` and the embedding's
        masked ids ``8 N``.
    ``"tp1d-sp"`` (torch's SequenceParallel on the LayerNorms, the residual stream sequence-sharded)
        ``2 N h ep / p + 2 N h e + 12 N h e / p``: the LayerNorm inputs and statistics (``4 N ep / p``) are
        sharded, but the column-parallel linears save the *all-gathered* ``[N, h]`` input (DTensor keeps the
        gathered tensor for the weight gradient; Megatron saves the shard and gathers again in backward), so the
        LayerNorm-output term stays full; ``B H T ep / p``. Outside the blocks as tp1d, with the final LayerNorm's
        input and statistics sharded.

    A Llama config (``"tp1d"``, ``"tp1d-sp"``): :func:`lightning_tp2d.planning.memory_model.baseline_activation_bytes`
    (the planner's rule; ``composite``: the package's eager RMSNorm and RoPE tables), plus under autocast the bf16
    copies of the block matrices and the head's ``ceil(V/p)`` rows.
    """
    _check(layout, cfg, batch, seq, p)
    if rank is not None and not 0 <= rank < p:
        raise ValueError(f"rank {rank} is not in [0, {p})")
    if not is_rival(layout):
        ranks = _ranks_to_price(layout, cfg, batch, seq, p, elem) if rank is None else [rank]
        return max(_traced(layout, cfg, batch, seq, p, elem, r).activation_bytes for r in ranks)
    if _one_dimensional(layout) and anatomy(cfg).rms_norm:  # Llama: the planner's rule, as this eager model runs
        total = baseline_activation_bytes(cfg, batch, seq, p, elem=elem, ep=float32_bytes(elem), composite=True,
                                          sequence_parallel=_sequence_parallel(layout))["total"]
        if elem < 4:  # autocast's copies of the block matrices and the head's rows (the embedding is looked up)
            split = parameter_split(cfg)
            total += elem * (cfg.n_layer * (split.block - split.block_vectors) / p + -(-cfg.vocab_size // p) * cfg.n_embd)
        return int(total)
    h, V, L, T, B, H = cfg.n_embd, cfg.vocab_size, cfg.n_layer, seq, batch, cfg.n_head
    N = B * T
    e, ep = elem, float32_bytes(elem)
    k = 1 if _one_device(layout) else p
    s = p if _sequence_parallel(layout) else 1  # what sequence parallelism shards: LayerNorm inputs and statistics
    per_block = N * h * (2 * ep / s + 2 * e) + 12 * N * h * e / k + 4 * N * ep / s + B * H * T * ep / k
    vocab = V if _one_device(layout) else -(-V // p)
    if _one_dimensional(layout) and rank is not None:  # torch.chunk-style shards: the last rank(s) may hold fewer rows
        vocab = max(0, min(vocab, V - rank * vocab))
    final_ln = (N * h * ep + 2 * N * ep) / s + N * h * e  # input, mean and rstd (ep), output as the head saves it
    total = L * per_block + final_ln + N * vocab * ep + 8 * T
    if _one_dimensional(layout):
        total += 8 * N  # the embedding's masked copy of the ids (DTensor _MaskPartial)
    if elem < 4:
        total += L * 12 * h * h * e / k + vocab * h * e  # bf16 copies of the weights (autocast)
    return int(total)


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
    gemm_overhead_s: float = 0.0  # fixed seconds per GEMM kernel on top of FLOPs / rate (lightning_tp2d.planning.gemm_rates)
    hbm_bytes_per_s: float = 0.0  # memory bandwidth: prices elementwise work and the optimizer (planning.planner)
    peak_flops_per_s: float = 0.0  # dense bf16 peak, the denominator of MFU
    host_bytes_per_s: float = 0.0  # one GPU's host link per direction (pinned copies): prices activation offload
    host_memory_bytes: float = 0.0  # host memory of one node: what offloaded activations must fit in
    # times the line's seconds an unaligned product takes (planning.gemm_rates.unaligned_slowdown; 1: not measured)
    unaligned_gemm_slowdown: float = 1.0
    # float8 GEMMs' rate over the bf16 ones' (parallel.float8, float8_seconds); 0: the GPU has none
    float8_gemm_speedup: float = 0.0


# H100 SXM (bf16 dense peak ~989e12). Compute rates measured on an H200 (an H100's compute with more HBM) by
# recipes/gpu_rates.py on 2026-12-04 (torch 2.11, CUDA 13; recipes/benchmarks/gpu_rates/h200.json): GEMMs, the fit of
# lightning_tp2d.planning.gemm_rates.H200_BF16 (83 products at Llama 3.1 8B / 70B's 1-D TP shards and GPT-2
# medium's grid shards): the 82 aligned ones ~711e12 plus ~9.4 us per kernel, the 3x3 grid's unaligned shard 2.53x
# that line (lightning_tp2d.planning.gemm_rates.unaligned_slowdown); attention, torch's causal SDPA (flash) forward + backward
# over 32k tokens, 32 heads of 128: 541e12. Assumptions, not measurements: NVLink 4: 900 GB/s total = ~450 GB/s per
# direction, ~3 us per message; NDR InfiniBand 400 Gb/s = 50 GB/s per GPU (one NIC each), ~5 us; HBM3 3.35 TB/s (the
# datasheet's; the H200's measured copy reached 88% of its datasheet's 4.8). Host: PCIe Gen5 x16 per GPU, 64 GB/s per
# direction on paper, ~50 GB/s for pinned copies (assumed, not measured here); 2 TB of host memory per node (a DGX
# H100's).
_H100_GEMM_RATE, _H100_GEMM_OVERHEAD = fit_gemm_rates(H200_BF16)
_H100_ATTENTION_RATE = 541e12
# float8 GEMMs: not measured here yet (recipes/benchmarks/run_gpu_issue48.sh measures _scaled_mm beside bf16). Until
# then torchao's own roofline model (torchao/testing/training/roofline_utils.py, torchao 0.18: H100 fp8 peak 1979e12
# and bf16 989e12 dense, the same achievable fraction of each): 2.0x the bf16 rate, both recipes (torchao's rowwise
# path runs the tensorwise kernel and scales after it; its extra cast passes are priced as bytes, float8_seconds)
_H100_FLOAT8_SPEEDUP = 1979 / 989
H100_NVLINK4_NDR = Hardware("H100 SXM, NVLink 4 (8/node), NDR 400G", _H100_GEMM_RATE, _H100_ATTENTION_RATE,
                            intra=Link(3e-6, 450e9), inter=Link(5e-6, 50e9), gpus_per_node=8,
                            gemm_overhead_s=_H100_GEMM_OVERHEAD, hbm_bytes_per_s=3.35e12, peak_flops_per_s=989e12,
                            host_bytes_per_s=50e9, host_memory_bytes=2e12,
                            unaligned_gemm_slowdown=unaligned_slowdown(H200_BF16, _H100_GEMM_RATE,
                                                                       _H100_GEMM_OVERHEAD),
                            float8_gemm_speedup=_H100_FLOAT8_SPEEDUP)
# H200 SXM: an H100's compute with HBM3e, whose 1 GiB copy measured 4.23 TB/s (read + written) on 2026-12-04.
H200_NVLINK4_NDR = dataclasses.replace(H100_NVLINK4_NDR, name="H200 SXM, NVLink 4 (8/node), NDR 400G",
                                       hbm_bytes_per_s=4.23e12)
# The H100s torchtitan's published figures ran on (Meta's Grand Teton): 96 GB HBM2e at 2.4 TB/s, 500 W power limit;
# torchtitan says their peak lies between the SXM's and the NVL's (835e12): the rates above scaled by 835/989. MFU
# stays relative to the SXM peak, as torchtitan reports it.
H100_GRAND_TETON = dataclasses.replace(
    H100_NVLINK4_NDR, name="H100 96GB HBM2e at 500 W, NVLink 4 (8/node), 400G RDMA (torchtitan's Grand Teton)",
    matmul_flops_per_s=_H100_GEMM_RATE * 835 / 989, attention_flops_per_s=_H100_ATTENTION_RATE * 835 / 989, hbm_bytes_per_s=2.4e12)
# A100 SXM: bf16 dense peak 312e12, GEMMs ~230e12 (not calibrated: no per-kernel overhead), FA2 ~190e12. NVLink 3: 600 GB/s total = ~300 GB/s per
# direction; HDR InfiniBand 200 Gb/s = 25 GB/s per GPU.
A100_NVLINK3_HDR = Hardware("A100 SXM, NVLink 3 (8/node), HDR 200G", 230e12, 190e12,
                            intra=Link(3e-6, 300e9), inter=Link(5e-6, 25e9), gpus_per_node=8,
                            hbm_bytes_per_s=2.0e12, peak_flops_per_s=312e12,
                            host_bytes_per_s=25e9, host_memory_bytes=1e12)  # PCIe Gen4 x16; a DGX A100's 1 TB


def with_measured_rates(hw: Hardware, rates: dict) -> Hardware:
    """``hw`` with its compute and memory rates replaced by those measured on a GPU (the JSON ``recipes/gpu_rates.py``
    writes): GEMMs by the fit of its aligned products (:func:`lightning_tp2d.planning.gemm_rates.fit`: rate and overhead
    per kernel) and the slowdown of its unaligned ones, attention by its ``summary``'s rate (causal SDPA forward + backward at the longest length measured),
    memory by its copy bandwidth; float8 GEMMs, where it measured them (``float8_gemm``: ``torch._scaled_mm`` of the
    same shapes), by the ratio of their fitted rate to the bf16 one (else ``hw``'s assumed speedup stays); the links,
    node size and MFU peak stay ``hw``'s. ``ValueError`` naming what is missing if ``rates`` is not such a table."""
    try:
        points = [GemmPoint(r["m"], r["k"], r["n"], r["flops_per_s"], r.get("label", "")) for r in rates["gemm"]]
        attention, hbm = rates["summary"]["attention_flops_per_s"], rates["summary"]["hbm_bytes_per_s"]
        device = rates["device"]
    except (KeyError, TypeError) as err:
        raise ValueError(f"not a rate table of recipes/gpu_rates.py: no {err} in it") from None
    rate, overhead = fit_gemm_rates(points)
    float8 = [GemmPoint(r["m"], r["k"], r["n"], r["flops_per_s"], r.get("label", ""))
              for r in rates.get("float8_gemm", ()) if "flops_per_s" in r]
    speedup = hw.float8_gemm_speedup
    if len({p.flops for p in float8 if p.aligned}) >= 2:
        speedup = fit_gemm_rates(float8)[0] / rate
    return dataclasses.replace(hw, name=f"{hw.name}; rates measured on {device}", matmul_flops_per_s=rate,
                               gemm_overhead_s=overhead, attention_flops_per_s=attention, hbm_bytes_per_s=hbm,
                               unaligned_gemm_slowdown=unaligned_slowdown(points, rate, overhead),
                               float8_gemm_speedup=speedup)


# bytes each operand element moves to be cast to float8 from bf16: its amax read (2), then read (2) and written (1)
FLOAT8_CAST_BYTES = 5
# how many times each GEMM operand is cast per training step: tensorwise once (the forward's input and weight serve the
# backward's GEMMs, the output gradient both of its GEMMs); rowwise once per GEMM it enters (twice: along the other axis)
FLOAT8_CASTS = {"tensorwise": 1, "rowwise": 2}


def float8_seconds(cfg, tokens: int, p: int, checkpointing: str, recipe: str, hw: Hardware,
                   weight_shards: int = 1) -> dict:
    """What training the linears in float8 changes in one micro-batch's compute on one rank, the same rule for every
    side (the layouts' ``parallel.float8``, the rivals with torchao's recipe): ``gemm_saved_s``, the linears' GEMM
    seconds at the bf16 rate less at ``hw.float8_gemm_speedup`` times it (their FLOPs: ``6 N`` per weight entry, and
    ``2 N`` again per recomputed linear, ``/ p``: every side computes ``1/p`` of them), and ``cast_s``, the casts'
    memory traffic (:data:`FLOAT8_CAST_BYTES` per element of each linear's input, weight and output gradient shards,
    ``N in + in out + N out`` over ``p``, :data:`FLOAT8_CASTS` times, recomputed inputs and weights again) at the HBM
    rate. The LM head, attention and the loss stay bf16. ``tokens``: ``N``, the replica's tokens per micro-batch.
    ``weight_shards``: the weights are cast as FSDP shards of ``1 / weight_shards`` before their float8 all-gather
    (torchao's ``enable_fsdp_float8_all_gather``, :func:`float8_gather_element`), not whole after a bf16 one.
    What travels is priced elsewhere: the grids' float8 panels and amax all-reduces in their closed forms
    (:mod:`~lightning_tp2d.planning.closed_grid`), the rivals' float8 FSDP all-gathers by
    :func:`float8_gather_element`. Not priced: the ring's float8 weight blocks (priced in bf16)."""
    if recipe not in FLOAT8_CASTS:
        raise ValueError(f"float8={recipe!r} is not one of {list(FLOAT8_CASTS)}")
    if hw.float8_gemm_speedup <= 0:
        raise ValueError(f"float8={recipe!r}: {hw.name} has no float8 GEMMs")
    linears = [shape for group in block_linears(cfg) for shape in group]
    again = recomputed_linears(cfg, checkpointing)
    entries = sum(o * i for o, i in linears) + sum(linears[k][0] * linears[k][1] for k in again) / 3
    linear_flops = 6.0 * tokens * entries * cfg.n_layer / p
    gemm_s = linear_flops / hw.matmul_flops_per_s
    elements = sum(tokens * i + i * o / weight_shards + tokens * o for o, i in linears)
    elements += sum(tokens * linears[k][1] + linears[k][0] * linears[k][1] / weight_shards for k in again)
    cast_bytes = FLOAT8_CAST_BYTES * FLOAT8_CASTS[recipe] * elements * cfg.n_layer / p
    return {"gemm_saved_s": gemm_s * (1.0 - 1.0 / hw.float8_gemm_speedup),
            "cast_s": cast_bytes / hw.hbm_bytes_per_s if hw.hbm_bytes_per_s else 0.0}


def float8_gather_element(cfg, elem: int) -> float:
    """Bytes per element FSDP all-gathers of one block's parameters when its linears' weights travel as float8
    (torchao's ``enable_fsdp_float8_all_gather``, tensorwise: one byte each) and its vectors (norms, biases) in the
    ``elem``-byte compute dtype, averaged over the block's parameters."""
    linear = sum(o * i for group in block_linears(cfg) for o, i in group)
    total = parameter_split(cfg).block
    return (linear + elem * (total - linear)) / total


def collective_time(kind: str, n: int, nbytes: float, link: Link) -> float:
    """Seconds for one call of ``kind`` over ``n`` ranks with ``nbytes`` payload (the ``Comm.nbytes`` convention).

    Broadcast / reduce (pipelined tree): ``latency * ceil(log2 n) + nbytes / bw``; ring all-reduce:
    ``2(n-1) latency + 2(n-1)/n * nbytes / bw``; all-gather (of the local input): ``(n-1)(latency + nbytes/bw)``;
    reduce-scatter (of the full input): ``(n-1)(latency + nbytes/(n bw))``; send and ring exchange:
    ``latency + nbytes / bw``; all-to-all (of the local input): ``(n-1)(latency + nbytes/(n bw))``. A ``recv`` costs
    nothing: it is the other direction of the matching ``send``
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
    if kind == "all_to_all":  # of the local input: (n-1)/n of it leaves, one message per peer
        return (n - 1) * (lat + nbytes / (n * bw))
    raise ValueError(f"unknown communication kind {kind!r}")


def _link(hw: Hardware, ranks) -> Link:
    return hw.intra if len({g // hw.gpus_per_node for g in ranks}) == 1 else hw.inter


# The overlap rule, one efficiency per collective kind: the fraction of a call's hideable time (the part its
# overlapped FLOPs could cover, :func:`_hidden`) that is really hidden, applied alike to the package's events
# (SUMMA's broadcasts and reduces, the ring's exchanges, traced with the compute they run behind) and to the rivals'
# (torch's async TP's all-gathers and reduce-scatters, context parallelism's ring). "fitted": 0.57 for every kind,
# the one value that reproduces torchtitan's published async / blocking TP gains on H100s (bf16, compile: 8B on 64
# GPUs, FSDP 8 x TP 8: 1.098x; 70B on 256, FSDP 32 x TP 8: 1.092x; recipes/benchmarks/scale.py's calibration rows);
# no measurement separates the kinds, so the package's collectives get the value the baseline's were fitted to.
# "pessimistic": nothing hidden (every call exposed, as blocking code runs it); "ideal": all of the hideable time
# hidden (what the cost model assumed for the package before the rule; its functions' default, so their traced
# numbers stay checkable against closed forms). The data-parallel part is not an event of the step: the planner
# prices it by one function for both sides (:func:`lightning_tp2d.planning.planner.data_parallel_time`).
OVERLAP_KINDS = ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter", "send", "ring_exchange",
                 "all_to_all")
FITTED_OVERLAP = 0.57
OVERLAP = {"fitted": dict.fromkeys(OVERLAP_KINDS, FITTED_OVERLAP),
           "pessimistic": dict.fromkeys(OVERLAP_KINDS, 0.0),
           "ideal": dict.fromkeys(OVERLAP_KINDS, 1.0)}


def overlap_rule(overlap="ideal") -> dict[str, float]:
    """The efficiency per collective kind (:data:`OVERLAP`) that ``overlap`` names: a preset (``"fitted"``,
    ``"pessimistic"``, ``"ideal"``), one number for every kind, or a mapping kind -> efficiency (kinds it leaves out
    take ``"ideal"``'s 1). Every efficiency lies in ``[0, 1]``."""
    if isinstance(overlap, str):
        if overlap not in OVERLAP:
            raise ValueError(f"overlap={overlap!r} is not one of {sorted(OVERLAP)}, a number or a mapping")
        return dict(OVERLAP[overlap])
    if isinstance(overlap, (int, float)) and not isinstance(overlap, bool):
        rule = dict.fromkeys(OVERLAP_KINDS, float(overlap))
    elif isinstance(overlap, dict) or hasattr(overlap, "items"):
        unknown = sorted(set(overlap) - set(OVERLAP_KINDS))
        if unknown:
            raise ValueError(f"overlap names unknown collective kinds {unknown}; kinds: {list(OVERLAP_KINDS)}")
        rule = {**OVERLAP["ideal"], **{k: float(v) for k, v in overlap.items()}}
    else:
        raise ValueError(f"overlap must be a preset name {sorted(OVERLAP)}, a number or a mapping, got {overlap!r}")
    bad = {k: v for k, v in rule.items() if not 0.0 <= v <= 1.0}
    if bad:
        raise ValueError(f"overlap efficiencies must lie in [0, 1], got {bad}")
    return rule


def _hidden(ev: Comm, t: float, matmul_flops: float, attention_flops: float, rates: dict, async_tp: bool,
            overlap: dict[str, float]) -> tuple[float, int]:
    """``(seconds of the call's ``t`` hidden, extra GEMM kernels)`` by the one rule for every event, the package's
    and the rivals' alike: ``overlap[kind]`` (:func:`overlap_rule`) of the hideable time, which is ``min(t,
    overlapped matmul FLOPs / matmul rate + overlapped attention FLOPs / attention rate)``; under ``async_tp`` a call
    carrying matmul FLOPs is micro-pipelined with that matmul in ``n`` chunks (the group's size), of which the first
    cannot hide, so its hideable time is ``min(t - t / n, matmul FLOPs / matmul rate)``, and the matmul runs as ``n``
    kernels (:func:`step_time`)."""
    efficiency = overlap[ev.kind] if ev.kind in overlap else 1.0
    if async_tp and matmul_flops > 0:
        return efficiency * min(t - t / ev.group_size, matmul_flops / rates["matmul"]), ev.group_size - 1
    return efficiency * min(t, matmul_flops / rates["matmul"] + attention_flops / rates["attention"]), 0


def vocab_block_rows(cfg, k: int) -> int:
    """Rows of one rank's vocabulary block over ``k`` ranks as its head multiplies it: ``ceil(V/k)`` padded to the
    config's ``pad_vocab_multiple`` (the layouts' heads pad each block; the rivals' priced as padded the same way)."""
    multiple = getattr(cfg, "pad_vocab_multiple", 1) or 1
    return -(-(-(-cfg.vocab_size // k)) // multiple) * multiple


def unaligned_share(layout: str, cfg, p: int, tp: int = 1) -> float:
    """The share of one rank's linear and head FLOPs that run in unaligned products (a contiguous width, ``k`` or
    ``n``, not a multiple of :data:`~lightning_tp2d.planning.gemm_rates.ALIGNMENT`), under ``layout`` on ``p``
    ranks: each product weighted by its weight's entries (every product of a side runs on the same tokens).

    The local widths of a linear ``[out, in]`` (:func:`~lightning_tp2d.planning.rivals.block_linears`): a grid of
    side ``q`` cuts both by ``q``; a ring (the METP blocks of ``B`` and ``C``) and 1-D TP (``"tp1d"``,
    ``"tp1d-sp"``) cut ``out`` of the linears that read a block's input and ``in`` of the output projections;
    ``"single"`` / ``"cp"`` / ``"ulysses"`` cut neither (``tp`` > 1: CP's ranks each run 1-D TP over ``tp``). The
    head's vocabulary: the config's ``pad_vocab_multiple`` padding each block as the layouts' heads pad it (a grid's
    ``ceil(V/q)`` rows, a ring's ``ceil(V/p)``, at width ``h/q`` and ``h``), and the 1-D rivals' ``ceil(V/p)`` rows
    padded the same way: a user who pads the package's vocabulary pads torch's too."""
    h, V = cfg.n_embd, cfg.vocab_size
    if layout in layout_names():
        lay = get_layout(layout)
        k = lay.side(p)
        both = lay.square
    else:
        k, both = (p if _one_dimensional(layout) else tp), False
    groups = block_linears(cfg)
    products = []  # (weight entries, local widths)
    for g, group in enumerate(groups):
        for out, inp in group:
            widths = ((out // k, inp // k) if both else (out // k, inp) if g % 2 == 0 else (out, inp // k))
            products.append((cfg.n_layer * out * inp, widths))
    products.append((V * h, (vocab_block_rows(cfg, k), h // k if both else h)))
    total = sum(w for w, _ in products)
    return sum(w for w, widths in products if not aligned(*widths)) / total


def _unaligned_seconds(share: float, matmul_s: float, hw: Hardware) -> float:
    """What the unaligned ``share`` of ``matmul_s`` adds: ``(slowdown - 1)`` times its part."""
    return share * (hw.unaligned_gemm_slowdown - 1.0) * matmul_s


def step_time(layout: str, cfg: GPT2Config, batch: int, seq: int, p: int, hw: Hardware, elem: int = 2,
              async_tp: bool = False, lean_wire: bool = False, *, dp: int = 1, zero_stage: int = 0,
              clip: bool = False, checkpointing: str = "none", ranks=None, overlap="ideal") -> dict:
    """Projected seconds of one training step: ``compute_s = matmul FLOPs / matmul rate + GEMM kernels * GEMM
    overhead + attention FLOPs / attention rate`` (shape-dependent GEMM rates: :mod:`lightning_tp2d.planning.gemm_rates`),
    plus ``unaligned_s``: the unaligned products' share of the matmul time (:func:`unaligned_share`) again
    ``unaligned_gemm_slowdown - 1`` times; per call ``t`` from :func:`collective_time` on its group's link, exposed
    ``t - overlap[kind] * min(t, overlapped matmul FLOPs / matmul rate + overlapped attention FLOPs / attention
    rate)`` (:func:`_hidden`; ``overlap``: :func:`overlap_rule`'s preset, number or mapping, default ``"ideal"``:
    efficiency 1, ``max(0, t - ...)``; the planner passes ``"fitted"``);
    ``total_s = compute_s + exposed_comm_s``. Ranks wait for each other, so the step is its slowest rank's
    (returned, with ``rank``); ``comm_bytes`` is that rank's payload as :func:`lightning_tp2d.comm.count_comm` counts
    it. Also returned: ``flops`` (:func:`flops`).

    ``async_tp`` (``"tp1d-sp"`` only) models torch's async tensor parallelism (micro-pipeline TP, which splits
    each all-gather / reduce-scatter next to a column- / row-parallel matmul into ``p`` steps overlapped with the
    matmul's pieces): the first of the ``p`` chunks cannot overlap, the other ``(p-1)/p`` of ``t`` hide behind the
    matmul, so such a call exposes ``t / p + max(0, t (p-1)/p - matmul FLOPs / matmul rate)``: ``t / p`` when the
    matmul covers the rest, never more than the blocking ``t``; the ``p - 1`` extra chunk products each pay the GEMM
    overhead. The same efficiency rule as every other event's: exposed ``t - overlap[kind] * min(t (p-1)/p,
    matmul FLOPs / matmul rate)``, the efficiency of the call's kind being the one the package's calls of that kind
    get (:data:`OVERLAP`: ``"fitted"`` 0.57 on both sides). The other calls stay blocking. ``lean_wire`` (``"tp1d-sp"`` only): its activation collectives in the
    compute dtype, as Megatron-LM with bf16 parameters sends them (:func:`~lightning_tp2d.planning.rivals.tp1d_sp_comm_events`).
    ``dp``, ``zero_stage``, ``clip``: the data-parallel part of the traced step, as for :func:`comm_events` (a
    group's ranks tell its link: ``data_parallel`` groups of replicas on other nodes pay the inter-node one).
    ``checkpointing``: the blocks' activations checkpointed in that mode (:func:`flops`; the recomputed collectives
    traced, for ``"tp1d-sp"`` :func:`~lightning_tp2d.planning.rivals.recomputed_sp_events`). ``ranks``: the tensor-parallel ranks to price
    (default: one of each kind the layout names, :meth:`~lightning_tp2d.layouts.Layout.distinct_ranks`)."""
    if (async_tp or lean_wire) and not _sequence_parallel(layout):
        raise ValueError(f"async_tp and lean_wire model the 'tp1d-sp' baseline, not layout {layout!r}")
    rule = overlap_rule(overlap)
    fl = flops(layout, cfg, batch, seq, p, checkpointing, elem)
    rates = {"matmul": hw.matmul_flops_per_s, "attention": hw.attention_flops_per_s}
    unaligned = _unaligned_seconds(unaligned_share(layout, cfg, p), fl["matmul"] / rates["matmul"], hw)
    compute = (fl["matmul"] / rates["matmul"] + unaligned + fl["gemms"] * hw.gemm_overhead_s
               + fl["attention"] / rates["attention"])
    worst = None
    data = dict(dp=dp, zero_stage=zero_stage, clip=clip, checkpointing=checkpointing)
    if ranks is None:
        ranks = _ranks_to_price(layout, cfg, batch, seq, p, elem, **data)
    for rank in ranks:
        comm_s = exposed = 0.0
        nbytes = 0
        split_gemms = 0  # async TP cuts each fused matmul into p chunk products: p - 1 more kernels each
        for ev, fm, fa, group in _timed_events(layout, cfg, batch, seq, p, elem, rank, async_tp, lean_wire, **data):
            t = collective_time(ev.kind, ev.group_size, ev.nbytes, _link(hw, group))
            hidden, chunks = _hidden(ev, t, fm, fa, rates, async_tp, rule)
            comm_s += ev.calls * t
            exposed += ev.calls * (t - hidden)
            split_gemms += ev.calls * chunks
            nbytes += ev.calls * ev.nbytes
        rank_compute = compute + split_gemms * hw.gemm_overhead_s
        result = {"compute_s": rank_compute, "comm_s": comm_s, "exposed_comm_s": exposed,
                  "total_s": rank_compute + exposed, "comm_bytes": nbytes, "rank": rank, "flops": fl,
                  "unaligned_s": unaligned}
        if worst is None or result["total_s"] > worst["total_s"]:
            worst = result
    return worst


def cp_step_time(cfg, batch: int, seq: int, p: int, hw: Hardware, elem: int = 2, *, dp: int = 1,
                 checkpointing: str = "none", tp: int = 1, async_tp: bool = False,
                 overlap="ideal", loss: str = "chunked", chunk_tokens: int | None = None) -> dict:
    """Projected seconds of one step of torch's context parallelism over ``p`` ranks (``"cp"``, CP x FSDP2 over
    ``p * dp``; :mod:`lightning_tp2d.baselines.context_parallel`) on one rank, as :func:`step_time` returns them; with
    ``tp`` > 1 (``"cp-tp"``) each CP rank is ``tp`` ranks of 1-D TP + SP, ``p * tp`` ranks in all.

    FLOPs: the plain model's (:func:`flops` of ``"single"``, with ``checkpointing``) over ``p``, as every layer runs
    on ``T/p`` tokens and the head-tail balancer gives each rank exactly ``1/p`` of the causal scores; the same number
    of GEMM kernels as the plain model, each ``1/p`` the size. ``tp`` > 1: the linears and the LM head of ``"tp1d-sp"``
    on the ``T/p`` tokens over ``tp`` ranks, the attention ``1 / (p tp)`` of the plain model's. Communication: torch's
    ring (:func:`~lightning_tp2d.planning.rivals.cp_comm_events`, axis ``"cp"``) on the link of the CP ranks
    (``tp`` apart), each call exposing ``max(0, t - its overlapped attention FLOPs / attention rate)`` (the
    all-gathers behind the diagonal block's kernel, the dK/dV permutes behind the next step's, the last behind
    nothing); TP + SP's calls (axis ``"tp"``, ``tp`` consecutive ranks) exposed as :func:`step_time` exposes
    ``"tp1d-sp"``'s, blocking or ``async_tp``; every call hides ``overlap[kind]`` (:func:`overlap_rule`, default
    ``"ideal"``) of what its overlapped FLOPs could hide, the ring's as the TP calls' (:func:`_hidden`); ``comm_bytes`` their
    payload. FSDP's all-gathers and reduce-scatters are the data-parallel part, priced by the planner as for plain
    FSDP over ``p * dp`` ranks (:func:`lightning_tp2d.planning.planner.data_parallel_time`).

    ``loss="chunked"`` (the default; :func:`~lightning_tp2d.baselines.context_parallel.chunked_cross_entropy` over
    chunks of ``chunk_tokens``, default its ``CHUNK_TOKENS``): the backward recomputes every chunk's logits, one
    more head matmul (``2 (B T/p) h ceil(V/tp)`` FLOPs, in ``backward`` and ``matmul``), and the head runs 4 GEMM
    kernels a chunk (forward, recomputation, input and weight gradients) instead of 3 in all; ``"unfused"``: the
    plain model's head, the earlier numbers."""
    if loss not in LOSSES:
        raise ValueError(f"loss={loss!r} is not one of {LOSSES}")
    rule = overlap_rule(overlap)
    single = flops(rv.SINGLE.name, cfg, batch, seq, 1, checkpointing, elem)
    if tp == 1:
        fl = {k: (v if k == "gemms" else v / p) for k, v in single.items()}
    else:  # the linears as 1-D TP + SP runs them on T/p tokens; attention over the whole causal sequence
        local = flops(rv.TP1D_SP.name, cfg, batch, seq // p, tp, checkpointing, elem)
        att, att_f = single["attention"] / (p * tp), single["attention_forward"] / (p * tp)
        fwd = local["forward"] - local["attention_forward"] + att_f
        bwd = local["backward"] - (local["attention"] - local["attention_forward"]) + (att - att_f)
        fl = {"forward": fwd, "backward": bwd, "total": fwd + bwd, "matmul": local["matmul"], "attention": att,
              "attention_forward": att_f, "gemms": local["gemms"]}
    if loss == "chunked":  # each chunk's logits recomputed in the backward: the head's forward again
        tokens = batch * seq // p
        recomputed = 2.0 * tokens * cfg.n_embd * -(-cfg.vocab_size // tp)
        fl = {**fl, "backward": fl["backward"] + recomputed, "total": fl["total"] + recomputed,
              "matmul": fl["matmul"] + recomputed,
              "gemms": fl["gemms"] - 3 + 4 * -(-tokens // (chunk_tokens or CHUNK_TOKENS))}
    rates = {"matmul": hw.matmul_flops_per_s, "attention": hw.attention_flops_per_s}
    unaligned = _unaligned_seconds(unaligned_share(rv.CP.name, cfg, p, tp), fl["matmul"] / rates["matmul"],
                                   hw)
    compute = (fl["matmul"] / rates["matmul"] + unaligned + fl["gemms"] * hw.gemm_overhead_s
               + fl["attention"] / rates["attention"])
    links = {RING_AXIS: _link(hw, range(0, p * tp, tp)), TP_AXIS: _link(hw, range(tp))}
    comm_s = exposed = 0.0
    nbytes = split_gemms = 0
    chunking = {"loss": loss} if chunk_tokens is None else {"loss": loss, "chunk_tokens": chunk_tokens}
    for ev in cp_comm_events(cfg, batch, seq, p, elem, dp=dp, checkpointing=checkpointing, tp=tp, async_tp=async_tp,
                             **chunking):
        if ev.group not in links:  # FSDP's: the planner's data-parallel part
            continue
        t = collective_time(ev.kind, ev.group_size, ev.nbytes, links[ev.group])
        matmul, attention = (ev.overlap_flops, 0.0) if ev.group == TP_AXIS else (0.0, ev.overlap_flops)
        hidden, chunks = _hidden(ev, t, matmul, attention, rates, async_tp and ev.group == TP_AXIS, rule)
        comm_s += ev.calls * t
        exposed += ev.calls * (t - hidden)
        split_gemms += ev.calls * chunks
        nbytes += ev.calls * ev.nbytes
    compute += split_gemms * hw.gemm_overhead_s
    return {"compute_s": compute, "comm_s": comm_s, "exposed_comm_s": exposed, "total_s": compute + exposed,
            "comm_bytes": nbytes, "rank": 0, "flops": fl, "unaligned_s": unaligned}


def ulysses_step_time(cfg, batch: int, seq: int, p: int, hw: Hardware, elem: int = 2, *,
                      checkpointing: str = "full", mlp_tiles: bool = True, overlap="ideal") -> dict:
    """Projected seconds of one step of Ulysses sequence parallelism with ALST's tiling over ``p`` ranks
    (:mod:`lightning_tp2d.baselines.ulysses`: DeepSpeed's ``UlyssesSPAttentionHF``, ``TiledMLP``,
    ``TiledFusedLogitsLoss``; FSDP2 over the ranks is the planner's data-parallel part), as :func:`cp_step_time`
    returns them.

    FLOPs: the plain model's (with ``checkpointing``) over ``p``: every linear runs on ``T/p`` tokens and each rank's
    attention covers the whole causal sequence for ``n_head / p`` heads (balanced without a zigzag); ``mlp_tiles``:
    ``TiledMLP`` recomputes each tile's forward once more in the backward (its forward keeps no graph), one MLP
    forward more per block. The tiled loss runs each tile's backward inside the forward: no recomputation.
    Communication: per block and pass (forward, its recomputation under full checkpointing, backward), four
    all-to-alls over the ``p`` ranks: q (``h``), k and v (``n_kv_head * hs`` each, or ``p * hs`` when DeepSpeed
    replicates the key/value heads up to ``p``) and the output (``h``), ``batch * T/p`` rows of ``elem`` bytes each;
    DeepSpeed issues them between the projections and the attention kernel, so none is hidden: they carry no
    overlapped FLOPs, and the overlap rule (``overlap``, :func:`overlap_rule`, as for every other event) hides
    nothing of them whatever its efficiency."""
    hs, a = cfg.n_embd // cfg.n_head, anatomy(cfg)
    kv_heads = max(a.kv_heads, p)
    single = flops(rv.SINGLE.name, cfg, batch, seq, 1, checkpointing, elem)
    fl = {k: (v if k == "gemms" else v / p) for k, v in single.items()}
    if mlp_tiles:
        inner, mats = a.mlp_width, 3 if a.gated_mlp else 2
        again = cfg.n_layer * 2.0 * batch * seq / p * cfg.n_embd * inner * mats
        fl = {**fl, "backward": fl["backward"] + again, "total": fl["total"] + again, "matmul": fl["matmul"] + again}
    unaligned = _unaligned_seconds(unaligned_share(rv.ULYSSES.name, cfg, p), fl["matmul"] / hw.matmul_flops_per_s,
                                   hw)
    compute = (fl["matmul"] / hw.matmul_flops_per_s + unaligned + fl["gemms"] * hw.gemm_overhead_s
               + fl["attention"] / hw.attention_flops_per_s)
    rows = batch * seq // p
    widths = (cfg.n_embd, kv_heads * hs, kv_heads * hs, cfg.n_embd)
    passes = 3 if checkpointing == "full" else 2
    link = _link(hw, range(p))
    calls = [(rows * w * elem) for w in widths] * passes * cfg.n_layer
    rule = overlap_rule(overlap)
    comm = sum(collective_time("all_to_all", p, nbytes, link) for nbytes in calls)
    exposed = comm - rule["all_to_all"] * 0.0  # the rule's efficiency times no hideable time: all exposed
    return {"compute_s": compute, "comm_s": comm, "exposed_comm_s": exposed, "total_s": compute + exposed,
            "comm_bytes": sum(calls), "rank": 0, "flops": fl, "unaligned_s": unaligned}


def _representative_ranks(layout: str, p: int) -> list[int]:
    """One rank of each kind whose schedule can differ (the layout says which); for tp1d and single all are alike."""
    if is_rival(layout):
        return [0]
    return get_layout(layout).distinct_ranks(p)


def projected_speedup(cfg: GPT2Config, batch: int, seq: int, gpus=(4, 16, 64), hw: Hardware = H100_NVLINK4_NDR,
                      elem: int = 2) -> list[dict]:
    """For each GPU count ``N`` (one tensor-parallel group of ``p = N`` ranks, no data parallelism): the step
    time of ``"2d"`` (a ``sqrt(N) x sqrt(N)`` grid), of ``"tp1d"`` and of ``"tp1d-sp"`` (blocking, as the code runs it,
    and with torch's async TP modelled; both with bf16 on the wire, ``lean_wire``: the strongest form of the
    baseline), and ``speedup = tp1d / 2d`` (> 1: 2d is faster). One group across nodes is not how 1-D TP runs at 16
    and 64 GPUs: :func:`fair_configurations` compares the best tensor x data parallel configurations instead. Each entry: ``gpus``, ``q``,
    ``nodes``, ``tp1d``, ``tp1d_sp``, ``tp1d_sp_async`` and ``2d`` (:func:`step_time` dicts), ``tp1d_s``,
    ``tp1d_sp_s``, ``tp1d_sp_async_s``, ``2d_s``, ``speedup``. ``seq`` must divide by every ``N`` (sequence
    parallelism). Head-count divisibility is ignored (the model's widths are split, not its heads);
    ``batch`` must divide by every ``q`` and ``n_embd`` by every ``N``."""
    out = []
    for n in gpus:
        q = math.isqrt(n)
        if q * q != n:
            raise ValueError(f"the 2d layout needs a square number of GPUs, got {n}")
        t2d = step_time(GRID_2D, cfg, batch, seq, n, hw, elem)
        t1d = step_time(rv.TP1D.name, cfg, batch, seq, n, hw, elem)
        sp = step_time(rv.TP1D_SP.name, cfg, batch, seq, n, hw, elem, lean_wire=True)
        sp_async = step_time(rv.TP1D_SP.name, cfg, batch, seq, n, hw, elem, async_tp=True, lean_wire=True)
        out.append({"gpus": n, "q": q, "nodes": -(-n // hw.gpus_per_node), ONE_D: t1d, "tp1d_sp": sp,
                    "tp1d_sp_async": sp_async, GRID_2D: t2d, "tp1d_s": t1d["total_s"], "tp1d_sp_s": sp["total_s"],
                    "tp1d_sp_async_s": sp_async["total_s"], "2d_s": t2d["total_s"],
                    "speedup": t1d["total_s"] / t2d["total_s"]})
    return out


def parameter_count(cfg: GPT2Config) -> int:
    """Parameters of the (tied) GPT-2: ``L (12 h² + 13 h)`` with biases (``12 h² + 4 h`` without: the two
    LayerNorms' weights only... and no linear biases), ``V h + block_size h`` embeddings, ``ln_f``."""
    h, L = cfg.n_embd, cfg.n_layer
    per_block = 12 * h * h + (13 * h if cfg.bias else 2 * h)
    return L * per_block + cfg.vocab_size * h + cfg.block_size * h + (2 * h if cfg.bias else h)


def data_parallel_all_reduce_time(nbytes: float, n: int, size: int, hw: Hardware) -> float:
    """Seconds of the gradient all-reduce of ``nbytes`` per rank over the data-parallel group of ``n / size``
    replicas of ``size`` consecutive ranks (the layout :func:`lightning_tp2d.mesh.init_mesh` builds). Inside one node
    a ring on NVLink; across nodes hierarchical (as NCCL's tree / PyTorch's hybrid sharding run it): a reduce-scatter
    among the group's ``k`` ranks of each node, an all-reduce of ``nbytes / k`` across the ``m`` nodes on InfiniBand,
    an all-gather back inside the node. Both families of :func:`fair_configurations` are priced by this one rule."""
    dp = n // size
    if dp <= 1:
        return 0.0
    per_node = max(1, min(dp, hw.gpus_per_node // size)) if size <= hw.gpus_per_node else 1
    nodes = -(-dp // per_node)
    if nodes == 1:
        return collective_time("all_reduce", dp, nbytes, hw.intra)
    local = 0.0
    if per_node > 1:  # reduce-scatter and all-gather of nbytes among the node's per_node ranks
        local = 2 * (per_node - 1) * (hw.intra.latency_s + nbytes / (per_node * hw.intra.bandwidth_Bps))
    return local + collective_time("all_reduce", nodes, nbytes / per_node, hw.inter)


def fair_configurations(cfg: GPT2Config, batch: int, seq: int, n: int, hw: Hardware = H100_NVLINK4_NDR,
                        elem: int = 2) -> dict:
    """Every way to run ``batch x seq`` on ``n`` GPUs as tensor parallelism x data parallelism, priced per step:
    ``{"tp1d": [...], "2d": [...], "best_tp1d": row, "best_2d": row, "speedup": best_tp1d / best_2d}``.

    1-D rows (the strongest baseline): ``tp <= gpus_per_node`` ranks of ``"tp1d-sp"`` with bf16 on the wire
    (``lean_wire``), without and with async TP (the faster counts), ``tp = 1`` the plain model, times
    ``dp = n / tp`` replicas of ``batch / dp`` sequences; their float32 gradient all-reduce (``P / tp`` numbers per
    rank, :func:`data_parallel_all_reduce_time`) overlaps the backward as DDP's buckets do: exposed
    ``max(0, t - backward compute)``.
    2-D rows: ``q x q`` grids (inside a node, or one grid across nodes) x ``dp = n / q²``; the gradient all-reduce of
    ``P / q²`` numbers overlaps the backward by the same rule (the strategy's
    :class:`~lightning_tp2d.training.GradientSync` posts its buckets during the backward). A configuration whose shapes do not divide (batch over replicas and grid rows, width, sequence) is
    skipped. Each row: ``layout``, ``tp`` (ranks per replica), ``dp``, ``batch`` (per replica), ``step`` (the
    :func:`step_time` dict), ``dp_comm_s``, ``dp_exposed_s``, ``total_s``."""
    P = parameter_count(cfg)
    rows: dict[str, list] = {ONE_D: [], GRID_2D: []}
    for tp in range(1, n + 1):
        if n % tp:
            continue
        dp = n // tp
        if batch % dp:
            continue
        b = batch // dp
        q = math.isqrt(tp)
        candidates = []
        if tp <= hw.gpus_per_node and cfg.n_embd % tp == 0 and seq % tp == 0:
            if tp == 1:
                candidates.append((ONE_D, rv.SINGLE.name, step_time(rv.SINGLE.name, cfg, b, seq, 1, hw, elem)))
            else:
                candidates.append((ONE_D, rv.TP1D_SP.name, min(
                    (step_time(rv.TP1D_SP.name, cfg, b, seq, tp, hw, elem, async_tp=a, lean_wire=True) for a in (False, True)),
                    key=lambda r: r["total_s"])))
        if q > 1 and q * q == tp and b % q == 0 and cfg.n_embd % q == 0:
            candidates.append((GRID_2D, GRID_2D, step_time(GRID_2D, cfg, b, seq, tp, hw, elem)))
        for family, layout, step in candidates:
            grads = float32_bytes(elem) * P / tp
            dp_comm = data_parallel_all_reduce_time(grads, n, tp, hw)
            fl = step["flops"]
            backward_s = step["compute_s"] * fl["backward"] / fl["total"]
            dp_exposed = max(0.0, dp_comm - backward_s)
            rows[family].append({"layout": layout, "tp": tp, "dp": dp, "batch": b, "step": step,
                                 "dp_comm_s": dp_comm, "dp_exposed_s": dp_exposed,
                                 "total_s": step["total_s"] + dp_exposed})
    if not rows[ONE_D] or not rows[GRID_2D]:
        raise ValueError(f"no {'1-D' if not rows[ONE_D] else '2-D'} configuration of batch {batch} x seq {seq} "
                         f"fits {n} GPUs")
    best = {k: min(v, key=lambda r: r["total_s"]) for k, v in rows.items()}
    return {**rows, "best_tp1d": best[ONE_D], "best_2d": best[GRID_2D],
            "speedup": best[ONE_D]["total_s"] / best[GRID_2D]["total_s"]}


def metp_overlap_threshold(cfg: GPT2Config, hw: Hardware, elem: int = 2, causal: bool = True) -> int:
    """Smallest per-rank sequence length ``S = seq/p`` (even: two zigzag chunks) for which one forward ring step's
    attention compute hides its ``K|V`` transfer on the intra-node link (docs/layouts.md, "metp"), one sequence:

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
