"""Pipeline stages through the entry points: ``Trainer(strategy=TP2DStrategy(pipeline_parallel_size=...))``, Fabric,
and the refusals before launch.

* **Trainer parity**: 20 logged losses of ``CausalLMModule`` at pp 2 (GPT-2's tied head across the stages; 1F1B;
  gradient clipping by the whole model's norm; gradient accumulation) equal the single-device run's within float32
  noise, and so does the validation loss; at pp 2 x a ring of 2 too; at pp 2 x dp 2 with ZeRO 1 (Llama,
  interleaved) and ZeRO 3 (FSDP2 per stage; GPT-2's tied copy in the head's group) the same two replicas' run
  without stages.
* **Checkpoints**: a Trainer checkpoint written at pp 2 resumes without stages (a ring of 2) and continues the
  single-device run's losses.
* **Fabric**: an own loop at pp 2 (``loss = model(x, y); fabric.backward(loss)``) takes the plain model's steps.
* **Refusals**: sizes, schedules and what stages do not run with yet, each naming the numbers, when the strategy is
  built.

Ranks are Lightning's, forked with an external-launcher environment (tests/lightning_ranks.py).
"""

from __future__ import annotations

import copy
import functools

import lightning as L
import pytest
import torch

import lightning_tp2d as tp
from lightning_tp2d.fabric import TP2DFabricStrategy
from lightning_tp2d.families import family_of
from lightning_tp2d.models import GPT2, GPT2Config
from lightning_tp2d.nn.stage import Elsewhere
from lightning_tp2d.pipeline import pipeline_of
from lightning_tp2d.strategy import TP2DStrategy
from tests.lightning_ranks import run_ranks

STEPS = 20


class _Losses(L.pytorch.Callback):
    """The logged losses; ``save = (step, path)``: a checkpoint written after that step."""

    def __init__(self, save=None) -> None:
        self.losses: list[float] = []
        self.save = save

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(trainer.callback_metrics["train_loss"].item())
        if self.save is not None and trainer.global_step == self.save[0]:
            trainer.save_checkpoint(self.save[1])


def _fit(rank, world_size, strategy, trainer_kw=(), model="gpt2-tiny", steps=STEPS, ckpt=None, save=None):
    """``CausalLMModule`` for ``steps`` steps; the logged losses and the validation loss after the run."""
    L.seed_everything(0)
    recorder = _Losses(save)
    kw = dict(trainer_kw)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=2, val_check_interval=kw.pop("val_check_interval", steps),
                        callbacks=[recorder], max_steps=steps, use_distributed_sampler=False, **kw)
    module = tp.CausalLMModule(model if isinstance(model, str) else dict(model), learning_rate=3e-3,
                               warmup_steps=5, max_steps=STEPS)
    data = tp.TextDataModule(block_size=32, batch_size=4, max_tokens=40_000)
    trainer.fit(module, data, ckpt_path=ckpt)
    pp = trainer.strategy.train_plan.pipeline_parallel_size if isinstance(strategy, TP2DStrategy) else 1
    if pp > 1:  # the stages are real: this rank holds only its blocks, the others' are placeholders
        held = [not isinstance(b, Elsewhere) for b in family_of(module.model).block_modules(module.model)]
        assert pipeline_of(module.model) is not None and 0 < sum(held) < len(held)
    val = trainer.callback_metrics.get("val_loss")
    return recorder.losses, None if val is None else val.item()


@functools.cache
def _reference(trainer_kw=(), model="gpt2-tiny") -> tuple:
    return run_ranks(_fit, 1, "auto", trainer_kw, model)[0]


def _assert_parity(run, ref, tol=2e-5):
    losses, val = run
    assert len(losses) == len(ref[0]) >= STEPS  # (a loss per batch: accumulated steps log more)
    worst = max(abs(a - b) for a, b in zip(losses, ref[0]))
    assert worst <= tol, f"losses differ from the single-device run by up to {worst:.2e}"
    assert losses[-1] < losses[0] - 0.5  # it learns
    assert val is not None and abs(val - ref[1]) <= tol, (val, ref[1])


CLIPPED = (("gradient_clip_val", 0.5),)


def test_trainer_at_pp_2_trains_like_one_device_clipped_and_validated():
    """GPT-2 (its tied embedding on both ends), 1F1B over 2 micro-batches, clipped by the whole model's norm."""
    strategy = TP2DStrategy(layout="2d", tensor_parallel_size=1, pipeline_parallel_size=2, microbatches=2)
    runs = run_ranks(_fit, 2, strategy, CLIPPED)
    assert runs[0] == runs[1]  # every stage logs the last stage's loss
    _assert_parity(runs[0], _reference(CLIPPED))


ACCUMULATED = (("accumulate_grad_batches", 2), ("gradient_clip_val", 0.5))
LLAMA4 = (("n_layer", 4),) + tuple(sorted((k, v) for k, v in vars(tp.LlamaConfig.from_name("llama-tiny")).items()
                                           if k != "n_layer"))


