"""The communication schedule of one training step, read from the code: the real layers run on torch's fake process
group with fake tensors (shapes and dtypes, no data, no compute), and every call of :mod:`lightning_tp2d.comm` is
recorded in order together with the FLOPs the step computes between calls.

What is recorded per call: kind, mesh axis, the global ranks of its group (so the time model can tell an NVLink group
from one that crosses nodes), payload bytes (:mod:`lightning_tp2d.comm`'s convention), the phase (forward or backward)
and the compute it overlaps: every FLOP computed while a call is in flight (posted, not yet waited for) is shared by
the calls in flight in proportion to their bytes, and tagged with the rate that prices it (``"matmul"`` for
``mm``/``addmm``/``bmm``..., ``"attention"`` for fused attention kernels; causal attention counts the visible scores
only). A blocking call overlaps nothing. So a schedule change in a layer (a prefetch moved, double buffering off,
panels kept) changes the traced overlap with no edit here.

One step is traced per rank, with ``n_layer`` 1 and 2: blocks are identical, so the second trace minus the first is
one block's events, and a model of ``L`` blocks is ``trace(1) + (L - 1) * block``. Tracing needs this process to have
no default process group of its own; the traces run in a forked worker process, so nothing of the fake group stays
behind.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from lightning_tp2d import comm_record
from lightning_tp2d.bench.events import Comm
from lightning_tp2d.bench.measure import tensors_in
from lightning_tp2d.layouts import Layout, get_layout
from lightning_tp2d.mesh import init_mesh
from lightning_tp2d.models.gpt2 import GPT2, GPT2Config
from lightning_tp2d.parallelize import parallelize

_MATMUL_FLOPS = {packet.__name__: formula for packet, formula in flop_registry.items()
                 if packet.__name__ in ("mm", "addmm", "bmm", "baddbmm")}
_DTYPES = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


@dataclasses.dataclass(frozen=True)
class TracedStep:
    """One rank's step: the calls (merged where identical) each tagged with its overlapped FLOPs per rate, and the
    FLOPs per phase and rate."""

    # (event with overlap_flops = all overlapped FLOPs, of which matmul, of which attention, the group's global ranks)
    events: tuple[tuple[Comm, float, float, tuple[int, ...]], ...]
    flops: dict  # {"forward": {"matmul": f, "attention": f}, "backward": {...}}
    activation_bytes: int  # storages the forward created that autograd saved for the backward
    gemms: dict  # {"forward": n, "backward": n}: matmul kernels launched (each pays the GEMM overhead of the rates)
    block_calls: int | None = None  # communication calls one transformer block adds (None: traced with one block)


class _Recorder(TorchDispatchMode):
    """Records comm calls (a :func:`lightning_tp2d.comm.recording` target) and counts FLOPs of the ops that run
    between them (a dispatch mode), sharing each op's FLOPs among the calls in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.in_flight: dict[int, list] = {}  # id(call) -> [call, phase, matmul FLOPs, attention FLOPs]
        self.done: list[list] = []
        self.flops = {phase: {"matmul": 0.0, "attention": 0.0} for phase in ("forward", "backward")}
        self.gemms = {"forward": 0, "backward": 0}
        self._created: dict[int, int] = {}  # storages created in the forward: key -> bytes
        self._saved: set[int] = set()  # of those, the ones autograd saved for the backward

    def save(self, t: torch.Tensor) -> torch.Tensor:
        """``saved_tensors_hooks`` pack hook: note the storage of what autograd keeps, keep the tensor as is."""
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
            self._saved.add(_storage(t)[0])
        return t

    def saved_bytes(self) -> int:
        """Bytes of the storages the forward created and autograd saved for the backward."""
        return sum(self._created[k] for k in self._saved if k in self._created)

    # comm_record.recording protocol
    def posted(self, call: comm_record.CommCall) -> None:
        self.in_flight[id(call)] = [call, self.phase, 0.0, 0.0]

    def waited(self, call: comm_record.CommCall) -> None:
        entry = self.in_flight.pop(id(call), None)
        if entry is not None:
            self.done.append(entry)

    # FLOPs
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor desugars into local ops, which come back through this mode
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
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
        if not flops:
            return
        self.flops[self.phase][rate] += flops
        total = sum(e[0].nbytes for e in self.in_flight.values())
        if not total:
            return
        slot = 2 if rate == "matmul" else 3
        for entry in self.in_flight.values():
            entry[slot] += flops * entry[0].nbytes / total


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


