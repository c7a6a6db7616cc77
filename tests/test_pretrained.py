"""Starting from pretrained weights and sampling: ``load_hf_weights`` fills a plain or parallelized GPT2 from a local
transformers directory (safetensors, sharded safetensors, ``pytorch_model.bin``) tensor by tensor, giving
transformers' logits; ``CausalLMModule(init_from=...)`` trains from them; ``tp2d-generate`` samples from our
checkpoints and from transformers directories."""

from __future__ import annotations

import json
import subprocess
import sys
import weakref
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
import transformers

import lightning_tp2d as tp
from lightning_tp2d import generate as gen
from lightning_tp2d.export import load_hf_weights
from lightning_tp2d.models import GPT2, GPT2Config
from lightning_tp2d.module import sample
from tests.distributed import run_distributed

SIZES = dict(n_layer=2, n_head=6, n_embd=48, vocab_size=257, n_positions=64)  # gpt2-tiny's
IDX = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(1))


def _hf_model() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(**SIZES, activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, bos_token_id=None, eos_token_id=None, attn_implementation="eager")
    return transformers.GPT2LMHeadModel(cfg).eval()


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """The transformers model and three directories holding it: ``model.safetensors``, sharded safetensors with an
    index, and ``pytorch_model.bin`` (with the tied ``lm_head.weight``, as old checkpoints have)."""
    model = _hf_model()
    root = tmp_path_factory.mktemp("hf")
    model.save_pretrained(root / "safetensors")
    model.save_pretrained(root / "sharded", max_shard_size="40KB")
    model.config.save_pretrained(root / "bin")
    torch.save(model.state_dict(), root / "bin" / "pytorch_model.bin")
    assert (root / "sharded" / "model.safetensors.index.json").is_file()
    return model, root


def _plain(config: GPT2Config | None = None) -> GPT2:
    with torch.device("meta"):
        model = GPT2(config or GPT2Config.from_name("gpt2-tiny"))
    model.to_empty(device="cpu")
    return model.eval()


@pytest.mark.parametrize("fmt", ["safetensors", "sharded", "bin"])
def test_plain_model_gives_transformers_logits(hf, fmt):
    model, root = hf
    ours = load_hf_weights(_plain(), root / fmt)
    with torch.no_grad():
        expected = model(IDX).logits
        torch.testing.assert_close(ours(IDX), expected, atol=1e-5, rtol=1e-5)
        # a shorter block_size takes the first rows of the position embedding
        short = load_hf_weights(_plain(GPT2Config.from_name("gpt2-tiny", block_size=32)), root / fmt)
        torch.testing.assert_close(short(IDX), expected, atol=1e-5, rtol=1e-5)
    assert ours.lm_head.weight is ours.transformer.wte.weight


def test_reads_one_tensor_at_a_time(hf, monkeypatch):
    import safetensors
    import safetensors.torch

    real_open = safetensors.safe_open
    reads, alive_at_read = [], []
    returned: list[weakref.ref] = []

    class Spy:
        def __init__(self, *args, **kwargs):
            self._f = real_open(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self._f, name)

        def get_tensor(self, key):
            alive_at_read.append(sum(r() is not None for r in returned))
            reads.append(key)
            t = self._f.get_tensor(key)
            returned.append(weakref.ref(t))
            return t

    def no_whole_file(*args, **kwargs):
        raise AssertionError("the whole state dict was loaded")

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    monkeypatch.setattr(safetensors.torch, "load_file", no_whole_file)
    model, root = hf
    load_hf_weights(_plain(), root / "sharded")
    assert sorted(reads) == sorted(k for k in model.state_dict() if k != "lm_head.weight")  # each once
    assert max(alive_at_read) == 0  # each full tensor was dropped before the next was read

    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: loads.append(kw) or real_load(*a, **kw))
    load_hf_weights(_plain(), root / "bin")
    assert loads == [dict(map_location="cpu", mmap=True, weights_only=True)]


def _parallel(rank, world_size, layout, directory):
    torch.manual_seed(5)
    with torch.device("meta"):
        gpt = GPT2(GPT2Config.from_name("gpt2-tiny"))
    tp.parallelize(gpt, tp.init_mesh(layout, world_size, 1), layout)  # materialised from the seed, then loaded
    load_hf_weights(gpt, directory)
    gpt.eval()
    with torch.no_grad():
        logits = gpt(IDX)
        loss = gpt(IDX, IDX.roll(-1, 1))
    return logits.tolist(), loss.item()


@pytest.mark.parametrize("layout, world_size", [("2d", 4), ("metp", 2)])
def test_parallelized_model_gives_the_plain_models_logits(hf, layout, world_size):
    model, root = hf
    plain = load_hf_weights(_plain(), root / "bin")
    with torch.no_grad():
        logits, loss = plain(IDX), plain(IDX, IDX.roll(-1, 1)).item()
    results = run_distributed(_parallel, world_size, layout, str(root / "safetensors"))
    for got_logits, got_loss in results:
        torch.testing.assert_close(torch.tensor(got_logits), logits, atol=1e-5, rtol=1e-5)
        assert got_loss == pytest.approx(loss, abs=1e-5)


