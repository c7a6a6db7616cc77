"""The tensor- and data-parallel sizes of a run: one resolver and one "nothing fits" message for both the
strategies (``TP2DStrategy`` / ``TP2DFabricStrategy``, named by their arguments) and ``tp2d-train`` (named by its
config keys).

:func:`resolve_sizes` turns ``tensor_parallel_size`` / ``data_parallel_size`` (each ``"auto"`` or an int) into
``(p, dp)`` for a job of ``per_node`` devices on each of ``nodes`` machines, or raises one ``ValueError`` naming the
numbers that do not fit and the sizes, device counts or keys that would. Every size check takes the family's one
path (:meth:`~lightning_tp2d.families.ModelFamily.problems`); a model that is not known yet (``config=None``: a
strategy built before its module) is checked by the layout alone. How a message names the settings is a
:class:`SizeNames`: :data:`ARGUMENTS` or :data:`CONFIG_KEYS`.

Floors: stands on :mod:`lightning_tp2d.families` and :mod:`lightning_tp2d.layouts`; read by ``core`` and ``train``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_tp2d.families import auto_tensor_parallel_size, default_sizes, family_of_config, fits, problems
from lightning_tp2d.layouts import Layout
from lightning_tp2d.values import check_number

LARGEST = 64  # the device counts a "sizes that fit" list looks through


@dataclass(frozen=True)
class SizeNames:
    """How a size message names the settings the user gave."""

    tensor: str  # the tensor-parallel size
    data: str  # the data-parallel size
    devices: str  # devices per machine
    nodes: str  # machines
    fallback: str  # how to ask for whole-model replicas
    model: str = ""  # prefix of the model's sizes (``"model."``)
    single: str | None = None  # how to train one plain model instead, if the front end has a way
    processes: str = "{devices}={per_node} x {nodes}={n} = {world} processes"  # the job's processes

    def world(self, per_node: int, nodes: int) -> str:
        """The processes of the job, in these names."""
        return self.processes.format(devices=self.devices, nodes=self.nodes, per_node=per_node, n=nodes,
                                     world=per_node * nodes)


ARGUMENTS = SizeNames("tensor_parallel_size", "data_parallel_size", "devices", "num_nodes", "allow_fallback=True",
                      processes="world size {world} ({n} node(s) x {per_node} devices)")
CONFIG_KEYS = SizeNames("parallel.tensor_parallel_size", "parallel.data_parallel_size", "trainer.devices",
                        "trainer.num_nodes", "parallel.allow_fallback=true", model="model.",
                        single="parallel=single with trainer.devices=1")


def size_problem(layout: Layout, p: int, config: Any = None, prefix: str = "") -> str | None:
    """Why ``p`` ranks of ``layout`` cannot hold one replica of ``config``, in one line (``None``: they can)."""
    return "; ".join(problems(layout, p, config, prefix)) or None


def fitting_sizes(layout: Layout, world: int, config: Any = None) -> list[int]:
    """The tensor-parallel sizes that divide ``world`` and fit ``layout`` and ``config``."""
    return [p for p in range(1, world + 1) if world % p == 0 and size_problem(layout, p, config) is None]


def stage_devices(pp: int, per_node: int, nodes: int, names: SizeNames = ARGUMENTS) -> tuple[int, int]:
    """``(per_node, nodes)`` of one of ``pp`` pipeline stages of a job of ``per_node x nodes`` devices (the
    ``pipeline`` axis is the mesh's outermost: a stage is a run of consecutive ranks): whole machines when ``pp``
    divides the machines, else a ``1/pp`` share of the one machine. A ``ValueError`` naming the numbers otherwise
    (a stage split over parts of several machines would put its tensor-parallel groups across them)."""
    if pp == 1:
        return per_node, nodes
    if nodes % pp == 0:
        return per_node, nodes // pp
    if nodes == 1 and per_node % pp == 0:
        return per_node // pp, 1
    raise ValueError(f"pipeline_parallel_size={pp} must divide the {names.world(per_node, nodes)}: "
                     + (f"it divides neither {names.nodes}={nodes} nor, on one machine, {names.devices}={per_node}"
                        if nodes > 1 else f"{names.devices}={per_node} is not a multiple of {pp}"))


def resolve_sizes(layout: Layout, config: Any, per_node: int, nodes: int, tensor: int | str = "auto",
                  data: int | str = "auto", *, allow_fallback: bool = False,
                  names: SizeNames = ARGUMENTS) -> tuple[int, int]:
    """``(p, dp)`` for ``tensor`` / ``data`` (``"auto"`` or a positive int) on ``per_node x nodes`` devices, or a
    ``ValueError`` naming the numbers (module docstring). Both ``"auto"``: the largest ``p`` inside one machine
    that fits (:func:`~lightning_tp2d.families.auto_tensor_parallel_size`); ``p = 1`` on more than one device is
    refused unless ``allow_fallback`` (whole-model replicas are asked for, not fallen into)."""
    for key, value in ((names.tensor, tensor), (names.data, data)):
        check_number(key, value, low=1, integer=True, also=("auto",), meaning="processes; auto: chosen to fit")
    world = per_node * nodes
    here = names.world(per_node, nodes)
    fitting = fitting_sizes(layout, world, config)
    if tensor == "auto" and data == "auto":
        p = auto_tensor_parallel_size(layout, per_node, world, config)
        if p == 1 and world > 1 and not allow_fallback:
            raise ValueError(no_fit_message(layout, config, per_node, nodes, names))
    elif tensor == "auto":
        if world % int(data):
            raise ValueError(f"{names.data}={data} does not divide the {here}; use one of "
                             f"{[d for d in range(1, world + 1) if world % d == 0]}")
        p = world // int(data)
    else:
        p = int(tensor)
    problem = size_problem(layout, p, config, names.model)
    if problem:
        raise ValueError(f"{names.tensor}={p}: {problem}; sizes that fit this model on {world} processes: "
                         f"{names.tensor} in {fitting}")
    if world % p:
        more = p * -(-per_node // p) if nodes == 1 else p
        raise ValueError(f"{names.tensor}={p} needs a multiple of {p} processes, but {here}; use "
                         f"{names.devices}={more}, or {names.tensor} in {fitting}")
    if data != "auto" and p * int(data) != world:
        raise ValueError(f"{names.data}={data} x {names.tensor}={p} = {p * int(data)} processes, but {here}; use "
                         f"{names.data}={world // p} (or auto)")
    return p, world // p


def no_fit_message(layout: Layout, config: Any, per_node: int, nodes: int, names: SizeNames = ARGUMENTS) -> str:
    """Why ``tensor_parallel_size: auto`` found no replica larger than one device, and the device counts, sizes
    and settings that would fit (training whole-model replicas instead has to be asked for)."""
    world = per_node * nodes
    family = family_of_config(config) if config is not None else None
    if config is None:
        needs = ""
    else:
        split = family.sizes(config, layout) if family is not None else default_sizes(config, layout)
        named = [f"{names.model}{name}={value}" for name, value in split]
        needs = " and ".join([", ".join(named[:-1]), named[-1]] if len(named) > 1 else named)
    why = f"layout {layout.name!r} needs a " + (
        ("q x q grid" + (f", q dividing {needs}" if needs else "")) if layout.square else
        ("ring" + (f" whose size divides {needs}" if needs else "")))
    sizes = [p for p in range(2, LARGEST + 1) if fits(layout, p, config)][:3]
    ways = []
    if sizes:
        shapes = ", ".join(layout.describe(p) for p in sizes)
        ways.append(f"{names.devices}={', '.join(map(str, sizes))} (or a multiple: data-parallel replicas of a "
                    f"{shapes})")
    else:
        ways.append(f"a model that splits (no {layout.arrangement} up to {LARGEST} devices fits this one)")
    spanning = max(fitting_sizes(layout, world, config))
    if spanning > 1:
        ways.append(f"{names.tensor}={spanning} (replicas spanning machines)")
    ways.append(f"{names.fallback} to train {world} data-parallel replicas of the whole model")
    if names.single:
        ways.append(names.single)
    return (f"{names.tensor}=auto: no {layout.arrangement} larger than 1 fits {names.devices}={per_node} per machine "
            f"({why}). Use " + "; or ".join(ways))


__all__ = ["ARGUMENTS", "CONFIG_KEYS", "SizeNames", "fitting_sizes", "no_fit_message", "resolve_sizes", "stage_devices",
           "size_problem"]
