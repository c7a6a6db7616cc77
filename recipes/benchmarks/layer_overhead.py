"""The layouts' own layers against the plain model, per training step, on CPU processes (gloo): aten ops dispatched,
bytes moved by memory-bound ops, eager (and with ``--compile``, inductor-compiled) seconds. Issue 48's measure.

    python recipes/benchmarks/layer_overhead.py [--out recipes/benchmarks/layer_overhead] [--rounds 15] [--compile]
    python recipes/benchmarks/layer_overhead.py --markdown  # results.md again from results.json

* **One rank** (size-1 axes: a 1x1 grid, a ring of one; no communication): each layout's step against the plain
  model's (``single``), for gpt2-tiny and llama-tiny in 2 blocks on B2 x 64 tokens (an overhead-bound shape: the
  host's per-op cost dominates, as it does on a GPU for a layout that dispatches more ops than the plain model),
  beside torch's own 1-D TP + SP on the same size-1 mesh (``tp1d-sp``: DTensor parameters, as the layouts').
* **Four ranks** (2x2 grids, a ring of 4; 4 heads for gpt2-tiny, 8 and 4 key/value heads for llama-tiny, which
  torch's 1-D TP over 4 ranks needs): per rank, the largest rank's ops (collectives counted apart) and its
  memory-bound bytes times 4, against the plain model on one process with the same global batch, beside torch's
  own 1-D TP + SP (``tp1d-sp``) on the same ranks and, for Llama, torch's context parallelism (``cp``).

Every step: forward, backward, AdamW, zero_grad. Ops and bytes are counted with
:class:`lightning_tp2d.bench.layer_cost.OpCounter` after a warm-up step, with AdamW's for-loop (the same on every
side). One-rank seconds are timed with every layout built in one process, in alternating rounds (the fastest round
is reported: this shared 2-core machine's step times drift by 2x from run to run), with AdamW's for-loop and with the
fused AdamW that ``CausalLMModule`` configures (a fused step over DTensor parameters takes the local shards:
:mod:`lightning_tp2d.fused_adam`). Writes ``results.json`` and ``results.md`` into ``--out``. The counts are
deterministic for a torch build; the seconds are this machine's (2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import replace
from pathlib import Path

import torch

from lightning_tp2d.bench.layer_cost import interleaved_seconds, rank_cost
from lightning_tp2d.bench.procs import run_ranks
from lightning_tp2d.bench.runner import BenchSpec

MODELS = ("gpt2-tiny", "llama-tiny")
LAYOUTS = ("2d", "metp", "2d-metp")
# torch's own 1-D TP + SP on a size-1 mesh: its parameters are DTensors as the layouts' are, so it pays the same
# per-parameter crossing; the fair peer of the one-rank rows (the plain model keeps plain tensors)
ONE_RANK_PEERS = ("tp1d-sp",)


def _run(layout: str, world: int, spec: BenchSpec, steps: int) -> list[dict]:
    result = run_ranks(rank_cost, world, layout, spec, steps, timeout=1800.0, tracebacks=True)
    if not result.ok:
        raise RuntimeError(f"{layout} on {world} rank(s): {result.reason}")
    return result.values


def one_rank(model: str, rounds: int, compiled: bool) -> dict:
    """Ops and bytes of each layout's step (counted apart, one process each, AdamW's for-loop), and its seconds timed
    in one process for all layouts (:func:`~lightning_tp2d.bench.layer_cost.interleaved_seconds`): eager with the
    for-loop AdamW and with the fused one (what CausalLMModule configures), and with ``compiled`` the inductor-compiled
    step with the fused one."""
    spec = BenchSpec(model=model, overrides={"n_layer": 2, "dropout": 0.0}, batch=2, seq=64)
    layouts = ("single", *LAYOUTS, *ONE_RANK_PEERS)
    rows = {layout: _run(layout, 1, spec, 0)[0] for layout in layouts}
    timings = {"seconds": replace(spec, optimizer="torch"), "seconds_fused": replace(spec, optimizer="fused")}
    if compiled:
        timings["seconds_compiled"] = replace(spec, optimizer="fused", compile="inductor")
    for key, timed in timings.items():
        result = run_ranks(interleaved_seconds, 1, layouts, timed, rounds, timeout=1800.0, tracebacks=True)
        if not result.ok:
            raise RuntimeError(f"{model} timed ({key}): {result.reason}")
        for layout, t in result.values[0].items():
            rows[layout][key] = t["min"]
            rows[layout][key + "_median"] = t["median"]
    plain = rows["single"]
    for layout, cost in rows.items():
        cost["ops_x"] = cost["total"] / plain["total"]
        cost["bytes_x"] = cost["bytes"] / plain["bytes"]
        for key in timings:
            cost[key + "_x"] = cost[key] / plain[key]
        print(f"one rank {model} {layout}: {cost['total']} ops, {cost['bytes'] / 1e6:.2f} MB, "
              + ", ".join(f"{key} {cost[key] * 1e3:.2f} ms ({cost[key + '_x']:.2f}x)" for key in timings), flush=True)
    return rows


# heads that 4 ranks of torch's 1-D TP divide (gpt2-tiny has 6, llama-tiny 12 query and 6 key/value heads)
FOUR_RANK_HEADS = {"gpt2-tiny": {"n_head": 4}, "llama-tiny": {"n_head": 8, "n_kv_head": 4}}


def _four_rank_seconds(spec: BenchSpec, layouts: tuple[str, ...], rounds: int) -> tuple[dict, dict]:
    """Per layout, the slowest rank's fastest round (seconds a step, layouts built in one process per rank and timed
    in turn); a layout whose build or step fails is timed no more, and its error is returned beside."""
    failed: dict[str, str] = {}
    while layouts:
        result = run_ranks(interleaved_seconds, 4, layouts, spec, rounds, timeout=1800.0, tracebacks=True)
        if result.ok:
            return {layout: max(r[layout]["min"] for r in result.values) for layout in layouts}, failed
        culprit = next((l for l in layouts if l in (result.reason or "")), None)  # noqa: E741
        for layout in layouts:  # which one fails on its own
            alone = run_ranks(interleaved_seconds, 4, (layout,), spec, 1, timeout=1800.0, tracebacks=True)
            if not alone.ok:
                culprit = layout
                failed[layout] = (alone.reason or "").strip().splitlines()[-1][:300]
                break
        if culprit is None:
            raise RuntimeError(f"four ranks, {spec.model}: {result.reason}")
        layouts = tuple(l for l in layouts if l != culprit)  # noqa: E741
    return {}, failed


def four_ranks(model: str, rounds: int, compiled: bool) -> dict:
    spec = BenchSpec(model=model, overrides={"n_layer": 2, "dropout": 0.0, **FOUR_RANK_HEADS[model]}, batch=2,
                     seq=256)
    rows = {"single": _run("single", 1, spec, 0)[0]}
    rivals = ("tp1d-sp", "cp") if model.startswith("llama") else ("tp1d-sp",)
    for layout in (*LAYOUTS, *rivals):
        ranks = _run(layout, 4, spec, 0)
        worst = max(ranks, key=lambda r: r["total"])
        rows[layout] = {**worst, "bytes_x4": 4 * max(r["bytes"] for r in ranks)}
        print(f"four ranks {model} {layout}: {worst['total']} ops per rank, collectives {worst['collectives']}",
              flush=True)
    plain = rows["single"]
    for layout, cost in rows.items():
        cost["ops_x"] = cost["total"] / plain["total"]
        cost["bytes_x4_x"] = cost.get("bytes_x4", cost["bytes"]) / plain["bytes"]
    # seconds a step with the fused AdamW: eager, every layout and rival; compiled (inductor), the grids against
    # torch's 1-D TP + SP compiled block by block (torchtitan's way; CP's harness does not compile)
    timed = {"seconds": (replace(spec, optimizer="fused"), (*LAYOUTS, *rivals))}
    if compiled:
        timed["seconds_compiled"] = (replace(spec, optimizer="fused", compile="inductor"),
                                     tuple(l for l in (*LAYOUTS, "tp1d-sp") if l != "metp"))  # noqa: E741
    for key, (timed_spec, layouts) in timed.items():
        seconds, failed = _four_rank_seconds(timed_spec, layouts, rounds)
        for layout, value in seconds.items():
            rows[layout][key] = value
        for layout, error in failed.items():
            rows[layout][key + "_error"] = error
        base = seconds.get("tp1d-sp")
        for layout, value in seconds.items():
            if base:
                rows[layout][key + "_x_tp"] = value / base
        print(f"four ranks {model} {key}: " + ", ".join(f"{l} {v * 1e3:.1f} ms" for l, v in seconds.items())
              + "".join(f"; {l} failed: {e}" for l, e in failed.items()), flush=True)
    return rows


def markdown(results: dict) -> str:
    lines = [f"# The layouts' own cost per training step ({results['date']}, torch {results['torch']}, "
             f"{results['machine']})", "",
             "One rank (size-1 axes), B2 x 64 tokens, 2 blocks: against the plain model (`single`). Ops and "
             "memory-bound bytes per training step (forward, backward, AdamW's for-loop, zero_grad). Seconds: the "
             "fastest of alternating rounds, every layout timed in one process; eager with AdamW's for-loop and with "
             "the fused AdamW that CausalLMModule configures"
             + ("; compiled (inductor) with the fused AdamW." if results["compiled"] else ".")
             + " `tp1d-sp`: torch's own 1-D TP + SP on the same size-1 mesh (its parameters DTensors, as the layouts'; "
             "compiled block by block, as torchtitan compiles it).", "",
             "| model | layout | ops | x plain | memory-bound MB | x plain | eager ms, for-loop AdamW | x plain |"
             " eager ms, fused AdamW | x plain |"
             + (" compiled ms, fused AdamW | x plain |" if results["compiled"] else ""),
             "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if results["compiled"] else "")]
    for model, rows in results["one_rank"].items():
        for layout, c in rows.items():
            line = (f"| {model} | {layout} | {c['total']} | {c['ops_x']:.2f} | {c['bytes'] / 1e6:.2f} | "
                    f"{c['bytes_x']:.2f} | {c['seconds'] * 1e3:.2f} | {c['seconds_x']:.2f} | "
                    f"{c['seconds_fused'] * 1e3:.2f} | {c['seconds_fused_x']:.2f} |")
            if results["compiled"]:
                line += f" {c['seconds_compiled'] * 1e3:.2f} | {c['seconds_compiled_x']:.2f} |"
            lines.append(line)
    lines += ["", "Four ranks (2x2 grid, ring of 4), B2 x 256 tokens, 2 blocks: the largest rank's ops (collectives "
              "apart) and memory-bound bytes x 4, against the plain model on one process; torch's 1-D TP + SP and "
              "context parallelism on the same ranks.", "",
              "| model | layout | ops per rank | x plain | collectives per rank | memory-bound MB x 4 | x plain |"
              " eager ms | x tp1d-sp |" + (" compiled ms | x tp1d-sp |" if results["compiled"] else ""),
              "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if results["compiled"] else "")]

    def seconds(c: dict, key: str) -> str:
        if key in c:
            ratio = f"{c[key + '_x_tp']:.2f}" if key + "_x_tp" in c else ""
            return f" {c[key] * 1e3:.1f} | {ratio} |"
        return f" failed: {c[key + '_error']} | |" if key + "_error" in c else " | |"

    for model, rows in results["four_ranks"].items():
        for layout, c in rows.items():
            coll = sum(c["collectives"].values())
            lines.append(f"| {model} | {layout} | {c['total']} | {c['ops_x']:.2f} | {coll} | "
                         f"{c.get('bytes_x4', c['bytes']) / 1e6:.2f} | {c['bytes_x4_x']:.2f} |" + seconds(c, "seconds")
                         + (seconds(c, "seconds_compiled") if results["compiled"] else ""))
    lines += ["", "Four-rank seconds: the slowest rank's fastest of alternating rounds, fused AdamW, the four ranks "
              "sharing this machine's cores (so gloo and the host dominate); compiled: each layout's whole model, "
              "torch's 1-D TP + SP block by block as torchtitan compiles it (its loss_parallel does not trace), "
              "context parallelism eager only (the harness does not compile it)."]
    lines += op_ledger(results["four_ranks"])
    return "\n".join(lines) + "\n"


# each layout's fair peer at four ranks (issue 48): torch's 1-D TP + SP for the grids, its context parallelism for
# the ring where the harness runs it (Llama; GPT-2's ring is set beside TP + SP)
PEERS = {"2d": ("tp1d-sp",), "2d-metp": ("tp1d-sp",), "metp": ("cp", "tp1d-sp")}


def op_ledger(four_ranks: dict, least: int = 4) -> list[str]:
    """Markdown: op by op, where each layout's largest rank dispatches a different count from its fair peer's
    (:data:`PEERS`), both sides' counts (collectives apart), the ops that differ by at least ``least`` one per row and
    the rest summed; the rows that add up to the totals' difference."""
    lines = ["", "Op by op at four ranks, against each layout's fair peer (the largest rank of each; collectives "
             f"apart): every op whose count differs by {least} or more, the others summed in the last row.", ""]
    for model, rows in four_ranks.items():
        for layout, peers in PEERS.items():
            peer = next((p for p in peers if p in rows), None)
            if layout not in rows or peer is None:
                continue
            ours, theirs = rows[layout]["ops"], rows[peer]["ops"]
            diffs = sorted(((ours.get(op, 0) - theirs.get(op, 0), op) for op in set(ours) | set(theirs)),
                           key=lambda d: (-abs(d[0]), d[1]))
            shown = [(d, op) for d, op in diffs if abs(d) >= least]
            rest = [(d, op) for d, op in diffs if 0 < abs(d) < least]
            lines += [f"**{model}, {layout} against {peer}**: {rows[layout]['total']} against {rows[peer]['total']} "
                      f"ops ({rows[layout]['total'] - rows[peer]['total']:+d}).", "",
                      f"| op | {layout} | {peer} | difference |", "|---|---|---|---|"]
            lines += [f"| `{op}` | {ours.get(op, 0)} | {theirs.get(op, 0)} | {d:+d} |" for d, op in shown]
            if rest:
                lines.append(f"| {len(rest)} other ops | {sum(ours.get(op, 0) for _, op in rest)} | "
                             f"{sum(theirs.get(op, 0) for _, op in rest)} | {sum(d for d, _ in rest):+d} |")
            lines.append("")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "layer_overhead"))
    parser.add_argument("--rounds", type=int, default=15, help="alternating timed rounds (of 5 steps) per one-rank row")
    parser.add_argument("--compile", action="store_true", help="also time each one-rank step compiled (inductor)")
    parser.add_argument("--markdown", action="store_true",
                        help="only write results.md again from --out's results.json (nothing is run)")
    args = parser.parse_args()
    if args.markdown:
        out = Path(args.out)
        (out / "results.md").write_text(markdown(json.loads((out / "results.json").read_text())))
        return
    started = time.time()
    results = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
               "machine": f"{platform.machine()}, {torch.get_num_threads()} threads", "compiled": args.compile,
               "one_rank": {m: one_rank(m, args.rounds, args.compile) for m in MODELS}}
    results["four_ranks"] = {m: four_ranks(m, max(3, args.rounds // 3), args.compile) for m in MODELS}
    results["seconds"] = time.time() - started
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
