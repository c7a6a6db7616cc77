"""Pipeline parallelism over the layouts: ``pp`` stages of whole blocks, each stage a layout of its own ranks.

The mesh is ``pipeline x data_parallel x (the layout's grid or ring)`` (:func:`~lightning_tp2d.init_mesh` with
``pipeline_parallel_size``). A :class:`Pipeline` cuts the plain model into stages and parallelizes each stage's
modules with the layout on that stage's ``dp x p`` sub-mesh, then runs a training step with torch's own schedules
(``torch.distributed.pipelining``):

* **Stages hold whole blocks**: the embedding on the first stage, the final norm, the head and the loss on the last
  one, the blocks split into contiguous runs balanced by their FLOPs (:func:`split_blocks`: a long vocabulary's head
  counts, so the last stage takes fewer blocks). The modules a stage does not hold are :class:`~lightning_tp2d.nn.
  stage.Elsewhere` placeholders, so every parameter keeps its global name (``transformer.h.7...``). A tied head
  (GPT-2, a tied Llama) keeps a copy of the embedding on the last stage: the two copies start equal, their gradients
  are summed over the two stages after each step (one all-reduce), so they stay equal, as Megatron-LM ties them.
* **Between stages** each rank sends its own activation shard to the rank with the same data-parallel and layout
  coordinates on the next stage (the ``pipeline`` axis group): shards, never a gathered activation.
* **Schedules** (:data:`SCHEDULES`): ``gpipe``, ``1f1b`` and ``interleaved_1f1b`` (``virtual_stages`` per rank,
  round-robin); ``microbatches`` micro-batches per step; the gradients are those of the mean of the micro-batches'
  mean losses, the full batch's mean loss when every micro-batch counts the same tokens.
* **Data parallelism**: at ZeRO 0 and 1 the gradients are averaged over ``data_parallel`` after the schedule; at 2
  and 3 (``zero_stage``) FSDP2 shards each stage (:func:`lightning_tp2d.fsdp.shard_pipeline_stages`) and torch's
  schedule reduce-scatters once, after the last micro-batch.

:meth:`Pipeline.step` returns the step's loss on every rank (the last stage's, broadcast along ``pipeline``);
:meth:`Pipeline.clip_grad_norm_` clips by the global norm over every stage and shard (the tied copy counted once).

:meth:`Pipeline.save` / :meth:`Pipeline.load`: a sharded checkpoint of the whole model, every stage writing its own
shards under the global names, that loads at any other pipeline size or split, without stages
(:func:`lightning_tp2d.checkpoint.load_into`) and on one device.

Activation checkpointing (``"full"``, ``"selective"``) applies to each stage's blocks as to a model without stages.

The strategies and ``tp2d-train`` run it (``pipeline_parallel_size``): the model's call runs :meth:`Pipeline.forward`
(:func:`run_model_as_pipeline`), whose training step holds its gradients until the strategy's backward
(:meth:`Pipeline.deferred_step`, :meth:`Pipeline.backward`). A dead or stalled stage ends the others' schedule with
a :class:`~lightning_tp2d.comm.CommError` naming it.

Not yet: packed documents, compile and the zero-bubble schedules (they need the layers' weight
gradients apart, which the layouts' autograd functions do not give).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_tp2d.families import anatomy, family_of
from lightning_tp2d.layouts import DEFAULT_LAYOUT, Layout, get_layout
from lightning_tp2d.nn.stage import Elsewhere, present
from lightning_tp2d.options import TPOptions
from lightning_tp2d import recompute
from lightning_tp2d.parallelize import ACTIVATION_CHECKPOINTING, checkpoint_activations, parallelize
from lightning_tp2d.training import average_gradients_, grad_norm
from lightning_tp2d.train_plan import PIPELINE_AXIS, PP_SCHEDULES, fsdp_shards, pipeline_problem

__all__ = ["SCHEDULES", "Pipeline", "block_costs", "micro_batch_problem", "pipeline_of", "run_model_as_pipeline",
           "split_blocks", "stage_of_blocks"]

SCHEDULES = PP_SCHEDULES  # parallel.pp_schedule's values


def _schedule_class(name: str):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}[name]


def block_costs(cfg, seq: int) -> tuple[float, float, float]:
    """``(embedding, block, head)`` training FLOPs per token (forward and backward: 3x the forward's): a block's
    linears ``6 x`` their weights plus causal attention's scores and values (``6 h seq``: ``2 x 2 h seq / 2`` forward,
    twice that backward); the head's ``6 h V``; the embedding's lookup none."""
    a = anatomy(cfg)
    h = cfg.n_embd
    q_out = cfg.n_head * (h // cfg.n_head)
    linears = h * (q_out + 2 * a.kv_width) + q_out * h + h * a.mlp_width * (3 if a.gated_mlp else 2)
    return 0.0, 6.0 * linears + 6.0 * h * seq, 6.0 * h * cfg.vocab_size


def split_blocks(n_layer: int, stages: int, costs: tuple[float, float, float] = (0.0, 1.0, 0.0)) -> list[range]:
    """The blocks of each of ``stages`` stages: contiguous runs, at least one block each, that minimise the largest
    stage's cost (``costs``: the embedding's, one block's and the head's, from :func:`block_costs`; the first stage
    also pays the embedding, the last the head). Among equally good splits, earlier stages take fewer blocks (1F1B's
    first stage holds the most micro-batches' activations). ``ValueError`` when there are fewer blocks than stages."""
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"pipeline stages must be a positive int, got {stages!r}")
    if n_layer < stages:
        raise ValueError(f"{n_layer} blocks cannot fill {stages} pipeline stages (each needs at least one block); "
                         f"use at most {n_layer} stages")
    embed, block, head = costs

    def cost(i: int, lo: int, hi: int) -> float:
        return (hi - lo) * block + (embed if i == 0 else 0.0) + (head if i == stages - 1 else 0.0)

    # best[i][j]: the least largest cost of stages i.. over blocks j.. (dynamic programme; n_layer, stages small)
    best = [[math.inf] * (n_layer + 1) for _ in range(stages + 1)]
    cut = [[0] * (n_layer + 1) for _ in range(stages + 1)]
    best[stages][n_layer] = 0.0
    for i in range(stages - 1, -1, -1):
        for j in range(n_layer - (stages - i), -1, -1):
            for k in range(j + 1, n_layer - (stages - i - 1) + 1):
                value = max(cost(i, j, k), best[i + 1][k])
                if value < best[i][j] - 1e-9 * max(1.0, value):
                    best[i][j], cut[i][j] = value, k
    out, j = [], 0
    for i in range(stages):
        out.append(range(j, cut[i][j]))
        j = cut[i][j]
    return out


