"""The planner's on-disk cache: a finished answer, stored as JSON under a key made of everything it depends on.

A key is the SHA-256 of a canonical JSON document: what was asked (the model's config fields, the cluster, the
search's options, the hardware's every rate) and the digest of the package's own source files, so that an answer is
never served by code other than the code that would compute it now (any edit of the package, a new version, starts
afresh). Entries are written atomically (a temporary file renamed into place), one file per key, so concurrent
planners (every rank of a job with ``layout="auto"``, say) never read half an entry; a file that does not parse is
ignored and rewritten.

Where: ``$TP2D_PLAN_CACHE`` if set (``""`` or ``"0"``: no cache), else ``$XDG_CACHE_HOME/lightning_tp2d/plan``, else
``~/.cache/lightning_tp2d/plan``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["cache_dir", "cache_key", "load", "store", "source_digest"]

_PACKAGE = Path(__file__).resolve().parents[1]


@functools.cache
def source_digest() -> str:
    """BLAKE2b of every ``.py`` file of the installed package (path and contents), computed once per process."""
    h = hashlib.blake2b(digest_size=16)
    for path in sorted(_PACKAGE.rglob("*.py")):
        h.update(str(path.relative_to(_PACKAGE)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def cache_dir(cache: bool | str | os.PathLike | None = True) -> Path | None:
    """The folder answers live in, or ``None`` for no cache: ``cache`` a path (that folder), ``False`` (none), or
    ``True``/``None`` (the environment's choice, module docstring)."""
    if cache is False:
        return None
    if cache not in (True, None):
        return Path(cache)
    env = os.environ.get("TP2D_PLAN_CACHE")
    if env is not None:
        return None if env in ("", "0") else Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lightning_tp2d" / "plan"


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"__type__": type(value).__name__, **{k: _plain(v) for k, v in dataclasses.asdict(value).items()}}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    raise TypeError(f"plan cache: cannot key on a {type(value).__name__} ({value!r})")


def cache_key(kind: str, **asked: Any) -> str:
    """The key of an answer of ``kind`` (e.g. ``"plan"``) to the question ``asked`` (dataclasses, mappings,
    sequences and scalars), under this package's source."""
    document = json.dumps({"kind": kind, "source": source_digest(), "asked": _plain(asked)}, sort_keys=True)
    return hashlib.sha256(document.encode()).hexdigest()


def load(folder: Path | None, key: str) -> Any | None:
    """The stored answer, or ``None`` (no cache, no entry, or an entry that does not parse)."""
    if folder is None:
        return None
    try:
        with open(folder / f"{key}.json") as f:
            return json.load(f)["answer"]
    except (OSError, ValueError, KeyError):
        return None


def store(folder: Path | None, key: str, answer: Any) -> None:
    """Write ``answer`` (JSON-serialisable) under ``key``, atomically. A folder that cannot be written is skipped:
    the cache only ever saves time."""
    if folder is None:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"answer": answer}, f)
            os.replace(tmp, folder / f"{key}.json")
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        return
