"""The rivals: the systems the package is measured and priced against, registered as objects like the layouts.

A :class:`Rival` answers what every part of the package used to ask of a name with ``if`` chains: on how many
ranks it runs and how it cuts them (:meth:`~Rival.split`), what input sizes it needs (:meth:`~Rival.input_multiples`),
which model families it runs (:attr:`~Rival.families`), whose code runs it (:attr:`~Rival.baseline`), whether the
planner enumerates it (:attr:`~Rival.planned`) or prices it on request (:attr:`~Rival.priced`), and whose measured
op counts price its host time (:attr:`~Rival.host_ops`). Its cost and memory model is its pricing in
:mod:`lightning_tp2d.planning.rival_models` (the arithmetic in :mod:`lightning_tp2d.planning.rivals`); its runnable
baseline is the bench harness's scenario (:mod:`lightning_tp2d.bench.runner`), built from :attr:`~Rival.baseline`.

Registered here (:func:`register_rival` adds more):

============  ======================================================================  ==========  ========
name          what runs                                                               ranks       families
============  ======================================================================  ==========  ========
``single``    the plain model on one device (the package's own ``GPT2`` / ``Llama``)   one         all
``hf``        transformers' ``GPT2LMHeadModel`` with the same weights                 one         GPT-2
``tp1d``      torch's 1-D TP (colwise / rowwise, loss parallel)                        ``p``       all
``tp1d-sp``   torch's 1-D TP + SP x FSDP2 (torchtitan's plan; the planner's baseline) ``p``       all
``cp``        torch's context parallelism x FSDP2                                      ``p``       Llama
``cp-tp``     torch's CP x 1-D TP + SP inside each CP rank (torchtitan's composition)   ``p``       Llama
``ulysses``   DeepSpeed's Ulysses SP + ALST's tiling x FSDP2                           ``p``       Llama
============  ======================================================================  ==========  ========

Names never collide with a layout's (:func:`register_rival` refuses one that does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_tp2d.layouts import layout_names


@dataclass(frozen=True)
class Rival:
    """One rival (module docstring). Frozen: a value, compared and hashed by its fields."""

    name: str
    title: str  # what runs, in a phrase
    baseline: str | None = None  # the module of the package that runs it (None: the plain model or transformers')
    one_device: bool = False  # runs one process whatever the ranks asked ("single", "hf")
    tensor_parallel: bool = False  # torch's 1-D TP over every one of its p ranks ("tp1d", "tp1d-sp")
    sequence_parallel: bool = False  # the residual stream sequence-sharded over its TP ranks ("tp1d-sp", "cp-tp")
    context_parallel: bool = False  # the sequence cut into 2 x (CP ranks) zigzag chunks, a ring of K/V ("cp", ...)
    inner_tensor_parallel: bool = False  # 1-D TP + SP inside each CP rank: cp_tp_size of its p ("cp-tp")
    ulysses: bool = False  # heads scattered by all-to-all over its p ranks, the sequence cut by p ("ulysses")
    families: tuple[str, ...] | None = None  # the model families it runs (None: every registered family)
    planned: bool = False  # plan() enumerates its rows beside the package's (the 1-D baseline)
    priced: bool = False  # price() takes it (a rival row)
    host_ops: str | None = None  # whose measured op counts price its host time (planning.host_cost); None: its own
    hf_weights: bool = False  # a transformers model loaded with the package's weights
    torchtitan: bool = False  # torchtitan runs it (the planner prints its settings for the rival's rows)

    def runs(self, family: str) -> bool:
        """Whether it runs models of the family named ``family``."""
        return self.families is None or family in self.families

    def split(self, p: int, cp_tp_size: int = 2) -> tuple[int, int]:
        """``(sequence ranks, tensor ranks)`` of ``p``: a CP rival's CP ranks and the 1-D TP ranks inside each
        (``cp_tp_size`` for ``"cp-tp"``, else 1); Ulysses ``(p, 1)``; 1-D TP ``(1, p)``; one device ``(1, 1)``."""
        if self.one_device:
            return 1, 1
        if self.context_parallel:
            inner = cp_tp_size if self.inner_tensor_parallel else 1
            return p // inner, inner
        if self.ulysses:
            return p, 1
        return 1, p

    def ranks(self, p: int) -> int:
        """The processes it runs on when ``p`` are asked for."""
        return 1 if self.one_device else p

    def input_multiples(self, p: int, cp_tp_size: int = 2) -> tuple[int, int]:
        """``(batch, sequence)`` multiples its input needs on ``p`` ranks: sequence parallelism and Ulysses split
        the sequence by ``p``; context parallelism cuts ``2 x (CP ranks)`` chunks (each rank's pair split again by
        the inner sequence parallelism of ``"cp-tp"``); the rest take any input."""
        if self.context_parallel:
            chunks = 2 * self.split(p, cp_tp_size)[0]
            return 1, chunks * p // math.gcd(chunks, p)
        if self.sequence_parallel or self.ulysses:
            return 1, p
        return 1, 1


_REGISTRY: dict[str, Rival] = {}


def register_rival(rival: Rival, *, override: bool = False) -> Rival:
    """Add ``rival`` to the registry (``override``: replace one of the same name); returns it."""
    if rival.name in layout_names():
        raise ValueError(f"rival {rival.name!r} would hide the layout of the same name")
    if rival.name in _REGISTRY and not override:
        raise ValueError(f"rival {rival.name!r} is already registered")
    _REGISTRY[rival.name] = rival
    return rival


def rival_names() -> tuple[str, ...]:
    """The registered rivals' names, in registration order."""
    return tuple(_REGISTRY)


