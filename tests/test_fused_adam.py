"""The fused AdamW step on DTensor parameters (:mod:`lightning_tp2d.fused_adam`): the same numbers as DTensor's own
dispatch, on the local shards, and DTensor's own dispatch wherever a tensor is laid out otherwise."""

from __future__ import annotations

import torch

from tests.distributed import run_distributed


def _step(params, grads, handler: bool, **kwargs) -> list[torch.Tensor]:
    """Two fused AdamW steps from ``params`` (copies) with ``grads``; the parameters and moments after, as full
    tensors. ``handler``: with the fast path in place, else DTensor's own dispatch."""
    from torch.distributed.tensor import DTensor

    from lightning_tp2d import fused_adam

    handlers = fused_adam._handlers()
    saved = {o: handlers.pop(o) for o in fused_adam._OVERLOADS if o in handlers}
    try:
        if handler:
            assert fused_adam.install()
        ps = [torch.nn.Parameter(DTensor.from_local(p.to_local().clone(), p.device_mesh, p.placements,
                                                    shape=p.shape, stride=p.stride())) for p in params]
        opt = torch.optim.AdamW(ps, lr=0.1, weight_decay=0.01, fused=True, **kwargs)
        for _ in range(2):
            for p, g in zip(ps, grads):
                p.grad = g
            opt.step()
        state = [opt.state[p][k] for p in ps for k in ("exp_avg", "exp_avg_sq")]
        return [t.detach().full_tensor() for t in (*ps, *state)]
    finally:
        for o in fused_adam._OVERLOADS:
            handlers.pop(o, None)
        handlers.update(saved)


def _compare(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from lightning_tp2d import fused_adam

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(6, 4, generator=gen), torch.randn(4, generator=gen), torch.randn(3, 8, generator=gen)]
    placements = [[Shard(0)], [Replicate()], [Shard(1)]]
    params = [distribute_tensor(t, mesh, pl) for t, pl in zip(full, placements)]
    grads = [distribute_tensor(torch.randn(t.shape, generator=gen), mesh, pl) for t, pl in zip(full, placements)]
    out = {"fast": _step(params, grads, True), "torch": _step(params, grads, False),
           "fast_amsgrad": _step(params, grads, True, amsgrad=True),
           "torch_amsgrad": _step(params, grads, False, amsgrad=True)}
    # the fast path takes these calls: every DTensor laid out as its parameter
    ps = [torch.nn.Parameter(p.detach().clone()) for p in params]
    out["takes_aligned"] = fused_adam._local_lists((ps, grads, grads, grads, [], [])) is not None
    # the same specs again: taken without a check (the cache), the same shards handed over
    again = fused_adam._local_lists((ps, grads, grads, grads, [], []))
    out["cached"] = (again is not None and all(a is g._local_tensor for a, g in zip(again[1], grads))
                     and any(len(k) == 5 for k in fused_adam._CHECKED))
    # a parameter's moment laid out otherwise after the cache holds the aligned call: still refused
    other = [distribute_tensor(torch.zeros(t.shape), mesh, [Replicate()]) for t in full]
    out["takes_other"] = fused_adam._local_lists((ps, grads, other, grads, [], [])) is not None
    # a gradient left Partial (replicated parameter, unreduced gradient) is DTensor's to redistribute
    partial = [grads[0], DTensor.from_local(grads[1].to_local() * (rank + 1), mesh, [Partial()]), grads[2]]
    out["takes_partial"] = fused_adam._local_lists((ps, partial, grads, grads, [], [])) is not None
    out["fast_partial"] = _step(params, partial, True)
    out["torch_partial"] = _step(params, partial, False)
    return out


def test_fused_adamw_on_local_shards_matches_dtensor_dispatch_and_falls_back_when_laid_out_otherwise():
    out = run_distributed(_compare, 2)
    for rank in out:
        for name in ("", "_amsgrad", "_partial"):
            fast, ref = rank["fast" + name], rank["torch" + name]
            assert len(fast) == len(ref) == 9
            for a, b in zip(fast, ref):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert rank["takes_aligned"] is True and rank["cached"] is True
        assert rank["takes_partial"] is False and rank["takes_other"] is False


def _installed_after_parallelize(rank: int, world: int) -> bool:
    from lightning_tp2d import fused_adam
    from lightning_tp2d.bench import layer_cost

    layer_cost.build("gpt2-tiny", "2d", n_layer=1)
    handlers = fused_adam._handlers()
    return all(handlers.get(o) is fused_adam._handler for o in fused_adam._OVERLOADS)


def test_parallelize_installs_the_fast_path():
    assert run_distributed(_installed_after_parallelize, 1) == [True]
