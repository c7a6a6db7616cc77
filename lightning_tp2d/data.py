"""``TextDataModule``: next-token windows from text or token files, fed the tensor-parallel way.

Sources: a text file, a folder of text files (``*.txt``, ``*.md``, ``*.rst``, read in sorted order and joined with
the end-of-text token), a pre-tokenised token file (``*.bin``: raw little-endian ``uint16`` ids, nanoGPT's format,
memory-mapped), or by default the Python documentation that ships with every Python install
(``pydoc_data.topics``), so a run needs no download. Tokenizers: ``"byte"`` (UTF-8 bytes, 256 ids + end-of-text =
257, offline) and ``"gpt2"`` (tiktoken's BPE, 50257 ids; needs tiktoken and its files).

The token stream is split into train (first ``1 - val_fraction``) and validation (the rest); sample ``i`` is the
window ``tokens[iT : iT + T + 1]`` cut into inputs ``[:-1]`` and targets ``[1:]`` (``T = block_size``).

Batches: the sampler shards over *data-parallel* replicas only (``trainer.strategy.distributed_sampler_kwargs``:
under TP2DStrategy, the ``data_parallel`` axis), so every rank of a tensor-parallel group gets the same batch.
``batch_size`` is per replica. The train loader is resumable: its state (epoch, batches consumed) goes into
Lightning checkpoints, and a resumed run continues with the next unseen batch.
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

TEXT_SUFFIXES = (".txt", ".md", ".rst")
TOKEN_SUFFIX = ".bin"


# ---- tokenizers ------------------------------------------------------------------------------------------------


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, end-of-text 256: vocabulary 257 (``gpt2-tiny``'s), no files needed."""

    name, vocab_size, eot = "byte", 257, 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class GPT2Tokenizer:
    """GPT-2's BPE through tiktoken (50257 ids, end-of-text 50256)."""

    name, vocab_size, eot = "gpt2", 50257, 50256

    def __init__(self) -> None:
        hint = ("tokenizer 'gpt2' needs the tiktoken package and its GPT-2 BPE files, which tiktoken downloads on "
                "first use (from openaipublic.blob.core.windows.net) or reads from TIKTOKEN_CACHE_DIR; ")
        try:
            import tiktoken
        except ImportError as err:
            raise RuntimeError(hint + "tiktoken is not installed (pip install tiktoken). Offline, use "
                               "tokenizer='byte' or a pre-tokenised .bin token file.") from err
        try:
            self._enc = tiktoken.get_encoding("gpt2")
        except Exception as err:  # noqa: BLE001 - any network / cache failure
            raise RuntimeError(hint + f"they could not be loaded ({type(err).__name__}: {err}). Offline, use "
                               "tokenizer='byte' or a pre-tokenised .bin token file.") from err

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._enc.encode_ordinary(text), dtype=np.uint16)

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids])


def get_tokenizer(name: str):
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        return GPT2Tokenizer()
    raise ValueError(f"unknown tokenizer {name!r}; choose 'byte' or 'gpt2'")


# ---- sources ---------------------------------------------------------------------------------------------------


def default_corpus() -> str:
    """The Python documentation topics that ship with CPython (``pydoc_data.topics``): about half a megabyte of text."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def _text_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            raise ValueError(f"folder {str(path)!r} holds no text files ({', '.join(TEXT_SUFFIXES)})")
        return files
    return [path]


def _binary_reason(file: Path, head: int = 1 << 16) -> str | None:
    """Why ``file`` is not text (a NUL byte or invalid UTF-8 in its first 64 KiB), or ``None``."""
    with open(file, "rb") as f:
        data = f.read(head)
    if b"\0" in data:
        return f"a NUL byte at offset {data.index(bytes(1))}"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        if err.start < len(data) - 4:  # not just a character cut at the end of the sample
            return f"invalid UTF-8 at offset {err.start}"
    return None


def check_path(path: str | os.PathLike, vocab_size: int | None = None) -> None:
    """Check a data path before any process starts (``tp2d-train`` does, on the launching process): it exists; a
    ``.bin`` token file is non-empty, whole ``uint16`` ids and (with ``vocab_size``) holds only ids below it; text
    files are text (a binary given as ``data=text`` is refused by content, not trained on). Raises ``ValueError``
    (``FileNotFoundError``) naming the file and the numbers that do not fit."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"data path {str(p)!r} does not exist")
    if p.is_file() and p.suffix == TOKEN_SUFFIX:
        size = p.stat().st_size
        if size == 0:
            raise ValueError(f"token file {str(p)!r} is empty")
        if size % 2:
            raise ValueError(f"token file {str(p)!r} has {size} bytes, not a whole number of uint16 ids")
        if vocab_size is not None:
            top = int(np.memmap(p, dtype=np.uint16, mode="r").max())
            if top >= vocab_size:
                raise ValueError(f"token file {str(p)!r} holds id {top}, but the model's vocabulary has {vocab_size} "
                                 f"ids (0..{vocab_size - 1}): use a model with vocab_size > {top}, or the file made "
                                 "for this model")
        return
    for file in _text_files(p):
        reason = _binary_reason(file)
        if reason is not None:
            raise ValueError(f"{str(file)!r} is not a text file ({reason}): data=text reads UTF-8 text; for "
                             f"pre-tokenised ids use a {TOKEN_SUFFIX} file (data=tokens)")


