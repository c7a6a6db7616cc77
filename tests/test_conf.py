"""The Hydra tree in ``conf/`` and the pieces of ``tp2d-train`` that need no processes: composition of every group
option, comments on every key, ``_target_`` classes, ``auto`` values per launcher, the command line each rank
parses, override-key checks and the layout checks that run before any process starts."""

from __future__ import annotations

import csv
import importlib
import importlib.util
import re
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lightning_tp2d import launch, train
from lightning_tp2d.families import auto_tensor_parallel_size
from lightning_tp2d.models import GPT2Config
from lightning_tp2d.train import ConfigError, check_config, device_count

CONF = launch.CONF_DIR
GROUPS = {"model": ["gpt2", "gpt2-large", "gpt2-medium", "gpt2-mini", "gpt2-tiny", "gpt2-xl", "llama-3.1-8b",
                    "llama-3.2-1b", "llama-mini", "llama-tiny"],
          "parallel": ["auto", "metp", "single", "tp2d", "tp2d_metp"],
          "trainer": ["auto", "cpu", "gpu", "multinode"],
          "data": ["default", "text", "tokens"],
          "callbacks": ["default", "divergence_guard", "early_stopping", "last_step_log", "lr_monitor", "model_checkpoint",
                        "none", "progress_bar", "rich_progress_bar", "speed_monitor"],
          "logger": ["csv", "default", "many_loggers", "none", "tensorboard", "wandb"]}

launch.register_resolvers()


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3", job_name="test"):
        return compose(config_name="config", overrides=list(overrides))


def test_groups_hold_the_options_the_issue_names():
    for group, options in GROUPS.items():
        assert sorted(p.stem for p in (CONF / group).glob("*.yaml")) == options
    assert (CONF / "experiment").is_dir()


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_option_composes_and_resolves(group, option):
    extra = ["data.path=some/file.txt"] if option in ("text", "tokens") else []
    cfg = composed(f"{group}={option}", *extra)
    container = OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    assert container["trainer"]["_target_"] == "lightning.pytorch.Trainer"


def test_every_yaml_key_carries_a_comment():
    missing = []
    for path in sorted(CONF.rglob("*.yaml")):
        lines = path.read_text().splitlines()
        in_block = False
        for no, line in enumerate(lines, 1):
            body = line.split("#", 1)[0]
            if in_block:  # the text of a `key: |` block
                if line.startswith("      ") or not line.strip():
                    continue
                in_block = False
            if not body.strip() or body.strip().startswith("- "):
                continue  # comments, blank lines, defaults-list entries
            if body.rstrip().endswith("|"):
                in_block = True
            commented = "#" in line or lines[no - 2].strip().startswith("#")  # inline, or on the line above
            if re.match(r"^\s*[\w.@/-]+:", body) and not commented:
                parent = re.match(r"^\s*(hydra|run|sweep|job|help|defaults):\s*$", body)
                if not parent:
                    missing.append(f"{path.relative_to(CONF)}:{no}: {line.strip()}")
    assert not missing, "keys without a comment:\n" + "\n".join(missing)


def test_targets_import_and_the_default_objects_build():
    cfg = composed("trainer=cpu", "callbacks=[default,lr_monitor,early_stopping,rich_progress_bar]",
                   "logger=many_loggers")
    nodes = [cfg[n] for n in ("model", "module", "parallel", "data", "trainer")]
    for node in nodes + list(cfg.callbacks.values()) + list(cfg.logger.values()) + [composed().logger.tensorboard]:
        module_name, _, name = node["_target_"].rpartition(".")
        assert hasattr(importlib.import_module(module_name), name), node["_target_"]
    config = instantiate(cfg.model)
    assert config == GPT2Config.from_name("gpt2-mini")  # the CPU default size
    module = instantiate(cfg.module)
    assert module.config == config and module.hparams.learning_rate == 2e-3  # the size's own learning rate
    strategy = instantiate(cfg.parallel)
    assert strategy.layout == "2d"
    assert instantiate(cfg.data).block_size == config.block_size == 128


def test_cpu_defaults_are_a_2x2_grid_of_gpt2_mini_in_float32():
    cfg = OmegaConf.to_container(composed(), resolve=True)
    assert cfg["trainer"]["accelerator"] == "cpu" and cfg["trainer"]["devices"] == 4
    assert cfg["trainer"]["precision"] == "32-true" and cfg["trainer"]["num_nodes"] == 1
    assert cfg["parallel"]["layout"] == "2d" and cfg["model"]["n_embd"] == 96


