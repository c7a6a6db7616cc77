"""Run a function on ``world_size`` CPU processes joined by a gloo process group, for tests.

``run_distributed(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` on every rank and returns the list of
per-rank return values (which must pickle). A failure on any rank raises with that rank's traceback; a hang raises
after ``timeout`` seconds instead of blocking the suite, and a rank that exits without reporting raises at once.

The ranks are the session's: one :class:`~lightning_tp2d.bench.procs.RankPool` per world size (and kind), forked
once and reused by every call that can travel to it (a module-level ``fn``, pickling ``args``), so a call costs the
task, not a fork and a process group; the task runs under this process's environment as it is at the call. A call
that cannot travel, one made by a test that uses ``monkeypatch`` (the ranks would not see the patch), or one that
asks ``fresh=True`` (a test that kills, stalls or poisons its ranks, or relies on the process group's timeout,
half the call's), forks new ranks (:func:`lightning_tp2d.bench.procs.run_ranks`), which inherit everything.
A failed call ends its pool; the next call starts another. At most ``MAX_POOLED_RANKS`` ranks wait at a time: the
pool used least recently ends first.
"""

from __future__ import annotations

import atexit
import os

from lightning_tp2d.bench import procs

MAX_POOLED_RANKS = 14
# set by tests/conftest.py for a test that uses ``monkeypatch``: what it patches in this process, a fork inherits
# and a pool's ranks (forked before) would not see, so its calls fork fresh ranks
FRESH_FOR_THIS_TEST = False
_POOLS: dict[tuple[int, bool], procs.RankPool] = {}  # in the order they were last used


def _pool(world_size: int, lightning: bool) -> procs.RankPool:
    key = (world_size, lightning)
    pool = _POOLS.pop(key, None)
    if pool is None or not pool.alive:
        while _POOLS and sum(w for w, _ in _POOLS) + world_size > MAX_POOLED_RANKS:
            _POOLS.pop(next(iter(_POOLS))).close()
        pool = procs.RankPool(world_size, lightning=lightning)
    _POOLS[key] = pool
    return pool


_MODULE: list[str] = [""]


def new_module(name: str) -> None:
    """Ends the pools when the tests move to another module (a 4-rank Lightning fit hung on its rank 0 in the full
    suite when its pool had served other modules first; in a pool of its own module it passes)."""
    if name != _MODULE[0]:
        _MODULE[0] = name
        _close_pools()


@atexit.register
def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def raise_failure(result: procs.RunResult) -> list:
    """The per-rank values of ``result``, or its failure raised: ``TimeoutError`` past the timeout, else
    ``RuntimeError`` naming the rank and holding its traceback."""
    if result.status == "timeout":
        raise TimeoutError(result.reason)
    if not result.ok:
        raise RuntimeError(result.reason if result.rank is None else f"rank {result.rank} failed:\n{result.reason}")
    return result.values


def run_on_ranks(fn, world_size: int, *args, timeout: float, lightning: bool, allow_exit: bool = False,
                 fresh: bool = False) -> list:
    """The one way tests start ranks: the session's pool for ``(world_size, lightning)``, or fresh ranks when
    ``fresh``, ``allow_exit`` (ranks that end themselves) or ``fn``/``args`` cannot be sent to a pool."""
    if fresh or FRESH_FOR_THIS_TEST or allow_exit or not procs.picklable(fn, args):
        return raise_failure(procs.run_ranks(fn, world_size, *args, timeout=timeout, lightning=lightning,
                                             allow_exit=allow_exit, tracebacks=True, group_timeout=timeout / 2))
    return raise_failure(_pool(world_size, lightning).run(fn, *args, timeout=timeout, env=dict(os.environ)))


def run_distributed(fn, world_size: int, *args, timeout: float = 180.0, fresh: bool = False):
    return run_on_ranks(fn, world_size, *args, timeout=timeout, lightning=False, fresh=fresh)
