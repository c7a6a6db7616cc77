"""TextDataModule: sources, tokenizers, windows, data-parallel sharding, resumable position, and clear errors."""

from __future__ import annotations

import lightning.pytorch as L
import numpy as np
import pytest
import torch

import lightning_tp2d as tp
from lightning_tp2d.data import (ByteTokenizer, ResumableLoader, ResumableSampler, TokenWindows, default_corpus,
                                 get_tokenizer, load_tokens)


def test_byte_tokenizer_round_trips_any_text():
    tok = ByteTokenizer()
    text = "def f(x):\n    return x ** 2  # Grüße, 東京"
    ids = tok.encode(text)
    assert ids.dtype == np.uint16 and ids.max() < 256 and tok.vocab_size == 257 and tok.eot == 256
    assert tok.decode(list(ids) + [tok.eot]) == text


def test_gpt2_tokenizer_says_what_it_needs_when_unavailable():
    try:
        tok = get_tokenizer("gpt2")
    except RuntimeError as err:
        message = str(err)
        assert "tiktoken" in message and "tokenizer='byte'" in message and ".bin" in message
    else:  # tiktoken and its files are there: then it must work
        assert tok.decode(tok.encode("hello world")) == "hello world"
    with pytest.raises(ValueError, match="unknown tokenizer 'bpe'"):
        get_tokenizer("bpe")


def test_default_corpus_is_pythons_documentation_and_splits_into_windows():
    assert default_corpus().startswith("The \"assert\" statement")
    dm = tp.TextDataModule(block_size=16, batch_size=4, val_fraction=0.1)
    dm.setup("fit")
    n = len(dm.tokens)
    assert n > 300_000 and len(dm.train_set) == (n - int(n * 0.1) - 1) // 16
    x, y = dm.train_set[3]
    assert x.shape == y.shape == (16,) and x.dtype == torch.int64
    assert torch.equal(x[1:], y[:-1])  # targets are the inputs shifted by one
    assert torch.equal(torch.cat([x, y[-1:]]), torch.from_numpy(dm.tokens[48:65].astype(np.int64)))
    assert dm.max_token_id < 257


def test_folder_of_text_files_reads_in_order_joined_by_end_of_text(tmp_path):
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.md").write_text("first")
    (tmp_path / "skip.bin").write_bytes(b"\x00\x01")
    tokens = load_tokens(str(tmp_path), ByteTokenizer())
    assert ByteTokenizer().decode(tokens) == "firstsecond" and list(tokens).count(256) == 1


def test_token_file_is_memory_mapped(tmp_path):
    ids = np.arange(1000, dtype=np.uint16) % 250
    path = tmp_path / "train.bin"
    ids.tofile(path)
    dm = tp.TextDataModule(path=str(path), block_size=8, batch_size=2)
    dm.setup()
    assert isinstance(dm.tokens, np.memmap) and np.array_equal(dm.tokens, ids)
    assert dm.max_token_id == 249 and dm.vocab_size is None


def _bad_path(directory, case: str):
    """A data path with one problem, by name."""
    contents = {"empty.txt": "", "empty.bin": b"", "odd.bin": b"abc", "short.txt": "too short"}
    if case == "folder":
        (directory / "sub").mkdir()
        return directory / "sub"
    path = directory / case
    if case in contents:
        data = contents[case]
        path.write_bytes(data) if isinstance(data, bytes) else path.write_text(data)
    return path


@pytest.mark.parametrize("case, error, message", [
    ("missing.txt", FileNotFoundError, "does not exist"),
    ("empty.txt", ValueError, "is empty"),
    ("empty.bin", ValueError, "token file .* is empty"),
    ("odd.bin", ValueError, "not a whole number of uint16 ids"),
    ("folder", ValueError, "holds no text files"),
    ("short.txt", ValueError, "tokens are too few"),
])
def test_bad_data_fails_with_a_clear_message(tmp_path, case, error, message):
    dm = tp.TextDataModule(path=str(_bad_path(tmp_path, case)), block_size=8, batch_size=2)
    with pytest.raises(error, match=message):
        dm.setup("fit")


def test_token_ids_beyond_the_vocabulary_fail_before_training(tmp_path):
    ids = np.arange(2000, dtype=np.uint16) % 300  # ids up to 299, gpt2-tiny has 257
    ids.tofile(tmp_path / "tokens.bin")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    module = tp.GPT2LightningModule("gpt2-tiny")
    with pytest.raises(ValueError, match="token id 299 but the model's vocab_size is 257"):
        trainer.fit(module, tp.TextDataModule(path=str(tmp_path / "tokens.bin"), block_size=8, batch_size=2))
    assert trainer.global_step == 0


def _loader(rank: int, replicas: int, windows: TokenWindows) -> ResumableLoader:
    sampler = ResumableSampler(windows, num_replicas=replicas, rank=rank, shuffle=True, seed=0, drop_last=True)
    return ResumableLoader(windows, batch_size=3, sampler=sampler, drop_last=True)


def test_sampler_shards_over_replicas_and_the_loader_resumes_mid_epoch():
    windows = TokenWindows(np.arange(400, dtype=np.uint16), block_size=4)  # 99 windows
    firsts = [torch.cat([x[:, 0] for x, _ in _loader(r, 2, windows)]) for r in range(2)]
    assert not set(firsts[0].tolist()) & set(firsts[1].tolist())  # replicas see disjoint data
    assert len(firsts[0]) == len(firsts[1]) == 48  # 49 windows each (drop_last), whole batches of 3

    loader = _loader(0, 1, windows)
    loader.sampler.set_epoch(2)
    batches = iter(loader)
    seen = [next(batches)[0] for _ in range(5)]
    state = loader.state_dict()
    assert state == {"epoch": 2, "batches": 5}
    rest = [x for x, _ in batches]
    resumed = _loader(0, 1, windows)
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(2)  # Lightning sets the epoch before iterating
    again = [x for x, _ in resumed]
    assert len(again) == len(rest) == 33 - 5 and all(torch.equal(a, b) for a, b in zip(again, rest))
    assert resumed.state_dict() == {"epoch": 2, "batches": 33}
    assert len(list(resumed)) == 33  # the skip applies to the resumed epoch only
    assert seen[0].shape == (3, 4)
