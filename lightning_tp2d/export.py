"""One device: a plain :class:`~lightning_tp2d.models.GPT2` from a checkpoint of any layout, and export to
transformers' GPT-2 format. No process group needed; the checkpoint may be sharded (DCP directory) or full.

The other direction, :func:`load_hf_weights`, fills a GPT2 (plain or parallelized with any layout) from a local
transformers GPT-2 directory, one tensor at a time: each rank reads a full tensor, keeps its own shard (cut by the
checkpoint module's rules, so the layouts' q/k/v arrangements are handled in one place) and drops the rest, so no
rank ever holds more than one full tensor it does not keep.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

from lightning_tp2d.checkpoint import (META, MODEL, _aliases, _assign, _stored_tensors, is_sharded, read_state_dict,
                                       resolve)
from lightning_tp2d.layouts import handle_of
from lightning_tp2d.models import llama as _llama
from lightning_tp2d.models.gpt2 import HF_TRANSPOSED, GPT2, GPT2Config, from_hf_key, from_hf_tensor
from lightning_tp2d.models.llama import Llama, LlamaConfig

# A key every model of the class has (relative to the model), which finds the model's prefix in a checkpoint.
_MARKERS = {"GPT2": "transformer.wte.weight", "Llama": "model.embed_tokens.weight"}


def _model_state_dict(path, kind: str, prefix: str | None) -> dict[str, torch.Tensor]:
    state = read_state_dict(path)
    if prefix is None:
        marker = _MARKERS[kind]
        found = sorted(k[: -len(marker)] for k in state if k.endswith(marker))
        if kind == "Llama":  # a Llama under prefix "model." has "model.model.embed_tokens.weight": both end so
            found = [f for f in found if f + "model.embed_tokens.weight" in state and f + "lm_head.weight" in state]
        if len(found) != 1:
            raise ValueError(f"checkpoint holds {len(found)} {kind} models (prefixes {found}); pass prefix=")
        prefix = found[0]
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def gpt2_state_dict(path, prefix: str | None = None) -> dict[str, torch.Tensor]:
    """The weights of the GPT2 inside a checkpoint under plain ``GPT2`` keys; ``prefix`` (e.g. ``"model."``) picks
    one when the LightningModule holds several."""
    return _model_state_dict(path, "GPT2", prefix)


def llama_state_dict(path, prefix: str | None = None) -> dict[str, torch.Tensor]:
    """The weights of the Llama inside a checkpoint under plain ``Llama`` keys (transformers' too); ``prefix`` as in
    :func:`gpt2_state_dict`."""
    return _model_state_dict(path, "Llama", prefix)


def load_llama(path, config: LlamaConfig | None = None, prefix: str | None = None) -> Llama:
    """A plain single-device :class:`~lightning_tp2d.models.Llama` with a checkpoint's weights (config from the
    checkpoint if recorded)."""
    state = llama_state_dict(path, prefix)
    if config is None:
        config = LlamaConfig(**_recorded(resolve(path), prefix, "llama_configs", "Llama"))
    return _plain_model(Llama, config, state)


def load_gpt2(path, config: GPT2Config | None = None, prefix: str | None = None) -> GPT2:
    """A plain single-device :class:`GPT2` with a checkpoint's weights (config from the checkpoint if recorded)."""
    state = gpt2_state_dict(path, prefix)
    if config is None:
        config = _recorded_config(resolve(path), prefix)
    return _plain_model(GPT2, config, state)


def _plain_model(cls, config, state: dict[str, torch.Tensor]):
    """``cls(config)`` on the CPU holding ``state`` (built on the meta device: no random init, no second copy)."""
    with torch.device("meta"):
        model = cls(config)
    model.to_empty(device="cpu")
    model.tie_weights()
    model.load_state_dict(state)
    return model


def _recorded_config(path: Path, prefix: str | None) -> GPT2Config:
    return GPT2Config(**_recorded(path, prefix, "gpt2_configs", "GPT2"))


