"""A checkpoint is data, not code: what the package trusts when it reads one of its own files, and what it writes.

A pickle can name any importable callable and call it on load, so ``torch.load(..., weights_only=False)`` of a file
someone else could write runs their code. The package therefore reads its checkpoints as data only:

* **Its own pickles** (a sharded checkpoint's ``meta.pt``, a single-file checkpoint) load with torch's
  ``weights_only=True`` (:func:`load_data`): tensors, containers, numbers, strings and torch's dtypes, sizes and
  devices, plus whatever the user allow-listed with ``torch.serialization.add_safe_globals``. A file that asks for
  any other global is refused with one line naming the file and the global (:class:`UntrustedCheckpointError`).
* **What it writes** is made plain first (:func:`to_plain`): OmegaConf containers (Hydra's), Lightning's
  ``AttributeDict`` and other mappings become dicts, paths strings, ``argparse.Namespace`` a dict, so its own
  checkpoints always load that way; a value that still would not (a user's own class in ``hyper_parameters``) is
  named in a warning at save time (:func:`untrusted_entries`).
* **torch's DCP ``.metadata``** is a plain pickle that torch reads with ``pickle.load``. Before torch reads it,
  :func:`check_dcp_metadata` unpickles it with an allow-list of DCP's metadata classes, ``torch.Size``, dtypes,
  layouts and paths, and refuses anything else the same way.
* **Trust on request:** ``trust=True`` (``trust_checkpoint=True`` on the loaders, ``tp2d-train
  trust_checkpoint=true``, ``trainer.fit(..., weights_only=False)``) loads an old or foreign file the old way, with a
  warning: only for files whose origin you trust.

Floors: stands on :mod:`lightning_tp2d.errors` and torch only.
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import re
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path, PurePath
from typing import Any

import torch

from lightning_tp2d.errors import CheckpointError

__all__ = ["UntrustedCheckpointError", "check_dcp_metadata", "load_data", "to_plain", "untrusted_entries"]

TRUST_HINT = ("if you trust its origin (tp2d-train's checkpoints from before this check stored Hydra's OmegaConf "
              "lists), load it with trust_checkpoint=True (tp2d-train trust_checkpoint=true), which runs its pickle")


class UntrustedCheckpointError(CheckpointError):
    """A checkpoint file that asks to import code on load (a pickled global outside the data allow-list)."""


def _refusal(file: Path, name: str) -> UntrustedCheckpointError:
    return UntrustedCheckpointError(f"checkpoint file {str(file)!r} asks to import {name!r} when loaded, which a "
                                    f"checkpoint's data never needs; it was not loaded ({TRUST_HINT})")


_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")  # torch's wordings: "Unsupported global: GLOBAL x", "unsupported GLOBAL x"


def load_data(file: str | os.PathLike, *, trust: bool = False, mmap: bool = False) -> Any:
    """``torch.load`` of one of the package's pickles as data (``weights_only=True``, on the CPU). A file that asks
    for a global outside torch's allow-list raises :class:`UntrustedCheckpointError` naming it; other failures
    (damaged, truncated, not a torch file) propagate for the caller to name. ``trust=True``: the old way, warned."""
    file = Path(file)
    if trust:
        warnings.warn(f"loading {file} with trust_checkpoint=True: its pickle may run code; do this only for files "
                      "whose origin you trust", stacklevel=2)
        return torch.load(file, map_location="cpu", weights_only=False, mmap=mmap)
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        found = _GLOBAL.search(str(err))
        if found:
            raise _refusal(file, found.group(1)) from None
        if "Weights only load failed" in str(err):  # an opcode or a call outside plain data
            lines = [ln.strip() for ln in str(err).splitlines()[1:] if ln.strip() and "documentation" not in ln]
            raise UntrustedCheckpointError(f"checkpoint file {str(file)!r} is not plain data ({lines[0] if lines else ''}"
                                           f"); it was not loaded ({TRUST_HINT})") from None
        raise


# ---- torch's DCP metadata: a restricted unpickler --------------------------------------------------------------

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "ChunkStorageMetadata",
                                              "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout from its name, e.g. "torch.strided"
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice", "complex"},
}


class _DCPMetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``Metadata`` and refuses every other global (no callable outside the allow-list runs)."""

    def __init__(self, data: io.BytesIO, file: Path) -> None:
        super().__init__(data)
        self.file = file

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                         torch.memory_format)):
            return getattr(torch, name)
        raise _refusal(self.file, f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _refusal(self.file, f"persistent id {pid!r}")


def check_dcp_metadata(directory: str | os.PathLike) -> None:
    """Check a DCP directory's ``.metadata`` before torch unpickles it: only DCP's metadata classes and plain values
    (:class:`UntrustedCheckpointError` otherwise, naming the global); :class:`CheckpointError` when it is not a
    pickle of DCP's ``Metadata`` at all."""
    file = Path(directory) / ".metadata"
    try:
        value = _DCPMetadataUnpickler(io.BytesIO(file.read_bytes()), file).load()
    except UntrustedCheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - a damaged pickle fails in many ways
        raise CheckpointError(f"checkpoint file {str(file)!r} cannot be read ({type(err).__name__}: {err}): it is "
                              "damaged, truncated or not torch.distributed.checkpoint metadata") from None
    if type(value).__name__ != "Metadata":
        raise CheckpointError(f"checkpoint file {str(file)!r} holds a {type(value).__name__}, not "
                              "torch.distributed.checkpoint metadata")


# ---- writing plain data ----------------------------------------------------------------------------------------

_PLAIN = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.dtype, torch.device, torch.Size)


