"""What the Trainer strategy (:class:`~lightning_tp2d.strategy.TP2DStrategy`) and the Fabric strategy
(:class:`~lightning_tp2d.fabric.TP2DFabricStrategy`) share: the arguments and their checks, resolving the
tensor- and data-parallel sizes (or, with ``layout="auto"``, the planner's choice of layout, sizes, ZeRO stage and
checkpointing: :mod:`lightning_tp2d.planning.planner`), the mesh, finding and parallelizing the
:class:`~lightning_tp2d.models.GPT2` (or other registered model family: :mod:`lightning_tp2d.families`) modules (meta-device models from one seed or
a transformers directory, eager ones made identical on every rank, then activation checkpointing and
``torch.compile``), and what a checkpoint records about the run. What a strategy is asked is one checked object
(:class:`RunRequest`) until its sizes are known, then the run's :class:`~lightning_tp2d.train_plan.TrainPlan`.

A mixin: the Lightning base class (Trainer's or Fabric's ``ModelParallelStrategy``) brings ``num_nodes``,
``num_processes``, ``root_device``, ``broadcast`` and the process group; nothing here imports Lightning.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn as nn
from torch.distributed.constants import default_pg_timeout

from lightning_tp2d import fsdp
from lightning_tp2d.export import hf_loader
from lightning_tp2d.families import families, family_of, family_of_config, model_names
from lightning_tp2d.layouts import DEFAULT_LAYOUT, STRATEGY_NAMES, Layout, get_layout, handle_of
from lightning_tp2d.mesh import as_timeout, init_mesh
from lightning_tp2d.parallelize import ACTIVATION_CHECKPOINTING, offloaded_checkpointing
from lightning_tp2d.pipeline import micro_batch_problem, pipeline_of
from lightning_tp2d.sizes import ARGUMENTS, resolve_sizes, stage_devices
from lightning_tp2d.step import (AssembledStep, assemble_step, block_sharder, clip_grad_norm_, is_prepared,
                                 prepare_model, shard_optimizer)
from lightning_tp2d.train_plan import PRECISIONS, TrainPlan, pipeline_problem
from lightning_tp2d.training import broadcast_module_
from lightning_tp2d.values import check_number
from lightning_tp2d.zero import ZERO_STAGES

if TYPE_CHECKING:
    from lightning_tp2d.planning.planner import PlanRow

SUPPORTED_PRECISION = PRECISIONS  # lightning_tp2d.train_plan's
AUTO_LAYOUT = "auto"  # layout="auto": the planner picks layout, sizes, ZeRO stage and checkpointing at start-up
LONGEST_DEFAULT_SEQ = 8192  # layout="auto" plans for config.block_size up to this; longer needs plan_options["seq"]
# what plan_options may set: lightning_tp2d.planning.planner.plan's arguments that are not the job's (gpus, memory)
PLAN_OPTIONS = ("seq", "global_batch_tokens", "hardware", "layouts", "zero_stages", "checkpointing", "memory_fraction",
                "max_micro_batch", "compiled", "workers")

__all__ = ["AUTO_LAYOUT", "LONGEST_DEFAULT_SEQ", "PLAN_OPTIONS", "SUPPORTED_PRECISION", "TensorParallelCore",
           "compile_options", "find_model_config"]


def _check_plan_values(options: Mapping[str, Any]) -> None:
    """``ValueError`` naming the first value of ``layout="auto"``'s ``plan_options`` the planner cannot take."""
    for key, values, known in (("zero_stages", options.get("zero_stages"), ZERO_STAGES),
                               ("checkpointing", options.get("checkpointing"), ACTIVATION_CHECKPOINTING)):
        if values is not None and (isinstance(values, str) or not set(values) <= set(known) or not values):
            raise ValueError(f"plan_options['{key}']={values!r} must be a non-empty list of {list(known)}")
    for key, rule in (("seq", {"low": 1, "integer": True}), ("global_batch_tokens", {"low": 1, "integer": True}),
                      ("memory_fraction", {"low": 0, "high": 1, "low_open": True}),
                      ("max_micro_batch", {"low": 1, "integer": True}), ("workers", {"low": 1, "integer": True})):
        if options.get(key) is not None:
            check_number(f"plan_options['{key}']", options[key], **rule)


def compile_options(compile: bool | str | dict | None) -> dict | None:
    """``torch.compile`` keyword arguments for the strategy's ``compile`` argument (``None``: no compilation)."""
    if compile is None or compile is False:
        return None
    if compile is True:
        options: dict = {}
    elif isinstance(compile, str):
        options = {"backend": compile}
    elif isinstance(compile, Mapping):
        options = dict(compile)
    else:
        raise ValueError(f"compile must be a bool, a backend name or a dict of torch.compile arguments, "
                         f"got {compile!r}")
    options.setdefault("dynamic", False)
    return options


def find_model_config(module: nn.Module | None) -> Any:
    """The config of the (first) model of a registered family (:mod:`lightning_tp2d.families`: GPT2, Llama ...)
    inside ``module``, or of a ``config`` attribute of such a family's config class before the model is built."""
    if module is None:
        return None
    for m in module.modules():
        if family_of(m) is not None:
            return m.config
    config = getattr(module, "config", None)
    return config if family_of_config(config) is not None else None


