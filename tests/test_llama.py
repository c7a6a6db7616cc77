"""Single-device Llama against transformers' LlamaForCausalLM, plus config, input checks, init and RoPE.

Compared in float32: transformers' LlamaRMSNorm normalises in float32 even in a float64 model, so float64 would
not be tighter. With the same SDPA kernel our logits equal transformers' bit for bit on CPU; the tolerances leave
room for other kernels.
"""

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.llama import modeling_llama as hf_llama

from lightning_tp2d.models import Llama, LlamaConfig, LMHead
from lightning_tp2d.models.llama import LlamaAttention, apply_rope, rope_cache
from lightning_tp2d.parallelize import _materialiser

TOL = dict(rtol=1e-5, atol=1e-5)


def hf_config(n_kv_head: int = 6, tie: bool = False, **kw) -> transformers.LlamaConfig:
    """transformers' config with llama-tiny's sizes."""
    return transformers.LlamaConfig(
        vocab_size=257, hidden_size=96, intermediate_size=264, num_hidden_layers=2, num_attention_heads=12,
        num_key_value_heads=n_kv_head, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=tie,
        attn_implementation="sdpa", **kw)


def make_pair(n_kv_head: int = 6, tie: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(hf_config(n_kv_head, tie)).eval()
    ours = Llama(LlamaConfig.from_hf(hf.config)).eval()
    ours.load_hf_state_dict(hf.state_dict())
    return hf, ours


def random_idx(B: int = 3, T: int = 17, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 257, (B, T), generator=g)


def shift_left(labels: torch.Tensor) -> torch.Tensor:
    """What HF does inside its loss: target at t is label at t+1; the last position is ignored."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)


# ---- equivalence with transformers ---------------------------------------------------------------------------------

def test_from_hf_config_and_state_dict_keys_equal_transformers():
    hf, ours = make_pair()
    cfg = ours.config
    # the sizes of llama-tiny, and the special-token ids transformers' LlamaConfig says by default (carried)
    assert cfg == LlamaConfig.from_name("llama-tiny", bos_token_id=1, eos_token_id=2)
    assert (cfg.head_size, cfg.kv_groups, cfg.rope_theta, cfg.norm_eps) == (8, 2, 10000.0, 1e-5)
    assert list(ours.state_dict()) == list(hf.state_dict())  # same keys, same order
    assert ours.state_dict()["model.layers.0.self_attn.k_proj.weight"].shape == (48, 96)  # 6 kv heads of 8


@pytest.mark.parametrize("n_kv_head, tie", [(6, False), (12, False), (6, True), (1, True)],
                         ids=["gqa-untied", "mha-untied", "gqa-tied", "mqa-tied"])
def test_logits_and_loss_match_transformers(n_kv_head, tie):
    hf, ours = make_pair(n_kv_head, tie)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tie
    idx = random_idx()
    with torch.no_grad():
        ref = hf(idx, labels=idx)
        logits = ours(idx)
        loss = ours(idx, shift_left(idx))
    assert logits.shape == (3, 17, 257)
    torch.testing.assert_close(logits, ref.logits, **TOL)
    torch.testing.assert_close(loss, ref.loss, **TOL)


def test_ignored_targets_match_transformers_and_the_mean_by_hand():
    hf, ours = make_pair()
    idx = random_idx()
    labels = idx.clone()
    labels[0, 3:9] = -100
    labels[2, 10] = -100
    with torch.no_grad():
        ref = hf(idx, labels=labels).loss
        got = ours(idx, shift_left(labels))
        full = ours(idx, shift_left(idx))
        logp = F.log_softmax(ours(idx), dim=-1)[:, :-1]
        keep = labels[:, 1:] != -100
        by_hand = -logp.gather(-1, idx[:, 1:, None]).squeeze(-1)[keep].mean()  # 3*16 - 7 = 41 tokens
    assert keep.sum().item() == 41
    torch.testing.assert_close(got, ref, **TOL)
    torch.testing.assert_close(got, by_hand, **TOL)
    assert abs(got.item() - full.item()) > 1e-4


def test_gradients_match_transformers():
    hf, ours = make_pair(tie=True)
    idx = random_idx()
    targets = shift_left(idx)
    targets[1, :4] = -100
    F.cross_entropy(hf(idx).logits.reshape(-1, 257), targets.reshape(-1)).backward()
    ours(idx, targets).backward()
    names = [n for n, _ in ours.named_parameters()]
    assert len(names) == 1 + 9 * 2 + 1  # embed_tokens (= lm_head), 9 per layer, norm
    for name, p in ours.named_parameters():
        ref = hf.get_parameter(name).grad
        assert p.grad.abs().max() > 0, name
        torch.testing.assert_close(p.grad, ref, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_hf_state_dict_round_trips_into_fresh_transformers_model(tie):
    torch.manual_seed(5)
    ours = Llama(LlamaConfig.from_name("llama-tiny", tie_embeddings=tie)).eval()
    torch.manual_seed(6)
    hf = transformers.LlamaForCausalLM(hf_config(tie=tie)).eval()
    sd = ours.hf_state_dict()
    assert torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"]) == tie
    result = hf.load_state_dict(sd, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    idx = random_idx()
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx), **TOL)


def test_load_accepts_tied_checkpoint_without_lm_head_rope_buffers_and_bare_model_keys():
    hf, _ = make_pair(tie=True)
    sd = {k.removeprefix("model."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # LlamaModel
    sd["layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # Llama 2 era checkpoints carry these
    sd["rotary_emb.inv_freq"] = torch.ones(4)
    ours = Llama(LlamaConfig.from_name("llama-tiny", tie_embeddings=True))
    ours.load_hf_state_dict(sd)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    torch.testing.assert_close(ours.lm_head.weight, hf.lm_head.weight, rtol=0, atol=0)


def test_load_reports_missing_unexpected_and_misshaped_keys_at_once():
    hf, _ = make_pair(n_kv_head=12)  # MHA checkpoint into a GQA model: k/v projections twice too tall
    sd = dict(hf.state_dict())
    del sd["model.layers.1.post_attention_layernorm.weight"]
    sd["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(96)
    ours = Llama(LlamaConfig.from_name("llama-tiny"))
    before = ours.model.embed_tokens.weight.clone()
    with pytest.raises(ValueError) as err:
        ours.load_hf_state_dict(sd)
    msg = str(err.value)
    assert "missing keys: ['model.layers.1.post_attention_layernorm.weight']" in msg
    assert "unexpected keys: ['model.layers.0.self_attn.q_proj.bias']" in msg
    assert "model.layers.0.self_attn.k_proj.weight: expected (48, 96), got (96, 96)" in msg
    assert "model.layers.1.self_attn.v_proj.weight: expected (48, 96), got (96, 96)" in msg
    assert torch.equal(ours.model.embed_tokens.weight, before)  # nothing copied when anything is wrong


def test_load_tied_and_untied_mismatches():
    untied_sd = dict(make_pair(tie=False)[0].state_dict())
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
        Llama(LlamaConfig.from_name("llama-tiny", tie_embeddings=True)).load_hf_state_dict(untied_sd)
    del untied_sd["lm_head.weight"]
    with pytest.raises(ValueError, match=r"missing keys: \['lm_head.weight'\][\s\S]*use tie_embeddings=True"):
        Llama(LlamaConfig.from_name("llama-tiny")).load_hf_state_dict(untied_sd)


def test_load_after_meta_to_empty_reties_lm_head_and_matches_transformers():
    hf, _ = make_pair(tie=True)
    with torch.device("meta"):
        ours = Llama(LlamaConfig.from_hf(hf.config))
    ours.to_empty(device="cpu")
    ours.eval().load_hf_state_dict(hf.state_dict())  # no init_weights in between
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    idx = random_idx()
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, **TOL)


# ---- RoPE ----------------------------------------------------------------------------------------------------------

def test_rope_equals_transformers_rotary_embedding():
    cfg = hf_config(rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    x = torch.randn(2, 3, 20, 8)
    pos = torch.arange(20)[None]
    cos_ref, sin_ref = hf_llama.LlamaRotaryEmbedding(cfg)(x, pos)
    cos, sin = rope_cache(20, 8, 500000.0)
    torch.testing.assert_close(cos, cos_ref[0], rtol=0, atol=0)
    torch.testing.assert_close(sin, sin_ref[0], rtol=0, atol=0)
    ref, _ = hf_llama.apply_rotary_pos_emb(x, x, cos_ref, sin_ref)
    torch.testing.assert_close(apply_rope(x, cos, sin), ref, rtol=0, atol=0)


def test_rope_with_explicit_positions_equals_the_full_sequence_sliced():
    T, hs, theta = 16, 8, 10000.0
    x = torch.randn(2, 3, T, hs, dtype=torch.float64)
    cos, sin = rope_cache(T, hs, theta)
    full = apply_rope(x, cos, sin)
    zigzag = torch.tensor([2, 3, 12, 13])  # rank 1 of a ring of 4: chunks 1 and 6 of 8
    chunk = x[:, :, zigzag]
    assert torch.equal(apply_rope(chunk, cos, sin, zigzag), full[:, :, zigzag])  # gather from a full cache
    assert torch.equal(apply_rope(chunk, *rope_cache(zigzag, hs, theta)), full[:, :, zigzag])  # cache per position
    per_batch = torch.stack([zigzag, zigzag + 1])  # (B, T) positions, one row per sequence
    rows = torch.stack([x[0, :, zigzag], x[1, :, zigzag + 1]])
    assert torch.equal(apply_rope(rows, cos, sin, per_batch), torch.stack([full[0, :, zigzag], full[1, :, zigzag + 1]]))
    assert torch.equal(apply_rope(x[:, :, :5], cos, sin), full[:, :, :5])  # a longer cache serves a prefix
    # Scores depend on the position difference only: shifting q and k positions together changes nothing.
    q, k = x[0, 0, :1], x[0, 1, :1]
    c, s = rope_cache(64, hs, theta)
    scores = [(apply_rope(q, c, s, torch.tensor([a + 3])) @ apply_rope(k, c, s, torch.tensor([a])).T).item()
              for a in (0, 10, 40)]
    assert max(scores) - min(scores) < 1e-5  # cos/sin are float32, as in transformers


def test_attention_with_default_positions_equals_explicit_arange():
    torch.manual_seed(0)
    attn = LlamaAttention(LlamaConfig.from_name("llama-tiny"))
    x = torch.randn(2, 10, 96)
    torch.testing.assert_close(attn(x), attn(x, torch.arange(10)), rtol=0, atol=0)
    torch.testing.assert_close(attn(x), attn(x, torch.arange(10).expand(2, 10)), rtol=0, atol=0)


# ---- input checks and config ---------------------------------------------------------------------------------------

def test_check_input_takes_sequences_past_block_size_and_rejects_out_of_vocab_ids():
    model = Llama(LlamaConfig.from_name("llama-tiny"))
    assert model(torch.zeros(2, 65, dtype=torch.long)).shape == (2, 65, 257)  # RoPE: block_size is no limit
    idx = torch.zeros(2, 8, dtype=torch.long)
    idx[1, 3] = 257
    with pytest.raises(ValueError, match=r"in \[0, 257\) for vocab_size 257, got min 0 max 257"):
        model(idx)
    bad = torch.zeros_like(idx)
    bad[0, 0] = -5
    with pytest.raises(ValueError, match="got 1 outside, min -5 max -5"):
        model(torch.zeros_like(idx), bad)
    assert model(torch.zeros(2, 64, dtype=torch.long)).shape == (2, 64, 257)


@pytest.mark.parametrize("overrides, message", [
    (dict(n_embd=100), "n_embd=100 is not divisible by n_head=12; n_embd % n_head = 4"),
    (dict(n_kv_head=5), "n_head=12 is not divisible by n_kv_head=5; n_head % n_kv_head = 2"),
    (dict(n_kv_head=24), "n_head=12 is not divisible by n_kv_head=24"),
    (dict(n_embd=36, n_head=12, n_kv_head=4), r"head_size = n_embd // n_head = 36 // 12 = 3 is odd"),
    (dict(n_layer=0), "LlamaConfig.n_layer must be a positive int, got 0"),
    (dict(intermediate_size=-1), "LlamaConfig.intermediate_size must be a positive int, got -1"),
    (dict(rope_theta=0.0), "LlamaConfig.rope_theta must be a positive number, got 0.0"),
    (dict(norm_eps=-1e-5), "LlamaConfig.norm_eps must be a positive number"),
    (dict(dropout=1.0), r"dropout must be in \[0, 1\), got 1.0"),
])
def test_config_errors_name_the_numbers(overrides, message):
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_name("llama-tiny", **overrides)


def test_from_hf_refuses_unimplemented_variants_in_one_error():
    cfg = hf_config(hidden_act="gelu", attention_bias=True, mlp_bias=True, rope_parameters={
        "rope_type": "linear", "rope_theta": 500000.0, "factor": 32.0})
    with pytest.raises(ValueError) as err:
        LlamaConfig.from_hf(cfg)
    msg = str(err.value)
    for part in ("hidden_act='gelu'", "attention_bias=True", "mlp_bias=True", "rope_type='linear'",
                 "supported: 'default', 'llama3'"):
        assert part in msg
    theta = LlamaConfig.from_hf(hf_config(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}))
    assert theta.rope_theta == 500000.0


@pytest.mark.parametrize("name, params", [("llama-3.2-1b", 1_235_814_400), ("llama-3.2-3b", 3_212_749_824),
                                          ("llama-3.1-8b", 8_030_261_248), ("llama-2-7b", 6_738_415_616),
                                          ("llama-3.1-70b", 70_553_706_496), ("llama-3.1-405b", 405_853_388_800)])
def test_named_real_shapes_have_the_published_parameter_counts(name, params):
    with torch.device("meta"):
        model = Llama(LlamaConfig.from_name(name))
    assert model.num_parameters() == params


def test_from_name_overrides_and_unknown_name_lists_valid_names():
    cfg = LlamaConfig.from_name("llama-3.2-1b", block_size=1024)
    assert (cfg.n_kv_head, cfg.kv_groups, cfg.head_size, cfg.rope_theta, cfg.block_size) == (8, 4, 64, 5e5, 1024)
    assert cfg.tie_embeddings and not LlamaConfig.from_name("llama-3.1-8b").tie_embeddings
    with pytest.raises(ValueError) as err:
        LlamaConfig.from_name("llama-70b")
    for name in ("llama-tiny", "llama-mini", "llama-2-7b", "llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b",
                 "llama-3.1-70b", "llama-3.1-405b"):
        assert f"'{name}'" in str(err.value)


# ---- init ----------------------------------------------------------------------------------------------------------

def test_init_is_normal_002_with_unit_norms_and_tying_as_configured():
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_name("llama-mini"))
    assert isinstance(model.lm_head, LMHead) and model.lm_head.weight is not model.model.embed_tokens.weight
    mlp = torch.cat([p.flatten() for n, p in model.named_parameters() if ".mlp." in n])  # ~1.2M draws
    assert abs(mlp.std().item() / 0.02 - 1) < 0.02 and abs(mlp.mean().item()) < 1e-4
    assert abs(model.lm_head.weight.std().item() / 0.02 - 1) < 0.05
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert all(torch.all(p == 1) for n, p in model.named_parameters() if n.endswith("norm.weight"))
    tied = Llama(LlamaConfig.from_name("llama-tiny", tie_embeddings=True))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_meta_build_materialised_module_by_module_equals_eager_build(tie):
    """What parallel plans do (parallelize's _materialiser: to_empty + init_module_ per swapped module, in
    named_modules() order), and meta + to_empty + init_weights, both equal an eager build with the same seed."""
    cfg = LlamaConfig.from_name("llama-tiny", tie_embeddings=tie)
    torch.manual_seed(3)
    eager = Llama(cfg).state_dict()

    with torch.device("meta"):
        lazy = Llama(cfg)
    lazy.to_empty(device="cpu")
    torch.manual_seed(3)
    lazy.init_weights()
    assert (lazy.lm_head.weight is lazy.model.embed_tokens.weight) == tie  # init_weights re-tied it

    with torch.device("meta"):
        piecewise = Llama(cfg)
    assert piecewise.model.embed_tokens.weight.is_meta
    materialise = _materialiser(piecewise)
    torch.manual_seed(3)
    m = piecewise.model
    m.embed_tokens = materialise("model.embed_tokens", m.embed_tokens)
    for i, layer in enumerate(m.layers):
        for part in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
            setattr(layer, part, materialise(f"model.layers.{i}.{part}", getattr(layer, part)))
    m.norm = materialise("model.norm", m.norm)
    if tie:
        piecewise.tie_weights()
    else:
        piecewise.lm_head = materialise("lm_head", piecewise.lm_head)

    for other in (lazy.state_dict(), piecewise.state_dict()):
        assert list(other) == list(eager)
        for k in eager:
            assert torch.equal(eager[k], other[k]), k


def test_attention_dropout_is_active_in_train_and_off_in_eval():
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_name("llama-tiny", dropout=0.5))
    idx = random_idx(T=16)
    model.train()
    assert (model(idx) - model(idx)).abs().max() > 1e-4
    model.eval()
    assert torch.equal(model(idx), model(idx))
