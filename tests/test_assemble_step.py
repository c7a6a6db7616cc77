"""One :class:`~lightning_tp2d.train_plan.TrainPlan` and one :func:`~lightning_tp2d.step.assemble_step` (issue 36).

* the plan's checks and its ZeRO predicates at every stage x dp, against the table of what each stage runs;
* every place that runs or prices a step (the strategies' core, Fabric, the Trainer strategy, the tracer's build, the
  memory model's profile, the benchmark's measured step) calls ``assemble_step`` and none wires FSDP, GradientSync,
  ZeRO-1 or a clipping function of its own;
* on gloo, dp 2 x a ring of 2 (4 ranks, one spawn): a real clipped AdamW step assembled by ``assemble_step`` at each
  ZeRO stage 0-3 sends, call for call (kind, axis, group size, bytes, phase), what the tracer's step
  (``cost_model.comm_events(..., dp=2, zero_stage=s, clip=True)``) says on every rank, and every stage's step leaves
  the weights stage 0's step leaves.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections import Counter

import pytest
import torch

import lightning_tp2d as tp
from lightning_tp2d import comm_record, core, fabric, fsdp, strategy, zero
from lightning_tp2d.bench import measure, runner
from lightning_tp2d.core import RunRequest
from lightning_tp2d.fabric import TP2DFabricStrategy
from lightning_tp2d.layouts import get_layout
from lightning_tp2d.models import GPT2, GPT2Config
from lightning_tp2d.parallelize import ACTIVATION_CHECKPOINTING
from lightning_tp2d.planning import cost_model as cm
from lightning_tp2d.planning import memory_model, trace
from lightning_tp2d.step import assemble_step
from lightning_tp2d.train_plan import CHECKPOINTING, PRECISIONS, ZERO_STAGES, TrainPlan
from tests.distributed import run_distributed

# ---- (a) the plan ---------------------------------------------------------------------------------------------

# (stage, dp) -> (fsdp, reshard_after_forward, optimizer_sharded, gradient_sync, clip_with_fsdp): what each runs
EXPECTED = {
    (0, 1): (False, False, False, False, False), (0, 2): (False, False, False, True, False),
    (0, 4): (False, False, False, True, False),
    (1, 1): (False, False, True, False, False), (1, 2): (False, False, True, True, False),
    (1, 4): (False, False, True, True, False),
    (2, 1): (False, False, False, False, True), (2, 2): (True, False, True, False, True),
    (2, 4): (True, False, True, False, True),
    (3, 1): (False, False, False, False, True), (3, 2): (True, True, True, False, True),
    (3, 4): (True, True, True, False, True),
}


@pytest.mark.parametrize("stage_dp", sorted(EXPECTED), ids=lambda k: f"zero{k[0]}-dp{k[1]}")
def test_plan_predicates_are_the_zero_rules_at_every_stage_and_dp(stage_dp):
    stage, dp = stage_dp
    plan = TrainPlan("metp", 2, dp, stage)
    got = (plan.fsdp, plan.reshard_after_forward, plan.optimizer_sharded, plan.gradient_sync, plan.clip_with_fsdp)
    assert got == EXPECTED[stage_dp]
    assert plan.world_size == 2 * dp


def test_plan_constants_are_the_runtimes():
    from lightning_tp2d import fsdp
    from lightning_tp2d.train_plan import FSDP_STAGES

    assert zero.ZERO_STAGES is ZERO_STAGES and ACTIVATION_CHECKPOINTING is CHECKPOINTING
    assert fsdp.FSDP_STAGES is FSDP_STAGES
    assert core.SUPPORTED_PRECISION == PRECISIONS
    assert tp.TrainPlan is TrainPlan and "TrainPlan" in tp.__all__


@pytest.mark.parametrize("kwargs, message", [
    ({"layout": "3d"}, "unknown layout '3d'"),
    ({"layout": "2d", "tensor_parallel_size": 6}, "6 is not a perfect square"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be a positive int, got 0"),
    ({"data_parallel_size": 2.0}, "data_parallel_size must be a positive int, got 2.0"),
    ({"zero_stage": 4}, "zero_stage=4 is not one of [0, 1, 2, 3]"),
    ({"zero_stage": True}, "zero_stage=True is not one of"),
    ({"activation_checkpointing": "some"}, "activation_checkpointing='some' is not one of"),
    ({"activation_offload": 1}, "activation_offload must be True or False, got 1"),
    ({"activation_offload": True, "activation_checkpointing": "selective"}, "got activation_checkpointing='selective'"),
    ({"micro_batch": 0}, "micro_batch must be a positive int or None, got 0"),
    ({"precision": "16-mixed"}, "precision='16-mixed' is not one of"),
])
def test_plan_refuses_bad_values_naming_them(kwargs, message):
    args = {"layout": "metp", "tensor_parallel_size": 2, **kwargs}
    with pytest.raises(ValueError) as err:
        TrainPlan(**args)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_strategies_take_a_plan_and_refuse_arguments_that_disagree():
    plan = TrainPlan("metp", 2, 2, zero_stage=1, activation_checkpointing="full", micro_batch=3)
    trainer_side = tp.TP2DStrategy(plan=plan)
    # the strategy holds what it was asked as one object (its sizes resolved when the Trainer is built)
    assert trainer_side._request == RunRequest(get_layout("metp"), 2, 2, 1, "full")
    assert (trainer_side.layout, trainer_side.zero_stage, trainer_side.activation_checkpointing) == ("metp", 1, "full")
    fabric_side = TP2DFabricStrategy(plan=plan, zero_stage=1, tensor_parallel_size=2)  # equal: accepted
    assert fabric_side._request == RunRequest(get_layout("metp"), 2, 2, 1, "full")
    with pytest.raises(ValueError, match=r"data_parallel_size=4 \(the plan's: 2\), zero_stage=3 \(the plan's: 1\)"):
        tp.TP2DStrategy(plan=plan, zero_stage=3, data_parallel_size=4)
    with pytest.raises(ValueError, match=r"layout='auto' \(the plan's: 'metp'\)"):
        tp.TP2DStrategy(plan=plan, layout="auto")
    with pytest.raises(ValueError, match="the plan's precision='bf16-mixed' disagrees with the run's precision "
                                         "'32-true'"):
        tp.TP2DStrategy(plan=TrainPlan("metp", 2, precision="bf16-mixed"))._check_precision_name("32-true")


def test_a_plan_is_the_runs_sizes_and_carries_its_layouts_options():
    import dataclasses

    plan = TrainPlan("2d", 9, 2, zero_stage=3)
    assert tp.ParallelDims is TrainPlan  # one class for the sizes and the plan
    assert (plan.q, plan.world_size, plan.mesh_shape, plan.mesh_dim_names) == (3, 18, (2, 3, 3),
                                                                               ("data_parallel", "row", "col"))
    with pytest.raises(ValueError, match=r"world size 6 != data_parallel_size 2 x tensor_parallel_size 9 = 18"):
        plan.check_world_size(6)
    options = tp.RingOptions(double_buffer=False)
    ring = TrainPlan(tp.layouts.get_layout("metp", options), 4)  # a Layout object: its name, its options
    assert ring.layout == "metp" and ring.options == options and ring.spec.options == options
    assert ring == TrainPlan("metp", 4, options=options) != TrainPlan("metp", 4)
    assert dataclasses.replace(ring, zero_stage=1).spec.options == options  # replace keeps them
    assert TrainPlan(tp.layouts.get_layout("metp"), 4) == TrainPlan("metp", 4)  # default options: the same plan
    # the strategies hold the plan: one given with options reaches their layout
    assert tp.TP2DStrategy(plan=ring).layout_spec.options == options


# ---- (b) one assemble_step --------------------------------------------------------------------------------------

# (module, qualified function or None for the whole module): every place that assembles a step
USERS = [(core, "TensorParallelCore.assemble"), (trace, "_build"), (memory_model, "_shards_here"),
         (measure, "step_peak_bytes")]
ADAPTERS = [strategy, fabric]  # they call the core's assemble
WIRING = {"shard_data_parallel", "shard_block", "GradientSync", "shard_optimizer_state", "clip_grad_norm_",
          "mixed_precision_policy"}  # what only lightning_tp2d.step may call for a step


def _function(module, qualname: str) -> ast.AST:
    tree = ast.parse(inspect.getsource(module))
    node: ast.AST = tree
    for part in qualname.split("."):
        node = next(n for n in ast.iter_child_nodes(node)
                    if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
    return node


def _called(node: ast.AST) -> set[str]:
    """What ``node`` calls: ``name`` or ``owner.name`` (an attribute of a plain name)."""
    names = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            if isinstance(f, ast.Attribute):
                names.add(f"{f.value.id}.{f.attr}" if isinstance(f.value, ast.Name) else f.attr)
            elif isinstance(f, ast.Name):
                names.add(f.id)
    return names


def _wiring(called: set[str], bare: set[str] = WIRING) -> set[str]:
    """The calls that wire a step by hand: the runtime's own functions (``fsdp.``, ``training.``, ``zero.``), or
    imported under their names (``bare``)."""
    return {c for c in called if c in bare or (c.partition(".")[0] in ("fsdp", "training", "zero")
                                                and c.partition(".")[2] in WIRING)}


def test_every_step_user_calls_assemble_step_and_wires_nothing_itself():
    for module, qualname in USERS:
        called = _called(_function(module, qualname))
        assert "assemble_step" in called, (module.__name__, qualname)
        assert not _wiring(called), (module.__name__, qualname, _wiring(called))
    for module in (core, *ADAPTERS):  # the strategies: no wiring anywhere (core's clip_grad_norm_ is the step's)
        called = _called(ast.parse(inspect.getsource(module)))
        assert not _wiring(called, WIRING - {"clip_grad_norm_"}), (module.__name__, _wiring(called))
    assert core.clip_grad_norm_.__module__ == "lightning_tp2d.step"
    for module in ADAPTERS:
        assert "self.assemble" in _called(ast.parse(inspect.getsource(module))), module.__name__
    clip = textwrap.dedent(inspect.getsource(core.TensorParallelCore.clip_norm_))
    assert "self.train_plan" in clip and "zero_stage" not in clip  # the plan's rule, not a stage test of its own


# the places that turn a plan's layout and checkpointing into a model: each calls step.prepare_model, none
# parallelizes or checkpoints a package layout's model itself
PREPARERS = [(core, "TensorParallelCore.parallelize_models"), (trace, "_build"), (memory_model, "_shards_here"),
             (runner, "_build")]


def test_every_model_preparer_calls_prepare_model_and_parallelizes_nothing_itself():
    for module, qualname in PREPARERS:
        called = _called(_function(module, qualname))
        assert "prepare_model" in called, (module.__name__, qualname)
        assert "parallelize" not in called, (module.__name__, qualname)
        if module is not runner:  # (the bench checkpoints the rivals' plain and 1-D models with torch's code)
            assert "checkpoint_activations" not in called, (module.__name__, qualname)


def _built_steps(rank: int, world_size: int) -> dict:
    from lightning_tp2d.layouts import handle_of
    from lightning_tp2d.parallelize import _mode_of  # (the checkpointing a model carries)
    from lightning_tp2d.step import build_step, prepare_model

    cfg = GPT2Config.from_name("gpt2-tiny", n_head=12, dropout=0.0)
    torch.manual_seed(0)
    plain = GPT2(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    want = plain(idx, idx).item()
    mesh = tp.init_mesh("metp", world_size, 1)
    model = GPT2(cfg)
    model.load_state_dict(plain.state_dict())
    plan = TrainPlan("metp", world_size, activation_checkpointing="full")
    step = build_step(model, mesh, plan, precision="32-true")
    out = {"parallel": handle_of(model) is not None, "mode": _mode_of(model), "sync": step.gradient_sync,
           "loss": model(idx, idx).item(), "want": want, "plan": step.plan == plan}
    again = prepare_model(model, mesh, plan)  # already prepared on this mesh: kept as it is
    out["kept"] = again is model and _mode_of(model) == "full"
    errors = []
    for other in (TrainPlan("metp", world_size, activation_checkpointing="full"),):
        try:
            prepare_model(model, tp.init_mesh("metp", world_size, 1), other)  # another mesh
        except ValueError as err:
            errors.append(str(err))
    out["errors"] = errors
    options = tp.RingOptions(double_buffer=False)  # a Layout object in the plan reaches the model, options and all
    carried = prepare_model(GPT2(cfg), mesh, TrainPlan(tp.layouts.get_layout("metp", options), world_size))
    out["options"] = handle_of(carried).layout.options == options
    return out


def test_build_step_prepares_the_model_and_assembles_its_step():
    for r in run_distributed(_built_steps, 2):
        assert r["parallel"] and r["mode"] == "full" and r["sync"] is None and r["plan"] and r["kept"]
        assert r["loss"] == pytest.approx(r["want"], rel=1e-5)  # the plain model's loss, checkpointed ring of 2
        assert "already parallelized with layout 'metp' on another mesh" in r["errors"][0]
        assert r["options"]


# ---- (c) the traced step is the assembled step, collective by collective ------------------------------------------

LAYOUT, P, DP, BATCH, SEQ = "metp", 2, 2, 2, 24
CFG = {"n_head": 12}  # gpt2-tiny: h=48, V=257, L=2; 12 heads over a ring of 2


class _Calls:
    """A :func:`~lightning_tp2d.comm_record.recording` target: every call as ``(kind, axis, group size, bytes,
    phase)``."""

    def __init__(self) -> None:
        self.phase, self.calls = "forward", Counter()

    def posted(self, call: comm_record.CommCall) -> None:
        self.calls[(call.kind, call.axis, len(call.ranks), call.nbytes, self.phase)] += 1

    def waited(self, call: comm_record.CommCall) -> None:
        pass


def _assembled_steps(rank: int, world_size: int) -> dict:
    cfg = GPT2Config.from_name("gpt2-tiny", **CFG)
    mesh = tp.init_mesh(LAYOUT, P, world_size // P)
    out = {"rank": rank % P, "calls": {}, "weights": {}}
    for stage in ZERO_STAGES:
        torch.manual_seed(0)
        model = tp.parallelize(GPT2(cfg), mesh, LAYOUT)
        step = assemble_step(model, mesh, TrainPlan(LAYOUT, P, world_size // P, stage), precision="32-true")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step.shard_optimizer(optimizer)
        g = torch.Generator().manual_seed(1 + mesh.get_local_rank("data_parallel"))
        idx, targets = (torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g) for _ in range(2))
        with fsdp.gathered(model):
            start = {n: q.full_tensor().clone() for n, q in model.named_parameters()}
        recorder = _Calls()
        with comm_record.recording(recorder):
            loss = model(idx, targets)
            recorder.phase = "backward"
            loss.backward()
            if step.gradient_sync is not None:
                step.gradient_sync.finish()
            step.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        out["calls"][stage] = dict(recorder.calls)
        with fsdp.gathered(model):  # the stage-0 form of every parameter (a collective at stages 2/3)
            weights = {n: q.full_tensor().clone() for n, q in model.named_parameters()}
        if stage == 0:
            base, base_start = weights, start
        moved = max((weights[n] - base_start[n]).abs().max().item() for n in weights) if stage else 0.0
        out["weights"][stage] = (max((weights[n] - base[n]).abs().max().item() for n in weights), moved)
    return out


@pytest.fixture(scope="module")
def assembled_runs():
    return run_distributed(_assembled_steps, P * DP, timeout=300)


@pytest.mark.parametrize("stage", ZERO_STAGES)
def test_traced_step_equals_the_assembled_step_call_for_call(assembled_runs, stage):
    cfg = GPT2Config.from_name("gpt2-tiny", **CFG)
    for global_rank, out in enumerate(assembled_runs):
        events = cm.comm_events(LAYOUT, cfg, BATCH, SEQ, P, 4, rank=out["rank"], dp=DP, zero_stage=stage, clip=True)
        traced = Counter()
        for e in events:
            traced[(e.kind, e.group, e.group_size, e.nbytes, e.phase)] += e.calls
        assert traced == Counter(out["calls"][stage]), (stage, global_rank)
        kinds = {k[0] for k in out["calls"][stage] if k[1] == "data_parallel"}
        assert kinds == [{"all_reduce"}, {"all_reduce", "all_gather"}, {"all_gather", "reduce_scatter", "all_reduce"},
                         {"all_gather", "reduce_scatter", "all_reduce"}][stage], stage


def test_every_stage_steps_to_stage_0s_weights(assembled_runs):
    for out in assembled_runs:  # (largest difference from stage 0's stepped weights, largest move of the step)
        for stage in ZERO_STAGES[1:]:
            difference, moved = out["weights"][stage]
            assert moved > 1e-3, (stage, moved)  # the step changed the weights (lr 1e-2) ...
            assert difference < 1e-5, (stage, difference)  # ... as stage 0's did


def test_the_zero_rules_are_stated_once_in_train_plan():
    """Issue 49: FSDP on (stages 2 and 3 over more than one replica), resharding after the forward (stage 3 under
    FSDP) and the lists of ZeRO stages and checkpointing modes are written in :mod:`lightning_tp2d.train_plan` only;
    the runtime (``fsdp``, ``step``, the 1-D baseline) and the planner's models ask its functions."""
    import re
    from pathlib import Path

    from lightning_tp2d.train_plan import fsdp_shards, reshards_after_forward

    package = Path(tp.__file__).parent
    restated = re.compile(r"stage\s*(>=\s*2|>\s*1|<\s*2|==\s*3\b)|\(0, 1, 2, 3\)|stage\w* (not )?in \(2, 3\)"
                          r"|dp\s*>\s*1\s+and\s+\w*stage|\(\"none\", \"(selective|full)\", \"(selective|full)\"\)")
    found = [f"{path.relative_to(package)}:{n}: {line.strip()}" for path in sorted(package.rglob("*.py"))
             if path.name != "train_plan.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if restated.search(line)]
    assert found == [], found
    for stage, dp in EXPECTED:
        plan = TrainPlan("metp", 2, dp, stage)
        assert (fsdp_shards(stage, dp), reshards_after_forward(stage, dp)) == (plan.fsdp, plan.reshard_after_forward)
