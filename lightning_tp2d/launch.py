"""Hydra and the processes of one ``tp2d-train`` job: the run directory, ranks, sweeps, ``auto`` values, key checks.

Lightning starts the other local ranks of a job by re-running the command line; torchrun, SLURM or a second
machine start them on their own. Under Hydra each of those processes composes the config again and would create
its own timestamped run directory. The rules here:

* Global rank 0 (the command the user typed, or rank 0 of torchrun / SLURM) owns the run directory
  ``outputs/<date>/<time>/`` and writes Hydra's files (``.hydra/``, ``train.log``) into it.
* Every other process writes no Hydra files (``hydra.output_subdir=null``, log to the console) and uses rank 0's
  directory: ranks that tp2d-train starts inherit it as ``TP2D_RUN_DIR`` (and Lightning adds ``hydra.run.dir=``);
  ranks that a launcher starts use ``TP2D_RUN_DIR`` when it is exported (the recipes do) and otherwise the working
  directory, where they create nothing: the checkpoint directory is broadcast from rank 0.
* A run resumed from a checkpoint in a run directory (``ckpt_path=<run>/checkpoints/last.ckpt``) continues in that
  directory: rank 0 sets ``TP2D_RUN_DIR`` to it before Hydra starts (:func:`pin_resume_run_dir`).
* ``--multirun`` runs the jobs one after the other in the first process. For each job the re-run command of the
  other ranks is that job's own overrides (one plain run in the job's folder), and the process group and the
  environment are reset between jobs. Under an external launcher (torchrun, SLURM, several machines) each process
  would run the whole sweep, so sweeps are refused there.

Nothing here imports torch or Lightning at import time: ``tp2d-train --cfg job`` stays quick.
"""

from __future__ import annotations

import difflib
import functools
import os
import sys
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from pathlib import Path

from omegaconf import OmegaConf

SOURCE_CONF_DIR = Path(__file__).resolve().parents[1] / "conf"  # <checkout>/conf
PACKAGE_CONF_DIR = Path(__file__).resolve().parent / "conf"  # <site-packages>/lightning_tp2d/conf


def _find_conf_dir() -> Path:
    """The Hydra configs: a source checkout's top-level ``conf/`` (users edit it there, and editable installs read it
    there), else the copy that the wheel ships as the package data ``lightning_tp2d/conf``."""
    if (SOURCE_CONF_DIR.parent / "pyproject.toml").is_file() and (SOURCE_CONF_DIR / "config.yaml").is_file():
        return SOURCE_CONF_DIR
    return PACKAGE_CONF_DIR


CONF_DIR = _find_conf_dir()
RUN_DIR_ENV = "TP2D_RUN_DIR"
CPU_PROCESSES = 4  # the CPU default: one 2x2 grid
GPU_MODEL, CPU_MODEL = "gpt2", "gpt2-mini"
CPU_MEMORY_GIB = 1.0  # parallel=auto without GPUs: the memory per CPU process the plan may fill
# flags after which tp2d-train does not check override keys (other config sources, or nothing is composed)
_NO_KEY_CHECK = ("-h", "--help", "--hydra-help", "--version", "-i", "--info", "-sc", "--shell-completion", "-cd",
                 "--config-dir", "-cp", "--config-path", "-cn", "--config-name", "--experimental-rerun")


# ---- who is who --------------------------------------------------------------------------------------------------


def _int(env: Mapping[str, str], name: str, default: int = 0) -> int:
    try:
        return int(env.get(name, default))
    except ValueError:
        return default


def slurm_tasks(env: Mapping[str, str] = os.environ) -> bool:
    """Inside an ``srun`` step with several tasks (what Lightning's SLURM environment joins)."""
    return "SLURM_PROCID" in env and _int(env, "SLURM_NTASKS", 1) > 1


def is_rank_zero(env: Mapping[str, str] = os.environ) -> bool:
    """Whether this process is (or will become) global rank 0 of the job."""
    names = ["RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK"] + (["SLURM_PROCID"] if slurm_tasks(env) else [])
    return all(_int(env, name) == 0 for name in names)


