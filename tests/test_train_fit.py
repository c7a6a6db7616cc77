"""``tp2d-train`` checks the fit of a package layout's run with the planner's memory model before any process starts
(:func:`lightning_tp2d.train.check_fit`): when ``parallel.memory_gib`` is set, or the run is on GPUs. Configs are
composed with Hydra's API and checked in this process (as tests/test_refuse_before_launch.py does); every test
prices the same llama-tiny run (metp over 2 CPU processes, 2 x 32 tokens, offload: full checkpointing), so the
memory model traces it once (its profiles are cached per process)."""

from __future__ import annotations

import logging

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

import lightning.pytorch as L
from lightning_tp2d import launch, train
from lightning_tp2d.planning import planner
from lightning_tp2d.train import ConfigError, check_config

launch.register_resolvers()

RUN = ["trainer=cpu", "trainer.devices=2", "model=llama-tiny", "parallel=metp", "data.block_size=32",
       "data.batch_size=2", "parallel.activation_offload=true"]
P, DP, BATCH, SEQ = 2, 1, 2, 32  # metp p=2 (auto: the largest ring dividing 2 devices), one replica


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(launch.CONF_DIR), version_base="1.3", job_name="test"):
        return compose(config_name="config", overrides=list(overrides))


def predicted(model, offload: bool = True) -> dict:
    """What the planner's memory model says of the run: the numbers check_fit must quote."""
    memory = planner.row_memory(model, "metp", P, DP, 0, "full", BATCH, SEQ)
    return planner.offload_memory(memory, model, BATCH, SEQ, P, 2) if offload else memory


def fit_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tp2d-train"]


