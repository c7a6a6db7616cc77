"""``parallelize(model, mesh, layout)``: turn a plain :class:`~lightning_tp2d.models.GPT2` into its parallel form.

The model file knows nothing about parallelism; this module swaps its submodules, by name, for the parallel
layers of the layout and shards their weights. Which submodules, and which parallel class replaces each, is
the model family's plan (:mod:`lightning_tp2d.families`); GPT-2's is described here. ``GPT2.forward`` itself is
reused unchanged: the parallel ``wte`` takes the full ``idx`` and returns this rank's shard, the blocks work on shards, and the parallel
``lm_head`` returns the loss (vocab-parallel) or the gathered logits.

Plan for ``"2d"`` (docs/layouts.md, "2d"), per submodule:

=========================  ==================  ==========================================================
submodule                  becomes             parameter placements over (data_parallel, row, col)
=========================  ==================  ==========================================================
transformer.wte            TokenEmbedding2D    weight [V, h]: R, Shard(0), Shard(1)
transformer.wpe            PositionEmbedding2D weight [T, h]: R, R, Shard(1)
h.*.ln_1 / ln_2, ln_f      LayerNorm2D         weight, bias [h]: R, R, Shard(0)
h.*.attn                   Attention2D         c_attn.weight [3h, h]: R, Shard(1), Strided(0, 3); c_proj like a Linear
h.*.mlp                    MLP2D               weight [out, in]: R, Shard(1), Shard(0); bias [out]: R, R, Shard(0)
lm_head                    LMHead2D            tied to transformer.wte.weight
=========================  ==================  ==========================================================

With the collective SUMMA (the default) the two output projections (``attn.c_proj``, ``mlp.c_proj``: output no
wider than input) run in its scatter form and store the mirror blocks: weight R, Shard(0), Shard(1).

``"metp"`` (docs/layouts.md, "metp", :mod:`lightning_tp2d.nn.ring`, :mod:`lightning_tp2d.nn.ring_stream`) on the mesh
``(data_parallel, ring)``: rank ``i`` holds the zigzag chunks ``i`` and ``2p-1-i`` of every sequence with the full
hidden size; ``wte`` Shard(0) (vocab rows), ``c_attn`` _StridedShard(0, 3), ``c_fc`` Shard(0), both ``c_proj``
Shard(1), everything else replicated with gradients summed over ``ring``. ``"2d-metp"`` (docs/layouts.md, "2d-metp",
:mod:`lightning_tp2d.nn.grid_metp`) places parameters as ``"2d"``; grid rows hold zigzag chunks instead of batch
shards, and attention is a ring along ``row``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.utils.checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_tp2d import float8, fused_adam, recompute
from lightning_tp2d.families import family_of, model_names
from lightning_tp2d.layouts import DEFAULT_LAYOUT, Layout, ParallelHandle, get_layout
from lightning_tp2d.offload import ActivationOffloader
from lightning_tp2d.ops import register_mesh
from lightning_tp2d.nn.stage import present
from lightning_tp2d.nn.functional import own_leaf_grads
from lightning_tp2d.train_plan import CHECKPOINTING

if TYPE_CHECKING:  # pragma: no cover
    from lightning_tp2d.metp import RingOptions


def parallelize(model: nn.Module, mesh: DeviceMesh, layout: str | Layout = DEFAULT_LAYOUT, *,
                options: RingOptions | None = None,
                on_block: Callable[[nn.Module], object] | None = None,
                elsewhere: tuple[Sequence[str], Mapping[str, nn.Module]] | None = None) -> nn.Module:
    """Parallelize ``model`` in place for ``layout`` on ``mesh`` (from :func:`~lightning_tp2d.init_mesh`) and
    return it. Every rank must pass the same plain model: each rank keeps its own shards of it.

    ``model`` is an instance of a registered model family (:mod:`lightning_tp2d.families`: GPT2, Llama, or one a
    user registered). ``layout`` is a name (``"2d"``, ``"metp"``, ``"2d-metp"``) or a
    :class:`~lightning_tp2d.layouts.Layout` object; ``options`` (a :class:`~lightning_tp2d.metp.RingOptions`)
    configure the ring kernels. The family's plan for the layout decides which parallel module replaces each of its
    roles; the model then carries one :class:`~lightning_tp2d.layouts.ParallelHandle` as ``model.tp``.

    A model built under ``torch.device("meta")`` is materialised here, module by module, with the model's init from
    the global CPU generator (its ``init_module_``): seed it (the same on every rank) before calling, and the
    weights equal an eager build after the same seed. Shards land on the mesh's device type.

    ``on_block(block)`` is called with each transformer block (the family's ``blocks``) as soon as all its modules
    are parallel, before the next module is materialised: :func:`lightning_tp2d.fsdp.shard_block` there cuts each
    block over ``data_parallel`` at once, so its tensor shards are freed before the next block is built.

    ``elsewhere = (order, modules)``: a meta-device pipeline stage (:mod:`lightning_tp2d.pipeline`): ``order`` is
    every role path of the whole model in init order, ``modules`` the meta modules of the roles other stages hold
    (by path). Each is materialised and dropped at its place in the order, so the generator's draws, and so this
    stage's weights, are those of the whole model's build from the same seed.

    Under autocast (``bf16-mixed``) the parallel model runs its residual stream in the autocast dtype
    (``model.residual_in_compute_dtype``): block inputs and every saved activation are bf16 at every ZeRO stage,
    parameters, gradients and optimizer state float32."""
    family = family_of(model)
    if family is None:
        raise TypeError(f"parallelize expects a lightning_tp2d.models.GPT2 or another registered model family "
                        f"({model_names()}), got {type(model).__name__}")
    done = getattr(model, "tp", None)  # ours (a ParallelHandle) or another parallelization's handle (1-D TP)
    if done is not None:
        raise ValueError(f"model is already parallelized with layout {getattr(done, 'name', type(done).__name__)!r}")
    spec = get_layout(layout, options)
    p, dp = spec.sizes_of_mesh(mesh)
    spec.check_tensor_parallel_size(p)
    family.plan(spec)  # a family without a plan for this layout is refused before anything changes
    register_mesh(mesh)  # the registered ops find it again under torch.compile
    fused_adam.install()  # the fused AdamW step on the DTensor parameters at the plain tensors' host cost
    recipe = getattr(spec.options, "float8", None)
    if recipe is not None:  # torchao imported and the recipe's config made now, not first inside a compiled forward
        float8.recipe_config(recipe)
    family.check_model(spec, p, model.config)  # dropout is refused by ring layers in training
    # A model built on the meta device is materialised one module at a time, on CPU, initialised in
    # init_weights' order (so a seed gives the same weights as an eager build) and then sharded: no rank
    # ever holds more than one full module.
    materialise = _materialiser(model) if any(p.is_meta for p in model.parameters()) else (lambda name, m: m)
    tied = family.tied(model)
    # a pipeline stage (lightning_tp2d.pipeline) parallelizes the modules it holds, not the ones other stages do
    roles = [(path, role) for path, role in family.module_roles(model) if present(model, path)]
    finished = _blocks_finished(model, roles)
    order, others = elsewhere if elsewhere is not None else ((), {})
    pending = iter(order)
    for i, (path, role) in enumerate(roles):
        for before in pending:  # the roles other stages hold, up to this one: their draws, in order, then dropped
            if before == path:
                break
            if before in others:
                materialise(before, others[before])
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        pad_multiple = getattr(getattr(parent, attr), "pad_multiple", None)  # an LM head's vocabulary padding
        if path in tied:  # built from the (already parallel) weight of the module it is tied to
            new = family.build(spec, role, model.get_submodule(tied[path]).weight, mesh)
        else:
            new = family.build(spec, role, materialise(path, getattr(parent, attr)), mesh)
        if pad_multiple is not None:
            new.pad_multiple = pad_multiple
        setattr(parent, attr, new)
        for block in finished.get(i, ()) if on_block is not None else ():
            on_block(block)
    model.residual_in_compute_dtype = True  # bf16 activations under bf16-mixed at every stage (gpt2.in_compute_dtype)
    model.tp = ParallelHandle(spec, mesh, p, dp)
    own_leaf_grads(model)  # the layers take each parameter's shard as a leaf of its own (nn.functional.local_view)
    return model


def _blocks_finished(model: nn.Module, roles: list[tuple[str, str]]) -> dict[int, list[nn.Module]]:
    """The transformer blocks whose last module is the ``i``-th of ``roles``, by ``i``."""
    ids = {id(b) for b in family_of(model).block_modules(model)}
    finished: dict[int, list[nn.Module]] = {}
    for name, block in model.named_modules():
        if id(block) in ids:
            last = max((i for i, (path, _) in enumerate(roles) if path.startswith(f"{name}.")), default=None)
            if last is not None:
                finished.setdefault(last, []).append(block)
    return finished


ACTIVATION_CHECKPOINTING = CHECKPOINTING


def _selective(model: nn.Module):
    forward = model.forward

    def selective(*args, **kwargs):
        if not (torch.is_grad_enabled() and model.training):
            return forward(*args, **kwargs)
        with recompute.saving_recipes():
            return forward(*args, **kwargs)

    selective.recomputes = forward
    return selective


def _mode_of(model: nn.Module) -> str:
    if hasattr(model.forward, "recomputes"):
        return "selective"
    if any(hasattr(block.forward, "recomputes") for block in _blocks(model)):
        return "full"
    return "none"


def _blocks(model: nn.Module):
    family = family_of(model)
    if family is None:
        raise TypeError(f"activation checkpointing expects a registered model family ({model_names()}), got "
                        f"{type(model).__name__}")
    return family.block_modules(model)


def _recomputed(block: nn.Module, offloader: ActivationOffloader | None = None):
    forward = getattr(block.forward, "recomputes", block.forward)  # (re-wrapped to add an offloader)

    def checkpointed(x: torch.Tensor, *args) -> torch.Tensor:  # args: the block's packed documents, if any
        if not (torch.is_grad_enabled() and block.training):
            return forward(x, *args)
        if offloader is None:
            return torch.utils.checkpoint.checkpoint(forward, x, *args, use_reentrant=False)
        with offloader.saving():  # the checkpoint's saved inputs go to the host (lightning_tp2d.offload)
            return torch.utils.checkpoint.checkpoint(forward, x, *args, use_reentrant=False)

    checkpointed.recomputes = forward  # what the wrapper recomputes; marks the block as wrapped
    checkpointed.offloader = offloader
    return checkpointed


def offloaded_checkpointing(mode: str, offload: bool) -> str:
    """The checkpointing mode a run with ``activation_offload=offload`` uses: offload moves the inputs ``"full"``
    checkpointing keeps, so ``"none"`` becomes ``"full"`` and ``"selective"`` is a ``ValueError``; without offload,
    ``mode``. One rule for the strategies and ``tp2d-train``'s fit check."""
    if not offload or mode == "full":
        return mode
    if mode == "selective":
        raise ValueError("activation_offload=True with activation_checkpointing='selective' is not supported: "
                         "offload moves the block inputs that 'full' checkpointing keeps to host memory; use "
                         "activation_checkpointing='full' (or 'none', which then means 'full'), or no offload")
    return "full"


def activation_offloader(model: nn.Module) -> ActivationOffloader | None:
    """The :class:`~lightning_tp2d.offload.ActivationOffloader` of a model checkpointed with ``offload``, else
    ``None``. Its ``stats`` count the bytes that left for the host and came back."""
    if family_of(model) is None:
        return None
    return next((o for o in (getattr(b.forward, "offloader", None) for b in _blocks(model)) if o is not None), None)


def checkpoint_activations(model: nn.Module, mode: str = "full",
                           offload: bool | ActivationOffloader = False) -> nn.Module:
    """Activation checkpointing of a (parallel or plain) GPT2's (or other registered model's) transformer blocks, in place; returns ``model``.

    ``"full"``: each block keeps only its input for the backward and runs its forward again there (its collectives
    included: every rank of a tensor-parallel group recomputes the same blocks in the same order), trading one more
    forward of the blocks for their saved activations. ``"selective"``: the blocks keep their matmul and attention
    outputs but store the cheap, large tensors as recipes rebuilt in the backward (:mod:`lightning_tp2d.recompute`):
    LayerNorm outputs and the GELU output (elementwise, from tensors the backward keeps anyway) and, in the grid
    layouts, the LM head's mirrored embedding block (swapped again with the mirror rank); gradients are
    bit-identical. ``"none"``: nothing changes. The module tree and parameter names stay as they are (checkpoints
    are unaffected); applying a mode twice wraps once, and a model keeps the first mode applied. Dropout draws the same mask
    in the recomputation (the RNG state is restored). Apply it after :func:`parallelize` or before: the wrapper
    calls whatever the block's submodules are when it runs.

    ``offload`` (``"full"`` only; ``True`` or an :class:`~lightning_tp2d.offload.ActivationOffloader` of one's own,
    e.g. with another ``min_bytes``): the inputs each block keeps move to host memory in the forward and come back,
    one block ahead, in the backward (:mod:`lightning_tp2d.offload`); gradients are bit-identical. It may be added to
    a model already checkpointed with ``"full"``; once added it stays (:func:`activation_offloader` finds it)."""
    if mode not in ACTIVATION_CHECKPOINTING:
        raise ValueError(f"activation_checkpointing={mode!r} is not one of "
                         f"{', '.join(map(repr, ACTIVATION_CHECKPOINTING))}")
    if offload is not False and not isinstance(offload, ActivationOffloader) and offload is not True:
        raise ValueError(f"offload must be a bool or an ActivationOffloader, got {offload!r}")
    if offload is not False and mode != "full":
        raise ValueError(f"activation offload needs activation_checkpointing='full' (it offloads the block inputs "
                         f"that full checkpointing keeps), got activation_checkpointing={mode!r}")
    current = _mode_of(model)
    if mode == "full" and current == "full" and offload is not False and activation_offloader(model) is None:
        current = "none"  # re-wrap the checkpointed blocks with an offloader
    if mode == "none" or mode == current:
        return model
    if current != "none":
        raise ValueError(f"model already uses activation_checkpointing={current!r}; cannot also apply {mode!r}")
    if mode == "full":
        offloader = offload if isinstance(offload, ActivationOffloader) else ActivationOffloader() if offload else None
        for block in _blocks(model):
            block.forward = _recomputed(block, offloader)
    else:
        model.forward = _selective(model)
    return model


def _materialiser(model: nn.Module):
    """``(name, module) -> module`` on CPU with the model's init (``model.init_module_``); call in
    ``named_modules()`` order."""

    def materialise(name: str, module: nn.Module) -> nn.Module:
        module.to_empty(device="cpu")
        for sub_name, sub in module.named_modules():
            model.init_module_(f"{name}.{sub_name}" if sub_name else name, sub)
        return module

    return materialise


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Plain tensors with the keys of the unparallelized model's ``state_dict()`` (a collective: every rank
    of the mesh must call it)."""
    # full_tensor() already returns a fresh tensor; only plain entries need a copy
    return {k: v.full_tensor() if isinstance(v, DTensor) else v.detach().clone() for k, v in model.state_dict().items()}


def local_parameter_bytes(model: nn.Module) -> int:
    """Bytes of parameter storage this rank holds (local shards of DTensors; tied tensors once)."""
    total = 0
    for p in model.parameters():
        t = p.to_local() if isinstance(p, DTensor) else p
        total += t.numel() * t.element_size()
    return total
