"""``pad_vocab_multiple``: the LM head's product over a GPU-shaped vocabulary (issue 48, part 4). The padded logits
are masked out of the loss and never returned, so the padded model is the unpadded one: the same loss, gradients
and logits, plain and parallel; its parameters (and so its checkpoints and exports) keep ``vocab_size`` rows."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import lightning_tp2d as tp
from lightning_tp2d.models.gpt2 import GPT2, GPT2Config, lm_head, padded_rows
from lightning_tp2d.models.llama import Llama, LlamaConfig
from tests.distributed import run_distributed

MULTIPLE = 64  # the tiny models' 257 ids: 320 on one rank, blocks of 129 -> 192 rows on a 2x2 grid


def _batch(vocab: int, batch: int = 4, seq: int = 16):
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, vocab, (batch, seq), generator=g)
    targets = torch.randint(0, vocab, (batch, seq), generator=g)
    targets[0, :3] = -100
    targets[1, 0] = vocab - 1  # the last id: the last block's last real column
    return idx, targets


def _model(family: str, pad: int, dtype=torch.float64):
    torch.manual_seed(0)
    if family == "gpt2":
        return GPT2(GPT2Config.from_name("gpt2-tiny", pad_vocab_multiple=pad)).to(dtype)
    return Llama(LlamaConfig.from_name("llama-tiny", pad_vocab_multiple=pad, tie_embeddings=family == "llama-tied")
                 ).to(dtype)


def _loss_grads_logits(model, idx, targets):
    loss = model(idx, targets)
    loss.backward()
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) for n, p in
             model.named_parameters()}
    with torch.no_grad():
        logits = model(idx)
    return loss.detach(), grads, logits


def test_padded_rows_rounds_up():
    assert [padded_rows(n, 128) for n in (50257, 50304, 128256, 1)] == [50304, 50304, 128256, 128]
    assert padded_rows(129, 1) == 129


@pytest.mark.parametrize("family", ["gpt2", "llama", "llama-tied"])
def test_padded_plain_model_is_the_unpadded_model(family):
    idx, targets = _batch(257)
    plain, padded = _model(family, 1), _model(family, MULTIPLE)
    assert padded.lm_head.pad_multiple == MULTIPLE
    assert all(p.shape[0] == 257 for n, p in padded.named_parameters() if "wte" in n or "embed" in n or "lm_head" in n)
    loss0, grads0, logits0 = _loss_grads_logits(plain, idx, targets)
    loss1, grads1, logits1 = _loss_grads_logits(padded, idx, targets)
    torch.testing.assert_close(loss1, loss0, rtol=1e-12, atol=0)
    assert logits1.shape == logits0.shape == (4, 16, 257)
    torch.testing.assert_close(logits1, logits0, rtol=1e-12, atol=1e-12)
    assert grads1.keys() == grads0.keys()
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-10, atol=1e-12, msg=name)
    assert padded.state_dict().keys() == plain.state_dict().keys()
    assert all(padded.state_dict()[k].shape == v.shape for k, v in plain.state_dict().items())


def test_padded_head_under_bf16_autocast_takes_one_cast_and_matches():
    weight = torch.randn(257, 48, requires_grad=True)
    x = torch.randn(2, 8, 48)
    targets = torch.randint(0, 257, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss0 = lm_head(x, weight, targets)
        loss1 = lm_head(x, weight, targets, pad_multiple=128)
        logits = lm_head(x, weight, pad_multiple=128)
    assert logits.shape == (2, 8, 257) and logits.dtype == torch.bfloat16
    g0, = torch.autograd.grad(loss0, weight)
    g1, = torch.autograd.grad(loss1, weight)
    assert g1.dtype == torch.float32 and g1.shape == weight.shape
    torch.testing.assert_close(loss1, loss0)
    torch.testing.assert_close(g1, g0)


def _parallel(rank: int, world: int, family: str, layout: str) -> dict:
    idx, targets = _batch(257)
    plain = _model(family, 1)
    par = tp.parallelize(_model(family, MULTIPLE), tp.init_mesh(layout, world, 1), layout=layout)
    head = par.lm_head
    out = {"pad": head.pad_multiple, "block_rows": head.block_rows, "vocab_rows": head.vocab_rows}
    loss0, grads0, logits0 = _loss_grads_logits(plain, idx, targets)
    loss1, grads1, logits1 = _loss_grads_logits(par, idx, targets)
    out["loss"] = (loss1 - loss0).abs().item() / loss0.abs().item()
    out["logits_shape"] = tuple(logits1.shape)
    out["logits"] = (logits1 - logits0).abs().max().item()
    out["grads"] = max((grads1[n] - g).abs().max().item() / g.abs().max().clamp_min(1e-30).item()
                       for n, g in grads0.items())
    out["rows"] = {n: tuple(p.shape) for n, p in par.named_parameters() if p.shape[0] == 257}
    return out


@pytest.mark.parametrize("family,layout", [("gpt2", "2d"), ("gpt2", "2d-metp"), ("llama", "2d")])
def test_padded_vocab_blocks_on_a_grid_give_the_unpadded_loss_gradients_and_logits(family, layout):
    for out in run_distributed(_parallel, 4, family, layout):
        assert out["pad"] == MULTIPLE and (out["vocab_rows"], out["block_rows"]) == (129, 192)  # ceil(257 / 2) ids
        assert out["loss"] <= 1e-12
        assert out["logits_shape"] == (4, 16, 257)
        assert out["logits"] <= 1e-10
        assert out["grads"] <= 1e-10
        assert out["rows"]  # the embedding (and an untied head) keep 257 rows: parameters are not padded


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_padded_vocab_blocks_on_a_ring_give_the_unpadded_loss_gradients_and_logits(family):
    for out in run_distributed(_parallel, 4, family, "metp"):
        assert out["pad"] == MULTIPLE and (out["vocab_rows"], out["block_rows"]) == (65, 128)  # ceil(257 / 4) ids
        assert out["loss"] <= 1e-12
        assert out["logits_shape"] == (4, 16, 257)
        assert out["logits"] <= 1e-10
        assert out["grads"] <= 1e-10


def test_one_rank_layouts_pad_the_plain_head():
    out = run_distributed(_parallel, 1, "gpt2", "metp")[0]
    assert out["pad"] == MULTIPLE
    assert out["loss"] <= 1e-12 and out["grads"] <= 1e-10 and out["logits_shape"] == (4, 16, 257)


def test_pad_vocab_multiple_must_be_a_positive_int():
    with pytest.raises(ValueError, match="pad_vocab_multiple"):
        GPT2Config.from_name("gpt2-tiny", pad_vocab_multiple=0)
    with pytest.raises(ValueError, match="pad_vocab_multiple"):
        dataclasses.replace(LlamaConfig.from_name("llama-tiny"), pad_vocab_multiple=-128)
