"""Run one benchmark scenario on ``world_size`` fresh processes and report what happened, never raise.

Every scenario (and every probe of the maximum-sequence search) gets its own processes and its own process
group, so an out-of-memory rank, a bad size or a crash ends that scenario alone: the parent terminates the
other ranks (which may be blocked in a collective with the failed one) and the result says why.

Devices: ``cpu`` runs gloo; ``cuda`` runs NCCL with one rank per GPU when there are enough GPUs, otherwise gloo
with every rank on GPU 0 (``comm`` stages point-to-point through host memory), the way one GPU can host a grid.
A per-rank memory cap is ``torch.cuda.set_per_process_memory_fraction`` on GPU and the tracker's cap on CPU.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import random
import signal
import socket
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

import torch
import torch.distributed as dist

from lightning_tp2d.planning.live import MemoryCapExceeded
from lightning_tp2d.planning.processes import start_process

OOM = "oom"


@dataclass
class RunResult:
    """``status``: ``"ok"`` (``values`` holds each rank's return value), ``"oom"``, ``"error"`` or ``"timeout"``."""

    status: str
    values: list[Any] = field(default_factory=list)
    reason: str = ""
    rank: int | None = None  # the rank whose failure ended the run, when one did

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _oom_in(exc: BaseException | None) -> BaseException | None:
    """The out-of-memory error (or cap exceeded) ``exc`` is or was raised from, if any: DTensor's dispatcher
    re-raises what an op raised inside its sharding propagation as a ``RuntimeError`` caused by it."""
    while exc is not None and not isinstance(exc, (MemoryCapExceeded, torch.OutOfMemoryError)):
        exc = exc.__cause__ or exc.__context__
    return exc


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:400]


