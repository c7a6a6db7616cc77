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

import contextlib
import errno
import hashlib
import json
import os
import shutil
import warnings
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from lightning_tp2d.errors import CheckpointError

CHECKSUMS = "checksums.json"  # sizes and digests of a saved directory's files

__all__ = ["CHECKSUMS", "clear", "commit", "describe_failure", "file_digest", "gather_objects", "old_path",
           "resolve", "save_staged", "staging_path", "verify", "write_checksums", "free_bytes", "human_bytes",
           "mount_of"]


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


def _causes(err: BaseException):
    """``err`` and every exception behind it: chained causes and contexts, and the per-rank failures torch's
    ``CheckpointException`` carries (``{rank: (exception, traceback)}``)."""
    todo, seen = [err], set()
    while todo:
        cause = todo.pop(0)
        if cause is None or id(cause) in seen:
            continue
        seen.add(id(cause))
        yield cause
        todo += [cause.__cause__, cause.__context__]
        failures = getattr(cause, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]


def describe_failure(err: BaseException) -> str:
    """One line for a failed write or read; a full disk or a file-size limit is said as such, however deep a
    library (torch's DCP included, which wraps each rank's error in a ``CheckpointException``) wrapped it."""
    causes = list(_causes(err))
    for cause in causes:
        if (isinstance(cause, OSError) and cause.errno == errno.ENOSPC) or "No space left on device" in str(cause):
            return "the disk is full (No space left on device)"
        if (isinstance(cause, OSError) and cause.errno == errno.EFBIG) or "File too large" in str(cause):
            return "a file outgrew the file-size limit (File too large)"
    named = next((c for c in causes if isinstance(c, OSError)), None)
    if named is None:  # torch's CheckpointException's own text is a traceback per rank: name the first cause
        named = causes[1] if type(err).__name__ == "CheckpointException" and len(causes) > 1 else err
    text = str(named).strip().splitlines()
    return f"{type(named).__name__}: {text[0] if text else ''}"


def mount_of(path: Path) -> Path:
    """The mount point of the file system holding ``path`` (or its nearest existing parent)."""
    path = Path(os.path.abspath(path))
    while not path.exists():
        path = path.parent
    while not os.path.ismount(path):
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    """Bytes free to this user on the file system holding ``path``."""
    return shutil.disk_usage(mount_of(path)).free


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


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


QUICK_DIGEST_BYTES = 64 << 20  # the launcher's quick check digests files up to this size (the ranks digest all)


