"""``tp2d-train`` (also ``python -m lightning_tp2d.train``): train GPT-2 or Llama (``model=llama-tiny`` ...) with
tensor parallelism from the command line.

With no arguments it trains ``gpt2`` (124M) on every GPU of the machine (NCCL, bf16-mixed), or ``gpt2-mini`` on 4
CPU processes (gloo, one 2x2 grid of the "2d" layout), on the Python documentation with the byte tokenizer. A run
leaves in ``outputs/<date>/<time>/``: ``logs/metrics.csv`` (train_loss, val_loss, val_perplexity, speed),
``logs/loss.png``, ``logs/tensorboard/`` (when tensorboard is installed), ``checkpoints/`` (``last.ckpt`` links the
newest), ``sample.txt`` (the generated text, also printed), Hydra's ``.hydra/`` and ``train.log``. A run resumed
with ``ckpt_path=<run dir>/checkpoints/last.ckpt`` continues in that run directory (and its metrics.csv).

The configuration is ``conf/`` (groups model, parallel, trainer, data, callbacks, logger, experiment; every key
commented; objects built from ``_target_``). Before any process starts, :func:`check_config` turns configurations
that cannot run into one message naming the numbers and a choice that fits, and the callbacks and loggers are built
(a missing package, a ``+callbacks.<name>`` entry without a class, are errors then); each error is one line on
stderr and exit code 2. How the processes of a job share one run directory, and how sweeps run, is
:mod:`lightning_tp2d.launch`.

``module.init_from=DIR`` alone fine-tunes a local transformers directory: without a ``model=`` choice the model is
``DIR/config.json``'s (:func:`model_from_init`), the tokenizer ``DIR/tokenizer.json`` when it has one (the data
groups' ``${tp2d.tokenizer:...}``), and ``export_hf=<dir>`` writes the result back to transformers after training.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ProgressBar
# Lightning loads here, before Hydra sets up logging (`import lightning_tp2d` does not import it): loaded under
# Hydra's root handler, Lightning would print each of its messages twice, in its format and in Hydra's
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import MissingMandatoryValue

from lightning_tp2d import launch
from lightning_tp2d.callbacks import GracefulInterrupt
from lightning_tp2d.checkpoint import saved_step
from lightning_tp2d.core import AUTO_LAYOUT
from lightning_tp2d.data import (check_format, check_path, get_tokenizer, is_token_file, text_suffixes,
                                 tokenizer_vocab_size)
from lightning_tp2d.errors import CheckpointError, CommError, DivergenceError
from lightning_tp2d.export import read_hf_config
from lightning_tp2d.families import family_of_config
from lightning_tp2d.layouts import STRATEGY_NAMES, get_layout
from lightning_tp2d.models.config import max_seq_len
from lightning_tp2d.parallelize import offloaded_checkpointing
from lightning_tp2d.param_memory import parameter_bytes, parameter_count, parameter_memory_problem, physical_memory
from lightning_tp2d.quiet import silence_known_noise
from lightning_tp2d.run_outputs import export_transformers, given_run_dir_problem, outputs_problem
from lightning_tp2d.run_values import check_run_values
from lightning_tp2d.safe_files import clear, resolve, staging_path
from lightning_tp2d.sizes import CONFIG_KEYS, resolve_sizes, stage_devices
from lightning_tp2d.supervise import RankWatch, wait_to_be_ended
from lightning_tp2d.train_plan import pipeline_problem, reshards_after_forward
from lightning_tp2d.zero import ZERO_STAGES

log = logging.getLogger("tp2d-train")
TOKENIZER_IDS = {"byte": 257, "gpt2": 50257}  # ids each tokenizer of TextDataModule produces


class ConfigError(ValueError):
    """A configuration that cannot run, reported as one message before any process starts."""


def main() -> None:
    """The console script: rank-aware Hydra arguments, a check of the override keys, then the Hydra job."""
    if not launch.CONF_DIR.is_dir():
        raise SystemExit(f"tp2d-train: the configs are missing: neither a source checkout's {launch.SOURCE_CONF_DIR} "
                         f"nor the installed copy {launch.PACKAGE_CONF_DIR} exists; reinstall the package "
                         "(`pip install .`, or `pip install -e .` in a source checkout)")
    launch.survive_closed_output()  # `tp2d-train | tee run.log`: Ctrl-C ends tee too, and the step must still be saved
    launch.register_resolvers()
    sys.argv = launch.prepare_argv(sys.argv)
    if launch.started_by_this_job():
        launch.watch_parent()
    if launch.is_rank_zero():
        launch.check_master_port()
        launch.check_override_keys(sys.argv)
        check_given_run_dir(sys.argv[1:])  # before Hydra writes .hydra/ and train.log into it
        launch.pin_resume_run_dir(sys.argv[1:])  # a resumed run continues in its checkpoint's run directory
    _hydra_main()


def run(cfg: DictConfig) -> float | None:
    """The Hydra task: one training job; returns the last validation loss (for sweepers)."""
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    if multirun and hc.runtime.choices.get("hydra/launcher") != "basic":
        raise SystemExit("tp2d-train: --multirun needs Hydra's basic launcher (jobs one after the other): each job "
                         "starts its own processes on all devices, so jobs cannot run side by side")
    run_dir = Path(hc.runtime.output_dir)
    ranks = RankWatch()  # the ranks this process starts, if any (lightning_tp2d.supervise)
    with launch.job_environment(run_dir, list(hc.overrides.task), multirun):
        try:
            with ranks.ended_on_failure():  # a rank that fails: one line naming it, every rank ended, exit 1
                return train(cfg, run_dir, ranks)
        except ConfigError as err:
            print(f"tp2d-train: error: {err}", file=sys.stderr)
            if launch.is_rank_zero():
                launch.remove_unused_run_dir(run_dir)
            sys.exit(2)
        except (DivergenceError, CommError, CheckpointError) as err:  # one line, not a traceback per rank
            if isinstance(err, CommError) and launch.started_by_this_job():
                wait_to_be_ended()  # the process that started this rank names the failure once and ends the job
            if isinstance(err, CommError) or launch.is_rank_zero():  # (otherwise every rank names its own call)
                print(f"tp2d-train: error: {err}", file=sys.stderr, flush=True)
            sys.exit(1)


_hydra_main = hydra.main(version_base="1.3", config_path=str(launch.CONF_DIR), config_name="config")(run)


# ---- the job -----------------------------------------------------------------------------------------------------


def train(cfg: DictConfig, run_dir: Path, ranks: RankWatch | None = None) -> float | None:
    ranks = ranks or RankWatch()
    started = time.monotonic()
    rank_zero = launch.is_rank_zero()
    model_from_init(cfg)  # module.init_from without a model= choice: the model is its config.json's
    try:
        model_config = instantiate(cfg.model)
    except Exception as err:  # noqa: BLE001 - GPT2Config's ValueError, wrapped by Hydra
        raise ConfigError(f"model: {err.__cause__ or err}") from err
    plan = check_config(cfg, model_config)
    finished = finished_note(cfg)
    if finished:  # before any process starts: a resume with nothing to train says so and ends (exit 0)
        if rank_zero:
            log.info("%s", finished)
            launch.remove_unused_run_dir(run_dir)  # a new run directory it made (a resumed run's own stays)
        return None
    loggers = make_loggers(cfg.get("logger"), run_dir)  # before any process starts: a missing package is a ConfigError
    callbacks, interrupt, checkpoint = make_callbacks(cfg, run_dir)
    if rank_zero:
        log.info("tp2d-train: %s", plan)
        notice = float8_notice_line(cfg.parallel)  # the CPU emulates float8 GEMMs: one line says so
        if notice:
            log.info("tp2d-train: %s", notice)
        log.info("%s", resume_note(cfg.ckpt_path, run_dir) or f"run directory: {run_dir}")

    steps, every = int(cfg.trainer.max_steps), int(cfg.trainer.log_every_n_steps)
    if 0 < steps < every:  # a run shorter than the logging interval would log nothing: no metrics.csv, no plot
        with open_dict(cfg):
            cfg.trainer.log_every_n_steps = steps
        if rank_zero:
            log.info("trainer.max_steps=%d < trainer.log_every_n_steps=%d: logging every %d steps", steps, every, steps)

    silence_known_noise()  # Lightning's own LeafSpec deprecation and tips, once per rank (lightning_tp2d.quiet)
    if continues_run(cfg.ckpt_path, run_dir):  # of course the checkpoints/ it resumes from is not empty
        warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
    L.seed_everything(cfg.seed, verbose=False)
    try:  # plain values (data.suffixes a list, not Hydra's ListConfig): a checkpoint records them as data
        datamodule = instantiate(cfg.data, _convert_="all")
    except Exception as err:  # noqa: BLE001 - a TextDataModule argument it refuses, wrapped by Hydra
        raise ConfigError(f"data: {err.__cause__ or err}") from err
    try:
        module = instantiate(cfg.module)
    except Exception as err:  # noqa: BLE001 - a CausalLMModule argument it refuses, wrapped by Hydra
        raise ConfigError(f"module: {err.__cause__ or err}") from err
    # no ModelCheckpoint listed (callbacks=none, callbacks.model_checkpoint=null): none of Lightning's either
    extra = {} if checkpoint is not None or "enable_checkpointing" in cfg.trainer else {"enable_checkpointing": False}
    try:  # (the strategy's own checks; the ranks start in trainer.fit)
        strategy = instantiate(cfg.parallel, **strategy_overrides(cfg.parallel))
    except Exception as err:  # noqa: BLE001 - a TP2DStrategy argument it refuses, wrapped by Hydra
        raise ConfigError(f"parallel: {err.__cause__ or err}") from err
    trainer = instantiate(cfg.trainer, strategy=strategy, logger=loggers or False, callbacks=callbacks,
                          default_root_dir=str(run_dir), **extra)
    ranks.take_over(trainer.strategy.launcher)  # the ranks Lightning starts: watched by this process, not Lightning
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path,  # weights_only=False: trust its pickles
                    weights_only=False if cfg.get("trust_checkpoint") else None)
    except SystemExit:  # Lightning's Ctrl-C handling (a second Ctrl-C: abort) ends with sys.exit(1)
        if rank_zero and trainer.interrupted:
            report_interrupt(trainer, checkpoint)
            sys.exit(128 + signal.SIGINT)
        raise
    if trainer.interrupted:
        if rank_zero:
            report_interrupt(trainer, checkpoint)
        return None
    if interrupt.stopped:  # Ctrl-C or preemption, handled at a step boundary on every rank
        if not rank_zero:
            return None  # exit 0: a rank that exits non-zero ends the whole job (lightning_tp2d.supervise)
        report_interrupt(trainer, checkpoint)
        ranks.wait()
        # 128 + the signal (130 for Ctrl-C, 143 for SIGTERM), what a process killed by it reports, so shells and
        # requeue scripts tell "stopped by a signal after saving its step" from a failure
        sys.exit(128 + interrupt.signum)

    sample = generate_sample(cfg, module, datamodule, trainer)  # collective: every rank of a grid takes part
    if rank_zero:
        report(cfg, trainer, checkpoint, run_dir, sample, time.monotonic() - started)
    ranks.wait()  # so the command ends when the whole job has
    newest = newest_checkpoint(checkpoint) if rank_zero and cfg.get("export_hf") else ""
    if newest:  # one process reads the whole checkpoint, outside the job's process group
        launch.end_process_group()
        try:
            exported = export_transformers(cfg, newest, module.config, run_dir)
        except (FileExistsError, NotADirectoryError) as err:  # weights that appeared there since the launch
            print(f"tp2d-train: error: {err}. Training finished: the checkpoint {newest} is complete, for "
                  "lightning_tp2d.export_hf(checkpoint, directory, ...)", file=sys.stderr)
            sys.exit(1)
        log.info("tp2d-train: exported %s to %s (transformers: AutoModelForCausalLM.from_pretrained(%r))", newest,
                 exported, str(exported))
    val_loss = trainer.callback_metrics.get("val_loss")
    return float(val_loss) if val_loss is not None else None


def finished_note(cfg: DictConfig) -> str | None:
    """The line to say when ``ckpt_path`` was saved at or past ``trainer.max_steps`` (Lightning would start every
    process, train nothing and say nothing), with how to continue; ``None`` otherwise."""
    max_steps = int(cfg.trainer.max_steps)
    if cfg.ckpt_path is None or max_steps < 0:
        return None
    try:
        step = saved_step(Path(str(cfg.ckpt_path)).expanduser(), trust_checkpoint=bool(cfg.get("trust_checkpoint")))
    except CheckpointError as err:
        raise ConfigError(f"ckpt_path: {err}") from None
    if step < max_steps:
        return None
    return (f"tp2d-train: nothing to train: {cfg.ckpt_path} was saved at step {step} and trainer.max_steps={max_steps}. "
            f"To train on, resume with a larger trainer.max_steps (e.g. trainer.max_steps={step + max(max_steps, 1)}): "
            "the learning rate continues from the checkpoint's, and the rest of its cosine is spread over the new "
            "steps (a schedule that had reached its floor stays there)")


def make_callbacks(cfg: DictConfig, run_dir: Path) -> tuple[list, object, object | None]:
    """The Trainer's callbacks: :class:`~lightning_tp2d.callbacks.GracefulInterrupt` (always: Ctrl-C and preemption
    stop every rank after the same step), then every entry of ``callbacks`` that is not null, in order, built from
    its ``_target_`` (``callbacks/`` options and ``+callbacks.<name>._target_=...`` alike). A ModelCheckpoint without
    ``dirpath`` writes to ``<run dir>/checkpoints``; progress bars are dropped under ``trainer.enable_progress_bar=
    false``, and of several the last one listed is kept. Returns the list, the interrupt callback and the checkpoint
    callback that reports and resumes use (``callbacks.model_checkpoint``, else the first ModelCheckpoint)."""
    interrupt = GracefulInterrupt()
    built = build_entries("callbacks", cfg.get("callbacks"), Callback, "lightning.pytorch.callbacks.LearningRateMonitor")
    for callback in built.values():
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
            callback.dirpath = os.path.realpath(run_dir / "checkpoints")
    bars = [name for name, c in built.items() if isinstance(c, ProgressBar)]
    for name in bars if not cfg.trainer.enable_progress_bar else bars[:-1]:
        del built[name]
    checkpoints = [c for c in built.values() if isinstance(c, ModelCheckpoint)]
    checkpoint = built.get("model_checkpoint") if isinstance(built.get("model_checkpoint"), ModelCheckpoint) else \
        (checkpoints[0] if checkpoints else None)
    return [interrupt, *built.values()], interrupt, checkpoint


def make_loggers(cfg_logger: DictConfig | None, run_dir: Path) -> list:
    """Every entry of ``logger`` that is not null, built from its ``_target_`` (``save_dir: null``: the run
    directory). A logger whose package is missing is a :class:`ConfigError` naming the ``pip install``."""
    for name, node in (cfg_logger or {}).items():
        target = str(node["_target_"]) if isinstance(node, DictConfig) and "_target_" in node else ""
        for cls, packages, hint in (("WandbLogger", ("wandb",), "wandb"),
                                    ("TensorBoardLogger", ("tensorboard", "tensorboardX"), "tensorboard")):
            if target.endswith(cls) and not any(importlib.util.find_spec(m) for m in packages):
                raise ConfigError(f"logger.{name} ({target}) needs the {hint} package, which is not installed: "
                                  f"pip install {hint} (or choose another logger: logger=csv)")
    built = build_entries("logger", cfg_logger, Logger, "lightning.pytorch.loggers.CSVLogger",
                          lambda node: {"save_dir": str(run_dir)} if "save_dir" in node and node.save_dir is None
                          else {})
    return [logger for logger in built.values() if logger is not None]  # tensorboard_if_installed: maybe None


def build_entries(group: str, nodes: DictConfig | None, kind: type, example: str,
                  arguments: Callable[[DictConfig], dict] | None = None) -> dict[str, Any]:
    """Every entry of the config group ``group`` (``callbacks``, ``logger``) that is not null, in order, built from
    its ``_target_`` (with ``arguments(node)`` added): a :class:`ConfigError` names an entry without a class, a
    class or argument Hydra cannot build, and an object that is not a ``kind`` (``None`` is let through).
    ``example``: a class of the group, for the message."""
    kind_path = f"{example.rsplit('.', 1)[0]}.{kind.__name__}"  # lightning.pytorch.callbacks.Callback
    built = {}
    for name, node in (nodes or {}).items():
        if node is None:
            continue
        if not isinstance(node, DictConfig) or "_target_" not in node:
            raise ConfigError(f"{group}.{name} has no _target_ (a Lightning {kind.__name__.lower()} class), e.g. "
                              f"+{group}.{name}._target_={example}; {group}.{name}=null removes the entry")
        try:
            entry = instantiate(node, **(arguments(node) if arguments else {}))
        except Exception as err:  # noqa: BLE001 - a bad class name or argument, wrapped by Hydra
            raise ConfigError(f"{group}.{name}: {err.__cause__ or err}") from err
        if entry is not None and not isinstance(entry, kind):
            raise ConfigError(f"{group}.{name}: {node['_target_']} built a {type(entry).__name__}, not a "
                              f"{kind_path}")
        built[name] = entry
    return built


def tensorboard_if_installed(**kwargs):
    """``logger=default``'s TensorBoard entry: a ``TensorBoardLogger(**kwargs)`` when tensorboard (or tensorboardX)
    is installed, else ``None`` (no event files; ``logger=tensorboard`` asks for them and says what to install)."""
    if not any(importlib.util.find_spec(m) for m in ("tensorboard", "tensorboardX")):
        return None
    return TensorBoardLogger(**kwargs)


class ContinuingCSVLogger(CSVLogger):
    """Lightning's CSVLogger (``logger/csv.yaml``), except that an existing ``metrics.csv`` is continued instead of
    deleted: a run resumed in its run directory keeps the rows logged before the step it resumed from (the rows
    from that step on, which the first run logged after its last checkpoint, go when the first new rows are saved)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.earlier_rows: list[dict] | None = None  # rank 0: the rows metrics.csv held, once the writer exists

    @property
    def experiment(self):
        if self.earlier_rows is not None or rank_zero_only.rank != 0:
            return super().experiment
        metrics = Path(self.log_dir) / "metrics.csv"
        rows, header = [], []
        if metrics.is_file():
            with open(metrics, newline="") as f:
                reader = csv.DictReader(f)
                rows, header = [r for r in reader if r.get("step")], sorted(reader.fieldnames or [])
        with warnings.catch_warnings():  # "Previous log files in this directory will be deleted": not by us
            warnings.filterwarnings("ignore", message=".*exists and is not empty")
            writer = super().experiment  # (Lightning's writer deletes metrics.csv here)
        self.earlier_rows = rows
        if rows:
            self.rewrite(metrics, header, rows)
            writer.metrics_keys = header  # the writer appends under this header (and widens it for new keys)
        return writer

    @rank_zero_only
    def save(self) -> None:
        writer = self.experiment
        if self.earlier_rows and writer.metrics:  # the first rows of this run: drop what they replace
            first = min(int(m["step"]) for m in writer.metrics)
            kept = [r for r in self.earlier_rows if int(r["step"]) < first]
            self.rewrite(Path(self.log_dir) / "metrics.csv", writer.metrics_keys, kept)
            self.earlier_rows = []
        super().save()

    @staticmethod
    def rewrite(path: Path, header: list[str], rows: list[dict]) -> None:
        with open(path, "w", newline="") as f:
            out = csv.DictWriter(f, fieldnames=header)
            out.writeheader()
            out.writerows(rows)