def _worker(rank: int, world_size: int, init_file: str, device: str, cap_bytes: int | None, fn: Callable,
            args: tuple, results, timeout: float, lightning: str | None, tracebacks: bool) -> None:
    _dump_stacks_on_request()
    try:
        backend = "gloo"
        if device == "cuda":
            n_gpus = torch.cuda.device_count()
            gpu = rank if n_gpus >= world_size else 0
            backend = "nccl" if n_gpus >= world_size else "gloo"
            torch.cuda.set_device(gpu)
            if cap_bytes is not None:
                total = torch.cuda.get_device_properties(gpu).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), gpu)
        else:
            _one_thread_team(max(1, int(os.environ.get("TP2D_BENCH_THREADS", "1"))))
        if lightning is not None:  # launched "externally": Lightning makes the process group itself
            os.environ.update(_launch_env(rank, world_size, lightning))
            warnings.filterwarnings("ignore")
        else:
            dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=timeout))
        try:
            out = fn(rank, world_size, *args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        _put_result(results, rank, out)
    except BaseException as exc:  # noqa: BLE001 - every failure is reported to the parent, which decides
        oom = _oom_in(exc)
        status = OOM if oom is not None else "error"
        short = oom if oom is not None else exc if isinstance(exc, ValueError) and not tracebacks else None
        results.put((rank, status, _short(short) if short is not None else traceback.format_exc()))


def _put_result(results, rank: int, out) -> None:
    """Send ``rank``'s return value to the parent, or an error naming why it cannot travel. A queue pickles in a
    thread of its own, which only prints a value that does not pickle (a tensor that requires grad and is not a
    leaf, a lambda) and drops it: the parent would wait for the rank until its timeout. Pickled here first, such a
    value fails the run at once, with the reason."""
    try:
        ForkingPickler.dumps(out)  # (the queue's pickler: torch's reductions refuse what plain pickle takes)
    except Exception as exc:  # noqa: BLE001 - pickling raises whatever the object's __reduce__ raises
        results.put((rank, "error", f"rank {rank}'s return value cannot be sent to the parent (it must pickle): "
                                    f"{type(exc).__name__}: {exc}"))
        return
    results.put((rank, "ok", out))


def _one_thread_team(threads: int = 1) -> None:
    """A forked CPU rank's intra-op threads, also in ``OMP_NUM_THREADS`` so that Lightning's strategies and
    ``TP2DStrategy`` (which raise the count to cores / processes when it is unset) leave it. A rank forked from a
    parent whose OpenMP team had more than one thread must keep to one: GNU OpenMP is not fork-safe, and a parallel
    region in the child waits for ever on the parent's threads (seen: a one-rank fit hung in ``layer_norm``)."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def _launch_env(rank: int, world_size: int, port: str) -> dict[str, str]:
    """What torchrun sets for a rank of one machine: Lightning then neither spawns nor re-runs ``sys.argv``."""
    return dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), NODE_RANK="0",
                LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)


def run_ranks(fn: Callable, world_size: int, *args, device: str = "cpu", cap_bytes: int | None = None,
              timeout: float = 600.0, lightning: bool = False, allow_exit: bool = False,
              tracebacks: bool = False, group_timeout: float | None = None) -> RunResult:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` new processes joined by a process group.

    Returns the per-rank values, or the first failure (``oom`` / ``error`` with the rank's reason, ``timeout``,
    or a rank that died without a word). The processes left are terminated either way. ``lightning``: the ranks
    look launched by torchrun (:func:`_launch_env`) and Lightning makes the process group; ``allow_exit``: a rank
    may end without a result (its value is ``None``); ``tracebacks``: a ``ValueError`` is reported with its
    traceback too, not as one line; ``group_timeout``: the process group's timeout (default ``timeout``)."""
    ctx = mp.get_context("spawn" if device == "cuda" else "fork")
    results = ctx.Queue()
    port = str(free_port()) if lightning else None
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [start_process(ctx, _worker, (r, world_size, init_file, device, cap_bytes, fn, args, results,
                                              group_timeout or timeout, port, tracebacks), daemon=True)
                 for r in range(world_size)]  # each ends with this process (planning.processes)
        return collect(procs, results, world_size, timeout, allow_exit)


def collect(procs: list, results, world_size: int, timeout: float, allow_exit: bool = False,
            keep_alive: bool = False) -> RunResult:
    """Per-rank values from ``results`` (a queue of ``(rank, status, value)``) sent by ``procs``, or the first
    failure: a rank's non-``"ok"`` status, a rank that exited without a result (unless ``allow_exit``: its value
    is then ``None``), or ``timeout`` seconds passing. The processes still alive are terminated on the way out,
    unless ``keep_alive`` and every rank reported ``"ok"`` (:class:`RankPool`'s ranks wait for the next task)."""
    outs: dict[int, Any] = {}
    finished = timed_out = False
    deadline = time.monotonic() + timeout
    try:
        while len(outs) < world_size:
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue.Empty:
                exited = [r for r, p in enumerate(procs) if r not in outs and p.exitcode is not None]
                message = None
                if exited:
                    try:  # a rank that reported just before exiting: its message is in the pipe by now
                        message = results.get(timeout=2.0)
                    except queue.Empty:
                        if not allow_exit:
                            codes = [procs[r].exitcode for r in exited]
                            return RunResult("error", reason=f"ranks {exited} exited (codes {codes}) without a result")
                        if all(p.exitcode is not None for p in procs):
                            break
                if message is None:
                    if time.monotonic() > deadline:
                        missing = sorted(set(range(world_size)) - set(outs))
                        timed_out = True
                        return RunResult("timeout", reason=f"ranks {missing} did not finish within {timeout:.0f} s")
                    continue
                rank, status, value = message
            if status != "ok":
                return RunResult(status, reason=f"rank {rank}: {value}", rank=rank)
            outs[rank] = value
        finished = True
    finally:
        if not (keep_alive and finished):
            stop(procs, dump=[p for r, p in enumerate(procs) if r not in outs] if timed_out else [])
    return RunResult("ok", values=[outs.get(r) for r in range(world_size)])


def _dump_stacks_on_request() -> None:
    """A rank prints every thread's Python stack to its stderr on ``SIGUSR1`` (:func:`stop` asks one that has not
    finished, so a hang says where it hung), even while blocked in C (a collective, a lock)."""
    # (descriptor 2 itself: under pytest's capsys ``sys.stderr`` has no descriptor)
    faulthandler.register(signal.SIGUSR1, file=2, all_threads=True, chain=False)


def stop(procs: list, dump: list = ()) -> None:
    """Ends ``procs`` for certain: ``SIGTERM``, then ``SIGKILL`` for those still alive 3 s later (a rank blocked in
    C, or one whose SIGTERM handler only sets a flag, as Lightning's does, outlives ``SIGTERM``; a survivor would
    keep the pipes it inherited open, and ``multiprocessing``'s exit handler would wait for it for ever). The ones
    in ``dump`` first print their stacks (:func:`_dump_stacks_on_request`)."""
    for p in dump:  # one at a time: stacks written together into one descriptor interleave line by line
        if p.is_alive() and p.pid is not None:
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except OSError:
                continue
            time.sleep(0.3)
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=3)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


# ---- ranks kept for many tasks -------------------------------------------------------------------------------------


