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
import socket
import traceback
import warnings

import torch

from tests.distributed import collect_results


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
    return collect_results(procs, results, world_size, timeout, allow_exit)
