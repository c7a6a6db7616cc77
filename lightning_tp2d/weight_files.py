"""Which files of a directory hold model weights, the one line that refuses an output written over weights something
else wrote, and writing a transformers directory so that the weights it held stay whole until the new ones are
complete.

* :func:`hf_weight_files`: transformers' weight files in a directory (:data:`HF_WEIGHT_FILES`, the shards an index
  names, and shards without their index); :func:`held_weights` adds this package's checkpoints (a run's
  ``checkpoints/`` folder, ``*.ckpt`` files or folders, a sharded checkpoint's ``.metadata``), each named for a
  message.
* :func:`export_problem` and :func:`run_dir_problem`: ``tp2d-train`` asks them before launch about ``export_hf`` and
  the run directory (``hydra.run.dir``, ``TP2D_RUN_DIR``); like the layouts' ``*_problem`` functions they return one
  line naming the directory, what it holds and the way out, or ``None``.
* :func:`write_staged`: every new file written beside the directory's own as ``<name>.tmp-tp2d``
  (:func:`~lightning_tp2d.safe_files.staging_path`, in the directory itself, so on its file system); only when all
  are complete is each moved into place (:func:`~lightning_tp2d.safe_files.commit`: the file it replaces survives as
  ``<name>.old-tp2d`` for the instant between two renames), and then the weight files the new ones replace
  (``pytorch_model.bin``, the shards of an index) are removed. A crash or error while writing removes the staged files
  and leaves the directory as it was; files the export does not write (a tokenizer, a README) are kept.

Floors: :mod:`lightning_tp2d.safe_files` only (beside :mod:`lightning_tp2d.export`, which writes through it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path

from lightning_tp2d.safe_files import clear, commit, staging_path

# Weight files of a transformers directory, in the order transformers prefers them.
HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                   "pytorch_model.bin.index.json")
# the shards save_pretrained writes beside an index (model-00001-of-00004.safetensors)
HF_SHARDS = ("model-*-of-*.safetensors", "pytorch_model-*-of-*.bin")
OVERWRITE = "export_hf_overwrite=true"  # tp2d-train's way to write an export over weights


def hf_weight_files(directory: Path) -> list[str]:
    """The names of the transformers weight files in ``directory``, sorted: :data:`HF_WEIGHT_FILES`, the shards their
    index files name and shards without an index (:data:`HF_SHARDS`); ``[]`` when it is not a directory."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    names = {name for name in HF_WEIGHT_FILES if (directory / name).is_file()}
    for index in [name for name in names if name.endswith(".index.json")]:
        try:
            names |= {str(f) for f in json.loads((directory / index).read_text()).get("weight_map", {}).values()
                      if (directory / str(f)).is_file()}
        except (ValueError, OSError, AttributeError):  # an unreadable index: its shards are found by name below
            pass
    names |= {p.name for pattern in HF_SHARDS for p in directory.glob(pattern) if p.is_file()}
    return sorted(names)


def held_weights(directory: Path) -> list[str]:
    """What in ``directory`` holds model weights, each named for a message: its transformers weight files
    (:func:`hf_weight_files`), a non-empty ``checkpoints/`` folder (a tp2d-train run's), ``*.ckpt`` files or folders
    (this package's and Lightning's checkpoints), or ``.metadata`` (it is a sharded checkpoint itself)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    held = hf_weight_files(directory)
    runs = directory / "checkpoints"
    if runs.is_dir() and any(runs.iterdir()):
        count = sum(1 for _ in runs.iterdir())
        held.append(f"checkpoints/ ({count} entr{'y' if count == 1 else 'ies'})")
    held += sorted(p.name for p in directory.glob("*.ckpt"))
    if (directory / ".metadata").is_file():
        held.append(".metadata (a sharded checkpoint)")
    return held


def _same(a: Path, b: Path) -> bool:
    """Whether two paths name the same directory (links and relative paths resolved)."""
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def export_problem(directory: Path, *, key: str = "export_hf", init_from: Path | None = None,
                   overwrite: bool = False) -> str | None:
    """One line when an export to ``directory`` (the value of ``key``) would be written over weights something else
    wrote: ``init_from``'s directory (the weights the run starts from), or any directory that :func:`held_weights`
    finds weights in, unless ``overwrite``; a path that is a file is refused either way. ``None``: it may be
    written."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        return (f"{key}={str(directory)!r} is a file, not a directory: the export is a transformers directory "
                f"(config.json, generation_config.json, model.safetensors); choose a directory path")
    if overwrite:
        return None
    held = held_weights(directory)
    staged = (f"or set {OVERWRITE} to replace them (each new file is written beside the old ones and moved into "
              "place only when all are complete; files the export does not write, e.g. a tokenizer, are kept)")
    if init_from is not None and _same(directory, Path(init_from)):
        return (f"{key}={str(directory)!r} is module.init_from's directory: the export would be written over the "
                f"weights this run starts from ({', '.join(held) or 'config.json'}). Export to another directory "
                f"(e.g. {key}={directory.resolve().name}_ft), {staged}")
    if held:
        return (f"{key}={str(directory)!r} already holds weights this run did not write ({', '.join(held)}): the "
                f"export would be written over them. Export to a new directory, {staged}")
    return None


def run_dir_problem(run_dir: Path, *, key: str = "hydra.run.dir") -> str | None:
    """One line when the run directory ``run_dir`` (the value of ``key``) already holds weights (a transformers
    directory, another run's ``checkpoints/``: :func:`held_weights`), which this run's checkpoints, logs and Hydra
    files would be written beside and over; ``None`` when it holds none. (A resumed run continuing in its
    checkpoint's run directory is not asked.)"""
    held = held_weights(Path(run_dir))
    if not held:
        return None
    resume = ""
    if any(h.startswith("checkpoints/") for h in held) and (Path(run_dir) / ".hydra").is_dir():
        resume = (f", or resume the run that wrote them (ckpt_path={Path(run_dir) / 'checkpoints' / 'last.ckpt'}: "
                  "it continues in its run directory)")
    return (f"{key}={str(run_dir)!r} already holds weights this run did not write ({', '.join(held)}): the run "
            f"would write its checkpoints, logs and .hydra/ there. Leave {key} out (each run gets a new "
            f"outputs/<date>/<time>/) or choose a new directory{resume}")


def write_staged(directory: Path, writers: Mapping[str, Callable[[Path], object]]) -> Path:
    """Write the files ``writers`` names (``name -> write(path)``) into ``directory`` (made if missing) the crash-safe
    way (module docstring): all staged, then moved into place, then the transformers weight files that are not among
    them removed (the new weights replace them). On any error the staged files are removed and the directory is
    as it was (one this call made is removed again). Returns ``directory``."""
    directory = Path(directory)
    made = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    staged = {name: staging_path(directory / name) for name in writers}
    try:
        for name, write in writers.items():
            clear(staged[name])  # debris of an export that crashed
            write(staged[name])
    except BaseException:
        for path in staged.values():
            clear(path)
        if made and not any(directory.iterdir()):
            directory.rmdir()
        raise
    replaced = [name for name in hf_weight_files(directory) if name not in writers]
    for name in writers:  # in the order given (export_hf: the weights first, then the configs describing them)
        commit(staged[name], directory / name)
    for name in replaced:
        clear(directory / name)
    return directory


__all__ = ["HF_SHARDS", "HF_WEIGHT_FILES", "export_problem", "held_weights", "hf_weight_files", "run_dir_problem",
           "write_staged"]
