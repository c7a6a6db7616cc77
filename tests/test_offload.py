"""``activation_offload``: under full checkpointing the block inputs wait on the host between forward and backward
(:mod:`lightning_tp2d.offload`), with bit-identical losses and gradients, every byte that leaves coming back, the
fetches one block ahead; the strategies and ``tp2d-train`` take it as an option, and refuse what it cannot run with.

On this CPU machine the offloader's CPU path runs (plain host copies); its CUDA path (pinned memory, side stream,
events) is the same schedule with other copies."""

from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch

import lightning_tp2d as tp
from lightning_tp2d.fabric import TP2DFabricStrategy
from lightning_tp2d.models import GPT2, GPT2Config, Llama, LlamaConfig
from lightning_tp2d.offload import MIN_BYTES, ActivationOffloader, uses_streams
from lightning_tp2d.parallelize import activation_offloader, checkpoint_activations
from tests.distributed import run_distributed

MODELS = {"gpt2-tiny": (GPT2, GPT2Config), "llama-tiny": (Llama, LlamaConfig)}


def _config(name: str):
    model, config = MODELS[name]
    return model, config.from_name(name, **({"dropout": 0.0} if config is GPT2Config else {}))


def _step(name: str, offload, idx: torch.Tensor, doc_ids=None, dtype=torch.float32):
    """Loss, gradients (by name) and offloader of one forward and backward of the named model with full
    checkpointing, from seed 0."""
    model_class, cfg = _config(name)
    torch.manual_seed(0)
    model = model_class(cfg).to(dtype)
    checkpoint_activations(model, "full", offload=offload)
    loss = model(idx, idx, doc_ids=doc_ids)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, activation_offloader(model)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed-documents"])
def test_offload_gives_bit_identical_gradients_and_every_block_input_leaves_and_returns(name, packed):
    _, cfg = _config(name)
    B, T = 2, 16
    idx = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(1))
    doc_ids = torch.tensor([[0] * 5 + [1] * 11, [0] * 9 + [1] * 7]) if packed else None
    loss, grads, none = _step(name, False, idx, doc_ids)
    assert none is None
    off_loss, off_grads, offloader = _step(name, ActivationOffloader(min_bytes=0), idx, doc_ids)
    assert torch.equal(loss, off_loss)
    assert grads.keys() == off_grads.keys()
    for n, g in grads.items():
        assert torch.equal(g, off_grads[n]), n
    block_input = B * T * cfg.n_embd * 4  # [B, T, h] float32; the documents are no tensor the checkpoint saves
    stats = offloader.stats
    assert stats.offloaded_bytes == stats.fetched_bytes == cfg.n_layer * block_input
    assert stats.peak_host_bytes == cfg.n_layer * block_input  # every block's input on the host after the forward
    assert stats.host_bytes == 0  # all released once the backward is done
    assert stats.kept_bytes == 0
    assert (stats.fetched_on_demand, stats.prefetched) == (1, cfg.n_layer - 1)  # the last block only on demand


class _Recording(ActivationOffloader):
    """Records, per fetch, the forward index of the block fetched, whether ahead of its unpack, and the block
    whose unpack started it."""

    def __init__(self) -> None:
        super().__init__(min_bytes=0)
        self.order: list = []  # groups in forward order, as the pack hook makes them
        self.fetches: list[tuple[int, bool, int]] = []
        self._unpacking = None

    def saving(self):
        hooks = super().saving()
        pack = hooks.pack_hook

        def recording_pack(t):
            saved = pack(t)
            if saved.group not in self.order:
                self.order.append(saved.group)
            return saved

        hooks.pack_hook = recording_pack
        return hooks

    def _unpack(self, packed):
        self._unpacking = self.order.index(packed.group)
        return super()._unpack(packed)

    def _fetch(self, group, ahead: bool) -> None:
        self.fetches.append((self.order.index(group), ahead, self._unpacking))
        super()._fetch(group, ahead)


def test_the_backward_fetches_each_block_input_one_block_ahead():
    cfg = GPT2Config.from_name("gpt2-mini", dropout=0.0)  # 4 blocks
    torch.manual_seed(0)
    model = GPT2(cfg)
    offloader = _Recording()
    checkpoint_activations(model, "full", offload=offloader)
    idx = torch.randint(0, cfg.vocab_size, (2, 8))
    model(idx, idx).backward()
    # block 3 (the first the backward reaches) on demand; then at block i's unpack the fetch of block i-1
    assert offloader.fetches == [(3, False, 3), (2, True, 3), (1, True, 2), (0, True, 1)]


