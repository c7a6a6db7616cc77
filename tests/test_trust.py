"""A checkpoint is data, not code (issue 34): a planted pickle payload never runs in any loader, each loader checks
the files first and names the damaged one, and a real full disk in torch's own DCP writer loses nothing.

The payload is harmless: unpickling it creates a marker file. Every test asserts the marker never appears (and,
with ``trust_checkpoint=True``, that it does: the switch really is the old way)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

import lightning_tp2d as tp
from lightning_tp2d import checkpoint as ckpt
from lightning_tp2d.models import GPT2, GPT2Config
from lightning_tp2d.safe_files import CHECKSUMS, file_digest
from lightning_tp2d.trust import UntrustedCheckpointError, to_plain, untrusted_entries
from tests.distributed import run_distributed

CONFIG = GPT2Config.from_name("gpt2-tiny")


class Payload:
    """Unpickling this creates the directory ``marker`` (``os.makedirs``): code a checkpoint's data never needs."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (str(self.marker), 0o777, True))  # exist_ok: it may run more than once


def _module(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    module = torch.nn.Module()
    module.model = GPT2(CONFIG)
    return module


def _checkpoint(module, step: int = 3) -> dict:
    return {"state_dict": module.state_dict(keep_vars=True), "optimizer_states": [], "global_step": step, "epoch": 0}


def _recompute_checksums(directory: Path) -> None:
    """What anyone who can write a checkpoint's files can do: record the planted file's digest."""
    record = json.loads((directory / CHECKSUMS).read_text())
    for name in record["files"]:
        record["files"][name] = file_digest(directory / name)
    (directory / CHECKSUMS).write_text(json.dumps(record))


def _plant_in_meta(directory: Path, marker: Path) -> None:
    meta = torch.load(directory / ckpt.META, weights_only=True)
    meta["hyper_parameters"] = {"evil": Payload(marker)}
    torch.save(meta, directory / ckpt.META)
    _recompute_checksums(directory)


def _plant_in_dcp_metadata(directory: Path, marker: Path) -> None:
    md = ckpt.dcp.FileSystemReader(str(directory)).read_metadata()
    md.planner_data = {"evil": Payload(marker)}
    (directory / ".metadata").write_bytes(pickle.dumps(md))
    _recompute_checksums(directory)


@pytest.fixture
def sharded(tmp_path) -> Path:
    path = tmp_path / "step=3.ckpt"
    ckpt.save(_checkpoint(_module()), path, rank=0, sharded=True)
    return path


@pytest.mark.parametrize("where", ["meta.pt", ".metadata"])
def test_a_planted_payload_runs_in_no_loader_and_is_named(sharded, tmp_path, where):
    from lightning_tp2d.generate import main as generate

    marker = tmp_path / "payload-ran"
    (_plant_in_meta if where == "meta.pt" else _plant_in_dcp_metadata)(sharded, marker)
    asked = r"os\.makedirs"
    loaders = {
        "read_state_dict": lambda: tp.read_state_dict(sharded),
        "load_gpt2": lambda: tp.load_gpt2(sharded, CONFIG),
        "load_model": lambda: tp.load_model(sharded, CONFIG),
        "export_hf": lambda: tp.export_hf(sharded, tmp_path / "hf", CONFIG),
        "saved_step": lambda: ckpt.saved_step(sharded),
        "load_into": lambda: ckpt.load_into(_module(1), [], sharded),
    }
    for name, load in loaders.items():
        with pytest.raises(UntrustedCheckpointError, match=rf"{where}' asks to import '({asked})'.*trust_checkpoint"):
            load()
        assert not marker.exists(), f"{name} ran the payload"
    assert not (tmp_path / "hf" / "model.safetensors").exists()
    assert generate([str(sharded), "--max-new-tokens", "2"]) == 2  # one line, exit 2
    assert not marker.exists()
    with pytest.warns(UserWarning, match="trust_checkpoint=True"):  # the old way, asked for: the pickle runs
        tp.read_state_dict(sharded, trust_checkpoint=True)
    assert marker.exists()


def test_a_planted_payload_in_a_single_file_runs_in_no_loader(tmp_path):
    marker, path = tmp_path / "payload-ran", tmp_path / "full.ckpt"
    checkpoint = _checkpoint(_module())
    checkpoint["hyper_parameters"] = {"evil": Payload(marker)}
    torch.save(checkpoint, path)
    for load in (lambda: tp.load_model(path, CONFIG), lambda: ckpt.load_into(_module(1), [], path),
                 lambda: ckpt.saved_step(path)):
        with pytest.raises(UntrustedCheckpointError, match=r"full.ckpt' asks to import 'os\.makedirs'"):
            load()
    assert not marker.exists()


def test_tp2d_train_launcher_refuses_a_payload_before_any_rank_starts(sharded, tmp_path):
    """``tp2d-train ckpt_path=...`` read meta.pt with the full unpickler before any check, even for "nothing to
    train" (exit 0). Now: one line, exit 2, the payload never runs."""
    marker = tmp_path / "payload-ran"
    _plant_in_meta(sharded, marker)
    proc = subprocess.run([shutil.which("tp2d-train"), "experiment=quick", f"ckpt_path={sharded}",
                           "trainer.max_steps=3", f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "asks to import 'os.makedirs'" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not marker.exists()


def test_what_the_package_writes_loads_as_data(tmp_path):
    """Hydra's OmegaConf lists (tp2d-train's data hyper-parameters) made every tp2d-train checkpoint need the full
    unpickler; they are written as plain lists now, and a value that cannot be is named at save time."""
    from lightning.fabric.utilities.data import AttributeDict
    from omegaconf import OmegaConf

    hparams = AttributeDict(suffixes=OmegaConf.create([".txt", ".md"]), nested=OmegaConf.create({"a": [1, 2]}),
                            path=Path("/data/corpus.txt"))
    plain = to_plain({"datamodule_hyper_parameters": hparams})
    assert plain == {"datamodule_hyper_parameters": {"suffixes": [".txt", ".md"], "nested": {"a": [1, 2]},
                                                     "path": "/data/corpus.txt"}}
    assert type(plain["datamodule_hyper_parameters"]["suffixes"]) is list and untrusted_entries(plain) == []
    path = tmp_path / "last.ckpt"
    checkpoint = {**_checkpoint(_module()), "datamodule_hyper_parameters": hparams}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        ckpt.save(checkpoint, path, rank=0, sharded=True)
    meta = torch.load(path / ckpt.META, weights_only=True)  # torch's own safe load, no allow-list
    assert meta["datamodule_hyper_parameters"]["suffixes"] == [".txt", ".md"]
    with pytest.warns(UserWarning, match=r"hyper_parameters\.evil \(tests\.test_trust\.Payload\) will load only "
                                         r"with trust_checkpoint=True"):
        ckpt.save({**_checkpoint(_module()), "hyper_parameters": {"evil": Payload(tmp_path / "m")}},
                  tmp_path / "other.ckpt", rank=0, sharded=True)


def test_checksums_are_checked_by_every_loader_and_their_absence_is_said(sharded, tmp_path):
    shard = sorted(sharded.glob("*.distcp"))[0]
    good = shard.read_bytes()
    data = bytearray(good)
    data[len(data) // 2: len(data) // 2 + 64] = bytes(64)
    shard.write_bytes(bytes(data))
    damaged = rf"{shard.name}: contents differ from what was written \(damaged: blake2b [0-9a-f]+, recorded [0-9a-f]+"
    for load in (lambda: tp.export_hf(sharded, tmp_path / "hf", CONFIG), lambda: tp.read_state_dict(sharded),
                 lambda: tp.load_gpt2(sharded, CONFIG)):
        with pytest.raises(ckpt.CheckpointError, match=damaged):
            load()
    assert not (tmp_path / "hf" / "model.safetensors").exists()  # used to be written with 16 NaNs
    shard.write_bytes(good)
    (sharded / CHECKSUMS).unlink()  # used to turn every check off silently
    with pytest.warns(UserWarning, match=r"step=3.ckpt' has no checksums.json, so its files cannot be checked"):
        tp.read_state_dict(sharded)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tp.read_state_dict(sharded, verify=False)


# ---- a real full disk, through torch's own DCP writer on 4 ranks -------------------------------------------------

def _save_on_a_small_disk(rank: int, world_size: int, directory: str, how: str) -> dict:
    import resource
    import signal

    import torch.distributed as dist

    mesh = tp.init_mesh("metp", world_size, 1)
    module = _module()
    tp.parallelize(module.model, mesh, layout="metp")
    path = Path(directory) / "last.ckpt"

    def save(step):
        ckpt.save(_checkpoint(module, step), path, rank=rank, sharded=True, barrier=lambda name: dist.barrier())

    save(1)
    own = max(f.stat().st_size for f in ckpt.own_files(path, rank))
    if how == "rlimit":  # every rank's shard outgrows a file-size limit (SIGXFSZ ignored: write fails with EFBIG)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (own // 2, resource.RLIM_INFINITY))
    try:
        save(2)
    except ckpt.CheckpointError as err:
        error = str(err)
    else:
        error = None
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    dist.barrier()
    return {"error": error, "staging": ckpt.staging_path(path).exists(), "step": ckpt.saved_step(path),
            "loads": sorted(ckpt.read_state_dict(path)) == sorted(module.state_dict())}


def _tmpfs(directory: Path, size: int) -> bool:
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                          capture_output=True).returncode == 0


@pytest.mark.parametrize("how", ["tmpfs", "rlimit"])
def test_a_real_full_disk_in_torchs_writer_keeps_the_previous_checkpoint(tmp_path, how):
    """torch's DCP wraps each rank's write error in ``CheckpointException``, a ``BaseException`` the save's
    handler did not catch: 4 tracebacks and the staging folder left, keeping the disk full. The tmpfs holds one
    checkpoint and a half (root only; the file-size limit exercises the same path anywhere)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if how == "tmpfs":
        probe = tmp_path / "probe.ckpt"
        ckpt.save(_checkpoint(_module()), probe, rank=0, sharded=True)
        size = sum(f.stat().st_size for f in probe.iterdir())
        if not _tmpfs(disk, int(size * 1.5)):
            pytest.skip("mounting a tmpfs needs root")
    try:
        results = run_distributed(_save_on_a_small_disk, 4, str(disk), how)
    finally:
        if how == "tmpfs":
            subprocess.run(["umount", str(disk)], check=False)
    for r in results:
        assert r["error"] is not None and "\n" not in r["error"], r
        cause = "the disk is full" if how == "tmpfs" else "File too large"
        assert cause in r["error"] and "previous checkpoint at that path, if any, is intact" in r["error"], r
        assert not r["staging"] and r["step"] == 1 and r["loads"], r
    if how == "tmpfs":
        assert f"on {disk} (" in results[0]["error"] and "the save needs about" in results[0]["error"]
