"""Live tensor memory: the ``TorchDispatchMode`` that counts every storage an aten op makes while it lives, and the
bytes a model and optimizer hold between steps. The memory model profiles fake steps with it; the harness
(:mod:`lightning_tp2d.bench.measure`) measures real ones with the same class.

:class:`LiveTensorBytes` sees every tensor an aten op returns, counts the bytes of each new storage while it lives (a
weak reference on the storage tells it when it is freed) and keeps the peak and the shapes allocated. Only new
storages count: an op's output that shares an input's storage (a view such as ``weight.t()``, an in-place result)
allocates nothing, so a view of a parameter is not mistaken for an activation. DTensor operations are let through
first (the mode answers ``NotImplemented``, as torch's own ``CommDebugMode`` does), so the local tensors DTensor
allocates -- including gradients of DTensor parameters -- are counted like any other. Kernels' internal scratch
inside one aten op (e.g. a flash-attention kernel's tiles) is invisible, for every layout alike.

With ``cap`` set, the allocation that takes the live bytes past it raises :class:`MemoryCapExceeded`, like an
out-of-memory error on a GPU whose memory is capped with ``torch.cuda.set_per_process_memory_fraction``: the
maximum-sequence search uses that to stop a probe at once. Tensors that existed before the mode was entered
(parameters, optimizer state) are not seen; callers add them as ``resident`` bytes (:func:`resident_bytes`).
With ``fake`` a ``FakeTensorMode``, the fake tensors of that mode (shapes, no data) are counted like real ones, so
the same mode profiles a step that never computes (``fake=True``: every fake tensor); by default none are. DTensor's
sharding propagation, the first time an op meets a placement, runs the op on fake tensors of the global shapes in a
mode of its own: those hold no memory in a real step, and in a profiled one they would be counted or not as the
propagation cache happens to be cold or warm.

With ``count_resizes=True`` storage resizes inside the mode count too: FSDP2 frees a gathered parameter with
``UntypedStorage.resize_(0)`` and re-allocates it with ``resize_(n)``, which no aten op sees. That is right for
storages made before the mode (FSDP's, made in a warm-up step's lazy init) when the measured region makes none.
"""

from __future__ import annotations

import heapq
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode


def tensors_in(obj) -> list[torch.Tensor]:
    """The tensors among an op's nested arguments or outputs (tuples, lists, dict values), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in tensors_in(item)]
    return []


class MemoryCapExceeded(RuntimeError):
    """Raised by :class:`LiveTensorBytes` when the tracked bytes pass its cap (the CPU stand-in for a CUDA OOM)."""


_DEVICE = torch.ops.prim.device.default
LARGEST = 3  # live tensors :attr:`LiveTensorBytes.largest` names at the peak


def largest_entry(nbytes: int, shape, dtype, op: str) -> dict:
    """One tensor of a ``largest`` record: ``{"shape", "dtype", "bytes", "op"}`` (``op``: the aten op that made it,
    e.g. ``"mm.default"``)."""
    return {"shape": tuple(shape), "dtype": str(dtype).removeprefix("torch."), "bytes": int(nbytes), "op": op}


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of the tensor storages allocated inside the mode and still alive: ``live``, ``peak``, ``shapes``, and
    ``largest``: the :data:`LARGEST` largest tensors alive when ``peak`` was reached (:func:`largest_entry` dicts,
    largest first; storages grown by ``resize_`` are counted in the bytes but not named).

    ``base`` is added to ``live`` before comparing with ``cap`` (the resident bytes the mode cannot see);
    ``count_resizes``: also count ``UntypedStorage.resize_`` (module docstring). The record is cheap: the largest
    live storages are kept as they come and go (rebuilt from the live set only after one of them is freed), and
    named only when a new peak is reached."""

    def __init__(self, cap: int | None = None, base: int = 0, record_shapes: bool = True,
                 count_resizes: bool = False, fake: bool | FakeTensorMode = False) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.cap, self.base, self.record_shapes, self.count_resizes = cap, base, record_shapes, count_resizes
        self._plain = _PLAIN if fake is not False else (torch.Tensor,)  # real runs: propagation's fakes are no memory
        self._fake_mode = fake if isinstance(fake, FakeTensorMode) else None
        self.shapes: list[tuple[int, ...]] = []
        self.largest: list[dict] = []
        self._refs: dict[int, weakref.ref] = {}
        self._info: dict[int, tuple] = {}  # storage key -> (bytes, shape, dtype, op) of each live tracked storage
        self._top: list[tuple[int, int]] | None = []  # (bytes, key) of the largest live ones; None: to rebuild
        self._op = "?"
        self._resize = None

    def __enter__(self):
        if self.count_resizes:
            self._resize = original = torch.UntypedStorage.resize_

            def resize_(storage, size):
                before = storage.nbytes()
                original(storage, size)
                self.live += storage.nbytes() - before
                self._rose()

            torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        if self._resize is not None:
            torch.UntypedStorage.resize_, self._resize = self._resize, None
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into local ops, which come back through this mode
        if isinstance(func, torch._ops.HigherOrderOperator) or func is _DEVICE:  # (a fake tensor's device, from C++)
            return func(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        self._op = func.__name__
        inputs = {_storage_key(t) for t in tensors_in((args, kwargs))}
        for t in tensors_in(out):
            if type(t) in self._plain and t.device.type != "meta" and _storage_key(t) not in inputs and (
                    self._fake_mode is None or not isinstance(t, FakeTensor) or t.fake_mode is self._fake_mode):
                self._track(t)  # a new storage: views, in-place results and aliases of the inputs are not
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key, nbytes = _storage_key(t), storage.nbytes()
        if nbytes == 0 or (key in self._refs and self._refs[key]() is not None):
            return  # empty, or a view of a storage already counted
        self.live += nbytes
        self._info[key] = (nbytes, tuple(t.shape), t.dtype, self._op)
        if self._top is not None and (len(self._top) < LARGEST or nbytes > self._top[-1][0]):
            self._top = sorted([*self._top, (nbytes, key)], key=lambda e: -e[0])[:LARGEST]
        self._rose()
        if self.record_shapes:
            self.shapes.append(tuple(t.shape))
        self._refs[key] = weakref.ref(storage, lambda _, k=key, n=nbytes: self._free(k, n))
        if self.cap is not None and self.base + self.live > self.cap:
            raise MemoryCapExceeded(
                f"tracked memory {self.base + self.live} bytes (resident {self.base} + live {self.live}) exceeds "
                f"the cap of {self.cap} bytes at a {list(t.shape)} {t.dtype} tensor")

    def _rose(self) -> None:
        """Called whenever ``live`` grows (a subclass may note more than the peak)."""
        if self.live > self.peak:
            self.peak = self.live
            self.largest = self.live_largest()

    def live_largest(self) -> list[dict]:
        """The :data:`LARGEST` largest tracked tensors alive now (:func:`largest_entry` dicts, largest first)."""
        if self._top is None or any(key not in self._info for _, key in self._top):  # (a free during _track)
            self._top = heapq.nlargest(LARGEST, ((info[0], key) for key, info in list(self._info.items())),
                                       key=lambda e: e[0])
        return [largest_entry(*self._info[key]) for _, key in self._top]

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._refs.pop(key, None)
        self._info.pop(key, None)
        if self._top is not None and any(k == key for _, k in self._top):
            self._top = None  # one of the largest is gone: rebuilt from the live set when next asked for


_PLAIN = (torch.Tensor, FakeTensor)  # tensors with a storage of their own (not wrapper subclasses such as DTensor)


def _storage_key(t: torch.Tensor) -> int | None:
    """The data pointer of ``t``'s storage (Parameters included); for a fake tensor the identity of its storage
    object (one per storage while it lives: a fake storage has no data pointer); ``None`` for tensors without
    storage (meta or wrapper subclasses)."""
    if t.device.type == "meta":
        return None
    if isinstance(t, FakeTensor):
        return id(t.untyped_storage())
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def resident_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                   grads: bool = True) -> int:
    """Bytes this rank holds for parameters (local shards, tied tensors once), their gradients and the
    optimizer's state: what exists between steps."""
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor | None) -> None:
        nonlocal total
        if t is None or not isinstance(t, torch.Tensor):
            return
        storage = _local(t).untyped_storage()
        if storage.data_ptr() in seen or storage.device.type == "meta":
            return
        seen.add(storage.data_ptr())
        total += storage.nbytes()

    for p in model.parameters():
        add(p)
        if grads:
            add(p.grad)
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.numel() > 1:  # skip scalar step counters
                    add(value)
    return total


def adamw_kernel(fused: bool) -> dict[str, bool]:
    """AdamW's keyword choosing its kernel in the measured and profiled steps: ``fused`` (``CausalLMModule``'s on a
    GPU) or ``foreach`` (which holds a float32 copy of the parameters at once in its step)."""
    return {"fused": True} if fused else {"foreach": True}