def external_launch(env: Mapping[str, str] = os.environ) -> str | None:
    """Why this process is one of several started outside tp2d-train (``None`` when tp2d-train starts them)."""
    if "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env):
        return "it was started by torchrun (or another launcher that sets RANK and WORLD_SIZE)"
    if slurm_tasks(env):
        return "it runs as one of several SLURM tasks"
    if "LOCAL_RANK" in env:
        return "it is one of the processes of a running job (LOCAL_RANK is set)"
    if "NODE_RANK" in env or "GROUP_RANK" in env:
        return "it is one machine of a multi-node job (NODE_RANK is set)"
    return None


# ---- rendezvous --------------------------------------------------------------------------------------------------


def check_master_port(env: Mapping[str, str] = os.environ) -> None:
    """On the process that starts a job's ranks itself: an exported ``MASTER_PORT`` that something on this machine
    already listens on (another job's rendezvous) is refused, since this job's ranks would join that job's store
    and hang. Without ``MASTER_PORT`` Lightning picks a free port."""
    if external_launch(env) or "MASTER_PORT" not in env:
        return
    import socket

    port = _int(env, "MASTER_PORT", -1)
    if not 0 < port < 65536:
        raise SystemExit(f"tp2d-train: MASTER_PORT={env['MASTER_PORT']!r} is not a port number (1..65535)")
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as err:
            raise SystemExit(f"tp2d-train: MASTER_PORT={port} is already in use on this machine ({err.strerror}): "
                             "another job's ranks are listening there, and this job's would join them. Unset "
                             "MASTER_PORT (tp2d-train then picks a free port) or export another one.") from None


class SurvivingStream:
    """A text stream (``sys.stdout`` / ``sys.stderr``) that outlives its reader. ``tp2d-train ... | tee run.log``:
    Ctrl-C reaches ``tee`` too, and the next write to the closed pipe raised ``BrokenPipeError`` wherever it happened
    (a progress bar, a log line, a signal handler's print), so rank 0 died mid-step, the other ranks failed with
    "Connection closed by peer" and the interrupted step was never saved. Here the first write or flush that finds
    the pipe closed points the file descriptor at ``/dev/null`` (for every writer of this process: Python's
    buffered files, logging handlers that hold the original stream, C code) and carries on; ``train.log`` still
    gets every line. Everything else is the wrapped stream's."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._discard()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._discard()

    def _discard(self) -> None:
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, self._stream.fileno())
        finally:
            os.close(null)
        try:
            self._stream.flush()  # what was buffered for the closed pipe goes to /dev/null now
        except OSError:
            pass

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def survive_closed_output() -> None:
    """Wrap ``sys.stdout`` and ``sys.stderr`` in :class:`SurvivingStream` (idempotent), before Hydra's logging
    handlers and the progress bar pick them up."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, SurvivingStream):
            setattr(sys, name, SurvivingStream(stream))


def watch_parent(poll_s: float = 1.0, name: str = "tp2d-train") -> None:
    """In a rank that the job's first process started: exit when that process is gone (``kill -9`` of rank 0
    during start-up would otherwise leave this rank waiting in the rendezvous until the process-group timeout)."""
    import threading
    import time

    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                print(f"{name}: the job's first process (pid {parent}) is gone; this rank (pid {os.getpid()}) exits",
                      file=sys.stderr, flush=True)
                os._exit(1)

    threading.Thread(target=watch, name="tp2d-parent-watch", daemon=True).start()


def started_by_this_job(env: Mapping[str, str] = os.environ) -> bool:
    """A rank that tp2d-train's own launcher started (rank 0 passes ``TP2D_RUN_DIR`` to them), not a torchrun /
    SLURM task."""
    return RUN_DIR_ENV in env and _int(env, "LOCAL_RANK") > 0 and "TORCHELASTIC_RUN_ID" not in env \
        and not slurm_tasks(env)


# ---- command lines -----------------------------------------------------------------------------------------------


def _is_multirun(args: list[str]) -> bool:
    return any(a in ("-m", "--multirun") or a == "hydra.mode=MULTIRUN" for a in args)


def _override_keys(args: list[str]) -> set[str]:
    return {a.split("=", 1)[0].lstrip("+~") for a in args if "=" in a and not a.startswith("-")}


PATH_KEYS = ("ckpt_path", "data.path", "data.val_path", "callbacks.model_checkpoint.dirpath")


