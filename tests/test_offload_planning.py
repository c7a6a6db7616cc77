"""The planner's activation-offload dimension and its longest-sequence search, on analytic memory (no trace).

``offload_memory`` moves all but two block inputs of a fully checkpointed row to the host, never below the step's
resident state; ``offload_time`` exposes what a copy takes beyond the block compute it hides behind;
``longest_sequence`` finds the longest sequence that fits in a few evaluations of a (here linear) memory function and
names what stops it (the GPU, or the node's host memory under offload).
"""

from __future__ import annotations

import dataclasses

import pytest

from lightning_tp2d.planning import planner
from lightning_tp2d.planning.cost_model import H100_NVLINK4_NDR
from lightning_tp2d.families import model_config

GIB = 2**30
CFG = model_config("llama-3.1-8b")


def _linear(fixed_gib: float, per_token: float):
    """A row's parts whose peak is ``fixed + per_token * seq``, of which every block input is a part (as in a fully
    checkpointed step): the activations term holds n_layer block inputs."""
    def parts(seq: int) -> dict:
        inputs = CFG.n_layer * planner.block_input_bytes(CFG, 1, seq, 8)
        total = fixed_gib * GIB + per_token * seq + inputs
        return {"parameters": 4 * GIB, "gradients": 4 * GIB, "optimizer": 7 * GIB, "activations": inputs,
                "total": total}
    return parts


def test_offload_moves_all_but_two_block_inputs_and_counts_the_host():
    parts = _linear(16, 20_000)(1 << 20)
    one = planner.block_input_bytes(CFG, 1, 1 << 20, 8)
    assert one == (1 << 20) * 4096 * 2 / 8  # bf16 [T/p, h]
    moved = planner.offload_memory(parts, CFG, 1, 1 << 20, 8, gpus_per_node=8)
    assert moved["offloaded"] == (CFG.n_layer - planner.RESIDENT_BLOCK_INPUTS) * one
    assert moved["total"] == parts["total"] - moved["offloaded"]
    assert moved["host"] == CFG.n_layer * one and moved["host_per_node"] == 8 * moved["host"]
    # never below what the step holds without activations
    tiny = {"parameters": 4 * GIB, "gradients": 4 * GIB, "optimizer": 8 * GIB, "total": 17 * GIB}
    assert planner.offload_memory(tiny, CFG, 1, 1 << 20, 8, 8)["total"] == 16 * GIB


def test_offload_time_exposes_only_what_the_block_compute_does_not_hide():
    hw = H100_NVLINK4_NDR
    one = planner.block_input_bytes(CFG, 1, 1 << 20, 8) / hw.host_bytes_per_s
    hidden = planner.offload_time(CFG, 1, 1 << 20, 8, hw, forward_s=CFG.n_layer * 2 * one,
                                  backward_s=CFG.n_layer * 3 * one)
    assert hidden["exposed_s"] == 0 and hidden["copy_s"] == pytest.approx(2 * CFG.n_layer * one)
    slow = planner.offload_time(CFG, 1, 1 << 20, 8, hw, forward_s=CFG.n_layer * one / 2,
                                backward_s=CFG.n_layer * one / 4)
    assert slow["exposed_s"] == pytest.approx(CFG.n_layer * (one / 2 + 3 * one / 4))
    with pytest.raises(ValueError, match="host_bytes_per_s"):
        planner.offload_time(CFG, 1, 1024, 8, dataclasses.replace(hw, host_bytes_per_s=0.0), 1.0, 1.0)


def test_price_refuses_offload_without_full_checkpointing():
    with pytest.raises(ValueError, match="checkpointing='selective'"):
        planner.price(CFG, layout="metp", p=8, dp=1, zero_stage=0, checkpointing="selective", micro_batch=1,
                      grad_accum=1, seq=8192, hw=H100_NVLINK4_NDR, gpus_per_node=8, offload=True)


@pytest.mark.parametrize("offload", [False, True])
def test_longest_sequence_is_the_last_multiple_that_fits_and_says_what_limits_it(offload):
    fn = _linear(16, 20_000)
    multiple = 1024 * 16
    found = planner.longest_sequence(CFG, layout="metp", p=8, zero_stage=0, gpu_memory_gib=80,
                                     hw=H100_NVLINK4_NDR, offload=offload, memory_fn=fn, multiple=multiple)
    cap = 0.9 * 80 * GIB

    def held(seq):
        parts = fn(seq)
        return planner.offload_memory(parts, CFG, 1, seq, 8, 8)["total"] if offload else parts["total"]

    seq = found["seq"]
    assert seq % multiple == 0 and found["evaluations"] <= 8
    assert held(seq) <= cap
    if found["limit"] == "gpu":
        assert held(seq + multiple) > cap
    else:  # the node's host memory (2 TB, 90% of it) holds n_layer block inputs of each of its 8 GPUs
        per_node = lambda s: 8 * CFG.n_layer * planner.block_input_bytes(CFG, 1, s, 8)  # noqa: E731
        assert per_node(seq) <= 0.9 * H100_NVLINK4_NDR.host_memory_bytes < per_node(seq + multiple)
    if offload:
        without = planner.longest_sequence(CFG, layout="metp", p=8, zero_stage=0, gpu_memory_gib=80,
                                           hw=H100_NVLINK4_NDR, memory_fn=fn, multiple=multiple)
        assert seq > 2 * without["seq"]


