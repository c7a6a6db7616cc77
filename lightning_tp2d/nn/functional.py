"""Small autograd duals shared by the parallel layers (forward/backward pairs of :mod:`lightning_tp2d.comm`)."""

from __future__ import annotations

import copy
import functools
import weakref

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_global_tensor_info  # private: see lightning_tp2d._private_api

from lightning_tp2d import recompute
from lightning_tp2d.nn import traced
from lightning_tp2d.comm import all_gather_along, all_reduce_along, axis_rank, axis_size, exchange_with
from lightning_tp2d.layouts import DATA_AXIS
from lightning_tp2d.mesh import transpose_peer
from lightning_tp2d.ops import registered


class _LocalView(torch.autograd.Function):
    """A DTensor parameter -> a view of its local shard; backward: the shard's gradient as a DTensor of the
    parameter's own placements. What ``DTensor.to_local()`` does, without its backward's ``DTensor.from_local``
    (a second autograd function and a checked spec: ~120 us per parameter and step on CPU), and with one gradient
    spec per parameter (:func:`_grad_spec`). The crossing for parameters whose shard is not a leaf of its own
    (:func:`local_view`: FSDP's, a copied model's)."""

    @staticmethod
    def forward(ctx, param):
        ctx.spec = _grad_spec(param)
        ctx.set_materialize_grads(False)
        local = param._local_tensor
        ctx.stride = local.stride()
        return local.view_as(local)  # a fresh tensor: autograd's metadata must not land on the stored shard

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None
        return _as_param_grad(grad, ctx.spec, ctx.stride)


# ``DTensor(local, spec, requires_grad=)`` is ``__new__`` (the wrapper made in C++ since torch 2.9, a Python
# ``_make_wrapper_subclass`` before) and then an ``__init__`` that does nothing but pass through
# ``torch._disable_dynamo``'s frame switch: 2.8 of its 4.5 us on CPU, once per parameter and step. Gradients are
# wrapped in autograd's hooks, never under Dynamo, so they are made by ``__new__`` alone.
_new_dtensor = DTensor.__new__


def _as_param_grad(grad: torch.Tensor, spec, stride) -> DTensor:
    """``grad`` (a local shard's gradient) as a DTensor laid out as the parameter of ``spec`` (whose local shard has
    ``stride``)."""
    if grad.stride() == stride:  # laid out as the shard itself: the parameter's own global stride
        return _new_dtensor(DTensor, grad, spec, requires_grad=False)
    _, global_stride = compute_global_tensor_info(grad, spec.mesh, spec.placements)
    if tuple(global_stride) != spec.tensor_meta.stride:  # a gradient laid out otherwise: torch's own conversion
        return DTensor.from_local(grad, spec.mesh, spec.placements, shape=spec.shape, stride=tuple(global_stride))
    return _new_dtensor(DTensor, grad, spec, requires_grad=False)


_GRAD_SPEC = "_tp2d_grad_spec"


def _grad_spec(param: DTensor):
    """The spec of ``param``'s gradients: a copy of its own, made once per parameter (and again if its spec is
    replaced) and shared by every step's gradient. Torch's ``to_local`` copies the spec for every gradient, so that
    nothing that rewrites a gradient's spec reaches the parameter's; one copy per step cost 31 us per parameter on
    CPU (DTensor hashes a new spec), this costs nothing."""
    cached = getattr(param, _GRAD_SPEC, None)
    if cached is None or cached[0] is not param._spec:
        cached = (param._spec, copy.copy(param._spec))
        setattr(param, _GRAD_SPEC, cached)
    return cached[1]


# On a DTensor parameter whose local shard may become an autograd leaf of its own: its _Link
_LEAF = "_tp2d_leaf"
# On a module: {name: the _Link of each such parameter it holds} (own_leaf_grads), read by local_param when compiled
_LINKS = "_tp2d_links"


