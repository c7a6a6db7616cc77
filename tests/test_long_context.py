"""Long context in the ring layouts ("metp", "2d-metp"), Llama-shaped: activation checkpointing of the ring blocks
(same gradients, fewer saved bytes, the ring's exchanges run once more per block in the backward), the audit that
a training step at T = 262144 never makes a ``[T, T]`` tensor nor one with a sequence-sized and a vocabulary-sized
dim (torch's fake process group, fake tensors: shapes only), tp2d-bench's scenarios unbounded by a RoPE model's
``block_size``, and the error a sequence that does not divide ``2p`` raises (the nearest lengths that do)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

import lightning_tp2d as tp
from lightning_tp2d.bench import runner
from lightning_tp2d.planning.live import LiveTensorBytes
from lightning_tp2d.bench.runner import BenchSpec, check_scenario
from lightning_tp2d.planning.trace import drop_fake_group, fake_group, fake_mesh, in_worker
from lightning_tp2d.comm_record import count_comm
from lightning_tp2d.families import family_of, model_config
from lightning_tp2d.layouts import GridRing, Ring, get_layout
from lightning_tp2d.models import Llama, LlamaConfig
from lightning_tp2d.models.documents import Documents
from lightning_tp2d.parallelize import checkpoint_activations, parallelize
from tests.distributed import run_distributed

# small width, GQA (4 query heads on 2 key/value heads), SwiGLU; vocabulary and sizes told apart from every T below
SMALL = dict(n_layer=2, n_embd=64, n_head=4, n_kv_head=2, intermediate_size=96, vocab_size=1000)
LONG_T = 262144


def _count_block_forwards(model, stats: list) -> None:
    """Count the communication of every block's forward call (``stats``: one ``CommStats`` per call)."""
    for block in family_of(model).block_modules(model):
        contexts = []

        def enter(module, args, contexts=contexts):
            contexts.append(count_comm())
            stats.append(contexts[-1].__enter__())

        def leave(module, args, out, contexts=contexts) -> None:  # returns None: the block's output stays
            contexts.pop().__exit__(None, None, None)

        block.register_forward_pre_hook(enter)
        block.register_forward_hook(leave)


def _checkpointing(rank: int, world_size: int) -> dict:
    cfg = LlamaConfig.from_name("llama-tiny", **{**SMALL, "vocab_size": 257})
    idx = torch.randint(0, cfg.vocab_size, (1, 256), generator=torch.Generator().manual_seed(1))
    out = {}
    for layout in ("metp", "2d-metp"):
        for mode in ("none", "full", "selective"):
            torch.manual_seed(0)
            model = parallelize(Llama(cfg), tp.init_mesh(layout, world_size, 1), layout)
            blocks: list = []
            if mode == "none":
                _count_block_forwards(model, blocks)
            checkpoint_activations(model, mode)
            with LiveTensorBytes(record_shapes=False) as live:
                loss = model(idx, idx)
                kept = live.live
                with count_comm() as backward:
                    loss.backward()
            calls = lambda stats: {k: v["calls"] for k, v in stats.snapshot().items() if v["calls"]}  # noqa: E731
            grads = {n: q.grad.to_local() for n, q in model.named_parameters()}
            reference = grads if mode == "none" else reference
            out[layout, mode] = {"loss": loss.item(), "kept": kept, "backward": calls(backward),
                                 "blocks_forward": [calls(s) for s in blocks],
                                 "same_grads": all(torch.equal(reference[n], g) for n, g in grads.items())}
    out["logits_at"] = _logits_at_errors(cfg, idx, world_size)
    return out  # plain numbers: tensors would travel as shared memory that a finished rank takes with it


def _logits_at_errors(cfg: LlamaConfig, idx: torch.Tensor, world_size: int) -> dict:
    """Per layout (and the plain model), the largest difference between ``model(idx, logits_at=t)`` and the full
    logits at ``t``, over positions in different zigzag chunks (and one from the end), and the returned shape."""
    torch.manual_seed(0)
    plain = Llama(cfg).eval()
    idx = idx.repeat(2, 1)  # "2d" splits the batch over the grid's 2 rows
    errors = {}
    for layout in (None, "2d", "metp", "2d-metp"):
        model = plain if layout is None else parallelize(copy.deepcopy(plain), tp.init_mesh(layout, world_size, 1),
                                                         layout)
        with torch.no_grad():
            full = model(idx)
            picked = {t: model(idx, logits_at=t) for t in (0, 37, 100, 200, 255, -3)}
        errors[layout] = (max((full[:, t] - y[:, 0]).abs().max().item() for t, y in picked.items()),
                          {tuple(y.shape) for y in picked.values()})
    return errors