# ---- checks before any process starts ----------------------------------------------------------------------------


def device_count(devices, accelerator: str) -> int | None:
    """The processes per machine ``trainer.devices`` stands for (``None`` when it cannot be told here)."""
    if isinstance(devices, (list, ListConfig)):
        return len(devices)
    if isinstance(devices, str) and "," in devices:
        return len([d for d in devices.split(",") if d.strip()])
    if devices in (-1, "-1", "auto") and accelerator in ("gpu", "cuda", "auto"):
        return launch._cuda_devices() or (1 if devices == "auto" else None)
    try:
        count = int(devices)
    except (TypeError, ValueError):
        return None
    return count if count > 0 else None


def check_config(cfg: DictConfig, model) -> str:
    """Raise :class:`ConfigError` for data, devices or sizes that do not fit; return a one-line plan of the run."""
    tr, data = cfg.trainer, cfg.data
    check_values(cfg)
    check_parallel(cfg.parallel)
    model = check_init_from(cfg, model)
    check_outputs(cfg)
    if cfg.ckpt_path is not None:
        try:
            resolve(Path(str(cfg.ckpt_path)).expanduser())  # also finds the survivor of an interrupted save
        except FileNotFoundError:
            raise ConfigError(f"ckpt_path={str(cfg.ckpt_path)!r} does not exist (looked for "
                              f"{Path(str(cfg.ckpt_path)).expanduser().absolute()})") from None
    try:
        path = data.path
    except MissingMandatoryValue:
        raise ConfigError("data.path is required with this data config: a text file or folder (data=text) or a "
                          ".bin token file (data=tokens), e.g. data.path=$HOME/corpus.txt") from None
    try:
        form, suffixes = check_format(str(data.get("format", "auto"))), text_suffixes(data.get("suffixes"))
    except ValueError as err:
        raise ConfigError(f"data.format: {err}") from None
    val_path = data.get("val_path")
    for key, source in (("data.path", path), ("data.val_path", val_path)):
        if source is None:
            continue
        if not Path(str(source)).expanduser().exists():
            raise ConfigError(f"{key}={str(source)!r} does not exist (looked for "
                              f"{Path(str(source)).expanduser().absolute()}; relative paths start from the directory "
                              f"tp2d-train runs in, {os.getcwd()})")
        try:
            check_path(str(source), vocab_size=model.vocab_size, dtype=data.get("dtype", "uint16"), format=form,
                       suffixes=suffixes)
        except ValueError as err:
            raise ConfigError(f"{key}: {err}") from None
    text = path is None or any(s is not None and not is_token_file(s, form) for s in (path, val_path))
    if text:  # the tokenizer makes the ids (with token files only, it just prints the sample)
        try:
            ids = tokenizer_vocab_size(str(data.tokenizer))  # (no tiktoken needed for this)
        except (ValueError, OSError, RuntimeError) as err:
            raise ConfigError(f"data.tokenizer: {err}") from None
        if ids > model.vocab_size:
            fit = "model=gpt2 or larger" if ids <= TOKENIZER_IDS["gpt2"] else f"model.vocab_size={ids}"
            raise ConfigError(f"data.tokenizer={data.tokenizer} makes {ids} token ids but model.vocab_size="
                              f"{model.vocab_size}: use a model with vocab_size >= {ids} ({fit}) or "
                              "data.tokenizer=byte")
        try:  # and it loads here, before any process starts (tiktoken missing, or offline without its files)
            get_tokenizer(str(data.tokenizer))
        except (ValueError, OSError, RuntimeError) as err:
            raise ConfigError(f"data.tokenizer: {err}") from None
        warn_tokenizer_fallback(cfg)
    seq, batch = int(data.block_size), int(data.batch_size)
    if max_seq_len(model) is not None and seq > model.block_size:  # None: RoPE, any length
        raise ConfigError(f"data.block_size={seq} exceeds model.block_size={model.block_size} (the positions the "
                          f"model can embed): lower data.block_size or set model.block_size={seq}")
    devices, nodes = device_count(tr.devices, str(tr.accelerator)), int(tr.num_nodes)
    node_rank = launch._int(os.environ, "NODE_RANK", launch._int(os.environ, "GROUP_RANK"))
    if node_rank >= nodes:
        raise ConfigError(f"NODE_RANK={node_rank} but trainer.num_nodes={nodes}: set trainer.num_nodes to the number "
                          f"of machines (at least {node_rank + 1}) on every machine")
    where = f"{tr.accelerator}, {tr.precision}; {batch} x {seq} tokens per step and replica"
    p = dp = None  # the tensor- and data-parallel sizes, where known here
    if "layout" not in cfg.parallel:  # parallel=single
        if devices is not None and devices * nodes != 1:
            raise ConfigError(f"parallel=single runs one process, but trainer.devices={devices} x trainer.num_nodes="
                              f"{nodes} = {devices * nodes}: use trainer.devices=1, or a tensor-parallel layout "
                              "(parallel=tp2d)")
        plan, p, dp = f"plain {_model_name(model)} ({model.n_layer} layers, {model.n_embd} wide) on one device", 1, 1
    elif str(cfg.parallel.layout) == AUTO_LAYOUT:
        plan = check_auto(cfg.parallel, model, str(tr.accelerator))
    elif devices is None:
        plan = f"layout {cfg.parallel.layout!r} on trainer.devices={tr.devices}"
    else:
        plan, p, dp = check_layout(cfg.parallel, model, devices, nodes, batch, seq,
                                   packed=bool(data.get("pack_documents", False)))
    if launch._int(os.environ, "LOCAL_RANK") == 0:  # once per machine: the ranks it starts were checked by it
        if cfg.ckpt_path is not None:
            check_checkpoint(cfg)
        if p is not None and devices is not None:
            check_memory(cfg, model, p, dp, devices)
        check_data_size(cfg, dp or 1)
        if p is not None and devices is not None:  # last: it takes a minute for a large model
            check_fit(cfg, model, p, dp, devices)
    return f"{plan} ({where})"


