"""The parameters' gradients when each DTensor parameter hands the layers its local shard as an autograd leaf of its
own (:func:`lightning_tp2d.nn.functional.local_view`): ``p.grad`` is still a DTensor of the parameter's placements,
accumulates over backwards, survives both kinds of ``zero_grad``, runs the hooks registered on the parameter once
per backward, and reaches only the model it was computed on (a deep copy has its own). The shard itself never keeps
a gradient: the memory is the plain model's."""

from __future__ import annotations

import copy

import torch
from torch.distributed.tensor import DTensor

import lightning_tp2d as tp
from lightning_tp2d.bench import layer_cost
from tests.distributed import run_distributed


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, 257, (2, 17), generator=torch.Generator().manual_seed(seed))
    return idx[:, :-1], idx[:, 1:]


def _grads(model) -> dict:
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
            for n, p in model.named_parameters() if p.grad is not None}


def _semantics(rank: int, world: int, layout: str) -> dict:
    plain = layer_cost.build("gpt2-tiny", None, n_layer=1)
    model = layer_cost.build("gpt2-tiny", layout, n_layer=1)
    (a, ya), (b, yb) = _batch(0), _batch(1)
    out = {}
    # two backwards without zero_grad: the sum of both, as the plain model's
    for m in (plain, model):
        m(a, ya).backward()
        m(b, yb).backward()
    out["accumulated"] = (_grads(model), _grads(plain))
    out["grad_types"] = {type(p.grad).__name__ for p in model.parameters()}
    out["shard_grads"] = sum(p._local_tensor.grad is not None for p in model.parameters())
    # zeroed in place, then one backward: that backward's gradient alone
    for m in (plain, model):
        m.zero_grad(set_to_none=False)
        m(b, yb).backward()
    out["after_zeroing"] = (_grads(model), _grads(plain))
    # a hook on the parameter runs once per backward, with the parameter's gradient in place
    model.zero_grad(set_to_none=True)
    seen = []
    weight = model.transformer.h[0].mlp.c_fc.weight
    weight.register_post_accumulate_grad_hook(lambda p: seen.append(isinstance(p.grad, DTensor)))
    model(a, ya).backward()
    model(b, yb).backward()
    out["hook_calls"] = seen
    # a deep copy trains on its own: its backward fills its gradients, never the original's
    model.zero_grad(set_to_none=True)
    twin = copy.deepcopy(model)
    twin(a, ya).backward()
    out["twin"] = (sum(p.grad is not None for p in twin.parameters()),
                   sum(p.grad is not None for p in model.parameters()))
    # a frozen parameter gets no gradient; the others still do
    twin.zero_grad(set_to_none=True)
    frozen = twin.transformer.wpe.weight
    frozen.requires_grad_(False)
    twin(a, ya).backward()
    out["frozen"] = (frozen.grad is None, sum(p.grad is not None for p in twin.parameters()))
    out["parameters"] = sum(1 for _ in model.parameters())
    return out


def test_leaf_shards_give_dtensor_gradients_that_accumulate_zero_and_hook_like_the_plain_model():
    out = run_distributed(_semantics, 1, "2d")[0]
    for key in ("accumulated", "after_zeroing"):
        ours, plain = out[key]
        assert ours.keys() == plain.keys()
        for name, grad in plain.items():
            torch.testing.assert_close(ours[name], grad, rtol=1e-6, atol=1e-7, msg=f"{key}: {name}")
    assert out["grad_types"] == {"DTensor"}
    assert out["shard_grads"] == 0  # moved into p.grad, never kept twice
    assert out["hook_calls"] == [True, True]
    n = out["parameters"]
    assert out["twin"] == (n, 0)
    assert out["frozen"] == (True, n - 1)


def _four_ranks(rank: int, world: int, layout: str) -> dict:
    torch.manual_seed(0)
    plain = layer_cost.build("gpt2-tiny", None, n_layer=1)
    model = tp.parallelize(copy.deepcopy(plain), tp.init_mesh(layout, world, 1), layout)
    model.validate_inputs = False
    (a, ya), (b, yb) = _batch(0), _batch(1)
    for m in (plain, model):
        m(a, ya).backward()
        m(b, yb).backward()
    return {"ours": _grads(model), "plain": _grads(plain)}


def test_accumulated_gradients_at_four_ranks_are_the_plain_models():
    for layout in ("2d", "metp"):
        for out in run_distributed(_four_ranks, 4, layout):
            for name, grad in out["plain"].items():
                torch.testing.assert_close(out["ours"][name], grad, rtol=1e-5, atol=1e-6, msg=f"{layout}: {name}")


