"""ZeRO-1 (``lightning_tp2d.zero``): every parameter split evenly over data_parallel, the optimizer state of its
slice per replica; trains exactly like the replicated optimizer, holds ~1/dp of its bytes, and its checkpoints load
with or without sharding, in either format."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import lightning_tp2d as tp
from lightning_tp2d import checkpoint as ckpt
from lightning_tp2d.comm import all_reduce_along, count_comm
from lightning_tp2d.models import GPT2, GPT2Config
from lightning_tp2d.training import GradientSync, average_gradients_, clip_grad_norm_
from lightning_tp2d.zero import (ShardedOptimizer, even_slices, full_param_groups, optimizer_state_bytes,
                                 shard_optimizer_state, sharding_of)
from tests.distributed import run_distributed


@pytest.mark.parametrize("n, parts", [(5, 4), (7, 3), (4097, 4), (3, 4), (1, 2), (0, 2), (12, 4)])
def test_even_slices_tile_every_element_in_ceil_sized_slices(n, parts):
    slices = even_slices(n, parts)
    assert len(slices) == parts
    assert [b for _, b in slices[:-1]] == [a for a, _ in slices[1:]] and slices[0][0] == 0 and slices[-1][1] == n
    sizes, ceil = [b - a for a, b in slices], math.ceil(n / parts)
    assert sizes == sorted(sizes, reverse=True) and all(0 <= s <= ceil for s in sizes)
    assert sum(0 < s < ceil for s in sizes) <= 1  # full slices first, then at most one shorter, then empty ones
    if (n, parts) == (5, 4):
        assert slices == [(0, 2), (2, 4), (4, 5), (5, 5)]


@pytest.mark.parametrize("optimizer", [torch.optim.LBFGS, torch.optim.Adafactor, torch.optim.SparseAdam])
def test_a_non_elementwise_optimizer_is_refused_before_anything_changes(optimizer):
    params = [nn.Parameter(torch.zeros(4, 4))]
    opt = optimizer(params)
    with pytest.raises(TypeError, match=f"exact only for an element-wise optimizer.*{optimizer.__name__}"):
        ShardedOptimizer(opt, mesh=None)
    assert opt.param_groups[0]["params"][0] is params[0] and sharding_of(opt) is None


def _adamw(model, lr=1e-2):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, foreach=True)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


# ---- uneven plain parameters at dp 4: exact steps, bytes, closure, scheduler, remove ---------------------------


class _Uneven(nn.Module):
    """Parameters of 4097, 403, 31, 3 (fewer than dp) and 1 (0-dim) elements: sizes no dp divides."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Parameter(torch.randn(17, 241))
        self.lin = nn.Linear(13, 31)
        self.small = nn.Parameter(torch.randn(3))
        self.temperature = nn.Parameter(torch.tensor(0.7))

    def forward(self, x):  # x [B, 13]
        h = torch.tanh(self.lin(x))  # [B, 31]
        return (h.sum() * self.big.mean() + self.small.pow(2).sum() * self.temperature).pow(2)