def _recorded(path: Path, prefix: str | None, field: str, kind: str) -> dict:
    meta = torch.load(path / META if is_sharded(path) else path, map_location="cpu", weights_only=False, mmap=True)
    configs = meta.get("tp2d", {}).get(field, {})
    key = (prefix or "").rstrip(".")
    if key not in configs and len(configs) == 1:
        key = next(iter(configs))
    if key not in configs:
        raise ValueError(f"checkpoint records no {kind} config for {key!r} (has {sorted(configs)}); pass config=")
    return configs[key]


def _is_llama_checkpoint(path) -> bool:
    path = resolve(path)
    if is_sharded(path):
        keys = [k[len(MODEL):] for k in _stored_tensors(path)]
    else:
        keys = list(torch.load(path, map_location="cpu", weights_only=False, mmap=True)["state_dict"])
    return any(k.endswith(_MARKERS["Llama"]) for k in keys) and not any(k.endswith(_MARKERS["GPT2"]) for k in keys)


def export_hf(source, directory, config: GPT2Config | LlamaConfig | None = None) -> Path:
    """Write transformers' format (``config.json`` + ``model.safetensors``) from a plain :class:`GPT2` or
    :class:`~lightning_tp2d.models.Llama`, or a checkpoint path holding one; ``GPT2LMHeadModel`` /
    ``LlamaForCausalLM.from_pretrained(directory)`` loads it."""
    if isinstance(source, Llama) or isinstance(config, LlamaConfig) or (
            not isinstance(source, GPT2) and config is None and _is_llama_checkpoint(source)):
        return _export_llama(source if isinstance(source, Llama) else load_llama(source, config), Path(directory))
    model = source if isinstance(source, GPT2) else load_gpt2(source, config)
    cfg = model.config
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf = {k: v.contiguous() for k, v in model.hf_state_dict().items() if k != "lm_head.weight"}  # tied
    from safetensors.torch import save_file

    save_file(hf, str(directory / "model.safetensors"), metadata={"format": "pt"})
    hf_config = {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": cfg.n_layer, "n_head": cfg.n_head,
        "n_embd": cfg.n_embd, "vocab_size": cfg.vocab_size, "n_positions": cfg.block_size, "n_ctx": cfg.block_size,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout, "scale_attn_weights": True,
        "bos_token_id": cfg.vocab_size - 1, "eos_token_id": cfg.vocab_size - 1, "tie_word_embeddings": True,
    }
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    return directory


def _export_llama(model: Llama, directory: Path) -> Path:
    cfg = model.config
    directory.mkdir(parents=True, exist_ok=True)
    hf = {k: v.contiguous() for k, v in model.hf_state_dict().items()
          if not (cfg.tie_embeddings and k == "lm_head.weight")}
    from safetensors.torch import save_file

    save_file(hf, str(directory / "model.safetensors"), metadata={"format": "pt"})
    hf_config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.n_embd, "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head, "head_dim": cfg.head_size,
        "max_position_embeddings": cfg.block_size, "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
        # transformers 5 reads rope_parameters, 4 reads rope_theta (and rope_scaling None)
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "attention_dropout": cfg.dropout, "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    return directory


# ---- transformers GPT-2 directories -> a live GPT2 ------------------------------------------------------------

# Weight files of a transformers directory, in the order transformers prefers them.
HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                   "pytorch_model.bin.index.json")
# transformers' GPT2Config defaults: save_pretrained writes only the values that differ from them.
_HF_DEFAULTS = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
                    activation_function="gelu_new", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                    layer_norm_epsilon=1e-5, scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
                    reorder_and_upcast_attn=False, add_cross_attention=False)


def is_hf_directory(path) -> bool:
    """Whether ``path`` is a transformers checkpoint directory: ``config.json`` and one of :data:`HF_WEIGHT_FILES`."""
    path = Path(path)
    return (path / "config.json").is_file() and any((path / f).is_file() for f in HF_WEIGHT_FILES)


def _hf_json(directory, model_type: str, kind: str) -> tuple[Path, dict]:
    """``(path, contents)`` of a transformers directory's ``config.json``, which must describe ``model_type``."""
    file = Path(directory) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{str(directory)!r} is not a transformers {kind} directory: no config.json")
    raw = json.loads(file.read_text())
    if raw.get("model_type", model_type) != model_type:
        raise ValueError(f"{str(file)!r} describes a {raw['model_type']!r} model, not {model_type!r}")
    return file, raw


