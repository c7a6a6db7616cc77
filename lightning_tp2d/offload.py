"""Host offload of the block inputs that full activation checkpointing keeps (``activation_offload``).

Under ``checkpoint_activations(model, "full")`` each transformer block keeps, between its forward and its backward,
only what the non-reentrant ``torch.utils.checkpoint`` saves: the block's tensor inputs (the hidden states
``x [B, T, h]``, or this rank's shard of them: ``[B, T/p, h]`` on the ring, ``[B/q, T, h/q]`` on the grid; packed
document ids are plain Python data, or small integer tensors that stay on the device). For ``n_layer`` blocks that is
``n_layer`` such tensors alive at the end of the forward, the checkpointed model's largest activation term at long
``T``. :class:`ActivationOffloader` moves each of them to host memory when it is saved and brings it back when the
backward needs it, through torch's saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``): the
checkpoint call of each block runs inside :meth:`ActivationOffloader.saving`, whose pack hook sees exactly the
checkpoint's inputs (the tensors saved inside the checkpointed region go through the checkpoint's own, inner hooks).
Copies are exact, so losses and gradients are bit-identical with and without offload.

**Forward (pack).** A floating-point, contiguous tensor of at least ``min_bytes`` on a CUDA device is copied into
pinned host memory (``torch.empty(..., pin_memory=True)``) on a side stream (``torch.cuda.Stream``): the side stream
first waits on the current stream (the copy reads the value the forward computed), the copy is ``non_blocking``,
and the device tensor is ``record_stream``-ed on the side stream, so the caching allocator does not hand its memory
to anyone before the copy has read it. The device tensor itself is then dropped (autograd keeps the handle, not the
tensor): its memory returns to the allocator as soon as the forward's last use of it is done. Anything else (small,
integer, non-contiguous, a subclass such as a ``DTensor`` or a ``Parameter``) is saved as it is, on the device.

**Backward (unpack, prefetch).** The backward reaches the blocks in reverse order. When block ``i``'s input is
unpacked (the first step of its recomputation), its fetch is waited for, and the fetch of the *previous live* block's
inputs (block ``i-1``: the next the backward needs) starts at once, one block ahead: a device tensor is allocated on
the current stream, the side stream waits on the current stream (so that memory is free of earlier work) and copies
host-to-device ``non_blocking``, recording an event; that copy overlaps block ``i``'s recomputation and backward.
The unpack of block ``i-1`` then only makes the current stream wait on that event. The last block (the first the
backward reaches) is fetched on demand. So at most two block inputs are back on the device at a time: the one being
recomputed and the next. Host copies live as long as autograd keeps the handle (a ``retain_graph`` backward can unpack
again).

**On the CPU** the same code path runs with plain host copies, no pinned memory and no streams (``pin_memory``
needs a GPU): :func:`uses_streams` is the one test of CPU against CUDA. It saves nothing there (host memory is the
device's), but it lets the tests count the bytes that leave and come back.

**What is measured** (:class:`OffloadStats`, ``offloader.stats``, cumulative until :meth:`ActivationOffloader.reset`):
``offloaded_bytes`` copied to the host, ``fetched_bytes`` copied back, ``host_bytes`` held on the host now and
``peak_host_bytes`` its maximum, ``kept_bytes`` saved on the device instead (too small, not float ...), and the
number of fetches started one block ahead (``prefetched``) or on demand (``fetched_on_demand``). For a model of
``n_layer`` blocks, one forward and backward offloads and fetches ``n_layer`` block inputs, and ``n_layer - 1`` of
the fetches are prefetches.

This module imports nothing of the package (floor 1, beside :mod:`lightning_tp2d.recompute`).
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

__all__ = ["MIN_BYTES", "ActivationOffloader", "OffloadStats", "uses_streams"]

MIN_BYTES = 1 << 20  # tensors smaller than 1 MiB stay on the device: a copy's fixed cost outweighs what it frees
_DEVICES = ("cpu", "cuda")  # device types whose tensors are offloaded (others are saved as they are)


def uses_streams(device: torch.device) -> bool:
    """Whether offloading from ``device`` copies into pinned memory on a side stream (CUDA), or with plain,
    synchronous host copies (CPU)."""
    return device.type == "cuda"


@dataclasses.dataclass
class OffloadStats:
    """Byte counts of an :class:`ActivationOffloader` (module docstring, "What is measured")."""

    offloaded_bytes: int = 0  # copied device -> host in the forwards
    fetched_bytes: int = 0  # copied host -> device in the backwards
    host_bytes: int = 0  # held on the host now
    peak_host_bytes: int = 0  # the most held on the host at once
    kept_bytes: int = 0  # saved on the device instead (small, not floating point, a subclass ...)
    prefetched: int = 0  # fetches started one block ahead of their unpack
    fetched_on_demand: int = 0  # fetches started by their own unpack (the first block the backward reaches)


class _Saved:
    """One offloaded tensor: its host copy and, once a fetch has started, its device copy and the fetch's event."""

    __slots__ = ("__weakref__", "device", "event", "group", "host", "nbytes", "offloader", "on_device", "stream")

    def __init__(self, offloader: ActivationOffloader, group: _Group, host: torch.Tensor, device: torch.device,
                 nbytes: int) -> None:
        self.offloader, self.group, self.host, self.device, self.nbytes = offloader, group, host, device, nbytes
        self.on_device: torch.Tensor | None = None  # the fetched copy, until unpacked
        self.event = None  # CUDA: the fetch's event on the side stream
        self.stream = None  # CUDA: the stream the device copy was allocated on

    def __del__(self) -> None:  # autograd let go of the handle: the host copy goes
        self.offloader._release(self.nbytes)


