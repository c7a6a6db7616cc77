"""The processes the planner and the harness start, each ending with the process that started it, however that ends.

A process started by ``multiprocessing`` outlives its parent when the parent is killed: ``SIGKILL`` (a time limit,
the OOM killer) runs no exit handler, so neither the ``daemon`` flag nor ``atexit`` acts, and the children are
re-parented to init and run on. ``tp2d-plan`` killed by a time limit left three planning processes running for 35-45
minutes. Every fork (or spawn) site of ``planning/`` and ``bench/`` therefore starts its processes with
:func:`start_process`, whose child first calls :func:`end_with_parent`:

* on Linux, ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel kills the child when its parent ends. The kernel ties it
  to the *thread* that forked the child, so it is used only for a child started from its parent's main thread (which
  lives as long as the process); from any other thread, and where ``prctl`` is missing, a daemon thread of the child
  polls ``os.getppid()`` every :data:`POLL_S` seconds instead;
* then the child compares ``os.getppid()`` with the parent's pid taken before the fork: a parent that died before the
  signal was armed has already re-parented the child, which then kills itself at once.

A chain (``tp2d-plan`` -> its planning processes -> their tracing workers, :func:`lightning_tp2d.planning.trace.
in_worker`) ends link by link: a fork clears the death signal, and each link arms its own.

:func:`in_processes` is the planner's map over forked processes, built on :func:`start_process`. Nothing of the
package is imported here.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from multiprocessing import connection as mp_connection

__all__ = ["POLL_S", "end_with_parent", "in_processes", "start_process"]

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
POLL_S = 0.5  # the fallback's check of the parent, seconds: a child outlives its parent by at most this much


def start_process(ctx, target, args=(), *, name: str | None = None, daemon: bool | None = None):
    """Start ``target(*args)`` in a process of the ``multiprocessing`` context ``ctx`` (fork or spawn) that ends when
    this process ends, however it ends (module docstring); return the started process. ``target`` and ``args``
    must pickle under spawn, as for ``ctx.Process``. Not ``forkserver``: its children are the server's, not ours."""
    if ctx.get_start_method() not in ("fork", "spawn"):
        raise ValueError(f"start_process: start method {ctx.get_start_method()!r}: use 'fork' or 'spawn' (a "
                         "forkserver's children are the server's, so they cannot end with this process)")
    kernel = threading.current_thread() is threading.main_thread()  # PR_SET_PDEATHSIG follows the forking thread
    process = ctx.Process(target=_run_tied, args=(os.getpid(), kernel, target, tuple(args)), name=name,
                          daemon=daemon)
    process.start()
    return process


def _run_tied(parent: int, kernel: bool, target, args: tuple) -> None:
    end_with_parent(parent, kernel=kernel)
    target(*args)


def end_with_parent(parent: int, *, kernel: bool = True) -> str:
    """Make this process end (``SIGKILL``) when the process ``parent`` (its parent's pid, taken before the fork) ends:
    the kernel's parent-death signal where ``kernel`` allows it and ``prctl`` exists, else a polling thread. Returns
    which: ``"kernel"`` or ``"thread"``. A parent already gone ends this process now."""
    how = "kernel" if kernel and _arm_parent_death_signal(signal.SIGKILL) else "thread"
    if os.getppid() != parent:  # the parent died between the fork and here: nothing would signal us
        _end_now()
    if how == "thread":
        threading.Thread(target=_watch_parent, args=(parent,), name="tp2d-parent-watch", daemon=True).start()
    return how


def _arm_parent_death_signal(sig: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)`` through libc; ``False`` where there is none (not Linux, no libc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    _end_now()


def _end_now() -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's parent-death signal would: no handler, no exit code


def in_processes(fn, items, workers: int) -> list:
    """``[fn(item) for item in items]``, in this process when ``workers`` is 1, else up to ``workers`` at a time,
    each in a forked process of its own (:func:`start_process`) that sends its result back (a failure there is raised
    here, the other processes ended). The processes are not daemonic: each may start the memory model's and the
    tracer's workers (:func:`lightning_tp2d.planning.trace.in_worker`), which are its own."""
    items = list(items)
    if workers <= 1 or len(items) <= 1:
        return [fn(item) for item in items]
    ctx = mp.get_context("fork")
    results, waiting, running = [None] * len(items), list(enumerate(items)), {}
    try:
        while waiting or running:
            while waiting and len(running) < workers:
                i, item = waiting.pop(0)
                ours, theirs = ctx.Pipe(duplex=False)
                process = start_process(ctx, _child, (theirs, fn, item), name=f"tp2d-plan-{i}")
                theirs.close()
                running[ours] = (i, process)
            for conn in mp_connection.wait(list(running)):
                i, process = running.pop(conn)
                try:
                    status, value = conn.recv()
                except EOFError:
                    status, value = "died", f"the planning process of item {i} exited with code {process.exitcode}"
                conn.close()
                process.join()
                if status == "error":
                    raise value
                if status == "died":
                    raise RuntimeError(value)
                results[i] = value
    finally:
        for conn, (_, process) in running.items():
            process.kill()
            process.join()
            conn.close()
    return results


def _child(conn, fn, item) -> None:
    try:
        conn.send(("ok", fn(item)))
    except BaseException as err:  # noqa: BLE001 - raised again in the parent
        try:
            conn.send(("error", err))
        except Exception:  # noqa: BLE001 - an exception that does not pickle: its text then
            conn.send(("error", RuntimeError(f"{type(err).__name__}: {err}")))
    finally:
        conn.close()
