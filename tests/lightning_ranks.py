"""Run a function as the ranks of a Lightning job on CPU, launched "externally".

``run_ranks(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` on ``world_size`` processes that carry the
torchrun-style environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR=127.0.0.1``, a free
``MASTER_PORT``), so that Lightning sees processes created by an outside launcher and neither re-runs ``sys.argv``
(which would re-run pytest) nor spawns. ``fn`` builds its own Trainer; its return value must pickle. The ranks are the
session's Lightning pool for that world size (:mod:`tests.distributed`): Trainers of one world size are built one
after another in the same processes, over the process group the pool made; ``fresh=True`` (and ``allow_exit``) fork
new ranks instead. A failing rank raises with its traceback; a hang raises after ``timeout`` seconds.
"""

from __future__ import annotations

from lightning_tp2d.bench.procs import free_port
from tests.distributed import run_on_ranks

__all__ = ["free_port", "run_ranks"]


def run_ranks(fn, world_size: int, *args, timeout: float = 240.0, allow_exit: bool = False, fresh: bool = False):
    """``allow_exit``: ranks may end without a result (a test that kills its run); their result is ``None``."""
    return run_on_ranks(fn, world_size, *args, timeout=timeout, lightning=True, allow_exit=allow_exit, fresh=fresh)
