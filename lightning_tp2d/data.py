"""``TextDataModule``: next-token windows from text or token files, fed the tensor-parallel way.

Sources (``path``, and optionally a separate ``val_path``): a text file, a folder of text files (``*.txt``, ``*.md``,
``*.rst``, and any suffix added with ``suffixes``, read in sorted order and joined with the end-of-text token), a
token file, or by default the Python documentation that ships with every Python install (``pydoc_data.topics``), so
a run needs no download. ``format="auto"`` tells token files from text by the suffix (``.bin``, ``.npy``);
``"text"`` reads every source as text and ``"tokens"`` as token ids, whatever its suffix.

Token files are memory-mapped, never read into memory: ``*.bin`` holds raw little-endian ids of ``dtype``
(``"uint16"``, nanoGPT's ``train.bin`` / ``val.bin`` as they are, or ``"uint32"`` for vocabularies over 65536 ids; a
raw file has no header, so the dtype is an argument); ``*.npy`` is one 1-D integer array whose header carries the
dtype.

Tokenizers: ``"byte"`` (UTF-8 bytes, 256 ids + end-of-text = 257, offline), ``"gpt2"`` (tiktoken's BPE, 50257 ids;
``pip install "lightning_tp2d[gpt2]"``) or the path of a Hugging Face ``tokenizer.json`` (or a folder holding one),
read with the ``tokenizers`` package (``pip install "lightning_tp2d[hf-tokenizer]"``); its end-of-text id is the
first of ``<|endoftext|>``, ``</s>``, ``<eos>``, ``<|end_of_text|>`` it knows.

Text is tokenised once: :meth:`TextDataModule.prepare_data` (Lightning calls it on one process per node, before
``setup`` on any) streams the corpus through the tokenizer into a cache token file in ``.tp2d_cache/`` next to the
corpus, or in ``$XDG_CACHE_HOME/lightning_tp2d`` (``~/.cache/lightning_tp2d``) where that folder is not writable.
Its name carries a hash of the tokenizer and of the corpus files' names, sizes and modification times, so a changed
corpus or another tokenizer is tokenised afresh (and the stale file of the same corpus and tokenizer is removed);
it is written to a temporary file and renamed, so a reader never sees half of it. ``setup`` on every rank then
memory-maps it (and tokenises first if nobody did: ``dm.setup()`` works alone). ``cache="<folder>"`` keeps the cache
files there; ``cache=False`` tokenises in memory on every rank, as the default corpus (half a megabyte) always is.
Text is read and tokenised in pieces of about four million characters, cut where the tokens split anyway, so memory
stays bounded for corpora of any size.

Without ``val_path`` the token stream is split into train (first ``1 - val_fraction``) and validation (the rest);
with it, the whole of ``path`` is the training data and ``val_path`` the validation data (``val_fraction`` is not
used). Sample ``i`` is the window ``tokens[iT : iT + T + 1]`` cut into inputs ``[:-1]`` and targets ``[1:]``
(``T = block_size``).

Batches: the sampler shards over *data-parallel* replicas only (``trainer.strategy.distributed_sampler_kwargs``:
under TP2DStrategy, the ``data_parallel`` axis), so every rank of a tensor-parallel group gets the same batch.
``batch_size`` is per replica. The train loader is resumable: its state (epoch, batches consumed) goes into
Lightning checkpoints, and a resumed run continues with the next unseen batch.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import re
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import lightning.pytorch as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".rst")
TOKEN_SUFFIX = ".bin"  # raw ids of a given dtype (nanoGPT's format)
TOKEN_SUFFIXES = (".bin", ".npy")  # .npy: the numpy header carries the dtype
FORMATS = ("auto", "text", "tokens")  # how a source is read: by its suffix, as text, as token ids


def check_format(format: str) -> str:
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)} (auto: token files by their .bin / .npy suffix), "
                         f"got {format!r}")
    return format


def text_suffixes(extra=None) -> tuple[str, ...]:
    """The suffixes of the files a text folder contributes: :data:`TEXT_SUFFIXES` and ``extra`` (``"py"`` or
    ``".py"``)."""
    if isinstance(extra, str):
        extra = [extra]
    added = tuple(s if str(s).startswith(".") else f".{s}" for s in (extra or ()))
    return TEXT_SUFFIXES + tuple(s for s in added if s not in TEXT_SUFFIXES)
TOKEN_DTYPES = ("uint16", "uint32")  # what a raw .bin file may hold (little-endian)
EOT_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")  # end-of-text, looked up in a tokenizer.json
CACHE_DIRNAME = ".tp2d_cache"  # next to the corpus: its cache token files
CACHE_FORMAT = 1  # part of every cache key: bump when the cache's content changes for the same inputs
CHUNK_CHARS = 1 << 22  # characters tokenised at a time (text is cut at line starts), so memory stays bounded


# ---- tokenizers ------------------------------------------------------------------------------------------------


def _id_dtype(vocab_size: int) -> np.dtype:
    """The smallest token-file dtype for ``vocab_size`` ids: ``uint16`` up to 65536 ids, else ``uint32``."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, end-of-text 256: vocabulary 257 (``gpt2-tiny``'s), no files needed."""

    name, vocab_size, eot = "byte", 257, 256
    identity, dtype = "byte", np.dtype(np.uint16)

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class GPT2Tokenizer:
    """GPT-2's BPE through tiktoken (50257 ids, end-of-text 50256)."""

    name, vocab_size, eot = "gpt2", 50257, 50256
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
    of a corpus). ``encode`` adds no special tokens; ``decode`` keeps them."""

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


def tokenizer_vocab_size(name: str) -> int:
    """How many ids tokenizer ``name`` makes (the model's ``vocab_size`` must be at least this), without tiktoken for
    ``"gpt2"``; a ``tokenizer.json`` is read (errors as :func:`get_tokenizer`)."""
    if name == "byte":
        return ByteTokenizer.vocab_size
    if name == "gpt2":
        return GPT2Tokenizer.vocab_size
    return get_tokenizer(name).vocab_size


# ---- sources ---------------------------------------------------------------------------------------------------


def default_corpus() -> str:
    """The Python documentation topics that ship with CPython (``pydoc_data.topics``): about half a megabyte of text."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def is_token_file(path: str | os.PathLike, format: str = "auto") -> bool:
    """Whether ``path`` is read as a token file rather than text: by its suffix (``.bin`` or ``.npy``) under
    ``format="auto"``, always under ``"tokens"``, never under ``"text"``."""
    if check_format(format) != "auto":
        return format == "tokens"
    return Path(str(path)).suffix in TOKEN_SUFFIXES


def _text_files(path: Path, suffixes: tuple[str, ...] = TEXT_SUFFIXES) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes)
        if not files:
            found = sorted({p.suffix for p in path.rglob("*") if p.is_file() and p.suffix})[:8]
            seen = f"; it holds {', '.join(found)} files" if found else ""
            raise ValueError(f"folder {str(path)!r} holds no text files with the suffixes read ({', '.join(suffixes)})"
                             f"{seen}: add suffixes with suffixes=[...] (tp2d-train: data.suffixes='[.py]')")
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