def _uneven_worker(rank: int, world_size: int, steps: int) -> dict:
    mesh = tp.init_mesh("2d", 1, world_size)  # data_parallel = world_size, no tensor parallelism
    models, optimizers, schedulers = [], [], []
    for sharded in (False, True):
        torch.manual_seed(0)
        model = _Uneven()
        optimizer = _adamw(model, lr=3e-2)
        if sharded:  # buckets of ~1000 gathered bytes: more buckets than are kept in flight
            shard_optimizer_state(optimizer, mesh, bucket_mib=1000 / 2 ** 20)
        models.append(model)
        optimizers.append(optimizer)
        schedulers.append(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step)))
    torch.manual_seed(10 + rank)  # each replica its own data
    diff, norms = 0.0, []
    for step in range(steps):
        x = torch.randn(4, 13)
        for model, optimizer, scheduler in zip(models, optimizers, schedulers):
            def closure(model=model, optimizer=optimizer):
                optimizer.zero_grad()
                loss = model(x)
                loss.backward()
                average_gradients_(model, mesh)
                norms.append(float(clip_grad_norm_([q for g in full_param_groups(optimizer) for q in g], 0.5, mesh)))
                return loss

            if step % 2:  # a closure (Lightning's way): the slices' gradients are bound after it ran
                optimizer.step(closure)
            else:
                closure()
                optimizer.step()
            scheduler.step()
        diff = max(diff, max((a - b).abs().max().item() for a, b in zip(*(m.parameters() for m in models))))
    replicated, zero = optimizers
    sharding = sharding_of(zero)
    counts = torch.tensor([float(s.numel()) for s in sharding.shards])
    all_reduce_along(counts, mesh, "data_parallel")  # every element owned exactly once (0-dim: whole everywhere)
    gathered = {id(p): sharding.full_state(p) for p in sharding.params}
    state_equal = all(sorted(gathered[id(p)]) == sorted(replicated.state[q]) and all(
        torch.equal(gathered[id(p)][k], replicated.state[q][k]) for k in replicated.state[q])
        for p, q in zip(models[1].parameters(), models[0].parameters()))
    out = {"diff": diff, "norms": norms, "bytes": [optimizer_state_bytes(o) for o in optimizers],
           "lrs": [[g["lr"] for g in o.param_groups] for o in optimizers],
           "grads_left": sum(q.grad is not None for q in models[1].parameters()),
           "owned_once": counts.tolist() == [float(p.numel() if p.dim() else world_size) for p in sharding.params],
           "state_equal": state_equal, "buckets": len(sharding._buckets)}
    sharding.remove()  # back to a plain optimizer holding the full state, which steps on as the replicated one
    out["removed"] = zero.param_groups[0]["params"][0] is models[1].big and sharding_of(zero) is None and all(
        torch.equal(zero.state[p][k], replicated.state[q][k])
        for p, q in zip(models[1].parameters(), models[0].parameters()) for k in replicated.state[q])
    resharded = shard_optimizer_state(zero, mesh)  # existing state is cut to this replica's slices
    out["resharded"] = all(torch.equal(resharded.full_state(p)[k], replicated.state[q][k])
                           for p, q in zip(models[1].parameters(), models[0].parameters()) for k in replicated.state[q])
    models[1].double()  # the slices are views of the old storage: stepping now would train nothing
    try:
        models[1](torch.randn(4, 13).double()).backward()
        zero.step()
        out["moved"] = "no error"
    except RuntimeError as err:
        out["moved"] = str(err)
    return out


def test_zero1_splits_uneven_parameters_evenly_and_steps_exactly_like_the_replicated_adamw():
    dp = 4
    outs = run_distributed(_uneven_worker, dp, 6, timeout=180)
    for out in outs:
        assert out["diff"] <= 1e-6, out  # 6 AdamW steps, two weight-decay groups, a scheduler, clipping
        assert out["norms"][0::2] == out["norms"][1::2]  # clipped by the whole model's norm, not the owned slices
        assert out["lrs"][0] == out["lrs"][1] and out["lrs"][0][0] < 3e-2  # the scheduler reached the slices
        full, share = out["bytes"]
        assert share <= 0.27 * full, out["bytes"]  # ideal 1/4: ceil slices and step counts add a little
        assert out["grads_left"] == 0  # the step drops the parameters' gradients, as zero_grad would
        assert out["owned_once"] and out["state_equal"], out
        assert out["buckets"] == 3  # 4097 and 403 elements each alone (over the cap), 31 and 3 together
        assert out["removed"] and out["resharded"], out
        assert "storage changed after its optimizer state was sharded" in out["moved"], out
    assert len({tuple(out["norms"]) for out in outs}) == 1


# ---- GPT-2 on the tensor-parallel layouts: exact training, bytes, checkpoints in both formats ------------------


def _states(model, optimizer) -> dict:
    """Every state tensor this rank holds, by parameter name (local shards; with ZeRO-1 this replica's slices)."""
    names = {id(p): n for n, p in model.named_parameters()}
    sharding = sharding_of(optimizer)
    keys = {id(s): p for p, s in zip(sharding.params, sharding.shards)} if sharding is not None else {}
    return {names[id(keys.get(id(p), p))]: {k: _local(v).clone() for k, v in s.items()}
            for p, s in optimizer.state.items()}


def _slices(states: dict, model, dp: int, rank: int) -> dict:
    """This replica's slices of replicated ``states`` (scalars whole): what ZeRO-1 holds of them."""
    shapes = {n: _local(p).shape for n, p in model.named_parameters()}
    out = {}
    for name, fields in states.items():
        start, stop = even_slices(math.prod(shapes[name]), dp)[rank]
        out[name] = {k: v.reshape(-1)[start:stop] if v.shape == shapes[name] and v.dim() else v
                     for k, v in fields.items()}
    return out