def hf_config(directory) -> GPT2Config:
    """Our :class:`GPT2Config` for a transformers GPT-2 directory's ``config.json`` (read as JSON: transformers is
    not needed); refuses what this model does not implement (:meth:`GPT2Config.from_hf`)."""
    file, raw = _hf_json(directory, "gpt2", "GPT-2")
    hf = SimpleNamespace(**{**_HF_DEFAULTS, **raw})
    problems = []
    if hf.n_inner not in (None, 4 * hf.n_embd):
        problems.append(f"n_inner={hf.n_inner} (need 4 * n_embd = {4 * hf.n_embd})")
    if hf.add_cross_attention:
        problems.append("add_cross_attention=True (need False)")
    if problems:
        raise ValueError(f"unsupported transformers GPT2Config in {str(file)!r}: " + "; ".join(problems))
    try:
        return GPT2Config.from_hf(hf)
    except ValueError as err:
        raise ValueError(f"{str(file)!r}: {err}") from None


# transformers' LlamaConfig defaults (a config.json may omit them)
_HF_LLAMA_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=None, hidden_act="silu",
                          max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                          rope_theta=10000.0, rope_scaling=None, attention_bias=False, attention_dropout=0.0,
                          mlp_bias=False, head_dim=None)


def hf_llama_config(directory) -> LlamaConfig:
    """Our :class:`~lightning_tp2d.models.LlamaConfig` for a transformers Llama directory's ``config.json`` (read as
    JSON); refuses what this model does not implement (:meth:`LlamaConfig.from_hf`)."""
    file, raw = _hf_json(directory, "llama", "Llama")
    try:
        return LlamaConfig.from_hf(SimpleNamespace(**{**_HF_LLAMA_DEFAULTS, **raw}))
    except ValueError as err:
        raise ValueError(f"{str(file)!r}: {err}") from None


def hf_model_config(directory) -> GPT2Config | LlamaConfig:
    """Our config for a transformers directory: :func:`hf_llama_config` for ``model_type`` "llama", else
    :func:`hf_config` (GPT-2)."""
    file = Path(directory) / "config.json"
    if file.is_file() and json.loads(file.read_text()).get("model_type") == "llama":
        return hf_llama_config(directory)
    return hf_config(directory)


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


def _check_fits(ours: GPT2Config | LlamaConfig, theirs: GPT2Config | LlamaConfig, directory) -> None:
    """Raise ValueError naming every size of ``ours`` the transformers checkpoint cannot fill."""
    llama = isinstance(ours, LlamaConfig)
    names = ("n_layer", "n_head", "n_kv_head", "n_embd", "intermediate_size", "vocab_size", "rope_theta",
             "norm_eps") if llama else ("n_layer", "n_head", "n_embd", "vocab_size")
    problems = [f"{name}: model {getattr(ours, name)}, checkpoint {getattr(theirs, name)}"
                for name in names if getattr(ours, name) != getattr(theirs, name)]
    if not llama and ours.block_size > theirs.block_size:  # (Llama's RoPE has no position table: any fits)
        problems.append(f"block_size: model {ours.block_size} exceeds the checkpoint's n_positions "
                        f"{theirs.block_size} (the rows of its position embedding; a smaller block_size is fine)")
    if not llama and not ours.bias:
        problems.append("bias: model False, but GPT-2 checkpoints hold biases")
    if problems:
        raise ValueError(f"transformers checkpoint {str(directory)!r} does not fit this model: " + "; ".join(problems)
                         + ". Build the model with the checkpoint's sizes (CausalLMModule(model=None, "
                         "init_from=...) takes them from its config.json)")


