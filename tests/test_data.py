"""TextDataModule: sources, tokenizers, windows, data-parallel sharding, resumable position, and clear errors."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as L
import numpy as np
import pytest
import torch

import lightning_tp2d as tp
from lightning_tp2d.data import (ByteTokenizer, ResumableLoader, ResumableSampler, TokenWindows, check_path,
                                 default_corpus, get_tokenizer, load_tokens, tokenizer_vocab_size)
from lightning_tp2d.data.token_files import _pieces


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
        assert 'pip install "lightning_tp2d[gpt2]"' in message or "could not be loaded" in message
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
    module = tp.CausalLMModule("gpt2-tiny")
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


# ---- validation files, token-file dtypes --------------------------------------------------------------------------


def test_nanogpt_train_and_val_bin_are_read_as_they_are(tmp_path):
    train = np.arange(1000, dtype=np.uint16) % 250  # raw little-endian uint16, as nanoGPT's prepare.py writes
    val = np.arange(300, dtype=np.uint16) % 7 + 50_000
    train.tofile(tmp_path / "train.bin")
    val.tofile(tmp_path / "val.bin")
    dm = tp.TextDataModule(path=str(tmp_path / "train.bin"), val_path=str(tmp_path / "val.bin"), block_size=8,
                           batch_size=2, val_fraction=0.0, shuffle=False)  # val_fraction is not used with val_path
    dm.setup()
    assert isinstance(dm.val_set.tokens, np.memmap) and np.array_equal(dm.val_set.tokens, val)
    assert np.array_equal(dm.train_set.tokens, train) and len(dm.train_set) == 999 // 8  # all of path trains
    assert dm.max_token_id == 50_006 and dm.tokenizer is None
    x, y = next(iter(dm.val_dataloader()))
    assert x[0].tolist() == val[:8].tolist() and y[0].tolist() == val[1:9].tolist()


def test_val_path_of_text_is_the_validation_data(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("the training text, " * 20)
    (tmp_path / "val.txt").write_text("held-out text " * 10)
    dm = tp.TextDataModule(path=str(tmp_path / "corpus"), val_path=str(tmp_path / "val.txt"), block_size=8,
                           batch_size=2)
    dm.prepare_data()
    dm.setup()
    byte = ByteTokenizer()
    assert byte.decode(dm.tokens) == "the training text, " * 20 and byte.decode(dm.val_tokens) == "held-out text " * 10
    (tmp_path / "short.txt").write_text("tiny")
    short = tp.TextDataModule(path=str(tmp_path / "corpus"), val_path=str(tmp_path / "short.txt"), block_size=8,
                              batch_size=2)
    with pytest.raises(ValueError, match=r"val_path '.*short.txt': 4 tokens are too few for one window of "
                                         r"block_size\+1 = 9"):
        short.setup()


def test_uint32_and_npy_token_files_round_trip(tmp_path):
    ids = np.array([0, 65_535, 65_536, 99_999, 70_000, 12] * 100, dtype=np.uint32)  # ids beyond uint16
    ids.tofile(tmp_path / "big.bin")
    np.save(tmp_path / "big.npy", ids)
    for name, dtype in (("big.bin", "uint32"), ("big.npy", "uint16")):  # a .npy header carries its own dtype
        path = tmp_path / name
        check_path(path, vocab_size=100_000, dtype=dtype)
        with pytest.raises(ValueError, match="holds id 99999, but the model's vocabulary has 70000 ids"):
            check_path(path, vocab_size=70_000, dtype=dtype)
        dm = tp.TextDataModule(path=str(path), dtype=dtype, block_size=5, batch_size=2)
        dm.setup()
        assert isinstance(dm.tokens, np.memmap) and dm.tokens.dtype == np.uint32 and np.array_equal(dm.tokens, ids)
        assert dm.max_token_id == 99_999 and dm.train_set[0][0].tolist() == [0, 65_535, 65_536, 99_999, 70_000]


def test_token_files_read_with_the_wrong_dtype_are_named(tmp_path):
    np.array([3, 70_000, 400, 9] * 200, dtype=np.uint32).tofile(tmp_path / "u32.bin")
    with pytest.raises(ValueError, match=r"looks like uint32 ids .* set dtype='uint32'"):
        check_path(tmp_path / "u32.bin", vocab_size=100_000)  # uint16, the default
    with pytest.warns(UserWarning, match="looks like uint32 ids"):
        load_tokens(str(tmp_path / "u32.bin"), ByteTokenizer())
    (np.arange(1000, dtype=np.uint16) % 250).tofile(tmp_path / "u16.bin")  # nanoGPT's, read as uint32
    with pytest.raises(ValueError, match=r"if the file holds uint16 ids as nanoGPT writes them, dtype='uint16'"):
        check_path(tmp_path / "u16.bin", vocab_size=50_257, dtype="uint32")


@pytest.mark.parametrize("name, data, dtype, message", [
    ("six.bin", b"\x01" * 6, "uint32", r"has 6 bytes, not a whole number of uint32 ids \(4 bytes each\)"),
    ("ok.bin", b"\x01" * 8, "int8", "dtype must be one of uint16, uint32"),
    ("matrix.npy", np.zeros((2, 3), np.float32), "uint16", r"holds a float32 array of shape \(2, 3\)"),
    ("signed.npy", np.array([5, -3, 7], np.int32), "uint16", "holds the negative id -3"),
    ("empty.npy", np.zeros(0, np.uint16), "uint16", "is empty"),
])
def test_token_file_checks_name_the_dtype_and_the_numbers(tmp_path, name, data, dtype, message):
    path = tmp_path / name
    np.save(path, data) if isinstance(data, np.ndarray) else path.write_bytes(data)
    with pytest.raises(ValueError, match=message):
        check_path(path, vocab_size=257, dtype=dtype)


# ---- the token cache --------------------------------------------------------------------------------------------


@pytest.fixture
def encodes(monkeypatch) -> list[int]:
    """Lengths of the texts ByteTokenizer.encode is given (how often text is tokenised)."""
    calls: list[int] = []
    encode = ByteTokenizer.encode
    monkeypatch.setattr(ByteTokenizer, "encode", lambda self, text: calls.append(len(text)) or encode(self, text))
    return calls


def test_prepare_data_tokenises_once_and_setup_memory_maps_the_cache(tmp_path, encodes):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world\n" * 50)
    dm = tp.TextDataModule(path=str(corpus), block_size=8, batch_size=2)
    dm.prepare_data()
    [cache] = (tmp_path / ".tp2d_cache").glob("*.bin")
    assert cache.name.startswith("corpus.txt.byte.") and cache.name.endswith(".uint16.bin") and len(encodes) == 1
    written = cache.stat().st_mtime_ns
    dm.prepare_data()  # up to date: not tokenised again, not rewritten
    again = tp.TextDataModule(path=str(corpus), block_size=8, batch_size=2)  # another rank: setup only
    again.setup()
    assert len(encodes) == 1 and cache.stat().st_mtime_ns == written
    assert isinstance(again.tokens, np.memmap) and Path(again.tokens.filename) == cache
    assert ByteTokenizer().decode(again.tokens) == corpus.read_text()

    corpus.write_text("hello there\n" * 60)  # a changed corpus is tokenised afresh; its stale cache goes
    fresh = tp.TextDataModule(path=str(corpus), block_size=8, batch_size=2)
    fresh.setup()  # setup alone (no prepare_data) builds the cache too
    [new] = (tmp_path / ".tp2d_cache").glob("*.bin")
    assert new != cache and len(encodes) == 2 and ByteTokenizer().decode(fresh.tokens) == "hello there\n" * 60
    assert not list((tmp_path / ".tp2d_cache").glob("*.tmp"))


def test_unwritable_folders_fall_back_to_the_user_cache_then_to_memory(tmp_path, monkeypatch, encodes):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    (tmp_path / ".tp2d_cache").write_text("a file where the cache folder would go")  # mkdir fails (root ignores chmod)
    (tmp_path / "a.txt").write_text("some text to cache " * 10)
    dm = tp.TextDataModule(path=str(tmp_path / "a.txt"), block_size=8, batch_size=2)
    dm.prepare_data()
    dm.setup()
    assert Path(dm.tokens.filename).parent == tmp_path / "xdg" / "lightning_tp2d" and len(encodes) == 1
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / ".tp2d_cache"))  # not writable either
    (tmp_path / "b.txt").write_text("other text " * 30)
    nowhere = tp.TextDataModule(path=str(tmp_path / "b.txt"), block_size=8, batch_size=2)
    with pytest.warns(UserWarning, match="no writable cache folder for .*b.txt.*: its tokens stay in memory"):
        nowhere.setup()
    assert not isinstance(nowhere.tokens, np.memmap) and ByteTokenizer().decode(nowhere.tokens) == "other text " * 30


def test_cache_off_or_in_a_chosen_folder(tmp_path):
    (tmp_path / "a.txt").write_text("some text to cache " * 10)
    off = tp.TextDataModule(path=str(tmp_path / "a.txt"), block_size=8, batch_size=2, cache=False)
    off.prepare_data()
    off.setup()
    assert not isinstance(off.tokens, np.memmap) and not (tmp_path / ".tp2d_cache").exists()
    chosen = tp.TextDataModule(path=str(tmp_path / "a.txt"), block_size=8, batch_size=2, cache=str(tmp_path / "c"))
    chosen.setup()
    assert Path(chosen.tokens.filename).parent == tmp_path / "c" and np.array_equal(chosen.tokens, off.tokens)


def test_long_text_is_tokenised_in_pieces_cut_where_tokens_split_anyway(tmp_path):
    file = tmp_path / "long.txt"
    text = "".join(f"line {i}: some words\n  indented {i}\n\n" for i in range(40)) + "x" * 300 + " tail"
    file.write_text(text)
    pieces = list(_pieces(file, chunk=16))
    assert "".join(pieces) == text and len(pieces) > 40
    at = 0
    for piece in pieces[:-1]:
        at += len(piece)
        if len(piece) < 64:  # a place to cut was found: after a newline or before a space, between non-spaces
            after_newline = text[at - 1] == "\n" and not text[at - 2].isspace() and not text[at].isspace()
            before_space = text[at] == " " and not text[at - 1].isspace() and not text[at + 1].isspace()
            assert after_newline or before_space, (text[at - 2: at], text[at: at + 2])
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(_tokenizer_json(tmp_path / "tok.json")))  # GPT-2's split, byte-level BPE
    assert [i for p in pieces for i in tok.encode(p).ids] == tok.encode(text).ids


# ---- tokenizer.json ---------------------------------------------------------------------------------------------


def _tokenizer_json(path: Path, special=("<|endoftext|>",)) -> Path:
    """A small byte-level BPE (GPT-2's pre-tokenizer) trained here on a few strings: no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(special), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the quick brown fox", "jumps over the lazy dog\n"] * 4, trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def test_tokenizer_json_round_trips_and_caches_its_ids(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    file = _tokenizer_json(tmp_path / "tok" / "tokenizer.json")
    size = tokenizers.Tokenizer.from_file(str(file)).get_vocab_size()
    for name in (str(file), str(file.parent)):  # the file, or the folder that holds it
        tok = get_tokenizer(name)
        text = "the lazy fox\nGrüße, 東京"
        ids = tok.encode(text)
        assert ids.dtype == np.uint16 and tok.decode(ids) == text
        assert tok.eot == 0 and tok.vocab_size == size == tokenizer_vocab_size(name)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("hello world, the quick brown fox " * 5)
    (tmp_path / "corpus" / "b.txt").write_text("jumps over the lazy dog " * 5)
    dm = tp.TextDataModule(path=str(tmp_path / "corpus"), tokenizer=str(file), block_size=4, batch_size=1,
                           val_fraction=0.25)
    dm.prepare_data()
    dm.setup()
    assert ".hf." in Path(dm.tokens.filename).name and dm.vocab_size == size
    joined = "hello world, the quick brown fox " * 5 + "<|endoftext|>" + "jumps over the lazy dog " * 5
    assert dm.decode(dm.tokens) == joined  # the files joined by the end-of-text token


def test_tokenizer_json_beyond_65536_ids_caches_uint32(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"</s>": 0, **{f"w{i}": i for i in range(1, 70_000)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="</s>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "big.json"))
    (tmp_path / "a.txt").write_text("w69999 w1 w65536 w70 " * 10)
    dm = tp.TextDataModule(path=str(tmp_path / "a.txt"), tokenizer=str(tmp_path / "big.json"), block_size=4,
                           batch_size=1, val_fraction=0.25)
    dm.setup()
    assert dm.tokens.dtype == np.uint32 and Path(dm.tokens.filename).name.endswith(".uint32.bin")
    assert dm.tokens[:4].tolist() == [69_999, 1, 65_536, 70] and dm.tokenizer.eot == 0
    assert tokenizer_vocab_size(str(tmp_path / "big.json")) == 70_000


def test_tokenizer_json_errors_name_the_path(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    with pytest.raises(FileNotFoundError, match=r"tokenizer file '.*missing.json' does not exist"):
        get_tokenizer(str(tmp_path / "missing.json"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"the folder '.*empty' holds no tokenizer.json"):
        get_tokenizer(str(tmp_path / "empty"))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match=r"'.*bad.json' is not a tokenizer.json the tokenizers package can read"):
        get_tokenizer(str(tmp_path / "bad.json"))
    _tokenizer_json(tmp_path / "no_eot.json", special=())
    with pytest.raises(ValueError, match=r"no_eot.json' has no end-of-text token \(none of <\|endoftext\|>, </s>"):
        get_tokenizer(str(tmp_path / "no_eot.json"))
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if not installed
    with pytest.raises(RuntimeError, match=r'no_eot.json\' is a Hugging Face tokenizer.json, .*not installed: '
                                           r'pip install "lightning_tp2d\[hf-tokenizer\]"'):
        get_tokenizer(str(tmp_path / "no_eot.json"))


# ---- tp2d-train's checks before any process starts ------------------------------------------------------------


def _check_config(*overrides: str) -> str:
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from lightning_tp2d import launch
    from lightning_tp2d.train import check_config

    launch.register_resolvers()
    with initialize_config_dir(config_dir=str(launch.CONF_DIR), version_base="1.3", job_name="test"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return check_config(cfg, instantiate(cfg.model))


def test_check_config_reads_val_path_dtype_and_tokenizer_json(tmp_path):
    from lightning_tp2d.train import ConfigError

    (np.arange(2000, dtype=np.uint16) % 250).tofile(tmp_path / "train.bin")  # gpt2-mini: one batch is 1025 tokens
    np.array([1, 2, 300, 4] * 100, dtype=np.uint32).tofile(tmp_path / "val.bin")
    tokens = ["data=tokens", f"data.path={tmp_path / 'train.bin'}"]
    assert _check_config(*tokens, f"data.val_path={tmp_path / 'train.bin'}").startswith("layout")
    with pytest.raises(ConfigError, match=r"data.val_path='.*nowhere.bin' does not exist"):
        _check_config(*tokens, f"data.val_path={tmp_path / 'nowhere.bin'}")
    (np.arange(1000, dtype=np.uint32) % 250).tofile(tmp_path / "train32.bin")  # data.dtype is both files' dtype
    with pytest.raises(ConfigError, match=r"data.val_path: token file '.*val.bin' holds id 300, but the model's "
                                          "vocabulary has 257 ids"):
        _check_config("data=tokens", f"data.path={tmp_path / 'train32.bin'}", f"data.val_path={tmp_path / 'val.bin'}",
                      "data.dtype=uint32")
    (tmp_path / "a.txt").write_text("some text")
    text = ["data=text", f"data.path={tmp_path / 'a.txt'}"]
    with pytest.raises(ConfigError, match="data.tokenizer: unknown tokenizer 'bpe'"):
        _check_config(*text, "data.tokenizer=bpe")
    pytest.importorskip("tokenizers")
    _tokenizer_json(tmp_path / "tok.json")
    size = tokenizer_vocab_size(str(tmp_path / "tok.json"))
    with pytest.raises(ConfigError, match=rf"makes {size} token ids but model.vocab_size=257"):
        _check_config(*text, f"data.tokenizer={tmp_path / 'tok.json'}")
