"""The memory a model's parameters alone take on one machine, and whether the machine has it: what ``tp2d-train``
refuses before any process starts (``model.n_layer=10000000`` otherwise grows every rank's meta model for minutes;
a width of 10**9 fails in torch's allocator, naming neither the setting nor the size).

:func:`parameter_count` is the model's own count in closed form in ``n_layer``: ``root + n_layer * block``, the root
(embeddings, final norm, an untied head) and one block counted on the meta device from the family's model with one
and two blocks (no memory, milliseconds, any registered family; tied weights count once).
:func:`parameter_memory_problem` prices them as the layouts hold them: ``bytes_per_parameter`` each (float32 master
weights: 4; :func:`parameter_bytes`), ``1/p`` of every matrix per rank of a tensor-parallel group, with ZeRO-3 ``1/dp``
of that again, times the processes on this machine. A lower bound (replicated vectors, vocabulary padding, gradients,
optimizer state and activations left out): a refusal is certain, a pass is no promise.

Floors: stands on :mod:`lightning_tp2d.families` (a config's model class); read by ``train``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from lightning_tp2d.families import family_of_config
from lightning_tp2d.safe_files import human_bytes


def _meta_count(cls: type, config: Any) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in cls(config).parameters())


def parameter_count(config: Any) -> int | None:
    """Parameters of the model of ``config`` (a registered family's; ``None`` otherwise), tied weights once:
    ``root + n_layer * block``, root and block counted on the meta device (module docstring)."""
    family = family_of_config(config)
    if family is None:
        return None
    layers = getattr(config, "n_layer", None)
    if not dataclasses.is_dataclass(config) or not isinstance(layers, int) or layers < 2:
        return _meta_count(family.model_class, config)
    one = _meta_count(family.model_class, dataclasses.replace(config, n_layer=1))
    block = _meta_count(family.model_class, dataclasses.replace(config, n_layer=2)) - one
    return one + (layers - 1) * block


def parameter_bytes(precision: str) -> tuple[int, str]:
    """``(bytes, dtype)`` of one parameter at rest under Lightning's ``precision``: float32 master weights (also
    under ``*-mixed``), bfloat16 / float16 under ``bf16-true`` / ``16-true``, float64 under ``64-true``."""
    precision = str(precision)
    if precision.startswith("64"):
        return 8, "float64"
    if precision in ("bf16-true", "16-true"):
        return 2, "bfloat16" if precision.startswith("bf") else "float16"
    return 4, "float32"


def physical_memory() -> int | None:
    """This machine's physical memory in bytes (``None`` where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def parameter_memory_problem(parameters: int, *, p: int, dp: int = 1, zero_stage: int = 0, processes: int,
                             available: int | None, bytes_per_parameter: int = 4, dtype: str = "float32",
                             zero_key: str = "parallel.zero_stage") -> str | None:
    """Why ``parameters`` cannot rest on this machine (``None``: they can, or ``available`` is unknown):
    ``processes x parameters x bytes_per_parameter / (p x (dp under ZeRO-3))`` bytes against ``available``, with the
    most parameters these settings hold and ZeRO-3 when it would fit (``zero_key``: how to ask for it)."""
    if available is None:
        return None
    shards = p * (dp if zero_stage >= 3 else 1)
    per_process = parameters * bytes_per_parameter / shards
    needed = per_process * processes
    if needed <= available:
        return None
    split = f" / p={p}" + (f" / dp={dp} (ZeRO-3)" if zero_stage >= 3 and dp > 1 else "")
    fit = available * shards // (processes * bytes_per_parameter)
    ways = "use a smaller model"
    if zero_stage < 3 and dp > 1 and needed / dp <= available:
        ways += (f", or {zero_key}=3 (the parameters sharded over the {dp} data-parallel replicas too: "
                 f"{human_bytes(needed / dp)})")
    return (f"the model's parameters alone need {human_bytes(needed)} of this machine's {human_bytes(available)} of "
            f"memory: {parameters:,} parameters x {bytes_per_parameter} bytes ({dtype}){split} = "
            f"{human_bytes(per_process)} per process x {processes} process{'' if processes == 1 else 'es'}; at most "
            f"{fit:,} parameters fit these settings: {ways}")


__all__ = ["parameter_bytes", "parameter_count", "parameter_memory_problem", "physical_memory"]