def _omegaconf_container(obj: Any) -> Any:
    """``obj`` as plain dicts and lists when it is an OmegaConf container (Hydra's configs), else ``None``."""
    try:
        from omegaconf import Container, OmegaConf
    except ImportError:
        return None
    if not isinstance(obj, Container):
        return None
    try:
        return OmegaConf.to_container(obj, resolve=True)
    except Exception:  # noqa: BLE001 - an interpolation that does not resolve outside its config: kept as written
        return OmegaConf.to_container(obj, resolve=False)


def to_plain(obj: Any) -> Any:
    """``obj`` with every container a builtin one (OmegaConf containers, ``AttributeDict`` and other mappings ->
    dict; ``Namespace`` -> dict; paths -> str), tensors and plain values as they are (the same objects, so tied
    tensors stay tied). What it cannot make plain (a user's own class) is left for :func:`untrusted_entries`."""
    if isinstance(obj, torch.Tensor) or type(obj) in _PLAIN:
        return obj
    container = _omegaconf_container(obj)
    if container is not None:
        return to_plain(container)
    if isinstance(obj, OrderedDict) and type(obj) is OrderedDict:
        return OrderedDict((to_plain(k), to_plain(v)) for k, v in obj.items())
    if isinstance(obj, Mapping):
        return {to_plain(k): to_plain(v) for k, v in obj.items()}
    if type(obj) in (list, tuple, set):
        return type(obj)(to_plain(v) for v in obj)
    if type(obj) is frozenset:
        return {to_plain(v) for v in obj}
    if isinstance(obj, argparse.Namespace):
        return {k: to_plain(v) for k, v in vars(obj).items()}
    if isinstance(obj, PurePath):
        return str(obj)
    return obj


def _loads_as_data(value: Any) -> bool:
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception:  # noqa: BLE001 - any refusal means "not data"
        return False
    return True


def untrusted_entries(obj: Any, prefix: str = "") -> list[str]:
    """``"key.path (TypeName)"`` for each value in ``obj`` (after :func:`to_plain`) that would not load with
    ``weights_only=True``: tensors and plain containers are walked, anything else tried alone."""
    if isinstance(obj, torch.Tensor) or type(obj) in _PLAIN:
        return []
    if type(obj) in (dict, OrderedDict):
        return [e for k, v in obj.items() for e in untrusted_entries(v, f"{prefix}.{k}" if prefix else str(k))]
    if type(obj) in (list, tuple, set):
        return [e for i, v in enumerate(obj) for e in untrusted_entries(v, f"{prefix}[{i}]")]
    return [] if _loads_as_data(obj) else [f"{prefix or '<root>'} ({type(obj).__module__}.{type(obj).__qualname__})"]


def warn_untrusted(obj: Any, file: str | os.PathLike) -> None:
    """Warn (once per save) naming the entries of a checkpoint about to be written that will load only with
    ``trust_checkpoint=True`` or after ``torch.serialization.add_safe_globals``."""
    found = untrusted_entries(obj)
    if found:
        more = f" and {len(found) - 3} more" if len(found) > 3 else ""
        warnings.warn(f"checkpoint {str(file)!r}: {', '.join(found[:3])}{more} will load only with "
                      "trust_checkpoint=True or after torch.serialization.add_safe_globals([...their classes]): "
                      "store plain values (numbers, strings, lists, dicts, tensors) to keep the checkpoint data",
                      stacklevel=2)
