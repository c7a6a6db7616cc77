"""What a layout's own layers cost per training step, against the plain model: aten ops dispatched, bytes moved by
memory-bound ops, eager time. The measure of "one rank is the plain model" and "lean at every grid"
(docs/benchmarks.md, "The layouts' own cost"; ``recipes/benchmarks/layer_overhead.py`` runs it).

* :class:`OpCounter` (a ``TorchDispatchMode``): every aten op of a step by name, and the bytes read and written by
  the memory-bound ones: not a view (an op whose result aliases an input without writing it), not an allocation
  (``empty`` and its kin, :data:`ALLOCATIONS`), not a GEMM or an attention kernel (:data:`COMPUTE_BOUND`), not a
  collective. A view or an allocation costs host time, no memory traffic.
* :func:`step_cost`: one training step (forward, backward, AdamW, zero_grad) of a model on a batch, counted, after
  one warm-up step (AdamW's state exists); :func:`eager_seconds`: the mean wall time of further steps.
* :func:`build`: the plain model of a family and size, or its parallel form for a layout on a mesh.
* :func:`fake_rank_host_seconds`: the host's CPU seconds of a micro-batch of each side, one rank alone on torch's
  fake process group (the planner's host price per op, ``recipes/benchmarks/host_ops.py --rates``).

Op counts are deterministic for a given torch build, model, batch and layout: tests assert them exactly.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import lightning_tp2d as tp
from lightning_tp2d.bench import counting, runner
from lightning_tp2d.families import family_of_config, model_config

# GEMMs and fused attention: compute-bound kernels, left out of the memory-bound bytes (their time is FLOPs)
COMPUTE_BOUND = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "_scaled_mm",
                           "addmm_", "baddbmm_", "addbmm_",  # (in place: a GEMM accumulating into its output)
                           "_scaled_dot_product_flash_attention_for_cpu",
                           "_scaled_dot_product_flash_attention_for_cpu_backward",
                           "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
                           "_scaled_dot_product_efficient_attention",
                           "_scaled_dot_product_efficient_attention_backward",
                           "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
                           "_flash_attention_forward", "_flash_attention_backward"})


# ops that allocate without reading or writing a byte (a receive buffer, an output to fill): host time, no traffic
ALLOCATIONS = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "empty_permuted"})


# views whose schema declares no alias (``_unsafe_view``: what ``reshape`` and ``matmul`` return after a copy or a GEMM)
UNDECLARED_VIEWS = frozenset({"_unsafe_view"})


def _is_view(func) -> bool:
    """An op whose result aliases an input without writing it (``view``, ``t``, ``slice``, ``as_strided`` ...)."""
    return (func.overloadpacket.__name__ in UNDECLARED_VIEWS
            or any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns))


def _bytes(value) -> int:
    """Bytes of the tensors in ``value`` (an op's arguments or result: tensors in tuples, lists and dicts). A DTensor
    counts its local shard: the dispatch mode sees torch's DTensor code one op at a time with the global shapes
    (DTensor then runs the op on the shards, outside the mode), and a rank moves its shard's bytes, not the whole's."""
    if isinstance(value, DTensor):
        value = value._local_tensor
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_bytes(v) for v in value.values())
    return 0


# ops that write without reading ``self``: in-place ops that overwrite it (their result, ``self``, is the only traffic
# on it) and factories that take it for its dtype and device only (``g.new_zeros(shape)``, ``torch.zeros_like(g)``)
WRITE_ONLY = frozenset({"copy_", "zero_", "fill_", "uniform_", "normal_", "bernoulli_", "random_", "exponential_",
                        "new_zeros", "new_ones", "new_full", "zeros_like", "ones_like", "full_like"})


def _read_bytes(func, name: str, args, kwargs) -> int:
    """Bytes an op reads: its tensor arguments, less an ``out=`` buffer and the ``self`` of a :data:`WRITE_ONLY` op,
    which it only writes (their bytes are counted once, as the result). An in-place op that reads ``self``
    (``add_``, ``mul_``) reads it and writes it: twice."""
    if name in WRITE_ONLY:
        args = args[1:]
    outs = {a.name for a in func._schema.arguments if a.is_out}
    return _bytes((args, {k: v for k, v in kwargs.items() if k not in outs} if outs else kwargs))


COLLECTIVES = frozenset({"c10d", "_c10d_functional", "_dtensor"})  # op namespaces of communication


@dataclass
class Cost:
    """One step's aten ops by name, the memory-bound bytes, and the collectives (by name, not in ``ops``)."""

    ops: collections.Counter = field(default_factory=collections.Counter)
    bytes: int = 0
    collectives: collections.Counter = field(default_factory=collections.Counter)

    @property
    def total(self) -> int:
        return sum(self.ops.values())


class OpCounter(TorchDispatchMode):
    """Counts every op dispatched inside it into :attr:`cost` (module docstring). A DTensor op is counted as the one
    op the mode sees, with its shards' bytes; what a DTensor handler runs on the shards runs with the mode off,
    unseen, unless the handler's code asks :func:`~lightning_tp2d.bench.counting.count_local` (torch's CP ring: a
    kernel, a merge and a K|V gradient sum per ring step behind one SDPA op)."""

    def __init__(self) -> None:
        super().__init__()
        self.cost = Cost()

    def __enter__(self):
        counting.OPEN.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        counting.OPEN.pop()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.namespace in COLLECTIVES:
            self.cost.collectives[name] += 1
            return out
        self.cost.ops[name] += 1
        if name not in COMPUTE_BOUND and name not in ALLOCATIONS and not _is_view(func):
            self.cost.bytes += _read_bytes(func, name, args, kwargs) + _bytes(out)
        return out


def build(family_size: str, layout: str | None, *, n_layer: int | None = None, seed: int = 0) -> nn.Module:
    """The plain model of the named size ``family_size`` (``"gpt2-tiny"``, ``"llama-tiny"`` ...; dropout 0,
    ``n_layer`` blocks when given) for ``layout=None``, or its ``layout`` form on ``tp.init_mesh`` over the current
    default process group (``tensor_parallel_size`` its world size), drawn from ``seed``."""
    cfg = model_config(family_size)
    cfg = dataclasses.replace(cfg, dropout=0.0, **({} if n_layer is None else {"n_layer": n_layer}))
    torch.manual_seed(seed)
    model = family_of_config(cfg).model_class(cfg)
    if layout is not None:
        world = torch.distributed.get_world_size()
        model = tp.parallelize(model, tp.init_mesh(layout, world, 1), layout)
    model.validate_inputs = False
    return model


def _step(model: nn.Module, optimizer, idx: torch.Tensor, targets: torch.Tensor) -> None:
    loss = model(idx, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def step_cost(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> Cost:
    """The ops and memory-bound bytes of one training step (forward, backward, AdamW for-loop, zero_grad), after one
    warm-up step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    _step(model, optimizer, idx, targets)
    counter = OpCounter()
    with counter:
        _step(model, optimizer, idx, targets)
    return counter.cost


def rank_cost(rank: int, world_size: int, layout: str, spec, timed_steps: int = 0) -> dict:
    """On each of ``world_size`` ranks (:func:`lightning_tp2d.bench.procs.run_ranks`): one counted training step of
    the benchmark harness's ``layout`` scenario (:class:`~lightning_tp2d.bench.runner.BenchSpec`; ``"single"`` the
    plain model, the rivals with torch's code; ``spec.compile`` compiles it), after a warm-up step; its ops,
    memory-bound bytes and collectives, and with ``timed_steps`` the mean seconds of that many more steps."""
    built = runner._build(layout, spec, spec.seq, world_size)

    def step() -> None:
        with built.region():
            loss = built.forward()
            loss.backward()
        built.optimizer.step()
        built.optimizer.zero_grad(set_to_none=True)

    step()
    counter = OpCounter()
    with counter:  # (compiled: the dispatch mode makes Dynamo run the step eagerly; the ops are eager's)
        step()
    cost = counter.cost
    out = {"ops": dict(cost.ops), "total": cost.total, "bytes": cost.bytes, "collectives": dict(cost.collectives)}
    if timed_steps:
        step()  # (compiled: the graph exists after the warm-up step; this one runs it)
        start = time.perf_counter()
        for _ in range(timed_steps):
            step()
        out["seconds"] = (time.perf_counter() - start) / timed_steps
    return out


def _alternating_rounds(fns: dict, rounds: int, steps: int, clock) -> dict[str, list[float]]:
    """``rounds`` rounds, each running every one of ``fns`` ``steps`` times in turn: ``{key: [clock seconds per call,
    one per round]}``, so that a slow spell of a shared machine falls on every one alike."""
    times: dict[str, list[float]] = {key: [] for key in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            start = clock()
            for _ in range(steps):
                fn()
            times[key].append((clock() - start) / steps)
    return times


def interleaved_seconds(rank: int, world_size: int, layouts: tuple[str, ...], spec, rounds: int = 10,
                        steps: int = 5) -> dict:
    """On each of ``world_size`` ranks: every one of ``layouts`` built in this one process
    (:func:`~lightning_tp2d.bench.runner._build` with ``spec``: its optimizer, ``spec.compile``), warmed up, then timed
    in ``rounds`` alternating rounds of ``steps`` training steps each, so that a slow spell of a shared machine falls
    on every layout alike. ``{layout: {"min": s, "median": s}}``: seconds per step, the fastest round's and the
    median round's."""
    steps_of = {}
    for layout in layouts:
        built = runner._build(layout, spec, spec.seq, world_size)

        def step(built=built) -> None:
            with built.region():
                built.forward().backward()
            built.optimizer.step()
            built.optimizer.zero_grad(set_to_none=True)

        for _ in range(3):  # (compiled: the graph is made in the first)
            step()
        steps_of[layout] = step
    times = _alternating_rounds(steps_of, rounds, steps, time.perf_counter)
    return {layout: {"min": min(t), "median": statistics.median(t)} for layout, t in times.items()}


def rank_phase_ops(rank: int, world_size: int, layout: str, spec) -> dict:
    """On each of ``world_size`` ranks: the aten ops (collectives apart) of one micro-batch's forward (with the loss)
    and backward of the benchmark harness's ``layout`` scenario, counted apart, after a warm-up step. What the
    planner's host price is made of (:mod:`lightning_tp2d.planning.host_cost`): ``{"forward": n, "backward": n}``,
    with the memory-bound bytes of each too (``"forward_bytes"``, ``"backward_bytes"``)."""
    built = runner._build(layout, spec, spec.seq, world_size)
    with built.region():
        built.forward().backward()
    built.optimizer.zero_grad(set_to_none=True)
    forward, backward = OpCounter(), OpCounter()
    with built.region():
        with forward:
            loss = built.forward()
        with backward:
            loss.backward()
    built.optimizer.zero_grad(set_to_none=True)
    return {"forward": forward.cost.total, "backward": backward.cost.total, "forward_bytes": forward.cost.bytes,
            "backward_bytes": backward.cost.bytes}


def interleaved_host_seconds(rank: int, world_size: int, sides: tuple[str, ...], spec, rounds: int = 8,
                             steps: int = 3, compiled: tuple[str, ...] = ()) -> dict:
    """On each of ``world_size`` ranks: the host's price of one micro-batch (forward with the loss, backward) of each
    of ``sides`` (the benchmark harness's scenarios, :func:`~lightning_tp2d.bench.runner._build` with ``spec``),
    eager, and of those in ``compiled`` also compiled (inductor), all built in this one process and timed in
    ``rounds`` alternating rounds of ``steps`` micro-batches, so that a slow spell falls on every side alike.

    The time is this thread's CPU seconds (``time.thread_time``): what the host spends issuing the micro-batch --
    Python, autograd, dispatch and, on CPU, the kernels themselves -- and not the time a rank waits for a collective
    or for a core it shares with the other ranks. ``{side or side + ":compiled": {"ops": n, "seconds": s}}``: the
    eager micro-batch's aten ops (collectives apart, :class:`OpCounter`) and the fastest round's seconds per
    micro-batch (the compiled entry's ``ops`` are the eager step's: the unit the planner's table counts)."""
    runs = {}
    for side in sides:
        for mode in ("eager", "compiled") if side in compiled else ("eager",):
            built = runner._build(side, dataclasses.replace(spec, compile="inductor" if mode == "compiled" else ""),
                                  spec.seq, world_size)

            def micro(built=built) -> None:
                with built.region():
                    built.forward().backward()
                built.optimizer.zero_grad(set_to_none=True)

            for _ in range(3):  # (compiled: the graph is made in the first)
                micro()
            runs[side if mode == "eager" else f"{side}:compiled"] = micro
    ops = {}
    for key, micro in runs.items():
        if ":" not in key:
            counter = OpCounter()
            with counter:
                micro()
            ops[key] = counter.cost.total
    times = _alternating_rounds(runs, rounds, steps, time.thread_time)
    return {key: {"ops": ops[key.split(":")[0]], "seconds": min(t)} for key, t in times.items()}


@contextlib.contextmanager
def _alone_on_fake_group(world_size: int):
    """This process as rank 0 of ``world_size`` on torch's fake process group, destroyed on the way out."""
    from lightning_tp2d.planning.trace import drop_fake_group, fake_group

    fake_group(world_size, 0)
    try:
        yield
    finally:
        drop_fake_group()


def fake_rank_phase_ops(world_size: int, layout: str, spec) -> dict:
    """:func:`rank_phase_ops` of rank 0 of ``world_size`` in this one process, on torch's fake process group (as
    :func:`fake_rank_host_seconds`): its ops and memory-bound bytes are its own exactly, whatever its values."""
    with _alone_on_fake_group(world_size):
        return rank_phase_ops(0, world_size, layout, spec)


def fake_rank_host_seconds(world_size: int, sides: tuple[str, ...], spec, rounds: int = 8, steps: int = 3,
                           compiled: tuple[str, ...] = ()) -> dict:
    """:func:`interleaved_host_seconds` of rank 0 of ``world_size`` in this one process, on torch's fake process
    group (:func:`lightning_tp2d.planning.trace.fake_group`): every collective returns at once, so the rank is timed
    alone on its core, doing exactly its own host work (its ops, its collectives' calls), never waiting for another
    rank or sharing a core with one. The values are wrong (nothing arrives); the host's work is not. The process's
    default group is made and destroyed here."""
    with _alone_on_fake_group(world_size):
        return interleaved_host_seconds(0, world_size, sides, spec, rounds, steps, compiled)


def eager_seconds(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor, steps: int = 10) -> float:
    """Mean wall seconds of an eager training step (after two warm-up steps)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    for _ in range(2):
        _step(model, optimizer, idx, targets)
    start = time.perf_counter()
    for _ in range(steps):
        _step(model, optimizer, idx, targets)
    return (time.perf_counter() - start) / steps


__all__ = ["ALLOCATIONS", "COLLECTIVES", "COMPUTE_BOUND", "Cost", "OpCounter", "build", "eager_seconds",
           "fake_rank_host_seconds", "fake_rank_phase_ops", "interleaved_host_seconds", "interleaved_seconds",
           "rank_cost", "rank_phase_ops", "step_cost"]