class _Link:
    """Where an armed shard's gradient goes (:func:`_leaf_of`), kept in its parameter's ``__dict__``: the module
    that holds the parameter (a weak reference) and the parameter's name there, and the shard armed for it (a weak
    reference). Nothing here refers to the parameter: a strong reference from its shard's hook would keep it alive
    (autograd's hooks are invisible to the garbage collector) and a cycle through it would free its memory only at
    the collector's next pass; a weak reference to the parameter would stop ``torch.utils.swap_tensors``, which
    ``Module._apply`` (``.to()``) uses on DTensor parameters. A deep copy is an empty link (its copied parameter
    goes through :class:`_LocalView`)."""

    __slots__ = ("module", "name", "local")

    def __init__(self, module: weakref.ref | None, name: str) -> None:
        self.module, self.name, self.local = module, name, None

    def __deepcopy__(self, memo) -> _Link:
        return _Link(None, self.name)

    def __reduce__(self):  # (pickled: an empty link too; weak references do not pickle)
        return _Link, (None, self.name)


def own_leaf_grads(model: torch.nn.Module) -> None:
    """Let each DTensor parameter of ``model`` not split over ``data_parallel`` (FSDP's, whose gathered copies
    FSDP's own backward hooks read) hand the layers its local shard as an autograd leaf of its own
    (:func:`local_view`). :func:`lightning_tp2d.parallelize` calls it on the model it parallelized, and
    :func:`lightning_tp2d.step.assemble_step` again for the parameters that a cast or a move replaced since."""
    for module in model.modules():
        ref = None
        links = {}
        for name, param in module.named_parameters(recurse=False):
            if not isinstance(param, DTensor) or _split_over_data(param):
                continue
            link = param.__dict__.get(_LEAF)
            if link is None or _holder(link) is not param:  # new, copied, or its module no longer holds it
                ref = ref or weakref.ref(module)
                param.__dict__[_LEAF] = link = _Link(ref, name)
            if param.requires_grad and (link.local is None or link.local() is not param._local_tensor):
                _leaf_of(link, param._local_tensor)
            links[name] = link
        if links or _LINKS in module.__dict__:
            module.__dict__[_LINKS] = links  # (only the parameters it holds now: local_param's compiled lookup)


def _holder(link: _Link):
    """The parameter ``link``'s module holds under its name now (``None``: none, or no module)."""
    owner = None if link.module is None else link.module()
    return None if owner is None else owner._parameters.get(link.name)  # private: see lightning_tp2d._private_api


def _split_over_data(param: DTensor) -> bool:
    names = param.device_mesh.mesh_dim_names or ()
    return DATA_AXIS in names and not param.placements[names.index(DATA_AXIS)].is_replicate()


def _leaf_of(link: _Link, local: torch.Tensor) -> torch.Tensor:
    """Arm ``local`` (a parameter's shard) as an autograd leaf of its own, once per shard object: it requires grad,
    and after each accumulation a hook moves its gradient into the parameter's ``.grad`` (:func:`_to_param_grad`)."""
    local.requires_grad_(True)
    local.register_post_accumulate_grad_hook(functools.partial(_to_param_grad, link.module, link.name))
    link.local = weakref.ref(local)
    return local


