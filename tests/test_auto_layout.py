"""``TP2DStrategy(layout="auto")`` and ``tp2d-train parallel=auto``: the strategy runs the planner's best row.

One process, no process group: the Trainer is built (4 CPU devices), the module connected, and the resolving step
(``plan_layout``, what ``setup_environment`` calls before the process group) run directly; its choice is compared
with :func:`lightning_tp2d.planning.planner.plan` called by hand. The plans are restricted (ZeRO 0/1, no selective
checkpointing, one sequence per micro-batch) to keep them at seconds; the planner caches its traces, so the second
plan of the same model is free.
"""

from __future__ import annotations

import sys

import lightning.pytorch as L
import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate

import lightning_tp2d as tp
from lightning_tp2d import strategy as strategy_module
from lightning_tp2d import launch, train
from lightning_tp2d.planning.planner import NothingFits, plan
from lightning_tp2d.families import family_of_config, model_config
from lightning_tp2d.fabric import TP2DFabricStrategy
from lightning_tp2d.strategy import TP2DStrategy
from lightning_tp2d.train import ConfigError, check_config
from tests.lightning_ranks import run_ranks

FAST = {"zero_stages": (0, 1), "checkpointing": ("none", "full"), "max_micro_batch": 1}
DEVICES = 4


def _planned(model: str, **kwargs) -> TP2DStrategy:
    """A layout="auto" strategy of a 4-device CPU Trainer, planned for ``model`` (a CausalLMModule)."""
    strategy = TP2DStrategy(layout="auto", **{"memory_gib": 1.0, "plan_options": FAST, **kwargs})
    L.Trainer(strategy=strategy, accelerator="cpu", devices=DEVICES, logger=False, enable_checkpointing=False)
    strategy.connect(tp.CausalLMModule(model))
    strategy.plan_layout()
    return strategy


def _rows(model: str, memory_gib: float = 1.0):
    cfg = model_config(model)
    return plan(cfg, gpus=DEVICES, gpu_memory_gib=memory_gib, gpus_per_node=DEVICES, seq=cfg.block_size,
                global_batch_tokens=DEVICES * cfg.block_size, include_baselines=False,
                layouts=family_of_config(cfg).layouts, **FAST)


@pytest.mark.parametrize("model", ["llama-tiny", "gpt2-tiny"])
def test_auto_runs_the_plans_best_row(model, monkeypatch):
    logged = []
    monkeypatch.setattr(strategy_module, "rank_zero_info", logged.append)
    strategy = _planned(model)
    best, runner_up = _rows(model)[:2]
    assert strategy.chosen_plan == best
    assert len(logged) == 1 and best.describe() in logged[0] and f"runner-up: {runner_up.describe()}" in logged[0]
    assert strategy.layout == best.layout and strategy.layout_spec.name == best.layout
    assert strategy.zero_stage == best.zero_stage and strategy.activation_checkpointing == best.checkpointing
    dims = strategy._resolve(model_config(model))  # what setup_environment builds the mesh from
    assert (dims.tensor_parallel_size, dims.data_parallel_size) == (best.tensor_parallel_size,
                                                                    best.data_parallel_size)


def test_a_tensor_parallel_size_restricts_the_plan_to_it():
    rows = _rows("gpt2-tiny")
    other = next(r for r in rows if r.tensor_parallel_size != rows[0].tensor_parallel_size)  # another size's best
    strategy = _planned("gpt2-tiny", tensor_parallel_size=other.tensor_parallel_size)
    assert strategy.chosen_plan == other  # (not the best row: the restriction changed the choice)
    assert strategy.layout == other.layout
    asked = strategy._request  # the planner's row replaced the request whole
    assert (asked.tensor_parallel_size, asked.data_parallel_size) == (other.tensor_parallel_size,
                                                                      other.data_parallel_size)


