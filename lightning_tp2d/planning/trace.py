"""The communication schedule of one training step, read from the code: the real layers run on torch's fake process
group with fake tensors (shapes and dtypes, no data, no compute), and every call of :mod:`lightning_tp2d.comm` is
recorded in order together with the FLOPs the step computes between calls.

What is recorded per call: kind, mesh axis, the global ranks of its group (so the time model can tell an NVLink group
from one that crosses nodes), payload bytes (:mod:`lightning_tp2d.comm`'s convention), the phase (forward or backward)
and the compute it overlaps: every FLOP computed while a call is in flight (posted, not yet waited for) is shared by
the calls in flight *on the same stream* in proportion to their bytes, and tagged with the rate that prices it
(``"matmul"`` for ``mm``/``addmm``/``bmm``..., ``"attention"`` for fused attention kernels; causal attention counts
the visible scores only). A blocking call overlaps nothing. So a schedule change in a layer (a prefetch moved,
double buffering off, panels kept) changes the traced overlap with no edit here.

The step is ``loss = model(idx, targets); loss.backward()`` on one data-parallel replica by default. With ``dp > 1``
(``dp`` replicas on a ``dp x p`` mesh; this replica's calls, which every replica repeats on its own ranks) the step
also runs what the strategies run over ``data_parallel`` at ``zero_stage``, assembled by the same call
(:func:`lightning_tp2d.step.assemble_step`): stage 0 averages the gradients with
:class:`~lightning_tp2d.training.GradientSync` (buckets all-reduced while the backward runs, waited for after it);
stage 1 does too, and after the step all-gathers the optimizer's updated slices
(:meth:`~lightning_tp2d.zero.ShardedOptimizer.after_step`: bucketed all-gathers, up to three in flight, behind no
compute; the optimizer's arithmetic is not counted); stages 2 and 3 shard the model with :func:`lightning_tp2d.fsdp.shard_data_parallel` (bf16 autocast, ``elem`` 2,
with :func:`~lightning_tp2d.fsdp.mixed_precision_policy` ``"bf16-mixed"``), whose all-gathers and reduce-scatters
:mod:`lightning_tp2d.comm_record` sees in ``torch.distributed``. ``clip``: the gradients are then clipped by their
global norm as the strategies clip (:func:`lightning_tp2d.training.clip_grad_norm_`, at stages 2 and 3
:func:`lightning_tp2d.fsdp.clip_grad_norm_`). The optimizer step itself communicates nothing and is not run. Everything after the forward is phase ``"backward"``.

Streams and FSDP's schedule, as on a GPU. Calls over the tensor axes share one budget of compute (one stream, as
with ``dp = 1``); the data-parallel calls run on other streams (other communicators, usually other links) and hide
behind the same compute independently: ``comm``'s calls over ``data_parallel`` (GradientSync's buckets, the
clipping norm, the all-reduce of the parameters FSDP leaves whole), FSDP's all-gathers and FSDP's reduce-scatters
each share their own budget. FSDP issues its collectives on its own streams without the host waiting, so its calls
are not timed where the host meets them but by FSDP's schedule, assuming the host runs ahead of the device:

* forward: a group's all-gather starts when the previous group's all-gather has finished (its stream is free and
  the host has issued it), so it runs behind the previous group's forward compute (the root's, which comes first,
  and the first block's run behind nothing: the embeddings compute no counted FLOPs);
* backward (stage 3): FSDP prefetches the next group's all-gather when a group's backward starts (the root's, at
  the loss, prefetches the last block's); it runs behind that group's backward compute until the group it gathers
  starts its backward (a tensor hook on each block's output tells when; it fires before FSDP's own);
* each reduce-scatter is issued after its group's backward and runs behind the next (earlier) groups' backward
  until the next reduce-scatter is issued (one at a time on its stream) or, for the last (the root's), until the
  backward ends.

Assumed, not traced: the host is never the bottleneck, copy-in/copy-out kernels take no time, and transfers on
different streams do not slow each other.

One step is traced per rank, with ``n_layer`` 1 and 2: blocks are identical, so the second trace minus the first is
one block's events, and a model of ``L`` blocks is ``trace(1) + (L - 1) * block`` (at stages 2 and 3 each block's
FSDP group adds its own all-gathers and reduce-scatter, and the FSDP streams keep its overlaps the same). At stage 0
with ``dp > 1`` GradientSync's buckets (cut every 25 MiB in reverse parameter order) do not repeat per block: that
step is traced with all ``n_layer`` blocks. Tracing needs this process to have no default process group of its own;
the traces run in a forked worker process, so nothing of the fake group stays behind.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import multiprocessing as mp
import os
import warnings
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import _clear_python_sharding_prop_cache  # private: see _private_api
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from lightning_tp2d import comm_record, recompute
from lightning_tp2d.planning import closed_step as closed
from lightning_tp2d.planning.events import Comm
from lightning_tp2d.planning.live import _DEVICE, tensors_in
from lightning_tp2d.planning.processes import start_process
from lightning_tp2d.planning.steps import TracedStep
from lightning_tp2d.families import family_of, family_of_config, fits
from lightning_tp2d.layouts import DATA_AXIS, Layout, get_layout
from lightning_tp2d.mesh import init_mesh
from lightning_tp2d.ops import register_mesh
from lightning_tp2d.step import assemble_step, prepare_model
from lightning_tp2d.train_plan import ZERO_STAGES, TrainPlan, fsdp_shards
from lightning_tp2d.parallelize import ACTIVATION_CHECKPOINTING

_MATMUL_FLOPS = {packet.__name__: formula for packet, formula in flop_registry.items()
                 if packet.__name__ in ("mm", "addmm", "bmm", "baddbmm")}
# parallel.float8's GEMMs: [m, k] @ [k, n], the same FLOPs as the mm they replace (priced at the float8 rate by
# cost_model.float8_seconds)
_MATMUL_FLOPS["_scaled_mm"] = lambda a, b, *args, out_val=None, **kwargs: 2 * a.shape[0] * a.shape[1] * b.shape[1]
_SCALED_MM = torch.ops.aten._scaled_mm


def _scaled_mm_shape(a, b, scale_a=None, scale_b=None, bias=None, scale_result=None, out_dtype=None,
                     use_fast_accum=False, out=None):
    """``torch._scaled_mm``'s output for the trace (either overload: ``out=`` is returned as it is): its shape and
    dtype only. Fake tensors have no CPU kernel for it and would run the real one on zero-filled copies (slow, and
    it hung a forked tracer whose parent had started OpenMP threads)."""
    if out is not None:
        return out
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype or a.dtype)
_DTYPES = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}
TRACED_STAGES = ZERO_STAGES  # the tracer runs every ZeRO stage


class _Recorder(TorchDispatchMode):
    """Records comm calls (a :func:`lightning_tp2d.comm_record.recording` target) and the FLOPs of the ops that run
    between them (a dispatch mode); :meth:`overlaps` shares each op's FLOPs among the calls in flight on its stream
    (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.chunks: list[tuple[int, float]] = []  # (slot: 0 matmul, 1 attention; FLOPs) of each op that computes
        self.calls: list[list] = []  # [call, phase, start, end]: in flight while chunks[start:end] compute
        self.in_flight: dict[int, list] = {}  # id(call) -> entry of comm's calls not waited for yet
        self.flops = {phase: {"matmul": 0.0, "attention": 0.0} for phase in ("forward", "backward")}
        self.gemms = {"forward": 0, "backward": 0}
        self._gathered = 0  # chunk index where the last FSDP all-gather of the forward finished
        self._gathering: list[list] = []  # FSDP all-gathers prefetched in the backward, until their group starts
        self._scattering: list[list] = []  # the FSDP reduce-scatter on its stream, until the next one
        self._created: dict[int, int] = {}  # storages created in the forward: key -> bytes
        self._saved: set[int] = set()  # of those, the ones autograd saved for the backward

    def save(self, t: torch.Tensor) -> torch.Tensor:
        """``saved_tensors_hooks`` pack hook: note the storage of what autograd keeps, keep the tensor as is."""
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
            self._saved.add(_storage(t)[0])
        return t

    def keep(self, args) -> None:
        """Forward pre-hook of a fully checkpointed block: the checkpoint holds the block's inputs for its
        recomputation (outside any saved-tensor hook)."""
        for t in tensors_in(args):
            if isinstance(t, torch.Tensor):
                self.save(t.to_local() if isinstance(t, DTensor) else t)

    def saved_bytes(self) -> int:
        """Bytes of the storages the forward created and autograd saved for the backward."""
        return sum(self._created[k] for k in self._saved if k in self._created)

    # comm_record.recording protocol
    def posted(self, call: comm_record.CommCall) -> None:
        now = len(self.chunks)
        entry = [call, self.phase, now, None]
        self.calls.append(entry)
        if not call.direct:
            self.in_flight[id(call)] = entry
        elif call.kind == "all_gather" and self.phase == "forward":
            entry[2:] = [self._gathered, now]  # behind the previous group's forward
            self._gathered = now
        elif call.kind == "all_gather":
            self._gathering.append(entry)
        elif call.kind == "reduce_scatter":
            self._close(self._scattering)
            self._scattering.append(entry)
        else:  # another direct call: blocking
            entry[3] = now

    def waited(self, call: comm_record.CommCall) -> None:
        entry = self.in_flight.pop(id(call), None)
        if entry is not None:
            entry[3] = len(self.chunks)

    def group_backward_starts(self, grad: torch.Tensor) -> None:
        """Tensor hook on an FSDP group's output: the group's backward starts, its prefetched all-gather is needed."""
        self._close(self._gathering)

    def backward_done(self) -> None:
        self._close(self._gathering)
        self._close(self._scattering)

    def _close(self, entries: list[list]) -> None:
        for entry in entries:
            entry[3] = len(self.chunks)
        entries.clear()

    def overlaps(self) -> list[tuple[comm_record.CommCall, str, float, float]]:
        """``(call, phase, overlapped matmul FLOPs, overlapped attention FLOPs)`` of every call, in posting order:
        each op's FLOPs shared among the calls in flight on its stream in proportion to their bytes."""
        starts, ends = defaultdict(list), defaultdict(list)
        for entry in self.calls:
            if entry[2] < entry[3]:
                starts[entry[2]].append(entry)
                ends[entry[3]].append(entry)
        shares = {id(entry): [0.0, 0.0] for entry in self.calls}
        active: dict[str, dict[int, list]] = defaultdict(dict)  # stream -> in-flight entries, by id
        for i, (slot, flops) in enumerate(self.chunks):
            for entry in ends.get(i, ()):
                del active[_stream(entry[0])][id(entry)]
            for entry in starts.get(i, ()):
                active[_stream(entry[0])][id(entry)] = entry
            for entries in active.values():
                total = sum(e[0].nbytes for e in entries.values())
                for e in entries.values() if total else ():
                    shares[id(e)][slot] += flops * e[0].nbytes / total
        return [(entry[0], entry[1], *shares[id(entry)]) for entry in self.calls]

    # FLOPs, and the direct collectives (comm_record.recording(direct=False): one Python dispatch layer, not two)
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor desugars into local ops, which come back through this mode
        if func is _DEVICE:
            return func(*args)  # a fake tensor's device asked from C++ (indexing...): over half the ops of a trace
        kwargs = kwargs or {}
        call = comm_record.direct_call(func, args)
        if func.overloadpacket is _SCALED_MM:
            out = _scaled_mm_shape(*args, **kwargs)
        elif call is None:
            out = func(*args, **kwargs)
        else:
            self.posted(call)
            out = func(*args, **kwargs)
            self.waited(call)
        if self.phase == "forward":
            self._track(args, kwargs, out)
        name = func.overloadpacket.__name__
        if "scaled_dot_product" in name and "attention" in name:
            self._compute(_attention_flops(func, args, kwargs, backward=name.endswith("_backward")), "attention")
        else:
            formula = _MATMUL_FLOPS.get(name.rstrip("_"))  # addmm_ and friends: the in-place forms
            if formula is not None:
                self.gemms[self.phase] += 1
                self._compute(float(formula(*args, **kwargs, out_val=out)), "matmul")
        return out

    def _track(self, args, kwargs, out) -> None:
        """Remember each new storage an op returns (views and in-place results share an input's storage)."""
        inputs = {_storage(t)[0] for t in tensors_in((args, kwargs))}
        for t in tensors_in(out):
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
                key, storage = _storage(t)
                if key not in inputs and storage.nbytes():
                    self._created[key] = storage.nbytes()

    def _compute(self, flops: float, rate: str) -> None:
        if flops:
            self.flops[self.phase][rate] += flops
            self.chunks.append((0 if rate == "matmul" else 1, flops))


def _stream(call: comm_record.CommCall) -> str:
    """The stream whose budget of compute ``call`` hides behind (module docstring): the tensor axes' one, or over
    ``data_parallel`` comm's, FSDP's all-gathers' or FSDP's reduce-scatters'."""
    if call.axis != DATA_AXIS:
        return "tensor"
    return f"fsdp {call.kind}" if call.direct else DATA_AXIS


def _storage(t: torch.Tensor):
    """``(key, storage)`` of a tensor's storage; the key tells storages apart while they live (fake ones too)."""
    storage = t.untyped_storage()
    return storage._cdata, storage  # the StorageImpl's address (private; see lightning_tp2d._private_api)


def _attention_flops(func, args, kwargs, backward: bool) -> float:
    """FLOPs of a fused attention kernel: ``4 d`` per visible score forward, ``10 d`` backward (the scores are
    recomputed); a causal mask leaves ``(S+1)/(2S)`` of a square block visible."""
    names = [a.name for a in func._schema.arguments]
    at = lambda name, default=None: kwargs.get(name, args[names.index(name)] if names.index(name) < len(args)  # noqa: E731
                                                else default) if name in names else default
    q, k = at("query"), at("key")
    *lead, sq, d = q.shape
    sk = k.shape[-2]
    scores = float(sq * sk)
    for size in lead:
        scores *= size
    if at("is_causal", False):
        visible = sum(min(r + 1, sk) for r in range(sq)) if sq != sk else sq * (sq + 1) // 2  # top-left aligned
        scores *= visible / (sq * sk)
    return (10.0 if backward else 4.0) * d * scores


def config_key(cfg) -> tuple:
    """A hashable key of a model config's class and fields (a dict field, e.g. Llama's ``rope_scaling``, as its
    sorted items): the caches of the tracer and the memory model."""
    return (type(cfg).__name__, *sorted((k, tuple(sorted(v.items())) if isinstance(v, dict) else v)
                                        for k, v in vars(cfg).items()))


@dataclasses.dataclass(frozen=True)
class _DataParallel:
    """What a traced step runs over ``data_parallel`` (module docstring): ``dp`` replicas, ZeRO ``stage``,
    clipping by the global norm."""

    dp: int = 1
    stage: int = 0
    clip: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.dp, int) or isinstance(self.dp, bool) or self.dp < 1:
            raise ValueError(f"dp must be a positive int, got {self.dp!r}")
        if self.stage not in TRACED_STAGES:
            raise ValueError(f"zero_stage={self.stage!r} is not traced: choose one of {list(TRACED_STAGES)}")

    @property
    def sharded(self) -> bool:
        """Whether FSDP shards the model (stages 2 and 3 on more than one replica)."""
        return fsdp_shards(self.stage, self.dp)

    @property
    def repeats_per_block(self) -> bool:
        """Whether every block adds the same calls (the two-trace rule holds): not with GradientSync's buckets."""
        return self.dp == 1 or self.sharded


