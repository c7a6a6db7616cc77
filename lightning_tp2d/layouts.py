"""The layouts: how one transformer is cut over ``p`` ranks, one class each, and a registry by name.

A layout owns every rule that depends on it (docs/layouts.md, docs/architecture.md):

* the mesh: tensor axes (``row``/``col`` or ``ring``) after ``data_parallel``, their shape for ``(p, dp)``, and
  which tensor-parallel sizes are valid (square for the grids);
* what the model, the batch and the sequence must satisfy (the model's named sizes divisible by the grid side or
  the ring -- which sizes is the family's rule --, batch split over grid rows, sequences cut into zigzag chunks,
  dropout) -- each refusal a ``ValueError`` naming the numbers that do not fit and one that would;
* the options of the layers it is built with (:class:`~lightning_tp2d.metp.RingOptions` for the ring kernels);
* the handle a parallelized model carries (:class:`ParallelHandle`, ``model.tp``).

Which parallel module replaces which part of a model is the model family's plan, not the layout's
(:mod:`lightning_tp2d.families`), and so is the one answer to "does this size fit" and the automatic size
(:func:`~lightning_tp2d.families.fits`, :func:`~lightning_tp2d.families.auto_tensor_parallel_size`: the layout's
:meth:`Layout.size_problem`, then the family's sizes).

Layout names (``"2d"``, ``"metp"``, ``"2d-metp"``) appear in code only here and in the families' registrations
(``tests/test_layout_names.py`` walks the package for them); elsewhere a name is a user's input or an output, and
the default layout is :data:`DEFAULT_LAYOUT`.

Callers (``parallelize``, ``init_mesh``, the strategy, ``tp2d-train``'s checks, the LightningModule, the
benchmarks and the cost model) ask the layout object instead of comparing names. A new layout is a subclass with
``name`` and ``tensor_axes``, registered with :func:`register_layout` (and a plan in each family that trains with it:
:func:`~lightning_tp2d.families.register_plan`).

The bottom floor of the parallel code: nothing here imports the package (nor torch or Lightning at run time).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_tp2d.metp import RingOptions

DATA_AXIS = "data_parallel"


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _round_to(value: int, multiple: int) -> int:
    """The multiple of ``multiple`` nearest ``value`` from above (at least ``multiple``)."""
    return max(multiple, -(-value // multiple) * multiple)


class Layout:
    """Base class: one tensor-parallel layout. Instances carry the options of the layers they build."""

    name: ClassVar[str]
    tensor_axes: ClassVar[tuple[str, ...]]
    square: ClassVar[bool] = False  # p must be q*q (a grid); the side is then q, otherwise p
    arrangement: ClassVar[str] = "ring"  # what the ranks of one replica form, in messages: "grid" or "ring"
    side_symbol: ClassVar[str] = "p"  # how messages name the side ("q" on a grid)
    splits_batch: ClassVar[bool] = False  # the batch is split over the side (grid rows)
    zigzag: ClassVar[bool] = False  # sequences are cut into 2*side zigzag chunks
    supports_dropout: ClassVar[bool] = True
    packs_documents: ClassVar[bool] = False  # attention can keep inside each packed document (doc_ids)
    splits_heads: ClassVar[bool] = True  # heads are split over the side (else only the width must divide)
    # torch.compile of activation-checkpointed blocks works (torch 2.13's AOTAutograd fails to save the DTensor
    # parameters' metadata inside a checkpointed "2d" block)
    compiles_checkpointed: ClassVar[bool] = True
    float8_products: ClassVar[bool] = False  # its linears run options.float8 (lightning_tp2d.float8)

    def __init__(self, options: RingOptions | None = None) -> None:
        if options is not None and getattr(options, "float8", None) and not self.float8_products:
            runs = [name for name, cls in _REGISTRY.items() if cls.float8_products]
            raise ValueError(f"float8={options.float8!r} runs on the layouts {', '.join(map(repr, runs))}; layout "
                             f"{self.name!r} does not say its products run it (Layout.float8_products)")
        self.options = options

    def with_float8(self, recipe: str | None) -> Layout:
        """This layout with its linears' GEMMs in float8 by ``recipe`` (``None``: in high precision); ``self`` when
        its options already say so."""
        from lightning_tp2d.options import check_float8, tp_options

        options = tp_options(self.options)
        recipe = check_float8(recipe)
        if options.float8 == recipe:
            return self
        return type(self)(options=dataclasses.replace(options, float8=recipe))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, options={self.options!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.options == self.options  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), self.options))

    # ---- sizes and mesh ---------------------------------------------------------------------------------------

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return (DATA_AXIS, *self.tensor_axes)

    def size_problem(self, p: int) -> str | None:
        """Why ``p`` ranks cannot hold one replica in this layout (``None``: they can)."""
        if self.square and math.isqrt(p) ** 2 != p:
            near = sorted({math.isqrt(p) ** 2, (math.isqrt(p) + 1) ** 2})
            return (f"layout {self.name!r} needs a square tensor_parallel_size (q x q grid); {p} is not a perfect "
                    f"square (nearest: {near})")
        return None

    def check_tensor_parallel_size(self, p: int) -> None:
        problem = self.size_problem(p)
        if problem:
            raise ValueError(problem)

    def side(self, p: int) -> int:
        """The size of each tensor axis: ``q`` of a ``q x q`` grid, ``p`` of a ring."""
        return math.isqrt(p) if self.square else p

    def mesh_shape(self, p: int, dp: int = 1) -> tuple[int, ...]:
        return (dp, *(self.side(p),) * len(self.tensor_axes))

    def sizes_of_mesh(self, mesh: DeviceMesh) -> tuple[int, int]:
        """``(p, dp)`` of a mesh built for this layout; ``ValueError`` when its axes or shape do not fit."""
        names = tuple(mesh.mesh_dim_names or ())
        if names != self.mesh_dim_names:
            raise ValueError(f"layout {self.name!r} needs a mesh with axes {self.mesh_dim_names}, got {names}")
        shape = tuple(mesh.shape)
        tensor = shape[1:]
        if len(set(tensor)) > 1:
            sizes = " x ".join(f"{a}={s}" for a, s in zip(self.tensor_axes, tensor))
            raise ValueError(f"layout {self.name!r}: the mesh's tensor axes must be equal (square grid), got {sizes}")
        return math.prod(tensor), shape[0]

    def describe(self, p: int) -> str:
        """``"2x2 grid"`` / ``"ring of 4"``: how ``p`` ranks are arranged."""
        q = self.side(p)
        return f"{q}x{q} {self.arrangement}" if self.square else f"{self.arrangement} of {p}"

    # ---- the model, the batch, the sequence --------------------------------------------------------------------

    def split_problems(self, p: int, sizes: Iterable[tuple[str, int]], prefix: str = "") -> list[str]:
        """Each named size (``("n_head", 12)``, ...) that the side of ``p`` ranks does not divide, as the one message
        every check uses (``prefix``: how the sizes are named, e.g. ``"model."``). Which sizes a model splits is
        its family's rule (:meth:`~lightning_tp2d.families.ModelFamily.sizes`)."""
        q = self.side(p)
        return [f"{prefix}{name}={value} is not divisible by {self.side_symbol}={q}" for name, value in sizes
                if value % q]

    def dropout_problem(self, dropout: float, key: str = "dropout") -> str | None:
        """Why ``dropout`` cannot train in this layout (``None``: it can)."""
        if dropout and not self.supports_dropout:
            return f"{key}={dropout}: layout {self.name!r} does not support dropout; set {key}=0"
        return None

    def documents_problem(self, key: str = "pack_documents") -> str | None:
        """Why packed documents cannot train in this layout (``None``: they can)."""
        if not self.packs_documents:
            packing = document_layouts()
            return (f"{key}=true: layout {self.name!r} has no per-document attention; use one of {packing} (or one "
                    f"device), or set {key}=false")
        return None

    def check_sizes(self, p: int, sizes: Iterable[tuple[str, int]] | Mapping[str, int], dropout: float = 0.0) -> None:
        """``ValueError`` naming the numbers when a model with these named sizes cannot be split over ``p`` ranks
        (and the sides that would split them all), or its dropout cannot train here."""
        sizes = list(sizes.items() if isinstance(sizes, Mapping) else sizes)
        bad = self.split_problems(p, sizes)
        if bad:
            fits = _divisors(math.gcd(*(value for _, value in sizes)))
            raise ValueError(f"layout {self.name!r}: " + "; ".join(bad) + f"; use {self.side_symbol} in {fits}")
        problem = self.dropout_problem(dropout)
        if problem:
            raise ValueError(problem)

    def input_multiples(self, p: int) -> tuple[int, int]:
        """``(batch, sequence)`` multiples this layout's input must have on ``p`` ranks."""
        q = self.side(p)
        return (q if self.splits_batch else 1), (2 * q if self.zigzag else 1)

    def batch_problem(self, p: int, batch: int, key: str | None = None) -> str | None:
        """Why ``batch`` sequences cannot be split (``key``: the config key to name, e.g. ``data.batch_size``)."""
        multiple = self.input_multiples(p)[0]
        if batch % multiple == 0:
            return None
        label = f"{key}={batch}" if key else f"batch size {batch}"
        fix = f"{key}={_round_to(batch, multiple)}" if key else f"a multiple of {multiple}"
        return (f"{label} is not divisible by {self.side_symbol}={multiple} (layout {self.name!r} splits each batch "
                f"over the {multiple} grid rows); use {fix}")

    def sequence_problem(self, p: int, seq: int, key: str | None = None) -> str | None:
        """Why sequences of ``seq`` tokens cannot be cut (zigzag layouts need ``2 * side`` chunks)."""
        multiple = self.input_multiples(p)[1]
        if seq % multiple == 0:
            return None
        label = f"{key}={seq}" if key else f"sequence length {seq}"
        below, above = seq - seq % multiple, seq - seq % multiple + multiple  # the nearest lengths that divide
        named = [f"{key}={n}" if key else str(n) for n in (below, above) if n > 0]
        fix = (f"{named[0]} or {named[1]}, the nearest multiples of {multiple}" if below > 0 else
               f"{named[0]}, the shortest multiple of {multiple}")
        return (f"{label} is not divisible by 2*{self.side_symbol}={multiple} (layout {self.name!r} cuts every "
                f"sequence into {multiple} zigzag chunks); use {fix}")

    def check_input(self, p: int, batch: int | None = None, seq: int | None = None) -> None:
        """``ValueError`` when ``[batch, seq]`` token ids cannot be split over ``p`` ranks (checked before any
        communication; ``None`` skips a dimension)."""
        for problem in (None if batch is None else self.batch_problem(p, batch),
                        None if seq is None else self.sequence_problem(p, seq)):
            if problem:
                raise ValueError(problem)

    # ---- tracing ------------------------------------------------------------------------------------------------

    def distinct_ranks(self, p: int) -> list[int]:
        """Tensor-parallel ranks (``0..p-1``) whose step schedules can differ, one of each kind: the cost model traces
        only these (the default: every rank)."""
        return list(range(p))