@pytest.fixture(scope="module")
def ring_runs() -> list:
    """One spawned group of 4 ranks for this file's multi-rank checks (:func:`_checkpointing`)."""
    return run_distributed(_checkpointing, 4)


def test_logits_at_one_position_equals_that_position_of_the_full_logits_in_every_layout(ring_runs):
    """Llama (untied head), T = 256: ``logits_at=t`` gives ``[B, 1, V]`` equal to the full logits at ``t`` (to
    float32 rounding: one row's product instead of all rows') on one device, "2d", "metp" and "2d-metp" (4 ranks);
    with targets, or outside ``[-T, T)``, it is refused."""
    for out in ring_runs:
        for layout, (error, shapes) in out["logits_at"].items():
            assert error < 1e-5 and shapes == {(2, 1, 257)}, (layout, error, shapes)
    model = Llama(LlamaConfig.from_name("llama-tiny", **{**SMALL, "vocab_size": 257}))
    idx = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="pass targets or logits_at, not both"):
        model(idx, idx, logits_at=-1)
    with pytest.raises(ValueError, match=r"logits_at must be an int in \[-8, 8\) for a sequence of 8 tokens, got 8"):
        model(idx, logits_at=8)


def test_checkpointing_the_ring_blocks_keeps_the_gradients_saves_bytes_and_reruns_each_blocks_exchanges(ring_runs):
    """Llama on "metp" (ring of 4) and "2d-metp" (2 x 2): "full" and "selective" give bit-identical gradients;
    "full" keeps under a third of what the forward keeps for the backward without it, "selective" less than
    without; "full"'s backward makes exactly the communication calls of one more forward of every block (the
    ring's exchanges included) on top of the uncheckpointed backward's, "selective"'s none more."""
    for rank, out in enumerate(ring_runs):
        for layout in ("metp", "2d-metp"):
            none, full, selective = (out[layout, m] for m in ("none", "full", "selective"))
            assert none["loss"] == full["loss"] == selective["loss"], (rank, layout)
            assert full["same_grads"] and selective["same_grads"], (rank, layout)
            assert full["kept"] < 0.3 * none["kept"] and selective["kept"] < 0.9 * none["kept"], (rank, layout)
            assert len(none["blocks_forward"]) == SMALL["n_layer"]
            rerun = {k: sum(b.get(k, 0) for b in none["blocks_forward"]) for k in full["backward"]}
            assert rerun["ring_exchange"] > 0, (rank, layout, none["blocks_forward"])
            assert full["backward"] == {k: none["backward"].get(k, 0) + rerun[k] for k in full["backward"]}, (
                rank, layout, full["backward"], none["backward"], rerun)
            assert selective["backward"] == none["backward"], (rank, layout)
        # a ring block's forward: 5 weight-streaming / attention ring passes of p - 1 = 3 exchanges each
        assert out["metp", "none"]["blocks_forward"][0]["ring_exchange"] == 15, out["metp", "none"]["blocks_forward"]


# ---- the audit: no [T, T] and no [T, vocab] tensor at T = 262144 (fake process group, fake tensors) ------------