_CACHE: dict[tuple, TracedStep] = {}
_ALL_RANKS_UP_TO = 9  # trace every rank of groups this small at once (tests and tools ask for each in turn) ...
_ALL_RANKS_BELOW_ELEMENTS = 2**24  # ... when the model is small too (h * seq * batch): a planner asks for one rank
_AS_ASKED: list[bool] = []  # inside ranks_as_asked(): trace only the ranks asked for


@contextlib.contextmanager
def ranks_as_asked():
    """Within this context :func:`trace_steps` traces only the ranks it is asked for (the planner prices one rank
    per configuration; tracing every rank of a small group at once pays off only when each is asked for)."""
    _AS_ASKED.append(True)
    try:
        yield
    finally:
        _AS_ASKED.pop()


_CLOSED: contextvars.ContextVar[bool] = contextvars.ContextVar("closed_forms", default=False)


@contextlib.contextmanager
def closed_forms():
    """Within this context :func:`trace_steps` answers with :func:`~lightning_tp2d.planning.closed_step.closed_step`
    (arithmetic on the config, milliseconds) for the cases it models (:func:`~lightning_tp2d.planning.closed_step.models`)
    and traces the rest as outside it. Nests; per thread and task (a context variable)."""
    token = _CLOSED.set(True)
    try:
        yield
    finally:
        _CLOSED.reset(token)


