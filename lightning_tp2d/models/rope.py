"""Rotary position embedding (RoPE) as transformers' Llama computes it, plain or with Llama 3.1's frequency scaling.

A :class:`RoPE` describes the embedding: the base ``theta`` and, for ``rope_type="llama3"``, the scaling fields of
transformers' ``rope_parameters`` / ``rope_scaling``. :func:`rope_inv_freq` gives the ``hs/2`` inverse
frequencies, :func:`rope_cache` the cos/sin rows of any positions and :func:`apply_rope` rotates a head by them.

Plain RoPE: ``f_i = theta^(-2i/hs)`` for ``i < hs/2``. Llama 3.1 / 3.2 (``"llama3"``) rescale them by wavelength
``w_i = 2 pi / f_i`` against the pre-training context ``L = original_max_position_embeddings``:

* ``w_i < L / high_freq_factor`` (high frequencies): ``f_i`` unchanged;
* ``w_i > L / low_freq_factor`` (low frequencies): ``f_i / factor``;
* in between: ``(1 - s) f_i / factor + s f_i`` with ``s = (L / w_i - low_freq_factor) / (high_freq_factor -
  low_freq_factor)``, which joins the two ends continuously.

Computed in float32 with transformers' operations in transformers' order, so the frequencies (and the cos/sin) are
bit-identical to its ``_compute_llama3_parameters``. The scaling needs no attention factor (it is 1). RoPE has no
parameters and no table: every position has its rows, so a RoPE model accepts sequences of any length.

Floors: torch only; nothing of the package.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

# Fields of each scaling type, as transformers names them in rope_parameters (besides rope_type and rope_theta).
SCALING_FIELDS = {"default": (), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                           "original_max_position_embeddings")}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class RoPE:
    """One RoPE: base ``theta`` and the scaling (``rope_type`` ``"default"``: none; ``"llama3"``: the four fields
    of the module docstring, ``None`` otherwise). Build it from a config's ``rope_scaling`` dict with
    :meth:`from_scaling`, which checks every field."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None

    @classmethod
    def from_scaling(cls, theta: float, scaling: Mapping[str, Any] | None, what: str = "rope_scaling") -> "RoPE":
        """The RoPE of base ``theta`` with ``scaling`` (``None``, or a dict with ``rope_type`` and that type's
        fields, e.g. ``{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}``). A ``ValueError`` names an unknown type (and the supported
        ones), a missing or unknown field, or a value that does not fit; ``what`` names the setting in it."""
        if scaling is None:
            return cls(float(theta))
        if not isinstance(scaling, Mapping):
            raise ValueError(f"{what} must be a dict with a rope_type, or None, got {scaling!r}")
        rope_type = scaling.get("rope_type")
        if rope_type not in SCALING_FIELDS:
            raise ValueError(f"{what}: rope_type={rope_type!r} is not supported; supported: "
                             f"{', '.join(map(repr, SCALING_FIELDS))} (or {what}=None for plain RoPE)")
        fields = SCALING_FIELDS[rope_type]
        missing = [name for name in fields if name not in scaling]
        unknown = sorted(str(name) for name in scaling if name != "rope_type" and name not in fields)
        if missing or unknown:
            raise ValueError(f"{what} of rope_type {rope_type!r}: " + "; ".join(
                ([f"missing {missing}"] if missing else []) + ([f"unknown {unknown}"] if unknown else []))
                + f" (its fields: {list(fields) or 'none'})")
        if rope_type == "default":
            return cls(float(theta))
        bad = [f"{name}={scaling[name]!r}" for name in fields if not _number(scaling[name])]
        if bad:
            raise ValueError(f"{what}: {', '.join(bad)} (need numbers)")
        factor, low, high = (float(scaling[name]) for name in fields[:3])
        original = scaling["original_max_position_embeddings"]
        if factor <= 0 or low <= 0:
            raise ValueError(f"{what}: factor={factor} and low_freq_factor={low} must be positive")
        if high <= low:
            raise ValueError(f"{what}: high_freq_factor={high} must exceed low_freq_factor={low} (the band between "
                             f"them is interpolated)")
        if original != int(original) or original <= 0:
            raise ValueError(f"{what}: original_max_position_embeddings={original!r} must be a positive integer")
        return cls(float(theta), rope_type, factor, low, high, int(original))

    @property
    def scaling(self) -> dict[str, Any] | None:
        """The scaling as a ``rope_scaling`` dict (``rope_type`` first), or ``None`` for plain RoPE."""
        if self.rope_type == "default":
            return None
        return {"rope_type": self.rope_type, **{name: getattr(self, name) for name in SCALING_FIELDS[self.rope_type]}}


def _as_rope(rope: RoPE | float) -> RoPE:
    return rope if isinstance(rope, RoPE) else RoPE(float(rope))


def rope_inv_freq(head_size: int, rope: RoPE | float, device: torch.device | str | None = None) -> torch.Tensor:
    """Float32 inverse frequencies ``(hs/2,)``: ``theta^(-2i/hs)``, rescaled for ``"llama3"`` (module docstring).
    ``rope``: a :class:`RoPE`, or a number for plain RoPE of that base."""
    rope = _as_rope(rope)
    exponents = torch.arange(0, head_size, 2, dtype=torch.int64, device=device).to(torch.float32) / head_size
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.rope_type != "llama3":
        return inv_freq
    factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    context = rope.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)  # low frequencies: / factor
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < context / high) * ~(wavelen > context / low)
    return torch.where(medium, smoothed, scaled)


def rope_cache(positions: int | torch.Tensor, head_size: int, rope: RoPE | float,
               device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), float32, of shape ``(T, hs)`` for positions ``0 .. T-1`` (``positions`` an int T), or
    ``positions.shape + (hs,)`` for a tensor of absolute positions (any integer tensor, e.g. a zigzag chunk's;
    ``device`` is then the tensor's). Each row depends only on its position, so rows equal those of a longer cache.
    ``rope``: as in :func:`rope_inv_freq`."""
    if not isinstance(positions, torch.Tensor):  # an int (or a SymInt under torch.compile)
        positions = torch.arange(positions, device=device)
    freqs = positions[..., None].to(torch.float32) * rope_inv_freq(head_size, rope, positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)  # (..., hs): feature i and i + hs/2 share a frequency
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last dimension (halves of a head)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               positions: torch.Tensor | None = None) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin for x of shape (B, heads, T, hs), in x's dtype.

    ``cos`` / ``sin`` from :func:`rope_cache`: ``(T_cache, hs)`` rows per position or ``(B, T, hs)`` per sequence.
    With ``positions`` (``(T,)`` or ``(B, T)`` integer indices) the rows for those positions are gathered from a
    ``(T_cache, hs)`` cache; without, the first T rows are used (a longer cache serves shorter sequences)."""
    T = x.size(-2)
    if positions is not None:
        cos, sin = cos[positions], sin[positions]
    elif cos.dim() == 2:
        if cos.size(0) < T:
            raise ValueError(f"RoPE cache has {cos.size(0)} positions, the sequence {T}")
        cos, sin = cos[:T], sin[:T]
    if cos.dim() == 3:  # (B, T, hs) -> (B, 1, T, hs), broadcast over heads
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


__all__ = ["RoPE", "SCALING_FIELDS", "apply_rope", "rope_cache", "rope_inv_freq", "rotate_half"]