def is_rival(name) -> bool:
    """Whether ``name`` (a string, or anything else) names a registered rival."""
    return isinstance(name, str) and name in _REGISTRY


def get_rival(name: str | Rival) -> Rival:
    """The registered rival named ``name`` (a :class:`Rival` is returned as it is); a ``ValueError`` naming the
    registered ones otherwise."""
    if isinstance(name, Rival):
        return name
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown rival {name!r}; registered: {list(_REGISTRY)}") from None


def rivals(**having) -> tuple[Rival, ...]:
    """The registered rivals whose fields equal ``having`` (``rivals(priced=True)``), in registration order."""
    return tuple(r for r in _REGISTRY.values() if all(getattr(r, k) == v for k, v in having.items()))


SINGLE = register_rival(Rival("single", "the plain model on one device", one_device=True))
HF = register_rival(Rival("hf", "transformers' GPT2LMHeadModel with the same weights", one_device=True,
                          families=("gpt2",), hf_weights=True, host_ops="single"))
TP1D = register_rival(Rival("tp1d", "torch's 1-D TP (colwise / rowwise, loss parallel)",
                            baseline="lightning_tp2d.baselines.tp1d", tensor_parallel=True))
TP1D_SP = register_rival(Rival("tp1d-sp", "torch's 1-D TP + SP x FSDP2 (torchtitan's plan)",
                               baseline="lightning_tp2d.baselines.tp1d", tensor_parallel=True, sequence_parallel=True,
                               planned=True, priced=True, torchtitan=True))
CP = register_rival(Rival("cp", "torch's context parallelism x FSDP2",
                          baseline="lightning_tp2d.baselines.context_parallel", context_parallel=True, families=("llama",), priced=True, torchtitan=True))
CP_TP = register_rival(Rival("cp-tp", "torch's context parallelism x 1-D TP + SP inside each CP rank, x FSDP2",
                             baseline="lightning_tp2d.baselines.context_parallel", context_parallel=True,
                             inner_tensor_parallel=True, sequence_parallel=True, families=("llama",), priced=True,
                             host_ops="cp", torchtitan=True))
ULYSSES = register_rival(Rival("ulysses", "DeepSpeed's Ulysses SP + ALST's tiling x FSDP2",
                               baseline="lightning_tp2d.baselines.ulysses", ulysses=True, families=("llama",),
                               priced=True, host_ops="single"))

__all__ = ["CP", "CP_TP", "HF", "Rival", "SINGLE", "TP1D", "TP1D_SP", "ULYSSES", "get_rival", "is_rival",
           "register_rival", "rival_names", "rivals"]
