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
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from lightning_tp2d.planning.live import MemoryCapExceeded

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
            args: tuple, results, timeout: float) -> None:
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
            torch.set_num_threads(max(1, int(os.environ.get("TP2D_BENCH_THREADS", "1"))))
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, "ok", out))
    except BaseException as exc:  # noqa: BLE001 - every failure is reported to the parent, which decides
        oom = _oom_in(exc)
        status = OOM if oom is not None else "error"
        detail = _short(oom) if oom is not None else _short(exc) if isinstance(exc, ValueError) else traceback.format_exc()
        results.put((rank, status, detail))


def run_ranks(fn: Callable, world_size: int, *args, device: str = "cpu", cap_bytes: int | None = None,
              timeout: float = 600.0) -> RunResult:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` new processes joined by a process group.

    Returns the per-rank values, or the first failure (``oom`` / ``error`` with the rank's reason, ``timeout``,
    or a rank that died without a word). The processes left are terminated either way."""
    ctx = mp.get_context("spawn" if device == "cuda" else "fork")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(r, world_size, init_file, device, cap_bytes, fn, args, results, timeout))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        return collect(procs, results, world_size, timeout)


def collect(procs: list, results, world_size: int, timeout: float, allow_exit: bool = False) -> RunResult:
    """Per-rank values from ``results`` (a queue of ``(rank, status, value)``) sent by ``procs``, or the first
    failure: a rank's non-``"ok"`` status, a rank that exited without a result (unless ``allow_exit``: its value
    is then ``None``), or ``timeout`` seconds passing. The processes still alive are terminated on the way out."""
    outs: dict[int, Any] = {}
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
                        return RunResult("timeout", reason=f"ranks {missing} did not finish within {timeout:.0f} s")
                    continue
                rank, status, value = message
            if status != "ok":
                return RunResult(status, reason=f"rank {rank}: {value}", rank=rank)
            outs[rank] = value
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)
    return RunResult("ok", values=[outs.get(r) for r in range(world_size)])
