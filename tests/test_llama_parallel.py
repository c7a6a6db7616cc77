"""Llama in the "2d" layout against the plain Llama (gloo, CPU), and the model-family registry.

As tests/test_parallel_2d.py for GPT-2: every rank builds the same plain model from one seed, deep-copies and
parallelizes it, and feeds both the same batch; loss, gathered logits, every gradient and the parameters after one
AdamW step must match. Covers GQA (llama-tiny: 12 query heads, 6 key/value heads), multi-head attention, tied and
untied heads, 2x2 and 3x3 grids, meta-device materialisation, and the named-number refusals.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import lightning_tp2d as tp
from lightning_tp2d.families import ModelFamily, family_of, get_family, register_family, unregister_family
from lightning_tp2d.layouts import get_layout
from lightning_tp2d.models import GPT2, GPT2Config, Llama, LlamaConfig
from tests.distributed import run_distributed


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _batch(vocab: int, batch: int, seq: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (batch, seq), generator=g)
    targets = torch.randint(0, vocab, (batch, seq), generator=g)
    targets[0, :3] = -100
    return idx, targets


def _parity(rank, world_size, dtype, overrides, meta):
    q = int(round(world_size ** 0.5))
    cfg = LlamaConfig.from_name("llama-tiny", **overrides)
    torch.manual_seed(0)
    plain = Llama(cfg).to(dtype)
    if meta:  # a meta build materialised by parallelize from the same seed
        with torch.device("meta"):
            par = Llama(cfg)
        torch.manual_seed(0)
    else:
        par = copy.deepcopy(plain)
    mesh = tp.init_mesh("2d", world_size, 1)
    tp.parallelize(par, mesh, layout="2d")
    if meta:
        par.to(dtype)
    idx, targets = _batch(cfg.vocab_size, batch=2 * q, seq=12)

    out = {"names": [n for n, _ in par.named_parameters()] == [n for n, _ in plain.named_parameters()],
           "n_params": len(list(par.parameters())) == len(list(plain.parameters())),
           "init": max(_rel(p.full_tensor(), p0) for p, p0 in zip(par.parameters(), plain.parameters()))}
    loss0, loss1 = plain(idx, targets), par(idx, targets)
    loss0.backward()
    loss1.backward()
    out["loss"] = (loss0.item(), loss1.item())
    with torch.no_grad():
        logits = par(idx)
        out["logits_shape"] = tuple(logits.shape)
        out["logits"] = _rel(logits, plain(idx))
    out["grads"] = {n: _rel(p.grad.full_tensor(), p0.grad)
                    for (n, p), p0 in zip(par.named_parameters(), plain.parameters())}
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    for model in (plain, par):
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1).step()
    full, ref = tp.full_state_dict(par), plain.state_dict()
    out["keys"] = list(full) == list(ref)
    out["step"] = max(((full[k] - ref[k]).norm() / (ref[k] - before[k]).norm().clamp_min(1e-30)).item()
                      for k in ref)
    out["tied"] = par.lm_head.weight is par.model.embed_tokens.weight
    return out


@pytest.mark.parametrize("world_size, dtype, overrides, meta, tol", [
    (4, torch.float64, {}, False, 1e-10),  # GQA (12 / 6 heads), untied head
    (4, torch.float64, {"n_kv_head": 12, "tie_embeddings": True}, True, 1e-10),  # MHA, tied head, meta build
    (9, torch.float32, {"n_kv_head": 3, "tie_embeddings": False}, False, 1e-4),  # 3x3, g = 4
], ids=["2x2-gqa-untied-f64", "2x2-mha-tied-meta-f64", "3x3-gqa-untied-f32"])
def test_llama_2d_matches_plain_model(world_size, dtype, overrides, meta, tol):
    results = run_distributed(_parity, world_size, dtype, overrides, meta)
    tied = overrides.get("tie_embeddings", False)
    for out in results:
        assert out["names"] and out["n_params"] and out["keys"]
        assert out["tied"] == tied
        assert out["init"] == 0.0
        loss0, loss1 = out["loss"]
        assert abs(loss1 - loss0) <= tol * abs(loss0)
        assert out["logits_shape"] == (2 * int(round(world_size ** 0.5)), 12, 257)
        assert out["logits"] <= tol
        assert len(out["grads"]) == (20 if tied else 21)
        bad = {n: r for n, r in out["grads"].items() if not r <= tol}
        assert not bad, bad
        assert out["step"] <= 10 * tol


def test_llama_sizes_that_do_not_split_are_refused_naming_the_numbers():
    fam, grid = get_family("llama"), get_layout("2d")
    cfg = LlamaConfig.from_name("llama-tiny", n_head=6, n_kv_head=3, n_embd=48)  # hs 8; 3 kv heads on q = 2
    with pytest.raises(ValueError, match=r"layout '2d': n_kv_head=3 is not divisible by q=2; use q in \[1, 3\]"):
        fam.check_model(grid, 4, cfg)
    cfg = LlamaConfig.from_name("llama-tiny", intermediate_size=250)
    with pytest.raises(ValueError, match=r"intermediate_size=250 is not divisible by q=3; use q in \[1, 2\]"):
        fam.check_model(grid, 9, cfg)
    fam.check_model(grid, 4, LlamaConfig.from_name("llama-tiny"))  # fits
    assert fam.fits(grid, 9, LlamaConfig.from_name("llama-tiny"))
    assert not fam.fits(grid, 16, LlamaConfig.from_name("llama-tiny"))  # 6 kv heads on q = 4


def _refusals(rank, world_size):
    mesh = tp.init_mesh("2d", world_size, 1)
    out = {}
    bad = Llama(LlamaConfig.from_name("llama-tiny", n_head=6, n_kv_head=3, n_embd=48))
    for name, call in (("kv", lambda: tp.parallelize(bad, mesh, "2d")),
                       ("metp", lambda: tp.parallelize(Llama(LlamaConfig.from_name("llama-tiny")),
                                                       tp.init_mesh("metp", world_size, 1), "metp"))):
        try:
            call()
            out[name] = None
        except ValueError as err:
            out[name] = str(err)
    out["untouched"] = type(bad.model.layers[0].self_attn).__name__
    return out


def test_llama_parallelize_refusals_come_before_any_change():
    for out in run_distributed(_refusals, 4):
        assert "n_kv_head=3 is not divisible by q=2" in out["kv"]
        assert "model family 'llama' has no plan for layout 'metp' yet" in out["metp"]
        assert out["untouched"] == "LlamaAttention"


# ---- a user's own family -------------------------------------------------------------------------------------


class _CountingMLP(nn.Module):
    """A user's parallel MLP for GPT-2 blocks: GPT-2's MLP2D, counting its calls."""

    calls = 0

    def __init__(self, mlp, mesh, *, options=None):
        super().__init__()
        from lightning_tp2d.nn import MLP2D

        self.inner = MLP2D(mlp, mesh, options=options)

    def forward(self, x):
        type(self).calls += 1
        return self.inner(x)


class MyGPT(GPT2):
    """A user's model class (here a GPT-2 subclass, so its plan reuses GPT-2's parallel modules)."""


def _my_family() -> ModelFamily:
    gpt2 = get_family("gpt2")

    def plan_2d(layout):
        return {**layout.plan(), "mlp": _CountingMLP}

    return ModelFamily(name="mygpt", model_class=MyGPT, config_class=GPT2Config, module_roles=gpt2.module_roles,
                       plans={"2d": plan_2d}, blocks="transformer.h", tied=gpt2.tied)


def _user_family(rank, world_size):
    register_family(_my_family(), override=True)  # in the forked rank (the registry is per process)
    torch.manual_seed(0)
    plain = GPT2(GPT2Config.from_name("gpt2-tiny", dropout=0.0))
    mine = MyGPT(plain.config)
    mine.load_state_dict(plain.state_dict())
    tp.parallelize(mine, tp.init_mesh("2d", world_size, 1), "2d")
    idx, targets = _batch(plain.config.vocab_size, 4, 8)
    loss0, loss1 = plain(idx, targets).item(), mine(idx, targets).item()
    return {"loss": (loss0, loss1), "calls": _CountingMLP.calls, "mlp": type(mine.transformer.h[0].mlp).__name__,
            "family": family_of(mine).name}


def test_a_registered_user_family_is_parallelized_with_its_own_plan():
    fam = register_family(_my_family())
    try:
        assert family_of(MyGPT(GPT2Config.from_name("gpt2-tiny"))) is fam  # the most derived class wins
        assert family_of(GPT2(GPT2Config.from_name("gpt2-tiny"))).name == "gpt2"
        with pytest.raises(ValueError, match="already registered"):
            register_family(_my_family())
    finally:
        unregister_family("mygpt")
    for out in run_distributed(_user_family, 4):
        assert out["family"] == "mygpt" and out["mlp"] == "_CountingMLP"
        assert out["calls"] == GPT2Config.from_name("gpt2-tiny").n_layer
        assert abs(out["loss"][0] - out["loss"][1]) <= 1e-5 * out["loss"][0]