def _zip_problems(path: Path) -> list[str]:
    """A single-file checkpoint checked by the CRC-32 that torch's zip format records for every entry."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, EOFError) as err:
        return [f"{path.name}: not a complete zip archive as torch.save writes ({err}; truncated or damaged)"]
    return [f"{path.name}: entry {bad!r} differs from what was written (CRC-32 mismatch: damaged)"] if bad else []


def verify(path: Path, rank: int = 0, world_size: int = 1,
           all_gather: Callable[[list], list] | None = None, *, quick: bool = False) -> None:
    """Check a checkpoint before it is loaded: a directory's files against ``checksums.json`` (this rank checks
    every ``world_size``-th file), a single file against the CRC-32 of each entry of torch's zip format (rank 0);
    ``all_gather`` pools the findings so every rank raises the same :class:`CheckpointError`, naming each bad file
    with the recorded and the found size or digest. ``quick``: sizes of every file and digests of those up to
    :data:`QUICK_DIGEST_BYTES` only (one process, before the ranks start; they check the rest). A directory without
    ``checksums.json`` cannot be checked: one warning names it (loaders take ``verify=False`` to skip silently)."""
    problems: list[str] = []
    record = path / CHECKSUMS
    if path.is_file():
        problems = _zip_problems(path) if rank == 0 and not quick else []
    elif not record.is_file():
        if rank == 0:
            warnings.warn(f"checkpoint {str(path)!r} has no {CHECKSUMS}, so its files cannot be checked (written "
                          "before checksums existed, or copied without it); pass verify=False to load it without "
                          "this warning", stacklevel=3)
    else:
        try:
            files = json.loads(record.read_text())["files"]
        except (ValueError, KeyError, TypeError) as err:
            problems, files = [f"{CHECKSUMS}: unreadable ({err})"], {}
        names = sorted(files) if quick else sorted(files)[rank::world_size]
        for name in names:
            expected, file = files[name], path / name
            if not file.is_file():
                problems.append(f"{name}: missing")
            elif file.stat().st_size != expected["bytes"]:
                problems.append(f"{name}: {file.stat().st_size} bytes, written with {expected['bytes']} (truncated "
                                "or overwritten)")
            elif quick and expected["bytes"] > QUICK_DIGEST_BYTES:
                continue
            elif (found := file_digest(file)["blake2b"]) != expected["blake2b"]:
                problems.append(f"{name}: contents differ from what was written (damaged: blake2b {found}, "
                                f"recorded {expected['blake2b']})")
    if all_gather is not None:
        problems = sorted({p for found in all_gather(problems) for p in found})
    if problems:
        raise CheckpointError(f"checkpoint {str(path)!r} is damaged and was not loaded: " + "; ".join(problems)
                              + ". Load an earlier checkpoint (every save is a separate directory unless "
                              "save_top_k removed it), or restore the files from a copy.")


def _attempt(step: Callable[[], Any], where: Path) -> tuple[str | None, Any]:
    """``(None, step())``, or ``(one line, None)`` when it fails, torch's ``CheckpointException`` (a
    ``BaseException``) included; an unnamed write error on a disk left with (almost) nothing free is a full disk (torch's
    zip writer says only "file write failed"). Ctrl-C and ``sys.exit`` pass through."""
    try:
        return None, step()
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as err:  # noqa: BLE001 - agreed on by every rank, then raised on each
        line = describe_failure(err)
        if "disk is full" not in line and "write" in str(err).lower():
            with contextlib.suppress(OSError):
                if free_bytes(where) < FULL_DISK_BYTES:
                    line = f"the disk is full ({human_bytes(free_bytes(where))} free; {line})"
        return line, None


FULL_DISK_BYTES = 1 << 20  # a write error with less than this free is taken for a full disk


def _by_cause(outcomes: list[str | None]) -> list[str]:
    """``["rank 2: cause", "ranks 0, 1, 3: other cause"]`` from every rank's outcome (``None``: it succeeded)."""
    ranks: dict[str, list[int]] = {}
    for rank, cause in enumerate(outcomes):
        if cause:
            ranks.setdefault(cause, []).append(rank)
    return [f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {cause}" for cause, rs in ranks.items()]


def save_staged(write: Callable[[Path], dict[str, dict]], path: Path, *, rank: int, directory: bool,
                checksummed: Iterable[str] = (), barrier: Callable[[str], None] = lambda name: None,
                all_gather: Callable[[Any], list] = gather_objects, planned_bytes: int = 0) -> None:
    """Save ``path`` the crash-safe way (module docstring). Every rank calls it; ``write(staging)`` writes this
    rank's part (into the staging directory when ``directory``, else the staging file) and returns the digests of
    the files it wrote (:func:`file_digest`, for ``checksums.json``; ``checksummed``: files rank 0 adds after
    every rank wrote); ``planned_bytes``: about what this rank writes (for the message when the disk is full).
    ``barrier`` and ``all_gather`` are the job's collectives (a no-op and ``[obj]`` in one process). A failure on
    any rank, in its write or in rank 0's checksums and renames, torch's own exceptions included, is agreed on by
    all: the staging copy is removed, the previous copy stays, and every rank raises :class:`CheckpointError`
    naming the rank and the cause (for a full disk also the file system, the bytes the save needs and those free)."""
    staging = staging_path(path)
    if rank == 0:
        clear(staging)  # debris of a save that crashed
        path.parent.mkdir(parents=True, exist_ok=True)
        if directory:
            staging.mkdir()
    barrier("tp2d_save_start")
    failure, digests = _attempt(lambda: write(staging), staging.parent)
    results = all_gather((failure, digests, int(planned_bytes)))
    failures = _by_cause([f for f, _, _ in results])
    if not failures:  # rank 0 finishes: checksums, then the renames; its outcome is agreed on too
        def finish() -> None:
            if directory:
                write_checksums(staging, {name: d for _, ds, _ in results for name, d in ds.items()}, checksummed)
            commit(staging, path)

        final, _ = _attempt(finish, staging.parent) if rank == 0 else (None, None)
        failures = _by_cause(all_gather(final))
    if failures:
        if rank == 0:
            clear(staging)
        barrier("tp2d_save_failed")
        disk = ""
        if any("disk is full" in f for f in failures):
            needed = sum(n for _, _, n in results)
            where = mount_of(path.parent)
            disk = (f"; the save needs about {human_bytes(needed)} on {where} ({human_bytes(free_bytes(where))} free "
                    "now)") if needed else f"; {where} has {human_bytes(free_bytes(where))} free now"
        raise CheckpointError(f"saving checkpoint {str(path)!r} failed ({'; '.join(failures)}){disk}; the "
                              f"half-written copy was removed and the previous checkpoint at that path, if any, is "
                              "intact")
    barrier("tp2d_save_done")
