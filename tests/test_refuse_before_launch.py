"""What ``tp2d-train`` refuses on the launching process, before any rank starts (issue 34, item 4): a corpus too
short for the windows and batches the data module would cut, parameters that alone exceed the machine's memory, and
absurd sizes in a transformers ``config.json`` (refused wherever it is read). No ranks are spawned: ``check_config``
runs on configs composed with Hydra's API, and the console script's ``main``, run in this process, shows the one-line
exit.

Issue 38: every config error is one line on stderr and exit 2 before any process starts (a ZeRO stage out of range,
a model, group option or layout that does not exist, an ``init_from`` that disagrees with the model chosen, a damaged
or incomplete ``ckpt_path``), run through the console script's own ``main`` in this process with the Trainer's
``fit`` (where Lightning starts the ranks) made to fail the test; and the long-running tools say what they do
(``tp2d-plan``'s progress lines, the fit check's line)."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

import lightning_tp2d as tp
from lightning_tp2d import launch, train
from lightning_tp2d.data import ByteTokenizer, build_cache, count_tokens, load_tokens
from lightning_tp2d.data.token_files import CHUNK_CHARS
from lightning_tp2d.export import hf_config, hf_llama_config, hf_model_config, load_hf_model
from lightning_tp2d.families import family_of_config
from lightning_tp2d.models import GPT2Config
from lightning_tp2d.models.llama import LlamaConfig
from lightning_tp2d.param_memory import parameter_count, parameter_memory_problem
from lightning_tp2d.safe_files import human_bytes
from lightning_tp2d.train import ConfigError, check_config

GIB = 1 << 30

launch.register_resolvers()


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(launch.CONF_DIR), version_base="1.3", job_name="test"):
        return compose(config_name="config", overrides=list(overrides))


def checked(*overrides: str) -> str:
    cfg = composed(*overrides)
    return check_config(cfg, instantiate(cfg.model))


def refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        checked(*overrides)
    message = str(err.value)
    assert "\n" not in message  # one line
    return message


# ---- 1. a corpus too short for the data module -------------------------------------------------------------------


def test_a_text_corpus_shorter_than_one_window_is_refused_before_launch_naming_file_and_tokens(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("hi")
    # gpt2-mini on a 2x2 grid (dp=1): each split needs batch_size=8 windows of 128 tokens, +1 = 1025 tokens, and
    # the validation split is the last 5%: int(n * 0.05) >= 1025 first holds at n = 20500
    message = refusal("trainer=cpu", "model=gpt2-mini", "data=text", f"data.path={short}")
    assert f"data.path '{short}': 2 tokens are too few" in message
    assert "train split (2 tokens)" in message and "validation split (the last data.val_fraction=0.05, 0 tokens)" in \
        message
    assert "= 1025 tokens" in message and "needs at least 20500 tokens (or a separate data.val_path)" in message


def test_short_token_files_and_a_short_val_path_are_refused_before_launch(tmp_path):
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "short.bin")
    (np.arange(5000, dtype=np.uint16) % 250).tofile(tmp_path / "train.bin")
    message = refusal("trainer=cpu", "model=gpt2-mini", "data=tokens", f"data.path={tmp_path / 'short.bin'}")
    assert f"data.path '{tmp_path / 'short.bin'}': 100 tokens are too few" in message
    message = refusal("trainer=cpu", "model=gpt2-mini", "data=tokens", f"data.path={tmp_path / 'train.bin'}",
                      f"data.val_path={tmp_path / 'short.bin'}")
    assert message == (f"data.val_path '{tmp_path / 'short.bin'}': 100 tokens are too few for data.batch_size=8 x 1 "
                       "data-parallel replica(s) = 8 windows of data.block_size=128 tokens, +1 = 1025 tokens (the "
                       "validation split)")
    # data.max_tokens cuts each source: 5000 tokens of train.bin, but only the first 1000 are used
    message = refusal("trainer=cpu", "model=gpt2-mini", "data=tokens", f"data.path={tmp_path / 'train.bin'}",
                      f"data.val_path={tmp_path / 'train.bin'}", "data.max_tokens=1000")
    assert message.startswith(f"data.path '{tmp_path / 'train.bin'}': 1000 tokens (data.max_tokens=1000) are too few "
                              "for data.batch_size=8") and message.endswith("(the train split)")


@pytest.mark.parametrize("overrides, least", [
    ([], 340),  # both splits need batch_size=2 windows of 8 tokens, +1 = 17: int(n * 0.05) >= 17 from n = 340
    (["trainer.limit_val_batches=0"], 180),  # no validation loader: the validation split needs one window (9)
])
def test_the_launcher_refuses_exactly_what_the_data_module_refuses(tmp_path, overrides, least):
    corpus = tmp_path / "corpus.txt"
    settings = ["parallel=single", "trainer=cpu", "model=gpt2-tiny", "data=text", f"data.path={corpus}",
                "data.block_size=8", "data.batch_size=2", "data.cache=false", *overrides]
    validates = not overrides
    for n, fits in ((least - 1, False), (least, True)):
        corpus.write_text(("abcdefghij" * 100)[:n])  # byte tokenizer: one token per ASCII byte
        dm = tp.TextDataModule(path=str(corpus), block_size=8, batch_size=2, cache=False)
        if fits:
            assert checked(*settings).startswith("plain GPT-2")
            dm.setup()
            assert len(dm.train_dataloader()) >= 1 and (not validates or len(dm.val_dataloader()) >= 1)
        else:
            assert f"{n} tokens are too few" in refusal(*settings)
            with pytest.raises(ValueError, match="too few|fewer than batch_size"):  # the data module's own refusal
                dm.setup()
                dm.train_dataloader()
                if validates:
                    dm.val_dataloader()


def test_data_parallel_replicas_multiply_the_windows_a_split_needs(tmp_path):
    corpus = tmp_path / "corpus.txt"
    settings = ["trainer=cpu", "trainer.devices=8", "parallel.tensor_parallel_size=4", "model=gpt2-tiny", "data=text",
                f"data.path={corpus}", "data.block_size=8", "data.batch_size=2", "data.cache=false"]
    corpus.write_text("x" * 659)  # dp=2: each split needs 2 x 2 = 4 windows of 8 tokens, +1 = 33; n >= 660
    assert "x 2 data-parallel replica(s) = 4 windows" in refusal(*settings)
    corpus.write_text("x" * 660)
    assert checked(*settings).startswith("layout '2d': 2 replica(s)")


def test_the_data_modules_own_error_names_the_file_and_the_numbers(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("hi")
    dm = tp.TextDataModule(path=str(short), block_size=64, cache=False)
    with pytest.raises(ValueError) as err:
        dm.setup()
    message = str(err.value)
    assert message.startswith(f"path '{short}': 2 tokens are too few: its train split (2 tokens) and its validation "
                              "split (the last val_fraction=0.05, 0 tokens) must each hold one window of "
                              "block_size+1 = 65 tokens; it needs at least 1300 tokens")
    assert "\n" not in message


class _CountingBytes(ByteTokenizer):
    """The byte tokenizer, counting the characters it encodes."""

    def __init__(self) -> None:
        self.chars = 0

    def encode(self, text: str) -> np.ndarray:
        self.chars += len(text)
        return super().encode(text)


class _Refusing(ByteTokenizer):
    def encode(self, text: str) -> np.ndarray:
        raise AssertionError("tokenised although the cache holds the tokens")


def test_counting_tokens_reads_a_bounded_prefix_and_matches_the_stream_exactly(tmp_path):
    big = tmp_path / "big.txt"
    big.write_text("a few words on a line\n" * (3 * CHUNK_CHARS // 22))  # three pieces of the data module's reader
    tokenizer = _CountingBytes()
    assert count_tokens(big, tokenizer, at_least=20_000) >= 20_000
    assert tokenizer.chars <= CHUNK_CHARS + 64  # one piece tokenised, not the whole corpus
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_bytes(b"windows\r\nline ends\r\n")  # read as text: \r\n becomes \n
    (folder / "b.md").write_text("caf\u00e9 \u00fcber")
    stream = load_tokens(str(folder), ByteTokenizer())
    assert count_tokens(folder, ByteTokenizer()) == len(stream) == 18 + 1 + 11  # the files joined by end-of-text
    np.arange(77, dtype=np.uint32).tofile(tmp_path / "ids.bin")
    np.save(tmp_path / "ids.npy", np.arange(55, dtype=np.int64))
    assert count_tokens(tmp_path / "ids.bin", None, dtype="uint32") == 77
    assert count_tokens(tmp_path / "ids.npy", None) == 55
    build_cache(big, ByteTokenizer())
    assert count_tokens(big, _Refusing(), cache=True) == big.stat().st_size  # the cache's size, nothing tokenised


# ---- 2. parameters beyond the machine's memory -------------------------------------------------------------------


@pytest.mark.parametrize("config", [
    GPT2Config.from_name("gpt2-tiny"), GPT2Config.from_name("gpt2-mini", bias=False),
    LlamaConfig.from_name("llama-tiny"), LlamaConfig.from_name("llama-tiny", tie_embeddings=True),
    LlamaConfig.from_name("llama-mini", n_layer=3)])
def test_the_parameter_count_is_the_models_own(config):
    assert parameter_count(config) == family_of_config(config).model_class(config).num_parameters()


def test_the_parameter_count_of_a_huge_config_is_arithmetic():
    started = time.monotonic()
    mini = GPT2Config.from_name("gpt2-mini")
    block = 12 * 96 * 96 + 13 * 96
    assert parameter_count(GPT2Config.from_name("gpt2-mini", n_layer=10 ** 7)) == \
        parameter_count(mini) + (10 ** 7 - 4) * block
    assert parameter_count(LlamaConfig.from_name("llama-3.2-1b")) == 1_235_814_400
    assert time.monotonic() - started < 5


def test_the_memory_problem_names_needed_available_and_what_fits():
    assert parameter_memory_problem(10 ** 9, p=4, dp=1, processes=4, available=16 * GIB) is None  # 4 GB in all
    message = parameter_memory_problem(10 ** 10, p=4, dp=2, zero_stage=0, processes=8, available=16 * GIB)
    # 8 processes x (1e10 x 4 bytes / p=4) = 80 GB; ZeRO-3 halves it to 40 GB, still too much
    assert message.startswith(f"the model's parameters alone need {human_bytes(8e10)} of this machine's "
                              f"{human_bytes(16 * GIB)} of memory: 10,000,000,000 parameters x 4 bytes (float32) / "
                              "p=4 = 9.3 GiB per process x 8 processes")
    assert "at most 2,147,483,648 parameters fit these settings" in message
    fits = parameter_memory_problem(3 * 10 ** 9, p=4, dp=2, processes=8, available=16 * GIB)
    assert "parallel.zero_stage=3" in fits  # 24 GB, 12 GB with the parameters sharded over dp=2 too
    assert parameter_memory_problem(3 * 10 ** 9, p=4, dp=2, zero_stage=3, processes=8, available=16 * GIB) is None
    assert parameter_memory_problem(10 ** 13, p=4, processes=4, available=None) is None  # unknown memory: no check


def test_parameters_beyond_physical_memory_are_refused_before_launch(monkeypatch):
    monkeypatch.setattr(train, "physical_memory", lambda: 16 * GIB)
    message = refusal("trainer=cpu", "model=gpt2-mini", "model.n_layer=10000000")
    params = parameter_count(GPT2Config.from_name("gpt2-mini", n_layer=10 ** 7))
    assert message.startswith(f"the model's parameters alone need {human_bytes(params * 4)} of this "
                              f"machine's 16.0 GiB of memory: {params:,} parameters x 4 bytes (float32) / p=4")
    assert "x 4 processes" in message and "use a smaller model" in message
    single = refusal("parallel=single", "trainer=cpu", "model=gpt2-mini", "model.n_embd=600000000", "model.n_head=6")
    assert "/ p=1 =" in single and "x 1 process" in single
    # ZeRO-3 shards the parameters over data_parallel too: 8 processes x 1/8 of them each
    assert "parallel.zero_stage=3" in refusal("trainer=cpu", "trainer.devices=8", "parallel.tensor_parallel_size=4",
                                              "model=gpt2-mini", "model.n_layer=27000")
    assert checked("trainer=cpu", "trainer.devices=8", "parallel.tensor_parallel_size=4", "model=gpt2-mini",
                   "model.n_layer=27000", "parallel.zero_stage=3").startswith("layout '2d'")
    monkeypatch.setattr(train, "physical_memory", lambda: None)
    assert checked("trainer=cpu", "model=gpt2-mini", "model.n_layer=10000000").startswith("layout '2d'")


# ---- 3. absurd sizes in a transformers config.json ---------------------------------------------------------------


def _hf_dir(path: Path, **fields) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(fields))
    return path


@pytest.mark.parametrize("fields, message", [
    (dict(model_type="gpt2", n_layer=10 ** 7), "n_layer=10000000 is not a plausible size (at most 1024 layers)"),
    (dict(model_type="gpt2", n_embd=12 * 10 ** 8), "n_embd=1200000000 is not a plausible size (at most 131072 "),
    (dict(model_type="gpt2", vocab_size=10 ** 10), "vocab_size=10000000000 is not a plausible size (at most "),
    (dict(model_type="gpt2", n_positions=10 ** 9), "n_positions=1000000000 is not a plausible size (at most "),
    (dict(model_type="gpt2", n_head=0), "n_head=0 is not a positive integer"),
    (dict(model_type="gpt2", n_layer=-3), "n_layer=-3 is not a positive integer"),
    (dict(model_type="gpt2", n_layer=2.5), "n_layer=2.5 is not a positive integer"),
    (dict(model_type="gpt2", n_layer=True), "n_layer=True is not a positive integer"),
    (dict(model_type="gpt2", n_embd="768"), "n_embd='768' is not a positive integer"),
    (dict(model_type="llama", num_hidden_layers=10 ** 7), "num_hidden_layers=10000000 is not a plausible size"),
    (dict(model_type="llama", hidden_size=10 ** 9), "hidden_size=1000000000 is not a plausible size"),
    (dict(model_type="llama", vocab_size=10 ** 10), "vocab_size=10000000000 is not a plausible size"),
    (dict(model_type="llama", intermediate_size=10 ** 9), "intermediate_size=1000000000 is not a plausible size"),
    (dict(model_type="llama", num_key_value_heads=-8), "num_key_value_heads=-8 is not a positive integer"),
])
def test_absurd_sizes_in_a_config_json_are_refused_when_it_is_read(tmp_path, fields, message):
    directory = _hf_dir(tmp_path / "hf", **fields)
    (directory / "model.safetensors").write_bytes(b"")  # never reached
    named = f"'{directory / 'config.json'}': {message}"
    started = time.monotonic()
    for read in (hf_model_config, load_hf_model, hf_config if fields["model_type"] == "gpt2" else hf_llama_config,
                 lambda d: tp.CausalLMModule(model=None, init_from=str(d))):
        with pytest.raises(ValueError) as err:
            read(directory)
        assert str(err.value).startswith(named), str(err.value)
    named_model = "gpt2-tiny" if fields["model_type"] == "gpt2" else "llama-tiny"
    module = tp.CausalLMModule(model=named_model, init_from=str(directory))
    with pytest.raises(ValueError, match="is not a p"):
        module.configure_model()
    assert time.monotonic() - started < 10  # no allocation of the absurd model


def test_the_largest_real_configs_read_as_they_are(tmp_path):
    llama_405b = dict(model_type="llama", num_hidden_layers=126, hidden_size=16384, vocab_size=128256,
                      intermediate_size=53248, num_attention_heads=128, num_key_value_heads=8,
                      max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                      rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                        original_max_position_embeddings=8192))
    config = hf_llama_config(_hf_dir(tmp_path / "405b", **llama_405b))
    assert (config.n_layer, config.n_embd, config.vocab_size, config.intermediate_size) == (126, 16384, 128256, 53248)
    wide_vocab = hf_llama_config(_hf_dir(tmp_path / "1m", model_type="llama", vocab_size=1_048_576, hidden_size=2048,
                                         num_attention_heads=16, intermediate_size=8192, num_hidden_layers=16))
    assert wide_vocab.vocab_size == 1_048_576
    xl = hf_config(_hf_dir(tmp_path / "xl", model_type="gpt2", n_layer=48, n_head=25, n_embd=1600))
    assert (xl.n_layer, xl.n_embd, xl.vocab_size, xl.block_size) == (48, 1600, 50257, 1024)


def test_tp2d_train_reads_init_from_before_launch(tmp_path, monkeypatch):
    absurd = _hf_dir(tmp_path / "absurd", model_type="gpt2", n_layer=10 ** 7)
    message = refusal("trainer=cpu", "model=gpt2-mini", f"module.init_from={absurd}")
    assert message == (f"module.init_from: '{absurd / 'config.json'}': n_layer=10000000 is not a plausible size "
                       "(at most 1024 layers)")
    other = _hf_dir(tmp_path / "other", model_type="gpt2", n_layer=3, n_head=6, n_embd=48, vocab_size=257,
                    n_positions=64)
    message = refusal("trainer=cpu", "model=gpt2-mini", f"module.init_from={other}")
    assert message.startswith(f"module.init_from: transformers checkpoint '{other}' does not fit the model GPT-2 "
                              "4x96: ")  # (the fields' order was seen to vary within a session: each is checked)
    assert "n_layer: model 4, checkpoint 3" in message and "n_embd: model 96, checkpoint 48" in message
    assert "module.model=null" in message
    # module.model=null: the model is the checkpoint's, and the checks before launch are of its sizes
    assert checked("parallel=single", "trainer=cpu", f"module.init_from={other}", "module.model=null",
                   "data.block_size=64").startswith("plain GPT-2 (3 layers, 48 wide)")
    missing = refusal("trainer=cpu", f"module.init_from={tmp_path / 'nowhere'}")
    assert missing.startswith(f"module.init_from='{tmp_path / 'nowhere'}' does not exist")
    assert refusal("trainer=cpu", "module.model=null").startswith("module.model=null takes the sizes from "
                                                                  "module.init_from's config.json")
    (other / "config.json").write_text("{not json")
    assert refusal("trainer=cpu", f"module.init_from={other}").startswith(
        f"module.init_from: '{other / 'config.json'}' is not JSON (")


def test_tp2d_train_refuses_an_absurd_init_from_in_one_line_before_any_process_starts(tmp_path, monkeypatch,
                                                                                     capsys):
    absurd = _hf_dir(tmp_path / "hf" / "absurd", model_type="gpt2", n_layer=10 ** 7)
    started = time.monotonic()
    message = one_line_exit_2(["trainer=cpu", "model=gpt2-mini", f"module.init_from={absurd}"], tmp_path, monkeypatch,
                              capsys)  # (the console script's main in this process; no run directory left)
    assert message == (f"module.init_from: '{absurd / 'config.json'}': n_layer=10000000 is not a plausible size (at "
                       "most 1024 layers)")
    assert time.monotonic() - started < 60


# ---- 4. every config error: one line, exit 2, no process started (issue 38) -------------------------------------


def tp2d_train_main(args: list[str], cwd: Path, monkeypatch, capsys, launches: bool = False) -> tuple[int, str, str]:
    """``tp2d-train <args>`` through the console script's ``main`` in this process, in ``cwd``, with
    ``Trainer.fit`` (where Lightning starts the ranks) raising unless ``launches``: ``(exit code, stdout,
    stderr)``; 0 when it returned."""
    from hydra.core.global_hydra import GlobalHydra

    def no_launch(*_args, **_kwargs):
        raise AssertionError("Trainer.fit was called: the ranks would have started")

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "SLURM_PROCID", launch.RUN_DIR_ENV):
        monkeypatch.delenv(name, raising=False)
    if not launches:
        monkeypatch.setattr(train.L.Trainer, "fit", no_launch)
    monkeypatch.setattr(sys, "argv", ["tp2d-train", *args])
    for name in ("stdout", "stderr"):  # (main wraps them: launch.survive_closed_output)
        monkeypatch.setattr(sys, name, getattr(sys, name))
    monkeypatch.chdir(cwd)
    capsys.readouterr()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level  # Hydra's job logging replaces them
    GlobalHydra.instance().clear()
    try:
        train.main()
        code = 0
    except SystemExit as err:
        code = err.code
    finally:
        GlobalHydra.instance().clear()
        root.handlers[:] = handlers
        root.setLevel(level)
    out, err = capsys.readouterr()
    return code, out, err


def one_line_exit_2(args: list[str], tmp_path: Path, monkeypatch, capsys) -> str:
    """The one stderr line of a refused ``tp2d-train <args>`` (exit 2, nothing left in its working directory)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    code, out, err = tp2d_train_main(args, cwd, monkeypatch, capsys)
    assert code == 2, out[-2000:] + err[-2000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tp2d-train: error: "), err[-3000:]
    assert "Traceback" not in out + err and "HYDRA_FULL_ERROR" not in out + err
    assert not list(cwd.iterdir())  # no run directory left behind
    return lines[0][len("tp2d-train: error: "):]


CPU_RUN = ["trainer=cpu", "model=gpt2-tiny", "data.max_tokens=20000", "data.block_size=32"]


@pytest.mark.parametrize("stage", ["7", "-1", "true"])
def test_a_zero_stage_out_of_range_is_one_line_naming_it_and_the_stages(tmp_path, monkeypatch, capsys, stage):
    message = one_line_exit_2([*CPU_RUN, f"parallel.zero_stage={stage}"], tmp_path, monkeypatch, capsys)
    shown = {"7": "7", "-1": "-1", "true": "True"}[stage]
    assert message.startswith(f"parallel.zero_stage={shown} is not a ZeRO stage: choose 0 (")
    assert "1 (the optimizer state sharded" in message and message.endswith("or 3 (parameters too)")


def test_an_unknown_model_or_group_option_is_one_line_listing_the_options(tmp_path, monkeypatch, capsys):
    models = ", ".join(sorted(p.stem for p in (launch.CONF_DIR / "model").glob("*.yaml")))
    message = one_line_exit_2(["trainer=cpu", "model=gpt2-nonsense"], tmp_path, monkeypatch, capsys)
    assert message == f"model=gpt2-nonsense: model/ has no option 'gpt2-nonsense'; its options: {models}"
    assert "llama-tiny" in models and "gpt2-mini" in models
    message = one_line_exit_2(["trainer=cpu", "parallel=ring"], tmp_path, monkeypatch, capsys)
    assert message.startswith("parallel=ring: parallel/ has no option 'ring'; its options: auto, metp, single, tp2d, "
                              "tp2d_metp")
    # a sweep's every value, and a list of options, is checked too
    message = one_line_exit_2(["-m", "trainer=cpu", "model=gpt2-tiny,llama-huge"], tmp_path, monkeypatch, capsys)
    assert message.startswith("model=gpt2-tiny,llama-huge: model/ has no option 'llama-huge'")
    message = one_line_exit_2(["trainer=cpu", "callbacks=[default,lr_monitr]"], tmp_path, monkeypatch, capsys)
    assert message.startswith("callbacks=[default,lr_monitr]: callbacks/ has no option 'lr_monitr'") and \
        message.endswith("(did you mean callbacks=lr_monitor?)")


def test_an_unknown_layout_name_is_one_line_listing_the_layouts(tmp_path, monkeypatch, capsys):
    message = one_line_exit_2([*CPU_RUN, "parallel.layout=3d"], tmp_path, monkeypatch, capsys)
    assert message == "parallel.layout: unknown layout '3d'; choose one of ['2d', 'metp', '2d-metp'], or 'auto' (planned)"


def test_hydras_own_message_stays_for_a_malformed_override(tmp_path, monkeypatch, capsys):
    code, _, err = tp2d_train_main(["trainer=cpu", "model=[gpt2"], tmp_path, monkeypatch, capsys)
    assert code == 1 and "no viable alternative at input '[gpt2'" in err  # Hydra's grammar error


def test_init_from_of_another_family_or_other_sizes_is_one_line_naming_each_field_once(tmp_path, monkeypatch, capsys):
    llama = _hf_dir(tmp_path / "llama", model_type="llama", vocab_size=300, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                    rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5,
                    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=16))
    message = one_line_exit_2([*CPU_RUN, "model=gpt2-mini", f"module.init_from={llama}"], tmp_path, monkeypatch,
                              capsys)
    assert message == (f"module.init_from={str(llama)!r} holds a Llama model (its config.json), but the model chosen, "
                       "gpt2-mini, is a GPT-2: leave model= out (the model is then the directory's), or choose a "
                       "model of its family")
    message = one_line_exit_2([*CPU_RUN, "model=llama-tiny", f"module.init_from={llama}"], tmp_path, monkeypatch,
                              capsys)
    scaling = "{'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0, " \
              "'original_max_position_embeddings': 16}"
    assert message.startswith(f"module.init_from: transformers checkpoint {str(llama)!r} does not fit the model "
                              "llama-tiny: n_layer: model 2, checkpoint 3; n_head: model 12, checkpoint 4; n_kv_head: "
                              "model 6, checkpoint 2; n_embd: model 96, checkpoint 64; intermediate_size: model 264, "
                              "checkpoint 128; vocab_size: model 257, checkpoint 300; rope_theta: model 10000.0, "
                              f"checkpoint 500000.0; rope_scaling: model None, checkpoint {scaling}; "
                              "tie_embeddings: model False, checkpoint True; leave model= out"), message
    listed = message.split("llama-tiny: ", 1)[1].split("; leave model= out")[0]
    fields = [part.split(":")[0] for part in listed.split("; ")]
    assert len(fields) == len(set(fields)) == 9  # each disagreeing field once


