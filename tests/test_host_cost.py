"""The planner's host price (issue 48, part 5): a micro-batch takes the longer of its GPU time and the host's time to
issue its ops (:mod:`lightning_tp2d.planning.host_cost`), the ops measured per block on CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_tp2d.families import model_config
from lightning_tp2d.planning import host_cost, planner
from lightning_tp2d.planning.cost_model import H100_NVLINK4_NDR
from tests.distributed import run_distributed


def test_measured_sizes_give_the_measured_ops_and_other_sizes_lie_on_the_lines_between():
    for name in ("gpt2-tiny", "llama-tiny"):
        cfg = model_config(name)
        family = "llama" if name.startswith("llama") else "gpt2"
        for layout, points in host_cost.MEASURED_OPS[family].items():
            for k, ((f1, b1), (f2, b2)) in points.items():
                p = k * k if layout in ("2d", "2d-metp") else k  # (a grid of side k)
                for n_layer, total in ((1, f1 + b1), (2, f2 + b2)):
                    assert host_cost.micro_batch_ops(layout, dataclasses.replace(cfg, n_layer=n_layer), p) == total
    cfg = model_config("gpt2-tiny")
    ring = host_cost.MEASURED_OPS["gpt2"]["metp"]
    at = {k: host_cost.micro_batch_ops("metp", cfg, k) for k in (2, 3, 4, 8)}
    assert at[3] == pytest.approx((at[2] + at[4]) / 2)  # between measured ring lengths: on the line
    assert at[8] == sum(ring[8][1])  # (two blocks: the measured two-block count)
    # the grid beyond its largest measured side: the last two sides' line, extended
    q4, q3 = (host_cost.micro_batch_ops("2d", cfg, q * q) for q in (4, 3))
    assert host_cost.micro_batch_ops("2d", cfg, 64) == pytest.approx(q4 + 4 * (q4 - q3))


def test_full_checkpointing_runs_each_block_forward_again():
    cfg = model_config("llama-tiny")
    (f1, _), (f2, _) = host_cost.MEASURED_OPS["llama"]["2d"][2]
    extra = host_cost.micro_batch_ops("2d", cfg, 4, "full") - host_cost.micro_batch_ops("2d", cfg, 4)
    assert extra == cfg.n_layer * (f2 - f1)
    assert host_cost.micro_batch_ops("2d", cfg, 4, "selective") == host_cost.micro_batch_ops("2d", cfg, 4)


def test_torch_code_costs_no_host_time_compiled_and_the_layouts_their_eager_price():
    cfg = model_config("llama-3.1-8b")
    for rival in ("tp1d-sp", "cp", "cp-tp", "ulysses", "single"):
        assert host_cost.micro_batch_host_seconds(rival, cfg, 8, compiled=True) == 0.0
        assert host_cost.micro_batch_host_seconds(rival, cfg, 8) == pytest.approx(
            host_cost.micro_batch_ops(rival, cfg, 8) * host_cost.PLAIN_SECONDS_PER_OP)
    for layout in ("2d", "metp", "2d-metp"):
        p = 4 if layout != "metp" else 8
        eager = host_cost.micro_batch_host_seconds(layout, cfg, p)
        assert eager == host_cost.micro_batch_host_seconds(layout, cfg, p, compiled=True) > 0
        assert eager == pytest.approx(host_cost.micro_batch_ops(layout, cfg, p) * host_cost.SECONDS_PER_OP[layout])


@pytest.mark.parametrize("compiled", [False, True])
def test_a_row_takes_the_longer_of_its_gpu_and_host_times(compiled):
    cfg = model_config("llama-3.1-8b")
    common = dict(p=4, dp=1, zero_stage=0, checkpointing="none", micro_batch=2, grad_accum=1, seq=4096,
                  hw=H100_NVLINK4_NDR, gpus_per_node=8, compiled=compiled)
    row = planner.price(cfg, layout="2d", **common)
    times = row.parts["time_s"]
    gpu = times["micro_compute"] + times["micro_tp_exposed"] + times["micro_elementwise"]
    assert times["micro_host_ops"] == pytest.approx(host_cost.micro_batch_host_seconds("2d", cfg, 4,
                                                                                         compiled=compiled))
    micro = max(gpu, times["micro_host_ops"])
    assert row.step_s == pytest.approx(micro + times["dp_exposed"] + times["optimizer"])
    baseline = planner.price(cfg, layout="tp1d-sp", **common, async_tp=False)
    assert (baseline.parts["time_s"]["micro_host_ops"] == 0.0) == compiled


def _table_entry(rank: int, world: int, n_layer: int) -> dict:
    from lightning_tp2d.bench.layer_cost import rank_phase_ops
    from lightning_tp2d.bench.runner import BenchSpec

    spec = BenchSpec(model="gpt2-tiny", overrides={"n_layer": n_layer, "dropout": 0.0, "n_head": 12}, batch=12,
                     seq=96, dtype="bfloat16")
    return rank_phase_ops(rank, world, "2d", spec)


@pytest.mark.skipif(not torch.__version__.startswith("2.13."), reason="the table counts torch 2.13.0's ops")
def test_the_table_is_what_the_code_dispatches_now():
    """One entry of MEASURED_OPS counted again: a change to the layers' ops must come with a new table."""
    measured = []
    for n_layer in (1, 2):
        ranks = run_distributed(_table_entry, 4, n_layer)
        worst = max(ranks, key=lambda c: c["forward"] + c["backward"])
        measured.append((worst["forward"], worst["backward"]))
    assert tuple(measured) == host_cost.MEASURED_OPS["gpt2"]["2d"][2]


def test_a_host_bound_row_says_so_in_the_table():
    cfg = model_config("llama-3.1-8b")
    common = dict(dp=1, zero_stage=0, checkpointing="none", grad_accum=1, hw=H100_NVLINK4_NDR, gpus_per_node=8,
                  compiled=True)
    short = planner.price(cfg, layout="metp", p=8, micro_batch=1, seq=4096, **common)  # little GPU work a micro-batch
    long = planner.price(cfg, layout="metp", p=8, micro_batch=1, seq=131072, **common)
    assert short.host_bound and not long.host_bound
    assert short.step_s == pytest.approx(short.parts["time_s"]["micro_host_ops"] + short.parts["time_s"]["optimizer"]
                                         + short.parts["time_s"]["dp_exposed"])
    text = planner.table([short, long])
    assert text.splitlines()[2].count("(host)") == 1 and "(host)" not in text.splitlines()[3]
    assert short.describe().endswith(", host-bound") and not long.describe().endswith("host-bound")
