"""The grid layouts' closed-form peak memory (:func:`lightning_tp2d.planning.closed_memory_grid.grid_peak_bytes`)
against the traced memory model (:func:`lightning_tp2d.planning.memory_model.peak_bytes`, fake steps profiled phase
by phase) on small configurations: ``"2d"`` and ``"2d-metp"``, both families (Llama's head tied and untied), grids of side 2 and 3, ZeRO stages 0
to 3 (FSDP2 over two replicas at 2 and 3), checkpointing none, selective and full, bf16 autocast with AdamW's fused
step, rank 0. Each case is picked so that a different moment peaks (the last block's MLP backward, the loss's
backward, the ring attention's backward, a block's forward run again under full checkpointing, the optimizer's
all-gather after the step; under FSDP the last block's MLP backward beside its rebuilt activation (selective),
block 0's ring attention and MLP backward beside the held reduce-scatter input, the root's reduce-scatter); the
vocabulary (257) does not divide by the side. The traced references are shared by the module's fixture."""

from __future__ import annotations

import dataclasses
import time

import pytest

from lightning_tp2d.families import model_config
from lightning_tp2d.planning import memory_model
from lightning_tp2d.planning.closed_memory import closed_form_problem, closed_peak_bytes
from lightning_tp2d.planning.closed_memory_grid import grid_peak_bytes

# (layout, model, blocks, batch, seq, p, checkpointing, dp, zero stage)
CASES = [
    ("2d", "llama-tiny", 2, 2, 128, 4, "none", 1, 0),  # the last block's MLP backward
    ("2d", "gpt2-tiny", 2, 2, 128, 4, "none", 1, 0),  # the loss's backward (GELU, tied head, positions)
    ("2d-metp", "gpt2-tiny", 2, 1, 128, 4, "none", 1, 0),  # the loss's backward; the ring attention's backward
    ("2d-metp", "llama-tiny", 2, 1, 128, 4, "full", 2, 1),  # stage 1's all-gather; the streamed column
    ("2d", "llama-tiny", 2, 3, 192, 9, "full", 1, 0),  # a 3x3 grid: the recomputed forward, gathered column
    # FSDP2 over dp=2 (stages 2 and 3: dp shards, bf16 groups and gradients)
    ("2d", "llama-tiny", 2, 2, 128, 4, "selective", 2, 3),  # the last block's MLP beside its rebuilt product
    ("2d-metp", "gpt2-tiny", 2, 1, 128, 4, "full", 2, 3),  # block 0's ring attention, the held reduce-scatter input
    ("2d-metp", "llama-tiny", 2, 1, 128, 4, "full", 2, 2),  # block 0's MLP beside every block gathered; the forward
    # run again in the forward phase
    ("2d", "llama-tiny@8192", 2, 2, 16, 4, "none", 2, 2),  # a vocabulary of 8192 at 16 tokens: the root's
    # reduce-scatter at the end of the backward; the head's backward in the forward phase
    # Llama with a tied head (as 3.2-1b / 3b): the mirrored head block, a recipe under "selective"
    ("2d", "llama-tiny+tied", 2, 2, 128, 4, "selective", 1, 0),
    ("2d-metp", "llama-tiny+tied", 2, 1, 128, 4, "selective", 2, 3),
]


def _config(name: str, blocks: int, seq: int):
    name, tied = name.removesuffix("+tied"), name.endswith("+tied")  # "name+tied": the named Llama, head tied
    name, _, vocab = name.partition("@")  # "name@V": the named size with a vocabulary of V
    base = model_config(name)
    base = dataclasses.replace(base, tie_embeddings=True) if tied else base
    if vocab:
        base = dataclasses.replace(base, vocab_size=int(vocab))
    return dataclasses.replace(base, n_layer=blocks, block_size=max(base.block_size, seq))


def _args(case) -> tuple:
    layout, name, blocks, batch, seq, p = case[:6]
    return layout, _config(name, blocks, seq), batch, seq, p


def _kwargs(case) -> dict:
    ck, dp, stage = case[6:]
    return dict(dp=dp, zero_stage=stage, checkpointing=ck, elem=2, fused=True)


