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
  runs ``n_head/p`` local heads (:class:`~lightning_tp2d.baselines.tp1d.TP1DAttention`).
* ``attn.c_proj``, ``mlp.c_proj``: ``RowwiseParallel(output_layouts=Shard(1))``: the Partial ``[B, T, h]`` is
  reduce-scattered to ``[B, T/p, h]`` (backward: all-gather of the gradient).
* ``lm_head``: :class:`~lightning_tp2d.baselines.tp1d.TP1DLMHead` all-gathers the ``ln_f`` output (backward:
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

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleOutput, RowwiseParallel,
                                               SequenceParallel)

from lightning_tp2d.families import family_of
from lightning_tp2d.train_plan import FSDP_STAGES, reshards_after_forward
from lightning_tp2d.planning.rivals import AXIS, check_sequence_parallel
from lightning_tp2d.models.gpt2 import GPT2Config
from lightning_tp2d.models.llama import LlamaConfig

__all__ = ["sp_plan", "reduce_norm_grads", "init_tp_dp_mesh", "shard_1d_data_parallel"]


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


# ---- x FSDP2: torchtitan's composition (``apply_fsdp`` after ``apply_tp``) ---------------------------------------

DP_AXIS = "dp"
_ENDS = {GPT2Config: ("transformer.wte", "transformer.ln_f"), LlamaConfig: ("model.embed_tokens", "model.norm")}


def init_tp_dp_mesh(tp: int, dp: int, device_type: str = "cpu") -> DeviceMesh:
    """The 2-D ``("dp", "tp")`` mesh of ``dp * tp`` ranks (the default process group's): tensor-parallel groups of
    ``tp`` adjacent ranks, data parallelism across them, as torchtitan orders its mesh."""
    return init_device_mesh(device_type, (dp, tp), mesh_dim_names=(DP_AXIS, AXIS))


def shard_1d_data_parallel(model: nn.Module, dp_mesh: DeviceMesh, zero_stage: int, mp_policy=None) -> nn.Module:
    """FSDP2 over ``dp_mesh`` on a model parallelized by :func:`~lightning_tp2d.baselines.tp1d.parallelize_1d`, as
    torchtitan's ``apply_fsdp`` groups it: the input embedding alone, each block, the final norm with the head, then
    the root (what is left: GPT-2's position table). ``zero_stage`` 3: the embedding and every block resharded after
    their forward (torchtitan's default policy), so each is all-gathered again in the backward; the norm and head
    not (FSDP would gather them again at once: the backward starts there). 2: nothing resharded after the forward.
    A head tied to the embedding (GPT-2) joins it in the root group, which FSDP keeps gathered from the forward to
    the backward (``reshard_after_forward`` left to FSDP: the root is not resharded). ``mp_policy``: FSDP's
    :class:`~torch.distributed.fsdp.MixedPrecisionPolicy` (torchtitan: bf16 parameters, float32 reduction)."""
    if zero_stage not in FSDP_STAGES:
        raise ValueError(f"shard_1d_data_parallel: zero_stage={zero_stage!r} is not 2 or 3")
    again = reshards_after_forward(zero_stage, dp_mesh.size())
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
