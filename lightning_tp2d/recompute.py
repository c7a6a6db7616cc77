"""Selective activation recomputation: cheap, large tensors are saved for the backward as recipes, not values.

``checkpoint_activations(model, "selective")`` runs the model's forward inside :func:`saving_recipes`. Layers mark
the tensors that are cheap to rebuild from tensors the backward keeps anyway (:func:`mark`): LayerNorm outputs
(from the input, mean and reciprocal std the LayerNorm saves for its own backward: elementwise, no
communication), the GELU output (from the GELU input, which the GELU saves), and the mirrored LM-head block of
"2d" (one point-to-point exchange with the mirror rank). When autograd saves a marked tensor, or a view of one, or
a cast of one (:func:`follow`), a saved-tensor hook stores the recipe instead; the backward runs it when the
consumer (a SUMMA product, a ring kernel) unpacks its saved tensors. Matmul outputs and attention outputs stay
saved: recomputing them would cost a GEMM and its communication.

Recomputation repeats the forward's arithmetic exactly, so gradients are bit-identical. Outside
:func:`saving_recipes` :func:`mark` does nothing and no hook is installed.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch

Recipe = Callable[[], torch.Tensor]

_ACTIVE = False
_RECIPES: dict[int, tuple[weakref.ref, Recipe]] = {}


def active() -> bool:
    """Whether a forward under :func:`saving_recipes` is running."""
    return _ACTIVE


def _forget(key: int, ref: weakref.ref) -> None:
    entry = _RECIPES.get(key)
    if entry is not None and entry[0] is ref:
        del _RECIPES[key]


def mark(t: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """Record that ``recipe()`` rebuilds ``t`` exactly (while :func:`saving_recipes` is active); returns ``t``."""
    if _ACTIVE:
        _remember(t, recipe)
        base = t._base
        if base is not None and base.numel() == t.numel() and base.is_contiguous() and t.is_contiguous():
            # a whole-tensor view (``view_as``, ``reshape``): consumers' views of it have ``base`` as their base
            shape = base.shape
            _remember(base, lambda: recipe().view(shape))
    return t


def _remember(t: torch.Tensor, recipe: Recipe) -> None:
    key = id(t)
    ref = weakref.ref(t, lambda r, key=key: _forget(key, r))
    _RECIPES[key] = (ref, recipe)


def _own_recipe(t: torch.Tensor) -> Recipe | None:
    entry = _RECIPES.get(id(t))
    return entry[1] if entry is not None and entry[0]() is t else None


def recipe_for(t: torch.Tensor) -> Recipe | None:
    """A recipe that rebuilds ``t``: its own, or its base's followed by the same view, or ``None``."""
    recipe = _own_recipe(t)
    if recipe is not None:
        return recipe
    base = t._base
    if base is None:
        return None
    base_recipe = _own_recipe(base)
    if base_recipe is None:
        return None
    size, stride, offset = t.size(), t.stride(), t.storage_offset() - base.storage_offset()
    base_stride = base.stride()

    def view() -> torch.Tensor:
        full = base_recipe()
        if full.stride() != base_stride:
            raise RuntimeError(f"recomputed tensor has strides {full.stride()}, the saved one {base_stride}")
        return full.as_strided(size, stride, full.storage_offset() + offset)

    return view


def follow(new: torch.Tensor, old: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``new == fn(old)`` (a cast, a reshape into a copy): ``new`` gets a recipe when ``old`` can be rebuilt."""
    if _ACTIVE and new is not old:
        recipe = recipe_for(old)
        if recipe is not None:
            mark(new, lambda: fn(recipe()))
    return new


class _Saved:
    __slots__ = ("recipe",)

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe


_KEPT_OBSERVERS: list[Callable[[torch.Tensor], object]] = []


@contextlib.contextmanager
def observing_kept(fn: Callable[[torch.Tensor], object]) -> Iterator[None]:
    """Inside the block, ``fn(t)`` is called on every tensor that :func:`saving_recipes` keeps as it is (one with no
    recipe): what a tracer counts as saved under selective checkpointing."""
    _KEPT_OBSERVERS.append(fn)
    try:
        yield
    finally:
        _KEPT_OBSERVERS.remove(fn)


def _pack(t: torch.Tensor):
    recipe = recipe_for(t)
    if recipe is not None:
        return _Saved(recipe)
    for fn in _KEPT_OBSERVERS:
        fn(t)
    return t


def _unpack(saved) -> torch.Tensor:
    if not isinstance(saved, _Saved):
        return saved
    with torch.no_grad():
        return saved.recipe()


@contextlib.contextmanager
def saving_recipes() -> Iterator[None]:
    """Inside the block, marked tensors that autograd saves are stored as their recipes."""
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, True
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _ACTIVE = previous
        if not _ACTIVE:
            _RECIPES.clear()
