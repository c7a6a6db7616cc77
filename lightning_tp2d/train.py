"""``tp2d-train`` (also ``python -m lightning_tp2d.train``): train GPT-2 with tensor parallelism from the command line.

With no arguments it trains ``gpt2`` (124M) on every GPU of the machine (NCCL, bf16-mixed), or ``gpt2-mini`` on 4
CPU processes (gloo, one 2x2 grid of the "2d" layout), on the Python documentation with the byte tokenizer. A run
leaves in ``outputs/<date>/<time>/``: ``logs/metrics.csv`` (train_loss, val_loss, val_perplexity, speed),
``logs/loss.png``, ``logs/tensorboard/`` (when tensorboard is installed), ``checkpoints/`` (``last.ckpt`` links the
newest), ``sample.txt`` (the generated text, also printed), Hydra's ``.hydra/`` and ``train.log``.

The configuration is ``conf/`` (groups model, parallel, trainer, data, experiment; every key commented; objects
built from ``_target_``). Before any process starts, :func:`check_config` turns configurations that cannot run
into one message naming the numbers and a choice that fits. How the processes of a job share one run directory,
and how sweeps run, is :mod:`lightning_tp2d.launch`.
"""

from __future__ import annotations

import csv
import importlib.util
import logging
import math
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import MissingMandatoryValue

from lightning_tp2d import launch
from lightning_tp2d.errors import CommError, DivergenceError

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
    # Lightning before Hydra sets up logging (`import lightning_tp2d` no longer imports it): loaded under Hydra's
    # root handler, Lightning would print each of its messages twice, in its format and in Hydra's
    import lightning.pytorch  # noqa: F401
    launch.register_resolvers()
    sys.argv = launch.prepare_argv(sys.argv)
    if launch.started_by_this_job():
        launch.watch_parent()
    if launch.is_rank_zero():
        launch.check_master_port()
        launch.check_override_keys(sys.argv)
    _hydra_main()


def run(cfg: DictConfig) -> float | None:
    """The Hydra task: one training job; returns the last validation loss (for sweepers)."""
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    if multirun and hc.runtime.choices.get("hydra/launcher") != "basic":
        raise SystemExit("tp2d-train: --multirun needs Hydra's basic launcher (jobs one after the other): each job "
                         "starts its own processes on all devices, so jobs cannot run side by side")
    run_dir = Path(hc.runtime.output_dir)
    with launch.job_environment(run_dir, list(hc.overrides.task), multirun):
        try:
            return train(cfg, run_dir)
        except ConfigError as err:
            print(f"tp2d-train: error: {err}", file=sys.stderr)
            if launch.is_rank_zero():
                launch.remove_unused_run_dir(run_dir)
            sys.exit(2)
        except (DivergenceError, CommError) as err:  # one line, not a traceback per rank
            if isinstance(err, CommError) or launch.is_rank_zero():  # every rank's CommError names its own call
                print(f"tp2d-train: error: {err}", file=sys.stderr, flush=True)
            sys.exit(1)


_hydra_main = hydra.main(version_base="1.3", config_path=str(launch.CONF_DIR), config_name="config")(run)


# ---- the job -----------------------------------------------------------------------------------------------------