def _raw_dtype(dtype) -> np.dtype:
    name = np.dtype(dtype).name if isinstance(dtype, (np.dtype, type)) else str(dtype)
    if name not in TOKEN_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(TOKEN_DTYPES)} (the ids of a raw .bin token file), got "
                         f"{dtype!r}")
    return np.dtype(name).newbyteorder("<")


def open_token_file(path: str | os.PathLike, dtype="uint16") -> np.ndarray:
    """A read-only memory map of a token file: a raw ``.bin`` of little-endian ``dtype`` ids (``"uint16"``: nanoGPT's
    ``train.bin`` / ``val.bin``; ``"uint32"``), or a ``.npy`` 1-D integer array (its own dtype; ``dtype`` unused)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"data path {str(p)!r} does not exist")
    if p.suffix == ".npy":
        try:
            tokens = np.load(p, mmap_mode="r", allow_pickle=False)
        except ValueError as err:
            raise ValueError(f"token file {str(p)!r} is not a .npy array numpy can memory-map ({err})") from None
        if tokens.ndim != 1 or tokens.dtype.kind not in "ui":
            raise ValueError(f"token file {str(p)!r} holds a {tokens.dtype} array of shape {tuple(tokens.shape)}; a "
                             ".npy token file is one 1-D array of integer ids")
        if tokens.size == 0:
            raise ValueError(f"token file {str(p)!r} is empty")
        return tokens
    dt = _raw_dtype(dtype)
    size = p.stat().st_size
    if size == 0:
        raise ValueError(f"token file {str(p)!r} is empty")
    if size % dt.itemsize:
        raise ValueError(f"token file {str(p)!r} has {size} bytes, not a whole number of {dt.name} ids "
                         f"({dt.itemsize} bytes each)")
    return np.memmap(p, dtype=dt, mode="r")


def _looks_like_uint32(tokens: np.ndarray) -> bool:
    """Whether 16-bit ids read from a raw file look like 32-bit ids: in the first 64 Ki values every second one (the
    high halves) is below 16 while the others are not. Real text in any 16-bit vocabulary is never like that."""
    head = np.asarray(tokens[: 1 << 16])
    if tokens.dtype.itemsize != 2 or len(head) < 256:
        return False
    return int(head[1::2].max()) < 16 <= int(head[0::2].max())


def check_path(path: str | os.PathLike, vocab_size: int | None = None, dtype="uint16", format: str = "auto",
               suffixes: tuple[str, ...] = TEXT_SUFFIXES) -> None:
    """Check a data path before any process starts (``tp2d-train`` does, on the launching process): it exists; a
    token file is non-empty, whole ids of ``dtype`` (``.bin``; a ``.npy`` has its own) and (with ``vocab_size``)
    holds only ids below it; text files are text (a binary given as ``data=text`` is refused by content, not
    trained on). Raises ``ValueError`` (``FileNotFoundError``) naming the file and the numbers that do not fit."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"data path {str(p)!r} does not exist")
    if p.is_file() and is_token_file(p, format):
        why = f" (read as token ids for its {p.suffix} suffix; format='text' reads it as text)" if format == "auto" \
            else ""
        tokens = open_token_file(p, dtype)
        if p.suffix == TOKEN_SUFFIX and _looks_like_uint32(tokens):
            raise ValueError(f"token file {str(p)!r} read as uint16 looks like uint32 ids (every second uint16, the "
                             "high halves, is below 16): set dtype='uint32' (data.dtype=uint32)")
        if tokens.dtype.kind == "i" and int(tokens.min()) < 0:
            raise ValueError(f"token file {str(p)!r} holds the negative id {int(tokens.min())}")
        if vocab_size is not None:
            top = int(tokens.max())
            if top >= vocab_size:
                hint = (" (or, if the file holds uint16 ids as nanoGPT writes them, dtype='uint16')"
                        if p.suffix == TOKEN_SUFFIX and tokens.dtype.itemsize == 4 and top >= 1 << 16 else "")
                raise ValueError(f"token file {str(p)!r}{why} holds id {top}, but the model's vocabulary has "
                                 f"{vocab_size} ids (0..{vocab_size - 1}): use a model with vocab_size > {top}, or "
                                 f"the file made for this model{hint}")
        return
    for file in _text_files(p, suffixes):
        reason = _binary_reason(file)
        if reason is not None:
            raise ValueError(f"{str(file)!r} is not a text file ({reason}): data=text reads UTF-8 text; for "
                             f"pre-tokenised ids use a {TOKEN_SUFFIX} file (data=tokens)")


