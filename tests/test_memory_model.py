"""The memory model (:mod:`lightning_tp2d.bench.memory_model`) against the measured peak of real steps on 4 gloo
ranks: every case's predicted peak per rank within 10% of the largest rank's measured one.

The grid, on one group of 4 ranks: GPT-2 and Llama (width 192, 2 blocks, vocabulary 512), METP ring 2 x dp 2 at
ZeRO stages 0 and 3 and the 2x2 grid ("2d", p 4, dp 1) at stage 0, each with activation checkpointing none and
full, and selective on the ring at stage 0 and the grid. The measured step is
``recipes/benchmarks/zero_stages.py``'s (a warm-up step first, then zero_grad, forward,
backward, data-parallel averaging, clipping, AdamW's step): resident bytes plus the peak of
:class:`~lightning_tp2d.bench.measure.LiveTensorBytes` with ``count_resizes``.
"""

from __future__ import annotations

import pytest
import torch

import lightning_tp2d as tp
from lightning_tp2d import fsdp, training
from lightning_tp2d.bench.measure import LiveTensorBytes, resident_bytes
from lightning_tp2d.bench.memory_model import peak_bytes
from lightning_tp2d.models import GPT2, GPT2Config, Llama, LlamaConfig
from lightning_tp2d.parallelize import checkpoint_activations
from tests.distributed import run_distributed

BATCH, SEQ, WORLD = 4, 64, 4
MODELS = {
    "gpt2": (GPT2, GPT2Config.from_name("gpt2-tiny", n_layer=2, n_embd=192, n_head=4, vocab_size=512,
                                        block_size=SEQ, dropout=0.0)),
    "llama": (Llama, LlamaConfig.from_name("llama-tiny", n_layer=2, n_embd=192, n_head=4, n_kv_head=2,
                                           intermediate_size=512, vocab_size=512)),
}
# (model, layout, p, zero stage, checkpointing); dp = WORLD // p
CASES = [(name, layout, p, stage, ck) for name in MODELS for layout, p, stages in (("metp", 2, (0, 3)), ("2d", 4, (0,)))
         for stage in stages for ck in ("none", "full")]
CASES += [(name, layout, p, 0, "selective") for name in MODELS for layout, p in (("metp", 2), ("2d", 4))]


def _measure_cases(rank: int, world_size: int, cases) -> list[int]:
    """Each case's measured peak on this rank: resident bytes before the step plus the step's live peak."""
    meshes, peaks = {}, []
    for name, layout, p, stage, ck in cases:
        model_class, cfg = MODELS[name]
        mesh = meshes.setdefault(layout, tp.init_mesh(layout, p, world_size // p))  # one mesh object per layout
        torch.manual_seed(0)
        with torch.device("meta"):
            model = model_class(cfg)
        tp.parallelize(model, mesh, layout)
        checkpoint_activations(model, ck)
        if stage >= 2:
            fsdp.shard_data_parallel(model, stage)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        sync = training.GradientSync(model, mesh) if stage < 2 else None
        torch.manual_seed(1 + rank)
        idx = torch.randint(0, cfg.vocab_size, (BATCH, SEQ))

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            model(idx, idx).backward()
            if sync is not None:
                sync.finish()
                training.clip_grad_norm_(list(model.parameters()), 1.0, mesh)
            else:
                fsdp.clip_grad_norm_(model.parameters(), 1.0, mesh)
            optimizer.step()

        step()  # warm-up: the optimizer state and FSDP's lazy init exist after it
        optimizer.zero_grad(set_to_none=True)
        before = resident_bytes(model, optimizer)
        tracker = LiveTensorBytes(record_shapes=False, count_resizes=True)
        with tracker:
            step()
        peaks.append(before + tracker.peak)
        del model, optimizer, sync
    return peaks


@pytest.fixture(scope="module")
def measured() -> dict:
    per_rank = run_distributed(_measure_cases, WORLD, CASES, timeout=600)
    return {case: max(rank[i] for rank in per_rank) for i, case in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_predicted_peak_within_10_percent_of_measured(measured, case):
    name, layout, p, stage, ck = case
    predicted = peak_bytes(layout, MODELS[name][1], BATCH, SEQ, p, dp=WORLD // p, zero_stage=stage,
                           checkpointing=ck)
    assert predicted["total"] == pytest.approx(measured[case], rel=0.10), (predicted, measured[case])


def test_parts_follow_the_zero_stage():
    """Stage 3 on dp 2 holds half the tensor shard at rest (plus what FSDP leaves whole) and AdamW's two moments of
    it; stage 1 keeps the parameters whole and halves the optimizer state; both see the same traced activations."""
    cfg = MODELS["gpt2"][1]
    s0 = peak_bytes("metp", cfg, BATCH, SEQ, 2, dp=2, zero_stage=0)
    s1 = peak_bytes("metp", cfg, BATCH, SEQ, 2, dp=2, zero_stage=1)
    s3 = peak_bytes("metp", cfg, BATCH, SEQ, 2, dp=2, zero_stage=3)
    assert s1["parameters"] == s0["parameters"] and s1["optimizer"] == s0["optimizer"] // 2
    assert s0["parameters"] / 2 <= s3["parameters"] < 0.6 * s0["parameters"]
    assert s3["optimizer"] == 2 * s3["parameters"] and s0["optimizer"] == 2 * s0["parameters"]
    assert s0["activations"] == s1["activations"] == s3["activations"] > 0
    assert s0["gathered"] == 0 < s3["gathered"]


def test_checkpointing_modes_order_the_traced_activations_and_unknown_modes_are_refused():
    """Selective keeps less than none and more than full; full alone pays a block's recomputation."""
    cfg = MODELS["gpt2"][1]
    parts = {ck: peak_bytes("metp", cfg, BATCH, SEQ, 2, checkpointing=ck) for ck in ("none", "selective", "full")}
    assert parts["none"]["activations"] > parts["selective"]["activations"] > parts["full"]["activations"] > 0
    assert parts["full"]["backward"] > parts["selective"]["backward"] == parts["none"]["backward"]
    with pytest.raises(ValueError, match="checkpointing='some'"):
        peak_bytes("metp", cfg, BATCH, SEQ, 2, checkpointing="some")
