"""From plan to run: the commands ``tp2d-plan`` prints for its best rows (:mod:`lightning_tp2d.planning.commands`).

The package row's ``tp2d-train`` overrides are composed by Hydra from the package's ``conf/`` in-process (as
``tests/test_conf.py`` does) and the strategy is built from the result, as ``tp2d-train`` builds it; the baseline
row's torchtitan settings and Lightning strategy are checked field by field. The rows are written by hand: the
planner that produces them is ``tests/test_planner.py``'s.
"""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from lightning_tp2d import launch, train
from lightning_tp2d.planning import planner
from lightning_tp2d.planning.commands import (command_for, lightning_strategy, torchtitan_settings, train_command,
                                              train_overrides)
from lightning_tp2d.planning.planner import BASELINE, CP, ULYSSES, PlanRow

launch.register_resolvers()


def _row(layout: str, p: int, dp: int, *, baseline: bool = False, stage: int = 0, ckpt: str = "none", micro: int = 1,
         accum: int = 1, **more) -> PlanRow:
    return PlanRow(layout=layout, baseline=baseline, tensor_parallel_size=p, data_parallel_size=dp, zero_stage=stage,
                   checkpointing=ckpt, micro_batch=micro, grad_accum=accum, memory_gib=70.0, step_s=1.0,
                   tokens_per_s_per_gpu=1000.0, mfu=0.4, **more)


def test_a_package_row_becomes_tp2d_train_overrides():
    row = _row("metp", 8, 1, stage=3, ckpt="full", micro=1, accum=4, activation_offload=True)
    assert train_overrides(row, "llama-3.1-8b", 262144, gpus_per_node=8, gpu_memory_gib=141) == [
        "model=llama-3.1-8b", "parallel=metp", "parallel.tensor_parallel_size=8", "parallel.data_parallel_size=1",
        "parallel.zero_stage=3", "parallel.activation_checkpointing=full", "parallel.activation_offload=true",
        "parallel.memory_gib=141", "trainer=gpu", "trainer.devices=8", "trainer.num_nodes=1",
        "trainer.accumulate_grad_batches=4", "data.batch_size=1", "data.block_size=262144",
        "model.block_size=262144"]  # longer than the model's 131072: the data's windows need it


def test_compile_is_asked_only_where_the_strategy_compiles_the_row():
    def compiled(layout, ckpt, offload=False):
        row = _row(layout, 4, 2, ckpt=ckpt, activation_offload=offload)
        return "parallel.compile=true" in train_overrides(row, "gpt2", 1024, gpus_per_node=8)
    assert compiled("2d", "none") and compiled("metp", "full") and compiled("2d-metp", "full")
    assert not compiled("2d", "full")  # the grid's checkpointed blocks do not compile (Layout.compiles_checkpointed)
    assert not compiled("metp", "selective") and not compiled("metp", "full", offload=True)
    row = _row("2d", 4, 2)
    assert "parallel.compile=true" not in train_overrides(row, "gpt2", 1024, gpus_per_node=8, compiled=False)


def test_many_nodes_use_the_multinode_trainer_and_whole_nodes():
    row = _row("2d", 16, 4, stage=1, micro=2)
    over = train_overrides(row, "gpt2-xl", 1024, gpus_per_node=8)
    assert over[over.index("trainer=multinode"):][:3] == ["trainer=multinode", "trainer.devices=8",
                                                          "trainer.num_nodes=8"]
    assert "model.block_size=1024" not in " ".join(over)  # gpt2-xl's own block_size already holds 1024 tokens
    with pytest.raises(ValueError, match=r"p=4 x dp=3 = 12 GPUs is not a whole number of nodes of 8"):
        train_overrides(_row("2d", 4, 3), "gpt2", 1024, gpus_per_node=8)
    with pytest.raises(ValueError, match=r"tp1d-sp is a baseline row"):
        train_overrides(_row(BASELINE, 8, 2, baseline=True), "gpt2", 1024, gpus_per_node=8)
    assert train_command(row, "gpt2-xl", 1024, gpus_per_node=8).startswith("tp2d-train model=gpt2-xl parallel=tp2d ")


@pytest.mark.parametrize("row,model,seq", [
    (_row("2d", 4, 2, stage=1, ckpt="full", micro=4, accum=2), "gpt2-tiny", 64),
    (_row("metp", 8, 1, stage=3, ckpt="full", accum=4, activation_offload=True), "llama-3.1-8b", 262144),
    (_row("2d-metp", 16, 4, stage=2, ckpt="selective", micro=1), "llama-tiny", 96),
])
def test_printed_overrides_compose_into_the_strategy_that_runs_the_row(row, model, seq):
    over = train_overrides(row, model, seq, gpus_per_node=8, gpu_memory_gib=80)
    with initialize_config_dir(config_dir=str(launch.CONF_DIR), version_base="1.3", job_name="test"):
        cfg = compose(config_name="config", overrides=over)
    par = cfg.parallel
    assert (par.layout, par.tensor_parallel_size, par.data_parallel_size, par.zero_stage,
            par.activation_checkpointing, par.activation_offload) == (
        row.layout, row.tensor_parallel_size, row.data_parallel_size, row.zero_stage, row.checkpointing,
        row.activation_offload)
    assert (cfg.data.block_size, cfg.data.batch_size, cfg.trainer.accumulate_grad_batches) == (seq, row.micro_batch,
                                                                                                 row.grad_accum)
    assert cfg.trainer.devices * cfg.trainer.num_nodes == row.tensor_parallel_size * row.data_parallel_size
    assert cfg.trainer.accelerator == "gpu" and par.memory_gib == 80
    strategy = instantiate(par, **train.strategy_overrides(par))  # as tp2d-train builds it
    assert strategy.layout == row.layout and strategy._requested == (row.tensor_parallel_size,
                                                                     row.data_parallel_size)
    assert strategy.zero_stage == row.zero_stage and strategy.activation_checkpointing == row.checkpointing
    config = instantiate(cfg.model)
    assert config.block_size >= seq and type(config).__name__ == ("GPT2Config" if "gpt2" in model else "LlamaConfig")


