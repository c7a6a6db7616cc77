"""A rank that dies while a checkpoint is being written (``kill -9``, the OOM killer) ends the ``tp2d-train`` job as a
death mid-step does: one ``tp2d-train: error:`` line naming the dead rank and its signal, exit code 1 whatever the
timing, and no rank outliving the command (issue 34, item 5).

It used to end with one raw gloo traceback per surviving rank ("Connection closed by peer" inside the save's barrier,
torch.distributed.checkpoint's gathers or the all-gather of outcomes), with exit code 1 or 137 from run to run
(Lightning's observer SIGKILLs the whole job, the launching process included, up to 5 s after a rank dies), and ranks
could outlive the command. The process that started the ranks now watches them (:mod:`lightning_tp2d.supervise`)."""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lightning_tp2d.errors import CommError
from lightning_tp2d.safe_files import staging_path
from lightning_tp2d.supervise import RankWatch
from tests.test_train import ROOT, command, environment
from tests.waiting import wait_until

VICTIM = 2  # a rank the first process started (rank 0's own death is the parent-watch test of test_faults.py)


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state, ppid, pgrp, ...); None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _live_processes_of_group(pgid: int) -> list[int]:
    """Every process of the job: the command ran in its own session, and its ranks inherit its process group."""
    return [pid for pid in _pids() if (s := _stat(pid)) and s[0] != "Z" and int(s[2]) == pgid]


def _child_rank(parent: int, local_rank: int) -> int:
    for pid in _pids():
        s = _stat(pid)
        if s and int(s[1]) == parent:
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"LOCAL_RANK={local_rank}".encode() in environ:
                return pid
    raise AssertionError(f"no rank with LOCAL_RANK={local_rank} among the children of {parent}")


def test_a_rank_killed_mid_save_ends_the_job_with_one_line_naming_it_exit_1_and_no_orphan(tmp_path):
    args = ["experiment=quick", "trainer.max_steps=500", "callbacks.model_checkpoint.every_n_train_steps=2",
            "trainer.val_check_interval=1000", "data.max_tokens=20000", "trainer.enable_progress_bar=false"]
    proc = subprocess.Popen(command(args), cwd=tmp_path, env=environment(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)  # (every rank writes to it)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        checkpoints = tmp_path / "outputs/*/*/checkpoints"
        first = str(checkpoints / "step=2.ckpt/.metadata")
        staged = str(checkpoints / staging_path(Path("step=4.ckpt")).name)
        running = dict(gone=lambda: proc.poll() is not None, detail=lambda: "".join(err)[-3000:])
        wait_until(lambda: glob.glob(first), deadline, what="step 2's checkpoint", **running)
        assert glob.glob(first)  # every rank is up and has saved once
        victim = _child_rank(proc.pid, VICTIM)
        wait_until(lambda: glob.glob(staged), deadline, interval=0.002, what="step 4's save", **running)
        assert glob.glob(staged) and proc.poll() is None  # the next save has begun ...
        os.kill(victim, signal.SIGKILL)  # ... and cannot finish without this rank
        code = proc.wait(timeout=120)
        ended = time.monotonic()
        while (left := _live_processes_of_group(proc.pid)) and time.monotonic() - ended < 10:
            time.sleep(0.05)
        outlived = time.monotonic() - ended
    finally:
        for pid in _live_processes_of_group(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    reader.join(timeout=10)
    stderr = "".join(err)

    assert code == 1, stderr[-3000:]  # the survivors' failure, never 137 (Lightning's observer SIGKILLing the job)
    lines = [line for line in stderr.splitlines() if line.startswith("tp2d-train: error:")]
    assert len(lines) == 1, stderr[-3000:]  # one line for the job, not one per surviving rank
    assert f"rank {VICTIM} (pid {victim}) was killed by SIGKILL" in lines[0], lines[0]
    assert "stopped in the save of checkpoint" in lines[0] and "step=4.ckpt" in lines[0], lines[0]
    assert "Traceback" not in stderr and "Error executing job" not in stderr, stderr[-3000:]
    assert not left and outlived < 5, (left, outlived)  # no rank outlives the command
    (folder,) = glob.glob(str(checkpoints))
    assert (Path(folder) / "last.ckpt" / ".metadata").is_file()  # step 2's, intact


# ---- the watch alone, on stand-in ranks (sleeping processes): fast ------------------------------------------------


def _ranks(n: int = 3) -> list[subprocess.Popen]:
    return [subprocess.Popen(["sleep", "60"]) for _ in range(n)]


def _all_ended(procs, within: float) -> bool:
    deadline = time.monotonic() + within
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_killed_rank_ends_the_others_at_once_and_is_named_once_for_the_job():
    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

    procs = _ranks()
    launcher_list = list(procs)  # Lightning's launcher.procs, which its observer holds
    stand_in = subprocess.Popen(["sleep", "60"])  # the observer's "main process" (it would SIGKILL it)
    observer = _ChildProcessObserver(main_pid=stand_in.pid, child_processes=launcher_list)
    watch = RankWatch(poll_s=0.05, grace_s=30)
    try:
        watch.adopt(launcher_list, rank=0)
        os.kill(procs[1].pid, signal.SIGKILL)
        assert _all_ended(procs, within=2), [p.returncode for p in procs]  # the others: at once, not after 5 s
        assert observer._run() is True and stand_in.poll() is None  # Lightning's observer saw nothing: it stops
        call = "all_reduce along mesh axis 'col' (global ranks [0, 1])"
        with pytest.raises(CommError) as raised:
            with watch.ended_on_failure():  # the first process's own collective fails a moment later
                raise CommError(f"{call} did not complete on rank 0: Connection closed by peer.", call=call)
        assert str(raised.value) == (f"rank 2 (pid {procs[1].pid}) was killed by SIGKILL; rank 0 stopped in {call}, "
                                     "and every other rank was ended")
    finally:
        for p in [*procs, stand_in]:
            p.kill()
            p.wait()


def test_without_a_failed_rank_the_first_process_error_stands_and_every_rank_is_ended():
    procs = _ranks()
    watch = RankWatch(poll_s=0.05)
    watch.adopt(list(procs), rank=0)
    started = time.monotonic()
    with pytest.raises(ValueError, match="its own"):
        with watch.ended_on_failure():
            raise ValueError("its own")
    assert all(p.returncode == -signal.SIGKILL for p in procs)  # no rank outlives it
    assert time.monotonic() - started < 3  # waited at most about a second for a failed rank to show


def test_a_first_process_stuck_after_a_rank_died_ends_the_job_itself():
    """The main thread never reaches ``ended_on_failure`` (stuck elsewhere): after ``grace_s`` the watch says the
    same kind of line and exits with 1, every rank ended."""
    script = """
import os, signal, subprocess, sys, time
from lightning_tp2d.supervise import RankWatch
procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
print(" ".join(str(p.pid) for p in procs), flush=True)
RankWatch(poll_s=0.05, grace_s=0.5).adopt(list(procs), rank=0)
os.kill(procs[0].pid, signal.SIGKILL)
time.sleep(60)
"""
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    first, second = map(int, run.stdout.split())
    assert run.returncode == 1 and time.monotonic() - started < 10, run.stderr
    assert run.stderr.strip() == (f"tp2d-train: error: rank 1 (pid {first}) was killed by SIGKILL; rank 0 did not "
                                  "stop within 0.5 s (it is stuck), so the job is ended")
    assert _stat(second) is None  # killed and reaped before the exit