class SquareGrid(Layout):
    """Base of the layouts on a ``q x q`` grid of ranks (axes ``row`` and ``col``)."""

    tensor_axes = ("row", "col")
    square = True
    arrangement = "grid"
    side_symbol = "q"


class Grid2D(SquareGrid):
    """``"2d"``: SUMMA on a ``q x q`` grid (docs/layouts.md, "2d"). Rows split the batch, columns the hidden size."""

    name = "2d"
    splits_batch = True
    compiles_checkpointed = False
    float8_products = True

    def distinct_ranks(self, p: int) -> list[int]:
        # Every rank runs the same SUMMA shapes; only the diagonal skips the LM head's mirror swap. First and last
        # row and column (the vocabulary's short last block) are kept for good measure.
        q = self.side(p)
        return sorted({0, min(1, p - 1), p - 1, p - q})


class Ring(Layout):
    """``"metp"``: the METP ring over ``p`` ranks (docs/layouts.md, "metp"). Ranks keep zigzag sequence chunks;
    weight blocks and K/V travel round the ring."""

    name = "metp"
    float8_products = True  # the ring kernels' GEMMs (lightning_tp2d.float8)
    tensor_axes = ("ring",)
    packs_documents = True
    zigzag = True
    supports_dropout = False
    splits_heads = False  # only the width must divide: weight and head blocks are column blocks (any head count)