@torch.no_grad()
def load_hf_weights(model: GPT2 | Llama, directory) -> GPT2 | Llama:
    """Fill ``model``'s weights, in place, from a local transformers GPT-2 directory (a Llama's from a transformers
    ``LlamaForCausalLM`` / ``LlamaModel`` directory, by the same rules: separate q/k/v tensors, nothing transposed,
    any ``block_size``) (``config.json`` and
    ``model.safetensors``, a sharded ``model.safetensors.index.json`` or ``pytorch_model.bin``); returns ``model``.

    ``model`` may be plain or parallelized with any layout (DTensor parameters; then every rank of the mesh calls
    this): each tensor is read whole, this rank's shard is copied into the live parameter and the full tensor is
    dropped before the next is read, so the extra memory is one full tensor, never a state dict. Sizes must match
    the checkpoint's except ``block_size``, which may be smaller than its ``n_positions`` (the position embedding's
    first rows are used). Conv1D weights are transposed and the tied ``lm_head.weight``, when stored, must equal
    ``transformer.wte.weight``, as in :meth:`GPT2.load_hf_state_dict`; missing, unexpected and mis-shaped keys are
    reported together in one ValueError. Dropout is the model's own.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"transformers checkpoint directory {str(directory)!r} does not exist")
    llama = isinstance(model, Llama)
    _check_fits(model.config, (hf_llama_config if llama else hf_config)(directory), directory)
    key_of = _llama.from_hf_key if llama else from_hf_key
    if handle_of(model) is None:
        model.tie_weights()  # after to_empty() lm_head is a separate, uninitialised Parameter
    state = model.state_dict(keep_vars=True)
    aliases = _aliases(state)
    live = {k: v for k, v in state.items() if k not in aliases and isinstance(v, torch.Tensor)}
    weights = _HFWeights(directory)
    names: dict[str, str] = {}  # our key -> stored key
    unexpected = []
    for stored in weights.keys():
        key = key_of(stored)
        if key is None:
            continue
        if key in names or (key not in live and key not in aliases):
            unexpected.append(stored)
        else:
            names[key] = stored
    wte = "model.embed_tokens.weight" if llama else "transformer.wte.weight"
    if "lm_head.weight" in live and "lm_head.weight" not in names and wte in names:
        names["lm_head.weight"] = names[wte]  # an untied model: its head starts from the embedding, as HF's does
    missing = [k for k in live if k not in names]
    misshaped = []
    for key, stored in names.items():
        shape = tuple(state[key].shape)
        expected = shape[::-1] if not llama and key.endswith(HF_TRANSPOSED) else shape
        got = weights.shape(stored)
        if key == "transformer.wpe.weight" and len(got) == 2 and got[0] >= shape[0]:
            got = (shape[0], got[1])  # truncated to the model's block_size
        if got != expected:
            misshaped.append(f"{stored}: expected {expected}, got {weights.shape(stored)}")
    problems = ([f"missing keys: {missing}"] if missing else []) + \
               ([f"unexpected keys: {unexpected}"] if unexpected else []) + \
               ([f"mis-shaped keys (HF layout): {misshaped}"] if misshaped else [])
    if not problems and "lm_head.weight" in aliases and "lm_head.weight" in names and not _same_rows(
            weights, names["lm_head.weight"], names[aliases["lm_head.weight"]]):
        problems.append(f"lm_head.weight differs from {wte}, but this model ties them")
    if problems:
        raise ValueError(f"cannot load transformers checkpoint {str(directory)!r}:\n  " + "\n  ".join(problems))
    for key, tensor in live.items():
        _copy_one(weights, names[key], key, tensor, _llama.from_hf_tensor if llama else from_hf_tensor)
    return model


def _copy_one(weights: _HFWeights, stored: str, key: str, live: torch.Tensor, convert=from_hf_tensor) -> None:
    """Copy one stored tensor into ``live`` (this rank's shard of it); the full tensor dies on return."""
    full = convert(key, weights.get(stored))
    if key == "transformer.wpe.weight":
        full = full[: live.shape[0]]
    _assign(live, full)


def _same_rows(weights: _HFWeights, a: str, b: str, rows: int = 4096) -> bool:
    """Whether two stored tensors of equal shape are equal, compared ``rows`` rows at a time."""
    if a == b:
        return True
    n = weights.shape(a)[0]
    return all(torch.equal(weights.rows(a, i, i + rows), weights.rows(b, i, i + rows)) for i in range(0, n, rows))


def hf_loader(family):
    """How weights of ``family``'s models come from a transformers directory: its own ``load_hf`` hook, else
    :func:`load_hf_weights` where that reads the family's format (``hf_format``), else ``None``."""
    if family is None:
        return None
    return family.load_hf or (load_hf_weights if family.hf_format else None)
