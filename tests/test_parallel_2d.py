"""Whole-model parity of the "2d" layout against the plain GPT2, on 2x2 and 3x3 grids (gloo, CPU).

Every rank builds the same plain model from one seed, deep-copies it, parallelizes the copy and feeds both
the same batch; the loss, the gathered logits, every parameter's gradient and the parameters after one AdamW
step must match (float64 tight, float32 ~1e-5 relative). Also: communication per block equals the SUMMA
schedule, and each rank stores 1/p of the model.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import distribute_tensor

import lightning_tp2d as tp
from lightning_tp2d import comm
from lightning_tp2d.models import GPT2, GPT2Config
from lightning_tp2d.summa import ab_form
from tests.distributed import run_distributed


def _batch(cfg: GPT2Config, batch: int, seq: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    targets[0, :3] = -100  # ignored tokens must be ignored identically
    return idx, targets


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _parity(rank, world_size, dtype, config_overrides, options=None):
    q = int(round(world_size ** 0.5))
    torch.manual_seed(0)
    cfg = GPT2Config.from_name("gpt2-tiny", **config_overrides)
    plain = GPT2(cfg).to(dtype)
    par = copy.deepcopy(plain)
    mesh = tp.init_mesh("2d", world_size, 1)
    tp.parallelize(par, mesh, layout="2d", options=tp.TPOptions(**(options or {})))
    idx, targets = _batch(cfg, batch=2 * q, seq=24)

    out = {"names": [n for n, _ in par.named_parameters()] == [n for n, _ in plain.named_parameters()]}
    out["shapes"] = all(p.shape == p0.shape for p, p0 in zip(par.parameters(), plain.parameters()))
    out["init"] = max(_rel(p.full_tensor(), p0) for p, p0 in zip(par.parameters(), plain.parameters()))

    loss0, loss1 = plain(idx, targets), par(idx, targets)
    loss0.backward()
    loss1.backward()
    out["loss"] = (loss0.item(), loss1.item())
    with torch.no_grad():
        out["logits"] = _rel(par(idx), plain(idx))
        out["logits_shape"] = tuple(par(idx).shape)
    out["grads"] = {n: _rel(p.grad.full_tensor(), p0.grad)
                    for (n, p), p0 in zip(par.named_parameters(), plain.parameters())}

    before = {k: v.clone() for k, v in plain.state_dict().items()}
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (plain, par)]
    for opt in opts:
        opt.step()
    full = tp.full_state_dict(par)
    ref = plain.state_dict()
    out["keys"] = list(full) == list(ref)
    # Adam's first step is lr * g / (|g| + eps): on elements with |g| << eps it amplifies absolute gradient
    # rounding by lr / eps, so compare each tensor's update in norm (relative), not element by element.
    out["step"] = max(((full[k] - ref[k]).norm() / (ref[k] - before[k]).norm()).item() for k in ref)
    out["plain_tensors"] = all(type(v) is torch.Tensor for v in full.values())
    return out


def _check_parity(results, tol, step_tol=None):
    """``step_tol`` (default ``tol``): the optimizer step's. Adam's first step divides each gradient by its own size,
    so where a tensor's gradients are small (GPT-2's key rows of ``c_attn`` at initialisation) float32 rounding of
    the gradient grows into the update: 2.3e-5 of the update's norm on an Intel Xeon's kernels for gradients equal
    to 4e-7, under 2e-5 on an AMD EPYC's."""
    step_tol = tol if step_tol is None else step_tol
    for out in results:
        assert out["names"] and out["shapes"] and out["keys"] and out["plain_tensors"]
        assert out["init"] == 0.0  # sharding loses nothing: full_tensor() is the plain parameter
        loss0, loss1 = out["loss"]
        assert abs(loss1 - loss0) <= tol * abs(loss0)
        assert out["logits"] <= tol
        worst = max(out["grads"], key=out["grads"].get)
        assert out["grads"][worst] <= tol, f"gradient of {worst} differs by {out['grads'][worst]:.2e}"
        assert out["step"] <= step_tol
    # every rank reports the same loss
    assert len({out["loss"][1] for out in results}) == 1


@pytest.mark.parametrize("world_size", [4, 9])
def test_2d_matches_plain_model_float64(world_size):
    results = run_distributed(_parity, world_size, torch.float64, {})
    _check_parity(results, tol=1e-10)
    q = int(world_size ** 0.5)
    assert results[0]["logits_shape"] == (2 * q, 24, 257)


