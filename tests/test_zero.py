"""ZeRO-1 (``lightning_tp2d.zero``): optimizer state sharded over data_parallel trains exactly like the replicated
optimizer, holds ~1/dp of its bytes, and its checkpoints load with or without sharding, in either format."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lightning_tp2d as tp
from lightning_tp2d import checkpoint as ckpt
from lightning_tp2d.models import GPT2, GPT2Config
from lightning_tp2d.training import GradientSync, clip_grad_norm_
from lightning_tp2d.zero import (full_param_groups, optimizer_state_bytes, partition, shard_optimizer_state,
                                 sharding_of)
from tests.distributed import run_distributed


def test_partition_balances_whole_items_largest_first():
    owners = partition([10, 1, 7, 3, 3, 2], 2)
    loads = [sum(s for s, o in zip([10, 1, 7, 3, 3, 2], owners) if o == r) for r in range(2)]
    assert sorted(loads) == [13, 13]
    assert partition([5, 5, 5], 4) == [0, 1, 2]  # more owners than items: some own nothing


def _adamw(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=1e-2, foreach=True)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _states(model, optimizer) -> dict:
    """Every state tensor this rank holds, by parameter name (local shards)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: {k: _local(v).clone() for k, v in s.items()} for p, s in optimizer.state.items()}


def _zero_worker(rank: int, world_size: int, layout: str, p: int, directory: str) -> dict:
    cfg = GPT2Config.from_name("gpt2-tiny")
    mesh = tp.init_mesh(layout, p, world_size // p)
    dp_rank = mesh.get_local_rank("data_parallel")
    models, optimizers = [], []
    for sharded in (False, True):
        torch.manual_seed(0)
        model = tp.parallelize(GPT2(cfg), mesh, layout)
        optimizer = _adamw(model)
        if sharded:
            shard_optimizer_state(optimizer, mesh)
        models.append(model)
        optimizers.append(optimizer)
    syncs = [GradientSync(m, mesh) for m in models]
    torch.manual_seed(10 + dp_rank)  # each replica its own data
    param_diff, norms = 0.0, []
    for _ in range(3):
        idx = torch.randint(0, cfg.vocab_size, (2, 16))
        for model, optimizer, sync in zip(models, optimizers, syncs):
            optimizer.zero_grad()
            model(idx, idx).backward()
            sync.finish()
            params = [q for group in full_param_groups(optimizer) for q in group]
            norms.append(float(clip_grad_norm_(params, 0.5, mesh)))
            optimizer.step()
        param_diff = max(param_diff, max((_local(a) - _local(b)).abs().max().item()
                                         for a, b in zip(models[0].parameters(), models[1].parameters())))
    replicated, zero = optimizers
    out = {"param_diff": param_diff, "norms": norms,
           "bytes": [optimizer_state_bytes(o) for o in optimizers],
           "grads_left": sum(q.grad is not None for q in models[1].parameters()),
           "owned": sum(sharding_of(zero).owns(q) for q in models[1].parameters()),
           "n_params": len(list(models[1].parameters()))}

    # checkpoints: the sharded optimizer's (both formats) load into a replicated optimizer and give the replicated
    # run's state; the replicated run's checkpoint loads into a sharded optimizer (each replica takes its share)
    barrier = lambda name: dist.barrier()  # noqa: E731
    reference = _states(models[0], replicated)
    for sharded_format in (True, False):
        path = f"{directory}/zero-{sharded_format}" + ("" if sharded_format else ".ckpt")
        state = (ckpt.sharded_optimizer_state(models[1], zero) if sharded_format
                 else ckpt.full_optimizer_state(models[1], zero, rank))
        model_state = (models[1].state_dict(keep_vars=True) if sharded_format
                       else ckpt.full_model_state(models[1], rank))
        ckpt.save({"state_dict": model_state, "optimizer_states": [state]}, Path(path),
                  rank=rank, sharded=sharded_format, barrier=barrier)
        torch.manual_seed(1)
        fresh = tp.parallelize(GPT2(cfg), mesh, layout)
        fresh_optimizer = _adamw(fresh)
        ckpt.load_into(fresh, [fresh_optimizer], path)
        loaded = _states(fresh, fresh_optimizer)
        out[f"load_replicated_{sharded_format}"] = (
            sorted(loaded) == sorted(reference)
            and all(torch.equal(loaded[n][k], reference[n][k]) for n in reference for k in reference[n]))
        out[f"weights_{sharded_format}"] = max((_local(a) - _local(b)).abs().max().item()
                                               for a, b in zip(fresh.parameters(), models[1].parameters()))
    path = Path(f"{directory}/replicated")
    ckpt.save({"state_dict": models[0].state_dict(keep_vars=True),
               "optimizer_states": [ckpt.sharded_optimizer_state(models[0], replicated)]},
              path, rank=rank, sharded=True, barrier=barrier)
    fresh = tp.parallelize(GPT2(cfg), mesh, layout)
    fresh_optimizer = _adamw(fresh)
    sharding = shard_optimizer_state(fresh_optimizer, mesh)
    ckpt.load_into(fresh, [fresh_optimizer], path)
    loaded = _states(fresh, fresh_optimizer)
    names = {id(q): n for n, q in fresh.named_parameters()}
    mine = sorted(names[id(q)] for q in fresh.parameters() if sharding.owns(q))
    out["load_sharded"] = sorted(loaded) == mine and all(
        torch.equal(loaded[n][k], reference[n][k]) for n in loaded for k in loaded[n])
    return out


@pytest.mark.parametrize("layout, p, world", [("metp", 2, 4), ("2d", 1, 4)], ids=["metp-p2-dp2", "2d-p1-dp4"])
def test_zero1_trains_like_the_replicated_optimizer_and_its_checkpoints_load_either_way(tmp_path, layout, p, world):
    dp = world // p
    outs = run_distributed(_zero_worker, world, layout, p, str(tmp_path), timeout=300)
    for out in outs:
        # the owner computes exactly the replicated update and broadcasts it: identical weights on every replica
        assert out["param_diff"] == 0.0, out
        assert out["norms"][0::2] == out["norms"][1::2]  # clipped by the whole model's norm, not the owned share
        assert out["grads_left"] == out["owned"]  # gradients of parameters owned elsewhere are dropped
        full, share = out["bytes"]
        assert share < full / dp * 1.35, out["bytes"]  # whole parameters, balanced: about 1/dp
        assert out["load_replicated_True"] and out["load_replicated_False"], out
        assert out["weights_True"] == 0.0 and out["weights_False"] == 0.0
        assert out["load_sharded"], out
    assert sum(out["owned"] for out in outs[:: p]) >= outs[0]["n_params"]  # every parameter has an owner
