"""torch's own context parallelism on CPU (:mod:`lightning_tp2d.baselines.context_parallel`): CP x FSDP over 4 gloo
ranks equals the plain Llama, torch's ring really runs (its collectives, counted), and what a step costs beside
"metp" at p 4. One spawned group of 4 ranks serves every multi-rank test."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import math
import statistics

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp

import lightning_tp2d as tp
from lightning_tp2d.baselines import context_parallel as cp
from lightning_tp2d.planning import rivals
from lightning_tp2d.bench.collectives import FunctionalCollectiveCounter
from lightning_tp2d.planning.cost_model import collective_time, cp_step_time, flops
from lightning_tp2d.planning.events import wire_bytes
from lightning_tp2d.planning.memory_model import parameter_split
from lightning_tp2d.planning.planner import BASELINE, CP, CP_TP, HARDWARE, price
from lightning_tp2d.families import model_config
from lightning_tp2d.models import Llama, LlamaConfig
from tests.distributed import run_distributed

WORLD, B = 4, 2
# GQA (4 query heads on 2 key/value heads), RoPE, untied head; vocab 257 divides by no p
CFG = LlamaConfig(vocab_size=257, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=128, block_size=128)
SEQS = (32, 64)  # multiples of 2p = 8 (torch's head-tail balancer)
PARITY_CHUNK = 5  # tokens per chunk of the chunked loss in the parity runs: uneven chunks across the batch rows
CHUNK = 8  # tokens per chunk of the chunked loss in the measured steps: 16 or 32 tokens per rank, 2 or 4 chunks
# cp in float8 against torchao's plain float8 model: seen 5e-5 in the loss, 0.13 in the worst gradient's relative
# norm (a cosine of about 0.99, the bound the layouts' float8 tests hold)
FLOAT8_LOSS_REL, FLOAT8_GRAD_REL = 1e-3, 0.2
REPEATS = 3  # measured steps per case: a step's peak moves by a few gloo buffers; growth compares medians


def _batch(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, CFG.vocab_size, (B, seq + 1), generator=torch.Generator().manual_seed(seq))
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _parity(rank: int, tp: int, loss: str = "chunked", float8: str | None = None) -> dict:
    """Loss and every gradient (gathered from FSDP's and TP's shards) of CP x FSDP (x 1-D TP + SP over ``tp``)
    against the plain model on the whole sequence, with unevenly ignored targets; the functional collectives
    counted on the way. ``loss``: :func:`cp.sequence_loss`'s, chunked in uneven chunks of 5 tokens (16 per rank
    for cp, 8 per CP rank for cp-tp). ``float8`` (tensorwise): both sides' linears in float8 by torchao (the plain
    model converted, the rival with its weights gathered as float8)."""
    torch.manual_seed(0)
    plain = Llama(CFG)
    mesh = cp.init_cp_mesh(WORLD // tp, tp)
    cp_rank, n_cp = rank // tp, WORLD // tp
    model = cp.parallelize_cp(copy.deepcopy(plain), mesh, float8=float8, fsdp_float8_all_gather=float8 is not None)
    if float8 is not None:
        from lightning_tp2d.float8 import convert_plain

        convert_plain(plain, float8)
    idx, targets = _batch(SEQS[0])
    targets[0, :11] = -100  # 11 of 64 targets ignored, in the first rank's head chunk and the next one
    expected = plain(idx, targets)
    expected.backward()
    counter = FunctionalCollectiveCounter(strict=False)
    sdpa = F.scaled_dot_product_attention
    with counter, cp.sharded_sequence(model, mesh, idx, targets) as (idx_here, targets_here):
        chunks = idx.chunk(2 * n_cp, dim=1)
        head_tail = torch.equal(idx_here, torch.cat((chunks[cp_rank], chunks[2 * n_cp - 1 - cp_rank]), dim=1))
        loss = cp.sequence_loss(model, mesh, idx_here, targets_here, loss=loss, chunk_tokens=PARITY_CHUNK)
        loss.backward()
    loss = loss.detach()
    dist.all_reduce(loss)
    grads = {n: _rel(p.grad.full_tensor(), dict(plain.named_parameters())[n].grad)
             for n, p in model.named_parameters()}
    return {"loss": (loss / WORLD).item(), "expected": expected.item(), "grads": grads, "head_tail": head_tail,
            "all_gather": counter.stats.snapshot()["all_gather"]["calls"],
            "permutes": sum("all_to_all_single" in op for op, _ in counter.uncounted),
            "restored": F.scaled_dot_product_attention is sdpa
            and cp._FORWARD not in DTensor._op_dispatcher._custom_op_handlers}


def _costs(rank: int) -> dict:
    """Peak bytes and bytes sent per step on this rank, "cp", "cp-tp" (CP 2 x TP 2) and "metp", at each of SEQS."""
    out = {}
    cp_tp_mesh = cp.init_cp_mesh(WORLD // 2, 2)
    for seq in SEQS:
        idx, targets = _batch(seq)
        torch.manual_seed(0)
        mesh = cp.init_cp_mesh(WORLD)
        model = cp.parallelize_cp(Llama(CFG), mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        out["cp", seq] = cp.measure_step(lambda: cp.train_step(model, optimizer, mesh, idx, targets,
                                                               chunk_tokens=CHUNK),
                                         model, optimizer, WORLD, repeats=REPEATS)
        torch.manual_seed(0)
        model = cp.parallelize_cp(Llama(CFG), mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        out["cp-unfused", seq] = cp.measure_step(
            lambda: cp.train_step(model, optimizer, mesh, idx, targets, loss="unfused"), model, optimizer, WORLD,
            repeats=REPEATS)
        torch.manual_seed(0)
        model = cp.parallelize_cp(Llama(CFG), cp_tp_mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        # both axes have 2 ranks: every functional collective is priced as a 2-rank one (DTensor's caches, keyed by
        # mesh shape, may hand this mesh the process groups of _parity's equal one)
        out["cp-tp", seq] = cp.measure_step(lambda: cp.train_step(model, optimizer, cp_tp_mesh, idx, targets,
                                                                  chunk_tokens=CHUNK),
                                            model, optimizer, 2, repeats=REPEATS)
        torch.manual_seed(0)
        model = Llama(CFG)
        tp.parallelize(model, tp.init_mesh("metp", WORLD, 1), "metp")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            optimizer.zero_grad(set_to_none=True)
            model(idx, targets).backward()
            optimizer.step()

        out["metp", seq] = cp.measure_step(step, model, optimizer, WORLD, repeats=REPEATS)
    return out


def _ranks(rank: int, world_size: int) -> dict:
    out = {"parity": _parity(rank, 1), "parity_tp": _parity(rank, 2), "parity_unfused": _parity(rank, 1, "unfused"),
           "parity_tp_unfused": _parity(rank, 2, "unfused"), "costs": _costs(rank)}
    if importlib.util.find_spec("torchao") is not None:
        out["parity_float8"] = _parity(rank, 1, float8="tensorwise")
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(_ranks, WORLD, timeout=300)


def test_cpu_flash_logsumexp_is_the_natural_log_the_ring_merger_reads():
    """The CPU kernel's second output is log Σ exp(scale · q kᵀ) over the unmasked keys, shape (B, H, T): what
    torch's ``_SDPAMerger`` takes from the CUDA flash kernel."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 4, 16, 8), torch.randn(2, 4, 16, 8)
    out, lse = cp._FORWARD(q, k, v, is_causal=True)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(8)
    scores = scores.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    assert lse.shape == (2, 4, 16)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, scores.softmax(-1) @ v, rtol=1e-5, atol=1e-5)


