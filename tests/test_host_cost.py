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
                    assert host_cost.micro_batch_ops(layout, dataclasses.replace(cfg, n_layer=n_layer), p,
                                                     ring=k) == total  # (torch's CP: its ring's length)
    cfg = model_config("gpt2-tiny")
    ring = host_cost.MEASURED_OPS["gpt2"]["metp"]
    at = {k: host_cost.micro_batch_ops("metp", cfg, k) for k in (2, 3, 4, 8)}
    assert at[3] == pytest.approx((at[2] + at[4]) / 2)  # between measured ring lengths: on the line
    assert at[8] == sum(ring[8][1])  # (two blocks: the measured two-block count)
    # the grid beyond its largest measured side: the last two sides' line, extended
    q4, q3 = (host_cost.micro_batch_ops("2d", cfg, q * q) for q in (4, 3))
    assert host_cost.micro_batch_ops("2d", cfg, 64) == pytest.approx(q4 + 4 * (q4 - q3))


def test_torch_s_context_parallelism_is_priced_at_its_own_ring_length(monkeypatch):
    """torch's CP is a ring (a kernel, a merge and a K|V gradient sum per ring step, counted since the counter sees
    inside its DTensor handler): its ops and memory-bound quotient grow with its CP degree, and a cp row is priced at
    it, not at the four ranks its rates were timed on; cp-tp's ring is its CP degree, not its GPU count."""
    cfg = model_config("llama-tiny")
    ops = [host_cost.micro_batch_ops("cp", cfg, k, ring=k) for k in (2, 4, 8)]
    ratios = [host_cost.memory_bound_ratio("cp", cfg, k, ring=k) for k in (2, 4, 8)]
    assert ops[0] < ops[1] < ops[2] and ratios[0] < ratios[1] < ratios[2]
    assert host_cost.micro_batch_ops("cp-tp", cfg, 8, ring=4) == ops[1]  # (counted as cp, at its CP degree)
    assert host_cost.micro_batch_ops("tp1d-sp", cfg, 8, ring=8) == host_cost.micro_batch_ops("tp1d-sp", cfg, 4)
    seen, real = [], host_cost.memory_bound_ratio
    def recorded(layout, cfg_, p, ring=None):
        seen.append((layout, p, ring))
        return real(layout, cfg_, p, ring)

    monkeypatch.setattr(host_cost, "memory_bound_ratio", recorded)
    common = dict(p=8, dp=1, zero_stage=3, checkpointing="full", micro_batch=1, grad_accum=1, seq=32768,
                  hw=H100_NVLINK4_NDR, gpus_per_node=8)
    planner.price(model_config("llama-3.1-8b"), layout="cp", **common)
    planner.price(model_config("llama-3.1-8b"), layout="cp-tp", cp_tp_size=2, **common)
    assert seen == [("cp", 8, 8), ("cp-tp", 8, 4)]


def test_full_checkpointing_runs_each_block_forward_again():
    cfg = model_config("llama-tiny")
    (f1, _), (f2, _) = host_cost.MEASURED_OPS["llama"]["2d"][2]
    extra = host_cost.micro_batch_ops("2d", cfg, 4, "full") - host_cost.micro_batch_ops("2d", cfg, 4)
    assert extra == cfg.n_layer * (f2 - f1)
    assert host_cost.micro_batch_ops("2d", cfg, 4, "selective") == host_cost.micro_batch_ops("2d", cfg, 4)


def test_each_side_is_priced_at_its_measured_rate_and_the_plain_model_compiled_at_none():
    cfg = model_config("llama-3.1-8b")
    rates = host_cost.CPU_RATES
    unit = host_cost.PLAIN_SECONDS_PER_OP
    for compiled in (False, True):
        mode = "compiled" if compiled else "eager"
        # the plain model: the unit eager, none compiled; torch's 1-D TP + SP and CP at their four-rank ratios
        assert host_cost.seconds_per_op("single", cfg, 1, compiled) == (0.0 if compiled else unit)
        # (not measured: none, the figure most favourable to the rival; Llama's 1-D TP compiled fails in torch 2.13)
        one_d = unit * rates[mode]["llama"]["4"].get("tp1d-sp", 0.0)
        assert host_cost.seconds_per_op("tp1d-sp", cfg, 8, compiled) == one_d and (one_d == 0.0) == compiled
        cp = unit * rates[mode]["llama"]["4"].get("cp", 0.0)  # (cp is not compiled by the harness: none)
        assert host_cost.seconds_per_op("cp", cfg, 8, compiled) == host_cost.seconds_per_op("cp-tp", cfg, 8, compiled)
        assert host_cost.seconds_per_op("cp", cfg, 8, compiled) == cp and (cp == 0.0) == compiled
        # DeepSpeed-Ulysses runs the plain model's ops: the plain model's rate
        assert host_cost.seconds_per_op("ulysses", cfg, 8, compiled) == host_cost.seconds_per_op("single", cfg, 8,
                                                                                                compiled)
        for layout in ("2d", "metp", "2d-metp"):  # size 1: the one-rank ratio; any other size: the four-rank one
            assert host_cost.seconds_per_op(layout, cfg, 1, compiled) == unit * rates[mode]["llama"]["1"][layout]
            for p in (4, 8, 64):
                assert host_cost.seconds_per_op(layout, cfg, p, compiled) == unit * rates[mode]["llama"]["4"][layout]
            assert host_cost.micro_batch_host_seconds(layout, cfg, 4, compiled=compiled) == pytest.approx(
                host_cost.micro_batch_ops(layout, cfg, 4) * host_cost.seconds_per_op(layout, cfg, 4, compiled))
    gpt2 = model_config("gpt2-medium")  # no CP of torch's for GPT-2: counted, and priced, as the plain model
    assert host_cost.seconds_per_op("cp", gpt2, 4) == unit


