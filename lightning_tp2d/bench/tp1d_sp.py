"""1-D tensor parallelism *with sequence parallelism*: the fair baseline (docs/layouts.md, the fair baseline),
PyTorch's own styles applied to our GPT-2 and Llama the way torchtitan applies them to Llama (``apply_tp``). Build it
with ``parallelize_1d(model, mesh, sequence_parallel=True)``; this module holds the plan and its communication.

Between blocks the residual stream is this rank's sequence shard, a plain ``[B, T/p, h]``; only the
column-parallel inputs are gathered to the full sequence, and the row-parallel outputs are reduce-scattered back
(Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"). Per submodule:

* ``transformer.wte``: ``RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))``: masked vocab-row
  lookup, then a reduce-scatter of ``[B, T, h]`` to sequence shards (backward: all-gather of the shard gradients).
* ``transformer.wpe``: ``PrepareModuleOutput(Replicate() -> Shard(0))``: every rank looks up all ``T`` positions
  (no communication) and keeps its ``T/p`` rows; backward all-gathers the ``[T/p, h]`` gradients so the plain
  ``wpe`` weight gets the same full gradient on every rank.
* ``ln_1``, ``ln_2``, ``ln_f``: ``SequenceParallel()``: LayerNorm of the local ``[B, T/p, h]``; weights are
  Replicate DTensors whose gradients (Partial over the sequence shards) are all-reduced together, once per
  backward (:func:`reduce_norm_grads`).
* ``attn.c_attn``, ``mlp.c_fc``: ``ColwiseParallel(input_layouts=Shard(1))``: all-gather of the LayerNorm output
  to ``[B, T, h]`` (backward: reduce-scatter of its gradient); c_attn rows regrouped as in tp1d and the attention
  runs ``n_head/p`` local heads (:class:`~lightning_tp2d.bench.tp1d.TP1DAttention`).
* ``attn.c_proj``, ``mlp.c_proj``: ``RowwiseParallel(output_layouts=Shard(1))``: the Partial ``[B, T, h]`` is
  reduce-scattered to ``[B, T/p, h]`` (backward: all-gather of the gradient).
* ``lm_head``: :class:`~lightning_tp2d.bench.tp1d.TP1DLMHead` all-gathers the ``ln_f`` output (backward:
  reduce-scatter) and projects onto the vocab-sharded tied weight; the loss is ``loss_parallel``, as in tp1d.

Llama (``model.*``), torchtitan's ``parallelize_llama`` plan: ``embed_tokens`` as ``wte``; ``input_layernorm``,
``post_attention_layernorm``, ``norm``: ``SequenceParallel()``; ``self_attn`` and ``mlp``:
``PrepareModuleInput(Shard(1) -> Replicate())``, one all-gather of the norm output shared by ``q/k/v_proj`` (and by
``gate/up_proj``), each ``ColwiseParallel()``, so the attention runs ``n_head/p`` query heads on ``n_kv_head/p``
key/value heads unchanged; ``o_proj``, ``down_proj``: ``RowwiseParallel(output_layouts=Shard(1))``; ``lm_head`` as
above, tied to ``embed_tokens`` or an untied weight sharded on vocab rows the same way.

Dropout must be 0 as in tp1d (the check is shared), and the residual adds and dropouts run on plain local
sequence shards, so no ``SequenceParallel`` wrapper is needed around them (with dropout 0 it would only add
DTensor conversions). The sequence length must divide by ``p`` (:func:`check_sequence_parallel`; checked on every
forward, before any communication).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleOutput, RowwiseParallel,
                                               SequenceParallel)

from lightning_tp2d.bench.events import Comm, float32_bytes
from lightning_tp2d.families import family_of
from lightning_tp2d.models.gpt2 import GPT2Config
from lightning_tp2d.models.llama import LlamaConfig

__all__ = ["check_sequence_parallel", "sp_plan", "block_linears", "reduce_norm_grads", "tp1d_sp_comm_events",
           "recomputed_sp_events", "init_tp_dp_mesh", "shard_1d_data_parallel"]

AXIS = "tp"


def check_sequence_parallel(seq: int, p: int) -> None:
    """Raise ``ValueError`` naming the numbers unless the sequence length ``seq`` splits evenly over ``p`` ranks."""
    if seq % p:
        fits = [k for k in range(1, p + 1) if seq % k == 0]
        raise ValueError(f"1-D tensor parallelism with sequence parallelism: sequence length T={seq} is not divisible "
                         f"by p={p}; use T a multiple of {p} (or p in {fits})")


def sp_plan(n_layer: int) -> dict:
    """The ``parallelize_module`` plan, keyed by submodule name."""
    plan = {
        "transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "transformer.wpe": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0)),
        "transformer.ln_f": SequenceParallel(),
    }
    for i in range(n_layer):
        prefix = f"transformer.h.{i}"
        plan[f"{prefix}.ln_1"] = SequenceParallel()
        plan[f"{prefix}.attn.c_attn"] = ColwiseParallel(input_layouts=Shard(1))
        plan[f"{prefix}.attn.c_proj"] = RowwiseParallel(output_layouts=Shard(1))
        plan[f"{prefix}.ln_2"] = SequenceParallel()
        plan[f"{prefix}.mlp.c_fc"] = ColwiseParallel(input_layouts=Shard(1))
        plan[f"{prefix}.mlp.c_proj"] = RowwiseParallel(output_layouts=Shard(1))
    return plan


def block_linears(cfg) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The ``(out, in)`` weight shapes of one block's linears, in four groups: those reading the attention input,
    the attention output projection, those reading the MLP input, the MLP output projection. GPT-2: ``c_attn``
    ``[3h, h]``, ``c_proj`` ``[h, h]``, ``c_fc`` ``[4h, h]``, ``mlp.c_proj`` ``[h, 4h]``. Llama (a config with
    ``n_kv_head`` and ``intermediate_size``): ``q_proj`` ``[h, h]``, ``k_proj`` and ``v_proj`` ``[nkv*hs, h]`` (GQA),
    ``o_proj`` ``[h, h]``, ``gate_proj`` and ``up_proj`` ``[I, h]``, ``down_proj`` ``[h, I]``."""
    h = cfg.n_embd
    if not hasattr(cfg, "intermediate_size"):
        return ((3 * h, h),), ((h, h),), ((4 * h, h),), ((h, 4 * h),)
    kv, width = cfg.n_kv_head * (h // cfg.n_head), cfg.intermediate_size
    return ((h, h), (kv, h), (kv, h)), ((h, h),), ((width, h), (width, h)), ((h, width),)


def check_input_hook(p: int):
    """A forward pre-hook for the model: the sequence length of ``idx`` must divide by ``p``."""

    def hook(module, args, kwargs):
        idx = args[0] if args else kwargs["idx"]
        check_sequence_parallel(idx.size(1), p)

    return hook


class _NormGradReducer:
    """Turns the Partial gradients of the norm weights (LayerNorm or RMSNorm: each rank's sum over its own
    sequence shard) into Replicate ones with **one** all-reduce per backward: a post-accumulate-grad hook on each
    parameter collects them; when the last one arrives, their local values are concatenated into one flat buffer,
    all-reduced (``Partial -> Replicate``) and split back. Left Partial, every optimizer op that reads such a gradient would
    all-reduce it again, and ``2 (2L + 1)`` separate ``[h]`` all-reduces would pay the latency ``2 (2L + 1)`` times.

    Always correct, not always one call: a backward that does not reach every LayerNorm parameter leaves its
    gradients Partial (``full_tensor()`` and DTensor ops reduce them where used) and the flush then comes early in a
    later backward; gradients accumulated into existing Replicate ones (no ``zero_grad`` between backwards) are
    reduced by DTensor's in-place add, one all-reduce per parameter. The measured step (fresh gradients, one
    backward through the loss) makes exactly the one call."""

    def __init__(self, params: list[nn.Parameter], mesh: DeviceMesh):
        self.params, self.mesh, self.ready = params, mesh, set()
        for q in params:
            q.register_post_accumulate_grad_hook(self._arrived)

    def _arrived(self, param: nn.Parameter) -> None:
        self.ready.add(id(param))
        if len(self.ready) < len(self.params):
            return
        self.ready.clear()
        partial = [q for q in self.params if isinstance(q.grad, DTensor) and q.grad.placements[0].is_partial()]
        if not partial:
            return
        with torch.no_grad():
            flat = torch.cat([q.grad.to_local().reshape(-1) for q in partial])
            flat = DTensor.from_local(flat, self.mesh, [Partial()], run_check=False)
            flat = flat.redistribute(self.mesh, [Replicate()]).to_local()
            for q, g in zip(partial, flat.split([q.numel() for q in partial])):
                q.grad = DTensor.from_local(g.view(q.shape), self.mesh, [Replicate()], run_check=False)


def reduce_norm_grads(model: nn.Module, mesh: DeviceMesh, plan: dict) -> None:
    """Install :class:`_NormGradReducer` on the parameters of the modules ``plan`` makes ``SequenceParallel``
    (GPT-2's LayerNorms, Llama's RMSNorms)."""
    params = [q for name, style in plan.items() if isinstance(style, SequenceParallel)
              for q in model.get_submodule(name).parameters()]
    if params:
        _NormGradReducer(params, mesh)


def tp1d_sp_comm_events(cfg: GPT2Config, batch: int, seq: int, p: int, elem: int,
                        async_tp: bool = False, lean_wire: bool = False) -> list[Comm]:
    """The communication one rank performs for one training step ``loss = model(idx, targets); loss.backward()``
    with ``idx [batch, seq]`` (``seq`` divisible by ``p``), in the byte convention of :func:`lightning_tp2d.comm.count_comm`: an all-gather
    counts its local input, a reduce-scatter its full input.

    ``N = batch * seq`` tokens, ``e = elem`` (matmul outputs and their gradients), ``ep`` (4, or 8 for float64:
    what stays float32 under autocast: embeddings, LayerNorm outputs, the residual stream and their gradients):

    forward
        * token embedding: 1 reduce-scatter of ``[N, h]`` (``ep``) to sequence shards;
        * each block: 2 all-gathers of ``[N/p, h]`` (``ep``: the ``ln_1`` / ``ln_2`` outputs for c_attn, c_fc) and
          2 reduce-scatters of ``[N, h]`` (``e``: the attention and MLP ``c_proj`` outputs);
        * LM head: 1 all-gather of ``[N/p, h]`` (``ep``: the ``ln_f`` output);
        * vocab-parallel loss: 3 all-reduces of ``[N, 1]`` (``ep``; row max, sum of exp, target log-probability).
    backward
        * LM head: 1 reduce-scatter of ``[N, h]`` (``ep``: gradient of the gathered ``ln_f`` output);
        * each block: 2 all-gathers of ``[N/p, h]`` (``e``: gradients of the ``c_proj`` outputs) and
          2 reduce-scatters of ``[N, h]`` (``ep``: gradients of the gathered LayerNorm outputs);
        * LayerNorm weights (and biases): 1 all-reduce of all their gradients in one flat buffer,
          ``(2L + 1) h`` (``x2`` with biases, ``ep``), issued when the last of them is accumulated
          (:class:`_NormGradReducer`: they are Partial over the sequence shards);
        * token embedding: 1 all-gather of ``[N/p, h]`` (``ep``: the shard gradients back to the full lookup);
        * position embedding: 1 all-gather of ``[T/p, h]`` (``ep``).

    Llama (``cfg`` a :class:`~lightning_tp2d.models.llama.LlamaConfig`; torchtitan's plan, module docstring): the
    same calls and bytes, ``q/k/v_proj`` sharing the all-gather of ``input_layernorm``'s output (``gate/up_proj``
    that of ``post_attention_layernorm``), ``o_proj`` / ``down_proj`` in place of the ``c_proj``\ s, RMSNorm weights
    without biases, and no position embedding (RoPE) and so no last all-gather.

    Every call is blocking in this code (``overlap_flops`` 0). ``async_tp=True`` prices torch's async TP
    (micro-pipelined collective matmuls) instead: each all-gather / reduce-scatter next to a column- / row-parallel
    linear carries that linear's matmul FLOPs as ``overlap_flops`` (the forward product; in backward the
    input-gradient product, the same count); the embedding, LayerNorm-gradient and loss collectives stay exposed.
    Calls and bytes are the same either way.

    ``lean_wire=True`` counts every activation collective in the compute dtype (``e`` for ``ep`` above), as Megatron-LM
    with bf16 parameters runs them (its LayerNorm outputs, residual stream and their gradients are bf16): the strongest
    form of this baseline, used by the projection. torch's code under autocast sends the ``ep`` bytes.

    On one rank DTensor skips every redistribution; ``loss_parallel``'s three all-reduces remain (counted, nothing
    sent), as in :func:`~lightning_tp2d.bench.tp1d.tp1d_comm_events`.
    """
    if p < 1 or batch < 1 or seq < 1 or elem < 1:
        raise ValueError(f"need positive sizes, got batch={batch} seq={seq} p={p} elem={elem}")
    check_sequence_parallel(seq, p)
    h, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    e, ep = elem, float32_bytes(elem)
    ea = e if lean_wire else ep  # the float32 activations' bytes on the wire
    N = batch * seq
    full_e, full_ep, shard_e, shard_ep = N * h * e, N * h * ea, N * h * e // p, N * h * ea // p
    # matmul FLOPs per rank of each linear's forward (= its input-gradient product in backward)
    qkv, proj, fc, fc_proj = (2 * N * sum(o * i for o, i in group) / p for group in block_linears(cfg))
    head = 2 * N * h * -(-V // p)

    def ev(kind: str, nbytes: int, calls: int, phase: str, matmul: float = 0.0) -> Comm:
        return Comm(kind, AXIS, p, nbytes, calls=calls, overlap_flops=matmul if async_tp else 0.0, phase=phase)

    loss = [ev("all_reduce", N * ep, 3, "forward")]
    if p == 1:
        return loss
    norm_grads = (2 * L + 1) * (2 if getattr(cfg, "bias", False) else 1) * h * ep  # RMSNorm: weights only
    # a learned position table (GPT-2's wpe); RoPE (Llama, a rope_theta) has none
    positions = [ev("all_gather", seq * h * ea // p, 1, "backward")] if not hasattr(cfg, "rope_theta") else []
    return [
        ev("reduce_scatter", full_ep, 1, "forward"),  # wte: MaskPartial -> Shard(1)
        ev("all_gather", shard_ep, L, "forward", qkv),  # ln_1 output -> c_attn
        ev("reduce_scatter", full_e, L, "forward", proj),  # attn.c_proj output: Partial -> Shard(1)
        ev("all_gather", shard_ep, L, "forward", fc),  # ln_2 output -> c_fc
        ev("reduce_scatter", full_e, L, "forward", fc_proj),  # mlp.c_proj output: Partial -> Shard(1)
        ev("all_gather", shard_ep, 1, "forward", head),  # ln_f output -> lm_head
        *loss,
        ev("reduce_scatter", full_ep, 1, "backward", head),  # lm_head input gradient
        ev("all_gather", shard_e, L, "backward", fc_proj),  # mlp.c_proj output gradient
        ev("reduce_scatter", full_ep, L, "backward", fc),  # c_fc input gradient
        ev("all_gather", shard_e, L, "backward", proj),  # attn.c_proj output gradient
        ev("reduce_scatter", full_ep, L, "backward", qkv),  # c_attn input gradient
        ev("all_reduce", norm_grads, 1, "backward"),  # LayerNorm weight / bias gradients, one flat buffer
        ev("all_gather", shard_ep, 1, "backward"),  # wte output gradient
        *positions,  # wpe output gradient
    ]


def recomputed_sp_events(cfg, events: list[Comm], checkpointing: str, **kw) -> list[Comm]:
    """The sequence-parallel baseline's collectives its checkpointed blocks run again in the backward: ``"full"``
    every block's forward all-gathers and reduce-scatters; ``"selective"`` (torchtitan's per-op policy, which saves
    reduce-scatter outputs) the two all-gathers of each block. Phase ``"backward"``. A block's calls are those one
    more block adds."""
    if checkpointing == "none":
        return []
    deeper = tp1d_sp_comm_events(dataclasses.replace(cfg, n_layer=cfg.n_layer + 1), **kw)
    again = []
    for ev, more in zip(events, deeper):
        per_block = ev.phase == "forward" and more.calls > ev.calls and ev.kind in ("all_gather", "reduce_scatter")
        if per_block and (checkpointing == "full" or ev.kind == "all_gather"):
            again.append(dataclasses.replace(ev, phase="backward"))
    return again


# ---- x FSDP2: torchtitan's composition (``apply_fsdp`` after ``apply_tp``) ---------------------------------------

DP_AXIS = "dp"
_ENDS = {GPT2Config: ("transformer.wte", "transformer.ln_f"), LlamaConfig: ("model.embed_tokens", "model.norm")}


def init_tp_dp_mesh(tp: int, dp: int, device_type: str = "cpu") -> DeviceMesh:
    """The 2-D ``("dp", "tp")`` mesh of ``dp * tp`` ranks (the default process group's): tensor-parallel groups of
    ``tp`` adjacent ranks, data parallelism across them, as torchtitan orders its mesh."""
    return init_device_mesh(device_type, (dp, tp), mesh_dim_names=(DP_AXIS, AXIS))


def shard_1d_data_parallel(model: nn.Module, dp_mesh: DeviceMesh, zero_stage: int, mp_policy=None) -> nn.Module:
    """FSDP2 over ``dp_mesh`` on a model parallelized by :func:`~lightning_tp2d.bench.tp1d.parallelize_1d`, as
    torchtitan's ``apply_fsdp`` groups it: the input embedding alone, each block, the final norm with the head, then
    the root (what is left: GPT-2's position table). ``zero_stage`` 3: the embedding and every block resharded after
    their forward (torchtitan's default policy), so each is all-gathered again in the backward; the norm and head
    not (FSDP would gather them again at once: the backward starts there). 2: nothing resharded after the forward.
    A head tied to the embedding (GPT-2) joins it in the root group, which FSDP keeps gathered from the forward to
    the backward (``reshard_after_forward`` left to FSDP: the root is not resharded). ``mp_policy``: FSDP's
    :class:`~torch.distributed.fsdp.MixedPrecisionPolicy` (torchtitan: bf16 parameters, float32 reduction)."""
    if zero_stage not in (2, 3):
        raise ValueError(f"shard_1d_data_parallel: zero_stage={zero_stage!r} is not 2 or 3")
    again = zero_stage == 3
    options = {"mesh": dp_mesh, "mp_policy": mp_policy} if mp_policy is not None else {"mesh": dp_mesh}
    embedding_name, norm_name = next(ends for cls, ends in _ENDS.items() if isinstance(model.config, cls))
    embedding, norm = model.get_submodule(embedding_name), model.get_submodule(norm_name)
    tied = model.lm_head.weight is embedding.weight
    if not tied:
        fully_shard(embedding, reshard_after_forward=again, **options)
    for block in family_of(model).block_modules(model):
        fully_shard(block, reshard_after_forward=again, **options)
    if not tied:
        fully_shard([norm, model.lm_head], reshard_after_forward=False, **options)
    fully_shard(model, **options)
    return model