def test_a_size_no_row_has_is_refused_naming_the_planned_sizes():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3.*the planned \(p, dp\): \[\(2, 2\)"):
        _planned("gpt2-tiny", tensor_parallel_size=3)


def test_nothing_fits_names_the_least_memory():
    with pytest.raises(NothingFits, match=r"least memory per GPU any configuration needs is"):
        _planned("gpt2-tiny", memory_gib=1e-4)


def _fit_auto(rank, world_size):
    strategy = TP2DStrategy(layout="auto", memory_gib=1.0, plan_options=FAST)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    module = tp.CausalLMModule("gpt2-tiny", learning_rate=3e-3, warmup_steps=1)
    trainer.fit(module, tp.TextDataModule(block_size=64, batch_size=2, max_tokens=20_000))
    handle = module.model.tp  # what the model really was parallelized as
    loss = float(trainer.callback_metrics["train_loss"])
    return (handle.layout.name, handle.tensor_parallel_size, handle.data_parallel_size, strategy.zero_stage,
            strategy.activation_checkpointing, loss == loss)


def test_a_four_rank_fit_trains_the_planned_layout():
    best = _rows("gpt2-tiny")[0]  # also warms the planner's caches, which the forked ranks inherit: the test's
    # ranks are daemonic processes, which may not fork the planner's tracing worker (Lightning's launchers' may)
    expected = (best.layout, best.tensor_parallel_size, best.data_parallel_size, best.zero_stage, best.checkpointing,
                True)
    assert run_ranks(_fit_auto, DEVICES) == [expected] * DEVICES


def test_auto_on_cpu_needs_memory_gib():
    with pytest.raises(ValueError, match="memory_gib"):
        L.Trainer(strategy=TP2DStrategy(layout="auto"), accelerator="cpu", devices=DEVICES, logger=False)


@pytest.mark.parametrize("kwargs,message", [
    ({"zero_stage": 1}, r"chooses zero_stage and activation_checkpointing itself.*plan_options"),
    ({"activation_checkpointing": "full"}, r"chooses zero_stage and activation_checkpointing itself"),
    ({"memory_gib": 0}, r"memory_gib must be a positive number"),
    ({"plan_options": {"gpus": 8}}, r"plan_options: unknown keys \['gpus'\]"),
])
def test_auto_arguments_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TP2DStrategy(layout="auto", **kwargs)


def test_planner_arguments_need_layout_auto_and_the_trainer():
    with pytest.raises(ValueError, match="memory_gib and plan_options configure layout='auto'"):
        TP2DStrategy(layout="2d", memory_gib=1.0)
    with pytest.raises(ValueError, match="not supported by TP2DFabricStrategy"):
        TP2DFabricStrategy(layout="auto", memory_gib=1.0)


def test_tp2d_train_parallel_auto_composes(capsys, monkeypatch):
    GlobalHydra.instance().clear()
    monkeypatch.setattr(sys, "argv", ["tp2d-train", "parallel=auto", "trainer=cpu", "model=gpt2-tiny",
                                      "data.block_size=32", "--cfg", "job", "--resolve"])
    train.main()
    GlobalHydra.instance().clear()
    par = yaml.safe_load(capsys.readouterr().out)["parallel"]
    assert par["_target_"] == "lightning_tp2d.TP2DStrategy" and par["layout"] == "auto"
    assert par["plan_options"]["seq"] == 32  # the data's sequence length
    assert par["memory_gib"] == launch.auto_value("memory_gib") == launch.CPU_MEMORY_GIB  # (no GPU here)
    strategy = TP2DStrategy(**{k: v for k, v in par.items() if not k.startswith("_")})
    assert strategy.layout == "auto" and strategy.layout_spec is None and strategy.plan_options["seq"] == 32


def test_check_config_of_parallel_auto_needs_memory_on_cpu():
    launch.register_resolvers()
    with initialize_config_dir(config_dir=str(launch.CONF_DIR), version_base="1.3", job_name="test"):
        cfg = compose(config_name="config", overrides=["parallel=auto", "trainer=cpu", "model=gpt2-tiny",
                                                       "parallel.memory_gib=1.0"])
        plain = compose(config_name="config", overrides=["parallel=auto", "trainer=cpu", "model=gpt2-tiny",
                                                         "parallel.memory_gib=null"])
    assert check_config(cfg, instantiate(cfg.model)).startswith("layout 'auto': the planner picks the layout")
    with pytest.raises(ConfigError, match=r"parallel=auto on trainer.accelerator=cpu needs parallel.memory_gib"):
        check_config(plain, instantiate(plain.model))
