"""Run a function as the ranks of a Lightning job on CPU: one forked process per rank, launched "externally".

``run_ranks(fn, world_size, *args)`` forks ``world_size`` processes; each sets the torchrun-style environment
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``) so that
Lightning sees processes created by an outside launcher and neither re-runs ``sys.argv`` (which would re-run
pytest) nor spawns. ``fn(rank, world_size, *args)`` builds its own Trainer; its return value must pickle (no
tensors: they travel through shared memory that dies with the process). The process group Lightning made is
destroyed afterwards. A failing rank raises with its traceback; a hang raises after ``timeout`` seconds.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
import warnings

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, results):
    try:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), NODE_RANK="0",
                          LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        warnings.filterwarnings("ignore")
        try:
            out = fn(rank, world_size, *args)
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world_size: int, *args, timeout: float = 240.0, allow_exit: bool = False):
    """``allow_exit``: ranks may end without a result (a test that kills its run); their result is ``None``."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(rank, world_size, port, fn, args, results), daemon=True)
             for rank in range(world_size)]
    for p in procs:
        p.start()
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