def warn_tokenizer_fallback(cfg: DictConfig) -> None:
    """A WARNING (once, in the launching process) when ``module.init_from`` names a directory without
    ``tokenizer.json`` and the data's tokenizer was left to follow it: the text is then tokenized with the data
    group's default (bytes), not the model's own tokenizer, which a fine-tune almost never wants."""
    source = cfg.module.get("init_from")
    given = OmegaConf.to_container(cfg.data, resolve=False).get("tokenizer")
    if source is None or not (isinstance(given, str) and given.startswith("${tp2d.tokenizer:")):
        return  # no directory, or a data.tokenizer the user chose
    directory = Path(str(source)).expanduser()
    if not (directory / "tokenizer.json").is_file() and launch.is_rank_zero():
        log.warning("module.init_from=%s has no tokenizer.json: the text is tokenized with data.tokenizer=%s "
                    "instead of the model's own tokenizer; copy the model's tokenizer.json into %s, or set "
                    "data.tokenizer=<its tokenizer.json>", source, cfg.data.tokenizer, directory)


def check_values(cfg: DictConfig) -> None:
    """The numbers no class of the package checks when it is built (Lightning's Trainer arguments, the sample's,
    the seed, Lightning's loggers and early stopping: :mod:`lightning_tp2d.run_values`), before anything is read or
    started. The module's, the data's, the strategy's and the model's own are checked by their classes, which are
    built here before launch too."""
    try:
        check_run_values(cfg)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_parallel(par: DictConfig) -> None:
    """The ``parallel`` values the strategy would refuse only when it is built: the ZeRO stage and the layout's
    name (a group option that does not exist, ``parallel=<name>``, is refused on the command line:
    :func:`lightning_tp2d.launch.check_override_keys`)."""
    stage = par.get("zero_stage", 0)
    if "zero_stage" in par and (isinstance(stage, bool) or stage not in ZERO_STAGES):
        raise ConfigError(f"parallel.zero_stage={stage!r} is not a ZeRO stage: choose 0 (every data-parallel replica "
                          "keeps the whole optimizer state of its shard), 1 (the optimizer state sharded over the "
                          "replicas), 2 (gradients too) or 3 (parameters too)")
    if "layout" in par and str(par.layout) != AUTO_LAYOUT:
        try:
            get_layout(str(par.layout))
        except ValueError as err:
            raise ConfigError(f"parallel.layout: {err}, or {AUTO_LAYOUT!r} (planned)") from None
    if par.get("float8") not in (None, False, "none"):
        check_float8(par)