@pytest.fixture(scope="module")
def traced() -> dict:
    return {case: memory_model.peak_bytes(*_args(case), rank=0, **_kwargs(case)) for case in CASES}


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_closed_total_within_2_percent_of_the_traced_and_parameters_and_optimizer_exact(traced, case):
    assert closed_form_problem(*_args(case), **_kwargs(case)) is None
    closed = grid_peak_bytes(*_args(case), rank=0, **_kwargs(case))
    reference = traced[case]
    assert closed["parameters"] == reference["parameters"]
    assert closed["gradients"] == reference["gradients"]
    assert closed["optimizer"] == reference["optimizer"]
    assert closed["activations"] == reference["activations"]  # the traced forward's saved tensors
    assert (closed["gathered"], closed["backward"]) == (reference["gathered"], reference["backward"])
    assert closed["step"] == max(closed["phases"].values())
    assert closed["total"] == closed["parameters"] + closed["optimizer"] + closed["step"]
    assert closed["total"] == pytest.approx(reference["total"], rel=0.02), (closed, reference)


def test_closed_forms_context_answers_grid_steps_from_the_closed_form_and_profiles_the_rest(traced):
    case = CASES[0]
    args, kwargs = _args(case), _kwargs(case)
    with memory_model.closed_forms():
        inside = memory_model.peak_bytes(*args, rank=0, **kwargs)
        with memory_model.closed_forms(False):
            off = memory_model.peak_bytes(*args, rank=0, **kwargs)
    assert "phases" in inside and "phases" not in off
    assert inside == closed_peak_bytes(*args, rank=0, **kwargs)  # closed_memory hands a grid over to this module
    assert inside["total"] == pytest.approx(traced[case]["total"], rel=0.02)
    assert off == traced[case]


def test_a_llama_8b_grid_step_is_answered_in_milliseconds():
    cfg = model_config("llama-3.1-8b")
    start = time.perf_counter()
    parts = grid_peak_bytes("2d", cfg, 2, 8192, 4, dp=2, zero_stage=1, checkpointing="full")
    assert time.perf_counter() - start < 1.0
    # parameters: 1/4 of every matrix, 1/2 of the norms, the vocabulary rows of block 0 (of 2) x h/2, float32
    h, inner, kv, V, L = 4096, 14336, 1024, 128256, 32
    block = (2 * h * h + 2 * kv * h + 3 * inner * h) // 4 + 2 * h // 2
    assert parts["parameters"] == 4 * (L * block + 2 * (V // 2) * (h // 2) + h // 2)
    assert parts["optimizer"] == parts["parameters"]  # two moments, halved by stage 1 over dp 2
    assert parts["activations"] > L * 1 * 8192 * (h // 2) * 2  # at least every block's input
    assert parts["step"] == max(parts["phases"].values())
    # stage 3 (FSDP2 over the same two replicas): half of every tensor shard at rest, gathered in bf16 the root's
    # and two blocks' tensor shards; the saved tensors are the trace's, as at stage 1
    sharded = grid_peak_bytes("2d", cfg, 2, 8192, 4, dp=2, zero_stage=3, checkpointing="full")
    assert 2 * sharded["parameters"] == parts["parameters"] and sharded["optimizer"] == 2 * sharded["parameters"]
    assert sharded["gathered"] == 2 * (2 * (V // 2) * (h // 2) + h // 2 + 2 * block)
    assert sharded["activations"] == parts["activations"] and sharded["step"] == max(sharded["phases"].values())


@pytest.mark.parametrize("change, words", [
    (dict(layout="metp"), "not a square grid"), (dict(zero_stage=3, dp=1), "zero_stage=3"),
    (dict(elem=4), "elem=4"), (dict(fused=False), "fused=False"),
    (dict(batch=3), "batch size 3"), (dict(p=8), "p=8"), (dict(layout="2d-metp", seq=66), "sequence length 66"),
])
def test_steps_outside_the_grid_closed_form_are_refused_naming_the_numbers(change, words):
    args = dict(layout="2d", cfg=model_config("llama-tiny"), batch=2, seq=64, p=4)
    args.update({k: v for k, v in change.items() if k in args})
    kwargs = {k: v for k, v in change.items() if k not in args}
    if args["layout"] != "metp":  # (the ring's refusals are closed_memory's)
        assert words in closed_form_problem(*args.values(), **kwargs)
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        grid_peak_bytes(*args.values(), **kwargs)