class GridRing(SquareGrid):
    """``"2d-metp"``: the ``"2d"`` grid with rows splitting the *sequence* (zigzag); attention is a METP ring along
    ``row`` (docs/layouts.md, "2d-metp"), so batch 1 works."""

    name = "2d-metp"
    float8_products = True  # its linears are "2d"'s SUMMA products (the ring carries attention only)
    zigzag = True
    supports_dropout = False
    packs_documents = True

    def distinct_ranks(self, p: int) -> list[int]:
        # The attention ring along row sees different causal blocks at each row; diagonal vs off-diagonal as "2d".
        q = self.side(p)
        return sorted({r * q + c for r in range(q) for c in (r, (r + 1) % q)})


_REGISTRY: dict[str, type[Layout]] = {}


def register_layout(cls: type[Layout], *, override: bool = False) -> type[Layout]:
    """Make ``cls`` available by its ``name`` (usable as a class decorator)."""
    if not override and cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"layout {cls.name!r} is already registered ({_REGISTRY[cls.name].__name__})")
    _REGISTRY[cls.name] = cls
    return cls


def unregister_layout(name: str) -> None:
    _REGISTRY.pop(name, None)


for _cls in (Grid2D, Ring, GridRing):
    register_layout(_cls)


# Lightning strategy names (registered by ``import lightning_tp2d``) -> the layout each one trains with; the same
# names are tp2d-train's parallel= options (conf/parallel/<strategy name>.yaml).
STRATEGY_NAMES = {"tp2d": Grid2D.name, "metp": Ring.name, "tp2d_metp": GridRing.name}
DEFAULT_LAYOUT = Grid2D.name  # what init_mesh, parallelize and the strategies use when no layout is named