def _compiled(rank: int, world: int, layout: str) -> dict:
    import torch._dynamo as dynamo

    from lightning_tp2d.nn.functional import own_leaf_grads

    plain = layer_cost.build("gpt2-tiny", None, n_layer=1)
    model = layer_cost.build("gpt2-tiny", layout, n_layer=1)
    twin = copy.deepcopy(model)  # unarmed until a step's assembly marks it: traced through to_local
    (a, ya), (b, yb) = _batch(0), _batch(1)
    dynamo.reset()
    dynamo.utils.counters.clear()
    out = {}
    guards: dict[str, list] = {}
    for name, m in (("plain", plain), ("ours", model), ("twin", twin)):
        seen = guards.setdefault(name, [])

        def keep(entries, seen=seen):  # records the guards' types, keeps them all
            seen.extend(e.guard_type for e in entries)
            return [True] * len(entries)

        m.compile(backend="aot_eager", dynamic=False, options={"guard_filter_fn": keep})
        m(a, ya).backward()
        m(b, yb).backward()
        out[name] = _grads(m)
    out["shard_grads"] = sum(p._local_tensor.grad is not None for p in model.parameters())
    out["breaks"] = sum(dynamo.utils.counters["graph_break"].values())
    out["spec_guards"] = {name: seen.count("DTENSOR_SPEC_MATCH") for name, seen in guards.items()}
    # frozen after it was traced: the compiled graph still takes its shard, which gets no gradient
    model.zero_grad(set_to_none=True)
    frozen = model.transformer.wpe.weight
    frozen.requires_grad_(False)
    model(a, ya).backward()
    out["frozen"] = (frozen.grad is None, frozen._local_tensor.grad is None,
                     sum(p.grad is not None for p in model.parameters()), sum(1 for _ in model.parameters()))
    # cast after it was traced: the old shards die with their weak references, the model is traced again through
    # its parameters, and the gradients are the cast plain model's
    frozen.requires_grad_(True)
    model.zero_grad(set_to_none=True)
    plain.zero_grad(set_to_none=True)
    for m in (plain, model):
        m.double()
        m(a, ya).backward()
    out["cast"] = (_grads(model), _grads(plain))
    # a parameter replaced (a new nn.Parameter) while the old one lives on: the compiled graph, which reaches shards
    # through the modules' links, still takes the old shard; its gradient cannot reach the new parameter, and the
    # backward says so rather than leave the parameter untrained. Armed again, the graph takes the new shard.
    own_leaf_grads(model)  # armed again after the cast (a step's assembly does this), and traced with the shards
    model(a, ya).backward()
    model.zero_grad(set_to_none=True)
    fc = model.transformer.h[0].mlp.c_fc
    old = fc.weight
    fc.weight = torch.nn.Parameter(old.detach().clone())
    try:
        model(a, ya).backward()
        out["replaced"] = "no error"
    except RuntimeError as err:
        out["replaced"] = str(err)
    own_leaf_grads(model)
    model.zero_grad(set_to_none=True)
    plain.zero_grad(set_to_none=True)
    for m in (plain, model):
        m(a, ya).backward()
    out["rearmed"] = (_grads(model), _grads(plain), old.grad is None)
    return out


def test_compiled_steps_take_the_shards_as_leaves_and_give_the_plain_gradients():
    out = run_distributed(_compiled, 1, "2d")[0]
    assert out["breaks"] == 0 and out["shard_grads"] == 0
    # the armed shards are found through the modules' links: no DTensor parameter is guarded by its whole spec (a
    # Python guard per parameter and call); the twin, unarmed, still is
    assert out["spec_guards"]["ours"] == 0 and out["spec_guards"]["plain"] == 0
    assert out["spec_guards"]["twin"] > 0
    frozen_grad_none, shard_grad_none, with_grads, n = out["frozen"]
    assert frozen_grad_none and shard_grad_none and with_grads == n - 1
    ours, plain = out["cast"]
    assert ours.keys() == plain.keys()
    for name, grad in plain.items():
        assert ours[name].dtype == torch.float64, name
        torch.testing.assert_close(ours[name], grad, rtol=1e-9, atol=1e-10, msg=f"cast: {name}")
    assert "the gradient of Linear2D.weight reached a shard that is no longer that parameter's" in out["replaced"]
    ours, plain, old_untouched = out["rearmed"]
    assert old_untouched and ours.keys() == plain.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(ours[name], grad, rtol=1e-9, atol=1e-10, msg=f"re-armed: {name}")
    for side in ("ours", "twin"):
        assert out[side].keys() == out["plain"].keys()
        for name, grad in out["plain"].items():
            torch.testing.assert_close(out[side][name], grad, rtol=1e-5, atol=1e-6, msg=f"{side}: {name}")
