"""One rank's training step as the cost and memory models read it: :class:`TracedStep`, what the tracer
(:mod:`lightning_tp2d.planning.trace`) records and the closed forms (:mod:`lightning_tp2d.planning.closed_step`)
compute."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

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


def _order(item) -> tuple:
    ev, fm, fa, ranks = item
    return (ev.phase, ev.kind, ev.group, ev.nbytes, ev.overlap_flops, fm, fa, ranks, ev.calls)


def root_and_blocks(root, block, n_layer: int, activation_bytes: int) -> TracedStep:
    """The step of a model of ``n_layer`` identical blocks from one rank's root and one block, each a schedule
    with ``events()`` (``(event, matmul FLOPs, attention FLOPs, ranks) -> calls``), ``flops[phase][rate]`` and
    ``gemms[phase]`` (the closed forms' streams): the root's once, the block's ``n_layer`` times, the events merged
    and ordered as the tracer orders them; ``block_calls`` the calls one block adds."""
    merged: dict[tuple, int] = defaultdict(int)
    for key, n in root.events().items():
        merged[key] += n
    block_events = block.events()
    for key, n in block_events.items():
        merged[key] += n_layer * n
    events = tuple(sorted(((dataclasses.replace(ev, calls=n), fm, fa, r) for (ev, fm, fa, r), n in merged.items()),
                          key=_order))
    flops = {ph: {rate: root.flops[ph][rate] + n_layer * block.flops[ph][rate] for rate in root.flops[ph]}
             for ph in root.flops}
    gemms = {ph: root.gemms[ph] + n_layer * block.gemms[ph] for ph in root.gemms}
    return TracedStep(events, flops, activation_bytes, gemms, sum(block_events.values()))
