"""From plan to run: the commands ``tp2d-plan`` prints for its best rows (:mod:`lightning_tp2d.planning.commands`).

The package row's ``tp2d-train`` overrides are composed by Hydra from the package's ``conf/`` in-process (as
``tests/test_conf.py`` does) and the strategy is built from the result, as ``tp2d-train`` builds it; the tokens the
printed lines ask for are the ones ``tp2d-train``'s own data check demands; the baseline row's torchtitan settings and
Lightning strategy are checked field by field. The rows are written by hand (the planner that produces them is
``tests/test_planner.py``'s), but for the table's labels, checked on a real plan.
"""

from __future__ import annotations

import re
import shlex
from collections import defaultdict

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from lightning_tp2d import launch, train
from lightning_tp2d.planning import commands, planner
from lightning_tp2d.planning.commands import (command_for, lightning_strategy, torchtitan_settings, train_command,
                                              train_overrides)
from lightning_tp2d.planning.planner import BASELINE, CP, CP_TP, ULYSSES, PlanRow

launch.register_resolvers()


def _row(layout: str, p: int, dp: int, *, baseline: bool = False, stage: int = 0, ckpt: str = "none", micro: int = 1,
         accum: int = 1, **more) -> PlanRow:
    return PlanRow.of(layout=layout, baseline=baseline, tensor_parallel_size=p, data_parallel_size=dp, zero_stage=stage,
                   checkpointing=ckpt, micro_batch=micro, grad_accum=accum, memory_gib=70.0, step_s=1.0,
                   tokens_per_s_per_gpu=1000.0, mfu=0.4, **more)


def test_a_package_row_becomes_tp2d_train_overrides():
    row = _row("metp", 8, 1, stage=3, ckpt="full", micro=1, accum=4, activation_offload=True)
    assert train_overrides(row, "llama-3.1-8b", 262144, gpus_per_node=8, gpu_memory_gib=141) == [
        "model=llama-3.1-8b", "parallel=metp", "parallel.tensor_parallel_size=8", "parallel.data_parallel_size=1",
        "parallel.zero_stage=3", "parallel.activation_checkpointing=full", "parallel.activation_offload=true",
        "parallel.memory_gib=141", "trainer=gpu", "trainer.devices=8", "trainer.num_nodes=1",
        "trainer.accumulate_grad_batches=4", "data=tokens", "data.path=YOUR_TOKENS.bin",
        "data.dtype=uint32",  # 128256 ids do not fit uint16
        "data.batch_size=1", "data.block_size=262144",
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
    asked = strategy._request
    assert strategy.layout == row.layout and (asked.tensor_parallel_size, asked.data_parallel_size) == (
        row.tensor_parallel_size, row.data_parallel_size)
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


def test_tp2d_plan_prints_the_commands_of_its_best_rows_and_writes_nothing_unasked(tmp_path, monkeypatch, capsys):
    rows = [_row("2d", 4, 1, stage=0, ckpt="none", micro=2, accum=2),
            _row(BASELINE, 2, 2, baseline=True, stage=3, ckpt="full", micro=1, accum=4),
            _row("metp", 4, 1, stage=3, ckpt="full")]
    monkeypatch.setattr(planner, "plan", lambda *args, **kwargs: rows)
    monkeypatch.chdir(tmp_path)
    assert planner.main(["gpt2-tiny", "--gpus", "4", "--gpus-per-node", "4", "--gpu-memory-gib", "1", "--seq",
                         "64"]) == 0
    assert list(tmp_path.iterdir()) == []  # no --json PATH: no file
    out = capsys.readouterr().out.splitlines()
    package = out.index(f"run the best package configuration ({rows[0].describe()}):")
    assert out[package + 1] == ("tp2d-train model=gpt2-tiny parallel=tp2d parallel.tensor_parallel_size=4 "
                                "parallel.data_parallel_size=1 parallel.zero_stage=0 "
                                "parallel.activation_checkpointing=none parallel.compile=true parallel.memory_gib=1 "
                                "trainer=gpu trainer.devices=4 trainer.num_nodes=1 trainer.accumulate_grad_batches=2 "
                                "data=tokens data.path=YOUR_TOKENS.bin data.batch_size=2 data.block_size=64")
    assert out[package + 2].startswith("data: replace YOUR_TOKENS.bin with your token file (raw uint16 ids, or a "
                                       ".npy) of at least 2,580 tokens: the least tp2d-train accepts")
    # (its validation split, the last 5%, must hold 2 x 1 windows of 64 tokens + 1 = 129: 2580 x 0.05 = 129)
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


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(launch.CONF_DIR), version_base="1.3", job_name="test"):
        return compose(config_name="config", overrides=overrides)