# where byte and GPT-2 BPE tokenisation split anyway: after a newline, or before a space, between two non-spaces
_SAFE_CUT = re.compile(r"(?<=\S\n)(?=\S)|(?<=\S)(?= \S)")


def _last_cut(text: str) -> int:
    """The last :data:`_SAFE_CUT` position in ``text`` (looking at its tail first), or 0 when there is none."""
    for start in (max(0, len(text) - 4096), 0):
        cut = 0
        for match in _SAFE_CUT.finditer(text, start):
            cut = match.start()
        if cut or start == 0:
            return cut
    return 0


def _pieces(file: Path, chunk: int = CHUNK_CHARS) -> Iterator[str]:
    """The text of ``file`` in pieces of about ``chunk`` characters, cut only after a newline or before a space that
    stands between two non-space characters, where byte and GPT-2 BPE tokenisation split anyway (so their tokens are
    those of the whole text; a tokenizer.json that prefixes a space to every input sees one more per piece). Text
    with no such place in ``4 * chunk`` characters is cut there."""
    with open(file, encoding="utf-8", errors="replace") as f:
        rest, block = "", f.read(chunk)
        while block:
            text, block = rest + block, f.read(chunk)
            cut = _last_cut(text) if block else len(text)  # the end of the file: all the rest
            if not cut and len(text) < 4 * chunk:  # no place to cut yet: read on
                rest = text
                continue
            cut = cut or len(text)
            yield text[:cut]
            rest = text[cut:]


