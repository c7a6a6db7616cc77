"""Shape-dependent GEMM rates: a small calibration table and the two-parameter model fitted to it.

A GEMM of ``F = 2 m k n`` FLOPs is modelled as taking ``F / rate + overhead`` seconds: ``rate`` the sustained
throughput of large products, ``overhead`` a fixed cost per kernel (launch, the last partial wave of tiles, the
pipeline's fill and drain). Small panel products -- a SUMMA step on a ``q x q`` grid multiplies blocks ``q`` times
narrower in two dimensions, ``q`` times as often -- lose to the overhead what large ones do not; the cost model
charges every traced GEMM (:mod:`lightning_tp2d.planning.trace` counts them) its overhead.

:data:`H200_BF16` is the committed table: the 83 bf16 products ``recipes/gpu_rates.py`` measured on an H200 on
2026-12-04 (torch 2.11, CUDA 13; GPU time, CUDA events around back-to-back runs): every linear of Llama 3.1 8B and
70B as 1-D TP cuts it over 1-8 ranks at 8192 and 16384 tokens, and GPT-2 medium's MLP product on the 1x1, 2x2 and
3x3 grids (``recipes/benchmarks/gpu_rates/h200.json``). Their fit, ``rate = 719e12`` FLOP/s and ``overhead =
11.6 us`` until 2026-12-06, prices the H100 and H200 presets (an H200 is an H100's compute with more HBM). It
replaced two points quoted in the developers' brief (730e12 at 8192x1024x4096 and 525e12 at its 2x2 shard: 773e12
+ 5.25 us), which the measurement did not reproduce (577e12 and 403e12).

Unaligned products. No rate-plus-overhead line prices a product whose contiguous widths (``k``, the shared
dimension, and ``n``, the output's) are not multiples of :data:`ALIGNMENT` elements: the 3x3 grid's ``2730 x 341 x
1365`` ran at 77e12, 2.53x the time of the line fitted to the other 82 (its ``711e12 + 9.4 us``, which the presets
now use: the unaligned point had pulled the line to ``719e12 + 11.6 us``). :func:`fit` fits the aligned points;
:func:`unaligned_slowdown` is the measured time of the unaligned ones over the line's (geometric mean), which the
cost model charges every unaligned product (a grid shard, a 1-D TP shard, a vocabulary block:
:func:`lightning_tp2d.planning.cost_model.unaligned_share`) on both sides. GPT-2's unpadded 50257-wide head ran on
an sm75 kernel at about 5.9x its line in the same day's profile (three products, 20.7 ms a step); that is not a
timed product of the table, so the one measured slowdown prices it too. ``tp2d-bench
--measured-rates`` measures a table on the machine it runs on (:func:`lightning_tp2d.bench.calibrate.measure_table`)
and projects with that fit instead, keeping the preset's links; its table is written into ``results.json``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# bf16 tensor-core products want their contiguous widths in multiples of 8 elements (16 bytes)
ALIGNMENT = 8


def aligned(*widths: int) -> bool:
    """Every width a multiple of :data:`ALIGNMENT`."""
    return all(w % ALIGNMENT == 0 for w in widths)


@dataclass(frozen=True)
class GemmPoint:
    """One measured product ``[m, k] @ [k, n]`` and its rate in FLOP/s."""

    m: int
    k: int
    n: int
    flops_per_s: float
    source: str = ""

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n

    @property
    def seconds(self) -> float:
        return self.flops / self.flops_per_s

    @property
    def aligned(self) -> bool:
        """``k`` and ``n`` (the widths that are contiguous in memory) are multiples of :data:`ALIGNMENT`."""
        return aligned(self.k, self.n)


_H200_SOURCE = "H200, torch 2.11 / CUDA 13, bf16, recipes/gpu_rates.py 2026-12-04: "
H200_BF16 = tuple(GemmPoint(m, k, n, rate, _H200_SOURCE + label) for m, k, n, rate, label in (
    (8192, 4096, 4096, 798.1e12, "llama-3.1-8b q tp1"),
    (8192, 4096, 1024, 773.5e12, "llama-3.1-8b kv tp1"),
    (8192, 4096, 4096, 790.5e12, "llama-3.1-8b o tp1"),
    (8192, 4096, 14336, 778.4e12, "llama-3.1-8b gate/up tp1"),
    (8192, 14336, 4096, 726.8e12, "llama-3.1-8b down tp1"),
    (16384, 4096, 4096, 700.1e12, "llama-3.1-8b q tp1"),
    (16384, 4096, 1024, 709.2e12, "llama-3.1-8b kv tp1"),
    (16384, 4096, 4096, 706.2e12, "llama-3.1-8b o tp1"),
    (16384, 4096, 14336, 703.7e12, "llama-3.1-8b gate/up tp1"),
    (16384, 14336, 4096, 696.4e12, "llama-3.1-8b down tp1"),
    (8192, 4096, 2048, 688.4e12, "llama-3.1-8b q tp2"),
    (8192, 4096, 512, 674.1e12, "llama-3.1-8b kv tp2"),
    (8192, 2048, 4096, 699.5e12, "llama-3.1-8b o tp2"),
    (8192, 4096, 7168, 771e12, "llama-3.1-8b gate/up tp2"),
    (8192, 7168, 4096, 735.1e12, "llama-3.1-8b down tp2"),
    (16384, 4096, 2048, 691.8e12, "llama-3.1-8b q tp2"),
    (16384, 4096, 512, 692.3e12, "llama-3.1-8b kv tp2"),
    (16384, 2048, 4096, 677.9e12, "llama-3.1-8b o tp2"),
    (16384, 4096, 7168, 745.9e12, "llama-3.1-8b gate/up tp2"),
    (16384, 7168, 4096, 566.7e12, "llama-3.1-8b down tp2"),
    (8192, 4096, 1024, 617.3e12, "llama-3.1-8b q tp4"),
    (8192, 4096, 256, 533.5e12, "llama-3.1-8b kv tp4"),
    (8192, 1024, 4096, 625.2e12, "llama-3.1-8b o tp4"),
    (8192, 4096, 3584, 743e12, "llama-3.1-8b gate/up tp4"),
    (8192, 3584, 4096, 687e12, "llama-3.1-8b down tp4"),
    (16384, 4096, 1024, 667.3e12, "llama-3.1-8b q tp4"),
    (16384, 4096, 256, 659.9e12, "llama-3.1-8b kv tp4"),
    (16384, 1024, 4096, 635.8e12, "llama-3.1-8b o tp4"),
    (16384, 4096, 3584, 745.1e12, "llama-3.1-8b gate/up tp4"),
    (16384, 3584, 4096, 692.8e12, "llama-3.1-8b down tp4"),
    (8192, 4096, 512, 660.8e12, "llama-3.1-8b q tp8"),
    (8192, 4096, 128, 372.1e12, "llama-3.1-8b kv tp8"),
    (8192, 512, 4096, 570.6e12, "llama-3.1-8b o tp8"),
    (8192, 4096, 1792, 716.8e12, "llama-3.1-8b gate/up tp8"),
    (8192, 1792, 4096, 680.4e12, "llama-3.1-8b down tp8"),
    (16384, 4096, 512, 697.7e12, "llama-3.1-8b q tp8"),
    (16384, 4096, 128, 440.8e12, "llama-3.1-8b kv tp8"),
    (16384, 512, 4096, 601.2e12, "llama-3.1-8b o tp8"),
    (16384, 4096, 1792, 774.6e12, "llama-3.1-8b gate/up tp8"),
    (16384, 1792, 4096, 667.1e12, "llama-3.1-8b down tp8"),
    (8192, 8192, 8192, 708.9e12, "llama-3.1-70b q tp1"),
    (8192, 8192, 1024, 681e12, "llama-3.1-70b kv tp1"),
    (8192, 8192, 8192, 708.5e12, "llama-3.1-70b o tp1"),
    (8192, 8192, 28672, 688.6e12, "llama-3.1-70b gate/up tp1"),
    (8192, 28672, 8192, 652.3e12, "llama-3.1-70b down tp1"),
    (16384, 8192, 8192, 655.2e12, "llama-3.1-70b q tp1"),
    (16384, 8192, 1024, 688.7e12, "llama-3.1-70b kv tp1"),
    (16384, 8192, 8192, 682.9e12, "llama-3.1-70b o tp1"),
    (16384, 8192, 28672, 670e12, "llama-3.1-70b gate/up tp1"),
    (16384, 28672, 8192, 676.6e12, "llama-3.1-70b down tp1"),
    (8192, 8192, 4096, 666.5e12, "llama-3.1-70b q tp2"),
    (8192, 8192, 512, 673e12, "llama-3.1-70b kv tp2"),
    (8192, 4096, 8192, 699.1e12, "llama-3.1-70b o tp2"),
    (8192, 8192, 14336, 704.5e12, "llama-3.1-70b gate/up tp2"),
    (8192, 14336, 8192, 670.4e12, "llama-3.1-70b down tp2"),
    (16384, 8192, 4096, 663.6e12, "llama-3.1-70b q tp2"),
    (16384, 8192, 512, 687.3e12, "llama-3.1-70b kv tp2"),
    (16384, 4096, 8192, 680.7e12, "llama-3.1-70b o tp2"),
    (16384, 8192, 14336, 693e12, "llama-3.1-70b gate/up tp2"),
    (16384, 14336, 8192, 672.8e12, "llama-3.1-70b down tp2"),
    (8192, 8192, 2048, 661.6e12, "llama-3.1-70b q tp4"),
    (8192, 8192, 256, 623.8e12, "llama-3.1-70b kv tp4"),
    (8192, 2048, 8192, 658.7e12, "llama-3.1-70b o tp4"),
    (8192, 8192, 7168, 725.7e12, "llama-3.1-70b gate/up tp4"),
    (8192, 7168, 8192, 683.9e12, "llama-3.1-70b down tp4"),
    (16384, 8192, 2048, 673.7e12, "llama-3.1-70b q tp4"),
    (16384, 8192, 256, 672e12, "llama-3.1-70b kv tp4"),
    (16384, 2048, 8192, 636.6e12, "llama-3.1-70b o tp4"),
    (16384, 8192, 7168, 690.2e12, "llama-3.1-70b gate/up tp4"),
    (16384, 7168, 8192, 645.9e12, "llama-3.1-70b down tp4"),
    (8192, 8192, 1024, 691.3e12, "llama-3.1-70b q tp8"),
    (8192, 8192, 128, 454.8e12, "llama-3.1-70b kv tp8"),
    (8192, 1024, 8192, 621.9e12, "llama-3.1-70b o tp8"),
    (8192, 8192, 3584, 753.8e12, "llama-3.1-70b gate/up tp8"),
    (8192, 3584, 8192, 681.2e12, "llama-3.1-70b down tp8"),
    (16384, 8192, 1024, 688.5e12, "llama-3.1-70b q tp8"),
    (16384, 8192, 128, 486.6e12, "llama-3.1-70b kv tp8"),
    (16384, 1024, 8192, 569.2e12, "llama-3.1-70b o tp8"),
    (16384, 8192, 3584, 727.3e12, "llama-3.1-70b gate/up tp8"),
    (16384, 3584, 8192, 676.2e12, "llama-3.1-70b down tp8"),
    (8192, 1024, 4096, 577.3e12, "gpt2-medium mlp 1x1 grid"),
    (4096, 512, 2048, 403.4e12, "gpt2-medium mlp 2x2 grid"),
    (2730, 341, 1365, 77.22e12, "gpt2-medium mlp 3x3 grid"),
))


def fit(points) -> tuple[float, float]:
    """``(rate, overhead)`` of ``t = F / rate + overhead`` fitted to the aligned ``points`` (at least two distinct
    sizes; the unaligned are :func:`unaligned_slowdown`'s) by
    least squares on the relative error of each product's time: a 30 us shard counts as much as a 30 ms product,
    so the overhead that small products pay is seen (an absolute-error fit of the H200 table let its largest
    products set the line and clamped the overhead to zero). The overhead is clamped at zero (a machine whose small
    products run at the large ones' rate); the rate is then refitted through the origin."""
    points = [p for p in points if p.aligned]
    if len({p.flops for p in points}) < 2:
        raise ValueError(f"fitting a GEMM rate needs aligned products (k and n multiples of {ALIGNMENT}) of at least "
                         f"two sizes, got {len(points)} aligned point(s)")
    # minimise sum((x / rate + overhead - y) / y)^2: weighted least squares, weights 1 / y^2
    xs, ws = [p.flops / p.seconds for p in points], [1.0 / p.seconds for p in points]  # x / y, 1 / y
    sx, sw = sum(xs), sum(ws)
    sxx, sww, sxw = sum(x * x for x in xs), sum(w * w for w in ws), sum(x * w for x, w in zip(xs, ws))
    det = sxx * sww - sxw * sxw
    slope, overhead = (sx * sww - sw * sxw) / det, (sw * sxx - sx * sxw) / det
    if overhead < 0 or slope <= 0:
        overhead, slope = 0.0, sx / sxx
    return 1.0 / slope, overhead


def unaligned_slowdown(points, rate: float, overhead: float) -> float:
    """How many times the line ``F / rate + overhead`` the unaligned ``points`` took (geometric mean of measured over
    predicted seconds; 1.0 when none was measured)."""
    ratios = [p.seconds / (p.flops / rate + overhead) for p in points if not p.aligned]
    return math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else 1.0


def gemm_seconds(flops: float, gemms: float, rate: float, overhead: float) -> float:
    """Seconds of ``gemms`` products of ``flops`` FLOPs in all: ``flops / rate + gemms * overhead``."""
    return flops / rate + gemms * overhead


def table_shapes(tokens: int, hidden: int, sides=(1, 2, 3), max_m: int | None = None) -> list[tuple[int, int, int]]:
    """The local MLP up-projection ``[tokens/q, h/q] @ [h/q, 4h/q]`` of a ``q x q`` grid for each side ``q``
    (``q = 1``: the unsharded product), ``m`` capped at ``max_m`` (CPU runs)."""
    shapes = []
    for q in sides:
        m = tokens // q if max_m is None else min(tokens // q, max_m)
        shapes.append((m, hidden // q, 4 * hidden // q))
    return shapes


