"""Whole-model parity of the "metp" (rings of 2 and 4) and "2d-metp" (2x2 grid) layouts against the plain GPT2.

As for "2d" (tests/test_parallel_2d.py): the loss, the gathered logits, every gradient and the parameters after
one AdamW step match the plain model in float64. In the same runs: a second step with double buffering off
gives bit-identical loss and gradients; the communication of one block and of the whole model equals the ring
schedule, with no collective on activations. Then bad input and a rank that dies or stalls mid-ring.
"""

from __future__ import annotations

import copy
import os
import time

import pytest
import torch
from torch.distributed.tensor import Replicate

import lightning_tp2d as tp
from lightning_tp2d.layouts import get_layout
from lightning_tp2d import comm, metp
from lightning_tp2d.models import GPT2, GPT2Config
from tests.distributed import run_distributed
from tests.test_parallel_2d import _batch, _check_parity, _rel, expected_block_comm

SEQ = 24  # divisible by 2p for p = 2, 4 and by 2q for q = 2
HEADS = 12  # gpt2-tiny with 12 heads of 4: divisible by p = 4 (its default 6 is not)


def _counts(stats) -> dict:
    return {k: v for k, v in stats.snapshot().items() if v["calls"]}


def _block_comm(model, layout, mesh, batch, seq):
    """Forward and backward communication of block 0 on a random local input."""
    cfg = model.config
    n = mesh.size(mesh.mesh_dim_names.index("ring" if layout == "metp" else "row"))
    width = cfg.n_embd if layout == "metp" else cfg.n_embd // n
    x = torch.randn(batch, seq // n, width, dtype=torch.float64, requires_grad=True)
    with comm.count_comm() as stats:
        y = model.transformer.h[0](x)
    fwd = _counts(stats)
    with comm.count_comm() as stats:
        y.backward(torch.ones_like(y))
    return {"forward": fwd, "backward": _counts(stats)}


def _parity(rank, world_size, layout, batch, seq=SEQ, heads=HEADS):
    torch.manual_seed(0)
    cfg = GPT2Config.from_name("gpt2-tiny", n_head=heads)
    plain = GPT2(cfg).double()
    par = copy.deepcopy(plain)
    mesh = tp.init_mesh(layout, world_size, 1)
    tp.parallelize(par, mesh, layout=layout)
    idx, targets = _batch(cfg, batch=batch, seq=seq)

    out = {"names": [n for n, _ in par.named_parameters()] == [n for n, _ in plain.named_parameters()]}
    out["shapes"] = all(p.shape == p0.shape for p, p0 in zip(par.parameters(), plain.parameters()))
    out["init"] = max(_rel(p.full_tensor(), p0) for p, p0 in zip(par.parameters(), plain.parameters()))
    named = list(par.named_parameters())
    out["placements"] = {n: str(p.placements) for n, p in named if n.startswith(("transformer.h.0", "transformer.w"))}
    out["replicated"] = {n: p.numel() for n, p in named if all(isinstance(x, Replicate) for x in p.placements)}
    out["storage"] = (tp.local_parameter_bytes(par), sum(p.numel() * p.element_size() for p in plain.parameters()))

    loss0 = plain(idx, targets)
    with comm.count_comm() as stats:
        loss1 = par(idx, targets)
    out["model_fwd"] = _counts(stats)
    loss0.backward()
    with comm.count_comm() as stats:
        loss1.backward()
    out["model_bwd"] = _counts(stats)
    out["loss"] = (loss0.item(), loss1.item())
    with torch.no_grad():
        logits = par(idx)
        out["logits"] = _rel(logits, plain(idx))
        out["logits_shape"] = tuple(logits.shape)
    out["grads"] = {n: _rel(p.grad.full_tensor(), p0.grad)
                    for (n, p), p0 in zip(par.named_parameters(), plain.parameters())}

    # the same model parallelized with double buffering off: the same arithmetic in the same order
    waits = get_layout(layout, options=metp.RingOptions(double_buffer=False))
    par2 = tp.parallelize(copy.deepcopy(plain), mesh, layout=waits)
    out["options_reach_the_layers"] = all(m.options.double_buffer is False for m in par2.modules()
                                          if isinstance(getattr(m, "options", None), metp.RingOptions))
    loss2 = par2(idx, targets)
    loss2.backward()
    out["identical"] = loss2.item() == loss1.item() and all(
        torch.equal(p2.grad.to_local(), p.grad.to_local()) for p2, p in zip(par2.parameters(), par.parameters()))

    before = {k: v.clone() for k, v in plain.state_dict().items()}
    for opt in [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (plain, par)]:
        opt.step()
    full, ref = tp.full_state_dict(par), plain.state_dict()
    out["keys"] = list(full) == list(ref)
    out["step"] = max(((full[k] - ref[k]).norm() / (ref[k] - before[k]).norm()).item() for k in ref)
    out["plain_tensors"] = all(type(v) is torch.Tensor for v in full.values())
    out["block"] = _block_comm(par, layout, mesh, batch, seq)
    return out


def _ring(calls, nbytes):
    return {"ring_exchange": {"calls": calls, "bytes": nbytes}}


def expected_metp_block(h: int, tokens: int, p: int, elem: int = 8) -> dict:
    """One block on a ring of p: four ring passes (QKV weights, K|V, c_proj weights, MLP weights), each p-1
    exchanges forward and (p-1) + p backward; backward also sums the 8 replicated vectors' gradients, in 6 calls
    (each LayerNorm's weight and bias in one)."""
    travelling = 3 * h * h // p + 2 * tokens * h + h * h // p + 2 * 4 * h * h // p  # elements per exchange, all passes
    return {"forward": _ring(4 * (p - 1), (p - 1) * travelling * elem),
            "backward": {**_ring(4 * (2 * p - 1), (2 * p - 1) * travelling * elem),
                         "all_reduce": {"calls": 6, "bytes": 13 * h * elem}}}


@pytest.mark.parametrize("layout, world_size, batch", [("metp", 2, 2), ("metp", 4, 2), ("2d-metp", 4, 1)])
def test_metp_layouts_match_plain_model_float64(layout, world_size, batch):
    results = run_distributed(_parity, world_size, layout, batch)
    _check_parity(results, tol=1e-10)
    cfg = GPT2Config.from_name("gpt2-tiny", n_head=HEADS)
    h, n = cfg.n_embd, world_size if layout == "metp" else 2
    r0 = results[0]
    assert r0["logits_shape"] == (batch, SEQ, cfg.vocab_size)
    for out in results:
        assert out["identical"] and out["options_reach_the_layers"]  # double buffering off: the same bits
    if layout == "metp":
        assert r0["placements"]["transformer.wte.weight"] == "(Replicate(), Shard(dim=0))"
        assert r0["placements"]["transformer.h.0.attn.c_attn.weight"].startswith("(Replicate(), _StridedShard(dim=0")
        assert r0["placements"]["transformer.h.0.mlp.c_proj.weight"] == "(Replicate(), Shard(dim=1))"
        assert r0["placements"]["transformer.h.0.ln_1.weight"] == "(Replicate(), Replicate())"
        tokens = batch * SEQ // n
        for out in results:
            # every matrix is split p ways; only vectors and wpe are whole on every rank
            local, total = out["storage"]
            replicated = 8 * sum(out["replicated"].values())
            assert abs((local - replicated) - (total - replicated) / n) <= 8 * h * n  # V=257 splits unevenly
            assert out["block"] == expected_metp_block(h, tokens, n)
            # whole model: embedding, 4 passes per block and the LM head, p-1 exchanges each forward; one
            # all-reduce of [loss sum, count]; backward adds the replicated vectors' gradient sums, nothing else
            layers, vocab_block = cfg.n_layer, -(-cfg.vocab_size // n) * h * 8
            assert out["model_fwd"]["ring_exchange"]["calls"] == (2 + 4 * layers) * (n - 1)
            assert out["model_fwd"]["all_reduce"] == {"calls": 1, "bytes": 16}
            assert set(out["model_fwd"]) == {"ring_exchange", "all_reduce"}
            assert out["model_bwd"]["ring_exchange"]["calls"] == (n - 1) + (4 * layers + 1) * (2 * n - 1)
            assert out["model_bwd"]["ring_exchange"]["bytes"] == (
                layers * expected_metp_block(h, tokens, n)["backward"]["ring_exchange"]["bytes"]
                + (n - 1) * vocab_block + (2 * n - 1) * vocab_block)
            # one call a replicated vector, a LayerNorm's weight and bias in one (2 a block and the final norm)
            norms = sum(name.endswith(".bias") and (".ln_" in name) for name in out["replicated"])
            assert norms == 2 * layers + 1
            assert out["model_bwd"]["all_reduce"] == {"calls": len(out["replicated"]) - norms,
                                                      "bytes": 8 * sum(out["replicated"].values())}
            assert set(out["model_bwd"]) == {"ring_exchange", "all_reduce"}
    else:
        tokens = batch * SEQ // n  # per grid row
        kv = 2 * tokens * h // n * 8  # K|V of this rank's heads and chunks
        for rank, out in enumerate(results):
            want = expected_block_comm(h, tokens, n, elem=8, diagonal=rank // n == rank % n)
            for phase, steps in (("forward", n - 1), ("backward", 2 * n - 1)):  # ring attention's K|V on top of SUMMA's
                ring = want[phase]["ring_exchange"]
                want[phase]["ring_exchange"] = {"calls": ring["calls"] + steps, "bytes": ring["bytes"] + steps * kv}
            for phase in ("forward", "backward"):
                assert out["block"][phase] == {k: v for k, v in want[phase].items() if v["calls"]}, (rank, phase)


@pytest.mark.parametrize("world_size, heads, seq", [pytest.param(8, 12, 32, marks=pytest.mark.slow), (2, 3, 24)],
                         ids=["12-heads-on-8", "3-heads-on-2"])  # (3 heads on 2 ranks: the same property, 4 ranks fewer)
def test_metp_takes_any_head_count_whose_width_divides_the_ring(world_size, heads, seq):
    # GPT-2's 12 heads on an 8-rank ring (width blocks of 6 cut through heads of 4), and 3 heads of 16 on 2 ranks
    results = run_distributed(_parity, world_size, "metp", 1, seq, heads)
    _check_parity(results, tol=1e-10)


# ---- bad input ----------------------------------------------------------------------------------------


def _bad_input(rank, world_size):
    cfg = GPT2Config.from_name("gpt2-tiny")
    errors = {}
    ring, grid = tp.init_mesh("metp", 2, 2), tp.init_mesh("2d-metp", 4, 1)
    for key, call in {
        "heads": lambda: tp.parallelize(GPT2(GPT2Config.from_name("gpt2-tiny", n_head=3, n_embd=45)), ring, "metp"),
        "mesh": lambda: tp.parallelize(GPT2(cfg), grid, "metp"),
        "world": lambda: tp.init_mesh("metp", 3, 1),
    }.items():
        try:
            call()
        except ValueError as e:
            errors[key] = str(e)
    models = {"metp": tp.parallelize(GPT2(cfg), ring, "metp"), "2d-metp": tp.parallelize(GPT2(cfg), grid, "2d-metp")}
    for layout, model in models.items():
        for seq in (10, 6):
            try:
                model(torch.zeros(1, seq, dtype=torch.long), torch.zeros(1, seq, dtype=torch.long))
            except ValueError as e:
                errors[f"{layout} seq {seq}"] = str(e)
        # the groups still work after the refused calls: nothing was left half-done
        errors[f"{layout} after"] = torch.isfinite(model(torch.zeros(1, 8, dtype=torch.long),
                                                         torch.zeros(1, 8, dtype=torch.long))).item()
    model = models["metp"].train()
    model.transformer.h[0].attn.dropout = 0.1
    try:
        model(torch.zeros(1, 8, dtype=torch.long))
    except NotImplementedError as e:
        errors["dropout"] = str(e)
    return errors


def test_bad_input_raises_value_error_naming_the_numbers_on_every_rank():
    for errors in run_distributed(_bad_input, 4, timeout=60):
        # the ring splits the width, not the heads: any head count fits a ring that divides n_embd
        assert "n_embd=45 is not divisible by p=2; use p in [1, 3, 5, 9, 15, 45]" in errors["heads"]
        assert ("layout 'metp' needs a mesh with axes ('data_parallel', 'ring'), "
                "got ('data_parallel', 'row', 'col')") in errors["mesh"]
        assert "world size 4 != data_parallel_size 1 x tensor_parallel_size 3 = 3" in errors["world"]
        assert "sequence length 10 is not divisible by 2*p=4" in errors["metp seq 10"]
        assert "sequence length 6 is not divisible by 2*p=4" in errors["metp seq 6"]
        assert "sequence length 10 is not divisible by 2*q=4" in errors["2d-metp seq 10"]
        assert errors["metp after"] is True and errors["2d-metp after"] is True
        assert "dropout=0.1" in errors["dropout"]


# ---- a rank that dies or stalls mid-ring --------------------------------------------------------------


def _broken_ring(rank, world_size, how):
    mesh = tp.init_mesh("metp", world_size, 1)
    qkv = torch.randn(3, 1, 2, 2 * 3, 4, dtype=torch.float64)
    if rank == 1:
        real, calls = metp.attend_block, []

        def broken(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:  # after the first exchange: the neighbours are mid-ring
                if how == "dies":
                    os._exit(3)
                time.sleep(30)
            return real(*args, **kwargs)

        metp.attend_block = broken
    start = time.monotonic()
    try:
        for _ in range(2):
            metp.ring_attention(qkv, mesh, "ring")
    except RuntimeError as e:
        raise RuntimeError(f"ring failed after {time.monotonic() - start:.1f}s: {e}") from None
    return "finished"


@pytest.mark.parametrize("how", ["dies", "stalls"])
def test_a_rank_failing_mid_ring_makes_its_neighbours_raise_instead_of_hanging(how):
    # run_distributed gives fresh ranks a process group with half its timeout: 4 s here. A survivor must raise within it
    # (run_distributed would report a TimeoutError if every rank hung).
    with pytest.raises(RuntimeError, match=r"rank [02] failed") as info:
        run_distributed(_broken_ring, 3, how, timeout=8, fresh=True)  # a rank dies or stalls: not pooled
    message = str(info.value)
    assert "ring failed after" in message
    if how == "stalls":
        assert "Timed out" in message


# ---- data parallel replicas and bf16 autocast ---------------------------------------------------------


def _replicas_and_autocast(rank, world_size):
    """dp=2 x ring of 2: each replica matches the plain model on its own batch (parallelize never mixes
    replicas), in float64; then bf16 autocast against the plain model under autocast."""
    from torch.distributed.tensor import distribute_tensor

    torch.manual_seed(0)
    cfg = GPT2Config.from_name("gpt2-tiny")
    plain = GPT2(cfg).double()
    par = tp.parallelize(copy.deepcopy(plain), tp.init_mesh("metp", 2, 2), layout="metp")
    mesh = par.tp.mesh
    replica = mesh.get_local_rank("data_parallel")
    idx, targets = _batch(cfg, batch=2, seq=16, seed=10 + replica)
    loss0, loss1 = plain(idx, targets), par(idx, targets)
    loss0.backward()
    loss1.backward()
    grad = max(_rel(p.grad.to_local(), distribute_tensor(p0.grad, mesh, p.placements, src_data_rank=None).to_local())
               for p, p0 in zip(par.parameters(), plain.parameters()))
    out = {"replica": replica, "loss": (loss0.item(), loss1.item()), "grad": grad}

    plain = GPT2(cfg)
    par = tp.parallelize(copy.deepcopy(plain), tp.init_mesh("metp", 2, 2), layout="metp")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss0, loss1 = plain(idx, targets), par(idx, targets)
    loss0.backward()
    loss1.backward()
    out["bf16_loss"] = (loss0.item(), loss1.item())
    out["bf16_grad"] = max(((p.grad.full_tensor() - p0.grad).norm() / p0.grad.norm()).item()
                           for p, p0 in zip(par.parameters(), plain.parameters()))
    out["bf16_dtypes"] = {p.grad.dtype for p in par.parameters()}
    return out


def test_data_parallel_replicas_and_bf16_autocast_match_the_plain_model():
    results = run_distributed(_replicas_and_autocast, 4)
    losses = {}
    for out in results:
        loss0, loss1 = out["loss"]
        assert abs(loss1 - loss0) <= 1e-10 * abs(loss0) and out["grad"] <= 1e-10
        losses.setdefault(out["replica"], set()).add(round(loss1, 12))
        loss0, loss1 = out["bf16_loss"]
        assert abs(loss1 - loss0) <= 1e-2 * abs(loss0)  # bf16 has 8 mantissa bits
        assert out["bf16_grad"] <= 3e-2  # measured 7e-3
        assert out["bf16_dtypes"] == {torch.float32}
    assert len(losses[0]) == len(losses[1]) == 1 and losses[0] != losses[1]