def quote_path_override(arg: str) -> str:
    """``ckpt_path=.../step=20.ckpt`` (our own checkpoint names hold ``=``) quoted for Hydra's override grammar,
    which would refuse the bare value; already quoted values and other overrides pass unchanged."""
    key, sep, value = arg.partition("=")
    if not sep or key.lstrip("+~") not in PATH_KEYS or "=" not in value or value[:1] in ("'", '"'):
        return arg
    if "'" in value:
        return arg  # leave what we cannot quote simply to Hydra's own message
    return f"{key}='{value}'"


NULL_MODEL = "module.model=null"  # what `model=null` stands for: the model of module.init_from's config.json


def prepare_argv(argv: list[str], env: Mapping[str, str] = os.environ) -> list[str]:
    """The command line Hydra should parse in this process (see the module docstring): paths holding ``=`` quoted,
    ``model=null`` read as :data:`NULL_MODEL` (Hydra cannot drop a group the config interpolates). Refuses sweeps
    that every process of an externally launched job would run on its own."""
    argv = [argv[0], *(NULL_MODEL if a == "model=null" else quote_path_override(a) for a in argv[1:])]
    args = argv[1:]
    why = external_launch(env)
    if _is_multirun(args) and why:
        raise SystemExit(f"tp2d-train: --multirun is not supported here: {why}, and every process would run the "
                         "whole sweep. Launch one job per sweep point (a shell loop around torchrun / srun), or run "
                         "the sweep on one machine without a launcher (tp2d-train starts the processes of each job).")
    if is_rank_zero(env):
        return list(argv)
    keys, extra = _override_keys(args), []
    if "hydra.output_subdir" not in keys:
        extra.append("hydra.output_subdir=null")  # no .hydra/ of its own
    if "hydra/job_logging" not in keys:
        extra.append("hydra/job_logging=stdout")  # no log file of its own
    if RUN_DIR_ENV not in env and "hydra.run.dir" not in keys:
        extra.append("hydra.run.dir=.")  # rank 0's directory is unknown here: create none (checkpoints are broadcast)
    return list(argv) + extra


def resume_run_dir(ckpt_path: str) -> Path | None:
    """The tp2d-train run directory a checkpoint was saved in: ``<run>/checkpoints/<name>`` where ``<run>/.hydra``
    exists (``None`` for a checkpoint anywhere else, e.g. a ``callbacks.model_checkpoint.dirpath`` of its own)."""
    path = Path(ckpt_path.strip().strip("'\"")).expanduser()  # not resolved: last.ckpt links into the same folder
    run = path.parent.parent
    return run if path.parent.name == "checkpoints" and (run / ".hydra").is_dir() else None


def continues_run(ckpt_path, run_dir: Path) -> bool:
    """Whether a run resuming from ``ckpt_path`` continues in ``run_dir`` itself: the checkpoint lies in its
    ``checkpoints/`` (tp2d-train pins a resumed run's directory to the checkpoint's: :func:`pin_resume_run_dir`)."""
    previous = None if ckpt_path is None else resume_run_dir(str(ckpt_path))
    return previous is not None and previous.resolve() == Path(run_dir).resolve()


def pin_resume_run_dir(args: list[str], env: MutableMapping[str, str] = os.environ) -> Path | None:
    """On rank 0 before Hydra starts: a run resumed from a checkpoint inside a run directory (``ckpt_path=<run>/
    checkpoints/last.ckpt``) continues in that directory, so its metrics, checkpoints and log stay together: set
    ``TP2D_RUN_DIR`` (what ``hydra.run.dir`` reads). Not when ``TP2D_RUN_DIR`` or ``hydra.run.dir`` is given, nor in
    a sweep (one folder per job). Returns the directory pinned (``None``: Hydra makes a new one; the job says
    so)."""
    if RUN_DIR_ENV in env or "hydra.run.dir" in _override_keys(args) or _is_multirun(args):
        return None
    ckpt = [a.split("=", 1)[1] for a in args if "=" in a and a.split("=", 1)[0].lstrip("+~") == "ckpt_path"]
    run = resume_run_dir(ckpt[-1]) if ckpt and ckpt[-1].strip("'\"") not in ("", "null") else None
    if run is not None:
        env[RUN_DIR_ENV] = str(run)
    return run