def trace_step(layout: str | Layout, cfg, batch: int, seq: int, p: int, elem: int = 4, rank: int = 0, *,
               dp: int = 1, zero_stage: int = 0, clip: bool = False, checkpointing: str = "none") -> TracedStep:
    """The traced step of tensor-parallel rank ``rank`` of the first replica (``n_layer`` blocks, by the two-trace
    rule of the module docstring), ``cfg`` a config of a registered model family (GPT-2, Llama). ``elem``: 4
    float32, 2 bf16 autocast (float32 parameters), 8 float64. ``dp`` replicas at ZeRO ``zero_stage`` (0 to 3)
    and ``clip``: what the step runs over ``data_parallel`` (module docstring); the defaults trace one replica's
    forward and backward. ``checkpointing``: the model's blocks under
    :func:`~lightning_tp2d.parallelize.checkpoint_activations` in that mode, as the strategies apply it; then
    ``activation_bytes`` are what the checkpointed forward keeps (``"full"``: each block's input, held by the
    checkpoint, and the root's saved tensors; ``"selective"``: what is saved as a tensor, not as a recipe), and the
    backward's FLOPs, GEMMs and calls include the recomputation. Cached."""
    return trace_steps(layout, cfg, batch, seq, p, elem, [rank], dp=dp, zero_stage=zero_stage, clip=clip,
                       checkpointing=checkpointing)[rank]


