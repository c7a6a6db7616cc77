"""torch's own context parallelism (CP) as a long-context baseline, run for real on CPU gloo ranks.

What long-context users run (torchtitan's ``context_parallel`` x FSDP): the sequence sharded through every layer,
``F.scaled_dot_product_attention`` replaced inside :func:`torch.distributed.tensor.experimental.context_parallel`
by torch's ring attention (``_templated_ring_attention``: K/V rotated around the p ranks, blocks merged by their
log-sum-exp; causal load balancing by torch's head-tail balancer: rank r holds sequence chunks r and 2p-1-r of
2p), and the weights sharded by FSDP2 ``fully_shard`` over the same p ranks ("zero_stage=3").

**How it runs on CPU.** torch 2.13's CP maps only the CUDA fused kernels (flash, memory-efficient, cuDNN) to its
ring; on CPU SDPA calls ``aten._scaled_dot_product_flash_attention_for_cpu``, which has no DTensor sharding
strategy, so ``context_parallel`` fails with ``NotImplementedError``. :func:`cpu_ring_attention` adds, for the
duration of a block, exactly what torch has for the CUDA flash op and nothing else:

* a sharding strategy for the CPU op and its backward (all inputs and outputs ``Shard(2)``, the sequence dim, or
  all ``Replicate()``), installed with torch's own ``_op_strategy_context`` (restored on exit);
* a handler, the CPU twin of torch's ``_sdpa_handler``, in the table ``custom_ops`` that ``context_parallel`` merges
  into DTensor's dispatcher on entry (and drops on exit). It calls torch's ``_templated_ring_attention`` /
  ``_templated_ring_attention_backward`` with the CPU kernels as the block op. Only the argument conventions are
  adapted: the CPU forward returns ``(out, logsumexp)`` with a natural-log ``logsumexp`` of shape ``(B, H, T)``,
  the convention torch's merger (``_SDPAMerger``) reads from the CUDA flash op; its backward takes
  ``(grad_out, q, k, v, out, logsumexp, dropout_p, is_causal)`` and returns ``(dq, dk, dv)``. GQA needs nothing:
  the CPU kernel takes fewer K/V heads, and the ring rotates K/V as they are.

The ring schedule, the causal-block rule, the merge, the load balancer and all communication are torch's code
(K/V all-gathered once per attention forward and backward, the dK/dV partial sums passed on with
``all_to_all_single`` permutes); this module writes none of them.

**The model.** The package's plain :class:`~lightning_tp2d.models.Llama`, unchanged: :func:`parallelize_cp` shards
its weights with ``fully_shard`` (each block, then the root) over the 1-D CP mesh; :func:`sharded_sequence` passes
``idx``, ``targets`` and the absolute positions ``0 .. T-1`` to ``context_parallel`` as its buffers (sequence dims
1, 1, 0: torch shards them in place with the head-tail balancer, as torchtitan passes ``freqs_cis``), and a forward
pre-hook on each attention hands the local positions to :meth:`LlamaAttention.forward
<lightning_tp2d.models.llama.LlamaAttention.forward>`, so RoPE follows the sharded sequence. Each rank's loss is the
mean over its own tokens; :func:`sequence_loss` scales it by ``p * n_r / n`` (``n_r`` counted targets here, ``n``
in all), so FSDP's averaging reduce-scatter yields the gradient of the global mean exactly, however unevenly
``-100`` targets fall.

``cp-tp`` (torchtitan's CP x 1-D TP + SP): on a 2-D ``("cp", "tp")`` mesh from :func:`init_cp_mesh`,
:func:`parallelize_cp` first applies :func:`~lightning_tp2d.bench.tp1d.parallelize_1d` with sequence parallelism
over ``"tp"``; the attention then runs on its local heads, and CP and FSDP use the ``"cp"`` axis only.

Costs per rank and step (measured by :func:`measure_step`): FSDP's all-gathers (forward and backward) and
reduce-scatters of the parameters, the ring's K/V all-gathers and dK/dV permutes, two small all-reduces (the
8-byte target count and the 4-byte reported loss), and with ``cp-tp`` TP's all-gathers and reduce-scatters.
The same schedule, declared for the cost model (``"cp"`` rows of :func:`lightning_tp2d.bench.planner.price`):
:func:`cp_comm_events` (equal on every rank to what :func:`measure_step` counts, ``tests/test_context_parallel.py``),
:func:`cp_peak_bytes` (analytic) and :func:`diagonal_share` (the ring steps' shares of the causal scores).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp
from torch.distributed.tensor.experimental._context_parallel._sharding_rules import _op_strategy_context

from lightning_tp2d.bench.collectives import FunctionalCollectiveCounter
from lightning_tp2d.bench.events import Comm, float32_bytes, wire_factor
from lightning_tp2d.bench.measure import LiveTensorBytes, resident_bytes
from lightning_tp2d.bench.memory_model import (baseline_block_backward_bytes, baseline_peak_bytes,
                                               loss_forward_bytes, loss_input_bytes, parameter_split)
from lightning_tp2d.bench.tp1d import _LossParallelInBackward, _loss_parallel_once, local_shapes_1d, parallelize_1d
from lightning_tp2d.bench.tp1d_sp import recomputed_sp_events, tp1d_sp_comm_events
from lightning_tp2d.comm_record import recording
from lightning_tp2d.models.llama import Llama, LlamaAttention

__all__ = ["CHUNK_TOKENS", "LOSSES", "chunked_cross_entropy", "cp_comm_events", "cp_mesh_of", "cp_peak_bytes", "cpu_ring_attention", "diagonal_share",
           "fsdp_shard_elements", "group_sizes", "init_cp_mesh", "mean_loss", "measure_step", "parallelize_cp",
           "sequence_loss", "sharded_sequence", "train_step", "SentBytes"]

CP_AXIS, TP_AXIS = "cp", "tp"  # TP_AXIS: tp1d_sp.AXIS, the group of its events
SEQ_DIM = 2  # the sequence dim of SDPA's (B, H, T, hs) operands, the one torch's CP shards
_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


# ---- torch's ring attention with the CPU flash kernel --------------------------------------------------------------

def _forward_strategy(op_schema):
    """``[out, logsumexp, q, k, v]``: all sharded on the sequence (CP) or all replicated."""
    placements = [[Shard(SEQ_DIM)] * 5, [Replicate()] * 5]
    return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(), op_schema, placements, input_index=2)


def _backward_strategy(op_schema):
    """``[dq, dk, dv, grad_out, q, k, v, out, logsumexp]``: all sharded on the sequence or all replicated."""
    placements = [[Shard(SEQ_DIM)] * 9, [Replicate()] * 9]
    return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(validate=False), op_schema, placements,
                                           input_index=3)


def _ring_forward(mesh: DeviceMesh, query, key, value, dropout_p: float = 0.0, is_causal: bool = False, *,
                  attn_mask=None, scale=None) -> tuple[torch.Tensor, ...]:
    """The CPU op's signature, local shards in; torch's ring with the CPU kernel per block; ``(out, logsumexp)``."""
    if dropout_p or attn_mask is not None:
        raise NotImplementedError(f"CPU context-parallel attention takes no dropout (got {dropout_p}) and no "
                                  f"attn_mask (got {'a tensor' if attn_mask is not None else None}), as torch's ring")
    return torch_cp._templated_ring_attention(mesh.get_group(), SEQ_DIM, _FORWARD, query=query, key=key,
                                              value=value, is_causal=is_causal, scale=scale)


def _ring_backward(mesh: DeviceMesh, grad_out, query, key, value, out, logsumexp, dropout_p: float,
                   is_causal: bool, *, attn_mask=None, scale=None) -> tuple[torch.Tensor, ...]:
    """The CPU backward's signature; torch's ring backward with the CPU backward kernel per block; ``(dq, dk, dv)``."""
    if dropout_p or attn_mask is not None:
        raise NotImplementedError("CPU context-parallel attention takes no dropout and no attn_mask")
    return torch_cp._templated_ring_attention_backward(
        mesh.get_group(), SEQ_DIM, _BACKWARD, grad_out=grad_out, grad_out_name="grad_out", query=query, key=key,
        value=value, out=out, logsumexp=logsumexp, is_causal=is_causal, dropout_p=dropout_p, scale=scale)


_RING = {_FORWARD: _ring_forward, _BACKWARD: _ring_backward}


def _cpu_sdpa_handler(op_call, args, kwargs):
    """torch's ``_sdpa_handler`` for the CPU ops: propagate the sharding, run the ring on the local shards (or the
    kernel itself when everything is replicated), wrap the results in the propagated specs."""
    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    sharding = op_info.output_sharding
    if sharding is None or sharding.needs_redistribute:
        raise AssertionError(f"{op_call}: inputs must all be Shard({SEQ_DIM}) or all Replicate on one mesh")
    if all(isinstance(p, Replicate) for p in sharding.output_spec[0].placements):
        local = op_call(*op_info.local_args, **op_info.local_kwargs)
    else:
        local = _RING[op_call](op_info.compute_mesh, *op_info.local_args, **op_info.local_kwargs)
    return dispatcher.wrap(local, sharding.output_spec)


@contextlib.contextmanager
def cpu_ring_attention() -> Iterator[None]:
    """Within the block, torch's ``context_parallel`` also handles the CPU flash-attention op (module docstring).

    Enter it *before* ``context_parallel`` (which copies torch's handler table into DTensor's dispatcher when it is
    entered); on exit the strategies and the handlers are removed again (torch's own strategies are restored by
    ``_op_strategy_context``)."""
    if any(op in torch_cp.custom_ops for op in _RING):
        raise RuntimeError("cpu_ring_attention is already active (it does not nest)")
    with contextlib.ExitStack() as stack:
        stack.enter_context(_op_strategy_context(_FORWARD, _forward_strategy))
        stack.enter_context(_op_strategy_context(_BACKWARD, _backward_strategy))
        torch_cp.custom_ops.update(dict.fromkeys(_RING, _cpu_sdpa_handler))
        try:
            yield
        finally:
            for op in _RING:
                torch_cp.custom_ops.pop(op, None)


# ---- Llama under CP x FSDP -----------------------------------------------------------------------------------------

def init_cp_mesh(p: int, tp: int = 1, device_type: str = "cpu") -> DeviceMesh:
    """The mesh of ``p * tp`` ranks: 1-D, axis ``"cp"`` (the sequence and, by FSDP, the weights sharded over ``p``)
    when ``tp`` is 1, else 2-D ``("cp", "tp")`` for CP x 1-D TP + SP, the TP groups of ``tp`` adjacent ranks (as
    torchtitan orders its mesh)."""
    if tp == 1:
        return init_device_mesh(device_type, (p,), mesh_dim_names=(CP_AXIS,))
    return init_device_mesh(device_type, (p, tp), mesh_dim_names=(CP_AXIS, TP_AXIS))


def cp_mesh_of(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D CP axis of a mesh from :func:`init_cp_mesh`."""
    return mesh if mesh.ndim == 1 else mesh[CP_AXIS]