@pytest.fixture
def no_trainer(monkeypatch):
    """A Trainer built (the step that starts the ranks) fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("a Trainer was built: processes would start")
    monkeypatch.setattr(L.Trainer, "__init__", refuse)


def test_a_peak_above_memory_gib_is_refused_in_one_line_before_any_process_starts(tmp_path, caplog, no_trainer):
    caplog.set_level(logging.INFO, logger="tp2d-train")
    cfg = composed(*RUN, "parallel.memory_gib=0.0001")
    with pytest.raises(ConfigError) as err:
        train.train(cfg, tmp_path)  # the job: check_config raises before the Trainer (and its ranks) exist
    message = str(err.value)
    assert "\n" not in message
    model = instantiate(cfg.model)
    peak = predicted(model)["total"]
    assert peak > 0.9 * 0.0001 * 2**30
    assert message.startswith(f"the memory model predicts a peak of {train._gib(peak)} GiB per device for Llama "
                              f"2x96 on metp p=2 x dp 1 (bf16, micro-batch 2, full checkpointing, ZeRO 0")
    assert f"more than {train._gib(0.9 * 0.0001 * 2**30)} GiB, 90% of parallel.memory_gib=0.0001: try" in message
    # what to try: offload and full checkpointing are on already; a larger ring, fewer or shorter sequences
    assert "try a larger ring (parallel.tensor_parallel_size above 2, more devices)" in message
    assert "a smaller data.batch_size (now 2)" in message and message.endswith("a shorter data.block_size (now 32)")
    assert "activation_offload=true" not in message and "activation_checkpointing=full" not in message
    lines = fit_lines(caplog)
    assert lines == ["tp2d-train: checking the fit with the memory model (Llama 2x96, metp p=2, seq 32, offload)..."]


def test_the_printed_prediction_is_the_planners_gpu_and_host_memory(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="tp2d-train")
    cfg = composed(*RUN, "parallel.memory_gib=100")
    model = instantiate(cfg.model)
    memory = predicted(model)
    seen = []  # the lines logged when the memory model is asked: the first line comes before the minute it takes
    row_memory = planner.row_memory

    def asked(*args, **kwargs):
        seen.append(fit_lines(caplog))
        return row_memory(*args, **kwargs)

    monkeypatch.setattr(planner, "row_memory", asked)
    check_config(cfg, model)
    first, result = fit_lines(caplog)
    assert seen == [[first]]
    assert first == "tp2d-train: checking the fit with the memory model (Llama 2x96, metp p=2, seq 32, offload)..."
    assert result == (f"tp2d-train: predicted peak {train._gib(memory['total'])} GiB per device (bf16, micro-batch 2, "
                      "full checkpointing, ZeRO 0; the model prices bf16, trainer.precision=32-true keeps more), and "
                      f"{train._gib(memory['host_per_node'])} GiB of host memory per node (2 devices x "
                      f"{train._gib(memory['host'])} GiB of offloaded block inputs): within 90.0 GiB, 90% of "
                      "parallel.memory_gib=100")
    # the numbers are the planner's: the peak with the block inputs on the host, and those inputs on 2 devices
    assert memory["host_per_node"] == 2 * memory["host"] > 0
    assert float(result.split("predicted peak ")[1].split()[0]) == pytest.approx(memory["total"] / 2**30, rel=5e-3)


def test_nothing_is_checked_without_memory_gib_on_cpu(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="tp2d-train")
    monkeypatch.setattr(planner, "row_memory", lambda *a, **k: pytest.fail("the memory model was asked"))
    cfg = composed(*RUN)
    assert cfg.parallel.memory_gib is None
    assert check_config(cfg, instantiate(cfg.model)).startswith("layout 'metp'")
    assert not [line for line in fit_lines(caplog) if "memory model" in line or "predicted" in line]
    cfg = composed("trainer=cpu", "model=llama-tiny", "parallel=auto", "parallel.memory_gib=1")
    check_config(cfg, instantiate(cfg.model))  # layout auto plans its own fit at start-up
    assert not fit_lines(caplog)


def test_on_gpus_the_gpus_memory_is_the_cap_when_nvidia_smi_tells_it(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="tp2d-train")
    cfg = composed(*RUN, "trainer=gpu", "trainer.devices=2")  # (never started here: checked only)
    model = instantiate(cfg.model)
    memory = predicted(model)
    monkeypatch.setattr(train, "gpu_memory_gib", lambda: None)  # no nvidia-smi: the prediction alone
    check_config(cfg, model)
    assert fit_lines(caplog)[-1] == (
        f"tp2d-train: predicted peak {train._gib(memory['total'])} GiB per GPU (bf16, micro-batch 2, full "
        f"checkpointing, ZeRO 0), and {train._gib(memory['host_per_node'])} GiB of host memory per node (2 GPUs x "
        f"{train._gib(memory['host'])} GiB of offloaded block inputs); the GPU's memory is not known here (no "
        "nvidia-smi): set parallel.memory_gib to check it")
    monkeypatch.setattr(train, "gpu_memory_gib", lambda: 0.0001)
    refused = r"GiB per GPU .* more than 0\.0000900 GiB, 90% of the GPU's 0\.000100 GiB \(nvidia-smi\): try"
    with pytest.raises(ConfigError, match=refused):
        check_config(cfg, model)


@pytest.mark.filterwarnings("ignore:activation_offload=True needs full activation checkpointing")
def test_a_named_layouts_memory_gib_is_the_launchers_not_the_strategys():
    cfg = composed(*RUN, "parallel.memory_gib=100")
    with pytest.raises(Exception, match="memory_gib and plan_options configure layout='auto'"):
        instantiate(cfg.parallel)
    strategy = instantiate(cfg.parallel, **train.strategy_overrides(cfg.parallel))
    assert strategy.memory_gib is None and strategy.activation_offload
    auto = composed("trainer=cpu", "model=llama-tiny", "parallel=auto", "parallel.memory_gib=3")
    assert train.strategy_overrides(auto.parallel) == {}


def test_offload_with_selective_checkpointing_is_refused_in_the_fit_check_by_the_strategies_rule():
    """The fit check runs the checkpointing mode the strategy would (``parallelize.offloaded_checkpointing``), so
    offload with selective checkpointing is the same one-line refusal there, before the memory model is asked."""
    cfg = composed(*[o for o in RUN if not o.startswith("parallel.activation_checkpointing")],
                   "parallel.activation_checkpointing=selective", "parallel.memory_gib=100")
    with pytest.raises(ConfigError, match="activation_checkpointing='selective' is not supported"):
        check_config(cfg, instantiate(cfg.model))


def test_a_run_with_pipeline_stages_is_checked_per_stage(caplog):
    """With ``parallel.pipeline_parallel_size`` the predicted peak is a stage's: the planner's memory model of each
    rank's blocks and in-flight micro-batches (``row_memory(..., pipeline_parallel_size=...)``), at the schedule's
    micro-batch."""
    caplog.set_level(logging.INFO, logger="tp2d-train")
    cfg = composed("trainer=cpu", "trainer.devices=4", "model=llama-tiny", "model.n_layer=4", "parallel=metp",
                   "parallel.tensor_parallel_size=2", "parallel.pipeline_parallel_size=2", "parallel.microbatches=2",
                   "data.block_size=32", "data.batch_size=4", "parallel.memory_gib=100")
    model = instantiate(cfg.model)
    check_config(cfg, model)
    staged = planner.row_memory(model, "metp", 2, 1, 0, "none", 2, SEQ, pipeline_parallel_size=2, microbatches=2)
    whole = planner.row_memory(model, "metp", 2, 1, 0, "none", 4, SEQ)
    assert staged["total"] < whole["total"]  # half the blocks and state per rank
    line = [m for m in fit_lines(caplog) if m.startswith("tp2d-train: predicted peak")][0]
    assert f"predicted peak {train._gib(staged['total'])} GiB per device" in line, line
    assert "micro-batch 2" in line and "2 pipeline stages (1f1b, 2 micro-batches)" in line, line