def trace_steps(layout: str | Layout, cfg, batch: int, seq: int, p: int, elem: int, ranks, *, dp: int = 1,
                zero_stage: int = 0, clip: bool = False, checkpointing: str = "none") -> dict[int, TracedStep]:
    """:func:`trace_step` for several ranks; the ones not cached yet are traced together in one child process
    (every rank when ``p`` is small)."""
    spec = get_layout(layout)
    if elem not in _DTYPES:
        raise ValueError(f"elem must be 2 (bf16 autocast), 4 (float32) or 8 (float64), got {elem}")
    if family_of_config(cfg) is None:
        raise ValueError(f"cfg must be the config of a registered model family, got {type(cfg).__name__}")
    if checkpointing not in ACTIVATION_CHECKPOINTING:
        raise ValueError(f"checkpointing={checkpointing!r} is not one of {ACTIVATION_CHECKPOINTING}")
    data = _DataParallel(dp, zero_stage, bool(clip))
    ranks = list(ranks)
    for rank in ranks:
        if not 0 <= rank < p:
            raise ValueError(f"rank {rank} is not in [0, {p})")
    if _CLOSED.get() and closed.models(spec, cfg, p, elem, dp=dp, zero_stage=zero_stage, clip=clip) is None:
        return {rank: closed.closed_step(spec, cfg, batch, seq, p, elem, rank, checkpointing=checkpointing)
                for rank in ranks}
    base = (type(spec), spec.options, config_key(cfg), batch, seq, p, elem, data, checkpointing)
    small = p <= _ALL_RANKS_UP_TO and cfg.n_embd * seq * batch <= _ALL_RANKS_BELOW_ELEMENTS and not _AS_ASKED
    wanted = set(ranks) | (set(range(p)) if small else set())
    missing = sorted(r for r in wanted if base + (r,) not in _CACHE)
    if missing:
        traced = _run(spec, _traceable(spec, cfg, p), batch, seq, p, elem, data, missing, checkpointing)
        for rank, step in traced.items():
            _CACHE[base + (rank,)] = step
    return {rank: _CACHE[base + (rank,)] for rank in ranks}