def _to_param_grad(module: weakref.ref, name: str, local: torch.Tensor) -> None:
    """The post-accumulate hook of an armed shard: its gradient becomes the parameter's (a DTensor over the same
    storage, no copy) or is added into the parameter's existing one (gradient accumulation), the shard's own
    ``.grad`` is cleared, and the parameter's own post-accumulate hooks (the data-parallel gradient buckets',
    FSDP's averaging of the parameters it keeps whole, a user's) run as autograd would have run them. The parameter
    is the one ``module`` holds as ``name`` now, if this shard is still its shard; if it is not (the parameter was
    replaced after a forward, or a compiled graph, took this shard), the step computed with values the model no longer
    holds and its gradient has nowhere to go: that raises, naming the parameter, rather than leave it untrained."""
    owner = module()
    param = None if owner is None else owner._parameters.get(name)  # private: see lightning_tp2d._private_api
    if not isinstance(param, DTensor) or param._local_tensor is not local:
        if owner is not None and local.grad is not None:
            raise RuntimeError(
                f"the gradient of {type(owner).__name__}.{name} reached a shard that is no longer that parameter's: "
                f"the parameter was replaced (a new nn.Parameter assigned, or its shard swapped) after a forward or "
                f"a compiled graph took the old one, so this step computed with the old values and its gradient "
                f"cannot reach the parameter the module holds now. Replace parameters before the forward, and after "
                f"replacing them under torch.compile call lightning_tp2d.nn.functional.own_leaf_grads(model) (a "
                f"Trainer or lightning_tp2d.step.assemble_step does) so that the compiled graph takes the new ones")
        return
    grad, local.grad = local.grad, None
    if grad is None or not param.requires_grad:  # (frozen since a compiled graph took its shard: no gradient)
        return
    have = param.grad
    if have is None:
        param.grad = _as_param_grad(grad, _grad_spec(param), local.stride())
    elif isinstance(have, DTensor) and have._local_tensor.shape == grad.shape:
        have._local_tensor.add_(grad)
    else:
        param.grad = have + _as_param_grad(grad, _grad_spec(param), local.stride())
    hooks = param._post_accumulate_grad_hooks  # private: see lightning_tp2d._private_api
    if hooks:
        for hook in tuple(hooks.values()):
            hook(param)


