"""Fine-tuning a local transformers directory in one line (issue 38): ``tp2d-train module.init_from=DIR`` alone takes
the family, sizes, RoPE theta and scaling, tied embeddings and vocabulary from ``DIR/config.json`` and the tokenizer
from ``DIR/tokenizer.json``; a ``model=`` given beside it must agree; ``CausalLMModule(init_from=DIR)`` and ``tp2d
fit --model.init_from=DIR`` need no model name either. The directories are made by transformers' ``save_pretrained``:
a GPT-2, a Llama 3.2-style one (GQA, ``rope_type: llama3``, tied embeddings, its own tokenizer.json) and a GQA Llama
of ``llama-tiny``'s sizes (untied). The recipe of docs/fine-tuning.md runs as written: its script makes a directory,
its first command fine-tunes it in this process (one CPU process) and exports it back to transformers with the
package's logits, its second trains the same directory on a ring of 2 with sequences 4 times its context."""

from __future__ import annotations

import csv
import json
import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import lightning_tp2d as tp
from lightning_tp2d import launch, train
from lightning_tp2d.export import read_hf_config
from lightning_tp2d.models import GPT2Config
from lightning_tp2d.models.llama import LlamaConfig
from lightning_tp2d.train import ConfigError, check_config, model_from_init

from .test_refuse_before_launch import one_line_exit_2, tp2d_train_main

launch.register_resolvers()

SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 16}


def _tokenizer_json(path: Path, eot: str) -> None:
    """A byte-level BPE of at most 300 ids, end-of-text ``eot``, trained on a few lines (milliseconds)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[eot],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def f(x):\n    return x + 1\n", "The quick brown fox jumps over the lazy dog."] * 20,
                            trainer)
    tok.save(str(path))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    """Three transformers directories (weights drawn by transformers from seed 0), keyed by kind."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    made = {
        "gpt2": transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_head=4, n_embd=32, vocab_size=300, n_positions=64, activation_function="gelu_new",
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
        "llama-3.2": transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rope_theta=500000.0, rope_scaling=dict(SCALING),
            tie_word_embeddings=True, rms_norm_eps=1e-5)),
        "gqa": transformers.LlamaForCausalLM(transformers.LlamaConfig(  # llama-tiny's sizes
            vocab_size=257, hidden_size=96, intermediate_size=264, num_hidden_layers=2, num_attention_heads=12,
            num_key_value_heads=6, max_position_embeddings=64, rope_theta=10000.0, tie_word_embeddings=False,
            rms_norm_eps=1e-5)),
    }
    for kind, model in made.items():
        model.save_pretrained(root / kind)
    _tokenizer_json(root / "gpt2" / "tokenizer.json", "<|endoftext|>")
    _tokenizer_json(root / "llama-3.2" / "tokenizer.json", "<|end_of_text|>")
    return {kind: root / kind for kind in made}


# (special-token ids as transformers writes them by default: GPT-2's 50256 is no id of a 300-token vocabulary and is
# left out; Llama's 1 and 2 are carried)
EXPECTED = {
    "gpt2": GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=300, block_size=64, dropout=0.0),
    "llama-3.2": LlamaConfig(vocab_size=300, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=128,
                             block_size=64, rope_theta=500000.0, tie_embeddings=True, rope_scaling=SCALING,
                             bos_token_id=1, eos_token_id=2),
    "gqa": LlamaConfig.from_name("llama-tiny", bos_token_id=1, eos_token_id=2),
}


def composed(*overrides: str):
    """The config as ``tp2d-train <overrides>`` composes it, with Hydra's record of the choices and overrides."""
    with initialize_config_dir(config_dir=str(launch.CONF_DIR), version_base="1.3", job_name="test"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)


RUN = ["trainer=cpu", "parallel=single", "trainer.devices=1", "data.max_tokens=20000", "data.block_size=32",
       "data.cache=false"]


@pytest.mark.parametrize("kind", ["gpt2", "llama-3.2", "gqa"])
def test_init_from_alone_is_the_directorys_model_and_tokenizer(dirs, kind):
    directory = dirs[kind]
    cfg = composed(*RUN, f"module.init_from={directory}")
    assert cfg.model._target_ == "lightning_tp2d.GPT2Config"  # the machine's default, before the directory is read
    assert model_from_init(cfg)
    model = instantiate(cfg.model)
    assert model == read_hf_config(directory) == EXPECTED[kind]
    assert instantiate(cfg.module).config == model  # module.model follows the model node
    assert cfg.data.block_size == 32
    following = composed(*RUN[:-2], f"module.init_from={directory}")
    assert model_from_init(following) and following.data.block_size == 64  # data.block_size follows the model's
    tokenizer = directory / "tokenizer.json"
    assert cfg.data.tokenizer == (str(tokenizer) if tokenizer.is_file() else "byte")
    assert check_config(cfg, model).startswith(f"plain {'GPT-2' if kind == 'gpt2' else 'Llama'} (2 layers, "
                                               f"{model.n_embd} wide) on one device")
    # a data.tokenizer given wins over the directory's
    assert composed(*RUN, f"module.init_from={directory}", "data.tokenizer=byte").data.tokenizer == "byte"


