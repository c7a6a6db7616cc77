"""Faults a shared cluster produces, scripted: each case asserts the outcome, the time to end and what is left.

Covered so far (issue 13): a stalled rank under a short timeout (every mesh axis group gets the timeout; the
surviving ranks end within about that time with an error naming the axis and ranks).
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch

import lightning_tp2d as tp
from lightning_tp2d.comm import CommError
from lightning_tp2d.mesh import as_timeout, group_timeout
from lightning_tp2d.models import GPT2, GPT2Config
from tests.distributed import run_distributed

TIMEOUT_S = 2.0


def _stall(rank: int, world_size: int, layout: str, stalled: int) -> dict:
    mesh = tp.init_mesh(layout, world_size, 1, timeout=TIMEOUT_S)
    timeouts = {axis: group_timeout(mesh.get_group(axis)) for axis in mesh.mesh_dim_names if mesh.size(
        mesh.mesh_dim_names.index(axis)) > 1}
    cfg = GPT2Config.from_name("gpt2-tiny", n_head=4, dropout=0.0)
    torch.manual_seed(0)
    model = tp.parallelize(GPT2(cfg), mesh, layout)
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    model(idx, idx).backward()  # everyone healthy once
    torch.distributed.barrier()
    if rank == stalled:
        time.sleep(3 * TIMEOUT_S)  # a rank stops answering (a hung data loader, a SIGSTOP, a slow disk)
    t0 = time.monotonic()
    try:
        model(idx, idx).backward()
        error = None
    except CommError as err:
        error = str(err)
    return {"timeouts": {k: v.total_seconds() for k, v in timeouts.items()}, "error": error,
            "seconds": time.monotonic() - t0}


@pytest.mark.parametrize("layout", ["2d", "metp"])
def test_a_stalled_rank_ends_the_step_within_the_timeout_naming_the_axis(layout):
    stalled = 3
    results = run_distributed(_stall, 4, layout, stalled, timeout=120)
    for rank, r in enumerate(results):
        assert set(r["timeouts"].values()) == {TIMEOUT_S}, (rank, r["timeouts"])  # every axis group, not 30 min
        if rank == stalled:
            continue
        assert r["error"] is not None, (rank, r)
        assert "along mesh axis" in r["error"] and "did not complete" in r["error"], r["error"]
        assert r["seconds"] < 3 * TIMEOUT_S, (rank, r["seconds"])  # about the timeout, never the default 30 min


def test_timeout_values_are_seconds_or_timedeltas():
    assert as_timeout(90) == timedelta(seconds=90)
    assert as_timeout(timedelta(minutes=2)) == timedelta(minutes=2)
    assert as_timeout(None) is None
    with pytest.raises(ValueError, match="timeout must be seconds"):
        as_timeout("60")
    with pytest.raises(ValueError, match="timeout must be positive"):
        as_timeout(0)
    assert tp.TP2DStrategy(timeout=60).timeout == timedelta(seconds=60)