@pytest.mark.parametrize("options", [dict(summa="broadcast"), dict(keep_panels=True),
                                     dict(summa="broadcast", keep_panels=True)],
                         ids=["broadcast", "keep-panels", "broadcast-keep-panels"])
def test_2d_summa_variants_match_plain_model_float64(options):
    # the default (collective SUMMA, panels gathered again in backward) is the test above
    _check_parity(run_distributed(_parity, 4, torch.float64, {}, options), tol=1e-10)


def test_2d_matches_plain_model_float32_without_bias():
    results = run_distributed(_parity, 4, torch.float32, {"bias": False})
    _check_parity(results, tol=2e-5, step_tol=1e-4)
    assert not any("bias" in n for n in results[0]["grads"])


# ---- communication per block --------------------------------------------------------------------------


def expected_block_comm(h: int, tokens: int, q: int, elem: int, bias: bool = True, summa: str = "collective",
                        keep_panels: bool = False, diagonal: bool = True) -> dict:
    """What SUMMA predicts for one Block on a q x q grid, per rank: ``tokens`` = B/q * T local tokens.

    Linear (in -> out), blocks X [n, in/q], W [out/q, in/q]. ``summa="broadcast"``:
      forward  Y = XW:   q broadcasts of X and q of W                       (2q broadcasts)
      backward dX = dY Wᵀ: q broadcasts of W, q reduces of [n, in/q]
               dW = Xᵀ dY: q broadcasts of X, q reduces of [out/q, in/q]   (2q broadcasts, 2q reduces)
    ``summa="collective"`` (a ring pass: q//2 exchanges sending q-1 blocks), gather form (c_attn, c_fc):
      forward  one all-gather of W's block along row, one ring pass of X
      backward one all-gather of W (dX), a ring pass of the dX sums, a ring pass of X and one reduce-scatter of the
               q stacked dW partials (dW)
    scatter form (the output projections: ``summa.ab_form``; their weights stored as the mirror rank's blocks):
      forward  one all-gather of W's mirrored block, one ring pass of Y's partial sums
      backward one all-gather of W, one ring pass of dY, one reduce-scatter of the dW partials
    ``keep_panels``: the backward neither broadcasts / gathers X and W again nor passes X round.
    LayerNorm: one all-reduce of [2, n] along col forward and one backward; its weight and bias gradients one
    all-reduce along row together, every linear's bias gradient one.
    """
    n = tokens
    linears = [(h, 3 * h), (h, h), (h, 4 * h), (4 * h, h)]  # c_attn, attn.c_proj, c_fc, mlp.c_proj
    kinds = ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter", "ring_exchange", "send", "recv")
    fwd = {k: [0, 0] for k in kinds}
    bwd = {k: [0, 0] for k in kinds}
    fwd["all_reduce"] = [2, 2 * 2 * n]
    bwd["all_reduce"] = [2, 2 * 2 * n]

    def add(d, kind, calls, nbytes):
        d[kind][0] += calls
        d[kind][1] += nbytes

    for i, o in linears:
        x_block, w_block = n * i // q, (o // q) * (i // q)
        if bias:
            add(bwd, "all_reduce", 1, o // q)
        if summa == "broadcast":
            add(fwd, "broadcast", 2 * q, q * (x_block + w_block))
            if not keep_panels:
                add(bwd, "broadcast", 2 * q, q * (w_block + x_block))
            add(bwd, "reduce", 2 * q, q * (x_block + w_block))
            continue
        y_block = n * o // q

        def column(d, against, keep=False):  # streamed (q broadcasts) when it outweighs the block: summa._streams
            if not keep and q * w_block > against:
                add(d, "broadcast", q, q * w_block)
            else:
                add(d, "all_gather", 1, w_block)

        if ab_form(i, o, keep_panels) == "gather":
            column(fwd, x_block, keep_panels)
            add(fwd, "ring_exchange", q // 2, (q - 1) * x_block)
            if not keep_panels:
                column(bwd, y_block)
                add(bwd, "ring_exchange", q // 2, (q - 1) * x_block)
            add(bwd, "ring_exchange", q // 2, (q - 1) * x_block)
            add(bwd, "reduce_scatter", 1, q * w_block)
        else:  # scatter: Y's partial sums travel, dY once backward (W stored mirrored: no swap)
            column(fwd, x_block, keep_panels)
            add(fwd, "ring_exchange", q // 2, (q - 1) * y_block)
            if not keep_panels:
                column(bwd, y_block)
            add(bwd, "ring_exchange", q // 2, (q - 1) * y_block)
            add(bwd, "reduce_scatter", 1, q * w_block)
    add(bwd, "all_reduce", 2, (4 if bias else 2) * h // q)  # ln_1, ln_2: weight (and bias) in one call over row
    scale = lambda d: {k: {"calls": v[0], "bytes": v[1] * elem} for k, v in d.items()}  # noqa: E731
    return {"forward": scale(fwd), "backward": scale(bwd)}


SUMMA_CASES = (("collective", False), ("broadcast", False), ("collective", True), ("broadcast", True))


def _block_comm(rank, world_size):
    q = int(round(world_size ** 0.5))
    cfg = GPT2Config.from_name("gpt2-tiny")
    batch, seq = 2, 8  # local: B/q sequences
    out = {"tokens": batch * seq, "h": cfg.n_embd, "diagonal": rank // q == rank % q}
    for summa, keep in SUMMA_CASES:
        torch.manual_seed(0)
        options = tp.TPOptions(summa=summa, keep_panels=keep)
        model = tp.parallelize(GPT2(cfg), tp.init_mesh("2d", world_size, 1), options=options)
        block = model.transformer.h[0]
        x = torch.randn(batch, seq, cfg.n_embd // q, requires_grad=True)
        with comm.count_comm() as stats:
            y = block(x)
        fwd = stats.snapshot()
        with comm.count_comm() as stats:
            y.backward(torch.ones_like(y))
        bwd = stats.snapshot()
        out[summa, keep] = {"forward": fwd, "backward": bwd, "y": y.detach().clone(), "dx": x.grad.clone()}
    ref_y, ref_dx = out["broadcast", False]["y"], out["broadcast", False]["dx"]
    for case in SUMMA_CASES:  # the algorithms differ in schedule only: compared here (tensors do not travel back)
        case_out = out[case]
        case_out["y_err"] = (case_out.pop("y") - ref_y).abs().max().item() / ref_y.abs().max().item()
        case_out["dx_err"] = (case_out.pop("dx") - ref_dx).abs().max().item() / ref_dx.abs().max().item()
    return out


@pytest.mark.parametrize("world_size", [4, 9])
def test_block_communication_equals_summa_schedule(world_size):
    q = int(world_size ** 0.5)
    results = run_distributed(_block_comm, world_size)
    for summa, keep in SUMMA_CASES:
        for out in results:
            expected = expected_block_comm(results[0]["h"], results[0]["tokens"], q, elem=4, summa=summa,
                                           keep_panels=keep, diagonal=out["diagonal"])
            for phase in ("forward", "backward"):
                got = {k: v for k, v in out[summa, keep][phase].items() if v["calls"]}
                want = {k: v for k, v in expected[phase].items() if v["calls"]}
                assert got == want, (summa, keep, phase)
    for out in results:  # the algorithms differ in schedule only
        for case in SUMMA_CASES:
            assert out[case]["y_err"] < 1e-5 and out[case]["dx_err"] < 1e-5, (case, out[case])


# ---- memory per rank ----------------------------------------------------------------------------------


def _storage(rank, world_size):
    torch.manual_seed(0)
    cfg = GPT2Config.from_name("gpt2-mini")
    model = GPT2(cfg)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    vectors = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if p.dim() == 1 or "wpe" in n)
    tp.parallelize(model, tp.init_mesh("2d", world_size, 1))
    return {"local": tp.local_parameter_bytes(model), "total": total, "vectors": vectors,
            "vocab_row_bytes": cfg.n_embd * 4}


def test_each_rank_stores_one_pth_of_the_model():
    p, q = 4, 2
    results = run_distributed(_storage, p)
    total = results[0]["total"]
    matrices = total - results[0]["vectors"]
    # matrices split p ways, vectors and wpe q ways (replicated over row), vocab rows rounded up per block
    bound = matrices / p + results[0]["vectors"] / q + results[0]["vocab_row_bytes"] / q
    assert sum(r["local"] for r in results) >= total  # nothing is lost
    for r in results:
        assert total / p * 0.95 <= r["local"] <= bound
        assert r["local"] / total < 0.3


# ---- bad input ----------------------------------------------------------------------------------------


def _bad_input(rank, world_size):
    torch.manual_seed(0)
    cfg = GPT2Config.from_name("gpt2-tiny")
    errors = {}
    mesh = tp.init_mesh("2d", world_size, 1)
    try:
        tp.parallelize(GPT2(GPT2Config.from_name("gpt2-tiny", n_head=3, n_embd=48)), tp.init_mesh("2d", 9, 1)
                       if world_size == 9 else mesh)
    except ValueError as e:
        errors["heads"] = str(e)
    model = tp.parallelize(GPT2(cfg), mesh)
    for key, idx in {"batch": torch.zeros(3, 8, dtype=torch.long),
                     "seq": torch.zeros(2, cfg.block_size + 1, dtype=torch.long),
                     "vocab": torch.full((2, 8), cfg.vocab_size)}.items():
        try:
            model(idx)
        except ValueError as e:
            errors[key] = str(e)
    try:
        tp.parallelize(model, mesh)
    except ValueError as e:
        errors["twice"] = str(e)
    # the group still works after the refused calls: nothing is left half-done
    loss = model(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
    errors["loss_after"] = torch.isfinite(loss).item()
    return errors


def test_bad_input_raises_value_error_naming_the_numbers_on_every_rank():
    results = run_distributed(_bad_input, 4, timeout=60)
    for errors in results:
        assert "batch size 3 is not divisible by q=2" in errors["batch"]
        assert "sequence length 65 exceeds block_size 64" in errors["seq"]
        assert "257" in errors["vocab"]
        assert "already parallelized" in errors["twice"]
        assert errors["loss_after"] is True


def _heads(rank, world_size):
    mesh = tp.init_mesh("2d", world_size, 1)
    with pytest.raises(ValueError) as info:
        tp.parallelize(GPT2(GPT2Config.from_name("gpt2-tiny", n_head=4, n_embd=48)), mesh)
    return str(info.value)


def test_heads_not_divisible_by_q_is_refused_before_communication():
    message = run_distributed(_heads, 9, timeout=60)[0]
    assert "n_head=4 is not divisible by q=3" in message


def _data_parallel_replicas(rank, world_size):
    """dp=2 x 2x2: each replica runs its own batch; parallelize itself never mixes replicas."""
    torch.manual_seed(0)
    cfg = GPT2Config.from_name("gpt2-tiny")
    plain = GPT2(cfg).double()
    par = copy.deepcopy(plain)
    mesh = tp.init_mesh("2d", 4, 2)
    tp.parallelize(par, mesh)
    replica = mesh.get_local_rank("data_parallel")
    idx, targets = _batch(cfg, batch=4, seq=16, seed=10 + replica)
    loss0, loss1 = plain(idx, targets), par(idx, targets)
    loss0.backward()
    loss1.backward()
    # slice the plain gradient locally (src_data_rank=None: no communication, so no mixing of replicas)
    grad = max(_rel(p.grad.to_local(), distribute_tensor(p0.grad, mesh, p.placements, src_data_rank=None).to_local())
               for p, p0 in zip(par.parameters(), plain.parameters()))
    return {"replica": replica, "loss": (loss0.item(), loss1.item()), "grad": grad}


def test_data_parallel_replicas_each_match_the_plain_model_on_their_own_batch():
    results = run_distributed(_data_parallel_replicas, 8)
    losses = {}
    for out in results:
        loss0, loss1 = out["loss"]
        assert abs(loss1 - loss0) <= 1e-10 * abs(loss0)
        assert out["grad"] <= 1e-10
        losses.setdefault(out["replica"], set()).add(round(loss1, 12))
    assert len(losses[0]) == len(losses[1]) == 1 and losses[0] != losses[1]


def _autocast(rank, world_size):
    torch.manual_seed(0)
    cfg = GPT2Config.from_name("gpt2-tiny")
    plain = GPT2(cfg)
    par = tp.parallelize(copy.deepcopy(plain), tp.init_mesh("2d", world_size, 1))
    idx, targets = _batch(cfg, batch=4, seq=24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss0, loss1 = plain(idx, targets), par(idx, targets)
        linear_out = par.transformer.h[0].mlp.c_fc(torch.randn(2, 4, cfg.n_embd // 2)).dtype
    loss0.backward()
    loss1.backward()
    dtypes = {p.grad.dtype for p in par.parameters()}
    grad = max(((p.grad.full_tensor() - p0.grad).norm() / p0.grad.norm()).item()
               for p, p0 in zip(par.parameters(), plain.parameters()))
    return {"loss": (loss0.item(), loss1.item()), "grad": grad, "dtypes": dtypes, "linear_out": linear_out}


def test_bf16_autocast_matches_plain_model_under_autocast():
    for out in run_distributed(_autocast, 4):
        loss0, loss1 = out["loss"]
        assert abs(loss1 - loss0) <= 1e-2 * abs(loss0)  # bf16 has 8 mantissa bits
        assert out["grad"] <= 2e-2  # measured 8e-3
        assert out["dtypes"] == {torch.float32}  # gradients land in the parameters' dtype
        assert out["linear_out"] == torch.bfloat16  # activations stay bf16, like nn.Linear under autocast


def _meta(rank, world_size):
    cfg = GPT2Config.from_name("gpt2-tiny")
    torch.manual_seed(3)
    eager = tp.full_state_dict(tp.parallelize(GPT2(cfg), tp.init_mesh("2d", world_size, 1)))
    with torch.device("meta"):
        model = GPT2(cfg)
    torch.manual_seed(3)
    model = tp.parallelize(model, tp.init_mesh("2d", world_size, 1))
    meta = tp.full_state_dict(model)
    on_meta = [n for n, p in model.named_parameters() if p.to_local().is_meta]
    return {"equal": all(torch.equal(eager[k], meta[k]) for k in eager), "keys": list(eager) == list(meta),
            "on_meta": on_meta}


def test_meta_device_model_materialises_to_the_same_weights_as_an_eager_build():
    for out in run_distributed(_meta, 4):
        assert out["keys"] and out["equal"] and out["on_meta"] == []


def _head_comm(rank, world_size):
    q = int(round(world_size ** 0.5))
    cfg = GPT2Config.from_name("gpt2-tiny")
    batch, seq = 2 * q, 8
    out = {"diagonal": rank // q == rank % q}
    for summa in ("collective", "broadcast"):
        torch.manual_seed(0)
        model = tp.parallelize(GPT2(cfg), tp.init_mesh("2d", world_size, 1), options=tp.TPOptions(summa=summa))
        x = torch.randn(batch // q, seq, cfg.n_embd // q, requires_grad=True)
        targets = torch.randint(0, cfg.vocab_size, (batch, seq))
        with comm.count_comm() as stats:
            loss = model.lm_head(x, targets)
        fwd = stats.snapshot()
        with comm.count_comm() as stats:
            loss.backward()
        out[summa] = {"forward": fwd, "backward": stats.snapshot()}
    return out


def test_lm_head_swaps_weight_blocks_with_the_mirror_rank_and_never_moves_logits():
    q, (V, h), tokens = 2, (257, 48), 16  # gpt2-tiny; per rank B/q * T = 2 * 8 tokens
    e, rows = 4, -(-V // q)
    x_panel, w_panel, swap = tokens * h // q * e, rows * h // q * e, rows * h // q * e
    for out in run_distributed(_head_comm, q * q):
        p2p = 0 if out["diagonal"] else 1
        for summa in ("collective", "broadcast"):
            fwd, bwd = out[summa]["forward"], out[summa]["backward"]
            assert fwd["send"] == fwd["recv"] == {"calls": p2p, "bytes": p2p * swap}
            assert bwd["send"] == bwd["recv"] == {"calls": p2p, "bytes": p2p * swap}
            # the loss: max, then [sum-exp, target logit] along col; [loss sum, count] along row
            assert fwd["all_reduce"] == {"calls": 3, "bytes": tokens * e + 2 * tokens * e + 2 * e}
            # every byte below is an activation panel [N/q, h/q] or a weight panel: no logits block
            if summa == "broadcast":
                assert fwd["broadcast"] == {"calls": 2 * q, "bytes": q * (x_panel + w_panel)}
                assert fwd["reduce"]["calls"] == 0
                assert bwd["broadcast"] == {"calls": 2 * q, "bytes": q * (w_panel + x_panel)}
                assert bwd["reduce"] == {"calls": 2 * q, "bytes": q * (x_panel + w_panel)}
                assert fwd["all_gather"]["calls"] == fwd["reduce_scatter"]["calls"] == 0
            else:  # at 16 tokens per rank the head's weight column outweighs the activations: streamed
                assert fwd["broadcast"] == {"calls": q, "bytes": q * w_panel}
                assert fwd["ring_exchange"] == {"calls": q // 2, "bytes": (q - 1) * x_panel}
                assert fwd["all_gather"]["calls"] == fwd["reduce"]["calls"] == fwd["reduce_scatter"]["calls"] == 0
                assert bwd["broadcast"] == {"calls": q, "bytes": q * w_panel}
                assert bwd["ring_exchange"] == {"calls": 2 * (q // 2), "bytes": 2 * (q - 1) * x_panel}
                assert bwd["reduce_scatter"] == {"calls": 1, "bytes": q * w_panel}