def _traceable(spec: Layout, cfg, p: int):
    side = spec.side(p)
    if not fits(spec, p, cfg) and cfg.n_embd % side == 0:
        # Bytes and FLOPs depend on the width, not on how it is cut into heads: trace with heads the layout takes.
        heads = {name: side for name in ("n_head", "n_kv_head") if hasattr(cfg, name)}
        cfg = dataclasses.replace(cfg, **heads)
    return cfg


_SHALLOW: dict[tuple, TracedStep] = {}  # in the worker: the one- and two-block traces, for any depth


def _trace_rank(spec: Layout, cfg, batch: int, seq: int, p: int, elem: int, data: _DataParallel,
                rank: int, checkpointing: str = "none") -> TracedStep:
    if cfg.n_layer == 1:  # the one-block trace a deeper model of this shape may have made already
        return _shallow(spec, cfg, batch, seq, p, elem, data, rank, checkpointing)
    if not data.repeats_per_block:
        return _run_here(spec, cfg, batch, seq, p, elem, data, rank, checkpointing)
    one, two = (_shallow(spec, dataclasses.replace(cfg, n_layer=n), batch, seq, p, elem, data, rank, checkpointing)
                for n in (1, 2))
    try:
        return _extrapolate(one, two, cfg.n_layer)
    except _NotLinear:  # e.g. ZeRO-1's bucketed gather of what FSDP keeps whole (GPT-2's q/k/v bias on the grids)
        return _run_here(spec, cfg, batch, seq, p, elem, data, rank, checkpointing)


