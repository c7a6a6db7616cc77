"""A third model family registered by a user, with a transformers format of its own (other key names, a transposed
weight, its own ``config.json``), goes through the generic export and import paths with no edit to the package:
``export_hf`` / ``load_hf_weights`` / ``load_hf_model`` round trip exactly, the one key checker names its problems
in the format's own names, and a trained checkpoint loads back, exports and samples through ``load_model`` and
``tp2d-generate``'s loader."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import lightning.pytorch as L
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import lightning_tp2d as tp
from lightning_tp2d import checkpoint as ckpt
from lightning_tp2d import generate as gen
from lightning_tp2d.core import TensorParallelCore
from lightning_tp2d.export import (export_hf, hf_model_config, load_hf_model, load_hf_weights, load_model,
                                   read_hf_config)
from lightning_tp2d.families import ModelFamily, family_of, register_family, unregister_family
from lightning_tp2d.models import GPT2, LMHead
from lightning_tp2d.models.hf import HFFormat

safetensors = pytest.importorskip("safetensors")


@dataclass
class TinyConfig:
    vocab_size: int
    n_embd: int
    n_layer: int
    block_size: int = 32
    tie: bool = False


class TinyBlock(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.proj = nn.Linear(n_embd, 2 * n_embd)  # [2h, h]: stored transposed as [h, 2h]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.glu(self.proj(x))


class TinyLM(nn.Module):
    """x = embed(idx); x += glu(proj(x)) per block; logits = norm(x) @ headᵀ (tied to embed with ``tie``)."""

    validate_inputs = True
    check_input = GPT2.check_input
    _assert_ids_on_device = GPT2._assert_ids_on_device

    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList([TinyBlock(config.n_embd) for _ in range(config.n_layer)])
        self.norm = nn.LayerNorm(config.n_embd)
        head = self.embed.weight if config.tie else nn.Parameter(torch.randn(config.vocab_size, config.n_embd) * 0.1)
        self.lm_head = LMHead(head)

    def tie_weights(self) -> None:
        if self.config.tie:
            self.lm_head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        self.check_input(idx, targets)
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x), targets)


# ours <-> theirs: embed.weight <-> net.wte.weight, blocks.{i}.proj.* <-> net.layers.{i}.dense.*,
# norm.* <-> net.ln.*, lm_head.weight <-> out.weight
_TO_HF = [(r"^embed\.", "net.wte."), (r"^blocks\.(\d+)\.proj\.", r"net.layers.\1.dense."), (r"^norm\.", "net.ln."),
          (r"^lm_head\.", "out.")]
_FROM_HF = [(r"^net\.wte\.", "embed."), (r"^net\.layers\.(\d+)\.dense\.", r"blocks.\1.proj."), (r"^net\.ln\.", "norm."),
            (r"^out\.", "lm_head.")]


def _rename(rules, key: str) -> str:
    for pattern, repl in rules:
        key = re.sub(pattern, repl, key)
    return key


def _read(raw) -> TinyConfig:
    if raw.get("activation", "glu") != "glu":
        raise ValueError(f"unsupported transformers TinyConfig: activation={raw['activation']!r} (need 'glu')")
    return TinyConfig(vocab_size=raw["vocab"], n_embd=raw["width"], n_layer=raw["depth"],
                      block_size=raw["max_len"], tie=raw["tie_word_embeddings"])


def _write(cfg: TinyConfig) -> dict:
    return {"vocab": cfg.vocab_size, "width": cfg.n_embd, "depth": cfg.n_layer, "max_len": cfg.block_size,
            "tie_word_embeddings": cfg.tie, "activation": "glu"}


TINY_FORMAT = HFFormat(model_type="tiny-lm", architecture="TinyForCausalLM", read_config=_read, write_config=_write,
                       embedding="embed.weight", prefix="net.", transposed=("proj.weight",),
                       ignored=(".rotary",), sizes=("vocab_size", "n_embd", "n_layer"), tie_option="tie",
                       to_hf_key=lambda k: _rename(_TO_HF, k), from_hf_key=lambda k: _rename(_FROM_HF, k))


@pytest.fixture
def tiny():
    family = register_family(ModelFamily(name="tiny", model_class=TinyLM, config_class=TinyConfig,
                                         module_roles=lambda model: [], plans={}, blocks="blocks", hf=TINY_FORMAT))
    try:
        yield family
    finally:
        unregister_family("tiny")


def _model(seed: int, **kw) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(TinyConfig(**{**dict(vocab_size=50, n_embd=8, n_layer=2), **kw})).eval()


def _empty(config: TinyConfig) -> TinyLM:
    with torch.device("meta"):
        model = TinyLM(config)
    model.to_empty(device="cpu")
    return model.eval()


IDX = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_a_user_family_exports_and_loads_back_exactly(tiny, tmp_path, tie):
    source = _model(1, tie=tie)
    assert family_of(source) is tiny and tiny.config_key == "tiny_configs"  # the key defaults from the name
    out = export_hf(source, tmp_path / "hf")
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "tiny-lm" and written["architectures"] == ["TinyForCausalLM"]
    with safetensors.safe_open(str(out / "model.safetensors"), framework="pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    assert set(stored) == {"net.wte.weight", "net.ln.weight", "net.ln.bias"} | {
        f"net.layers.{i}.dense.{p}" for i in range(2) for p in ("weight", "bias")} | (set() if tie else {"out.weight"})
    assert torch.equal(stored["net.layers.1.dense.weight"], source.blocks[1].proj.weight.t())  # [h, 2h]
    assert hf_model_config(out) == read_hf_config(out, "tiny") == source.config  # by config.json's model_type

    loaded = load_hf_weights(_empty(source.config), out)
    fresh = load_hf_model(out)
    for model in (loaded, fresh):
        assert type(model) is TinyLM and (model.lm_head.weight is model.embed.weight) == tie
        assert model.state_dict().keys() == source.state_dict().keys()
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), source.state_dict().values()))
        with torch.no_grad():
            assert torch.equal(model(IDX), source(IDX))


def test_the_key_checker_names_the_problems_in_the_formats_own_names(tiny, tmp_path):
    from safetensors.torch import save_file

    source = _model(2)
    out = export_hf(source, tmp_path / "hf")
    with pytest.raises(ValueError, match=r"does not fit this model: n_layer: model 3, checkpoint 2"):
        load_hf_weights(_empty(TinyConfig(vocab_size=50, n_embd=8, n_layer=3)), out)
    with safetensors.safe_open(str(out / "model.safetensors"), framework="pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    del stored["net.ln.bias"]
    stored["net.layers.0.extra"] = torch.zeros(3)
    stored["net.layers.0.rotary"] = torch.zeros(3)  # an ignored buffer: no problem
    stored["net.layers.1.dense.weight"] = stored["net.layers.1.dense.weight"].t().contiguous()  # our layout: wrong
    save_file(stored, str(out / "model.safetensors"))
    target = _model(5)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError) as err:
        load_hf_weights(target, out)
    msg = str(err.value)
    assert "missing keys: ['norm.bias']" in msg
    assert "unexpected keys: ['net.layers.0.extra']" in msg
    assert "net.layers.1.dense.weight: expected (8, 16), got (16, 8)" in msg
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())  # nothing copied

    tied = _model(3, tie=True)
    sd = TINY_FORMAT.hf_state_dict(_model(3))  # an untied head, stored
    with pytest.raises(ValueError, match=r"lm_head.weight differs from embed.weight, but this model ties them "
                                         r"\(tie=True\)"):
        TINY_FORMAT.load_state_dict(tied, sd, "tiny state dict")
    del sd["out.weight"]
    with pytest.raises(ValueError, match=r"cannot load tiny state dict:\n  missing keys: \['lm_head.weight'\]"
                                         r"[\s\S]*use tie=True"):
        TINY_FORMAT.load_state_dict(_model(4), sd, "tiny state dict")  # (an untied model needs its head)
    TINY_FORMAT.load_state_dict(tied, sd, "tiny state dict")  # a tied model does not
    assert torch.equal(tied.embed.weight, _model(3).embed.weight) and tied.lm_head.weight is tied.embed.weight

    raw = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, "activation": "relu"}))
    with pytest.raises(ValueError, match=r"config.json': unsupported transformers TinyConfig: activation='relu'"):
        hf_model_config(out)
    (out / "config.json").write_text(json.dumps({**raw, "model_type": "mystery"}))
    with pytest.raises(ValueError, match=r"describes a 'mystery' model; registered transformers formats: "
                                         r"\['gpt2', 'llama', 'tiny-lm'\]"):
        load_hf_model(out)


def test_a_user_family_trains_and_its_checkpoint_loads_exports_and_samples(tiny, tmp_path):
    module = tp.CausalLMModule(model=TinyConfig(vocab_size=257, n_embd=8, n_layer=2, block_size=16),
                               warmup_steps=1, max_steps=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(module, tp.TextDataModule(block_size=16, batch_size=2, max_tokens=400, val_fraction=0.2))
    trained = module.model.eval()
    path = tmp_path / "tiny.ckpt"
    trainer.save_checkpoint(path)  # records the config as the 'model' hyper-parameter only

    # what TP2DStrategy records: each registered family's configs under its own key
    dims = tp.ParallelDims(layout="2d", tensor_parallel_size=1, data_parallel_size=1)
    info = TensorParallelCore.checkpoint_info(type("Core", (), {"train_plan": dims})(), module)
    assert info["tiny_configs"] == {"model": vars(trained.config)} and info["gpt2_configs"] == {}
    recorded = tmp_path / "recorded"
    ckpt.save({"state_dict": ckpt.full_model_state(module, 0), "tp2d": info}, recorded, rank=0, sharded=True,
              all_gather=lambda obj: [obj])

    for source in (path, recorded):
        plain = load_model(source, trained.config if source == path else None)  # recorded config: found
        assert type(plain) is TinyLM and plain.config == trained.config
        assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), trained.state_dict().values()))
    exported = export_hf(recorded, tmp_path / "hf")  # the family found from the checkpoint's record
    assert torch.equal(load_hf_model(exported)(IDX), trained(IDX))
    sampled, _ = gen.load_model(str(path), hf=False)  # tp2d-generate: config from the 'model' hyper-parameter
    assert all(torch.equal(a, b) for a, b in zip(sampled.state_dict().values(), trained.state_dict().values()))
