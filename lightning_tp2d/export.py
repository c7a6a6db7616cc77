"""One device: a plain model of any registered family (:mod:`lightning_tp2d.families`: GPT-2, Llama, a user's own)
from a checkpoint of any layout, and export to the family's transformers format. No process group needed; the
checkpoint may be sharded (DCP directory) or full.

The other direction, :func:`load_hf_weights`, fills a model (plain or parallelized with any layout) from a local
transformers directory, one tensor at a time: each rank reads a full tensor, keeps its own shard (cut by the
checkpoint module's rules, so the layouts' q/k/v arrangements are handled in one place) and drops the rest, so no
rank ever holds more than one full tensor it does not keep.

Everything here is generic: the family comes from the model (:func:`~lightning_tp2d.families.family_of`), its config
(:func:`~lightning_tp2d.families.family_of_config`), the ``config_key`` a checkpoint records its configs under, or
the ``model_type`` a transformers ``config.json`` names; its :class:`~lightning_tp2d.models.hf.HFFormat` (the
family's ``hf``) knows the keys, transposes and config files. :func:`load_gpt2`, :func:`load_llama`,
:func:`hf_config` ... are the family-named wrappers.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from lightning_tp2d.checkpoint import (MODEL, _aliases, _assign, _stored_tensors, is_sharded, open_checkpoint,
                                       read_state_dict, resolve)
from lightning_tp2d.families import ModelFamily, families, family_of, family_of_config, get_family
from lightning_tp2d.layouts import handle_of
from lightning_tp2d.models.gpt2 import GPT2, GPT2Config
from lightning_tp2d.models.config import TOKEN_IDS
from lightning_tp2d.models.hf import HFFormat, check_keys
from lightning_tp2d.models.llama import Llama, LlamaConfig
from lightning_tp2d.weight_files import HF_WEIGHT_FILES, hf_weight_files, write_staged


def _family(family: str | ModelFamily) -> ModelFamily:
    return get_family(family) if isinstance(family, str) else family


def _format(family: ModelFamily) -> HFFormat:
    if family.hf is None:
        raise ValueError(f"model family {family.name!r} has no transformers format (ModelFamily.hf)")
    return family.hf


# ---- our checkpoints -> a plain model -------------------------------------------------------------------------


def _prefixes(keys, family: ModelFamily) -> list[str]:
    """The prefixes under which ``keys`` hold a whole ``family`` model (its embedding and head keys)."""
    fmt = _format(family)
    keys = set(keys)
    return sorted(p for k in keys if k.endswith(fmt.embedding)
                  for p in [k[: -len(fmt.embedding)]] if p + fmt.head in keys)


def model_state_dict(path, family: str | ModelFamily, prefix: str | None = None, *, trust_checkpoint: bool = False,
                     verify: bool = True) -> dict[str, torch.Tensor]:
    """The weights of the ``family`` model inside a checkpoint under the plain model's keys; ``prefix`` (e.g.
    ``"model."``) picks one when the LightningModule holds several. The checkpoint is checked first (checksums,
    pickles read as data: :func:`~lightning_tp2d.checkpoint.open_checkpoint`)."""
    family = _family(family)
    state = read_state_dict(path, trust_checkpoint=trust_checkpoint, verify=verify)
    if prefix is None:
        found = _prefixes(state, family)
        if len(found) != 1:
            raise ValueError(f"checkpoint holds {len(found)} {family.model_class.__name__} models (prefixes "
                             f"{found}); pass prefix=")
        prefix = found[0]
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def gpt2_state_dict(path, prefix: str | None = None, **checks) -> dict[str, torch.Tensor]:
    """The weights of the GPT2 inside a checkpoint under plain ``GPT2`` keys (:func:`model_state_dict`; ``checks``:
    its ``trust_checkpoint`` and ``verify``)."""
    return model_state_dict(path, "gpt2", prefix, **checks)


def llama_state_dict(path, prefix: str | None = None, **checks) -> dict[str, torch.Tensor]:
    """The weights of the Llama inside a checkpoint under plain ``Llama`` keys (transformers' too)."""
    return model_state_dict(path, "llama", prefix, **checks)


def _meta(path: Path, meta: dict[str, Any] | None = None, **checks) -> dict[str, Any]:
    return meta if meta is not None else open_checkpoint(path, **checks)


def recorded_config(path, family: str | ModelFamily, prefix: str | None = None, *, meta: dict[str, Any] | None = None,
                    trust_checkpoint: bool = False, verify: bool = True) -> Any:
    """The ``family`` config a checkpoint records (under the family's ``config_key``) for the model at ``prefix``
    (or its only one); ``meta``: the checkpoint's non-tensor part when already read."""
    family = _family(family)
    configs = _meta(resolve(path), meta, trust_checkpoint=trust_checkpoint, verify=verify).get("tp2d", {}).get(
        family.config_key, {})
    key = (prefix or "").rstrip(".")
    if key not in configs and len(configs) == 1:
        key = next(iter(configs))
    if key not in configs:
        raise ValueError(f"checkpoint records no {family.model_class.__name__} config for {key!r} (has "
                         f"{sorted(configs)}); pass config=")
    return family.config_class(**configs[key])


def checkpoint_family(path, *, meta: dict[str, Any] | None = None, trust_checkpoint: bool = False,
                      verify: bool = True) -> ModelFamily:
    """The family of the model inside a checkpoint: the one whose configs it records, else the one whose
    embedding and head keys it holds."""
    path = resolve(path)
    meta = _meta(path, meta, trust_checkpoint=trust_checkpoint, verify=verify)
    recorded = meta.get("tp2d", {})
    found = [f for f in families() if recorded.get(f.config_key)]
    if not found:
        if is_sharded(path):
            keys = [k[len(MODEL):] for k in _stored_tensors(path)] + list(meta.get("tp2d_aliases", {}))
        else:
            keys = list(meta["state_dict"])
        found = [f for f in families() if f.hf is not None and _prefixes(keys, f)]
    if len(found) != 1:
        raise ValueError(f"checkpoint {str(path)!r} holds models of {len(found)} families "
                         f"({[f.name for f in found]}); pass config=")
    return found[0]


def load_model(path, config: Any = None, prefix: str | None = None,
               family: str | ModelFamily | None = None, *, trust_checkpoint: bool = False,
               verify: bool = True) -> nn.Module:
    """A plain single-device model with a checkpoint's weights, of ``family`` (default: ``config``'s, else the
    checkpoint's, :func:`checkpoint_family`); the config from the checkpoint if recorded. The checkpoint is checked
    once, first: its checksums (``verify=False``: not), and its pickles are read as data (``trust_checkpoint=True``:
    the old way, which runs them; :mod:`lightning_tp2d.trust`)."""
    path = resolve(path)
    meta = open_checkpoint(path, trust_checkpoint=trust_checkpoint, verify=verify)
    if family is None:
        family = family_of_config(config) if config is not None else checkpoint_family(path, meta=meta)
    family = _family(family)
    state = model_state_dict(path, family, prefix, trust_checkpoint=trust_checkpoint, verify=False)  # checked above
    if config is None:
        config = recorded_config(path, family, prefix, meta=meta)
    return _plain_model(family.model_class, config, state)


def load_gpt2(path, config: GPT2Config | None = None, prefix: str | None = None, **checks) -> GPT2:
    """A plain single-device :class:`GPT2` with a checkpoint's weights (config from the checkpoint if recorded;
    ``checks``: :func:`load_model`'s ``trust_checkpoint`` and ``verify``)."""
    return load_model(path, config, prefix, family="gpt2", **checks)


def load_llama(path, config: LlamaConfig | None = None, prefix: str | None = None, **checks) -> Llama:
    """A plain single-device :class:`~lightning_tp2d.models.Llama` with a checkpoint's weights (config from the
    checkpoint if recorded; ``checks`` as :func:`load_gpt2`'s)."""
    return load_model(path, config, prefix, family="llama", **checks)


def _plain_model(cls, config, state: dict[str, torch.Tensor]):
    """``cls(config)`` on the CPU holding ``state`` (built on the meta device: no random init, no second copy)."""
    model = _empty_model(cls, config)
    model.load_state_dict(state)
    return model


def _empty_model(cls, config) -> nn.Module:
    """``cls(config)`` on the CPU with uninitialised weights (ties restored)."""
    with torch.device("meta"):
        model = cls(config)
    model.to_empty(device="cpu")
    model.tie_weights()
    return model


def export_hf(source, directory, config: Any = None, *, overwrite: bool = False,
              token_ids: Mapping[str, Any] | None = None, tokenizer=None, trust_checkpoint: bool = False,
              verify: bool = True) -> Path:
    """Write transformers' format from a plain model of a family with a transformers format (GPT-2, Llama, ...), or
    a checkpoint path holding one (``config``, ``trust_checkpoint`` and ``verify`` as in :func:`load_model`: a
    damaged checkpoint is named, never exported): ``model.safetensors`` (tied weights once, under their first name),
    ``config.json`` and ``generation_config.json``, which ``AutoModelForCausalLM.from_pretrained(directory)`` (the
    format's ``GPT2LMHeadModel`` / ``LlamaForCausalLM``) loads and ``generate`` reads. Returns the directory.

    * Special tokens: ``config.json`` and ``generation_config.json`` carry the config's ``bos_token_id``,
      ``eos_token_id`` (an int or a list) and ``pad_token_id``; ``token_ids`` (``{"eos_token_id": 50256, ...}``, e.g.
      from the tokenizer) fills those the config lacks, and then the family's convention (GPT-2: ``vocab_size - 1``;
      Llama: none, written as null so that transformers does not assume 1 and 2).
    * ``tokenizer``: a ``tokenizer.json``, or a directory holding one, copied into the export.
    * Safety: a ``directory`` that already holds transformers weight files is refused (``FileExistsError`` naming
      them) unless ``overwrite=True``. Every file is written staged (:func:`~lightning_tp2d.weight_files.write_staged`:
      beside the old ones as ``*.tmp-tp2d``, moved into place only when all are complete), so a crash mid-export
      leaves the old weights whole; with ``overwrite`` the directory's other weight files (``pytorch_model.bin``, an
      index and its shards) are removed after, and the files the export does not write (a tokenizer it was not given,
      a README) are kept."""
    directory = Path(directory).expanduser()
    held = hf_weight_files(directory)
    if held and not overwrite:
        raise FileExistsError(f"export_hf: {str(directory)!r} already holds transformers weights ({', '.join(held)}); "
                              "pass overwrite=True to replace them (the new files are written beside them and moved "
                              "into place only when complete; its other files are kept), or export to another "
                              "directory")
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"export_hf: {str(directory)!r} is a file, not a directory")
    tokenizer_file = None
    if tokenizer is not None:
        tokenizer_file = Path(tokenizer).expanduser()
        tokenizer_file = tokenizer_file / "tokenizer.json" if tokenizer_file.is_dir() else tokenizer_file
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"export_hf: tokenizer {str(tokenizer)!r} is neither a tokenizer.json nor a "
                                    "directory holding one")
    family = family_of(source)
    model = source if family is not None else load_model(source, config, trust_checkpoint=trust_checkpoint,
                                                         verify=verify)
    fmt = _format(family or family_of(model))
    hf_config = fmt.hf_config(_with_token_ids(model.config, token_ids))
    carried = [k for k in TOKEN_IDS if k in hf_config]  # (a format may write none: then no generation_config.json)
    generation = {k: hf_config[k] for k in carried if hf_config[k] is not None}
    state = model.state_dict(keep_vars=True)
    tied = _aliases(state)
    hf = {fmt.to_hf_key(k): fmt.hf_tensor(k, v) for k, v in state.items() if k not in tied}
    from safetensors.torch import save_file  # optional dependency (transformers brings it): only to write its files

    writers = {"model.safetensors": lambda path: save_file(hf, str(path), metadata={"format": "pt"}),
               "config.json": lambda path: path.write_text(json.dumps(hf_config, indent=2) + "\n")}
    if carried:
        writers["generation_config.json"] = lambda path: path.write_text(json.dumps(generation, indent=2) + "\n")
    if tokenizer_file is not None:
        writers["tokenizer.json"] = lambda path: shutil.copyfile(tokenizer_file, path)
    return write_staged(directory, writers)


