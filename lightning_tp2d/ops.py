"""Registered ops: the package's communicating autograd functions as torch custom ops, for ``torch.compile``.

Every layer that communicates (SUMMA products, LayerNorm statistics, the vocab-parallel loss, the ring kernels)
is a ``torch.autograd.Function`` whose forward and backward post collectives and point-to-point transfers and
overlap them with GEMMs by hand. Dynamo cannot trace c10d ``Work`` objects, so under ``torch.compile`` each such
function would split the graph. :func:`registered` turns a function class into a pair of torch custom ops
(``tp2d::<name>`` and ``tp2d::<name>_backward``) with the autograd formula registered, which the compiler treats
as single opaque kernels: a transformer block compiles into one graph, its elementwise work (GELU, residuals,
dropout, casts) fused by the backend around the opaque products, and the hand-written overlap inside each product
kept as it is.

* **Eager is untouched**: outside ``torch.compile`` the class's own ``apply`` runs.
* **One implementation**: the ops call the class's ``forward``/``backward`` with a small stand-in ``ctx``. Their
  fake (shape) kernels run the same code on fake tensors with communication switched off
  (:func:`lightning_tp2d.comm.shapes_only`), so no shape rule is written twice.
* **Non-tensor arguments** (mesh, axis names, :class:`~lightning_tp2d.options.TPOptions`, sizes) and the
  non-tensor state the forward leaves on ``ctx`` are interned in a table (:func:`constant_key`) and reach the ops
  as integer keys baked into the graph; tensors the forward saves travel as op outputs, so the compiler's
  partitioner sees (and frees) exactly what the eager function keeps.
* **Aliasing rules** of custom ops are kept: an output (or gradient) that is a view of an input is copied, and
  an input the forward overwrites (``mutates``: the vocab-parallel loss turns its logits into the softmax in
  place) is copied first. Any other in-place write to an input is a bug and raises.

The layers whose communication is a plain all-reduce (the grid's norms, the vocab-parallel loss, the gradient sums
of replicated parameters) do not go through here under ``torch.compile``: their plain-torch forms with functional
all-reduces (:mod:`lightning_tp2d.nn.traced`) let the compiler fuse their local math as well.

Compiled graphs specialise on shapes (the strategy compiles with ``dynamic=False``): the interned ``ctx`` state
may hold sizes.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch.distributed.device_mesh import DeviceMesh

from lightning_tp2d.comm import shapes_only

_TABLE: list[Any] = []  # interned constants; an op's integer key is an index here
_LOCK = threading.Lock()
_LAST = threading.local()  # the ctx key of the forward op that just ran (read by its setup_context)


def _real(value: Any) -> Any:
    """The real object behind the stand-in torch.compile passes for an opaque one (a ``DeviceMesh`` is a
    reference-type opaque object since torch 2.10: traced code sees a ``FakeScriptObject`` wrapping it)."""
    if type(value).__name__ == "FakeScriptObject":
        return object.__getattribute__(value, "real_obj")
    return value


_PLAIN = (int, float, str, bool, bytes, torch.dtype, torch.device, slice)  # op constants compared by value as they are


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, _PLAIN) or (dataclasses.is_dataclass(a) and not isinstance(a, type)):
        return a == b
    return False  # meshes, process groups, anything else: by identity


def _intern(value: Any) -> int:
    with _LOCK:
        for k, known in enumerate(_TABLE):
            if _same(known, value):
                return k
        _TABLE.append(value)
        return len(_TABLE) - 1


_DATACLASS = "__dataclass__"


_MESH = "__mesh__"
_MESHES: dict[tuple, DeviceMesh] = {}  # meshes by the names of their process groups (register_mesh)


_NAMES = "_tp2d_group_names"  # a registered mesh's names, a tuple of strings kept on the mesh (older torch)
_OPAQUE_MESH = [False]  # whether Dynamo treats DeviceMesh as an opaque reference type (torch 2.13 does)


def register_mesh(mesh: DeviceMesh) -> None:
    """Make ``mesh`` known to the registered ops (:func:`lightning_tp2d.init_mesh` does it for its mesh). Its
    process groups' names are read here, eagerly. Where Dynamo treats ``DeviceMesh`` as an opaque type (torch 2.13:
    its own members are read at trace time, and no other attribute may be), traced code reads them from the mesh;
    elsewhere they are kept on the mesh as a tuple, since torch 2.11's Dynamo cannot turn the mesh's own list into
    a tuple inside traced code (a graph break in every layer, seen on an H200)."""
    names = tuple(mesh._dim_group_names)
    _OPAQUE_MESH[0] = _is_opaque(type(mesh))
    if not _OPAQUE_MESH[0]:
        setattr(mesh, _NAMES, names)
    _MESHES[names] = mesh


def _is_opaque(cls) -> bool:
    try:
        from torch._library.opaque_object import is_opaque_type  # private: see lightning_tp2d._private_api
    except ImportError:  # older torch: no opaque types
        return False
    return is_opaque_type(cls)


def _mesh_names(mesh: DeviceMesh) -> tuple:
    if not _OPAQUE_MESH[0]:
        names = getattr(mesh, _NAMES, None)
        if names is not None:
            return names
    return tuple(mesh._dim_group_names)


def group_name(mesh: DeviceMesh, axis: str) -> str:
    """The name of the process group of ``mesh``'s ``axis`` (what functional collectives take), read at trace time
    under ``torch.compile`` as :func:`register_mesh` describes."""
    return _mesh_names(mesh)[mesh.mesh_dim_names.index(axis)]


def _pack(value: Any) -> Any:
    """``value`` as plain constants for :func:`constant_key`. A mesh becomes the names of its process groups (read
    at trace time; passing the mesh object itself would make it an input of the graph, which activation
    checkpointing's recompute cannot save); a dataclass instance a ``(marker, class, field values)`` tuple (one
    built inside traced code would reach :func:`constant_key` as a bare object, without its fields)."""
    if value is None or isinstance(value, _PLAIN):
        return value  # before is_dataclass: torch 2.11's Dynamo cannot trace hasattr on NoneType (a graph break)
    if isinstance(value, DeviceMesh):
        return (_MESH, _mesh_names(value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (_DATACLASS, type(value), tuple(getattr(value, f.name) for f in dataclasses.fields(value)))
    return value


def _unpack(value: Any) -> Any:
    value = _real(value)
    if isinstance(value, tuple) and len(value) == 3 and value[0] == _DATACLASS:
        return value[1](*value[2])
    if isinstance(value, tuple) and len(value) == 2 and value[0] == _MESH:
        if value[1] not in _MESHES:
            raise RuntimeError(f"a compiled tp2d layer uses a mesh the registered ops do not know (process groups "
                               f"{value[1]}): parallelize the model with lightning_tp2d.parallelize, or call "
                               f"lightning_tp2d.ops.register_mesh(mesh) before compiling")
        return _MESHES[value[1]]
    return value


@torch.compiler.assume_constant_result
def constant_key(*values: Any) -> int:
    """Index of ``values`` (compared by value for plain data and dataclasses, by identity for meshes and other
    objects) in the process-wide table of op constants, adding it if new. Under ``torch.compile`` it runs at trace
    time and its result is a constant of the graph. Pass dataclass instances through :func:`_pack`."""
    return _intern(tuple(_unpack(v) for v in values))


def constants(key: int) -> Any:
    return _TABLE[key]


_ARITY: dict[tuple[str, int], tuple[int, bool]] = {}


@torch.compiler.assume_constant_result
def _arity(name: str, key: int) -> tuple[int, bool]:
    """``(number of outputs, returns a bare tensor)`` of the function behind op ``name`` called with ``key``."""
    return _ARITY[(name, key)]


class _Ctx:
    """Stand-in for the autograd ``ctx`` of a function run inside an op."""

    def __init__(self) -> None:
        self.saved_tensors: tuple = ()
        self.needs_input_grad: tuple = ()

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


_CTX_FIELDS = frozenset(("saved_tensors", "needs_input_grad"))


def _aliases(t: torch.Tensor, others) -> bool:
    return any(o is not None and (t is o or torch._C._is_alias_of(t, o)) for o in others)


def _fresh(tensors, inputs) -> list[torch.Tensor]:
    """``tensors`` with every one that aliases an input or an earlier one replaced by a copy (custom ops return
    fresh memory)."""
    out: list[torch.Tensor] = []
    for t in tensors:
        out.append(t.clone() if _aliases(t, list(inputs) + out) else t)
    return out


def _tensor_refs(saved_at: tuple, state: tuple) -> list[tuple]:
    """Where each tensor the backward needs comes from: the saved tensors, then the tensor-valued ctx attributes."""
    return list(saved_at) + [v for _, v in state if v[0] != "value"]


def _versions(tensors) -> list[int]:
    return [t._version if t is not None else -1 for t in tensors]


class RegisteredFunction:
    """``function`` (a ``torch.autograd.Function`` subclass) with ``apply`` that dispatches to registered ops under
    ``torch.compile`` and to the class itself otherwise. ``mutates``: positions of tensor arguments the forward
    writes in place (copied first inside the op)."""

    def __init__(self, function: type[torch.autograd.Function], name: str, mutates: Sequence[int] = ()) -> None:
        self.function, self.name, self.mutates = function, name, tuple(mutates)
        self.__doc__ = function.__doc__
        qualified = f"tp2d::{name}"

        def forward_op(tensors: list[Optional[torch.Tensor]], key: int) -> list[torch.Tensor]:
            return self._forward(tensors, key)

        def backward_op(grads: list[Optional[torch.Tensor]], saved: list[torch.Tensor], needs: list[bool],
                        key: int, ctx_key: int) -> list[torch.Tensor]:
            return self._backward(grads, saved, needs, key, ctx_key)

        self._op = torch.library.custom_op(qualified, forward_op, mutates_args=())
        self._op_backward = torch.library.custom_op(f"{qualified}_backward", backward_op, mutates_args=())

        @self._op.register_fake
        def _(tensors, key):
            with shapes_only():
                return self._forward(tensors, key)

        @self._op_backward.register_fake
        def _(grads, saved, needs, key, ctx_key):
            with shapes_only():
                return self._backward(grads, saved, needs, key, ctx_key)

        self._op.register_autograd(self._autograd_backward, setup_context=self._setup_context)

    # ---- entry point ----------------------------------------------------------------------------------------

    def apply(self, *args):
        if not torch.compiler.is_compiling():
            return self.function.apply(*args)
        slots = tuple(k for k, a in enumerate(args) if isinstance(a, torch.Tensor))
        rest = tuple(None if k in slots else a for k, a in enumerate(args))
        key = constant_key(slots, *(_pack(a) for a in rest))
        out = self._op([args[k] for k in slots], key)
        n_out, single = _arity(self.name, key)  # known once the op's fake kernel has run (just now, in tracing)
        return out[0] if single else tuple(out[:n_out])

    # ---- the ops' bodies ------------------------------------------------------------------------------------

    def _arguments(self, tensors, key) -> list:
        slots, *rest = constants(key)
        args = list(rest)
        for k, t in zip(slots, tensors):
            args[k] = t
        return args

    def _forward(self, tensors, key) -> list[torch.Tensor]:
        slots = constants(key)[0]
        tensors = [t.clone() if pos in self.mutates else t for pos, t in zip(slots, tensors)]
        args = self._arguments(tensors, key)
        kept = [t for pos, t in zip(slots, tensors) if pos not in self.mutates]
        before = _versions(kept)
        ctx = _Ctx()
        result = self.function.forward(ctx, *args)
        if _versions(kept) != before:
            raise RuntimeError(f"tp2d::{self.name}: the forward wrote into an input not declared in mutates")
        single = isinstance(result, torch.Tensor)
        outputs = [result] if single else list(result)
        residuals: list[torch.Tensor] = []

        def where(t: torch.Tensor) -> tuple:
            for pos, a in zip(slots, tensors):
                if t is a and pos not in self.mutates:
                    return ("input", pos)
            for k, o in enumerate(outputs):
                if t is o:
                    return ("output", k)
            residuals.append(t)
            return ("residual", len(residuals) - 1)

        saved = tuple(where(t) for t in ctx.saved_tensors)
        state = tuple(sorted((name, where(v) if isinstance(v, torch.Tensor) else ("value", v))
                             for name, v in vars(ctx).items() if name not in _CTX_FIELDS))
        meta = lambda ts: tuple((tuple(t.shape), t.dtype, t.device) for t in ts)  # noqa: E731
        _LAST.key = _intern(("ctx", self.name, key, len(outputs), single, saved, state, meta(tensors),
                             meta(outputs)))
        _ARITY[(self.name, key)] = (len(outputs), single)
        return _fresh(outputs + residuals, tensors)

    def _backward(self, grads, saved, needs, key, ctx_key) -> list[torch.Tensor]:
        slots = constants(key)[0]
        _, _, _, n_out, _, saved_at, state, in_meta, out_meta = constants(ctx_key)
        refs = _tensor_refs(saved_at, state)
        by_ref = dict(zip(refs, saved))
        ctx = _Ctx()
        ctx.saved_tensors = tuple(by_ref[r] for r in saved_at)
        for name, v in state:
            setattr(ctx, name, v[1] if v[0] == "value" else by_ref[v])
        need = dict(zip(slots, needs))
        ctx.needs_input_grad = tuple(need.get(k, False) for k in range(len(constants(key)) - 1))
        grads = [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
                 for g, (shape, dtype, device) in zip(list(grads)[:n_out], out_meta)]
        before = _versions(grads) + _versions(saved)
        result = self.function.backward(ctx, *grads)
        result = (result,) if isinstance(result, torch.Tensor) else tuple(result)
        if _versions(grads) + _versions(saved) != before:
            raise RuntimeError(f"tp2d::{self.name}: the backward wrote into a gradient or a saved tensor")
        out = []
        for pos, (shape, dtype, device), n in zip(slots, in_meta, needs):
            if n:
                g = result[pos]
                out.append(torch.zeros(shape, dtype=dtype, device=device) if g is None else g)
        return _fresh(out, list(grads) + list(saved))

    # ---- autograd of the forward op -------------------------------------------------------------------------

    def _setup_context(self, ctx, inputs, output) -> None:
        tensors, key = inputs
        ctx.key, ctx.ctx_key = key, _LAST.key
        _, _, _, n_out, _, saved_at, state, _, _ = constants(ctx.ctx_key)
        refs = _tensor_refs(saved_at, state)
        slots = constants(key)[0]
        pick = {("input", pos): t for pos, t in zip(slots, tensors)}
        residuals = output[n_out:]
        ctx.save_for_backward(*[pick[r] if r[0] == "input" else
                                output[r[1]] if r[0] == "output" else residuals[r[1]] for r in refs])
        ctx.n_inputs = len(tensors)

    def _autograd_backward(self, ctx, grads):
        needs = list(ctx.needs_input_grad[0]) if isinstance(ctx.needs_input_grad[0], (list, tuple)) else [
            bool(ctx.needs_input_grad[0])] * ctx.n_inputs
        computed = iter(self._op_backward(list(grads), list(ctx.saved_tensors), needs, ctx.key, ctx.ctx_key))
        return [next(computed) if n else None for n in needs], None


def registered(name: str, mutates: Sequence[int] = ()):
    """Class decorator: ``@registered("summa_ab")`` on a ``torch.autograd.Function`` subclass returns a
    :class:`RegisteredFunction` whose ``apply`` is compile-friendly (module docstring)."""

    def wrap(function: type[torch.autograd.Function]) -> RegisteredFunction:
        return RegisteredFunction(function, name, mutates)

    return wrap