@dataclasses.dataclass(frozen=True)
class RunRequest:
    """What a strategy is asked to run before its sizes are known, checked once and held whole: the layout
    (``spec``; ``None`` while ``layout="auto"`` is not planned), the sizes asked for (``"auto"`` or a number), the
    ZeRO stage, checkpointing, offload and whether a 1-D fallback is allowed. ``layout="auto"`` replaces it whole with
    the planner's row (:meth:`TensorParallelCore._take_plan`); :meth:`plan` is the run's
    :class:`~lightning_tp2d.train_plan.TrainPlan` at resolved sizes. The strategy's ``layout``, ``layout_spec``,
    ``zero_stage``, ``activation_checkpointing``, ``activation_offload`` and ``allow_fallback`` read it."""

    spec: Layout | None
    tensor_parallel_size: Literal["auto"] | int = "auto"
    data_parallel_size: Literal["auto"] | int = "auto"
    zero_stage: int = 0
    activation_checkpointing: str = "none"
    activation_offload: bool = False
    allow_fallback: bool = False
    pipeline_parallel_size: int = 1
    pp_schedule: str = "1f1b"
    microbatches: int | None = None
    virtual_stages: int = 1

    @property
    def layout(self) -> str:
        return AUTO_LAYOUT if self.spec is None else self.spec.name

    def plan(self, tensor_parallel_size: int, data_parallel_size: int, micro_batch: int | None = None,
             precision: str | None = None) -> TrainPlan:
        """The run's plan at these sizes (its layout must be known: not ``"auto"``)."""
        if self.spec is None:
            raise RuntimeError("layout='auto' is planned when the model is known, before the plan is made")
        return TrainPlan(self.spec, tensor_parallel_size, data_parallel_size, self.zero_stage,
                         self.activation_checkpointing, self.activation_offload, micro_batch, precision,
                         pipeline_parallel_size=self.pipeline_parallel_size, pp_schedule=self.pp_schedule,
                         microbatches=self.microbatches, virtual_stages=self.virtual_stages)