def train(cfg: DictConfig, run_dir: Path) -> float | None:
    started = time.monotonic()
    import lightning.pytorch as L
    from hydra.utils import instantiate

    import lightning_tp2d  # noqa: F401  (registers the strategy names)
    from lightning_tp2d.callbacks import GracefulInterrupt, SpeedMonitor

    rank_zero = launch.is_rank_zero()
    try:
        model_config = instantiate(cfg.model)
    except Exception as err:  # noqa: BLE001 - GPT2Config's ValueError, wrapped by Hydra
        raise ConfigError(f"model: {err.__cause__ or err}") from err
    plan = check_config(cfg, model_config)
    if rank_zero:
        log.info("tp2d-train: %s", plan)
        log.info("run directory: %s", run_dir)

    steps, every = int(cfg.trainer.max_steps), int(cfg.trainer.log_every_n_steps)
    if 0 < steps < every:  # a run shorter than the logging interval would log nothing: no metrics.csv, no plot
        with open_dict(cfg):
            cfg.trainer.log_every_n_steps = steps
        if rank_zero:
            log.info("trainer.max_steps=%d < trainer.log_every_n_steps=%d: logging every %d steps", steps, every, steps)

    # Lightning 2.6 under torch >= 2.10 warns about its own pytree use once per rank: not the user's business
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    L.seed_everything(cfg.seed, verbose=False)
    datamodule = instantiate(cfg.data)
    module = instantiate(cfg.module)
    checkpoint = instantiate(cfg.checkpoint, dirpath=cfg.checkpoint.dirpath or str(run_dir / "checkpoints"))
    interrupt = GracefulInterrupt()
    callbacks = [interrupt, instantiate(cfg.divergence), checkpoint] + ([SpeedMonitor()] if cfg.logging.speed else [])
    if cfg.trainer.enable_progress_bar:
        callbacks.append(instantiate(cfg.progress_bar))
    trainer = instantiate(cfg.trainer, strategy=instantiate(cfg.parallel), logger=make_loggers(cfg.logging, run_dir),
                          callbacks=callbacks, default_root_dir=str(run_dir))
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    except SystemExit:  # Lightning's Ctrl-C handling ends with sys.exit(1)
        if rank_zero and trainer.interrupted:
            report_interrupt(trainer, checkpoint)
        raise
    if trainer.interrupted:
        if rank_zero:
            report_interrupt(trainer, checkpoint)
        return None
    if interrupt.stopped:  # Ctrl-C, handled at a step boundary on every rank
        if not rank_zero:
            return None  # exit 0: Lightning's launcher kills the whole job when a child rank exits non-zero
        report_interrupt(trainer, checkpoint)
        wait_for_ranks(trainer)
        # Ctrl-C: 1; preemption: 128 + signal (143 for SIGTERM), what a killed process reports, so requeue scripts
        # tell "stopped and saved, run me again" from a failure
        sys.exit(1 if interrupt.signum == signal.SIGINT else 128 + interrupt.signum)

    sample = generate_sample(cfg, module, datamodule, trainer)  # collective: every rank of a grid takes part
    if rank_zero:
        report(cfg, trainer, checkpoint, run_dir, sample, time.monotonic() - started)
    wait_for_ranks(trainer)
    val_loss = trainer.callback_metrics.get("val_loss")
    return float(val_loss) if val_loss is not None else None


