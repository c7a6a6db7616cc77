"""Every raw collective of the package, along one named axis of a :class:`DeviceMesh`.

No autograd here: the functions in :mod:`lightning_tp2d.summa` and :mod:`lightning_tp2d.nn` pair them into
forward/backward duals. Each call

* returns at once when the axis has one rank (size-1 bypass: nothing is sent and nothing is counted);
* takes ``src``/``dst`` as the *coordinate along the axis*, not a global rank;
* with ``async_op=True`` returns a :class:`Handle` whose ``wait()`` completes it;
* is reported to the open recorders of :mod:`lightning_tp2d.comm_record`, if any: :func:`count_comm` (calls and
  payload bytes per kind, so tests can assert the communication a layer performs) or the cost model's schedule
  tracer (:mod:`lightning_tp2d.planning.trace`). Nothing is recorded outside such a context. ``bytes`` is the payload
  of the tensor handed to the call on this rank: the broadcast/reduced/all-reduced tensor, the local input of an
  all-gather, the full input of a reduce-scatter.

Under gloo, ``broadcast`` and ``reduce`` of CUDA tensors are staged through host memory here (gloo has no CUDA
``reduce``, and its CUDA broadcast writes back into the source); this is how several ranks share one GPU.

The ring layouts add one point-to-point call, :func:`ring_shift`: every rank of an axis sends its tensors to the
next coordinate and receives the previous one's (counted as ``ring_exchange``, one call per shift). Every wait
on a point-to-point handle is bounded by the process group's timeout, so a rank that dies or stalls mid-ring
surfaces on its neighbours as an error, not a hang.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

# KINDS, CommStats, count_comm and recording are public names of lightning_tp2d.comm too (comm.count_comm())
from lightning_tp2d.comm_record import (KINDS, CommCall, CommStats, announce_posted, announce_waited,  # noqa: F401
                                        count_comm, listening, recording)
from lightning_tp2d.errors import CommError, backend_detail  # noqa: F401 (raised here; public name lightning_tp2d.comm.CommError)

# torch >= 2.13 renamed the tensor-in/tensor-out collectives; keep older releases working.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# True while :func:`shapes_only` is active: every call allocates its outputs but nothing is sent or counted.
_SHAPES_ONLY = False


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
    """Inside the block no call communicates or is recorded: receive and output buffers are allocated but left
    unwritten. The fake (shape-propagation) kernels of :mod:`lightning_tp2d.ops` run a layer's real forward and
    backward this way on fake tensors, so torch.compile learns its output shapes without a second implementation."""
    global _SHAPES_ONLY
    before, _SHAPES_ONLY = _SHAPES_ONLY, True
    try:
        yield
    finally:
        _SHAPES_ONLY = before


def _post(kind: str, axis: str, group, tensors, peer: int | None = None) -> CommCall | None:
    """Tell the open recorders about a call (nothing to do, and nothing computed, when none is open)."""
    if not listening() or _SHAPES_ONLY:
        return None
    ranks = (dist.get_rank(), peer) if peer is not None else tuple(dist.get_process_group_ranks(group))
    return announce_posted(CommCall(kind, axis, ranks, sum(t.numel() * t.element_size() for t in tensors)))


def _where(kind: str, axis: str, group, peers: tuple[int, ...] = ()) -> tuple:
    return kind, axis, group, peers


@contextlib.contextmanager
def _named(where: tuple | None) -> Iterator[None]:
    """Re-raise a backend error from the block as a :class:`CommError` naming ``where``."""
    try:
        yield
    except CommError:
        raise
    except RuntimeError as err:
        if where is None:
            raise
        kind, axis, group, peers = where
        try:
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
        except (RuntimeError, ValueError):
            ranks = ()
        with_peers = f", exchanging with global rank(s) {', '.join(map(str, peers))}" if peers else ""
        raise _failed(f"{kind} along mesh axis {axis!r} (global ranks {list(ranks)}{with_peers})", err,
                      "A rank of that axis") from err


@contextlib.contextmanager
def naming_failures(call: str) -> Iterator[None]:
    """Re-raise a backend error from the block as a :class:`CommError` naming ``call``, as the axis calls above do,
    for the collectives of the default group that are not made here: Lightning's barriers and broadcasts, and the
    gathers and barriers of a checkpoint save (torch.distributed.checkpoint's own included). Only the backend's
    errors are translated (a plain ``RuntimeError``, as gloo raises, or torch's ``DistError``s); the package's own
    errors and any other exception pass unchanged."""
    try:
        yield
    except RuntimeError as err:
        if type(err) is not RuntimeError and not isinstance(err, dist.DistError):
            raise
        raise _failed(call, err, "A rank") from err


def _failed(call: str, err: BaseException, who: str) -> CommError:
    """``call`` did not complete on this rank; ``who`` (which rank may be to blame) stalled or died."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return CommError(f"{call} did not complete on rank {rank}: {backend_detail(err)} {who} stalled past the process "
                     "group's timeout or died; its own log says which.", call=call)




class Handle:
    """Completion handle of an async call; ``wait()`` is idempotent and runs any host-staging copy-back. A failure
    or timeout raises :class:`CommError` naming the call."""

    __slots__ = ("_work", "_then", "_call", "_where")

    def __init__(self, work=None, then: Callable[[], None] | None = None, call: CommCall | None = None,
                 where: tuple | None = None) -> None:
        self._work, self._then, self._call, self._where = work, then, call, where

    def wait(self) -> None:
        if self._work is not None:
            with _named(self._where):
                self._work.wait()
            self._work = None
        if self._then is not None:
            then, self._then = self._then, None
            then()
        if self._call is not None:
            call, self._call = self._call, None
            announce_waited(call)


DONE = Handle()


def axis_group(mesh: DeviceMesh, axis: str) -> dist.ProcessGroup:
    return mesh.get_group(axis)


def axis_size(mesh: DeviceMesh, axis: str) -> int:
    return mesh.size(mesh.mesh_dim_names.index(axis))


def axis_rank(mesh: DeviceMesh, axis: str) -> int:
    return mesh.get_local_rank(axis)


FLOAT8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz})


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """What travels for ``tensor``: float8 blocks (``parallel.float8``) as their bytes (a ``uint8`` view of the same
    storage: gloo has no float8 type, and NCCL moves them as bytes too), anything else as it is."""
    return tensor.view(torch.uint8) if tensor.dtype in FLOAT8_DTYPES else tensor


