"""ZeRO stage 1 on the data-parallel axis: each replica keeps the optimizer state of only its share of the
parameters.

Without it, every data-parallel replica holds the full optimizer state of its tensor shard: for AdamW two float32
tensors per parameter element, twice the weights. :class:`ShardedOptimizer` partitions the optimizer's parameters
over the ``data_parallel`` ranks (whole parameters, balanced by element count, the same partition on every rank)
and changes the optimizer in place:

* each parameter group keeps only the parameters this replica *owns*, so the optimizer creates, updates and saves
  state for those alone (optimizer state per rank ~ 1/dp of the replicated state);
* gradients are still averaged over all replicas before the step (:class:`~lightning_tp2d.training.GradientSync`)
  and clipped by the global norm of the whole model (the strategy clips over :attr:`ShardedOptimizer.params`);
* after every ``optimizer.step()`` each owner broadcasts its updated parameters to the other replicas (one
  flattened broadcast per owner and dtype, all posted before any is waited on), and the gradients of the
  parameters this replica does not own are dropped (``zero_grad`` also clears them).

The optimizer stays a plain ``torch.optim.Optimizer`` (the step and zero-grad behaviour come from its public hook
API), so learning-rate schedulers, Lightning's optimizer loop, Fabric and hand-written loops work unchanged.
Checkpoints (:mod:`lightning_tp2d.checkpoint`) record the full parameter groups and every owner's state, so a
checkpoint written with optimizer sharding loads with or without it, on any data-parallel size and layout.

What is not sharded: gradients (all-reduced in full, as before: ZeRO-2 would reduce-scatter them) and parameters
(ZeRO-3). The extra traffic per step is one broadcast of the parameters (the same bytes as a second gradient
all-reduce would move).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor

from lightning_tp2d.comm import axis_rank, axis_size, broadcast_along
from lightning_tp2d.layouts import DATA_AXIS

__all__ = ["ShardedOptimizer", "ZERO_STAGES", "clipped_parameters", "full_param_groups", "optimizer_state_bytes", "shard_optimizer_state",
           "sharding_of"]

ZERO_STAGES = (0, 1, 2, 3)  # 2 and 3: lightning_tp2d.fsdp (FSDP2 over data_parallel)
_ATTRIBUTE = "tp2d_sharding"  # where a sharded optimizer keeps its ShardedOptimizer


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def partition(sizes: list[int], parts: int) -> list[int]:
    """Owner (0 .. ``parts - 1``) of each item: largest first onto the least loaded part (ties: lowest index), so
    the busiest owner holds at most the balanced share plus one item."""
    loads, owners = [0] * parts, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owner = min(range(parts), key=lambda r: (loads[r], r))
        owners[i], loads[owner] = owner, loads[owner] + sizes[i]
    return owners


class ShardedOptimizer:
    """Optimizer-state sharding of ``optimizer`` over the ``data_parallel`` axis of ``mesh`` (module docstring).

    Applied in place and once (:func:`shard_optimizer_state`); :attr:`param_groups` keeps the full parameter lists
    (what checkpoints record), :attr:`params` every parameter, :meth:`owns` says whether this replica steps one.
    With ``dp = 1`` nothing changes but the bookkeeping.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, mesh) -> None:
        if getattr(optimizer, _ATTRIBUTE, None) is not None:
            raise ValueError("this optimizer's state is already sharded")
        self.optimizer, self.mesh = optimizer, mesh
        self.dp = axis_size(mesh, DATA_AXIS)
        self.rank = axis_rank(mesh, DATA_AXIS)
        self.param_groups = [list(g["params"]) for g in optimizer.param_groups]
        self.params = [p for group in self.param_groups for p in group]
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("a parameter appears twice in the optimizer's parameter groups")
        owners = partition([p.numel() for p in self.params], self.dp)
        self.owner = {id(p): r for p, r in zip(self.params, owners)}
        for group, full in zip(optimizer.param_groups, self.param_groups):
            group["params"] = [p for p in full if self.owns(p)]
        for p in [p for p in optimizer.state if not self.owns(p)]:  # state created before sharding: let it go
            del optimizer.state[p]
        # broadcast buckets: per owner and dtype, in a fixed order
        buckets: dict[tuple[int, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for p in self.params:
            buckets[(self.owner[id(p)], p.dtype)].append(p)
        self._buckets = sorted(buckets.items(), key=lambda kv: (kv[0][0], str(kv[0][1])))
        self._foreign = [p for p in self.params if not self.owns(p)]
        self._hook = optimizer.register_step_post_hook(lambda opt, args, kwargs: self.after_step())
        self._zero_grad = optimizer.zero_grad
        optimizer.zero_grad = self.zero_grad  # also clears the gradients of parameters owned elsewhere
        setattr(optimizer, _ATTRIBUTE, self)

    def owns(self, param: torch.Tensor) -> bool:
        """Whether this replica keeps the optimizer state of ``param`` and steps it."""
        return self.owner[id(param)] == self.rank

    @torch.no_grad()
    def after_step(self) -> None:
        """Every owner sends its freshly stepped parameters to the other replicas; foreign gradients are dropped."""
        if self.dp > 1:
            posted = []
            for (owner, _), params in self._buckets:
                locals_ = [_local(p.detach()) for p in params]
                flat = (torch.cat([t.reshape(-1) for t in locals_]) if owner == self.rank else
                        torch.empty(sum(t.numel() for t in locals_), dtype=locals_[0].dtype, device=locals_[0].device))
                posted.append((owner, locals_, flat, broadcast_along(flat, self.mesh, DATA_AXIS, src=owner,
                                                                     async_op=True)))
            for owner, locals_, flat, handle in posted:
                handle.wait()
                if owner == self.rank:
                    continue
                offset = 0
                for t in locals_:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()
        for p in self._foreign:
            p.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._zero_grad(set_to_none=set_to_none)
        for p in self._foreign:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.detach_()
                p.grad.zero_()

    @torch.no_grad()
    def owner_state(self, param: torch.Tensor, fields: dict[str, tuple[torch.dtype, bool]]) -> dict[str, torch.Tensor]:
        """``param``'s optimizer state on every replica, sent by its owner (a collective over ``data_parallel``:
        every rank calls it for the same parameters in the same order). ``fields``: ``{name: (dtype,
        shaped_like_param)}`` as the owner holds them (:meth:`state_fields`). Used to write a full-file checkpoint;
        the copies are temporary."""
        owner = self.owner[id(param)]
        mine = self.optimizer.state.get(param, {}) if owner == self.rank else {}
        out = {}
        for field, (dtype, like_param) in fields.items():
            if owner == self.rank:
                value = mine[field]
            elif like_param:
                value = torch.empty_like(param.detach(), dtype=dtype)
            else:
                value = torch.empty((), dtype=dtype, device=_local(param).device)
            if self.dp > 1:
                buffer = _local(value).contiguous()
                broadcast_along(buffer, self.mesh, DATA_AXIS, src=owner)
                if owner != self.rank:
                    _local(value).copy_(buffer)
            out[field] = value
        return out

    def state_fields(self) -> dict[int, dict[str, tuple[torch.dtype, bool]]]:
        """``{index in params: {field: (dtype, shaped like the parameter)}}`` of the tensor state this replica
        owns (non-tensor state is kept out: optimizers in torch keep their state in tensors)."""
        out = {}
        for index, p in enumerate(self.params):
            if self.owns(p) and p in self.optimizer.state:
                out[index] = {k: (v.dtype, v.dim() > 0 and tuple(v.shape) == tuple(p.shape))
                              for k, v in self.optimizer.state[p].items() if isinstance(v, torch.Tensor)}
        return out

    def remove(self) -> None:
        """Undo the sharding of the parameter groups (state of foreign parameters is not brought back)."""
        self._hook.remove()
        self.optimizer.zero_grad = self._zero_grad
        for group, full in zip(self.optimizer.param_groups, self.param_groups):
            group["params"] = list(full)
        setattr(self.optimizer, _ATTRIBUTE, None)


def shard_optimizer_state(optimizer: torch.optim.Optimizer, mesh) -> ShardedOptimizer:
    """ZeRO-1: shard ``optimizer``'s state over ``mesh``'s ``data_parallel`` axis in place (module docstring); the
    same optimizer when it already is."""
    existing = sharding_of(optimizer)
    return existing if existing is not None else ShardedOptimizer(optimizer, mesh)


def sharding_of(optimizer) -> ShardedOptimizer | None:
    """The :class:`ShardedOptimizer` of ``optimizer``, or ``None`` when its state is not sharded."""
    return getattr(optimizer, _ATTRIBUTE, None)


def full_param_groups(optimizer) -> list[list[torch.Tensor]]:
    """Every parameter group's full parameter list (also those another replica steps)."""
    sharding = sharding_of(optimizer)
    return sharding.param_groups if sharding is not None else [list(g["params"]) for g in optimizer.param_groups]


def clipped_parameters(optimizer, main_params) -> list[torch.Tensor]:
    """The parameters a gradient clip for ``optimizer`` must cover: with ZeRO every one (the optimizer steps a share,
    the norm is the whole model's), else ``main_params`` (the precision plugin's view of its parameters)."""
    sharding = sharding_of(optimizer)
    return list(main_params) if sharding is None else sharding.params


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of tensor state this rank's optimizer holds (local shards)."""
    return sum(_local(v).numel() * v.element_size() for state in optimizer.state.values()
               for v in state.values() if isinstance(v, torch.Tensor))

