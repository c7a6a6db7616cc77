"""Faults a shared cluster produces, scripted: each case asserts the outcome, the time to end and what is left.

Covered so far (issue 13): a stalled rank under a short timeout (every mesh axis group gets the timeout; the
surviving ranks end within about that time with an error naming the axis and ranks); a diverging loss (training
stops, the last finite checkpoint survives); SIGTERM to every rank (one step boundary, that step saved, exit 143).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import lightning_tp2d as tp
from lightning_tp2d.comm import CommError
from lightning_tp2d.mesh import as_timeout, group_timeout
from lightning_tp2d.models import GPT2, GPT2Config
from tests.distributed import run_distributed
from tests.waiting import wait_until

TIMEOUT_S = 2.0


def _stall(rank: int, world_size: int, layout: str, stalled: int) -> dict:
    mesh = tp.init_mesh(layout, world_size, 1, timeout=TIMEOUT_S)
    timeouts = {axis: group_timeout(mesh.get_group(axis)) for axis in mesh.mesh_dim_names if mesh.size(
        mesh.mesh_dim_names.index(axis)) > 1}
    cfg = GPT2Config.from_name("gpt2-tiny", n_head=4, dropout=0.0)
    torch.manual_seed(0)
    model = tp.parallelize(GPT2(cfg), mesh, layout)
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    model(idx, idx).backward()  # everyone healthy once
    torch.distributed.barrier()
    if rank == stalled:
        time.sleep(3 * TIMEOUT_S)  # a rank stops answering (a hung data loader, a SIGSTOP, a slow disk)
    t0 = time.monotonic()
    try:
        model(idx, idx).backward()
        error = None
    except CommError as err:
        error = str(err)
    return {"timeouts": {k: v.total_seconds() for k, v in timeouts.items()}, "error": error,
            "seconds": time.monotonic() - t0}


@pytest.mark.parametrize("layout", ["2d", "metp"])
def test_a_stalled_rank_ends_the_step_within_the_timeout_naming_the_axis(layout):
    stalled = 3
    results = run_distributed(_stall, 4, layout, stalled, timeout=120, fresh=True)  # its ranks time out: not pooled
    for rank, r in enumerate(results):
        assert set(r["timeouts"].values()) == {TIMEOUT_S}, (rank, r["timeouts"])  # every axis group, not 30 min
        if rank == stalled:
            continue
        assert r["error"] is not None, (rank, r)
        assert "along mesh axis" in r["error"] and "did not complete" in r["error"], r["error"]
        assert r["seconds"] < 3 * TIMEOUT_S, (rank, r["seconds"])  # about the timeout, never the default 30 min


def test_timeout_values_are_seconds_or_timedeltas():
    assert as_timeout(90) == timedelta(seconds=90)
    assert as_timeout(timedelta(minutes=2)) == timedelta(minutes=2)
    assert as_timeout(None) is None
    with pytest.raises(ValueError, match="timeout must be seconds"):
        as_timeout("60")
    with pytest.raises(ValueError, match="timeout must be positive"):
        as_timeout(0)
    assert tp.TP2DStrategy(timeout=60).timeout == timedelta(seconds=60)


def _diverge(rank: int, world_size: int, tmp: str) -> dict:
    import glob

    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_tp2d.callbacks import DivergenceGuard
    from lightning_tp2d.errors import DivergenceError

    L.seed_everything(0)
    checkpoints = ModelCheckpoint(dirpath=tmp, every_n_train_steps=1, save_top_k=1)  # keeps only the newest
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=30, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, log_every_n_steps=5,
                        callbacks=[DivergenceGuard(), checkpoints])
    module = tp.CausalLMModule("gpt2-tiny", learning_rate=1e6, warmup_steps=0)  # diverges within a few steps
    data = tp.TextDataModule(block_size=32, batch_size=4, max_tokens=20_000)
    try:
        trainer.fit(module, data)
        error = None
    except DivergenceError as err:
        error = str(err)
    kept = sorted(glob.glob(f"{tmp}/*.ckpt"))
    states = [torch.load(path, map_location="cpu", weights_only=False) for path in kept]
    return {"error": error, "stopped_at": trainer.global_step, "kept": [s["global_step"] for s in states],
            "finite": [all(torch.isfinite(v).all().item() for v in s["state_dict"].values()) for s in states]}


def test_divergence_stops_training_and_keeps_the_last_finite_checkpoint(tmp_path):
    from tests.lightning_ranks import run_ranks

    r = run_ranks(_diverge, 1, str(tmp_path))[0]
    assert r["error"] is not None and "non-finite" in r["error"], r
    assert r["stopped_at"] < 30  # stopped, not trained to the end on NaN
    assert r["kept"] and all(r["finite"]), r  # a checkpoint survives, and it is finite
    assert max(r["kept"]) < r["stopped_at"], r  # from before the divergence


@pytest.mark.parametrize("extra", [(), ("parallel=metp", "parallel.tensor_parallel_size=2",
                                           "parallel.pipeline_parallel_size=2", "parallel.microbatches=2")],
                         ids=["2x2", "pp2-ring2"])
def test_sigterm_to_every_rank_stops_them_at_one_step_saves_it_and_exits_143(tmp_path, extra):
    """Preemption (``scancel``, Kubernetes, torchrun's SIGTERM) reaches every rank at once: the case that deadlocked
    in Lightning's own handler. Every rank stops after the same step, that step is saved, and the command exits
    with 143 (128 + SIGTERM) within seconds. (A signal on rank 0 alone travels in the same per-step all-reduce as
    Ctrl-C, tested in test_train.py.) Also with two pipeline stages (each a ring of 2): the signal lands between
    schedules, the step is saved by every stage and loads as one model."""
    import os
    import re
    import signal

    from lightning_tp2d import load_gpt2
    from tests.test_train import long_run_until_checkpoint

    proc = long_run_until_checkpoint(tmp_path, every=4, step=4, extra=extra)
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 143, out[-3000:]
    assert time.monotonic() - sent < 60
    assert re.search(r"SIGTERM: stopping after step \d+ and saving it", out)
    found = re.search(r"interrupted at step (\d+); the last complete checkpoint is (\S+)", out)
    assert found, out[-3000:]
    step, newest = int(found.group(1)), Path(found.group(2))
    target = newest.parent / os.readlink(newest)
    assert target.name == f"step={step}.ckpt" and (target / ".metadata").is_file()  # the step stopped at, saved
    assert load_gpt2(newest) is not None
    # saved at the step boundary like the periodic checkpoints (which resume exactly), not after Lightning closed the
    # epoch (which made resume start a new, reshuffled epoch): the loop state says epoch 0, still open
    meta = torch.load(target / "meta.pt", weights_only=False)
    assert meta["epoch"] == 0 and meta["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"] == 0


# ---- checkpoint integrity (one process: the same code every rank runs, with its collectives as no-ops) ----------


def _model_and_checkpoint(seed: int = 0):
    torch.manual_seed(seed)
    model = GPT2(GPT2Config.from_name("gpt2-tiny"))
    return model, {"state_dict": model.state_dict(keep_vars=True), "optimizer_states": [], "epoch": 0,
                   "global_step": seed}


def _save(path, seed=0):
    from lightning_tp2d import checkpoint as ckpt

    _, checkpoint = _model_and_checkpoint(seed)
    ckpt.save(checkpoint, path, rank=0, sharded=True)


def _load(path) -> dict:
    from lightning_tp2d import checkpoint as ckpt

    model, _ = _model_and_checkpoint(seed=99)
    return ckpt.load_into(model, [], path)


def test_damaged_truncated_or_missing_checkpoint_files_are_named_not_loaded(tmp_path):
    from lightning_tp2d.checkpoint import CHECKSUMS, CheckpointError

    path = tmp_path / "step=1.ckpt"
    _save(path, seed=1)
    assert (path / CHECKSUMS).is_file() and _load(path)["global_step"] == 1
    shard = sorted(path.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = bytes(64)  # 64 bytes overwritten: used to load NaNs silently
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard.name}: contents differ from what was written \(damaged: "
                                                 r"blake2b [0-9a-f]{32}, recorded [0-9a-f]{32}\)"):
        _load(path)
    shard.write_bytes(bytes(data[: len(data) // 3]))
    with pytest.raises(CheckpointError, match=rf"{shard.name}: \d+ bytes, written with \d+ \(truncated"):
        _load(path)
    (path / "meta.pt").unlink()
    with pytest.raises(CheckpointError, match=r"was not loaded: .*meta.pt: missing"):
        _load(path)


def test_a_full_disk_is_named_and_leaves_the_previous_checkpoint_and_no_staging_folder(tmp_path, monkeypatch):
    import errno
    import os

    from lightning_tp2d import checkpoint as ckpt

    path = tmp_path / "last.ckpt"
    _save(path, seed=1)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ckpt, "_dcp_save", full_disk)
    with pytest.raises(ckpt.CheckpointError, match=r"rank 0: the disk is full \(No space left on device\).*previous "
                                                    r"checkpoint at that path, if any, is intact"):
        _save(path, seed=2)
    assert not ckpt.staging_path(path).exists()  # no debris keeping the disk full
    assert _load(path)["global_step"] == 1


def test_a_damaged_garbage_or_truncated_single_file_checkpoint_is_named(tmp_path):
    """A single file carries no checksums.json: the CRC-32 of each entry of torch's zip format is checked instead
    (64 bytes overwritten used to load silently)."""
    from lightning_tp2d import checkpoint as ckpt

    model, checkpoint = _model_and_checkpoint(1)
    full = tmp_path / "full.ckpt"
    ckpt.save(checkpoint, full, rank=0, sharded=False)
    assert _load(full)["global_step"] == 1
    good = full.read_bytes()
    data = bytearray(good)
    data[len(data) // 2: len(data) // 2 + 64] = bytes(64)
    full.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=r"full.ckpt' is damaged and was not loaded: full.ckpt: entry "
                                                    r"'.*' differs from what was written \(CRC-32 mismatch"):
        _load(full)
    full.write_bytes(good[:1000])
    with pytest.raises(ckpt.CheckpointError, match=r"full.ckpt: not a complete zip archive .*truncated or damaged"):
        _load(full)
    full.write_bytes(b"\x7fELF" + bytes(4000))  # a binary that is not a checkpoint
    with pytest.raises(ckpt.CheckpointError, match=r"full.ckpt' is damaged and was not loaded"):
        _load(full)


def test_our_own_checkpoint_names_need_no_quoting_on_the_command_line():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from lightning_tp2d.launch import prepare_argv

    path = "outputs/2026-11-30/18-00-00/checkpoints/step=20.ckpt"
    argv = prepare_argv(["tp2d-train", f"ckpt_path={path}", "trainer.max_steps=40", "data.path='a=b.txt'"], env={})
    assert argv[1] == f"ckpt_path='{path}'" and argv[2:] == ["trainer.max_steps=40", "data.path='a=b.txt'"]
    parsed = OverridesParser.create().parse_overrides(argv[1:])
    assert parsed[0].value() == path  # what Hydra hands to the job


def test_bad_data_is_refused_before_any_process_starts(tmp_path):
    """What ``tp2d-train`` checks on the launching process (``train.check_config`` calls it)."""
    import numpy as np

    from lightning_tp2d.data import check_path

    binary = tmp_path / "lib.so"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(100))  # a shared library given as data=text
    with pytest.raises(ValueError, match=r"lib.so' is not a text file \(a NUL byte at offset 7\)"):
        check_path(binary)
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("hello")
    (folder / "b.txt").write_bytes("caf\u00e9".encode("latin-1") + b" more text")
    with pytest.raises(ValueError, match=r"b.txt' is not a text file \(invalid UTF-8 at offset 3\)"):
        check_path(folder)
    tokens = tmp_path / "train.bin"
    np.array([1, 2, 300], dtype=np.uint16).tofile(tokens)
    check_path(tokens, vocab_size=50257)
    with pytest.raises(ValueError, match=r"holds id 300, but the model's vocabulary has 257 ids"):
        check_path(tokens, vocab_size=257)
    tokens.write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError, match=r"has 3 bytes, not a whole number of uint16 ids"):
        check_path(tokens)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_path(tmp_path / "nowhere.txt")


# ---- rendezvous ----------------------------------------------------------------------------------------------------


def test_an_occupied_master_port_is_refused_before_any_rank_starts():
    import socket

    from lightning_tp2d.launch import check_master_port

    with socket.socket() as other_job:  # another job's rendezvous store listening on the exported port
        other_job.bind(("127.0.0.1", 0))
        other_job.listen()
        port = other_job.getsockname()[1]
        with pytest.raises(SystemExit, match=rf"MASTER_PORT={port} is already in use on this machine"):
            check_master_port({"MASTER_PORT": str(port)})
        check_master_port({"MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "4"})  # torchrun owns its port
    check_master_port({})  # unset: Lightning picks a free one
    with pytest.raises(SystemExit, match="is not a port number"):
        check_master_port({"MASTER_PORT": "http"})


def test_a_rank_whose_launching_process_dies_exits_instead_of_waiting(tmp_path):
    """``kill -9`` of rank 0 while the other ranks wait in the rendezvous: they notice within a second or two."""
    import os
    import signal
    import subprocess
    import sys

    child_pid = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", f"""
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", '''
import os, time
from lightning_tp2d.launch import watch_parent
watch_parent(0.2)
open({str(child_pid)!r}, "w").write(str(os.getpid()))
time.sleep(120)
'''])
time.sleep(120)
"""], env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    wait_until(lambda: child_pid.exists() and child_pid.read_text(), time.monotonic() + 60, what="the child's pid")
    assert child_pid.read_text().isdigit()
    pid = int(child_pid.read_text())
    os.kill(parent.pid, signal.SIGKILL)
    assert parent.wait() == -signal.SIGKILL
    killed = time.monotonic()
    wait_until(lambda: _ended(pid), killed + 10, interval=0.1, what="the orphaned rank's exit")
    assert _ended(pid) and time.monotonic() - killed < 5


def _ended(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return _reaped_zombie(pid)


def _reaped_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _skip_one_bad_step(rank: int, world_size: int) -> dict:
    import lightning.pytorch as L

    from lightning_tp2d.callbacks import DivergenceGuard

    class Spiky(tp.CausalLMModule):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * float("nan") if self.global_step == 3 else loss  # one bad batch

    L.seed_everything(0)
    guard = DivergenceGuard(check_every_n_steps=1, skip_bad_steps=True)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[guard])
    module = Spiky("gpt2-tiny", learning_rate=1e-3, warmup_steps=0)
    trainer.fit(module, tp.TextDataModule(block_size=32, batch_size=4, max_tokens=20_000))
    return {"steps": trainer.global_step, "skipped": guard.skipped,
            "finite": all(torch.isfinite(p).all().item() for p in module.parameters())}


def test_a_bad_step_can_be_skipped_instead_of_stopping():
    from tests.lightning_ranks import run_ranks

    r = run_ranks(_skip_one_bad_step, 1)[0]
    assert r == {"steps": 6, "skipped": 1, "finite": True}, r


def _fit_with_one_voter(rank: int, world_size: int, voter: str) -> dict:
    """One process, one of the two callbacks that share the step vote: GracefulInterrupt with a SIGUSR1 as step 3
    starts, or DivergenceGuard(check_every_n_steps=2) with a NaN loss at step 3."""
    import signal

    import lightning.pytorch as L

    from lightning_tp2d.callbacks import DivergenceGuard, GracefulInterrupt
    from lightning_tp2d.errors import DivergenceError

    class Faulty(tp.CausalLMModule):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            if self.global_step + 1 == 3 and voter == "interrupt":
                signal.raise_signal(signal.SIGUSR1)
            return loss * float("nan") if self.global_step + 1 == 3 and voter == "guard" else loss

    L.seed_everything(0)
    callback = GracefulInterrupt() if voter == "interrupt" else DivergenceGuard(check_every_n_steps=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=10, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[callback])
    try:
        trainer.fit(Faulty("gpt2-tiny", warmup_steps=0), tp.TextDataModule(block_size=32, batch_size=4,
                                                                            max_tokens=20_000))
        error = None
    except DivergenceError as err:
        error = str(err)
    return {"stopped_at": trainer.global_step, "error": error, "signum": getattr(callback, "signum", None)}


def test_each_voter_alone_stops_a_vote_late():
    """GracefulInterrupt alone votes every step: a signal during step 3 stops training after step 4.
    DivergenceGuard(check_every_n_steps=2) alone votes at steps 2, 4, 6: the NaN of step 3 is in the vote of steps
    3-4, read at step 6, and the error names that window."""
    import signal

    from tests.lightning_ranks import run_ranks

    assert run_ranks(_fit_with_one_voter, 1, "interrupt")[0] == {"stopped_at": 4, "error": None,
                                                                  "signum": signal.SIGUSR1}
    r = run_ranks(_fit_with_one_voter, 1, "guard")[0]
    assert r["stopped_at"] == 6 and "non-finite (NaN or inf) between steps 3 and 4;" in r["error"], r


def _dead_stage(rank: int, world_size: int) -> dict:
    from lightning_tp2d.pipeline import Pipeline

    mesh = tp.init_mesh("2d", 1, 1, timeout=TIMEOUT_S, pipeline_parallel_size=2)
    torch.manual_seed(0)
    pipe = Pipeline(GPT2(GPT2Config.from_name("gpt2-tiny", dropout=0.0)), mesh, "2d", microbatches=2)
    idx = torch.randint(0, 257, (4, 16))
    pipe.step(idx, idx)  # everyone healthy once
    torch.distributed.barrier()
    if rank == 1:
        os._exit(9)  # the last stage dies (an OOM kill, a lost node)
    t0 = time.monotonic()
    try:
        pipe.step(idx, idx)
        error = None
    except CommError as err:
        error = str(err)
    return {"error": error, "seconds": time.monotonic() - t0}


def test_a_dead_stage_ends_the_other_stages_step_in_one_named_error():
    """Issue 51: a pipeline stage dies between steps; the other stage's schedule, waiting on it, ends within about the
    timeout with a CommError naming the schedule and the pipeline axis (not a hang, not a bare gloo trace)."""
    from lightning_tp2d.bench import procs
    from tests.distributed import raise_failure

    alive = raise_failure(procs.run_ranks(_dead_stage, 2, timeout=120, allow_exit=True, tracebacks=True,
                                          group_timeout=TIMEOUT_S))[0]
    assert isinstance(alive, dict), alive
    assert alive["error"] is not None and "schedule's point-to-point along 'pipeline'" in alive["error"], alive
    assert "\n" not in alive["error"].strip() and alive["seconds"] < 30, alive
