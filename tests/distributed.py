"""Run a function on ``world_size`` CPU processes joined by a gloo process group (file:// rendezvous).

``run_distributed(fn, world_size, *args)`` forks one process per rank, calls ``fn(rank, world_size, *args)``
in each after ``init_process_group``, and returns the list of per-rank return values (which must pickle).
A failure on any rank kills the others and raises with that rank's traceback; a hang raises after
``timeout`` seconds instead of blocking the suite, and a rank that exits without reporting raises at once.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback

import torch
import torch.distributed as dist


def _worker(rank, world_size, init_file, fn, args, results, timeout):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", traceback.format_exc()))


def collect_results(procs, results, world_size: int, timeout: float, allow_exit: bool = False) -> list:
    """Per-rank results from ``results`` (a queue of ``(rank, "ok" | "error", value)``) of the forked ``procs``.

    A rank's error raises with its traceback; a rank that exits without a result raises (unless
    ``allow_exit``: then its result is ``None``); past ``timeout`` seconds the missing ranks raise. The
    processes still alive are terminated on the way out.
    """
    outs: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outs) < world_size:
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue.Empty:
                exited = [r for r, p in enumerate(procs) if r not in outs and p.exitcode is not None]
                if exited:  # a rank that reported just before exiting: its result is in the pipe by now
                    try:
                        rank, status, value = results.get(timeout=2.0)
                    except queue.Empty:
                        pass
                    else:
                        if status == "error":
                            raise RuntimeError(f"rank {rank} failed:\n{value}") from None
                        outs[rank] = value
                        continue
                if exited and not allow_exit:
                    raise RuntimeError(f"ranks {exited} exited (codes {[procs[r].exitcode for r in exited]}) "
                                       "without a result") from None
                if allow_exit and all(p.exitcode is not None for p in procs) and results.empty():
                    break
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(outs))
                    raise TimeoutError(f"ranks {missing} did not finish within {timeout}s") from None
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            outs[rank] = value
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)
    return [outs.get(r) for r in range(world_size)]


def run_distributed(fn, world_size: int, *args, timeout: float = 180.0):
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker, args=(rank, world_size, init_file, fn, args, results, timeout / 2),
                             daemon=True) for rank in range(world_size)]
        for p in procs:
            p.start()
        return collect_results(procs, results, world_size, timeout)
