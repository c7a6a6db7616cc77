"""Llama 3.1's RoPE scaling ("llama3") against transformers, the config's scaling through transformers' formats, its
bad inputs, and RoPE models running sequences longer than ``block_size`` (GPT-2's position table still bounds it).

The parallel layers with scaled RoPE are checked against the plain model in tests/test_llama_parallel.py (the
``-llama3`` cases)."""

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import lightning_tp2d as tp
from lightning_tp2d.export import hf_llama_config
from lightning_tp2d.models import GPT2, GPT2Config, Llama, LlamaConfig
from lightning_tp2d.models.llama import HF_FORMAT
from lightning_tp2d.models.rope import RoPE, rope_cache, rope_inv_freq
from lightning_tp2d.module import sample

TOL = dict(rtol=1e-5, atol=1e-5)  # float32, as tests/test_llama.py
# A short "pre-training context" so that a 256-token test sequence runs 8x past it.
SMALL = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 32}
# hs 16 with theta 10000: wavelengths 6.3, 20, 63, 199, ... -> one kept (< 32/4), one interpolated, six divided
SIZES = dict(vocab_size=257, n_layer=2, n_head=6, n_kv_head=3, n_embd=96, intermediate_size=264, block_size=64)


def _hf_config(rope_parameters: dict, **kw) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=257, hidden_size=96, intermediate_size=264, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=3, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
        attn_implementation="sdpa", rope_parameters=rope_parameters, **kw)


def _transformers_inv_freq(head_size: int, theta: float, scaling: dict) -> torch.Tensor:
    hf = transformers.LlamaConfig(hidden_size=head_size * 4, num_attention_heads=4, max_position_embeddings=131072,
                                  rope_parameters={**scaling, "rope_theta": theta})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf)
    assert attention_factor == 1.0
    return inv_freq


def _pair(scaling: dict | None, seed: int = 0):
    """transformers' LlamaForCausalLM and ours with the same weights."""
    torch.manual_seed(seed)
    params = {"rope_type": "default", "rope_theta": 10000.0, **(scaling or {})}
    hf = transformers.LlamaForCausalLM(_hf_config(params)).eval()
    ours = Llama(LlamaConfig.from_hf(hf.config)).eval()
    ours.load_hf_state_dict(hf.state_dict())
    return hf, ours


def _idx(T: int, B: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 257, (B, T), generator=torch.Generator().manual_seed(seed))


# ---- the scaled frequencies ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("head_size, theta, scaling", [
    (128, 500000.0, LlamaConfig.NAMED["llama-3.1-8b"]["rope_scaling"]),
    (64, 500000.0, LlamaConfig.NAMED["llama-3.2-1b"]["rope_scaling"]),
    (16, 10000.0, SMALL),
], ids=["llama-3.1", "llama-3.2", "small"])
def test_llama3_inverse_frequencies_equal_transformers_bit_for_bit(head_size, theta, scaling):
    rope = RoPE.from_scaling(theta, scaling)
    got, plain = rope_inv_freq(head_size, rope), rope_inv_freq(head_size, theta)
    assert torch.equal(got, _transformers_inv_freq(head_size, theta, scaling))
    # the three bands: short wavelengths kept, long ones divided by factor, those between in between
    wavelen = 2 * torch.pi / plain
    context = scaling["original_max_position_embeddings"]
    high, low = wavelen < context / scaling["high_freq_factor"], wavelen > context / scaling["low_freq_factor"]
    assert high.any() and low.any() and (~high & ~low).any()
    assert torch.equal(got[high], plain[high])
    assert torch.equal(got[low], plain[low] / scaling["factor"])
    mid = ~high & ~low
    assert ((got[mid] < plain[mid]) & (got[mid] > plain[mid] / scaling["factor"])).all()


def test_default_rope_is_unchanged_by_the_description():
    """A RoPE without scaling gives the very numbers of a plain theta (and of transformers' default RoPE)."""
    for positions in (20, torch.tensor([2, 3, 12, 13])):
        for a, b in zip(rope_cache(positions, 8, RoPE(500000.0)), rope_cache(positions, 8, 500000.0)):
            assert torch.equal(a, b)
    assert LlamaConfig.from_name("llama-tiny").rope == RoPE(10000.0)
    assert LlamaConfig.from_name("llama-tiny", rope_scaling={"rope_type": "default"}).rope_scaling is None


