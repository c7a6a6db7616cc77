"""Each METP ring function alone against a single-device computation, on rings of 1, 2, 3 and 4 gloo ranks
(the one attention kernel also with 2 and 3 query heads per key/value head, the one MLP pass also with SwiGLU).

One ``run_distributed`` call per ring size ``p``; every rank builds the same full tensors from one seed, runs
the ring function on its share and returns errors against the plain computation, communication counts and
whether switching double buffering off changed a single bit. ``visible`` (which query rows of a rank see which
key rows of another) is checked exhaustively against the global causal mask without any process group.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import lightning_tp2d as tp
from lightning_tp2d import comm, metp
from lightning_tp2d.nn.ring_stream import (ColumnBlocks, ring_cross_entropy, ring_embedding, ring_linear_in,
                                           ring_linear_out)
from lightning_tp2d.nn.sequence import zigzag_positions
from tests.distributed import run_distributed

B, H, C, D = 2, 3, 5, 4  # batch, heads, rows per zigzag chunk, head size
DT = torch.float64


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_visible_blocks_cover_exactly_the_global_causal_mask(p):
    for i in range(p):
        q_pos = zigzag_positions(2 * p * C, p, i)
        for j in range(p):
            k_pos = zigzag_positions(2 * p * C, p, j)
            want = q_pos.unsqueeze(1) >= k_pos.unsqueeze(0)  # (2c, 2c) global causal mask for this pair
            rows, cols, causal = metp.visible(i, j, C)
            got = torch.zeros_like(want)
            block = got[rows, cols]
            block.fill_(True)
            if causal:
                block.copy_(torch.ones_like(block).tril())
            got[rows, cols] = block
            assert torch.equal(got, want), (i, j)
            if j > i:  # the early chunk sees nothing of a later rank: skipped, not masked
                assert rows == slice(C, None) and not want[:C].any()


def test_ring_options_refuse_bad_values_naming_them_and_the_valid_ones():
    assert metp.RingOptions() == metp.RingOptions(double_buffer=True, attention_kernel="auto", math_tile=128)
    for bad, words in [({"attention_kernel": "flash"}, ["'flash'", "'auto'", "'math'"]),
                       ({"math_tile": 0}, ["math_tile=0", "positive int"]),
                       ({"math_tile": 2.5}, ["math_tile=2.5"]),
                       ({"double_buffer": "no"}, ["'no'", "True or False"]),
                       ({"tile_tokens": -1}, ["tile_tokens=-1", "non-negative int"]),
                       ({"tile_tokens": 8.0}, ["tile_tokens=8.0"]), ({"tile_tokens": True}, ["tile_tokens=True"])]:
        with pytest.raises(ValueError) as info:
            metp.RingOptions(**bad)
        assert all(w in str(info.value) for w in words), (bad, str(info.value))
    with pytest.raises(dataclasses.FrozenInstanceError):
        metp.RingOptions().double_buffer = False
    assert metp.RingOptions().tile_tokens == 8192 and metp.RingOptions(tile_tokens=None).row_tiles(5) == [slice(0, 5)]
    assert metp.RingOptions(tile_tokens=2).row_tiles(5) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    with pytest.raises(TypeError, match=r"TPOptions \(alias RingOptions\) or None, got dict"):
        metp.ring_options({"double_buffer": False})


def _rel(a, b):
    if b.numel() == 0:  # a vocab block that is all padding
        return 0.0
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _counted(fn):
    with comm.count_comm() as stats:
        out = fn()
    return out, {k: v for k, v in stats.snapshot().items() if v["calls"]}


def _attention(mesh, p, i, kernel):
    T = 2 * p * C
    g = torch.Generator().manual_seed(7)
    qkv_full = torch.randn(3, B, H, T, D, dtype=DT, generator=g)
    dy_full = torch.randn(B, H, T, D, dtype=DT, generator=g)
    ref_in = qkv_full.clone().requires_grad_()
    ref = F.scaled_dot_product_attention(*ref_in.unbind(0), is_causal=True)
    ref.backward(dy_full)
    pos = zigzag_positions(T, p, i)
    qkv = qkv_full[..., pos, :].clone().requires_grad_()
    options = metp.RingOptions(attention_kernel=kernel, math_tile=3)  # tile 3 < chunk 5: several tiles per block
    y, fwd = _counted(lambda: metp.ring_attention(qkv, mesh, "ring", options=options))
    _, bwd = _counted(lambda: y.backward(dy_full[..., pos, :]))
    grad = qkv.grad.clone()
    qkv.grad = None
    y2 = metp.ring_attention(qkv, mesh, "ring", options=dataclasses.replace(options, double_buffer=False))
    y2.backward(dy_full[..., pos, :])
    return {"y": _rel(y, ref[..., pos, :]), "grad": _rel(grad, ref_in.grad[..., pos, :]),
            "fwd": fwd, "bwd": bwd, "kv_bytes": 2 * B * H * 2 * C * D * 8,
            "identical": torch.equal(y, y2) and torch.equal(grad, qkv.grad)}


def _mlp(mesh, p, i, tile_tokens=None):
    """``tile_tokens``: also in row tiles (f = 4p > h = 3: the hidden block is wider than h, so the MLP tiles)."""
    h, f, n = 3, 4 * p, 7  # hidden, rows of W1 per rank (wider than h), tokens per rank
    g = torch.Generator().manual_seed(8)
    x_all = torch.randn(p, n, h, dtype=DT, generator=g)
    w1, b1 = torch.randn(p * f, h, dtype=DT, generator=g), torch.randn(p * f, dtype=DT, generator=g)
    w2, b2 = torch.randn(h, p * f, dtype=DT, generator=g), torch.randn(h, dtype=DT, generator=g)
    dout = torch.randn(p, n, h, dtype=DT, generator=g)
    ref_params = [t.clone().requires_grad_() for t in (x_all, w1, b1, w2, b2)]
    rx, rw1, rb1, rw2, rb2 = ref_params
    ref = F.linear(F.gelu(F.linear(rx, rw1, rb1), approximate="tanh"), rw2, rb2)
    ref.backward(dout)
    mine = [x_all[i], w1[i * f:(i + 1) * f], b1, w2[:, i * f:(i + 1) * f], b2]
    x, lw1, lb1, lw2, lb2 = [t.clone().requires_grad_() for t in mine]
    options = metp.RingOptions(tile_tokens=tile_tokens)
    # the biases replicated over the ring: the kernel sums their gradients over it (two all-reduces, below)
    out, fwd = _counted(lambda: metp.ring_mlp(x, lw1, lb1, lw2, lb2, mesh, "ring", options=options))
    _, bwd = _counted(lambda: out.backward(dout[i]))
    errs = [_rel(out, ref[i]), _rel(x.grad, rx.grad[i]), _rel(lw1.grad, rw1.grad[i * f:(i + 1) * f]),
            _rel(lb1.grad, rb1.grad), _rel(lw2.grad, rw2.grad[:, i * f:(i + 1) * f]), _rel(lb2.grad, rb2.grad)]
    return {"err": max(errs), "fwd": fwd, "bwd": bwd, "w_bytes": 2 * f * h * 8, "b_bytes": (p * f + h) * 8,
            "grads": [t.grad for t in (x, lw1, lb1, lw2, lb2)], "out": out.detach()}


def _linears(mesh, p, i):
    """Out-split (column blocks) then in-split linear: Y = (X W1ᵀ + b1) W2ᵀ + b2."""
    n, d_in, w, d_out = 5, 4, 3, 6
    g = torch.Generator().manual_seed(9)
    x_all = torch.randn(p, n, d_in, dtype=DT, generator=g)
    w1, b1 = torch.randn(p * w, d_in, dtype=DT, generator=g), torch.randn(p * w, dtype=DT, generator=g)
    w2 = torch.randn(d_out, p * w, dtype=DT, generator=g)
    ref_in = [t.clone().requires_grad_() for t in (x_all, w1, b1, w2)]
    ref = F.linear(F.linear(ref_in[0], ref_in[1], ref_in[2]), ref_in[3])
    ref.sum().backward()
    mine = (x_all[i], w1[i * w:(i + 1) * w], b1, w2[:, i * w:(i + 1) * w])
    x, lw1, lb1, lw2 = [t.clone().requires_grad_() for t in mine]
    y = ring_linear_out(x, lw1, lb1, mesh, "ring", ColumnBlocks(n, p, w))  # (its bias' gradient summed inside)
    out = ring_linear_in(y, lw2, None, mesh, "ring", ColumnBlocks(n, p, w))
    out.sum().backward()
    errs = [_rel(out, ref[i]), _rel(x.grad, ref_in[0].grad[i]), _rel(lw1.grad, ref_in[1].grad[i * w:(i + 1) * w]),
            _rel(lb1.grad, ref_in[2].grad), _rel(lw2.grad, ref_in[3].grad[:, i * w:(i + 1) * w])]
    return max(errs)


def _vocab(mesh, p, i, V, tile_tokens=None):
    """Ring cross-entropy and embedding against F.cross_entropy / F.embedding; V need not divide by p;
    ``tile_tokens``: the cross-entropy in row tiles."""
    n, h = 6, 4
    rows = -(-V // p)
    g = torch.Generator().manual_seed(10 + V)
    x_all = torch.randn(p, n, h, dtype=DT, generator=g)
    E = torch.randn(V, h, dtype=DT, generator=g)
    targets = torch.randint(0, V, (p, n), generator=g)
    targets[0, :2] = -100
    ids = torch.randint(0, V, (p, n), generator=g)
    dx_emb = torch.randn(p, n, h, dtype=DT, generator=g)
    rx, rE = x_all.clone().requires_grad_(), E.clone().requires_grad_()
    loss_ref = F.cross_entropy(rx.reshape(-1, h) @ rE.t(), targets.reshape(-1), ignore_index=-100)
    (loss_ref + (F.embedding(ids, rE) * dx_emb).sum()).backward()
    block = F.pad(E[i * rows:(i + 1) * rows], (0, 0, 0, rows - E[i * rows:(i + 1) * rows].shape[0]))
    x, lE = x_all[i].clone().requires_grad_(), block.clone().requires_grad_()
    options = metp.RingOptions(tile_tokens=tile_tokens)
    loss, fwd = _counted(lambda: ring_cross_entropy(x, lE, targets[i], mesh, "ring", V, options=options))
    emb = ring_embedding(lE, ids[i], mesh, "ring", options=options)
    _, bwd = _counted(lambda: (loss + (emb * dx_emb[i]).sum()).backward())
    valid = E[i * rows:(i + 1) * rows].shape[0]
    errs = [abs(loss.item() - loss_ref.item()) / loss_ref.item(), _rel(emb, F.embedding(ids[i], E)),
            _rel(x.grad, rx.grad[i]), _rel(lE.grad[:valid], rE.grad[i * rows:i * rows + valid])]
    return {"err": max(errs), "pad_grad": lE.grad[valid:].abs().max().item() if valid < rows else 0.0,
            "fwd": fwd, "bwd": bwd, "e_bytes": rows * h * 8, "loss": loss.item(), "grads": [x.grad, lE.grad]}


def _shift(mesh, p, i):
    send = [torch.full((3,), float(i)), torch.full((2, 2), 10.0 + i)]
    recv = [torch.empty(3), torch.empty(2, 2)]
    _, counts = _counted(lambda: comm.ring_shift(send, recv, mesh, "ring"))
    prev = (i - 1) % p
    return {"ok": bool((recv[0] == prev).all() and (recv[1] == 10 + prev).all()), "counts": counts}


def _kernels(rank, world_size):
    out = {}
    for p in sorted({1, world_size}):
        mesh = tp.init_mesh("metp", p, world_size // p)
        i = mesh.get_local_rank("ring")
        out[p] = {"shift": _shift(mesh, p, i), "linears": _linears(mesh, p, i),
                  "attention": {k: _attention(mesh, p, i, k) for k in ("auto", "math")},
                  # tile_tokens: the default (8192 > N: one tile), untiled (0), tiles of 2 and 4 rows (the last shorter)
                  "mlp": {t: _mlp(mesh, p, i, t) for t in (None, 0, 2)},
                  "vocab": {(V, t): _vocab(mesh, p, i, V, t) for V in (5, 37) for t in (0, 4)}}
        for part in ("mlp", "vocab"):  # tensors do not travel back to the test process: their differences do
            runs = out[p][part]
            for key, r in runs.items():
                base = runs[(key[0], 0)] if part == "vocab" else runs[0]
                r["vs_untiled"] = max([_rel(a, b) for a, b in zip(r["grads"], base["grads"])]
                                      + [abs(r.get("loss", 0.0) - base.get("loss", 0.0))]
                                      + ([_rel(r["out"], base["out"])] if "out" in r else []))
            for r in runs.values():
                r.pop("out", None), r.pop("grads")
    return out


def _ring(calls: int, nbytes: int) -> dict:
    return {"ring_exchange": {"calls": calls, "bytes": nbytes}} if calls else {}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_functions_equal_single_device_maths_with_the_ring_schedule(world_size):
    for per_p in run_distributed(_kernels, world_size):
        for p, r in per_p.items():
            assert r["shift"]["ok"] and r["shift"]["counts"] == _ring(p - 1 and 1, (p > 1) * (3 + 4) * 4)
            assert r["linears"] <= 1e-13
            for kernel, a in r["attention"].items():
                assert a["y"] <= 1e-13 and a["grad"] <= 1e-13, (p, kernel)
                assert a["identical"], (p, kernel)  # double buffering off: not one bit differs
                # forward: p-1 shifts of K|V; backward: p-1 of K|V and p of dK|dV; nothing else
                assert a["fwd"] == _ring(p - 1, (p - 1) * a["kv_bytes"])
                assert a["bwd"] == _ring((p - 1) + p * (p > 1), (2 * p - 1) * a["kv_bytes"] * (p > 1))
            for tile, m in r["mlp"].items():  # tiled or not: the same maths and the same exchanges
                assert m["err"] <= 1e-13 and m["vs_untiled"] <= 1e-13, (p, tile)
                assert m["fwd"] == _ring(p - 1, (p - 1) * m["w_bytes"])
                assert m["bwd"] == {**_ring((p - 1) + p * (p > 1), (2 * p - 1) * m["w_bytes"] * (p > 1)),
                                    **({"all_reduce": {"calls": 2, "bytes": m["b_bytes"]}} if p > 1 else {})}
            for (V, tile), v in r["vocab"].items():
                assert v["err"] <= 1e-13 and v["vs_untiled"] <= 1e-13, (p, V, tile)
                assert v["pad_grad"] == 0.0
                # forward: p-1 shifts of the vocab block (+ one all-reduce of [loss sum, count], 2 numbers);
                # backward: cross-entropy p-1 + p, embedding p-1 (its gradients travel alone)
                assert v["fwd"] == {**_ring(p - 1, (p - 1) * v["e_bytes"]),
                                    **({"all_reduce": {"calls": 1, "bytes": 16}} if p > 1 else {})}
                assert v["bwd"] == _ring((p - 1) + p * (p > 1) + (p - 1), (3 * p - 2) * v["e_bytes"] * (p > 1))


def _gqa_attention(mesh, p, i, kernel, groups):
    """The one ring attention kernel with ``groups`` query heads per key/value head against plain causal attention
    of the key/value heads repeated per group (transformers' ``repeat_kv``: query head ``j`` reads ``j // g``)."""
    T, nkv = 2 * p * C, 2
    g = torch.Generator().manual_seed(11 + groups)
    full = [torch.randn(B, n, T, D, dtype=DT, generator=g) for n in (nkv * groups, nkv, nkv)]  # q, k, v
    dy_full = torch.randn(B, nkv * groups, T, D, dtype=DT, generator=g)
    ref_in = [t.clone().requires_grad_() for t in full]
    rq, rk, rv = ref_in
    ref = F.scaled_dot_product_attention(rq, rk.repeat_interleave(groups, 1), rv.repeat_interleave(groups, 1),
                                         is_causal=True)
    ref.backward(dy_full)
    pos = zigzag_positions(T, p, i)
    q, k, v = [t[..., pos, :].clone().requires_grad_() for t in full]
    options = metp.RingOptions(attention_kernel=kernel, math_tile=3)
    run = lambda: metp.ring_attention(metp.group_queries(q, k, v), mesh, "ring", groups=groups,  # noqa: E731
                                      options=options)
    y, fwd = _counted(run)
    _, bwd = _counted(lambda: y.backward(dy_full[..., pos, :]))
    errs = [_rel(y, ref[..., pos, :])] + [_rel(t.grad, r.grad[..., pos, :]) for t, r in zip((q, k, v), ref_in)]
    return {"err": max(errs), "fwd": fwd, "bwd": bwd, "kv_bytes": 2 * B * nkv * 2 * C * D * 8}


def _swiglu_mlp(mesh, p, i, tile_tokens=None):
    """The one ring MLP pass with ``activation="swiglu"`` (and biases on the up projection and the output);
    ``tile_tokens``: in row tiles (I/p = 7 > h = 6: the MLP tiles)."""
    h, f, n = 6, 7, 7  # hidden, I/p rows of the gate and up projections per rank (wider than h), tokens per rank
    g = torch.Generator().manual_seed(12)
    x_all, dout = torch.randn(p, n, h, dtype=DT, generator=g), torch.randn(p, n, h, dtype=DT, generator=g)
    wg, wu = torch.randn(p * f, h, dtype=DT, generator=g), torch.randn(p * f, h, dtype=DT, generator=g)
    wd, bu, bd = (torch.randn(h, p * f, dtype=DT, generator=g), torch.randn(p * f, dtype=DT, generator=g),
                  torch.randn(h, dtype=DT, generator=g))
    ref_in = [t.clone().requires_grad_() for t in (x_all, wg, wu, bu, wd, bd)]
    rx, rwg, rwu, rbu, rwd, rbd = ref_in
    F.linear(F.silu(F.linear(rx, rwg)) * F.linear(rx, rwu, rbu), rwd, rbd).backward(dout)
    rows = slice(i * f, (i + 1) * f)
    mine = [t.clone().requires_grad_() for t in (x_all[i], wg[rows], wu[rows], bu, wd[:, rows], bd)]
    x, lwg, lwu, lbu, lwd, lbd = mine
    out, fwd = _counted(lambda: metp.ring_mlp(x, lwu, lbu, lwd, lbd, mesh, "ring", activation="swiglu",
                                              w_gate=lwg, options=metp.RingOptions(tile_tokens=tile_tokens)))
    _, bwd = _counted(lambda: out.backward(dout[i]))
    want = [rx.grad[i], rwg.grad[rows], rwu.grad[rows], rbu.grad, rwd.grad[:, rows], rbd.grad]
    errs = [_rel(out, F.linear(F.silu(F.linear(x_all[i], wg)) * F.linear(x_all[i], wu, bu), wd, bd))]
    return {"err": max(errs + [_rel(t.grad, w) for t, w in zip(mine, want)]), "fwd": fwd, "bwd": bwd,
            "w_bytes": 3 * f * h * 8, "b_bytes": (p * f + h) * 8, "grads": [out.detach()] + [t.grad for t in mine]}


def _grouped(rank, world_size):
    out = {}
    for p in sorted({1, world_size}):
        mesh = tp.init_mesh("metp", p, world_size // p)
        i = mesh.get_local_rank("ring")
        out[p] = {"swiglu": {t: _swiglu_mlp(mesh, p, i, t) for t in (0, 2, 3)},
                  "gqa": {(k, g): _gqa_attention(mesh, p, i, k, g) for k in ("auto", "math") for g in (1, 2, 3)}}
        for r in out[p]["swiglu"].values():  # tiled against untiled, here (tensors do not travel back)
            r["vs_untiled"] = max(_rel(a, b) for a, b in zip(r["grads"], out[p]["swiglu"][0]["grads"]))
        for r in out[p]["swiglu"].values():
            r.pop("grads")
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_one_attention_kernel_with_groups_and_one_mlp_pass_with_swiglu_equal_single_device_maths(world_size):
    for per_p in run_distributed(_grouped, world_size):
        for p, r in per_p.items():
            for (kernel, groups), a in r["gqa"].items():
                assert a["err"] <= 1e-13, (p, kernel, groups)
                # only K|V of the nkv key/value heads travel, whatever the group count
                assert a["fwd"] == _ring(p - 1, (p - 1) * a["kv_bytes"]), (p, kernel, groups)
                assert a["bwd"] == _ring((p - 1) + p * (p > 1), (2 * p - 1) * a["kv_bytes"] * (p > 1))
            for tile, m in r["swiglu"].items():  # untiled (0) and in row tiles of 2 and 3: same maths, same exchanges
                assert m["err"] <= 1e-13 and m["vs_untiled"] <= 1e-13, (p, tile)
                # the gate, up and down blocks travel together: one pass, p-1 exchanges forward, p-1 + p backward
                assert m["fwd"] == _ring(p - 1, (p - 1) * m["w_bytes"])
                assert m["bwd"] == {**_ring((p - 1) + p * (p > 1), (2 * p - 1) * m["w_bytes"] * (p > 1)),
                                    **({"all_reduce": {"calls": 2, "bytes": m["b_bytes"]}} if p > 1 else {})}


def test_ring_attention_and_mlp_refuse_mismatched_groups_and_activations_naming_them():
    qkv = torch.empty(4, 1, 2, 6, 4)
    with pytest.raises(ValueError, match=r"qkv \[groups\+2, B, nkv, S, d\].*\(4, 1, 2, 6, 4\) with groups=1"):
        metp.ring_attention(qkv, None, "ring")
    with pytest.raises(ValueError, match=r"nh % nkv == 0, got \(1, 3, 6, 4\), \(1, 2, 6, 4\)"):
        metp.group_queries(torch.empty(1, 3, 6, 4), torch.empty(1, 2, 6, 4), torch.empty(1, 2, 6, 4))
    q, k = torch.randn(1, 6, 6, 4), torch.randn(1, 2, 6, 4)
    packed = metp.group_queries(q, k, -k)
    assert packed.shape == (5, 1, 2, 6, 4)  # 3 query rows, then k and v
    assert torch.equal(packed[2, :, 1], q[:, 1 * 3 + 2]) and torch.equal(packed[4], -k)  # row r, head k: k*g + r
    w = torch.empty(3, 6)
    for activation, gate in [("swiglu", None), ("gelu_tanh", w), ("relu", None)]:
        with pytest.raises(ValueError, match=f"activation={activation!r}.*'gelu_tanh' without w_gate"):
            metp.ring_mlp(torch.empty(2, 6), w, None, w.t(), None, None, "ring", activation=activation, w_gate=gate)


def _vocab_on_meta(rank, world_size):
    mesh = tp.init_mesh("metp", 1, 1)
    x = torch.empty(6, 4, dtype=DT, device="meta", requires_grad=True)
    block = torch.empty(7, 4, dtype=DT, device="meta", requires_grad=True)
    loss = ring_cross_entropy(x, block, torch.zeros(6, dtype=torch.long, device="meta"), mesh, "ring", 5)
    emb = ring_embedding(block, torch.zeros(2, 3, dtype=torch.long, device="meta"), mesh, "ring")
    (loss + emb.sum()).backward()
    return [tuple(t.shape) for t in (loss, emb, x.grad, block.grad)]


def test_vocab_functions_run_on_meta_tensors_so_nothing_depends_on_the_ids_values():
    # hits are masks (gather / scatter_add / where), never nonzero() or boolean indexing: no data-dependent shape
    (shapes,) = run_distributed(_vocab_on_meta, 1)
    assert shapes == [(), (2, 3, 4), (6, 4), (7, 4)]


def _bf16_wire(rank, world_size):
    """bf16 ring MLP and attention: gradient sums travel in bf16 by default (float32 with ``ring_grad_dtype``)."""
    p = world_size
    mesh = tp.init_mesh("metp", p, 1)
    i = mesh.get_local_rank("ring")
    h, f, n = 16, 8, 12
    g = torch.Generator().manual_seed(3)
    x_all, dout = torch.randn(p, n, h, generator=g), torch.randn(p, n, h, generator=g)
    w1, w2 = torch.randn(p * f, h, generator=g) / 4, torch.randn(h, p * f, generator=g) / 4
    rx, rw1, rw2 = [t.double().requires_grad_() for t in (x_all, w1, w2)]
    F.linear(F.gelu(F.linear(rx, rw1), approximate="tanh"), rw2).backward(dout.double())
    qkv_full = torch.randn(3, 1, 2, 2 * p * 4, 8, generator=g)
    dy_full = torch.randn(1, 2, 2 * p * 4, 8, generator=g)
    ref_in = qkv_full.double().requires_grad_()
    F.scaled_dot_product_attention(*ref_in.unbind(0), is_causal=True).backward(dy_full.double())
    pos = zigzag_positions(2 * p * 4, p, i)
    out = {}
    for wire in ("activation", "float32"):
        options = metp.RingOptions(ring_grad_dtype=wire)
        x, lw1, lw2 = [t.to(torch.bfloat16).requires_grad_() for t in
                       (x_all[i], w1[i * f:(i + 1) * f], w2[:, i * f:(i + 1) * f])]
        y = metp.ring_mlp(x, lw1, None, lw2, None, mesh, "ring", options=options)
        _, mlp_bwd = _counted(lambda: y.backward(dout[i].to(torch.bfloat16)))
        qkv = qkv_full[..., pos, :].to(torch.bfloat16).requires_grad_()
        ya = metp.ring_attention(qkv, mesh, "ring", options=options)
        _, att_bwd = _counted(lambda: ya.backward(dy_full[..., pos, :].to(torch.bfloat16)))
        out[wire] = {"mlp_bytes": mlp_bwd["ring_exchange"]["bytes"], "att_bytes": att_bwd["ring_exchange"]["bytes"],
                     "dw1": _rel(lw1.grad.double(), rw1.grad[i * f:(i + 1) * f]),
                     "dw2": _rel(lw2.grad.double(), rw2.grad[:, i * f:(i + 1) * f]),
                     "dqkv": _rel(qkv.grad.double(), ref_in.grad[..., pos, :])}
    return out


def test_bf16_ring_gradients_travel_in_bf16_and_stay_accurate():
    p = 4
    for r in run_distributed(_bf16_wire, p):
        bf16, f32 = r["activation"], r["float32"]
        # backward: p-1 operand shifts (bf16 either way) and p gradient shifts (bf16 or float32)
        mlp_operands = (p - 1) * 2 * 8 * 16 * 2
        assert bf16["mlp_bytes"] - mlp_operands == (f32["mlp_bytes"] - mlp_operands) // 2
        kv_operands = (p - 1) * 2 * 2 * 8 * 8 * 2
        assert bf16["att_bytes"] - kv_operands == (f32["att_bytes"] - kv_operands) // 2
        for name in ("dw1", "dw2", "dqkv"):
            assert bf16[name] < 2e-2 and f32[name] < 2e-2, (name, r)  # bf16 rounding of the results themselves


def test_block_kernel_choice_and_the_first_use_check():
    q = torch.empty(1, 1, 4, 16)
    assert metp.block_kernel(q) == "flash_cpu"
    assert metp.block_kernel(q, metp.RingOptions(attention_kernel="math")) == "math"
    # the check a CUDA kernel passes before its first use, run here on the CPU flash kernel: it agrees
    assert metp._check_kernel("flash_cpu", torch.device("cpu"), torch.float32, 16)
    # a kernel that fails (no CUDA here) is refused with a warning naming it, and the math kernel is used
    with pytest.warns(RuntimeWarning, match="fused flash_cuda kernel is not usable"):
        assert not metp._check_kernel("flash_cuda", torch.device("cpu"), torch.bfloat16, 16)


def test_cudnn_block_kernel_plumbing_on_the_meta_device():
    """cuDNN's fused attention (the ring's block kernel on Hopper and newer) cannot run here, but its meta kernels
    check what the ring passes and gets back: the output in the queries' shape, the log-sum-exp squeezed from
    cuDNN's ``[.., Lq, 1]`` to ``[.., Lq]`` float32, a half block's rows sliced out of a longer block, and the
    backward taking the global output and log-sum-exp (unsqueezed again) with the forward's bookkeeping outputs."""
    q_long = torch.empty(1, 2, 128, 64, device="meta", dtype=torch.bfloat16)
    for causal, q in ((True, q_long[..., :64, :].clone()), (False, q_long[..., 64:, :])):
        k, v = (torch.empty(1, 2, 64, 64, device="meta", dtype=torch.bfloat16) for _ in range(2))
        out, lse = metp._fused_forward("cudnn_cuda", q, k, v, causal, 0.125)
        assert out.shape == q.shape and out.dtype == torch.bfloat16
        assert lse.shape == q.shape[:-1] and lse.dtype == torch.float32
        dq, dk, dv = metp._fused_backward("cudnn_cuda", torch.empty_like(out), q, k, v, out, lse, causal, 0.125)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    # and, like every CUDA kernel, it is refused with a warning where it does not run
    with pytest.warns(RuntimeWarning, match="fused cudnn_cuda kernel is not usable"):
        assert not metp._check_kernel("cudnn_cuda", torch.device("cpu"), torch.bfloat16, 16)


def test_the_first_use_check_runs_eagerly_while_torch_compile_traces():
    """The check of a fused kernel (a generator, kernels, a comparison) is a constant of the graph, run at trace
    time, not traced: on the H200 it broke every compiled ring attention. Checked here on the CPU flash kernel,
    whole-graph."""
    metp._VERIFIED.pop(("flash_cpu", torch.device("cpu"), torch.float32, 16), None)

    def scaled(q):
        return q * 2 if metp._verified("flash_cpu", q) else q

    q = torch.randn(1, 2, 8, 16)
    assert torch.equal(torch.compile(scaled, backend="aot_eager", fullgraph=True)(q), q * 2)
    assert metp._VERIFIED[("flash_cpu", torch.device("cpu"), torch.float32, 16)] is True