def _checkpoint_file(path: Path) -> Path:
    """A single-file Lightning checkpoint: its state dict and the step it was saved at."""
    torch.save({"state_dict": {"model.w": torch.full((4096,), 1.5)}, "global_step": 3, "epoch": 0}, path)
    return path


def test_a_damaged_or_incomplete_ckpt_path_is_named_before_any_process_starts(tmp_path, monkeypatch, capsys):
    from lightning_tp2d.safe_files import file_digest, write_checksums

    single = _checkpoint_file(tmp_path / "single.ckpt")
    data = bytearray(single.read_bytes())
    at = data.find(bytes.fromhex("0000c03f") * 64)  # float32 1.5, little-endian
    assert at > 0
    data[at:at + 8] = bytes(8)  # a tensor's bytes overwritten, the size unchanged: only the CRC-32 tells
    single.write_bytes(bytes(data))
    message = one_line_exit_2([*CPU_RUN, f"ckpt_path={single}"], tmp_path, monkeypatch, capsys)
    assert message.startswith(f"ckpt_path: checkpoint {str(single)!r} is damaged and was not loaded: single.ckpt: "
                              "entry ") and "CRC-32 mismatch: damaged" in message
    sharded = tmp_path / "sharded.ckpt"
    sharded.mkdir()
    for name, size in (("__0_0.distcp", 3000), ("__1_0.distcp", 2000), (".metadata", 100), ("meta.pt", 100)):
        (sharded / name).write_bytes(bytes(range(256)) * (size // 256))
    write_checksums(sharded, {n: file_digest(sharded / n) for n in ("__0_0.distcp", "__1_0.distcp")},
                    also=(".metadata", "meta.pt"))
    (sharded / "__1_0.distcp").unlink()
    (sharded / "__0_0.distcp").write_bytes(b"x" * 10)
    message = one_line_exit_2([*CPU_RUN, f"ckpt_path={sharded}", "trainer.max_steps=-1"], tmp_path, monkeypatch,
                              capsys)
    assert message.startswith(f"ckpt_path: checkpoint {str(sharded)!r} is damaged and was not loaded: __0_0.distcp: "
                              "10 bytes, written with 2816 (truncated or overwritten); __1_0.distcp: missing. ")


# ---- 5. the long-running checks say what they do (issue 38) -------------------------------------------------------


def test_tp2d_plan_prints_candidates_done_of_total_and_the_time_taken(tmp_path, monkeypatch, capsys):
    from lightning_tp2d.planning import planner

    monkeypatch.setenv("TP2D_PLAN_CACHE", str(tmp_path / "cache"))  # a fresh question: every candidate is priced
    monkeypatch.setattr(planner, "PROGRESS_EVERY_S", 0.0)  # a line per candidate (the command: every 5 s)
    args = ["llama-tiny", "--gpus", "4", "--gpu-memory-gib", "1", "--seq", "32", "--global-batch-tokens", "256",
            "--workers", "1", "--json", "", "--layouts", "2d", "metp", "--no-baselines"]
    assert planner.main(args) == 0
    err = capsys.readouterr().err.splitlines()
    first, progress = err[0], [line for line in err[1:] if line.startswith("tp2d-plan: ")]
    total = int(first.split("pricing ")[1].split()[0])
    assert first == (f"tp2d-plan: pricing {total} (layout, size) candidates of llama-tiny on 4 GPUs (1 at a time; a "
                     "progress line every 0 s)...")
    assert total == 3  # 2d p=4 (a 2x2 grid), metp p=2 and 4
    assert [line.split()[1] for line in progress] == [f"{k}/{total}" for k in range(1, total + 1)]
    assert all(line.endswith(" s") and " candidates priced, " in line for line in progress)


def test_plan_progress_counts_across_forked_planning_processes(tmp_path):
    import multiprocessing as mp

    from lightning_tp2d.planning import planner

    out, level = tmp_path / "progress.txt", planner.log.level
    with open(out, "a") as stream, planner.PlanProgress(total=4, every=0.0, stream=stream):
        def price_two() -> None:
            for _ in range(2):
                planner.log.info(planner.PRICED + " %.1f s (%d rows)", "2d", 4, 1, 0.0, 1)

        children = [mp.get_context("fork").Process(target=price_two) for _ in range(2)]
        for child in children:
            child.start()
        for child in children:
            child.join()
        planner.log.info("plan: something else")  # not a candidate's line
    counts = sorted(line.split()[1] for line in out.read_text().splitlines())
    assert counts == ["1/4", "2/4", "3/4", "4/4"]
    assert not [h for h in planner.log.handlers if isinstance(h, planner.PlanProgress)]
    assert planner.log.level == level


def test_the_fit_check_says_it_is_checking_before_it_refuses(tmp_path, monkeypatch, capsys):
    args = ["trainer=cpu", "trainer.devices=2", "model=llama-tiny", "parallel=metp", "data.max_tokens=20000",
            "data.block_size=32", "data.batch_size=2", "parallel.memory_gib=0.0001"]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    code, out, err = tp2d_train_main(args, cwd, monkeypatch, capsys)
    assert code == 2, out[-2000:] + err[-2000:]
    checking = "tp2d-train: checking the fit with the memory model (llama-tiny, metp p=2, seq 32)..."
    assert checking in out
    (line,) = err.strip().splitlines()
    assert line.startswith("tp2d-train: error: the memory model predicts a peak of ")


@pytest.mark.parametrize("overrides, message", [
    (["parallel.pipeline_parallel_size=3", "parallel.microbatches=4"], "parallel.pipeline_parallel_size=3 must divide"),
    (["parallel.pipeline_parallel_size=2", "parallel.pp_schedule=zb"], "parallel.pp_schedule='zb' is not one of"),
    (["parallel.pipeline_parallel_size=2", "parallel.microbatches=1"],
     "parallel.microbatches=1 < parallel.pipeline_parallel_size=2"),
    (["parallel.pipeline_parallel_size=2", "parallel.microbatches=3"],
     "data.batch_size=4 does not split into parallel.microbatches=3"),
    (["parallel.pipeline_parallel_size=4", "parallel.pp_schedule=interleaved_1f1b", "parallel.virtual_stages=2",
      "parallel.microbatches=4"], "model.n_layer=4 blocks cannot fill parallel.pipeline_parallel_size=4 x "
                                  "parallel.virtual_stages=2 = 8 stages"),
    (["parallel.pipeline_parallel_size=2", "parallel.virtual_stages=2"],
     "parallel.virtual_stages=2 needs parallel.pp_schedule='interleaved_1f1b'"),
])
def test_pipeline_sizes_that_do_not_fit_are_one_line_before_launch(overrides, message):
    """Issue 51, item 6: pipeline sizes that do not divide the devices or the blocks, a schedule that does not exist,
    too few micro-batches for 1F1B, a batch that does not split into them: one line naming the keys."""
    got = refusal("experiment=quick", "model.n_layer=4", "parallel=tp2d", "parallel.tensor_parallel_size=1",
                  "trainer.devices=4", "data.batch_size=4", *overrides)
    assert message in got, got


def test_pipeline_stages_are_named_in_the_plan_line():
    line = checked("experiment=quick", "model.n_layer=4", "parallel=metp", "parallel.tensor_parallel_size=2", "trainer.devices=4",
                   "data.batch_size=4", "parallel.pipeline_parallel_size=2", "parallel.microbatches=4",
                   "parallel.pp_schedule=gpipe")
    assert "2 pipeline stages (gpipe, 4 micro-batches) x 1 replica(s) x ring of 2 (p=2)" in line, line


def test_what_stages_do_not_run_with_yet_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    """The strategy's own refusal (compile with stages), through the console script: one line, exit 2, no ranks."""
    message = one_line_exit_2(["experiment=quick", "model.n_layer=4", "parallel=tp2d", "parallel.tensor_parallel_size=1",
                               "trainer.devices=2", "parallel.pipeline_parallel_size=2", "parallel.compile=true"],
                              tmp_path, monkeypatch, capsys)
    assert "pipeline_parallel_size=2 does not run with compile" in message, message
