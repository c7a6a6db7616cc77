"""Llama in the "2d" and "metp" layouts against the plain Llama (gloo, CPU), and the model-family registry.

As tests/test_parallel_2d.py for GPT-2: every rank builds the same plain model from one seed, deep-copies and
parallelizes it, and feeds both the same batch; loss, gathered logits, every gradient and the parameters after one
AdamW step must match. Covers GQA (llama-tiny: 12 query heads, 6 key/value heads), multi-head attention, tied and
untied heads, 2x2 and 3x3 grids, meta-device materialisation, and the named-number refusals; "metp" on rings of 2
and 4 (GQA with g = 2 and 4, multi-head attention, tied and untied heads) in float64.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
import torch.nn as nn

import lightning_tp2d as tp
from lightning_tp2d.families import ModelFamily, family_of, fits, get_family, register_family, unregister_family
from lightning_tp2d.layouts import get_layout
from lightning_tp2d.models import GPT2, GPT2Config, Llama, LlamaConfig
from lightning_tp2d.data import ByteTokenizer
from tests.distributed import run_distributed


# Llama 3.1's RoPE scaling from a pre-training context of 8 (llama-tiny: hs 8, wavelengths 6.3, 63, 628, 6283):
# one frequency interpolated, three divided by 8, over the test's 12-16 (zigzag, absolute) positions.
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _batch(vocab: int, batch: int, seq: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (batch, seq), generator=g)
    targets = torch.randint(0, vocab, (batch, seq), generator=g)
    targets[0, :3] = -100
    return idx, targets


def _compare(plain, par, idx, targets, out: dict) -> dict:
    """Loss, gathered logits, every gradient and one AdamW step of ``par`` against ``plain`` (added to ``out``)."""
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
    return _compare(plain, par, idx, targets, out)


@pytest.mark.parametrize("world_size, dtype, overrides, meta, tol", [
    (4, torch.float64, {}, False, 1e-10),  # GQA (12 / 6 heads), untied head
    (4, torch.float64, {"n_kv_head": 12, "tie_embeddings": True, "rope_scaling": LLAMA3},
     True, 1e-10),  # MHA, tied head, meta build, Llama 3.1's RoPE scaling
    (9, torch.float32, {"n_kv_head": 3, "tie_embeddings": False}, False, 1e-4),  # 3x3, g = 4
], ids=["2x2-gqa-untied-f64", "2x2-mha-tied-meta-llama3-f64", "3x3-gqa-untied-f32"])
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


def _metp_parity(rank, world_size, dtype, overrides, layout="metp"):
    cfg = LlamaConfig.from_name("llama-tiny", **overrides)
    torch.manual_seed(0)
    plain = Llama(cfg).to(dtype)
    par = copy.deepcopy(plain)
    mesh = tp.init_mesh(layout, world_size, 1)
    tp.parallelize(par, mesh, layout=layout)
    idx, targets = _batch(cfg.vocab_size, batch=2, seq=16)  # 16: divisible by 2p for p = 2, 4 (2q for q = 2)

    out = {"names": [n for n, _ in par.named_parameters()] == [n for n, _ in plain.named_parameters()],
           "init": max(_rel(p.full_tensor(), p0) for p, p0 in zip(par.parameters(), plain.parameters())),
           "placements": {n.rsplit(".", 2)[-2]: str(p.placements[1]) for n, p in par.named_parameters()
                          if n.startswith("model.layers.0.") or not n.startswith("model.layers.")},
           "attn": type(par.model.layers[0].self_attn).__name__, "head": type(par.lm_head).__name__}
    return _compare(plain, par, idx, targets, out)


def _assert_ring_parity(out: dict, tol: float, tied: bool) -> None:
    loss0, loss1 = out["loss"]
    assert abs(loss1 - loss0) <= tol * abs(loss0)
    assert out["logits_shape"] == (2, 16, 257)
    assert out["logits"] <= tol
    assert len(out["grads"]) == (20 if tied else 21)
    bad = {n: r for n, r in out["grads"].items() if not r <= tol}
    assert not bad, bad
    assert out["step"] <= 10 * tol


@pytest.mark.parametrize("world_size, overrides", [
    (2, {}),  # GQA (12 / 6 heads, g = 2), untied head
    (4, {"n_kv_head": 3, "tie_embeddings": True}),  # GQA g = 4 (24 k/v rows: 6 per rank), tied head
    (2, {"n_kv_head": 12, "tie_embeddings": True, "rope_scaling": LLAMA3}),  # MHA, tied head, scaled RoPE
], ids=["ring2-gqa-untied", "ring4-gqa4-tied", "ring2-mha-tied-llama3"])
def test_llama_metp_matches_plain_model(world_size, overrides):
    tol = 1e-10  # float64
    tied = overrides.get("tie_embeddings", False)
    for out in run_distributed(_metp_parity, world_size, torch.float64, overrides):
        assert out["names"] and out["keys"]
        assert out["attn"] == "RingLlamaAttention"
        assert out["head"] == ("RingLMHead" if tied else "UntiedRingLMHead")
        assert out["tied"] == tied
        assert out["init"] == 0.0
        place = out["placements"]
        assert place["q_proj"] == place["k_proj"] == place["v_proj"] == place["gate_proj"] == "S(0)"
        assert place["o_proj"] == place["down_proj"] == "S(1)"
        assert place["input_layernorm"] == place["norm"] == "R"
        assert place["embed_tokens"] == "S(0)"
        assert tied or place["lm_head"] == "S(0)"
        _assert_ring_parity(out, tol, tied)


@pytest.mark.parametrize("overrides", [{}, {"n_kv_head": 12, "tie_embeddings": True, "rope_scaling": LLAMA3}],
                         ids=["2x2-gqa-untied", "2x2-mha-tied-llama3"])
def test_llama_2d_metp_matches_plain_model(overrides):
    tol = 1e-10  # float64
    tied = overrides.get("tie_embeddings", False)
    for out in run_distributed(_metp_parity, 4, torch.float64, overrides, "2d-metp"):
        assert out["names"] and out["keys"] and out["tied"] == tied
        assert out["attn"] == "LlamaAttention2DMetp"
        assert out["head"] == ("LMHead2DMetp" if tied else "UntiedLMHead2DMetp")
        assert out["init"] == 0.0
        _assert_ring_parity(out, tol, tied)


def test_llama_metp_sizes_that_do_not_split_are_refused_naming_the_numbers():
    fam, ring = get_family("llama"), get_layout("metp")
    cfg = LlamaConfig.from_name("llama-tiny", n_kv_head=1, intermediate_size=250)  # 8 k/v rows
    with pytest.raises(ValueError, match=r"layout 'metp': intermediate_size=250 is not divisible by p=4; "
                                         r"use p in \[1, 2\]"):
        fam.check_model(ring, 4, cfg)
    with pytest.raises(ValueError, match=r"layout 'metp': n_kv_head\*head_size=8 is not divisible by p=16; "
                                         r"intermediate_size=264 is not divisible by p=16; use p in \[1, 2, 4, 8\]"):
        fam.check_model(ring, 16, LlamaConfig.from_name("llama-tiny", n_kv_head=1))
    fam.check_model(ring, 4, LlamaConfig.from_name("llama-tiny", n_head=6, n_kv_head=3, n_embd=48))  # heads: any
    assert fits(ring, 4, LlamaConfig.from_name("llama-tiny"))
    assert not fits(ring, 5, LlamaConfig.from_name("llama-tiny"))
    assert fam.layouts == ("2d", "metp", "2d-metp")
    without = dataclasses.replace(fam, plans={"2d": fam.plans["2d"]})  # a family lacking a plan is refused by name
    with pytest.raises(ValueError, match=r"model family 'llama' has no plan for layout 'metp' yet; "
                                         r"layouts with a plan: \['2d'\]"):
        without.plan(ring)


def test_llama_sizes_that_do_not_split_are_refused_naming_the_numbers():
    fam, grid = get_family("llama"), get_layout("2d")
    cfg = LlamaConfig.from_name("llama-tiny", n_head=6, n_kv_head=3, n_embd=48)  # hs 8; 3 kv heads on q = 2
    with pytest.raises(ValueError, match=r"layout '2d': n_kv_head=3 is not divisible by q=2; use q in \[1, 3\]"):
        fam.check_model(grid, 4, cfg)
    cfg = LlamaConfig.from_name("llama-tiny", intermediate_size=250)
    with pytest.raises(ValueError, match=r"intermediate_size=250 is not divisible by q=3; use q in \[1, 2\]"):
        fam.check_model(grid, 9, cfg)
    fam.check_model(grid, 4, LlamaConfig.from_name("llama-tiny"))  # fits
    assert fits(grid, 9, LlamaConfig.from_name("llama-tiny"))
    assert not fits(grid, 16, LlamaConfig.from_name("llama-tiny"))  # 6 kv heads on q = 4


def _refusals(rank, world_size):
    mesh = tp.init_mesh("2d", world_size, 1)
    out = {}
    bad = Llama(LlamaConfig.from_name("llama-tiny", n_head=6, n_kv_head=3, n_embd=48))
    for name, call in (("kv", lambda: tp.parallelize(bad, mesh, "2d")),
                       ("2d-metp", lambda: tp.parallelize(bad, tp.init_mesh("2d-metp", world_size, 1), "2d-metp"))):
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
        assert "layout '2d-metp': n_kv_head=3 is not divisible by q=2" in out["2d-metp"]
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
        return {**gpt2.plan(layout), "mlp": _CountingMLP}

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


# ---- checkpoints: sharded and full, resharded, on one device, exported ---------------------------------------


def _save_2x2(rank, world_size, directory):
    from pathlib import Path

    import torch.distributed as dist

    from lightning_tp2d import checkpoint as ckpt

    cfg = LlamaConfig.from_name("llama-tiny")  # GQA, untied
    torch.manual_seed(0)
    module = nn.Module()
    module.model = Llama(cfg)
    tp.parallelize(module.model, tp.init_mesh("2d", world_size, 1), "2d")
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    idx, targets = _batch(cfg.vocab_size, 4, 12)
    module.model(idx, targets).backward()
    optimizer.step()
    info = {"tp2d": {"llama_configs": {"model": vars(cfg)}}, "global_step": 1}
    barrier = lambda name: dist.barrier()  # noqa: E731
    ckpt.save({**info, "state_dict": module.state_dict(keep_vars=True),
               "optimizer_states": [ckpt.sharded_optimizer_state(module, optimizer)]},
              Path(directory) / "sharded.ckpt", rank=rank, sharded=True, barrier=barrier)
    ckpt.save({**info, "state_dict": ckpt.full_model_state(module, rank),
               "optimizer_states": [ckpt.full_optimizer_state(module, optimizer, rank)]},
              Path(directory) / "full.ckpt", rank=rank, sharded=False, barrier=barrier)
    exp_avg = optimizer.state[module.model.model.layers[1].self_attn.k_proj.weight]["exp_avg"]
    return ({k: v.numpy() for k, v in tp.full_state_dict(module).items()}, ckpt._full(exp_avg).numpy())


def _load_3x3(rank, world_size, directory, layout="2d"):
    from pathlib import Path

    from lightning_tp2d import checkpoint as ckpt

    torch.manual_seed(1)  # other weights than the saved ones
    module = nn.Module()
    module.model = Llama(LlamaConfig.from_name("llama-tiny"))
    tp.parallelize(module.model, tp.init_mesh(layout, world_size, 1), layout)
    out = {}
    for name in ("sharded.ckpt", "full.ckpt"):
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
        meta = ckpt.load_into(module, [optimizer], Path(directory) / name)
        exp_avg = optimizer.state[module.model.model.layers[1].self_attn.k_proj.weight]["exp_avg"]
        out[name] = ({k: v.numpy() for k, v in tp.full_state_dict(module).items()}, meta["global_step"],
                     ckpt._full(exp_avg).numpy())
    return out


def test_llama_checkpoints_reshard_load_on_one_device_and_export_to_transformers(tmp_path, capsys):
    import numpy as np

    from lightning_tp2d import checkpoint as ckpt

    weights, exp_avg = run_distributed(_save_2x2, 4, str(tmp_path))[0]
    assert not any(ckpt._is_qkv(k) for k in weights)  # separate q/k/v: plain boxes, no [3, n/3] view
    loaded = run_distributed(_load_3x3, 9, str(tmp_path))  # 2x2 -> 3x3 (vocab 257 in other blocks)
    loaded += run_distributed(_load_3x3, 4, str(tmp_path), "metp")  # -> a ring of 4 (another layout)
    for out in loaded:
        for name, (state, step, avg) in out.items():
            assert step == 1 and list(state) == list(weights), name
            assert all(np.array_equal(state[k], weights[k]) for k in weights), name
            assert np.array_equal(avg, exp_avg) and np.abs(avg).max() > 0, name
    for name in ("sharded.ckpt", "full.ckpt"):  # one device, no process group
        plain = Llama(LlamaConfig.from_name("llama-tiny"))
        plain.load_state_dict({k[len("model."):]: v for k, v in ckpt.read_state_dict(tmp_path / name).items()})
        assert all(np.array_equal(v.numpy(), weights["model." + k]) for k, v in plain.state_dict().items())
        loaded = tp.load_llama(tmp_path / name)  # the config recorded in the checkpoint
        assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), plain.state_dict().values()))
    from lightning_tp2d import generate

    greedy = ["--prompt", "ab", "--max-new-tokens", "3", "--temperature", "0"]
    assert generate.main([str(tmp_path / "sharded.ckpt"), *greedy]) == 0  # tp2d-generate on a Llama checkpoint
    ids = torch.tensor([list(b"ab")])
    with torch.no_grad():
        expected = tp.module.sample(plain.eval(), ids, 3, temperature=0)[0].tolist()
    assert capsys.readouterr().out.strip() == ByteTokenizer().decode(expected).strip()
    transformers = pytest.importorskip("transformers")
    out = tp.export_hf(tmp_path / "sharded.ckpt", tmp_path / "hf")
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    idx = torch.randint(0, 257, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, plain.eval()(idx), rtol=1e-5, atol=1e-5)


# ---- Lightning: the strategy finds and parallelizes a Llama --------------------------------------------------

FIT_STEPS = 8


def _fit_llama(rank, world_size, strategy):
    import lightning.pytorch as L
    from torch.utils.data import DataLoader, DistributedSampler

    from lightning_tp2d.data import ByteTokenizer, TokenWindows, load_tokens

    class LlamaModule(L.LightningModule):
        """What a user writes: a Llama and a training step, no parallel code."""

        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.llama = Llama(LlamaConfig.from_name("llama-tiny"))

        def training_step(self, batch, batch_idx):
            loss = self.llama(*batch)
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    class Losses(L.Callback):
        def __init__(self):
            self.losses = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(trainer.callback_metrics["train_loss"].item())

    losses = Losses()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[losses], max_steps=FIT_STEPS)
    windows = TokenWindows(load_tokens(None, ByteTokenizer(), 20_000), block_size=32)
    if strategy == "auto":  # the order Lightning's distributed sampler gives a training set: shuffled, seed 0
        loader = DataLoader(windows, batch_size=4, sampler=DistributedSampler(windows, 1, 0, shuffle=True, seed=0))
    else:
        loader = DataLoader(windows, batch_size=4)
    module = LlamaModule()
    trainer.fit(module, loader)
    attn = type(module.llama.model.layers[0].self_attn).__name__
    return losses.losses, attn, trainer.strategy.checkpoint_info(module) if strategy != "auto" else None


@functools.cache
def _one_device_llama_fit():
    from tests.lightning_ranks import run_ranks

    return run_ranks(_fit_llama, 1, "auto")[0]


@pytest.mark.parametrize("strategy, devices, attention", [("tp2d", 4, "LlamaAttention2D"),
                                                           ("metp", 2, "RingLlamaAttention"),
                                                           ("tp2d_metp", 4, "LlamaAttention2DMetp")])
def test_the_strategies_train_a_module_holding_a_llama_like_one_device(strategy, devices, attention):
    from tests.lightning_ranks import run_ranks

    results = run_ranks(_fit_llama, devices, strategy)
    losses, attn, info = results[0]
    assert attn == attention and all(r[0] == losses for r in results)
    assert info["llama_configs"]["llama"]["n_kv_head"] == 6 and info["gpt2_configs"] == {}
    ref, attn1, _ = _one_device_llama_fit()
    assert attn1 == "LlamaAttention" and len(losses) == len(ref) == FIT_STEPS
    worst = max(abs(a - b) for a, b in zip(losses, ref))
    assert worst <= 2e-5, f"losses differ from the single-device run by up to {worst:.2e}"
    assert losses[-1] < losses[0]


def test_activation_checkpointing_finds_the_llama_blocks():
    cfg = LlamaConfig.from_name("llama-tiny")
    torch.manual_seed(0)
    plain = Llama(cfg)
    wrapped = tp.checkpoint_activations(copy.deepcopy(plain), "full")
    assert all(hasattr(block.forward, "recomputes") for block in wrapped.model.layers)
    idx, targets = _batch(cfg.vocab_size, 2, 10)
    plain(idx, targets).backward()
    wrapped(idx, targets).backward()
    for (name, p), p0 in zip(wrapped.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, p0.grad, rtol=0, atol=0, msg=name)
