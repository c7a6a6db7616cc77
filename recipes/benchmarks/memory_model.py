"""The memory model against measured runs: every layout x ZeRO stage {0, 1, 3} x activation checkpointing, GPT-2
and Llama, on 8 CPU processes (gloo).

    python recipes/benchmarks/memory_model.py [--out recipes/benchmarks/memory_model] [--predict-only]

Per case, the largest rank's measured peak of one training step
(:func:`lightning_tp2d.bench.measure.measured_peaks`: a warm-up step, then zero_grad, forward, backward,
data-parallel averaging, clipping, AdamW's step; resident bytes plus the live peak) beside
:func:`lightning_tp2d.planning.memory_model.peak_bytes`'s prediction and its parts. The grid is
:data:`lightning_tp2d.bench.measure.GRID` (the one ``tests/test_memory_model.py`` checks): "metp" (ring 4), "2d" (2x2 grid) and "2d-metp" (2x2 grid of
rings), each x dp 2, stages 0, 1 and 3, checkpointing none and full; selective on "metp" and "2d" at stage 0; an
8-block model on the ring at stages 0 and 3 and on the grid of rings at stage 3 (deeper than the 4 and 5 blocks the
model extrapolates from). Writes
``results.json`` and ``results.md`` into ``--out``. ``--predict-only`` keeps the measurements of ``--out``'s
``results.json`` and predicts them again with the model as it is now (minutes instead of the runs).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from lightning_tp2d.bench.measure import GRID as CASES
from lightning_tp2d.bench.measure import GRID_BATCH as BATCH
from lightning_tp2d.bench.measure import GRID_SEQ as SEQ
from lightning_tp2d.bench.measure import GRID_WORLD as WORLD
from lightning_tp2d.bench.measure import grid_config as config_of
from lightning_tp2d.bench.measure import measured_peaks
from lightning_tp2d.planning.memory_model import peak_bytes
from lightning_tp2d.bench.procs import run_ranks

MIB = 2 ** 20
PARTS = ("parameters", "gradients", "optimizer", "activations", "gathered", "backward", "step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).with_suffix("")))
    parser.add_argument("--predict-only", action="store_true",
                        help="keep the measurements in --out's results.json; predict them again with today's model")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    if args.predict_only:
        old = json.loads((out / "results.json").read_text())
        if [_case(r) for r in old["rows"]] != [tuple(c) for c in CASES]:
            raise SystemExit(f"{out / 'results.json'} measured another grid: measure again (without --predict-only)")
        per_case = [[{"peak": r["measured_bytes"], "resident": r["measured_resident_bytes"]} if k == r["measured_rank"]
                     else {"peak": -1, "resident": 0} for k in range(WORLD)] for r in old["rows"]]
        measured_s = old["meta"]["measured_s"]
    else:
        result = run_ranks(measured_peaks, WORLD, [(config_of(c), *c[1:5]) for c in CASES], BATCH, SEQ, timeout=3000)
        if not result.ok:
            raise SystemExit(f"the measured runs failed: {result.reason}")
        per_case = [[rank[i] for rank in result.values] for i in range(len(CASES))]
        measured_s = time.time() - start
    rows = []
    for i, case in enumerate(CASES):
        name, layout, p, stage, ck, depth = case
        peaks = per_case[i]
        worst = max(range(WORLD), key=lambda r: peaks[r]["peak"])
        predicted = peak_bytes(layout, config_of(case), BATCH, SEQ, p, dp=WORLD // p, zero_stage=stage,
                               checkpointing=ck)
        rows.append({"model": name, "n_layer": depth, "layout": layout, "p": p, "dp": WORLD // p, "zero_stage": stage,
                     "checkpointing": ck, "measured_bytes": peaks[worst]["peak"], "measured_rank": worst,
                     "measured_resident_bytes": peaks[worst]["resident"], "predicted": predicted,
                     "ratio": predicted["total"] / peaks[worst]["peak"]})
        print(f"{name} {depth} blocks {layout} stage {stage} {ck}: {rows[-1]['ratio']:.3f}", flush=True)
    meta = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "batch": BATCH, "seq": SEQ, "world_size": WORLD, "measured_s": round(measured_s, 1),
            "total_s": round(time.time() - start, 1)}
    if args.predict_only:  # the measurements' own record stays; the predictions are today's
        meta = old["meta"] | {"predicted_again": time.strftime("%Y-%m-%d"), "predict_s": meta["total_s"]}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (out / "results.md").write_text(_markdown(rows, meta))


def _case(row: dict) -> tuple:
    return (row["model"], row["layout"], row["p"], row["zero_stage"], row["checkpointing"], row["n_layer"])


def _markdown(rows, meta) -> str:
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
    lines = ["# Memory model against measured peaks", "",
             f"`python recipes/benchmarks/memory_model.py`: torch {meta['torch']}, {meta['world_size']} CPU "
             f"processes (gloo), batch {meta['batch']} x {meta['seq']} per replica, float32, AdamW (foreach). "
             "Per case the largest rank's measured peak of one step (resident + live peak) and "
             "`memory_model.peak_bytes`'s prediction (the largest over the tensor-parallel ranks); parts in MiB "
             "(`step`: the profiled peak of what the step allocates; total = parameters + optimizer + step; the "
             "other parts are sizes, not all alive at once).", "",
             f"Largest deviation: {worst['ratio']:.3f} ({worst['model']}, {worst['layout']}, stage "
             f"{worst['zero_stage']}, {worst['checkpointing']}). Measured in {meta['measured_s']:.0f} s, "
             f"{meta['total_s']:.0f} s with the predictions"
             + (f"; predicted again on {meta['predicted_again']} from the same measurements ({meta['predict_s']:.0f} s)"
                if "predicted_again" in meta else "") + ".", "",
             "| model | blocks | layout | p x dp | stage | checkpointing | measured MiB | predicted MiB | ratio | "
             + " | ".join(PARTS) + " |",
             "|" + "---|" * (9 + len(PARTS))]
    for r in rows:
        pr = r["predicted"]
        lines.append(f"| {r['model']} | {r['n_layer']} | {r['layout']} | {r['p']} x {r['dp']} | {r['zero_stage']} | "
                     f"{r['checkpointing']} | {r['measured_bytes'] / MIB:.3f} | {pr['total'] / MIB:.3f} | "
                     f"{r['ratio']:.3f} | " + " | ".join(f"{pr[k] / MIB:.3f}" for k in PARTS) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