def _with_token_ids(config: Any, token_ids: Mapping[str, Any] | None) -> Any:
    """``config`` with the special-token ids of ``token_ids`` it lacks (fields it has and that are ``None``),
    checked as the config checks its own (an id outside the vocabulary is a ``ValueError``)."""
    if not dataclasses.is_dataclass(config):
        return config
    missing = {k: v for k, v in (token_ids or {}).items()
               if k in TOKEN_IDS and v is not None and hasattr(config, k) and getattr(config, k) is None}
    return dataclasses.replace(config, **missing) if missing else config


def token_ids_of(config: Any) -> dict[str, Any]:
    """The special-token ids ``config`` records (its :data:`~lightning_tp2d.models.config.TOKEN_IDS` fields that are
    set)."""
    return {k: getattr(config, k) for k in TOKEN_IDS if getattr(config, k, None) is not None}


# ---- transformers directories -> a live model -----------------------------------------------------------------

def is_hf_directory(path) -> bool:
    """Whether ``path`` is a transformers checkpoint directory: ``config.json`` and one of :data:`HF_WEIGHT_FILES`."""
    path = Path(path)
    return (path / "config.json").is_file() and any((path / f).is_file() for f in HF_WEIGHT_FILES)


def hf_family(directory) -> ModelFamily:
    """The registered family whose transformers format has the ``model_type`` of ``directory``'s ``config.json``."""
    file = Path(directory) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{str(directory)!r} is not a transformers directory: no config.json")
    model_type = json.loads(file.read_text()).get("model_type")
    known = {f.hf.model_type: f for f in families() if f.hf is not None}
    if model_type not in known:
        raise ValueError(f"{str(file)!r} describes a {model_type!r} model; registered transformers formats: "
                         f"{sorted(known)}")
    return known[model_type]


