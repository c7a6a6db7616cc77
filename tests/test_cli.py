"""The ``tp2d`` LightningCLI entry point: the recipe YAML parses, and ``tp2d fit`` trains on 4 CPU processes."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_tp2d.cli import main

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tp2d_cli.yaml"
# Lightning's known-harmless warnings and tips that lightning_tp2d.quiet silences
NOISE = re.compile(r"LeafSpec|You have overridden `on_before_batch_transfer`|💡 Tip")


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


def test_tp2d_fit_with_yaml_config_trains_on_4_processes_shows_the_loss_and_saves_the_final_step(tmp_path):
    """Lightning starts ranks 1-3 by re-running the command; the sharded checkpoint has one file per rank. The run
    ends one step after its last validation (step 6): the final step 7 is still saved (Lightning's default
    checkpoint saved only after validation), the progress bar shows train_loss, and Lightning's known-harmless
    warnings and tips (lightning_tp2d.quiet) are not printed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "lightning_tp2d.cli", "fit", "--config", str(RECIPE), "--trainer.strategy=tp2d",
           "--trainer.max_steps=7", "--trainer.val_check_interval=3", "--trainer.log_every_n_steps=1",
           f"--trainer.default_root_dir={tmp_path}", "--data.max_tokens=20000",
           # pin the CSV logger: with tensorboard installed, Lightning's default logger would not write metrics.csv
           "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.save_dir={tmp_path}"]
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    version = tmp_path / "lightning_logs" / "version_0"
    rows = list(csv.DictReader(open(version / "metrics.csv")))
    train = [float(r["train_loss"]) for r in rows if r["train_loss"]]
    val = [float(r["val_perplexity"]) for r in rows if r["val_perplexity"]]
    assert len(train) == 7 and train[-1] < train[0] and len(val) == 2 and val[1] < val[0] < 257
    (checkpoint,) = (version / "checkpoints").iterdir()  # the newest only (save_top_k=1): step 6's was replaced
    assert checkpoint.name == "epoch=0-step=7.ckpt"
    output = run.stdout + run.stderr
    # rank 0's progress bar: Lightning's rich bar ("train_loss: 4.717") where rich is installed, else tqdm's ("=")
    shown = [float(v) for v in re.findall(r"train_loss[:=] ?(\d+(?:\.\d+)?)", output)]
    assert shown and shown[-1] == pytest.approx(train[-1], abs=6e-3)
    assert [line for line in output.splitlines() if NOISE.search(line)] == []
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


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
def test_the_default_checkpoint_saves_the_final_step_and_yields_to_a_listed_or_disabled_one(tmp_path):
    """A run that ends before its first validation (step 3 of 5): Lightning's default checkpoint saves nothing then
    (it waits for validation), tp2d's StepCheckpoint saves step 3. A listed ModelCheckpoint is used instead;
    checkpointing off means none."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_tp2d.callbacks import StepCheckpoint
    from lightning_tp2d.cli import cli

    base = ["fit", "--model.model=gpt2-tiny", "--data.max_tokens=2000", "--data.block_size=16", "--data.batch_size=2",
            "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.logger=false", "--trainer.max_steps=3",
            "--trainer.val_check_interval=5", "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false"]
    run = cli([*base, f"--trainer.default_root_dir={tmp_path / 'default'}"])
    (checkpoint,) = [c for c in run.trainer.callbacks if isinstance(c, ModelCheckpoint)]
    assert type(checkpoint) is StepCheckpoint
    assert sorted(p.name for p in (tmp_path / "default" / "checkpoints").iterdir()) == ["epoch=0-step=3.ckpt"]

    listed = cli([*base, f"--trainer.default_root_dir={tmp_path / 'listed'}", "--trainer.max_steps=1",
                  "--trainer.callbacks=lightning.pytorch.callbacks.ModelCheckpoint",
                  "--trainer.callbacks.filename=mine"])
    assert [type(c) for c in listed.trainer.callbacks if isinstance(c, ModelCheckpoint)] == [ModelCheckpoint]
    off = cli([*base, f"--trainer.default_root_dir={tmp_path / 'off'}", "--trainer.max_steps=1",
               "--trainer.enable_checkpointing=false"])
    assert [c for c in off.trainer.callbacks if isinstance(c, ModelCheckpoint)] == []
    assert not (tmp_path / "off" / "checkpoints").exists()


def test_silence_known_noise_drops_exactly_lightnings_known_messages():
    """Each filter matches one message of one library module: the same text from elsewhere, or another message
    of the same module, still shows."""
    import logging
    import warnings

    from lightning_tp2d import quiet
    from lightning_tp2d.quiet import silence_known_noise

    leaf = "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and ...` instead."
    hook = ("You have overridden `on_before_batch_transfer` in `LightningModule` but have passed in a "
            "`LightningDataModule`. It will use the implementation from `LightningModule` instance.")
    cases = [(leaf, FutureWarning, "lightning.pytorch.utilities._pytree", False),
             (hook, UserWarning, "lightning.pytorch.trainer.connectors.data_connector", False),
             (leaf, FutureWarning, "my_code", True),  # the user's own use of LeafSpec: still warned
             ("some other warning", UserWarning, "lightning.pytorch.trainer.connectors.data_connector", True)]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        silence_known_noise()
        silence_known_noise()  # idempotent
        for message, category, module, _ in cases:
            warnings.warn_explicit(message, category, f"{module}.py", 1, module=module)
    assert [str(w.message) for w in seen] == [m for m, _, _, shown in cases if shown]

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logger.addHandler(handler)
    try:
        logger.warning("💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]")
        logger.warning("GPU available: False, used: False")
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["GPU available: False, used: False"]
    assert [f for f in logger.filters if f is quiet._not_a_tip] == [quiet._not_a_tip]  # one copy, however often
