"""What the model configs share: the checks of their fields (each failure a ``ValueError`` naming the field and
its value) and named sizes (``from_name``). Each config class is a dataclass that calls these checks in its
``__post_init__`` and lists its named sizes in ``NAMED`` (set below the class)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

# transformers' special-token fields, which our configs carry under the same names: where generation starts (bos),
# stops (eos; Llama 3 instruct stops at any of several) and what pads a batch (pad)
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def check_positive_ints(config: Any, names: tuple[str, ...]) -> None:
    """Each named field of ``config`` is a positive int (``bool`` is not)."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{type(config).__name__}.{name} must be a positive int, got {value!r}")


def check_divides(config: Any, whole: str, part: str, why: str = "") -> None:
    """``config.<part>`` divides ``config.<whole>`` (``why``: what the split is for, added to the message)."""
    a, b = getattr(config, whole), getattr(config, part)
    if a % b:
        raise ValueError(f"{whole}={a} is not divisible by {part}={b}; {whole} % {part} = {a % b}"
                         + (f" ({why})" if why else ""))


def check_dropout(dropout: float) -> None:
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")


def check_token_ids(config: Any) -> None:
    """Each special-token field of ``config`` (:data:`TOKEN_IDS`) is ``None`` or a token id of its vocabulary (an int
    in ``0 .. vocab_size - 1``); ``eos_token_id`` may also be a list of them, kept as a tuple (hashable, and plain
    data in a checkpoint; a YAML list arrives as a ListConfig)."""
    for name in TOKEN_IDS:
        value = getattr(config, name)
        if value is None:
            continue
        many = name == "eos_token_id" and isinstance(value, Sequence) and not isinstance(value, str)
        ids = list(value) if many else [value]
        if not ids or any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < config.vocab_size
                          for i in ids):
            what = "an int" + (", or a list of ints," if name == "eos_token_id" else "")
            raise ValueError(f"{type(config).__name__}.{name}={value!r} is not a token id of its vocabulary: {what} "
                             f"in 0..{config.vocab_size - 1} (vocab_size={config.vocab_size}), or None")
        setattr(config, name, tuple(ids) if many else value)


def max_seq_len(config: Any) -> int | None:
    """The longest sequence ``config``'s model runs: its ``max_seq_len`` (``None``: any length, as for RoPE), or
    ``block_size`` for a config without one (a learned position table has ``block_size`` rows)."""
    return getattr(config, "max_seq_len", config.block_size)


class NamedSizes:
    """``from_name``, ``max_seq_len`` and ``head_size`` for a config dataclass with ``n_embd``, ``n_head``,
    ``block_size`` and a ``NAMED`` table."""

    NAMED: ClassVar[dict[str, dict]] = {}
    KIND: ClassVar[str] = "model"  # how messages name the family ("GPT-2", "Llama")

    @classmethod
    def from_name(cls, name: str, **overrides):
        """A named size, e.g. ``GPT2Config.from_name("gpt2-tiny", dropout=0.1)``."""
        if name not in cls.NAMED:
            raise ValueError(f"unknown {cls.KIND} config {name!r}; valid names: {sorted(cls.NAMED)}")
        return cls(**{**cls.NAMED[name], **overrides})

    @property
    def max_seq_len(self) -> int | None:
        """The longest sequence the model runs: ``block_size`` (a learned position table has that many rows);
        ``None`` where any length runs, as for RoPE (a config class overrides this)."""
        return self.block_size  # type: ignore[attr-defined]

    @property
    def head_size(self) -> int:
        """hs = n_embd // n_head, the width of one attention head."""
        return self.n_embd // self.n_head  # type: ignore[attr-defined]
