"""A model family's transformers format (:class:`HFFormat`), and the one key checker every transformers import uses.

A format says how a plain model of ours and a transformers checkpoint of the same architecture differ: key names,
weights stored transposed, buffers to ignore, the ``config.json`` reader and writer and which sizes must match.
Each model module defines its own (``models.gpt2.HF_FORMAT``, ``models.llama.HF_FORMAT``); the families registry
hands it to :mod:`lightning_tp2d.export`, which reads and writes transformers directories for any family through it.

:func:`check_keys` is the single place that decides which stored keys are missing, unexpected or mis-shaped
(shapes in transformers' layout) and whether a tied head's stored copy equals its embedding; both an in-memory
state dict (:meth:`HFFormat.load_state_dict`) and :func:`~lightning_tp2d.export.load_hf_weights`, which reads a
directory tensor by tensor into sharded parameters, go through it.

:func:`read_token_ids` / :func:`write_token_ids` carry the special-token ids (bos, eos, pad) between a ``config.json``
and our configs' fields of the same names, for every format.

Floors: torch and :mod:`lightning_tp2d.models.config` only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from lightning_tp2d.models.config import TOKEN_IDS


def _same_key(key: str) -> str:
    return key


# Bounds on the sizes a transformers config.json may give: far above every real model (Llama 3.1 405B: 126 layers,
# hidden 16384, MLP 53248, 128 heads, vocabulary 128256; the widest vocabularies ~1M; Llama 4: 10M positions), far
# below what a typo or a hostile file asks for (n_layer=10**7 grows a meta model for minutes; n_embd=10**9 fails in
# torch's allocator, naming nothing). (most, unit) per kind of size; each format maps its fields onto these.
LAYERS = (1024, "layers")
WIDTH = (1 << 17, "hidden features")
MLP_WIDTH = (1 << 20, "MLP features")
HEADS = (1 << 14, "heads")
HEAD_WIDTH = (1 << 14, "features per head")
VOCAB = (1 << 23, "token ids")
POSITIONS = (1 << 27, "positions")


def _is_id(value: Any, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def read_token_ids(hf_config: Any, vocab_size: int) -> dict[str, Any]:
    """The special-token ids (:data:`TOKEN_IDS`) of a ``config.json`` (a namespace or transformers config) that are
    ids of a ``vocab_size`` vocabulary, for our config's fields of the same names; an ``eos_token_id`` list as a
    tuple. Others are left out, as transformers warns about and ignores them: absent or null, out of range (a
    GPT-2 ``config.json`` of a smaller vocabulary keeps GPT-2's 50256), negative (old files' ``pad_token_id: -1``)."""
    found: dict[str, Any] = {}
    for name in TOKEN_IDS:
        value = getattr(hf_config, name, None)
        if name == "eos_token_id" and isinstance(value, (list, tuple)):
            if value and all(_is_id(i, vocab_size) for i in value):
                found[name] = tuple(value)
        elif _is_id(value, vocab_size):
            found[name] = value
    return found


def write_token_ids(config: Any, **defaults: Any) -> dict[str, Any]:
    """``config.json``'s special-token ids for our ``config``: its own fields (:data:`TOKEN_IDS`), else ``defaults``
    (the family's), else ``null``, written out so that transformers does not fill in its own class defaults (its
    ``LlamaConfig`` says 1 and 2, which are not ids of ours); an ``eos_token_id`` tuple as a list."""
    out = {}
    for name in TOKEN_IDS:
        value = getattr(config, name, None)
        value = defaults.get(name) if value is None else value
        out[name] = list(value) if isinstance(value, tuple) else value
    return out


def check_hf_sizes(hf_config: Any, limits: Mapping[str, tuple[int, str]]) -> None:
    """``ValueError`` naming the first field of ``limits`` (``config.json`` names) that ``hf_config`` (a namespace or
    transformers config) sets to anything but a positive int at most its bound; unset (``None``) fields pass."""
    for field, (most, unit) in limits.items():
        value = getattr(hf_config, field, None)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{field}={value!r} is not a positive integer")
        if value > most:
            raise ValueError(f"{field}={value} is not a plausible size (at most {most} {unit})")


@dataclass(frozen=True)
class HFFormat:
    """One family's transformers format. Keys named "ours" are our ``state_dict()`` keys, "theirs" transformers'.

    ===============  ==============================================================================================
    model_type       ``config.json``'s ``"model_type"`` (``"gpt2"``): how a directory names its family
    architecture     the transformers class that loads an exported directory (``"GPT2LMHeadModel"``)
    read_config      ``config.json`` contents (a dict, defaults not filled in) -> our config; ``ValueError`` naming
                     every setting this model does not implement; the special-token ids it holds are kept
                     (:func:`read_token_ids`)
    write_config     our config -> ``config.json`` contents (``model_type`` and ``architectures`` are added), the
                     special-token ids included (:func:`write_token_ids`: bos and eos never left to transformers'
                     class defaults)
    embedding        our key of the token embedding weight, which a tied head shares
    head             our key of the LM head weight
    prefix           theirs: the base model's prefix (``"transformer."``); a bare base-model checkpoint lacks it
    ignored          suffixes of stored keys to skip (old causal-mask buffers, RoPE frequencies)
    transposed       suffixes of our keys stored transposed, ``[in, out]`` (GPT-2's Conv1D)
    fused_qkv        suffixes of our fused q/k/v tensors (checkpoints store them as ``[3, n/3, ...]`` boxes)
    sizes            config fields a checkpoint must match exactly
    fit              ``(ours, theirs) -> [problem]``: further rules beyond ``sizes`` (GPT-2's ``block_size``)
    longer_rows      our keys whose stored tensor may hold more rows than ours (a position table): the first
                     rows are loaded
    tie_option       the config field that ties the head (``"tie_embeddings"``), named in errors; ``None``: the
                     family always ties
    to_hf_key        ours -> theirs where the names differ (default: the same name)
    from_hf_key      theirs (prefix added) -> ours, the inverse of ``to_hf_key``
    ===============  ==============================================================================================
    """

    model_type: str
    architecture: str
    read_config: Callable[[Mapping[str, Any]], Any]
    write_config: Callable[[Any], dict[str, Any]]
    embedding: str
    head: str = "lm_head.weight"
    prefix: str = ""
    ignored: tuple[str, ...] = ()
    transposed: tuple[str, ...] = ()
    fused_qkv: tuple[str, ...] = ()
    sizes: tuple[str, ...] = ()
    fit: Callable[[Any, Any], list[str]] | None = None
    longer_rows: tuple[str, ...] = ()
    tie_option: str | None = None
    to_hf_key: Callable[[str], str] = _same_key
    from_hf_key: Callable[[str], str] = _same_key

    # ---- keys and tensors -----------------------------------------------------------------------------------

    def ours(self, key: str) -> str | None:
        """Our key for a stored key, or ``None`` for a buffer to ignore; a bare base-model key gets the prefix."""
        if self.ignored and key.endswith(self.ignored):
            return None
        top = self.to_hf_key(self.head).split(".")[0] + "."
        if self.prefix and not key.startswith((self.prefix, top)):
            key = self.prefix + key
        return self.from_hf_key(key)

    def hf_shape(self, key: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The stored shape of our tensor ``key`` of ``shape`` (reversed where stored transposed)."""
        return tuple(shape)[::-1] if self.transposed and key.endswith(self.transposed) else tuple(shape)

    def to_ours(self, key: str, tensor: torch.Tensor, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """A stored tensor in our layout (a view): transposed back, and cut to ``shape``'s rows for
        :attr:`longer_rows` keys."""
        if self.transposed and key.endswith(self.transposed):
            tensor = tensor.t()
        if shape is not None and key in self.longer_rows:
            tensor = tensor[: shape[0]]
        return tensor

    def hf_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """``model``'s weights under transformers' keys and layout (contiguous copies), tied keys included, as
        transformers' ``state_dict()`` has them."""
        return {self.to_hf_key(k): self.hf_tensor(k, v) for k, v in model.state_dict().items()}

    def hf_tensor(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """Our tensor ``key`` in transformers' layout (a contiguous copy)."""
        if self.transposed and key.endswith(self.transposed):
            tensor = tensor.t()
        return tensor.detach().clone().contiguous()

    # ---- configs --------------------------------------------------------------------------------------------

    def hf_config(self, config: Any) -> dict[str, Any]:
        """The ``config.json`` contents for our ``config``."""
        return {"model_type": self.model_type, "architectures": [self.architecture], **self.write_config(config)}

    def fit_problems(self, ours: Any, theirs: Any) -> list[str]:
        """Each size of our config ``ours`` that a checkpoint of config ``theirs`` cannot fill."""
        problems = [f"{name}: model {getattr(ours, name)}, checkpoint {getattr(theirs, name)}"
                    for name in self.sizes if getattr(ours, name) != getattr(theirs, name)]
        return problems + (list(self.fit(ours, theirs)) if self.fit is not None else [])

    # ---- loading a state dict -------------------------------------------------------------------------------

    @torch.no_grad()
    def load_state_dict(self, model: nn.Module, sd: Mapping[str, torch.Tensor], what: str) -> None:
        """Copy a transformers state dict into plain ``model``'s parameters; nothing is copied unless
        :func:`check_keys` finds every key in order (``what`` names the source in its error)."""
        model.tie_weights()  # after to_empty() a tied head would otherwise keep uninitialised memory
        state = model.state_dict(keep_vars=True)  # the Parameters themselves: ties are the same object
        tied = self.head in state and state[self.head] is state.get(self.embedding)
        aliases = {self.head: self.embedding} if tied else {}
        names = check_keys(self, {k: tuple(v.shape) for k, v in state.items()},
                           {k: tuple(v.shape) for k, v in sd.items()}, aliases=aliases,
                           same=lambda a, b: torch.equal(sd[a].to(sd[b].device), sd[b]), what=what)
        for key, dst in state.items():
            if key not in aliases:  # a tied key is the same storage, copied under its first name
                dst.detach().copy_(self.to_ours(key, sd[names[key]], tuple(dst.shape)))


def check_keys(fmt: HFFormat, ours: Mapping[str, tuple[int, ...]], stored: Mapping[str, tuple[int, ...]], *,
               aliases: Mapping[str, str], same: Callable[[str, str], bool], head_from_embedding: bool = False,
               what: str) -> dict[str, str]:
    """Our key -> the stored key it loads from, for every key of ``ours`` (our shapes) that is not a tied alias;
    else one ``ValueError("cannot load <what>: ...")`` listing every problem.

    * stored keys map to ours by ``fmt.ours`` (ignored buffers skipped); one that maps to no key of ours, or to a
      key another stored key already fills, is unexpected;
    * a key of ours with no stored tensor is missing, except a tied alias (``aliases``: a tied head is optional);
      with ``head_from_embedding`` an untied head with no stored tensor starts from the embedding's;
    * shapes are compared in transformers' layout (``fmt.hf_shape``); ``fmt.longer_rows`` keys may have more rows;
    * a tied alias whose stored copy differs from its target's (``same(stored_a, stored_b)``) is refused.
    """
    names: dict[str, str] = {}
    unexpected = []
    for key in stored:
        mine = fmt.ours(key)
        if mine is None:
            continue
        if mine in names or mine not in ours:
            unexpected.append(key)
        else:
            names[mine] = key
    head, emb = fmt.head, fmt.embedding
    if head_from_embedding and head in ours and head not in aliases and head not in names and emb in names:
        names[head] = names[emb]  # an untied model: its head starts from the embedding, as transformers' does
    missing = [k for k in ours if k not in names and k not in aliases]
    misshaped = []
    for key, theirs in names.items():
        want, got = fmt.hf_shape(key, ours[key]), tuple(stored[theirs])
        longer = key in fmt.longer_rows and len(got) == len(want) and got[0] >= want[0] and got[1:] == want[1:]
        if got != want and not longer:
            misshaped.append(f"{theirs}: expected {want}, got {got}")
    problems = ([f"missing keys: {missing}"] if missing else []) + \
               ([f"unexpected keys: {unexpected}"] if unexpected else []) + \
               ([f"mis-shaped keys (HF layout): {misshaped}"] if misshaped else [])
    option = f" ({fmt.tie_option}=True)" if fmt.tie_option else ""
    if head in missing and fmt.tie_option:
        problems.append(f"(a checkpoint without {head} has tied embeddings: use {fmt.tie_option}=True)")
    for alias, target in aliases.items():
        a, b = names.get(alias), names.get(target)
        if a is not None and b is not None and tuple(stored[a]) == tuple(stored[b]) and not same(a, b):
            problems.append(f"{alias} differs from {target}, but this model ties them{option}")
    if problems:
        raise ValueError(f"cannot load {what}:\n  " + "\n  ".join(problems))
    return {k: v for k, v in names.items() if k not in aliases}


__all__ = ["HFFormat", "TOKEN_IDS", "check_hf_sizes", "check_keys", "read_token_ids", "write_token_ids"]