def given_run_dir(args: list[str], env: Mapping[str, str] = os.environ) -> tuple[str, Path] | None:
    """The run directory a command line names before Hydra creates it, and where it is named: ``("hydra.run.dir",
    path)`` for the last such override (``None`` when its value interpolates, ``${...}``: only Hydra knows it), else
    ``("TP2D_RUN_DIR", path)`` when that is exported; ``None`` otherwise and in a sweep (a folder per job)."""
    if _is_multirun(args):
        return None
    given = [a.split("=", 1)[1] for a in args if "=" in a and not a.startswith("-")
             and a.split("=", 1)[0].lstrip("+~") == "hydra.run.dir"]
    if given:
        value = given[-1].strip().strip("'\"")
        return None if "${" in value or not value else ("hydra.run.dir", Path(value).expanduser())
    return (RUN_DIR_ENV, Path(env[RUN_DIR_ENV]).expanduser()) if env.get(RUN_DIR_ENV) else None


def given_value(args: list[str], key: str) -> str | None:
    """The value of the last ``key=value`` override in ``args``, quotes stripped (``None``: not given, or null)."""
    given = [a.split("=", 1)[1] for a in args if "=" in a and a.split("=", 1)[0].lstrip("+~") == key]
    value = given[-1].strip().strip("'\"") if given else ""
    return None if value in ("", "null") else value


@contextmanager
def job_environment(run_dir: Path, task_overrides: list[str], multirun: bool) -> Iterator[None]:
    """Around one job on rank 0: pin the run directory for the ranks Lightning starts (``TP2D_RUN_DIR``); in a sweep,
    make their command line this job's overrides only; afterwards (every rank) end the process group and restore the environment
    (Lightning leaves ``LOCAL_RANK``, ``MASTER_PORT`` ... behind, which would make the next job's ranks wait for
    processes that never come)."""
    saved_env, saved_argv = dict(os.environ), list(sys.argv)
    if is_rank_zero():
        os.environ[RUN_DIR_ENV] = str(run_dir)
        if multirun:
            sys.argv = [sys.argv[0], *task_overrides]
    try:
        yield
    finally:
        # every process ends its process group before exiting: a gloo group left to interpreter shutdown can
        # abort the process ("terminate called without an active exception"), and Lightning's launcher then
        # kills the whole job although training finished
        end_process_group()
        for key in set(os.environ) - set(saved_env):
            del os.environ[key]
        os.environ.update(saved_env)
        sys.argv = saved_argv


def remove_unused_run_dir(run_dir: Path) -> None:
    """Delete a run directory that holds only what Hydra put there (a job refused before it started)."""
    if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= {".hydra", "train.log"}:
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)
        cwd = Path.cwd().resolve()
        for parent in run_dir.resolve().parents:  # outputs/<date>/ and outputs/ when now empty, below the cwd
            if parent == cwd or cwd not in parent.parents or any(parent.iterdir()):
                break
            parent.rmdir()


def end_process_group() -> None:
    if "torch" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# ---- `auto` values ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@functools.lru_cache(maxsize=None)
def _cuda_bf16() -> bool:
    import torch

    return _cuda_devices() > 0 and torch.cuda.is_bf16_supported()