@pytest.mark.parametrize("kwargs, trainer_kw, model", [
    ({"layout": "metp", "tensor_parallel_size": 2, "pp_schedule": "gpipe", "microbatches": 4}, ACCUMULATED,
     "gpt2-tiny"),
    ({"layout": "2d", "tensor_parallel_size": 1, "data_parallel_size": 2, "zero_stage": 1,
      "pp_schedule": "interleaved_1f1b", "virtual_stages": 2, "microbatches": 2}, CLIPPED, LLAMA4),
    ({"layout": "2d", "tensor_parallel_size": 1, "data_parallel_size": 2, "zero_stage": 3, "microbatches": 2},
     CLIPPED, "gpt2-tiny"),
], ids=["ring2-gpipe-accumulated", "dp2-zero1-interleaved-llama", "dp2-zero3-tied-gpt2"])
def test_trainer_at_pp_2_composes_with_a_ring_dp_zero_1_and_zero_3(kwargs, trainer_kw, model):
    strategy = TP2DStrategy(pipeline_parallel_size=2, **kwargs)
    runs = run_ranks(_fit, 4, strategy, trainer_kw, model)
    assert all(run == runs[0] for run in runs)
    if kwargs.get("data_parallel_size", 1) == 1:
        _assert_parity(runs[0], _reference(trainer_kw, model))
    else:  # the data module gives each replica its own batches: against the same replicas without stages
        flat = TP2DStrategy(layout="2d", tensor_parallel_size=1, data_parallel_size=2, zero_stage=kwargs["zero_stage"])
        _assert_parity(runs[0], run_ranks(_fit, 2, flat, trainer_kw, model)[0])


def test_a_pp_2_checkpoint_resumes_without_stages(tmp_path):
    """Saved after step 10 of a pp 2 run; resumed on a ring of 2 without stages for the last 10: the single-device
    run's losses (model, optimizer, schedule and data position restored)."""
    path = tmp_path / "pp2.ckpt"
    strategy = TP2DStrategy(layout="2d", tensor_parallel_size=1, pipeline_parallel_size=2, microbatches=2)
    run_ranks(_fit, 2, strategy, (), "gpt2-tiny", STEPS, None, (10, str(path)))
    resumed = run_ranks(_fit, 2, TP2DStrategy(layout="metp", tensor_parallel_size=2), (), "gpt2-tiny", STEPS,
                        str(path))[0]
    ref = _reference()
    assert len(resumed[0]) == 10
    assert max(abs(a - b) for a, b in zip(resumed[0], ref[0][10:])) <= 2e-5


def _fabric_loop(rank, world_size):
    torch.manual_seed(0)
    ref = GPT2(GPT2Config.from_name("gpt2-tiny", n_layer=4))
    model = copy.deepcopy(ref)
    fabric = L.Fabric(strategy=TP2DFabricStrategy(layout="2d", tensor_parallel_size=1, pipeline_parallel_size=2,
                                                  microbatches=2), accelerator="cpu", devices=world_size)
    fabric.launch()
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    ref_optimizer = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(3):
        idx = torch.randint(0, 257, (4, 32), generator=g)
        optimizer.zero_grad()
        loss = model(idx, idx)
        fabric.backward(loss)
        norm = fabric.clip_gradients(model, optimizer, max_norm=0.5)
        optimizer.step()
        ref_optimizer.zero_grad()
        ref_loss = ref(idx, idx)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_optimizer.step()
        out.append((loss.item(), ref_loss.item(), norm.item(), ref_norm.item()))
    with torch.no_grad():
        model.eval()
        ref.eval()
        out.append((model(idx, idx).item(), ref(idx, idx).item(), 0.0, 0.0))
    return out


def test_fabric_loop_at_pp_2_takes_the_plain_models_steps():
    for rank_out in run_ranks(_fabric_loop, 2):
        for loss, ref_loss, norm, ref_norm in rank_out:
            assert abs(loss - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss)), (loss, ref_loss)
            assert abs(norm - ref_norm) <= 1e-5 * max(1.0, ref_norm), (norm, ref_norm)


@pytest.mark.parametrize("kwargs, devices, message", [
    ({"pipeline_parallel_size": 3}, 4, "pipeline_parallel_size=3 must divide"),
    ({"pipeline_parallel_size": 2, "pp_schedule": "zb"}, 4, "pp_schedule='zb' is not one of"),
    ({"pipeline_parallel_size": 2, "microbatches": 1}, 4, "microbatches=1 < pipeline_parallel_size=2"),
    ({"pipeline_parallel_size": 2, "virtual_stages": 2}, 4, "virtual_stages=2 needs pp_schedule='interleaved_1f1b'"),
    ({"pipeline_parallel_size": 2, "layout": "auto", "memory_gib": 8}, 4, "layout='auto'"),
    ({"pipeline_parallel_size": 2, "compile": True}, 4, "compile"),
    ({"pipeline_parallel_size": 2, "save_distributed_checkpoint": False}, 4, "save_distributed_checkpoint=False"),
])
def test_pipeline_arguments_are_refused_when_the_trainer_is_built(kwargs, devices, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        L.Trainer(strategy=TP2DStrategy(**kwargs), accelerator="cpu", devices=devices, logger=False)


def test_a_plan_carries_the_stages_into_the_strategy():
    plan = tp.TrainPlan("metp", 2, pipeline_parallel_size=2, pp_schedule="gpipe", microbatches=4)
    trainer = L.Trainer(strategy=TP2DStrategy(plan=plan), accelerator="cpu", devices=4, logger=False)
    resolved = trainer.strategy.train_plan
    assert (resolved.pipeline_parallel_size, resolved.pp_schedule, resolved.pp_microbatches) == (2, "gpipe", 4)
    assert "pp=2 gpipe x4" in resolved.describe()
    with pytest.raises(ValueError, match="pipeline_parallel_size=4 \\(the plan's: 2\\)"):
        TP2DStrategy(plan=plan, pipeline_parallel_size=4)