def _same(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(sorted(a[n]) == sorted(b[n]) and all(torch.equal(a[n][k], b[n][k])
                                                                              for k in a[n]) for n in a)


def _zero_worker(rank: int, world_size: int, layout: str, p: int, directory: str) -> dict:
    cfg = GPT2Config.from_name("gpt2-tiny")
    mesh = tp.init_mesh(layout, p, world_size // p)
    dp, dp_rank = world_size // p, mesh.get_local_rank("data_parallel")
    models, optimizers = [], []
    for sharded in (False, True):
        torch.manual_seed(0)
        model = tp.parallelize(GPT2(cfg), mesh, layout)
        optimizer = _adamw(model)
        if sharded:  # buckets of ~1000 gathered bytes: more buckets than are kept in flight
            shard_optimizer_state(optimizer, mesh, bucket_mib=1000 / 2 ** 20)
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
    sharding = sharding_of(zero)
    counts = torch.tensor([float(s.numel()) for s in sharding.shards])
    all_reduce_along(counts, mesh, "data_parallel")
    out = {"param_diff": param_diff, "norms": norms,
           "bytes": [optimizer_state_bytes(o) for o in optimizers],
           "grads_left": sum(q.grad is not None for q in models[1].parameters()),
           "owned_once": counts.tolist() == [float(_local(q).numel()) for q in sharding.params]}

    # checkpoints: the sharded optimizer's (both formats) load into a replicated optimizer and give the replicated
    # run's state, and into a sharded one its slices; the replicated run's checkpoint loads into a sharded optimizer
    # (each replica takes its slices)
    barrier = lambda name: dist.barrier()  # noqa: E731
    reference = _states(models[0], replicated)
    mine = _slices(reference, models[0], dp, dp_rank)
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
        out[f"load_replicated_{sharded_format}"] = _same(_states(fresh, fresh_optimizer), reference)
        out[f"weights_{sharded_format}"] = max((_local(a) - _local(b)).abs().max().item()
                                               for a, b in zip(fresh.parameters(), models[1].parameters()))
        fresh = tp.parallelize(GPT2(cfg), mesh, layout)
        fresh_optimizer = _adamw(fresh)
        shard_optimizer_state(fresh_optimizer, mesh)
        ckpt.load_into(fresh, [fresh_optimizer], path)
        out[f"load_zero_{sharded_format}"] = _same(_states(fresh, fresh_optimizer), _states(models[1], zero))
    path = Path(f"{directory}/replicated")
    ckpt.save({"state_dict": models[0].state_dict(keep_vars=True),
               "optimizer_states": [ckpt.sharded_optimizer_state(models[0], replicated)]},
              path, rank=rank, sharded=True, barrier=barrier)
    fresh = tp.parallelize(GPT2(cfg), mesh, layout)
    fresh_optimizer = _adamw(fresh)
    shard_optimizer_state(fresh_optimizer, mesh)
    ckpt.load_into(fresh, [fresh_optimizer], path)
    out["load_sharded"] = _same(_states(fresh, fresh_optimizer), mine) and _same(_states(models[1], zero), mine)
    return out


@pytest.mark.parametrize("layout, p, world", [("metp", 2, 4), ("2d", 1, 4)], ids=["metp-p2-dp2", "2d-p1-dp4"])
def test_zero1_trains_like_the_replicated_optimizer_and_its_checkpoints_load_either_way(tmp_path, layout, p, world):
    dp = world // p
    outs = run_distributed(_zero_worker, world, layout, p, str(tmp_path), timeout=300)
    for out in outs:
        # every replica computes exactly the replicated update of its slices: identical weights on every replica
        assert out["param_diff"] == 0.0, out
        assert out["norms"][0::2] == out["norms"][1::2]  # clipped by the whole model's norm, not the owned share
        assert out["grads_left"] == 0  # the step drops the parameters' gradients (the slices' are views of them)
        full, share = out["bytes"]
        assert share <= full * (1 / dp + 0.02), out["bytes"]  # an even split of every tensor: about 1/dp
        assert out["load_replicated_True"] and out["load_replicated_False"], out
        assert out["load_zero_True"] and out["load_zero_False"], out
        assert out["weights_True"] == 0.0 and out["weights_False"] == 0.0
        assert out["load_sharded"], out
        assert out["owned_once"]  # every element of every parameter has exactly one owner


# ---- parameters FSDP shards over data_parallel pass through; the ones it keeps whole are sliced ----------------


def _mixed_worker(rank: int, world_size: int, steps: int) -> dict:
    """``steps`` AdamW steps of ``_Uneven`` replicated (gradients averaged) and with FSDP over data_parallel but for
    two parameters kept whole (averaged by hand, as fsdp's hook does), its optimizer sharded; then a model FSDP
    cuts whole, whose sharding has nothing to slice."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("data_parallel",))
    torch.manual_seed(0)
    reference = _Uneven()
    plain = _adamw(reference, lr=3e-2)
    model = copy.deepcopy(reference)  # FSDP shards lin and big, and keeps small and temperature whole (told to):
    whole = {model.small, model.temperature}  # the mix ZeRO-1 sees at stages 2/3 (GPT-2's fused q/k/v bias, grids)
    fully_shard(model.lin, mesh=mesh)
    fully_shard(model, mesh=mesh, ignored_params=whole)
    optimizer = _adamw(model, lr=3e-2)
    sharding = shard_optimizer_state(optimizer, mesh)
    torch.manual_seed(10 + rank)  # each replica its own data
    diff, grads_after_step = 0.0, []
    for _ in range(steps):
        x = torch.randn(4, 13)
        for m, opt in ((reference, plain), (model, optimizer)):
            opt.zero_grad()
            m(x).backward()
            if m is reference:
                average_gradients_(m, mesh)
            else:  # what fsdp's hook does for the parameters it keeps whole
                for p in whole:
                    all_reduce_along(p.grad, mesh, "data_parallel")
                    p.grad.div_(world_size)
            opt.step()
        grads_after_step.append(sorted(n for n, p in model.named_parameters() if p.grad is not None))
        diff = max(diff, max((b.full_tensor() if isinstance(b, DTensor) else b).sub(a).abs().max().item()
                             for a, b in zip(reference.parameters(), model.parameters())))
    names = {id(p): n for n, p in model.named_parameters()}
    split = [p for p in model.parameters() if isinstance(p, DTensor)]
    out = {"diff": diff, "grads_after_step": grads_after_step,
           "split": sorted(names[id(p)] for p in split),
           # FSDP's: their own entries, state keyed by them, given back as they are
           "passthrough": all(sharding.shard_of(p) is p and p in optimizer.state and all(
               sharding.full_state(p)[k] is v and sharding.owned_slice(p, v) is v
               for k, v in optimizer.state[p].items()) for p in split),
           "in_groups": [sum(any(q is p for q in g["params"]) for g in optimizer.param_groups) for p in split],
           "whole_state": {names[id(p)]: optimizer.state[sharding.shard_of(p)]["exp_avg"].numel() for p in whole},
           "whole_full": {names[id(p)]: sharding.full_state(p)["exp_avg"].shape == p.shape for p in whole},
           "buckets": len(sharding._buckets)}
    # nothing replicated left: no hook, no bucket, no collective at the step, and the same update as plain AdamW
    torch.manual_seed(0)
    reference = nn.Linear(13, 31)
    alone = fully_shard(copy.deepcopy(reference), mesh=mesh)
    plain, optimizer = _adamw(reference), _adamw(alone)
    sharding = shard_optimizer_state(optimizer, mesh)
    x = torch.randn(4, 13)
    for m, opt in ((reference, plain), (alone, optimizer)):
        m(x).pow(2).sum().backward()
        if m is reference:
            average_gradients_(m, mesh)
        with count_comm() as stats:
            opt.step()
    out["alone"] = {"hooks": len(sharding._hooks), "buckets": len(sharding._buckets),
                    "calls": sum(v["calls"] for v in stats.snapshot().values()),
                    # nothing to slice: any optimizer is exact (FSDP's own sharding of it is untouched)
                    "any_optimizer": isinstance(shard_optimizer_state(torch.optim.Adafactor(alone.parameters()),
                                                                      mesh), ShardedOptimizer),
                    "diff": max((b.full_tensor() - a).abs().max().item()
                                for a, b in zip(reference.parameters(), alone.parameters()))}
    return out


def test_zero1_slices_only_what_fsdp_keeps_whole_and_steps_like_plain_adamw():
    outs = run_distributed(_mixed_worker, 2, 4, timeout=180)
    for out in outs:
        assert out["diff"] <= 1e-6, out  # 4 AdamW steps, two weight-decay groups: FSDP's shards and the slices
        assert out["split"] == ["big", "lin.bias", "lin.weight"], out
        assert out["passthrough"] and out["in_groups"] == [1, 1, 1], out
        assert out["whole_state"]["temperature"] == 1, out  # 0-dim: whole everywhere (its own entry, as FSDP's)
        assert out["whole_full"] == {"small": True, "temperature": True}, out
        assert out["buckets"] == 1, out  # only "small" is gathered after the step
        # the step drops the sliced parameter's gradient; those passing through keep theirs until zero_grad
        assert all(names == ["big", "lin.bias", "lin.weight", "temperature"] for names in out["grads_after_step"])
        assert out["alone"] == {"hooks": 0, "buckets": 0, "calls": 0, "any_optimizer": True,
                                "diff": out["alone"]["diff"]}, out
        assert out["alone"]["diff"] <= 1e-6, out
    assert sorted(out["whole_state"]["small"] for out in outs) == [1, 2]  # the whole-kept 3 elements: ceil(3/2), rest
