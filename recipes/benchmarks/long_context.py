"""Longest trainable sequence at the same per-rank cap: METP against torch's context parallelism and 1-D TP + SP.

    python recipes/benchmarks/long_context.py [--out recipes/benchmarks/long_context] [--budget-min 35]
    python recipes/benchmarks/long_context.py --render   # results.md and the plot again from results.json
    python recipes/benchmarks/long_context.py --checkpointing 4 --unit 512   # only the checkpointing section, p = 4

Four searches of ``tp2d-bench``'s :func:`~lightning_tp2d.bench.runner.max_sequence` (doubling, then bisection to
``--unit`` tokens; each probe a warm-up step and a measured step of training, forward, backward and AdamW, on fresh
CPU gloo processes, stopped the moment a rank's live bytes pass the cap): p = 4 and 8 ranks, vocabularies 257 and
32000, one cap per vocabulary. Layouts: "metp", "2d-metp" (2 x 2, p = 4 only: it needs a square), ``cp`` (torch's
``context_parallel`` over p, FSDP2 over the same p), ``cp-tp`` (CP over p/2 x 1-D TP + SP over 2) and ``tp1d-sp``
(torch's 1-D TP + SP), the same Llama-shaped model (RoPE, GQA, SwiGLU), batch 1, float32.

Results go to ``--out`` as they come (``results.json`` after every search, so a run stopped by ``--budget-min``
keeps what it measured and says which searches it skipped), then ``results.md`` (the tables, the p = 8 targets,
a linear fit of peak against length per search: the fixed bytes and the bytes per token) and
``peak_vs_seq.png`` (every fitted probe's peak per rank against its length, one panel per search).

``--checkpointing P[,P]``: instead, the activation-checkpointing section alone, merged into the ``results.json``
already in ``--out`` (its searches kept as measured): "metp" on p ranks, vocabulary 257 at its cap, one search per
mode of :func:`~lightning_tp2d.parallelize.checkpoint_activations` (``none``, ``full``, ``selective``), the same
model and probes; its table (longest sequence per mode, the fit of peak against length) and
``peak_vs_seq_checkpointing.png`` (one panel per p, one curve per mode). A rerun replaces the rows of the p it
names and keeps the others.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import time
from dataclasses import asdict, replace

from lightning_tp2d.bench import report
from lightning_tp2d.bench.cli import machine
from lightning_tp2d.bench.runner import BenchSpec, max_sequence

MODEL = "llama-tiny"
# widened llama-tiny: 16 query heads on 8 key/value heads (GQA, hs 16), so 1-D TP splits them over 8 ranks
SHAPE = {"n_layer": 2, "n_embd": 256, "n_head": 16, "n_kv_head": 8, "intermediate_size": 704}
CAPS_MIB = {257: 32, 32000: 256}  # per rank, one per vocabulary: every layout fits a few probes, the search ends
LAYOUTS = {4: ("metp", "2d-metp", "cp", "cp-tp", "tp1d-sp"), 8: ("metp", "cp", "cp-tp", "tp1d-sp")}
TARGET_KEYS = ("max_seq_metp_vs_cp_p8", "max_seq_metp_vs_tp1d_sp_p8")
CHECKPOINTING = {"layout": "metp", "vocab": 257, "modes": ("none", "full", "selective")}  # the checkpointing section


def search_spec(vocab: int, timeout: float) -> BenchSpec:
    return BenchSpec(model=MODEL, overrides={**SHAPE, "vocab_size": vocab}, batch=1, timeout=timeout)


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    out = {"command": "python recipes/benchmarks/long_context.py " + shlex.join(argv), "machine": machine(),
           "date": datetime.datetime.now().isoformat(timespec="seconds"), "model": MODEL, "shape": SHAPE,
           "unit": args.unit, "limit": args.limit, "caps_mib": CAPS_MIB, "searches": []}
    start = time.monotonic()
    for p in (8, 4):  # the targets' p first
        for vocab, cap in CAPS_MIB.items():
            spec = search_spec(vocab, args.probe_timeout)
            search = {"p": p, "vocab": vocab, "cap_bytes": int(cap * report.MIB), "spec": asdict(spec), "max_seq": []}
            out["searches"].append(search)
            for layout in LAYOUTS[p]:
                if time.monotonic() - start > args.budget_min * 60:
                    search["max_seq"].append({"layout": layout, "p": p, "batch": 1, "cap_bytes": search["cap_bytes"],
                                              "status": "skipped", "reason": f"time budget of {args.budget_min} "
                                              "min spent before this search started"})
                    continue
                t0 = time.monotonic()
                row = max_sequence(layout, p, spec, search["cap_bytes"], unit=args.unit, limit=args.limit,
                                   log=lambda m: print(m, flush=True))
                row["wall_s"] = time.monotonic() - t0
                print(f"p={p} vocab={vocab} {layout}: {row.get('max_seq', row.get('reason'))} "
                      f"({row['wall_s']:.0f} s)", flush=True)
                search["max_seq"].append(row)
                out["wall_s"] = time.monotonic() - start
                save(out, args.out)
    return out


def run_checkpointing(args: argparse.Namespace, argv: list[str], results: dict) -> dict:
    """The checkpointing section (module docstring) into ``results["checkpointing"]``: one search per p of
    ``args.checkpointing`` and mode, rows of other p kept; saved after every search."""
    layout, vocab = CHECKPOINTING["layout"], CHECKPOINTING["vocab"]
    cap = int(CAPS_MIB[vocab] * report.MIB)
    ps = [int(p) for p in args.checkpointing.split(",")]
    old = results.get("checkpointing", {}).get("searches", [])
    command = "python recipes/benchmarks/long_context.py " + shlex.join(argv)
    date = datetime.datetime.now().isoformat(timespec="seconds")
    section = {"machine": machine(), "layout": layout, "vocab": vocab, "cap_bytes": cap,
               "searches": [s for s in old if s["p"] not in ps]}
    results["checkpointing"] = section
    start = time.monotonic()
    for p in ps:
        for mode in CHECKPOINTING["modes"]:
            spec = replace(search_spec(vocab, args.probe_timeout), activation_checkpointing=mode)
            if time.monotonic() - start > args.budget_min * 60:
                row = {"layout": layout, "p": p, "batch": 1, "cap_bytes": cap, "status": "skipped",
                       "reason": f"time budget of {args.budget_min} min spent before this search started"}
            else:
                t0 = time.monotonic()
                row = max_sequence(layout, p, spec, cap, unit=args.unit, limit=args.limit,
                                   log=lambda m: print(m, flush=True))
                row["wall_s"] = time.monotonic() - t0
            print(f"checkpointing p={p} {mode}: {row.get('max_seq', row.get('reason'))}", flush=True)
            section["searches"].append({"p": p, "mode": mode, "command": command, "date": date, "unit": args.unit,
                                        "limit": args.limit, "spec": asdict(spec), "max_seq": row})
            save(results, args.out)
    section["searches"].sort(key=lambda s: (s["p"], CHECKPOINTING["modes"].index(s["mode"])))
    return results


def save(results: dict, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)


def fit(row: dict) -> tuple[float, float] | None:
    """Least-squares ``peak = fixed + per_token * T`` over the probes that fitted (``None`` below two)."""
    pts = [(x["seq"], x["peak_bytes"]) for x in row.get("probes", []) if x["status"] == "ok" and x.get("peak_bytes")]
    if len({t for t, _ in pts}) < 2:
        return None
    n, st, sp = len(pts), sum(t for t, _ in pts), sum(b for _, b in pts)
    slope = (n * sum(t * b for t, b in pts) - st * sp) / (n * sum(t * t for t, _ in pts) - st * st)
    return (sp - slope * st) / n, slope


def markdown(results: dict) -> str:
    shape = ", ".join(f"{k} {v}" for k, v in results["shape"].items())
    lines = ["# Longest sequence at the same per-rank cap: METP, torch's context parallelism, 1-D TP + SP", "",
             f"Command: `{results['command']}`", "", f"Machine: {results['machine']['summary']}", "",
             f"Date: {results['date']}; wall time {results.get('wall_s', 0) / 60:.1f} min", "",
             f"Model `{results['model']}` widened ({shape}; RoPE, GQA, SwiGLU), batch 1, float32, CPU gloo. "
             f"Each probe: a warm-up step, then one measured training step (forward, backward, AdamW) under the cap; "
             f"doubling from {results['unit']} tokens, then bisection to {results['unit']}, up to {results['limit']}. "
             "Peak: resident bytes (parameter shards, optimizer state) plus the most the step's tensors hold at once "
             "(FSDP's gathered parameters included), largest rank. Sent: bytes the rank that sends most puts on the "
             "wire in the measured step, per token of the batch.", "", "## Targets (p = 8, same cap)", "",
             "| vocabulary | cap MiB | target | measured | threshold | verdict |", "|---|---|---|---|---|---|"]
    for s in results["searches"]:
        if s["p"] != 8:
            continue
        targets = {t["key"]: t for t in report.evaluate_targets({"max_seq": s["max_seq"]})}
        for key in TARGET_KEYS:
            t = targets[key]
            value = "" if t["value"] is None else format(t["value"], ".3g")
            lines.append(f"| {s['vocab']} | {s['cap_bytes'] / report.MIB:.0f} | {t['target']} | {value} "
                         f"| {t['threshold']} | {report.verdict(t)} |")
    for s in results["searches"]:
        lines += ["", f"## p = {s['p']}, vocabulary {s['vocab']}, cap {s['cap_bytes'] / report.MIB:.0f} MiB per rank",
                  "", "| layout | ranks | batch | cap MiB | max seq | peak MiB there | sent bytes per token there "
                  "| probes | attention kernel |", "|---|---|---|---|---|---|---|---|---|"]
        lines += report.max_seq_rows(s["max_seq"])
        fits = [(r["layout"], fit(r)) for r in s["max_seq"]]
        if any(f for _, f in fits):
            lines += ["", "Fit of the fitted probes, peak = fixed + per token x T: " + "; ".join(
                f"{layout} {f[0] / report.MIB:.1f} MiB + {f[1] / 1024:.1f} KiB/token" for layout, f in fits if f) + "."]
        skipped = [r for r in s["max_seq"] if r["status"] != "ok"]
        lines += [f"* {r['layout']}: {r['status']}: {r.get('reason', '')}" for r in skipped]
    lines += ["", "![peak per rank against sequence length](peak_vs_seq.png)", "", NOTES]
    if results.get("checkpointing"):
        lines += checkpointing_markdown(results["checkpointing"])
    return "\n".join(lines) + "\n"


def checkpointing_markdown(section: dict) -> list[str]:
    """The checkpointing section's table: per p and mode the longest sequence at the cap, its peak, the ratio to
    ``none``'s, and the fit of peak against length."""
    lines = ["", f"## Activation checkpointing of the ring blocks: \"{section['layout']}\", vocabulary "
             f"{section['vocab']}, cap {section['cap_bytes'] / report.MIB:.0f} MiB per rank", "",
             "Measured apart from the tables above (the same model, batch, probes and cap), by:", ""]
    runs: dict[tuple, list] = {}
    for s in section["searches"]:
        runs.setdefault((s["command"], s["date"], s["unit"], s["limit"]), []).append(s)
    for (command, date, unit, limit), searches in runs.items():
        wall = sum(s["max_seq"].get("wall_s", 0) for s in searches) / 60
        lines.append(f"* `{command}` ({date}; p = {', '.join(sorted({str(s['p']) for s in searches}))}; resolution "
                     f"{unit} tokens, up to {limit}; {wall:.1f} min)")
    lines += ["", f"Machine: {section['machine']['summary']}", "",
              "| p | checkpointing | max seq | x none's | peak MiB there | fit: fixed MiB | fit: KiB per token "
              "| probes |",
              "|---|---|---|---|---|---|---|---|"]
    longest = {(s["p"], s["mode"]): s["max_seq"].get("max_seq") for s in section["searches"]}
    for s in section["searches"]:
        r, base = s["max_seq"], longest.get((s["p"], "none"))
        if r["status"] != "ok":
            lines.append(f"| {s['p']} | {s['mode']} | {r['status']}: {r.get('reason', '')} | | | | | |")
            continue
        value = f"{r['max_seq']} (the search limit: a lower bound)" if r.get("capped_by_limit") else r["max_seq"]
        ratio = format(r["max_seq"] / base, ".2f") if base else ""
        f = fit(r)
        fixed, slope = ("", "") if f is None else (f"{f[0] / report.MIB:.1f}", f"{f[1] / 1024:.2f}")
        lines.append(f"| {s['p']} | {s['mode']} | {value} | {ratio} | {r['peak_bytes'] / report.MIB:.2f} | {fixed} "
                     f"| {slope} | {len(r.get('probes', []))} |")
    return lines + ["", "![peak per rank against sequence length, by checkpointing mode]"
                    "(peak_vs_seq_checkpointing.png)", "", CHECKPOINTING_NOTES]


