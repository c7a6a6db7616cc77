"""The 1-D tensor-parallel baseline: PyTorch's own ``torch.distributed.tensor.parallel`` applied to our GPT-2 / Llama.

This is what a Lightning ``ModelParallelStrategy`` user writes in ``configure_model`` (Megatron-style 1-D TP,
as in torchtitan), so that the benchmarks compare our layouts against stock PyTorch rather than against a
second implementation of our own. Every rank passes the same full micro-batch. With
``parallelize_1d(..., sequence_parallel=True)`` the plan is the sequence-parallel one of
:mod:`lightning_tp2d.baselines.tp1d_sp` (the same attention, QKV regrouping and LM head; described there).

Plan (``parallelize_module`` styles on a 1-D mesh with axis ``"tp"`` of ``p`` ranks), per submodule:

* ``transformer.wte``: ``RowwiseParallel(input_layouts=Replicate())``; weight ``[V, h]`` Shard(0) (vocab rows).
* ``h.*.attn.c_attn``, ``h.*.mlp.c_fc``: ``ColwiseParallel()``; weight and bias Shard(0) (c_attn rows regrouped).
* ``h.*.attn.c_proj``, ``h.*.mlp.c_proj``: ``RowwiseParallel()``; weight Shard(1), bias Replicate.
* ``lm_head``: :class:`TP1DLMHead`, column-parallel on the very wte Parameter (Shard(0)).
* ``wpe``, ``ln_1``, ``ln_2``, ``ln_f``: untouched, plain tensors, identical on every rank.

Our Llama (``model.*`` names) gets torchtitan's ``parallelize_llama`` plan: ``embed_tokens`` as ``wte``;
``self_attn`` / ``mlp`` ``PrepareModuleInput`` (their input one Replicate DTensor, so the q/k/v and the gate/up
projections share one backward all-reduce); ``q/k/v_proj``, ``gate_proj``, ``up_proj`` ``ColwiseParallel()``
(separate matrices: plain Shard(0), no regrouping; the unchanged :class:`~lightning_tp2d.models.llama.LlamaAttention`
runs ``n_head/p`` query heads on this rank's ``n_kv_head/p`` key/value heads, RoPE per head); ``o_proj``,
``down_proj`` ``RowwiseParallel()``; RMSNorms plain; ``lm_head`` :class:`TP1DLMHead` on the embedding Parameter if
tied, else on its own weight sharded on vocab rows (Shard(0)). Communication: :func:`~lightning_tp2d.planning.rivals.tp1d_comm_events` holds for it.

* **Fused QKV.** GPT-2's ``c_attn`` stacks ``[q; k; v]`` (each ``h`` rows, heads in order). A plain Shard(0)
  would give rank 0 all of q and part of k. Its rows are therefore permuted before sharding so that shard ``i``
  is ``[q_i; k_i; v_i]`` for head group ``i`` (heads ``i*nh/p .. (i+1)*nh/p - 1``), and each block's attention is
  replaced by :class:`TP1DAttention`, which runs ``nh/p`` local heads with ``F.scaled_dot_product_attention``.
  The parameter's ``full_tensor()`` is the *permuted* matrix; :func:`full_state_dict_1d` undoes it.
* **Replicated parameters.** LayerNorms and ``wpe`` stay plain tensors. Their inputs are replicated
  activations and the gradients that reach them are already all-reduced by the TP styles (the backward of a
  column-parallel input), so every rank computes the same gradient with no communication, and the same
  optimizer step keeps them identical. This needs dropout 0 (a dropout mask drawn from each rank's own generator
  would make the replicas differ), so ``parallelize_1d`` refuses ``dropout > 0``.
* **Tied head and loss.** ``lm_head`` uses the wte Parameter as a column-parallel projection: logits are a
  DTensor sharded on vocab (``[B, T, V]``, Shard(2)). With targets, the loss is ``F.cross_entropy`` under torch's
  :func:`~torch.distributed.tensor.parallel.loss_parallel`, so no rank holds ``[tokens, V]`` logits. Torch
  requires the *backward* to run under ``loss_parallel()`` too, while our ``GPT2`` contract returns the loss and
  the caller calls ``loss.backward()`` anywhere; hooks on the two cross-entropy backward nodes
  (:class:`_LossParallelInBackward`) enter the context just for them. The graph, memory and communication are
  those of torch's documented ``with loss_parallel(): loss = ...; loss.backward()``. The returned loss is a
  plain scalar tensor. Without targets the logits are gathered (``full_tensor()``) into a plain ``[B, T, V]``.
* **Embedding backward.** torch 2.13 has no row-wise (masked) strategy for ``embedding_dense_backward``: the
  lookup's weight gradient is computed as a *replicated* ``[V, h]`` on every rank (all of ``idx``, all of the
  replicated output gradient) and then sliced to the local Shard(0) rows when added to the LM head's gradient.
  No communication, but every rank briefly holds (and scatters into) a full ``[V, h]``.
* **Optimizer.** torch's multi-tensor (``foreach``) optimizer kernels, the default for CUDA tensors, refuse lists
  mixing DTensor and plain tensors; build the optimizer on :func:`param_groups_1d`.
* **Vocabulary not divisible by p.** DTensor's Shard(0) is ``torch.chunk``-style: ceil(V/p) rows per rank, the
  last rank(s) fewer (V=257, p=4: 65, 65, 65, 62; p=2: 129, 128). The rowwise embedding (``_MaskPartial``, which
  takes shard sizes and offsets from ``Shard.local_shard_size_and_offset``) and ``loss_parallel`` (the same
  masked-target gather; max and sum-exp all-reduces over ``[N, 1]``) handle uneven shards correctly, so no
  padding is needed and none is added: the padded-vocab trick of our own layouts would change the parameter's
  global shape, which torch's styles do not expect. The only uneven cost is in gathering full logits for
  ``model(idx)``, where DTensor pads each shard to ceil(V/p) for the all-gather (not in the training step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               loss_parallel, parallelize_module)

from lightning_tp2d.baselines.tp1d_sp import check_input_hook, reduce_norm_grads, sp_plan
from lightning_tp2d.models.gpt2 import GPT2, GPT2Config
from lightning_tp2d.models.llama import Llama, LlamaConfig

__all__ = ["TP1DHandle", "init_tp1d_mesh", "check_tp1d", "parallelize_1d", "local_shapes_1d", "full_state_dict_1d", "param_groups_1d", "qkv_permutation", "TP1DAttention", "TP1DLMHead"]

AXIS = "tp"


@dataclass(frozen=True)
class TP1DHandle:
    """What :func:`parallelize_1d` attaches as ``model.tp``: the 1-D mesh and its size ``p``.

    Not a :class:`~lightning_tp2d.layouts.ParallelHandle` (1-D TP is a baseline, not one of our layouts), so
    :func:`~lightning_tp2d.layouts.handle_of` returns ``None`` for such a model."""

    mesh: DeviceMesh
    tensor_parallel_size: int
    sequence_parallel: bool = False  # the residual stream is sequence-sharded (:mod:`~lightning_tp2d.baselines.tp1d_sp`)
    name: ClassVar[str] = "1d"


def init_tp1d_mesh(p: int, device_type: str | None = None) -> DeviceMesh:
    """1-D :class:`DeviceMesh` with axis ``"tp"`` over the initialised default process group of ``p`` ranks.

    ``device_type`` defaults to ``cuda`` for the NCCL backend and ``cpu`` otherwise."""
    if not isinstance(p, int) or isinstance(p, bool) or p < 1:
        raise ValueError(f"tensor-parallel size p must be a positive int, got {p!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("init_tp1d_mesh needs an initialised process group: call "
                           "torch.distributed.init_process_group first")
    world = dist.get_world_size()
    if world != p:
        raise ValueError(f"1-D tensor parallelism over p={p} ranks needs world size {p}, got world size {world}")
    if device_type is None:
        device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    return init_device_mesh(device_type, (p,), mesh_dim_names=(AXIS,))


def check_tp1d(config: GPT2Config | LlamaConfig, p: int) -> None:
    """Raise ``ValueError`` naming the numbers when ``config`` cannot be split over ``p`` ranks in 1-D TP.

    GPT-2: heads and width divide by ``p``. Llama: query heads, key/value heads (each rank runs ``n_head/p`` query
    heads on its own ``n_kv_head/p`` key/value heads) and the MLP width divide by ``p``. Both: dropout 0."""
    sizes = _family(config).split_sizes
    bad = [f"{name}={getattr(config, name)} is not divisible by p={p}" for name in sizes if getattr(config, name) % p]
    if bad:
        fits = [k for k in range(1, max(p, 8) + 1) if all(getattr(config, name) % k == 0 for name in sizes)]
        bad.append(f"use p in {fits}")
    if config.dropout != 0.0:
        bad.append(f"dropout={config.dropout} must be 0 (replicated activations would get different masks "
                   "on each rank)")
    if bad:
        raise ValueError(f"cannot parallelize {config.KIND} with 1-D tensor parallelism: " + "; ".join(bad))


def qkv_permutation(n_embd: int, p: int) -> torch.Tensor:
    """Row order for the fused ``c_attn`` ([3h, h] weight, [3h] bias): ``W_grouped = W[perm]`` puts
    ``[q_i; k_i; v_i]`` (rows of head group ``i``, ``h/p`` each) in the i-th of ``p`` equal row blocks."""
    g = n_embd // p
    rows = torch.arange(3 * n_embd).view(3, p, g)  # [q | k | v] x group x row
    return rows.transpose(0, 1).reshape(-1)  # group-major: q_0 k_0 v_0 q_1 k_1 v_1 ...


class TP1DAttention(nn.Module):
    """Causal self-attention over this rank's ``n_head / p`` heads.

    ``c_attn`` is column-parallel on regrouped rows (returns the local ``[B, T, 3h/p]`` = ``[q_i | k_i | v_i]``),
    ``c_proj`` row-parallel (takes the local ``[B, T, h/p]``, all-reduces to the replicated ``[B, T, h]``).
    """

    def __init__(self, attn: nn.Module, p: int):
        super().__init__()
        self.c_attn = attn.c_attn
        self.c_proj = attn.c_proj
        self.resid_dropout = attn.resid_dropout
        self.n_head = attn.n_head // p  # local heads
        self.head_size = attn.n_embd // attn.n_head
        self.dropout = attn.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        nh, hs = self.n_head, self.head_size
        q, k, v = self.c_attn(x).split(nh * hs, dim=2)  # 3 x (B, T, h/p), plain local tensors
        q = q.view(B, T, nh, hs).transpose(1, 2)
        k = k.view(B, T, nh, hs).transpose(1, 2)
        v = v.view(B, T, nh, hs).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, nh * hs)
        return self.resid_dropout(self.c_proj(y))


def _loss_parallel_active() -> bool:
    """Whether torch's ``loss_parallel()`` handlers are installed right now (someone is inside that context)."""
    handlers = getattr(getattr(DTensor, "_op_dispatcher", None), "_custom_op_handlers", {})
    return torch.ops.aten._log_softmax.default in handlers