def _encode_source(source: Path, tokenizer, write: Callable[[np.ndarray], None],
                   suffixes: tuple[str, ...] = TEXT_SUFFIXES) -> int:
    """Tokenise the text file or folder ``source`` piece by piece into ``write`` (files joined by end-of-text);
    returns the number of tokens."""
    eot = np.array([tokenizer.eot], dtype=tokenizer.dtype)
    chars = count = 0
    for k, file in enumerate(_text_files(source, suffixes)):
        if k:
            write(eot)
            count += 1
        for piece in _pieces(file):
            ids = np.asarray(tokenizer.encode(piece), dtype=tokenizer.dtype)
            chars, count = chars + len(piece), count + len(ids)
            write(ids)
    if not chars:
        raise ValueError(f"{str(source)!r} is empty: no text to train on")
    return count


# ---- the token cache -------------------------------------------------------------------------------------------


def user_cache_dir() -> Path:
    """Where cache token files go when the corpus's folder is not writable: ``$XDG_CACHE_HOME/lightning_tp2d``
    (``~/.cache/lightning_tp2d``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lightning_tp2d"


def _cache_dirs(source: Path, cache) -> list[Path]:
    if cache is True:
        return [source.parent / CACHE_DIRNAME, user_cache_dir()]
    return [Path(str(cache)).expanduser()]


def _cache_name(source: Path, tokenizer, suffixes: tuple[str, ...] = TEXT_SUFFIXES) -> tuple[str, str]:
    """``(prefix, name)`` of the cache file for ``source``: the prefix names the corpus (its absolute path hashed)
    and the tokenizer kind; the name adds a hash of the tokenizer and of every file's name, size and mtime."""
    where = hashlib.sha256(str(source).encode()).hexdigest()[:8]
    key = hashlib.sha256(f"{CACHE_FORMAT}\0{tokenizer.identity}\0{tokenizer.dtype.name}".encode())
    for file in _text_files(source, suffixes):
        stat = file.stat()
        key.update(f"\0{file.relative_to(source) if file != source else file.name}\0{stat.st_size}\0"
                   f"{stat.st_mtime_ns}".encode())
    prefix = f"{source.name}.{tokenizer.name}.{where}-"
    return prefix, f"{prefix}{key.hexdigest()[:16]}.{tokenizer.dtype.name}.bin"


def build_cache(path: str | os.PathLike, tokenizer, cache=True,
                suffixes: tuple[str, ...] = TEXT_SUFFIXES) -> Path | None:
    """Tokenise text ``path`` into its cache token file unless an up-to-date one exists; returns it, or ``None`` (with
    a warning) when no cache folder is writable. ``cache``: ``True`` (next to the corpus, else the user cache dir)
    or a folder. Written to a temporary file and renamed into place, so concurrent writers and readers are safe."""
    source = Path(path).expanduser().resolve()
    if not source.exists():
        raise FileNotFoundError(f"data path {str(source)!r} does not exist")
    prefix, name = _cache_name(source, tokenizer, suffixes)
    dirs = _cache_dirs(source, cache)
    found = next((d / name for d in dirs if (d / name).is_file()), None)
    if found is not None:
        return found
    for folder in dirs:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
        except OSError as err:
            log.info("cache folder %s is not writable (%s)", folder, err)
            continue
        log.info("tokenising %s with tokenizer %s into %s", source, tokenizer.name, folder / name)
        try:
            with os.fdopen(fd, "wb") as f:
                _encode_source(source, tokenizer, lambda ids: ids.tofile(f), suffixes)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, folder / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        for stale in folder.glob(f"{glob.escape(prefix)}*.bin"):  # this corpus and tokenizer kind, before a change
            if stale.name != name:
                stale.unlink(missing_ok=True)
        return folder / name
    warnings.warn(f"no writable cache folder for {str(source)!r} (tried {', '.join(str(d) for d in dirs)}): its tokens "
                  "stay in memory, tokenised by every process", stacklevel=2)
    return None


