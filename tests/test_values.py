"""Every number a user can set is checked before anything starts: one line naming the setting and its value, exit 2,
nothing left on disk (issue 47: ``module.learning_rate=-1e-3`` started 4 processes and ended in 4 tracebacks;
``tp2d-generate --temperature -1`` sampled greedily without a word).

* :func:`lightning_tp2d.values.number_problem`, the one rule every check uses;
* ``tp2d-train``: a bad value of every numeric key of ``conf/`` (every option of every group composed, the keys
  found in it; and the keys whose default is ``null`` or an interpolation) is refused through the console script's
  own ``main`` in this process, with ``Trainer.fit`` (where Lightning would start the ranks) failing the test;
* ``CausalLMModule`` refuses the same values when a user's own script builds it, and ``tp2d-generate`` its flags;
* the rich progress bar says ``Epoch 0``, not ``Epoch 0/-2``, under tp2d-train's ``max_epochs=-1``.
"""

from __future__ import annotations

import math

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import lightning_tp2d as tp
from lightning_tp2d import generate, launch
from lightning_tp2d.callbacks import ResumableRichProgressBar
from lightning_tp2d.values import number_problem
from tests.test_refuse_before_launch import CPU_RUN, one_line_exit_2

# ---- the rule --------------------------------------------------------------------------------------------------


def test_number_problem_names_the_setting_the_value_and_what_would_do():
    assert number_problem("lr", -1e-3, low=0, low_open=True, meaning="peak") == "lr=-0.001 must be a number > 0 (peak)"
    assert number_problem("steps", 2.5, low=0, integer=True) == "steps=2.5 must be an int >= 0"
    assert number_problem("k", 0, low=1, integer=True, optional=True) == "k=0 must be an int >= 1 or null"
    assert number_problem("n", -2, low=1, integer=True, also=(-1,)) == "n=-2 must be an int >= 1 or -1"
    assert number_problem("seed", -1, low=0, high=2**32 - 1, integer=True) == "seed=-1 must be an int in [0, 4294967295]"
    assert number_problem("b", 1.0, low=0, high=1, high_open=True) == "b=1.0 must be a number in [0, 1)"
    for value in (math.nan, math.inf, "3", True, None):  # not finite, not a number, a bool typo, a missing value
        assert number_problem("x", value, low=0) == f"x={value!r} must be a number >= 0"
    for good, rule in ((0.5, {"low": 0}), (None, {"optional": True}), (-1, {"low": 1, "also": (-1,)}),
                       ("auto", {"low": 1, "also": ("auto",)}), (3, {"low": 1, "integer": True})):
        assert number_problem("x", good, **rule) is None


# ---- tp2d-train: every numeric key ------------------------------------------------------------------------------