def test_cpu_ring_attention_is_undone_on_exit_and_does_not_nest():
    propagator = DTensor._op_dispatcher.sharding_propagator
    before = propagator.op_strategy_funcs.get(cp._FORWARD), propagator.op_strategy_funcs.get(cp._BACKWARD)
    with cp.cpu_ring_attention():
        assert cp._FORWARD in propagator.op_strategy_funcs and cp._BACKWARD in propagator.op_strategy_funcs
        with pytest.raises(RuntimeError, match="does not nest"):
            with cp.cpu_ring_attention():
                pass
    assert (propagator.op_strategy_funcs.get(cp._FORWARD), propagator.op_strategy_funcs.get(cp._BACKWARD)) == before
    assert cp._FORWARD not in torch_cp.custom_ops and cp._BACKWARD not in torch_cp.custom_ops


def test_sequence_length_must_split_into_2p_chunks():
    class _Mesh:  # a 1-D mesh of 4 ranks as far as the check reads it (refused before any communication)
        ndim = 1

        def size(self):
            return 4

    idx = torch.zeros(1, 36, dtype=torch.long)
    with pytest.raises(ValueError, match="36 is not divisible by 2p = 8"):
        with cp.sharded_sequence(Llama(CFG), _Mesh(), idx, idx):
            pass


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk_tokens", [1, 5, 13, 26, 1000])
def test_chunked_cross_entropy_equals_the_unfused_loss_and_its_gradients(dtype, chunk_tokens):
    """:func:`cp.chunked_cross_entropy` over chunks of 1 to more than all 26 tokens (uneven, across the batch rows;
    ``-100`` targets, one chunk of them only) divided by the counted targets: the loss and the gradients of the
    final norm's output and of the head equal ``F.cross_entropy`` on the full logits (float32 / float64 tight), and
    the graph keeps no ``[n, V]`` tensor (the chunks' logits are recomputed in the backward)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 13, 16, dtype=dtype, generator=gen, requires_grad=True)
    weight = torch.randn(257, 16, dtype=dtype, generator=gen, requires_grad=True)
    targets = torch.randint(0, 257, (2, 13), generator=gen)
    targets[0, :7] = -100  # with chunks of 1 or 5 some chunks count nothing
    expected = F.cross_entropy(F.linear(x, weight).reshape(-1, 257), targets.reshape(-1), ignore_index=-100)
    grads = torch.autograd.grad(expected, (x, weight))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        loss = cp.chunked_cross_entropy(x, weight, targets, chunk_tokens) / (targets != -100).sum()
    assert not any(shape[-1:] == (257,) and len(shape) == 2 and shape[0] > 1 for shape in saved), saved
    tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(loss, expected, **tol)
    for got, want in zip(torch.autograd.grad(loss, (x, weight)), grads):
        torch.testing.assert_close(got, want, **tol)


def test_chunked_loss_refuses_bad_arguments():
    with pytest.raises(ValueError, match="chunk_tokens must be a positive"):
        cp.chunked_cross_entropy(torch.zeros(1, 4, 8), torch.zeros(5, 8), torch.zeros(1, 4, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="loss='fused' is not one of"):
        cp.sequence_loss(Llama(CFG), None, torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long),
                         loss="fused")
    with pytest.raises(ValueError, match="loss='fused'"):
        rivals.cp_peak_bytes(CFG, 1, 64, 4, loss="fused")


def test_cp_peak_bytes_prices_one_chunk_of_the_loss_and_names_the_peak():
    """Llama 3.1 8B on 8 GPUs, full checkpointing (the planner's bf16): unfused, the ``[T/p, V]`` loss is most of
    the peak; chunked, what the loss adds does not grow with T, the peak falls by at least the saved log-softmax,
    and ``peak_at`` / ``largest`` name the phase and its largest part (from 512k tokens no longer the loss)."""
    cfg = model_config("llama-3.1-8b")
    kw = dict(checkpointing="full", elem=2)
    losses = []
    for seq in (131072, 262144, 524288):
        unfused = rivals.cp_peak_bytes(cfg, 1, seq, 8, loss="unfused", **kw)
        chunked = rivals.cp_peak_bytes(cfg, 1, seq, 8, **kw)
        assert unfused["peak_at"] == "plain FSDP" and unfused["largest"] == "loss, gathered and transients"
        saved = 4 * (seq // 8) * cfg.vocab_size
        assert chunked["total"] <= unfused["total"] - saved
        assert chunked["activations"] == unfused["activations"] - saved
        assert chunked["total"] == sum(chunked["phases"][chunked["peak_at"]].values())
        assert chunked["largest"] in chunked["phases"][chunked["peak_at"]]
        losses.append(chunked["loss"])
    assert losses[0] == losses[1] == losses[2] < 4 * rivals.CHUNK_TOKENS * cfg.vocab_size + 3 * 2 * cfg.vocab_size * cfg.n_embd
    assert chunked["peak_at"] == "block backward (plain FSDP)" and chunked["largest"] == "activations"


@pytest.mark.parametrize("case", ["parity", "parity_tp", "parity_unfused", "parity_tp_unfused"],
                         ids=["cp", "cp-tp", "cp-unfused", "cp-tp-unfused"])
def test_cp_fsdp_loss_and_every_gradient_equal_the_plain_model(ranks, case):
    """cp: CP over 4 ranks x FSDP over the same 4; cp-tp: CP over 2 x 1-D TP + SP over 2, FSDP over the CP axis."""
    for r in ranks:
        p = r[case]
        assert p["head_tail"]  # this rank holds chunks r and 2p-1-r of 2p: torch's head-tail load balancer
        assert p["loss"] == pytest.approx(p["expected"], rel=1e-6)
        assert len(p["grads"]) == len(list(Llama(CFG).parameters()))
        worst = max(p["grads"], key=p["grads"].get)
        assert p["grads"][worst] < 1e-5, (worst, p["grads"][worst])
        assert p["restored"]


def test_cp_runs_float8_with_torchaos_own_code(ranks):
    """cp with torchao's tensorwise float8 linears, FSDP2 gathering them as float8: the loss and gradients against
    the plain model converted by torchao (the same recipe; each CP rank scales its own sequence shard's activations,
    the plain model the whole sequence's, so they agree within float8 rounding, not to float32's)."""
    if "parity_float8" not in ranks[0]:
        pytest.skip("float8 needs torchao (the test extra)")
    for r in ranks:
        p = r["parity_float8"]
        assert p["head_tail"] and p["restored"]
        assert p["loss"] == pytest.approx(p["expected"], rel=FLOAT8_LOSS_REL), p["loss"]
        worst = max(p["grads"], key=p["grads"].get)
        assert p["grads"][worst] < FLOAT8_GRAD_REL, (worst, p["grads"][worst])


def test_torch_ring_runs_its_schedule(ranks):
    """Per layer: one K/V all-gather in the forward and one in the backward (torch's default rotation), and p
    permutes of the dK/dV partial sums in the backward."""
    for r in ranks:
        assert r["parity"]["all_gather"] == 2 * CFG.n_layer
        assert r["parity"]["permutes"] == WORLD * CFG.n_layer


def test_cp_bytes_sent_grow_by_the_ring_traffic_alone(ranks):
    """FSDP's traffic does not depend on T; per layer the ring sends its K/V shard (k and v, ``B * T/p * nkv * hs``
    float32 each) p-1 times in each of two all-gathers and p times as dK/dV: (3p - 2) shards per layer."""
    def kv_bytes(seq):
        return 2 * B * (seq // WORLD) * CFG.n_kv_head * CFG.head_size * 4

    ring = CFG.n_layer * (3 * WORLD - 2) * (kv_bytes(SEQS[1]) - kv_bytes(SEQS[0]))
    for r in ranks:
        assert r["costs"]["cp", SEQS[1]]["sent_bytes"] - r["costs"]["cp", SEQS[0]]["sent_bytes"] == ring


def test_report_peak_and_sent_bytes_of_cp_and_metp(ranks):
    """The measured numbers per rank (largest rank), printed as a table; each grows with the sequence."""
    rows = []
    for layout in ("cp", "metp"):
        for seq in SEQS:
            peak = max(r["costs"][layout, seq]["peak_bytes"] for r in ranks)
            sent = max(r["costs"][layout, seq]["sent_bytes"] for r in ranks)
            rows.append((layout, seq, peak, sent))
            print(f"{layout:5} p={WORLD} T={seq:4}: peak {peak / 2**20:.3f} MiB, sent {sent / 2**20:.3f} MiB, "
                  f"{sent / (B * seq):.0f} B/token")
    for layout in ("cp", "metp"):
        short, long = (r for r in rows if r[0] == layout)
        assert long[2] > short[2] > 0 and long[3] > short[3] > 0


def test_declared_cp_events_send_the_bytes_a_real_step_counts(ranks):
    """The cost model's "cp" schedule (:func:`rivals.cp_comm_events`: FSDP2's gathers and reduce-scatters with their
    dim-0 padding, torch's ring, the two small all-reduces), float32 as the CPU runs it, sends on every rank exactly
    what :func:`cp.measure_step` counted in a real 4-rank step, at each sequence length."""
    for seq in SEQS:
        for case, loss in (("cp", "chunked"), ("cp-unfused", "unfused")):
            declared = wire_bytes(rivals.cp_comm_events(CFG, B, seq, WORLD, elem=4, loss=loss, chunk_tokens=CHUNK))
            for r in ranks:
                assert declared == r["costs"][case, seq]["sent_bytes"], (seq, declared, r["costs"][case, seq])


def test_declared_cp_tp_events_send_the_bytes_a_real_step_counts(ranks):
    """"cp-tp" (CP 2 x 1-D TP + SP 2, FSDP over the CP axis): :func:`rivals.cp_comm_events` with ``tp=2`` -- FSDP's
    traffic of the TP shards, torch's ring on this rank's key/value heads, TP + SP's calls on the CP rank's ``T/2``
    tokens -- sends exactly what a real 4-rank step counts on tensor rank 0 (ranks 0 and 2, which hold the larger
    half of the 257-row vocabulary); tensor rank 1 sends less, by FSDP's gathers and reduce-scatters of one
    vocabulary row fewer per FSDP shard. The chunked loss's backward recomputes each chunk's ``loss_parallel``
    forward: its three ``[n, 1]`` all-reduces again."""
    for seq in SEQS:
        declared = wire_bytes(rivals.cp_comm_events(CFG, B, seq, WORLD // 2, elem=4, tp=2, chunk_tokens=CHUNK))
        unfused = wire_bytes(rivals.cp_comm_events(CFG, B, seq, WORLD // 2, elem=4, tp=2, loss="unfused"))
        assert declared - unfused == 3 * 4 * B * seq // 2  # float32 rows of the CP rank's tokens, over 2 TP ranks
        sent = [r["costs"]["cp-tp", seq]["sent_bytes"] for r in ranks]
        assert sent[0] == sent[2] == declared, (seq, declared, sent)
        assert sent[1] == sent[3] < declared


def test_cp_tp_peak_bytes_grow_with_the_sequence_as_measured(ranks):
    """:func:`rivals.cp_peak_bytes` with ``tp=2`` (the 1-D TP + SP baseline's parts on the CP rank's ``T/2`` tokens, the
    ring on half the heads) against the growth of the largest rank's measured "cp-tp" peak (the median of its
    ``REPEATS`` steps: one step's peak moves by a few gloo buffers) from T = 32 to 64, within 20% as for "cp"."""
    predicted = [rivals.cp_peak_bytes(CFG, B, seq, WORLD // 2, elem=4, tp=2, chunk_tokens=CHUNK)["total"] for seq in SEQS]
    measured = [max(statistics.median(r["costs"]["cp-tp", seq]["peaks"]) for r in ranks) for seq in SEQS]
    growth = (predicted[1] - predicted[0]) / (measured[1] - measured[0])
    print(f"cp-tp peak growth T={SEQS[0]} -> {SEQS[1]}: predicted {predicted[1] - predicted[0]} B, measured "
          f"{measured[1] - measured[0]} B")
    assert 0.8 < growth < 1.2, (predicted, measured)


def test_head_tail_ring_gives_every_rank_a_pth_of_the_causal_scores():
    """Counted from torch's own causal rule per ring step (``_is_causal_behavior``): each rank computes
    ``T (T+1) / (2p)`` visible scores, split as :func:`rivals.diagonal_share` says (step 0 vs each later step)."""
    seq, p = 96, 4
    c = seq // (2 * p)
    for rank in range(p):
        steps = []
        for i in range(p):
            behavior = torch_cp._is_causal_behavior(rank=rank, world_size=p, i=i, is_causal=True)
            assert behavior != torch_cp._CausalBehavior.SKIP  # load balanced: no idle step
            steps.append(c * (2 * c + 1) if i == 0 else 2 * c * c)  # step 0 causal 2c x 2c; later 2c x c / c x 2c
        assert sum(steps) * p == seq * (seq + 1) // 2
        diagonal, off = rivals.diagonal_share(seq, p)
        assert steps[0] / sum(steps) == pytest.approx(diagonal) and steps[1] / sum(steps) == pytest.approx(off)


def test_cp_step_computes_a_pth_of_the_plain_model_and_hides_most_of_the_ring():
    """FLOPs per rank: the plain model's over p (exact: each rank sees T/p tokens and 1/p of the causal scores);
    the ring's all-gathers and permutes at 128k tokens on 8 H100s hide behind the attention they overlap."""
    cfg = model_config("llama-3.1-8b")
    seq, p = 131072, 8
    step = cp_step_time(cfg, 1, seq, p, HARDWARE["h100"], checkpointing="full", loss="unfused")
    plain = flops("single", cfg, 1, seq, 1, "full")
    for key in ("forward", "backward", "matmul", "attention"):
        assert step["flops"][key] == pytest.approx(plain[key] / p, rel=1e-12)
    assert step["flops"]["gemms"] == plain["gemms"]
    assert 0 < step["exposed_comm_s"] < 0.5 * step["comm_s"]
    # the chunked loss (the default) recomputes the head's forward in the backward: 4 GEMMs a chunk for the head's 3
    chunked = cp_step_time(cfg, 1, seq, p, HARDWARE["h100"], checkpointing="full")
    head = 2 * (seq // p) * cfg.n_embd * cfg.vocab_size
    for key in ("forward", "attention"):
        assert chunked["flops"][key] == step["flops"][key]
    for key in ("backward", "matmul", "total"):
        assert chunked["flops"][key] == pytest.approx(step["flops"][key] + head, rel=1e-12)
    assert chunked["flops"]["gemms"] == plain["gemms"] - 3 + 4 * (seq // p) // rivals.CHUNK_TOKENS
    assert chunked["exposed_comm_s"] == step["exposed_comm_s"] and chunked["total_s"] > step["total_s"]


@pytest.mark.parametrize("loss", ["chunked", "unfused"])
def test_cp_peak_bytes_grow_with_the_sequence_as_measured(ranks, loss):
    """What :func:`rivals.cp_peak_bytes` adds per token (activations of ``T/p`` tokens, the ring's gathered K/V and
    accumulators; unfused the logits, chunked one chunk of ``CHUNK`` tokens whatever T; float32 as the CPU runs it,
    ``elem`` 4) against the growth of the largest rank's measured peak (the median of its ``REPEATS`` steps: one
    step's peak moves by a few gloo buffers) from T = 32 to 64 on 4 ranks, within 20%. (Its fixed part, FSDP's
    gathered and unsharded root and block, is the bf16 baseline's rule and over-counts this float32 toy, whose root
    is half its weights.)"""
    case = "cp" if loss == "chunked" else "cp-unfused"
    predicted = [rivals.cp_peak_bytes(CFG, B, seq, WORLD, elem=4, loss=loss, chunk_tokens=CHUNK)["total"] for seq in SEQS]
    measured = [max(statistics.median(r["costs"][case, seq]["peaks"]) for r in ranks) for seq in SEQS]
    growth = (predicted[1] - predicted[0]) / (measured[1] - measured[0])
    print(f"{case} peak growth T={SEQS[0]} -> {SEQS[1]}: predicted {predicted[1] - predicted[0]} B, measured "
          f"{measured[1] - measured[0]} B")
    assert 0.8 < growth < 1.2, (predicted, measured)


# a vocabulary and a sequence large enough that the unfused loss, not the ring, FSDP's buffers or the optimizer,
# sets the peak: 2 ranks, 2 x 256 tokens each ([512, 8192] float32 logits: 16 MiB)
BIG_VOCAB, BIG_SEQ = dataclasses.replace(CFG, vocab_size=8192, block_size=512), 512


def _loss_peaks(rank: int, world_size: int) -> dict:
    out = {}
    idx = torch.randint(0, BIG_VOCAB.vocab_size, (B, BIG_SEQ + 1), generator=torch.Generator().manual_seed(1))
    idx, targets = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    mesh = cp.init_cp_mesh(world_size)
    for loss in ("chunked", "unfused"):
        torch.manual_seed(0)
        model = cp.parallelize_cp(Llama(BIG_VOCAB), mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        out[loss] = cp.measure_step(lambda: cp.train_step(model, optimizer, mesh, idx, targets, loss=loss,
                                                          chunk_tokens=CHUNK), model, optimizer, world_size,
                                    repeats=REPEATS)
    return out


def test_chunked_loss_holds_less_than_the_unfused_loss_as_measured():
    """With an 8192-row vocabulary on 2 ranks (2 x 256 tokens each, chunks of ``CHUNK``) the loss sets the peak: the
    measured peak of the step with the chunked loss is below the unfused one's, and :func:`rivals.cp_peak_bytes`
    predicts the saving (the ``[T/p, V]`` log-softmax, logits and gradient less one chunk's) within 20%."""
    ranks = run_distributed(_loss_peaks, 2, timeout=300)
    measured = {loss: max(statistics.median(r[loss]["peaks"]) for r in ranks) for loss in ("chunked", "unfused")}
    predicted = {loss: rivals.cp_peak_bytes(BIG_VOCAB, B, BIG_SEQ, 2, elem=4, loss=loss, chunk_tokens=CHUNK)
                 for loss in ("chunked", "unfused")}
    saving = measured["unfused"] - measured["chunked"]
    predicted_saving = predicted["unfused"]["total"] - predicted["chunked"]["total"]
    print(f"vocab 8192, 2 ranks, T={BIG_SEQ}: measured {measured}, predicted "
          f"{ {k: (v['total'], v['peak_at'], v['largest']) for k, v in predicted.items()} }; saving measured {saving} "
          f"B, predicted {predicted_saving} B")
    assert saving > 0
    assert 0.8 < predicted_saving / saving < 1.2, (predicted_saving, saving)


def test_cp_tp_step_computes_the_plain_models_flops_over_its_ranks_and_prices_tp_as_the_baseline_does():
    """"cp-tp" at 128k on 8 H100s (CP 4 x TP 2): each rank computes ``1/8`` of the plain model's FLOPs (the linears
    as 1-D TP + SP on ``T/4`` tokens, the attention ``1/8`` of the causal scores); its TP + SP calls expose what
    :func:`step_time` exposes for "tp1d-sp" over 2 on ``T/4`` tokens (blocking: all of them; async TP less), and its
    ring what "cp"'s ring exposes at degree 4 on half the heads (both by the one overlap rule, 0.57 of what their
    overlapped compute could hide), so the step is the sum of the parts."""
    from lightning_tp2d.planning.cost_model import step_time

    cfg, seq, hw = model_config("llama-3.1-8b"), 131072, HARDWARE["h100"]
    plain = flops("single", cfg, 1, seq, 1, "full")
    for async_tp in (False, True):
        step = cp_step_time(cfg, 1, seq, 4, hw, checkpointing="full", tp=2, async_tp=async_tp, overlap=0.57,
                            loss="unfused")
        chunked = cp_step_time(cfg, 1, seq, 4, hw, checkpointing="full", tp=2, async_tp=async_tp,
                               overlap=0.57)
        head = 2 * (seq // 4) * cfg.n_embd * -(-cfg.vocab_size // 2)  # the recomputed head on the local vocabulary
        assert chunked["flops"]["backward"] == pytest.approx(step["flops"]["backward"] + head, rel=1e-12)
        assert chunked["flops"]["matmul"] == pytest.approx(step["flops"]["matmul"] + head, rel=1e-12)
        assert chunked["exposed_comm_s"] > step["exposed_comm_s"]  # loss_parallel's recomputed all-reduces
        for key in ("forward", "backward", "matmul", "attention", "attention_forward"):
            assert step["flops"][key] == pytest.approx(plain[key] / 8, rel=1e-9), key
        tp_alone = step_time("tp1d-sp", cfg, 1, seq // 4, 2, hw, checkpointing="full", async_tp=async_tp,
                             lean_wire=True, overlap=0.57)
        ring = sum(e.calls * (collective_time(e.kind, e.group_size, e.nbytes, hw.intra)  # the same rule: 0.57 hidden
                              - 0.57 * min(collective_time(e.kind, e.group_size, e.nbytes, hw.intra),
                                           e.overlap_flops / hw.attention_flops_per_s))
                   for e in rivals.cp_comm_events(cfg, 1, seq, 4, 2, checkpointing="full", tp=2, loss="unfused")
                   if e.group == rivals.RING_AXIS)
        assert step["exposed_comm_s"] == pytest.approx(tp_alone["exposed_comm_s"] + ring, rel=1e-9)
        assert step["compute_s"] - tp_alone["compute_s"] == pytest.approx(
            (step["flops"]["attention"] - tp_alone["flops"]["attention"]) / hw.attention_flops_per_s, rel=1e-9)
    blocking = cp_step_time(cfg, 1, seq, 4, hw, checkpointing="full", tp=2, loss="unfused")
    assert step["exposed_comm_s"] < blocking["exposed_comm_s"]


def test_cp_tp_row_shards_the_tensor_shards_over_the_cp_ranks():
    """A "cp-tp" row of the planner (CP 4 x TP 2 on 8 GPUs): FSDP over the 4 CP ranks of each tensor rank moves
    :func:`rivals.cp_comm_events`' FSDP traffic; the optimizer updates 1/8 of the matrices and 1/4 of the vectors, as the
    1-D baseline over TP 2 x FSDP 4 does; memory is :func:`rivals.cp_peak_bytes` with ``tp=2``."""
    cfg, seq = model_config("llama-3.1-8b"), 32768
    hw = HARDWARE["h100"]
    kw = dict(dp=1, zero_stage=3, checkpointing="full", micro_batch=1, grad_accum=1, seq=seq, hw=hw, gpus_per_node=8)
    row = price(cfg, layout=CP_TP, p=8, cp_tp_size=2, **kw)
    assert (row.context_parallel_size, row.tensor_parallel_size) == (4, 8) and "CP 4 x TP 2" in row.describe()
    counted = sum(e.calls * collective_time(e.kind, e.group_size, e.nbytes, hw.intra)
                  for e in rivals.cp_comm_events(cfg, 1, seq, 4, 2, checkpointing="full", tp=2) if e.group == rivals.FSDP_AXIS)
    assert row.parts["time_s"]["dp_comm"] == pytest.approx(counted, rel=2e-3)
    baseline = price(cfg, layout=BASELINE, p=2, **(kw | {"dp": 4}))
    assert row.parts["time_s"]["optimizer"] == pytest.approx(baseline.parts["time_s"]["optimizer"], rel=1e-12)
    assert row.memory_gib * 2**30 == rivals.cp_peak_bytes(cfg, 1, seq, 4, checkpointing="full", elem=2, tp=2)["total"]
    with pytest.raises(ValueError, match=r"'cp-tp' needs cp_tp_size >= 2 dividing p with at least 2 CP ranks"):
        price(cfg, layout=CP_TP, p=8, cp_tp_size=8, **kw)


def test_cp_row_prices_fsdp_and_the_optimizer_as_plain_fsdp_over_its_ranks():
    """A "cp" row of the planner: CP 8 x FSDP over the same 8 GPUs moves the FSDP traffic :func:`rivals.cp_comm_events`
    counts (the root, resharded after forward by :func:`cp.parallelize_cp`, gathered again in the backward), which is
    plain FSDP over 8's (the same data-parallel rule) with the whole root gathered again where plain FSDP gathers
    only its untied embedding again; it updates what plain FSDP does, its step is the cost model's, and its
    tokens per GPU follow from the step."""
    cfg, seq = model_config("llama-3.1-8b"), 32768
    hw = HARDWARE["h100"]
    kw = dict(dp=1, zero_stage=3, checkpointing="full", micro_batch=1, grad_accum=1, seq=seq, hw=hw, gpus_per_node=8)
    row = price(cfg, layout=CP, p=8, **kw)
    fsdp = price(cfg, layout=BASELINE, p=1, **(kw | {"dp": 8, "seq": seq // 8}))
    counted = sum(e.calls * collective_time(e.kind, e.group_size, e.nbytes, hw.intra)
                  for e in rivals.cp_comm_events(cfg, 1, seq, 8, 2, checkpointing="full") if e.group == rivals.FSDP_AXIS)
    assert row.parts["time_s"]["dp_comm"] == pytest.approx(counted, rel=1e-3)
    split = parameter_split(cfg)
    gather = lambda elements: collective_time("all_gather", 8, 2 * elements / 8, hw.intra)  # noqa: E731
    assert row.parts["time_s"]["dp_comm"] == pytest.approx(
        fsdp.parts["time_s"]["dp_comm"] - gather(split.embedding) + gather(split.root), rel=1e-12)
    assert row.parts["time_s"]["optimizer"] == pytest.approx(fsdp.parts["time_s"]["optimizer"], rel=1e-12)
    step = cp_step_time(cfg, 1, seq, 8, HARDWARE["h100"], checkpointing="full")
    assert row.parts["time_s"]["micro_compute"] == step["compute_s"]
    assert row.tokens_per_s_per_gpu == pytest.approx(seq / row.step_s / 8, rel=1e-12)