def _needs_host_staging(tensor: torch.Tensor, group: dist.ProcessGroup) -> bool:
    return tensor.is_cuda and dist.get_backend(group) == "gloo"


def _finish(work, async_op: bool, then: Callable[[], None] | None = None, call: CommCall | None = None,
            where: tuple | None = None) -> Handle:
    handle = Handle(work, then, call, where)
    if not async_op:
        handle.wait()
        return DONE
    return handle


def _issue(collective, tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool, write_back: bool,
           call: CommCall | None, where: tuple | None = None, **kwargs) -> Handle:
    """Run the in-place ``collective`` on ``tensor``; under gloo a CUDA tensor travels through a host copy,
    copied back afterwards when ``write_back`` (gloo has no CUDA ``reduce``, and its own CUDA broadcast writes
    back into the source too, which would bump the version of a parameter shard that autograd saved)."""
    if _SHAPES_ONLY:
        return DONE
    tensor = _bits(tensor)
    if not _needs_host_staging(tensor, group):
        with _named(where):
            work = collective(tensor, group=group, async_op=async_op, **kwargs)
        return _finish(work, async_op, call=call, where=where)
    host = tensor.detach().cpu()
    with _named(where):
        work = collective(host, group=group, async_op=async_op, **kwargs)
    return _finish(work, async_op, then=(lambda: tensor.copy_(host)) if write_back else None, call=call, where=where)


def broadcast_along(tensor: torch.Tensor, mesh: DeviceMesh, axis: str, src: int, async_op: bool = False) -> Handle:
    """In place: every rank of the axis receives ``tensor`` of the rank at coordinate ``src``."""
    if axis_size(mesh, axis) == 1:
        return DONE
    group = axis_group(mesh, axis)
    call = _post("broadcast", axis, group, (tensor,))
    return _issue(dist.broadcast, tensor, group, async_op, write_back=axis_rank(mesh, axis) != src, call=call,
                  where=_where("broadcast", axis, group), src=dist.get_global_rank(group, src))


