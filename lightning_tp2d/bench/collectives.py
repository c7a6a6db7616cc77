"""Count the functional collectives that PyTorch's DTensor issues, in the byte convention of :mod:`lightning_tp2d.comm`.

Our own layouts count their communication with :func:`lightning_tp2d.comm.count_comm` because every call goes through
``comm.py``. PyTorch's tensor parallelism (``torch.distributed.tensor.parallel``) does not: DTensor turns each
redistribution into a functional collective (``torch.ops._c10d_functional.*``). To compare the two on the same
scale, :class:`FunctionalCollectiveCounter` is a ``TorchDispatchMode`` that sees those ops and adds them to a
:class:`~lightning_tp2d.comm.CommStats`:

* For an op whose arguments include a DTensor it returns ``NotImplemented``: DTensor then runs and desugars the
  op into local ops and functional collectives, which reach this mode as plain-tensor ops (the same trick as
  torch's own ``CommDebugMode``). The mode stays on the stack while autograd runs, so the collectives of
  ``backward()`` called inside the block are counted too.
* Bytes per call, as in ``comm.py``: ``all_reduce`` and ``broadcast``: the tensor; ``all_gather``: the *local*
  input; ``reduce_scatter``: the *full* input. A ``*_coalesced`` op is one call whose bytes are all of its
  tensors. The in-place and ``*_out`` variants count like the plain ones. ``by_group`` holds the same bytes per
  kind and process group name (what pricing a call by its group's size needs).
* Only the native ops (``_c10d_functional``) are counted. Their autograd wrappers
  (``_c10d_functional_autograd.*``) are not seen by a dispatch mode at all (autograd runs above the Python mode
  key and calls the native op, which is what the mode sees), so nothing is counted twice.
* ``all_to_all_single`` has no kind in :data:`~lightning_tp2d.comm.KINDS`, and no honest one: it is neither an
  all-gather nor a reduce-scatter, and its bytes are split unevenly. Folding it into another kind would make the
  totals lie, so by default (``strict=True``) the counter raises ``RuntimeError`` naming the op and the tensor
  shape at the first one, before it is issued (every rank raises at the same op, nothing hangs). With
  ``strict=False`` it records each one in ``counter.uncounted`` (op name and the bytes of its tensor arguments)
  instead and lets it run. Point-to-point functional ops (``isend``, ``irecv``, ``batch_p2p_ops``) are
  treated the same way.
* ``wait_tensor`` and ``_wrap_tensor_autograd`` are bookkeeping, not communication, and a collective on meta or
  fake tensors (shape propagation, tracing) sends nothing and is not counted.

Collectives issued through the non-functional ``torch.distributed`` API (``dist.all_reduce`` ...) are not
counted here: ``comm.py`` counts its own, and DTensor does not use that API on its data path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_tp2d.planning.live import tensors_in
from lightning_tp2d.comm_record import CommStats

__all__ = ["FunctionalCollectiveCounter", "count_functional_collectives"]

_funcol = torch.ops._c10d_functional

# op packet -> kind; the payload is the first argument (a tensor, or the list of a coalesced op)
_COUNTED = {
    _funcol.all_reduce: "all_reduce",
    _funcol.all_reduce_: "all_reduce",
    _funcol.all_reduce_coalesced: "all_reduce",
    _funcol.all_reduce_coalesced_: "all_reduce",
    _funcol.all_gather_into_tensor: "all_gather",
    _funcol.all_gather_into_tensor_out: "all_gather",
    _funcol.all_gather_into_tensor_coalesced: "all_gather",
    _funcol.reduce_scatter_tensor: "reduce_scatter",
    _funcol.reduce_scatter_tensor_out: "reduce_scatter",
    _funcol.reduce_scatter_tensor_coalesced: "reduce_scatter",
    _funcol.broadcast: "broadcast",
    _funcol.broadcast_: "broadcast",
}
# Communication without a kind in comm.KINDS: refused (strict) or listed in ``uncounted``.
_UNCOUNTABLE = {
    _funcol.all_to_all_single,
    _funcol.isend,
    _funcol.irecv,
    _funcol.batch_p2p_ops,
}


def _payload(arg) -> list[torch.Tensor]:
    if isinstance(arg, torch.Tensor):
        return [arg]
    return [t for t in arg if isinstance(t, torch.Tensor)]


def _shape_only(arg) -> bool:
    return any(t.is_meta or isinstance(t, FakeTensor) for t in _payload(arg))


class FunctionalCollectiveCounter(TorchDispatchMode):
    """Dispatch mode adding every functional collective DTensor issues to ``self.stats`` (a fresh
    :class:`~lightning_tp2d.comm.CommStats`, or the one given). See the module docstring for the convention.

    Usable with other modes on the stack (``with FunctionalCollectiveCounter() as c, OtherMode(): ...``);
    ``stats`` keeps the counts after the block ends.
    """

    def __init__(self, stats: CommStats | None = None, strict: bool = True) -> None:
        super().__init__()
        self.stats = stats if stats is not None else CommStats()
        self.strict = strict
        self.uncounted: list[tuple[str, int]] = []
        self.by_group: dict[tuple[str, str], int] = {}  # (kind, process group name) -> payload bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar it; its local ops and collectives come back here
        packet = func.overloadpacket
        kind = _COUNTED.get(packet)
        if kind is not None and _shape_only(args[0]):
            pass  # shape propagation (meta / fake tensors) sends nothing
        elif kind is not None:
            self.stats.add(kind, *_payload(args[0]))
            group = kwargs.get("group_name") or [a for a in args if isinstance(a, str)][-1]  # the last str argument
            key = (kind, group)
            nbytes = sum(t.numel() * t.element_size() for t in _payload(args[0]))
            self.by_group[key] = self.by_group.get(key, 0) + nbytes
        elif packet in _UNCOUNTABLE:
            tensors = tensors_in((args, kwargs))
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            if self.strict:
                shapes = [tuple(t.shape) for t in tensors]
                raise RuntimeError(
                    f"{func} ({shapes}, {nbytes} bytes) has no kind in lightning_tp2d.comm.KINDS and would be "
                    "miscounted; count with strict=False to run it and list it in .uncounted instead")
            self.uncounted.append((str(func), nbytes))
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_functional_collectives(strict: bool = True) -> Iterator[CommStats]:
    """Count the functional collectives (forward and backward) issued inside the block; yields the
    :class:`~lightning_tp2d.comm.CommStats` being filled (``.snapshot()`` has the shape of a ``comm.count_comm()`` snapshot).

    With ``strict=False`` use :class:`FunctionalCollectiveCounter` directly to read its ``uncounted`` list."""
    counter = FunctionalCollectiveCounter(strict=strict)
    with counter:
        yield counter.stats
