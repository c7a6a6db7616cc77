"""What one small gloo collective costs when there are more ranks than cores (the test suite's case: 2, 4, 8 and 9
CPU ranks on a 2-core machine).

For each world size, ``--calls`` all-reduces of a 64-element float32 tensor on forked gloo ranks, one thread each,
first free to use every core, then all pinned to one core (``os.sched_setaffinity``). Prints the milliseconds per
call and the CPU seconds the ranks used (user + system, every rank's sum), so that the cost shows as the machine's,
not just as wall time::

    python recipes/benchmarks/gloo_oversubscribed.py --ranks 2 4 8 --calls 500

On the project's 2-core machine (2026-12-03, `--calls 500`, the range of three runs), ms per call / CPU seconds of
all ranks:

| ranks | both cores | one core |
|---|---|---|
| 2 | 0.6-2.8 / 0.4-1.4 | 0.3-0.4 / 0.1-0.2 |
| 4 | 5.2-7.4 / 3.6-4.5 | 5.4-6.5 / 2.7-3.1 |
| 8 | 21-35 / 16-21 | 25-29 / 13-14 |

Most of it is kernel time: a rank switches context 35-80 times per call. So a test that issues many small
collectives on 8 ranks pays 20-35 ms for each, whatever the process layout around it. Ranks kept on one core cost
the machine less CPU; the test suite with each pytest worker's processes on its own core used 4-8% less CPU but
took as long (1,122 and 1,181 s against 1,168 and 1,192 s; CONTRIBUTING.md), so it does not pin.
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import torch
import torch.distributed as dist

from lightning_tp2d.bench.procs import run_ranks


def _rank(rank: int, world: int, calls: int) -> tuple[float, float, float]:
    """``(seconds, user s, system s)`` of ``calls`` all-reduces on this rank (one thread, its group made by
    :func:`~lightning_tp2d.bench.procs.run_ranks`)."""
    x = torch.ones(64)
    dist.barrier()
    start, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(calls):
        dist.all_reduce(x)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter() - start, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime


def measure(world: int, calls: int, cores: list[int]) -> dict:
    """``{"ms_per_call", "cpu_s", "system_s"}`` of ``calls`` all-reduces on ``world`` forked ranks on ``cores``."""
    every = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)  # before the fork: the ranks and gloo's threads inherit it
    try:
        run = run_ranks(_rank, world, calls)
    finally:
        os.sched_setaffinity(0, every)
    if not run.ok:
        raise RuntimeError(f"rank {run.rank}: {run.status}: {run.reason}")
    wall = max(r[0] for r in run.values)
    return {"ms_per_call": 1e3 * wall / calls, "cpu_s": sum(r[1] + r[2] for r in run.values),
            "system_s": sum(r[2] for r in run.values)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--calls", type=int, default=1000)
    args = parser.parse_args(argv)
    every = sorted(os.sched_getaffinity(0))
    print(f"{len(every)} cores; {args.calls} all-reduces of 64 floats per row")
    print(f"{'ranks':>5} {'cores':>6} {'ms/call':>8} {'CPU s':>7} {'of it system':>12}")
    for world in args.ranks:
        for cores in (every, every[:1]):
            r = measure(world, args.calls, cores)
            print(f"{world:>5} {len(cores):>6} {r['ms_per_call']:>8.2f} {r['cpu_s']:>7.1f} {r['system_s']:>12.1f}")


if __name__ == "__main__":
    main()
