"""One rank's training step as the cost and memory models read it: :class:`TracedStep`, what the tracer
(:mod:`lightning_tp2d.planning.trace`) records and the closed forms (:mod:`lightning_tp2d.planning.closed_step`)
compute."""

from __future__ import annotations

import dataclasses

from lightning_tp2d.planning.events import Comm


@dataclasses.dataclass(frozen=True)
class TracedStep:
    """One rank's step: the calls (merged where identical) each tagged with its overlapped FLOPs per rate, and the
    FLOPs per phase and rate."""

    # (event with overlap_flops = all overlapped FLOPs, of which matmul, of which attention, the group's global ranks)
    events: tuple[tuple[Comm, float, float, tuple[int, ...]], ...]
    flops: dict  # {"forward": {"matmul": f, "attention": f}, "backward": {...}}
    activation_bytes: int  # storages the forward created that autograd saved for the backward
    gemms: dict  # {"forward": n, "backward": n}: matmul kernels launched (each pays the GEMM overhead of the rates)
    block_calls: int | None = None  # communication calls one transformer block adds (None: traced with one block)
