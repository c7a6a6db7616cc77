"""The closed-form step (lightning_tp2d.planning.closed_step) against the traced one (planning.trace): the same
events, FLOPs, GEMM count and saved bytes on the ring -- GPT-2 and Llama (GQA or not, tied or untied head), float32
and bf16 autocast, every checkpointing mode, p 2/4/8, vocabularies the ring does not divide -- and the cost model's
step time under closed_forms()."""

import dataclasses

import pytest

from lightning_tp2d.layouts import get_layout
from lightning_tp2d.metp import RingOptions
from lightning_tp2d.models.gpt2 import GPT2Config
from lightning_tp2d.models.llama import LlamaConfig
from lightning_tp2d.planning import cost_model, trace
from lightning_tp2d.planning.closed_step import closed_step, models

GPT2 = GPT2Config(n_layer=3, n_head=8, n_embd=64, vocab_size=100, block_size=128)  # V = 100: uneven vocab blocks
GPT2_NO_BIAS = GPT2Config(n_layer=2, n_head=4, n_embd=48, vocab_size=97, block_size=64, bias=False)
LLAMA_GQA = LlamaConfig(vocab_size=101, n_layer=2, n_head=8, n_kv_head=2, n_embd=64, intermediate_size=96,
                        block_size=64)  # untied head; p = 4, 8: the last rank's vocab block is zero-padded
LLAMA_MHA = LlamaConfig(vocab_size=103, n_layer=3, n_head=8, n_kv_head=8, n_embd=64, intermediate_size=160,
                        block_size=64, tie_embeddings=True)  # I/p > h at p = 2: the MLP's wide hidden block
# (cfg, batch, seq, p, rank, elem, checkpointing)
GRID = [(GPT2, 1, 16, 2, 1, 4, "none"), (GPT2, 2, 32, 4, 3, 4, "selective"), (GPT2, 1, 64, 8, 5, 4, "full"),
        (GPT2, 1, 16, 2, 0, 2, "none"), (GPT2, 1, 32, 8, 7, 2, "selective"),
        (GPT2_NO_BIAS, 2, 16, 2, 0, 4, "full"), (GPT2_NO_BIAS, 1, 24, 4, 3, 2, "full"),
        (LLAMA_GQA, 1, 16, 2, 1, 2, "none"), (LLAMA_GQA, 2, 32, 4, 3, 4, "selective"),
        (LLAMA_GQA, 1, 32, 8, 7, 2, "full"), (LLAMA_GQA, 3, 16, 2, 0, 4, "full"),
        (LLAMA_GQA, 1, 32, 4, 2, 2, "selective"),
        (LLAMA_MHA, 1, 16, 2, 0, 4, "none"), (LLAMA_MHA, 2, 16, 2, 1, 2, "selective"),
        (LLAMA_MHA, 1, 32, 4, 3, 2, "none"), (LLAMA_MHA, 1, 32, 8, 6, 4, "selective")]


def _same_events(closed, traced) -> bool:
    """Equal event sets, the overlapped FLOPs to rounding (the tracer sums them op by op, in its own order)."""
    def key(item):
        ev, fm, fa, ranks = item
        return (ev.phase, ev.kind, ev.group, ev.group_size, ev.nbytes, ev.calls, ranks)

    if len(closed) != len(traced):
        return False
    for a, b in zip(sorted(closed, key=key), sorted(traced, key=key)):
        if key(a) != key(b) or any(x != pytest.approx(y, rel=1e-12, abs=1e-6)
                                   for x, y in zip((a[0].overlap_flops, a[1], a[2]), (b[0].overlap_flops, b[1], b[2]))):
            return False
    return True


@pytest.mark.parametrize("cfg,batch,seq,p,rank,elem,checkpointing", GRID)
def test_closed_step_equals_the_traced_step(cfg, batch, seq, p, rank, elem, checkpointing):
    assert models("metp", cfg, p, elem) is None
    with trace.ranks_as_asked():  # one rank traced, not the whole small ring
        traced = trace.trace_step("metp", cfg, batch, seq, p, elem, rank, checkpointing=checkpointing)
    closed = closed_step("metp", cfg, batch, seq, p, elem, rank, checkpointing=checkpointing)
    assert _same_events(closed.events, traced.events)  # kind, group, size, bytes, calls, phase, overlaps, ranks
    assert closed.flops == traced.flops
    assert closed.gemms == traced.gemms
    assert closed.activation_bytes == traced.activation_bytes  # exact: the same storages, counted as the tracer does
    assert closed.block_calls == traced.block_calls