def float8_notice_line(par: DictConfig) -> str | None:
    """What a run with ``parallel.float8`` says before it starts (:func:`lightning_tp2d.float8.float8_notice`: one line
    when the GEMMs are emulated, on the CPU), ``None`` without a recipe or on a GPU with float8 GEMMs."""
    if par.get("float8") in (None, False, "none"):
        return None
    from lightning_tp2d.float8 import float8_notice

    return float8_notice(str(par.float8))


def check_float8(par: DictConfig) -> None:
    """``parallel.float8`` before launch: a recipe name, a layout whose products run it (``auto``: the planner prices
    every row with it), torchao installed, and a GPU with float8 GEMMs where there is one."""
    from lightning_tp2d.float8 import check_recipe, float8_notice

    layout = str(par.get("layout", AUTO_LAYOUT))
    try:
        if layout == AUTO_LAYOUT:
            check_recipe(str(par.float8))
        else:
            get_layout(layout).with_float8(str(par.float8))
        float8_notice(str(par.float8))
    except (ValueError, ImportError) as err:
        raise ConfigError(f"parallel.float8: {err}") from None


def check_checkpoint(cfg: DictConfig) -> None:
    """``ckpt_path`` checked in the launching process before any rank starts: every file against its recorded size
    and digest (a sharded directory's ``checksums.json``; a single file's CRC-32 of each entry), then its
    non-tensor part read as data (:func:`~lightning_tp2d.checkpoint.saved_step`). A damaged or incomplete
    checkpoint is a :class:`ConfigError` naming each bad file."""
    try:
        saved_step(Path(str(cfg.ckpt_path)).expanduser(), trust_checkpoint=bool(cfg.get("trust_checkpoint")),
                   verify=True)
    except CheckpointError as err:
        raise ConfigError(f"ckpt_path: {err}") from None


