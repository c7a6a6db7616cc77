"""Run a function on ``world_size`` CPU processes joined by a gloo process group (file:// rendezvous).

``run_distributed(fn, world_size, *args)`` forks one process per rank, calls ``fn(rank, world_size, *args)``
in each after ``init_process_group``, and returns the list of per-rank return values (which must pickle).
A failure on any rank kills the others and raises with that rank's traceback; a hang raises after
``timeout`` seconds instead of blocking the suite.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import tempfile
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


def run_distributed(fn, world_size: int, *args, timeout: float = 180.0):
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker, args=(rank, world_size, init_file, fn, args, results, timeout / 2),
                             daemon=True) for rank in range(world_size)]
        for p in procs:
            p.start()
        outs: dict[int, object] = {}
        try:
            while len(outs) < world_size:
                try:
                    rank, status, value = results.get(timeout=timeout)
                except queue.Empty:
                    missing = sorted(set(range(world_size)) - set(outs))
                    raise TimeoutError(f"ranks {missing} did not finish within {timeout}s") from None
                if status == "error":
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                outs[rank] = value
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(timeout=10)
    return [outs[r] for r in range(world_size)]
