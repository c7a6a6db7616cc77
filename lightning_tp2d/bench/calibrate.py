"""Measure this machine's rates so the cost model can be checked against a run on it.

* :func:`matmul_rate`: FLOP/s of a local matrix product of the given shape, one thread per rank as the
  benchmark ranks run (or on the GPU).
* :func:`measure_table`: a table of such rates (:class:`~lightning_tp2d.planning.gemm_rates.GemmPoint`) for
  :func:`lightning_tp2d.planning.gemm_rates.fit`.
* :func:`link`: latency and bandwidth of a point-to-point transfer between two ranks of the benchmark's own
  backend, fitted (least squares, ``t = latency + bytes / bandwidth``) from ping-pongs of several sizes.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from lightning_tp2d.bench.procs import run_ranks
from lightning_tp2d.planning.gemm_rates import GemmPoint

SIZES = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22)  # bytes per ping-pong message


def matmul_rate(m: int, k: int, n: int, device: str = "cpu", dtype: str = "float32", repeats: int = 20) -> float:
    """FLOP/s of ``[m, k] @ [k, n]`` (median of ``repeats``), single-threaded on CPU."""
    if device == "cpu":
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
    try:
        dt = getattr(torch, dtype)
        a = torch.randn(m, k, device=device).to(dt)
        b = torch.randn(k, n, device=device).to(dt)
        times = []
        for _ in range(repeats + 2):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            a @ b
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        times = sorted(times[2:])
        return 2 * m * k * n / times[len(times) // 2]
    finally:
        if device == "cpu":
            torch.set_num_threads(threads)


def _ping_pong(rank: int, world_size: int, sizes, repeats: int) -> list[tuple[int, float]]:
    out = []
    for nbytes in sizes:
        buf = torch.zeros(nbytes // 4)
        times = []
        for _ in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            times.append((time.perf_counter() - t0) / 2)  # one way
        times = sorted(times[1:])
        out.append((nbytes, times[len(times) // 2]))
    return out


def link(device: str = "cpu", sizes=SIZES, repeats: int = 10) -> tuple[float, float]:
    """``(latency_s, bandwidth_Bps)`` of one-way transfers between two benchmark ranks."""
    result = run_ranks(_ping_pong, 2, sizes, repeats, device=device, timeout=120)
    if not result.ok:
        raise RuntimeError(f"link calibration failed: {result.reason}")
    pts = result.values[0]
    n = len(pts)
    mean_b = sum(b for b, _ in pts) / n
    mean_t = sum(t for _, t in pts) / n
    slope = sum((b - mean_b) * (t - mean_t) for b, t in pts) / sum((b - mean_b) ** 2 for b, _ in pts)
    latency = max(mean_t - slope * mean_b, 1e-7)
    return latency, (1.0 / slope if slope > 0 else float("inf"))


def measure_table(shapes, device: str = "cpu", dtype: str = "float32", repeats: int = 5) -> list[GemmPoint]:
    """Measure each ``(m, k, n)`` on this machine (:func:`matmul_rate`)."""
    return [GemmPoint(m, k, n, matmul_rate(m, k, n, device, dtype, repeats=repeats), f"this machine, {device} {dtype}")
            for m, k, n in shapes]