@contextlib.contextmanager
def _loss_parallel_once():
    """``loss_parallel()``, unless the caller is already inside it (its exit would remove the caller's handlers)."""
    if _loss_parallel_active():
        yield
    else:
        with loss_parallel():
            yield


class _LossParallelInBackward:
    """Runs the backward of a ``loss_parallel()`` cross-entropy inside that context, wherever the caller calls
    ``backward()``: entered by a pre-hook on the ``NllLossBackward`` node, left by a hook on the
    ``LogSoftmaxBackward`` node after it (the two nodes whose DTensor ops loss_parallel replaces).

    The graph is exactly the one ``with loss_parallel(): loss = F.cross_entropy(...); loss.backward()`` builds,
    so memory and communication are those of torch's documented usage. If backward fails between the two nodes,
    the handlers stay installed until the next such backward completes."""

    def __init__(self, loss: torch.Tensor):
        nll = loss.grad_fn
        log_softmax = nll.next_functions[0][0] if nll is not None and nll.next_functions else None
        if nll is None or log_softmax is None:
            return  # no graph (no_grad): nothing to do in backward
        if "NllLoss" not in type(nll).__name__ or "LogSoftmax" not in type(log_softmax).__name__:
            raise RuntimeError(f"unexpected cross-entropy graph: {type(nll).__name__} <- "
                               f"{type(log_softmax).__name__}; cannot run its backward under loss_parallel()")
        self._cm = None
        nll.register_prehook(self._enter)
        log_softmax.register_hook(self._exit)

    def _enter(self, grad_outputs):
        if self._cm is None and not _loss_parallel_active():
            self._cm = loss_parallel()
            self._cm.__enter__()

    def _exit(self, grad_inputs, grad_outputs):
        if self._cm is not None:
            cm, self._cm = self._cm, None
            cm.__exit__(None, None, None)


