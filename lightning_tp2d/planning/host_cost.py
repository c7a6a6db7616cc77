"""The host's price of a micro-batch: the aten ops one rank dispatches, times the host seconds an op costs.

An eager GPU step runs ahead of the GPU only while the host issues kernels faster than the GPU runs them: the step
takes ``max(host, GPU)``. On one H200 (2026-12-04, ``recipes/results/layer_overhead_h200.json``: GPT-2 medium, B8 x
1024, one rank, no communication) the plain model's host spent 0.068 s a step beside 0.073 s of GPU kernels, while
the layouts' own layers spent 0.17-0.26 s of host a step: host-bound at 0.31-0.53x the plain model's speed. (That
run counted 13.6-33.3k profiler events a step; the same steps dispatch 3.0-9.3k aten ops, the unit here.) The planner priced neither before (issue 48, part 5); now each row's
micro-batch is ``max(GPU seconds, host seconds)``:

* **ops**, per rank and micro-batch, forward (with the loss) and backward apart, measured on CPU by
  :func:`lightning_tp2d.bench.layer_cost.rank_phase_ops` (torch 2.13.0; ops are what the code dispatches, the same
  on any device): one- and two-block models give the ops of a block and of the rest (embedding, head, loss), at
  grids of side 2, 3 and 4 and rings of 2, 4 and 8 (:data:`MEASURED_OPS`); other sizes are interpolated (a grid's
  ops grow linearly with its side: ``q`` SUMMA panels per product) and extrapolated from the last two. ``"full"``
  checkpointing runs each block's forward again; ``"selective"``'s recomputed recipes (a few elementwise ops a block)
  are not counted. Shapes move the counts a little (the SUMMA streams a weight column past a size, the ring MLP
  tiles rows past ``tile_tokens``): two shapes of the ring of 4 differed by 13%;
* **host seconds per op** (:data:`SECONDS_PER_OP`), from the H200 run: torch's own code (the plain model, and every
  rival, whose DTensor dispatch was not measured: the rate most favourable to them) at the plain model's 23 us
  (an op's whole host cost: autograd, Python, the kernel launch); each layout at its own measured rate, 24-35 us
  (the layers' registered ops and autograd functions: more Python per op);
* **compiled**: torch's code is captured whole (its host cost is left out, as the kernel launches of every side
  are); the layouts' registered ops stay opaque and run their ops eagerly inside the graph, priced as eager (the
  plain parts between them fuse; the only compiled measure, the H200's under torch 2.11 with the graph breaks since
  fixed, ran the layouts at 0.14-0.16x the compiled plain model, slower than their eager step).

The AdamW step (once per step, fused) is not counted.
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path

from lightning_tp2d.families import family_of_config
from lightning_tp2d.layouts import get_layout, layout_names
from lightning_tp2d.rivals import SINGLE, get_rival, is_rival

# The measurements (host_ops.json beside this module, with how each was taken): host seconds per aten op (an op as
# OpCounter counts it: every dispatch but the collectives) from the H200 run, and per rank the (forward, backward)
# ops of a micro-batch with one block and with two, by axis size (a grid's side, a ring's length; the rivals' do not
# depend on it).
_DATA = json.loads((Path(__file__).parent / "host_ops.json").read_text())
_RATES = _DATA["seconds_per_op"]
_PLAIN = "plain"
PLAIN_SECONDS_PER_OP = _RATES["host_s_per_step"][_PLAIN] / _RATES["aten_ops_per_step"][_PLAIN]
SECONDS_PER_OP = {name: _RATES["host_s_per_step"][name] / ops
                  for name, ops in _RATES["aten_ops_per_step"].items() if name != _PLAIN}
MEASURED_OPS = {family: {name: {int(k): (tuple(one), tuple(two)) for k, (one, two) in points.items()}
                         for name, points in table.items()}
                for family, table in _DATA["ops"]["counts"].items()}


def _counted_as(name: str) -> str:
    """Whose measured counts price the rival ``name``: its :attr:`~lightning_tp2d.rivals.Rival.host_ops` (those
    with no count of their own: DeepSpeed-Ulysses runs the plain model's ops between its all-to-alls, cp-tp as cp),
    else its own; a rival a family has no count for (GPT-2 has no CP baseline of torch's) takes the plain model's."""
    return (get_rival(name).host_ops or name) if is_rival(name) else name


def _at(points: dict[int, tuple], k: int) -> tuple[float, float, float, float]:
    """``(fixed forward, fixed backward, block forward, block backward)`` at axis size ``k``: the measured points
    interpolated linearly, extrapolated from the nearest two."""
    def split(pair):
        (f1, b1), (f2, b2) = pair
        return (2 * f1 - f2, 2 * b1 - b2, f2 - f1, b2 - b1)

    ks = sorted(points)
    if len(ks) == 1 or k in points:
        return split(points[k if k in points else ks[0]])
    i = min(max(bisect.bisect(ks, k), 1), len(ks) - 1)  # the segment holding k, or the end one nearest it
    lo, hi = ks[i - 1], ks[i]
    a, b = split(points[lo]), split(points[hi])
    t = (k - lo) / (hi - lo)
    return tuple(x + t * (y - x) for x, y in zip(a, b))


def micro_batch_ops(layout: str, cfg, p: int, checkpointing: str = "none") -> float:
    """Aten ops one rank dispatches for one micro-batch (forward with the loss, backward, ``"full"``'s recomputed
    forwards) of ``cfg`` (its ``n_layer`` blocks) under ``layout`` on ``p`` tensor-parallel ranks: a package layout,
    ``"single"`` / ``"tp1d-sp"`` / ``"cp"`` / ``"cp-tp"`` / ``"ulysses"``."""
    table = MEASURED_OPS[family_of_config(cfg).name]
    if layout in layout_names():  # by the layout's axis size: a grid's side, a ring's length
        points, k = table[layout], get_layout(layout).side(p)
    else:  # a rival's count does not depend on its size
        points = table.get(_counted_as(layout), table[SINGLE.name])
        k = min(points)
    fixed_f, fixed_b, block_f, block_b = _at(points, k)
    recompute = block_f if checkpointing == "full" else 0.0
    return fixed_f + fixed_b + cfg.n_layer * (block_f + block_b + recompute)


def micro_batch_host_seconds(layout: str, cfg, p: int, checkpointing: str = "none", compiled: bool = False) -> float:
    """Host seconds of one micro-batch (module docstring): :func:`micro_batch_ops` times the layout's
    :data:`SECONDS_PER_OP`, torch's own code at :data:`PLAIN_SECONDS_PER_OP`; compiled, torch's code costs none
    and the layouts' opaque registered ops their eager price."""
    ours = layout in SECONDS_PER_OP
    if compiled and not ours:
        return 0.0
    return micro_batch_ops(layout, cfg, p, checkpointing) * (SECONDS_PER_OP[layout] if ours else PLAIN_SECONDS_PER_OP)


__all__ = ["MEASURED_OPS", "PLAIN_SECONDS_PER_OP", "SECONDS_PER_OP", "micro_batch_host_seconds",
           "micro_batch_ops"]