@pytest.mark.parametrize("row,model,seq", [
    (_row("metp", 4, 4, stage=1, ckpt="selective", micro=2, accum=8), "llama-3.1-8b", 8192),  # 2 nodes, uint32 ids
    (_row("2d", 4, 2, micro=2, accum=64), "gpt2", 1024),  # uint16 ids; a whole step needs more than the least
])
def test_the_printed_token_count_is_the_one_tp2d_train_demands(row, model, seq, tmp_path):
    """``tp2d-plan``'s printed command, composed as ``tp2d-train`` composes it with its placeholder replaced by a token
    file of exactly the printed number of tokens: ``tp2d-train``'s own pre-launch check (``check_data_size``, given the
    data-parallel size its layout check resolves from the same config) accepts it and refuses the file one token
    shorter and one window shorter. The trainer options are left as printed (``trainer=gpu`` / ``multinode``): the
    check reads only ``trainer.limit_val_batches`` of them, so composing on CPU needs no override."""
    lines = planner.run_commands([row], model, seq, gpus_per_node=8, gpu_memory_gib=80).splitlines()
    printed, need, step = lines[1], lines[2], lines[3]
    assert printed.startswith("tp2d-train ") and need.startswith(f"data: replace {commands.TOKEN_FILE} with your ")
    least = int(re.search(r"of at least ([\d,]+) tokens: the least tp2d-train accepts", need)[1].replace(",", ""))
    tokens = tmp_path / "tokens.bin"
    cfg = _compose([o.replace(commands.TOKEN_FILE, str(tokens)) for o in shlex.split(printed)[1:]])
    assert cfg.data.path == str(tokens) and cfg.data.format == "tokens"
    # the conf/ defaults the planner's count assumes are the composed ones
    assert (cfg.data.val_fraction, cfg.trainer.max_steps) == (commands.VAL_FRACTION, commands.MAX_STEPS)
    assert (cfg.trainer.limit_val_batches not in (0, 0.0)) == commands.VALIDATES
    _, p, dp = train.check_layout(cfg.parallel, instantiate(cfg.model), int(cfg.trainer.devices),
                                  int(cfg.trainer.num_nodes), int(cfg.data.batch_size), int(cfg.data.block_size))
    assert (p, dp) == (row.tensor_parallel_size, row.data_parallel_size)
    ids = np.dtype(str(cfg.data.dtype))
    assert ids == (np.uint32 if model == "llama-3.1-8b" else np.uint16)
    np.zeros(least, ids).tofile(tokens)
    train.check_data_size(cfg, dp)  # accepted: raises nothing
    for fewer in (least - 1, least - seq):
        np.zeros(fewer, ids).tofile(tokens)
        with pytest.raises(train.ConfigError) as refused:
            train.check_data_size(cfg, dp)
        assert f"{fewer} tokens are too few" in str(refused.value)
        assert f"it needs at least {least} tokens" in str(refused.value)
    # a whole step: the data module's own train split holds micro x accum x dp windows from that many tokens on
    whole = re.search(r"one whole step needs ([\d,]+) ", step)
    whole = least if whole is None else int(whole[1].replace(",", ""))
    assert (whole > least) == (model == "gpt2")
    for n, holds in ((whole, True), (whole - 1, False))[:2 if whole > least else 1]:  # (least: the data check's)
        np.zeros(n, ids).tofile(tokens)
        data = instantiate(cfg.data)
        data.setup()
        assert (len(data.train_set) >= row.micro_batch * row.grad_accum * dp) == holds, n
    assert f"trainer.max_steps=300 reads {300 * dp * row.micro_batch * row.grad_accum * seq:,} tokens" in step


def test_labels_name_what_tells_rows_apart():
    assert _row(BASELINE, 2, 4, baseline=True, stage=0).label == "1-D TP+SP x DDP"
    assert _row(BASELINE, 8, 4, baseline=True, stage=3, async_tp=True, shard_group=2,
                loss="chunked").label == "1-D TP+SP (async) x HSDP 2x2, chunked loss"
    assert _row(BASELINE, 1, 16, baseline=True, stage=2).label == "FSDP (no TP)"
    assert _row(BASELINE, 4, 1, baseline=True).label == "1-D TP+SP"
    assert _row(CP_TP, 8, 1, stage=3, context_parallel_size=4, async_tp=True,
                loss="chunked").label == "cp-tp (CP 4 x TP 2, async), chunked loss"
    assert _row(CP, 8, 1, stage=3, context_parallel_size=8, loss="unfused").label == "cp (CP 8)"
    row = _row("metp", 4, 2, stage=3, ckpt="full", activation_offload=True, loss="own")
    assert row.label == "metp" and row.describe().startswith("metp p=4 dp=2 zero=3 ckpt=full micro=1x1 offload: ")


def test_rows_that_read_the_same_in_the_table_are_priced_the_same():
    """The user's plan (Llama 3.1 8B on 16 GPUs of 80 GiB): no two rows of the table read the same in their
    configuration columns (label, p, dp, ZeRO, checkpointing, micro x accum) unless their predictions are equal too;
    the two that read "FSDP (no TP) ... 1 x 32" at 68.0 and 56.9 GiB now say HSDP and which loss."""
    rows = planner.plan("llama-3.1-8b", gpus=16, gpu_memory_gib=80, seq=8192, global_batch_tokens=4 * 2**20)
    lines = planner.table(rows, None).splitlines()[2:]
    priced = defaultdict(set)
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        priced[tuple(cells[1:7])].add(tuple(cells[7:]))
    alike = [k for k, v in priced.items() if len(v) > 1]
    assert len(lines) == len(rows) > 500 and not alike, alike
    assert len({r.describe().split(":")[0] for r in rows}) == len(priced)  # describe() names them as the table does
    plain = {(r.label, round(r.memory_gib, 1)) for r in rows if r.baseline and r.tensor_parallel_size == 1
             and (r.zero_stage, r.checkpointing, r.micro_batch) == (3, "none", 1)}
    assert {("HSDP 8x2 (no TP)", 68.0), ("HSDP 8x2 (no TP), chunked loss", 56.9)} <= plain
