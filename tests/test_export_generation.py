"""Exports are complete for generation: ``config.json`` and ``generation_config.json`` carry the special-token ids
(bos, eos: an int or a list, pad), so transformers' ``generate`` stops at the model's end of text instead of its class
defaults (Llama's 1 and 2). The ids come from the config (read from ``module.init_from``'s ``config.json`` and
``generation_config.json``, recorded in checkpoints), else from the data's tokenizer, else the family's convention;
Llama 3's ids (bos 128000, eos 128001 or a list) round-trip directory -> our model and checkpoint -> export, and a
checkpoint recorded before the fields existed still exports."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

import lightning_tp2d as tp
from lightning_tp2d import checkpoint as ckpt
from lightning_tp2d import launch
from lightning_tp2d.core import TensorParallelCore
from lightning_tp2d.export import read_hf_config, recorded_config
from lightning_tp2d.models import GPT2, GPT2Config
from lightning_tp2d.models.llama import Llama, LlamaConfig
from lightning_tp2d.module import sample
from lightning_tp2d.run_outputs import export_token_ids, export_transformers
from lightning_tp2d.train import model_from_init

launch.register_resolvers()

TINY = {"gpt2": GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, block_size=32),
        "llama": LlamaConfig(vocab_size=64, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, intermediate_size=32,
                             block_size=32)}
MODELS = {"gpt2": GPT2, "llama": Llama}


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def composed(*overrides: str):
    """The config as ``tp2d-train <overrides>`` composes it, with Hydra's record of the choices (model_from_init)."""
    with initialize_config_dir(config_dir=str(launch.CONF_DIR), version_base="1.3", job_name="test"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)


def _greedy_with_a_new_token(family: str, prompt: torch.Tensor, n: int) -> tuple[torch.nn.Module, list[int], int]:
    """A seeded tiny model whose greedy continuation of ``prompt`` (``n`` tokens, ours) emits a token it had not
    emitted before at a step ``j >= 1`` (a freshly drawn model often repeats one token): ``(model, tokens, j)``."""
    for seed in range(100):
        torch.manual_seed(seed)
        model = MODELS[family](TINY[family]).eval()
        ours = sample(model, prompt, n, temperature=0)[0, prompt.size(1):].tolist()
        j = next((j for j in range(1, n - 2) if ours[j] not in ours[:j]), None)
        if j is not None:
            return model, ours, j
    raise AssertionError(f"no {family} seed below 100 emits a new token")


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_transformers_generation_stops_at_the_exported_end_of_text(tmp_path, family):
    """Greedy decoding of a tiny model emits token ``eos`` at step ``j >= 1`` (its first time); with that id as the
    model's ``eos_token_id`` the export's ``generate`` stops there: ``j + 1 < max_new_tokens`` tokens, the last eos,
    the same tokens as ours."""
    prompt, n = torch.tensor([[5, 9, 2]]), 16
    model, ours, j = _greedy_with_a_new_token(family, prompt, n)
    eos = ours[j]
    model.config = dataclasses.replace(model.config, bos_token_id=1, eos_token_id=eos)
    out = tp.export_hf(model, tmp_path / "hf")
    assert _json(out / "generation_config.json") == {"bos_token_id": 1, "eos_token_id": eos}
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.config.eos_token_id == eos and hf.generation_config.eos_token_id == eos
    with torch.no_grad():
        new = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False,
                          pad_token_id=0)[0, 3:].tolist()
    assert new == ours[: j + 1] and len(new) < n and new[-1] == eos
    # our sampling stops there too: at the model config's end-of-text id, as transformers' generate does
    assert sample(model, prompt, n, temperature=0)[0, 3:].tolist() == new
    assert sample(model, prompt, n, temperature=0, eos_token_id=None)[0, 3:].tolist() == ours  # never stops


def test_sampling_stops_when_every_row_has_ended_and_fills_the_rows_that_ended_first():
    prompt, n = torch.tensor([[5, 9, 2], [7, 1, 3]]), 12

    def ends_of(rows):  # each row's first new token at a step >= 1 (its end), the rows ending at two steps, each
        ends = [next((k for k in range(1, n - 1) if row[k] not in row[:k]), None) for row in rows]
        if None in ends or ends[0] == ends[1]:  # row's end id absent from the other row's tokens before its end
            return None
        clean = rows[0][ends[0]] not in rows[1][:ends[1] + 1] and rows[1][ends[1]] not in rows[0][:ends[0] + 1]
        return ends if clean else None

    for seed in range(100):  # a seeded tiny model whose greedy rows end so (a fresh one often repeats one token)
        torch.manual_seed(seed)
        model = MODELS["gpt2"](TINY["gpt2"]).eval()
        rows = sample(model, prompt, n, temperature=0, eos_token_id=None)[:, 3:].tolist()
        ends = ends_of(rows)
        if ends is not None:
            break
    else:
        raise AssertionError("no gpt2 seed below 100 gives two rows that end at distinct steps")
    stops = [rows[0][ends[0]], rows[1][ends[1]]]
    out = sample(model, prompt, n, temperature=0, eos_token_id=stops)[:, 3:].tolist()
    last = max(ends)
    assert len(out[0]) == last + 1  # stopped when the later row ended, not at max_new_tokens
    for r, row in enumerate(out):
        assert row[:ends[r] + 1] == rows[r][:ends[r] + 1]  # the same tokens up to its end
        assert row[ends[r] + 1:] == [stops[r]] * (last - ends[r])  # then its end-of-text id (no pad_token_id)
    with pytest.raises(ValueError, match=r"eos_token_id=999: 999 is not one of the model's 64 token ids"):
        sample(model, prompt, 2, eos_token_id=999)