def test_a_baseline_row_becomes_torchtitan_settings_and_a_lightning_strategy():
    row = _row(BASELINE, 8, 16, baseline=True, stage=3, ckpt="selective", micro=2, accum=2, async_tp=True,
               shard_group=4)
    assert torchtitan_settings(row, 8192) == [
        "--parallelism.tensor_parallel_degree=8", "--parallelism.data_parallel_shard_degree=4",
        "--parallelism.data_parallel_replicate_degree=4", "--activation_checkpoint.mode=selective",
        "--activation_checkpoint.selective_ac_option=op", "--parallelism.enable_async_tensor_parallel",
        "--compile.enable", "--training.local_batch_size=2", "--training.seq_len=8192",
        "--training.global_batch_size=64"]
    assert lightning_strategy(row) == "ModelParallelStrategy(tensor_parallel_size=8, data_parallel_size=16)"
    plain = _row(BASELINE, 1, 8, baseline=True, stage=2, ckpt="full")  # FSDP alone, ZeRO-2: no resharding
    assert torchtitan_settings(plain, 4096, compiled=False) == [
        "--parallelism.tensor_parallel_degree=1", "--parallelism.data_parallel_shard_degree=8",
        "--parallelism.fsdp_reshard_after_forward=never", "--activation_checkpoint.mode=full",
        "--training.local_batch_size=1", "--training.seq_len=4096"]
    text = command_for(row, "llama-3.1-70b", 8192, gpus_per_node=8)
    assert text.startswith("torchrun --nnodes=16 --nproc_per_node=8 -m torchtitan.train ")
    assert "Trainer(devices=8, num_nodes=16, strategy=ModelParallelStrategy(tensor_parallel_size=8, " in text


def test_context_parallel_rows_name_the_cp_degree_and_ulysses_is_refused():
    cp = _row(CP, 8, 1, baseline=True, stage=3, ckpt="full", context_parallel_size=8)
    assert torchtitan_settings(cp, 65536)[:3] == ["--parallelism.tensor_parallel_degree=1",
                                                  "--parallelism.context_parallel_degree=8",
                                                  "--parallelism.data_parallel_shard_degree=1"]
    assert "Lightning" not in command_for(cp, "llama-3.1-8b", 65536, gpus_per_node=8)
    with pytest.raises(ValueError, match="'ulysses' is not a torchtitan configuration"):
        torchtitan_settings(_row(ULYSSES, 8, 1, baseline=True), 65536)
    with pytest.raises(ValueError, match="'cp': Lightning's ModelParallelStrategy runs the 1-D TP"):
        lightning_strategy(cp)


def test_tp2d_plan_prints_the_commands_of_its_best_rows(monkeypatch, capsys):
    rows = [_row("2d", 4, 1, stage=0, ckpt="none", micro=2, accum=2),
            _row(BASELINE, 2, 2, baseline=True, stage=3, ckpt="full", micro=1, accum=4),
            _row("metp", 4, 1, stage=3, ckpt="full")]
    monkeypatch.setattr(planner, "plan", lambda *args, **kwargs: rows)
    assert planner.main(["gpt2-tiny", "--gpus", "4", "--gpus-per-node", "4", "--gpu-memory-gib", "1", "--seq", "64",
                         "--json", ""]) == 0
    out = capsys.readouterr().out.splitlines()
    package = out.index(f"run the best package configuration ({rows[0].describe()}):")
    assert out[package + 1] == ("tp2d-train model=gpt2-tiny parallel=tp2d parallel.tensor_parallel_size=4 "
                                "parallel.data_parallel_size=1 parallel.zero_stage=0 "
                                "parallel.activation_checkpointing=none parallel.compile=true parallel.memory_gib=1 "
                                "trainer=gpu trainer.devices=4 trainer.num_nodes=1 trainer.accumulate_grad_batches=2 "
                                "data.batch_size=2 data.block_size=64")
    baseline = out.index(f"run the best 1-D baseline ({rows[1].describe()}):")
    assert out[baseline + 1].startswith("torchrun --nnodes=1 --nproc_per_node=4 -m torchtitan.train")
    assert out[baseline + 1].endswith("--parallelism.tensor_parallel_degree=2 "
                                      "--parallelism.data_parallel_shard_degree=2 "
                                      "--activation_checkpoint.mode=full --compile.enable "
                                      "--training.local_batch_size=1 --training.seq_len=64 "
                                      "--training.global_batch_size=8")
    assert out[baseline + 2].startswith("Lightning: Trainer(devices=4, num_nodes=1, strategy=ModelParallelStrategy("
                                        "tensor_parallel_size=2, data_parallel_size=2))")


def test_a_row_without_a_command_says_why_and_keeps_the_other():
    rows = [_row("2d", 4, 3), _row(BASELINE, 4, 3, baseline=True)]  # 12 GPUs: not whole nodes of 8
    text = planner.run_commands(rows, "gpt2", 1024, gpus_per_node=8)
    assert text.splitlines()[1] == "(no command: p=4 x dp=3 = 12 GPUs is not a whole number of nodes of 8)"
    assert planner.run_commands(rows[:1], "gpt2", 1024, gpus_per_node=16).splitlines()[1].startswith(
        "tp2d-train model=gpt2 parallel=tp2d ")