def _shapes_of_a_step(layout: str, p: int, rank: int, seq: int, starts: tuple[int, ...] | None = None) -> dict:
    """In a fake-group worker: every shape a training step (forward, backward) of the small Llama allocates on
    ``rank`` of ``layout`` at ``seq`` tokens, fake tensors only; and the error a sequence one token longer raises.
    ``starts``: packed documents starting there (host data: the fake ids are never read)."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # private: see lightning_tp2d._private_api

    fake_group(p, rank)
    try:
        mesh = fake_mesh(get_layout(layout), p, 1)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            model = parallelize(Llama(LlamaConfig.from_name("llama-tiny", **SMALL)), mesh, layout)
            model.validate_inputs = False  # fake ids cannot be read
            idx = torch.zeros(1, seq, dtype=torch.long)
            docs = None if starts is None else Documents(torch.zeros(1, seq, dtype=torch.long), (starts,))
            tracker = LiveTensorBytes(record_shapes=True, fake=mode)
            with tracker:
                loss = model(idx, idx, doc_ids=docs)
                loss.backward()
            grads = all(q.grad is not None for q in model.parameters())
            try:
                model(torch.zeros(1, seq + 1, dtype=torch.long), torch.zeros(1, seq + 1, dtype=torch.long))
                error = ""
            except ValueError as err:
                error = str(err)
        return {"shapes": sorted(set(tracker.shapes)), "peak": tracker.peak, "grads": grads, "error": error}
    finally:
        drop_fake_group()


@pytest.mark.parametrize("layout, rank", [("metp", 0), ("metp", 3), ("2d-metp", 1)])
def test_a_training_step_at_262144_tokens_makes_no_quadratic_and_no_full_vocabulary_tensor(layout, rank):
    """Ring of 4 / 2 x 2 grid, T = 262144, vocabulary 1000: no tensor has T*T elements or more, none has two dims
    of a zigzag chunk's length or more (the ``[T/p, T/p]`` scores of a ring block), and none has a dim of the chunk's
    length beside one of the vocabulary's (the full ``[T/p, V]`` logits; vocabulary blocks ``[T/p, V/p]`` stream);
    every parameter gets its gradient; T + 1 tokens are refused naming T and the next multiple of 2p (2q)."""
    p, T, V = 4, LONG_T, SMALL["vocab_size"]
    out = in_worker(_shapes_of_a_step, layout, p, rank, T)
    chunk = T // (2 * p)  # shorter than any sequence-sized dim a rank holds (a zigzag chunk of the ring of p)
    shapes = out["shapes"]
    assert shapes and out["grads"]
    assert max(torch.Size(s).numel() for s in shapes) < T * T
    assert not [s for s in shapes if sum(d >= chunk for d in s) >= 2], "quadratic in the sequence"
    assert not [s for s in shapes if any(d >= chunk for d in s) and any(d >= V for d in s if d < chunk)], "logits"
    side = get_layout(layout).side(p)  # the ranks a sequence is cut over: p on the ring, q on the grid's rows
    assert any(T // side in s for s in shapes), "no tensor of the rank's tokens: the step did not run at length T"
    # the largest tensor is linear in the rank's tokens: (T/side) x the widest of n_embd, intermediate_size, V/side
    widest = max(SMALL["n_embd"], SMALL["intermediate_size"], -(-V // side))
    assert max(torch.Size(s).numel() for s in shapes) <= T // side * widest
    multiple = get_layout(layout).input_multiples(p)[1]  # 2p on the ring, 2q on the grid
    assert f"sequence length {T + 1} is not divisible" in out["error"], out["error"]
    assert f"use {T} or {T + multiple}, the nearest multiples of {multiple}" in out["error"], out["error"]


@pytest.mark.parametrize("layout, rank", [("metp", 1), ("2d-metp", 2)])
def test_a_packed_training_step_at_262144_tokens_makes_no_tensor_of_a_chunk_pairs_size(layout, rank):
    """As above with packed documents whose starts fall inside zigzag chunks (so the ring cuts chunk pairs at
    them): no tensor has as many elements as one ``[c, c]`` chunk pair (``c = T/(2p)``), so no document mask
    exists, and the step holds no full-vocabulary tensor either."""
    p, T, V = 4, LONG_T, SMALL["vocab_size"]
    c = T // (2 * p)
    starts = (0, 1000, 3 * c + 5, 4 * c, 150000, 7 * c + 17)  # inside chunks 0, 3, 4 and 7; one on a chunk edge
    out = in_worker(_shapes_of_a_step, layout, p, rank, T, starts)
    shapes = out["shapes"]
    assert shapes and out["grads"]
    assert max(torch.Size(s).numel() for s in shapes) < c * c
    assert not [s for s in shapes if sum(d >= c for d in s) >= 2], "quadratic in the sequence"
    assert not [s for s in shapes if any(d >= c for d in s) and any(d >= V for d in s if d < c)], "logits"
    assert any(T // get_layout(layout).side(p) in s for s in shapes), "the step did not run at length T"


# ---- generation's prefill at T = 262144: one position's logits, never [T, V] ----------------------------------------


def _shapes_of_a_prefill(layout: str | None, p: int, rank: int, seq: int) -> dict:
    """Every shape one sampling step (:func:`~lightning_tp2d.module.sample`, greedy) of the small Llama allocates
    on ``rank`` of ``layout`` (``None``: the plain model, one device) from a ``seq``-token prompt, fake tensors only
    (the token-id checks, which read values, switched off); and the shape of what it returns."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # private: see lightning_tp2d._private_api

    from lightning_tp2d.module import sample

    if layout is not None:
        fake_group(p, rank)
    try:
        mesh = None if layout is None else fake_mesh(get_layout(layout), p, 1)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            model = Llama(LlamaConfig.from_name("llama-tiny", **SMALL))
            if layout is not None:
                model = parallelize(model, mesh, layout)
            prompt = torch.zeros(1, seq, dtype=torch.long)
            model.check_input = lambda idx, targets=None, values=None: None  # fake ids cannot be read
            tracker = LiveTensorBytes(record_shapes=True, fake=mode)
            with tracker:
                out = sample(model, prompt, 1, temperature=0)
        return {"shapes": sorted(set(tracker.shapes)), "out": tuple(out.shape)}
    finally:
        if layout is not None:
            drop_fake_group()