def _config_key(cfg: GPT2Config) -> tuple:
    return tuple(sorted(vars(cfg).items()))


_CACHE: dict[tuple, TracedStep] = {}
_ALL_RANKS_UP_TO = 9  # trace every rank of groups this small at once (tests and tools ask for each in turn)


def trace_step(layout: str | Layout, cfg: GPT2Config, batch: int, seq: int, p: int, elem: int = 4,
               rank: int = 0) -> TracedStep:
    """The traced step of tensor-parallel rank ``rank`` (``n_layer`` blocks, by the two-trace rule of the module
    docstring). ``elem``: 4 float32, 2 bf16 autocast (float32 parameters), 8 float64. Cached."""
    return trace_steps(layout, cfg, batch, seq, p, elem, [rank])[rank]


def trace_steps(layout: str | Layout, cfg: GPT2Config, batch: int, seq: int, p: int, elem: int,
                ranks) -> dict[int, TracedStep]:
    """:func:`trace_step` for several ranks; the ones not cached yet are traced together in one child process
    (every rank when ``p`` is small)."""
    spec = get_layout(layout)
    if elem not in _DTYPES:
        raise ValueError(f"elem must be 2 (bf16 autocast), 4 (float32) or 8 (float64), got {elem}")
    ranks = list(ranks)
    for rank in ranks:
        if not 0 <= rank < p:
            raise ValueError(f"rank {rank} is not in [0, {p})")
    base = (type(spec), spec.options, _config_key(cfg), batch, seq, p, elem)
    wanted = set(ranks) | (set(range(p)) if p <= _ALL_RANKS_UP_TO else set())
    missing = sorted(r for r in wanted if base + (r,) not in _CACHE)
    if missing:
        for rank, step in _run(spec, _traceable(spec, cfg, p), batch, seq, p, elem, missing).items():
            _CACHE[base + (rank,)] = step
    return {rank: _CACHE[base + (rank,)] for rank in ranks}


def _traceable(spec: Layout, cfg: GPT2Config, p: int) -> GPT2Config:
    side = spec.side(p)
    if cfg.n_head % side and cfg.n_embd % side == 0:
        # Bytes and FLOPs depend on the width, not on how it is cut into heads: trace with heads the layout takes.
        cfg = dataclasses.replace(cfg, n_head=side)
    return cfg


def _trace_rank(spec: Layout, cfg: GPT2Config, batch: int, seq: int, p: int, elem: int, rank: int) -> TracedStep:
    one = _run_here(spec, dataclasses.replace(cfg, n_layer=1), batch, seq, p, elem, rank)
    if cfg.n_layer == 1:
        return one
    two = _run_here(spec, dataclasses.replace(cfg, n_layer=2), batch, seq, p, elem, rank)
    return _extrapolate(one, two, cfg.n_layer)


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
            raise RuntimeError(f"traced schedule is not linear in the number of blocks: {key[0]}")
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
    ev = item[0]
    return (ev.phase, ev.kind, ev.group, ev.nbytes, ev.overlap_flops)


