"""The processes tests and benchmarks run ranks in (``lightning_tp2d.bench.procs``): they end for certain, say where
they hung, and a rank forked from a process that used several OpenMP threads does not hang in its first parallel
kernel.

Both failures were seen in the full suite: a one-rank Lightning fit hung in ``layer_norm`` (GNU OpenMP is not
fork-safe: the strategy raised the rank's threads from one to cores / processes, and the parallel region waited on
the parent's threads), and, with Lightning's SIGTERM handler installed, that rank outlived ``terminate()``, so
pytest's exit (multiprocessing joins its children) and CI's output pipe waited on it past CI's limit.
"""

from __future__ import annotations

import os
import signal
import time

import torch

from lightning_tp2d.bench import procs


def _parallel_layer_norm_in_the_parent() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(2048, 4096)
        for _ in range(3):  # large enough for ATen to open a parallel region of two threads
            torch.nn.functional.layer_norm(x, (4096,))
    finally:
        torch.set_num_threads(threads)


def _strategy_threads_then_layer_norm(rank: int, world_size: int) -> tuple[int, str]:
    from lightning.fabric.utilities.distributed import _set_num_threads_if_needed

    _set_num_threads_if_needed(1)  # what a one-process Lightning strategy does (TP2DStrategy too): cores / processes
    torch.nn.functional.layer_norm(torch.randn(2048, 4096), (4096,))
    return torch.get_num_threads(), os.environ["OMP_NUM_THREADS"]


def test_a_rank_forked_after_the_parent_used_two_openmp_threads_keeps_one_and_finishes():
    _parallel_layer_norm_in_the_parent()
    fresh = procs.run_ranks(_strategy_threads_then_layer_norm, 1, timeout=60)
    assert fresh.ok, fresh.reason
    assert fresh.values == [(1, "1")]
    pool = procs.RankPool(1, lightning=True)
    try:
        for _ in range(2):  # the second task starts from what the first left
            pooled = pool.run(_strategy_threads_then_layer_norm, timeout=60, env=dict(os.environ))
            assert pooled.ok, pooled.reason
            assert pooled.values == [(1, "1")]
    finally:
        pool.close()


def _stall_ignoring_sigterm(rank: int, world_size: int, folder: str) -> None:
    signal.signal(signal.SIGTERM, lambda *_: None)  # as Lightning's handler: a flag, the run goes on
    with open(os.path.join(folder, f"pid-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(0.1)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_stalled_rank_that_ignores_sigterm_prints_its_stack_and_is_killed(tmp_path, capfd):
    result = procs.run_ranks(_stall_ignoring_sigterm, 2, str(tmp_path), timeout=3)
    assert result.status == "timeout" and result.reason == "ranks [0, 1] did not finish within 3 s"
    pids = [int((tmp_path / f"pid-{r}").read_text()) for r in range(2)]
    assert all(_gone(pid) for pid in pids)
    err = capfd.readouterr().err
    assert err.count("in _stall_ignoring_sigterm") >= 2  # each rank's stack, from faulthandler


def test_a_pool_whose_task_stalls_ends_its_ranks_and_refuses_more_tasks(tmp_path):
    pool = procs.RankPool(2)
    result = pool.run(_stall_ignoring_sigterm, str(tmp_path), timeout=3)
    assert result.status == "timeout" and not pool.alive
    assert all(_gone(int((tmp_path / f"pid-{r}").read_text())) for r in range(2))
    try:
        pool.run(_stall_ignoring_sigterm, str(tmp_path))
    except RuntimeError as err:
        assert "this RankPool has ended" in str(err)
    else:
        raise AssertionError("an ended pool ran a task")


def _returns_a_tensor_that_requires_grad(rank: int, world_size: int) -> torch.Tensor:
    return torch.ones(2, requires_grad=True) * 2  # not a leaf: it does not pickle


def test_a_rank_whose_return_value_does_not_pickle_fails_at_once_naming_why():
    # the queue's feeder thread would only print the pickling error and drop the value: the parent waited 180 s
    start = time.monotonic()
    pool = procs.RankPool(2)
    try:
        for result in (procs.run_ranks(_returns_a_tensor_that_requires_grad, 2, timeout=120.0),
                       pool.run(_returns_a_tensor_that_requires_grad, timeout=120.0)):
            assert result.status == "error", result.status
            assert "return value cannot be sent to the parent (it must pickle)" in result.reason
            assert "requires_grad" in result.reason
    finally:
        pool.close()
    assert time.monotonic() - start < 60


def test_the_oversubscription_benchmark_times_both_placements(capsys):
    """``recipes/benchmarks/gloo_oversubscribed.py`` (what a small collective costs with more ranks than cores): a
    row per world size and placement, each with its time per call and the ranks' CPU seconds."""
    import runpy

    bench = runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "recipes", "benchmarks",
                                        "gloo_oversubscribed.py"))
    row = bench["measure"](2, 20, sorted(os.sched_getaffinity(0))[:1])
    assert row["ms_per_call"] > 0 and row["cpu_s"] >= row["system_s"] >= 0, row
    bench["main"](["--ranks", "2", "--calls", "20"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].endswith("20 all-reduces of 64 floats per row")
    assert [line.split()[:2] for line in lines[2:]] == [["2", str(len(os.sched_getaffinity(0)))], ["2", "1"]]
