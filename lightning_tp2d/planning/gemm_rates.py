"""Shape-dependent GEMM rates: a small calibration table and the two-parameter model fitted to it.

A GEMM of ``F = 2 m k n`` FLOPs is modelled as taking ``F / rate + overhead`` seconds: ``rate`` the sustained
throughput of large products, ``overhead`` a fixed cost per kernel (launch, the last partial wave of tiles, the
pipeline's fill and drain). Small panel products -- a SUMMA step on a ``q x q`` grid multiplies blocks ``q`` times
narrower in two dimensions, ``q`` times as often -- lose to the overhead what large ones do not; the cost model
charges every traced GEMM (:mod:`lightning_tp2d.planning.trace` counts them) its overhead.

:data:`H200_BF16` is the committed table: two bf16 products measured on this project's H200 (the local MLP product of
GPT-2 medium's shapes at 8192 tokens, and its quarter-size 2x2-grid shard). Their fit,
``rate = 773e12`` FLOP/s and ``overhead = 5.25 us``, prices the H100 preset (an H200 is an H100's compute with
more HBM). ``tp2d-bench --measured-rates`` measures a table on the machine it runs on
(:func:`lightning_tp2d.bench.calibrate.measure_table`) and
projects with that fit instead, keeping the preset's links; its table is written into ``results.json``.
"""

from __future__ import annotations

from dataclasses import dataclass


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


H200_BF16 = (
    GemmPoint(8192, 1024, 4096, 730e12, "H200, torch 2.11 / CUDA 13, bf16 (the developers' brief)"),
    GemmPoint(4096, 512, 2048, 525e12, "H200, torch 2.11 / CUDA 13, bf16: the 2x2-grid shard of the product above"),
)


def fit(points) -> tuple[float, float]:
    """``(rate, overhead)`` of ``t = F / rate + overhead`` by least squares over ``points`` (at least two distinct
    sizes). The overhead is clamped at zero (a machine whose small products run at the large ones' rate); the rate
    is then refitted through the origin."""
    points = list(points)
    if len({p.flops for p in points}) < 2:
        raise ValueError(f"fitting a GEMM rate needs products of at least two sizes, got {len(points)} point(s)")
    xs, ys = [p.flops for p in points], [p.seconds for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    overhead = my - slope * mx
    if overhead < 0 or slope <= 0:
        overhead, slope = 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return 1.0 / slope, overhead


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