def _read_text_files(path: Path) -> list[str]:
    files = _text_files(path)
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    if not any(texts):
        raise ValueError(f"{str(path)!r} is empty: no text to train on")
    return texts


def load_tokens(path: str | None, tokenizer, max_tokens: int | None = None) -> np.ndarray:
    """The whole token stream as a ``uint16`` array (a read-only memory map for ``.bin`` files)."""
    if path is None:
        tokens = tokenizer.encode(default_corpus())
    else:
        p = Path(path).expanduser()
        if not p.exists():
            raise FileNotFoundError(f"data path {str(p)!r} does not exist")
        if p.is_file() and p.suffix == TOKEN_SUFFIX:
            if p.stat().st_size == 0:
                raise ValueError(f"token file {str(p)!r} is empty")
            if p.stat().st_size % 2:
                raise ValueError(f"token file {str(p)!r} has {p.stat().st_size} bytes, not a whole number of uint16 ids")
            tokens = np.memmap(p, dtype=np.uint16, mode="r")
        else:
            parts = [tokenizer.encode(t) for t in _read_text_files(p)]
            eot = np.array([tokenizer.eot], dtype=np.uint16)
            tokens = np.concatenate([x for part in parts for x in (part, eot)][:-1])
    return tokens[:max_tokens] if max_tokens else tokens


# ---- datasets, sampler, loader ---------------------------------------------------------------------------------


class TokenWindows(Dataset):
    """Non-overlapping ``(inputs, targets)`` windows of ``block_size`` tokens, targets shifted by one."""

    def __init__(self, tokens: np.ndarray, block_size: int) -> None:
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.block_size)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.block_size
        chunk = torch.from_numpy(np.asarray(self.tokens[i * T: i * T + T + 1], dtype=np.int64))
        return chunk[:-1], chunk[1:]


class _EveryRank(torch.utils.data.Sampler):
    """Every index in order, on every rank (Lightning leaves a custom sampler alone: prompts are not split)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


class ResumableSampler(DistributedSampler):
    """A ``DistributedSampler`` (over data-parallel replicas) that can start its next epoch part-way."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.skip = 0  # indices to drop from the start of the next epoch

    def __iter__(self):
        indices = list(super().__iter__())
        skip, self.skip = self.skip, 0
        return iter(indices[skip:])


