"""Token files and the text sources they are made from: what is read as token ids (``is_token_file``), memory-maps
of ``.bin`` / ``.npy`` files (``open_token_file``), the checks of paths, formats and suffixes run before any process
starts (``check_path``), text tokenised piece by piece into cache token files (``build_cache``), the whole token
stream of one source (``load_tokens``) and its length, counted without reading more than needed (``count_tokens``).
See :mod:`lightning_tp2d.data` for the formats and the cache."""

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

import numpy as np

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".rst")
TOKEN_SUFFIX = ".bin"  # raw ids of a given dtype (nanoGPT's format)
TOKEN_SUFFIXES = (".bin", ".npy")  # .npy: the numpy header carries the dtype
FORMATS = ("auto", "text", "tokens")  # how a source is read: by its suffix, as text, as token ids
TOKEN_DTYPES = ("uint16", "uint32")  # what a raw .bin file may hold (little-endian)
CACHE_DIRNAME = ".tp2d_cache"  # next to the corpus: its cache token files
CACHE_FORMAT = 1  # part of every cache key: bump when the cache's content changes for the same inputs
CHUNK_CHARS = 1 << 22  # characters tokenised at a time (text is cut at line starts), so memory stays bounded


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


def raw_dtype(dtype) -> np.dtype:
    """The little-endian numpy dtype of a raw ``.bin`` token file of ``dtype`` ids (one of :data:`TOKEN_DTYPES`)."""
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
    dt = raw_dtype(dtype)
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
                   suffixes: tuple[str, ...] = TEXT_SUFFIXES, until: int | None = None) -> int:
    """Tokenise the text file or folder ``source`` piece by piece into ``write`` (files joined by end-of-text);
    returns the number of tokens. ``until``: stop after the piece that brings the count to at least this."""
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
            if until is not None and count >= until:
                return count
    if not chars:
        raise ValueError(f"{str(source)!r} is empty: no text to train on")
    return count


def count_tokens(path: str | os.PathLike | None, tokenizer, *, at_least: int | None = None, dtype="uint16",
                 format: str = "auto", suffixes: tuple[str, ...] = TEXT_SUFFIXES, cache=False) -> int:
    """How many tokens :func:`load_tokens` makes of ``path`` (before ``max_tokens``), cheaply: a token file's from
    its size (``.bin``) or header (``.npy``), text from its up-to-date cache token file when ``cache`` finds one, else
    tokenised in the cache's pieces until ``at_least`` are counted (then the count is at least that, and the rest is
    not read: at most one piece, ``CHUNK_CHARS`` characters, more). ``path=None``: the Python documentation."""
    if path is None:
        return len(tokenizer.encode(default_corpus()))
    if is_token_file(path, format):
        return len(open_token_file(path, dtype))
    source = Path(path).expanduser().resolve()
    if not source.exists():
        raise FileNotFoundError(f"data path {str(source)!r} does not exist")
    if cache:
        name = _cache_name(source, tokenizer, suffixes)[1]
        found = next((d / name for d in _cache_dirs(source, cache) if (d / name).is_file()), None)
        if found is not None:
            return found.stat().st_size // tokenizer.dtype.itemsize
    return _encode_source(source, tokenizer, lambda ids: None, suffixes, until=at_least)


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

