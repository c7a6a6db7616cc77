"""How long ``plan()`` takes to answer, cold and warm, on clusters no test names, and whether the closed forms pick
the traced planner's row.

    python recipes/benchmarks/plan_speed.py [--out recipes/benchmarks/plan_speed] [--traced-too] [--every-size]

Per cluster, each in a fresh process (so nothing of an earlier answer is in memory):

* ``cold``: ``plan(..., method="closed")`` with an empty on-disk cache: imports not counted (timed from the call);
* ``warm``: the same question again in another fresh process, answered from the on-disk cache the cold run filled;
* ``traced`` (``--traced-too``, slow: minutes to hours on 2 cores): ``plan(..., method="traced", cache=False)``,
  the reference, and whether its best package and baseline rows are the closed-form planner's.

Writes ``results.json`` and ``results.md`` into ``--out``. The targets (issue 36): cold <= 10 s on 2 cores for
Llama 3.1 70B on 64 GPUs, warm <= 1 s; (issue 49, ``--every-size``) the same for every named model size, on
clusters up to 1,024 GPUs, at sequences up to 128k.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# (model, gpus, GiB per GPU, GPUs per node, seq, tokens per step, hardware): none of these is named by a test
CLUSTERS = [
    ("llama-3.1-8b", 16, 80.0, 8, 8192, 2 * 2**20, "h100"),
    ("llama-3.1-70b", 64, 80.0, 8, 8192, 4 * 2**20, "h100"),
    ("llama-3.1-405b", 512, 141.0, 8, 8192, 16 * 2**20, "h200"),
]
# issue 49: every named size in conf/model (and the other Llama sizes), at the longest sequence each takes up to
# 128k, and the clusters the issue found slow (a tied Llama 3.2 at 32k; 70B on 32, 8B on 24)
EVERY_SIZE = [
    ("gpt2-tiny", 8, 80.0, 8, 64, 2**16, "h100"),
    ("gpt2-mini", 8, 80.0, 8, 128, 2**17, "h100"),
    ("gpt2", 64, 80.0, 8, 1024, 2**20, "h100"),
    ("gpt2-medium", 64, 80.0, 8, 1024, 2**20, "h100"),
    ("gpt2-large", 256, 80.0, 8, 1024, 2**21, "h100"),
    ("gpt2-xl", 1024, 80.0, 8, 1024, 2**22, "h100"),
    ("llama-tiny", 8, 80.0, 8, 64, 2**16, "h100"),
    ("llama-mini", 8, 80.0, 8, 128, 2**17, "h100"),
    ("llama-3.2-1b", 16, 80.0, 8, 32768, 4 * 2**20, "h100"),
    ("llama-3.2-3b", 64, 80.0, 8, 131072, 4 * 2**20, "h100"),
    ("llama-3.1-8b", 24, 80.0, 8, 8192, 4 * 2**20, "h100"),
    ("llama-3.1-8b", 1024, 80.0, 8, 131072, 16 * 2**20, "h100"),
    ("llama-3.1-70b", 32, 80.0, 8, 8192, 4 * 2**20, "h100"),
    ("llama-3.1-70b", 1024, 141.0, 8, 131072, 16 * 2**20, "h200"),
    ("llama-3.1-405b", 1024, 80.0, 8, 131072, 16 * 2**20, "h100"),
]

_CHILD = """
import json, sys, time
t0 = time.perf_counter()
from lightning_tp2d.planning import planner
imported = time.perf_counter() - t0
model, gpus, mem, per_node, seq, tokens, hw, method, cache = json.loads(sys.argv[1])
t0 = time.perf_counter()
rows = planner.plan(model, gpus=gpus, gpu_memory_gib=mem, gpus_per_node=per_node, seq=seq,
                    global_batch_tokens=tokens, hardware=hw, method=method, cache=cache)
took = time.perf_counter() - t0
best = {side: next((r.describe() for r in rows if r.baseline == side), None) for side in (False, True)}
print(json.dumps({"seconds": took, "import_seconds": imported, "rows": len(rows),
                  "best_package": best[False], "best_baseline": best[True]}))
"""


def _ask(cluster, method: str, cache) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps([*cluster, method, cache])], check=True,
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE / "plan_speed"))
    parser.add_argument("--traced-too", action="store_true", help="also run the traced reference (slow)")
    parser.add_argument("--every-size", action="store_true",
                        help="also every named model size and the clusters issue 49 found slow (EVERY_SIZE)")
    args = parser.parse_args(argv)
    results = []
    for cluster in CLUSTERS + (EVERY_SIZE if args.every_size else []):
        with tempfile.TemporaryDirectory(prefix="tp2d-plan-cache-") as cache:
            cold = _ask(cluster, "closed", cache)
            warm = _ask(cluster, "closed", cache)
        entry = {"cluster": list(cluster), "cold": cold, "warm": warm}
        if args.traced_too:
            traced = _ask(cluster, "traced", False)
            entry["traced"] = traced
            entry["same_best"] = (traced["best_package"] == cold["best_package"],
                                  traced["best_baseline"] == cold["best_baseline"])
        results.append(entry)
        print(json.dumps(entry), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    (out / "results.json").write_text(json.dumps({"machine": machine, "date": time.strftime("%Y-%m-%d"),
                                                  "results": results}, indent=1))
    lines = [f"# plan() answer times ({machine}, {time.strftime('%Y-%m-%d')})", "",
             f"`python recipes/benchmarks/plan_speed.py{' --traced-too' if args.traced_too else ''}"
             f"{' --every-size' if args.every_size else ''}`: each answer "
             "in a fresh process, timed from the call (imports apart); warm answers come from the on-disk cache the "
             "cold one filled.", "",
             "| model | GPUs | GiB/GPU | seq | tokens/step | rows | cold s | warm s | import s | best package row |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for e in results:
        model, gpus, mem, _, seq, tokens, hw = e["cluster"]
        lines.append(f"| {model} | {gpus} ({hw}) | {mem:g} | {seq} | {tokens:,} | {e['cold']['rows']} | "
                     f"{e['cold']['seconds']:.2f} | {e['warm']['seconds']:.3f} | {e['cold']['import_seconds']:.1f} | "
                     f"{e['cold']['best_package']} |")
    if args.traced_too:
        lines += ["", "| model | GPUs | traced s | same best package row | same best baseline row |", "|---|---|---|---|---|"]
        for e in results:
            lines.append(f"| {e['cluster'][0]} | {e['cluster'][1]} | {e['traced']['seconds']:.0f} | "
                         f"{e['same_best'][0]} | {e['same_best'][1]} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'results.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