def _slurm_tasks_per_node(env: Mapping[str, str]) -> int:
    raw = env.get("SLURM_NTASKS_PER_NODE", "")
    digits = raw.split("(")[0]  # "8" or "8(x2)"
    if digits.isdigit():
        return int(digits)
    return max(1, _int(env, "SLURM_NTASKS", 1) // max(1, _int(env, "SLURM_NNODES", 1)))


def auto_value(key: str, env: Mapping[str, str] | None = None):
    """``${tp2d.auto:key}``: what this machine and launcher call for (trainer/auto.yaml documents each key)."""
    env = os.environ if env is None else env
    torchrun = "LOCAL_WORLD_SIZE" in env and "WORLD_SIZE" in env
    if key == "accelerator":
        return "gpu" if _cuda_devices() else "cpu"
    if key == "devices":
        if torchrun:
            return _int(env, "LOCAL_WORLD_SIZE", 1)
        if slurm_tasks(env):
            return _slurm_tasks_per_node(env)
        return _cuda_devices() or CPU_PROCESSES
    if key == "num_nodes":
        if torchrun:
            return max(1, _int(env, "WORLD_SIZE", 1) // max(1, _int(env, "LOCAL_WORLD_SIZE", 1)))
        if slurm_tasks(env):
            return _int(env, "SLURM_NNODES", _int(env, "SLURM_JOB_NUM_NODES", 1))
        return 1
    if key == "precision":
        return "bf16-mixed" if _cuda_bf16() else "32-true"
    if key == "model":
        return GPU_MODEL if _cuda_devices() else CPU_MODEL
    if key == "memory_gib":  # None: each GPU's total memory (TP2DStrategy's default on CUDA)
        return None if _cuda_devices() else CPU_MEMORY_GIB
    raise ValueError(f"${{tp2d.auto:{key}}}: unknown key; use accelerator, devices, num_nodes, precision, model or "
                     "memory_gib")


def torch_device(accelerator: str) -> str:
    """``${tp2d.device:accelerator}``: the torch device of a one-device run on ``trainer.accelerator``."""
    if accelerator in ("gpu", "cuda"):
        return "cuda:0"
    if accelerator == "auto":
        return "cuda:0" if _cuda_devices() else "cpu"
    return accelerator


def init_tokenizer(init_from, default: str = "byte") -> str:
    """``${tp2d.tokenizer:${module.init_from}[,default]}``, the data groups' ``tokenizer``: the ``tokenizer.json`` of
    the transformers directory ``init_from`` when it holds one, else ``default`` (a ``data.tokenizer=`` given
    replaces it)."""
    if init_from is not None:
        file = Path(str(init_from)).expanduser() / "tokenizer.json"
        if file.is_file():
            return str(file)
    return default


def register_resolvers() -> None:
    OmegaConf.register_new_resolver("tp2d.auto", auto_value, replace=True)
    OmegaConf.register_new_resolver("tp2d.tokenizer", init_tokenizer, replace=True)
    OmegaConf.register_new_resolver("tp2d.device", torch_device, replace=True)


# ---- override keys ----------------------------------------------------------------------------------------------


# keys of earlier versions, now in the callbacks/ and logger/ groups: renamed (the keys below them too) ...
RENAMED_KEYS = {"checkpoint": "callbacks.model_checkpoint", "divergence": "callbacks.divergence_guard",
                "progress_bar": "callbacks.progress_bar", "logging.plot": "plot"}
# ... or replaced by a choice
REPLACED_KEYS = {"logging.speed": "callbacks.speed_monitor=null to turn speed logging off",
                 "logging.csv": "logger=<option> without csv (e.g. logger=tensorboard), or logger.csv=null",
                 "logging.tensorboard": "logger=tensorboard or logger=many_loggers (logger.tensorboard=null: off)",
                 "logging": "logger=<option> (logger/: csv, tensorboard, wandb, many_loggers) and plot"}


def moved_key_message(key: str, line: str) -> str | None:
    """What an override of a key that moved to the callbacks/ or logger/ group is called now (``None``: not moved)."""
    now = next((new + key[len(old):] for old, new in RENAMED_KEYS.items()
                if key == old or key.startswith(old + ".")), None)
    now = now or next((new for old, new in REPLACED_KEYS.items() if key == old or key.startswith(old + ".")), None)
    if now is None:
        return None
    return (f"tp2d-train: {key!r} (in {line!r}) has moved; now: {now} (callbacks and loggers are the callbacks/ "
            "and logger/ config groups, see conf/README.md)")


def group_option_hint(conf_dir: Path, key: str) -> str | None:
    """For ``callbacks.early_stopping.patience=5`` when ``early_stopping`` is an option of ``callbacks/`` that the
    run does not use: how to add it."""
    parts = key.split(".")
    if len(parts) >= 2 and parts[0] in ("callbacks", "logger") and (conf_dir / parts[0] / f"{parts[1]}.yaml").is_file():
        return (f"  {parts[1]!r} is an option of {parts[0]}/ that this run does not use: list it with the others, "
                f"e.g. '{parts[0]}=[default,{parts[1]}]'")
    return None


def config_groups(conf_dir: Path = CONF_DIR) -> list[str]:
    return sorted(p.name for p in conf_dir.iterdir() if p.is_dir())


def unknown_key_message(cfg: dict, key: str, line: str) -> str | None:
    """``None`` when ``key`` (dotted) exists in the plain container ``cfg``; else what to write instead."""
    node, parts = cfg, key.split(".")
    for depth, part in enumerate(parts):
        if isinstance(node, dict) and part in node:
            node = node[part]
            continue
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
            continue
        parent = ".".join(parts[:depth])
        siblings = sorted(node) if isinstance(node, dict) else []
        where = f"keys under {parent!r}" if parent else "top-level keys"
        msg = [f"tp2d-train: unknown config key {key!r} (in {line!r})."]
        if siblings:
            msg.append(f"  {where}: {', '.join(siblings)}")
            close = difflib.get_close_matches(part, siblings, n=3)
            if close:
                msg.append("  did you mean " + " or ".join(".".join(parts[:depth] + [c]) for c in close) + "?")
        elif parent:
            msg.append(f"  {parent!r} is a value, not a group of keys")
        msg.append(f"  (to add a key the config does not have, write +{line})")
        return "\n".join(msg)
    return None


def group_options(conf_dir: Path, group: str) -> list[str]:
    """The options of the config group ``group`` (its ``.yaml`` files), sorted."""
    return sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))


