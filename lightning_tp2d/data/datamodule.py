"""``TextDataModule`` (see :mod:`lightning_tp2d.data`) and what feeds it: the next-token windows of a token stream,
a data-parallel sampler that can start part-way, a loader whose position goes into Lightning checkpoints, and the
tokens each split needs (one rule for :meth:`TextDataModule.setup`, its loaders and :meth:`TextDataModule.check_size`,
which ``tp2d-train`` calls before any process starts)."""

from __future__ import annotations

import os

import lightning.pytorch as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_tp2d.data.token_files import (build_cache, check_format, count_tokens, is_token_file, load_tokens,
                                             raw_dtype, text_suffixes)
from lightning_tp2d.data.tokenizers import ByteTokenizer, get_tokenizer
from lightning_tp2d.models.documents import Documents
from lightning_tp2d.token_need import split_need, split_needs, split_tokens, stream_need  # the rule, stated once
from lightning_tp2d.values import check_number


# ---- datasets, sampler, loader ---------------------------------------------------------------------------------


class TokenWindows(Dataset):
    """Non-overlapping ``(inputs, targets)`` windows of ``block_size`` tokens, targets shifted by one. With
    ``eos_id`` (packed documents) a third item: the inputs' document ids, the number of end-of-text tokens before
    each input token in the window (:meth:`~lightning_tp2d.models.documents.Documents.from_eos`)."""

    def __init__(self, tokens: np.ndarray, block_size: int, eos_id: int | None = None) -> None:
        self.tokens, self.block_size, self.eos_id = tokens, block_size, eos_id

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.block_size)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        T = self.block_size
        chunk = torch.from_numpy(np.asarray(self.tokens[i * T: i * T + T + 1], dtype=np.int64))
        if self.eos_id is None:
            return chunk[:-1], chunk[1:]
        return chunk[:-1], chunk[1:], Documents.from_eos(chunk[None, :-1], self.eos_id).ids[0]


def collate_documents(samples: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, torch.Tensor, Documents]:
    """``(idx [B, T], targets [B, T], Documents)`` from packed samples: the ids stacked and each row's document
    starts computed here, on the CPU (in the loader's worker), so the ring layouts decide which attention blocks to
    skip without a host sync in the step; Lightning moves the ``Documents`` with the batch (its ``to``)."""
    idx, targets, ids = (torch.stack(parts) for parts in zip(*samples))
    documents = Documents(ids)
    documents.starts  # noqa: B018 - computed now, on the host
    return idx, targets, documents


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


# ---- the tokens a split needs (the rule: lightning_tp2d.token_need; here, how a shortfall is told) -------------


def stream_problem(where: str, n: int, val_fraction: float, train: tuple[int, str], val: tuple[int, str],
                   key: str = "", found: str | None = None) -> str | None:
    """Why ``n`` tokens split by ``val_fraction`` leave too few for the train or validation split (``train`` / ``val``:
    :func:`split_need` of each), or ``None``. ``found``: how to name the ``n`` tokens (default ``"<n> tokens"``)."""
    n_train, n_val = split_tokens(n, val_fraction)
    if n_train >= train[0] and n_val >= val[0]:
        return None
    t = f"its train split ({n_train} tokens)"
    v = f"its validation split (the last {key}val_fraction={val_fraction}, {n_val} tokens)"
    hold = f"{t} and {v} must each hold {train[1]}" if train[1] == val[1] else \
        f"{t} must hold {train[1]} and {v} {val[1]}"
    return (f"{where}: {found or f'{n} tokens'} are too few: {hold}; it needs at least "
            f"{stream_need(train[0], val[0], val_fraction)} tokens (or a separate {key}val_path)")


def source_problem(where: str, n: int, need: tuple[int, str], split: str, found: str | None = None) -> str | None:
    """Why ``n`` tokens are too few for the ``split`` split (``need``: :func:`split_need`), or ``None``."""
    if n >= need[0]:
        return None
    return f"{where}: {found or f'{n} tokens'} are too few for {need[1]} (the {split} split)"