def test_a_retained_graph_keeps_the_host_copies_and_its_second_backward_fetches_again():
    cfg = GPT2Config.from_name("gpt2-tiny", dropout=0.0)
    idx = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(2))
    grads = {}
    for offload in (False, ActivationOffloader(min_bytes=0)):
        torch.manual_seed(0)
        model = GPT2(cfg)
        checkpoint_activations(model, "full", offload=offload)
        loss = model(idx, idx)
        loss.backward(retain_graph=True)
        held = offload.stats.host_bytes if offload else None  # the retained graph still holds the host copies
        loss.backward()
        grads[bool(offload)] = [p.grad.clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))
    block_input = 2 * 8 * cfg.n_embd * 4
    stats = offload.stats
    assert held == cfg.n_layer * block_input
    assert stats.offloaded_bytes == cfg.n_layer * block_input
    assert stats.fetched_bytes == 2 * cfg.n_layer * block_input  # each backward fetches every input
    assert (stats.fetched_on_demand, stats.prefetched) == (2, 2 * (cfg.n_layer - 1))
    assert stats.host_bytes == 0  # the last backward freed the graph


def test_small_or_integer_tensors_stay_on_the_device_and_cpu_copies_use_no_streams():
    cfg = GPT2Config.from_name("gpt2-tiny", dropout=0.0)
    idx = torch.randint(0, cfg.vocab_size, (2, 8))
    _, _, offloader = _step("gpt2-tiny", True, idx)  # the default threshold: 1 MiB
    assert offloader.min_bytes == MIN_BYTES == 1 << 20
    assert offloader.stats.offloaded_bytes == 0 and offloader.stats.fetched_bytes == 0
    assert offloader.stats.kept_bytes == cfg.n_layer * 2 * 8 * cfg.n_embd * 4
    hooks_offloader = ActivationOffloader(min_bytes=0)
    x = torch.arange(6.0, requires_grad=True)
    with hooks_offloader.saving():
        y = (x * 2).sin()  # saves x * 2 (float): offloaded
        z = x[torch.tensor([1, 2])]  # saves the int64 index: kept
    (y.sum() + z.sum()).backward()
    assert hooks_offloader.stats.offloaded_bytes == hooks_offloader.stats.fetched_bytes == 6 * 4
    assert hooks_offloader.stats.kept_bytes == 2 * 8
    assert torch.equal(x.grad, 2 * torch.cos(2 * torch.arange(6.0)) + torch.tensor([0.0, 1, 1, 0, 0, 0]))
    assert not uses_streams(torch.device("cpu")) and uses_streams(torch.device("cuda", 0))


def test_offload_arguments_are_checked():
    model = GPT2(GPT2Config.from_name("gpt2-tiny"))
    with pytest.raises(ValueError, match="needs activation_checkpointing='full'.*got activation_checkpointing="
                                         "'selective'"):
        checkpoint_activations(model, "selective", offload=True)
    with pytest.raises(ValueError, match="needs activation_checkpointing='full'.*got activation_checkpointing='none'"):
        checkpoint_activations(model, "none", offload=True)
    with pytest.raises(ValueError, match="offload must be a bool or an ActivationOffloader, got 'yes'"):
        checkpoint_activations(model, "full", offload="yes")
    with pytest.raises(ValueError, match="min_bytes must be a non-negative int, got -1"):
        ActivationOffloader(min_bytes=-1)
    checkpoint_activations(model, "full")
    assert activation_offloader(model) is None
    checkpoint_activations(model, "full", offload=True)  # added to a checkpointed model
    offloader = activation_offloader(model)
    assert offloader is not None
    checkpoint_activations(model, "full", offload=True)  # once
    checkpoint_activations(model, "full")  # and kept
    assert activation_offloader(model) is offloader
    assert all(b.forward.recomputes.__self__ is b for b in model.transformer.h)  # one wrapper, around the forward