CHECKPOINTING_NOTES = """**What "full" saves, and why 1.4-1.5x here.** Per token a rank holds (the fits times p; one
`[S, h]` float32 row is 1 KiB): 26 KiB without checkpointing, 18 with "full", at p = 4 and 8 alike. Without it the
backward starts with both blocks' saved activations alive; with "full" each block keeps only its input and the
backward's peak is one block recomputed and differentiated, in the ring MLP's backward step (eight `[S, h]` and nine
`[S, I/p]` temporaries of the SwiGLU backward alive at once). Two blocks leave little to save; read with a per-block
model (each block about 10.6 KiB per token without, 1, its input, with; the rest needed once), 32 blocks would hold
about 340 KiB per token against 48: an estimate from these two-block runs, not a measurement. "selective" (1.14x at
p = 4) drops the RMSNorm outputs only: the ring MLP already recomputes its SwiGLU hidden block, and matmul and
attention outputs stay saved.

**The cost on the wire.** "full" runs every block's forward again in the backward, the ring's exchanges included:
15 more ring exchanges per block at p = 4 and 35 at p = 8 (five ring passes of p - 1), nothing else (the RMSNorm
weight gradients' all-reduces stay 6). Per step, counted on rank 0 (`count_comm`): p = 4, 4096 tokens, 116 -> 146
exchanges, 36.8 -> 47.5 MB sent (+29%); p = 8, 8192 tokens, 256 -> 326, 63.6 -> 83.4 MB (+31%). On "2d-metp" (2 x 2,
`tests/test_long_context.py`) each block adds 8 ring exchanges, 7 all-gathers and 2 all-reduces. "selective" adds no
communication. p = 8 "selective" was not run (the budget of that run; the p = 8 run took 10.7 min).
"""