def choice_problem(conf_dir: Path, group: str, option, line: str) -> str | None:
    """One line when ``option`` (a name, or a list of names) is not an option of ``group``, naming the valid ones
    (``None``: it is, or null)."""
    for name in option if isinstance(option, list) else [option]:
        if name is None or not isinstance(name, str) or (conf_dir / group / f"{name}.yaml").is_file():
            continue
        options = group_options(conf_dir, group)
        close = difflib.get_close_matches(name, options, n=1)
        return (f"tp2d-train: error: {line}: {group}/ has no option {name!r}; its options: {', '.join(options)}"
                + (f" (did you mean {group}={close[0]}?)" if close else ""))
    return None


def check_override_keys(argv: list[str], conf_dir: Path = CONF_DIR) -> None:
    """Exit 2 with one line naming the options when a group choice is not one of them (``model=gpt2-nonsense``),
    and with a list of the valid keys when an override names a key the composed config lacks (Hydra's own
    message only says the key is not in the struct). Hydra's own messages are left for malformed overrides."""
    args = argv[1:]
    if any(a.split("=", 1)[0] in _NO_KEY_CHECK for a in args):
        return
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    lines = [a for a in args if "=" in a and not a.startswith("-")]
    try:
        overrides = OverridesParser.create().parse_overrides(lines)
    except Exception:  # noqa: BLE001 - a syntax error: Hydra reports it with its grammar
        return
    groups = set(config_groups(conf_dir))
    choices, values = [], []
    for o in overrides:
        if o.is_hydra_override() or o.is_delete():
            continue
        if o.key_or_group in groups:
            if o.is_sweep_override():
                try:
                    options = list(o.sweep_string_iterator())
                except Exception:  # noqa: BLE001 - glob sweeps etc.: check against the defaults
                    continue
                if not options:
                    continue
                choices.append(f"{o.get_key_element()}={options[0]}")
            else:
                options = [o.value()]
                choices.append(o.input_line)
            for option in options:
                msg = choice_problem(conf_dir, o.key_or_group, option, o.input_line)
                if msg:
                    print(msg, file=sys.stderr)
                    sys.exit(2)
        else:
            values.append(o)
    keys = [o for o in values if not (o.is_add() or o.is_force_add())]
    for o in values:  # (+checkpoint.dirpath=... would be added and then ignored)
        msg = moved_key_message(o.key_or_group, o.input_line)
        if msg:
            print(msg, file=sys.stderr)
            sys.exit(2)
    if not keys:
        return
    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3", job_name="tp2d_check"):
            cfg = compose(config_name="config", overrides=choices)
    except Exception:  # noqa: BLE001 - a bad group choice: Hydra reports it (with the options) when it runs
        return
    plain = OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False)
    for o in keys:
        msg = unknown_key_message(plain, o.key_or_group, o.input_line)
        if msg:
            hint = group_option_hint(conf_dir, o.key_or_group)
            print(msg + (f"\n{hint}" if hint else ""), file=sys.stderr)
            sys.exit(2)
