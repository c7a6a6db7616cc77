"""ZeRO stages 2 and 3 on the data-parallel axis with torch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

:func:`shard_data_parallel` takes a model already parallelized by :func:`~lightning_tp2d.parallelize` and shards
it over the ``data_parallel`` axis of its one root mesh, on top of the tensor-parallel shards:

* one FSDP group per transformer block (the family's ``blocks``) and one for the rest at the root (embeddings,
  norms, head; tied weights live in that group once);
* every parameter stays a DTensor on the root mesh ``(data_parallel, row, col)`` / ``(data_parallel, ring)``:
  FSDP is given the whole mesh and told which axis is data parallel (``DataParallelMeshDims``), so the tensor
  placements and the layers' local shards are untouched, and the at-rest parameter is split over
  ``data_parallel``: this rank holds ``ceil(n / dp)`` of the ``n`` rows (dim 0) of its tensor shard, a
  ``_StridedShard`` over ``data_parallel`` when a tensor axis also splits dim 0. Where a tensor axis splits dim 0
  strided (GPT-2's fused ``c_attn`` weight: ``[q_c | k_c | v_c]`` rows) the cut is along dim 1 instead, since no
  DTensor placement describes a contiguous cut of strided rows; a 1-D parameter of that kind (``c_attn.bias`` on
  the grids: ``3 * n_embd / q`` elements per block) has no other dim and is left to FSDP's ``ignored_params``: it
  stays whole on every replica and a gradient hook averages it over ``data_parallel``; its optimizer state is
  sharded by ZeRO-1's flat slices instead (:func:`~lightning_tp2d.zero.shard_optimizer_state` on the optimizer,
  which the strategies call at stages 2/3: each rank keeps and steps ``ceil(n / dp)`` of its ``n`` elements, reads
  them from the averaged gradient and all-gathers the stepped slices after the step, while FSDP's shards pass
  through untouched), so no parameter keeps a replicated optimizer state;
* before a group's forward FSDP all-gathers its parameters over ``data_parallel`` and after its backward
  reduce-scatters the gradients, averaged over ``dp`` (FSDP's default prefetching: in the backward the next
  block's all-gather is issued before the current block's gradients), so each rank keeps the gradient of its
  parameter shard. An optimizer built afterwards sees the sharded parameters and keeps state for them alone
  (plain loops: ``shard_optimizer_state(optimizer, mesh)`` right after building it slices the state of those
  kept whole too).

``stage=3`` (``reshard_after_forward=True``): a block's full parameters are freed after its forward and gathered
again for its backward; per step each block costs two all-gathers and one reduce-scatter of its parameters.
``stage=2`` (``reshard_after_forward=False``): they stay gathered from the forward to the end of the backward
(one all-gather and one reduce-scatter per block; peak memory holds every gathered block). The root group keeps
its parameters from the forward to the backward in both stages (it is the first the backward needs).

A model built on the meta device need never be whole on a rank: :func:`shard_block` cuts one block as
:func:`shard_data_parallel` would, and ``parallelize(model, mesh, layout, on_block=shard_block)`` calls it on each
block as soon as the block is materialised and parallel, so its tensor shards are freed before the next block is
built (the strategies do so at stages 2 and 3). A rank then holds at most the dp shards of the blocks built, the
tensor shards of the modules outside the blocks (cut last, with the root) and one block in full and in its tensor
shard; :func:`shard_data_parallel` afterwards cuts the root. The weights are those of the same seed at stage 0.

Mixed precision is FSDP's ``mp_policy`` (default: none, parameters gathered and gradients reduced in their own
dtype); :func:`mixed_precision_policy` gives the one for a Lightning precision, which both strategies use.
``"bf16-mixed"`` (``param_dtype=bfloat16, reduce_dtype=float32``): the parameters stay float32 at rest and in the
optimizer; each group's shard is cast to bf16 before its all-gather (half the bytes on the wire and in the gathered
blocks), the forward and backward compute with the bf16 parameters (under the precision's autocast too), and the
bf16 gradients are upcast and reduce-scattered in float32, so the optimizer sees float32 gradients. Unlike stage
0's autocast, which casts only matmul operands, every FSDP-managed parameter is bf16 in the forward (norms, biases,
embeddings) and FSDP casts each block's floating-point input to bf16, so the residual stream between blocks is
bf16: losses differ from stage 0's by bf16 rounding (a few 1e-3 relative after a few steps), not bit for bit.
``"bf16-true"`` (``reduce_dtype=float32``): the parameters are bf16 already and gathered as they are; FSDP2 upcasts
their gradients, reduce-scatters the sum over replicas in float32 and rounds it to bf16 once (the reduce-scatter
costs float32's bytes; stage 0 all-reduces bf16 gradients in bf16). The parameters FSDP leaves whole are not cast.

What replaces the package's own per-step machinery: the reduce-scatter *is* the data-parallel average (do not use
:class:`~lightning_tp2d.training.GradientSync` or :func:`~lightning_tp2d.training.average_gradients_` with it), and
gradients are sharded over ``data_parallel``, so the global norm needs a sum over it too: :func:`clip_grad_norm_`
here (and :func:`grad_norm`), not :func:`lightning_tp2d.training.clip_grad_norm_`, which assumes replicas hold
equal, whole gradients. ``dp = 1``: nothing to shard; the model is returned unchanged (a ``UserWarning`` says so)
and trains as at stage 0. Gradient accumulation without a sync is FSDP's
``model.set_requires_gradient_sync(False)``; the parameters kept whole are still averaged each backward (what they
held before is equal on every replica, so the sum stays right: tests/test_fsdp_lifecycle.py checks it against stage 0
under the Trainer). :func:`gathered` shows the model as
at stage 0 (full tensor-parallel parameters) for reading weights, ``full_tensor()`` or a full state dict.

.. code-block:: python

    model = tp.parallelize(GPT2(cfg), mesh, "2d")
    shard_data_parallel(model, stage=3)             # before building the optimizer
    optimizer = torch.optim.AdamW(model.parameters())
    shard_optimizer_state(optimizer, mesh)          # lightning_tp2d.zero: slices of the parameters kept whole
    loss = model(idx, targets); loss.backward()     # gradients reduce-scattered during the backward
    clip_grad_norm_(model.parameters(), 1.0, mesh)  # dp shards included
    optimizer.step()                                # then the slices all-gathered
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.fsdp import DataParallelMeshDims, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_tp2d import training
from lightning_tp2d.comm import all_gather_along, all_reduce_along, axis_rank, axis_size
from lightning_tp2d.families import family_of
from lightning_tp2d.layouts import DATA_AXIS, handle_of
from lightning_tp2d.train_plan import FSDP_STAGES, reshards_after_forward

__all__ = ["FSDP_STAGES", "Stage0", "clip_grad_norm_", "gathered", "grad_norm", "is_sharded", "mixed_precision_policy",
           "shard_block", "shard_data_parallel", "shard_pipeline_stages", "stage0_specs"]



def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy | None:
    """FSDP's :class:`~torch.distributed.fsdp.MixedPrecisionPolicy` for a Lightning ``precision`` name (module
    docstring, mixed precision): ``"bf16-mixed"``: gathered and computed in bf16, reduced in float32 (parameters and
    their gradients stay float32 at rest); ``"bf16-true"``: reduced in float32 (the parameters are bf16 already);
    ``"32-true"``: ``None``, no policy. ``ValueError`` for another name."""
    if precision == "32-true":
        return None
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision == "bf16-true":
        return MixedPrecisionPolicy(reduce_dtype=torch.float32)
    raise ValueError(f"mixed_precision_policy: precision={precision!r} is not one of '32-true', 'bf16-mixed', "
                     "'bf16-true'")


def _dp_shard_dim(param: DTensor, dp: int) -> int | None:
    """The dim FSDP splits ``param``'s local shard along over ``data_parallel``: 0, unless a tensor axis splits dim
    0 in a strided way (GPT-2's fused q/k/v rows ``[q_c | k_c | v_c]``): a contiguous cut of such a shard has no
    DTensor placement that describes it (FSDP would still train right, but ``full_tensor()``, checkpoints and
    redistributes of the at-rest parameter would read the wrong elements). Then the first dim no placement splits
    strided whose local size ``dp`` divides (FSDP splits a dim other than 0 only evenly); ``None`` when there is
    none (a 1-D fused bias): that parameter stays whole (module docstring)."""
    strided = {pl.dim for pl in param.placements if isinstance(pl, _StridedShard)}
    if 0 not in strided:
        return 0
    local = param.to_local().shape
    return next((d for d in range(1, len(local)) if d not in strided and local[d] % dp == 0), None)


def _stage0_only(param: DTensor, dp: int) -> bool:
    """Whether the at-rest (dp-sharded) form of ``param`` has placements that ``torch.distributed.checkpoint`` or a
    redistribute cannot describe as boxes: a strided tensor-parallel split (GPT-2's fused q/k/v on the grids) under
    FSDP's data-parallel cut. Checkpoints hold such tensors in their stage-0 form (:class:`Stage0`)."""
    dim = _dp_shard_dim(param, dp)
    return dim is not None and any(isinstance(pl, _StridedShard) for pl in param.placements)


@dataclass(frozen=True)
class Stage0:
    """The tensor-parallel form a dp-sharded parameter had before FSDP (its stage-0 DTensor: ``placements`` on
    ``mesh``, global ``shape``/``stride``, this rank's ``local`` shape) and the dim FSDP cut its local shard along
    over ``data_parallel`` (``torch.chunk`` order: rank ``r`` holds chunk ``r``). Checkpoints store such a
    parameter, and each optimizer state of its shape, in this form (the same as a stage-0 run's), so they load
    under every stage, grid and dp size."""

    mesh: object
    placements: tuple
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    local: tuple[int, ...]
    dim: int

    def gather(self, sharded: torch.Tensor) -> DTensor:
        """The stage-0 DTensor of ``sharded`` (the parameter at rest, or a state of its shape): its dp chunks
        all-gathered (a collective over ``data_parallel``; every rank calls it)."""
        local = sharded.to_local() if isinstance(sharded, DTensor) else sharded
        dp = axis_size(self.mesh, DATA_AXIS)
        chunk = -(-self.local[self.dim] // dp)
        pad = [0, 0] * (local.dim() - 1 - self.dim) + [0, chunk - local.shape[self.dim]]
        padded = torch.nn.functional.pad(local.contiguous(), pad) if any(pad) else local.contiguous()
        full = all_gather_along(padded, self.mesh, DATA_AXIS, dim=self.dim).narrow(self.dim, 0, self.local[self.dim])
        return DTensor.from_local(full.contiguous(), self.mesh, self.placements, shape=torch.Size(self.shape),
                                  stride=self.stride)

    def empty(self, dtype: torch.dtype, device) -> DTensor:
        """A zero stage-0 DTensor to load a checkpoint's tensor into."""
        return DTensor.from_local(torch.zeros(self.local, dtype=dtype, device=device), self.mesh, self.placements,
                                  shape=torch.Size(self.shape), stride=self.stride)

    def chunk(self, stage0: DTensor) -> torch.Tensor:
        """This rank's dp chunk of a stage-0 DTensor's local tensor (what FSDP keeps at rest)."""
        dp, r = axis_size(self.mesh, DATA_AXIS), axis_rank(self.mesh, DATA_AXIS)
        local = stage0.to_local()
        chunks = torch.chunk(local, dp, dim=self.dim)  # (fewer than dp when the dim is short: FSDP pads empties)
        return chunks[r] if r < len(chunks) else local.narrow(self.dim, 0, 0)


def stage0_specs(module: nn.Module) -> dict[str, Stage0]:
    """Every parameter inside ``module`` (by its name in ``module``) that a checkpoint stores in its stage-0 form
    (:class:`Stage0`); empty when nothing is sharded."""
    specs = {}
    for prefix, m in module.named_modules():
        for name, spec in getattr(m, "tp2d_stage0", {}).items():
            specs[f"{prefix}.{name}" if prefix else name] = spec
    return specs


def _wrap_problem(where: str, param: nn.Parameter, mesh) -> str | None:
    """Why FSDP cannot take ``param`` (named ``where``) over ``data_parallel`` of ``mesh`` (``None``: it can)."""
    if not isinstance(param, DTensor):
        return f"parameter {where!r} is a plain tensor (FSDP on the root mesh needs DTensors on it)"
    if param.device_mesh != mesh:
        return f"parameter {where!r} is a DTensor on another mesh than the model's root mesh"
    if not param.placements[mesh.mesh_dim_names.index(DATA_AXIS)].is_replicate():
        return f"parameter {where!r} is already split over {DATA_AXIS!r} ({param.placements})"
    if not param.to_local().is_contiguous():
        return f"parameter {where!r} has a non-contiguous local shard"
    return None


def _average_over_dp(param: nn.Parameter, mesh, dp: int) -> None:
    """Post-accumulate hook of a parameter FSDP leaves whole: its gradient's mean over ``data_parallel``."""
    grad = param.grad.to_local()
    all_reduce_along(grad, mesh, DATA_AXIS)
    grad.div_(dp)


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block every FSDP group of ``model`` is gathered over ``data_parallel`` (a collective: every rank
    enters it) and its parameters are the unsharded ones, DTensors with the tensor-parallel placements of stage 0:
    ``full_tensor()``, :func:`~lightning_tp2d.parallelize.full_state_dict` and anything written for an unsharded
    model read them as they are. On exit the groups are sharded again. A model that is not sharded passes
    through. Holds every gathered group at once (this rank's tensor shard of the whole model). The gathered
    storage is freed on exit, and ``full_tensor()`` of a parameter replicated on every tensor axis returns its
    local tensor itself: copy (``.clone()``) what must outlive the block."""
    groups = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for group in groups:
        group.unshard()
    try:
        yield model
    finally:
        for group in groups:
            group.reshard()


def is_sharded(model: nn.Module) -> bool:
    """Whether :func:`shard_data_parallel` (or another ``fully_shard``) has been applied to ``model``."""
    return isinstance(model, FSDPModule)


def _check_stage(stage: int, caller: str) -> None:
    if stage not in FSDP_STAGES:
        raise ValueError(f"{caller}: stage={stage!r} is not one of {FSDP_STAGES} (stage 0 is no "
                         f"sharding, stage 1 is lightning_tp2d.zero.shard_optimizer_state)")


def _check_wrappable(module: nn.Module, mesh, what: str, skip: tuple[str, ...] = ()) -> None:
    """``ValueError`` naming the first parameter inside ``module`` FSDP cannot take over ``data_parallel`` of
    ``mesh`` (none of the submodules whose names start with one of ``skip``)."""
    for module_name, m in module.named_modules():
        if module_name.startswith(skip):
            continue
        for name, param in m.named_parameters(recurse=False):
            problem = _wrap_problem(f"{module_name}.{name}" if module_name else name, param, mesh)
            if problem:
                raise ValueError(f"{what} cannot wrap module {module_name or type(module).__name__!r} "
                                 f"({type(m).__name__}): {problem}")


@dataclass(frozen=True)
class _Group:
    """How a model's FSDP groups are cut (the same for every group of a model): at ``stage`` over
    ``data_parallel`` of ``mesh`` (``dp`` ranks) with FSDP's ``mp_policy``."""

    mesh: object
    dp: int
    stage: int
    mp_policy: MixedPrecisionPolicy

    def shard(self, module: nn.Module, params: list[tuple[str, nn.Parameter]], *, root: bool) -> None:
        """``fully_shard`` ``module``, whose own parameters (outside groups already cut) are ``params`` (by their
        names in ``module``): records their stage-0 forms (:class:`Stage0`, as ``module.tp2d_stage0``), leaves the
        ones no dim of which FSDP can cut whole (named in ``module.tp2d_whole``; :meth:`average_whole` hooks them).
        A block reshards after its forward at stage 3; the root never does (the backward needs it first)."""
        whole = {p for _, p in params if _dp_shard_dim(p, self.dp) is None}
        module.tp2d_whole = tuple(name for name, p in params if p in whole)
        module.tp2d_stage0 = {name: Stage0(p.device_mesh, tuple(p.placements), tuple(p.shape), tuple(p.stride()),
                                           tuple(p.to_local().shape), _dp_shard_dim(p, self.dp))
                              for name, p in params if _stage0_only(p, self.dp)}
        again = reshards_after_forward(self.stage, self.dp) and not root
        fully_shard(module, mesh=self.mesh, reshard_after_forward=again,
                    dp_mesh_dims=DataParallelMeshDims(shard=DATA_AXIS), ignored_params=whole,
                    shard_placement_fn=lambda param: Shard(_dp_shard_dim(param, self.dp)), mp_policy=self.mp_policy)
        module.tp2d_sharding = self

    def average_whole(self, model: nn.Module) -> None:
        """Hook every parameter the groups inside ``model`` keep whole: its gradient's mean over ``data_parallel``
        after each backward. Once, when the last group is cut: ``module.to(...)`` between cutting a block and the
        root (the strategies move and convert the model there) replaces a DTensor parameter FSDP does not manage
        by a new ``Parameter``, which would lose a hook registered earlier."""
        mesh, dp = self.mesh, self.dp
        for module in model.modules():
            for name in getattr(module, "tp2d_whole", ()):
                module.get_parameter(name).register_post_accumulate_grad_hook(lambda p: _average_over_dp(p, mesh, dp))


def _one_mesh(params, what: str):
    """The one mesh object ``params`` (DTensors) hold. DTensor may hand out an equal mesh object made earlier in
    the process; FSDP needs the very object the parameters hold."""
    meshes = {id(p.device_mesh): p.device_mesh for p in params}
    if len(meshes) > 1:
        raise ValueError(f"{what}: the model's parameters hold different (equal) mesh objects; parallelize it on "
                         "one mesh")
    return next(iter(meshes.values()), None)


def shard_block(block: nn.Module, stage: int = 3, *, mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """Cut one transformer ``block`` of a model being parallelized over ``data_parallel`` now, as
    :func:`shard_data_parallel` cuts each block (its own FSDP group at ZeRO ``stage``, ``mp_policy`` as there);
    returns ``block``. Once it is cut, the block's tensor-parallel shards are freed (this rank keeps its dp
    shard of them).

    For building a model block by block: ``parallelize(model, mesh, layout, on_block=shard_block)`` materialises
    a meta-device model one block at a time, so a rank never holds more than the dp shards of the blocks done,
    the tensor shards of the modules outside the blocks (embeddings, final norm, head) and one module in full. Then
    :func:`shard_data_parallel` with the same ``stage`` and ``mp_policy`` cuts the root (and any block not yet cut)
    and hooks the parameters kept whole (train only after it); it refuses blocks cut with other ones. With
    ``dp = 1`` the block is returned unchanged."""
    what = "shard_block"
    _check_stage(stage, what)
    if is_sharded(block):
        raise ValueError(f"{what}: block is already sharded over data_parallel (fully_shard applied)")
    params = list(block.named_parameters())
    mesh = _one_mesh([p for _, p in params if isinstance(p, DTensor)], what)
    if mesh is None or DATA_AXIS not in (mesh.mesh_dim_names or ()):
        raise ValueError(f"{what} expects a block of a model parallelized by lightning_tp2d.parallelize (DTensor "
                         f"parameters on a mesh with a {DATA_AXIS!r} axis), got {type(block).__name__}")
    dp = axis_size(mesh, DATA_AXIS)
    if dp > 1:
        _check_wrappable(block, mesh, what)
        _Group(mesh, dp, stage, mp_policy or MixedPrecisionPolicy()).shard(block, params, root=False)
    return block


def shard_data_parallel(model: nn.Module, stage: int = 3, *,
                        mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """Shard ``model`` (parallelized by :func:`~lightning_tp2d.parallelize`) over its mesh's ``data_parallel``
    axis with FSDP2 at ZeRO ``stage`` 2 or 3 (module docstring), in place; returns ``model``.

    ``mp_policy`` is FSDP's :class:`~torch.distributed.fsdp.MixedPrecisionPolicy` for every group (default: none,
    parameters gathered and gradients reduced in their own dtype; :func:`mixed_precision_policy` gives the one for a
    Lightning precision). Blocks already cut by :func:`shard_block` are kept (they must have this ``stage`` and
    ``mp_policy``). Build the optimizer after this call. Raises
    ``ValueError`` for a stage outside ``FSDP_STAGES``, an unparallelized or already sharded model, or a module
    whose parameters FSDP cannot shard (naming it), before anything changes. With ``dp = 1`` it warns and returns
    ``model`` unchanged."""
    what = "shard_data_parallel"
    _check_stage(stage, what)
    handle = handle_of(model)
    if handle is None:
        raise ValueError(f"shard_data_parallel expects a model parallelized by lightning_tp2d.parallelize, got a "
                         f"plain {type(model).__name__}")
    if is_sharded(model):
        raise ValueError("shard_data_parallel: model is already sharded over data_parallel (fully_shard applied)")
    mesh = handle.mesh
    dp = axis_size(mesh, DATA_AXIS)
    if dp == 1:
        warnings.warn("shard_data_parallel: data_parallel size is 1, nothing to shard; the model is unchanged",
                      UserWarning, stacklevel=2)
        return model
    ids = {id(b) for b in family_of(model).block_modules(model)}
    blocks = [(name, b) for name, b in model.named_modules() if id(b) in ids]
    done = tuple(f"{name}." for name, b in blocks if is_sharded(b))
    _check_wrappable(model, mesh, what, skip=done)
    group = _Group(_one_mesh([p for n, p in model.named_parameters() if not n.startswith(done)], what), dp, stage,
                   mp_policy or MixedPrecisionPolicy())
    for name, block in blocks:
        cut = getattr(block, "tp2d_sharding", None) if is_sharded(block) else group
        if cut != group:  # (another fully_shard, another stage, policy or mesh)
            how = "by another fully_shard" if cut is None else f"at stage {cut.stage} with mp_policy={cut.mp_policy}"
            raise ValueError(f"shard_data_parallel(stage={stage}, mp_policy={group.mp_policy}): block {name!r} is "
                             f"already sharded {how}; cut every block of a model with one stage, policy and mesh")
    for _, block in blocks:
        if not is_sharded(block):
            group.shard(block, list(block.named_parameters()), root=False)
    inside = tuple(f"{name}." for name, _ in blocks)
    group.shard(model, [(n, p) for n, p in model.named_parameters() if not n.startswith(inside)], root=True)
    group.average_whole(model)
    return model


def shard_pipeline_stages(model: nn.Module, stage_modules, stage: int = 3, *,
                          mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """:func:`shard_data_parallel` for a model cut into pipeline stages (:class:`~lightning_tp2d.pipeline.Pipeline`,
    ``model`` parallelized on this rank's stage mesh): one FSDP group per block the rank holds and, as the root of
    each of its ``stage_modules`` (the modules torch's schedule calls), one group of that stage's other parameters (the
    embedding on the first stage; the final norm, the head and a tied embedding's copy on the last). The stage
    modules are what FSDP calls: their forward gathers the root group, and torch's ``PipelineStage`` recognises an
    ``FSDPModule`` and reduce-scatters once per step, after the last micro-batch. Returns ``model``; ``dp = 1``: a
    warning, nothing sharded."""
    what = "shard_pipeline_stages"
    _check_stage(stage, what)
    handle = handle_of(model)
    if handle is None:
        raise ValueError(f"{what} expects a model parallelized by lightning_tp2d.parallelize")
    mesh = handle.mesh
    dp = axis_size(mesh, DATA_AXIS)
    if dp == 1:
        warnings.warn(f"{what}: data_parallel size is 1, nothing to shard; the model is unchanged", UserWarning,
                      stacklevel=2)
        return model
    if any(is_sharded(m) for m in stage_modules):
        raise ValueError(f"{what}: the stages are already sharded over data_parallel")
    _check_wrappable(model, mesh, what)
    group = _Group(_one_mesh([p for p in model.parameters() if isinstance(p, DTensor)], what), dp, stage,
                   mp_policy or MixedPrecisionPolicy())
    for module in stage_modules:
        for block in module.blocks:
            group.shard(block, list(block.named_parameters()), root=False)
        group.shard(module, [(n, p) for n, p in module.named_parameters() if not n.startswith("blocks.")],
                    root=True)
        if getattr(module, "tp2d_stage0", None):  # (the ends are never strided: checkpoints read the model's tree)
            raise ValueError(f"{what}: a stage's own parameters {sorted(module.tp2d_stage0)} have strided "
                             "tensor-parallel cuts, which its checkpoint could not name")
    group.average_whole(model)  # the blocks' parameters kept whole; the stages' own (outside the model's tree):
    for module in stage_modules:
        for name in module.tp2d_whole:
            module.get_parameter(name).register_post_accumulate_grad_hook(
                lambda p: _average_over_dp(p, group.mesh, group.dp))
    return model


def _split_over_dp(grad: torch.Tensor, mesh) -> bool:
    return isinstance(grad, DTensor) and not grad.placements[mesh.mesh_dim_names.index(DATA_AXIS)].is_replicate()


@torch.no_grad()
def grad_norm(parameters, mesh, norm_type: float = 2.0) -> torch.Tensor:
    """Norm of the whole gradient when gradients are sharded over ``data_parallel`` too (FSDP), the same float32
    scalar on every rank. Per replica, :func:`lightning_tp2d.training.grad_norm` counts every element of its dp
    shards once over the tensor axes (``n_d``) and of the parameters kept whole (``w``, equal on every replica);
    the norm is ``(sum_d n_d^p + w^p)^(1/p)``, or ``max(max_d n_d, w)`` for the inf-norm."""
    grads = [p for p in parameters if p.grad is not None]
    split = [p for p in grads if _split_over_dp(p.grad, mesh)]
    shard = training.grad_norm(split, mesh, norm_type)
    whole = training.grad_norm([p for p in grads if not _split_over_dp(p.grad, mesh)], mesh, norm_type)
    if math.isinf(norm_type):
        all_reduce_along(shard, mesh, DATA_AXIS, op="max")
        return torch.maximum(shard, whole.to(shard.device))
    total = shard.pow(norm_type)
    all_reduce_along(total, mesh, DATA_AXIS)
    return (total + whole.to(total.device).pow(norm_type)).pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, mesh, norm_type: float = 2.0) -> torch.Tensor:
    """:func:`lightning_tp2d.training.clip_grad_norm_` for data-parallel-sharded gradients: the scale
    ``min(1, max_norm / (norm + 1e-6))`` uses :func:`grad_norm` (dp shards included); returns the norm."""
    parameters = [p for p in parameters if p.grad is not None]
    total = grad_norm(parameters, mesh, norm_type)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in parameters:
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        g.mul_(coef.to(g.dtype))
    return total