class _Worker:
    """A forked process that traces on request, for the life of the process that started it: the fake process
    group, its meshes and everything torch caches about them (group names, DTensor's sharding-propagation cache keyed
    by mesh shape) stay out of the caller, whose later real process groups (or forked ranks) would otherwise meet
    them, while the fake-tensor caches stay warm from one trace to the next (a cold trace costs ~4x a warm one)."""

    def __init__(self) -> None:
        ctx = mp.get_context("fork")
        self.owner = os.getpid()
        self.conn, theirs = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(theirs,), daemon=True, name="tp2d-trace")
        self.process.start()
        theirs.close()

    def usable(self) -> bool:
        return self.owner == os.getpid() and self.process.is_alive()

    def trace(self, *request) -> dict[int, TracedStep]:
        self.conn.send(request)
        try:
            status, value = self.conn.recv()
        except EOFError:
            status, value = "error", f"the tracing process died (exit code {self.process.exitcode})"
        if status != "ok":
            raise RuntimeError(value)
        return value


_WORKERS: list[_Worker] = []  # at most one: this process's tracing worker


def _run(spec: Layout, cfg: GPT2Config, batch: int, seq: int, p: int, elem: int, ranks) -> dict[int, TracedStep]:
    """Trace ``ranks`` in this process's tracing worker (:class:`_Worker`)."""
    if dist.is_initialized():
        raise RuntimeError("the schedule tracer runs the layers on its own fake process group; call the cost model "
                           "from a process without a default process group (e.g. the benchmark's parent process)")
    if not (_WORKERS and _WORKERS[0].usable()):
        _WORKERS[:] = [_Worker()]
    try:
        return _WORKERS[0].trace(spec, cfg, batch, seq, p, elem, list(ranks))
    except RuntimeError as err:
        raise RuntimeError(f"tracing layout {spec.name!r} on ranks {list(ranks)} of {p} failed: {err}") from None


def _serve(conn) -> None:
    while True:
        try:
            spec, cfg, batch, seq, p, elem, ranks = conn.recv()
        except (EOFError, OSError):
            return
        try:
            conn.send(("ok", {rank: _trace_rank(spec, cfg, batch, seq, p, elem, rank) for rank in ranks}))
        except BaseException as err:  # noqa: BLE001 - reported by the caller
            if dist.is_initialized():
                dist.destroy_process_group()
            conn.send(("error", f"{type(err).__name__}: {err}"))


def _run_here(spec: Layout, cfg: GPT2Config, batch: int, seq: int, p: int, elem: int, rank: int) -> TracedStep:
    from torch._subclasses.fake_tensor import FakeTensorMode  # private: see lightning_tp2d._private_api
    from torch.testing._internal.distributed.fake_pg import FakeStore  # private: the fake backend's store

    dist.init_process_group("fake", rank=rank, world_size=p, store=FakeStore())
    recorder = _Recorder()
    try:
        mesh = init_mesh(spec, p, 1, device_type="cpu")
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = GPT2(cfg)
            if elem == 8:
                model = model.double()
            parallelize(model, mesh, spec)
            model.validate_inputs = False  # fake ids cannot be read
            idx = torch.zeros(batch, seq, dtype=torch.long)
            autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=elem == 2)
            with comm_record.recording(recorder), recorder:
                with autocast, torch.autograd.graph.saved_tensors_hooks(recorder.save, lambda t: t):
                    loss = model(idx, idx)
                activation = recorder.saved_bytes()
                recorder.phase = "backward"
                loss.backward()
    finally:
        dist.destroy_process_group()
    if recorder.in_flight:
        raise RuntimeError(f"{len(recorder.in_flight)} communication calls were never waited for: "
                           f"{[e[0] for e in recorder.in_flight.values()][:3]}")
    merged: dict = defaultdict(int)
    for call, phase, fm, fa in recorder.done:
        ev = Comm(call.kind, call.axis, len(call.ranks), call.nbytes, 1, fm + fa, phase)
        merged[(ev, fm, fa, call.ranks)] += 1
    events = tuple(sorted(((dataclasses.replace(ev, calls=n), fm, fa, ranks)
                           for (ev, fm, fa, ranks), n in merged.items()), key=_order))
    return TracedStep(events, recorder.flops, activation, recorder.gemms)