def test_saved_bytes_grow_with_the_local_tokens_and_positions_as_derived():
    """Llama's RoPE tables are per local position (``S d``), not per token: one more sequence adds the per-token
    bytes only; the padded vocab block (float32) belongs to the short rank only."""
    def act(batch, rank=0, elem=4, cfg=LLAMA_GQA):
        return closed_step("metp", cfg, batch, 32, 4, elem, rank).activation_bytes

    one, two, three = act(1), act(2), act(3)
    assert two - one == three - two  # linear in the batch
    rope = LLAMA_GQA.n_layer * 2 * 8 * 8 * 4  # float32 cos and sin, [S = 8, d = 8], per block
    kv_block = LLAMA_GQA.n_layer * 2 * 2 * 8 * 64 // 4 * 4  # torch.cat([w_k, w_v]) per block
    assert one - (two - one) == rope + kv_block  # the batch-independent part
    vb = -(-101 // 4)
    assert act(1, rank=3) - act(1, rank=0) == vb * 64 * 4  # 101 = 3 * 26 + 23: rank 3's block is padded
    assert act(1, rank=3, elem=2) == act(1, rank=0, elem=2)  # bf16: every rank keeps its block's bf16 copy


def test_trace_steps_answers_in_closed_form_inside_the_context():
    with trace.closed_forms():
        step = trace.trace_step("metp", GPT2, 1, 16, 2, 4, 0)
        assert step == closed_step("metp", GPT2, 1, 16, 2, 4, 0)
        step = trace.trace_step("metp", LLAMA_GQA, 1, 16, 2, 2, 1, checkpointing="full")
        assert step == closed_step("metp", LLAMA_GQA, 1, 16, 2, 2, 1, checkpointing="full")
        tiled = get_layout("metp", RingOptions(tile_tokens=4))
        assert "ring options" in models(tiled, GPT2, 2, 4)
        traced = trace.trace_step(tiled, GPT2, 1, 16, 2, 4, 0)  # not modelled: traced as outside
    default = closed_step("metp", GPT2, 1, 16, 2, 4, 0)
    assert traced.flops == default.flops  # 4-row tiles of the 8 local rows compute the same FLOPs ...
    assert traced.gemms["forward"] > default.gemms["forward"]  # ... in more GEMMs (I/p = 128 > h = 64: tiled)


@pytest.mark.parametrize("cfg,elem,checkpointing", [(GPT2, 4, "none"), (GPT2, 4, "full"),
                                                    (LLAMA_GQA, 2, "selective")])
def test_step_time_under_closed_forms_matches_the_traced_one(cfg, elem, checkpointing):
    hw = cost_model.H100_NVLINK4_NDR
    args = ("metp", cfg, 2, 64, 4, hw, elem)
    with trace.ranks_as_asked():
        traced = cost_model.step_time(*args, checkpointing=checkpointing, ranks=[0, 1])
    with trace.closed_forms():
        closed = cost_model.step_time(*args, checkpointing=checkpointing, ranks=[0, 1])
    for key in ("compute_s", "comm_s", "exposed_comm_s", "total_s"):
        assert closed[key] == pytest.approx(traced[key], rel=0.02), key
    assert closed["comm_bytes"] == traced["comm_bytes"]


def test_what_is_not_modelled_is_refused_with_its_numbers():
    assert "ring options" in models(get_layout("metp", RingOptions(tile_tokens=4)), GPT2, 4, 4)
    assert "dp=2" in models("metp", GPT2, 4, 4, dp=2)
    assert "elem=8" in models("metp", GPT2, 4, 8)
    assert "p=3 does not split" in models("metp", LLAMA_GQA, 3, 2)
    assert models("metp", dataclasses.replace(LLAMA_GQA, n_kv_head=8), 8, 2) is None
    with pytest.raises(ValueError, match="p=3 does not split"):
        closed_step("metp", GPT2, 1, 36, 3, 4)
    with pytest.raises(ValueError, match="checkpointing='some'"):
        closed_step("metp", GPT2, 1, 16, 2, 4, checkpointing="some")
    with pytest.raises(ValueError, match="rank 4 is not in"):
        closed_step("metp", LLAMA_GQA, 1, 16, 4, 2, rank=4)