def _attentions(model: nn.Module) -> list[LlamaAttention]:
    return [m for m in model.modules() if isinstance(m, LlamaAttention)]


def parallelize_cp(model: Llama, mesh: DeviceMesh) -> Llama:
    """Shard ``model``'s weights with FSDP2 over the CP axis of ``mesh`` (each decoder layer, then the root:
    embedding, final norm, head), resharding after forward (ZeRO stage 3), as torchtitan does over
    ``dp_shard x cp``. On a 2-D ``("cp", "tp")`` mesh, 1-D TP + SP (:func:`~lightning_tp2d.bench.tp1d.parallelize_1d`,
    torchtitan's Llama plan) over ``"tp"`` first, as torchtitan composes CP x TP. The sequence is sharded per step by
    :func:`sharded_sequence`. Refuses other models and dropout > 0 (torch's ring takes none)."""
    if not isinstance(model, Llama):
        raise TypeError(f"parallelize_cp takes the package's Llama, got {type(model).__name__}")
    if model.config.dropout:
        raise ValueError(f"dropout={model.config.dropout}: torch's ring attention takes no dropout; use 0.0")
    if mesh.ndim == 2:
        parallelize_1d(model, mesh[TP_AXIS], sequence_parallel=True)
    cp_mesh = cp_mesh_of(mesh)
    for layer in model.model.layers:
        fully_shard(layer, mesh=cp_mesh, reshard_after_forward=True)
    fully_shard(model, mesh=cp_mesh, reshard_after_forward=True)
    return model