def read_hf_config(directory, family: str | ModelFamily | None = None) -> Any:
    """Our config for a transformers directory's ``config.json`` (read as JSON: transformers is not needed), by the
    format of ``family`` (default: the one its ``model_type`` names, :func:`hf_family`); refuses what the model
    does not implement (the format's ``read_config``, e.g. :meth:`GPT2Config.from_hf`). The special-token ids of a
    ``generation_config.json`` beside it win over ``config.json``'s (they are what ``generate`` stops at: Llama 3
    instruct lists more end tokens there), so that one set of ids reaches our config and its exports."""
    family = hf_family(directory) if family is None else _family(family)
    fmt = _format(family)
    file = Path(directory) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{str(directory)!r} is not a transformers {fmt.model_type} directory: no config.json")
    raw = json.loads(file.read_text())
    if raw.get("model_type", fmt.model_type) != fmt.model_type:
        raise ValueError(f"{str(file)!r} describes a {raw['model_type']!r} model, not {fmt.model_type!r}")
    generation = Path(directory) / "generation_config.json"
    if generation.is_file():
        try:
            ids = json.loads(generation.read_text())
        except ValueError as err:
            raise ValueError(f"{str(generation)!r} is not JSON ({err})") from None
        if isinstance(ids, dict):  # (a null there leaves config.json's)
            raw = {**raw, **{k: ids[k] for k in TOKEN_IDS if ids.get(k) is not None}}
    try:
        return fmt.read_config(raw)
    except ValueError as err:
        raise ValueError(f"{str(file)!r}: {err}") from None