class _NotLinear(RuntimeError):
    """A call the second block does not repeat (a bucket holding every block's parameters): trace every block."""


def _shallow(spec: Layout, cfg, *args) -> TracedStep:
    """:func:`_run_here`, remembered: models of one shape and any depth share their one- and two-block traces."""
    key = (type(spec), spec.options, config_key(cfg), *args)
    if key not in _SHALLOW:
        _SHALLOW[key] = _run_here(spec, cfg, *args)
    return _SHALLOW[key]


def _extrapolate(one: TracedStep, two: TracedStep, layers: int) -> TracedStep:
    def counts(step):
        out = defaultdict(int)
        for ev, fm, fa, ranks in step.events:
            out[(dataclasses.replace(ev, calls=1), fm, fa, ranks)] += ev.calls
        return out

    c1, c2 = counts(one), counts(two)
    events = []
    for key in c1.keys() | c2.keys():
        block = c2.get(key, 0) - c1.get(key, 0)
        if block < 0:
            raise _NotLinear(f"traced schedule is not linear in the number of blocks: {key[0]}")
        calls = c1.get(key, 0) + (layers - 1) * block
        if calls:
            ev, fm, fa, ranks = key
            events.append((dataclasses.replace(ev, calls=calls), fm, fa, ranks))
    flops = {ph: {r: one.flops[ph][r] + (layers - 1) * (two.flops[ph][r] - one.flops[ph][r])
                  for r in one.flops[ph]} for ph in one.flops}
    activation = one.activation_bytes + (layers - 1) * (two.activation_bytes - one.activation_bytes)
    gemms = {ph: one.gemms[ph] + (layers - 1) * (two.gemms[ph] - one.gemms[ph]) for ph in one.gemms}
    block_calls = sum(c2.values()) - sum(c1.values())
    return TracedStep(tuple(sorted(events, key=_order)), flops, activation, gemms, block_calls)


def _order(item) -> tuple:
    """A total order of ``(event, matmul FLOPs, attention FLOPs, ranks)`` items, whatever order they came in."""
    ev, fm, fa, ranks = item
    return (ev.phase, ev.kind, ev.group, ev.nbytes, ev.overlap_flops, fm, fa, ranks, ev.calls)


