"""``Fabric(strategy="tp2d" | "metp" | "tp2d_metp")``: the Fabric strategy trains like one device (data parallel
with gradient accumulation, global-norm clipping, ZeRO-1), and ``fabric.save``/``fabric.load`` go through the
package's checkpoints (loadable on one device)."""

from __future__ import annotations

import lightning as L
import pytest
import torch

import lightning_tp2d as tp
from lightning_tp2d import fsdp
from lightning_tp2d.fabric import TP2DFabricStrategy
from lightning_tp2d.models import GPT2, GPT2Config
from lightning_tp2d.training import grad_norm
from lightning_tp2d.zero import sharding_of
from tests.lightning_ranks import run_ranks

SEED, STEPS, MICRO = 1234, 3, 2


@pytest.mark.parametrize("name, layout, p", [("tp2d", "2d", 4), ("metp", "metp", 4), ("tp2d_metp", "2d-metp", 4)])
def test_strategy_names_resolve_for_fabric(name, layout, p):
    fabric = L.Fabric(strategy=name, accelerator="cpu", devices=4)
    assert isinstance(fabric.strategy, TP2DFabricStrategy)
    assert fabric.strategy.layout == layout and fabric.strategy.parallel_dims.tensor_parallel_size == p


def test_sizes_that_do_not_fit_fail_when_fabric_is_built():
    with pytest.raises(ValueError, match="allow_fallback"):
        L.Fabric(strategy="tp2d", accelerator="cpu", devices=3)
    with pytest.raises(ValueError, match="zero_stage=4"):
        TP2DFabricStrategy(zero_stage=4)
    strategy = TP2DFabricStrategy(zero_stage=3, compile=True)  # compiled per block under FSDP (tests/test_fsdp.py)
    assert strategy.zero_stage == 3 and strategy.compile_options == {"dynamic": False}
    with pytest.raises(ValueError, match="activation_checkpointing='selective' is not supported"):
        TP2DFabricStrategy(zero_stage=3, compile=True, activation_checkpointing="selective")


def _batches(cfg, dp: int):
    g = torch.Generator().manual_seed(7)
    return [[[torch.randint(0, cfg.vocab_size, (2, 16), generator=g) for _ in range(MICRO)] for _ in range(dp)]
            for _ in range(STEPS)]


def _inner(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # the torch optimizer behind Fabric's wrapper


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _fabric_run(rank, world_size, path, stage):
    cfg = GPT2Config.from_name("gpt2-tiny")
    strategy = TP2DFabricStrategy("metp", tensor_parallel_size=2, zero_stage=stage)
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=world_size)
    fabric.launch()
    dp, replica = strategy.parallel_dims.data_parallel_size, strategy.device_mesh.get_local_rank("data_parallel")
    torch.manual_seed(SEED)
    with fabric.init_module(empty_init=True):  # meta: each rank materialises only its shards, from rank 0's seed
        model = GPT2(cfg)
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    torch.manual_seed(SEED)
    plain = GPT2(cfg)  # the reference: one device, every replica's micro-batches in one step
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for step_batches in _batches(cfg, dp):
        for m, idx in enumerate(step_batches[replica]):
            with fabric.no_backward_sync(model, enabled=m < MICRO - 1):
                fabric.backward(model(idx, idx) / MICRO)
        norm = fabric.clip_gradients(model, optimizer, max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()
        loss = sum(plain(idx, idx) for batches in step_batches for idx in batches) / (dp * MICRO)
        loss.backward()
        plain_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
        plain_optimizer.step()
        plain_optimizer.zero_grad()
    with fsdp.gathered(model.module):  # stage 3: the parameters as at stage 0 (a no-op otherwise)
        worst = max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), plain.parameters()))
    sharded = sharding_of(_inner(optimizer)) is not None if stage == 1 else fsdp.is_sharded(model.module)

    fabric.save(path, {"model": model, "optimizer": optimizer, "step": STEPS, "note": {"a": 1}})
    # a fresh model and an optimizer made before setting up (its parameters are swapped for the shards)
    torch.manual_seed(SEED + 1)
    with fabric.init_module(empty_init=True):
        fresh = GPT2(cfg)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh, fresh_optimizer = fabric.setup(fresh, fresh_optimizer)
    state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0, "note": None}
    rest = fabric.load(path, state)
    with fsdp.gathered(fresh.module), fsdp.gathered(model.module):
        loaded = max((p.full_tensor() - q.full_tensor()).abs().max().item()
                     for p, q in zip(fresh.parameters(), model.parameters()))
    before, after = _inner(optimizer).state, _inner(fresh_optimizer).state
    keys = [[t for g in _inner(o).param_groups for t in g["params"]] for o in (optimizer, fresh_optimizer)]
    pairs = list(zip(*keys))  # what the state is keyed by: the parameters (stage 3) or this replica's slices (1)
    states_equal = sorted(map(id, after)) == sorted(id(q) for p, q in pairs if p in before) and all(
        torch.equal(_local(after[q][k]), _local(before[p][k])) for p, q in pairs if p in before for k in before[p])
    g = torch.Generator().manual_seed(3)
    probe = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
    return {"worst": worst, "norm": float(norm), "plain_norm": float(plain_norm), "sharded": sharded,
            "loaded": loaded, "states_equal": states_equal, "step": state["step"], "note": state["note"],
            "rest": sorted(rest), "probe_loss": float(plain(probe, probe).detach())}