@pytest.mark.parametrize("layout, rank", [(None, 0), ("metp", 2), ("2d-metp", 3)])
def test_a_prefill_at_262144_tokens_makes_no_full_vocabulary_tensor(layout, rank):
    """``sample``'s step asks the model for the last real token's logits only (``logits_at``): at T = 262144,
    vocabulary 1000, no tensor has a dim of a zigzag chunk's length (T for the plain model) beside one of the
    vocabulary's, on the plain model, the ring of 4 and the 2 x 2 grid; the step runs at length T and appends one
    token."""
    p, T, V = 4, LONG_T, SMALL["vocab_size"]
    out = in_worker(_shapes_of_a_prefill, layout, p, rank, T)
    long = T if layout is None else T // (2 * p)  # the shortest sequence-sized dim a rank holds
    shapes = out["shapes"]
    assert out["out"] == (1, T + 1)
    assert any(T // (1 if layout is None else get_layout(layout).side(p)) in s for s in shapes), "not at length T"
    assert not [s for s in shapes if any(d >= long for d in s) and any(V <= d < long for d in s)], "logits"
    assert any(V in s for s in shapes), "no logits at all: the step did not reach the head"


# ---- tp2d-bench: no block_size bound for RoPE; bad lengths name the nearest good ones ------------------------------


def test_bench_scenarios_take_llama_sequences_beyond_block_size(monkeypatch):
    """A RoPE model has no position table, so no length bound (``max_seq_len`` None); GPT-2's table is grown to the
    sequence by ``BenchSpec.config``, and without that growth its ``block_size`` would bound the scenario."""
    llama = BenchSpec(model="llama-tiny", overrides=SMALL)
    assert model_config("llama-tiny").block_size < LONG_T
    for layout in ("metp", "2d-metp", "cp", "cp-tp"):
        assert check_scenario(layout, 4, llama, 1, LONG_T) is None, layout
    ungrown = lambda self, seq=None: replace(model_config(self.model), **self.overrides)  # noqa: E731
    monkeypatch.setattr(runner.BenchSpec, "config", ungrown)
    assert check_scenario("metp", 4, llama, 1, LONG_T) is None
    assert check_scenario("metp", 4, BenchSpec(model="gpt2-tiny"), 1, 128) == (
        "seq 128 > block_size 64 (the rows of 'gpt2-tiny''s position table)")


def test_a_sequence_that_does_not_divide_2p_is_refused_naming_the_nearest_lengths_that_do():
    assert Ring().sequence_problem(8, 262145) == (
        "sequence length 262145 is not divisible by 2*p=16 (layout 'metp' cuts every sequence into 16 zigzag chunks); "
        "use 262144 or 262160, the nearest multiples of 16")
    assert GridRing().sequence_problem(4, 6, key="data.block_size") == (
        "data.block_size=6 is not divisible by 2*q=4 (layout '2d-metp' cuts every sequence into 4 zigzag chunks); "
        "use data.block_size=4 or data.block_size=8, the nearest multiples of 4")
    assert Ring().sequence_problem(4, 5).endswith("use 8, the shortest multiple of 8")
    assert check_scenario("metp", 4, BenchSpec(model="llama-tiny"), 1, 1000) is None
    assert "use 1000 or 1008" in check_scenario("metp", 4, BenchSpec(model="llama-tiny"), 1, 1001)
    with pytest.raises(ValueError, match="use 56 or 64, the nearest multiples of 8"):
        Ring().check_input(4, 1, 60)
