"""Pipeline stages priced (issue 51, item 5): :mod:`lightning_tp2d.planning.pipeline_cost` and the planner's rows
with ``pp``, held to a real pipeline step.

* **The model's terms**: the bubble ``(pp - 1) / (m v + pp - 1)``, the micro-batches each rank keeps in flight by
  schedule (torch's interleaved warm-up count), the step of ``m v + pp - 1`` chunk slots.
* **Held to a real step** (CPU gloo, :class:`~lightning_tp2d.pipeline.Pipeline`): every point-to-point byte torch's
  schedule sends is :func:`~lightning_tp2d.planning.pipeline_cost.boundary_bytes`'s (an activation shard forward
  and its gradient back per chunk and boundary, not a gathered activation); each rank runs ``m x v`` chunk
  forwards; the planner's split of blocks per rank (:func:`~lightning_tp2d.planning.planner.stage_blocks`) is the
  one the pipeline cuts.
* **Rows**: both sides get ``pp`` rows from :func:`~lightning_tp2d.planning.planner.plan` (``pipeline_sizes``); a
  row's time is its slowest rank's work over ``1 - bubble`` plus its boundary transfers; its memory the first rank's
  in-flight micro-batches; its ``tp2d-train`` overrides compose into a strategy that runs the stages, and the
  baseline's torchtitan settings name PP's degree, schedule and micro-batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

import lightning_tp2d as tp
from lightning_tp2d import launch, train
from lightning_tp2d.families import model_config
from lightning_tp2d.models import GPT2, GPT2Config
from lightning_tp2d.pipeline import Pipeline, StageModule
from lightning_tp2d.planning import planner
from lightning_tp2d.planning.commands import torchtitan_settings, train_overrides
from lightning_tp2d.planning.pipeline_cost import (boundary_bytes, bubble_fraction, chunk_slots, in_flight,
                                                   pipeline_step_time)
from tests.distributed import run_distributed

launch.register_resolvers()


def test_the_bubble_and_the_slots_of_each_schedule():
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7) and bubble_fraction(4, 16) == pytest.approx(3 / 19)
    assert bubble_fraction(4, 8, 2, "interleaved_1f1b") == pytest.approx(3 / 19)  # interleaving: warm-up / v
    assert bubble_fraction(4, 8, schedule="gpipe") == bubble_fraction(4, 8, schedule="1f1b")
    assert chunk_slots(4, 8, 2, "interleaved_1f1b") == 19
    # a step: the slots times (one chunk's work + its transfers); the idle share is the bubble
    step = pipeline_step_time(8.0, 0.0, 4, 8)
    assert step == pytest.approx(11.0) and 1 - 8.0 / step == pytest.approx(bubble_fraction(4, 8))
    assert pipeline_step_time(8.0, 0.5, 4, 8) == pytest.approx(11 * 1.5)
    assert pipeline_step_time(8.0, 0.5, 1, 8) == 8.0
    with pytest.raises(ValueError, match="virtual_stages=2 needs schedule 'interleaved_1f1b'"):
        bubble_fraction(4, 8, 2, "1f1b")


def test_what_each_rank_keeps_in_flight():
    assert [in_flight(4, 8, schedule="gpipe", rank=r) for r in range(4)] == [8.0] * 4
    assert [in_flight(4, 8, rank=r) for r in range(4)] == [4.0, 3.0, 2.0, 1.0]  # 1F1B: pp - rank
    assert in_flight(4, 2, rank=0) == 2.0  # never more than the micro-batches
    # interleaved: torch's warm-up, (v - 1) pp + 2 (pp - 1 - r) chunk forwards, each 1 / v of the rank's blocks
    assert in_flight(4, 8, 2, "interleaved_1f1b", 0) == pytest.approx((4 + 6 + 1) / 2)
    assert in_flight(4, 8, 2, "interleaved_1f1b", 3) == pytest.approx((4 + 0 + 1) / 2)


BATCH, SEQ, MICRO = 8, 32, 4


def _sent(rank: int, world_size: int, pp: int, layout: str, p: int, schedule: str, virtual: int) -> dict:
    """One step of a real pipeline: the bytes this rank's schedule sends point to point, its chunk forwards, and its
    blocks."""
    torch.manual_seed(0)
    model = GPT2(GPT2Config.from_name("gpt2-tiny", dropout=0.0, n_layer=8))
    mesh = tp.init_mesh(layout, p, 1, pipeline_parallel_size=pp)
    pipe = Pipeline(model, mesh, layout, schedule=schedule, microbatches=MICRO, virtual_stages=virtual)
    sent, forwards = [], [0]
    real_init, real_forward = dist.P2POp.__init__, StageModule.forward

    def record(self, op, tensor, *args, **kwargs):
        if op is dist.isend:
            sent.append(tensor.numel() * tensor.element_size())
        real_init(self, op, tensor, *args, **kwargs)

    def count(self, x):
        forwards[0] += 1
        return real_forward(self, x)

    idx = torch.randint(0, 257, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    pipe.step(idx, idx)  # (the first step also infers the stages' shapes: one more forward)
    dist.P2POp.__init__, StageModule.forward = record, count
    try:
        pipe.step(idx, idx)
    finally:
        dist.P2POp.__init__, StageModule.forward = real_init, real_forward
    return {"bytes": sum(sent), "forwards": forwards[0], "blocks": sum(len(pipe.splits[i]) for i in pipe.stage_indices),
            "pipe_rank": pipe.rank}


@pytest.mark.parametrize("pp, layout, p, schedule, virtual", [(4, "2d", 1, "1f1b", 1),
                                                               (2, "metp", 2, "interleaved_1f1b", 2)])
def test_a_real_step_sends_the_priced_boundary_bytes_and_runs_the_priced_chunks(pp, layout, p, schedule, virtual):
    out = run_distributed(_sent, 4, pp, layout, p, schedule, virtual)
    cfg = GPT2Config.from_name("gpt2-tiny", dropout=0.0, n_layer=8)
    micro = BATCH // MICRO
    per_chunk = boundary_bytes(micro, SEQ, cfg.n_embd, p, 4, 1)  # float32 on CPU: one chunk's two transfers
    # the middle ranks send what boundary_bytes says, the ends one direction less; nothing gathered
    by_stage = {}
    for r in out:
        by_stage.setdefault(r["pipe_rank"], []).append(r)
    for rank, rows in by_stage.items():
        for r in rows:
            assert r["forwards"] == MICRO * virtual  # m x v chunk forwards
            ends = (rank == 0) + (rank == pp - 1)  # the first stage sends no gradient back, the last no activation
            assert r["bytes"] == pytest.approx(per_chunk * MICRO * virtual - ends * per_chunk / 2 * MICRO)
    total = sum(r["bytes"] for r in out)
    assert total == pytest.approx(p * (pp * virtual - 1) * per_chunk * MICRO)  # (pp v - 1) boundaries, p shards each
    # the planner's blocks per rank are the pipeline's split
    assert sorted({(r["pipe_rank"], r["blocks"]) for r in out}) == list(
        enumerate(planner.stage_blocks(cfg, cfg.block_size, pp, virtual)))


HW = planner.HARDWARE["h100"]


def test_a_row_with_stages_is_its_slowest_rank_over_the_bubble_plus_its_transfers():
    cfg = model_config("llama-3.1-8b")
    with planner.pricing("closed"):
        flat = planner.price(cfg, layout="tp1d-sp", p=4, dp=1, zero_stage=1, checkpointing="full", micro_batch=2,
                             grad_accum=8, seq=4096, hw=HW, gpus_per_node=8)
        staged = planner.price(cfg, layout="tp1d-sp", p=4, dp=1, zero_stage=1, checkpointing="full", micro_batch=2,
                               grad_accum=8, seq=4096, hw=HW, gpus_per_node=8, pipeline_parallel_size=4)
        package = planner.price(cfg, layout="2d", p=4, dp=1, zero_stage=1, checkpointing="full", micro_batch=2,
                                grad_accum=8, seq=4096, hw=HW, gpus_per_node=8, pipeline_parallel_size=4,
                                pp_schedule="interleaved_1f1b", virtual_stages=2)
    t = staged.parts["time_s"]
    assert staged.pipeline_parallel_size == 4 and staged.parts["stage_blocks"] == [8, 9, 9, 6]
    bubble = bubble_fraction(4, 8)
    assert t["pp_bubble"] == pytest.approx(bubble * (staged.step_s - t["dp_exposed"] - t["optimizer"]))
    assert t["stage_work"] + t["pp_bubble"] + t["pp_boundary"] * (1 - bubble) == pytest.approx(
        staged.step_s - t["dp_exposed"] - t["optimizer"], rel=1e-9)
    # a quarter of the blocks per GPU, four times the GPUs: each GPU's work near a quarter, plus the bubble
    assert flat.step_s / 4 < t["stage_work"] < flat.step_s / 4 * 1.3
    assert staged.memory_gib < flat.memory_gib  # a quarter of the weights and state, 4 micro-batches in flight
    assert staged.tokens_per_s_per_gpu == pytest.approx(2 * 8 * 4096 / staged.step_s / 16)
    assert package.virtual_stages == 2 and package.parts["time_s"]["pp_bubble"] > 0
    assert "pp=4 interleaved_1f1b v=2" in package.describe()
    plan = package.train_plan
    assert (plan.pipeline_parallel_size, plan.pp_schedule, plan.virtual_stages, plan.pp_microbatches) == (
        4, "interleaved_1f1b", 2, 8)
    assert planner.PlanRow.of(**package.to_dict()).plan == package.plan  # (cached rows read back)


def test_plan_offers_stage_rows_on_both_sides_and_only_what_runs():
    """Both sides' stage rows, with the micro-batch counts their schedules take and the stages' GPUs."""
    rows = planner.plan("llama-3.1-8b", gpus=16, gpu_memory_gib=80, seq=4096, global_batch_tokens=2**20,
                        pipeline_sizes=(1, 2), layouts=("2d",), checkpointing=("full",), cache=False)
    staged = [r for r in rows if r.pipeline_parallel_size == 2]
    assert {r.baseline for r in staged} == {False, True}  # the package and torchtitan's PP
    assert {r.zero_stage for r in staged if not r.baseline} >= {1, 3}  # FSDP2 per stage too
    assert all(r.grad_accum >= 2 for r in staged if r.pp_schedule == "1f1b")  # 1F1B: m >= pp
    assert all(r.grad_accum % 2 == 0 for r in staged if r.pp_schedule == "interleaved_1f1b")
    assert all(r.tensor_parallel_size * r.data_parallel_size * 2 == 16 for r in staged)
    with pytest.raises(ValueError, match="pipeline_sizes must be positive ints"):
        planner.plan("llama-3.1-8b", gpus=16, gpu_memory_gib=80, seq=4096, global_batch_tokens=2**20,
                     pipeline_sizes=(0,), cache=False)


def _row(**more):
    return planner.PlanRow.of(layout="metp", baseline=False, tensor_parallel_size=2, data_parallel_size=1,
                              zero_stage=1, checkpointing="full", micro_batch=1, grad_accum=4, memory_gib=1.0,
                              step_s=1.0, tokens_per_s_per_gpu=1.0, mfu=0.1, pipeline_parallel_size=2,
                              pp_schedule="interleaved_1f1b", virtual_stages=2, **more)


def test_a_stage_rows_command_runs_its_stages():
    row = _row()
    over = train_overrides(row, "llama-tiny", 64, gpus_per_node=8)
    assert {"parallel.pipeline_parallel_size=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.microbatches=4",
            "parallel.virtual_stages=2", "trainer.devices=4", "trainer.accumulate_grad_batches=1",
            "data.batch_size=4"} <= set(over)
    assert "parallel.compile=true" not in over  # stages do not compile yet
    with initialize_config_dir(config_dir=str(launch.CONF_DIR), version_base="1.3", job_name="test"):
        cfg = compose(config_name="config", overrides=over + ["model.n_layer=4"])
    strategy = instantiate(cfg.parallel, **train.strategy_overrides(cfg.parallel))
    asked = strategy._request
    assert (asked.pipeline_parallel_size, asked.pp_schedule, asked.microbatches, asked.virtual_stages) == (
        2, "interleaved_1f1b", 4, 2)
    baseline = planner.PlanRow.of(layout=planner.BASELINE, baseline=True, tensor_parallel_size=8, data_parallel_size=8,
                                  zero_stage=3, checkpointing="full", micro_batch=1, grad_accum=16, memory_gib=1.0,
                                  step_s=1.0, tokens_per_s_per_gpu=1.0, mfu=0.1, pipeline_parallel_size=8,
                                  pp_schedule="1f1b")
    settings = torchtitan_settings(baseline, 8192)
    assert {"--parallelism.pipeline_parallel_degree=8", "--parallelism.pipeline_parallel_schedule=1F1B",
            "--parallelism.pipeline_parallel_microbatch_size=1", "--training.local_batch_size=16"} <= set(settings)
    assert not any(s.startswith("--training.global_batch_size") for s in settings)


def test_fsdp_under_stages_holds_the_gathered_stage_and_its_unreduced_gradients():
    """torch's PipelineStage keeps an FSDP stage gathered and its gradients unreduced from the first micro-batch to
    the last: the memory of a ZeRO 3 row with stages holds the rank's tensor shard in bf16 and float32 on top of the
    row's, and its data-parallel collectives are priced once per step, not per micro-batch."""
    cfg = model_config("llama-3.1-8b")
    with planner.pricing("closed"):
        kw = dict(layout="tp1d-sp", p=4, dp=2, zero_stage=3, checkpointing="full", micro_batch=1, seq=4096, hw=HW,
                  gpus_per_node=8, pipeline_parallel_size=2)
        row = planner.price(cfg, grad_accum=8, **kw)
        single = planner.price(cfg, grad_accum=2, **kw)
    held = row.parts["memory_bytes"]["pp_fsdp_held"]
    split = planner.parameter_split(cfg)
    blocks = planner.stage_blocks(cfg, 4096, 2)
    ranks = [(blocks[0] * split.block + split.embedding) / 4, (blocks[1] * split.block + split.root
                                                               - split.embedding) / 4]
    assert held == pytest.approx(max(ranks) * 6) or held == pytest.approx(min(ranks) * 6)
    assert row.parts["time_s"]["dp_comm"] == pytest.approx(single.parts["time_s"]["dp_comm"])  # once per step