def check_outputs(cfg: DictConfig) -> None:
    """Global rank 0, before launch: nothing this run writes lands on weights it did not write, neither its run
    directory (``TP2D_RUN_DIR``, which rank 0 sets to Hydra's for its job) nor ``export_hf``
    (:func:`~lightning_tp2d.run_outputs.outputs_problem`): a :class:`ConfigError` naming the directory, what it holds
    and the way out."""
    if launch.is_rank_zero():
        given = os.environ.get(launch.RUN_DIR_ENV)
        problem = outputs_problem(cfg, Path(given) if given else None)
        if problem:
            raise ConfigError(problem)


def check_given_run_dir(args: list[str]) -> None:
    """Rank 0, before Hydra writes its ``.hydra/`` and ``train.log`` into it: a run directory given on the command line
    or exported that holds weights this run did not write (:func:`~lightning_tp2d.run_outputs.given_run_dir_problem`)
    is one line on stderr, exit 2."""
    problem = given_run_dir_problem(args)
    if problem:
        print(f"tp2d-train: error: {problem}", file=sys.stderr)
        sys.exit(2)


def model_choice(cfg: DictConfig) -> tuple[bool, list[str]]:
    """Whether the ``model`` group was chosen (``model=<option>`` on the command line, or an experiment's choice
    other than this machine's default) and the ``model.<key>`` overrides given, from Hydra's record of the job: the
    composed config's ``hydra`` node when it has one (``compose(..., return_hydra_config=True)``), else the running
    job's. Without a record (a config composed without it): chosen, no overrides."""
    node = cfg.get("hydra") if "hydra" in cfg else None
    if node is None:
        try:
            node = HydraConfig.get()
        except ValueError:  # no Hydra job
            return True, []
    keys = [str(o).split("=", 1)[0].lstrip("+") for o in node.overrides.task if "=" in str(o)]
    chosen = "model" in keys or str(node.runtime.choices.get("model")) != str(launch.auto_value("model"))
    return chosen, [k.split(".", 1)[1] for k in keys if k.startswith("model.")]


def read_init_from(source, model=None):
    """Our config for the transformers directory ``source`` (``module.init_from``): its ``config.json`` read by
    :func:`~lightning_tp2d.export.read_hf_config` (the one reader of transformers configs; refuses implausible
    sizes and variants the model does not implement), the family the one its ``model_type`` names (a file without
    one: ``model``'s family). Any problem is a :class:`ConfigError`."""
    directory = Path(str(source)).expanduser()
    if not directory.is_dir():
        raise ConfigError(f"module.init_from={str(source)!r} does not exist (looked for {directory.absolute()}): a "
                          "local transformers directory (config.json and model.safetensors)")
    file = directory / "config.json"
    try:
        raw = json.loads(file.read_text()) if file.is_file() else {}
        typed = not isinstance(raw, dict) or "model_type" in raw or model is None
        return read_hf_config(directory, None if typed else family_of_config(model))
    except json.JSONDecodeError as err:
        raise ConfigError(f"module.init_from: {str(file)!r} is not JSON ({err})") from None
    except (ValueError, OSError) as err:
        raise ConfigError(f"module.init_from: {err}") from None


def model_from_init(cfg: DictConfig) -> bool:
    """``module.init_from=DIR`` with no model chosen (:func:`model_choice`), or with ``module.model=null``: the
    ``model`` node becomes ``DIR/config.json``'s model (family, sizes, RoPE theta and scaling, tied embeddings,
    vocabulary), with the ``model.<key>`` overrides given on top (``model.dropout=0``, a shorter
    ``model.block_size``), so everything that reads ``model.*`` (``data.block_size``, the checks, the module) sees
    it. Returns whether it did; a model chosen beside ``init_from`` stays, and :func:`check_init_from` holds it to
    the directory's."""
    source = cfg.module.get("init_from")
    if source is None:
        return False
    own = cfg.module.get("model", "") is None
    chosen, keys = model_choice(cfg)
    if chosen and not own:
        return False
    theirs = read_init_from(source)
    cls = type(theirs)
    node = OmegaConf.create({"_target_": f"{cls.__module__}.{cls.__qualname__}", **vars(theirs)})
    for key in dict.fromkeys(keys):
        if key.startswith("_"):
            continue
        if key not in node:
            raise ConfigError(f"model.{key}: the model of module.init_from={str(source)!r} is a {cls.__name__}, "
                              f"which has no {key!r}; its fields: {', '.join(k for k in node if k != '_target_')}")
        node[key] = cfg.model[key]
    with open_dict(cfg):
        cfg.model = node
    return True


def init_from_disagreements(model, theirs) -> list[str]:
    """``"<field>: model <ours>, checkpoint <theirs>"`` once for each field in which the model config ``model``
    cannot take the weights of a transformers directory of config ``theirs`` (same family): the format's sizes and
    rules (:meth:`~lightning_tp2d.models.hf.HFFormat.fit_problems`) and its tied-head option."""
    fmt = family_of_config(model).hf
    problems = fmt.fit_problems(model, theirs)
    tie = fmt.tie_option
    if tie and getattr(model, tie) != getattr(theirs, tie):
        problems.append(f"{tie}: model {getattr(model, tie)}, checkpoint {getattr(theirs, tie)}")
    named: dict[str, str] = {}
    for problem in problems:
        named.setdefault(problem.split(":", 1)[0], problem)
    return list(named.values())


def check_init_from(cfg: DictConfig, model):
    """``module.init_from``: its ``config.json`` is read here (nothing else of the directory), so implausible sizes,
    another family, or sizes that do not fit the chosen model are refused before any process starts, each
    disagreeing field named once. Returns the config the module builds: the directory's under
    ``module.model=null``, else ``model``."""
    source, own = cfg.module.get("init_from"), cfg.module.get("model", "") is None
    if source is None:
        if own:
            raise ConfigError("module.model=null takes the sizes from module.init_from's config.json: set "
                              "module.init_from=<a transformers directory>, or drop module.model=null")
        return model
    fmt = getattr(family_of_config(model), "hf", None)  # (a model of no registered family: check_layout says so)
    theirs = read_init_from(source, None if own or fmt is None else model)
    if own or fmt is None:
        return theirs if own else model
    label = _model_label(model)
    if family_of_config(theirs) is not family_of_config(model):
        raise ConfigError(f"module.init_from={str(source)!r} holds a {_model_name(theirs)} model (its config.json), "
                          f"but the model chosen, {label}, is a {_model_name(model)}: leave model= out (the model is "
                          "then the directory's), or choose a model of its family")
    problems = init_from_disagreements(model, theirs)
    if problems:
        raise ConfigError(f"module.init_from: transformers checkpoint {str(source)!r} does not fit the model "
                          f"{label}: {'; '.join(problems)}; leave model= out (or module.model=null): the model is "
                          "then its config.json's")
    return model


