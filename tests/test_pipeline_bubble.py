"""The schedule benchmark's timed mode (``recipes/benchmarks/pipeline_bubble.py``) at pp 2: 1F1B's measured bubble
is the cost model's (:func:`lightning_tp2d.planning.pipeline_cost.bubble_fraction`) within 0.1, and more
micro-batches measure a smaller bubble.

Each block of a real :class:`~lightning_tp2d.pipeline.Pipeline` sleeps a known time per micro-batch (5 ms forward,
10 ms backward: a 60 ms chunk of 4 blocks), so the 2 ranks do not compete for the cores; ``1 - B / W`` per rank,
``B`` the time inside the stage's modules, ``W`` the step's. Ranks from the module's pool (:func:`tests.distributed.
run_distributed`).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from lightning_tp2d.planning.pipeline_cost import bubble_fraction
from tests.distributed import run_distributed

BENCH = Path(__file__).parents[1] / "recipes" / "benchmarks" / "pipeline_bubble.py"
CASES = [("1f1b", 1, 2), ("1f1b", 1, 4)]  # (schedule, virtual_stages, microbatches)


def _bench():
    """The benchmark script as a module (``recipes/`` is not a package), loaded once per process."""
    if "pipeline_bubble_bench" not in sys.modules:
        spec = importlib.util.spec_from_file_location("pipeline_bubble_bench", BENCH)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["pipeline_bubble_bench"]


def _timed_worker(rank: int, world_size: int, cases: list) -> list[dict]:
    bench = _bench()
    mode = bench.modes(quick=True, block_ms=15.0, real_batch=128)["timed"]
    return bench.measure_cases(rank, world_size, mode, cases)


def test_1f1b_measured_bubble_is_the_predicted_one_and_shrinks_with_more_microbatches():
    per_rank = run_distributed(_timed_worker, 2, CASES, timeout=120.0)
    measured = [max(ranks[i]["bubble"] for ranks in per_rank) for i in range(len(CASES))]
    predicted = [bubble_fraction(2, m, v, schedule) for schedule, v, m in CASES]  # 1/3, 1/5
    for case, got, want in zip(CASES, measured, predicted):
        assert abs(got - want) <= 0.1, (case, got, want)
    assert measured[1] < measured[0], measured