def _models(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, model)`` of every model of a registered family inside ``module``."""
    return [(name, m) for name, m in module.named_modules() if family_of(m) is not None]


class TensorParallelCore:
    """The layout, sizes, mesh and model handling of both strategies (module docstring)."""

    _request: RunRequest  # what was asked (checked in _check_arguments; layout="auto": the planner's row, _take_plan)
    _run_plan: TrainPlan | None = None  # this run's plan, resolved once the sizes are known (_resolve)
    _mesh: Any = None  # the strategy's mesh (built in setup_environment)
    _run_precision: str = "32-true"  # the Lightning precision name (kept by _check_precision_name)
    plans_layout: bool = False  # layout="auto" is supported (the strategy knows the model before the process group)
    chosen_plan: PlanRow | None = None  # layout="auto": the planner's row this run follows
    _planned_float8: str | None = None  # the float8 recipe asked for (layout="auto": every planned row priced with it)
    given_plan: TrainPlan | None = None  # the plan= argument, or the TrainPlan of the planner's row (_take_plan)

    def __init__(self, layout: str | Layout = DEFAULT_LAYOUT, tensor_parallel_size: Literal["auto"] | int = "auto",
                 data_parallel_size: Literal["auto"] | int = "auto", save_distributed_checkpoint: bool = True,
                 process_group_backend: str | None = None, timeout: timedelta | float | None = default_pg_timeout,
                 activation_checkpointing: str = "none", compile: bool | str | dict = False,
                 allow_fallback: bool = False, zero_stage: int = 0, memory_gib: float | None = None,
                 plan_options: Mapping[str, Any] | None = None, activation_offload: bool = False,
                 plan: TrainPlan | None = None, float8: str | None = None, pipeline_parallel_size: int = 1,
                 pp_schedule: str = "1f1b", microbatches: int | None = None, virtual_stages: int = 1) -> None:
        """The arguments of both strategies (documented on :class:`~lightning_tp2d.strategy.TP2DStrategy`): checked
        and kept, then the Lightning base class (``ModelParallelStrategy``, given :meth:`_base_arguments`), then the
        strategy's own state (:meth:`_init_state`). ``plan``: the layout, sizes, ZeRO stage, checkpointing and offload
        as one :class:`~lightning_tp2d.train_plan.TrainPlan` (:meth:`_from_plan`)."""
        stages = {"pipeline_parallel_size": pipeline_parallel_size, "pp_schedule": pp_schedule,
                  "microbatches": microbatches, "virtual_stages": virtual_stages}
        if plan is not None:
            (layout, tensor_parallel_size, data_parallel_size, zero_stage, activation_checkpointing,
             activation_offload, stages) = self._from_plan(plan, layout, tensor_parallel_size, data_parallel_size,
                                                           zero_stage, activation_checkpointing, activation_offload,
                                                           stages)
        self._check_arguments(layout, tensor_parallel_size, data_parallel_size, timeout, activation_checkpointing,
                              compile, allow_fallback, zero_stage, memory_gib, plan_options, activation_offload)
        self._check_stages(stages, save_distributed_checkpoint)
        self._check_float8(float8)
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=self.timeout, **self._base_arguments())
        self._sharded_checkpoints = bool(save_distributed_checkpoint)
        self._init_state()

    def _from_plan(self, plan: TrainPlan, layout: str | Layout, tensor_parallel_size: Literal["auto"] | int,
                   data_parallel_size: Literal["auto"] | int, zero_stage: int, activation_checkpointing: str,
                   activation_offload: bool, stages: dict | None = None) -> tuple:
        """The arguments ``plan`` stands for, in ``__init__``'s order. An argument left at its default takes the
        plan's value; one given must equal it (a ``ValueError`` names each that does not). A
        :class:`~lightning_tp2d.layouts.Layout` object naming the plan's layout is kept (it carries the layers'
        options); else the plan's own (:attr:`~lightning_tp2d.train_plan.TrainPlan.spec`, with its ``options``)."""
        if not isinstance(plan, TrainPlan):
            raise ValueError(f"plan must be a lightning_tp2d.TrainPlan, got {type(plan).__name__}")
        named = layout.name if isinstance(layout, Layout) else layout
        given = (("layout", named, DEFAULT_LAYOUT, plan.layout),
                 ("tensor_parallel_size", tensor_parallel_size, "auto", plan.tensor_parallel_size),
                 ("data_parallel_size", data_parallel_size, "auto", plan.data_parallel_size),
                 ("zero_stage", zero_stage, 0, plan.zero_stage),
                 ("activation_checkpointing", activation_checkpointing, "none", plan.activation_checkpointing),
                 ("activation_offload", activation_offload, False, plan.activation_offload),
                 *((name, value, default, getattr(plan, name)) for (name, value), default
                   in zip((stages or {}).items(), (1, "1f1b", None, 1))))
        clashes = [f"{name}={value!r} (the plan's: {planned!r})" for name, value, default, planned in given
                   if value != default and value != planned]
        if clashes:
            raise ValueError(f"plan={plan.describe()!r} disagrees with the arguments {', '.join(clashes)}: give the "
                             "plan alone, or arguments that match it")
        self.given_plan = plan
        return (layout if isinstance(layout, Layout) and layout.name == plan.layout else plan.spec,
                plan.tensor_parallel_size, plan.data_parallel_size, plan.zero_stage, plan.activation_checkpointing,
                plan.activation_offload, {name: getattr(plan, name) for name in (stages or {})})

    def _base_arguments(self) -> dict:
        """Further keyword arguments of the Lightning base class (Fabric's needs a ``parallelize_fn``)."""
        return {}

    def _init_state(self) -> None:
        """The strategy's own attributes, after the base class is initialised."""

    def _check_arguments(self, layout: str | Layout, tensor_parallel_size: Literal["auto"] | int,
                         data_parallel_size: Literal["auto"] | int, timeout: timedelta | float | None,
                         activation_checkpointing: str, compile: bool | str | dict, allow_fallback: bool,
                         zero_stage: int, memory_gib: float | None = None,
                         plan_options: Mapping[str, Any] | None = None, activation_offload: bool = False) -> None:
        """Check and keep the strategy arguments (before the Lightning base class is initialised)."""
        auto = isinstance(layout, str) and layout == AUTO_LAYOUT
        spec = None if auto else get_layout(layout)
        if activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            raise ValueError(f"activation_checkpointing={activation_checkpointing!r} is not one of "
                             f"{', '.join(map(repr, ACTIVATION_CHECKPOINTING))}")
        self.compile_options = compile_options(compile)
        activation_checkpointing = self._check_offload(activation_offload, activation_checkpointing, auto)
        if self.compile_options is not None and activation_checkpointing == "selective":
            raise ValueError("compile with activation_checkpointing='selective' is not supported: its saved-tensor "
                             "hooks and recipes run in eager mode only (use 'full', or no compile)")
        checkpointed = activation_checkpointing != "none"
        if spec is not None and self.compile_options is not None and checkpointed and not spec.compiles_checkpointed:
            raise ValueError(f"compile with activation_checkpointing={activation_checkpointing!r} is not supported "
                             f"for layout {spec.name!r} yet: torch 2.13's AOTAutograd fails to save the DTensor "
                             "parameters' metadata inside a checkpointed region (use one of them, or layout 'metp' / "
                             "'2d-metp')")
        for name, value in (("tensor_parallel_size", tensor_parallel_size), ("data_parallel_size", data_parallel_size)):
            if value != "auto" and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be 'auto' or a positive int, got {value!r}")
        if zero_stage not in ZERO_STAGES:
            raise ValueError(f"zero_stage={zero_stage!r} is not supported: {list(ZERO_STAGES)} (0: every data-parallel "
                             "replica keeps the full optimizer state of its tensor shard; 1: the state is sharded "
                             "over the replicas; 2: gradients too; 3: parameters too)")
        self.timeout = as_timeout(timeout)
        self._check_plan_arguments(auto, memory_gib, plan_options, zero_stage, activation_checkpointing)
        planned = self.plan_options.get("checkpointing")
        if auto and activation_offload and planned is not None and "full" not in planned:
            raise ValueError(f"activation_offload=True offloads what activation_checkpointing='full' keeps, but "
                             f"plan_options['checkpointing']={list(planned)} leaves 'full' out: add it, or drop "
                             "activation_offload")
        self._request = RunRequest(spec, tensor_parallel_size, data_parallel_size, zero_stage,
                                   activation_checkpointing, activation_offload, bool(allow_fallback))
        self._run_plan = None

    def _check_stages(self, stages: dict, sharded_checkpoints: bool) -> None:
        """Check the pipeline arguments (:func:`~lightning_tp2d.train_plan.pipeline_problem`) and what stages do not
        run with yet, each a ``ValueError`` naming the values; keep them in the request."""
        pp = stages["pipeline_parallel_size"]
        check_number("pipeline_parallel_size", pp, low=1, integer=True, meaning="pipeline stages")
        problem = pipeline_problem(pp, stages["pp_schedule"], stages["microbatches"], stages["virtual_stages"])
        if problem:
            raise ValueError(problem)
        if pp > 1:
            request = self._request
            refused = [(request.spec is None, "layout='auto' (the planner has no pipeline rows yet)"),
                       (self.compile_options is not None, "compile"),
                       (request.activation_offload, "activation_offload=True"),
                       (not sharded_checkpoints, "save_distributed_checkpoint=False (each stage writes its own "
                                                 "shards)")]
            names = [what for bad, what in refused if bad]
            if names:
                raise ValueError(f"pipeline_parallel_size={pp} does not run with {', '.join(names)} yet")
        self._request = dataclasses.replace(self._request, **stages)

    def _check_float8(self, float8: str | None) -> None:
        """``float8`` (a torchao recipe, :mod:`lightning_tp2d.float8`) onto the requested layout's options, or with
        ``layout="auto"`` kept for the planner, which prices every row with it (the chosen row's plan carries it). A
        ``ValueError`` for a layout without float8 products. The layout's own ``options.float8`` stands when
        ``float8`` is ``None``."""
        from lightning_tp2d.float8 import check_recipe, float8_notice  # (torchao: imported only with a recipe)

        float8 = check_recipe(float8)
        self._planned_float8 = float8
        if float8 is None:
            return
        if self._request.spec is not None:
            self._request = dataclasses.replace(self._request, spec=self._request.spec.with_float8(float8))
        notice = float8_notice(float8)  # a GPU without float8 GEMMs: a ValueError; the CPU: a one-line notice
        if notice and int(os.environ.get("RANK", "0")) == 0:
            warnings.warn(notice, stacklevel=3)

    @property
    def float8(self) -> str | None:
        """The float8 recipe the linears run (``None``: high precision; ``layout="auto"`` before it is planned: the
        recipe asked for)."""
        spec = self._request.spec
        if spec is None:
            return self._planned_float8
        return None if spec.options is None else getattr(spec.options, "float8", None)

    def _check_offload(self, activation_offload: bool, activation_checkpointing: str, auto: bool) -> str:
        """Check and keep ``activation_offload``; return the checkpointing mode it runs with: ``"full"`` when it
        is asked with ``"none"`` (a warning says so; with ``layout="auto"`` the plan is restricted to ``"full"``
        instead, :meth:`_plan`), a ``ValueError`` with ``"selective"`` or with ``compile``."""
        if not isinstance(activation_offload, bool):
            raise ValueError(f"activation_offload must be True or False, got {activation_offload!r}")
        if not activation_offload:
            return activation_checkpointing
        mode = offloaded_checkpointing(activation_checkpointing, activation_offload)  # selective: refused
        if self.compile_options is not None:
            raise ValueError("compile with activation_offload=True is not supported: its saved-tensor hooks, side "
                             "stream and host copies run in eager mode only (use one of them)")
        if mode != activation_checkpointing and not auto:
            warnings.warn("activation_offload=True needs full activation checkpointing: using "
                          "activation_checkpointing='full' (offload keeps each block's input on the host)",
                          stacklevel=2)
            return mode
        return activation_checkpointing

    def _check_plan_arguments(self, auto: bool, memory_gib: float | None, plan_options: Mapping[str, Any] | None,
                              zero_stage: int, activation_checkpointing: str) -> None:
        """Check and keep ``memory_gib`` and ``plan_options``: arguments of ``layout="auto"`` only."""
        if not auto:
            if memory_gib is not None or plan_options:
                raise ValueError("memory_gib and plan_options configure layout='auto' (the planner); with a named "
                                 "layout leave them out")
            self.memory_gib, self.plan_options = None, {}
            return
        if not self.plans_layout:
            raise ValueError(f"layout='auto' is not supported by {type(self).__name__}: the plan needs the model "
                             "before the process group starts, which only the Trainer's TP2DStrategy sees; name a "
                             "layout (`tp2d-plan MODEL --gpus N --gpu-memory-gib G --seq T` prints the best)")
        if zero_stage != 0 or activation_checkpointing != "none":
            raise ValueError(f"layout='auto' chooses zero_stage and activation_checkpointing itself, got zero_stage="
                             f"{zero_stage!r}, activation_checkpointing={activation_checkpointing!r}; restrict the "
                             "choice with plan_options={'zero_stages': (...), 'checkpointing': (...)}")
        if memory_gib is not None and (isinstance(memory_gib, bool) or not isinstance(memory_gib, (int, float))
                                       or memory_gib <= 0):
            raise ValueError(f"memory_gib must be a positive number of GiB per device, got {memory_gib!r}")
        unknown = sorted(set(plan_options or {}) - set(PLAN_OPTIONS))
        if unknown:
            raise ValueError(f"plan_options: unknown keys {unknown}; known: {list(PLAN_OPTIONS)}")
        _check_plan_values(plan_options or {})
        self.memory_gib = None if memory_gib is None else float(memory_gib)
        self.plan_options = dict(plan_options or {})

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        """Register ``"tp2d"``, ``"metp"`` and ``"tp2d_metp"`` for this class in a Lightning strategy registry
        (``import lightning_tp2d`` does it for both Trainer and Fabric)."""
        for name, layout in STRATEGY_NAMES.items():
            strategy_registry.register(name, cls, description=f"tensor-parallel GPT-2, layout {layout!r}",
                                       layout=layout, override=True)

    # ---- the request, read through its one object ---------------------------------------------------------

    @property
    def layout(self) -> str:
        """The layout's name, or ``"auto"`` while the planner has not chosen one."""
        return self._request.layout

    @property
    def layout_spec(self) -> Layout | None:
        """The :class:`~lightning_tp2d.layouts.Layout` object (``None`` while ``layout="auto"`` is not planned)."""
        return self._request.spec

    @property
    def zero_stage(self) -> int:
        return self._request.zero_stage

    @property
    def activation_checkpointing(self) -> str:
        return self._request.activation_checkpointing

    @property
    def activation_offload(self) -> bool:
        return self._request.activation_offload

    @property
    def allow_fallback(self) -> bool:
        return self._request.allow_fallback

    # ---- sizes --------------------------------------------------------------------------------------------

    @property
    def device_mesh(self):
        """The ``(data_parallel, *tensor axes)`` mesh of the layout (Lightning's ``distributed_sampler_kwargs``
        reads it), built when the processes are set up."""
        if self._mesh is None:
            raise RuntimeError(f"{type(self).__name__}.device_mesh exists once the processes are set up")
        return self._mesh

    @property
    def parallel_dims(self) -> TrainPlan:
        """The run's sizes: :attr:`train_plan` (a plan is its sizes, with the mesh's shape and axis names)."""
        return self.train_plan

    def _check_precision_name(self, name: str) -> None:
        """Check the Lightning precision and keep it (:meth:`assemble` picks FSDP's mixed precision by it)."""
        if name not in SUPPORTED_PRECISION:
            raise ValueError(f"{type(self).__name__} supports precision {list(SUPPORTED_PRECISION)}, got {name!r}")
        planned = self.given_plan.precision if self.given_plan is not None else None
        if planned is not None and planned != name:
            raise ValueError(f"{type(self).__name__}: the plan's precision={planned!r} disagrees with the run's "
                             f"precision {name!r}")
        self._run_precision = name

    @property
    def train_plan(self) -> TrainPlan:
        """This run's :class:`~lightning_tp2d.train_plan.TrainPlan`, resolved once the sizes are (:meth:`_resolve`,
        when the Trainer or Fabric is built and again when the processes start): the layout object, sizes, ZeRO
        stage, checkpointing, offload, the run's precision and the plan's micro-batch advice, if any. Its properties
        decide what :func:`~lightning_tp2d.step.assemble_step` wires, and it is the mesh's shape."""
        if self._run_plan is None:
            raise RuntimeError(f"{type(self).__name__} sizes are resolved when the Trainer (or Fabric) is built")
        return self._run_plan

    def _plan_of(self, tensor_parallel_size: int, data_parallel_size: int) -> TrainPlan:
        """The plan of this strategy's arguments (or the planner's row it took) at these sizes."""
        micro = self.given_plan.micro_batch if self.given_plan is not None else None
        return self._request.plan(tensor_parallel_size, data_parallel_size, micro, self._run_precision)

    def _resolve(self, config: Any) -> TrainPlan:
        """Resolve and hold this run's plan: the sizes for this job's devices and the model's config (``None``
        before the module is known), from the one resolver :func:`~lightning_tp2d.sizes.resolve_sizes`, its messages
        in the strategy's argument names."""
        asked = self._request
        per_node, nodes = stage_devices(asked.pipeline_parallel_size, self.num_processes, self.num_nodes)
        tp, dp = resolve_sizes(asked.spec, config, per_node, nodes, asked.tensor_parallel_size,
                               asked.data_parallel_size, allow_fallback=asked.allow_fallback, names=ARGUMENTS)
        self._run_plan = self._plan_of(tp, dp)
        return self._run_plan

    def _plan(self, config: Any, memory_gib: float, per_node: int, nodes: int) -> list[PlanRow]:
        """``layout="auto"``: the configurations of :func:`lightning_tp2d.planning.planner.plan` (no 1-D baselines) for
        ``config`` on ``per_node x nodes`` devices of ``memory_gib`` GiB, best first, that this strategy runs: the
        family's layouts (those without dropout when ``config.dropout``), the sizes asked for (numbers given as
        ``tensor_parallel_size`` / ``data_parallel_size``) and, under ``compile``, no checkpointing that does not
        compile; when the attached datamodule packs documents (``pack_documents=True``), only layouts with
        per-document attention (:meth:`~lightning_tp2d.layouts.Layout.documents_problem`). ``plan_options`` go to
        the planner; ``seq`` defaults to the window length of the data the strategy
        can see (the Trainer's datamodule's ``block_size``, :meth:`_data_window`), else to ``config.block_size`` up to
        :data:`LONGEST_DEFAULT_SEQ` tokens (a longer one, such as the 131072 of the named Llama 3.x configs, is the
        model's limit, not the job's: then ``plan_options["seq"]`` is required); ``global_batch_tokens`` defaults to
        one sequence per device. Run on rank 0 only (:meth:`_plan_once`, :meth:`_share_plan`). Nothing that
        fits: the planner's :class:`~lightning_tp2d.planning.planner.NothingFits` (a ``ValueError``)."""
        from lightning_tp2d.planning.planner import plan  # deferred: heavy, the cost model fits its GEMM rates on import

        family = family_of_config(config)
        if family is None:
            raise ValueError(f"layout='auto' plans for a model of a registered family, got {type(config).__name__}")
        options = dict(self.plan_options)
        seq = int(options.pop("seq", None) or self._data_window() or 0)
        if not seq:
            if config.block_size > LONGEST_DEFAULT_SEQ:
                raise ValueError(f"layout='auto' plans for the sequence length the job trains on, and none is known: "
                                 f"the model's block_size={config.block_size} is more than {LONGEST_DEFAULT_SEQ}, the "
                                 "longest taken as the default, and no data module with a block_size is attached; "
                                 "pass plan_options={'seq': <tokens per sequence>}")
            seq = config.block_size
        world = per_node * nodes
        tokens = int(options.pop("global_batch_tokens", None) or world * seq)
        asked = tuple(options.pop("layouts", None) or family.layouts)
        if set(asked) - set(family.layouts):
            raise ValueError(f"plan_options['layouts']={list(asked)}: model family {family.name!r} has plans for "
                             f"{list(family.layouts)} only")
        dropout = getattr(config, "dropout", 0.0)
        layouts = [n for n in asked if get_layout(n).dropout_problem(dropout) is None]
        if not layouts:
            raise ValueError(f"layout='auto': none of the layouts {list(asked)} trains with dropout={dropout}; set "
                             "the model's dropout to 0")
        if self._data_packs_documents():  # attention must keep inside each document: only layouts that can
            packing = [n for n in layouts if get_layout(n).documents_problem() is None]
            if not packing:
                raise ValueError(f"layout='auto': the data packs documents (pack_documents=True), and none of the "
                                 f"layouts {layouts} has per-document attention: "
                                 f"{get_layout(layouts[0]).documents_problem()}")
            layouts = packing
        if self.compile_options is not None:  # selective checkpointing runs eagerly only (see _check_arguments)
            options["checkpointing"] = tuple(m for m in options.get("checkpointing", ACTIVATION_CHECKPOINTING)
                                             if m != "selective")
        if self.activation_offload:  # offload runs on full checkpointing only (the planner prices it without offload)
            options["checkpointing"] = ("full",)
        rows = plan(config, gpus=world, gpu_memory_gib=memory_gib, gpus_per_node=per_node, seq=seq,
                    global_batch_tokens=tokens, include_baselines=False, layouts=layouts, float8=self._planned_float8,
                    **options)
        tensor, data = self._request.tensor_parallel_size, self._request.data_parallel_size
        kept = [r for r in rows if tensor in ("auto", r.tensor_parallel_size) and data in ("auto", r.data_parallel_size)
                and (self.compile_options is None or r.checkpointing == "none"
                     or get_layout(r.layout).compiles_checkpointed)]
        if not kept:
            sizes = sorted({(r.tensor_parallel_size, r.data_parallel_size) for r in rows})
            raise ValueError(f"layout='auto': none of the {len(rows)} configurations that fit has tensor_parallel_size="
                             f"{tensor}, data_parallel_size={data}" + (" and compiles" if self.compile_options else "")
                             + f"; the planned (p, dp): {sizes}")
        return kept

    def _attached_datamodule(self) -> Any:
        """The datamodule of the Trainer the LightningModule is attached to, or ``None`` (Fabric, no Trainer)."""
        module = getattr(self, "lightning_module", None)
        try:
            trainer = getattr(module, "trainer", None)
        except RuntimeError:  # a LightningModule not attached to a Trainer
            trainer = None
        return getattr(trainer, "datamodule", None)

    def _data_window(self) -> int | None:
        """Tokens per sequence of the data this strategy trains on, when it can see it: the ``block_size`` of the
        datamodule attached to the LightningModule's Trainer (``TokenDataModule``'s windows); else ``None``
        (Fabric, or data without one)."""
        window = getattr(self._attached_datamodule(), "block_size", None)
        return window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None

    def _data_packs_documents(self) -> bool:
        """Whether the data this strategy trains on packs documents (its datamodule's ``pack_documents``), when it
        can see it (:meth:`_data_window`'s datamodule); ``False`` otherwise."""
        return getattr(self._attached_datamodule(), "pack_documents", False) is True

    def _plan_once(self, plan_rows: Callable[[], list[PlanRow]]) -> tuple[list[PlanRow] | None, Exception | None]:
        """``layout="auto"``, before the process group exists: rank 0 runs ``plan_rows`` (:meth:`_plan` for the
        job), the other ranks nothing. The planner cannot run once the process group exists (it traces on a fake
        process group of its own, in forked workers, which refuse a process with a real default group), so the plan
        is made here and shared by :meth:`_share_plan` once the group exists. ``(rows, None)`` or ``(None, error)`` on
        rank 0 (the error is kept to be raised on every rank, not only here, where the other ranks would wait for
        rank 0 until the timeout), ``(None, None)`` elsewhere."""
        self.set_world_ranks()  # the global rank, before the process group sets it again
        if self.global_rank != 0:
            return None, None
        try:
            return plan_rows(), None
        except Exception as err:  # noqa: BLE001 - raised on every rank by _share_plan
            return None, err

    def _share_plan(self, planned: tuple[list[PlanRow] | None, Exception | None]) -> list[PlanRow]:
        """Rank 0's plan (:meth:`_plan_once`) on every rank, sent with the strategy's ``broadcast`` once the process
        group exists (without one: this process's own). Rank 0's error is raised on every rank: rank 0 raises its
        own, the others one of its type (a ``ValueError`` subclass such as the planner's ``NothingFits``; else a
        ``RuntimeError``) with its message."""
        rows, error = planned
        failure = None if error is None else (type(error) if isinstance(error, ValueError) else RuntimeError,
                                              f"{error} (rank 0 planned for layout='auto')")
        rows, failure = self.broadcast((rows, failure) if self.global_rank == 0 else (None, None), src=0)
        if error is not None:
            raise error
        if failure is not None:
            kind, message = failure
            try:
                raised = kind(message)
            except Exception:  # noqa: BLE001 - a class that takes other arguments: its message all the same
                raised = RuntimeError(message)
            raise raised
        return rows

    def _take_plan(self, row: PlanRow) -> None:
        """Run the planner's ``row`` as a :class:`~lightning_tp2d.train_plan.TrainPlan` (:attr:`given_plan`): its
        layout, sizes, ZeRO stage and activation checkpointing, with this strategy's ``activation_offload`` (its
        micro-batch and accumulation are advice: the data and the Trainer keep theirs)."""
        plan = dataclasses.replace(row.train_plan, activation_offload=self.activation_offload)
        self._request = dataclasses.replace(self._request, spec=plan.spec,
                                            tensor_parallel_size=plan.tensor_parallel_size,
                                            data_parallel_size=plan.data_parallel_size, zero_stage=plan.zero_stage,
                                            activation_checkpointing=plan.activation_checkpointing)
        self.given_plan = plan
        self.chosen_plan = row

    # ---- environment --------------------------------------------------------------------------------------

    def _limit_cpu_threads(self) -> None:
        if self.root_device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # CPU ranks share the node's cores; more threads than cores makes every collective wait (torchrun
            # sets OMP_NUM_THREADS=1 for the same reason)
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.num_processes))

    def _build_mesh(self, dims: TrainPlan, module: nn.Module | None):
        """The mesh a GPT2 inside ``module`` is already parallelized on, when it is this layout and these sizes
        (validate/test after fit, a second Trainer on the same module: its shards stay valid), else a new one."""
        for m in module.modules() if module is not None else ():
            pipeline = pipeline_of(m) if family_of(m) is not None else None
            if pipeline is not None and pipeline.plan == dims:  # (the stages' own sub-meshes are its slices)
                return pipeline.mesh
            handle = handle_of(m) if family_of(m) is not None else None
            if handle is None or handle.layout != self.layout_spec:
                continue
            if (handle.tensor_parallel_size, handle.data_parallel_size) == (dims.tensor_parallel_size,
                                                                           dims.data_parallel_size):
                return handle.mesh
        return init_mesh(self.layout_spec, dims.tensor_parallel_size, dims.data_parallel_size,
                         device_type=self.root_device.type, timeout=self.timeout,
                         pipeline_parallel_size=dims.pipeline_parallel_size)

    # ---- the model ----------------------------------------------------------------------------------------

    def _check_model(self, module: nn.Module) -> None:
        """The sizes fit the model's heads and width (a ValueError naming them)."""
        config = find_model_config(module)
        family = family_of_config(config)
        if family is not None:
            dims = self.parallel_dims
            family.check_model(dims.spec, dims.tensor_parallel_size, config)

    def parallelize_models(self, module: nn.Module) -> None:
        """Parallelize every not yet parallel :class:`GPT2` (or model of another registered family) inside ``module``
        on this strategy's mesh. A model built on the meta device takes its weights from ``module.init_from`` (a
        transformers directory) when ``module`` has that attribute set, else from a seed: ``module.init_seed`` if it
        has one, else rank 0's initial seed (the i-th model from ``seed + i``: the same full weights on every rank,
        whatever the layout); an eager model is first made equal to rank 0's. At ZeRO stages 2 and 3 a meta-device
        model's blocks are cut over ``data_parallel`` as they are built (:meth:`_block_sharder`; ``init_from`` then
        fills the dp shards) and :meth:`assemble` cuts the rest."""
        found = _models(module)
        if not found:
            raise TypeError(
                f"{type(module).__name__} holds no lightning_tp2d.models.GPT2 or other registered model "
                f"({model_names()}): {type(self).__name__} parallelizes the models it finds inside the module (build "
                "one in __init__ or configure_model)")
        base, plan = None, self.train_plan  # the model side of the plan: step.prepare_model

        def seed(index: int) -> int:  # the i-th meta-device model's seed (a broadcast: asked alike on every rank)
            nonlocal base
            if base is None:
                base = getattr(module, "init_seed", None)
                base = int(self.broadcast(torch.initial_seed()) if base is None else base)
            return base + index

        for index, (name, gpt) in enumerate(found):
            meta = any(p.is_meta for p in gpt.parameters())
            if plan.pipelined:
                if meta and getattr(module, "init_from", None) is not None:
                    raise ValueError(f"model {name!r}: init_from with pipeline stages needs the model built on the "
                                     "host (CausalLMModule does so), not on the meta device")
                self._cut_into_stages(name, gpt, seed(index) if meta else None)
                continue
            if is_prepared(gpt, self._mesh, plan, name):  # kept as it is (checkpointed and compiled already)
                continue
            if meta:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed(index))  # the same full weights on every rank, whatever the layout
                    prepare_model(gpt, self._mesh, plan, on_block=self._block_sharder())
                init_from = getattr(module, "init_from", None)  # CausalLMModule(init_from=<HF directory>)
                if init_from is not None:  # before Lightning restores a ckpt_path, which then wins
                    load_hf = hf_loader(family_of(gpt))
                    if load_hf is None:
                        raise ValueError(f"init_from: model family {family_of(gpt).name!r} has no transformers "
                                         "import")
                    load_hf(gpt, init_from)  # tensor by tensor, each rank keeping its shards (dp shards too)
            else:
                broadcast_module_(gpt, self._mesh)
                prepare_model(gpt, self._mesh, plan)
            if self.compile_options is not None:  # each block alone under FSDP: its hooks run between them
                for part in family_of(gpt).block_modules(gpt) if plan.fsdp else (gpt,):
                    part.compile(**self.compile_options)
        left = [n for n, p in module.named_parameters() if p.is_meta]
        if left:
            raise ValueError(f"parameters outside the {'/'.join(sorted({type(m).__name__ for _, m in found}))} modules are "
                             f"still on the meta device: {left[:5]}")

    def builds_on_meta(self, init_from=None) -> bool:
        """Whether a module should build its model on the meta device for this strategy to materialise shard by
        shard (:class:`~lightning_tp2d.module.CausalLMModule` asks): always, but for pipeline stages that load a
        transformers directory (``init_from``), which cut a model built on the host."""
        return self._run_plan is None or not self._run_plan.pipelined or init_from is None

    def _cut_into_stages(self, name: str, gpt: nn.Module, seed: int | None) -> None:
        """``gpt`` cut into this plan's pipeline stages (:class:`~lightning_tp2d.pipeline.Pipeline`), each rank's
        stages parallelized with the layout on its own ``dp x p`` ranks, and its call made the pipeline's
        (:func:`~lightning_tp2d.pipeline.run_model_as_pipeline`): ``gpt(idx, targets)`` runs the step's forward and
        backward. A meta-device model is materialised stage by stage from ``seed`` (the whole model's weights from
        that seed, each rank building only its stages); a host model first takes rank 0's weights. A model already
        cut for this plan is kept."""
        from lightning_tp2d.pipeline import Pipeline, run_model_as_pipeline

        plan = self.train_plan
        done = pipeline_of(gpt)
        if done is not None:
            if done.plan != plan:
                raise ValueError(f"model {name!r} already runs as the pipeline stages of {done.plan.describe()}, not "
                                 f"{plan.describe()}: build a new model")
            return
        options = dict(schedule=plan.pp_schedule, microbatches=plan.pp_microbatches, virtual_stages=plan.virtual_stages,
                       activation_checkpointing=plan.activation_checkpointing)
        if any(p.is_meta for p in gpt.parameters()):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                pipeline = Pipeline(gpt, self._mesh, plan.spec, **options)
        else:
            broadcast_module_(gpt, self._mesh)
            pipeline = Pipeline(gpt, self._mesh, plan.spec, **options)
        pipeline.plan = plan
        run_model_as_pipeline(pipeline)

    def pipelined_backward(self, module: nn.Module | None, loss: torch.Tensor, average: bool) -> None:
        """The backward of ``loss``, the loss a pipelined model's call returned (times a constant): its schedule ran
        the backward already; add its held gradients (:meth:`~lightning_tp2d.pipeline.Pipeline.backward`) and, when
        ``average`` (a backward that ends an accumulation window), average them over ``data_parallel``. A
        ``RuntimeError`` when ``loss`` has a graph: with stages nothing but the model's loss can be backpropagated."""
        if loss.requires_grad:
            raise RuntimeError("with pipeline stages the model's call runs its own backward: backpropagate the loss "
                               "it returns (times a constant, e.g. divided for accumulation), not a loss with a "
                               "graph of its own (an extra term of the parameters is not supported across stages)")
        waiting = [p for p in self.pipelines(module) if p.waits_for_backward]
        if len(waiting) != 1:
            raise RuntimeError(f"a pipelined backward needs exactly one model whose step waits for it, found "
                               f"{len(waiting)}: call the model once per backward")
        waiting[0].backward(loss)
        if average:
            waiting[0].average_gradients()

    def batch_problem(self, batch: int) -> str | None:
        """Why this plan cannot train batches of ``batch`` sequences per replica (a sentence naming the numbers), or
        ``None``: with pipeline stages the batch must split into the micro-batches, each into the layout's shards."""
        plan = self.train_plan
        if plan.pipelined:
            return micro_batch_problem(plan.spec, plan.tensor_parallel_size, plan.pp_microbatches, batch)
        return plan.spec.batch_problem(plan.tensor_parallel_size, batch)

    def pipelines(self, module: nn.Module | None) -> list:
        """The :class:`~lightning_tp2d.pipeline.Pipeline` of every model inside ``module`` cut into stages."""
        return [pipeline_of(m) for _, m in _models(module) if pipeline_of(m) is not None] if module is not None else []

    def _block_sharder(self):
        """Under FSDP (:attr:`TrainPlan.fsdp <lightning_tp2d.train_plan.TrainPlan.fsdp>`): what cuts each block over
        ``data_parallel`` as soon as it is materialised (:func:`~lightning_tp2d.step.block_sharder`; :meth:`assemble`
        then cuts the root), so a rank holds the dp shards of the blocks built, never its tensor shard of the whole
        model; else ``None``."""
        return block_sharder(self.train_plan, self._run_precision)

    def assemble(self, module: nn.Module, sync: bool = True) -> AssembledStep:
        """The data-parallel side of this run's step on ``module`` (:func:`~lightning_tp2d.step.assemble_step` with
        :attr:`train_plan` and the run's precision): FSDP2 over ``data_parallel`` at ZeRO stages 2 and 3, with
        ``sync`` the :class:`~lightning_tp2d.training.GradientSync` of stages 0 and 1; after the precision plugin
        converted the module, before any optimizer holds its parameters."""
        return assemble_step(module, self.device_mesh, self.train_plan, precision=self._run_precision, sync=sync)

    @property
    def shards_optimizer_state(self) -> bool:
        """Whether the optimizers get ZeRO-1's slices (:attr:`TrainPlan.optimizer_sharded
        <lightning_tp2d.train_plan.TrainPlan.optimizer_sharded>`)."""
        return self.train_plan.optimizer_sharded

    def shard_optimizer(self, optimizer) -> None:
        """ZeRO-1's slices of ``optimizer``'s state when the plan shards it
        (:func:`~lightning_tp2d.step.shard_optimizer`; at stages 2/3 of the parameters FSDP keeps whole, its own
        shards passing through)."""
        shard_optimizer(self.train_plan, optimizer, self.device_mesh)

    def sharded_models(self, module: nn.Module | None) -> list[nn.Module]:
        """The models inside ``module`` that FSDP shards (stage 2/3 with ``dp > 1``)."""
        return [m for _, m in _models(module) if fsdp.is_sharded(m)] if module is not None else []

    def clip_norm_(self, parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm of the whole gradient: over the tensor shards, and over the ``data_parallel`` shards
        too at stages 2 and 3 (:func:`lightning_tp2d.step.clip_grad_norm_`)."""
        return clip_grad_norm_(self.train_plan, parameters, max_norm, self.device_mesh, norm_type)

    def checkpoint_info(self, module: nn.Module) -> dict[str, Any]:
        """What a checkpoint records about the run that wrote it (informative; loading needs none of it)."""
        plan = self.train_plan
        info = {"layout": plan.layout, "tensor_parallel_size": plan.tensor_parallel_size,
                "data_parallel_size": plan.data_parallel_size, "zero_stage": plan.zero_stage,
                **{family.config_key: {} for family in families()}}
        for name, m in _models(module):  # each family's configs under its key (ModelFamily.config_key)
            info[family_of(m).config_key][name] = vars(m.config)
        return info