def test_the_measured_rates_are_complete_and_say_a_layout_costs_the_host_no_less_than_the_plain_model():
    for mode in ("eager", "compiled"):
        for family in ("gpt2", "llama"):
            table = host_cost.CPU_RATES[mode][family]
            for layout in ("2d", "metp", "2d-metp"):
                assert table["1"][layout] >= 0 and table["4"][layout] >= 0
            assert ("tp1d-sp" in table["4"]) == ((mode, family) != ("compiled", "llama"))  # (not compiled)
            assert table["1"]["single"] == (1.0 if mode == "eager" else 0.0)


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
    assert baseline.parts["time_s"]["micro_host_ops"] == pytest.approx(
        host_cost.micro_batch_host_seconds("tp1d-sp", cfg, 4, compiled=compiled))


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


def test_memory_bound_ratio_is_one_where_the_plain_model_runs_and_measured_elsewhere():
    for name in ("gpt2-medium", "llama-3.1-8b"):
        cfg = model_config(name)
        family = "llama" if name.startswith("llama") else "gpt2"
        table = host_cost.MEMORY_BOUND[family]
        for layout in ("2d", "metp", "2d-metp"):
            assert host_cost.memory_bound_ratio(layout, cfg, 1) == 1.0  # the plain model's ops on its tensors
            for k, ratio in table[layout].items():  # measured sizes: the measured quotient
                p = k * k if layout != "metp" else k
                assert host_cost.memory_bound_ratio(layout, cfg, p) == ratio > 0
        ring = table["metp"]
        assert host_cost.memory_bound_ratio("metp", cfg, 3) == pytest.approx((ring[2] + ring[4]) / 2)
        assert host_cost.memory_bound_ratio("metp", cfg, 16) == pytest.approx(ring[8] + 2 * (ring[8] - ring[4]))
        assert host_cost.memory_bound_ratio("tp1d-sp", cfg, 8) == table["tp1d-sp"][4]
        assert host_cost.memory_bound_ratio("single", cfg, 1) == host_cost.memory_bound_ratio("ulysses", cfg, 8) == 1.0
        assert host_cost.memory_bound_ratio("cp-tp", cfg, 8) == host_cost.memory_bound_ratio("cp", cfg, 8)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_row_prices_its_elementwise_bytes_times_its_measured_ratio(monkeypatch, compiled):
    cfg = model_config("llama-3.1-8b")
    common = dict(p=4, dp=1, zero_stage=0, checkpointing="none", micro_batch=2, grad_accum=1, seq=4096,
                  hw=H100_NVLINK4_NDR, gpus_per_node=8, compiled=compiled)
    sides = (("2d", {}), ("tp1d-sp", {"async_tp": False}))  # (the rows the test above prices: traced once)
    assert host_cost.memory_bound_ratio("2d", cfg, 4) == host_cost.MEMORY_BOUND["llama"]["2d"][2]
    rows = {}
    for ratio in (1.0, 2.0, 0.5):
        monkeypatch.setattr(host_cost, "memory_bound_ratio", lambda *args, r=ratio: r)
        rows[ratio] = {layout: planner.price(cfg, layout=layout, **common, **extra).parts["time_s"]["micro_elementwise"]
                       for layout, extra in sides}
    passes = planner.ELEMENTWISE_PASSES["compiled" if compiled else "eager"]
    eager = planner.ELEMENTWISE_PASSES["eager"]
    for layout, _ in sides:
        one = rows[1.0][layout]
        # more bytes than modelled: the layouts' extra moves inside their registered ops, at the eager passes even
        # compiled; torch's at the mode's
        extra = eager if layout == "2d" else passes
        assert rows[2.0][layout] == pytest.approx(one * (passes + extra) / passes)
        assert rows[0.5][layout] == pytest.approx(one * 0.5)  # fewer: the mode's passes over fewer bytes


def _bytes_recipe():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "recipes" / "benchmarks" / "host_ops.py"
    spec = importlib.util.spec_from_file_location("host_ops", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not torch.__version__.startswith("2.13."), reason="the table counts torch 2.13.0's ops")
def test_the_memory_bound_table_is_what_the_code_moves_now():
    """One entry of ``memory_bound`` counted again (exact counts): a change to the layers' bytes needs a recount."""
    recipe = _bytes_recipe()
    entry = host_cost._DATA["memory_bound"]["families"]["gpt2"]["2d"]["2"]
    assert recipe.block_bytes_per_token("gpt2", "2d", 2) == (entry["measured_per_token"], entry["modelled_per_token"])
