"""One device: a plain :class:`~lightning_tp2d.models.GPT2` from a checkpoint of any layout, and export to
transformers' GPT-2 format. No process group needed; the checkpoint may be sharded (DCP directory) or full."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lightning_tp2d.checkpoint import META, is_sharded, read_state_dict, resolve
from lightning_tp2d.models.gpt2 import GPT2, GPT2Config


def gpt2_state_dict(path, prefix: str | None = None) -> dict[str, torch.Tensor]:
    """The weights of the GPT2 inside a checkpoint under plain ``GPT2`` keys; ``prefix`` (e.g. ``"model."``) picks
    one when the LightningModule holds several."""
    state = read_state_dict(path)
    if prefix is None:
        found = sorted(k[: -len("transformer.wte.weight")] for k in state if k.endswith("transformer.wte.weight"))
        if len(found) != 1:
            raise ValueError(f"checkpoint holds {len(found)} GPT2 models (prefixes {found}); pass prefix=")
        prefix = found[0]
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def load_gpt2(path, config: GPT2Config | None = None, prefix: str | None = None) -> GPT2:
    """A plain single-device :class:`GPT2` with a checkpoint's weights (config from the checkpoint if recorded)."""
    state = gpt2_state_dict(path, prefix)
    if config is None:
        config = _recorded_config(resolve(path), prefix)
    with torch.device("meta"):
        model = GPT2(config)
    model.to_empty(device="cpu")
    model.tie_weights()
    model.load_state_dict(state)
    return model


def _recorded_config(path: Path, prefix: str | None) -> GPT2Config:
    meta = torch.load(path / META if is_sharded(path) else path, map_location="cpu", weights_only=False, mmap=True)
    configs = meta.get("tp2d", {}).get("gpt2_configs", {})
    key = (prefix or "").rstrip(".")
    if key not in configs and len(configs) == 1:
        key = next(iter(configs))
    if key not in configs:
        raise ValueError(f"checkpoint records no GPT2 config for {key!r} (has {sorted(configs)}); pass config=")
    return GPT2Config(**configs[key])


def export_hf(source, directory, config: GPT2Config | None = None) -> Path:
    """Write transformers' GPT-2 format (``config.json`` + ``model.safetensors``) from a plain :class:`GPT2` or a
    checkpoint path; ``GPT2LMHeadModel.from_pretrained(directory)`` loads it."""
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
