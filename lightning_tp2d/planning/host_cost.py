"""The host's price of a micro-batch: the aten ops one rank dispatches, times the host seconds an op costs.

An eager GPU step runs ahead of the GPU only while the host issues kernels faster than the GPU runs them: the step
takes ``max(host, GPU)``. On one H200 (2026-12-04, ``recipes/results/layer_overhead_h200.json``: GPT-2 medium, B8 x
1024, one rank, no communication) the plain model's host spent 0.068 s a step beside 0.073 s of GPU kernels, while
the layouts' own layers spent 0.17-0.26 s of host a step: host-bound at 0.31-0.53x the plain model's speed. (That
run counted 13.6-33.3k profiler events a step; the same steps dispatch 3.0-9.3k aten ops, the unit here.) Each
row's micro-batch is ``max(GPU seconds, host seconds)`` (issue 48, part 5):

* **ops**, per rank and micro-batch, forward (with the loss) and backward apart, measured on CPU by
  :func:`lightning_tp2d.bench.layer_cost.rank_phase_ops` (torch 2.13.0; ops are what the code dispatches, the same
  on any device): one- and two-block models give the ops of a block and of the rest (embedding, head, loss), at
  grids of side 2, 3 and 4 and rings of 2, 4 and 8 (:data:`MEASURED_OPS`); other sizes are interpolated (a grid's
  ops grow linearly with its side: ``q`` SUMMA panels per product) and extrapolated from the last two. ``"full"``
  checkpointing runs each block's forward again; ``"selective"``'s recomputed recipes (a few elementwise ops a block)
  are not counted. Shapes move the counts a little (the SUMMA streams a weight column past a size, the ring MLP
  tiles rows past ``tile_tokens``): two shapes of the ring of 4 differed by 13%. torch's context parallelism is a
  ring too (a kernel call and a merge per ring step): it is counted at rings of 2, 4 and 8 and priced at its own CP
  degree (``ring``); torch's 1-D TP + SP at 4 ranks, for every size;
* **host seconds per op**: the plain model's, :data:`PLAIN_SECONDS_PER_OP` (23 us: an op's whole host cost,
  autograd, Python, the kernel launch; the H200 run), times each side's measured ratio to it
  (:func:`seconds_per_op`; ``host_ops.json``'s ``cpu_rates``, ``recipes/benchmarks/host_ops.py --rates``): on CPU,
  rank 0 alone on torch's fake process group, the thread's CPU seconds of a micro-batch over its ops against the plain
  model's, in one process, at an overhead-bound shape (B2 x 32). The ratios are taken at one rank (the layouts'
  size-1 form, ``p`` 1) and at four (a 2x2 grid, a ring of 4, the rivals), and the four-rank ratio prices every
  larger size. The host's work is the same code on any device; its speed is the H200 host's. (The H200's own
  per-layout rates, 24-35 us an op, were of the layers before issue 48's changes and are kept in the table only as
  a record.) A rival with no ops of its own (:attr:`~lightning_tp2d.rivals.Rival.host_ops`) takes its stand-in's
  ratio;
* **compiled**: what a compiled micro-batch costs the host beyond the compiled plain model's, measured the same way
  (torch's inductor on CPU, the plain model's own compiled host cost taken as none: the kernel launches of every
  side are left out). torch's 1-D TP + SP is compiled block by block, as torchtitan does; its DTensor code between
  the blocks stays. The layouts' registered ops stay opaque and run their ops eagerly inside the graph. torch's
  context parallelism is not compiled by the harness, so its compiled host is priced at none, the figure most
  favourable to it (and DeepSpeed-Ulysses, counted as the plain model, likewise).

The AdamW step (once per step, fused) is not counted.

The same table holds what each side's layers move through memory beyond what the planner's elementwise model of it
says (``memory_bound``, ``recipes/benchmarks/host_ops.py --bytes``): the memory-bound bytes per token of a block on
one rank, counted on CPU (float32, exact; each layout and torch's CP at the grid sides and ring lengths their ops are
counted at, torch's 1-D TP + SP on four ranks), over the bytes per token the side's elementwise model prices (the
traced layouts' saved activations; the rivals' :func:`~lightning_tp2d.planning.rival_models.elementwise_bytes`), as
a quotient of the plain model's. :func:`memory_bound_ratio` is the factor the planner multiplies the side's
elementwise bytes by (:func:`lightning_tp2d.planning.planner.price`): a ring (METP's, torch's CP) merges every
block's partial output and sums the travelling K|V gradients once per ring step, which its saved activations do not
show, and torch's 1-D TP + SP copies each reduce-scatter's chunks into one buffer. Bytes that do not grow with the
tokens (the weights' traffic: the ring's weight-gradient accumulation per step, FSDP's copies in and out) are not
priced, on any side.
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path

from lightning_tp2d.families import family_of_config
from lightning_tp2d.layouts import get_layout, layout_names
from lightning_tp2d.rivals import SINGLE, get_rival, is_rival

# The measurements (host_ops.json beside this module, with how each was taken): the plain model's host seconds per
# aten op (an op as OpCounter counts it: every dispatch but the collectives) from the H200 run; per rank the
# (forward, backward) ops of a micro-batch with one block and with two, by axis size (a grid's side, a ring's length,
# torch's CP degree; torch's 1-D TP + SP's at 4 ranks); each side's host seconds per op against the plain model's,
# eager and compiled, at one rank and at four (cpu_rates).
_DATA = json.loads((Path(__file__).parent / "host_ops.json").read_text())
_RATES = _DATA["seconds_per_op"]
_PLAIN = "plain"
PLAIN_SECONDS_PER_OP = _RATES["host_s_per_step"][_PLAIN] / _RATES["aten_ops_per_step"][_PLAIN]
CPU_RATES = {mode: _DATA["cpu_rates"][mode] for mode in ("eager", "compiled")}
MEMORY_BOUND = {family: {side: {int(k): entry["ratio"] for k, entry in sizes.items()} for side, sizes in table.items()}
                for family, table in _DATA["memory_bound"]["families"].items()}
MEASURED_OPS = {family: {name: {int(k): (tuple(one), tuple(two)) for k, (one, two) in points.items()}
                         for name, points in table.items()}
                for family, table in _DATA["ops"]["counts"].items()}


def _counted_as(name: str) -> str:
    """Whose measured counts price the rival ``name``: its :attr:`~lightning_tp2d.rivals.Rival.host_ops` (those
    with no count of their own: DeepSpeed-Ulysses runs the plain model's ops between its all-to-alls, cp-tp as cp),
    else its own; a rival a family has no count for (GPT-2 has no CP baseline of torch's) takes the plain model's."""
    return (get_rival(name).host_ops or name) if is_rival(name) else name


def _line(points: dict[int, tuple[float, ...]], k: int) -> tuple[float, ...]:
    """The measured ``points`` (axis size -> values) at axis size ``k``: interpolated linearly between the two
    around it, extrapolated from the nearest two outside them."""
    ks = sorted(points)
    if len(ks) == 1 or k in points:
        return points[k if k in points else ks[0]]
    i = min(max(bisect.bisect(ks, k), 1), len(ks) - 1)  # the segment holding k, or the end one nearest it
    lo, hi = ks[i - 1], ks[i]
    t = (k - lo) / (hi - lo)
    return tuple(x + t * (y - x) for x, y in zip(points[lo], points[hi]))


def _at(points: dict[int, tuple], k: int) -> tuple[float, float, float, float]:
    """``(fixed forward, fixed backward, block forward, block backward)`` at axis size ``k`` (:func:`_line` over
    the measured one- and two-block counts)."""
    def split(pair):
        (f1, b1), (f2, b2) = pair
        return (2 * f1 - f2, 2 * b1 - b2, f2 - f1, b2 - b1)

    return _line({size: split(pair) for size, pair in points.items()}, k)


def _points(table: dict, layout: str, p: int, ring: int | None) -> tuple[dict, int]:
    """``(measured points, axis size)`` of ``layout`` on ``p`` ranks in a :data:`MEASURED_OPS` or
    :data:`MEMORY_BOUND` family table: a layout's by its axis size (a grid's side, a ring's length); a rival's by its
    ring's length ``ring`` (torch's CP degree; ``None``: all ``p`` ranks) where it was counted at several, else its
    one count (torch's 1-D TP + SP at 4 ranks; a rival with no count of its own, the plain model's)."""
    if layout in layout_names():
        return table[layout], get_layout(layout).side(p)
    points = table.get(_counted_as(layout), table[SINGLE.name])
    return points, ((p if ring is None else ring) if len(points) > 1 else min(points))


def micro_batch_ops(layout: str, cfg, p: int, checkpointing: str = "none", ring: int | None = None) -> float:
    """Aten ops one rank dispatches for one micro-batch (forward with the loss, backward, ``"full"``'s recomputed
    forwards) of ``cfg`` (its ``n_layer`` blocks) under ``layout`` on ``p`` tensor-parallel ranks: a package layout,
    ``"single"`` / ``"tp1d-sp"`` / ``"cp"`` / ``"cp-tp"`` / ``"ulysses"``; ``ring``: a CP rival's CP degree."""
    points, k = _points(MEASURED_OPS[family_of_config(cfg).name], layout, p, ring)
    fixed_f, fixed_b, block_f, block_b = _at(points, k)
    recompute = block_f if checkpointing == "full" else 0.0
    return fixed_f + fixed_b + cfg.n_layer * (block_f + block_b + recompute)


def seconds_per_op(layout: str, cfg, p: int, compiled: bool = False) -> float:
    """Host seconds an op of ``layout`` (a package layout or a rival, as :func:`micro_batch_ops` takes it) on ``p``
    ranks costs, eager or ``compiled`` (module docstring): :data:`PLAIN_SECONDS_PER_OP` times the side's measured
    ratio (:data:`CPU_RATES`) at one rank for a layout's size-1 form, else at four. A side with no measured ratio
    (compiled: torch's context parallelism, and its Llama 1-D TP + SP) costs none."""
    ours = layout in layout_names()
    table = CPU_RATES["compiled" if compiled else "eager"][family_of_config(cfg).name]["1" if ours and p == 1 else "4"]
    name = layout if ours else _counted_as(layout)
    if name not in table and name not in MEASURED_OPS[family_of_config(cfg).name]:  # counted as the plain model
        name = SINGLE.name
    return PLAIN_SECONDS_PER_OP * table.get(name, 0.0)


def memory_bound_ratio(layout: str, cfg, p: int, ring: int | None = None) -> float:
    """The factor on ``layout``'s elementwise bytes on ``p`` ranks (module docstring, :data:`MEMORY_BOUND`): 1 for
    a layout's size-1 form (the plain model's ops on the plain model's tensors) and for a side counted as the plain
    model; measured quotients by axis size (a grid's side, a ring's length, torch's CP degree ``ring``) interpolated
    linearly and extrapolated from the last two (a ring merges once per step: its extra grows with its length);
    torch's 1-D TP + SP's at four ranks."""
    if layout in layout_names() and p == 1:
        return 1.0
    points, k = _points(MEMORY_BOUND[family_of_config(cfg).name], layout, p, ring)
    return max(0.0, _line({size: (ratio,) for size, ratio in points.items()}, k)[0])


def micro_batch_host_seconds(layout: str, cfg, p: int, checkpointing: str = "none", compiled: bool = False,
                             ring: int | None = None) -> float:
    """Host seconds of one micro-batch (module docstring): :func:`micro_batch_ops` times :func:`seconds_per_op`."""
    return micro_batch_ops(layout, cfg, p, checkpointing, ring) * seconds_per_op(layout, cfg, p, compiled)


__all__ = ["CPU_RATES", "MEASURED_OPS", "MEMORY_BOUND", "PLAIN_SECONDS_PER_OP", "memory_bound_ratio",
           "micro_batch_host_seconds", "micro_batch_ops", "seconds_per_op"]
