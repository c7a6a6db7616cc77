"""Run a script file the way ``python <file>`` or ``torchrun`` runs it, in the session's pooled ranks, for tests.

``run_script(path, world_size)`` runs ``path`` with :func:`runpy.run_path` (``__name__ == "__main__"``,
``sys.argv == [path]``, its folder first on ``sys.path`` and as the working directory) on every rank of the
session's Lightning pool for ``world_size`` (:func:`tests.lightning_ranks.run_ranks`): the ranks carry torchrun's
environment, so a ``Trainer(devices=world_size)`` or ``Fabric(devices=world_size)`` that the script builds neither
spawns nor re-runs the file, and finds the process group made. ``own_group=True`` (a script written for torchrun,
which calls ``init_process_group`` itself) drops the pool's group first, on a port of its own; the pool makes it
again afterwards. A one-rank run drops the launch variables: the script sees what ``python <file>`` sees. Either
way the variables no launcher of one machine sets (``LAUNCH_VARS`` beyond the pool's) are dropped.

What the script shows is captured on each rank as a fresh interpreter would show it: ``sys.stdout`` and
``sys.stderr``; file descriptors 1 and 2 (C++ and gloo write there); warnings under Python's default filters, each
printed once per place; and Lightning's log records through handlers like those Lightning installs when a fresh
interpreter imports it (no handler on the root logger, so other WARNING records reach stderr through logging's
last resort). A fresh interpreter is not daemonic: the script may start processes of its own (the planner does).
What a script changes is put back afterwards (working directory, ``sys.argv``, ``sys.path``, the warning filters
and registries, those loggers); the pool restores the random generators, the default dtype and the environment
before each task. The state a fresh interpreter would not share (imported modules, caches) is shared: that is
what the pool saves.

Returns each rank's output, rank 0 first: its stdout, then its stderr, then what reached the file descriptors. A
script that raises, or exits with a non-zero code, fails the call with ``RuntimeError`` naming the rank and
holding the tail of that rank's output.
"""

from __future__ import annotations

import gc
import io
import logging
import multiprocessing as mp
import os
import runpy
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import lightning  # noqa: F401 - configures its loggers here, once, not inside a script's run (_fresh_loggers)
import torch
import torch.distributed as dist

from tests.lightning_ranks import free_port, run_ranks

# the variables a launcher sets, dropped from what a script run here sees unless the pool set them itself
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "SLURM_PROCID", "TP2D_RUN_DIR", "PL_GLOBAL_SEED")
POOL_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
# the loggers ``import lightning`` configures in a fresh interpreter: name -> (its handler's format, propagate)
LIGHTNING_LOGGERS = {"lightning": ("%(levelname)s: %(message)s", True),
                     "lightning.pytorch": ("%(message)s", False), "lightning.fabric": ("%(message)s", False)}
# loggers whose filters a fresh interpreter starts without (lightning_tp2d.quiet adds one to each when it runs)
FILTERED_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")
TORCH_DEFAULT_SEED = 67280421310721  # torch's generator in a fresh interpreter (c10's default_rng_seed_val)


def run_script(path: str | Path, world_size: int, *, own_group: bool = False, timeout: float = 300.0) -> list[str]:
    """Run ``path`` on ``world_size`` pooled ranks (module docstring); each rank's captured output."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: a script runs on at least one rank")
    port = free_port() if own_group else None
    return run_ranks(_run_on_rank, world_size, str(Path(path).resolve()), port, timeout=timeout)


def _default_warning_filters() -> None:
    """Python's filters in a fresh interpreter (no ``-W``): DeprecationWarning shown in ``__main__`` only."""
    warnings.resetwarnings()
    for category in (ResourceWarning, ImportWarning, PendingDeprecationWarning, DeprecationWarning):
        warnings.simplefilter("ignore", category)
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")


def _print_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Python's own way of showing a warning, to the ``sys.stderr`` of the moment (pytest's recording, inherited by
    forked ranks, would keep it)."""
    (file or sys.stderr).write(warnings.formatwarning(message, category, filename, lineno, line))


def _fresh_loggers(stream) -> list[tuple[logging.Logger, dict]]:
    """Sets the loggers of the module docstring as a fresh interpreter has them, writing to ``stream``; returns
    what to put back."""
    saved = []
    for name in ("", *LIGHTNING_LOGGERS, *FILTERED_LOGGERS):
        logger = logging.getLogger(name)
        saved.append((logger, {k: getattr(logger, k) for k in ("handlers", "filters", "level", "propagate")}))
    logging.getLogger().handlers = []
    for name, (fmt, propagate) in LIGHTNING_LOGGERS.items():
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter(fmt))
        logger = logging.getLogger(name)
        logger.handlers, logger.level, logger.propagate = [handler], logging.INFO, propagate
    for name in FILTERED_LOGGERS:
        logging.getLogger(name).filters = []
    return saved


def _run_on_rank(rank: int, world_size: int, path: str, port: int | None) -> str:
    """The task each pooled rank runs: ``path`` as ``__main__``, its output captured (module docstring)."""
    keep = POOL_VARS if world_size > 1 else ()
    for name in LAUNCH_VARS:
        if name not in keep:
            os.environ.pop(name, None)
    if port is not None:  # a torchrun script makes its own group: the pool's goes (RankPool makes it again)
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ["MASTER_PORT"] = str(port)
    torch.manual_seed(TORCH_DEFAULT_SEED)
    folder, process = os.path.dirname(path), mp.current_process()
    saved = (sys.stdout, sys.stderr, sys.argv, list(sys.path), os.getcwd(), process.daemon,
             dict(warnings.onceregistry))
    stdout, stderr, descriptors = io.StringIO(), io.StringIO(), tempfile.TemporaryFile()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    fds = os.dup(1), os.dup(2)
    os.dup2(descriptors.fileno(), 1)
    os.dup2(descriptors.fileno(), 2)
    loggers = _fresh_loggers(stderr)
    code: int | str | None = 0
    try:
        sys.stdout, sys.stderr, sys.argv = stdout, stderr, [path]
        sys.path.insert(0, folder)
        os.chdir(folder)
        process.daemon = False
        with warnings.catch_warnings():
            _default_warning_filters()
            warnings.onceregistry.clear()
            warnings.showwarning = _print_warning
            try:
                runpy.run_path(path, run_name="__main__")
            except SystemExit as exit_:
                code = exit_.code
                if isinstance(code, str):  # sys.exit("message"): printed, exit status 1
                    stderr.write(code + "\n")
            except BaseException:  # noqa: BLE001 - an uncaught error: printed as Python prints it, status 1
                stderr.write(traceback.format_exc())
                code = 1
    finally:
        sys.stdout, sys.stderr, sys.argv, sys.path[:], cwd, process.daemon, once = saved
        os.chdir(cwd)
        warnings.onceregistry.clear()
        warnings.onceregistry.update(once)
        for logger, state in loggers:
            for key, value in state.items():
                setattr(logger, key, value)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            os.close(fd)
        descriptors.seek(0)
        at_fds = descriptors.read().decode(errors="replace")
        descriptors.close()
        gc.collect()  # the script's objects (a Trainer, a model) are garbage now: free them before the next task
    output = stdout.getvalue() + stderr.getvalue() + at_fds
    if code not in (0, None):
        raise RuntimeError(f"{path} exited {code!r} on rank {rank} of {world_size}:\n{output[-4000:]}")
    return output
