"""The numeric keys of ``tp2d-train``'s configuration that no class of the package owns, each with its rule.

``tp2d-train`` checks every number a user can set before any process starts (one line, exit 2, nothing on disk).
Most are checked by the class that takes them, when ``tp2d-train`` builds it in the launching process:
``module.*`` by :class:`~lightning_tp2d.module.CausalLMModule`, ``data.*`` by
:class:`~lightning_tp2d.data.TextDataModule`, ``parallel.*`` by the strategy and the size resolver, ``model.*`` by
the model configs, ``callbacks.*`` by the callbacks (Lightning's ``ModelCheckpoint`` checks its own). The rest are
Lightning's ``Trainer`` arguments, which Lightning checks late or not at all (``trainer.gradient_clip_val=-1``
trained in four processes, ``trainer.accumulate_grad_batches=0`` failed in each of them), the generated sample's
settings, the seed and Lightning's loggers and early stopping: their rules are :data:`RULES`, checked by
:func:`check_run_values`.

Floors: the value checks, the sampling rule (:func:`lightning_tp2d.module.check_sampling`) and OmegaConf.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_tp2d.module import check_sampling
from lightning_tp2d.values import number_problem

__all__ = ["RULES", "check_run_values", "run_value_problem"]

SEED_MAX = 2**32 - 1  # Lightning's seed_everything (and numpy's) range


def _steps_or_fraction(key: str, value: Any, meaning: str, zero: bool = False) -> str | None:
    """An int (>= 1, or >= 0 when ``zero``) counts batches or steps; a float in (0, 1] (or [0, 1]) is a fraction
    of an epoch, as Lightning reads these keys."""
    if isinstance(value, float):
        return number_problem(key, value, low=0, high=1, low_open=not zero, meaning=meaning)
    return number_problem(key, value, low=0 if zero else 1, integer=True, meaning=meaning)


def _rule(**rule: Any) -> Callable[[str, Any], str | None]:
    return lambda key, value: number_problem(key, value, **rule)


# key -> (key, value) -> problem or None. Keys absent from a composed config (a logger or callback not chosen) are
# skipped.
RULES: Mapping[str, Callable[[str, Any], str | None]] = {
    "seed": _rule(low=0, high=SEED_MAX, integer=True, meaning="seeds the weights and the data order"),
    "trainer.max_steps": _rule(low=1, integer=True, also=(-1,), meaning="optimizer steps to train for; -1: no limit"),
    "trainer.max_epochs": _rule(low=1, integer=True, also=(-1,), optional=True,
                                meaning="epochs to train for; -1 or null: trainer.max_steps decides"),
    "trainer.val_check_interval": lambda k, v: None if v is None else _steps_or_fraction(
        k, v, "validate every N steps, or a fraction of an epoch"),
    "trainer.check_val_every_n_epoch": _rule(low=1, integer=True, optional=True,
                                             meaning="validate every N epochs; null: by val_check_interval"),
    "trainer.limit_val_batches": lambda k, v: _steps_or_fraction(
        k, v, "validation batches per check, or a fraction of them; 0: no validation", zero=True),
    "trainer.num_sanity_val_steps": _rule(low=0, integer=True, also=(-1,),
                                          meaning="validation batches before training; -1: all"),
    "trainer.log_every_n_steps": _rule(low=1, integer=True, meaning="write train_loss every N steps"),
    "trainer.gradient_clip_val": _rule(low=0, optional=True, meaning="the global gradient norm's limit; 0 or null: "
                                                                     "no clipping"),
    "trainer.accumulate_grad_batches": _rule(low=1, integer=True, meaning="micro-batches per optimizer step"),
    "trainer.devices": _rule(low=1, integer=True, also=(-1, "auto"), meaning="processes per machine; -1 or auto: "
                                                                             "every device"),
    "trainer.num_nodes": _rule(low=1, integer=True, meaning="machines"),
    "logger.csv.flush_logs_every_n_steps": _rule(low=1, integer=True, meaning="write metrics.csv every N steps"),
    "callbacks.early_stopping.patience": _rule(low=0, integer=True,
                                               meaning="validations without improvement before training stops"),
    "callbacks.early_stopping.min_delta": _rule(low=0, meaning="the least improvement that counts"),
}


_ABSENT = object()


def run_value_problem(cfg: DictConfig) -> str | None:
    """The first problem among :data:`RULES` and the ``sample.*`` keys of the composed config ``cfg``, or ``None``
    (a key the config does not have is skipped)."""
    for key, rule in RULES.items():
        value = OmegaConf.select(cfg, key, default=_ABSENT)
        if value is _ABSENT or (key == "trainer.devices" and isinstance(value, (str, list)) and value != "auto"):
            continue  # (devices "0,1" or [0, 1]: Lightning's own parser reads and checks them)
        problem = rule(key, value)
        if problem:
            return problem
    sample = [OmegaConf.select(cfg, f"sample.{name}", default=_ABSENT) for name in ("max_new_tokens", "temperature",
                                                                                    "top_k")]
    if _ABSENT in sample:
        return None
    try:
        check_sampling(*sample, names=("sample.max_new_tokens", "sample.temperature", "sample.top_k"))
    except ValueError as err:
        return str(err)
    return None


def check_run_values(cfg: DictConfig) -> None:
    """``ValueError`` with :func:`run_value_problem`'s message, if any."""
    problem = run_value_problem(cfg)
    if problem:
        raise ValueError(problem)