def hf_config(directory) -> GPT2Config:
    """Our :class:`GPT2Config` for a transformers GPT-2 directory (:func:`read_hf_config`)."""
    return read_hf_config(directory, "gpt2")


def hf_llama_config(directory) -> LlamaConfig:
    """Our :class:`~lightning_tp2d.models.LlamaConfig` for a transformers Llama directory (:func:`read_hf_config`)."""
    return read_hf_config(directory, "llama")


def hf_model_config(directory) -> Any:
    """Our config for a transformers directory of any registered format: the one its ``model_type`` names."""
    return read_hf_config(directory)


def load_hf_model(directory) -> nn.Module:
    """A plain single-device model of the family ``directory``'s ``config.json`` names, with its weights."""
    if not Path(directory).is_dir():
        raise FileNotFoundError(f"transformers checkpoint directory {str(directory)!r} does not exist")
    family = hf_family(directory)
    return load_hf_weights(_empty_model(family.model_class, read_hf_config(directory, family)), directory)


class _HFWeights:
    """The tensors of a transformers directory, read one at a time and never as a whole state dict: safetensors
    through ``safe_open`` (a tensor or rows of one on request), ``pytorch_model.bin`` memory-mapped; sharded
    variants through their ``*.index.json``."""

    def __init__(self, directory: Path) -> None:
        for name in HF_WEIGHT_FILES:
            if (directory / name).is_file():
                break
        else:
            raise FileNotFoundError(f"{str(directory)!r} holds no model weights (none of {', '.join(HF_WEIGHT_FILES)})")
        self._handles: dict[Path, object] = {}
        if name.endswith(".index.json"):
            weight_map = json.loads((directory / name).read_text())["weight_map"]
            self.files = {key: directory / file for key, file in weight_map.items()}
        else:
            self.files = {key: directory / name for key in self._open(directory / name).keys()}

    def _open(self, file: Path):
        handle = self._handles.get(file)
        if handle is not None:
            return handle
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            handle = safe_open(str(file), framework="pt", device="cpu")
        else:
            try:
                handle = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
            except RuntimeError as err:  # the pre-1.6 (non-zip) format cannot be memory-mapped
                if "mmap" not in str(err):
                    raise
                warnings.warn(f"{file} is in torch's legacy format and cannot be memory-mapped: it is read whole")
                handle = torch.load(file, map_location="cpu", weights_only=True)
        self._handles[file] = handle
        return handle

    def keys(self) -> list[str]:
        return list(self.files)

    def shape(self, key: str) -> tuple[int, ...]:
        handle = self._open(self.files[key])
        return tuple(handle[key].shape) if isinstance(handle, dict) else tuple(handle.get_slice(key).get_shape())

    def get(self, key: str) -> torch.Tensor:
        """The full tensor ``key`` (for a ``.bin`` a memory-mapped view: read when copied)."""
        handle = self._open(self.files[key])
        return handle[key] if isinstance(handle, dict) else handle.get_tensor(key)

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        handle = self._open(self.files[key])
        return handle[key][start:stop] if isinstance(handle, dict) else handle.get_slice(key)[start:stop]


