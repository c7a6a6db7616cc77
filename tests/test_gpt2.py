"""Single-device GPT2 against transformers' GPT2LMHeadModel, plus config, input checks and init.

transformers 5 notes, found while writing these tests:
* ``attn_implementation`` is no longer a GPT2LMHeadModel constructor keyword; it goes in the config
  (``GPT2Config(..., attn_implementation="eager")``).
* ``state_dict()`` lists the tied ``lm_head.weight`` (``named_parameters()`` does not), and has no
  ``attn.bias`` / ``attn.masked_bias`` mask buffers any more.
* The causal-LM loss upcasts logits with ``.float()``, i.e. computes it in float32 even for a float64
  model; so its loss is compared at float32 tolerance, and gradients use a float64 loss on HF logits.
* The default bos/eos id 50256 warns for a 257-token vocab; the config sets them to None.
"""

import math

import pytest
import torch
import torch.nn.functional as F
import transformers

from lightning_tp2d.models import GPT2, GPT2Config, LMHead
from lightning_tp2d.models.gpt2 import HF_TRANSPOSED

SIZES = dict(n_layer=2, n_head=6, n_embd=48, vocab_size=257, block_size=64)


def make_hf(seed: int = 0) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        n_layer=SIZES["n_layer"], n_head=SIZES["n_head"], n_embd=SIZES["n_embd"],
        vocab_size=SIZES["vocab_size"], n_positions=SIZES["block_size"],
        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=None, eos_token_id=None, attn_implementation="eager",
    )
    return transformers.GPT2LMHeadModel(cfg).double().eval()


def make_pair(seed: int = 0):
    hf = make_hf(seed)
    ours = GPT2(GPT2Config.from_hf(hf.config)).double().eval()
    ours.load_hf_state_dict(hf.state_dict())
    return hf, ours


def random_idx(B: int = 3, T: int = 17, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SIZES["vocab_size"], (B, T), generator=g)