# ---- the model against transformers --------------------------------------------------------------------------------

@pytest.mark.parametrize("scaling", [SMALL, None], ids=["llama3", "default"])
def test_logits_equal_transformers_far_past_the_original_context_and_block_size(scaling):
    """256 tokens: 8x the scaling's original context of 32 and 4x block_size 64 (which bounds nothing)."""
    hf, ours = _pair(scaling)
    assert ours.config.block_size == 64 and ours.config.rope_scaling == scaling
    idx = _idx(256)
    with torch.no_grad():
        ref = hf(idx, labels=idx)
        logits = ours(idx)
        loss = ours(idx, torch.cat([idx[:, 1:], torch.full_like(idx[:, :1], -100)], dim=1))
    assert logits.shape == (2, 256, 257)
    torch.testing.assert_close(logits, ref.logits, **TOL)
    torch.testing.assert_close(loss, ref.loss, **TOL)


def test_scaling_changes_the_logits_past_the_high_frequency_band():
    """The scaled and plain models differ (the scaling is applied, not just carried)."""
    (_, scaled), (_, plain) = _pair(SMALL), _pair(None)
    with torch.no_grad():
        assert (scaled(_idx(64)) - plain(_idx(64))).abs().max() > 1e-3


# ---- transformers' config formats ----------------------------------------------------------------------------------

def test_from_hf_reads_transformers_5_rope_parameters_and_4_rope_scaling():
    v5 = LlamaConfig.from_hf(_hf_config({**SMALL, "rope_theta": 500000.0}))
    assert (v5.rope_theta, v5.rope_scaling) == (500000.0, SMALL)
    # the config.json files below name no special tokens (transformers' class says 1 and 2): none are read
    assert (v5.bos_token_id, v5.eos_token_id) == (1, 2)
    v5 = dataclasses.replace(v5, bos_token_id=None, eos_token_id=None)
    raw4 = {"hidden_size": 96, "num_attention_heads": 6, "rope_theta": 500000.0, "max_position_embeddings": 64,
            "intermediate_size": 264, "num_hidden_layers": 2, "vocab_size": 257, "num_key_value_heads": 3,
            "rms_norm_eps": 1e-5}
    assert HF_FORMAT.read_config({**raw4, "rope_scaling": SMALL}) == v5  # a transformers 4 config.json
    old = {k: v for k, v in SMALL.items() if k != "rope_type"}
    assert HF_FORMAT.read_config({**raw4, "rope_scaling": {**old, "type": "llama3"}}) == v5  # "type": older files
    # transformers' default for a missing pre-training context: max_position_embeddings
    no_context = {k: v for k, v in SMALL.items() if k != "original_max_position_embeddings"}
    assert HF_FORMAT.read_config({**raw4, "rope_scaling": no_context}).rope_scaling == {
        **SMALL, "original_max_position_embeddings": 64}


def test_export_writes_the_scaling_transformers_reads_back(tmp_path):
    """export_hf -> LlamaForCausalLM.from_pretrained: the same scaling and logits; and back into our config."""
    torch.manual_seed(3)
    ours = Llama(LlamaConfig(**SIZES, rope_scaling=SMALL)).eval()
    tp.export_hf(ours, tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert hf.config.rope_parameters == {**SMALL, "rope_theta": 10000.0}
    assert json.loads((tmp_path / "config.json").read_text())["rope_scaling"] == SMALL  # what transformers 4 reads
    assert hf_llama_config(tmp_path) == ours.config == LlamaConfig.from_hf(hf.config)
    idx = _idx(160)
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, **TOL)
    plain = HF_FORMAT.hf_config(LlamaConfig(**SIZES))  # no scaling: transformers' default RoPE
    assert plain["rope_scaling"] is None and plain["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e4}


def test_a_checkpoint_with_another_scaling_is_refused_naming_it():
    ours, theirs = LlamaConfig(**SIZES), LlamaConfig(**SIZES, rope_scaling=SMALL)
    assert HF_FORMAT.fit_problems(ours, theirs) == [f"rope_scaling: model None, checkpoint {SMALL}"]


# ---- the named configs ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, factor", [("llama-3.1-8b", 8.0), ("llama-3.1-70b", 8.0), ("llama-3.1-405b", 8.0),
                                          ("llama-3.2-1b", 32.0), ("llama-3.2-3b", 32.0)])
