"""How the parallel layers run: one frozen options object a layout hands to every layer it builds.

None of it but ``float8`` changes the maths (results agree to rounding; the ring's ``double_buffer`` is
bit-identical). Each
layer reads the fields that concern it and ignores the rest, so one object serves every layout ("2d-metp" uses
both the SUMMA and the ring fields).

=================  ==========  =======================================================================================
field              default     meaning
=================  ==========  =======================================================================================
``summa``          collective  how a SUMMA product moves its panels (:mod:`lightning_tp2d.summa`): ``"collective"``
                               (activation panels as point-to-point ring transfers in both directions, each panel's
                               GEMM overlapped with the next transfer; weight blocks in one all-gather /
                               reduce-scatter) or ``"broadcast"`` (Optimus' ``q`` broadcasts / reduces per operand)
``keep_panels``    False       keep the activation panels the forward gathered for the weight gradient (no second
                               gather in backward; ``q`` times the input block of activation memory per linear)
``double_buffer``  True        ring layers post the next exchange before computing with the current block
``attention_kernel`` auto      ring attention's per-block kernel: ``"auto"`` (fused, returns the log-sum-exp) or
                               ``"math"`` (score tiles in plain torch)
``math_tile``      128         query rows per score tile of the ``"math"`` kernel
``ring_grad_dtype`` activation gradient sums travelling round a ring (weight blocks, K|V): ``"activation"`` (the
                               travelling operand's dtype: bf16 under autocast, each hop adding into a float32
                               contribution) or ``"float32"`` (float32 on the wire)
``tile_tokens``    8192        rows (tokens) per tile of the ring kernels whose per-step block is wider than the
                               hidden size: the LM head + cross-entropy (``[tile, V/p]`` logits per step instead of
                               ``[N, V/p]``) and the MLP when its hidden block ``F/p`` is wider than ``h``
                               (``[tile, F/p]``); forward and the recomputing backward. Same communication, results
                               equal to rounding. ``0`` or ``None``: untiled (one tile of all ``N`` rows)
``float8``         None        the linears' GEMMs in float8 by a torchao recipe: ``"tensorwise"`` or ``"rowwise"``
                               (:mod:`lightning_tp2d.float8`; the "2d" layout). This one *does* change the maths:
                               float8 rounding of the linears' operands
=================  ==========  =======================================================================================
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ATTENTION_KERNELS = ("auto", "math")
FLOAT8_RECIPES = ("tensorwise", "rowwise")  # torchao's recipe names (lightning_tp2d.float8)
RING_GRAD_DTYPES = ("activation", "float32")
SUMMA_ALGORITHMS = ("collective", "broadcast")


def check_float8(value) -> str | None:
    """``value`` as a float8 recipe name (``None``, ``"none"`` or ``False``: no float8); a clear error otherwise."""
    if value is None or value is False or value == "none":
        return None
    if value not in FLOAT8_RECIPES:
        raise ValueError(f"float8={value!r} is not one of None, {', '.join(map(repr, FLOAT8_RECIPES))}")
    return value


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


@dataclass(frozen=True)
class TPOptions:
    """Options of the tensor-parallel layers (module docstring). ``lightning_tp2d.RingOptions`` is this class."""

    summa: str = "collective"
    keep_panels: bool = False
    double_buffer: bool = True
    attention_kernel: str = "auto"
    math_tile: int = 128
    ring_grad_dtype: str = "activation"
    tile_tokens: int | None = 8192
    float8: str | None = None

    def wire_dtype(self, operand: torch.dtype) -> torch.dtype | None:
        """The dtype ring gradient sums of an ``operand``-typed block travel in (``None``: float32 / float64, the
        accumulation dtype)."""
        if self.ring_grad_dtype == "float32" or operand in (torch.float32, torch.float64):
            return None
        return operand

    def __post_init__(self) -> None:
        object.__setattr__(self, "float8", check_float8(self.float8))
        if self.summa not in SUMMA_ALGORITHMS:
            raise ValueError(f"summa={self.summa!r} is not one of {', '.join(map(repr, SUMMA_ALGORITHMS))}")
        _check_bool("keep_panels", self.keep_panels)
        _check_bool("double_buffer", self.double_buffer)
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(f"attention_kernel={self.attention_kernel!r} is not one of "
                             f"{', '.join(map(repr, ATTENTION_KERNELS))}")
        if self.ring_grad_dtype not in RING_GRAD_DTYPES:
            raise ValueError(f"ring_grad_dtype={self.ring_grad_dtype!r} is not one of "
                             f"{', '.join(map(repr, RING_GRAD_DTYPES))}")
        if isinstance(self.math_tile, bool) or not isinstance(self.math_tile, int) or self.math_tile < 1:
            raise ValueError(f"math_tile={self.math_tile!r} must be a positive int (query rows per score tile), "
                             f"e.g. 128")
        if self.tile_tokens is not None and (isinstance(self.tile_tokens, bool) or not isinstance(self.tile_tokens, int)
                                             or self.tile_tokens < 0):
            raise ValueError(f"tile_tokens={self.tile_tokens!r} must be a non-negative int (rows per tile of the "
                             f"ring cross-entropy and MLP; 0 or None: untiled), e.g. 8192")

    def row_tiles(self, rows: int) -> list[slice]:
        """The row tiles of ``rows`` rows (:attr:`tile_tokens` each, the last shorter; one slice of all when
        untiled). Static: decided by the shape alone."""
        tile = self.tile_tokens or rows
        return [slice(r, min(r + tile, rows)) for r in range(0, rows, max(tile, 1))] or [slice(0, rows)]


def tp_options(options: TPOptions | None) -> TPOptions:
    """``options``, or the defaults for ``None``; anything else is a ``TypeError``."""
    if options is None:
        return TPOptions()
    if not isinstance(options, TPOptions):
        raise TypeError(f"options must be a lightning_tp2d.TPOptions (alias RingOptions) or None, "
                        f"got {type(options).__name__}")
    return options


RingOptions = TPOptions  # the name the ring layers' options had before they served every layer