def local_view(param: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor parameter, differentiable: the math the layers do on it reaches the parameter's
    ``.grad`` (a DTensor of the parameter's placements).

    * A parameter marked by :func:`own_leaf_grads` (:func:`lightning_tp2d.parallelize` marks every parameter it
      makes, :func:`lightning_tp2d.step.assemble_step` those a cast or a move replaced since) hands out its local
      shard itself, armed as an autograd leaf of its own (:func:`_leaf_of`): no op, no autograd node and no tensor
      subclass per use, and its gradient accumulates as a plain tensor, as the plain model's do. Its hook sets
      ``param.grad`` after each backward. This makes one rank dispatch the plain model's ops exactly
      (``tests/test_one_rank.py``; docs/benchmarks.md, "The layouts' own cost"). Under ``torch.compile`` the armed
      shard is traced as a plain leaf input, so no DTensor enters the graph either: :func:`local_param`, what the
      layers call, finds it through the module's links.
    * Any other DTensor parameter (FSDP's sharded and gathered ones, a deep copy's until it is marked, one that does
      not require grad) goes through :class:`_LocalView`, and under ``torch.compile`` through ``to_local``; a plain
      tensor is itself.

    A gradient that reaches an armed shard must be a tensor no collective's work object still holds: autograd would
    copy it rather than keep it (``_SumGradAlong`` hands its all-reduced sum over as a fresh view)."""
    if not isinstance(param, DTensor):
        return param
    if torch.compiler.is_compiling():  # (an armed shard is found by local_param, without touching the DTensor)
        return param.to_local()
    link = param.__dict__.get(_LEAF)
    if link is not None and param.requires_grad and _holder(link) is param:  # (where its hook finds it)
        local = param._local_tensor
        armed = link.local
        if armed is None or armed() is not local:  # a shard replaced since it was marked (a cast, a load)
            _leaf_of(link, local)
        return local
    return _LocalView.apply(param)


def local_param(module: torch.nn.Module, name: str) -> torch.Tensor:
    """``local_view(getattr(module, name))``: the local shard of ``module``'s parameter ``name``, differentiable.

    Under ``torch.compile`` an armed shard (:func:`own_leaf_grads`) is found through the module's links, without
    touching the DTensor parameter: every DTensor that Dynamo wraps gets a guard in Python that compares its whole
    spec (``DTENSOR_SPEC_MATCH``: a deep copy's device mesh, compared field by field) on every call of the compiled
    model, ~4 us per parameter on CPU, 110 us of a 2-block GPT-2's 1 ms step and 1.2 ms of GPT-2 medium's. The shard
    is then guarded as the plain tensor it is (in C++). A shard replaced since it was armed (a cast or a move swaps
    the parameter's contents) is freed with its weak reference, which fails the guard: the model is traced again
    through the parameter itself. A parameter frozen after it was traced still gets no gradient: its shard's hook
    drops it (:func:`_to_param_grad`)."""
    if torch.compiler.is_compiling():
        links = getattr(module, _LINKS, None)
        link = None if links is None else links.get(name)
        local = None if link is None or link.local is None else link.local()
        if local is not None and local.requires_grad:
            return local
        return local_view(getattr(module, name))
    # eager: local_view's armed case, checked from the link's side (no Module.__getattr__, no weak module call)
    links = module.__dict__.get(_LINKS)
    link = None if links is None else links.get(name)
    if link is not None and link.local is not None:
        param = module._parameters.get(name)  # private: see lightning_tp2d._private_api
        if param is not None and param.__dict__.get(_LEAF) is link and param.requires_grad:
            local = param._local_tensor
            if link.local() is local:
                return local
    return local_view(getattr(module, name))


@registered("sum_grad_along")
class _SumGradAlong(torch.autograd.Function):
    """Forward: identity. Backward: sum the gradient over ``axis``.

    For a parameter replicated over an axis whose ranks see different tokens (the position table over ``row`` in
    "2d", the ring's norms and position table in "metp"): each replica's local gradient is a partial sum, and the true
    gradient is their sum. (The grid's norms, the SUMMA's biases and the ring kernels' biases sum theirs inside their
    own backward, overlapped, with no identity function per use: :func:`lightning_tp2d.comm.summed_later`.)
    """

    @staticmethod
    def forward(ctx, x, mesh, axis):
        ctx.mesh, ctx.axis = mesh, axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        summed = grad.contiguous().clone()
        all_reduce_along(summed, ctx.mesh, ctx.axis)
        return summed.view_as(summed), None, None


def sum_grad_along(x: torch.Tensor, mesh: DeviceMesh, axis: str) -> torch.Tensor:
    """Identity forward, gradient summed over ``axis`` backward (:class:`_SumGradAlong`); ``x`` itself when the axis
    has one rank (nothing to sum: no op at all)."""
    if axis_size(mesh, axis) == 1:
        return x
    if torch.compiler.is_compiling():  # traced: a functional all-reduce in the backward (lightning_tp2d.nn.traced)
        return traced.sum_gradient(x, mesh, axis)
    return _SumGradAlong.apply(x, mesh, axis)


@registered("sum_grads_along")
class _SumGradsAlong(torch.autograd.Function):
    """:class:`_SumGradAlong` for several tensors of one dtype with one all-reduce of their concatenated gradients
    (LayerNorm's weight and bias: one call instead of two)."""

    @staticmethod
    def forward(ctx, mesh, axis, *xs):
        ctx.mesh, ctx.axis, ctx.shapes = mesh, axis, [x.shape for x in xs]
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        flat = torch.cat([g if g.dim() == 1 else g.reshape(-1) for g in grads])  # (vectors: no view to flatten)
        all_reduce_along(flat, ctx.mesh, ctx.axis)
        # one op cuts every part; each is a view the collective's work does not hold, so autograd takes it as it is
        parts = flat.split([shape.numel() for shape in ctx.shapes])
        return (None, None, *(part if len(shape) == 1 else part.view(shape) for part, shape in zip(parts, ctx.shapes)))


def sum_grads_along(xs, mesh: DeviceMesh, axis: str) -> tuple[torch.Tensor, ...]:
    """Identity on each of ``xs`` forward; backward sums all their gradients over ``axis`` in one all-reduce."""
    xs = tuple(xs)
    if len(xs) == 1 or axis_size(mesh, axis) == 1:
        return tuple(sum_grad_along(x, mesh, axis) for x in xs)
    if torch.compiler.is_compiling():
        return traced.sum_gradients(xs, mesh, axis)
    return _SumGradsAlong.apply(mesh, axis, *xs)


@registered("gather_grid")
class _GatherGrid(torch.autograd.Function):
    """Forward: all-gather a ``[rows/q, cols/q]`` block into the full ``[rows, cols]`` matrix on every rank
    (gather along ``col`` on the last dim, then along ``row`` on the first). Backward: keep the local block."""

    @staticmethod
    def forward(ctx, block, mesh):
        ctx.mesh = mesh
        ctx.shape = block.shape
        full = all_gather_along(block.contiguous(), mesh, "col", dim=-1)
        return all_gather_along(full, mesh, "row", dim=0)

    @staticmethod
    def backward(ctx, grad):
        rows, cols = ctx.shape
        r, c = axis_rank(ctx.mesh, "row"), axis_rank(ctx.mesh, "col")
        return grad[r * rows:(r + 1) * rows, c * cols:(c + 1) * cols], None


def gather_grid(block: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    if is_local_grid(mesh):
        return block
    return _GatherGrid.apply(block, mesh)


@registered("transpose_grid")
class _TransposeGrid(torch.autograd.Function):
    """Forward: rank ``(r, c)`` swaps its block with rank ``(c, r)`` (diagonal ranks keep theirs): a matrix
    whose block ``(i, j)`` sat on rank ``(i, j)`` now has it on rank ``(j, i)``. Backward: the same swap."""

    @staticmethod
    def forward(ctx, block, mesh):
        ctx.mesh = mesh
        return exchange_with(block, transpose_peer(mesh)).view_as(block)

    @staticmethod
    def backward(ctx, grad):
        return exchange_with(grad.contiguous(), transpose_peer(ctx.mesh)).view_as(grad), None


def transpose_grid(block: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    if is_local_grid(mesh):
        return block  # the one rank is its own mirror
    return _TransposeGrid.apply(block, mesh)


def is_local_grid(mesh: DeviceMesh) -> bool:
    """Whether the grid is ``1 x 1``: one rank holds every block, and each grid layer runs the plain model's ops
    (its fused kernel, one matmul per linear, ``F.cross_entropy``) instead of the distributed algorithm."""
    return axis_size(mesh, "row") == 1 and axis_size(mesh, "col") == 1


def shard_range(size: int, n: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``index`` when ``size`` is split into ``n`` chunks the way DTensor's ``Shard``
    does (``ceil(size/n)`` each, the last ones short or empty)."""
    chunk = -(-size // n)
    start = min(index * chunk, size)
    return start, min(start + chunk, size)


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero-pad dim 0 of ``x`` to ``rows`` (differentiable; a no-op view when already that size)."""
    missing = rows - x.shape[0]
    if missing == 0:
        return x
    return F.pad(x, (0, 0, 0, missing))


def axis_index(mesh: DeviceMesh, axis: str) -> tuple[int, int]:
    """``(coordinate, size)`` of this rank along ``axis``."""
    return axis_rank(mesh, axis), axis_size(mesh, axis)


def shard_parameter(tensor: torch.Tensor, mesh: DeviceMesh, placements) -> torch.nn.Parameter:
    """A DTensor parameter holding this rank's shard of ``tensor`` (a full copy that every rank holds alike).

    Each rank slices its own shard, with no communication (torch >= 2.7); older releases scatter the shards
    from global rank 0 instead.
    """
    tensor = tensor.detach()
    try:
        dt = distribute_tensor(tensor, mesh, placements, src_data_rank=None)
    except TypeError:
        dt = distribute_tensor(tensor, mesh, placements)
    return torch.nn.Parameter(dt)


def shard_bias(module: torch.nn.Module, bias: torch.Tensor | None, mesh: DeviceMesh, placements) -> None:
    """Set ``module.bias`` to :func:`shard_parameter` of ``bias``, or register it as ``None`` when there is none."""
    if bias is None:
        module.register_parameter("bias", None)
    else:
        module.bias = shard_parameter(bias, mesh, placements)


def autocast_operands(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Cast matmul operands to the autocast dtype when autocast is on (``bf16-mixed``), outside the SUMMA
    autograd functions, so their forward and backward see one dtype (the cast's backward restores the
    parameter's dtype for its gradient)."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(recompute.follow(t.to(dtype), t, lambda s: s.to(dtype)) for t in tensors)
