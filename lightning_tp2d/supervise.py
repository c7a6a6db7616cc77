"""The ranks of one ``tp2d-train`` job once started: the process that started them ends the job when one fails.

Lightning's launcher starts the other local ranks from the first process of each machine, and its observer thread
looks at them every 5 s: a rank that had exited non-zero made it SIGKILL every process, the first one included. A rank
that died (``kill -9``, the OOM killer, a segfault) mid-step or mid-save therefore ended the job with exit code 137 or
1, as the observer or the survivors' own errors came first, with one line or a raw traceback per survivor, and ranks
could outlive the first process. Here instead, on that first process:

* :meth:`RankWatch.take_over` adopts the ranks as soon as Lightning's launcher has started them (its observer holds
  the same list, which is emptied: it then watches nothing and stops) and polls them every ``poll_s`` (0.1 s);
* a rank that exits non-zero (killed by a signal, or failed with its own error) makes the watch kill every other
  rank at once: the job cannot go on without it, and their collectives would only fail in turn;
* the first process's own error (its collectives fail a moment later) leaves :meth:`RankWatch.ended_on_failure`,
  which kills what is left, reaps every rank and names the rank that failed first: one ``CommError`` line, which
  ``tp2d-train`` prints before exiting with 1. Every rank is gone before the first process exits;
* a first process stuck elsewhere for ``grace_s`` after that says the same line itself, and exits with 1.

The other ranks leave the report to the first process: after a failed collective they wait to be ended
(:func:`wait_to_be_ended`), and report on their own only if it has not ended them by then (it is stuck, or gone:
:func:`lightning_tp2d.launch.watch_parent` then ends them). Under torchrun or SLURM no process starts the ranks: each
reports its own error, as before.

Nothing here imports torch or Lightning.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from lightning_tp2d.errors import CommError, backend_detail

WAIT_TO_BE_ENDED_S = 10.0  # a rank whose collective failed waits this long for the first process to end it


@dataclass(frozen=True)
class Failure:
    """A rank that exited non-zero: its global rank, pid and ``Popen.returncode`` (``-N``: killed by signal N)."""

    rank: int
    pid: int
    returncode: int

    @property
    def killed(self) -> bool:
        return self.returncode < 0

    def describe(self) -> str:
        if self.killed:
            try:
                how = f"was killed by {signal.Signals(-self.returncode).name}"
            except ValueError:
                how = f"was killed by signal {-self.returncode}"
            return f"rank {self.rank} (pid {self.pid}) {how}"
        return f"rank {self.rank} (pid {self.pid}) failed with exit code {self.returncode} (its own error is above)"


class RankWatch:
    """The ranks this process started (module docstring). Without :meth:`take_over`, or when the launcher started
    none (a launcher that creates processes externally, one device), every method does nothing."""

    def __init__(self, poll_s: float = 0.1, grace_s: float = 10.0, name: str = "tp2d-train") -> None:
        self.poll_s, self.grace_s, self.name = poll_s, grace_s, name
        self.procs: list[subprocess.Popen] = []
        self.rank = 0  # this process's global rank; its ranks follow it
        self.failure: Failure | None = None  # the first rank found exited non-zero
        self._failed_at = 0.0
        self._ended_by: str | None = None  # "main" (end()) or "watch" (the main thread never came)
        self._lock = threading.Lock()

    # ---- adopting the ranks ------------------------------------------------------------------------------------

    def take_over(self, launcher) -> None:
        """Adopt the ranks Lightning's subprocess ``launcher`` starts (its ``procs``), the moment it has started
        them: the launcher's ``launch`` is wrapped on the instance, so they are adopted before the job runs."""
        if launcher is None or not hasattr(launcher, "procs"):
            return
        start = launcher.launch

        def launch_watched(function, *args, **kwargs):
            if self.procs:  # Lightning refuses a second launch by its list of ranks, emptied by adopt()
                raise RuntimeError("The launcher can only create subprocesses once.")

            def watched(*fargs, **fkwargs):
                rank = launcher.cluster_environment.node_rank() * launcher.num_processes  # local rank 0
                self.adopt(launcher.procs, rank)
                return function(*fargs, **fkwargs)

            return start(watched, *args, **kwargs)

        launcher.launch = launch_watched

    def adopt(self, procs: list, rank: int = 0) -> None:
        """Watch ``procs`` (this process, global rank ``rank``, started them in rank order); ``procs`` is emptied,
        so Lightning's observer, which holds that list, stops."""
        self.procs, self.rank = list(procs), rank
        procs.clear()
        if self.procs:
            threading.Thread(target=self._watch, name="tp2d-rank-watch", daemon=True).start()

    # ---- while the job runs ------------------------------------------------------------------------------------

    def _watch(self) -> None:
        while True:
            time.sleep(self.poll_s)
            with self._lock:
                if self._ended_by is not None:
                    return
                if self.failure is None:
                    self._look()
                elif time.monotonic() - self._failed_at > self.grace_s:
                    self._ended_by = "watch"  # the main thread never came: end the job from here
                    break
        print(f"{self.name}: error: {self.failure.describe()}; rank {self.rank} did not stop within {self.grace_s:g} "
              "s (it is stuck), so the job is ended", file=sys.stderr, flush=True)
        self._kill_all()
        os._exit(1)

    def _look(self) -> None:
        """(Under the lock.) Record the first rank found exited non-zero, preferring one killed by a signal, and
        kill every other rank."""
        exited = [(i, p) for i, p in enumerate(self.procs) if p.poll() not in (None, 0)]
        if not exited:
            return
        i, proc = min(exited, key=lambda ip: (ip[1].returncode >= 0, ip[0]))
        self.failure, self._failed_at = Failure(self.rank + 1 + i, proc.pid, proc.returncode), time.monotonic()
        self._kill_all()

    def _kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # (unkillable: in the kernel; the launcher exits without it)
                pass

    # ---- ending the job ----------------------------------------------------------------------------------------

    def end(self, wait_s: float = 1.0) -> Failure | None:
        """This process failed: wait up to ``wait_s`` for a rank that exited non-zero to show (a killed rank's
        connections close a moment before its exit can be seen), then kill every rank left and reap them all.
        Returns that rank (``None``: none had failed; this process's own error is the job's)."""
        deadline = time.monotonic() + wait_s
        while self.procs:
            with self._lock:
                if self._ended_by == "watch":
                    break
                if self._ended_by is None and self.failure is None:
                    self._look()
                if self._ended_by == "main" or self.failure is not None or time.monotonic() >= deadline or \
                        all(p.poll() is not None for p in self.procs):
                    self._ended_by = "main"
                    self._kill_all()
                    return self.failure
            time.sleep(0.02)
        if self._ended_by == "watch":  # the watch is ending the job, this process included: it exits from there
            threading.Event().wait()
        return None

    def wait(self, timeout: float = 120.0) -> None:
        """The job ends well: wait for every rank to exit (a rank still running after ``timeout`` is killed)."""
        for proc in self.procs:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()

    @contextmanager
    def ended_on_failure(self) -> Iterator[None]:
        """Around the job on the process that started the ranks: whatever leaves the block unfinished (an error,
        ``sys.exit``, Ctrl-C) ends every rank first (:meth:`end`). When a rank had failed first, by a signal, or
        with its own error while this process's collectives failed (a :class:`CommError`), the error becomes one
        :class:`CommError` naming that rank and where this process stopped."""
        try:
            yield
        except BaseException as err:
            failure = self.end()
            if failure is None or not (failure.killed or isinstance(err, CommError)):
                raise
            raise CommError(f"{failure.describe()}; rank {self.rank} stopped {_where(err)}, and every other rank was "
                            "ended") from err
        with self._lock:  # the job is over and its ranks waited for: the watch stops (a sweep's next job has its own)
            self._ended_by = self._ended_by or "main"


def _where(err: BaseException) -> str:
    if isinstance(err, CommError) and err.call:
        return f"in {err.call}"
    first = backend_detail(err).rstrip(".")[:200] if str(err).strip() else ""
    return f"with {type(err).__name__}" + (f": {first}" if first else "")


def wait_to_be_ended(timeout_s: float = WAIT_TO_BE_ENDED_S) -> None:
    """In a rank that ``tp2d-train`` started, after a failed collective: the first process names the failure once
    for the whole job and ends every rank, this one within a second or so; wait for that. Returns after
    ``timeout_s`` when it has not (it is stuck), so that this rank reports its own error."""
    time.sleep(timeout_s)
