"""A process that used the package ends cleanly: no gloo worker thread is left to interpreter shutdown.

The README's own-loop example (``torchrun --nproc-per-node 4 layouts.py`` with ``gpt2``) printed its loss and then
lost a rank to SIGABRT ("terminate called without an active exception") in about half of its runs: a gloo worker
thread, freeing a finished collective's work, asked for the GIL while the interpreter was finalising
(:func:`lightning_tp2d.mesh.release_process_groups` has the whole story). The tests here:

* run that example exactly as the README prints it, ``gpt2`` and all, twice under torchrun on 4 CPU processes, and
  tests/test_docs.py runs it a third time (before the fix 4 of 6 such runs aborted here, 2 of 2 in the report that
  found it); each must exit 0 and print the numbers of a random ``gpt2``;
* show the mechanism that makes it deterministic: after :func:`~lightning_tp2d.mesh.release_process_groups`, every
  gloo thread the process groups started has been joined, with or without the
  user's own ``destroy_process_group()``; and a worker stuck in a collective delays the exit by the release's
  timeout, never more, and the process still exits 0.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_docs import BLOCKS, TEARDOWN_ABORT, environment

RUNS = 2  # runs of the README example here (tests/test_docs.py runs it once more); an abort in any fails

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc (Linux)")


def test_readme_own_loop_example_with_gpt2_ends_with_exit_0_every_run(tmp_path):
    (block,) = [b for b in BLOCKS if b.script == "layouts.py"]
    assert 'GPT2Config.from_name("gpt2")' in block.code  # verbatim: the documented size, not the CPU swap
    (tmp_path / "layouts.py").write_text(block.code)
    for run in range(RUNS):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", *block.torchrun, "layouts.py"]
        proc = subprocess.run(cmd, cwd=tmp_path, env=environment(), capture_output=True, text=True, timeout=300)
        output = proc.stdout + proc.stderr
        assert TEARDOWN_ABORT not in output, f"run {run + 1}: a rank aborted at exit:\n{output[-3000:]}"
        assert proc.returncode == 0, f"run {run + 1} exited {proc.returncode}:\n{output[-3000:]}"
        (line,) = re.findall(r"(?m)^loss (\d+\.\d+), logits \((\d+), (\d+), (\d+)\), (\d+) tensors$", proc.stdout)
        assert float(line[0]) == pytest.approx(math.log(50257), abs=0.2)  # random init, random tokens
        assert tuple(int(v) for v in line[1:]) == (4, 64, 50257, 149)  # gpt2's 149 tensors (the tied head once)


# Each rank, by PHASE: a 2-rank "metp" mesh, collectives through DTensor (full_tensor) and the ring, then the release,
# after the user's destroy_process_group() ("destroy") or without it ("kept"); or ("stuck") a worker waiting in a
# collective its peer never joins (the peer is alive, busy elsewhere). Prints what it saw.
RELEASE = r"""
import os, sys, time
import torch, torch.distributed as dist
import lightning_tp2d as tp
from lightning_tp2d import mesh as tp_mesh
from lightning_tp2d.models import GPT2, GPT2Config

def threads():  # gloo's threads: pt_gloo_runloop (a group's workers), gloo_tcp_loop (its transport)
    count = 0
    for t in os.listdir("/proc/self/task"):
        try:
            count += "gloo" in open(f"/proc/self/task/{t}/comm").read()
        except FileNotFoundError:  # a thread that ended while they were counted
            pass
    return count

rank, phase = int(os.environ["RANK"]), os.environ["PHASE"]
before = threads()
dist.init_process_group("gloo")
if phase == "stuck":
    mesh = tp.init_mesh(layout="metp", tensor_parallel_size=2, timeout=60)
    value = torch.ones(4)
    if rank == 1:
        work = dist.all_reduce(value, group=mesh.get_group("ring"), async_op=True)
    else:
        time.sleep(3.0)
    started = time.monotonic()
    ended = tp_mesh.release_process_groups(timeout=0.5)
    sys.stdout.write(f"rank {rank} stuck: ended {ended} in {time.monotonic() - started:.2f} s\n")
    sys.stdout.flush()
else:
    started = threads()
    torch.manual_seed(0)
    model = GPT2(GPT2Config.from_name("gpt2-tiny"))
    mesh = tp.init_mesh(layout="metp", tensor_parallel_size=2)
    tp.parallelize(model, mesh, layout="metp")
    tokens = torch.randint(0, model.config.vocab_size, (2, 17))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    state = tp.full_state_dict(model)
    running = threads()
    if phase == "destroy":
        dist.destroy_process_group()
    ended = tp_mesh.release_process_groups()
    # one write per line (print writes the text and its newline apart, and the two ranks share one pipe)
    sys.stdout.write(f"rank {rank} {phase}: ended {ended}, threads {before} {started} {running} {threads()} "
                     f"initialized {dist.is_initialized()}\n")
    sys.stdout.flush()
"""


def _phase(tmp_path: Path, phase: str) -> str:
    (tmp_path / "release.py").write_text(RELEASE)
    env = environment() | {"PHASE": phase}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "release.py"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc.stdout


@pytest.mark.parametrize("phase", ["destroy", "kept"])
def test_release_joins_every_process_group_thread_with_or_without_destroy(tmp_path, phase):
    out = _phase(tmp_path, phase)
    lines = re.findall(rf"(?m)^rank (\d) {phase}: ended (\w+), threads (\d+) (\d+) (\d+) (\d+) "
                       rf"initialized (\w+)$", out)
    assert sorted(rank for rank, *_ in lines) == ["0", "1"], out[-3000:]
    for rank, ended, before, started, running, after, initialized in lines:
        assert ended == "True" and initialized == "False"  # gloo: the release ends a group the user left too
        assert int(before) == 0 and int(running) > int(started) > 0  # the groups' gloo threads ran ...
        assert int(after) == 0  # ... and every one of them is joined: nothing left to interpreter shutdown


def test_a_worker_stuck_in_a_collective_delays_the_exit_by_the_timeout_only(tmp_path):
    out = _phase(tmp_path, "stuck")  # (and both processes exit 0)
    assert dict(re.findall(r"(?m)^rank (\d) stuck: ended (\w+) in", out)) == {"0": "True", "1": "False"}
    (seconds,) = re.findall(r"(?m)^rank 1 stuck: ended False in (\d+\.\d+) s$", out)
    assert float(seconds) < 2.5  # the release returned after its 0.5 s, not the group's 60 s
