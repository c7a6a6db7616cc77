"""Tokenizers of :class:`~lightning_tp2d.data.TextDataModule`: ``"byte"`` (offline), ``"gpt2"`` (tiktoken) and a
Hugging Face ``tokenizer.json`` (the ``tokenizers`` package), each with ``encode`` / ``decode``, ``vocab_size``, its
end-of-text id ``eot`` and start-of-text id ``bos`` (the byte and GPT-2 tokenizers have one token for both, as GPT-2
does), the ``dtype`` of its token files and an ``identity`` (part of a cache file's key). :func:`special_token_ids`
names them as an export's ``config.json`` does."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

EOT_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")  # end-of-text, looked up in a tokenizer.json
BOS_TOKENS = ("<|begin_of_text|>", "<s>", "<bos>")  # start-of-text, looked up in a tokenizer.json (else: end-of-text)


def _id_dtype(vocab_size: int) -> np.dtype:
    """The smallest token-file dtype for ``vocab_size`` ids: ``uint16`` up to 65536 ids, else ``uint32``."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, end-of-text 256: vocabulary 257 (``gpt2-tiny``'s), no files needed."""

    name, vocab_size, eot, bos = "byte", 257, 256, 256
    identity, dtype = "byte", np.dtype(np.uint16)

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class GPT2Tokenizer:
    """GPT-2's BPE through tiktoken (50257 ids, end-of-text 50256)."""

    name, vocab_size, eot, bos = "gpt2", 50257, 50256, 50256  # <|endoftext|> starts and ends a text
    identity, dtype = "gpt2", np.dtype(np.uint16)

    def __init__(self) -> None:
        hint = ("tokenizer 'gpt2' needs the tiktoken package and its GPT-2 BPE files, which tiktoken downloads on "
                "first use (from openaipublic.blob.core.windows.net) or reads from TIKTOKEN_CACHE_DIR; ")
        offline = ("Offline, use tokenizer='byte', a local tokenizer.json, or a pre-tokenised .bin token file.")
        try:
            import tiktoken
        except ImportError as err:
            raise RuntimeError(hint + 'tiktoken is not installed (pip install "lightning_tp2d[gpt2]"). '
                               + offline) from err
        try:
            self._enc = tiktoken.get_encoding("gpt2")
        except Exception as err:  # noqa: BLE001 - any network / cache failure
            first = (str(err).strip().splitlines() or [""])[0]
            first = first if len(first) <= 160 else first[:157] + "..."
            raise RuntimeError(hint + f"they could not be loaded ({type(err).__name__}: {first}). " + offline) from err

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._enc.encode_ordinary(text), dtype=np.uint16)

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids])


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` read with the ``tokenizers`` package (no ``transformers``, no download).

    ``path`` is the file or a folder holding ``tokenizer.json``. The vocabulary counts the added tokens; the
    end-of-text id is the first of :data:`EOT_TOKENS` the tokenizer knows (one is required: it separates the files
    of a corpus), its start-of-text id the first of :data:`BOS_TOKENS` (none: the end-of-text id). ``encode`` adds
    no special tokens; ``decode`` keeps them."""

    name = "hf"

    def __init__(self, path: str | os.PathLike) -> None:
        given = Path(path).expanduser()
        file = given / "tokenizer.json" if given.is_dir() else given
        if not file.is_file():
            where = f" (the folder {str(given)!r} holds no tokenizer.json)" if given.is_dir() else ""
            raise FileNotFoundError(f"tokenizer file {str(file)!r} does not exist{where}")
        try:
            from tokenizers import Tokenizer
        except ImportError as err:
            raise RuntimeError(f"tokenizer {str(file)!r} is a Hugging Face tokenizer.json, read with the tokenizers "
                               'package, which is not installed: pip install "lightning_tp2d[hf-tokenizer]"'
                               ) from err
        data = file.read_bytes()
        try:
            self._tok = Tokenizer.from_str(data.decode("utf-8"))
        except Exception as err:  # tokenizers raises its own exception types
            raise ValueError(f"{str(file)!r} is not a tokenizer.json the tokenizers package can read "
                             f"({type(err).__name__}: {err})") from err
        self.path = file.resolve()
        self.identity = "hf-" + hashlib.sha256(data).hexdigest()[:16]  # the content, wherever the file lies
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
        eot = next((t for t in EOT_TOKENS if t in vocab), None)
        if eot is None:
            raise ValueError(f"tokenizer {str(file)!r} has no end-of-text token (none of {', '.join(EOT_TOKENS)}), "
                             "which separates the documents of a corpus: add one to the tokenizer (a special token)")
        self.eot = vocab[eot]
        self.bos = next((vocab[t] for t in BOS_TOKENS if t in vocab), self.eot)
        self.dtype = _id_dtype(self.vocab_size)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=self.dtype)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _is_path_like(name: str) -> bool:
    """Whether a tokenizer name means a file or folder (a ``.json`` name, a separator, ``~``, or an existing path)."""
    return name.endswith(".json") or "/" in name or os.sep in name or name.startswith("~") or Path(name).exists()


def get_tokenizer(name: str):
    """``"byte"``, ``"gpt2"``, or the path of a ``tokenizer.json`` (or of a folder holding one)."""
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        return GPT2Tokenizer()
    if isinstance(name, (str, os.PathLike)) and _is_path_like(str(name)):
        return HFTokenizer(name)
    raise ValueError(f"unknown tokenizer {name!r}; choose 'byte', 'gpt2' or the path of a Hugging Face tokenizer.json "
                     "(or of a folder holding one)")


def special_token_ids(name: str) -> dict[str, int]:
    """``{"bos_token_id": ..., "eos_token_id": ...}`` of tokenizer ``name`` (its ``bos`` and end-of-text ``eot``), as
    a transformers ``config.json`` names them; without tiktoken for ``"gpt2"`` (errors as :func:`get_tokenizer`)."""
    known = {"byte": ByteTokenizer, "gpt2": GPT2Tokenizer}.get(name)
    tokenizer = known if known is not None else get_tokenizer(name)
    return {"bos_token_id": int(tokenizer.bos), "eos_token_id": int(tokenizer.eot)}


def tokenizer_vocab_size(name: str) -> int:
    """How many ids tokenizer ``name`` makes (the model's ``vocab_size`` must be at least this), without tiktoken for
    ``"gpt2"``; a ``tokenizer.json`` is read (errors as :func:`get_tokenizer`)."""
    if name == "byte":
        return ByteTokenizer.vocab_size
    if name == "gpt2":
        return GPT2Tokenizer.vocab_size
    return get_tokenizer(name).vocab_size