def test_without_known_ids_gpt2_writes_its_convention_and_llama_writes_none(tmp_path):
    """No ids anywhere: GPT-2's <|endoftext|> convention (vocab_size - 1); Llama null, never transformers' 1 and 2."""
    for family, ids in (("gpt2", {"bos_token_id": 63, "eos_token_id": 63}), ("llama", {})):
        out = tp.export_hf(MODELS[family](TINY[family]), tmp_path / family)
        written = _json(out / "config.json")
        assert {k: written[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")} == \
            {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **ids}  # written, null or not
        assert _json(out / "generation_config.json") == ids
        hf = transformers.AutoConfig.from_pretrained(out)
        assert (hf.bos_token_id, hf.eos_token_id) == (ids.get("bos_token_id"), ids.get("eos_token_id"))


def _llama3_dir(path: Path, eos, generation_eos=None) -> Path:
    """A transformers Llama with Llama 3's vocabulary (128256 ids, hidden size 8, tied) and its special ids: bos
    128000, ``eos`` in config.json, ``generation_eos`` (default: the same) in generation_config.json."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128256, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                      rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5,
                                      bos_token_id=128000, eos_token_id=eos)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    if generation_eos is not None:
        generation = _json(path / "generation_config.json")
        (path / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": generation_eos}))
    return path


@pytest.mark.parametrize("eos, generation_eos, ours", [
    (128001, None, 128001),  # Llama 3 base
    ([128001, 128008, 128009], None, (128001, 128008, 128009)),  # Llama 3.1 instruct: a list in both files
    (128009, [128001, 128009], (128001, 128009)),  # Llama 3 instruct: generation_config.json lists more
], ids=["int", "list", "generation-list"])
def test_llama3_ids_round_trip_from_init_from_through_a_checkpoint_to_the_export(tmp_path, eos, generation_eos, ours):
    source = _llama3_dir(tmp_path / "llama3", eos, generation_eos)
    assert (read_hf_config(source).bos_token_id, read_hf_config(source).eos_token_id) == (128000, ours)
    cfg = composed("trainer=cpu", "parallel=single", f"module.init_from={source}")  # tp2d-train's model node
    assert model_from_init(cfg) and instantiate(cfg.model) == read_hf_config(source)  # (a list survives YAML)
    module = tp.CausalLMModule(init_from=str(source))
    module.configure_model()
    dims = tp.ParallelDims(layout="2d", tensor_parallel_size=1, data_parallel_size=1)
    info = TensorParallelCore.checkpoint_info(type("Core", (), {"train_plan": dims})(), module)
    recorded = tmp_path / "recorded.ckpt"  # what TP2DStrategy records: the config's fields, under its family's key
    ckpt.save({"state_dict": ckpt.full_model_state(module, 0), "tp2d": info}, recorded, rank=0, sharded=True,
              all_gather=lambda obj: [obj])
    assert recorded_config(recorded, "llama").eos_token_id == ours
    out = tp.export_hf(recorded, tmp_path / "export")
    want = {"bos_token_id": 128000, "eos_token_id": list(ours) if isinstance(ours, tuple) else ours}
    assert {k: _json(out / "config.json")[k] for k in want} == want
    assert _json(out / "generation_config.json") == want
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert (hf.generation_config.bos_token_id, hf.generation_config.eos_token_id) == tuple(want.values())

    # a checkpoint recorded before the fields existed: its config loads, and the export falls back (Llama: none)
    old = {**info, "llama_configs": {"model": {k: v for k, v in info["llama_configs"]["model"].items()
                                               if not k.endswith("_token_id")}}}
    ckpt.save({"state_dict": ckpt.full_model_state(module, 0), "tp2d": old}, tmp_path / "old.ckpt", rank=0,
              sharded=True, all_gather=lambda obj: [obj])
    assert recorded_config(tmp_path / "old.ckpt", "llama").eos_token_id is None
    assert _json(tp.export_hf(tmp_path / "old.ckpt", tmp_path / "old_export") / "generation_config.json") == {}


def test_tp2d_train_exports_the_ids_of_init_from_else_of_the_tokenizer(tmp_path):
    """A model chosen beside init_from does not carry the directory's ids: the export takes them from it; without
    init_from, the text's tokenizer says (GPT-2's <|endoftext|> 50256, not the padded vocabulary's last id); token
    files carry ids of no known tokenizer: the family's convention."""
    cpu = ["trainer=cpu", "parallel=single", "trainer.devices=1"]
    assert export_token_ids(composed(*cpu)) == {"bos_token_id": 256, "eos_token_id": 256}  # the byte tokenizer
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "ids.bin")
    assert export_token_ids(composed(*cpu, "data=tokens", f"data.path={tmp_path / 'ids.bin'}")) == {}
    source = tmp_path / "init"
    tp.export_hf(GPT2(dataclasses.replace(TINY["gpt2"], bos_token_id=7, eos_token_id=8, pad_token_id=9)), source)
    assert export_token_ids(composed(*cpu, "model=gpt2-tiny", f"module.init_from={source}")) == \
        {"bos_token_id": 7, "eos_token_id": 8, "pad_token_id": 9}

    padded = GPT2(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=50304, block_size=16))
    cfg = composed(*cpu, "data.tokenizer=gpt2", f"export_hf={tmp_path / 'export'}")
    written = _json(export_transformers(cfg, padded, None) / "config.json")
    assert (written["bos_token_id"], written["eos_token_id"]) == (50256, 50256)