def test_parallel_single_is_one_process_on_the_trainers_device():
    cfg = OmegaConf.to_container(composed("parallel=single", "trainer=cpu"), resolve=True)
    assert cfg["trainer"]["devices"] == 1 and cfg["parallel"]["device"] == "cpu"
    assert launch.torch_device("gpu") == "cuda:0"


# ---- auto values and ranks ------------------------------------------------------------------------------------


def test_auto_devices_and_nodes_follow_the_launcher():
    torchrun = {"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "1"}
    assert launch.auto_value("devices", torchrun) == 4 and launch.auto_value("num_nodes", torchrun) == 2
    slurm = {"SLURM_PROCID": "3", "SLURM_NTASKS": "16", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "8(x2)"}
    assert launch.auto_value("devices", slurm) == 8 and launch.auto_value("num_nodes", slurm) == 2
    plain = {}
    assert launch.auto_value("devices", plain) == launch.CPU_PROCESSES  # no GPU here
    assert launch.auto_value("num_nodes", plain) == 1 and launch.auto_value("model", plain) == "gpt2-mini"
    with pytest.raises(ValueError, match="unknown key"):
        launch.auto_value("colour", plain)


def test_only_global_rank_zero_keeps_hydras_files():
    argv = ["tp2d-train", "trainer.max_steps=5"]
    assert launch.prepare_argv(argv, {}) == argv  # the command the user typed
    assert launch.prepare_argv(argv, {"NODE_RANK": "0"}) == argv  # machine 0 of a multi-node job
    child = launch.prepare_argv(argv, {"LOCAL_RANK": "2", launch.RUN_DIR_ENV: "/runs/a"})  # started by Lightning
    assert child == argv + ["hydra.output_subdir=null", "hydra/job_logging=stdout"]
    torchrun = launch.prepare_argv(argv, {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3"})
    assert torchrun[-1] == "hydra.run.dir=."  # creates no timestamped folder of its own
    assert launch.prepare_argv(argv + ["hydra.output_subdir=x"], {"LOCAL_RANK": "1"}).count("hydra.output_subdir=x") == 1


@pytest.mark.parametrize("env", [{"RANK": "0", "WORLD_SIZE": "4"}, {"SLURM_PROCID": "0", "SLURM_NTASKS": "8"},
                                 {"NODE_RANK": "1"}])
def test_sweeps_under_an_external_launcher_are_refused(env):
    with pytest.raises(SystemExit, match="--multirun is not supported here"):
        launch.prepare_argv(["tp2d-train", "-m", "trainer.max_steps=5,10"], env)


# ---- override keys --------------------------------------------------------------------------------------------


def test_unknown_key_lists_the_valid_ones_and_the_closest(capsys):
    with pytest.raises(SystemExit) as exit_:
        launch.check_override_keys(["tp2d-train", "model=gpt2", "trainer.max_stepz=5"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unknown config key 'trainer.max_stepz'" in err and "did you mean trainer.max_steps" in err
    assert "keys under 'trainer': _target_, accelerator" in err and "+trainer.max_stepz=5" in err


def test_known_keys_sweeps_and_additions_pass():
    launch.check_override_keys(["tp2d-train", "model=gpt2-tiny,gpt2-mini", "model.n_layer=3", "data=text",
                                "data.path=x.txt", "+trainer.detect_anomaly=true", "-m", "trainer.max_steps=1,2"])
    launch.check_override_keys(["tp2d-train", "callbacks=[default,early_stopping]",
                                "callbacks.early_stopping.patience=5", "callbacks.progress_bar=null",
                                "+callbacks.lr._target_=x.Y", "logger=many_loggers",
                                "logger.wandb.project=p", "parallel.allow_fallback=true", "plot=false"])


@pytest.mark.parametrize("args,message", [
    (["checkpoint.every_n_train_steps=5"], "'checkpoint.every_n_train_steps' (in 'checkpoint.every_n_train_steps=5') "
                                           "has moved; now: callbacks.model_checkpoint.every_n_train_steps"),
    (["logging.tensorboard=false"], "now: logger=tensorboard or logger=many_loggers (logger.tensorboard=null: off)"),
    (["+checkpoint.dirpath=x"], "has moved; now: callbacks.model_checkpoint.dirpath"),  # (would be added, unused)
    (["callbacks.early_stopping.patience=5"], "'early_stopping' is an option of callbacks/ that this run does not use: "
                                              "list it with the others, e.g. 'callbacks=[default,early_stopping]'"),
    (["callbacks.lr._target_=x.Y"], "keys under 'callbacks': divergence_guard, last_step_log, model_checkpoint, "
                                    "progress_bar, speed_monitor\n  (to add a key the config does not have, write +callbacks.lr"),
])
def test_moved_keys_and_unlisted_group_options_say_what_to_write(capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        launch.check_override_keys(["tp2d-train", *args])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_resumed_run_continues_in_its_checkpoints_run_directory(tmp_path):
    run = tmp_path / "outputs" / "2025-01-01" / "10-00-00"
    (run / ".hydra").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    ckpt = f"ckpt_path='{run}/checkpoints/step=6.ckpt'"  # quoted, as quote_path_override passes it to Hydra
    env = {}
    assert launch.pin_resume_run_dir([ckpt, "trainer.max_steps=9"], env) == run
    assert env == {launch.RUN_DIR_ENV: str(run)}
    for args, env in (([ckpt], {launch.RUN_DIR_ENV: "mine"}), ([ckpt, "hydra.run.dir=x"], {}), ([ckpt, "-m"], {}),
                      ([f"ckpt_path={tmp_path}/elsewhere/last.ckpt"], {}), (["ckpt_path=null"], {})):
        before = dict(env)
        assert launch.pin_resume_run_dir(args, env) is None and env == before
    assert train.resume_note(f"{run}/checkpoints/last.ckpt", run).startswith(
        f"resuming from {run}/checkpoints/last.ckpt in its run directory {run} (logs/metrics.csv continues")
    assert train.resume_note(f"{run}/checkpoints/last.ckpt", tmp_path / "new") == (
        f"resuming from {run}/checkpoints/last.ckpt (its run directory is {run}); this run writes to "
        f"{tmp_path / 'new'}")
    assert "(it is not inside a run directory's checkpoints/)" in train.resume_note("x/last.ckpt", tmp_path)


# ---- callbacks and loggers -------------------------------------------------------------------------------------


def built(*overrides: str, run_dir="/runs/a"):
    cfg = composed(*overrides)
    callbacks, interrupt, checkpoint = train.make_callbacks(cfg, Path(run_dir))
    return [type(c).__name__ for c in callbacks], checkpoint, train.make_loggers(cfg.get("logger"), Path(run_dir))


def test_callbacks_default_is_what_every_run_had_and_entries_add_or_remove_callbacks():
    names, checkpoint, loggers = built()
    assert names == ["GracefulInterrupt", "StepCheckpoint", "DivergenceGuard", "SpeedMonitor", "LastStepLog",
                     "ResumableProgressBar"]
    assert checkpoint.dirpath == "/runs/a/checkpoints" and checkpoint.save_last == "link"
    assert [type(lg).__name__ for lg in loggers][0] == "ContinuingCSVLogger" and loggers[0].log_dir == "/runs/a/logs/"
    names, _, _ = built("callbacks=[default,lr_monitor,early_stopping,rich_progress_bar]",
                        "callbacks.speed_monitor=null")
    assert names == ["GracefulInterrupt", "StepCheckpoint", "DivergenceGuard", "LastStepLog", "LearningRateMonitor",
                     "EarlyStopping", "ResumableRichProgressBar"]  # the last progress bar listed replaces the tqdm one
    names, checkpoint, _ = built("+callbacks.lr._target_=lightning.pytorch.callbacks.LearningRateMonitor",
                                 "+callbacks.lr.logging_interval=step", "trainer.enable_progress_bar=false",
                                 "callbacks.model_checkpoint=null")
    assert names == ["GracefulInterrupt", "DivergenceGuard", "SpeedMonitor", "LastStepLog", "LearningRateMonitor"]
    assert checkpoint is None
    names, checkpoint, loggers = built("callbacks=none", "logger=none")
    assert names == ["GracefulInterrupt"] and checkpoint is None and loggers == []


@pytest.mark.parametrize("overrides,message", [
    (["+callbacks.x.patience=1"], "callbacks.x has no _target_ (a Lightning callback class), e.g. +callbacks.x."),
    (["+callbacks.x._target_=builtins.dict"], "callbacks.x: builtins.dict built a dict, not a lightning.pytorch"),
    (["+callbacks.x._target_=lightning.pytorch.callbacks.EarlyStopping"], "callbacks.x: "),
    (["logger=wandb"], "logger.wandb (lightning.pytorch.loggers.WandbLogger) needs the wandb package, which is not "
                       "installed: pip install wandb"),
])
def test_callbacks_and_loggers_that_cannot_be_built_are_config_errors(overrides, message):
    if "logger=wandb" in overrides and importlib.util.find_spec("wandb"):
        pytest.skip("wandb is installed")
    with pytest.raises(ConfigError) as err:
        built(*overrides)
    assert message in str(err.value)


def test_the_csv_logger_continues_the_metrics_of_the_run_it_resumes(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "metrics.csv").write_text("epoch,step,train_loss,val_loss\n" + "".join(
        f"0,{s},{5 - s / 10},{'' if s % 3 else 4}\n" for s in range(6)))
    logger = instantiate(composed("logger=csv").logger.csv, save_dir=str(tmp_path))
    logger.log_metrics({"train_loss": 4.6, "lr": 1e-3}, step=4)  # resumed from step 4: the old 4 and 5 go
    logger.save()
    logger.log_metrics({"train_loss": 4.5}, step=5)
    logger.save()
    with open(logs / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["train_loss"], r["lr"]) for r in rows] == [
        ("0", "5.0", ""), ("1", "4.9", ""), ("2", "4.8", ""), ("3", "4.7", ""), ("4", "4.6", "0.001"), ("5", "4.5", "")]
    assert rows[0]["val_loss"] == rows[3]["val_loss"] == "4" and rows[0]["epoch"] == "0"


# ---- checks before any process starts --------------------------------------------------------------------------


def checked(*overrides: str) -> str:
    cfg = composed(*overrides)
    return check_config(cfg, instantiate(cfg.model))


def test_plan_of_the_cpu_default():
    assert checked().startswith("layout '2d': 1 replica(s) x 2x2 grid (p=4) on trainer.devices=4")


@pytest.mark.parametrize("overrides,message", [
    (["trainer.devices=6", "parallel.tensor_parallel_size=4"],
     "needs a multiple of 4 processes, but trainer.devices=6 x trainer.num_nodes=1 = 6 processes; use trainer.devices=8"),
    (["parallel.tensor_parallel_size=3"], "3 is not a perfect square (nearest: [1, 4]); sizes that fit this model on 4 "
                                           "processes: parallel.tensor_parallel_size in [1, 4]"),
    (["model=gpt2-xl", "trainer.devices=4", "parallel.tensor_parallel_size=4", "data.tokenizer=byte"],
     "model.n_head=25 is not divisible by q=2"),
    (["parallel.data_parallel_size=3"], "parallel.data_parallel_size=3 does not divide the trainer.devices=4"),
    (["data.batch_size=5"], "data.batch_size=5 is not divisible by q=2 (layout '2d' splits each batch over the 2 grid "
                            "rows); use data.batch_size=6"),
    # the ring takes all 4 devices (it splits gpt2-mini's width, whatever its head count)
    (["parallel=metp", "data.block_size=102"], "data.block_size=102 is not divisible by 2*p=8 (layout 'metp' cuts "
                                             "every sequence into 8 zigzag chunks); use data.block_size=96 or "
                                             "data.block_size=104"),
    (["parallel=single", "trainer.devices=2"], "parallel=single runs one process, but trainer.devices=2"),
    (["data.block_size=4096"], "data.block_size=4096 exceeds model.block_size=128"),
    (["data.tokenizer=gpt2"], "data.tokenizer=gpt2 makes 50257 token ids but model.vocab_size=257"),
    (["data=text"], "data.path is required"),
    (["data=text", "data.path=no/such/corpus.txt"], "data.path='no/such/corpus.txt' does not exist"),
    (["ckpt_path=outputs/x/checkpoints/last.ckpt"], "ckpt_path='outputs/x/checkpoints/last.ckpt' does not exist"),
])
def test_configs_that_cannot_run_name_the_numbers_and_a_fit(overrides, message):
    with pytest.raises(ConfigError) as err:
        checked(*overrides)
    assert message in str(err.value)


def test_node_rank_beyond_the_node_count_is_refused(monkeypatch):
    monkeypatch.setenv("NODE_RANK", "1")
    with pytest.raises(ConfigError, match="NODE_RANK=1 but trainer.num_nodes=1"):
        checked("trainer=cpu")


@pytest.mark.parametrize("overrides,message", [
    (["trainer.devices=3"],
     "no grid larger than 1 fits trainer.devices=3 per machine (layout '2d' needs a q x q grid, q dividing "
     "model.n_head=6 and model.n_embd=96). Use trainer.devices=4, 9, 36 (or a multiple"),
    (["trainer=cpu", "trainer.devices=2", "trainer.num_nodes=2"],
     "; or parallel.tensor_parallel_size=4 (replicas spanning machines); or parallel.allow_fallback=true"),
    (["parallel=metp", "trainer.devices=1", "trainer.num_nodes=3"],
     "no ring larger than 1 fits trainer.devices=1 per machine (layout 'metp' needs a ring whose size divides "
     "model.n_embd=96). Use trainer.devices=2, 3, 4"),
])
def test_devices_without_a_grid_name_the_counts_that_fit(overrides, message):
    """``tensor_parallel_size: auto`` finding no replica larger than one device is an error naming the device
    counts that fit, unless whole-model replicas are asked for."""
    with pytest.raises(ConfigError) as err:
        checked(*overrides)
    assert message in str(err.value) and "parallel.allow_fallback=true to train" in str(err.value)
    assert "parallel=single with trainer.devices=1" in str(err.value)


def test_fallback_to_whole_model_replicas_only_when_asked():
    plan = checked("trainer.devices=3", "data.batch_size=3", "parallel.allow_fallback=true")
    assert plan.startswith("layout '2d': 3 replica(s) x 1x1 grid (p=1)") and "data parallel only" in plan
    assert "3 replica(s) x 1x1 grid" in checked("trainer.devices=3", "parallel.data_parallel_size=3")  # explicit
    assert device_count("0,1", "gpu") == 2 and device_count([0, 1, 2], "gpu") == 3 and device_count("x", "cpu") is None


def test_the_console_script_is_declared():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((CONF.parent / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["tp2d-train"] == "lightning_tp2d.train:main"
    assert any(dep.startswith("matplotlib") for dep in project["dependencies"])



@pytest.mark.parametrize("option", ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt2-tiny", "gpt2-mini"])
def test_gpt2_model_files_build_their_named_configs(option):
    """One owner of a named size: what ``tp2d-train model=<name>`` trains is the config ``tp2d-plan <name>`` prices,
    the padded head of OpenAI's sizes included."""
    assert instantiate(composed(f"model={option}").model) == GPT2Config.from_name(option)
    assert GPT2Config.from_name(option).pad_vocab_multiple == (1 if option in ("gpt2-tiny", "gpt2-mini") else 128)


# ---- Llama: the family's size rules and plans ---------------------------------------------------------------------


@pytest.mark.parametrize("option", ["llama-tiny", "llama-mini", "llama-3.2-1b", "llama-3.1-8b"])
def test_llama_model_files_build_their_named_configs(option):
    from lightning_tp2d.models import LlamaConfig

    cfg = composed(f"model={option}")
    context = {"llama-3.2-1b": dict(block_size=8192)}.get(option, {})  # trains at its pre-training context
    assert instantiate(cfg.model) == LlamaConfig.from_name(option, **context)
    assert OmegaConf.to_container(cfg, resolve=True)["module"]["model"]["_target_"] == "lightning_tp2d.LlamaConfig"
    quick = composed("experiment=quick", f"model={option}")  # the command line's model wins over the recipe's
    assert quick.model.n_kv_head == LlamaConfig.from_name(option).n_kv_head


def test_llama_layouts_follow_the_family_rules():
    from lightning_tp2d.families import get_family
    from lightning_tp2d.layouts import get_layout
    from lightning_tp2d.models import LlamaConfig

    assert checked("model=llama-tiny", "trainer=cpu").startswith("layout '2d': 1 replica(s) x 2x2 grid (p=4)")
    # RoPE has no position table: data longer than model.block_size=64 fits (GPT-2's is refused, above)
    assert "8 x 256 tokens per step" in checked("model=llama-tiny", "trainer=cpu", "data.block_size=256")
    assert checked("model=llama-tiny", "parallel=single", "trainer.devices=1").startswith("plain Llama (2 layers")
    # the ring plans are Llama's too (a family without a plan is refused naming its layouts: test_llama_parallel.py)
    ring = checked("model=llama-tiny", "parallel=metp", "trainer=cpu")
    assert ring.startswith("layout 'metp': 1 replica(s) x ring of 4")
    assert checked("model=llama-tiny", "parallel=tp2d_metp", "trainer=cpu").startswith("layout '2d-metp'")
    with pytest.raises(ConfigError, match="model.intermediate_size=265 is not divisible by q=2"):
        checked("model=llama-tiny", "model.intermediate_size=265", "parallel.tensor_parallel_size=4")
    # auto asks the family: 3 key/value heads split over no 2x2 grid, but over a 3x3 one
    with pytest.raises(ConfigError, match=r"q dividing model.n_head=12, model.n_kv_head=3, model.n_embd=96 and "
                                          r"model.intermediate_size=264\). Use trainer.devices=9 \(or"):
        checked("model=llama-tiny", "model.n_kv_head=3", "trainer=cpu")
    assert "3x3 grid (p=9)" in checked("model=llama-tiny", "model.n_kv_head=3", "trainer=cpu", "trainer.devices=9",
                                       "data.batch_size=9")
    config = LlamaConfig.from_name("llama-tiny", n_kv_head=3)
    assert auto_tensor_parallel_size(get_layout("2d"), 4, 4, config) == 1
    assert auto_tensor_parallel_size(get_layout("2d"), 9, 9, config) == 9


# ---- inputs a user meets first (issue 21): tokenizers, the data format, folders of other suffixes ----------------


class _OfflineTiktoken:
    """A tiktoken whose BPE files cannot be fetched (a machine without network)."""

    @staticmethod
    def get_encoding(name):
        raise ConnectionError("HTTPSConnectionPool(host='openaipublic.blob.core.windows.net', port=443): Max retries "
                              "exceeded with url: /gpt-2/encodings/main/vocab.bpe (Caused by NameResolutionError("
                              "\"<urllib3.connection.HTTPSConnection object at 0x7f>: Failed to resolve\"))\n" * 3)


@pytest.mark.parametrize("tiktoken, message", [
    (None, "data.tokenizer: tokenizer 'gpt2' needs the tiktoken package"),
    (_OfflineTiktoken, "they could not be loaded (ConnectionError: HTTPSConnectionPool(host="),
])
def test_a_tokenizer_that_cannot_load_is_a_config_error_of_one_short_line(monkeypatch, tiktoken, message):
    """``data.tokenizer=gpt2`` without tiktoken, or offline with it: refused before any process starts, in one line
    (it used to be Hydra's "Error executing job" wrapper around a long ConnectionError, exit 1)."""
    monkeypatch.setitem(sys.modules, "tiktoken", tiktoken)
    with pytest.raises(ConfigError) as err:
        checked("model=gpt2", "data.tokenizer=gpt2", "trainer.devices=4")
    text = str(err.value)
    assert message in text and "tokenizer='byte'" in text
    assert "\n" not in text and len(text) < 700, text


def test_an_explicit_data_format_wins_over_the_suffix(tmp_path):
    """``data=text data.path=notes.bin`` reads the file as text (it used to be read as uint16 ids, silently, and
    answered with vocabulary advice); without ``data=text`` the suffix decides, and the message says so."""
    notes = tmp_path / "notes.bin"
    notes.write_text("plain words, not token ids " * 800, encoding="utf-8")  # 21600 tokens: 20500 are needed
    assert checked("data=text", f"data.path={notes}").startswith("layout '2d'")
    dm = instantiate(composed("data=text", f"data.path={notes}", "data.max_tokens=null").data)
    dm.setup()
    assert dm.decode(dm.tokens[:11].tolist()) == "plain words"
    with pytest.raises(ConfigError) as err:
        checked(f"data.path={notes}")  # data=default: format auto
    assert "(read as token ids for its .bin suffix; format='text' reads it as text)" in str(err.value)
    with pytest.raises(ConfigError, match="format must be one of auto, text, tokens"):
        checked("data=text", f"data.path={notes}", "data.format=txt")


def test_a_folder_of_other_suffixes_lists_what_is_read_and_data_suffixes_adds_them(tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    for i in range(3):
        (code / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 300)  # 25200 tokens in all
    with pytest.raises(ConfigError) as err:
        checked("data=text", f"data.path={code}")
    assert "holds no text files with the suffixes read (.txt, .md, .rst); it holds .py files: add suffixes" in \
        str(err.value) and "data.suffixes='[.py]'" in str(err.value)
    assert checked("data=text", f"data.path={code}", "data.suffixes=[.py]").startswith("layout '2d'")
    dm = instantiate(composed("data=text", f"data.path={code}", "data.suffixes=[py]", "data.cache=false").data)
    dm.setup()
    assert dm.decode(dm.tokens[:9].tolist()) == "def f0(x)"
