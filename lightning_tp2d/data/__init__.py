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

Modules: :mod:`~lightning_tp2d.data.tokenizers` (``get_tokenizer`` and the tokenizer classes),
:mod:`~lightning_tp2d.data.token_files` (sources, formats and suffixes, token files, the cache, ``load_tokens``,
``count_tokens``) and :mod:`~lightning_tp2d.data.datamodule` (``TextDataModule``, its windows, sampler and loader, and
the tokens each split needs); every public name is importable from ``lightning_tp2d.data``.
"""

from lightning_tp2d.data.datamodule import ResumableLoader, ResumableSampler, TextDataModule, TokenWindows
from lightning_tp2d.data.token_files import (CACHE_DIRNAME, CACHE_FORMAT, CHUNK_CHARS, FORMATS, TEXT_SUFFIXES,
                                             TOKEN_DTYPES, TOKEN_SUFFIX, TOKEN_SUFFIXES, build_cache, check_format,
                                             check_path, count_tokens, default_corpus, is_token_file, load_tokens,
                                             open_token_file, raw_dtype, text_suffixes, user_cache_dir)
from lightning_tp2d.data.tokenizers import (BOS_TOKENS, EOT_TOKENS, ByteTokenizer, GPT2Tokenizer, HFTokenizer,
                                            get_tokenizer, special_token_ids, tokenizer_vocab_size)

__all__ = [
    "TextDataModule", "TokenWindows", "ResumableSampler", "ResumableLoader",
    "get_tokenizer", "tokenizer_vocab_size", "special_token_ids", "ByteTokenizer", "GPT2Tokenizer", "HFTokenizer",
    "EOT_TOKENS", "BOS_TOKENS",
    "is_token_file", "check_format", "check_path", "text_suffixes", "default_corpus", "open_token_file", "raw_dtype",
    "build_cache", "load_tokens", "count_tokens", "user_cache_dir", "TEXT_SUFFIXES", "TOKEN_SUFFIX", "TOKEN_SUFFIXES",
    "FORMATS", "TOKEN_DTYPES", "CACHE_DIRNAME", "CACHE_FORMAT", "CHUNK_CHARS",
]
