"""ZeRO stage 1 on the data-parallel axis: each replica keeps the optimizer state of a 1/dp slice of every
parameter.

Without it, every data-parallel replica holds the full optimizer state of its tensor shard: for AdamW two float32
tensors per parameter element, twice the weights. :class:`ShardedOptimizer` splits every parameter evenly over the
``dp`` replicas of the ``data_parallel`` axis and changes the optimizer in place:

* replica ``r`` owns elements ``[r*s, min((r+1)*s, n))``, ``s = ceil(n/dp)``, of the flattened local tensor-parallel
  shard (``n`` elements) of each parameter (:func:`even_slices`: the last slices shorter or empty); each parameter
  group lists these *slices* (views of the parameters' storage) instead of the parameters, so the optimizer
  creates, updates and saves state for them alone: optimizer state per rank ~ 1/dp of the replicated state (at
  most one element per parameter and field above the even share; step counts stay whole). Group hyper-parameters
  (``lr`` set by schedulers, ``weight_decay``) apply as before. 0-dim parameters stay whole on every replica.
* gradients are still averaged in full over the replicas (:class:`~lightning_tp2d.training.GradientSync`; at
  stages 2/3 :mod:`lightning_tp2d.fsdp`'s hook on the parameters it keeps whole) and
  clipped by the global norm of the whole model (the strategies clip over :attr:`ShardedOptimizer.params`); at
  ``optimizer.step()`` (after its closure, if any) each slice's ``.grad`` becomes the matching slice of its
  parameter's averaged gradient (a view: no copy).
* after every step the updated slices are all-gathered back into the full local parameters, in buckets per dtype
  and device of at most ``bucket_mib`` gathered (:data:`BUCKET_MIB`; a larger parameter is a bucket alone), at
  most :data:`_IN_FLIGHT` + 1 on the wire at once (each later one posted before the oldest is waited on and copied
  into its parameters); then every sliced parameter's gradient is dropped, as
  ``zero_grad()`` would (a wrapper's ``zero_grad``, Fabric's, reaches only the slices). ``zero_grad`` clears the
  parameters' gradients too.
* parameters split over ``data_parallel`` already (FSDP's at ZeRO stages 2/3, :mod:`lightning_tp2d.fsdp`) *pass
  through* untouched: each is its own entry in its group (:meth:`~ShardedOptimizer.shard_of` returns it), its state
  is keyed by it and already 1/dp, its gradient (reduce-scattered by FSDP) is not bound, nothing of it is gathered,
  and :meth:`~ShardedOptimizer.owned_slice` / :meth:`~ShardedOptimizer.full_state` give its state as it is. So
  after ``fsdp.shard_data_parallel`` the parameters FSDP keeps whole (GPT-2's fused q/k/v bias on the grids) are
  the only ones sliced; a model with none left costs nothing per step. Next to such parameters each slice is a
  DTensor replicated on its parameter's mesh (a group's foreach kernels take DTensors or plain tensors, not a
  mix), and a 0-dim parameter passes through too (it is whole on every replica anyway).

The slicing is exact only for an *element-wise* optimizer, whose update of an element reads that element's
gradient and state alone: torch's SGD, Adam, AdamW, Adamax, Adagrad, Adadelta, ASGD, NAdam, RAdam, RMSprop and
Rprop (and their subclasses). Others (LBFGS, Adafactor, Muon, SparseAdam) are refused with a ``TypeError``, unless
every parameter passes through (nothing to slice).

The optimizer stays a plain ``torch.optim.Optimizer`` (slices bound and gathered by its public step hooks), so
learning-rate schedulers, Lightning's optimizer loop, Fabric and hand-written loops work unchanged. Checkpoints
(:mod:`lightning_tp2d.checkpoint`) store every parameter's state in its stage-0 form, gathered over
``data_parallel`` while saving (:meth:`~ShardedOptimizer.full_state`), and load it by slicing
(:meth:`~ShardedOptimizer.owned_slice`), so a checkpoint written at stage 1 loads at any stage, data-parallel size
and layout, and one from stage 0 loads here. The sharded (DCP) format saves and loads every parameter at once, so
for that moment each rank holds the replicated state, as at stage 0; the full file goes one parameter at a time.

What is not sharded: gradients (all-reduced in full, as before: ZeRO-2 would reduce-scatter them) and parameters
(ZeRO-3). Traffic per step: besides the gradient all-reduce, one all-gather in which every rank sends its ~1/dp of
the local parameters and receives the rest, ``(dp - 1)/dp`` of the local parameter bytes in (half of what a ring
all-reduce of the gradients moves); its receive buffers are at most three buckets at a time. At stages 2/3 only the
parameters FSDP keeps whole are gathered (GPT-2 on the grids: ``3 * n_embd / q`` elements per block). Build
the sharding after the model is parallelized, cast and on its device: the slices are views of the parameters'
storage (a step after the storage changed raises).
"""