@torch.no_grad()
def load_hf_weights(model: nn.Module, directory) -> nn.Module:
    """Fill ``model``'s weights, in place, from a local transformers directory of its family's format (GPT-2's
    ``GPT2LMHeadModel`` / ``GPT2Model``, Llama's ``LlamaForCausalLM`` / ``LlamaModel``, a registered family's own:
    ``config.json`` and ``model.safetensors``, a sharded ``model.safetensors.index.json`` or ``pytorch_model.bin``);
    returns ``model``.

    ``model`` may be plain or parallelized with any layout (DTensor parameters; then every rank of the mesh calls
    this): each tensor is read whole, this rank's shard is copied into the live parameter and the full tensor is
    dropped before the next is read, so the extra memory is one full tensor, never a state dict. Sizes must match
    the checkpoint's (the format's ``sizes`` and ``fit``: GPT-2's ``block_size`` may be smaller than its
    ``n_positions``, the position embedding's first rows are used; Llama's RoPE fits any). Keys are checked as by
    the model's own ``load_hf_state_dict`` (:func:`~lightning_tp2d.models.hf.check_keys`: transposed weights, the
    tied ``lm_head.weight``, when stored, must equal the embedding; an untied head missing from the directory starts
    from the embedding); missing, unexpected and mis-shaped keys are reported together in one ValueError. Dropout
    is the model's own.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"transformers checkpoint directory {str(directory)!r} does not exist")
    family = family_of(model)
    if family is None:
        raise TypeError(f"load_hf_weights: {type(model).__name__} is not a model of a registered family")
    fmt = _format(family)
    problems = fmt.fit_problems(model.config, read_hf_config(directory, family))
    if problems:
        raise ValueError(f"transformers checkpoint {str(directory)!r} does not fit this model: " + "; ".join(problems)
                         + ". Build the model with the checkpoint's sizes (CausalLMModule(model=None, "
                         "init_from=...) takes them from its config.json)")
    if handle_of(model) is None:
        model.tie_weights()  # after to_empty() lm_head is a separate, uninitialised Parameter
    state = {k: v for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}
    aliases = _aliases(state)
    weights = _HFWeights(directory)
    names = check_keys(fmt, {k: tuple(v.shape) for k, v in state.items()},
                       {k: weights.shape(k) for k in weights.keys()}, aliases=aliases,
                       same=lambda a, b: _same_rows(weights, a, b), head_from_embedding=True,
                       what=f"transformers checkpoint {str(directory)!r}")
    for key, live in state.items():
        if key not in aliases:  # one stored tensor at a time: the full tensor dies after its shard is copied
            _assign(live, fmt.to_ours(key, weights.get(names[key]), tuple(live.shape)))
    return model


def _same_rows(weights: _HFWeights, a: str, b: str, rows: int = 4096) -> bool:
    """Whether two stored tensors of equal shape are equal, compared ``rows`` rows at a time."""
    if a == b:
        return True
    n = weights.shape(a)[0]
    return all(torch.equal(weights.rows(a, i, i + rows), weights.rows(b, i, i + rows)) for i in range(0, n, rows))


def hf_loader(family):
    """How weights of ``family``'s models come from a transformers directory: its own ``load_hf`` hook, else
    :func:`load_hf_weights` where the family has a transformers format (``hf``), else ``None``."""
    if family is None:
        return None
    return family.load_hf or (load_hf_weights if family.hf is not None else None)
