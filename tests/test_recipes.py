"""Recipes: every experiment config composes (``tp2d-train experiment=<name> --cfg job``), every ``tp2d-train``
command that the READMEs, CONTRIBUTING.md, docs/, the recipe scripts and the experiment headers name composes with
its overrides, every ``recipes/`` file they name exists, and the single-machine torchrun recipe trains on 4 CPU
processes; the ZeRO benchmark's measurements hold on 4."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra.core.global_hydra import GlobalHydra

from lightning_tp2d import train
from lightning_tp2d.bench.procs import run_ranks
from lightning_tp2d.models import GPT2, GPT2Config

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "recipes" / "README.md", ROOT / "conf" / "README.md",
        *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "recipes").glob("*.sh")),
        *sorted((ROOT / "recipes").glob("*.sbatch")),
        *sorted((ROOT / "conf").rglob("*.yaml"))]
# a command, and what follows it up to the end of the line, a code span, a table cell or a comment
HEAD = r"tp2d-train|-m lightning_tp2d\.train|bash recipes/[\w./]+|sbatch recipes/[\w./]+"
COMMAND = re.compile(rf"({HEAD})((?:(?!{HEAD})[^`\n|#;])*)")
OVERRIDE = re.compile(r"^[+~]{0,2}[\w./@-]+=\S*$")
PLACEHOLDER = re.compile(r"[<>$\[\]]|\.\.\.")
LIST_CHOICE = re.compile(r"^[\w.]+=\[[\w,]+\]$")  # options of a group listed together: callbacks=[default,x]


def cfg_job(args: list[str], capsys, monkeypatch) -> dict:
    """``tp2d-train <args> --cfg job --resolve`` in this process (the console script's own code path)."""
    GlobalHydra.instance().clear()
    monkeypatch.setattr(sys, "argv", ["tp2d-train", *args, "--cfg", "job", "--resolve"])
    train.main()
    GlobalHydra.instance().clear()
    return yaml.safe_load(capsys.readouterr().out)


def documented_commands() -> list[tuple[str, list[str]]]:
    """``(where, overrides)`` for every tp2d-train command (direct, or through a recipe script) in the docs."""
    found = []
    for doc in DOCS:
        if not doc.exists():
            continue
        for line in doc.read_text().splitlines():
            for head, tail in COMMAND.findall(line):
                tokens = []
                for token in tail.split():
                    token = token.strip(",.'\"")
                    if (PLACEHOLDER.search(token) and not LIST_CHOICE.match(token)) or not token:
                        continue
                    if not OVERRIDE.match(token):
                        break  # prose after the command
                    tokens.append(token)
                script = ROOT / head.split()[-1] if head.startswith(("bash", "sbatch")) else None
                if script is not None and "tp2d-train" not in script.read_text():
                    continue  # a script of another command (the benchmarks)
                if script is not None and "trainer=multinode" in script.read_text():
                    tokens.insert(0, "trainer=multinode")  # what the script adds
                found.append((f"{doc.relative_to(ROOT)}: {head} {' '.join(tokens)}".strip(), tokens))
    return found


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_config_composes(name, capsys, monkeypatch):
    cfg = cfg_job([f"experiment={name}"], capsys, monkeypatch)
    assert cfg["trainer"]["max_steps"] > 0 and cfg["data"]["block_size"] <= cfg["model"]["block_size"]
    header = (ROOT / "conf" / "experiment" / f"{name}.yaml").read_text()
    assert f"experiment={name}" in header and "Shows:" in header  # the exact command and what it should show
    assert name in (ROOT / "recipes" / "README.md").read_text()  # indexed


def test_paper_setups_have_the_sizes_they_claim(capsys, monkeypatch):
    tp2d = cfg_job(["experiment=tp2d_4gpu"], capsys, monkeypatch)
    assert tp2d["trainer"]["devices"] == 4 and tp2d["parallel"]["layout"] == "2d"
    assert tp2d["trainer"]["precision"] == "bf16-mixed" and tp2d["model"]["n_embd"] == 1024
    work = {}
    for q, name in ((1, "weak_scaling_1gpu"), (2, "weak_scaling_4gpu"), (4, "weak_scaling_16gpu")):
        cfg = cfg_job([f"experiment={name}"], capsys, monkeypatch)
        h, batch = cfg["model"]["n_embd"], cfg["data"]["batch_size"]
        work[q] = (h * h // (q * q), batch * h // (q * q), cfg["model"]["n_head"] // q)  # weights, activations, heads
    assert work[1] == work[2] == work[4]  # the same work per GPU: weak scaling
    metp = cfg_job(["experiment=metp_max_seq_8gpu"], capsys, monkeypatch)
    assert metp["parallel"]["layout"] == "metp" and metp["trainer"]["devices"] == 8
    assert metp["data"]["block_size"] == metp["model"]["block_size"] == 32768 and metp["model"]["n_head"] % 8 == 0


def test_every_documented_command_composes(capsys, monkeypatch):
    commands = documented_commands()
    assert len(commands) >= 15
    places: dict[tuple[str, ...], list[str]] = {}  # the same overrides written in several places compose once
    for where, overrides in commands:
        places.setdefault(tuple(overrides), []).append(where)
    for overrides, wheres in places.items():
        try:
            cfg_job(list(overrides), capsys, monkeypatch)
        except SystemExit as err:
            pytest.fail(f"{'; '.join(wheres)}: exit {err.code}\n{capsys.readouterr().err}")


def test_every_recipe_file_the_docs_name_exists():
    named = set()
    for doc in DOCS:
        if doc.exists():
            named |= set(re.findall(r"recipes/([\w.-]+\.(?:py|sh|sbatch|yaml|json))", doc.read_text()))
    assert named >= {"single_node_torchrun.sh", "multi_node_torchrun.sh", "slurm.sbatch"}
    assert [n for n in sorted(named) if not (ROOT / "recipes" / n).exists()
            and not (ROOT / "recipes" / "results" / n).exists()] == []
    index = (ROOT / "recipes" / "README.md").read_text()
    assert [p.name for p in sorted((ROOT / "recipes").iterdir()) if p.is_file() and p.name != "README.md"
            and p.name not in index] == []


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not installed")
def test_single_node_torchrun_recipe_trains_on_4_cpu_processes(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TP2D_RUN_DIR")}
    env.update(NPROC="4", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    args = ["experiment=quick", "trainer.max_steps=4", "trainer.val_check_interval=2", "data.max_tokens=20000",
            "sample.max_new_tokens=8"]
    run = subprocess.run(["bash", str(ROOT / "recipes" / "single_node_torchrun.sh"), *args], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    (run_dir,) = tmp_path.glob("outputs/*/*")  # rank 0's folder; ranks 1-3 (torchrun's) made none
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]
    with open(run_dir / "logs" / "metrics.csv", newline="") as f:
        train_loss = [float(r["train_loss"]) for r in csv.DictReader(f) if r["train_loss"]]
    assert train_loss[0] == pytest.approx(5.5365, abs=2e-3) and train_loss[-1] < train_loss[0]
    shards = sorted(p.name for p in (run_dir / "checkpoints" / "step=4.ckpt").glob("*.distcp"))
    assert shards == [f"__{r}_0.distcp" for r in range(4)]


def _zero_stages_recipe():
    spec = importlib.util.spec_from_file_location("zero_stages", ROOT / "recipes" / "benchmarks" / "zero_stages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_zero_stages_recipe_measures_what_each_stage_shards_and_sends(monkeypatch):
    """The ZeRO benchmark's step on gpt2-tiny, ring of 2 x dp 2 (4 processes): stage 1 halves the optimizer state
    and stages 2-3 the parameters and gradients too, all with stage 0's weights after the steps; the dispatch-level
    collective count equals ``count_comm``'s where only the package communicates (stages 0-1) and grows by FSDP's
    all-gather (stage 2) and its second one in the backward (stage 3); the peak covers what the rank holds."""
    recipe = _zero_stages_recipe()
    monkeypatch.setitem(recipe.MODELS, "tiny", lambda: (GPT2, GPT2Config.from_name("gpt2-tiny", dropout=0.0)))
    result = run_ranks(recipe._stages_worker, 4, "tiny", "metp", 2, 2, 16, timeout=600)  # forked: sees "tiny"
    assert result.ok, result.reason
    for got in result.values:
        s0, s1, s2, s3 = (got[s] for s in recipe.STAGES)
        assert s1["optimizer_bytes"] <= 0.52 * s0["optimizer_bytes"] and s1["parameter_bytes"] == s0["parameter_bytes"]
        for s in (s2, s3):
            assert s["parameter_bytes"] <= 0.52 * s0["parameter_bytes"]
            assert s["gradient_bytes"] <= 0.52 * s0["gradient_bytes"]
            assert s["optimizer_bytes"] <= 0.52 * s0["optimizer_bytes"]
        assert s1["max_param_diff"] == 0.0 and max(s2["max_param_diff"], s3["max_param_diff"]) <= 1e-6
        assert s0["sent_bytes_all"] == s0["sent_bytes_package"] and s1["sent_bytes_all"] == s1["sent_bytes_package"]
        assert s0["sent_bytes_all"] < s2["sent_bytes_all"] < s3["sent_bytes_all"]
        for s in (s0, s1, s2, s3):
            assert s["peak_bytes"] >= s["parameter_bytes"] + s["gradient_bytes"] + s["optimizer_bytes"]


def test_scale_recipe_writes_the_tables_and_the_calibration(tmp_path):
    """``recipes/benchmarks/scale.py --tiny``: the same tables on llama-tiny (the real run takes an hour); the
    calibration rows price torchtitan's configurations and reproduce the fitted GPT-2 step exactly."""
    spec = importlib.util.spec_from_file_location("scale", ROOT / "recipes" / "benchmarks" / "scale.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    assert recipe.main(["--tiny", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    (scenario,) = results["scenarios"]
    assert scenario["status"] == "ok" and scenario["best_package"]["layout"] == "2d"
    assert scenario["best_baseline"]["baseline"] and scenario["package_over_baseline"] > 0
    big = results["largest_model"]
    assert big["package"]["n_layer"] > 0 and big["baseline"]["n_layer"] > 0
    ratios = {c["configuration"]: c["ratio"] for c in results["calibration"]}
    assert len(ratios) == len(recipe.TORCHTITAN) + 2
    assert [r for name, r in ratios.items() if "fitted" in name] == [pytest.approx(1.0)] * 2
    assert all(0.5 < r < 2.0 for r in ratios.values())
    text = (tmp_path / "results.md").read_text()
    assert "package / baseline" in text and "Calibration" in text and "Float8" in text


def test_gpu_rates_recipe_measures_every_table_and_the_planner_prices_with_it(tmp_path, capsys):
    """``recipes/gpu_rates.py --smoke`` (CPU, toy sizes; on a GPU it measures bf16 at the planner's shapes): GEMMs,
    causal SDPA, the METP ring's two block kinds on the package's kernel and the copy bandwidth, each rate positive
    and consistent with its time; :func:`~lightning_tp2d.planning.cost_model.with_measured_rates` takes the fit, the
    attention rate and the bandwidth from it, and ``tp2d-plan --rates`` plans with them (a table that is not one is
    refused in one line)."""
    from lightning_tp2d.planning import cost_model, gemm_rates, planner

    spec = importlib.util.spec_from_file_location("gpu_rates", ROOT / "recipes" / "gpu_rates.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    out = tmp_path / "rates.json"
    assert recipe.main(["--smoke", "--out", str(out)]) == 0
    rates = json.loads(out.read_text())
    for r in rates["gemm"]:
        assert r["flops_per_s"] == pytest.approx(2 * r["m"] * r["k"] * r["n"] / r["seconds"])
    assert [r["seq"] for r in rates["sdpa"]] == [64, 128]  # (toy sizes on a busy CPU: times, not their order)
    assert all(r["step_s"] > 0 and r["forward_s"] > 0 for r in rates["sdpa"])
    assert {(r["block"], r["kernel"]) for r in rates["ring"]} == {("diagonal", "flash_cpu"), ("half", "flash_cpu")}
    assert rates["bandwidth"]["bytes_per_s"] > 0 and (tmp_path / "rates.md").is_file()
    hw = cost_model.with_measured_rates(cost_model.H100_NVLINK4_NDR, rates)
    points = [gemm_rates.GemmPoint(r["m"], r["k"], r["n"], r["flops_per_s"]) for r in rates["gemm"]]
    assert (hw.matmul_flops_per_s, hw.gemm_overhead_s) == gemm_rates.fit(points)
    assert hw.attention_flops_per_s == rates["summary"]["attention_flops_per_s"] == rates["sdpa"][-1]["step_flops_per_s"]
    assert hw.hbm_bytes_per_s == rates["bandwidth"]["bytes_per_s"] and hw.intra == cost_model.H100_NVLINK4_NDR.intra
    float8 = [gemm_rates.GemmPoint(r["m"], r["k"], r["n"], r["flops_per_s"]) for r in rates.get("float8_gemm", ())
              if "flops_per_s" in r]
    if len({p.flops for p in float8 if p.aligned}) >= 2:  # the float8 speedup: measured where float8 GEMMs ran
        assert hw.float8_gemm_speedup == pytest.approx(gemm_rates.fit(float8)[0] / hw.matmul_flops_per_s)
    else:
        assert hw.float8_gemm_speedup == cost_model.H100_NVLINK4_NDR.float8_gemm_speedup
    plan = tmp_path / "plan.json"
    args = ["llama-tiny", "--gpus", "4", "--gpus-per-node", "4", "--gpu-memory-gib", "0.05", "--seq", "48",
            "--global-batch-tokens", "768", "--layouts", "2d", "--no-baselines", "--zero-stages", "0",
            "--checkpointing", "none", "--max-micro-batch", "4"]
    assert planner.main([*args, "--rates", str(out), "--json", str(plan)]) == 0
    assert json.loads(plan.read_text())["hardware"].endswith(f"rates measured on {rates['device']}")
    (tmp_path / "bad.json").write_text('{"gemm": []}')
    assert planner.main([*args, "--rates", str(tmp_path / "bad.json"), "--json", ""]) == 2
    assert "not a rate table of recipes/gpu_rates.py" in capsys.readouterr().err
