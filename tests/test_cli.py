"""The ``tp2d`` LightningCLI entry point: the recipe YAML parses, and ``tp2d fit`` trains on 4 CPU processes."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_tp2d.cli import main

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tp2d_cli.yaml"


def test_console_script_points_at_the_cli():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["tp2d"] == "lightning_tp2d.cli:main"


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
def test_recipe_config_resolves_every_key(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(RECIPE), "--print_config"])
    assert exit_.value.code == 0
    printed = capsys.readouterr().out
    assert "class_path: lightning_tp2d.TP2DStrategy" in printed and "layout: 2d" in printed
    assert "model: gpt2-tiny" in printed and "tokenizer: byte" in printed


def test_tp2d_fit_with_yaml_config_trains_on_4_processes(tmp_path):
    """Lightning starts ranks 1-3 by re-running the command; the sharded checkpoint has one file per rank."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "lightning_tp2d.cli", "fit", "--config", str(RECIPE), "--trainer.strategy=tp2d",
           "--trainer.max_steps=6", "--trainer.val_check_interval=3", "--trainer.log_every_n_steps=1",
           f"--trainer.default_root_dir={tmp_path}", "--data.max_tokens=20000",
           # pin the CSV logger: with tensorboard installed, Lightning's default logger would not write metrics.csv
           "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.save_dir={tmp_path}"]
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    version = tmp_path / "lightning_logs" / "version_0"
    rows = list(csv.DictReader(open(version / "metrics.csv")))
    train = [float(r["train_loss"]) for r in rows if r["train_loss"]]
    val = [float(r["val_perplexity"]) for r in rows if r["val_perplexity"]]
    assert len(train) == 6 and train[-1] < train[0] and len(val) == 2 and val[1] < val[0] < 257
    (checkpoint,) = (version / "checkpoints").iterdir()
    assert checkpoint.name == "epoch=0-step=6.ckpt"
    assert sorted(p.name for p in checkpoint.iterdir() if p.suffix == ".distcp") == [f"__{r}_0.distcp" for r in range(4)]


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
def test_the_console_script_exits_0_after_a_successful_run(tmp_path, capsys):
    """The console-script wrapper does ``sys.exit(main())``: ``main`` must return nothing (it returned the CLI
    object, which printed it and exited 1 on every rank)."""
    from lightning_tp2d.cli import cli

    args = ["fit", "--model.model=gpt2-tiny", "--data.max_tokens=2000", "--data.block_size=16", "--data.batch_size=2",
            "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.fast_dev_run=1", "--trainer.logger=false",
            f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false"]
    assert main(args) is None
    assert cli(args).trainer.state.finished  # the CLI object stays reachable for scripts