NOTES = """## Why

**Targets, p = 8.** Both met at both vocabularies: METP trains 2.7x `cp`'s longest sequence and 4x 1-D TP + SP's
with the 257-token vocabulary (8192 against 3072 and 2048 tokens at 32 MiB per rank), and at least 5.3x both with
32000 tokens (256 MiB per rank: METP fitted every probe up to the search's 16384-token limit, its peak there 125 MiB,
half the cap; its fit reaches the cap near 44k tokens). Lengths are resolved to 1024 tokens, so a 3072 reads "3072 to
4095".

**What each keeps, per rank (the fits above).** With the small vocabulary the per-token slope decides: METP 3.3
KiB per token at p = 8, `cp` 5.8, `cp-tp` 6.7, 1-D TP + SP 11.1. 1-D TP + SP gathers each block's norm output
to the full sequence (`[T, h]` on every rank, the column-parallel inputs) and keeps them for the weight gradients;
`cp` keeps `T/p` tokens of every activation, but torch's ring all-gathers the whole sequence's K and V once per
attention forward and again in backward (each attention holds the whole sequence's K/V while it runs); METP keeps
`T/p` tokens and streams K/V and weight blocks one ring step at a time. With 32000 tokens the fixed part decides
for `cp`: FSDP2's root group (embedding and head, 2 V h = 62.5 MiB) is gathered whole on every rank and its
gradient is held unsharded before the reduce-scatter, 129 MiB fixed against METP's 49 (parameter and AdamW
shards, vocabulary blocks in flight), and `cp`'s `T/p` tokens keep full-vocabulary logits and their softmax
gradient (38 KiB per token at p = 8); 1-D TP + SP and `cp-tp` keep `[tokens, V/t]` log-probabilities under
`loss_parallel` (73 and 69 KiB per token), 1-D TP + SP also a replicated `[V, h]` embedding gradient. METP shards
the head over the ring: 4.8 KiB per token.

**p = 4.** The same order, closer together at 32 MiB (METP 3072, "2d-metp" 2048, the three torch baselines
1024); with 32000 tokens METP 11264 against 1024 for all three (the same fixed parts, and twice the tokens per
rank, leave them little of 256 MiB).

**Bytes sent per token** (at each longest sequence, the rank that sends most): METP sends its weight blocks round
the ring every step, a cost that does not grow with T, so per token it falls with length (7.8 KB at 8192 tokens,
p = 8, vocabulary 257); `cp` sends FSDP's gathers and reduce-scatters (the whole model, per step) plus the ring's
K/V (11 KB per token at 3072); 1-D TP + SP 18 KB per token at any length (its all-gathers and reduce-scatters of
activations).
"""