def load_tokens(path: str | None, tokenizer, max_tokens: int | None = None, dtype="uint16",
                cache=False, format: str = "auto", suffixes: tuple[str, ...] = TEXT_SUFFIXES) -> np.ndarray:
    """The whole token stream of one source: a read-only memory map for token files (raw ``.bin`` ids of ``dtype``,
    or ``.npy``) and, with ``cache``, for text (its cache token file, built if missing); else an in-memory array of
    ``tokenizer.dtype``. ``path=None``: the Python documentation (in memory)."""
    if path is None:
        tokens = np.asarray(tokenizer.encode(default_corpus()), dtype=tokenizer.dtype)
    elif is_token_file(path, format):
        tokens = open_token_file(path, dtype)
        if Path(str(path)).suffix == TOKEN_SUFFIX and _looks_like_uint32(tokens):
            warnings.warn(f"token file {str(path)!r} read as uint16 looks like uint32 ids (every second uint16 is "
                          "below 16): set dtype='uint32'", stacklevel=2)
    else:
        p = Path(path).expanduser()
        if not p.exists():
            raise FileNotFoundError(f"data path {str(p)!r} does not exist")
        cached = build_cache(p, tokenizer, cache, suffixes) if cache else None
        if cached is not None:  # (text of only spaces may make no tokens, and an empty file cannot be mapped)
            tokens = np.memmap(cached, dtype=tokenizer.dtype, mode="r") if cached.stat().st_size else np.zeros(0)
        else:
            parts: list[np.ndarray] = []
            _encode_source(p, tokenizer, parts.append, suffixes)
            tokens = np.concatenate(parts)
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
        cache: tokenise text once into a cache token file (see the module docstring): ``True`` (``.tp2d_cache/``
            next to the corpus, or the user cache dir), a folder to keep it in, or ``False`` (in memory, every rank).
        format: ``"auto"`` (token files by their ``.bin`` / ``.npy`` suffix, the rest text), ``"text"`` (every source
            is text, a ``.bin`` too) or ``"tokens"`` (every source is token ids).
        suffixes: more suffixes of the files a text folder contributes (``[".py"]``), besides ``.txt``, ``.md`` and
            ``.rst``.
    """

    def __init__(self, path: str | None = None, tokenizer: str = "byte", block_size: int = 64, batch_size: int = 8,
                 val_fraction: float = 0.05, shuffle: bool = True, seed: int = 0, max_tokens: int | None = None,
                 num_workers: int = 0, prompts: list[str] | None = None, val_path: str | None = None,
                 dtype: str = "uint16", cache: bool | str = True, format: str = "auto",
                 suffixes: list[str] | None = None) -> None:
        super().__init__()
        if val_path is None and not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        for name, value in (("block_size", block_size), ("batch_size", batch_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        _raw_dtype(dtype)
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
        need = self.block_size + 1
        if self.val_path is None:
            n_val = int(len(tokens) * self.val_fraction)
            if len(tokens) - n_val < need or n_val < need:
                raise ValueError(f"{len(tokens)} tokens are too few: train {len(tokens) - n_val} and validation "
                                 f"{n_val} tokens must each hold at least one window of block_size+1 = {need}")
            train, val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:]
        else:
            train, val = tokens, self._load(self.val_path)
            for key, source, part in (("path", self.path, train), ("val_path", self.val_path, val)):
                if len(part) < need:
                    where = "the Python documentation" if source is None else repr(str(source))
                    raise ValueError(f"{key} {where}: {len(part)} tokens are too few for one window of "
                                     f"block_size+1 = {need}")
        self.tokens, self.val_tokens = tokens, val
        self.train_set = TokenWindows(train, self.block_size)
        self.val_set = TokenWindows(val, self.block_size)

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
