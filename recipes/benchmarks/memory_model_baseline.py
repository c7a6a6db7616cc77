"""The 1-D baseline's memory model against measured runs: torch's 1-D TP + SP x FSDP2 (torchtitan's grouping), GPT-2
and Llama, ZeRO stages 3 and 2 x checkpointing none and full x float32 and bf16 mixed, on 4 and 8 CPU processes
(gloo).

    python recipes/benchmarks/memory_model_baseline.py [--out recipes/benchmarks/memory_model_baseline]

Per case, the largest rank's measured peak of one training step
(:func:`lightning_tp2d.bench.measure.baseline_measured_peaks`: the model parallelized with 1-D TP + SP, sharded by
:func:`~lightning_tp2d.baselines.tp1d_sp.shard_1d_data_parallel`; a warm-up step, then zero_grad, forward, backward,
clipping, AdamW's step; resident bytes plus the live peak) beside
:func:`lightning_tp2d.planning.memory_model.baseline_peak_bytes`'s analytic prediction (``composite``: the package's
eager models, as measured) and its parts. The grid is :data:`lightning_tp2d.bench.measure.BASELINE_GRID` (the one
``tests/test_memory_model.py`` checks) at tp 2 x dp 2 and tp 2 x dp 4. Writes ``results.json`` and ``results.md``
into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from lightning_tp2d.bench.measure import (BASELINE_BATCH, BASELINE_GRID, BASELINE_SEQ, BASELINE_TP, BASELINE_WORLDS,
                                          baseline_grid_cases, baseline_grid_config, baseline_measured_peaks)
from lightning_tp2d.planning.memory_model import baseline_peak_bytes
from lightning_tp2d.bench.procs import run_ranks

MIB = 2 ** 20
PARTS = ("parameters", "gradients", "optimizer", "activations", "gathered", "loss_forward", "backward")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).with_suffix("")))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    rows, measured_s = [], {}
    for world in BASELINE_WORLDS:
        begun = time.time()
        result = run_ranks(baseline_measured_peaks, world, baseline_grid_cases(BASELINE_GRID), BASELINE_BATCH,
                           BASELINE_SEQ, timeout=3000)
        if not result.ok:
            raise SystemExit(f"the measured runs on {world} ranks failed: {result.reason}")
        measured_s[world] = round(time.time() - begun, 1)
        dp = world // BASELINE_TP
        for i, (name, stage, ck, precision, depth) in enumerate(BASELINE_GRID):
            peaks = [rank[i] for rank in result.values]
            worst = max(range(world), key=lambda r: peaks[r]["peak"])
            predicted = baseline_peak_bytes(baseline_grid_config(name, depth), BASELINE_BATCH, BASELINE_SEQ,
                                            BASELINE_TP, dp=dp, zero_stage=stage, checkpointing=ck,
                                            elem=4 if precision == "32-true" else 2, composite=True)
            rows.append({"model": name, "n_layer": depth, "tp": BASELINE_TP, "dp": dp, "zero_stage": stage,
                         "checkpointing": ck, "precision": precision, "measured_bytes": peaks[worst]["peak"],
                         "measured_rank": worst, "measured_resident_bytes": peaks[worst]["resident"],
                         "predicted": predicted, "ratio": predicted["total"] / peaks[worst]["peak"]})
            print(f"{world} ranks {name} {depth} blocks stage {stage} {ck} {precision}: {rows[-1]['ratio']:.3f}",
                  flush=True)
    meta = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "batch": BASELINE_BATCH, "seq": BASELINE_SEQ, "tp": BASELINE_TP, "world_sizes": list(BASELINE_WORLDS),
            "measured_s": measured_s, "total_s": round(time.time() - start, 1)}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (out / "results.md").write_text(_markdown(rows, meta))


def _markdown(rows, meta) -> str:
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
    low, high = min(r["ratio"] for r in rows), max(r["ratio"] for r in rows)
    seconds = ", ".join(f"{s:.0f} s on {w} ranks" for w, s in meta["measured_s"].items())
    lines = ["# The 1-D baseline's memory model against measured peaks", "",
             f"`python recipes/benchmarks/memory_model_baseline.py`: torch {meta['torch']}, CPU processes (gloo), "
             f"torch's 1-D TP + SP (tp {meta['tp']}) x FSDP2 grouped as torchtitan's `apply_fsdp` groups it, batch "
             f"{meta['batch']} x {meta['seq']} per replica, AdamW (foreach), float32 or FSDP's bf16 `param_dtype` "
             "(float32 reduction, no autocast). Per case the largest rank's measured peak of one step (resident + "
             "live peak) and `memory_model.baseline_peak_bytes`'s analytic prediction (`composite`: the package's "
             "eager models); parts in MiB (total = parameters + optimizer + the largest of activations + gathered + "
             "backward, the loss's forward and the end of the backward; the parts are sizes, not all alive at "
             "once).", "",
             f"Ratios {low:.3f} to {high:.3f}; largest deviation {worst['ratio']:.3f} ({worst['model']}, "
             f"{worst['n_layer']} blocks, tp {worst['tp']} x dp {worst['dp']}, stage {worst['zero_stage']}, "
             f"{worst['checkpointing']}, {worst['precision']}). Measured in {seconds}; {meta['total_s']:.0f} s in all.",
             "",
             "| model | blocks | tp x dp | stage | checkpointing | precision | measured MiB | predicted MiB | ratio | "
             + " | ".join(PARTS) + " |",
             "|" + "---|" * (9 + len(PARTS))]
    for r in rows:
        pr = r["predicted"]
        lines.append(f"| {r['model']} | {r['n_layer']} | {r['tp']} x {r['dp']} | {r['zero_stage']} | "
                     f"{r['checkpointing']} | {r['precision']} | {r['measured_bytes'] / MIB:.3f} | "
                     f"{pr['total'] / MIB:.3f} | {r['ratio']:.3f} | "
                     + " | ".join(f"{pr[k] / MIB:.3f}" for k in PARTS) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