# ---- the data module -------------------------------------------------------------------------------------------


class TextDataModule(L.LightningDataModule):
    """Next-token prediction data for GPT-2 (see :mod:`lightning_tp2d.data`).

    Args:
        path: text file, folder of text files, or token file (``.bin`` raw ids of ``dtype``, ``.npy``); ``None``:
            Python's documentation.
        tokenizer: ``"byte"`` (offline, 257 ids), ``"gpt2"`` (tiktoken, 50257 ids) or the path of a Hugging Face
            ``tokenizer.json`` (or a folder holding one; needs ``tokenizers``); unused when every source is a token
            file.
        block_size: tokens per sample (at most the model's ``block_size``).
        batch_size: samples per batch and data-parallel replica; "2d" needs a multiple of the grid side ``q``.
        val_fraction: share of the token stream held out for validation (its tail); not used with ``val_path``.
        shuffle: shuffle training windows each epoch (seeded: the same order on every rank).
        seed: shuffling seed.
        max_tokens: use only the first ``max_tokens`` tokens (quick runs), of each source when ``val_path`` is set.
        num_workers: DataLoader worker processes.
        prompts: texts for ``trainer.predict``: each is one batch of one sequence, shared out over the data-parallel
            replicas (every rank of a tensor-parallel group gets the same ones); the module continues them
            (``predict_step``).
        val_path: the validation data, a source like ``path`` (e.g. nanoGPT's ``val.bin`` beside ``train.bin``);
            then all of ``path`` is trained on and ``val_fraction`` is ignored. ``None``: the tail of ``path``.
        dtype: the ids of raw ``.bin`` token files: ``"uint16"`` (nanoGPT's format) or ``"uint32"`` (vocabularies
            over 65536 ids); a ``.npy`` file carries its own, and text caches take the tokenizer's.
        cache: tokenise text once into a cache token file (see :mod:`lightning_tp2d.data`): ``True`` (``.tp2d_cache/``
            next to the corpus, or the user cache dir), a folder to keep it in, or ``False`` (in memory, every rank).
        format: ``"auto"`` (token files by their ``.bin`` / ``.npy`` suffix, the rest text), ``"text"`` (every source
            is text, a ``.bin`` too) or ``"tokens"`` (every source is token ids).
        suffixes: more suffixes of the files a text folder contributes (``[".py"]``), besides ``.txt``, ``.md`` and
            ``.rst``.
        pack_documents: batches are ``(idx, targets, Documents)``: each window's document ids from its end-of-text
            tokens (:class:`~lightning_tp2d.models.documents.Documents`), so attention stays inside each document
            (the module passes them to the model as ``doc_ids``). Windows still cut the stream every
            ``block_size`` tokens: a document may begin in one window and continue in the next.
        eos_id: the end-of-text id that separates documents (default: the tokenizer's; needed when every source is
            a token file, which carries no tokenizer).
    """

    def __init__(self, path: str | None = None, tokenizer: str = "byte", block_size: int = 64, batch_size: int = 8,
                 val_fraction: float = 0.05, shuffle: bool = True, seed: int = 0, max_tokens: int | None = None,
                 num_workers: int = 0, prompts: list[str] | None = None, val_path: str | None = None,
                 dtype: str = "uint16", cache: bool | str = True, format: str = "auto",
                 suffixes: list[str] | None = None, pack_documents: bool = False, eos_id: int | None = None) -> None:
        super().__init__()
        if val_path is None and not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        for name, value in (("block_size", block_size), ("batch_size", batch_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        check_number("max_tokens", max_tokens, low=1, integer=True, optional=True,
                     meaning="tokens to read from the start of the source; null: all")
        check_number("num_workers", num_workers, low=0, integer=True, meaning="DataLoader worker processes")
        check_number("seed", seed, integer=True, meaning="the shuffling seed")
        raw_dtype(dtype)
        check_format(format)
        if not isinstance(cache, (bool, str, os.PathLike)):
            raise TypeError(f"cache must be True, False or a folder, got {cache!r}")
        self.save_hyperparameters()
        self.path, self.val_path, self.block_size, self.batch_size = path, val_path, block_size, batch_size
        self.val_fraction, self.shuffle, self.seed, self.max_tokens = val_fraction, shuffle, seed, max_tokens
        self.num_workers, self.dtype, self.cache = num_workers, dtype, cache
        self.format, self.suffixes = format, text_suffixes(suffixes)
        self.prompts = list(prompts or [])
        self.tokenizer_name = tokenizer
        self.tokenizer = get_tokenizer(tokenizer) if self.reads_text else None
        if not isinstance(pack_documents, bool):
            raise TypeError(f"pack_documents must be True or False, got {pack_documents!r}")
        if eos_id is not None and (not isinstance(eos_id, int) or isinstance(eos_id, bool) or eos_id < 0):
            raise ValueError(f"eos_id must be a non-negative int, got {eos_id!r}")
        if pack_documents and eos_id is None and self.tokenizer is None:
            raise ValueError("pack_documents=True with token files only needs eos_id: the end-of-text id of the "
                             "tokenizer that made them (e.g. 50256 for GPT-2's)")
        self.pack_documents = pack_documents
        self.eos_id = (eos_id if eos_id is not None else self.tokenizer.eot) if pack_documents else None
        self.tokens: np.ndarray | None = None  # the training source's whole stream (with its validation tail)
        self.val_tokens: np.ndarray | None = None
        self._max_token_id: int | None = None

    @property
    def reads_text(self) -> bool:
        """Whether a source is text (and so the tokenizer makes the ids)."""
        return self.path is None or bool(self._text_sources())

    @property
    def vocab_size(self) -> int | None:
        """The tokenizer's vocabulary (``None`` for token files, which carry no tokenizer)."""
        return self.tokenizer.vocab_size if self.tokenizer is not None else None

    @property
    def max_token_id(self) -> int:
        """Largest id in the data (scanned once); the model's ``vocab_size`` must exceed it."""
        if self._max_token_id is None:
            self.setup()
            top = int(np.max(self.tokens))
            self._max_token_id = top if self.val_path is None else max(top, int(np.max(self.val_tokens)))
        return self._max_token_id

    def _text_sources(self) -> list[str]:
        return [str(p) for p in (self.path, self.val_path) if p is not None and not is_token_file(p, self.format)]

    def prepare_data(self) -> None:
        """Tokenise the text sources into their cache token files unless up-to-date ones exist. Lightning calls this
        on one process per node (``prepare_data_per_node``) before ``setup`` on any, so a corpus is tokenised once."""
        if self.cache:
            for source in self._text_sources():
                build_cache(source, self.tokenizer, self.cache, self.suffixes)

    def _load(self, path: str | None) -> np.ndarray:
        return load_tokens(path, self.tokenizer or ByteTokenizer(), self.max_tokens, dtype=self.dtype,
                           cache=self.cache, format=self.format, suffixes=self.suffixes)

    def setup(self, stage: str | None = None) -> None:
        if self.tokens is not None:
            return
        tokens = self._load(self.path)
        need = split_need(self.block_size)
        if self.val_path is None:
            bad = stream_problem(self._where("path", self.path), len(tokens), self.val_fraction, need, need)
            if bad:
                raise ValueError(bad)
            n_train = split_tokens(len(tokens), self.val_fraction)[0]
            train, val = tokens[:n_train], tokens[n_train:]
        else:
            train, val = tokens, self._load(self.val_path)
            for key, part, split in (("path", train, "train"), ("val_path", val, "validation")):
                bad = source_problem(self._where(key, getattr(self, key)), len(part), need, split)
                if bad:
                    raise ValueError(bad)
        self.tokens, self.val_tokens = tokens, val
        self.train_set = TokenWindows(train, self.block_size, self.eos_id)
        self.val_set = TokenWindows(val, self.block_size, self.eos_id)

    @staticmethod
    def _where(name: str, source, key: str = "") -> str:
        return f"{key}{name} " + ("(the Python documentation)" if source is None else repr(str(source)))

    def check_size(self, replicas: int = 1, validates: bool = True, key: str = "") -> None:
        """``ValueError`` naming the source, the tokens found and the tokens needed when a source is too short for
        what :meth:`setup` and the loaders cut from it: each split ``batch_size`` windows per data-parallel replica
        (``replicas``; the validation split one window when nothing ``validates``). Cheap: sources are counted by
        :func:`~lightning_tp2d.data.count_tokens`, never read further than the count needed. ``key``: how messages
        name the settings (``"data."`` for ``tp2d-train``, which calls this before any process starts)."""
        train, val = split_needs(self.block_size, self.batch_size, replicas, validates=validates, key=key)
        least = stream_need(train[0], val[0], self.val_fraction) if self.val_path is None else None
        sources = [("path", self.path, "train", train)]
        if self.val_path is not None:
            sources.append(("val_path", self.val_path, "validation", val))
        for name, source, split, need in sources:
            counted = count_tokens(source, self.tokenizer or ByteTokenizer(), at_least=least or need[0],
                                   dtype=self.dtype, format=self.format, suffixes=self.suffixes, cache=self.cache)
            n = min(counted, self.max_tokens) if self.max_tokens else counted
            found = f"{n} tokens ({key}max_tokens={self.max_tokens})" if n < counted else None
            where = self._where(name, source, key)
            bad = stream_problem(where, n, self.val_fraction, train, val, key, found) if least is not None else \
                source_problem(where, n, need, split, found)
            if bad:
                raise ValueError(bad)

    def _replicas(self) -> dict[str, int]:
        strategy = self.trainer.strategy if self.trainer is not None else None
        kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {}
        return {"num_replicas": kwargs.get("num_replicas", 1), "rank": kwargs.get("rank", 0)}

    def _loader(self, dataset: TokenWindows, train: bool) -> DataLoader:
        replicas = self._replicas()
        per_replica = len(dataset) // replicas["num_replicas"]
        if per_replica < self.batch_size:
            split = "train" if train else "validation"
            source = self._where("val_path", self.val_path) if not train and self.val_path else \
                self._where("path", self.path)
            raise ValueError(f"{source}: the {split} split has {len(dataset)} windows of {self.block_size} tokens: "
                             f"{per_replica} per data-parallel replica, fewer than batch_size={self.batch_size}")
        sampler = ResumableSampler(dataset, shuffle=self.shuffle and train, seed=self.seed, drop_last=True,
                                   **replicas)
        cls = ResumableLoader if train else DataLoader
        # drop_last: every batch is full, so it divides by the grid side like batch_size does
        return cls(dataset, batch_size=self.batch_size, sampler=sampler, drop_last=True, num_workers=self.num_workers,
                   collate_fn=collate_documents if self.pack_documents else None)

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
        """Each prompt as a ``[1, T]`` batch of token ids (shared out over data-parallel replicas)."""
        if not self.prompts:
            raise ValueError("TextDataModule(prompts=[...]) is needed for trainer.predict: the texts to continue")
        tokenizer = self.tokenizer or ByteTokenizer()
        encoded = [torch.as_tensor(tokenizer.encode(p).astype(np.int64)) for p in self.prompts]
        empty = [i for i, t in enumerate(encoded) if t.numel() == 0]
        if empty:
            raise ValueError(f"prompts {empty} encode to no tokens")
        # Lightning shares the prompts out over the data-parallel replicas (the strategy's sampler arguments), so every
        # rank of one tensor-parallel group continues the same prompts
        return DataLoader(encoded, batch_size=1, collate_fn=torch.stack)

    def decode(self, ids) -> str:
        return (self.tokenizer or ByteTokenizer()).decode(ids)