class _Worker:
    """A forked process that traces on request, for the life of the process that started it: the fake process
    group, its meshes and everything torch caches about them (group names, DTensor's sharding-propagation cache keyed
    by mesh shape) stay out of the caller, whose later real process groups (or forked ranks) would otherwise meet
    them, while the fake-tensor caches stay warm from one trace to the next (a cold trace costs ~4x a warm one)."""

    def __init__(self) -> None:
        ctx = mp.get_context("fork")
        self.owner = os.getpid()
        self.conn, theirs = ctx.Pipe()
        self.process = start_process(ctx, _serve, (theirs,), daemon=True, name="tp2d-trace")  # ends with us
        theirs.close()

    def usable(self) -> bool:
        return self.owner == os.getpid() and self.process.is_alive()

    def close(self) -> None:
        """End the worker (its pipe closed, it returns; killed if it does not within a second)."""
        self.conn.close()
        self.process.join(1.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    def call(self, fn, *args):
        """``fn(*args)`` in the worker (``fn`` a module-level function: sent by name)."""
        self.conn.send((fn, args))
        try:
            status, value = self.conn.recv()
        except EOFError:
            status, value = "error", f"the tracing process died (exit code {self.process.exitcode})"
        if status != "ok":
            raise RuntimeError(value)
        return value


_WORKERS: list[_Worker] = []  # this process's tracing worker (at most one)
_GROUP_WORKERS: dict[tuple[int, int], _Worker] = {}  # workers that keep a fake group of (world, rank), oldest first
_MAX_GROUP_WORKERS = 4


def in_worker(fn, *args, group: tuple[int, int] | None = None):
    """``fn(*args)`` in one of this process's fake-group workers (:class:`_Worker`, started on first use): the
    tracer's and the memory model's builds on torch's fake process group.

    ``group=None``: the tracing worker; ``fn`` creates and destroys its own fake group (an error destroys one left
    behind). ``group=(world, rank)``: a worker kept for that group (at most :data:`_MAX_GROUP_WORKERS`, the least
    recently used closed first), in which ``fn`` calls :func:`fake_group` and :func:`fake_mesh`: the group and its
    meshes live on between calls, so DTensor's sharding-propagation caches, keyed by mesh, stay valid and warm (a
    build with cold caches costs 2-3x a warm one)."""
    if dist.is_initialized():
        raise RuntimeError("the schedule tracer runs the layers on its own fake process group; call the cost model "
                           "from a process without a default process group (e.g. the benchmark's parent process)")
    if group is None:
        if not (_WORKERS and _WORKERS[0].usable()):
            _WORKERS[:] = [_Worker()]
        return _WORKERS[0].call(fn, *args)
    worker = _GROUP_WORKERS.pop(group, None)
    if worker is None or not worker.usable():
        while len(_GROUP_WORKERS) >= _MAX_GROUP_WORKERS:
            _GROUP_WORKERS.pop(next(iter(_GROUP_WORKERS))).close()
        worker = _Worker()
    _GROUP_WORKERS[group] = worker  # (re-inserted: the most recently used last)
    return worker.call(fn, *args)


_LIVE: dict = {}  # in a group worker: its fake group {"group": (world, rank)} and meshes {"meshes": {...}}


def fake_group(world: int, rank: int) -> None:
    """Make the default process group torch's fake one of ``world`` ranks, as ``rank``: the live one if it is that
    group already (:func:`in_worker`'s ``group``), else a new one, the old group destroyed and DTensor's caches of
    its meshes emptied (:func:`forget_meshes`)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # private: the fake backend's store

    if dist.is_initialized() and _LIVE.get("group") == (world, rank):
        return
    drop_fake_group()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    _LIVE.update(group=(world, rank), meshes={})


def drop_fake_group() -> None:
    """Destroy this process's (fake) default group, if any, and forget its meshes."""
    if dist.is_initialized():
        dist.destroy_process_group()
    _LIVE.clear()
    forget_meshes()


def fake_mesh(spec: Layout, p: int, dp: int):
    """The layout's mesh of ``dp x p`` on the live :func:`fake_group`, one per shape and axis names while the
    group lives (so cached sharding decisions keep meeting the mesh they were made for)."""
    dims = TrainPlan(spec, p, dp)
    key = (tuple(dims.mesh_shape), tuple(dims.mesh_dim_names))
    meshes = _LIVE["meshes"]
    if key not in meshes:
        meshes[key] = init_mesh(spec, p, dp, device_type="cpu")
    register_mesh(meshes[key])
    return meshes[key]


def _trace_ranks(spec: Layout, cfg, batch: int, seq: int, p: int, elem: int, data: _DataParallel, ranks,
                 checkpointing: str) -> dict[int, TracedStep]:
    return {rank: _trace_rank(spec, cfg, batch, seq, p, elem, data, rank, checkpointing) for rank in ranks}


def _run(spec: Layout, cfg, batch: int, seq: int, p: int, elem: int, data: _DataParallel, ranks,
         checkpointing: str) -> dict[int, TracedStep]:
    """Trace ``ranks`` in this process's tracing worker (:class:`_Worker`)."""
    try:
        return in_worker(_trace_ranks, spec, cfg, batch, seq, p, elem, data, list(ranks), checkpointing)
    except RuntimeError as err:
        if dist.is_initialized():
            raise
        raise RuntimeError(f"tracing layout {spec.name!r} on ranks {list(ranks)} of {p} failed: {err}") from None


def _serve(conn) -> None:
    while True:
        try:
            fn, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            conn.send(("ok", fn(*args)))
        except BaseException as err:  # noqa: BLE001 - reported by the caller
            drop_fake_group()
            conn.send(("error", f"{type(err).__name__}: {err}"))


def _build(spec: Layout, cfg, mesh, elem: int, data: _DataParallel, recorder: _Recorder, checkpointing: str):
    """The model of ``cfg`` parallelized on ``mesh`` (``data.dp x p``), its activations checkpointed in mode
    ``checkpointing``, its step assembled as the strategies assemble it (:func:`lightning_tp2d.step.assemble_step`
    for the :class:`~lightning_tp2d.train_plan.TrainPlan` of ``data``: FSDP, GradientSync, ZeRO-1's optimizer slices,
    the clipping), with the recorder's hooks on its blocks; and what runs after the backward."""
    p, dp = spec.sizes_of_mesh(mesh)
    plan = TrainPlan(spec, p, dp, data.stage, checkpointing,
                     precision="bf16-mixed" if elem == 2 else "32-true")  # (float64: no policy, as float32)
    model = family_of_config(cfg).model_class(cfg)
    if elem == 8:
        model = model.double()
    prepare_model(model, mesh, plan)  # parallelized and checkpointed as the strategies do
    model.validate_inputs = False  # fake ids cannot be read
    if checkpointing == "full":
        for block in family_of(model).block_modules(model):
            block.register_forward_pre_hook(lambda m, args: recorder.keep(args))
    with warnings.catch_warnings():  # stage 2/3 on one replica: nothing to shard (assemble_step warns)
        warnings.simplefilter("ignore", UserWarning)
        step = assemble_step(model, mesh, plan)
    if plan.fsdp:
        for block in family_of(model).block_modules(model):  # before FSDP's own pre-backward hook (appended)
            block.register_forward_hook(lambda m, args, out: _hook_outputs(out, recorder.group_backward_starts),
                                        prepend=True)
    # the optimizer's own step computes and sends nothing traced; its slices' all-gather is the call (stage 1; at
    # stages 2/3 only the parameters FSDP keeps whole are sliced, GPT-2's q/k/v bias on grids)
    sharding = step.shard_optimizer(torch.optim.AdamW(model.parameters()))

    def after_backward() -> None:
        if step.gradient_sync is not None:
            step.gradient_sync.finish()
        if data.clip:
            step.clip_grad_norm_(model.parameters(), 1.0)
        if sharding is not None:
            sharding.after_step()

    return model, after_backward


def forget_meshes() -> None:
    """Empty DTensor's sharding-propagation caches: their output specs hold the (equal) meshes of earlier traces,
    whose fake process groups are gone, and hand them to new parameters; FSDP gathers over the mesh its parameters
    hold, so a sharded trace must not meet them."""
    _clear_python_sharding_prop_cache()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's (private: see _private_api)


def _hook_outputs(out, hook) -> None:
    for t in tensors_in(out):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(hook)


def _run_here(spec: Layout, cfg, batch: int, seq: int, p: int, elem: int, data: _DataParallel,
              rank: int, checkpointing: str = "none") -> TracedStep:
    from torch._subclasses.fake_tensor import FakeTensorMode  # private: see lightning_tp2d._private_api
    from torch.testing._internal.distributed.fake_pg import FakeStore  # private: the fake backend's store

    if dist.is_initialized():  # a group a memory-model build kept (fake_group) in this worker
        drop_fake_group()
    elif data.sharded:
        forget_meshes()
    dist.init_process_group("fake", rank=rank, world_size=p * data.dp, store=FakeStore())
    recorder = _Recorder()
    try:
        mesh = init_mesh(spec, p, data.dp, device_type="cpu")
        with FakeTensorMode(allow_non_fake_inputs=True):
            model, after_backward = _build(spec, cfg, mesh, elem, data, recorder, checkpointing)
            idx = torch.zeros(batch, seq, dtype=torch.long)
            autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=elem == 2)
            recipes = recompute.observing_kept(recorder.save)  # selective checkpointing's hooks replace ours
            with comm_record.recording(recorder, direct=False), recorder:
                with autocast, recipes, torch.autograd.graph.saved_tensors_hooks(recorder.save, lambda t: t):
                    loss = model(idx, idx)
                activation = recorder.saved_bytes()
                recorder.phase = "backward"
                loss.backward()
                recorder.backward_done()
                after_backward()
    finally:
        dist.destroy_process_group()
    if recorder.in_flight:
        raise RuntimeError(f"{len(recorder.in_flight)} communication calls were never waited for: "
                           f"{[e[0] for e in recorder.in_flight.values()][:3]}")
    merged: dict = defaultdict(int)
    for call, phase, fm, fa in recorder.overlaps():
        ev = Comm(call.kind, call.axis, len(call.ranks), call.nbytes, 1, fm + fa, phase)
        merged[(ev, fm, fa, call.ranks)] += 1
    events = tuple(sorted(((dataclasses.replace(ev, calls=n), fm, fa, ranks)
                           for (ev, fm, fa, ranks), n in merged.items()), key=_order))
    return TracedStep(events, recorder.flops, activation, recorder.gemms)