class RankPool:
    """``world_size`` forked CPU ranks joined once by a gloo process group, each running the tasks it is sent one
    after another: ``pool.run(fn, *args)`` calls ``fn(rank, world_size, *args)`` on every rank, like
    :func:`run_ranks`, without starting processes or a process group per call.

    Tasks travel pickled, so ``fn`` must be importable by name (a module-level function) and ``args`` must pickle
    (:func:`picklable`); the ranks were forked after the caller's modules were imported, so the module-level state
    they read is the caller's. Before each task a rank restores the state a fresh fork would have: torch's and
    Python's random generators, the default dtype and the warning filters; its environment is ``env`` when given
    (the caller's ``os.environ``, as a fork would inherit it), else the one the pool started with; a task that destroyed the default group gets a new one before the next. The
    sub-groups tasks make (each ``DeviceMesh`` makes its own) are left as they are: a mesh or FSDP state may still
    name them, and nothing lists them publicly; so the pool ends itself after ``tasks`` tasks, before sockets and
    gloo contexts pile up. A failure, a rank that dies or a timeout ends the pool too (its ranks may be blocked in a
    collective with the failed one): :attr:`alive` turns false and the caller starts a new pool.

    ``lightning=True``: the ranks look launched by torchrun to Lightning (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``/``MASTER_PORT``, ...), so a Trainer built in a task neither spawns nor re-runs ``sys.argv``,
    and finds the process group already made (a one-rank pool makes none: Lightning's single-device run has none).
    """

    def __init__(self, world_size: int, *, lightning: bool = False, timeout: float = 600.0, tasks: int = 40):
        self.world_size, self.lightning, self.tasks_left = world_size, lightning, tasks
        ctx = mp.get_context("fork")
        self._results = ctx.Queue()
        self._dir = tempfile.TemporaryDirectory(prefix="tp2d-pool-")
        port = free_port()
        pipes = [ctx.Pipe() for _ in range(world_size)]
        self._tasks = [parent for parent, _ in pipes]
        self._procs = [start_process(ctx, _pool_worker, (r, world_size, lightning, port, self._dir.name, child,
                                                         self._results, timeout), daemon=True)
                       for r, (_, child) in enumerate(pipes)]  # each ends with this process (planning.processes)
        self.alive = True

    def run(self, fn: Callable, *args, timeout: float = 600.0, env: dict[str, str] | None = None) -> RunResult:
        if not self.alive:
            raise RuntimeError("this RankPool has ended (a task failed, timed out or a rank died); start a new one")
        task = (fn, args, None if env is None else dict(env))
        for pipe in self._tasks:
            pipe.send(task)
        result = collect(self._procs, self._results, self.world_size, timeout, keep_alive=True)
        self.tasks_left -= 1
        if not result.ok or self.tasks_left <= 0:
            self.close()
        return result

    def close(self) -> None:
        """Ends the ranks (a rank blocked in a collective is terminated)."""
        if not self.alive:
            return
        self.alive = False
        for pipe in self._tasks:
            try:
                pipe.send(None)
            except OSError:
                pass
        for p in self._procs:
            p.join(timeout=2)
        stop(self._procs)
        self._dir.cleanup()


def picklable(fn: Callable, args: tuple) -> bool:
    """Whether ``(fn, args)`` can travel to a :class:`RankPool`'s ranks (a lambda, a nested function or an open
    file cannot: such a call forks fresh ranks, which inherit them)."""
    try:
        pickle.dumps((fn, args))
    except Exception:  # noqa: BLE001 - pickling raises whatever the object's __reduce__ raises
        return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pool_worker(rank: int, world_size: int, lightning: bool, port: int, folder: str, tasks, results,
                 timeout: float) -> None:
    try:
        _pool_rank(rank, world_size, lightning, port, folder, tasks, results, timeout)
    except BaseException:  # noqa: BLE001 - a rank that cannot go on (its group not made, a pipe gone) says why
        results.put((rank, "error", traceback.format_exc()))
        raise


def _pool_rank(rank: int, world_size: int, lightning: bool, port: int, folder: str, tasks, results,
               timeout: float) -> None:
    _dump_stacks_on_request()
    if lightning:
        os.environ.update(_launch_env(rank, world_size, str(port)))
    generation = 0

    def join() -> None:  # the default group, made anew under a new rendezvous file when a task destroyed it
        nonlocal generation
        generation += 1
        dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous-{generation}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout))

    if world_size > 1 or not lightning:
        join()
    fresh = (torch.get_rng_state(), random.getstate(), torch.get_default_dtype(), list(warnings.filters),
             dict(os.environ))
    while True:
        task = tasks.recv()
        if task is None:
            break
        fn, args, env = task
        torch.set_rng_state(fresh[0])
        random.setstate(fresh[1])
        torch.set_default_dtype(fresh[2])
        warnings.filters[:] = fresh[3]
        os.environ.clear()
        os.environ.update(fresh[4] if env is None else env)
        if lightning:
            os.environ.update(_launch_env(rank, world_size, str(port)))
        _one_thread_team()  # before every task: the last may have raised the count, or ``env`` lack the variable
        try:
            if lightning:
                warnings.filterwarnings("ignore")
            out = fn(rank, world_size, *args)
        except BaseException as exc:  # noqa: BLE001 - reported; the parent ends the pool
            oom = _oom_in(exc)
            results.put((rank, OOM if oom is not None else "error",
                         _short(oom) if oom is not None else traceback.format_exc()))
            continue
        if not dist.is_initialized() and (world_size > 1 or not lightning):
            join()
        _put_result(results, rank, out)

