"""Recording the communication calls of :mod:`lightning_tp2d.comm`: opt-in, nestable contexts, off by default.

Every call of ``comm`` that communicates is announced here as a :class:`CommCall` (its ``kind``, one of
:data:`KINDS`, its mesh axis, the global ranks it involves and its payload bytes) to the recorders open at the
time: ``posted(call)`` when it is issued and ``waited(call)`` when its handle completes (a blocking call is both
at once). Two recorders ship:

* :func:`count_comm`: calls and payload bytes per kind in a :class:`CommStats`, so a test can assert the
  communication a layer performs (``stats.snapshot()``);
* the cost model's schedule tracer (:mod:`lightning_tp2d.planning.trace`), any object with ``posted`` / ``waited``
  given to :func:`recording`.

Outside such a context nothing is recorded and nothing is computed for it (``comm`` asks :func:`listening` first).
Contexts nest: each sees the calls made while it is open, an outer one the inner block's calls too. ``comm`` works
out the ranks and bytes of its calls before announcing them.

Collectives that bypass ``comm``: torch's FSDP2 (ZeRO stages 2 and 3, :mod:`lightning_tp2d.fsdp`) all-gathers and
reduce-scatters through ``torch.distributed`` itself. While a context is open, a dispatch mode sees the ``c10d`` ops
that every ``torch.distributed`` collective issues; one issued while ``lightning_tp2d.comm`` is on the call stack is
``comm``'s own (announced by it), any other is announced as a :class:`CommCall` with ``direct=True`` in the same
convention: its kind, the mesh axis its group was made for (``DeviceMesh`` names an axis group ``mesh_<axis>``;
``"data_parallel"`` for FSDP's), the group's global ranks and the payload (an all-gather's local input, a
reduce-scatter's full input, an all-reduce's or broadcast's tensors), posted and waited at once where the host issues
it (FSDP issues its collectives without waiting on the host: the schedule tracer times them by FSDP's stream rule
instead). Collectives nested inside another op (DTensor's functional collectives) are not seen:
:class:`~lightning_tp2d.bench.collectives.FunctionalCollectiveCounter` counts those. The module loads without torch
(``comm`` builds its own calls); the dispatch mode is made on first use.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

KINDS = ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter", "send", "recv", "ring_exchange")


class CommCall:
    """One communication call as the recorders see it: ``kind``, the mesh ``axis`` (``"pair"`` for a point-to-point
    swap), the global ``ranks`` it involves and the payload ``nbytes`` (the convention of :mod:`lightning_tp2d.comm`:
    the payload of the tensor handed to the call on this rank). ``direct``: issued through ``torch.distributed``
    by other code than ``comm`` (FSDP's all-gathers and reduce-scatters; module docstring)."""

    __slots__ = ("kind", "axis", "ranks", "nbytes", "direct")

    def __init__(self, kind: str, axis: str, ranks: tuple[int, ...], nbytes: int, direct: bool = False) -> None:
        self.kind, self.axis, self.ranks, self.nbytes, self.direct = kind, axis, ranks, nbytes, direct

    def __repr__(self) -> str:
        direct = ", direct" if self.direct else ""
        return f"CommCall({self.kind}, {self.axis}, ranks={self.ranks}, nbytes={self.nbytes}{direct})"


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
def recording(recorder, *, direct: bool = True) -> Iterator:
    """Send every call made inside the block to ``recorder`` (``posted(call)`` when issued, ``waited(call)`` when
    its handle completes; a blocking call is both at once), the direct ``torch.distributed`` ones included (module
    docstring). ``direct=False``: ``recorder`` is itself a dispatch mode, active inside the block, that announces
    the direct ones with :func:`direct_call` (one Python dispatch layer fewer on every op)."""
    _RECORDERS.append(recorder)
    try:
        with _direct_collectives()(recorder) if direct else contextlib.nullcontext():
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


# ---- collectives issued through torch.distributed by other code (FSDP2) ----------------------------------------

# c10d op (the native op every torch.distributed collective issues) -> (kind, index of the payload argument, index
# of the process group argument). Payload as comm's: an all-gather's local input, a reduce-scatter's full input.
_C10D_CALLS = {
    "_allgather_base_": ("all_gather", 1, 2),  # all_gather_single / all_gather_into_tensor
    "allgather_into_tensor_coalesced_": ("all_gather", 1, 2),
    "allgather_": ("all_gather", 1, 2),
    "allgather_coalesced_": ("all_gather", 1, 2),
    "_reduce_scatter_base_": ("reduce_scatter", 1, 2),  # reduce_scatter_single / reduce_scatter_tensor
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, 2),
    "reduce_scatter_": ("reduce_scatter", 1, 2),
    "allreduce_": ("all_reduce", 0, 1),
    "allreduce_coalesced_": ("all_reduce", 0, 1),
    "broadcast_": ("broadcast", 0, 1),
    "reduce_": ("reduce", 0, 1),
}
_COMM_MODULE = f"{__name__.rpartition('.')[0]}.comm"  # lightning_tp2d.comm, which announces its own calls


def _payload(arg) -> int:
    """Bytes of a tensor, or of the tensors of a (nested) list."""
    if isinstance(arg, (list, tuple)):
        return sum(_payload(a) for a in arg)
    return arg.numel() * arg.element_size()


def _from_comm() -> bool:
    """Whether :mod:`lightning_tp2d.comm` is on the call stack (the collective is its own)."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_globals.get("__name__") == _COMM_MODULE:
            return True
        frame = frame.f_back
    return False


def _axis_of(group) -> str:
    """The mesh axis a process group was made for (``DeviceMesh`` describes an axis group as ``mesh_<axis>``),
    else the group's own description or name."""
    desc = group.group_desc or group.group_name
    return desc[len("mesh_"):] if desc.startswith("mesh_") else desc


@functools.cache
def _direct_collectives() -> type:
    """The class of the dispatch mode that announces the direct collectives (module docstring)."""
    # torch is imported here, on first use: the module itself loads without torch (comm builds its own calls)
    from torch.utils._python_dispatch import TorchDispatchMode

    class _DirectCollectives(TorchDispatchMode):
        """Announces to ``recorder`` every ``c10d`` collective issued while it is active that does not come from
        :mod:`lightning_tp2d.comm`, posted and waited at once."""

        def __init__(self, recorder) -> None:
            super().__init__()
            self.recorder = recorder

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            call = direct_call(func, args)
            if call is None:
                return func(*args, **kwargs)
            self.recorder.posted(call)
            out = func(*args, **kwargs)
            self.recorder.waited(call)
            return out

    return _DirectCollectives


def direct_call(func, args) -> CommCall | None:
    """The :class:`CommCall` of a dispatched op that is a ``c10d`` collective issued by code other than
    :mod:`lightning_tp2d.comm` (which announces its own), posted and waited at once; ``None`` for any other op."""
    what = _C10D_CALLS.get(func.overloadpacket.__name__) if func.namespace == "c10d" else None
    if what is None or _from_comm():
        return None
    import torch.distributed as dist  # on first use: the module loads without torch (as _direct_collectives)

    kind, payload, group_at = what
    group = dist.ProcessGroup.unbox(args[group_at])
    return CommCall(kind, _axis_of(group), tuple(dist.get_process_group_ranks(group)), _payload(args[payload]),
                    direct=True)