def plot(results: dict, out_dir: str) -> str:
    import matplotlib  # deferred: heavy to import, and only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: as above, after choosing the Agg backend

    searches = results["searches"]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5), squeeze=False)
    for ax, s in zip(axes.flat, searches):
        report.plot_probes(ax, s["max_seq"], f"p = {s['p']}, vocabulary {s['vocab']}: probes that fitted "
                           f"(dashed: the {s['cap_bytes'] / report.MIB:.0f} MiB cap); legend: the longest")
    for ax in list(axes.flat)[len(searches):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "peak_vs_seq.png"), dpi=110)
    plt.close(fig)
    return "peak_vs_seq.png"


def plot_checkpointing(section: dict, out_dir: str) -> str:
    """``peak_vs_seq_checkpointing.png``: one panel per p, one curve per checkpointing mode (its fitted probes)."""
    import matplotlib  # deferred: heavy to import, and only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: as above, after choosing the Agg backend

    ps = sorted({s["p"] for s in section["searches"]})
    fig, axes = plt.subplots(1, len(ps), figsize=(6 * len(ps), 4.5), squeeze=False)
    for ax, p in zip(axes.flat, ps):
        rows = [{**s["max_seq"], "layout": f"{section['layout']}, {s['mode']}"} for s in section["searches"]
                if s["p"] == p]
        report.plot_probes(ax, rows, f"\"{section['layout']}\", p = {p}, vocabulary {section['vocab']}: probes "
                           f"that fitted (dashed: the {section['cap_bytes'] / report.MIB:.0f} MiB cap)")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "peak_vs_seq_checkpointing.png"), dpi=110)
    plt.close(fig)
    return "peak_vs_seq_checkpointing.png"


def render(results: dict, out_dir: str) -> None:
    plot(results, out_dir)
    if results.get("checkpointing"):
        plot_checkpointing(results["checkpointing"], out_dir)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(markdown(results))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "long_context"))
    ap.add_argument("--unit", type=int, default=1024, help="bisection resolution (tokens)")
    ap.add_argument("--limit", type=int, default=16384, help="longest sequence probed")
    ap.add_argument("--budget-min", type=float, default=35.0, help="no search starts after this many minutes")
    ap.add_argument("--probe-timeout", type=float, default=600.0, help="seconds per probe")
    ap.add_argument("--render", action="store_true", help="rewrite results.md and the plot from results.json")
    ap.add_argument("--checkpointing", default="", metavar="P[,P]",
                    help="only the activation-checkpointing section at these p, merged into --out's results.json")
    args = ap.parse_args(argv)
    if args.render or args.checkpointing:
        with open(os.path.join(args.out, "results.json")) as f:
            results = json.load(f)
        if args.checkpointing:
            run_checkpointing(args, argv, results)
            save(results, args.out)
    else:
        results = run(args, argv)
        save(results, args.out)
    render(results, args.out)
    print(f"wrote {args.out}/results.json, results.md, peak_vs_seq.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