def check_memory(cfg: DictConfig, model, p: int, dp: int, devices: int) -> None:
    """The model's parameters alone fit this machine's physical memory, as the layout shards them
    (:mod:`lightning_tp2d.param_memory`). CPU processes only: a GPU's memory is not read here, which would start
    CUDA on the launching process."""
    accelerator = str(cfg.trainer.accelerator)
    if accelerator != "cpu" and not (accelerator == "auto" and not launch._cuda_devices()):
        return
    count = parameter_count(model)
    if count is None:
        return
    count //= int(cfg.parallel.get("pipeline_parallel_size") or 1) if "layout" in cfg.parallel else 1  # (a stage's)
    size, dtype = parameter_bytes(str(cfg.trainer.precision))
    bad = parameter_memory_problem(count, p=p, dp=dp, zero_stage=int(cfg.parallel.get("zero_stage") or 0),
                                   processes=devices, available=physical_memory(), bytes_per_parameter=size,
                                   dtype=dtype)
    if bad:
        raise ConfigError(bad)


def check_data_size(cfg: DictConfig, replicas: int) -> None:
    """The corpus holds the windows and batches the data module will cut from it
    (:meth:`~lightning_tp2d.data.TextDataModule.check_size`: counted from the sources' sizes, their token cache or a
    bounded prefix); the validation split needs full batches only where validation runs."""
    try:
        datamodule = instantiate(cfg.data)
    except Exception as err:  # noqa: BLE001 - a TextDataModule argument it refuses, wrapped by Hydra
        raise ConfigError(f"data: {err.__cause__ or err}") from err
    check = getattr(datamodule, "check_size", None)
    if check is None:
        return
    try:
        check(replicas=replicas, validates=cfg.trainer.get("limit_val_batches") not in (0, 0.0), key="data.")
    except (ValueError, OSError) as err:
        raise ConfigError(str(err)) from None


FIT_FRACTION = 0.9  # the share of a device's memory a run may fill, as the planner's memory_fraction (the rest:
# allocator fragmentation and kernel workspaces, which the memory model does not count)


def strategy_overrides(par: DictConfig) -> dict:
    """Arguments that replace ``parallel``'s when the strategy is built: a named layout's ``memory_gib`` is
    :func:`check_fit`'s alone (the strategy takes it for ``layout="auto"`` only)."""
    auto = "layout" not in par or str(par.layout) == AUTO_LAYOUT
    return {} if auto or "memory_gib" not in par else {"memory_gib": None}


def on_gpus(cfg: DictConfig) -> bool:
    """Whether the run trains on CUDA GPUs (``trainer.accelerator`` gpu or cuda, or auto with CUDA devices), told
    without initialising CUDA in the launching process (the ranks it starts need it uninitialised)."""
    accelerator = str(cfg.trainer.accelerator)
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and launch._cuda_devices() > 0)


