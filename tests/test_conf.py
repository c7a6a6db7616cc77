"""The Hydra tree in ``conf/`` and the pieces of ``tp2d-train`` that need no processes: composition of every group
option, comments on every key, ``_target_`` classes, ``auto`` values per launcher, the command line each rank
parses, override-key checks and the layout checks that run before any process starts."""

from __future__ import annotations

import importlib
import re

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lightning_tp2d import launch
from lightning_tp2d.models import GPT2Config
from lightning_tp2d.train import ConfigError, check_config, device_count

CONF = launch.CONF_DIR
GROUPS = {"model": ["gpt2", "gpt2-large", "gpt2-medium", "gpt2-mini", "gpt2-tiny", "gpt2-xl"],
          "parallel": ["metp", "single", "tp2d", "tp2d_metp"],
          "trainer": ["auto", "cpu", "gpu", "multinode"],
          "data": ["default", "text", "tokens"]}

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
    cfg = composed("trainer=cpu")
    for node in ("model", "module", "parallel", "data", "checkpoint", "progress_bar", "trainer"):
        module_name, _, name = cfg[node]["_target_"].rpartition(".")
        assert hasattr(importlib.import_module(module_name), name), cfg[node]["_target_"]
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
                                             "every sequence into 8 zigzag chunks); use data.block_size=96"),
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


def test_devices_without_a_grid_fall_back_to_data_parallel_with_a_note():
    assert "no grid larger than 1 fits 3 devices" in checked("trainer.devices=3", "data.batch_size=3")
    assert device_count("0,1", "gpu") == 2 and device_count([0, 1, 2], "gpu") == 3 and device_count("x", "cpu") is None


def test_the_console_script_is_declared():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((CONF.parent / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["tp2d-train"] == "lightning_tp2d.train:main"
    assert any(dep.startswith("matplotlib") for dep in project["dependencies"])