def reduce_along(tensor: torch.Tensor, mesh: DeviceMesh, axis: str, dst: int, async_op: bool = False) -> Handle:
    """Sum ``tensor`` over the axis into the rank at coordinate ``dst`` (other ranks' buffers are scratch)."""
    if axis_size(mesh, axis) == 1:
        return DONE
    group = axis_group(mesh, axis)
    call = _post("reduce", axis, group, (tensor,))
    return _issue(dist.reduce, tensor, group, async_op, write_back=True, call=call, where=_where("reduce", axis, group),
                  dst=dist.get_global_rank(group, dst), op=dist.ReduceOp.SUM)


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce_along(tensor: torch.Tensor, mesh: DeviceMesh, axis: str, op: str = "sum",
                     async_op: bool = False) -> Handle:
    """In place: ``tensor`` becomes its ``op`` (sum, max or min) over the axis."""
    if axis_size(mesh, axis) == 1:
        return DONE
    group = axis_group(mesh, axis)
    call = _post("all_reduce", axis, group, (tensor,))
    if _SHAPES_ONLY:
        return DONE
    where = _where("all_reduce", axis, group)
    with _named(where):
        work = dist.all_reduce(tensor, op=_OPS[op], group=group, async_op=async_op)
    return _finish(work, async_op, call=call, where=where)


def summed_later(tensor: torch.Tensor, mesh: DeviceMesh, axis: str) -> Callable[[], torch.Tensor]:
    """Post the in-place sum of ``tensor`` over ``axis`` (async) and return ``finish``, which waits for it and returns
    ``tensor`` as a fresh view: what a backward hands autograd as a replicated parameter's gradient, summed while its
    other work runs. (The collective's work object may still hold ``tensor`` itself when autograd accumulates the
    gradient, and autograd would then copy it; a view the work does not hold it takes as it is.)"""
    handle = all_reduce_along(tensor, mesh, axis, async_op=True)

    def finish() -> torch.Tensor:
        handle.wait()
        return tensor.view_as(tensor)

    return finish


def exchange_with(tensor: torch.Tensor, peer: int) -> torch.Tensor:
    """Send ``tensor`` to global rank ``peer`` and return what ``peer`` sends back (same shape and dtype).

    ``peer`` must call it with this rank as its peer; with ``peer`` == this rank it returns ``tensor`` itself
    and sends nothing. One ``send`` and one ``recv`` are counted. Under gloo, CUDA tensors travel through host
    memory (gloo has no CUDA point-to-point).
    """
    if peer == dist.get_rank():
        return tensor
    tensor = tensor.contiguous()
    if _SHAPES_ONLY:
        return torch.empty_like(tensor)
    calls = [_post(kind, "pair", None, (tensor,), peer=peer) for kind in ("send", "recv")]
    incoming = torch.empty_like(tensor)
    where = _where("exchange", "pair", None, (peer,))
    with _named(where):
        works, then = _point_to_point([tensor], [incoming], [(peer, 0)], [(peer, 0)], None, dist.get_rank() < peer)
        works.wait()
    if then is not None:
        then()
    for call in calls:
        announce_waited(call)
    return incoming


def all_gather_along(tensor: torch.Tensor, mesh: DeviceMesh, axis: str, dim: int = 0) -> torch.Tensor:
    """Concatenate the axis ranks' ``tensor`` (equal shapes) along ``dim``, in coordinate order."""
    n = axis_size(mesh, axis)
    if n == 1:
        return tensor
    blocks, handle = all_gather_blocks(tensor, mesh, axis)
    handle.wait()
    if dim % tensor.dim() == 0:
        return blocks.view(n * tensor.shape[0], *tensor.shape[1:])
    return torch.cat(blocks.unbind(0), dim=dim)