def gpu_memory_gib() -> float | None:
    """The total memory of the smallest GPU this machine shows the run (``CUDA_VISIBLE_DEVICES``), in GiB, as
    ``nvidia-smi`` reports it: reading it through torch would initialise CUDA in the launching process. ``None``
    when nvidia-smi is missing or does not answer."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    command = [exe, "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:
        command.append(f"--id={visible}")
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=20, check=True).stdout
        mib = [float(line) for line in out.split()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return min(mib) / 1024 if mib else None


def _gib(nbytes: float) -> str:
    """Bytes as GiB for a message: one decimal from 10 GiB, else three significant digits (tiny test models too)."""
    gib = nbytes / 2**30
    return f"{gib:.1f}" if gib >= 9.95 or gib <= 0 else f"{gib:.{2 - math.floor(math.log10(gib))}f}"


def _model_label(model) -> str:
    """The ``model=`` option of this run when Hydra knows it and it names this model's size (``llama-3.1-8b``), else
    the family and sizes (a Hydra state left from another job names another model)."""
    try:
        choice = HydraConfig.get().runtime.choices.get("model")
    except ValueError:  # no Hydra job (compose API, tests)
        choice = None
    named = (getattr(type(model), "NAMED", None) or {}).get(str(choice)) if choice else None
    if named and all(getattr(model, k) == named[k] for k in ("n_layer", "n_embd", "vocab_size") if k in named):
        return str(choice)
    return f"{_model_name(model)} {model.n_layer}x{model.n_embd}"


def check_fit(cfg: DictConfig, model, p: int, dp: int, devices: int) -> None:
    """The predicted peak memory per device of a package layout's run (``layout="auto"`` plans its own), from the
    planner's memory model (:func:`lightning_tp2d.planning.planner.row_memory`: its closed form where it models the
    run, else the step traced on fake tensors; bf16, fused AdamW; with ``activation_offload`` :func:`~lightning_tp2d.planning.planner.offload_memory`, the host memory
    per node too): checked when ``parallel.memory_gib`` is set or the run is on GPUs. Logs one line before (a large
    model takes about a minute) and one with the result; a peak above :data:`FIT_FRACTION` of
    ``parallel.memory_gib`` (else of the GPU's memory, when nvidia-smi tells it) is a :class:`ConfigError` naming
    both and what to try."""
    par = cfg.parallel
    if "layout" not in par or str(par.layout) == AUTO_LAYOUT:
        return
    memory_gib, gpus = par.get("memory_gib"), on_gpus(cfg)
    if memory_gib is None and not gpus:
        return
    if memory_gib is not None:
        if isinstance(memory_gib, bool) or not isinstance(memory_gib, (int, float)) or memory_gib <= 0:
            raise ConfigError(f"parallel.memory_gib must be a positive number of GiB per device (or null), got "
                              f"{memory_gib!r}")
        memory_gib = float(memory_gib)
    if family_of_config(model) is None:
        log.debug("check_fit: the memory model prices registered model families only, not %s", type(model).__name__)
        return
    layout = get_layout(str(par.layout))
    offload = bool(par.get("activation_offload", False))
    try:  # as the strategy runs it (offload keeps each block's input on the host)
        mode = offloaded_checkpointing(str(par.get("activation_checkpointing") or "none"), offload)
    except ValueError as err:
        raise ConfigError(f"parallel: {err}") from None
    stage, batch, seq = int(par.get("zero_stage") or 0), int(cfg.data.batch_size), int(cfg.data.block_size)
    pp = int(par.get("pipeline_parallel_size") or 1)
    staged = {} if pp == 1 else {  # (check_stages checked them): each rank's blocks, its in-flight micro-batches
        "pipeline_parallel_size": pp, "pp_schedule": str(par.get("pp_schedule", "1f1b")),
        "virtual_stages": int(par.get("virtual_stages") or 1),
        "microbatches": int(par.get("microbatches") or pp * int(par.get("virtual_stages") or 1))}
    if staged:
        batch //= staged["microbatches"]  # the memory model's micro-batch: one of the schedule's
    label, unit = _model_label(model), "GPU" if gpus else "device"
    log.info("tp2d-train: checking the fit with the memory model (%s, %s p=%d%s, seq %d%s)...", label, layout.name, p,
             f" x dp {dp}" if dp > 1 else "", seq, ", offload" if offload else "")
    # deferred: the planner is heavy (the cost model fits its GEMM rates on import); only a run that asks for the
    # check loads it (core.py imports the planner the same way)
    from lightning_tp2d.planning.planner import offload_memory, pricing, row_memory

    try:
        with pricing("closed"):  # the closed forms where they model the run (milliseconds), else the traced model
            memory = row_memory(model, layout.name, p, dp, stage, mode, batch, seq, **staged)
    except (ValueError, RuntimeError) as err:  # a trace the memory model cannot build: the run is not held up by it
        log.warning("tp2d-train: the memory model could not price this run (%s); launching without the fit check",
                    err)
        return
    if offload:
        memory = offload_memory(memory, model, batch, seq, p, devices)
    peak = memory["total"]
    how, precision = f"bf16, micro-batch {batch}, {mode} checkpointing, ZeRO {stage}", str(cfg.trainer.precision)
    if staged:
        how += f", {pp} pipeline stages ({staged['pp_schedule']}, {staged['microbatches']} micro-batches)"
    note = "" if precision.startswith("bf16") else f"; the model prices bf16, trainer.precision={precision} keeps more"
    line = f"tp2d-train: predicted peak {_gib(peak)} GiB per {unit} ({how}{note})"
    if offload:
        line += (f", and {_gib(memory['host_per_node'])} GiB of host memory per node ({devices} {unit}s x "
                 f"{_gib(memory['host'])} GiB of offloaded block inputs)")
    if memory_gib is not None:
        cap, source = memory_gib, f"parallel.memory_gib={memory_gib:g}"
    else:
        cap = gpu_memory_gib()
        source = None if cap is None else f"the GPU's {_gib(cap * 2**30)} GiB (nvidia-smi)"
    if cap is None:
        log.info("%s; the GPU's memory is not known here (no nvidia-smi): set parallel.memory_gib to check it", line)
        return
    limit = FIT_FRACTION * cap * 2**30
    if peak <= limit:
        log.info("%s: within %s GiB, %d%% of %s", line, _gib(limit), round(FIT_FRACTION * 100), source)
        return
    tries = [] if mode == "full" else ["parallel.activation_checkpointing=full"]
    if not offload:
        tries.append("parallel.activation_offload=true")
    if dp > 1 and not reshards_after_forward(stage, dp):  # not yet everything sharded over the replicas
        tries.append(f"parallel.zero_stage=3 (parameters, gradients and optimizer state sharded over the {dp} "
                     "replicas)")
    tries.append(f"a larger {layout.arrangement} (parallel.tensor_parallel_size above {p}, more devices)")
    if batch > 1:
        tries.append(f"a smaller data.batch_size (now {batch})")
    tries.append(f"a shorter data.block_size (now {seq})")
    raise ConfigError(f"the memory model predicts a peak of {_gib(peak)} GiB per {unit} for {label} on {layout.name} "
                      f"p={p} x dp {dp} ({how}{', offload' if offload else ''}{note}), more than {_gib(limit)} GiB, "
                      f"{round(FIT_FRACTION * 100)}% of {source}: try {', '.join(tries)}")


def _model_name(model) -> str:
    """``GPT2`` / ``Llama``: the model class of ``model``'s (a config's) family, for messages."""
    family = family_of_config(model)
    return "GPT-2" if family is None or family.name == "gpt2" else family.model_class.__name__


def check_auto(par: DictConfig, model, accelerator: str) -> str:
    """``parallel=auto``: what can be checked before the plan (which each rank makes at start-up, from the model)."""
    if family_of_config(model) is None:
        raise ConfigError(f"model: {type(model).__name__} is not the config of a registered model family")
    memory = par.get("memory_gib")
    if memory is None and accelerator not in ("gpu", "cuda", "auto"):
        raise ConfigError(f"parallel=auto on trainer.accelerator={accelerator} needs parallel.memory_gib=<GiB per "
                          "process> (the memory the plan may fill; GPUs report theirs)")
    per_device = "each GPU's memory" if memory is None else f"{float(memory):g} GiB per device"
    return (f"layout 'auto': the planner picks the layout, sizes, ZeRO stage and checkpointing for "
            f"{_model_name(model)} in {per_device} at start-up")


def check_stages(par: DictConfig, model, batch: int) -> tuple[int, int, str]:
    """``parallel.pipeline_parallel_size`` and its schedule before launch (:func:`~lightning_tp2d.train_plan.
    pipeline_problem`; the model's blocks fill the stages; the batch splits into the micro-batches): ``(pp,
    micro-batches, a phrase for the plan's line)``, ``(1, 1, "")`` without stages; a :class:`ConfigError` naming the
    keys and numbers otherwise."""
    pp = par.get("pipeline_parallel_size", 1)
    pp = 1 if pp is None else pp
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ConfigError(f"parallel.pipeline_parallel_size must be a positive int, got {pp!r}")
    schedule, micro = str(par.get("pp_schedule", "1f1b")), par.get("microbatches")
    virtual = par.get("virtual_stages", 1)
    problem = pipeline_problem(pp, schedule, micro, virtual, prefix="parallel.")
    if problem:  # (checked without stages too: a bad value is refused where it is given)
        raise ConfigError(problem)
    if pp == 1:
        return 1, 1, ""
    stages = pp * virtual
    if model.n_layer < stages:
        raise ConfigError(f"model.n_layer={model.n_layer} blocks cannot fill parallel.pipeline_parallel_size={pp} x "
                          f"parallel.virtual_stages={virtual} = {stages} stages (each needs at least one block)")
    micro = stages if micro is None else int(micro)
    if batch % micro:
        raise ConfigError(f"data.batch_size={batch} does not split into parallel.microbatches={micro}: use a "
                          f"multiple of {micro}")
    return pp, micro, f"{pp} pipeline stages ({schedule}, {micro} micro-batches) x "


def check_layout(par: DictConfig, model, devices: int, nodes: int, batch: int, seq: int,
                 packed: bool = False) -> tuple[str, int, int]:
    """The plan of a fixed layout, its tensor-parallel size ``p`` and data-parallel size ``dp``."""
    try:
        layout = get_layout(str(par.layout))
    except ValueError as err:
        raise ConfigError(f"parallel.layout: {err}") from None
    family = family_of_config(model)
    if family is None:
        raise ConfigError(f"model: {type(model).__name__} is not the config of a registered model family")
    if layout.name not in family.layouts:  # the family says which layouts it has plans for
        options = {v: k for k, v in STRATEGY_NAMES.items()}
        has = [f"parallel={options[n]}" if n in options else f"parallel.layout={n}" for n in family.layouts]
        raise ConfigError(f"parallel.layout={layout.name!r}: model family {family.name!r} "
                          f"({family.model_class.__name__}) has no plan for this layout yet; layouts it has: "
                          f"{list(family.layouts)} (use {' or '.join(has)}, or parallel=single)")
    world = devices * nodes
    here = CONFIG_KEYS.world(devices, nodes)
    pp, micro, stages = check_stages(par, model, batch)
    try:
        per_node, stage_nodes = stage_devices(pp, devices, nodes, names=CONFIG_KEYS)
        p, dp = resolve_sizes(layout, model, per_node, stage_nodes, par.tensor_parallel_size,
                              par.data_parallel_size, allow_fallback=bool(par.get("allow_fallback", False)),
                              names=CONFIG_KEYS)
    except ValueError as err:
        raise ConfigError(str(err).replace("pipeline_parallel_size", "parallel.pipeline_parallel_size")) from None
    for bad in (layout.batch_problem(p, batch // micro, key="data.batch_size" if micro == 1 else
                                     f"data.batch_size / parallel.microbatches ({batch} / {micro})"),
                layout.sequence_problem(p, seq, key="data.block_size")):
        if bad:
            raise ConfigError(bad)
    bad = layout.dropout_problem(model.dropout, key="model.dropout") or (
        layout.documents_problem(key="data.pack_documents") if packed else None)
    if bad:
        raise ConfigError(bad)
    text = f"layout {layout.name!r}: {stages}{dp} replica(s) x {layout.describe(p)} (p={p}) on {here}"
    if p == 1 and world > 1:
        text += (f" -- note: no {layout.arrangement} larger than 1 fits {devices} devices per machine, so "
                 "each device holds a whole model (data parallel only, parallel.allow_fallback=true)")
    return text, p, dp


# ---- after training ----------------------------------------------------------------------------------------------


def generate_sample(cfg: DictConfig, module, datamodule, trainer) -> str | None:
    """Text continuing ``sample.prompt``; every rank calls it (generation under tensor parallelism is collective)."""
    n = int(cfg.sample.max_new_tokens)
    if n <= 0:
        return None
    if int((cfg.get("parallel") or {}).get("pipeline_parallel_size") or 1) > 1:
        if launch.is_rank_zero():
            log.info("no sample: generation across pipeline stages is not supported (export_hf=<dir>, or resume the "
                     "checkpoint without stages, samples)")
        return None
    tokenizer = datamodule.tokenizer
    if tokenizer is None:
        try:
            tokenizer = get_tokenizer(cfg.data.tokenizer)
        except Exception:  # noqa: BLE001 - e.g. tiktoken missing: no sample, every rank alike
            return None
    ids = tokenizer.encode(str(cfg.sample.prompt)).astype("int64")
    idx = torch.as_tensor(ids if len(ids) else [tokenizer.eot])[None].to(trainer.strategy.root_device)
    top_k = cfg.sample.top_k
    out = module.generate(idx, n, temperature=float(cfg.sample.temperature),
                          top_k=None if top_k is None else int(top_k), seed=int(cfg.seed))
    ids = out[0].tolist()
    known = [i for i in ids if i < tokenizer.vocab_size]  # a model with more ids than the tokenizer (token files
    if len(known) < len(ids) and launch.is_rank_zero():  # of another tokenizer, data.tokenizer left at gpt2)
        log.warning("the sample holds %d ids that data.tokenizer=%s (%d ids) cannot decode, left out: the model has "
                    "%d ids; set data.tokenizer to the tokenizer that made the data (its tokenizer.json)",
                    len(ids) - len(known), cfg.data.tokenizer, tokenizer.vocab_size, module.config.vocab_size)
    return tokenizer.decode(known)


def plot_losses(metrics_csv: Path, png: Path) -> Path | None:
    """``png``: train loss per logged step and validation loss per check, from Lightning's ``metrics.csv``, in step
    order (a resumed run's rows may follow newer ones); the title quotes the newest validation perplexity and its
    step."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        log.warning("no loss plot: matplotlib is not installed (pip install matplotlib)")
        return None
    with open(metrics_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    train = sorted((int(r["step"]), float(r["train_loss"])) for r in rows if r.get("train_loss"))
    val = sorted((int(r["step"]), float(r["val_loss"])) for r in rows if r.get("val_loss"))
    # the newest check: the largest step (of equal steps, the row written last)
    ppl = max(((int(r["step"]), i, float(r["val_perplexity"])) for i, r in enumerate(rows) if r.get("val_perplexity")),
              default=None)
    if not train:
        return None
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    ax.plot(*zip(*train), lw=1, label="train loss")
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats per token)")
    newest = f"   validation perplexity {ppl[2]:.2f} at step {ppl[0]}" if ppl else ""
    ax.set_title(f"{png.parent.parent.name}{newest}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return png


continues_run = launch.continues_run  # whether a resumed run continues in run_dir (the rule lives in launch)


def resume_note(ckpt_path, run_dir: Path) -> str | None:
    """Where a resumed run writes: in the checkpoint's own run directory, or in a new one (``None``: not resuming)."""
    if ckpt_path is None:
        return None
    if continues_run(ckpt_path, run_dir):
        return (f"resuming from {ckpt_path} in its run directory {run_dir} (logs/metrics.csv continues; .hydra/ "
                "now holds this run's config)")
    previous = launch.resume_run_dir(str(ckpt_path))
    why = f"its run directory is {previous}" if previous else "it is not inside a run directory's checkpoints/"
    return f"resuming from {ckpt_path} ({why}); this run writes to {run_dir}"


def newest_checkpoint(checkpoint) -> str:
    """The newest complete checkpoint a ModelCheckpoint wrote ('' if none, or no checkpoint callback)."""
    if checkpoint is None:
        return ""
    return checkpoint.newest() if hasattr(checkpoint, "newest") else checkpoint.last_model_path or \
        checkpoint.best_model_path


def report(cfg: DictConfig, trainer, checkpoint, run_dir: Path, sample: str | None, seconds: float) -> None:
    csv_logger = next((lg for lg in trainer.loggers if isinstance(lg, CSVLogger)), None)
    metrics_csv = Path(csv_logger.log_dir) / "metrics.csv" if csv_logger else None
    lines = [f"tp2d-train: done in {seconds / 60:.1f} min, {trainer.global_step} steps"]
    if metrics_csv is not None and metrics_csv.exists():
        with open(metrics_csv, newline="") as f:
            rows = list(csv.DictReader(f))
        train = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
        ppl = max(((int(r["step"]), i, float(r["val_perplexity"])) for i, r in enumerate(rows)
                   if r.get("val_perplexity")), default=None)  # the newest check, as plot_losses quotes it
        if train:
            lines[0] += f": train_loss {train[0]:.3f} -> {train[-1]:.3f}"
        if ppl:
            lines[0] += f", validation perplexity {ppl[2]:.2f} at step {ppl[0]}"
        lines.append(f"  metrics     {metrics_csv}")
        if cfg.get("plot", True):
            png = plot_losses(metrics_csv, metrics_csv.parent / "loss.png")
            if png:
                lines.append(f"  loss curve  {png}")
    for lg in trainer.loggers:
        if isinstance(lg, TensorBoardLogger):
            lines.append(f"  tensorboard tensorboard --logdir {lg.log_dir}")
        elif isinstance(lg, WandbLogger):
            lines.append(f"  wandb       {Path(lg.save_dir or '.') / 'wandb'}   (an offline run uploads with "
                         "wandb sync <that folder>/offline-run-*)")
    newest = newest_checkpoint(checkpoint)
    if newest:
        lines.append(f"  checkpoint  {newest}   (resume: tp2d-train <same overrides> ckpt_path={newest})")
    if sample is not None:
        (run_dir / "sample.txt").write_text(sample, encoding="utf-8")
        lines.append(f"  sample      {run_dir / 'sample.txt'}")
        lines.append("----- sample " + "-" * 60 + "\n" + sample + "\n" + "-" * 73)
    log.info("\n".join(lines))


def report_interrupt(trainer, checkpoint) -> None:
    """Rank 0, after Lightning stopped the other ranks: drop half-written checkpoints and name the last good one."""
    suffix = staging_path(Path("x")).name[1:]  # what an unfinished save is called
    for partial in Path(checkpoint.dirpath or ".").glob(f"*{suffix}") if checkpoint is not None else ():
        clear(partial)
    newest = newest_checkpoint(checkpoint)
    where = (f"the last complete checkpoint is {newest} (resume: tp2d-train <same overrides> ckpt_path={newest})"
             if newest else "no checkpoint had been written yet")
    log.warning("tp2d-train: interrupted at step %d; %s", trainer.global_step, where)


if __name__ == "__main__":
    main()