# key -> (bad value, overrides that select the group option holding the key). The message must name the key's last
# part and the value.
LLAMA, ROPE = ["model=llama-tiny"], ["model=llama-3.1-8b"]
EARLY = ["callbacks=[default,early_stopping]"]
BAD = {
    "seed": ("-1", []),
    "module.learning_rate": ("-1e-3", []),
    "module.weight_decay": ("-0.1", []),
    "module.betas": ("[1.5,0.9]", []),
    "module.eps": ("0", []),
    "module.warmup_steps": ("-5", []),
    "module.max_steps": ("0", []),  # default null
    "module.min_lr_ratio": ("2", []),
    "module.init_seed": ("1.5", []),  # default ${seed}
    "trainer.max_steps": ("-5", []),
    "trainer.max_epochs": ("-5", []),
    "trainer.val_check_interval": ("0", []),
    "trainer.check_val_every_n_epoch": ("0", []),  # default null
    "trainer.limit_val_batches": ("-1", []),
    "trainer.num_sanity_val_steps": ("-5", []),
    "trainer.log_every_n_steps": ("0", []),
    "trainer.gradient_clip_val": ("-1", []),
    "trainer.accumulate_grad_batches": ("0", []),
    "trainer.devices": ("0", []),
    "trainer.num_nodes": ("0", []),
    "sample.max_new_tokens": ("-3", []),
    "sample.temperature": ("-1", []),
    "sample.top_k": ("0", []),
    "model.n_layer": ("0", []),
    "model.n_head": ("0", []),
    "model.n_embd": ("0", []),
    "model.vocab_size": ("0", []),
    "model.block_size": ("0", []),
    "model.dropout": ("1.5", []),
    "model.pad_vocab_multiple": ("0", []),
    "model.intermediate_size": ("0", LLAMA),
    "model.n_kv_head": ("0", LLAMA),
    "model.norm_eps": ("-1", LLAMA),
    "model.rope_theta": ("-1", LLAMA),
    "model.rope_scaling.factor": ("-2", ROPE),
    "model.rope_scaling.high_freq_factor": ("-4", ROPE),
    "model.rope_scaling.low_freq_factor": ("-1", ROPE),
    "model.rope_scaling.original_max_position_embeddings": ("0", ROPE),
    "parallel.tensor_parallel_size": ("0", []),
    "parallel.data_parallel_size": ("-1", []),
    "parallel.zero_stage": ("7", []),
    "parallel.timeout": ("-1", []),
    "parallel.memory_gib": ("-3", []),  # default null
    "parallel.pipeline_parallel_size": ("0", []),
    "parallel.microbatches": ("0", []),  # default null
    "parallel.virtual_stages": ("0", []),
    "parallel.plan_options.zero_stages": ("[7]", ["parallel=auto"]),
    "data.batch_size": ("0", []),
    "data.block_size": ("0", []),  # default ${model.block_size}
    "data.max_tokens": ("-5", []),
    "data.num_workers": ("-1", []),
    "data.val_fraction": ("1.5", []),
    "data.seed": ("1.5", []),  # default ${seed}
    "data.eos_id": ("-1", []),  # default null
    "logger.csv.flush_logs_every_n_steps": ("0", []),
    "callbacks.model_checkpoint.save_top_k": ("-5", []),
    "callbacks.model_checkpoint.every_n_train_steps": ("-1", []),  # default ${trainer.val_check_interval}
    "callbacks.progress_bar.refresh_rate": ("-1", []),
    "callbacks.rich_progress_bar.refresh_rate": ("-1", ["callbacks=[default,rich_progress_bar]"]),
    "callbacks.early_stopping.patience": ("-1", EARLY),
    "callbacks.early_stopping.min_delta": ("-0.5", EARLY),
    "callbacks.divergence_guard.check_every_n_steps": ("0", []),  # default null
}


def _numeric_keys() -> set[str]:
    """Every key that holds a number (or a list of numbers) in some option of some group of ``conf/``."""

    def leaves(node, path=""):
        if isinstance(node, dict):
            for key, value in node.items():
                yield from leaves(value, f"{path}.{key}" if path else str(key))
        elif isinstance(node, (int, float)) and not isinstance(node, bool) or (
                isinstance(node, list) and any(isinstance(x, (int, float)) for x in node)):
            yield path

    found = set()
    launch.register_resolvers()
    with initialize_config_dir(str(launch.CONF_DIR), version_base="1.3"):
        for group in sorted(p for p in launch.CONF_DIR.iterdir() if p.is_dir()):
            for option in sorted(p.stem for p in group.glob("*.yaml")):
                choice = f"callbacks=[default,{option}]" if group.name == "callbacks" else f"{group.name}={option}"
                cfg = OmegaConf.to_container(compose("config", overrides=[choice]), resolve=False)
                cfg.pop("hydra", None)
                found.update(leaves(cfg))
    return found


def test_every_numeric_key_of_the_configs_has_a_bad_value_here():
    found = _numeric_keys()
    assert len(found) > 40 and {"module.learning_rate", "sample.temperature", "trainer.max_steps"} <= found
    assert found - set(BAD) == set()


