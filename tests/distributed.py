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
import tempfile
import traceback

import torch
import torch.distributed as dist

from lightning_tp2d.bench.procs import collect


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
    """Per-rank results from ``results`` (a queue of ``(rank, "ok" | "error", value)``) of the forked ``procs``
    (:func:`lightning_tp2d.bench.procs.collect`), raising instead of reporting: a rank's error with its traceback,
    a rank that exits without a result (unless ``allow_exit``: its result is ``None``), ``TimeoutError`` past
    ``timeout`` seconds. The processes still alive are terminated on the way out."""
    result = collect(procs, results, world_size, timeout, allow_exit)
    if result.status == "timeout":
        raise TimeoutError(result.reason)
    if not result.ok:
        raise RuntimeError(result.reason if result.rank is None else f"rank {result.rank} failed:\n{result.reason}")
    return result.values


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