def make_loggers(cfg_logging: DictConfig, run_dir: Path) -> list:
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    loggers = []
    if cfg_logging.csv:
        loggers.append(CSVLogger(save_dir=run_dir, name="logs", version=""))  # logs/metrics.csv, logs/hparams.yaml
    tensorboard = cfg_logging.tensorboard
    if tensorboard == "auto":
        tensorboard = any(importlib.util.find_spec(m) for m in ("tensorboard", "tensorboardX"))
    if tensorboard:
        loggers.append(TensorBoardLogger(save_dir=run_dir, name="logs", version="tensorboard", default_hp_metric=False))
    return loggers


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
    if cfg.ckpt_path is not None:
        from lightning_tp2d.checkpoint import resolve

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
    tokens_file = path is not None and str(path).endswith(".bin")
    if path is not None and not Path(str(path)).expanduser().exists():
        raise ConfigError(f"data.path={str(path)!r} does not exist (looked for {Path(str(path)).expanduser().absolute()}; "
                          f"relative paths start from the directory tp2d-train runs in, {os.getcwd()})")
    if path is not None:
        from lightning_tp2d.data import check_path

        try:
            check_path(str(path), vocab_size=model.vocab_size)
        except ValueError as err:
            raise ConfigError(f"data.path: {err}") from None
    ids = None if tokens_file else TOKENIZER_IDS.get(data.tokenizer)
    if ids is not None and ids > model.vocab_size:
        raise ConfigError(f"data.tokenizer={data.tokenizer} makes {ids} token ids but model.vocab_size="
                          f"{model.vocab_size}: use a model with vocab_size >= {ids} (model=gpt2 or larger) or "
                          "data.tokenizer=byte")
    seq, batch = int(data.block_size), int(data.batch_size)
    if seq > model.block_size:
        raise ConfigError(f"data.block_size={seq} exceeds model.block_size={model.block_size} (the positions the "
                          f"model can embed): lower data.block_size or set model.block_size={seq}")
    devices, nodes = device_count(tr.devices, str(tr.accelerator)), int(tr.num_nodes)
    node_rank = launch._int(os.environ, "NODE_RANK", launch._int(os.environ, "GROUP_RANK"))
    if node_rank >= nodes:
        raise ConfigError(f"NODE_RANK={node_rank} but trainer.num_nodes={nodes}: set trainer.num_nodes to the number "
                          f"of machines (at least {node_rank + 1}) on every machine")
    where = f"{tr.accelerator}, {tr.precision}; {batch} x {seq} tokens per step and replica"
    if "layout" not in cfg.parallel:  # parallel=single
        if devices is not None and devices * nodes != 1:
            raise ConfigError(f"parallel=single runs one process, but trainer.devices={devices} x trainer.num_nodes="
                              f"{nodes} = {devices * nodes}: use trainer.devices=1, or a tensor-parallel layout "
                              "(parallel=tp2d)")
        return f"plain GPT-2 ({model.n_layer} layers, {model.n_embd} wide) on one device ({where})"
    if devices is None:
        return f"layout {cfg.parallel.layout!r} on trainer.devices={tr.devices} ({where})"
    return check_layout(cfg.parallel, model, devices, nodes, batch, seq) + f" ({where})"


def check_layout(par: DictConfig, model, devices: int, nodes: int, batch: int, seq: int) -> str:
    from lightning_tp2d.layouts import get_layout

    try:
        layout = get_layout(str(par.layout))
    except ValueError as err:
        raise ConfigError(f"parallel.layout: {err}") from None
    world = devices * nodes
    here = f"trainer.devices={devices} x trainer.num_nodes={nodes} = {world} processes"

    def problem(p: int) -> str | None:
        return layout.size_problem(p) or "; ".join(layout.model_problems(p, model.n_head, model.n_embd, "model.")) or None

    fitting = [p for p in range(1, world + 1) if world % p == 0 and problem(p) is None]
    tp, dp = par.tensor_parallel_size, par.data_parallel_size
    if tp == "auto" and dp == "auto":
        p = layout.auto_tensor_parallel_size(devices, world, model)
    elif tp == "auto":
        if world % int(dp):
            raise ConfigError(f"parallel.data_parallel_size={dp} does not divide the {here}; use one of "
                              f"{[d for d in range(1, world + 1) if world % d == 0]}")
        p = world // int(dp)
    else:
        p = int(tp)
    if problem(p):
        raise ConfigError(f"parallel.tensor_parallel_size={p}: {problem(p)}; sizes that fit this model on {world} "
                          f"processes: parallel.tensor_parallel_size in {fitting}")
    if world % p:
        more = p * math.ceil(devices / p) if nodes == 1 else p
        raise ConfigError(f"parallel.tensor_parallel_size={p} needs a multiple of {p} processes, but {here}; use "
                          f"trainer.devices={more}, or parallel.tensor_parallel_size in {fitting}")
    if dp != "auto" and p * int(dp) != world:
        raise ConfigError(f"parallel.data_parallel_size={dp} x tensor_parallel_size={p} = {p * int(dp)} processes, "
                          f"but {here}; use parallel.data_parallel_size={world // p} (or auto)")
    for bad in (layout.batch_problem(p, batch, key="data.batch_size"),
                layout.sequence_problem(p, seq, key="data.block_size")):
        if bad:
            raise ConfigError(bad)
    if model.dropout and not layout.supports_dropout:
        raise ConfigError(f"model.dropout={model.dropout}: layout {layout.name!r} does not support dropout; set "
                          "model.dropout=0")
    text = f"layout {layout.name!r}: {world // p} replica(s) x {layout.describe(p)} (p={p}) on {here}"
    if p == 1 and world > 1:
        text += (f" -- note: no {layout.arrangement} larger than 1 fits {devices} devices per machine, so "
                 "each device holds a whole model (data parallel only)")
    return text