def test_named_llama_3_configs_have_their_real_scaling_and_context(name, factor):
    cfg = LlamaConfig.from_name(name)
    assert cfg.block_size == 131072 and cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert torch.equal(rope_inv_freq(cfg.head_size, cfg.rope),
                       _transformers_inv_freq(cfg.head_size, cfg.rope_theta, cfg.rope_scaling))
    assert LlamaConfig.from_name("llama-2-7b").rope_scaling is None


# ---- bad input: one error each, at the config ----------------------------------------------------------------------

@pytest.mark.parametrize("scaling, message", [
    ({**SMALL, "rope_type": "yarn"}, "rope_type='yarn' is not supported; supported: 'default', 'llama3'"),
    ({k: v for k, v in SMALL.items() if k != "rope_type"}, "rope_type=None is not supported"),
    ({k: v for k, v in SMALL.items() if k != "low_freq_factor"}, r"missing \['low_freq_factor'\]"),
    ({**SMALL, "beta_fast": 32}, r"unknown \['beta_fast'\]"),
    ({"rope_type": "default", "factor": 2.0}, r"rope_type 'default': unknown \['factor'\]"),
    ({**SMALL, "factor": 0.0}, "factor=0.0 and low_freq_factor=1.0 must be positive"),
    ({**SMALL, "factor": -8}, "factor=-8.0 and low_freq_factor=1.0 must be positive"),
    ({**SMALL, "high_freq_factor": 1.0}, "high_freq_factor=1.0 must exceed low_freq_factor=1.0"),
    ({**SMALL, "factor": "8"}, r"factor='8' \(need numbers\)"),
    ({**SMALL, "original_max_position_embeddings": 31.5}, "original_max_position_embeddings=31.5 must be a positive"),
    ("llama3", "must be a dict with a rope_type, or None"),
], ids=["unknown-type", "no-type", "missing-field", "unknown-field", "default-with-field", "zero-factor",
        "negative-factor", "high-not-above-low", "string-factor", "fractional-context", "not-a-dict"])
def test_bad_scaling_is_refused_naming_the_field(scaling, message):
    with pytest.raises(ValueError, match="LlamaConfig.rope_scaling.*" + message):
        LlamaConfig(**SIZES, rope_scaling=scaling)


def test_from_hf_names_a_bad_scaling_with_the_other_problems():
    """A config.json transformers itself would refuse (it raises a KeyError for the missing field)."""
    raw = {"hidden_act": "gelu", "rope_scaling": {k: v for k, v in SMALL.items() if k != "high_freq_factor"}}
    with pytest.raises(ValueError, match=r"hidden_act='gelu'.*rope_scaling/rope_parameters of rope_type 'llama3': "
                                         r"missing \['high_freq_factor'\]"):
        HF_FORMAT.read_config(raw)


# ---- sequences longer than block_size ------------------------------------------------------------------------------

def test_generation_keeps_a_rope_models_whole_context_and_crops_gpt2s():
    torch.manual_seed(0)
    llama = Llama(LlamaConfig(**SIZES, rope_scaling=SMALL)).eval()
    idx = _idx(70, B=1)  # longer than block_size 64
    out = sample(llama, idx, 3, temperature=0)
    ref = idx
    with torch.no_grad():
        for _ in range(3):  # greedy on the whole context every step
            ref = torch.cat([ref, llama(ref)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ref)
    gpt2 = GPT2(GPT2Config.from_name("gpt2-tiny"))
    with pytest.raises(ValueError, match="sequence length 70 exceeds block_size 64"):
        sample(gpt2, idx, 1)


def test_data_longer_than_block_size_fits_a_rope_model_only():
    data = SimpleNamespace(block_size=256)
    assert LlamaConfig(**SIZES).max_seq_len is None and GPT2Config.from_name("gpt2-tiny").max_seq_len == 64
    tp.CausalLMModule(LlamaConfig(**SIZES)).check_data_sizes(data)  # no error
    with pytest.raises(ValueError, match="data block_size 256 exceeds the model's block_size 64"):
        tp.CausalLMModule("gpt2-tiny").check_data_sizes(data)