def stage_of_blocks(splits: Sequence[range], block: int) -> int:
    """The stage whose run of :func:`split_blocks` holds ``block``."""
    return next(i for i, r in enumerate(splits) if block in r)


class StageModule(nn.Module):
    """One pipeline stage of ``model``: the embedding when ``first``, its ``blocks`` (indices into the family's
    blocks), the final norm when ``last`` (the head and the loss run in the schedule's loss function, on the last
    stage). It holds ``model`` without registering it (the :class:`Pipeline` does), so several stages of one rank
    (interleaved) share it; it registers its blocks and ``ends`` (the model's modules outside the blocks this stage
    runs: embeddings, final norm, head, a tied embedding's copy), so that its parameters are the stage's (FSDP's
    groups at ZeRO 2/3: :func:`lightning_tp2d.fsdp.shard_pipeline_stages`)."""

    def __init__(self, model: nn.Module, blocks: range, first: bool, last: bool, selective: bool = False,
                 ends: Sequence[nn.Module] = ()) -> None:
        super().__init__()
        self.__dict__["model"] = model  # not a submodule: the stages share the one model
        family = family_of(model)
        every = list(family.block_modules(model))
        self.blocks = nn.ModuleList(every[i] for i in blocks)
        self.ends = nn.ModuleList(ends)
        self.first, self.last, self.selective = first, last, selective

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with _recipes(self.selective and self.model.training):
            if self.first:  # (Pipeline.step checked the ids on every rank, before any stage ran)
                x = self.model.embed(x)
            for block in self.blocks:
                x = block(x)
            return self.model.final_norm(x) if self.last else x