def layout_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def document_layouts() -> list[str]:
    """The registered layouts whose attention keeps inside each packed document, sorted."""
    return sorted(name for name, cls in _REGISTRY.items() if cls.packs_documents)


def strategy_name(layout: str | Layout) -> str:
    """The Lightning strategy name (and tp2d-train ``parallel=`` option) that trains with ``layout``."""
    name = get_layout(layout).name
    for strategy, trained in STRATEGY_NAMES.items():
        if trained == name:
            return strategy
    raise ValueError(f"layout {name!r} has no strategy name; named ones: {STRATEGY_NAMES}")


def get_layout(layout: str | Layout, options: RingOptions | None = None) -> Layout:
    """The :class:`Layout` for a name (or the object itself); ``options`` configure the ring kernels."""
    if isinstance(layout, Layout):
        if options is not None and options != layout.options:
            return type(layout)(options=options)
        return layout
    cls = _REGISTRY.get(layout) if isinstance(layout, str) else None
    if cls is None:
        raise ValueError(f"unknown layout {layout!r}; choose one of {list(_REGISTRY)}")
    return cls(options=options)


@dataclass(frozen=True)
class ParallelHandle:
    """What a parallelized model carries as ``model.tp``: its layout, mesh and sizes."""

    layout: Layout
    mesh: Any  # DeviceMesh
    tensor_parallel_size: int
    data_parallel_size: int

    @property
    def name(self) -> str:
        """The layout's name (what an "already parallelized" message names)."""
        return self.layout.name

    @property
    def input_multiples(self) -> tuple[int, int]:
        """``(batch, sequence)`` multiples the model's input must have."""
        return self.layout.input_multiples(self.tensor_parallel_size)


def handle_of(model: Any) -> ParallelHandle | None:
    """The :class:`ParallelHandle` of a parallelized model, ``None`` for a plain one."""
    handle = getattr(model, "tp", None)
    return handle if isinstance(handle, ParallelHandle) else None
