"""The unit the cost model speaks: one kind of communication call, how often, how big, over which group.

Both the exact byte count a rank sends per step (checked against the counters of a real run) and the projected
time come from the same list of :class:`Comm` events, so the two can never disagree about what is sent.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from lightning_tp2d.comm_record import KINDS


@dataclass(frozen=True)
class Comm:
    """``calls`` calls of ``kind`` over a group of ``group_size`` ranks along ``group``.

    ``nbytes`` is the payload of one call as :func:`lightning_tp2d.comm.count_comm` counts it on this rank: the
    broadcast / reduced / all-reduced tensor, the local input of an all-gather, the full input of a
    reduce-scatter, the tensors handed to one send, recv or ring exchange. ``overlap_flops`` is the compute
    (per call) the transfer can hide behind: 0 for a blocking call.
    """

    kind: str
    group: str  # mesh axis: "row" | "col" | "ring" | "data_parallel", "pair" (a point-to-point swap), "tp" (1-D TP)
    group_size: int
    nbytes: int
    calls: int = 1
    overlap_flops: float = 0.0
    phase: str = "forward"  # "forward" | "backward"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown communication kind {self.kind!r}; choose one of {list(KINDS)}")


def float32_bytes(elem: int) -> int:
    """Bytes per element of what the code keeps in float32 whatever the compute dtype ``elem`` (bf16 autocast keeps
    parameters, their gradients, embeddings and statistics in float32; float64 stays float64)."""
    return 8 if elem == 8 else 4


def totals(events: list[Comm]) -> dict[str, dict[str, int]]:
    """``{kind: {"calls": n, "bytes": b}}`` for every kind in :data:`~lightning_tp2d.comm.KINDS` (zeros included),
    the same shape as ``comm.count_comm()``'s ``snapshot()``."""
    calls: dict[str, int] = defaultdict(int)
    nbytes: dict[str, int] = defaultdict(int)
    for e in events:
        calls[e.kind] += e.calls
        nbytes[e.kind] += e.calls * e.nbytes
    return {kind: {"calls": calls[kind], "bytes": nbytes[kind]} for kind in KINDS}


def wire_factor(kind: str, group_size: int) -> float:
    """Bytes one rank puts on the wire per payload byte, averaged over the group, for the usual algorithms:
    pipelined broadcast / reduce ``(n-1)/n``, ring all-reduce ``2(n-1)/n``, ring all-gather ``n-1`` (of the local
    input), ring reduce-scatter ``(n-1)/n`` (of the full input); a send or ring exchange sends its payload, a
    receive sends nothing."""
    n = group_size
    return {"broadcast": (n - 1) / n, "reduce": (n - 1) / n, "all_reduce": 2 * (n - 1) / n,
            "all_gather": n - 1, "reduce_scatter": (n - 1) / n, "send": 1.0, "recv": 0.0,
            "ring_exchange": 1.0}[kind]


def wire_bytes(events: list[Comm]) -> int:
    """Bytes this rank sends in ``events`` (see :func:`wire_factor`): the volume the SUMMA and ring analyses
    compare, unlike the payload, which counts a broadcast on every rank that takes part."""
    return round(sum(e.calls * e.nbytes * wire_factor(e.kind, e.group_size) for e in events))
