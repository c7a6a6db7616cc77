"""The open :class:`~lightning_tp2d.bench.layer_cost.OpCounter` s, for code that runs while a counter's dispatch mode
is off: a DTensor op's handler (DTensor runs it with the modes popped), whose local work the counter would not see.
torch's CP ring (:func:`lightning_tp2d.baselines.context_parallel.cpu_ring_attention`) runs a kernel, a merge and a
K|V gradient sum per ring step behind one SDPA op; its handler runs the ring through :func:`count_local`. A module of
its own, below both the counter and the baselines (the counter's module imports the bench runner, which imports
the baselines)."""

from __future__ import annotations

OPEN: list = []  # the OpCounters whose ``with`` is open, innermost last (OpCounter.__enter__ / __exit__)


def count_local(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, its ops counted by the innermost open OpCounter, if any (the mode pushed again for
    the call). The handler's DTensor op itself is counted as one op besides."""
    if not OPEN:
        return fn(*args, **kwargs)
    with OPEN[-1]:
        return fn(*args, **kwargs)


__all__ = ["OPEN", "count_local"]
