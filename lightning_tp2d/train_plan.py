"""One training configuration as data: :class:`TrainPlan`, what the planner chooses, what the strategies take
(``TP2DStrategy(plan=...)``) and what :func:`lightning_tp2d.step.assemble_step` wires into a step.

============================  =======  =================================================================================
field                         default  meaning
============================  =======  =================================================================================
``layout``                    --       a registered layout's name (``"2d"``, ``"metp"``, ``"2d-metp"``) or its
                                       :class:`~lightning_tp2d.layouts.Layout` object: kept as the name, its options
                                       in ``options``, the object as :attr:`~TrainPlan.spec`
``tensor_parallel_size``      --       ``p``: ranks per model replica (square for the grid layouts)
``data_parallel_size``        1        ``dp``: model replicas
``zero_stage``                0        0: every replica keeps the optimizer state of its tensor shard; 1: the state is
                                       sharded over the replicas; 2: gradients too; 3: parameters too
``activation_checkpointing``  none     ``"none"``, ``"selective"`` or ``"full"``
``activation_offload``        False    the inputs full checkpointing keeps go to host memory (needs ``"full"``)
``micro_batch``               None     sequences per replica per micro-batch (advice: the data keeps its own)
``precision``                 None     a Lightning precision name (``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"``);
                                       ``None``: the run's
``options``                   None     the layout's layer options (:class:`~lightning_tp2d.options.TPOptions`: SUMMA
                                       algorithm, ring kernels); ``None``: the defaults, or the given Layout's
``pipeline_parallel_size``    1        ``pp``: pipeline stages of whole blocks (:mod:`lightning_tp2d.pipeline`), the
                                       mesh's outermost axis
``pp_schedule``               1f1b     the stages' schedule: :data:`PP_SCHEDULES`
``microbatches``              None     micro-batches per step and replica; ``None``: ``pp x virtual_stages``
``virtual_stages``            1        stages per pipeline rank (``interleaved_1f1b`` only)
============================  =======  =================================================================================

A plan is also the run's sizes (it replaced ``mesh.ParallelDims``, which names it still): :attr:`~TrainPlan.spec`,
:attr:`~TrainPlan.q`, :attr:`~TrainPlan.world_size`, :attr:`~TrainPlan.mesh_shape`,
:attr:`~TrainPlan.mesh_dim_names` and :meth:`~TrainPlan.check_world_size`. The strategies and Fabric resolve one
plan when their sizes are known and hold it (``train_plan``); nothing rebuilds it per access.

The ZeRO rules live here once, as properties; every place that runs or prices a step reads them:

* :attr:`~TrainPlan.fsdp` (stage >= 2 and dp > 1): FSDP2 wraps each block and the root over ``data_parallel``;
* :attr:`~TrainPlan.reshard_after_forward` (stage 3 under FSDP): a block's gathered parameters are freed after its
  forward and gathered again for its backward;
* :attr:`~TrainPlan.optimizer_sharded` (stage 1, or under FSDP): ZeRO-1's slices of the optimizer state (at stages
  2/3 of the parameters FSDP keeps whole);
* :attr:`~TrainPlan.gradient_sync` (stage 0 or 1 and dp > 1): :class:`~lightning_tp2d.training.GradientSync`
  averages the gradients during the backward;
* :attr:`~TrainPlan.clip_with_fsdp` (stage >= 2): clipping by :func:`lightning_tp2d.fsdp.clip_grad_norm_`, whose
  norm sums over the data-parallel shards.

A low floor: nothing here imports torch, and of the package only :mod:`lightning_tp2d.layouts`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_tp2d.layouts import Layout, get_layout

if TYPE_CHECKING:
    from lightning_tp2d.options import TPOptions

ZERO_STAGES = (0, 1, 2, 3)  # lightning_tp2d.zero.ZERO_STAGES is this tuple
FSDP_STAGES = (2, 3)  # the stages FSDP2 runs (lightning_tp2d.fsdp.FSDP_STAGES is this tuple)
# least recomputation first (the planner's order); parallelize.ACTIVATION_CHECKPOINTING is this tuple
CHECKPOINTING = ("none", "selective", "full")
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")  # what the strategies and FSDP's mixed precision support
PIPELINE_AXIS = "pipeline"  # the mesh axis of the pipeline stages (outermost; only when there are several)
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")  # lightning_tp2d.pipeline.SCHEDULES is this tuple

__all__ = ["CHECKPOINTING", "FSDP_STAGES", "PIPELINE_AXIS", "PP_SCHEDULES", "PRECISIONS", "ParallelDims", "TrainPlan",
           "ZERO_STAGES", "fsdp_shards", "pipeline_problem", "reshards_after_forward"]


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def pipeline_problem(pp: int, schedule: str = "1f1b", microbatches: int | None = None,
                     virtual_stages: int = 1, prefix: str = "") -> str | None:
    """Why ``pp`` stages cannot run ``schedule`` with ``microbatches`` micro-batches and ``virtual_stages`` stages per
    rank (a sentence naming the numbers, each setting's name after ``prefix``: ``"parallel."`` for ``tp2d-train``),
    or ``None``. The one statement of the rule: :class:`TrainPlan`, the :class:`~lightning_tp2d.pipeline.Pipeline`
    and ``tp2d-train`` ask it. ``microbatches=None`` means ``pp x virtual_stages``."""
    k = prefix
    if schedule not in PP_SCHEDULES:
        return f"{k}pp_schedule={schedule!r} is not one of {list(PP_SCHEDULES)}"
    if not _positive_int(virtual_stages):
        return f"{k}virtual_stages must be a positive int, got {virtual_stages!r}"
    if virtual_stages > 1 and schedule != "interleaved_1f1b":
        return f"{k}virtual_stages={virtual_stages} needs {k}pp_schedule='interleaved_1f1b', got {schedule!r}"
    if microbatches is not None and not _positive_int(microbatches):
        return f"{k}microbatches must be a positive int or None, got {microbatches!r}"
    m = pp * virtual_stages if microbatches is None else microbatches
    if pp > 1 and schedule == "1f1b" and m < pp:
        return (f"{k}pp_schedule '1f1b' needs at least as many micro-batches as pipeline stages: {k}microbatches={m} "
                f"< {k}pipeline_parallel_size={pp}")
    if pp > 1 and schedule == "interleaved_1f1b" and m % pp:
        return (f"{k}pp_schedule 'interleaved_1f1b' needs micro-batches in multiples of the pipeline ranks: "
                f"{k}microbatches={m} is not a multiple of {k}pipeline_parallel_size={pp}")
    return None


def fsdp_shards(zero_stage: int, data_parallel_size: int) -> bool:
    """Whether FSDP2 shards the model at ``zero_stage`` over ``data_parallel_size`` replicas: stages 2 and 3 with more
    than one replica. The one statement of the rule: :attr:`TrainPlan.fsdp`, and the planner's models of a step
    given only its stage and replicas, ask it."""
    return zero_stage in FSDP_STAGES and data_parallel_size > 1


def reshards_after_forward(zero_stage: int, data_parallel_size: int) -> bool:
    """Whether FSDP frees a block's gathered parameters after its forward and gathers them again for its backward:
    stage 3 under FSDP (:func:`fsdp_shards`). The one statement of the rule: :attr:`TrainPlan.reshard_after_forward`,
    :mod:`lightning_tp2d.fsdp`'s groups, the 1-D baseline's groups and the planner's models ask it."""
    return fsdp_shards(zero_stage, data_parallel_size) and zero_stage == 3


@dataclass(frozen=True)
class TrainPlan:
    """One training configuration (module docstring); checked when made, each refusal a ``ValueError`` naming the
    value."""

    layout: str  # the name; a Layout object given here is kept as spec
    tensor_parallel_size: int
    data_parallel_size: int = 1
    zero_stage: int = 0
    activation_checkpointing: str = "none"
    activation_offload: bool = False
    micro_batch: int | None = None  # advice: the data module and the Trainer keep theirs
    precision: str | None = None  # None: the run's (the Trainer's or Fabric's precision)
    options: TPOptions | None = None  # the layout's layer options; None: the defaults, or the given Layout's
    pipeline_parallel_size: int = 1  # pipeline stages (lightning_tp2d.pipeline): the mesh's outermost axis
    pp_schedule: str = "1f1b"  # the stages' schedule (PP_SCHEDULES)
    microbatches: int | None = None  # per step and replica; None: pp x virtual_stages
    virtual_stages: int = 1  # stages per pipeline rank (interleaved_1f1b)

    def __post_init__(self) -> None:
        if not isinstance(self.layout, (str, Layout)):
            raise ValueError(f"TrainPlan.layout must be a layout's name or Layout, got {self.layout!r}")
        given = self.layout.options if isinstance(self.layout, Layout) else None
        # an unknown name: a ValueError listing the registered ones
        spec = get_layout(self.layout, self.options if self.options is not None else given)
        object.__setattr__(self, "layout", spec.name)
        object.__setattr__(self, "options", spec.options)  # so dataclasses.replace keeps them
        object.__setattr__(self, "_spec", spec)
        for name in ("tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size"):
            if not _positive_int(getattr(self, name)):
                raise ValueError(f"TrainPlan.{name} must be a positive int, got {getattr(self, name)!r}")
        problem = spec.size_problem(self.tensor_parallel_size)
        if problem:
            raise ValueError(f"TrainPlan: {problem}")
        if self.zero_stage not in ZERO_STAGES or isinstance(self.zero_stage, bool):
            raise ValueError(f"TrainPlan.zero_stage={self.zero_stage!r} is not one of {list(ZERO_STAGES)}")
        if self.activation_checkpointing not in CHECKPOINTING:
            raise ValueError(f"TrainPlan.activation_checkpointing={self.activation_checkpointing!r} is not one of "
                             f"{list(CHECKPOINTING)}")
        if not isinstance(self.activation_offload, bool):
            raise ValueError(f"TrainPlan.activation_offload must be True or False, got {self.activation_offload!r}")
        if self.activation_offload and self.activation_checkpointing != "full":
            raise ValueError(f"TrainPlan: activation_offload=True moves the block inputs that full checkpointing "
                             f"keeps, got activation_checkpointing={self.activation_checkpointing!r}; use 'full'")
        if self.micro_batch is not None and not _positive_int(self.micro_batch):
            raise ValueError(f"TrainPlan.micro_batch must be a positive int or None, got {self.micro_batch!r}")
        problem = pipeline_problem(self.pipeline_parallel_size, self.pp_schedule, self.microbatches,
                                   self.virtual_stages)
        if problem:
            raise ValueError(f"TrainPlan: {problem}")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ValueError(f"TrainPlan.precision={self.precision!r} is not one of {list(PRECISIONS)} (or None: "
                             "the run's)")

    @property
    def spec(self) -> Layout:
        """The :class:`~lightning_tp2d.layouts.Layout` object: the layout's, with :attr:`options`."""
        return self._spec  # type: ignore[attr-defined]

    @property
    def world_size(self) -> int:
        """Ranks the plan runs on: ``pp * dp * p``."""
        return self.pipeline_parallel_size * self.data_parallel_size * self.tensor_parallel_size

    @property
    def q(self) -> int:
        """Side of the grid (``p = q*q``); for a ring layout, the ring size ``p``."""
        return self.spec.side(self.tensor_parallel_size)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """The mesh's axes: ``("data_parallel", *the layout's tensor axes)``, after ``"pipeline"`` when there are
        several stages."""
        pipeline = (PIPELINE_AXIS,) if self.pipeline_parallel_size > 1 else ()
        return pipeline + self.spec.mesh_dim_names

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The mesh's shape: ``(dp, q, q)`` on a grid, ``(dp, p)`` on a ring, after ``pp`` when there are several
        stages."""
        pipeline = (self.pipeline_parallel_size,) if self.pipeline_parallel_size > 1 else ()
        return pipeline + self.spec.mesh_shape(self.tensor_parallel_size, self.data_parallel_size)

    def check_world_size(self, world_size: int) -> None:
        """A ``ValueError`` naming the sizes when ``world_size`` ranks are not ``pp x dp x p``."""
        if world_size != self.world_size:
            pipeline = (f"pipeline_parallel_size {self.pipeline_parallel_size} x "
                        if self.pipeline_parallel_size > 1 else "")
            raise ValueError(f"world size {world_size} != {pipeline}data_parallel_size {self.data_parallel_size} x "
                             f"tensor_parallel_size {self.tensor_parallel_size} = {self.world_size}")

    @property
    def fsdp(self) -> bool:
        """FSDP2 wraps every block and the root over ``data_parallel`` (:mod:`lightning_tp2d.fsdp`): stages 2 and 3
        with more than one replica (``dp = 1``: nothing to shard, the step runs as at stage 0)."""
        return fsdp_shards(self.zero_stage, self.data_parallel_size)

    @property
    def reshard_after_forward(self) -> bool:
        """FSDP frees each block's gathered parameters after its forward and gathers them again for its backward
        (stage 3); at stage 2 they stay gathered until the backward. ``False`` without FSDP."""
        return reshards_after_forward(self.zero_stage, self.data_parallel_size)

    @property
    def pipelined(self) -> bool:
        """The model runs as pipeline stages (:class:`~lightning_tp2d.pipeline.Pipeline`): ``pp > 1``."""
        return self.pipeline_parallel_size > 1

    @property
    def pp_microbatches(self) -> int:
        """Micro-batches per step and replica: :attr:`microbatches`, or ``pp x virtual_stages``."""
        return self.pipeline_parallel_size * self.virtual_stages if self.microbatches is None else self.microbatches

    @property
    def optimizer_sharded(self) -> bool:
        """The optimizers get ZeRO-1's slices (:func:`lightning_tp2d.zero.shard_optimizer_state`): at stage 1 (any
        ``dp``; with one replica each slice is a whole parameter), and under FSDP for the parameters it keeps whole
        (its own shards pass through)."""
        return self.zero_stage == 1 or self.fsdp

    @property
    def gradient_sync(self) -> bool:
        """:class:`~lightning_tp2d.training.GradientSync` averages the gradients over ``data_parallel`` during the
        backward: stages 0 and 1 with more than one replica (under FSDP its reduce-scatter is the average; with
        one replica there is nothing to average)."""
        return self.zero_stage not in FSDP_STAGES and self.data_parallel_size > 1

    @property
    def clip_with_fsdp(self) -> bool:
        """Clipping sums the norm over the ``data_parallel`` shards too (:func:`lightning_tp2d.fsdp.clip_grad_norm_`):
        stages 2 and 3; else :func:`lightning_tp2d.training.clip_grad_norm_`, whose replicas hold equal, whole
        gradients."""
        return self.zero_stage in FSDP_STAGES

    def describe(self) -> str:
        """One line: ``metp p=4 dp=2 zero=3 ckpt=full offload micro=2 bf16-mixed`` (``pp=2 1f1b x4`` after ``dp``
        with pipeline stages)."""
        stages = "" if not self.pipelined else (
            f" pp={self.pipeline_parallel_size} {self.pp_schedule}"
            f"{'' if self.virtual_stages == 1 else f' v={self.virtual_stages}'} x{self.pp_microbatches}")
        return (f"{self.layout} p={self.tensor_parallel_size} dp={self.data_parallel_size}{stages} "
                f"zero={self.zero_stage} "
                f"ckpt={self.activation_checkpointing}{' offload' if self.activation_offload else ''}"
                f"{'' if self.micro_batch is None else f' micro={self.micro_batch}'}"
                f"{'' if self.precision is None else ' ' + self.precision}")


# The sizes of one run are a plan's (its layout, tensor_parallel_size and data_parallel_size; the rest at their
# defaults), with the mesh's shape and axis names: one class since issue 49, the older name kept.
ParallelDims = TrainPlan
