"""The planner's processes end with the process that started them, however it ends (:mod:`lightning_tp2d.planning.
processes`): ``tp2d-plan`` killed with ``SIGKILL`` leaves none of its planning processes nor their tracing workers
behind, and each of the helper's two ways (the kernel's parent-death signal, the polling thread used for a child
started from another thread) ends a child whose parent is killed.

A process counts as gone when ``/proc`` no longer lists it or lists it as a zombie (killed, not yet reaped: in a
container the init that adopts it may never reap it)."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

from lightning_tp2d.planning.processes import POLL_S, end_with_parent, start_process

from .waiting import wait_until


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # the task ended meanwhile
            pass
    return found


def _descendants(pid: int) -> list[int]:
    out = []
    for child in _children(pid):
        out += [child, *_descendants(child)]
    return out


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _depth(pid: int) -> int:
    """Generations of processes below ``pid``: 1 children only, 2 grandchildren too."""
    return max((1 + _depth(c) for c in _children(pid)), default=0)


def test_tp2d_plan_killed_leaves_no_process_behind(tmp_path):
    """``tp2d-plan --workers 2 --method traced`` (each planning process starts tracing workers; the closed forms
    would answer in a second), killed with ``SIGKILL`` once its processes and their workers run: every one of them
    is gone within a few seconds."""
    env = {**os.environ, "TP2D_PLAN_CACHE": str(tmp_path / "cache")}  # cold: nothing answered from disk
    plan = subprocess.Popen([shutil.which("tp2d-plan"), "llama-3.2-1b", "--gpus", "4", "--gpus-per-node", "4",
                             "--gpu-memory-gib", "80", "--seq", "4096", "--layouts", "metp", "--no-baselines",
                             "--workers", "2", "--method", "traced"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: _depth(plan.pid) >= 2, time.monotonic() + 240, gone=lambda: plan.poll() is not None,
                   detail=lambda: plan.stdout.read() if plan.poll() is not None else "",
                   what="tp2d-plan's planning processes and their tracing workers started", interval=0.1)
        left = _descendants(plan.pid)
        plan.kill()  # SIGKILL: no handler of its runs
        plan.wait()
        seen = set(left)

        def gone() -> bool:  # (a child may have forked just before it died: its children are looked for too)
            for pid in list(seen):
                seen.update(_descendants(pid))
            return not any(_running(pid) for pid in seen)

        wait_until(gone, time.monotonic() + 10, what="every process tp2d-plan started ended with it",
                   detail=lambda: f"still running: {[pid for pid in seen if _running(pid)]}")
    finally:
        if plan.poll() is None:
            plan.kill()
            plan.wait()
    assert len(left) >= 3 and not any(_running(pid) for pid in seen)  # 2 planning processes, >= 1 worker
    assert not (tmp_path / "plan.json").exists()  # and nothing written unasked


def _sleeper_under(parent_ready, from_thread: bool) -> None:
    """A parent (the forked ``_sleeper_under`` process) that starts a tied child sleeping for 10 minutes, from its
    main thread or another, sends the child's pid and sleeps until it is killed."""
    ctx = mp.get_context("fork")

    def start() -> None:
        parent_ready.send(start_process(ctx, time.sleep, (600,), name="tied-sleeper").pid)

    if from_thread:
        worker = threading.Thread(target=start)
        worker.start()
        worker.join()  # the thread that forked the child is gone: the kernel's signal would have killed it now
    else:
        start()
    time.sleep(600)


def test_a_child_ends_when_its_parent_is_killed_from_either_thread():
    ctx = mp.get_context("fork")
    for from_thread in (False, True):
        ours, theirs = ctx.Pipe(duplex=False)
        parent = ctx.Process(target=_sleeper_under, args=(theirs, from_thread))  # (a daemon may have no children)
        parent.start()
        theirs.close()
        try:
            child = ours.recv()
        except EOFError:
            parent.kill()
            raise AssertionError(f"the parent exited (code {parent.exitcode}) before it started its child") from None
        time.sleep(3 * POLL_S)
        alive_before = _running(child)  # started from a thread that ended: still alive (no kernel signal armed)
        os.kill(parent.pid, signal.SIGKILL)
        parent.join()
        wait_until(lambda: not _running(child), time.monotonic() + 10 * POLL_S + 5,
                   what=f"the child (started from {'a thread' if from_thread else 'the main thread'}) ended")
        assert alive_before and not _running(child)


def _tied_to(parent: int) -> None:
    end_with_parent(parent)
    os._exit(0)  # not reached: the parent named is not ours


def test_a_child_whose_parent_died_before_it_was_tied_ends_at_once():
    """The race the parent-death signal cannot see (the parent gone before ``prctl``): the child checks its parent
    against the pid taken before the fork and kills itself."""
    child = mp.get_context("fork").Process(target=_tied_to, args=(os.getpid() + 1_000_000,))  # no such parent
    child.start()
    child.join(10)
    assert child.exitcode == -signal.SIGKILL