class _Group:
    """The tensors one block call offloaded (one checkpoint's inputs): fetched together."""

    __slots__ = ("__weakref__", "members")

    def __init__(self) -> None:
        self.members: list[weakref.ref[_Saved]] = []

    def saved(self) -> list[_Saved]:
        return [s for s in (ref() for ref in self.members) if s is not None]


class ActivationOffloader:
    """Saved-tensor hooks that keep checkpointed block inputs on the host between forward and backward (module
    docstring). ``min_bytes``: smaller tensors stay on the device (default :data:`MIN_BYTES`; ``0`` offloads
    every floating-point tensor, as the tests do). One offloader serves one model; its :attr:`stats` count bytes."""

    def __init__(self, min_bytes: int = MIN_BYTES) -> None:
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"min_bytes must be a non-negative int, got {min_bytes!r}")
        self.min_bytes = min_bytes
        self.stats = OffloadStats()
        self._groups: list[weakref.ref[_Group]] = []  # live block calls, in forward order
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def reset(self) -> None:
        """Zero the counters (``host_bytes`` keeps counting what is still held)."""
        self.stats = OffloadStats(host_bytes=self.stats.host_bytes, peak_host_bytes=self.stats.host_bytes)

    def saving(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The hooks for one block call: run the block's checkpoint call inside them. Its saved inputs form one
        group, fetched together and prefetched while the block after it runs its backward."""
        group: list[_Group] = []  # made on the first offloaded tensor: a call that keeps everything makes none

        def pack(t: torch.Tensor):
            if not self._offloads(t):
                self.stats.kept_bytes += _nbytes(t)
                return t
            if not group:
                group.append(_Group())
                self._groups = [ref for ref in self._groups if ref() is not None] + [weakref.ref(group[0])]
            return self._pack(t, group[0])

        return torch.autograd.graph.saved_tensors_hooks(pack, self._unpack)

    # ---- forward -------------------------------------------------------------------------------------------

    def _offloads(self, t: torch.Tensor) -> bool:
        return (type(t) is torch.Tensor and t.device.type in _DEVICES and t.is_floating_point() and t.is_contiguous()
                and _nbytes(t) >= self.min_bytes)

    def _pack(self, t: torch.Tensor, group: _Group) -> _Saved:
        nbytes = _nbytes(t)
        streams = uses_streams(t.device)
        host = torch.empty(t.size(), dtype=t.dtype, pin_memory=streams)
        if streams:
            side = self._side_stream(t.device)
            side.wait_stream(torch.cuda.current_stream(t.device))  # the copy reads what the forward wrote
            with torch.cuda.stream(side):
                host.copy_(t, non_blocking=True)
            t.record_stream(side)  # its memory is not reused before the copy has read it
        else:
            host.copy_(t)
        saved = _Saved(self, group, host, t.device, nbytes)
        group.members.append(weakref.ref(saved))
        self.stats.offloaded_bytes += nbytes
        self.stats.host_bytes += nbytes
        self.stats.peak_host_bytes = max(self.stats.peak_host_bytes, self.stats.host_bytes)
        return saved

    def _release(self, nbytes: int) -> None:
        self.stats.host_bytes -= nbytes

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    # ---- backward ------------------------------------------------------------------------------------------

    def _unpack(self, packed):
        if not isinstance(packed, _Saved):
            return packed
        if packed.on_device is None:  # not prefetched: the first block the backward reaches (or a re-unpack)
            self._fetch(packed.group, ahead=False)
        self._prefetch_before(packed.group)
        t = packed.on_device
        if packed.event is not None:
            current = torch.cuda.current_stream(t.device)
            current.wait_event(packed.event)  # the fetch has landed before the backward reads it
            if current != packed.stream:  # used on another stream than it was allocated on
                t.record_stream(current)
        packed.on_device = packed.event = packed.stream = None  # the device copy is autograd's now
        return t

    def _prefetch_before(self, group: _Group) -> None:
        """Start fetching the live block call saved just before ``group`` (the next the backward needs)."""
        live = [g for g in (ref() for ref in self._groups) if g is not None]
        at = next((i for i, g in enumerate(live) if g is group), None)
        if at:
            self._fetch(live[at - 1], ahead=True)

    def _fetch(self, group: _Group, ahead: bool) -> None:
        """Copy ``group``'s tensors that have no device copy back to their device (CUDA: on the side stream,
        recording an event for each; CPU: at once)."""
        for saved in group.saved():
            if saved.on_device is not None:
                continue
            host = saved.host
            t = torch.empty(host.size(), dtype=host.dtype, device=saved.device)  # allocated on the current stream
            if uses_streams(saved.device):
                side = self._side_stream(saved.device)
                current = torch.cuda.current_stream(saved.device)
                side.wait_stream(current)  # t's memory is free of the current stream's earlier work
                with torch.cuda.stream(side):
                    t.copy_(host, non_blocking=True)
                    saved.event = torch.cuda.Event()
                    saved.event.record(side)
                t.record_stream(side)  # freed unread (a graph dropped before its backward): not reused mid-copy
                saved.stream = current
            else:
                t.copy_(host)
            saved.on_device = t
            self.stats.fetched_bytes += saved.nbytes
            if ahead:
                self.stats.prefetched += 1
            else:
                self.stats.fetched_on_demand += 1


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