def test_model_overrides_apply_on_top_of_the_directorys_model(dirs):
    cfg = composed(*RUN, f"module.init_from={dirs['gpt2']}", "model.dropout=0.1", "model.block_size=48")
    assert model_from_init(cfg)
    model = instantiate(cfg.model)
    assert (model.n_embd, model.vocab_size, model.dropout, model.block_size) == (32, 300, 0.1, 48)
    assert check_config(cfg, model)  # a shorter block_size fits the position table
    cfg = composed(*RUN, f"module.init_from={dirs['gpt2']}", "model.n_layer=3")
    model_from_init(cfg)
    with pytest.raises(ConfigError, match=r"does not fit the model GPT-2 3x32: n_layer: model 3, checkpoint 2; leave"):
        check_config(cfg, instantiate(cfg.model))
    cfg = composed(*RUN, f"module.init_from={dirs['llama-3.2']}", "model.bias=false")
    with pytest.raises(ConfigError, match=r"^model.bias: the model of module.init_from=.* is a LlamaConfig, which has "
                                          r"no 'bias'; its fields: vocab_size, n_layer"):
        model_from_init(cfg)


def test_a_model_chosen_beside_init_from_stays_when_it_agrees(dirs):
    cfg = composed(*RUN, "model=llama-tiny", f"module.init_from={dirs['gqa']}")
    assert not model_from_init(cfg)  # chosen: kept, and held to the directory's sizes
    assert check_config(cfg, instantiate(cfg.model)).startswith("plain Llama (2 layers, 96 wide)")
    assert launch.prepare_argv(["tp2d-train", "model=null"], {})[1:] == ["module.model=null"]  # Hydra's null: ours


def test_model_null_takes_the_directorys_model(dirs):
    cfg = composed(*RUN, "module.model=null", "model=llama-tiny", f"module.init_from={dirs['llama-3.2']}")
    assert model_from_init(cfg) and instantiate(cfg.model) == EXPECTED["llama-3.2"]


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
def test_causal_lm_module_and_tp2d_fit_need_no_model_name(dirs):
    assert tp.CausalLMModule(init_from=str(dirs["llama-3.2"])).config == EXPECTED["llama-3.2"]
    assert tp.CausalLMModule().config == GPT2Config.from_name("gpt2-tiny")  # neither: the default size
    from lightning_tp2d.cli import TP2DCLI

    built = TP2DCLI(tp.CausalLMModule, tp.TextDataModule, run=False,  # `tp2d fit`'s parser, built and not run
                    args=["--model.init_from", str(dirs["gqa"]), "--data.block_size=32", "--trainer.accelerator=cpu",
                          "--trainer.devices=1", "--trainer.logger=false"])
    assert built.model.config == EXPECTED["gqa"] and built.model.init_from == str(dirs["gqa"])


def test_a_disagreeing_model_is_one_line_before_any_process_starts(dirs, tmp_path, monkeypatch, capsys):
    message = one_line_exit_2([*RUN, "model=gpt2-tiny", f"module.init_from={dirs['gpt2']}"], tmp_path, monkeypatch,
                              capsys)
    assert message.startswith(f"module.init_from: transformers checkpoint {str(dirs['gpt2'])!r} does not fit the "
                              "model gpt2-tiny: n_head: model 6, checkpoint 4; n_embd: model 48, checkpoint 32; "
                              "vocab_size: model 257, checkpoint 300; leave model= out")


def test_a_directory_without_tokenizer_json_is_a_warning_naming_the_fallback(dirs, caplog):
    """init_from's directory has no tokenizer.json (the "gqa" one): the text is tokenized with bytes, said as a
    WARNING (it was one INFO line about tokenising); not when the directory has one, nor when data.tokenizer is the
    user's own choice."""
    with caplog.at_level(logging.INFO, logger="tp2d-train"):
        train.warn_tokenizer_fallback(composed(*RUN, f"module.init_from={dirs['gqa']}"))
    (record,) = [r for r in caplog.records if r.name == "tp2d-train"]
    assert record.levelno == logging.WARNING and record.getMessage().startswith(
        f"module.init_from={dirs['gqa']} has no tokenizer.json: the text is tokenized with data.tokenizer=byte "
        "instead of the model's own tokenizer")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tp2d-train"):
        train.warn_tokenizer_fallback(composed(*RUN, f"module.init_from={dirs['gpt2']}"))
        train.warn_tokenizer_fallback(composed(*RUN, f"module.init_from={dirs['gqa']}", "data.tokenizer=byte"))
    assert [r for r in caplog.records if r.name == "tp2d-train"] == []


