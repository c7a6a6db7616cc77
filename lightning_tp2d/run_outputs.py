"""What a ``tp2d-train`` run writes besides its checkpoints, and what it never writes over: its run directory and its
transformers export (``export_hf``).

Before launch, on global rank 0, each check returns one line or ``None`` (as the layouts' ``*_problem`` functions
do; :func:`lightning_tp2d.train.check_outputs` raises it as a ``ConfigError``, exit 2):

* the run directory (``hydra.run.dir``, ``TP2D_RUN_DIR``) holds no weights this run did not write, a transformers
  directory or another run's ``checkpoints/`` (:func:`~lightning_tp2d.weight_files.run_dir_problem`), unless the run
  resumes from one of its checkpoints and so continues there (:func:`~lightning_tp2d.launch.continues_run`). Given
  on the command line or exported, it is checked before Hydra writes its ``.hydra/`` and ``train.log`` into it
  (:func:`given_run_dir_problem`); Hydra's own choice (a config file's) once the job starts (:func:`outputs_problem`);
* ``export_hf`` is neither ``module.init_from``'s directory nor one holding weights
  (:func:`~lightning_tp2d.weight_files.export_problem`), unless :func:`export_overwrite`.

After training, :func:`export_transformers` writes the newest checkpoint as a transformers directory, staged, with
``generation_config.json``, the special-token ids of :func:`export_token_ids` and the data's ``tokenizer.json``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from lightning_tp2d import launch
from lightning_tp2d.data import is_token_file, special_token_ids
from lightning_tp2d.export import export_hf, read_hf_config, token_ids_of
from lightning_tp2d.weight_files import export_problem, run_dir_problem


def outputs_problem(cfg: DictConfig, run_dir: Path | None) -> str | None:
    """The line refusing the run directory ``run_dir`` (``None``: not known here, e.g. a config composed outside a
    job) or ``export_hf`` (module docstring), or ``None``."""
    if run_dir is not None and not launch.continues_run(cfg.ckpt_path, run_dir):
        problem = run_dir_problem(run_dir)
        if problem:
            return problem
    try:
        target = cfg.get("export_hf")
    except Exception:  # noqa: BLE001 - ${hydra:runtime.output_dir}/hf outside a job: the job checks it
        return None
    if target is None:
        return None
    init_from = cfg.module.get("init_from")
    return export_problem(Path(str(target)).expanduser(), overwrite=export_overwrite(cfg, run_dir),
                          init_from=None if init_from is None else Path(str(init_from)).expanduser())


def given_run_dir_problem(args: list[str], env: Mapping[str, str] = os.environ) -> str | None:
    """The line refusing a run directory named on the command line (``hydra.run.dir=``) or exported
    (``TP2D_RUN_DIR``) that holds weights, asked before Hydra writes into it; ``None`` when it holds none, when
    ``ckpt_path`` resumes from a checkpoint in it, or when no directory is named
    (:func:`~lightning_tp2d.launch.given_run_dir`)."""
    given = launch.given_run_dir(args, env)
    if given is None or launch.continues_run(launch.given_value(args, "ckpt_path"), given[1]):
        return None
    return run_dir_problem(given[1], key=given[0])


def export_overwrite(cfg: DictConfig, run_dir: Path | None) -> bool:
    """Whether the export may be written over weights: ``export_hf_overwrite=true``, or a resumed run continuing in
    its run directory that replaces the export it wrote inside it (the same run: ``experiment=finetune``'s
    ``<run dir>/hf``)."""
    if cfg.get("export_hf_overwrite"):
        return True
    if run_dir is None or not launch.continues_run(cfg.ckpt_path, run_dir):
        return False
    return Path(str(cfg.export_hf)).expanduser().resolve().is_relative_to(Path(run_dir).resolve())


def export_token_ids(cfg: DictConfig) -> dict[str, Any]:
    """The special-token ids (bos, eos, pad) an export takes where the model's config has none: ``module.init_from``'s
    (its ``config.json`` and ``generation_config.json``; a ``model=`` chosen beside it does not carry them), then
    ``data.tokenizer``'s when it made the ids from text (:func:`~lightning_tp2d.data.special_token_ids`: the byte
    tokenizer's 256, GPT-2's ``<|endoftext|>`` 50256, a tokenizer.json's own), then none (the family's convention,
    :func:`~lightning_tp2d.export.export_hf`). Token files hold ids of a tokenizer not known here."""
    ids: dict[str, Any] = {}
    data, source = cfg.data, cfg.module.get("init_from")
    sources = [s for s in (data.get("path"), data.get("val_path")) if s is not None]
    if not sources or any(not is_token_file(str(s), str(data.get("format", "auto"))) for s in sources):
        try:
            ids = special_token_ids(str(data.tokenizer))
        except (ValueError, OSError, RuntimeError):  # (it loaded before launch; a file gone since: none)
            ids = {}
    if source is not None:
        try:
            ids = {**ids, **token_ids_of(read_hf_config(Path(str(source)).expanduser()))}
        except (ValueError, OSError):  # (read before launch; gone since: the tokenizer's)
            pass
    return ids


def export_transformers(cfg: DictConfig, checkpoint, config, run_dir: Path | None = None) -> Path:
    """``export_hf``, on rank 0 after the job (no process group: the checkpoint is read whole, by one process): the
    newest checkpoint (or a model) written as a transformers directory (:func:`~lightning_tp2d.export.export_hf`:
    ``model.safetensors``, ``config.json`` and ``generation_config.json`` with the special-token ids of
    :func:`export_token_ids` where the model's config has none; a relative path starts from the directory tp2d-train
    runs in, as ``data.path`` does), with the data's ``tokenizer.json`` in it when it has one, so that the directory
    is whole; staged, and over weights only where :func:`export_overwrite` allows (else ``FileExistsError``).
    ``config``: the model's (a ``parallel=single`` checkpoint, Lightning's own, does not record it). Returns the
    directory."""
    tokenizer = Path(str(cfg.data.get("tokenizer") or "")).expanduser()
    tokenizer = tokenizer / "tokenizer.json" if tokenizer.is_dir() else tokenizer
    return export_hf(checkpoint, Path(str(cfg.export_hf)).expanduser(), config,
                     overwrite=export_overwrite(cfg, run_dir), token_ids=export_token_ids(cfg),
                     tokenizer=tokenizer if tokenizer.name == "tokenizer.json" and tokenizer.is_file() else None,
                     trust_checkpoint=bool(cfg.get("trust_checkpoint")))


__all__ = ["export_overwrite", "export_token_ids", "export_transformers", "given_run_dir_problem", "outputs_problem"]