# ---- after training ----------------------------------------------------------------------------------------------


def generate_sample(cfg: DictConfig, module, datamodule, trainer) -> str | None:
    """Text continuing ``sample.prompt``; every rank calls it (generation under tensor parallelism is collective)."""
    import torch

    from lightning_tp2d.data import get_tokenizer

    n = int(cfg.sample.max_new_tokens)
    if n <= 0:
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
    return tokenizer.decode(out[0].tolist())


def plot_losses(metrics_csv: Path, png: Path) -> Path | None:
    """``png``: train loss per logged step and validation loss per check, from Lightning's ``metrics.csv``."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        log.warning("no loss plot: matplotlib is not installed (pip install matplotlib)")
        return None
    with open(metrics_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    train = [(int(r["step"]), float(r["train_loss"])) for r in rows if r.get("train_loss")]
    val = [(int(r["step"]), float(r["val_loss"])) for r in rows if r.get("val_loss")]
    ppl = [float(r["val_perplexity"]) for r in rows if r.get("val_perplexity")]
    if not train:
        return None
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    ax.plot(*zip(*train), lw=1, label="train loss")
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.set_title(f"{png.parent.parent.name}" + (f"   final validation perplexity {ppl[-1]:.2f}" if ppl else ""))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return png


def report(cfg: DictConfig, trainer, checkpoint, run_dir: Path, sample: str | None, seconds: float) -> None:
    metrics_csv = run_dir / "logs" / "metrics.csv"
    lines = [f"tp2d-train: done in {seconds / 60:.1f} min, {trainer.global_step} steps"]
    if metrics_csv.exists():
        with open(metrics_csv, newline="") as f:
            rows = list(csv.DictReader(f))
        train = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
        ppl = [float(r["val_perplexity"]) for r in rows if r.get("val_perplexity")]
        if train:
            lines[0] += f": train_loss {train[0]:.3f} -> {train[-1]:.3f}"
        if ppl:
            lines[0] += f", validation perplexity {ppl[-1]:.2f}"
        lines.append(f"  metrics     {metrics_csv}")
        if cfg.logging.plot:
            png = plot_losses(metrics_csv, run_dir / "logs" / "loss.png")
            if png:
                lines.append(f"  loss curve  {png}")
    if (run_dir / "logs" / "tensorboard").exists():
        lines.append(f"  tensorboard tensorboard --logdir {run_dir / 'logs' / 'tensorboard'}")
    newest = checkpoint.newest()
    if newest:
        lines.append(f"  checkpoint  {newest}   (resume: tp2d-train <same overrides> ckpt_path={newest})")
    if sample is not None:
        (run_dir / "sample.txt").write_text(sample, encoding="utf-8")
        lines.append(f"  sample      {run_dir / 'sample.txt'}")
        lines.append("----- sample " + "-" * 60 + "\n" + sample + "\n" + "-" * 73)
    log.info("\n".join(lines))


def report_interrupt(trainer, checkpoint) -> None:
    """Rank 0, after Lightning stopped the other ranks: drop half-written checkpoints and name the last good one."""
    from lightning_tp2d.checkpoint import clear, staging_path

    suffix = staging_path(Path("x")).name[1:]  # what an unfinished save is called
    for partial in Path(checkpoint.dirpath or ".").glob(f"*{suffix}"):
        clear(partial)
    newest = checkpoint.newest()
    where = (f"the last complete checkpoint is {newest} (resume: tp2d-train <same overrides> ckpt_path={newest})"
             if newest else "no checkpoint had been written yet")
    log.warning("tp2d-train: interrupted at step %d; %s", trainer.global_step, where)


def wait_for_ranks(trainer, timeout: float = 120.0) -> None:
    """Wait for the ranks Lightning started (so the command ends when the whole job has)."""
    for proc in getattr(trainer.strategy.launcher, "procs", None) or []:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
