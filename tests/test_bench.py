"""``tp2d-bench --quick``: every section on 4 CPU ranks with the tiny model, checked field by field.

The run compares single device, transformers' GPT-2, PyTorch's 1-D tensor parallelism, "2d", "metp" and
"2d-metp" on the same model and data. Every scenario must report its numbers, start from the same loss, and
count exactly the communication the cost model predicts (rank by rank, kind by kind); the memory sections must
show the layouts ordered as the design says. Scenarios that cannot run are rows with a reason, not a crash.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from lightning_tp2d.bench import cli, report
from lightning_tp2d.bench.runner import BenchSpec, max_sequence, run_scenario
from lightning_tp2d.planning import gemm_rates

SCENARIO_FIELDS = {"layout", "p", "batch", "seq", "status", "loss", "step_time_s", "tokens_per_s", "resident_bytes",
                   "activation_bytes", "peak_bytes", "comm_calls", "comm_bytes", "model_comm_bytes", "wire_bytes",
                   "comm_matches_model", "model_activation_bytes", "per_rank"}
MODEL_FIELDS = {"model_comm_bytes", "wire_bytes", "comm_matches_model", "model_activation_bytes"}  # not for "hf"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    assert cli.main(["--quick", "--out", str(out)]) == 0
    with open(out / "results.json") as f:
        return json.load(f), out


@pytest.mark.slow
def test_quick_run_reports_every_field_of_every_scenario(quick):
    results, out = quick
    rows = {r["layout"]: r for r in results["scenarios"]}
    assert list(rows) == ["single", "hf", "tp1d", "2d", "metp", "2d-metp"]
    for layout, r in rows.items():
        assert r["status"] == "ok", r
        missing = SCENARIO_FIELDS - set(r) - (MODEL_FIELDS if layout == "hf" else set())
        assert not missing, (layout, missing)
        assert r["p"] == (1 if layout in ("single", "hf") else 4)
        assert len(r["per_rank"]) == r["p"]
        assert r["step_time_s"] > 0 and r["tokens_per_s"] > 0
        assert 0 < r["activation_bytes"] < r["peak_bytes"] and r["resident_bytes"] > 0
        if layout != "hf":  # transformers' loss leaves out the last position's target
            assert math.isclose(r["loss"], rows["single"]["loss"], rel_tol=1e-5), layout  # same model and data
    for name in ("results.json", "results.md", "memory_vs_seq.png", "comm_vs_p.png", "speedup_vs_gpus.png"):
        assert (out / name).stat().st_size > 0, name
    assert {t["key"] for t in results["targets"]} == set(report.TARGETS)
    assert results["machine"]["cores"] >= 1 and results["command"].startswith("tp2d-bench --quick")
    assert all(r["calls_per_block"] > 0 for layout, r in rows.items() if layout not in ("single", "hf"))
    proj = results["projection"]  # --quick projects 4 and 16 GPUs, each with its fair rows
    assert [r["gpus"] for r in proj["rows"]] == [4, 16] and [f["gpus"] for f in proj["fair"]] == [4, 16]
    assert {"time_tp1d_sp_s", "time_tp1d_sp_async_s", "time_2d_keep_s", "time_2d_broadcast_s",
            "hidden_comm_2d_s", "exposed_comm_2d_s"} <= set(proj["rows"][0])
    fair = proj["fair"][-1]
    assert fair["best_2d"]["layout"] == "2d" and fair["speedup"] > 0 and len(fair["configurations"]) >= 4
    # the committed H200 table (83 products measured on 2026-12-04) and its fit
    assert len(proj["gemm_calibration"]["table"]) == len(gemm_rates.H200_BF16) == 83
    assert proj["gemm_calibration"]["overhead_s"] > 0


@pytest.mark.slow
def test_counted_communication_equals_the_cost_model(quick):
    results, _ = quick
    for r in results["scenarios"] + results["weak_scaling"]:
        if r["layout"] in ("single", "hf"):
            assert r["comm_bytes"] == 0
            continue
        assert r["comm_matches_model"] is True, r["layout"]
        assert r["comm_bytes"] == r["model_comm_bytes"]
        assert (r["comm_bytes"] > 0) == (r["p"] > 1 or r["layout"] == "tp1d")  # tp1d: loss_parallel even on one rank


@pytest.mark.slow
def test_memory_sections_order_the_layouts_as_designed(quick):
    results, _ = quick
    rows = {r["layout"]: r for r in results["scenarios"]}
    # 1-D TP keeps full [tokens, h] activations on every rank; "2d" and the ring keep 1/p of them
    assert rows["2d"]["activation_bytes"] < rows["tp1d"]["activation_bytes"]
    assert rows["metp"]["activation_bytes"] < rows["tp1d"]["activation_bytes"]
    mem = {(r["layout"], r["seq"]): r["peak_bytes"] for r in results["memory_vs_seq"] if r["status"] == "ok"}
    assert mem and all(mem[layout, 64] > mem[layout, 32] for layout, seq in mem if seq == 32)
    seqs = {r["layout"]: r for r in results["max_seq"]}
    assert seqs["metp"]["status"] == seqs["tp1d"]["status"] == "ok"
    assert seqs["metp"]["max_seq"] > seqs["tp1d"]["max_seq"] > 0
    for r in seqs.values():  # the last probe that fit is the answer; a larger one ran out of the cap
        statuses = {p["seq"]: p["status"] for p in r["probes"]}
        assert statuses[r["max_seq"]] == "ok"
        assert any(s == "oom" and q > r["max_seq"] for q, s in statuses.items()) or r["capped_by_limit"]


def test_scenarios_that_cannot_run_are_reported_with_the_numbers():
    spec = BenchSpec(overrides={"n_head": 12}, steps=1, warmup=0)
    assert "tensor_parallel_size" in run_scenario("2d", 3, spec)["reason"]  # 3 is not a square
    assert "not divisible by 2*p=8" in run_scenario("metp", 4, spec, seq=60)["reason"]
    assert "batch size 3 is not divisible by q=2" in run_scenario("2d", 4, BenchSpec(batch=3, overrides={"n_head": 12}))[
        "reason"]
    assert "n_head=6 is not divisible by p=4" in run_scenario("tp1d", 4, BenchSpec())["reason"]
    oom = run_scenario("metp", 2, spec, cap_bytes=10_000, full=False)
    assert oom["status"] == "oom" and "exceeds the cap of 10000 bytes" in oom["reason"]
    assert "bias=False" in run_scenario("hf", 1, BenchSpec(overrides={"bias": False}))["reason"]
    # a search whose smallest probe does not fit reports 0, not an error
    assert max_sequence("tp1d", 2, spec, cap_bytes=10_000, log=lambda m: None)["max_seq"] == 0


def test_scenario_rules_come_from_the_layouts():
    from lightning_tp2d.bench.cli import local_mlp_shape
    from lightning_tp2d.bench.runner import SCENARIOS, check_scenario, input_multiples

    assert SCENARIOS == ("single", "hf", "tp1d", "tp1d-sp", "cp", "cp-tp", "ulysses", "2d", "metp", "2d-metp")
    # (batch, sequence) multiples on 4 ranks: grid rows split the batch; zigzag layouts cut 2 * side chunks;
    # sequence parallelism splits the sequence; CP cuts 2 * (CP ranks) chunks (cp-tp: CP over 2, SP over 2 of each
    # rank's T/2 tokens)
    assert [input_multiples(s, 4) for s in SCENARIOS] == [(1, 1), (1, 1), (1, 1), (1, 4), (1, 8), (1, 4), (1, 4),
                                                          (2, 1), (1, 8), (1, 4)]
    assert input_multiples("cp-tp", 8) == (1, 8) and input_multiples("cp-tp", 8, cp_tp_size=4) == (1, 8)
    spec = BenchSpec(overrides={"n_head": 12})
    assert "sequence length 62 is not divisible by 2*q=4" in check_scenario("2d-metp", 4, spec, 1, 62)
    assert check_scenario("2d-metp", 4, spec, 1, 64) is None  # batch 1 on the grid that splits sequences
    assert "p must be a positive int" in check_scenario("metp", 0, spec, 1, 64)
    assert "T=62 is not divisible by p=4" in check_scenario("tp1d-sp", 4, spec, 1, 62)
    assert check_scenario("tp1d-sp", 4, spec, 1, 64) is None and check_scenario("tp1d", 4, spec, 1, 62) is None
    # one rank's first MLP product [m, k] @ [k, n]: 256 tokens, h = 48 on 4 ranks
    assert local_mlp_shape("single", 256, 48, 1) == (256, 48, 192)
    assert local_mlp_shape("tp1d", 256, 48, 4) == (256, 48, 48)
    assert local_mlp_shape("2d", 256, 48, 4) == (128, 24, 96)  # [N/q, h/q] @ [h/q, 4h/q]
    assert local_mlp_shape("metp", 256, 48, 4) == (64, 48, 48)  # [N/p, h] @ [h, 4h/p]


@pytest.mark.parametrize("argv, message", [
    (["--model", "foo"], "unknown GPT-2 config 'foo'"),
    (["--layouts", "single,foo"], "unknown layouts ['foo']"),
    (["--set", "n_head=5"], "n_embd=48 is not divisible by n_head=5"),
])
def test_command_line_refuses_bad_input_before_running_anything(argv, message, capsys):
    with pytest.raises(SystemExit) as err:
        cli.main(argv)
    assert err.value.code == 2 and message in capsys.readouterr().err


def test_bfloat16_autocast_scenario_runs_and_starts_from_the_float32_loss():
    spec = BenchSpec(overrides={"n_head": 12}, steps=1, warmup=0)
    bf16 = run_scenario("2d", 4, BenchSpec(overrides={"n_head": 12}, steps=1, warmup=0, dtype="bfloat16"))
    assert bf16["status"] == "ok", bf16
    assert "comm_matches_model" not in bf16  # the exact check is float32-only
    assert math.isclose(bf16["loss"], run_scenario("single", 1, spec)["loss"], rel_tol=1e-2)


def test_compiled_scenario_runs_and_gives_the_eager_loss():
    assert cli.parser().parse_args(["--compile"]).compile == "inductor"
    assert cli.parser().parse_args(["--compile", "aot_eager"]).compile == "aot_eager"
    eager = run_scenario("single", 1, BenchSpec(steps=1, warmup=1))
    compiled = run_scenario("single", 1, BenchSpec(steps=1, warmup=1, compile="aot_eager"))
    assert compiled["status"] == "ok", compiled
    assert compiled["loss"] == eager["loss"]  # aot_eager runs the same kernels


def test_llama_runs_the_layouts_its_family_has_and_reports_the_others():
    """``--model llama-tiny``: the family decides the layouts (and sizes); GPT-2-only baselines are reasons, not
    crashes; a Llama step on a 2x2 grid starts from the single-device loss."""
    from lightning_tp2d.bench.runner import check_scenario
    from lightning_tp2d.families import get_family
    from lightning_tp2d.models import LlamaConfig

    spec = BenchSpec(model="llama-tiny", steps=1, warmup=0)
    assert spec.config() == LlamaConfig.from_name("llama-tiny")
    assert "baseline is GPT-2 only (model 'llama-tiny' is a Llama)" in run_scenario("hf", 4, spec)["reason"]
    for baseline in ("tp1d", "tp1d-sp"):  # torch's 1-D TP (+ SP) has torchtitan's Llama plan (baselines/tp1d.py)
        assert check_scenario(baseline, 2, spec, 4, 64) is None
        assert "n_kv_head=6 is not divisible by p=4" in check_scenario(baseline, 4, spec, 4, 64)
    for layout in ("metp", "2d-metp"):
        if layout not in get_family("llama").layouts:  # (ring plans for Llama are being added elsewhere)
            assert "model family 'llama' (Llama) has no plan for layout" in run_scenario(layout, 4, spec)["reason"]
    odd = BenchSpec(model="llama-tiny", overrides={"intermediate_size": 265})
    assert "intermediate_size=265 is not divisible by q=2" in check_scenario("2d", 4, odd, 4, 64)
    single, grid, sp = run_scenario("single", 1, spec), run_scenario("2d", 4, spec), run_scenario("tp1d-sp", 2, spec)
    assert single["status"] == grid["status"] == sp["status"] == "ok", (single, grid, sp)
    assert grid["loss"] == pytest.approx(single["loss"], rel=1e-4) and grid["comm_calls"] > 0
    assert sp["loss"] == pytest.approx(single["loss"], rel=1e-5) and sp["sent_bytes"] > 0
    assert "model_comm_bytes" not in grid  # the cost model describes GPT-2 only


def _fair(gpus: int, speedup: float, tp_ge_2: float) -> dict:
    best = {"layout": "single", "tp": 1, "dp": gpus}
    return {"gpus": gpus, "speedup": speedup, "speedup_vs_tp_ge_2": tp_ge_2, "best_tp1d": best,
            "best_2d": {"layout": "2d", "tp": 4, "dp": gpus // 4}, "configurations": []}


def _projected_figure(monkeypatch, tmp_path, proj: dict):
    """The matplotlib figure ``report.plots`` saves as ``speedup_vs_gpus.png`` for this projection section."""
    import matplotlib.pyplot as plt

    saved = {}

    def keep(fig, out_dir, name):
        saved[name] = fig
        return name

    monkeypatch.setattr(report, "_save", keep)
    assert report.plots({"projection": proj}, str(tmp_path)) == ["speedup_vs_gpus.png"]
    plt.close(saved["speedup_vs_gpus.png"])  # (its artists stay readable)
    return saved["speedup_vs_gpus.png"]


def test_speedup_figure_plots_the_fair_rows_against_their_named_baseline(monkeypatch, tmp_path):
    """One group of 1-D TP without SP stretched across nodes reads 2.0x and 16.3x; the fair rows (best 2d x DP
    against best 1-D TP+SP x DP, as results.md reports them) read 0.85x and 0.73x: the figure shows the fair rows
    and says against what."""
    rows = [{"gpus": 4, "speedup": 2.0}, {"gpus": 16, "speedup": 16.3}]
    proj = {"model": "gpt2-medium", "batch": 64, "seq": 1024, "hardware": "H100", "rows": rows,
            "fair": [_fair(16, 0.73, 0.90), _fair(4, 0.85, 0.95)]}
    ax = _projected_figure(monkeypatch, tmp_path, proj).axes[0]
    curves = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()
              if not line.get_label().startswith("_")}
    assert curves == {"best 2d (grid x DP) vs best 1-D TP+SP x DP (TP 1: plain DP)": ([4, 16], [0.85, 0.73]),
                      "best 2d (grid x DP) vs best 1-D TP+SP (TP >= 2) x DP": ([4, 16], [0.95, 0.90])}
    assert "vs best 1-D TP+SP x DP" in ax.get_title() and "1-D TP+SP x DP" in ax.get_ylabel()
    md = report.markdown({"command": "tp2d-bench", "machine": {"summary": "m"}, "date": "d", "projection": {
        **proj, "rows": [], "fair": [{**f, "configurations": []} for f in proj["fair"]]},
        "spec": {"model": "gpt2-medium", "overrides": {}, "dtype": "float32", "device": "cpu"}})
    assert "speedup best 1-D / best 2d: 0.73" in md and "speedup best 1-D / best 2d: 0.85" in md  # the same numbers
    # a results.json from before the fair rows: the one-group rows, and the figure names that baseline
    ax = _projected_figure(monkeypatch, tmp_path, {**proj, "fair": []}).axes[0]
    (line,) = [line for line in ax.get_lines() if not line.get_label().startswith("_")]
    assert list(line.get_ydata()) == [2.0, 16.3]
    assert "one 1-D TP group (no SP, blocking)" in ax.get_title()
    assert line.get_label() == "2d vs one 1-D TP group of all GPUs (no SP, blocking)"


def test_results_md_names_the_model_in_words_and_calls_a_lower_bound_one(tmp_path):
    """A max-sequence ratio measured while METP fitted every probe up to the search limit is a lower bound, not
    "not measured"; ``--set n_head=12`` reads ``gpt2-tiny (n_head=12)``, not a Python dict."""
    probe = {"batch": 1, "cap_bytes": 2 * 2**20, "probes": [], "status": "ok", "p": 2}
    results = {"command": "tp2d-bench --quick", "machine": {"summary": "2 cores"}, "date": "today",
               "spec": {"model": "gpt2-tiny", "overrides": {"n_head": 12}, "dtype": "float32", "device": "cpu"},
               "max_seq": [{**probe, "layout": "metp", "max_seq": 512, "capped_by_limit": True},
                           {**probe, "layout": "tp1d", "max_seq": 256, "capped_by_limit": False}]}
    results["targets"] = report.evaluate_targets(results)
    (target,) = [t for t in results["targets"] if t["key"] == "max_seq_metp_vs_tp1d"]
    assert target["value"] == 2.0 and target["met"] is None and target["bound"] == "lower"
    md = report.markdown(results)
    (row,) = [line for line in md.splitlines() if line.startswith("| METP max sequence")]
    assert "| 2 | >= 2.38 | lower bound: at least 2, the search stopped at its limit" in row
    assert "not measured" not in row
    assert "Model `gpt2-tiny` (n_head=12), float32" in md and "{'n_head'" not in md
    # a target this run did not measure still says so
    (row,) = [line for line in md.splitlines() if line.startswith("| plain GPT2 tokens/s")]
    assert "| not measured |" in row


LLAMA = BenchSpec(model="llama-tiny", batch=2, steps=1, warmup=0)


def test_context_parallel_scenarios_take_a_llama_and_refuse_the_rest_with_the_numbers():
    from lightning_tp2d.bench.runner import check_scenario

    for layout, p in (("cp", 2), ("cp", 4), ("cp-tp", 4), ("cp-tp", 8)):
        assert check_scenario(layout, p, LLAMA, 1, 64) is None, (layout, p)
    gpt2 = check_scenario("cp", 4, BenchSpec(), 1, 64)
    assert "runs the package's Llama only (model 'gpt2-tiny' is a GPT2)" in gpt2 and "wpe(arange(T))" in gpt2
    assert "sequence length 60 is not divisible by 2p = 8" in check_scenario("cp", 4, LLAMA, 1, 60)
    assert "2p = 4 (CP ranks 2)" in check_scenario("cp-tp", 4, LLAMA, 1, 62)  # CP over 4 / 2 ranks
    assert "needs p >= 4 (2 CP x 2 TP ranks), got p=2" in check_scenario("cp-tp", 2, LLAMA, 1, 64)
    assert "needs p a multiple of 4" in check_scenario("cp-tp", 6, replace(LLAMA, cp_tp_size=4), 1, 64)
    # TP over 4 of the 6 key/value heads of llama-tiny (12 query, 6 key/value)
    assert "n_kv_head=6 is not divisible by p=4" in check_scenario("cp-tp", 8, replace(LLAMA, cp_tp_size=4), 1, 64)
    assert "eager float32" in check_scenario("cp", 4, replace(LLAMA, dtype="bfloat16"), 1, 64)
    assert "dropout=0.1" in check_scenario("cp", 4, replace(LLAMA, overrides={"dropout": 0.1}), 1, 64)


def test_context_parallel_scenario_starts_from_the_single_device_loss_and_counts_what_it_sends():
    """``cp`` on 2 ranks (torch's ring, FSDP2 over the same 2): the global mean loss of the plain model; every rank
    sends at least its half of the weights once (all-gathers) and half of the gradients (reduce-scatters), and the
    ring's dK/dV permutes show as ``all_to_all_single``."""
    from lightning_tp2d.models import Llama

    single, ring = run_scenario("single", 1, LLAMA), run_scenario("cp", 2, LLAMA)
    assert ring["status"] == "ok", ring
    assert ring["loss"] == pytest.approx(single["loss"], rel=1e-5)
    params = sum(p.numel() for p in Llama(LLAMA.config()).parameters())
    assert ring["sent_bytes"] >= 4 * params  # float32: (1/2 + 1/2) x 4 bytes per parameter at p = 2
    assert ring["sent_bytes_per_token"] == ring["sent_bytes"] / (LLAMA.batch * LLAMA.seq)
    assert all(r["comm"]["all_to_all_single"]["calls"] > 0 for r in ring["ranks"])
    assert ring["peak_bytes"] > ring["resident_bytes"] > 0 and ring["step_time_s"] > 0


def test_max_sequence_section_reports_the_p8_long_context_targets_and_plots_every_probe(monkeypatch, tmp_path):
    """METP against cp and 1-D TP + SP at p = 8, same cap: the ratios of the longest sequences; the table gives
    each answer's peak and bytes sent per token; the figure has one curve per search, its fitted probes."""
    def search(layout, max_seq, fitted):
        probes = [{"seq": q, "status": "ok", "peak_bytes": q * 2**14, "sent_bytes_per_token": 1000.0}
                  for q in fitted] + [{"seq": 2 * max_seq, "status": "oom", "peak_bytes": None}]
        return {"layout": layout, "p": 8, "batch": 1, "cap_bytes": 2**26, "status": "ok", "max_seq": max_seq,
                "capped_by_limit": False, "peak_bytes": max_seq * 2**14, "sent_bytes_per_token": 1000.0,
                "probes": probes}

    results = {"command": "tp2d-bench", "machine": {"summary": "m"}, "date": "d",
               "spec": {"model": "llama-tiny", "overrides": {}, "dtype": "float32", "device": "cpu"},
               "max_seq": [search("metp", 4096, [512, 1024, 2048, 4096]), search("cp", 2048, [512, 1024, 2048]),
                           search("tp1d-sp", 1024, [512, 1024])]}
    targets = {t["key"]: t for t in report.evaluate_targets(results)}
    assert targets["max_seq_metp_vs_cp_p8"]["value"] == 2.0 and targets["max_seq_metp_vs_cp_p8"]["met"] is True
    assert targets["max_seq_metp_vs_tp1d_sp_p8"]["value"] == 4.0 and targets["max_seq_metp_vs_tp1d_sp_p8"]["met"]
    results["targets"] = list(targets.values())
    (row,) = [line for line in report.markdown(results).splitlines() if line.startswith("| cp | 8 |")]
    assert row.startswith("| cp | 8 | 1 | 64.00 | 2048 | 32.00 | 1000 | 4 |")
    saved = {}
    monkeypatch.setattr(report, "_save", lambda fig, out_dir, name: saved.setdefault(name, fig) and name)
    assert report.plots(results, str(tmp_path)) == ["max_seq_probes.png"]
    curves = {line.get_label(): list(line.get_xdata()) for line in saved["max_seq_probes.png"].axes[0].get_lines()
              if not line.get_label().startswith("_")}
    assert curves == {"metp (p=8): 4096": [512, 1024, 2048, 4096], "cp (p=8): 2048": [512, 1024, 2048],
                      "tp1d-sp (p=8): 1024": [512, 1024]}


def test_a_cap_passed_inside_dtensor_dispatch_ends_the_probe_as_out_of_memory():
    """DTensor re-raises what an op raised during its sharding propagation as a ``RuntimeError`` caused by it: the
    probe of a DTensor baseline (tp1d-sp, cp-tp) that passes the cap there is an OOM, not an error."""
    from lightning_tp2d.planning.live import MemoryCapExceeded
    from lightning_tp2d.bench.procs import _oom_in

    cap = MemoryCapExceeded("tracked memory 36170752 bytes exceeds the cap of 33554432 bytes")
    try:
        try:
            raise cap
        except MemoryCapExceeded as e:
            raise RuntimeError("Sharding propagation failed for aten.mm.default") from e
    except RuntimeError as wrapped:
        assert _oom_in(wrapped) is cap
    assert _oom_in(RuntimeError("a real error")) is None