from __future__ import annotations

import collections
import math
import warnings

import torch
from torch.distributed.tensor import DTensor, Replicate

from lightning_tp2d.comm import all_gather_blocks, axis_rank, axis_size
from lightning_tp2d import train_plan
from lightning_tp2d.layouts import DATA_AXIS

__all__ = ["BUCKET_MIB", "ELEMENTWISE_OPTIMIZERS", "ShardedOptimizer", "ZERO_STAGES", "clipped_parameters",
           "even_slices", "full_param_groups", "optimizer_state_bytes", "shard_optimizer_state", "sharding_of"]

ZERO_STAGES = train_plan.ZERO_STAGES  # 2 and 3: lightning_tp2d.fsdp (FSDP2 over data_parallel)
_ATTRIBUTE = "tp2d_sharding"  # where a sharded optimizer keeps its ShardedOptimizer
BUCKET_MIB = 64.0  # gathered bytes per all-gather after the step (ShardedOptimizer's bucket_mib)
_IN_FLIGHT = 2  # all-gathers left on the wire while the next is posted: at most 3 blocks of receive buffers at once
ELEMENTWISE_OPTIMIZERS = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop"))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _data_ptr(t: torch.Tensor) -> int:
    """``t.data_ptr()``; quiet for a fake tensor (the tracer's and the memory model's), which warns and never moves."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        return t.data_ptr()


def _split_over_dp(param: torch.Tensor) -> bool:
    """Whether ``param`` is a DTensor split over ``data_parallel`` already (FSDP's, zero_stage 2/3)."""
    names = (param.device_mesh.mesh_dim_names or ()) if isinstance(param, DTensor) else ()
    return DATA_AXIS in names and not param.placements[names.index(DATA_AXIS)].is_replicate()


def even_slices(n: int, parts: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each of ``parts`` contiguous slices of ``n`` elements: ``s = ceil(n/parts)`` each, the
    last ones shorter or empty (``even_slices(5, 4) == [(0, 2), (2, 4), (4, 5), (5, 5)]``)."""
    size = math.ceil(n / parts)
    return [(min(r * size, n), min((r + 1) * size, n)) for r in range(parts)]


class _Piece:
    """This replica's slice ``local = flat[start:stop]`` of one parameter's flattened local shard ``flat`` (``n``
    elements, ``size = ceil(n/dp)`` per replica), at ``offset`` in its bucket's all-gather block. A 0-dim parameter
    is ``whole``: every replica steps it (its slice is the parameter's local tensor) and nothing is gathered.
    ``shard`` (the optimizer's entry) is ``local`` itself, or with a ``mesh`` a DTensor of it replicated on that
    mesh (:meth:`wrap`): an optimizer group that also holds DTensors needs DTensors alone for its foreach kernels."""

    __slots__ = ("param", "flat", "ptr", "n", "size", "start", "stop", "local", "shard", "whole", "offset", "mesh")

    def __init__(self, param: torch.Tensor, dp: int, rank: int, mesh=None) -> None:
        local = _local(param.detach())
        if not local.is_contiguous():
            raise ValueError(f"ZeRO-1 slices a parameter's local shard in place, but one of shape {tuple(local.shape)} "
                             f"is not contiguous (strides {local.stride()})")
        self.param, self.flat, self.ptr, self.n = param, local.view(-1), _data_ptr(local), local.numel()
        self.whole = local.dim() == 0
        self.size = self.n if self.whole else math.ceil(self.n / dp)
        self.start, self.stop = (0, self.n) if self.whole else even_slices(self.n, dp)[rank]
        self.local = local if self.whole else self.flat[self.start:self.stop]
        self.mesh, self.offset = mesh, 0
        self.shard = self.wrap(self.local)

    def wrap(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a tensor of this slice's shape) as the optimizer holds it: itself, or a replicated DTensor."""
        if self.mesh is None:
            return t
        return DTensor.from_local(t, self.mesh, [Replicate()] * self.mesh.ndim, run_check=False)

    def scatter(self, blocks: torch.Tensor) -> None:
        """Copy every replica's slice from the gathered ``blocks [dp, chunk]`` into the parameter."""
        rows = self.n // self.size
        self.flat[:rows * self.size].view(rows, self.size).copy_(blocks[:rows, self.offset:self.offset + self.size])
        rest = self.n - rows * self.size
        if rest:
            self.flat[rows * self.size:].copy_(blocks[rows, self.offset:self.offset + rest])


def _scatter(pieces: list[_Piece], blocks: torch.Tensor, handle) -> None:
    handle.wait()
    for piece in pieces:
        piece.scatter(blocks)


class ShardedOptimizer:
    """ZeRO-1 of ``optimizer`` over the ``data_parallel`` axis of ``mesh`` (module docstring), applied in place and
    once (:func:`shard_optimizer_state`). :attr:`param_groups` keeps the full parameter lists (what checkpoints
    record), :attr:`params` every parameter and :attr:`shards` this replica's slice of each, in that order; state
    the optimizer already holds is cut to the slices. With ``dp = 1`` each slice is a whole parameter. A parameter
    split over ``data_parallel`` already (FSDP's; next to one, a 0-dim one too) is its own slice and passes through
    untouched (module docstring); with no other parameter nothing is bound or gathered at the step (no hook)."""

    def __init__(self, optimizer: torch.optim.Optimizer, mesh, bucket_mib: float = BUCKET_MIB) -> None:
        if getattr(optimizer, _ATTRIBUTE, None) is not None:
            raise ValueError("this optimizer's state is already sharded")
        self.param_groups = [list(g["params"]) for g in optimizer.param_groups]
        self.params = [p for group in self.param_groups for p in group]
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("a parameter appears twice in the optimizer's parameter groups")
        self._passthrough = {id(p) for p in self.params if _split_over_dp(p)}
        if self._passthrough:  # a 0-dim parameter is whole on every replica anyway: its own entry too
            self._passthrough |= {id(p) for p in self.params if p.dim() == 0}
        replicated = [p for p in self.params if id(p) not in self._passthrough]
        if replicated and not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
            names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
            raise TypeError(f"ZeRO-1 splits every parameter replicated over the data-parallel replicas, which is "
                            f"exact only for an element-wise optimizer ({names}); {type(optimizer).__name__} is not "
                            f"one of them: use zero_stage=0")
        self.optimizer, self.mesh = optimizer, mesh
        self.dp, self.rank = axis_size(mesh, DATA_AXIS), axis_rank(mesh, DATA_AXIS)
        # next to FSDP's DTensors (one foreach kernel per group) the slices are replicated DTensors too
        wrap = (lambda p: p.device_mesh if isinstance(p, DTensor) else mesh) if self._passthrough else lambda p: None
        self._pieces = [_Piece(p, self.dp, self.rank, wrap(p)) for p in replicated]
        self._piece_of = {id(piece.param): piece for piece in self._pieces}
        self.shards = [self.shard_of(p) for p in self.params]
        for piece in self._pieces:
            if piece.param in optimizer.state:  # state created before sharding: keep this replica's slice of it
                optimizer.state[piece.shard] = {k: self.owned_slice(piece.param, v)
                                                for k, v in optimizer.state.pop(piece.param).items()}
        for group, full in zip(optimizer.param_groups, self.param_groups):
            group["params"] = [self.shard_of(p) for p in full]
        # all-gather buckets: per dtype and device, in a fixed order, each cut where its gathered bytes would pass
        # the cap (a piece alone may pass it); each piece at its offset in its bucket's block
        by_kind: dict[tuple[str, str], list[_Piece]] = {}
        for piece in self._pieces:
            if not piece.whole and piece.n:
                by_kind.setdefault((str(piece.flat.dtype), str(piece.flat.device)), []).append(piece)
        cap = bucket_mib * 2 ** 20
        self._buckets: list[list[_Piece]] = []
        for key in sorted(by_kind):
            offset = cap  # start a new bucket
            for piece in by_kind[key]:
                if offset and (offset + piece.size) * self.dp * piece.flat.element_size() > cap:
                    self._buckets.append([])
                    offset = 0
                self._buckets[-1].append(piece)
                piece.offset, offset = offset, offset + piece.size
        # no slice to bind or gather (every parameter passes through): no hook, nothing per step
        self._hooks = [optimizer.register_step_pre_hook(self._before_step),
                       optimizer.register_step_post_hook(lambda opt, args, kwargs: self.after_step())
                       ] if self._pieces else []
        self._zero_grad = optimizer.zero_grad
        optimizer.zero_grad = self.zero_grad  # the parameters' gradients too, not only the slices'
        setattr(optimizer, _ATTRIBUTE, self)

    def shard_of(self, param: torch.Tensor) -> torch.Tensor:
        """This replica's slice of ``param`` (flattened local shard; the optimizer's key for its state); a parameter
        passing through (split over ``data_parallel`` already) is its own."""
        if id(param) in self._passthrough:
            return param
        return self._piece_of[id(param)].shard

    def _before_step(self, optimizer, args, kwargs):
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self.bind_gradients()
            return None

        def closure_then_bind():
            loss = closure()  # forward and backward (Lightning: and the clip): the gradients are final after it
            self.bind_gradients()
            return loss

        return args[:1], {**kwargs, "closure": closure_then_bind}

    @torch.no_grad()
    def bind_gradients(self) -> None:
        """Each slice's ``.grad``: the matching slice of its parameter's gradient (``None`` where that is)."""
        for piece in self._pieces:
            if _data_ptr(_local(piece.param.detach())) != piece.ptr:
                raise RuntimeError("a parameter's storage changed after its optimizer state was sharded (the model "
                                   "was moved or cast later): shard the optimizer after that")
            grad = piece.param.grad
            piece.shard.grad = None if grad is None else piece.wrap(
                _local(grad) if piece.whole else _local(grad).reshape(-1)[piece.start:piece.stop])

    @torch.no_grad()
    def after_step(self) -> None:
        """All-gather the freshly stepped slices into the parameters; drop their parameters' gradients (those of
        the parameters passing through stay until ``zero_grad``)."""
        if self.dp > 1:
            posted: collections.deque = collections.deque()
            for pieces in self._buckets:
                first = pieces[0].flat
                block = torch.empty(pieces[-1].offset + pieces[-1].size, dtype=first.dtype, device=first.device)
                for piece in pieces:  # the padding of shorter slices is never read back
                    block[piece.offset:piece.offset + piece.stop - piece.start].copy_(piece.local)
                posted.append((pieces, *all_gather_blocks(block, self.mesh, DATA_AXIS)))
                if len(posted) > _IN_FLIGHT:  # the oldest lands while the newer ones are on the wire
                    _scatter(*posted.popleft())
            while posted:
                _scatter(*posted.popleft())
        for piece in self._pieces:
            piece.shard.grad = piece.param.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._zero_grad(set_to_none=set_to_none)
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.detach_()
                p.grad.zero_()

    def owned_slice(self, param: torch.Tensor, value):
        """This replica's part of a state entry of ``param`` in stage-0 form: of a tensor shaped like ``param``
        (``dim > 0``; a DTensor in ``param``'s placement when it is one) a copy of the owned slice of its local
        shard (a replicated DTensor of it next to FSDP's parameters, as the optimizer holds its slice); anything else
        (step counts) as it is. For a parameter passing through (its state in the parameter's at-rest placement)
        ``value`` as it is."""
        if id(param) in self._passthrough:
            return value
        piece = self._piece_of[id(param)]
        if not isinstance(value, torch.Tensor):
            return value
        if piece.whole or value.dim() == 0 or tuple(value.shape) != tuple(param.shape):
            return _local(value).clone()
        local = _local(value).reshape(-1)
        if local.numel() != piece.n:
            raise ValueError(f"optimizer state of {local.numel()} elements for a local shard of {piece.n}")
        return piece.wrap(local[piece.start:piece.stop].clone())

    @torch.no_grad()
    def full_state(self, param: torch.Tensor) -> dict:
        """``param``'s optimizer state in stage-0 form: each field shaped like the slice gathered over
        ``data_parallel`` into the parameter's local shape (a DTensor in ``param``'s placement when it is one), the
        rest as this replica holds it. A collective: every replica calls it for the same parameters in the same
        order. The gathered copies are temporary (checkpoints, :meth:`remove`). For a parameter passing through: a
        new dict of its state as the optimizer holds it (no collective)."""
        if id(param) in self._passthrough:
            return dict(self.optimizer.state.get(param, {}))
        piece = self._piece_of[id(param)]
        state = self.optimizer.state.get(piece.shard, {})
        out = dict(state)
        sliced = sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and not piece.whole
                        and tuple(v.shape) == tuple(piece.local.shape))
        for dtype in sorted({state[k].dtype for k in sliced}, key=str):
            fields = [k for k in sliced if state[k].dtype == dtype]
            block = torch.zeros(len(fields), piece.size, dtype=dtype, device=piece.flat.device)
            for j, k in enumerate(fields):
                block[j, :piece.stop - piece.start].copy_(_local(state[k]))
            blocks, handle = all_gather_blocks(block, self.mesh, DATA_AXIS) if piece.n else (block[None], None)
            if handle is not None:
                handle.wait()  # blocks [dp, fields, size]
            for j, k in enumerate(fields):
                local = blocks[:, j].reshape(-1)[:piece.n].view(_local(param).shape)
                out[k] = (DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                             shape=param.shape, stride=param.stride())
                          if isinstance(param, DTensor) else local)
        return out

    def remove(self) -> None:
        """Undo the sharding: the full parameter groups back, with every parameter's full state (a collective)."""
        state = {piece.param: self.full_state(piece.param) for piece in self._pieces}
        for hook in self._hooks:
            hook.remove()
        self.optimizer.zero_grad = self._zero_grad
        for group, full in zip(self.optimizer.param_groups, self.param_groups):
            group["params"] = list(full)
        for piece in self._pieces:  # (the state of parameters split over data_parallel stays where it is)
            self.optimizer.state.pop(piece.shard, None)
            if state[piece.param]:
                self.optimizer.state[piece.param] = state[piece.param]
        setattr(self.optimizer, _ATTRIBUTE, None)


def shard_optimizer_state(optimizer: torch.optim.Optimizer, mesh, bucket_mib: float = BUCKET_MIB) -> ShardedOptimizer:
    """ZeRO-1: shard ``optimizer``'s state over ``mesh``'s ``data_parallel`` axis in place (module docstring;
    ``bucket_mib``: gathered MiB per all-gather after the step); the same optimizer when it already is."""
    existing = sharding_of(optimizer)
    return existing if existing is not None else ShardedOptimizer(optimizer, mesh, bucket_mib)


def sharding_of(optimizer) -> ShardedOptimizer | None:
    """The :class:`ShardedOptimizer` of ``optimizer``, or ``None`` when its state is not sharded."""
    return getattr(optimizer, _ATTRIBUTE, None)


def full_param_groups(optimizer) -> list[list[torch.Tensor]]:
    """Every parameter group's full parameter list (with ZeRO-1 the parameters, not this replica's slices)."""
    sharding = sharding_of(optimizer)
    return sharding.param_groups if sharding is not None else [list(g["params"]) for g in optimizer.param_groups]


def clipped_parameters(optimizer, main_params) -> list[torch.Tensor]:
    """The parameters a gradient clip for ``optimizer`` must cover: with ZeRO every one (the optimizer steps slices,
    the norm is the whole model's), else ``main_params`` (the precision plugin's view of its parameters)."""
    sharding = sharding_of(optimizer)
    return list(main_params) if sharding is None else sharding.params


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of tensor state this rank's optimizer holds (local shards)."""
    return sum(_local(v).numel() * v.element_size() for state in optimizer.state.values()
               for v in state.values() if isinstance(v, torch.Tensor))
