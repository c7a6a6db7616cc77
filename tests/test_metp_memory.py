"""Peak live tensor memory per rank of the "metp" layout, measured by a tensor allocation tracker on CPU.

:class:`~lightning_tp2d.planning.live.LiveTensorBytes` (the benchmarks' CPU memory tracker) sees every tensor an
aten op returns, counts the bytes of each new storage while it lives and keeps the peak and the shape of
everything allocated. Kernels' internal scratch (inside one aten op, e.g. the CPU flash attention
of both the plain model and a ring step) is invisible to it, for the plain model and METP alike.

At a fixed total sequence length T, one block's forward+backward on each rank of a ring of p = 1, 2, 4 must
peak at about 1/p of the plain block's, and nothing ``[T, T]`` (scores) or ``[tokens, vocab]`` (logits) may
ever be allocated. Measured (T = 1024, h = 48, 4 heads, float32): with the CPU flash block kernel each rank
peaks at 1.04, 1.05-1.08 and 1.14-1.17 times plain/p for p = 1, 2, 4; the "math" fallback kernel keeps
``[math_tile, 2T/(2p)]`` score tiles per head, about twice that, and scales as 1/p just the same.
"""

from __future__ import annotations

import copy
import functools

import torch

import lightning_tp2d as tp
from lightning_tp2d import metp
from lightning_tp2d.planning.live import LiveTensorBytes
from lightning_tp2d.metp import RingOptions
from lightning_tp2d.models import GPT2, GPT2Config
from tests.distributed import run_distributed

T = 1024  # total sequence length: long against the hidden size 48, as METP is meant for
RINGS = (1, 2, 4)


def _measure(fn) -> LiveTensorBytes:
    tracker = LiveTensorBytes()
    with tracker:
        fn()
    return tracker


def _block_step(block, x):
    y = block(x)
    y.backward(torch.ones_like(y))


def _memory(rank, world_size):
    torch.manual_seed(0)
    cfg = GPT2Config.from_name("gpt2-tiny", n_head=4, block_size=T)
    plain = GPT2(cfg)
    out = {"plain": None, "block": {}, "model": {}}
    if rank == 0:
        x = torch.randn(1, T, cfg.n_embd, requires_grad=True)
        out["plain"] = _measure(lambda: _block_step(plain.transformer.h[0], x)).peak + x.nbytes
    for p in RINGS:
        mesh = tp.init_mesh("metp", p, world_size // p)
        x = torch.randn(1, T // p, cfg.n_embd, requires_grad=True)  # this rank's zigzag chunks
        for kernel in ("auto", "math"):
            options = RingOptions(attention_kernel=kernel)
            model = tp.parallelize(copy.deepcopy(plain), mesh, layout="metp", options=options)
            tracker = _measure(lambda: _block_step(model.transformer.h[0], x))
            out["block"][p, kernel] = {"peak": tracker.peak + x.nbytes, "shapes": set(tracker.shapes)}
    small = GPT2Config.from_name("gpt2-tiny", n_head=4)  # block_size 64: no dimension as large as the vocab 257
    for p in RINGS[1:]:  # the LM head + loss: a whole model step
        model = tp.parallelize(GPT2(small), tp.init_mesh("metp", p, world_size // p), layout="metp")
        idx = torch.randint(0, small.vocab_size, (2, small.block_size))
        tracker = _measure(lambda: model(idx, idx).backward())
        out["model"][p] = {"shapes": set(tracker.shapes), "tokens": idx.numel() // p, "vocab": small.vocab_size}
    out["tiled"] = _tiled(tp.init_mesh("metp", world_size, 1))
    return out


N, V, TILE = 1024, 32000, 64  # tokens per rank, vocabulary, rows per tile: the logits [N, V/p] dominate the loss step


def _tiled(mesh):
    """The loss step (ring cross-entropy forward + backward) and a ring MLP step whose hidden block is wider than h,
    untiled and in tiles of ``TILE`` rows: peak and the largest tensors at it (:attr:`LiveTensorBytes.largest`)."""
    from lightning_tp2d.nn.ring_stream import ring_cross_entropy

    p, h, f = mesh["ring"].size(), 16, 512
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, h, generator=g, requires_grad=True)
    weight = torch.randn(V // p, h, generator=g, requires_grad=True)
    targets = torch.randint(0, V, (N,), generator=g)
    w1, w2 = torch.randn(f, h, generator=g, requires_grad=True), torch.randn(h, f, generator=g, requires_grad=True)
    out = {}
    for tile in (0, TILE):
        options = RingOptions(tile_tokens=tile)
        loss = _measure(lambda: ring_cross_entropy(x, weight, targets, mesh, "ring", V, options=options).backward())
        mlp = _measure(lambda: metp.ring_mlp(x, w1, None, w2, None, mesh, "ring", options=options).sum().backward())
        out[tile] = {"loss": (loss.peak, loss.largest), "mlp": (mlp.peak, mlp.largest), "vocab_block": V // p, "f": f}
    return out


def test_metp_block_memory_scales_as_one_over_p_and_no_seq_by_seq_or_logits_tensor_exists():
    results = _results()
    plain = results[0]["plain"]
    for out in results:
        for (p, kernel), r in out["block"].items():
            if kernel == "auto":
                ratio = r["peak"] * p / plain  # 1.0 would be exactly plain / p
                assert 0.5 < ratio < 1.25, (p, ratio)
            own = r["peak"] * p / out["block"][1, kernel]["peak"]  # against this layout's own p = 1
            assert own < 1.25, (p, kernel, own)
            for shape in r["shapes"]:
                assert sorted(shape)[-2:] != [T, T] and torch.Size(shape).numel() < T * T, shape
        for p, m in out["model"].items():
            for shape in m["shapes"]:
                assert max(shape, default=0) < m["vocab"], shape  # no vocab-wide dimension at all
                assert torch.Size(shape).numel() < m["tokens"] * m["vocab"], shape


@functools.cache
def _results():
    return run_distributed(_memory, 4)  # one group of 4 ranks for both tests


def test_tile_tokens_bound_the_loss_and_mlp_steps_and_the_peak_names_the_largest_tensor():
    """``tile_tokens``: the loss step's peak is the float32 logits block [N, V/p] untiled and [TILE, V/p] tiled; the
    MLP's the hidden block [N, f] / [TILE, f]; LiveTensorBytes names them at the peak."""
    for out in _results():
        _check_tiled(out["tiled"])


def _check_tiled(out):
    untiled, tiled = out[0], out[TILE]
    vb, f = untiled["vocab_block"], untiled["f"]
    peak, largest = untiled["loss"]
    assert largest[0]["shape"] == (N, vb) and largest[0]["dtype"] == "float32", largest
    assert largest[0]["bytes"] == 4 * N * vb and peak >= largest[0]["bytes"]
    tiled_peak, tiled_largest = tiled["loss"]
    assert tiled_peak < peak / 4, (tiled_peak, peak)
    assert max(e["bytes"] for e in tiled_largest) <= 4 * TILE * vb, tiled_largest
    assert any(e["shape"] == (TILE, vb) for e in tiled_largest), tiled_largest
    peak, largest = untiled["mlp"]
    assert largest[0]["shape"] == (N, f), largest
    tiled_peak, tiled_largest = tiled["mlp"]
    assert tiled_peak < peak / 2 and all(N not in e["shape"] or e["shape"][1] < f for e in tiled_largest), \
        tiled_largest