def reduce_scatter_along(tensor: torch.Tensor, mesh: DeviceMesh, axis: str, dim: int = 0) -> torch.Tensor:
    """Sum over the axis, then keep chunk ``axis_rank`` of ``dim`` (which must divide evenly)."""
    n = axis_size(mesh, axis)
    if n == 1:
        return tensor
    if tensor.shape[dim] % n:
        raise ValueError(f"reduce_scatter along {axis!r}: dim {dim} of size {tensor.shape[dim]} is not divisible by {n}")
    moved = tensor.movedim(dim, 0)
    out, handle = reduce_scatter_blocks(moved.reshape(n, moved.shape[0] // n, *moved.shape[1:]), mesh, axis)
    handle.wait()
    return out.movedim(0, dim)


class BroadcastPipeline:
    """Every rank of ``axis`` broadcasts its ``tensor`` in turn, in ``order`` (default: coordinate 0, 1, ...; the
    same on every rank of the axis); ``get(l)`` returns rank ``l``'s tensor, having first posted the next broadcast of
    the order, so that ``ahead`` of them are in flight behind the one returned (``ahead=1``: double buffering).
    ``get`` must be called in ``order``; all ranks' tensors share shape and dtype."""

    def __init__(self, tensor: torch.Tensor, mesh: DeviceMesh, axis: str, order=None, ahead: int = 1) -> None:
        self.tensor, self.mesh, self.axis = tensor, mesh, axis
        self.mine = axis_rank(mesh, axis)
        self._order = iter(range(axis_size(mesh, axis)) if order is None else order)
        self._pending: dict[int, tuple[torch.Tensor, Handle]] = {}
        for _ in range(ahead):
            self._post_next()

    def _post_next(self) -> None:
        l = next(self._order, None)
        if l is not None:
            buf = self.tensor if l == self.mine else torch.empty_like(self.tensor)
            self._pending[l] = (buf, broadcast_along(buf, self.mesh, self.axis, src=l, async_op=True))

    def get(self, l: int) -> torch.Tensor:
        buf, handle = self._pending.pop(l)
        self._post_next()
        handle.wait()
        return buf


class ReducePipeline:
    """Sums partial results over ``axis`` into their owners, one reduce per ``push``, at most two in flight;
    ``finish()`` returns the sum this rank owns (it must be the ``dst`` of exactly one push)."""

    def __init__(self, mesh: DeviceMesh, axis: str) -> None:
        self.mesh, self.axis, self.mine = mesh, axis, axis_rank(mesh, axis)
        self._prev: Handle | None = None
        self._result: torch.Tensor | None = None

    def push(self, partial: torch.Tensor, dst: int) -> None:
        handle = reduce_along(partial, self.mesh, self.axis, dst=dst, async_op=True)
        if dst == self.mine:
            self._result = partial
        if self._prev is not None:
            self._prev.wait()
        self._prev = handle

    def finish(self) -> torch.Tensor:
        if self._prev is not None:
            self._prev.wait()
        if self._result is None:
            raise RuntimeError(f"ReducePipeline along {self.axis!r}: no partial was reduced to this rank")
        return self._result


# ---- ring (point-to-point) --------------------------------------------------------------------------------


class _Works:
    """Several point-to-point works completed together (``wait()`` waits for each, in posting order)."""

    __slots__ = ("works",)

    def __init__(self, works) -> None:
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def ring_neighbours(mesh: DeviceMesh, axis: str) -> tuple[int, int]:
    """``(previous, next)`` coordinates of this rank on the ring formed by ``axis`` (wrapping around)."""
    n, i = axis_size(mesh, axis), axis_rank(mesh, axis)
    return (i - 1) % n, (i + 1) % n


def ring_shift(send, recv, mesh: DeviceMesh, axis: str, tag: int = 0, async_op: bool = False) -> Handle:
    """Send each tensor of ``send`` to the next rank of the ring along ``axis`` (coordinate ``i+1 mod n``) and
    receive the previous rank's (``i-1 mod n``) into the matching tensor of ``recv`` (same shapes and dtypes on
    every rank; ``recv`` must not alias ``send``).

    Point-to-point ``isend``/``irecv``, posted even/odd (even coordinates send first, odd ones receive first)
    so that no pair of blocking transports waits on each other; on NCCL one ``batch_isend_irecv``.
    ``tag`` keeps two shifts in flight at once apart (the ring backward overlaps operand and gradient shifts).
    Counted as one ``ring_exchange`` call whose bytes are all of ``send``. On one rank the tensors are copied
    across and nothing is counted. Under gloo, CUDA tensors travel through host buffers.
    """
    send, recv = list(send), list(recv)
    if len(send) != len(recv):
        raise ValueError(f"ring_shift: {len(send)} tensors to send but {len(recv)} receive buffers")
    if not all(t.is_contiguous() for t in recv):
        raise ValueError("ring_shift: receive buffers must be contiguous")
    n = axis_size(mesh, axis)
    if n == 1:
        for dst, src in zip(recv, send):
            dst.copy_(src)
        return DONE
    group = axis_group(mesh, axis)
    send = [t.contiguous() for t in send]
    call = _post("ring_exchange", axis, group, send)
    prev, nxt = ring_neighbours(mesh, axis)
    to, frm = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prev)
    where = _where("ring_exchange", axis, group, (frm, to))
    with _named(where):
        works, then = _point_to_point(send, recv, [(to, tag)] * len(send), [(frm, tag)] * len(recv), group,
                                      axis_rank(mesh, axis) % 2 == 0)
    return _finish(works, async_op, then, call, where)


def _point_to_point(send: list, recv: list, peers_out: list, peers_in: list, group, sends_first: bool):
    """Post ``isend`` of each ``send[i]`` to ``peers_out[i] = (global rank, tag)`` and ``irecv`` into each
    ``recv[i]`` from ``peers_in[i]``, sends first or receives first (ranks alternate, so that no pair of blocking
    transports waits on each other); on NCCL all of them in one ``batch_isend_irecv`` (a grouped launch, both
    directions at once); under gloo CUDA tensors travel through host buffers. Returns the works and
    the copy-back to run after them (or ``None``)."""
    if _SHAPES_ONLY:
        return _Works([]), None
    send, recv = [_bits(t) for t in send], [_bits(t) for t in recv]
    then = None
    if send and _needs_host_staging(send[0], group):
        targets = recv
        send = [t.detach().cpu() for t in send]
        recv = [torch.empty(t.shape, dtype=t.dtype, device="cpu") for t in targets]
        host = recv

        def then() -> None:
            for dst, src in zip(targets, host):
                dst.copy_(src)

    if dist.get_backend(group) == "nccl":  # one grouped launch: both directions in flight together
        ops = ([dist.P2POp(dist.isend, t, p, group=group, tag=k) for t, (p, k) in zip(send, peers_out)]
               + [dist.P2POp(dist.irecv, t, p, group=group, tag=k) for t, (p, k) in zip(recv, peers_in)])
        return _Works(dist.batch_isend_irecv(ops)), then
    sends = lambda: [dist.isend(t, dst=p, group=group, tag=k) for t, (p, k) in zip(send, peers_out)]  # noqa: E731
    recvs = lambda: [dist.irecv(t, src=p, group=group, tag=k) for t, (p, k) in zip(recv, peers_in)]  # noqa: E731
    return _Works(sends() + recvs() if sends_first else recvs() + sends()), then


def neighbour_exchange(mesh: DeviceMesh, axis: str, *, to_next=(), from_prev=(), to_prev=(), from_next=(),
                       tag: int = 0) -> Handle:
    """Async point-to-point transfers with both ring neighbours along ``axis`` at once (a bidirectional ring
    step): each tensor of ``to_next`` goes to coordinate ``i+1 mod n`` and lands there in the matching buffer of
    ``from_prev``; each of ``to_prev`` goes to ``i-1 mod n`` into ``from_next``. Every rank of the axis posts the
    same pattern (same counts, shapes and dtypes), so ``len(to_next) == len(from_prev)`` and
    ``len(to_prev) == len(from_next)``; receive buffers must be contiguous and must not alias a sent tensor.

    The two directions use tags ``2 tag`` and ``2 tag + 1`` (with ``n == 2`` both neighbours are one rank), so a
    caller keeping several exchanges in flight gives each its own ``tag``. Counted as one ``ring_exchange`` whose
    bytes are everything this rank sends. Posted even/odd like :func:`ring_shift`; under gloo, CUDA tensors travel
    through host buffers. On one rank nothing travels: ``from_prev`` / ``from_next`` receive copies of this rank's
    own ``to_next`` / ``to_prev`` tensors (the ring of one)."""
    to_next, from_prev, to_prev, from_next = list(to_next), list(from_prev), list(to_prev), list(from_next)
    if len(to_next) != len(from_prev) or len(to_prev) != len(from_next):
        raise ValueError(f"neighbour_exchange: {len(to_next)} tensors to send forward but {len(from_prev)} receive "
                         f"buffers, {len(to_prev)} backward but {len(from_next)}")
    recv = from_prev + from_next
    if not all(t.is_contiguous() for t in recv):
        raise ValueError("neighbour_exchange: receive buffers must be contiguous")
    n = axis_size(mesh, axis)
    if n == 1:
        for dst, src in zip(recv, to_next + to_prev):
            dst.copy_(src)
        return DONE
    group = axis_group(mesh, axis)
    send = [t.contiguous() for t in to_next + to_prev]
    call = _post("ring_exchange", axis, group, send)
    prev, nxt = ring_neighbours(mesh, axis)
    g_next, g_prev = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prev)
    peers_out = [(g_next, 2 * tag)] * len(to_next) + [(g_prev, 2 * tag + 1)] * len(to_prev)
    peers_in = [(g_prev, 2 * tag)] * len(from_prev) + [(g_next, 2 * tag + 1)] * len(from_next)
    where = _where("ring_exchange", axis, group, (g_prev, g_next))
    with _named(where):
        works, then = _point_to_point(send, recv, peers_out, peers_in, group, axis_rank(mesh, axis) % 2 == 0)
    return _finish(works, True, then, call, where)


