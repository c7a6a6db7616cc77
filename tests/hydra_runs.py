"""``tp2d-train`` in this process or in already-spawned ranks, for tests: the console script's own code
(:func:`lightning_tp2d.train.main`: the command-line checks, Hydra's job, :func:`~lightning_tp2d.train.run` and
:func:`~lightning_tp2d.train.train`) called with ``sys.argv`` set, instead of a fresh interpreter per run that
imports torch, Lightning and Hydra again.

* :func:`tp2d_train_here` runs it in the calling process: for runs that end before any process starts (bad input,
  a resume with nothing to train).
* :func:`tp2d_train_ranks` runs it on every rank of the session's pool of Lightning ranks
  (:func:`tests.lightning_ranks.run_ranks`), which look launched by torchrun: each rank composes the config, Lightning
  neither spawns nor re-runs the command line, and the ranks other than 0 write no Hydra files and take the
  checkpoint directory from rank 0 (what :mod:`lightning_tp2d.launch` does for a torchrun job without
  ``TP2D_RUN_DIR``). Rank 0 picks the run directory as the command would (``outputs/<date>/<time>/``, or the run
  directory of the checkpoint it resumes).

Both return a :class:`subprocess.CompletedProcess` as :func:`subprocess.run` would: the exit code (``SystemExit``'s;
0 when the job returns) and what was written to ``sys.stdout`` / ``sys.stderr`` (Hydra's console log included; for
ranks, rank 0's first, then the others'). Around each call the working directory, ``sys.argv``, the environment,
the streams, the loggers' handlers and Hydra's global state are restored, so calls can follow one another in one
process. (The one real ``tp2d-train`` subprocess, with Lightning starting the ranks itself, is test_train.py's
first test.)
"""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path

from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig

from lightning_tp2d import train

from .lightning_ranks import run_ranks

WORLD_SIZE = 4  # the CPU default: one 2x2 grid


@contextmanager
def _loggers_restored() -> Iterator[None]:
    """Hydra's job points the root logger (and its own) at the console and ``train.log``: afterwards every logger
    that existed before has its handlers, level and flags back, and the handlers added to them meanwhile are closed
    (``train.log`` complete); a logger made meanwhile keeps what its module gave it."""
    manager = logging.Logger.manager
    loggers = [logging.getLogger()] + [lg for lg in manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    saved = {id(lg): (lg, list(lg.handlers), lg.level, lg.propagate, lg.disabled) for lg in loggers}
    try:
        yield
    finally:
        added = set()
        for before in saved.values():
            lg = before[0]
            added.update(h for h in lg.handlers if h not in before[1])
            lg.handlers[:] = before[1]
            lg.setLevel(before[2])
            lg.propagate, lg.disabled = before[3], before[4]
        for handler in added:
            handler.flush()
            handler.close()


def _exit_code(args: list[str], cwd: Path) -> tuple[int, str, str]:
    """``tp2d-train *args`` run by :func:`lightning_tp2d.train.main` in ``cwd``: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    saved_cwd, saved_argv, saved_env = os.getcwd(), list(sys.argv), dict(os.environ)
    os.chdir(cwd)
    sys.argv = ["tp2d-train", *args]
    code = 0
    try:
        with _loggers_restored(), redirect_stdout(out), redirect_stderr(err):
            try:
                train.main()
            except SystemExit as done:
                code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
                if not isinstance(done.code, (int, type(None))):
                    print(done.code, file=sys.stderr)  # what the interpreter prints for sys.exit("message")
    finally:
        GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = None  # the job's state (its choices name the model) must not reach later checks
        os.chdir(saved_cwd)
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
    return code, out.getvalue(), err.getvalue()


def tp2d_train_here(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``tp2d-train *args`` in ``cwd``, in this process (no ranks: for runs that end before any process starts)."""
    code, out, err = _exit_code(list(args), Path(cwd))
    return subprocess.CompletedProcess(["tp2d-train", *args], code, out, err)


def _rank_job(rank: int, world_size: int, args: list[str], cwd: str) -> tuple[int, str, str]:
    return _exit_code(args, Path(cwd))


def tp2d_train_ranks(args: list[str], cwd: Path, timeout: float = 300.0) -> subprocess.CompletedProcess:
    """``tp2d-train *args`` in ``cwd`` on the session's 4 Lightning ranks (one 2x2 grid by default). The exit code
    is the first non-zero one in rank order (a job fails when one rank does), else 0."""
    results = run_ranks(_rank_job, WORLD_SIZE, list(args), str(cwd), timeout=timeout)
    code = next((c for c, _, _ in results if c != 0), 0)
    return subprocess.CompletedProcess(["tp2d-train", *args], code, "".join(o for _, o, _ in results),
                                       "".join(e for _, _, e in results))
