"""``checkpoint_activations``: blocks recompute their forward in the backward, with the same gradients and less
memory alive between forward and backward, for every layout; the strategy and ``tp2d-train`` take it as an option."""

from __future__ import annotations

import pytest
import torch

import lightning_tp2d as tp
from lightning_tp2d.planning.live import LiveTensorBytes
from lightning_tp2d.models import GPT2, GPT2Config
from lightning_tp2d.parallelize import checkpoint_activations
from tests.distributed import run_distributed


def _compare(rank: int, world_size: int, layout: str) -> dict:
    cfg = GPT2Config.from_name("gpt2-tiny", n_head=4, dropout=0.0)
    idx = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    out = {}
    for mode in ("none", "full", "selective"):
        torch.manual_seed(0)
        model = tp.parallelize(GPT2(cfg).double(), tp.init_mesh(layout, world_size, 1), layout)
        checkpoint_activations(model, mode)
        checkpoint_activations(model, mode)  # idempotent
        with LiveTensorBytes(record_shapes=False) as live:
            loss = model(idx, idx)
            kept = live.live
        loss.backward()
        out[mode] = {"loss": loss.item(), "kept": kept,
                     "grads": {n: p.grad.to_local().clone() for n, p in model.named_parameters()}}
    result = {}
    for mode in ("full", "selective"):
        diff = max((out["none"]["grads"][n] - g).abs().max().item() for n, g in out[mode]["grads"].items())
        result[mode] = {"loss": out[mode]["loss"], "grad_diff": diff, "kept": out[mode]["kept"]}
    result["none"] = {"loss": out["none"]["loss"], "kept": out["none"]["kept"]}
    return result


@pytest.mark.parametrize("layout, world_size", [("2d", 4), ("metp", 2), ("2d-metp", 4)])
def test_checkpointing_gives_the_same_gradients_and_keeps_less(layout, world_size):
    for rank, out in enumerate(run_distributed(_compare, world_size, layout)):
        none, full, selective = out["none"], out["full"], out["selective"]
        assert none["loss"] == full["loss"] == selective["loss"], rank
        assert full["grad_diff"] <= 1e-12, (rank, full["grad_diff"])
        assert selective["grad_diff"] == 0.0, (rank, selective["grad_diff"])  # the same arithmetic, recomputed
        assert full["kept"] < 0.6 * none["kept"], (rank, out)
        # selective drops every LayerNorm and GELU output (and the grid layouts' mirrored head block)
        assert full["kept"] < selective["kept"] < 0.9 * none["kept"], (rank, out)


def test_bad_mode_is_refused_naming_the_choices():
    model = GPT2(GPT2Config.from_name("gpt2-tiny"))
    with pytest.raises(ValueError, match="activation_checkpointing='partial' is not one of 'none', 'selective', 'full'"):
        checkpoint_activations(model, "partial")
    checkpoint_activations(model, "selective")
    with pytest.raises(ValueError, match="already uses activation_checkpointing='selective'; cannot also apply 'full'"):
        checkpoint_activations(model, "full")
    with pytest.raises(ValueError, match="activation_checkpointing='yes' is not one of"):
        tp.TP2DStrategy(activation_checkpointing="yes")
    plain = GPT2(GPT2Config.from_name("gpt2-tiny"))
    checkpoint_activations(plain, "full")  # works on the plain model too, with its own gradients
    idx = torch.randint(0, 257, (2, 8))
    plain(idx, idx).backward()
    assert all(p.grad is not None for p in plain.parameters())