class TP1DLMHead(nn.Module):
    """Tied LM head as a column-parallel projection: ``logits = x @ Eᵀ`` with ``E`` = the wte Parameter
    (DTensor, vocab Shard(0)), so the logits come out vocab-sharded (Shard(-1)); the loss is vocab-parallel.

    ``x`` is the replicated plain ``[B, T, h]``; its gradient is all-reduced in backward (``from_local`` with
    Replicate turns the Partial gradient into a replicated one). With sequence parallelism ``x`` is a DTensor
    sharded on the sequence (Shard(1)): it is all-gathered, and its gradient reduce-scattered in backward."""

    def __init__(self, weight: nn.Parameter, mesh: DeviceMesh):
        super().__init__()
        self.weight = weight  # the same Parameter object as transformer.wte.weight
        self.mesh = mesh

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
        elif x.placements != (Replicate(),):
            x = x.redistribute(self.mesh, [Replicate()])
        logits = F.linear(x, self.weight)  # DTensor [B, T, V], Shard(2)
        if targets is None:
            return logits.full_tensor()
        V = logits.size(-1)
        with _loss_parallel_once():
            loss = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), ignore_index=-100)
        _LossParallelInBackward(loss)
        return loss.to_local()  # Replicate scalar -> plain tensor


def _gpt2_plan(n_layer: int, sequence_parallel: bool) -> dict:
    if sequence_parallel:
        return sp_plan(n_layer)
    plan = {"transformer.wte": RowwiseParallel(input_layouts=Replicate())}
    for i in range(n_layer):
        prefix = f"transformer.h.{i}"
        plan[f"{prefix}.attn.c_attn"] = ColwiseParallel()
        plan[f"{prefix}.attn.c_proj"] = RowwiseParallel()
        plan[f"{prefix}.mlp.c_fc"] = ColwiseParallel()
        plan[f"{prefix}.mlp.c_proj"] = RowwiseParallel()
    return plan