def test_ulysses_rows_price_with_its_own_estimate_and_all_to_alls():
    """The Ulysses rival (ALST's schedule) is priced by the planner like cp: its memory is ``ulysses_peak_bytes``,
    its step the plain model's FLOPs over p plus TiledMLP's recomputation and 4 all-to-alls per block and pass,
    none hidden; offload applies the same rule as to every row."""
    from lightning_tp2d.planning import cost_model
    from lightning_tp2d.planning.rivals import ulysses_peak_bytes
    hw = H100_NVLINK4_NDR
    seq = 1 << 20
    row = planner.price(CFG, layout=planner.ULYSSES, p=8, dp=1, zero_stage=3, checkpointing="full", micro_batch=1,
                        grad_accum=1, seq=seq, hw=hw, gpus_per_node=8)
    assert row.memory_gib * GIB == ulysses_peak_bytes(CFG, 1, seq, 8, elem=2)["peak"]
    step = cost_model.ulysses_step_time(CFG, 1, seq, 8, hw)
    hs = CFG.n_embd // CFG.n_head
    rows = seq // 8
    per_block = [rows * w * 2 for w in (CFG.n_embd, 8 * hs, 8 * hs, CFG.n_embd)]
    assert step["comm_bytes"] == 3 * CFG.n_layer * sum(per_block)  # forward, recomputation, backward
    assert step["exposed_comm_s"] == step["comm_s"] > 0
    assert cost_model.collective_time("all_to_all", 8, 8e6, hw.intra) == pytest.approx(
        7 * (hw.intra.latency_s + 1e6 / hw.intra.bandwidth_Bps))
    plain = cost_model.cp_step_time(CFG, 1, seq, 8, hw, checkpointing="full")["flops"]
    assert step["flops"]["attention"] == plain["attention"]  # the same causal scores per GPU
    offloaded = planner.price(CFG, layout=planner.ULYSSES, p=8, dp=1, zero_stage=3, checkpointing="full",
                              micro_batch=1, grad_accum=1, seq=seq, hw=hw, gpus_per_node=8, offload=True)
    assert offloaded.activation_offload and offloaded.memory_gib < row.memory_gib
    with pytest.raises(ValueError, match="ALST's schedule"):
        planner.price(CFG, layout=planner.ULYSSES, p=8, dp=1, zero_stage=3, checkpointing="none", micro_batch=1,
                      grad_accum=1, seq=seq, hw=hw, gpus_per_node=8)


def test_longest_sequence_searches_past_lengths_where_the_peak_is_flat():
    """With offload a big model's peak sits on its parameter and optimizer floor at short lengths (70B on a ring of
    32): the search doubles past the flat part instead of failing, and still finds the last multiple that fits."""
    def parts(seq: int) -> dict:
        inputs = CFG.n_layer * planner.block_input_bytes(CFG, 1, seq, 8)
        return {"parameters": 20 * GIB, "gradients": 20 * GIB, "optimizer": 25 * GIB, "activations": inputs,
                "total": 65 * GIB + 6_000 * seq + inputs}

    multiple = 1024 * 16
    found = planner.longest_sequence(CFG, layout="metp", p=8, zero_stage=0, gpu_memory_gib=80, hw=H100_NVLINK4_NDR,
                                     offload=True, memory_fn=parts, multiple=multiple)
    held = lambda s: planner.offload_memory(parts(s), CFG, 1, s, 8, 8)["total"]  # noqa: E731
    assert held(found["seq"]) <= 72 * GIB < held(found["seq"] + multiple)


def test_cp_rows_price_the_chunked_loss_unless_asked_for_the_unfused_one():
    """cp is priced as users run it, with a chunked loss; calibration against torchtitan's published rows asks for
    the unfused loss those runs computed (its float32 log-softmax of [T/p, V] sets the peak)."""
    hw = H100_NVLINK4_NDR
    rows = {loss: planner.price(CFG, layout=planner.CP, p=8, dp=1, zero_stage=3, checkpointing="full", micro_batch=1,
                                grad_accum=1, seq=262144, hw=hw, gpus_per_node=8, cp_loss=loss)
            for loss in ("chunked", "unfused")}
    assert rows["chunked"].memory_gib < 30 < 70 < rows["unfused"].memory_gib
    assert rows["chunked"].step_s > rows["unfused"].step_s  # the chunks' logits are recomputed in the backward