def shift_left(labels: torch.Tensor) -> torch.Tensor:
    """What HF does inside its loss: target at t is label at t+1; the last position is ignored."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)


# ---- equivalence with transformers -----------------------------------------------------------------

def test_from_hf_config_matches_sizes():
    cfg = GPT2Config.from_hf(make_hf().config)
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.vocab_size, cfg.block_size) == tuple(SIZES.values())
    assert cfg.dropout == 0.0 and cfg.bias and cfg.head_size == 8


def test_state_dict_keys_equal_transformers_keys():
    hf, ours = make_pair()
    assert list(ours.state_dict().keys()) == list(hf.state_dict().keys())


def test_logits_match_transformers_float64():
    hf, ours = make_pair()
    idx = random_idx()
    with torch.no_grad():
        ref = hf(idx).logits
        got = ours(idx)
    assert got.shape == (3, 17, 257)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)


def test_loss_matches_transformers_shifted_labels():
    hf, ours = make_pair()
    idx = random_idx()
    with torch.no_grad():
        ref = hf(idx, labels=idx).loss  # computed in float32 by transformers 5
        got = ours(idx, shift_left(idx))
        ref64 = F.cross_entropy(hf(idx).logits[:, :-1].reshape(-1, 257), idx[:, 1:].reshape(-1))
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, ref64, rtol=0, atol=1e-12)
    torch.testing.assert_close(got, ref.double(), rtol=1e-6, atol=1e-6)
    assert abs(got.item() - math.log(257)) < 0.1  # near-uniform predictions at init


def test_ignored_targets_match_transformers_and_change_the_mean():
    hf, ours = make_pair()
    idx = random_idx()
    labels = idx.clone()
    labels[0, 3:9] = -100
    labels[2, 10] = -100
    with torch.no_grad():
        ref = hf(idx, labels=labels).loss
        got = ours(idx, shift_left(labels))
        full = ours(idx, shift_left(idx))
        # Mean over the 3*16 - 7 = 41 kept tokens, by hand.
        logp = F.log_softmax(ours(idx), dim=-1)[:, :-1]
        keep = labels[:, 1:] != -100
        by_hand = -logp.gather(-1, idx[:, 1:, None].clamp(min=0)).squeeze(-1)[keep].mean()
    assert keep.sum().item() == 41
    torch.testing.assert_close(got, ref.double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, by_hand, rtol=0, atol=1e-12)
    assert abs(got.item() - full.item()) > 1e-6


def test_gradients_match_transformers_with_transposes():
    hf, ours = make_pair()
    idx = random_idx()
    targets = shift_left(idx)
    targets[1, :4] = -100
    # Same float64 loss on both sides (HF's own loss would be float32, see module docstring).
    F.cross_entropy(hf(idx).logits.reshape(-1, 257), targets.reshape(-1)).backward()
    ours(idx, targets).backward()
    names = [n for n, _ in ours.named_parameters()]
    assert len(names) == 2 + 12 * 2 + 2  # wte, wpe, 12 per block, ln_f; lm_head is wte
    for name, p in ours.named_parameters():
        ref = hf.get_parameter(name).grad
        ref = ref.t() if name.endswith(HF_TRANSPOSED) else ref
        assert p.grad.abs().max() > 0, name
        torch.testing.assert_close(p.grad, ref, rtol=1e-9, atol=1e-12, msg=name)


def test_hf_state_dict_round_trips_into_fresh_transformers_model():
    torch.manual_seed(5)
    ours = GPT2(GPT2Config(**SIZES)).double().eval()
    hf = make_hf(seed=6)
    sd = ours.hf_state_dict()
    assert sd["transformer.h.0.attn.c_attn.weight"].shape == (48, 144)  # Conv1D layout [in, out]
    assert sd["transformer.h.0.mlp.c_proj.weight"].shape == (192, 48)
    torch.testing.assert_close(sd["lm_head.weight"], sd["transformer.wte.weight"], rtol=0, atol=0)
    result = hf.load_state_dict(sd, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    idx = random_idx()
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx), rtol=0, atol=1e-12)


def test_load_keeps_lm_head_tied_and_accepts_missing_lm_head_and_old_mask_buffers():
    hf = make_hf()
    sd = dict(hf.state_dict())
    del sd["lm_head.weight"]
    sd["transformer.h.0.attn.bias"] = torch.ones(1, 1, 64, 64, dtype=torch.bool)  # old-transformers buffer
    sd["transformer.h.1.attn.masked_bias"] = torch.tensor(-1e4)
    ours = GPT2(GPT2Config(**SIZES)).double()
    ours.load_hf_state_dict(sd)
    assert ours.lm_head.weight is ours.transformer.wte.weight
    torch.testing.assert_close(ours.lm_head.weight, hf.lm_head.weight, rtol=0, atol=0)


def test_load_reports_missing_unexpected_and_misshaped_keys_at_once():
    sd = dict(make_hf().state_dict())
    del sd["transformer.h.1.ln_2.bias"]
    sd["transformer.h.0.attn.rotary"] = torch.zeros(3)
    # The square c_proj loads silently if left in nn.Linear layout, so corrupt a non-square one.
    sd["transformer.h.0.mlp.c_fc.weight"] = sd["transformer.h.0.mlp.c_fc.weight"].t()
    sd["transformer.wpe.weight"] = torch.zeros(32, 48)
    ours = GPT2(GPT2Config(**SIZES))
    before = ours.transformer.wte.weight.clone()
    with pytest.raises(ValueError) as err:
        ours.load_hf_state_dict(sd)
    msg = str(err.value)
    assert "missing keys: ['transformer.h.1.ln_2.bias']" in msg
    assert "unexpected keys: ['transformer.h.0.attn.rotary']" in msg
    assert "transformer.h.0.mlp.c_fc.weight: expected (48, 192), got (192, 48)" in msg
    assert "transformer.wpe.weight: expected (64, 48), got (32, 48)" in msg
    assert torch.equal(ours.transformer.wte.weight, before)  # nothing copied when anything is wrong


def test_load_after_meta_to_empty_reties_lm_head_and_matches_transformers():
    hf = make_hf()
    with torch.device("meta"):
        ours = GPT2(GPT2Config(**SIZES))
    ours.to_empty(device="cpu")
    ours.double().eval().load_hf_state_dict(hf.state_dict())  # no init_weights in between
    assert ours.lm_head.weight is ours.transformer.wte.weight
    idx = random_idx()
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, rtol=0, atol=1e-12)


def test_load_rejects_untied_lm_head():
    sd = dict(make_hf().state_dict())
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1.0
    with pytest.raises(ValueError, match="lm_head.weight differs from transformer.wte.weight"):
        GPT2(GPT2Config(**SIZES)).double().load_hf_state_dict(sd)


# ---- input checks and config ------------------------------------------------------------------------

def test_check_input_rejects_sequence_longer_than_block_size():
    model = GPT2(GPT2Config.from_name("gpt2-tiny"))
    with pytest.raises(ValueError, match="sequence length 100 exceeds block_size 64"):
        model(torch.zeros(2, 100, dtype=torch.long))
    assert model(torch.zeros(2, 64, dtype=torch.long)).shape == (2, 64, 257)


def test_check_input_rejects_token_id_equal_to_vocab_size_and_negative_ids():
    model = GPT2(GPT2Config.from_name("gpt2-tiny"))
    idx = torch.zeros(2, 8, dtype=torch.long)
    idx[1, 3] = 257
    with pytest.raises(ValueError, match=r"in \[0, 257\) for vocab_size 257, got min 0 max 257"):
        model(idx)
    idx[1, 3] = -1
    with pytest.raises(ValueError, match="got min -1 max 0"):
        model(idx)


def test_check_input_rejects_bad_shapes_dtypes_and_targets():
    model = GPT2(GPT2Config.from_name("gpt2-tiny"))
    idx = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"2-D \(B, T\) integer tensor, got shape \(16,\)"):
        model(idx.view(-1))
    with pytest.raises(ValueError, match="dtype torch.float32"):
        model(idx.float())
    with pytest.raises(ValueError, match=r"idx's shape \(2, 8\), got shape \(2, 7\)"):
        model(idx, idx[:, :7])
    bad = idx.clone()
    bad[0, 0], bad[1, 1] = 257, -5
    with pytest.raises(ValueError, match="got 2 outside, min -5 max 257"):
        model(idx, bad)
    ok = torch.full_like(idx, -100)
    ok[:, 0] = 256
    assert model(idx, ok).dim() == 0


def test_config_rejects_indivisible_heads_and_bad_values():
    with pytest.raises(ValueError, match="n_embd=50 is not divisible by n_head=6"):
        GPT2Config(n_layer=1, n_head=6, n_embd=50, vocab_size=10, block_size=8)
    with pytest.raises(ValueError, match="n_layer must be a positive int, got 0"):
        GPT2Config(n_layer=0, n_head=1, n_embd=8, vocab_size=10, block_size=8)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got 1.0"):
        GPT2Config(n_layer=1, n_head=1, n_embd=8, vocab_size=10, block_size=8, dropout=1.0)


def test_from_name_sizes_and_overrides_and_unknown_name_lists_valid_names():
    xl = GPT2Config.from_name("gpt2-xl")
    assert (xl.n_layer, xl.n_head, xl.n_embd, xl.head_size) == (48, 25, 1600, 64)
    mini = GPT2Config.from_name("gpt2-mini", dropout=0.1)
    assert (mini.n_layer, mini.n_embd, mini.block_size, mini.dropout) == (4, 96, 128, 0.1)
    with pytest.raises(ValueError) as err:
        GPT2Config.from_name("gpt3")
    for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt2-tiny", "gpt2-mini"):
        assert f"'{name}'" in str(err.value)


def test_gpt2_small_has_124m_parameters_with_tied_head_counted_once():
    with torch.device("meta"):
        model = GPT2(GPT2Config.from_name("gpt2"))
    assert model.num_parameters() == 124_439_808  # nanoGPT / HF figure for GPT-2 small


# ---- init -------------------------------------------------------------------------------------------

def test_lm_head_weight_is_wte_weight():
    model = GPT2(GPT2Config.from_name("gpt2-tiny"))
    assert isinstance(model.lm_head, LMHead)
    assert model.lm_head.weight is model.transformer.wte.weight


def test_init_std_is_002_and_residual_projections_are_scaled_by_sqrt_2_n_layer():
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=8, n_head=8, n_embd=256, vocab_size=1000, block_size=64)
    model = GPT2(cfg)
    residual = 0.02 / math.sqrt(2 * 8)  # 0.005
    h = model.transformer.h
    c_proj = torch.cat([torch.cat([b.attn.c_proj.weight.flatten(), b.mlp.c_proj.weight.flatten()]) for b in h])
    c_fc = torch.cat([b.mlp.c_fc.weight.flatten() for b in h])
    # ~2.6M and 2.1M draws: the std of the sample std is ~0.05%, so 2% is a safe band.
    assert abs(c_proj.std().item() / residual - 1) < 0.02
    assert abs(c_fc.std().item() / 0.02 - 1) < 0.02
    assert abs(model.transformer.wte.weight.std().item() / 0.02 - 1) < 0.02
    assert abs(c_proj.mean().item()) < 1e-4
    assert torch.all(h[3].attn.c_attn.bias == 0) and torch.all(h[3].ln_1.weight == 1)


def test_same_seed_gives_identical_state_dict_and_other_seed_differs():
    cfg = GPT2Config.from_name("gpt2-tiny")
    sds = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        sds.append(GPT2(cfg).state_dict())
    assert all(torch.equal(sds[0][k], sds[1][k]) for k in sds[0])
    assert not torch.equal(sds[0]["transformer.wte.weight"], sds[2]["transformer.wte.weight"])


def test_meta_build_then_to_empty_and_init_weights_equals_eager_build():
    cfg = GPT2Config.from_name("gpt2-tiny")
    torch.manual_seed(3)
    eager = GPT2(cfg)
    with torch.device("meta"):
        lazy = GPT2(cfg)
    assert lazy.transformer.wte.weight.is_meta
    lazy.to_empty(device="cpu")  # torch 2.13: a new Parameter per name, so this unties lm_head ...
    torch.manual_seed(3)
    lazy.init_weights()
    assert lazy.lm_head.weight is lazy.transformer.wte.weight  # ... and init_weights re-ties it
    eager_sd, lazy_sd = eager.state_dict(), lazy.state_dict()
    assert list(eager_sd) == list(lazy_sd)
    for k in eager_sd:
        assert torch.equal(eager_sd[k], lazy_sd[k]), k


def test_dropout_is_active_in_train_and_off_in_eval():
    torch.manual_seed(0)
    model = GPT2(GPT2Config.from_name("gpt2-tiny", dropout=0.5))
    idx = random_idx(T=16)
    model.train()
    a, b = model(idx), model(idx)
    model.eval()
    c, d = model(idx), model(idx)
    assert (a - b).abs().max() > 1e-3
    assert torch.equal(c, d)


def test_bias_false_has_no_bias_parameters_and_round_trips_through_hf_layout():
    cfg = GPT2Config.from_name("gpt2-tiny", bias=False)
    torch.manual_seed(0)
    a = GPT2(cfg)
    torch.manual_seed(1)
    b = GPT2(cfg)
    assert not any(k.endswith("bias") for k in a.state_dict())
    assert a.num_parameters() == 257 * 48 + 64 * 48 + 2 * (2 * 48 + 12 * 48 * 48) + 48
    b.load_hf_state_dict(a.hf_state_dict())
    idx = random_idx()
    torch.testing.assert_close(b(idx), a(idx), rtol=0, atol=0)