def _recipes(selective: bool):
    """``"selective"`` checkpointing's context (:func:`lightning_tp2d.recompute.saving_recipes`) while gradients are
    recorded: the stages run the model's parts, not its ``forward``, which :func:`~lightning_tp2d.parallelize.
    checkpoint_activations` wraps."""
    return recompute.saving_recipes() if selective and torch.is_grad_enabled() else contextlib.nullcontext()


def _roles_around_blocks(model: nn.Module) -> tuple[list[str], list[str]]:
    """The family's role paths before its first block (the embeddings) and after its last one (final norm, head)."""
    family = family_of(model)
    prefix = family.blocks + "."
    paths = [path for path, _ in family.module_roles(model)]
    inside = [i for i, path in enumerate(paths) if path.startswith(prefix)]
    return paths[:inside[0]], paths[inside[-1] + 1:]


def _replace(model: nn.Module, path: str, stage: int) -> None:
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    if isinstance(parent, nn.ModuleList):
        parent[int(attr)] = Elsewhere(stage)
    else:
        setattr(parent, attr, Elsewhere(stage))


def micro_batch_problem(spec: Layout, p: int, microbatches: int, batch: int) -> str | None:
    """Why a batch of ``batch`` sequences cannot run as ``microbatches`` micro-batches on the layout ``spec`` of ``p``
    ranks (it does not split, or a micro-batch does not split into the layout's batch shards), naming the numbers;
    ``None`` when it can. The one statement of the rule: :meth:`Pipeline.check_batch` and the strategies ask it."""
    if batch % microbatches:
        return f"batch size {batch} does not split into microbatches={microbatches}: use a multiple of {microbatches}"
    problem = spec.batch_problem(p, batch // microbatches)
    return None if problem is None else f"each of the {microbatches} micro-batches: {problem}"


def pipeline_of(model: nn.Module) -> "Pipeline | None":
    """The :class:`Pipeline` ``model`` runs as (:func:`run_model_as_pipeline`), or ``None``."""
    return model.__dict__.get("_tp2d_pipeline")


def run_model_as_pipeline(pipeline: "Pipeline") -> None:
    """Make ``pipeline.model``'s call run the pipeline (:meth:`Pipeline.forward`): ``model(idx, targets)`` in a
    ``training_step`` runs the step's forward and backward over every stage and returns the loss, which needs no
    backward of its own (the strategies skip it); under ``no_grad`` the forward-only schedule. The model keeps its
    parameters' names and its ``state_dict``."""
    model = pipeline.model
    model.__dict__["_tp2d_pipeline"] = pipeline
    model.forward = pipeline.forward  # an instance attribute: nn.Module.__call__ finds it before the class's


class Pipeline:
    """``model`` (a registered family's plain model, built on CPU from the same seed on every rank) cut into
    ``pp x virtual_stages`` stages over the ``pipeline`` axis of ``mesh``, each stage parallelized with ``layout``
    on its own ``data_parallel x p`` ranks (module docstring). ``ValueError`` naming the numbers before any
    communication for: a mesh without a ``pipeline`` axis, fewer blocks than stages, an unknown schedule, fewer
    micro-batches than ranks under 1F1B (or not a multiple of them, interleaved).

    ``schedule``: one of :data:`SCHEDULES`; ``microbatches`` per step (default ``pp x virtual_stages``);
    ``virtual_stages``: stages per rank (``interleaved_1f1b`` only), rank ``r`` holding stages ``r, r + pp, ...``;
    ``options``: the layout's :class:`~lightning_tp2d.options.TPOptions`; ``seq``: the sequence length the stages
    are balanced for (attention's share of a block grows with it; default the model's ``block_size``);
    ``activation_checkpointing``: ``"none"``, ``"full"`` or ``"selective"``, as
    :func:`~lightning_tp2d.parallelize.checkpoint_activations` applies them to a model without stages;
    ``zero_stage`` 2 or 3: each stage sharded over ``data_parallel`` with FSDP2 (:meth:`shard_data_parallel`;
    ``mp_policy`` its mixed precision, :func:`lightning_tp2d.fsdp.mixed_precision_policy`); 0 and 1 change nothing
    here (ZeRO-1 slices the optimizer's state: :func:`lightning_tp2d.zero.shard_optimizer_state` on
    :attr:`stage_mesh`).

    ``model`` is changed in place (the blocks other stages hold become placeholders) and kept as
    :attr:`model`; optimise :meth:`parameters`. A model built on the meta device (seed the generator the same on
    every rank first) is materialised one module at a time, as :func:`~lightning_tp2d.parallelize.parallelize`
    does: a rank never holds more than its stage's shards and one module in full, and the weights are those of an
    eager build from the same seed (the other stages' modules are drawn and dropped in order)."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, layout: str | Layout = DEFAULT_LAYOUT, *,
                 schedule: str = "1f1b", microbatches: int | None = None, virtual_stages: int = 1,
                 options: TPOptions | None = None, seq: int | None = None,
                 activation_checkpointing: str = "none", zero_stage: int = 0, mp_policy=None) -> None:
        family = family_of(model)
        if family is None:
            raise TypeError(f"Pipeline expects a registered model family's model, got {type(model).__name__}")
        names = mesh.mesh_dim_names or ()
        if PIPELINE_AXIS not in names:
            raise ValueError(f"Pipeline needs a mesh with a {PIPELINE_AXIS!r} axis (init_mesh(..., "
                             f"pipeline_parallel_size=pp) with pp >= 2), got axes {names}")
        pp = mesh.size(names.index(PIPELINE_AXIS))
        problem = pipeline_problem(pp, schedule, microbatches, virtual_stages)
        if problem:
            raise ValueError(problem)
        microbatches = pp * virtual_stages if microbatches is None else microbatches
        meta = any(q.is_meta for q in model.parameters())
        cfg = model.config
        stages = pp * virtual_stages
        self.splits = split_blocks(cfg.n_layer, stages, block_costs(cfg, seq or cfg.block_size))
        self.pp, self.virtual_stages, self.microbatches, self.schedule_name = pp, virtual_stages, microbatches, schedule
        self.rank = mesh.get_local_rank(PIPELINE_AXIS)
        self.stage_indices = [self.rank + k * pp for k in range(virtual_stages)]
        self.first, self.last = 0 in self.stage_indices, stages - 1 in self.stage_indices
        self.mesh = mesh
        self.stage_mesh = mesh[tuple(n for n in names if n != PIPELINE_AXIS)]
        self.spec = get_layout(layout, options)

        # cut: the blocks, embeddings, final norm and head other stages hold become placeholders
        mine = {b for i in self.stage_indices for b in self.splits[i]}
        before, after = _roles_around_blocks(model)
        tied = family.tied(model)  # {head path: embedding path}
        # a meta-device model: every role's module in init order, so that parallelize draws the other stages' init
        # too (and drops it) and this stage's weights are the whole model's from the same seed
        order = [path for path, _ in family.module_roles(model)] if meta else []
        roles = {path: model.get_submodule(path) for path in order}
        self.tied_copies = [tied[path] for path in after if path in tied] if pp > 1 else []
        blocks = list(family.block_modules(model))
        for b in range(len(blocks)):
            if b not in mine:
                _replace(model, f"{family.blocks}.{b}", stage_of_blocks(self.splits, b) % pp)
        keep_before = set(before) if self.first else set(self.tied_copies) if self.last else set()
        for path in before:
            if path not in keep_before:
                _replace(model, path, 0)
        if not self.last:
            for path in after:
                _replace(model, path, pp - 1)
        others = {path: m for path, m in roles.items() if not present(model, path) and path not in tied}
        parallelize(model, self.stage_mesh, self.spec, elsewhere=(order, others) if meta else None)
        if activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            raise ValueError(f"activation_checkpointing={activation_checkpointing!r} is not one of "
                             f"{list(ACTIVATION_CHECKPOINTING)}")
        if activation_checkpointing == "full":  # each block's forward, wrapped in place (the stages call it)
            checkpoint_activations(model, "full")
        self.selective = activation_checkpointing == "selective"
        self.model = model
        self.plan = None  # the strategies' TrainPlan this pipeline runs, when a strategy built it

        held = {path: model.get_submodule(path) for path in before + after if present(model, path)}
        ends = {0: [held[p] for p in before if p in held],
                stages - 1: [held[p] for p in after if p in held] + [held[p] for p in self.tied_copies if p in held]}
        self._stage_modules = [StageModule(model, self.splits[i], i == 0, i == stages - 1, self.selective,
                                           ends.get(i, [])) for i in self.stage_indices]
        self.zero_stage = 0
        self._schedules: dict[tuple, object] = {}  # one per micro-batch shape and mode (torch's stages keep buffers)
        self.sync_gradients = True  # step(): average over data_parallel after the schedule
        self._pending: list[tuple[nn.Parameter, torch.Tensor]] = []  # forward()'s gradients, until backward()
        self._pending_loss: torch.Tensor | None = None
        self._tied_group = _first_and_last_groups(mesh, pp) if tied and pp > 1 else None
        self._last_rank = dist.get_global_rank(mesh.get_group(PIPELINE_AXIS), pp - 1)
        if zero_stage:
            self.shard_data_parallel(zero_stage, mp_policy)

    def shard_data_parallel(self, zero_stage: int, mp_policy=None) -> None:
        """ZeRO ``zero_stage`` over ``data_parallel``: 0 and 1 change nothing here (1 slices the optimizer's state:
        :func:`lightning_tp2d.zero.shard_optimizer_state` on the stage mesh); 2 and 3 shard this rank's stages with
        FSDP2 (:func:`lightning_tp2d.fsdp.shard_pipeline_stages`, ``mp_policy`` its mixed precision): each block a
        group, each stage's other parameters its root group; torch's schedule reduce-scatters once per step, which
        is the data-parallel average. Before the first step and before building the optimizer."""
        from lightning_tp2d import fsdp

        if self._schedules:
            raise RuntimeError("Pipeline.shard_data_parallel: shard before the first step")
        if fsdp_shards(zero_stage, self._dp):
            fsdp.shard_pipeline_stages(self.model, self._stage_modules, zero_stage, mp_policy=mp_policy)
            self.zero_stage = zero_stage

    @property
    def _dp(self) -> int:
        return self.stage_mesh.size(self.stage_mesh.mesh_dim_names.index("data_parallel"))

    @property
    def fsdp(self) -> bool:
        """FSDP2 shards the stages over ``data_parallel`` (ZeRO 2/3): gradients are reduce-scattered by the
        schedule, not averaged after it."""
        return fsdp_shards(self.zero_stage, self._dp)

    def _schedule(self, idx: torch.Tensor, training: bool):
        """torch's schedule (and stages) for batches of ``idx``'s shape, made on first use: a
        :class:`~torch.distributed.pipelining.PipelineStage` infers and keeps its activations' shapes, so a batch of
        another size (a validation loader's, an epoch's last) or an evaluation gets stages of its own."""
        key = (tuple(idx.shape), training)
        if key not in self._schedules:
            from torch.distributed.pipelining import PipelineStage

            device = _device(self.stage_mesh)
            group = self.mesh.get_group(PIPELINE_AXIS)
            n = self.pp * self.virtual_stages
            stages = [PipelineStage(module, i, n, device, group=group)
                      for module, i in zip(self._stage_modules, self.stage_indices)]
            cls = _schedule_class(self.schedule_name)
            self._schedules[key] = cls(stages if self.schedule_name == "interleaved_1f1b" else stages[0],
                                       n_microbatches=self.microbatches, loss_fn=self._loss, scale_grads=False)
        return self._schedules[key]

    def _loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # each micro-batch's mean loss over the micro-batches: the backward then leaves the gradient of their mean
        # (torch's scale_grads divides only the stage modules' own gradients afterwards, not the embedding's and the
        # head's, nor the layouts' shard leaves before they reach the parameters)
        with _recipes(self.selective and self.model.training):  # (the grids' head: its mirrored block a recipe)
            return self.model.lm_head(x, targets) / self.microbatches

    def parameters(self):
        """This rank's parameters (its stages' shards; on the last stage of a tied model, the embedding's copy)."""
        return self.model.parameters()

    def named_parameters(self):
        return self.model.named_parameters()

    def _tied_parameters(self) -> list[nn.Parameter]:
        return [q for path in self.tied_copies if present(self.model, path)
                for q in self.model.get_submodule(path).parameters()]

    def check_batch(self, idx: torch.Tensor) -> None:
        """``ValueError`` naming the numbers unless ``idx``'s batch splits into the micro-batches and each
        micro-batch into the layout's batch shards (:func:`micro_batch_problem`)."""
        p = self.stage_mesh.size() // self._dp
        problem = micro_batch_problem(self.spec, p, self.microbatches, idx.shape[0])
        if problem:
            raise ValueError(problem)

    def step(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One forward and backward of this replica's batch ``idx`` / ``targets`` (``[B, T]``, the same on every
        stage of the replica; only the first stage reads ``idx``, only the last ``targets``), gradients accumulated
        into the parameters' ``.grad`` (tied copies summed; averaged over ``data_parallel`` when
        :attr:`sync_gradients`). Returns the loss (the mean of the micro-batches' losses), the same 0-d float32
        tensor on every rank of the pipeline."""
        loss = self._run(idx, targets, training=True)
        self._sum_tied_copies()
        if self.sync_gradients:
            self.average_gradients()
        return loss

    def average_gradients(self) -> None:
        """Average every gradient over ``data_parallel`` (ZeRO 0 and 1: each replica's whole gradient; under FSDP the
        schedule's reduce-scatter averaged them)."""
        if not self.fsdp:
            average_gradients_(self.model, self.stage_mesh)

    def _sum_tied_copies(self) -> None:
        tied = self._tied_parameters()
        if self._tied_group is None or not tied:
            return
        for q in tied:
            grad = q.grad if q.grad is not None else torch.zeros_like(q)
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            dist.all_reduce(local, group=self._tied_group)
            if q.grad is None:
                q.grad = grad

    def deferred_step(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """:meth:`step` whose gradients are held back until :meth:`backward`: the parameters' ``.grad`` are as before
        the call when it returns. Lightning's loop zeroes the gradients between the ``training_step`` (where the
        model's call runs the schedule's forward and backward) and the backward of its loss; the strategies call
        :meth:`backward` there. Not averaged over ``data_parallel`` (:meth:`average_gradients`, after the backward
        that ends an accumulation window)."""
        if self.waits_for_backward:
            raise RuntimeError("a pipelined training step ran while the previous one's gradients still wait for their "
                               "backward: call backward (fabric.backward / Lightning's loop) on each step's loss")
        params = [q for q in self.model.parameters() if q.requires_grad]
        before = [q.grad for q in params]
        for q in params:
            q.grad = None
        try:
            loss = self._run(idx, targets, training=True)
            self._sum_tied_copies()
            self._pending = [(q, q.grad) for q in params if q.grad is not None]
        finally:
            for q, grad in zip(params, before):
                q.grad = grad
        self._pending_loss = loss
        return loss

    @torch.no_grad()
    def backward(self, loss: torch.Tensor) -> None:
        """Add the gradients of the last :meth:`deferred_step` to the parameters' ``.grad``, scaled by ``loss`` over
        that step's loss (``loss``: the step's loss times a constant, as a Trainer divides it by
        ``accumulate_grad_batches``; the ratio stays on the device, no host read)."""
        if self._pending_loss is None:
            raise RuntimeError("backward of a pipelined loss without its training step: call the model first")
        step_loss = self._pending_loss
        scale = torch.where(step_loss == 0, torch.ones_like(step_loss),
                            loss.detach().float() / torch.where(step_loss == 0, torch.ones_like(step_loss), step_loss))
        for q, grad in self._pending:
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            local.mul_(scale.to(local.dtype))
            if q.grad is None:
                q.grad = grad
            else:
                mine = q.grad.to_local() if hasattr(q.grad, "to_local") else q.grad
                mine.add_(local)
        self._pending, self._pending_loss = [], None

    @property
    def waits_for_backward(self) -> bool:
        """A :meth:`deferred_step` ran and its gradients wait for :meth:`backward`."""
        return self._pending_loss is not None

    @torch.no_grad()
    def evaluate(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of ``idx`` / ``targets`` (forward only, torch's ``schedule.eval``), the same 0-d float32 tensor on
        every rank of the pipeline; no gradients."""
        return self._run(idx, targets, training=False)

    def _run(self, idx: torch.Tensor, targets: torch.Tensor, training: bool) -> torch.Tensor:
        self.check_batch(idx)
        self.model.check_input(idx, targets)  # on every stage: a bad id fails every rank alike, before any send
        schedule = self._schedule(idx, training)
        losses: list[torch.Tensor] = []
        args = (idx,) if self.first else ()
        kwargs = {"target": targets, "losses": losses} if self.last else {}
        with _naming_stage_failures(f"the {self.schedule_name} schedule's point-to-point along "
                                    f"'{PIPELINE_AXIS}' (stage rank {self.rank} of {self.pp})"):
            (schedule.step if training else schedule.eval)(*args, **kwargs)
        device = _device(self.stage_mesh)
        loss = torch.stack([x.detach().float() for x in losses]).sum() if self.last else \
            torch.zeros((), dtype=torch.float32, device=device)
        dist.broadcast(loss, self._last_rank, group=self.mesh.get_group(PIPELINE_AXIS))
        return loss

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, doc_ids=None) -> torch.Tensor:
        """What the pipelined model's call does (:func:`run_model_as_pipeline`): with gradients recorded and the
        model in training mode, :meth:`deferred_step` (the schedule's backward runs inside: the returned loss has no
        graph, and the strategies' backward of it adds the gradients); else :meth:`evaluate`. Logits (no
        ``targets``: generation, ``predict``) and packed documents are refused."""
        if targets is None:
            raise ValueError("a model cut into pipeline stages returns its loss, not logits: call it with targets "
                             "(generation and predict across stages are not supported; load the checkpoint without "
                             "stages, e.g. with pipeline_parallel_size=1, to sample)")
        if doc_ids is not None:
            raise ValueError("packed documents (doc_ids) are not supported with pipeline stages yet")
        if torch.is_grad_enabled() and self.model.training:
            return self.deferred_step(idx, targets)
        return self.evaluate(idx, targets)

    def save(self, path, optimizers: Sequence[torch.optim.Optimizer] = (), extra: dict | None = None) -> None:
        """Write a sharded checkpoint of the whole model (and ``optimizers``' states) to ``path``, every rank its
        own stage's shards under the parameters' global names (:mod:`lightning_tp2d.checkpoint`: crash-safe,
        checksummed). It is the checkpoint one stage would write: it loads at another pipeline size
        (:meth:`load`), into a model without stages (``checkpoint.load_into``) and on one device (``export``).
        ``extra``: more entries of the checkpoint (a step count...). Every rank calls it."""
        from lightning_tp2d import checkpoint as ckpt

        state = ckpt.sharded_model_state(self.model)
        saved = {**(extra or {}), "state_dict": state, "tp2d_partial": True,
                 "optimizer_states": [ckpt.sharded_optimizer_state(self.model, o) for o in optimizers]}
        ckpt.save(saved, Path(path), rank=dist.get_rank(), sharded=True, barrier=lambda name: dist.barrier())

    def load(self, path, optimizers: Sequence[torch.optim.Optimizer] = (), strict: bool = True) -> dict:
        """Load a sharded checkpoint (any pipeline size, layout, grid or dp size that saved it) into this rank's
        stages and ``optimizers``, in place; returns the checkpoint's other entries. ``strict``: every stored
        tensor must be held by some stage. Every rank calls it."""
        from lightning_tp2d import checkpoint as ckpt

        return ckpt.load_into(self.model, list(optimizers), path, strict, partial=True)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every gradient of every stage by ``min(1, max_norm / (norm + 1e-6))``, ``norm`` the whole model's
        (every stage and shard; a tied embedding once); returns it, the same on every rank."""
        from lightning_tp2d import fsdp

        copies = {id(q) for q in self._tied_parameters()} if not self.first else set()
        counted = [q for q in self.model.parameters() if q.grad is not None and id(q) not in copies]
        local = (fsdp.grad_norm if self.fsdp else grad_norm)(counted, self.stage_mesh, norm_type)
        inf = math.isinf(norm_type)
        total = local.clone() if inf else local.pow(norm_type)
        dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM,
                        group=self.mesh.get_group(PIPELINE_AXIS))
        total = total if inf else total.pow(1.0 / norm_type)
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for q in self.model.parameters():
            if q.grad is not None:
                grad = q.grad.to_local() if hasattr(q.grad, "to_local") else q.grad
                grad.mul_(coef.to(grad.dtype))
        return total


# what the process group's backends say when a peer died or stalled (gloo, NCCL, torch's DistError types)
_BACKEND_FAILURES = ("Connection closed", "Connection reset", "Broken pipe", "Timed out", "timed out", "timeout",
                     "NCCL", "Gloo", "gloo")


@contextlib.contextmanager
def _naming_stage_failures(call: str):
    """A backend error inside torch's schedule (a send or receive whose peer stage died or stalled) re-raised as a
    :class:`~lightning_tp2d.comm.CommError` naming ``call``, as every other communication of the package is; any
    other error (a bug, a bad shape) passes unchanged."""
    from lightning_tp2d.comm import naming_failures

    try:
        yield
    except RuntimeError as err:
        if not (isinstance(err, dist.DistError) or any(word in str(err) for word in _BACKEND_FAILURES)):
            raise
        with naming_failures(call):
            raise RuntimeError(str(err)) from err


def _device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _first_and_last_groups(mesh: DeviceMesh, pp: int):
    """The process group of this rank's first- and last-stage ranks (same data-parallel and layout coordinates):
    the ``pipeline`` group itself when ``pp == 2``; else one group per coordinate, every rank creating all of them
    in the same order (``dist.new_group``'s rule)."""
    if pp == 2:
        return mesh.get_group(PIPELINE_AXIS)
    ranks = mesh.mesh.reshape(pp, -1)
    mine = None
    for column in range(ranks.shape[1]):
        pair = [int(ranks[0, column]), int(ranks[pp - 1, column])]
        group = dist.new_group(pair)
        if dist.get_rank() in pair:
            mine = group
    return mine