class ResumableLoader(DataLoader):
    """A DataLoader whose ``state_dict`` records the batches consumed in the current epoch (Lightning stores it in
    checkpoints and calls ``load_state_dict`` on resume). Lightning fetches sized loaders without prefetching,
    so batches yielded = batches trained on."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._epoch, self._consumed, self._resume = 0, 0, None

    def __iter__(self):
        self._epoch, self._consumed = self.sampler.epoch, 0
        if self._resume is not None:
            epoch, consumed = self._resume
            self._resume = None
            if epoch == self._epoch and consumed < len(self):
                self.sampler.skip, self._consumed = consumed * self.batch_size, consumed
        for batch in super().__iter__():
            self._consumed += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "batches": self._consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume = (int(state["epoch"]), int(state["batches"]))


# ---- the data module -------------------------------------------------------------------------------------------


class TextDataModule(L.LightningDataModule):
    """Next-token prediction data for GPT-2 (see the module docstring).

    Args:
        path: text file, folder of text files, or ``.bin`` uint16 token file; ``None``: Python's documentation.
        tokenizer: ``"byte"`` (offline, 257 ids) or ``"gpt2"`` (tiktoken, 50257 ids); unused for ``.bin`` files.
        block_size: tokens per sample (at most the model's ``block_size``).
        batch_size: samples per batch and data-parallel replica; "2d" needs a multiple of the grid side ``q``.
        val_fraction: share of the token stream held out for validation (its tail).
        shuffle: shuffle training windows each epoch (seeded: the same order on every rank).
        seed: shuffling seed.
        max_tokens: use only the first ``max_tokens`` tokens (quick runs).
        num_workers: DataLoader worker processes.
        prompts: texts for ``trainer.predict``: each is one batch of one sequence, given to every rank (a
            tensor-parallel group must see the same prompt); the module continues them (``predict_step``).
    """

    def __init__(self, path: str | None = None, tokenizer: str = "byte", block_size: int = 64, batch_size: int = 8,
                 val_fraction: float = 0.05, shuffle: bool = True, seed: int = 0, max_tokens: int | None = None,
                 num_workers: int = 0, prompts: list[str] | None = None) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        for name, value in (("block_size", block_size), ("batch_size", batch_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.save_hyperparameters()
        self.path, self.block_size, self.batch_size = path, block_size, batch_size
        self.val_fraction, self.shuffle, self.seed, self.max_tokens = val_fraction, shuffle, seed, max_tokens
        self.num_workers = num_workers
        self.prompts = list(prompts or [])
        self.tokenizer_name = tokenizer
        self.tokenizer = None if path is not None and str(path).endswith(TOKEN_SUFFIX) else get_tokenizer(tokenizer)
        self.tokens: np.ndarray | None = None
        self._max_token_id: int | None = None

    @property
    def vocab_size(self) -> int | None:
        """The tokenizer's vocabulary (``None`` for token files, which carry no tokenizer)."""
        return self.tokenizer.vocab_size if self.tokenizer is not None else None

    @property
    def max_token_id(self) -> int:
        """Largest id in the data (scanned once); the model's ``vocab_size`` must exceed it."""
        if self._max_token_id is None:
            self.setup()
            self._max_token_id = int(np.max(self.tokens))
        return self._max_token_id

    def setup(self, stage: str | None = None) -> None:
        if self.tokens is not None:
            return
        tokens = load_tokens(self.path, self.tokenizer or ByteTokenizer(), self.max_tokens)
        n_val = int(len(tokens) * self.val_fraction)
        need = self.block_size + 1
        if len(tokens) - n_val < need or n_val < need:
            raise ValueError(f"{len(tokens)} tokens are too few: train {len(tokens) - n_val} and validation {n_val} "
                             f"tokens must each hold at least one window of block_size+1 = {need}")
        self.tokens = tokens
        self.train_set = TokenWindows(tokens[: len(tokens) - n_val], self.block_size)
        self.val_set = TokenWindows(tokens[len(tokens) - n_val:], self.block_size)

    def _replicas(self) -> dict[str, int]:
        strategy = self.trainer.strategy if self.trainer is not None else None
        kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {}
        return {"num_replicas": kwargs.get("num_replicas", 1), "rank": kwargs.get("rank", 0)}

    def _loader(self, dataset: TokenWindows, train: bool) -> DataLoader:
        replicas = self._replicas()
        per_replica = len(dataset) // replicas["num_replicas"]
        if per_replica < self.batch_size:
            split = "train" if train else "validation"
            raise ValueError(f"the {split} split has {len(dataset)} windows of {self.block_size} tokens: "
                             f"{per_replica} per data-parallel replica, fewer than batch_size={self.batch_size}")
        sampler = ResumableSampler(dataset, shuffle=self.shuffle and train, seed=self.seed, drop_last=True,
                                   **replicas)
        cls = ResumableLoader if train else DataLoader
        # drop_last: every batch is full, so it divides by the grid side like batch_size does
        return cls(dataset, batch_size=self.batch_size, sampler=sampler, drop_last=True, num_workers=self.num_workers)

    def train_dataloader(self) -> DataLoader:
        self.setup()
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        self.setup()
        return self._loader(self.val_set, train=False)

    def test_dataloader(self) -> DataLoader:
        """The held-out split (the validation windows: the corpus has no separate test split)."""
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        """Each prompt as a ``[1, T]`` batch of token ids, on every rank."""
        if not self.prompts:
            raise ValueError("TextDataModule(prompts=[...]) is needed for trainer.predict: the texts to continue")
        tokenizer = self.tokenizer or ByteTokenizer()
        encoded = [torch.as_tensor(tokenizer.encode(p).astype(np.int64)) for p in self.prompts]
        empty = [i for i, t in enumerate(encoded) if t.numel() == 0]
        if empty:
            raise ValueError(f"prompts {empty} encode to no tokens")
        return DataLoader(encoded, batch_size=1, sampler=_EveryRank(len(encoded)), collate_fn=torch.stack)

    def decode(self, ids) -> str:
        return (self.tokenizer or ByteTokenizer()).decode(ids)
