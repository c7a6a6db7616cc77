"""Crash-safe saving and checked loading of a file or a directory of files written by every rank, for any content
(the model-specific part, what each rank writes, is :mod:`lightning_tp2d.checkpoint`'s).

* **Staging:** everything is written to ``<path>.tmp-tp2d`` and moved into place only when complete (:func:`commit`:
  two renames; between them the previous copy survives as ``<path>.old-tp2d``, which :func:`resolve` falls back
  to), so a crash mid-save leaves the previous copy untouched.
* **Agreement:** :func:`save_staged` runs the write on every rank and pools the outcome: a failure on any rank (a
  full disk, a permission error) removes the staging copy on every rank's word and raises
  :class:`~lightning_tp2d.errors.CheckpointError` naming the rank and the cause, on every rank.
* **Checksums:** a directory records the size and BLAKE2b digest of every file in ``checksums.json``
  (:func:`write_checksums`); :func:`verify` checks them before a load, each rank a share of the files, and names
  every missing, truncated or damaged file in one error.

Floors: stands on :mod:`lightning_tp2d.errors` and torch's process group only.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from lightning_tp2d.errors import CheckpointError

CHECKSUMS = "checksums.json"  # sizes and digests of a saved directory's files

__all__ = ["CHECKSUMS", "clear", "commit", "describe_failure", "file_digest", "gather_objects", "old_path",
           "resolve", "save_staged", "staging_path", "verify", "write_checksums"]


def staging_path(path: Path) -> Path:
    """Where a save of ``path`` is written until it is complete."""
    return path.with_name(path.name + ".tmp-tp2d")


def old_path(path: Path) -> Path:
    """Where the previous copy of ``path`` waits while a complete save replaces it."""
    return path.with_name(path.name + ".old-tp2d")


def clear(path: Path) -> None:
    """Remove a file, a link or a directory tree, if there is one."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def commit(staging: Path, path: Path) -> None:
    """Move a complete save from ``staging`` to ``path``. Replacing an existing one takes two renames; between them
    the previous copy survives as ``<path>.old-tp2d``, which :func:`resolve` falls back to."""
    old = old_path(path)
    if path.exists() or path.is_symlink():
        clear(old)
        os.replace(path, old)
    os.replace(staging, path)
    clear(old)  # also the survivor of an earlier interrupted replacement


def resolve(path: str | os.PathLike) -> Path:
    """``path``, or the previous copy a save interrupted between its two renames left (with a warning);
    ``FileNotFoundError`` when neither exists."""
    path = Path(path)
    if not path.exists() and old_path(path).exists():
        warnings.warn(f"{path} is missing (a save was interrupted); loading the previous {old_path(path)}")
        return old_path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    return path


def gather_objects(obj) -> list:
    """Every rank's ``obj`` (an all-gather over the default group; ``[obj]`` without one)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [obj]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def describe_failure(err: BaseException) -> str:
    """One line for a failed write or read; a full disk is said as such, however deep a library wrapped it."""
    cause: BaseException | None = err
    while cause is not None:
        if (isinstance(cause, OSError) and cause.errno == errno.ENOSPC) or "No space left on device" in str(cause):
            return "the disk is full (No space left on device)"
        cause = cause.__cause__
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def file_digest(path: Path) -> dict[str, Any]:
    """``{"bytes": size, "blake2b": hex digest}`` of one file (read in 8 MiB blocks)."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            h.update(block)
    return {"bytes": path.stat().st_size, "blake2b": h.hexdigest()}


def write_checksums(directory: Path, digests: dict[str, dict], also: Iterable[str] = ()) -> None:
    """Rank 0, after every rank wrote: ``checksums.json`` with ``digests`` (every rank's files) and the digests of
    the files named in ``also`` that exist (those rank 0 wrote, or a library's index)."""
    files = dict(digests)
    for name in also:
        if (directory / name).is_file():
            files[name] = file_digest(directory / name)
    (directory / CHECKSUMS).write_text(json.dumps({"algorithm": "blake2b-128", "files": files}, indent=1,
                                                  sort_keys=True))


def verify(path: Path, rank: int = 0, world_size: int = 1,
           all_gather: Callable[[list], list] | None = None) -> None:
    """Check a saved directory's files against ``checksums.json`` (this rank checks every ``world_size``-th file;
    ``all_gather`` pools the findings so every rank raises the same :class:`CheckpointError`). A directory written
    before checksums existed is not checked."""
    record = path / CHECKSUMS
    if not record.is_file():
        return
    try:
        files = json.loads(record.read_text())["files"]
    except (ValueError, KeyError) as err:
        problems = [f"{CHECKSUMS}: unreadable ({err})"]
        files = {}
    else:
        problems = []
    for name in sorted(files)[rank::world_size]:
        expected, file = files[name], path / name
        if not file.is_file():
            problems.append(f"{name}: missing")
        elif file.stat().st_size != expected["bytes"]:
            problems.append(f"{name}: {file.stat().st_size} bytes, written with {expected['bytes']} (truncated or "
                            f"overwritten)")
        elif file_digest(file)["blake2b"] != expected["blake2b"]:
            problems.append(f"{name}: contents differ from what was written (damaged)")
    if all_gather is not None:
        problems = sorted({p for found in all_gather(problems) for p in found})
    if problems:
        raise CheckpointError(f"checkpoint {str(path)!r} is damaged and was not loaded: " + "; ".join(problems)
                              + ". Load an earlier checkpoint (every save is a separate directory unless "
                              "save_top_k removed it), or restore the files from a copy.")


def save_staged(write: Callable[[Path], dict[str, dict]], path: Path, *, rank: int, directory: bool,
                checksummed: Iterable[str] = (), barrier: Callable[[str], None] = lambda name: None,
                all_gather: Callable[[Any], list] = gather_objects) -> None:
    """Save ``path`` the crash-safe way (module docstring). Every rank calls it; ``write(staging)`` writes this
    rank's part (into the staging directory when ``directory``, else the staging file) and returns the digests of
    the files it wrote (:func:`file_digest`, for ``checksums.json``; ``checksummed``: files rank 0 adds after
    every rank wrote). ``barrier`` and ``all_gather`` are the job's collectives (a no-op and ``[obj]`` in one
    process). A failure on any rank is agreed on by all: the staging copy is removed, the previous copy stays, and
    every rank raises :class:`CheckpointError` naming the rank and the cause."""
    staging = staging_path(path)
    if rank == 0:
        clear(staging)  # debris of a save that crashed
        path.parent.mkdir(parents=True, exist_ok=True)
        if directory:
            staging.mkdir()
    barrier("tp2d_save_start")
    failure, digests = None, {}
    try:
        digests = write(staging)
    except Exception as err:  # noqa: BLE001 - agreed on below, then raised on every rank
        failure = describe_failure(err)
    results = all_gather((failure, digests))
    failures = [f"rank {r}: {f}" for r, (f, _) in enumerate(results) if f]
    if failures:
        if rank == 0:
            clear(staging)
        barrier("tp2d_save_failed")
        raise CheckpointError(f"saving checkpoint {str(path)!r} failed ({'; '.join(failures)}); the half-written "
                              f"copy was removed and the previous checkpoint at that path, if any, is intact")
    if rank == 0:
        if directory:
            write_checksums(staging, {name: d for _, ds in results for name, d in ds.items()}, checksummed)
        commit(staging, path)
    barrier("tp2d_save_done")
