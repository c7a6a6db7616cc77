"""Checks of the numbers a user sets: each names the setting, the value given and the values that would do.

One function, :func:`check_number`, for every numeric argument the package's classes take and every numeric key
of ``tp2d-train``'s configuration (:mod:`lightning_tp2d.run_values`): the classes call it in their constructors, so a
bad value fails where it is given (``CausalLMModule(learning_rate=-1e-3)``, ``tp2d-train module.learning_rate=-1e-3``
before any process starts), with the same words everywhere::

    learning_rate=-0.001 must be a number > 0 (the peak AdamW learning rate)

Floors: nothing of the package; plain Python.
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any

__all__ = ["check_number", "number_problem"]


def _text(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _interval(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{_text(low)}, {_text(high)}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {_text(low)}"
    if high is not None:
        return f"{'<' if high_open else '<='} {_text(high)}"
    return "finite"


def number_problem(name: str, value: Any, *, low: float | None = None, high: float | None = None,
                   low_open: bool = False, high_open: bool = False, integer: bool = False, optional: bool = False,
                   also: tuple = (), meaning: str = "", none: str = "null") -> str | None:
    """What is wrong with ``name=value``, or ``None`` when it is a finite number (an int when ``integer``) within
    ``low`` / ``high`` (excluded when ``*_open``); ``None`` passes when ``optional``; any value of ``also`` (e.g.
    ``-1`` for "no limit", ``"auto"``) passes as it is. ``meaning`` closes the message in brackets; ``none`` is how
    the message names ``None`` (``"null"`` in a config, ``"left out"`` for a command-line flag). A bool is not a
    number here (``True`` for a step count is a typo)."""
    if (value is None and optional) or any(value == ok and type(value) is type(ok) for ok in also):
        return None
    kind = "an int" if integer else "a number"
    wanted = f"{kind} {_interval(low, high, low_open, high_open)}"
    extras = [repr(ok) for ok in also] + ([none] if optional else [])
    if extras:
        wanted += " or " + " or ".join(extras)
    tail = f" ({meaning})" if meaning else ""
    is_number = isinstance(value, Integral if integer else Real) and not isinstance(value, bool)
    if not is_number or not math.isfinite(value):
        return f"{name}={value!r} must be {wanted}{tail}"
    if (low is not None and (value < low or (low_open and value == low))) or \
            (high is not None and (value > high or (high_open and value == high))):
        return f"{name}={value!r} must be {wanted}{tail}"
    return None


def check_number(name: str, value: Any, **rule: Any) -> None:
    """``ValueError`` with :func:`number_problem`'s message when ``value`` breaks ``rule``."""
    problem = number_problem(name, value, **rule)
    if problem:
        raise ValueError(problem)