def all_gather_blocks(tensor: torch.Tensor, mesh: DeviceMesh, axis: str) -> tuple[torch.Tensor, Handle]:
    """Async all-gather of equal blocks along ``axis``: returns ``(out, handle)`` with ``out [n, *tensor.shape]``,
    ``out[k]`` the block of coordinate ``k`` once ``handle.wait()`` returns. Counted as ``all_gather`` of the local
    block. On one rank ``out`` is ``tensor[None]``."""
    n = axis_size(mesh, axis)
    if n == 1:
        return tensor.unsqueeze(0), DONE
    tensor = tensor.contiguous()
    group = axis_group(mesh, axis)
    call = _post("all_gather", axis, group, (tensor,))
    out = torch.empty((n, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
    if _SHAPES_ONLY:
        return out, DONE
    where = _where("all_gather", axis, group)
    with _named(where):
        flat = out.view(n * tensor.shape[0], *tensor.shape[1:]) if tensor.dim() else out
        work = _all_gather_single(_bits(flat), _bits(tensor), group=group, async_op=True)
    return out, _finish(work, True, call=call, where=where)


def reduce_scatter_blocks(stacked: torch.Tensor, mesh: DeviceMesh, axis: str) -> tuple[torch.Tensor, Handle]:
    """Async reduce-scatter of ``stacked [n, *shape]`` along ``axis``: returns ``(out, handle)``, ``out [*shape]``
    the sum over the axis of every rank's ``stacked[k]``, ``k`` this rank's coordinate, once ``handle.wait()``
    returns. Counted as ``reduce_scatter`` of the full input. On one rank ``out`` is ``stacked[0]``."""
    n = axis_size(mesh, axis)
    if stacked.shape[0] != n:
        raise ValueError(f"reduce_scatter_blocks along {axis!r}: {stacked.shape[0]} blocks for {n} ranks")
    if n == 1:
        return stacked[0], DONE
    stacked = stacked.contiguous()
    group = axis_group(mesh, axis)
    call = _post("reduce_scatter", axis, group, (stacked,))
    out = torch.empty(stacked.shape[1:], dtype=stacked.dtype, device=stacked.device)
    if _SHAPES_ONLY:
        return out, DONE
    flat = stacked.view(n * stacked.shape[1], *stacked.shape[2:]) if stacked.dim() > 1 else stacked
    where = _where("reduce_scatter", axis, group)
    with _named(where):
        work = _reduce_scatter_single(out, flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return out, _finish(work, True, call=call, where=where)
