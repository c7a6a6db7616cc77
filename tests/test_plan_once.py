"""``TP2DStrategy(layout="auto")`` plans once, on rank 0, and every rank runs rank 0's row.

Four forked CPU ranks (``tests.lightning_ranks.run_ranks``) each build the Trainer and run the strategy's
``setup_environment`` (plan, process group, mesh). The planner is replaced by one that answers differently on every
rank and records who called it, so the test sees which rank planned and whose answer each rank took; the planner's
own choices are ``tests/test_auto_layout.py``'s and ``tests/test_planner.py``'s.
"""

from __future__ import annotations

import os

import lightning.pytorch as L
import pytest

import lightning_tp2d as tp
from lightning_tp2d.planning import planner
from lightning_tp2d.planning.planner import NothingFits, PlanRow
from lightning_tp2d.strategy import TP2DStrategy
from tests.lightning_ranks import run_ranks

WORLD = 4
CALLS: list[int] = []  # the ranks that called the planner, in this process


def _row(layout: str, p: int, dp: int, memory_gib: float) -> PlanRow:
    return PlanRow.of(layout=layout, baseline=False, tensor_parallel_size=p, data_parallel_size=dp, zero_stage=1,
                   checkpointing="full", micro_batch=1, grad_accum=1, memory_gib=memory_gib, step_s=1.0,
                   tokens_per_s_per_gpu=1.0, mfu=0.1)


def _plan_by_rank(*args, **kwargs) -> list[PlanRow]:
    """A planner whose answer names the rank that made it: rank 0 a 2 x 2 grid, any other rank rings of 2."""
    rank = int(os.environ["RANK"])
    CALLS.append(rank)
    if kwargs.get("gpu_memory_gib", 1.0) < 0.01:
        raise NothingFits(f"the least memory per GPU any configuration needs is 0.5 GiB (asked on rank {rank})")
    best = _row("2d", 4, 1, float(rank)) if rank == 0 else _row("metp", 2, 2, float(rank))
    return [best, _row("metp", 4, 1, float(rank))]


def _setup(rank: int, world_size: int, memory_gib: float):
    strategy = TP2DStrategy(layout="auto", memory_gib=memory_gib, plan_options={"seq": 64})
    L.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, logger=False, enable_checkpointing=False)
    strategy.connect(tp.CausalLMModule("gpt2-tiny"))
    try:
        strategy.setup_environment()
    except ValueError as err:
        return "error", type(err).__name__, str(err), list(CALLS)
    dims = strategy.parallel_dims
    return ("ok", strategy.chosen_plan, (dims.layout, dims.tensor_parallel_size, dims.data_parallel_size),
            tuple(strategy.device_mesh.mesh.shape), strategy.zero_stage, list(CALLS))


@pytest.fixture()
def plan_by_rank(monkeypatch):
    monkeypatch.setattr(planner, "plan", _plan_by_rank)  # the forked ranks inherit it (core imports it at call time)


def test_rank_zero_plans_once_and_every_rank_runs_its_row(plan_by_rank):
    results = run_ranks(_setup, WORLD, 1.0)
    rank0_row = _row("2d", 4, 1, 0.0)
    for rank, (status, chosen, dims, mesh_shape, stage, calls) in enumerate(results):
        assert status == "ok"
        assert chosen == rank0_row  # rank 0's answer (memory_gib 0.0 names it), not the rank's own
        assert dims == ("2d", 4, 1) and mesh_shape == (1, 2, 2) and stage == 1
        assert calls == ([0] if rank == 0 else [])  # only rank 0 ran the planner, once


def test_rank_zeros_planning_error_stops_every_rank_with_its_message(plan_by_rank):
    results = run_ranks(_setup, WORLD, 0.001)
    for rank, (status, kind, message, calls) in enumerate(results):
        assert (status, kind) == ("error", "NothingFits")
        assert "least memory per GPU any configuration needs is 0.5 GiB (asked on rank 0)" in message
        assert calls == ([0] if rank == 0 else [])