def _with_positions(positions: torch.Tensor, module, args, kwargs):
    return args, {**kwargs, "positions": positions}


@contextlib.contextmanager
def sharded_sequence(model: Llama, mesh: DeviceMesh, idx: torch.Tensor,
                     targets: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Run the block under torch's ``context_parallel`` (with :func:`cpu_ring_attention`) over the CP axis of
    ``mesh`` (``p`` ranks), yielding this rank's ``(idx, targets)`` shards ``(B, T/p)``: chunks ``r`` and ``2p-1-r``
    of ``2p`` (torch's head-tail balancer). The absolute positions are a CP buffer too, handed to every attention
    (RoPE); forward *and* backward must run in the block. ``idx`` / ``targets`` (the full ``(B, T)``, the same on
    every rank) are copied, not changed."""
    mesh = cp_mesh_of(mesh)
    p, T = mesh.size(), idx.size(1)
    if T % (2 * p):
        raise ValueError(f"sequence length {T} is not divisible by 2p = {2 * p}: torch's head-tail load balancer "
                         f"needs 2p equal chunks; use T in multiples of {2 * p}")
    idx, targets = idx.clone(), targets.clone()
    positions = torch.arange(T, device=idx.device)
    hooks = [a.register_forward_pre_hook(functools.partial(_with_positions, positions), with_kwargs=True)
             for a in _attentions(model)]
    buffers = [idx, targets, positions]
    try:
        with cpu_ring_attention(), context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1, 0],
                                                    no_restore_buffers=set(buffers)):
            yield idx, targets
    finally:
        for hook in hooks:
            hook.remove()


LOSSES = ("chunked", "unfused")
# tokens per chunk of the chunked loss: one chunk's float32 logits are 1024 x V x 4 bytes, 501 MiB for Llama 3's
# 128256-row vocabulary (Liger's fused linear cross-entropy takes about T / ceil(V / h) tokens, 1/32 of the sequence
# for Llama 3.1 8B; torchtune 8 chunks)
CHUNK_TOKENS = 1024
IGNORE_INDEX = -100


def _chunk_loss_sum(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of one chunk ``x [n, h]``: its logits ``x Wᵀ`` (upcast to float32 when in a half
    dtype, as torchtune does), their log-softmax and the target entries, ``-100`` ignored. Under ``loss_parallel``
    (``cp-tp``: vocab-sharded DTensor logits) torch's vocab-parallel log-softmax and gather."""
    logits = F.linear(x, weight)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def _chunk_loss_sum_tp(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    with _loss_parallel_once():
        return _chunk_loss_sum(x, weight, targets)


def chunked_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          chunk_tokens: int = CHUNK_TOKENS) -> torch.Tensor:
    """The *summed* next-token cross-entropy of the final norm's output ``x [..., h]`` under the head ``weight
    [V, h]`` against ``targets [...]`` (``-100`` ignored), computed over chunks of ``chunk_tokens`` tokens (of the
    flattened ``x``) as torchtune's chunked loss does: each chunk's logits and log-softmax inside
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, so the graph keeps only the chunk's input (a view
    of ``x``) and the backward recomputes its logits (one more head matmul per chunk) just before their gradient.
    No ``[tokens, V]`` tensor exists; at most one chunk's logits, log-softmax and their gradients at a time. Divide
    by the counted targets for the mean (:func:`sequence_loss`).

    ``weight`` a DTensor (``cp-tp``: vocab ``Shard(0)`` over the TP axis, ``x`` then a DTensor too): the chunks'
    losses are torch's ``loss_parallel`` ones (its backward run in that context as
    :class:`~lightning_tp2d.bench.tp1d.TP1DLMHead` runs it); ``x`` is all-gathered to ``Replicate`` once first."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive number of tokens, got {chunk_tokens}")
    tensor_parallel = isinstance(weight, DTensor)
    if tensor_parallel:
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, weight.device_mesh, [Replicate()], run_check=False)
        elif x.placements != (Replicate(),):
            x = x.redistribute(x.device_mesh, [Replicate()])
    x, targets = x.reshape(-1, x.size(-1)), targets.reshape(-1)
    total = None
    for start in range(0, x.size(0), chunk_tokens):
        end = start + chunk_tokens
        part = torch.utils.checkpoint.checkpoint(_chunk_loss_sum_tp if tensor_parallel else _chunk_loss_sum,
                                                 x[start:end], weight, targets[start:end], use_reentrant=False)
        if tensor_parallel:
            _LossParallelInBackward(part)
        total = part if total is None else total + part
    return total.to_local() if tensor_parallel else total


@contextlib.contextmanager
def _head_computes(head: nn.Module, forward) -> Iterator[None]:
    """Within the block ``head(x, targets)`` calls ``forward(head, x, targets)`` instead of its own forward (an
    instance attribute, removed on exit): the model's forward, and so FSDP's hooks on it, run as they are."""
    if "forward" in vars(head):
        raise RuntimeError("the head's forward is already replaced (the chunked loss does not nest)")
    head.forward = functools.partial(forward, head)
    try:
        yield
    finally:
        del head.forward


def sequence_loss(model: Llama, mesh: DeviceMesh, idx: torch.Tensor, targets: torch.Tensor, *,
                  loss: str = "chunked", chunk_tokens: int = CHUNK_TOKENS) -> torch.Tensor:
    """This rank's mean loss over its shard times ``p * n_r / n`` (module docstring): the mean of the returned
    values over the ranks is the global mean loss, and FSDP's averaged gradients are its gradients. One all-reduce
    of the 8-byte count.

    ``loss="chunked"`` (default: what CP's users run, torchtune's chunked loss, Liger's fused linear
    cross-entropy): the head and the loss over chunks of ``chunk_tokens`` tokens
    (:func:`chunked_cross_entropy`), their sum divided by ``n / p``; no ``[T/p, V]`` logits. ``"unfused"``: the
    model's own head and ``F.cross_entropy`` on the full-vocabulary ``[T/p, V]`` logits (every rank's shard then
    needs one target that is not ``-100``), the earlier baseline's numbers."""
    if loss not in LOSSES:
        raise ValueError(f"loss={loss!r} is not one of {LOSSES}")
    mesh = cp_mesh_of(mesh)
    counted = (targets != IGNORE_INDEX).sum()
    total = counted.clone()
    dist.all_reduce(total, group=mesh.get_group())
    if loss == "unfused":
        return model(idx, targets) * (counted * mesh.size() / total)

    def chunked(head, x, targets):
        return chunked_cross_entropy(x, head.weight, targets, chunk_tokens)

    with _head_computes(model.lm_head, chunked):
        summed = model(idx, targets)
    return summed * (mesh.size() / total)


def train_step(model: Llama, optimizer: torch.optim.Optimizer, mesh: DeviceMesh, idx: torch.Tensor,
               targets: torch.Tensor, *, loss: str = "chunked", chunk_tokens: int = CHUNK_TOKENS) -> torch.Tensor:
    """One step of CP x FSDP on the full ``(B, T)`` batch (the same on every rank): zero_grad, forward and backward
    on this rank's sequence shard (:func:`sequence_loss`, ``loss`` and ``chunk_tokens`` passed on), the optimizer
    step. Returns the global mean loss (an all-reduce of 4 bytes)."""
    optimizer.zero_grad(set_to_none=True)
    with sharded_sequence(model, mesh, idx, targets) as (idx_here, targets_here):
        loss = sequence_loss(model, mesh, idx_here, targets_here, loss=loss, chunk_tokens=chunk_tokens)
        loss.backward()
    optimizer.step()
    return mean_loss(loss, mesh)


def mean_loss(loss: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The global mean loss from each rank's :func:`sequence_loss` (detached): their mean over the CP axis, one
    all-reduce of 4 bytes."""
    loss, mesh = loss.detach().clone(), cp_mesh_of(mesh)
    dist.all_reduce(loss, group=mesh.get_group())
    return loss / mesh.size()


# ---- what one step costs on this rank ------------------------------------------------------------------------------

def group_sizes(mesh: DeviceMesh) -> dict[str, int]:
    """Process group name -> size for each axis of ``mesh`` (what :class:`SentBytes` prices functional
    collectives by when the axes differ in size, as ``cp-tp``'s)."""
    return {mesh.get_group(dim).group_name: mesh.size(dim) for dim in range(mesh.ndim)}


class SentBytes:
    """Bytes this rank sends, from the calls :mod:`lightning_tp2d.comm_record` announces (``comm.py``'s and FSDP's
    ``torch.distributed`` collectives) and those of a :class:`FunctionalCollectiveCounter` (DTensor's and torch's
    ring), each priced by :func:`~lightning_tp2d.bench.events.wire_factor`: an all-gather sends its input ``n-1``
    times, a reduce-scatter ``(n-1)/n`` of its input, a permute (``all_to_all_single`` routing the whole input to
    one peer, what torch's ring sends dK/dV with) its input once. ``group_size``: the size of every functional
    collective's group, or a map from process group name to size (:func:`group_sizes`)."""

    def __init__(self, group_size: int | dict[str, int]) -> None:
        self.group_size = group_size  # of the functional collectives, which the counter records by group name
        self.direct = 0.0

    def posted(self, call) -> None:
        self.direct += call.nbytes * wire_factor(call.kind, len(call.ranks))

    def waited(self, call) -> None:
        pass

    def _size(self, group_name: str) -> int:
        if isinstance(self.group_size, int):
            return self.group_size
        if group_name not in self.group_size:
            raise RuntimeError(f"a functional collective on process group {group_name!r}, not one of the mesh's "
                               f"{sorted(self.group_size)}: no size to price it by")
        return self.group_size[group_name]

    def total(self, counter: FunctionalCollectiveCounter) -> int:
        functional = sum(nbytes * wire_factor(kind, self._size(group)) for (kind, group), nbytes in
                         counter.by_group.items())
        permuted = sum(nbytes for op, nbytes in counter.uncounted if "all_to_all_single" in op)
        others = [op for op, _ in counter.uncounted if "all_to_all_single" not in op]
        if others:
            raise RuntimeError(f"uncounted point-to-point collectives {others}: no rule for their bytes here")
        return round(self.direct + functional + permuted)


def measure_step(step, model: nn.Module, optimizer: torch.optim.Optimizer,
                 group_size: int | DeviceMesh, repeats: int = 1) -> dict:
    """Peak bytes and bytes sent by this rank in one call of ``step()`` (a whole training step that zeroes the
    gradients first), after a warm-up call (optimizer state and FSDP's lazy init then exist): ``peak_bytes`` is the
    resident bytes (parameter shards, optimizer state) plus the peak of
    :class:`~lightning_tp2d.bench.measure.LiveTensorBytes` with ``count_resizes`` (FSDP's gathered parameters);
    ``sent_bytes`` by :class:`SentBytes` (the first measured step's), ``group_size`` the size of the functional
    collectives' group, or the mesh whose axes they run on. ``repeats``: measured steps; ``peak_bytes`` is the highest
    of their peaks (the worst case a cap must hold) and ``peaks`` lists them all. On gloo the peak moves by a few
    buffers from step to step (when the asynchronous collectives' outputs are waited for and freed depends on the
    other ranks' timing), so a comparison of one schedule with another reads their medians."""
    step()
    sizes = group_sizes(group_size) if isinstance(group_size, DeviceMesh) else group_size
    peaks, sent_bytes = [], None
    for _ in range(max(1, repeats)):
        optimizer.zero_grad(set_to_none=True)
        before = resident_bytes(model, optimizer)
        sent, counter = SentBytes(sizes), FunctionalCollectiveCounter(strict=False)
        tracker = LiveTensorBytes(record_shapes=False, count_resizes=True)
        with recording(sent), counter, tracker:
            step()
        peaks.append(before + tracker.peak)
        sent_bytes = sent.total(counter) if sent_bytes is None else sent_bytes
    return {"peak_bytes": max(peaks), "peaks": peaks, "sent_bytes": sent_bytes}


# ---- what one step sends and holds, declared (the cost model's "cp" rows) -----------------------------------------
# Not traced: torch's ring and FSDP2's schedule as read from their code (torch 2.13), written out once here and
# checked against the bytes a real step counts (tests/test_context_parallel.py).

RING_AXIS, FSDP_AXIS = "cp", "data_parallel"  # the ring's group; FSDP's (the same ranks when dp is 1)
_SCORE_FLOPS = {"forward": 4, "backward": 10}  # per visible score and head channel (the cost model's convention)


def _shards(shapes, world: int) -> int:
    """Elements of one rank's FSDP2 shard of parameters of these ``shapes``: each one's dim 0 padded to a multiple
    of ``world``."""
    return sum(-(-shape[0] // world) * math.prod(shape[1:]) for shape in shapes)


def fsdp_shard_elements(cfg, world: int, tp: int = 1) -> tuple[int, int]:
    """``(root, block)``: elements of one rank's FSDP2 shard of the root group (embedding, final norm, head) and
    of one decoder layer, sharded over ``world`` ranks (counted on the meta device). ``tp`` > 1 (``cp-tp``): FSDP2
    cuts each parameter's 1-D TP shard (:func:`~lightning_tp2d.bench.tp1d.local_shapes_1d`, tensor rank 0's: the
    largest where the vocabulary does not divide)."""
    with torch.device("meta"):
        model = Llama(dataclasses.replace(cfg, n_layer=1))
    shapes = local_shapes_1d(model, tp)
    in_layer = {f"model.layers.0.{name}" for name, _ in model.model.layers[0].named_parameters()}
    return (_shards([v for k, v in shapes.items() if k not in in_layer], world),
            _shards([v for k, v in shapes.items() if k in in_layer], world))


def _kv_width(cfg) -> int:
    return cfg.n_kv_head * (cfg.n_embd // cfg.n_head)


def diagonal_share(seq: int, p: int) -> tuple[float, float]:
    """``(diagonal, off-diagonal)``: the fraction of one rank's visible causal scores in the ring's first step (its
    own two chunks, ``c (2c + 1)`` scores for ``c = seq / (2p)``) and in each of the other ``p - 1`` (``2c²``: the
    head-tail balancer's half blocks); ``diagonal + (p - 1) * off-diagonal == 1``."""
    c = seq // (2 * p)
    total = c * (2 * c + 1) + (p - 1) * 2 * c * c
    return c * (2 * c + 1) / total, 2 * c * c / total


def _chunks(tokens: int, chunk_tokens: int) -> dict[int, int]:
    """Chunk size -> how many chunks of it :func:`chunked_cross_entropy` cuts ``tokens`` tokens into."""
    full, rest = divmod(tokens, chunk_tokens)
    return {size: n for size, n in ((chunk_tokens, full), (rest, 1)) if n and size}


def _check_loss(loss: str, chunk_tokens: int) -> None:
    if loss not in LOSSES or chunk_tokens < 1:
        raise ValueError(f"loss={loss!r} must be one of {LOSSES} and chunk_tokens={chunk_tokens} positive")


def cp_comm_events(cfg, batch: int, seq: int, p: int, elem: int = 2, *, dp: int = 1,
                   checkpointing: str = "none", tp: int = 1, async_tp: bool = False, loss: str = "chunked",
                   chunk_tokens: int = CHUNK_TOKENS) -> list[Comm]:
    """The communication of one :func:`train_step` on one rank: CP over ``p`` ranks x FSDP2 over ``p * dp``
    (torchtitan shards the weights over ``dp_shard x cp``), and with ``tp`` > 1 (``cp-tp``) 1-D TP + SP over ``tp``
    ranks inside each CP rank. ``elem``: the activations' and gathered weights' bytes (4: float32, as the CPU runs;
    2: torchtitan's FSDP ``param_dtype`` bf16); gradients are reduced in float32.

    * FSDP (axis ``"data_parallel"``; :func:`fsdp_shard_elements`, ``S_root`` / ``S_block`` per rank, of the TP
      shards when ``tp`` > 1): forward all-gathers of the root's and each block's shard (``elem`` bytes each),
      backward all-gathers of each again (:func:`parallelize_cp` reshards the root after forward too),
      reduce-scatters of the root's and each block's float32 gradients (payload ``p dp S``).
    * torch's ring (axis ``"cp"``) per layer, ``kv = 2 B (T/p) n_kv hs elem / tp`` (the local K and V of this
      rank's key/value heads, concatenated): one all-gather in the forward (posted at ring step 0, waited at step 1:
      it runs behind the diagonal block's attention, ``overlap_flops``), one in the backward (behind the diagonal
      block's backward kernel), with ``"full"`` checkpointing one more for the recomputed forward; ``p`` permutes of
      the float32 dK/dV partial sums (``all_to_all_single`` to the next rank, kind ``"send"``,
      ``2 B (T/p) n_kv hs 4 / tp`` bytes): the one posted at step ``i`` runs behind step ``i + 1``'s backward
      kernel, the last behind nothing.
    * ``tp`` > 1: 1-D TP + SP's calls on this CP rank's ``T/p`` tokens (axis ``"tp"``,
      :func:`~lightning_tp2d.bench.tp1d_sp.tp1d_sp_comm_events` with its activations in ``elem`` as FSDP's
      ``param_dtype`` runs them, and :func:`~lightning_tp2d.bench.tp1d_sp.recomputed_sp_events` for
      ``checkpointing``); ``async_tp``: they carry the FLOPs of the matmul torch's async TP fuses them with.
      With the chunked loss (``loss="chunked"``, :func:`chunked_cross_entropy`) the backward recomputes each
      chunk's ``loss_parallel`` forward: its three all-reduces of the chunk's float32 ``[n, 1]`` rows again.
    * :func:`sequence_loss`'s 8-byte target count and :func:`mean_loss`'s 4-byte loss, all-reduced over ``"cp"``.

    FLOPs behind the ring are attention FLOPs (``4`` / ``10`` per visible score and channel, forward / backward)."""
    if seq % (2 * p):
        raise ValueError(f"sequence length {seq} is not divisible by 2p = {2 * p} (torch's head-tail balancer)")
    _check_loss(loss, chunk_tokens)
    if tp < 1 or cfg.n_kv_head % tp or cfg.n_head % tp:
        raise ValueError(f"cp-tp: n_head={cfg.n_head} and n_kv_head={cfg.n_kv_head} must divide by tp={tp}")
    world, L, tokens = p * dp, cfg.n_layer, batch * seq // p
    root, block = fsdp_shard_elements(cfg, world, tp)
    grad = float32_bytes(elem)
    kv = 2 * tokens * _kv_width(cfg) // tp
    diagonal, off = diagonal_share(seq, p)
    scores = batch * cfg.n_embd / tp * (seq * (seq + 1) // 2) / p  # one layer's visible scores x channels, per rank
    fwd, bwd = (_SCORE_FLOPS[k] * scores for k in ("forward", "backward"))
    gathers = 2 if checkpointing == "full" else 1  # forward all-gathers per layer in the backward phase
    events = [Comm("all_gather", FSDP_AXIS, world, elem * root, 1),
              Comm("all_gather", FSDP_AXIS, world, elem * block, L),
              Comm("all_gather", FSDP_AXIS, world, elem * block, L, phase="backward"),
              Comm("all_gather", FSDP_AXIS, world, elem * root, 1, phase="backward"),
              Comm("reduce_scatter", FSDP_AXIS, world, grad * world * block, L, phase="backward"),
              Comm("reduce_scatter", FSDP_AXIS, world, grad * world * root, 1, phase="backward"),
              Comm("all_gather", RING_AXIS, p, elem * kv, L, diagonal * fwd),
              Comm("all_gather", RING_AXIS, p, elem * kv, L * (gathers - 1), diagonal * fwd, "backward"),
              Comm("all_gather", RING_AXIS, p, elem * kv, L, diagonal * bwd, "backward"),
              Comm("send", RING_AXIS, p, grad * kv, L * (p - 1), off * bwd, "backward"),
              Comm("send", RING_AXIS, p, grad * kv, L, 0.0, "backward"),
              Comm("all_reduce", RING_AXIS, p, 8, 1), Comm("all_reduce", RING_AXIS, p, 4, 1, phase="backward")]
    if tp > 1:
        kw = dict(batch=batch, seq=seq // p, p=tp, elem=elem, async_tp=async_tp, lean_wire=True)
        inside = tp1d_sp_comm_events(cfg, **kw)
        events += inside + recomputed_sp_events(cfg, inside, checkpointing, **kw)
        if loss == "chunked":  # each chunk's loss_parallel forward recomputed in the backward: 3 [n, 1] all-reduces
            events += [Comm("all_reduce", TP_AXIS, tp, 4 * n, 3 * calls, phase="backward")
                       for n, calls in _chunks(tokens, chunk_tokens).items()]
    return [ev for ev in events if ev.calls and ev.group_size > 1]


def cp_peak_bytes(cfg, batch: int, seq: int, p: int, *, dp: int = 1, checkpointing: str = "none",
                  elem: int = 2, tp: int = 1, loss: str = "chunked", chunk_tokens: int = CHUNK_TOKENS) -> dict:
    """Predicted peak bytes per GPU of CP over ``p`` x FSDP2 (stage 3) over ``p * dp`` ranks, bf16 compute
    (FSDP ``param_dtype``), float32 parameters, gradients and AdamW moments: the parts of
    :func:`~lightning_tp2d.bench.memory_model.baseline_peak_bytes` for plain FSDP over ``p * dp`` ranks on this
    rank's ``T/p`` tokens (every layer sees ``T/p`` tokens; attention saves its local q, k, v, output and
    log-sum-exp), plus the ring's transients ``ring``: in the forward the gathered K/V (``2 B T n_kv hs e``), the
    local K/V it was gathered from and the merger's float32 output and log-sum-exp; in the backward the gathered
    K/V, the float32 dQ/dK/dV accumulators, one step's ``e``-byte block gradients and two float32 dK/dV permute
    buffers; and the loss's, ``loss``, the largest it adds to what is held:

    * ``loss="chunked"`` (:func:`chunked_cross_entropy`, the default; ``c = min(chunk_tokens, B T/p)`` tokens a
      chunk, ``v = ceil(V/tp)`` local vocabulary rows): nothing of the loss is saved but the chunks' inputs (views of
      the final norm's output, already counted), so the activations are plain FSDP's less its saved
      ``4 (B T/p) v`` log-softmax. One chunk at a time: its forward (and its recomputation in the backward)
      :func:`~lightning_tp2d.bench.memory_model.loss_forward_bytes` per element of ``[c, v]``; its backward the
      recomputed float32 log-softmax, its gradient and its input's gradient (``12 c v``), then the logits' gradient
      cast to ``e`` beside the float32 one and the chunk's ``[v, h]`` head gradient (``e v h``), with, from the
      second chunk on, the head gradient accumulated so far (another ``e v h``).
    * ``loss="unfused"`` (the model's head and ``F.cross_entropy`` on the ``[B T/p, v]`` logits; the earlier
      numbers): the activations hold the ``T/p`` rows' float32 log-softmax, and the loss adds the float32 gradient of
      the ``T/p x v`` logits when the backward starts (what a fused or compiled cross-entropy holds; eager's
      separate ``nll_loss`` gradient would add as much again), before any parameter gradient exists; plain FSDP's
      own peak on ``T/p`` tokens is ``baseline_peak_bytes``'s total.

    ``total``: the largest of the phases in ``phases`` (name -> its parts, name -> bytes): plain FSDP's peak on
    ``T/p`` tokens (unfused: ``baseline_peak_bytes``'s total; chunked: its block backward, the loss's forward and
    backward and the end of the step, with the chunked loss), the ring's forward on top of the activations and
    gathered groups, and the last block's backward (those, the gradients, FSDP's unsharded block gradients in ``e``
    and float32, the ring's backward transients). ``peak_at``: the phase at the peak; ``largest``: the largest part
    there. ``tp`` > 1 (``cp-tp``): the 1-D TP + SP baseline's parts over ``tp`` ranks on the ``T/p`` tokens instead
    of plain FSDP's, and the ring's heads, the loss's vocabulary and the unsharded block ``1 / tp`` of each.
    Analytic; not checked against a GPU."""
    _check_loss(loss, chunk_tokens)
    world = p * dp
    parts = baseline_peak_bytes(cfg, batch, seq // p, tp, dp=world, zero_stage=3, checkpointing=checkpointing,
                                elem=elem)
    tokens, kv, h, heads = batch * seq // p, _kv_width(cfg) // tp, cfg.n_embd // tp, cfg.n_head // tp
    vocab = -(-cfg.vocab_size // tp)
    gathered_kv = 2 * batch * seq * kv * elem
    forward = gathered_kv + 2 * tokens * kv * elem + tokens * (h + heads) * 4
    backward = gathered_kv + tokens * (h + 2 * kv) * (4 + elem) + 2 * 2 * tokens * kv * 4
    ring = {"ring": int(max(forward, backward))}
    resident = {"parameters": parts["parameters"], "optimizer": parts["optimizer"]}
    # the last block's backward: FSDP's unsharded block gradients before their reduce-scatter (bf16 and their float32
    # copy)
    unsharded = (elem + 4) * parameter_split(cfg).block_shard(tp)
    if loss == "unfused":
        loss_bytes = 4 * tokens * vocab
        activations = parts["activations"]
        logsoftmax = loss_input_bytes(elem, False) * tokens * vocab  # saved: among plain FSDP's activations
        rest = parts["total"] - parts["parameters"] - parts["optimizer"] - activations
        plain = {"plain FSDP": {**resident, "activations": activations - logsoftmax, "log-softmax": logsoftmax,
                                "loss, gathered and transients": rest}}
    else:
        split = parameter_split(cfg)
        c = min(chunk_tokens, tokens)
        logsoftmax = loss_input_bytes(elem, False) * tokens * vocab  # what plain FSDP's activations save
        activations = parts["activations"] - logsoftmax
        head_grad = elem * vocab * cfg.n_embd  # one chunk's [v, h] head gradient (and the accumulated one)
        accumulated = head_grad if tokens > c else 0
        chunk_forward = loss_forward_bytes(elem, elem, False) * c * vocab
        chunk_backward = accumulated + max(chunk_forward, 12 * c * vocab,
                                           (4 + (elem if elem < 4 else 0)) * c * vocab + head_grad)
        loss_bytes = max(chunk_forward, chunk_backward)
        # FSDP's flat all-gather output of the root group, kept until the next all-gather (baseline's last_gather)
        last_gather = parts["loss_forward"] - (loss_forward_bytes(elem, elem, False)
                                               - loss_input_bytes(elem, False)) * tokens * vocab
        at_loss = elem * (split.root_shard(tp) - split.embedding / tp)  # the root's groups gathered, not the blocks
        in_block = baseline_block_backward_bytes(cfg, batch, seq // p, tp, dp=world, zero_stage=3,
                                                 checkpointing=checkpointing, elem=elem)
        end = parts["gradients"] + parts["gathered"] + elem * cfg.vocab_size * cfg.n_embd
        plain = {"loss forward": {**resident, "activations": activations, "gathered": at_loss,
                                  "loss": chunk_forward, "last gather": last_gather},
                 "loss backward": {**resident, "activations": activations, "gathered": parts["gathered"],
                                   "loss": chunk_backward},
                 "block backward (plain FSDP)": {**resident, "activations": activations,
                                                 "gathered": parts["gathered"], "block backward": in_block},
                 "end of backward": {**resident, "gradients": end}}
    held = {"activations": activations, "gathered": parts["gathered"]}
    phases = {**plain,
              "ring forward": {**resident, **held, "ring": forward},
              "last block backward": {**resident, **held, "gradients": parts["gradients"],
                                      "unsharded block gradients": unsharded, "ring": backward}}
    phases = {name: {k: int(v) for k, v in terms.items()} for name, terms in phases.items()}
    peak_at = max(phases, key=lambda name: sum(phases[name].values()))
    largest = max(phases[peak_at], key=phases[peak_at].get)
    out = {**parts, "activations": int(activations), **ring, "loss": int(loss_bytes),
           "total": sum(phases[peak_at].values()), "peak_at": peak_at, "largest": largest, "phases": phases}
    return out