@pytest.mark.parametrize("stage", [1, 3])
def test_fabric_trains_like_one_device_and_saves_through_our_checkpoints(tmp_path, stage):
    path = tmp_path / "fabric.ckpt"
    outs = run_ranks(_fabric_run, 4, str(path), stage)
    for out in outs:
        # dp 2 x ring 2, accumulation, clipping, ZeRO-1 or 3 = one device, to float32 rounding grown by Adam's
        # steps at lr 1e-2 (which divide small gradients by their own size): 2.7e-5 on an Intel Xeon's kernels,
        # under 2e-5 on an AMD EPYC's; a wrong gradient moves a parameter by about the learning rate
        assert out["worst"] <= 1e-4, out
        assert out["norm"] == pytest.approx(out["plain_norm"], rel=1e-5)
        assert out["sharded"]
        assert out["loaded"] == 0.0 and out["states_equal"], out
        assert out["step"] == STEPS and out["note"] == {"a": 1} and out["rest"] == []
    assert (path / ".metadata").is_file()  # the sharded directory a Trainer writes
    model = tp.load_gpt2(path)  # on one device, no process group
    g = torch.Generator().manual_seed(3)
    probe = torch.randint(0, model.config.vocab_size, (2, 16), generator=g)
    with torch.no_grad():
        assert float(model(probe, probe)) == pytest.approx(outs[0]["probe_loss"], abs=1e-5)


def _fabric_bf16_clip(rank, world_size, precision):
    cfg = GPT2Config.from_name("gpt2-tiny")
    fabric = L.Fabric(strategy="tp2d", accelerator="cpu", devices=world_size, precision=precision)
    fabric.launch()
    torch.manual_seed(SEED)
    with fabric.init_module(empty_init=True):
        model = GPT2(cfg)
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    idx = _batches(cfg, 1)[0][0][0]
    fabric.backward(model(idx, idx))  # the module's forward runs under the precision's autocast
    norm = fabric.clip_gradients(model, optimizer, max_norm=0.1)
    clipped = grad_norm(model.parameters(), fabric.strategy.device_mesh)
    optimizer.step()
    torch.manual_seed(SEED)
    plain = GPT2(cfg).to(torch.bfloat16 if precision == "bf16-true" else torch.float32)
    with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16-mixed"):
        loss = plain(idx, idx)
    loss.backward()
    return {"norm": float(norm), "clipped": float(clipped), "plain_norm": float(torch.nn.utils.get_total_norm([p.grad for p in plain.parameters()])),
            "dtype": str(next(model.parameters()).dtype)}


@pytest.mark.parametrize("precision, dtype", [("bf16-mixed", "torch.float32"), ("bf16-true", "torch.bfloat16")])
def test_fabric_clips_a_fused_adamw_under_bf16(precision, dtype):
    """``fabric.clip_gradients`` with torch's fused AdamW under bf16-mixed and bf16-true (no gradient scaler): the
    norm is the whole model's (as one device computes it in the same precision) and the gradients end at
    ``max_norm``."""
    for out in run_ranks(_fabric_bf16_clip, 4, precision):
        assert out["dtype"] == dtype
        assert out["norm"] == pytest.approx(out["plain_norm"], rel=3e-2) and out["norm"] > 0.5, out
        assert out["clipped"] == pytest.approx(0.1, rel=2e-2), out