@pytest.mark.parametrize("key", sorted(BAD))
def test_a_bad_value_of_every_numeric_key_is_one_line_naming_it_before_launch(key, tmp_path, monkeypatch, capsys):
    value, choose = BAD[key]
    message = one_line_exit_2([*CPU_RUN, *choose, f"{key}={value}"], tmp_path, monkeypatch, capsys)
    name = key.rsplit(".", 1)[-1]
    assert name in message, message
    shown = {"[1.5,0.9]": "1.5", "[7]": "7", "-1e-3": "-0.001"}.get(value, value)
    assert shown in message, message


def test_the_learning_rate_of_the_report_is_refused_in_one_line_naming_it(tmp_path, monkeypatch, capsys):
    message = one_line_exit_2([*CPU_RUN, "module.learning_rate=-1e-3"], tmp_path, monkeypatch, capsys)
    assert message == "module: learning_rate=-0.001 must be a number > 0 (the peak AdamW learning rate)"


# ---- the same rules where users call the classes and the other commands ------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    ({"learning_rate": -1e-3}, "learning_rate=-0.001 must be a number > 0"),
    ({"learning_rate": math.nan}, "learning_rate=nan must be a number > 0"),
    ({"betas": (0.9, 1.0)}, "betas[1]=1.0 must be a number in [0, 1)"),
    ({"betas": (0.9,)}, "betas=(0.9,) must be two numbers in [0, 1)"),
    ({"warmup_steps": 2.5}, "warmup_steps=2.5 must be an int >= 0"),
    ({"predict_temperature": -1.0}, "predict_temperature=-1.0 must be a number >= 0"),
    ({"predict_top_k": 0}, "predict_top_k=0 must be an int >= 1 or null"),
])
def test_the_module_refuses_what_adamw_or_sampling_cannot_use_when_it_is_built(kwargs, message):
    with pytest.raises(ValueError) as err:
        tp.CausalLMModule("gpt2-tiny", **kwargs)
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "-1"], "--temperature=-1.0 must be a number >= 0 (softmax temperature; 0: greedy)"),
    (["--temperature", "nan"], "--temperature=nan must be a number >= 0"),
    (["--top-k", "0"], "--top-k=0 must be an int >= 1 or left out"),
    (["--max-new-tokens", "-2"], "--max-new-tokens=-2 must be an int >= 0"),
])
def test_tp2d_generate_refuses_bad_sampling_flags_in_one_line(flags, message, capsys):
    with pytest.raises(SystemExit) as done:
        generate.parse_args(["--hf", "some-dir", *flags])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"tp2d-generate: error: {message}")


def test_sampling_itself_refuses_a_negative_temperature_instead_of_going_greedy():
    import torch

    model = tp.GPT2(tp.GPT2Config.from_name("gpt2-tiny"))
    with pytest.raises(ValueError, match=r"^temperature=-1\.0 must be a number >= 0"):
        tp.module.sample(model, torch.zeros(1, 4, dtype=torch.long), 2, temperature=-1.0)
    greedy = tp.module.sample(model, torch.zeros(1, 4, dtype=torch.long), 2, temperature=0.0)
    assert greedy.shape == (1, 6)


# ---- the rich progress bar's epoch --------------------------------------------------------------------------------


class _Trainer:
    def __init__(self, max_epochs):
        self.max_epochs = max_epochs


@pytest.mark.parametrize("max_epochs, shown", [(-1, "Epoch 0"), (None, "Epoch 0"), (10, "Epoch 0/9")])
def test_the_rich_bar_shows_the_epoch_and_a_total_only_under_an_epoch_limit(max_epochs, shown):
    bar = ResumableRichProgressBar()
    bar._trainer = _Trainer(max_epochs)
    assert bar._get_train_description(0).rstrip() == shown
