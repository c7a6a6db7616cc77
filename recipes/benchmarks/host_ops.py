"""Recount the planner's host-op table: the aten ops one rank dispatches for a micro-batch's forward (with the loss)
and backward, for every layout and rival, with one block and with two (``lightning_tp2d/planning/host_ops.json``,
``ops.counts``; how the planner uses them: :mod:`lightning_tp2d.planning.host_cost`).

    python recipes/benchmarks/host_ops.py [--only metp,2d-metp] [--check]

A change to the layers' ops must come with a recount (``tests/test_host_cost.py`` recounts one entry and fails
otherwise). Each entry runs :func:`lightning_tp2d.bench.layer_cost.rank_phase_ops` on CPU processes (gloo) under
bf16 autocast, B12 x 96 tokens, and keeps the largest rank's count:

* the layouts and the plain model with 12 heads (Llama: 12 key/value heads), at grids of side 2, 3 and 4 (4, 9 and 16
  ranks) and rings of 2, 4 and 8;
* the rivals with 4 heads (Llama: 8 and 4 key/value heads), which torch's 1-D TP over 4 ranks needs, on 4 ranks.

``--only`` recounts the named sides and keeps the rest of the table; ``--check`` writes nothing and exits 1 when a
count differs. The seconds per op (``seconds_per_op``, from a GPU run) are not touched. Counts are torch 2.13.0's
(its decompositions decide them); the script refuses another torch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from lightning_tp2d.bench.layer_cost import rank_phase_ops
from lightning_tp2d.bench.procs import run_ranks
from lightning_tp2d.bench.runner import BenchSpec

TABLE = Path(__file__).resolve().parents[2] / "lightning_tp2d" / "planning" / "host_ops.json"
MODELS = {"gpt2": "gpt2-tiny", "llama": "llama-tiny"}
HEADS = {"gpt2": {"n_head": 12}, "llama": {"n_head": 12, "n_kv_head": 12}}
RIVAL_HEADS = {"gpt2": {"n_head": 4}, "llama": {"n_head": 8, "n_kv_head": 4}}
# side -> (axis sizes counted, ranks at each size): a grid's side q runs on q*q ranks, a ring of p on p
SIDES = {"single": ((1,), lambda k: 1), "2d": ((2, 3, 4), lambda q: q * q), "metp": ((2, 4, 8), lambda p: p),
         "2d-metp": ((2, 3, 4), lambda q: q * q), "tp1d-sp": ((4,), lambda k: 4), "cp": ((4,), lambda k: 4)}
FAMILIES_OF = {"cp": ("llama",)}  # torch's context parallelism baseline runs Llama only


def count(family: str, side: str, size: int) -> list[list[int]]:
    """``[[forward, backward] with one block, [forward, backward] with two]`` at axis size ``size``."""
    heads = RIVAL_HEADS[family] if side in ("tp1d-sp", "cp") else HEADS[family]
    ranks = SIDES[side][1](size)
    out = []
    for n_layer in (1, 2):
        spec = BenchSpec(model=MODELS[family], overrides={"n_layer": n_layer, "dropout": 0.0, **heads}, batch=12,
                         seq=96, dtype="bfloat16")
        result = run_ranks(rank_phase_ops, ranks, side, spec, timeout=900, tracebacks=True)
        if not result.ok:
            raise SystemExit(f"{family} {side} at {size} ({ranks} ranks): {result.reason}")
        worst = max(result.values, key=lambda c: c["forward"] + c["backward"])
        out.append([worst["forward"], worst["backward"]])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(SIDES), help="comma-separated sides to recount")
    parser.add_argument("--check", action="store_true", help="compare with the table, write nothing")
    args = parser.parse_args()
    if not torch.__version__.startswith("2.13."):
        print(f"the table counts torch 2.13.0's ops; this is torch {torch.__version__}", file=sys.stderr)
        return 2
    sides = args.only.split(",")
    unknown = sorted(set(sides) - set(SIDES))
    if unknown:
        print(f"--only: unknown sides {unknown}; known: {sorted(SIDES)}", file=sys.stderr)
        return 2
    data = json.loads(TABLE.read_text())
    counts = data["ops"]["counts"]
    differ = []
    start = time.time()
    for family in MODELS:
        for side in sides:
            if family not in FAMILIES_OF.get(side, MODELS):
                continue
            for size in SIDES[side][0]:
                new = count(family, side, size)
                old = counts.get(family, {}).get(side, {}).get(str(size))
                if new != old:
                    differ.append(f"{family} {side} {size}: {old} -> {new}")
                counts.setdefault(family, {}).setdefault(side, {})[str(size)] = new
                print(f"{family:6s} {side:8s} {size}: {new}  ({time.time() - start:.0f} s)", flush=True)
    print("\n".join(differ) or "every count as in the table")
    if args.check:
        return 1 if differ else 0
    data["ops"]["source"] = (f"recipes/benchmarks/host_ops.py: lightning_tp2d.bench.layer_cost.rank_phase_ops on CPU, "
                             f"torch {torch.__version__.split('+')[0]}, {time.strftime('%Y-%m-%d')}, bf16 autocast, "
                             "B12 x 96 tokens, 12 heads (Llama: 12 key/value heads); the rivals with 4 heads (Llama: "
                             "8 and 4) on 4 ranks; the largest rank's count")
    TABLE.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