def test_sizes_that_do_not_fit_are_named(hf, tmp_path):
    model, root = hf
    with pytest.raises(ValueError) as err:
        load_hf_weights(_plain(GPT2Config.from_name("gpt2-tiny", n_layer=3, block_size=128)), root / "safetensors")
    assert "n_layer: model 3, checkpoint 2" in str(err.value)
    assert "block_size: model 128 exceeds the checkpoint's n_positions 64" in str(err.value)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_weights(_plain(), tmp_path / "nowhere")

    sd = model.state_dict()
    del sd["transformer.h.1.ln_2.bias"]
    sd["transformer.h.0.attn.rotary"] = torch.zeros(3)
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1  # untied
    model.config.save_pretrained(tmp_path / "bad")
    torch.save(sd, tmp_path / "bad" / "pytorch_model.bin")
    with pytest.raises(ValueError) as err:
        load_hf_weights(_plain(), tmp_path / "bad")
    assert "missing keys: ['transformer.h.1.ln_2.bias']" in str(err.value)
    assert "unexpected keys: ['transformer.h.0.attn.rotary']" in str(err.value)
    del sd["transformer.h.0.attn.rotary"]
    sd["transformer.h.1.ln_2.bias"] = torch.zeros(48)
    torch.save(sd, tmp_path / "bad" / "pytorch_model.bin")
    with pytest.raises(ValueError, match="lm_head.weight differs from transformer.wte.weight"):
        load_hf_weights(_plain(), tmp_path / "bad")
    config = json.loads((root / "safetensors" / "config.json").read_text())
    (tmp_path / "variant").mkdir()
    (tmp_path / "variant" / "config.json").write_text(json.dumps({**config, "activation_function": "relu"}))
    with pytest.raises(ValueError, match="activation_function='relu'"):
        tp.CausalLMModule(model=None, init_from=str(tmp_path / "variant"))


class FirstBatch(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == 0:
            self.batch = [t.clone() for t in batch]
            self.loss = outputs["loss"].item()


@pytest.fixture(scope="module")
def fine_tuned(hf, tmp_path_factory):
    """One training step from the pretrained weights on one device, saved as a full checkpoint."""
    _, root = hf
    first = FirstBatch()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[first])
    module = tp.CausalLMModule(model=None, init_from=str(root / "safetensors"), warmup_steps=1, max_steps=1)
    trainer.fit(module, tp.TextDataModule(block_size=32, batch_size=2, max_tokens=400, val_fraction=0.2))
    path = tmp_path_factory.mktemp("ft") / "ft.ckpt"
    trainer.save_checkpoint(path)
    return first, module, path


def test_fine_tuning_starts_from_the_pretrained_weights(hf, fine_tuned):
    _, root = hf
    first, module, _ = fine_tuned
    assert module.hparams.model == GPT2Config.from_name("gpt2-tiny").__dict__  # sizes from config.json
    pretrained = load_hf_weights(_plain(), root / "safetensors")
    with torch.no_grad():
        assert first.loss == pytest.approx(pretrained(*first.batch).item(), abs=1e-6)


def test_generate_samples_from_a_checkpoint(fine_tuned, capsys):
    _, module, path = fine_tuned
    args = [str(path), "--prompt", "def f(", "--max-new-tokens", "12", "--top-k", "20", "--seed", "3"]
    done = subprocess.run([sys.executable, "-m", "lightning_tp2d.generate", *args], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    ids = sample(module.model, torch.tensor([list(b"def f(")]), 12, top_k=20, seed=3)
    expected = bytes(i for i in ids[0].tolist() if i < 256).decode("utf-8", errors="replace")
    assert done.stdout == expected + "\n"
    assert gen.main([str(path.parent / "missing.ckpt")]) == 2
    err = capsys.readouterr().err
    assert "tp2d-generate: error: checkpoint" in err and "missing.ckpt' does not exist" in err
    # a hand-made full checkpoint of a 100-token model: byte prompts may hold ids it cannot read
    small = GPT2(GPT2Config.from_name("gpt2-tiny", vocab_size=100))
    torch.save({"state_dict": {f"model.{k}": v for k, v in small.state_dict().items()},
                "hyper_parameters": {"model": vars(small.config)}}, path.parent / "small.ckpt")
    assert gen.main([str(path.parent / "small.ckpt"), "--prompt", "ab", "--max-new-tokens", "2"]) == 0
    assert gen.main([str(path.parent / "small.ckpt"), "--prompt", "é"]) == 2
    assert "the prompt holds token id 195" in capsys.readouterr().err


def test_generate_from_a_transformers_directory_samples_what_transformers_does(hf, capsys):
    model, root = hf
    prompt = "Hello"
    assert gen.main([str(root / "bin"), "--prompt", prompt, "--max-new-tokens", "8", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    ids = model.generate(torch.tensor([list(prompt.encode())]), max_new_tokens=8, do_sample=False,
                         pad_token_id=256)[0].tolist()
    assert out == bytes(i for i in ids if i < 256).decode("utf-8", errors="replace") + "\n"
    assert gen.main(["--hf", str(root / "safetensors"), "--prompt", "é" * 70]) == 2  # 140 byte tokens > 64
    assert "more than the model's block_size 64" in capsys.readouterr().err