def _losses(run_dir: Path) -> list[float]:
    with open(run_dir / "logs" / "metrics.csv", newline="") as f:
        return [float(r["train_loss"]) for r in csv.DictReader(f) if r.get("train_loss")]


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


# ---- the recipe of docs/fine-tuning.md, as written ----------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "fine-tuning.md"


def recipe_blocks() -> tuple[str, list[list[str]]]:
    """The document's first ```python block (it writes ``tiny_llama/`` and ``corpus.txt``) and the arguments of each
    ``tp2d-train`` command of its first ```bash block."""
    text = DOC.read_text()
    python = text.split("```python\n", 1)[1].split("```", 1)[0]
    bash = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return python, [shlex.split(line)[1:] for line in bash.splitlines() if line.startswith("tp2d-train ")]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    """A folder holding what the document's script writes (run in this process)."""
    cwd = tmp_path_factory.mktemp("fine-tuning")
    python, _ = recipe_blocks()
    here = os.getcwd()
    os.chdir(cwd)
    try:
        exec(compile(python, str(DOC), "exec"), {"__name__": "__recipe__"})
    finally:
        os.chdir(here)
    return cwd


def test_the_recipe_fine_tunes_and_exports_as_written(recipe, monkeypatch, capsys):
    """The document's first command, verbatim, in this process (one CPU process): the directory's model and
    tokenizer, and an export that transformers loads with the scaling, the tied head and the package's logits."""
    (first, _), scaling = recipe_blocks()[1], read_hf_config(recipe / "tiny_llama").rope_scaling
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == 8.0
    code, out, err = tp2d_train_main(first, recipe, monkeypatch, capsys, launches=True)
    assert code == 0, out[-3000:] + err[-3000:]
    (run_dir,) = recipe.glob("outputs/*/*")
    losses = _losses(run_dir)
    assert len(losses) == 4 and losses[-1] < losses[0]  # logged every 5 of 20 steps
    exported = recipe / "tiny_llama_ft"
    assert sorted(p.name for p in exported.iterdir()) == ["config.json", "generation_config.json",
                                                          "model.safetensors", "tokenizer.json"]
    assert (exported / "tokenizer.json").read_bytes() == (recipe / "tiny_llama" / "tokenizer.json").read_bytes()
    hf_config = _json(exported / "config.json")
    assert hf_config["rope_scaling"] == scaling and hf_config["tie_word_embeddings"] is True
    ids = {k: _json(recipe / "tiny_llama" / "generation_config.json")[k] for k in ("bos_token_id", "eos_token_id")}
    assert {k: hf_config[k] for k in ids} == ids == _json(exported / "generation_config.json")  # the directory's
    ours = tp.load_llama(run_dir / "checkpoints" / "last.ckpt", read_hf_config(recipe / "tiny_llama")).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    idx = torch.randint(0, 512, (2, 80), generator=torch.Generator().manual_seed(0))  # past the 64 it was made for
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx), rtol=1e-4, atol=1e-4)
    # trained from the directory's weights: 20 AdamW steps of at most 1e-3 moved each weight by a few hundredths at
    # most (a fresh draw of the same init, std 0.02, would differ by over 0.1 somewhere)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(recipe / "tiny_llama").state_dict()
    moved = max((w - theirs[k]).abs().max().item() for k, w in hf.state_dict().items())
    assert 0 < moved < 0.05


def test_the_recipes_long_context_run_trains_on_a_ring_of_two(recipe):
    """The document's second command, verbatim (``parallel=metp`` on 2 CPU processes: Lightning starts the second
    by re-running the command, so it runs as ``python -m lightning_tp2d.train``): sequences 4 times the directory's
    context, exported with the directory's scaling."""
    _, second = recipe_blocks()[1]
    cwd = recipe / "long"
    cwd.mkdir()
    for name in ("tiny_llama", "corpus.txt"):
        (cwd / name).symlink_to(recipe / name)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                                            "MASTER_PORT", launch.RUN_DIR_ENV)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-m", "lightning_tp2d.train", *second], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "data.block_size=256" in second and _json(cwd / "tiny_llama" / "config.json")[
        "max_position_embeddings"] == 64
    (run_dir,) = cwd.glob("outputs/*/*")
    log = (run_dir / "train.log").read_text()
    assert "layout 'metp': 1 replica(s) x ring of 2 (p=2)" in log and "1 x 256 tokens per step" in log
    assert len(_losses(run_dir)) >= 1
    exported = _json(cwd / "tiny_llama_long" / "config.json")
    assert exported["rope_scaling"] == read_hf_config(cwd / "tiny_llama").rope_scaling