def _llama_plan(n_layer: int, sequence_parallel: bool) -> dict:
    """torchtitan's ``parallelize_llama`` plan on our Llama's names (module docstring). ``PrepareModuleInput`` on
    ``self_attn`` / ``mlp`` makes their input one Replicate DTensor shared by q/k/v (gate/up): one all-gather (SP)
    for the three, and one all-reduce (no SP) or reduce-scatter (SP) of their summed input gradients."""
    stream = Shard(1) if sequence_parallel else Replicate()  # the residual stream's placement between blocks
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)}
    for i in range(n_layer):
        prefix = f"model.layers.{i}"
        plan[f"{prefix}.self_attn"] = PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),))
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{prefix}.self_attn.{name}"] = ColwiseParallel()
        plan[f"{prefix}.self_attn.o_proj"] = RowwiseParallel(output_layouts=stream)
        plan[f"{prefix}.mlp"] = PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),))
        plan[f"{prefix}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"{prefix}.mlp.up_proj"] = ColwiseParallel()
        plan[f"{prefix}.mlp.down_proj"] = RowwiseParallel(output_layouts=stream)
        if sequence_parallel:
            plan[f"{prefix}.input_layernorm"] = SequenceParallel()
            plan[f"{prefix}.post_attention_layernorm"] = SequenceParallel()
    if sequence_parallel:
        plan["model.norm"] = SequenceParallel()
    return plan


def _regroup_gpt2_attention(model: GPT2, p: int) -> None:
    """Permute each fused ``c_attn`` to head-group order and swap in :class:`TP1DAttention` (module docstring)."""
    perm = qkv_permutation(model.config.n_embd, p)
    with torch.no_grad():
        for block in model.transformer.h:
            c_attn = block.attn.c_attn
            c_attn.weight.copy_(c_attn.weight[perm])
            if c_attn.bias is not None:
                c_attn.bias.copy_(c_attn.bias[perm])
    for block in model.transformer.h:
        block.attn = TP1DAttention(block.attn, p)


@dataclass(frozen=True)
class _Family1D:
    """What 1-D TP needs of one model class: its sizes that must divide by ``p``, its plan
    ``(n_layer, sequence_parallel) -> {submodule: style}``, the in-place preparation before the plan applies
    (GPT-2: regroup the fused QKV), and the path of the token embedding (the tied head's weight)."""

    model_class: type
    split_sizes: tuple[str, ...]
    plan: Callable[[int, bool], dict]
    prepare: Callable[[nn.Module, int], None] | None
    embedding: str


_FAMILIES = {
    GPT2Config: _Family1D(GPT2, ("n_head", "n_embd"), _gpt2_plan, _regroup_gpt2_attention, "transformer.wte"),
    # Llama's attention runs unchanged on the local heads: it reshapes with -1 heads (models/llama.py)
    LlamaConfig: _Family1D(Llama, ("n_head", "n_kv_head", "intermediate_size"), _llama_plan, None,
                           "model.embed_tokens"),
}


def _family(config) -> _Family1D:
    for cls in type(config).__mro__:
        if cls in _FAMILIES:
            return _FAMILIES[cls]
    raise TypeError(f"1-D tensor parallelism has a plan for {[c.__name__ for c in _FAMILIES]} configs, "
                    f"got {type(config).__name__}")


def parallelize_1d(model: GPT2 | Llama, mesh: DeviceMesh, *, sequence_parallel: bool = False,
                   float8: str | None = None, fsdp_float8_all_gather: bool = False) -> GPT2 | Llama:
    """Apply Megatron-style 1-D tensor parallelism with torch's TP styles to ``model`` (our GPT-2 or Llama) in
    place; returns it.

    ``sequence_parallel=True`` adds sequence parallelism (the plan of :mod:`lightning_tp2d.baselines.tp1d_sp`):
    norms and the residual stream on ``[B, T/p, h]`` sequence shards, all-gather / reduce-scatter around the
    column- / row-parallel linears instead of all-reduces; the sequence length must then divide by ``p``.

    Every rank must pass the same plain model (same seed), on the mesh's device: sharded weights are scattered
    from rank 0 (``parallelize_module``'s default; an untied Llama head's too), the replicated norm / ``wpe``
    parameters are kept as each rank has them. Raises ``ValueError`` naming the numbers (heads, key/value heads,
    hidden or MLP size not divisible by ``p``, dropout) before any communication. Use :func:`param_groups_1d`
    for the optimizer.

    ``float8`` (``"tensorwise"`` / ``"rowwise"``): the linears but the head first become torchao's ``Float8Linear``
    (``convert_to_float8_training`` with the recipe, :func:`lightning_tp2d.float8.convert_plain`), then the same
    styles shard them (torchao's ``Float8Linear`` takes DTensor weights; its tensorwise amax is the DTensor's global
    one), as torchtitan converts before it parallelizes. torchtitan's tensorwise float8 TP styles, which all-gather the
    activations in float8, are not used: the activations travel in bf16, as in its rowwise runs.
    ``fsdp_float8_all_gather`` (tensorwise): torchao's ``enable_fsdp_float8_all_gather``, so that FSDP2
    (:func:`~lightning_tp2d.baselines.tp1d_sp.shard_1d_data_parallel`) gathers those weights as float8, as
    torchtitan's ``--quantize.linear.float8.enable_fsdp_float8_all_gather`` does; call
    :func:`lightning_tp2d.float8.precompute_fsdp_scales` after each optimizer step, as torchtitan does.
    """
    fam = _family(getattr(model, "config", None))
    if not isinstance(model, fam.model_class):
        raise TypeError(f"parallelize_1d expects a lightning_tp2d.models GPT2 or Llama, got {type(model).__name__}")
    done = getattr(model, "tp", None)
    if done is not None:
        raise ValueError(f"model is already parallelized with layout {getattr(done, 'name', type(done).__name__)!r}")
    if mesh.ndim != 1:
        raise ValueError(f"parallelize_1d needs a 1-D mesh, got {mesh.ndim}-D mesh {tuple(mesh.shape)}")
    if any(p.is_meta for p in model.parameters()):
        raise NotImplementedError("parallelize_1d does not materialise meta-device models; build the model eagerly")
    cfg, p = model.config, mesh.size()
    check_tp1d(cfg, p)
    devices = sorted({q.device.type for q in model.parameters()} - {mesh.device_type})
    if devices:
        # parallelize_module would move the sharded weights to the mesh's device but leave the plain ones
        raise ValueError(f"model parameters are on {devices} but the mesh is on {mesh.device_type!r}; "
                         f"move the model to the mesh's device first")

    embedding = model.get_submodule(fam.embedding)
    tied = model.lm_head.weight is embedding.weight
    if float8 is not None:
        from lightning_tp2d.float8 import convert_plain  # torchao: imported only with a recipe

        convert_plain(model, float8, fsdp_float8_all_gather=fsdp_float8_all_gather)
    elif fsdp_float8_all_gather:
        raise ValueError("parallelize_1d: fsdp_float8_all_gather needs float8='tensorwise'")
    if fam.prepare is not None:
        fam.prepare(model, p)
    plan = fam.plan(cfg.n_layer, sequence_parallel)
    parallelize_module(model, mesh, plan)
    if sequence_parallel:
        reduce_norm_grads(model, mesh, plan)
        model.register_forward_pre_hook(check_input_hook(p), with_kwargs=True)
    # RowwiseParallel registered a new (DTensor) Parameter on the embedding; tie the head to it again, or shard an
    # untied head's own weight on vocab rows the same way.
    head = (embedding.weight if tied else
            nn.Parameter(distribute_tensor(model.lm_head.weight.detach(), mesh, [Shard(0)]),
                         requires_grad=model.lm_head.weight.requires_grad))
    model.lm_head = TP1DLMHead(head, mesh)
    model.tp = TP1DHandle(mesh, p, sequence_parallel)
    return model


def local_shapes_1d(model: GPT2 | Llama, p: int) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape on tensor rank 0 of :func:`parallelize_1d` over ``p`` ranks (its plan read, nothing
    sharded: ``model`` may live on the meta device): a column-parallel linear's weight and bias cut on dim 0, a
    row-parallel one's weight on dim 1, a row-parallel embedding on vocab rows (dim 0), the LM head on vocab rows,
    the rest whole. DTensor cuts as ``torch.chunk`` does, so rank 0 holds the largest piece, ``ceil(n / p)``."""
    fam = _family(model.config)
    dims = {"lm_head.weight": 0}
    for path, style in fam.plan(model.config.n_layer, True).items():
        module = model.get_submodule(path)
        if isinstance(module, nn.Embedding) and isinstance(style, (ColwiseParallel, RowwiseParallel)):
            dims[f"{path}.weight"] = 1 if isinstance(style, ColwiseParallel) else 0
        elif isinstance(style, ColwiseParallel):
            dims[f"{path}.weight"] = dims[f"{path}.bias"] = 0
        elif isinstance(style, RowwiseParallel):
            dims[f"{path}.weight"] = 1
    shapes = {}
    for name, param in model.named_parameters():
        shape = list(param.shape)
        if name in dims:
            shape[dims[name]] = -(-shape[dims[name]] // p)
        shapes[name] = tuple(shape)
    return shapes


@torch.no_grad()
def full_state_dict_1d(model: GPT2) -> dict[str, torch.Tensor]:
    """Plain tensors with the keys of the plain model's ``state_dict()`` and the original (un-permuted) c_attn
    rows. A collective: every rank of the mesh must call it."""
    handle = getattr(model, "tp", None)
    if not isinstance(handle, TP1DHandle):
        raise ValueError("full_state_dict_1d expects a model parallelized by parallelize_1d")
    p = handle.tensor_parallel_size
    out = {}
    for key, value in model.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value.detach().clone()
        if key.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):  # GPT-2's fused QKV (Llama has none)
            full = full[torch.argsort(qkv_permutation(model.config.n_embd, p)).to(full.device)]
        out[key] = full
    return out


def param_groups_1d(model: nn.Module, **options) -> list[dict]:
    """``model``'s parameters as optimizer param groups, DTensors apart from plain tensors (each group gets
    ``options``): ``torch.optim.AdamW(param_groups_1d(model), lr=...)``.

    The multi-tensor (``foreach``) optimizer kernels, torch's default for CUDA tensors, refuse a list that mixes
    DTensor and torch.Tensor ("got mixed torch.Tensor and DTensor"), and this plan keeps LayerNorm and ``wpe``
    parameters plain; one group of each kind keeps every foreach call homogeneous."""
    params = list(model.parameters())
    groups = [[q for q in params if isinstance(q, DTensor)], [q for q in params if not isinstance(q, DTensor)]]
    return [{"params": g, **options} for g in groups if g]