@pytest.mark.parametrize("strategy_class", [tp.TP2DStrategy, TP2DFabricStrategy])
def test_strategies_take_activation_offload_and_refuse_what_it_cannot_run_with(strategy_class):
    with pytest.warns(UserWarning, match="activation_offload=True needs full activation checkpointing: using "
                                         "activation_checkpointing='full'"):
        strategy = strategy_class(layout="metp", activation_offload=True)
    assert (strategy.activation_checkpointing, strategy.activation_offload) == ("full", True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy = strategy_class(layout="metp", activation_checkpointing="full", activation_offload=True)
    assert (strategy.activation_checkpointing, strategy.activation_offload) == ("full", True)
    assert strategy_class(layout="metp").activation_offload is False
    with pytest.raises(ValueError, match="activation_offload=True with activation_checkpointing='selective' is not "
                                         "supported"):
        strategy_class(layout="2d", activation_checkpointing="selective", activation_offload=True)
    with pytest.raises(ValueError, match="compile with activation_offload=True is not supported"):
        strategy_class(layout="metp", activation_checkpointing="full", activation_offload=True, compile="aot_eager")
    with pytest.raises(ValueError, match="activation_offload must be True or False, got 'yes'"):
        strategy_class(layout="metp", activation_offload="yes")


class _Planned(Exception):
    pass


def test_auto_layout_keeps_activation_offload_and_plans_full_checkpointing_only(monkeypatch):
    strategy = tp.TP2DStrategy(layout="auto", activation_offload=True, memory_gib=1.0,
                               plan_options={"checkpointing": ("none", "selective", "full")})
    assert (strategy.activation_checkpointing, strategy.activation_offload) == ("none", True)  # the plan decides
    asked = {}

    def plan(config, **kwargs):  # the planner's arguments, without its minute of tracing
        asked.update(kwargs)
        raise _Planned

    monkeypatch.setitem(sys.modules, "lightning_tp2d.planning.planner", types.SimpleNamespace(plan=plan))
    with pytest.raises(_Planned):
        strategy._plan(GPT2Config.from_name("gpt2-tiny"), 1.0, 4, 1)
    assert asked["checkpointing"] == ("full",)  # offload runs on full checkpointing only
    with pytest.raises(ValueError, match=r"plan_options\['checkpointing'\]=\['none', 'selective'\] leaves 'full' out"):
        tp.TP2DStrategy(layout="auto", activation_offload=True, plan_options={"checkpointing": ("none", "selective")})


def test_hydra_parallel_groups_pass_activation_offload():
    from hydra.utils import instantiate

    from tests.test_conf import composed

    assert composed("parallel=metp").parallel.activation_offload is False
    for option in ("metp", "tp2d", "tp2d_metp"):
        strategy = instantiate(composed(f"parallel={option}", "parallel.activation_checkpointing=full",
                                        "parallel.activation_offload=true").parallel)
        assert (strategy.activation_checkpointing, strategy.activation_offload) == ("full", True), option
    assert instantiate(composed("parallel=auto", "parallel.activation_offload=true").parallel).activation_offload


def _ring_compare(rank: int, world_size: int) -> dict:
    out = {}
    B, T = 2, 16
    for name in sorted(MODELS):
        model_class, cfg = _config(name)
        idx = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(1))
        runs = {}
        for offload in (False, True):
            torch.manual_seed(0)
            model = tp.parallelize(model_class(cfg).double(), tp.init_mesh("metp", world_size, 1), "metp")
            checkpoint_activations(model, "full", offload=ActivationOffloader(min_bytes=0) if offload else False)
            loss = model(idx, idx)
            loss.backward()
            runs[offload] = (loss.item(), {n: p.grad.to_local().clone() for n, p in model.named_parameters()},
                             activation_offloader(model))
        (loss, grads, _), (off_loss, off_grads, offloader) = runs[False], runs[True]
        out[name] = {"losses": (loss, off_loss), "stats": offloader.stats, "n_layer": cfg.n_layer,
                     "block_input": B * (T // world_size) * cfg.n_embd * 8,  # this rank's zigzag chunks, float64
                     "equal": [n for n, g in grads.items() if torch.equal(g, off_grads[n])], "names": sorted(grads)}
    # the strategies' path: the core parallelizes the model inside a module and applies its checkpointing and offload
    model_class, cfg = _config("gpt2-tiny")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "activation_offload=True needs full activation checkpointing"
        strategy = TP2DFabricStrategy(layout="metp", activation_offload=True)
    strategy._run_plan = strategy._plan_of(world_size, 1)  # what setup_environment resolves and builds
    strategy._mesh = tp.init_mesh("metp", world_size, 1)
    torch.manual_seed(0)
    module = torch.nn.ModuleDict({"model": model_class(cfg).double()})
    strategy.parallelize_models(module)
    idx = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(1))
    offloader = activation_offloader(module["model"])
    out["core"] = {"loss": module["model"](idx, idx).item(), "min_bytes": offloader and offloader.min_bytes}
    return out


def test_offload_on_the_metp_ring_gives_the_same_losses_and_gradients():
    for rank, out in enumerate(run_distributed(_ring_compare, 2)):
        core = out.pop("core")
        assert core == {"loss": out["gpt2-tiny"]["losses"][0], "min_bytes": MIN_BYTES}, rank
        for name, r in out.items():
            assert r["losses"][0] == r["losses"][1], (rank, name)
            assert sorted(r["equal"]) == r["names"], (rank, name)  # every gradient bit for bit
            stats = r["stats"]
            whole = r["n_layer"] * r["block_input"]
            assert stats.offloaded_bytes == stats.fetched_bytes == stats.peak_host_bytes == whole, (rank, name)
            assert stats.host_bytes == 0 and (stats.fetched_on_demand, stats.prefetched) == (1, r["n_layer"] - 1)
