"""Recording the communication calls of :mod:`lightning_tp2d.comm`: opt-in, nestable contexts, off by default.

Every call of ``comm`` that communicates is announced here as a :class:`CommCall` (its ``kind``, one of
:data:`KINDS`, its mesh axis, the global ranks it involves and its payload bytes) to the recorders open at the
time: ``posted(call)`` when it is issued and ``waited(call)`` when its handle completes (a blocking call is both
at once). Two recorders ship:

* :func:`count_comm`: calls and payload bytes per kind in a :class:`CommStats`, so a test can assert the
  communication a layer performs (``stats.snapshot()``);
* the cost model's schedule tracer (:mod:`lightning_tp2d.bench.trace`), any object with ``posted`` / ``waited``
  given to :func:`recording`.

Outside such a context nothing is recorded and nothing is computed for it (``comm`` asks :func:`listening` first).
Contexts nest: each sees the calls made while it is open, an outer one the inner block's calls too. This module
needs neither torch nor a process group: ``comm`` works out the ranks and bytes of a call before announcing it.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

KINDS = ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter", "send", "recv", "ring_exchange")


class CommCall:
    """One communication call as the recorders see it: ``kind``, the mesh ``axis`` (``"pair"`` for a point-to-point
    swap), the global ``ranks`` it involves and the payload ``nbytes`` (the convention of :mod:`lightning_tp2d.comm`:
    the payload of the tensor handed to the call on this rank)."""

    __slots__ = ("kind", "axis", "ranks", "nbytes")

    def __init__(self, kind: str, axis: str, ranks: tuple[int, ...], nbytes: int) -> None:
        self.kind, self.axis, self.ranks, self.nbytes = kind, axis, ranks, nbytes

    def __repr__(self) -> str:
        return f"CommCall({self.kind}, {self.axis}, ranks={self.ranks}, nbytes={self.nbytes})"


class CommStats:
    """Calls and bytes per collective kind, as seen by this rank (a recorder: see :func:`count_comm`)."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)

    def add(self, kind: str, *tensors: torch.Tensor) -> None:
        """One call of ``kind`` whose payload is ``tensors`` (several for a ring exchange of a tuple)."""
        self.calls[kind] += 1
        self.bytes[kind] += sum(t.numel() * t.element_size() for t in tensors)

    def posted(self, call: CommCall) -> None:
        self.calls[call.kind] += 1
        self.bytes[call.kind] += call.nbytes

    def waited(self, call: CommCall) -> None:
        pass

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {kind: {"calls": self.calls.get(kind, 0), "bytes": self.bytes.get(kind, 0)} for kind in KINDS}

    def __repr__(self) -> str:
        return f"CommStats({ {k: v for k, v in self.snapshot().items() if v['calls']} })"


# Recorders listening to this process's calls, innermost last. Empty (nothing is counted, no cost) unless a
# count_comm() or a schedule trace is active; contexts nest, each sees the calls made while it is open.
_RECORDERS: list = []


@contextlib.contextmanager
def recording(recorder) -> Iterator:
    """Send every call made inside the block to ``recorder`` (``posted(call)`` when issued, ``waited(call)`` when
    its handle completes; a blocking call is both at once)."""
    _RECORDERS.append(recorder)
    try:
        yield recorder
    finally:
        _RECORDERS.remove(recorder)


@contextlib.contextmanager
def count_comm() -> Iterator[CommStats]:
    """Count the calls issued inside the block in a fresh :class:`CommStats` (nestable: an outer count also sees
    the inner block's calls). Off by default: outside any such block nothing is counted."""
    with recording(CommStats()) as stats:
        yield stats


def listening() -> bool:
    """Whether any recorder is open (``comm`` builds no :class:`CommCall` otherwise)."""
    return bool(_RECORDERS)


def announce_posted(call: CommCall) -> CommCall:
    """Tell every open recorder that ``call`` was issued; returns ``call`` (its handle announces the wait)."""
    for recorder in list(_RECORDERS):
        recorder.posted(call)
    return call


def announce_waited(call: CommCall | None) -> None:
    """Tell every open recorder that ``call`` completed (nothing for ``None``: a call made while none listened)."""
    if call is not None:
        for recorder in list(_RECORDERS):
            recorder.waited(call)
