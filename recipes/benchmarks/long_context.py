"""Longest trainable sequence at the same per-rank cap, measured on CPU: METP against torch's context parallelism
(chunked loss), DeepSpeed's Ulysses + ALST and torch's 1-D TP + SP.

    python recipes/benchmarks/long_context.py [--out recipes/benchmarks/long_context] [--budget-min 33]
    python recipes/benchmarks/long_context.py --render   # results.md and the plot again from results.json
    python recipes/benchmarks/long_context.py --resume   # only the searches results.json skipped (or lacks)

One search of ``tp2d-bench``'s :func:`~lightning_tp2d.bench.runner.max_sequence` per row of :data:`SEARCHES`
(doubling from the row's unit, then bisection to it; each probe a warm-up step and a measured step of training,
forward, backward and AdamW, on fresh CPU gloo processes, stopped the moment a rank's live bytes pass the cap). The
model: ``llama-tiny`` widened to four blocks (:data:`SHAPE`: RoPE, GQA 16 query on 8 key/value heads, SwiGLU) and a
32000-token vocabulary, batch 1, float32, and the same activation checkpointing for every layout: ``"full"`` (each
block keeps its input, recomputed in the backward; Ulysses + ALST always runs so, and the runner applies
:func:`~lightning_tp2d.parallelize.checkpoint_activations` to the baselines' blocks too). Layouts: ``metp`` (the
ring over p), ``2d-metp`` (2 x 2, p = 4), ``cp`` (torch's ``context_parallel`` x FSDP2 over p, chunked
cross-entropy), ``ulysses`` (DeepSpeed's ``UlyssesSPAttentionHF`` + ``TiledMLP`` + ``TiledFusedLogitsLoss``, FSDP2),
``tp1d-sp`` (torch's 1-D TP + SP, ``loss_parallel``) and ``cp-tp`` (CP over p/2 x TP + SP over 2).

Each row keeps the largest tensors alive at its longest fitting probe's peak, and those alive when the first probe
over the cap passed it (:class:`~lightning_tp2d.planning.live.LiveTensorBytes`' ``largest``).

Results go to ``--out`` as they come (``results.json`` after every search; a search that would start after
``--budget-min`` is recorded as skipped), then ``results.md`` (the targets, the table, a linear fit of peak against
length per search) and ``peak_vs_seq.png`` (every fitted probe's peak against its length, one panel per p). This
replaces the earlier two-block sweep over p and vocabulary (257 and 32000) and its activation-checkpointing
section; their results are in git history.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import time
from dataclasses import asdict

from lightning_tp2d.bench import report
from lightning_tp2d.bench.cli import machine
from lightning_tp2d.bench.runner import BenchSpec, describe_largest, max_sequence

MODEL = "llama-tiny"
# widened llama-tiny: four blocks, 16 query heads on 8 key/value heads (GQA, head size 16), a 32000-token vocabulary
SHAPE = {"n_layer": 4, "n_embd": 256, "n_head": 16, "n_kv_head": 8, "intermediate_size": 704, "vocab_size": 32000}
CHECKPOINTING = "full"  # the same for every layout (Ulysses + ALST always checkpoints every layer)
CAP_MIB = 128  # per rank: METP's longest sequence is measured (not the search's bound) within the time budget
BASELINE_CAP_MIB = 256  # a second cap at which the baselines fit (at 128 MiB FSDP's gathered vocabulary root does not)
LIMIT = 65536
# (p, layout, unit, cap MiB): the p = 8 targets' searches first, then the baselines again at the higher cap, then
# p = 4 (the 2d-metp comparison), then the optional ones. Units: the baselines fit up to a few thousand tokens,
# METP tens of thousands (its probes take minutes). METP is not searched at the higher cap: a probe's peak does not
# depend on the cap, so its longest sequence there is at least the one measured at 128 MiB (a lower bound)
SEARCHES = [(8, "cp", 128, CAP_MIB), (8, "ulysses", 128, CAP_MIB), (8, "tp1d-sp", 128, CAP_MIB),
            (8, "metp", 4096, CAP_MIB),
            (8, "cp", 512, BASELINE_CAP_MIB), (8, "ulysses", 512, BASELINE_CAP_MIB),
            (8, "tp1d-sp", 512, BASELINE_CAP_MIB),
            (4, "metp", 512, CAP_MIB), (4, "2d-metp", 512, CAP_MIB), (4, "cp", 64, CAP_MIB),
            (4, "ulysses", 64, CAP_MIB), (8, "cp-tp", 512, BASELINE_CAP_MIB),
            (4, "2d-metp", 512, BASELINE_CAP_MIB), (4, "metp", 1024, BASELINE_CAP_MIB)]
TARGETS = (("cp", 1.3), ("ulysses", 1.0))  # METP's longest sequence over theirs at p = 8, the threshold


def search_spec(timeout: float) -> BenchSpec:
    return BenchSpec(model=MODEL, overrides=dict(SHAPE), batch=1, timeout=timeout,
                     activation_checkpointing=CHECKPOINTING)


def run(args: argparse.Namespace, argv: list[str], previous: dict | None = None) -> dict:
    """Every search of :data:`SEARCHES`; with ``previous`` (``--resume``) only those it has no answer for (skipped
    or missing), its rows kept and its wall time added to."""
    spec = search_spec(args.probe_timeout)
    command = ("python recipes/benchmarks/long_context.py " + shlex.join(argv)).rstrip()
    out = {"command": command, "machine": machine(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "model": MODEL, "shape": SHAPE, "activation_checkpointing": CHECKPOINTING, "limit": args.limit,
           "spec": asdict(spec), "max_seq": []}
    done = {}
    if previous is not None:
        out = {**previous, "command": f"{previous['command']}, then {command}", "max_seq": []}
        done = {(r["p"], r["layout"], r["cap_bytes"]): r for r in previous["max_seq"] if r.get("status") != "skipped"}
    earlier = out.get("wall_s", 0.0)
    start = time.monotonic()
    for p, layout, unit, cap_mib in SEARCHES:
        cap = int(cap_mib * report.MIB)
        if (p, layout, cap) in done:
            out["max_seq"].append(done[(p, layout, cap)])
            continue
        if time.monotonic() - start > args.budget_min * 60:
            out["max_seq"].append({"layout": layout, "p": p, "batch": 1, "cap_bytes": cap, "unit": unit,
                                   "status": "skipped", "reason": f"time budget of {args.budget_min} min spent "
                                   "before this search started"})
            continue
        t0 = time.monotonic()
        row = max_sequence(layout, p, spec, cap, unit=unit, limit=args.limit, log=lambda m: print(m, flush=True))
        row["wall_s"], row["limit"] = time.monotonic() - t0, args.limit
        print(f"p={p} {layout} cap {cap_mib} MiB: {row.get('max_seq', row.get('reason'))} ({row['wall_s']:.0f} s); "
              f"largest {describe_largest(row.get('largest'), 1)}", flush=True)
        out["max_seq"].append(row)
        out["wall_s"] = earlier + time.monotonic() - start
        save(out, args.out)
    out["wall_s"] = earlier + time.monotonic() - start
    return out


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


def render(results: dict, out_dir: str) -> None:
    plot(results, out_dir)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(markdown(results))


def _mib(nbytes) -> str:
    return "" if nbytes is None else f"{nbytes / report.MIB:.1f}"


def _largest(entries, n: int = 2) -> str:
    return describe_largest(entries, n).replace(".default", "").replace(".Tensor", "")


def _over(row: dict) -> str:
    """The first probe over the cap: its length and the largest tensors alive when the cap was passed."""
    over = row.get("over_cap") or min((x for x in row.get("probes", []) if x["status"] == "oom"),
                                      key=lambda x: x["seq"], default=None)
    if not over:
        return "none (every probe fitted)"
    reason = over["reason"]
    named = reason.split("largest live: ", 1)[1] if "largest live: " in reason else reason
    return f"{over['seq']}: {named.replace('.default', '').replace('.Tensor', '')}"


def find(results: dict, layout: str, p: int, cap_mib: float) -> dict | None:
    return next((r for r in results["max_seq"] if r["layout"] == layout and r["p"] == p
                 and r["cap_bytes"] == int(cap_mib * report.MIB)), None)


def targets(results: dict) -> list[dict]:
    """METP's longest sequence over cp's and Ulysses' at p = 8, per cap. At the baselines' cap METP's number is its
    longest at the lower cap (a lower bound: a probe's peak does not depend on the cap)."""
    out = []
    metp = find(results, "metp", 8, CAP_MIB)
    for cap_mib in (CAP_MIB, BASELINE_CAP_MIB):
        for rival, threshold in TARGETS:
            row = find(results, rival, 8, cap_mib)
            t = {"cap_mib": cap_mib, "rival": rival, "threshold": threshold, "metp": None, "rival_max": None,
                 "ratio": None, "lower_bound": cap_mib != CAP_MIB, "verdict": "not measured"}
            out.append(t)
            if not metp or metp.get("status") != "ok" or not row or row.get("status") != "ok":
                continue
            t.update(metp=metp["max_seq"], rival_max=row["max_seq"])
            t["ratio"] = float("inf") if row["max_seq"] == 0 else metp["max_seq"] / row["max_seq"]
            t["verdict"] = "met" if t["ratio"] >= threshold else "not met"
    return out


def markdown(results: dict) -> str:
    shape = ", ".join(f"{k} {v}" for k, v in results["shape"].items())
    caps = sorted({r["cap_bytes"] for r in results["max_seq"]})
    lines = ["# Longest sequence at the same per-rank cap (measured, CPU): METP, torch's CP, Ulysses + ALST, "
             "1-D TP + SP", "",
             f"Command: `{results['command']}`", "", f"Machine: {results['machine']['summary']}", "",
             f"Date: {results['date']}; wall time {results.get('wall_s', 0) / 60:.1f} min", "",
             f"Model `{results['model']}` widened ({shape}; RoPE, GQA, SwiGLU), batch 1, float32, CPU gloo, "
             f"activation checkpointing `{results['activation_checkpointing']}` on every layout (Ulysses + ALST "
             "always checkpoints every layer; the runner wraps the baselines' plain blocks with torch's checkpoint "
             "before FSDP / CP / TP as it does METP's). Each probe: fresh processes, a warm-up step, then one "
             "measured training step (forward, backward, AdamW) under the cap; doubling from the row's unit, then "
             f"bisection to it, up to {results['limit']} tokens (a row's own limit where it says so). Caps per rank: "
             + " and ".join(f"{c / report.MIB:.0f} MiB" for c in caps) + ". Peak: resident bytes (parameter "
             "shards, gradients, AdamW state) plus the most the step's tensors hold at once (FSDP's gathered "
             "parameters included), on the rank that peaks highest. Largest tensors: the two largest alive at "
             "that peak (shape, dtype, MiB, the aten op that made them); FSDP's gathered parameters, grown by "
             "storage resizes, are counted but not named. Sent: bytes the rank that sends most puts on the wire "
             "in the measured step, per token of the batch.", "",
             "## Targets (p = 8, same cap)", "",
             "| cap MiB | target | METP max seq | rival max seq | measured ratio | threshold | verdict |",
             "|---|---|---|---|---|---|---|"]
    for t in targets(results):
        metp = "" if t["metp"] is None else (f">= {t['metp']} (its {CAP_MIB:.0f} MiB answer)" if t["lower_bound"]
                                             else str(t["metp"]))
        ratio = "" if t["ratio"] is None else ("inf (the rival fits no probe)" if t["ratio"] == float("inf")
                                               else f"{'>= ' if t['lower_bound'] else ''}{t['ratio']:.1f}")
        lines.append(f"| {t['cap_mib']:.0f} | METP / {t['rival']} | {metp} | "
                     f"{'' if t['rival_max'] is None else t['rival_max']} | {ratio} | >= {t['threshold']} "
                     f"| {t['verdict']} |")
    lines += ["", "## Longest sequence per layout", "",
              "| layout | p | cap MiB | unit | max seq | peak MiB there | largest tensors there "
              "| first probe over the cap: length, largest tensors alive when it passed | sent bytes per token "
              "there | probes | min |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["max_seq"]:
        if r.get("status") != "ok":
            lines.append(f"| {r['layout']} | {r['p']} | {r['cap_bytes'] / report.MIB:.0f} | {r.get('unit', '')} "
                         f"| {r.get('status')}: {r.get('reason', '')} | | | | | | |")
            continue
        value = r["max_seq"]
        if r.get("capped_by_limit"):
            value = f">= {value} (the search limit {r.get('limit', results['limit'])}: a lower bound)"
        sent = r.get("sent_bytes_per_token")
        sent = "" if sent is None else f"{sent:.0f}" + (" [1]" if r["layout"] == "ulysses" else "")
        lines.append(f"| {r['layout']} | {r['p']} | {r['cap_bytes'] / report.MIB:.0f} | {r['unit']} | {value} "
                     f"| {_mib(r.get('peak_bytes'))} | {_largest(r.get('largest'))} | {_over(r)} | {sent} "
                     f"| {len(r.get('probes', []))} | {r.get('wall_s', 0) / 60:.1f} |")
    fits = [(r, fit(r)) for r in results["max_seq"] if r.get("status") == "ok"]
    lines += ["", "## Fit of peak against length (probes that fitted), peak = fixed + per token x T", "",
              "| layout | p | cap MiB | fitted probes | fixed MiB | KiB per token | length at the cap (fit) |",
              "|---|---|---|---|---|---|---|"]
    for r, f in fits:
        n = sum(1 for x in r.get("probes", []) if x["status"] == "ok")
        if f is None:
            lines.append(f"| {r['layout']} | {r['p']} | {r['cap_bytes'] / report.MIB:.0f} | {n} | | | |")
            continue
        at_cap = (r["cap_bytes"] - f[0]) / f[1] if f[1] > 0 else float("inf")
        lines.append(f"| {r['layout']} | {r['p']} | {r['cap_bytes'] / report.MIB:.0f} | {n} | {f[0] / report.MIB:.1f} "
                     f"| {f[1] / 1024:.2f} | {at_cap:.0f} |")
    if results.get("superseded"):
        lines += ["", f"Superseded searches (kept in results.json under `superseded`): {results['superseded']['why']}: "
                  + "; ".join(f"{r['layout']} p = {r['p']}: {r.get('max_seq')}"
                              for r in results["superseded"]["max_seq"]) + "."]
    lines += ["", "![peak per rank against sequence length](peak_vs_seq.png)", "", WHY, "", NOTES]
    return "\n".join(lines) + "\n"


WHY = """## What sets each limit

**The caps.** At 128 MiB per rank METP's longest sequence is measured (24576 tokens at p = 8, its first probe over
the cap 28672), but `cp` and Ulysses fit no probe at all: FSDP2 gathers the root group (embedding, head and final
norm of a 32000-token vocabulary, 62.5 MiB) whole on every rank, and for a moment holds both the flat all-gather
buffer (`[16384256] float32`, named) and the unsharded parameters it is copied into (storage resizes: counted, not
named): 153 MiB at 128 tokens (p = 8), before any activation. So the baselines were searched again at 256 MiB,
where they fit 3072-3584 tokens. METP was not searched again there: a probe's peak does not depend on the cap, so
its longest sequence at 256 MiB is at least its 24576 at 128 MiB (a lower bound; the fit of its probes, 51.1 MiB
+ 2.96 KiB per token, reaches 256 MiB near 71k tokens: an extrapolation, not a measurement).

**The tensors at the limit.** METP (p = 8): its ring cross-entropy's logits block `[T/p, V/p]` (`[3072, 4000]`,
46.9 MiB of a 122.1 MiB peak; at 28672 tokens a `[3584, 4000]` block passed the cap). Its tile (`tile_tokens`,
8192 rows) is larger than `T/p` here, so this block is untiled: a smaller tile would move METP's limit further.
`cp`: three `[T/p, V]` float32 tensors of its loss (`log_softmax`, `nll_loss_backward`, `_log_softmax_backward_data`:
`[384, 32000]`, 46.9 MiB each at 3072 tokens) on top of the gathered root; its chunked loss cuts 1024-token
chunks, and `T/p` is at most 448 here, so each shard is one chunk: the chunking does not act at these lengths.
Ulysses: the same three `[T/p, V]` tensors: ALST's `TiledFusedLogitsLoss` tiles at 1 GiB of float32 logits, so
`T/p x V` (at most 55 MiB here) is one tile. 1-D TP + SP: `loss_parallel`'s `[T, V/p]` log-probabilities (`sub`,
`exp`, `zeros_like`: `[3584, 4000]`, 54.7 MiB each). `cp-tp`: `[T/4, V/2]` (`[768, 16000]`, 46.9 MiB each).

**p = 4: METP against "2d-metp" (2 x 2).** METP 2560 tokens against 512 at 128 MiB, 15360 against 3072 at
256 MiB (5.0x; the 256 MiB searches ran with a 16384 limit, METP's first probe over the cap was 16384). Both stop
at their logits block: METP's `[T/4, V/4]` (`[3840, 8000]`, 117.2 MiB at 15360 tokens), the grid's `[T/2, V/2]`
with two copies alive (`mm` and `mul`, `[1536, 16000]`, 93.8 MiB each at 3072 tokens): the grid splits the
vocabulary and the sequence by 2 each, the ring both by 4. `cp` and Ulysses fit nothing at 128 MiB at p = 4
either (the gathered root again, with twice the resident shards: 58 MB); they were not searched at 256 MiB at
p = 4 (time).

**Reading the fits.** The baselines' peaks are piecewise: flat while the gathered root decides (`cp` 158.4 MiB at 512
and at 1024 tokens, Ulysses 184.4 MiB), then about 48 KiB per token once the `[T/p, V]` loss tensors do (`cp`,
2048 -> 3072: 188.5 -> 236.3 MiB); one straight line through both parts gives the fixed and per-token figures in
the fit table, which describe the probes, not either regime. METP's probes lie on a line (2.96 KiB per token at
p = 8: block inputs `[T/p, h]` of four blocks, the recomputed block's `T/p`-row working set, the logits block).
"""


NOTES = """[1] Ulysses' sent bytes are FSDP's all-gathers and reduce-scatters only: DeepSpeed's all-to-alls
(`deepspeed.comm.all_to_all_single` -> `torch.distributed.all_to_all_single`, the c10d op `alltoall_base_`) are
seen by neither `comm_record`'s table of direct c10d collectives nor `FunctionalCollectiveCounter` (functional
collectives only). Not counted, by hand: per layer and pass each rank sends (p-1)/p of q `[T/p, 16, 16]`, k and v
`[T/p, 8, 16]` and the attention output `[T, 2, 16]`, 3072 (p-1)/p^2 bytes per token in float32; forward,
recomputed forward and backward make it three passes, four layers: 36864 (p-1)/p^2 = 4032 bytes per token at
p = 8, 6912 at p = 4, to add to the figure shown.

The machine's 2 cores were shared with other jobs (load average 6-10 during the run): the wall times are inflated;
the memory figures, counted tensor by tensor, are not.
"""


def plot(results: dict, out_dir: str) -> str:
    import matplotlib  # deferred: heavy to import, and only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: as above, after choosing the Agg backend

    panels: dict[tuple, list] = {}
    for r in results["max_seq"]:
        if r.get("status") == "ok":
            panels.setdefault((r["p"], r["cap_bytes"]), []).append(r)
    cols = min(2, max(1, len(panels)))
    rows = -(-max(1, len(panels)) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.6 * rows), squeeze=False)
    for ax, ((p, cap), rows) in zip(axes.flat, sorted(panels.items(), key=lambda kv: (-kv[0][0], kv[0][1]))):
        report.plot_probes(ax, rows, f"p = {p}, cap {cap / report.MIB:.0f} MiB (dashed): probes that fitted; "
                           "legend: the longest")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "peak_vs_seq.png"), dpi=110)
    plt.close(fig)
    return "peak_vs_seq.png"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "long_context"))
    ap.add_argument("--limit", type=int, default=LIMIT, help="longest sequence probed")
    ap.add_argument("--budget-min", type=float, default=33.0, help="no search starts after this many minutes")
    ap.add_argument("--probe-timeout", type=float, default=900.0, help="seconds per probe")
    ap.add_argument("--render", action="store_true", help="rewrite results.md and the plot from results.json")
    ap.add_argument("--resume", action="store_true",
                    help="run only the searches --out's results.json has no answer for (skipped or missing)")
    args = ap.parse_args(argv)
    if args.render or args.resume:
        with open(os.path.join(args.out, "results.json")) as f:
            results = json.load(f)
    if not args.render:
        results = run(args, argv, results if args.resume else None)
        save(results, args.out)
    render(results, args.out)
    print(f"wrote {args.out}/results.json, results.md, peak_vs_seq.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
