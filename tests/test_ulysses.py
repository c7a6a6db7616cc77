"""Ulysses + ALST with DeepSpeed's own code (:mod:`lightning_tp2d.baselines.ulysses`): equal to the plain Llama on 4 gloo
ranks, the head-count rules, the analytic peak against the measured one, and the bench scenario. One spawned group
of 4 ranks serves the parity and memory tests; tests that run DeepSpeed are skipped when it is not installed."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from lightning_tp2d.baselines import ulysses
from lightning_tp2d.planning import rivals
from lightning_tp2d.planning.live import LiveTensorBytes, resident_bytes
from lightning_tp2d.bench.runner import BenchSpec, check_scenario, input_multiples, run_scenario
from lightning_tp2d.models import Llama, LlamaConfig
from tests.distributed import run_distributed

WORLD, B = 4, 1
# the brief's small Llama: GQA 8 query / 4 key-value heads, Llama 2's vocabulary
CFG = LlamaConfig(vocab_size=32000, n_layer=4, n_head=8, n_kv_head=4, n_embd=256, intermediate_size=512,
                  block_size=1024)
SEQ = 1024
# memory: a small vocabulary and a longer sequence, so the activations (not the embedding) carry the peak
MEM_CFG = LlamaConfig(**{**CFG.__dict__, "vocab_size": 2048, "block_size": 4096})
MEM_SEQ = 4096
TILE = 4 << 20  # loss tile bytes (ALST's 1 GiB would be one tile here)

needs_deepspeed = pytest.mark.skipif(ulysses.deepspeed_problem() is not None,
                                     reason=str(ulysses.deepspeed_problem()))


def _batch(cfg, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, cfg.vocab_size, (B, seq + 1), generator=torch.Generator().manual_seed(seq))
    return data[:, :-1].clone(), data[:, 1:].clone()


def _ranks(rank: int, p: int) -> dict:
    out = {}
    # parity: loss and every gradient against the plain model on the whole sequence, uneven ignored targets
    torch.manual_seed(0)
    plain = Llama(CFG)
    idx, targets = _batch(CFG, SEQ)
    targets[0, :37] = -100
    expected = plain(idx, targets)
    expected.backward()
    lm = ulysses.build_ulysses(plain, p, B, SEQ, loss_tile_bytes=TILE)
    with ulysses.ulysses_attention(lm, p, B, SEQ) as group:
        out["sp_size"] = dist.get_world_size(group)
        loss = ulysses.sequence_loss(lm, idx, targets, rank, p)
        loss.backward()
        out["loss"], out["expected"] = ulysses.mean_loss(loss, p).item(), expected.item()
        ref = dict(plain.named_parameters())
        out["grads"] = {n: ((q.grad.full_tensor() - ref[n.removeprefix("hf.")].grad).norm()
                            / ref[n.removeprefix("hf.")].grad.norm()).item() for n, q in lm.named_parameters()}
    # memory: a warm-up step, then the measured one (as runner.measure_rank measures)
    torch.manual_seed(0)
    lm = ulysses.build_ulysses(Llama(MEM_CFG), p, B, MEM_SEQ, loss_tile_bytes=TILE)
    optimizer = torch.optim.AdamW(lm.parameters(), lr=1e-4)
    idx, targets = _batch(MEM_CFG, MEM_SEQ)
    with ulysses.ulysses_attention(lm, p, B, MEM_SEQ):
        for measured in (False, True):
            optimizer.zero_grad(set_to_none=True)
            resident = resident_bytes(lm, optimizer)
            tracker = LiveTensorBytes(base=resident, record_shapes=False, count_resizes=True)
            dist.barrier()
            with tracker if measured else contextlib.nullcontext():
                ulysses.sequence_loss(lm, idx, targets, rank, p).backward()
                optimizer.step()
        out["peak"] = resident + tracker.peak
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_ranks, WORLD, timeout=300)


def test_head_and_sequence_rules_name_the_numbers():
    with pytest.raises(ValueError, match=r"p=3 must divide the query head count n_head=8"):
        rivals.check_ulysses(CFG, 3, 1020)
    with pytest.raises(ValueError, match=r"n_kv_head=6 and p=4"):
        rivals.check_ulysses(LlamaConfig(**{**CFG.__dict__, "n_head": 12, "n_kv_head": 6, "n_embd": 384}), 4, 64)
    with pytest.raises(ValueError, match=r"sequence length 1022 is not divisible by .* p=4"):
        rivals.check_ulysses(CFG, 4, 1022)
    rivals.check_ulysses(CFG, 8, 64)  # p = 8 > 4 K/V heads: DeepSpeed replicates each K/V head twice
    assert rivals.local_kv_heads(CFG, 8) == 1 and rivals.local_kv_heads(CFG, 2) == 2
    # llama-tiny: 12 query heads, 6 key/value heads: 4 ranks fit neither rule
    assert "n_kv_head=6 and p=4" in check_scenario("ulysses", 4, BenchSpec(model="llama-tiny"), 1, 64)
    assert "runs transformers' LlamaForCausalLM" in check_scenario("ulysses", 2, BenchSpec(), 1, 64)
    assert input_multiples("ulysses", 4) == (1, 4)


def test_estimate_names_its_parts():
    est = rivals.ulysses_peak_bytes(CFG, 1, 131072, 8, elem=2)
    assert set(est["parts"]) == {"states", "gathered_root", "root_grads", "gathered_blocks", "checkpoints", "block",
                                 "mlp_tile", "loss_tile"}
    # offload keeps two checkpointed block inputs of four
    off = rivals.ulysses_peak_bytes(CFG, 1, 131072, 8, elem=2, offload=True)
    assert off["parts"]["checkpoints"] * 2 == est["parts"]["checkpoints"]
    assert est["largest_bytes"] == max(2 * 131072 // 8 * 256 * 4, 4 * 32000 * 256,
                                       4 * -(-(131072 // 8) // est["loss_tiles"]) * 32000, 2 * 131072 * 256)
    with pytest.raises(ValueError, match="checkpointing='full'"):
        rivals.ulysses_peak_bytes(CFG, 1, 1024, 4, checkpointing="none")


@needs_deepspeed
def test_matches_the_plain_model(ranks):
    for r in ranks:
        assert r["sp_size"] == WORLD
        assert r["loss"] == pytest.approx(r["expected"], rel=1e-5)
        assert max(r["grads"].values()) < 1e-5, max(r["grads"].items(), key=lambda kv: kv[1])


@needs_deepspeed
def test_estimate_within_15_percent_of_measured_peak(ranks):
    est = rivals.ulysses_peak_bytes(MEM_CFG, B, MEM_SEQ, WORLD, elem=4, loss_tile_bytes=TILE)
    peak = max(r["peak"] for r in ranks)
    assert abs(est["peak"] - peak) / peak < 0.15, (est, peak)


@needs_deepspeed
def test_bench_scenario_runs():
    spec = BenchSpec(model="llama-tiny", overrides={"n_head": 8, "n_kv_head": 4}, batch=1, seq=64, steps=1,
                     warmup=1, timeout=240)
    row = run_scenario("ulysses", WORLD, spec)
    assert row["status"] == "ok", row
    single = run_scenario("single", 1, spec)
    assert row["loss"] == pytest.approx(single["loss"], rel=1e-5)
    assert row["peak_bytes"] > row["resident_bytes"] > 0
