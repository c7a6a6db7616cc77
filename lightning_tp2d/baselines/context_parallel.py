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
:func:`parallelize_cp` first applies :func:`~lightning_tp2d.baselines.tp1d.parallelize_1d` with sequence parallelism
over ``"tp"``; the attention then runs on its local heads, and CP and FSDP use the ``"cp"`` axis only.

Costs per rank and step (measured by :func:`measure_step`): FSDP's all-gathers (forward and backward) and
reduce-scatters of the parameters, the ring's K/V all-gathers and dK/dV permutes, two small all-reduces (the
8-byte target count and the 4-byte reported loss), and with ``cp-tp`` TP's all-gathers and reduce-scatters.
The same schedule, declared for the cost model (``"cp"`` rows of :func:`lightning_tp2d.planning.planner.price`):
:func:`~lightning_tp2d.planning.rivals.cp_comm_events` (equal on every rank to what :func:`measure_step` counts, ``tests/test_context_parallel.py``),
:func:`~lightning_tp2d.planning.rivals.cp_peak_bytes` (analytic) and :func:`~lightning_tp2d.planning.rivals.diagonal_share` (the ring steps' shares of the causal scores).
"""

from __future__ import annotations

import contextlib
import functools
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
from lightning_tp2d.bench.counting import count_local
from lightning_tp2d.planning.events import wire_factor
from lightning_tp2d.planning.live import LiveTensorBytes, resident_bytes
from lightning_tp2d.baselines.tp1d import _LossParallelInBackward, _loss_parallel_once, parallelize_1d
from lightning_tp2d.comm_record import recording
from lightning_tp2d.planning.rivals import CHUNK_TOKENS, LOSSES
from lightning_tp2d.models.llama import Llama, LlamaAttention

__all__ = ["chunked_cross_entropy", "cp_mesh_of", "cpu_ring_attention", "group_sizes", "init_cp_mesh", "mean_loss", "measure_step", "parallelize_cp", "sequence_loss", "sharded_sequence", "train_step", "SentBytes"]

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
    return count_local(torch_cp._templated_ring_attention, mesh.get_group(), SEQ_DIM, _FORWARD, query=query,
                       key=key, value=value, is_causal=is_causal, scale=scale)


def _ring_backward(mesh: DeviceMesh, grad_out, query, key, value, out, logsumexp, dropout_p: float,
                   is_causal: bool, *, attn_mask=None, scale=None) -> tuple[torch.Tensor, ...]:
    """The CPU backward's signature; torch's ring backward with the CPU backward kernel per block; ``(dq, dk, dv)``."""
    if dropout_p or attn_mask is not None:
        raise NotImplementedError("CPU context-parallel attention takes no dropout and no attn_mask")
    return count_local(
        torch_cp._templated_ring_attention_backward, mesh.get_group(), SEQ_DIM, _BACKWARD, grad_out=grad_out,
        grad_out_name="grad_out", query=query, key=key, value=value, out=out, logsumexp=logsumexp,
        is_causal=is_causal, dropout_p=dropout_p, scale=scale)


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


def parallelize_cp(model: Llama, mesh: DeviceMesh, *, float8: str | None = None,
                   fsdp_float8_all_gather: bool = False) -> Llama:
    """Shard ``model``'s weights with FSDP2 over the CP axis of ``mesh`` (each decoder layer, then the root:
    embedding, final norm, head), resharding after forward (ZeRO stage 3), as torchtitan does over
    ``dp_shard x cp``. On a 2-D ``("cp", "tp")`` mesh, 1-D TP + SP (:func:`~lightning_tp2d.baselines.tp1d.parallelize_1d`,
    torchtitan's Llama plan) over ``"tp"`` first, as torchtitan composes CP x TP. The sequence is sharded per step by
    :func:`sharded_sequence`. Refuses other models and dropout > 0 (torch's ring takes none). ``float8`` /
    ``fsdp_float8_all_gather``: the linears but the head converted by torchao first, FSDP2 gathering them as float8
    (tensorwise), as for :func:`~lightning_tp2d.baselines.tp1d.parallelize_1d` (each rank's activation scales are
    its own sequence shard's: torchao casts the local tensors it sees)."""
    if not isinstance(model, Llama):
        raise TypeError(f"parallelize_cp takes the package's Llama, got {type(model).__name__}")
    if model.config.dropout:
        raise ValueError(f"dropout={model.config.dropout}: torch's ring attention takes no dropout; use 0.0")
    if mesh.ndim == 2:
        parallelize_1d(model, mesh[TP_AXIS], sequence_parallel=True, float8=float8,
                       fsdp_float8_all_gather=fsdp_float8_all_gather)
    elif float8 is not None or fsdp_float8_all_gather:
        from lightning_tp2d.float8 import convert_plain  # torchao: imported only with a recipe

        convert_plain(model, float8, fsdp_float8_all_gather=fsdp_float8_all_gather)
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
    :class:`~lightning_tp2d.baselines.tp1d.TP1DLMHead` runs it); ``x`` is all-gathered to ``Replicate`` once first."""
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
    ring), each priced by :func:`~lightning_tp2d.planning.events.wire_factor`: an all-gather sends its input ``n-1``
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
    :class:`~lightning_tp2d.planning.live.LiveTensorBytes` with ``count_resizes`` (FSDP's gathered parameters);
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


