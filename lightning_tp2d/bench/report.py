"""Benchmark output: ``results.json`` (everything), ``results.md`` (tables and targets) and matplotlib plots."""

from __future__ import annotations

import json
import os

from lightning_tp2d.layouts import Grid2D, Ring
from lightning_tp2d.rivals import CP, HF, SINGLE, TP1D, TP1D_SP

MIB = 1024 * 1024
GRID, RING = Grid2D.name, Ring.name  # the layouts the targets compare with 1-D TP

# (key, title, threshold, what "met" means) -- the issue's targets, each a ratio measured in one run
TARGETS = {
    "activation_2d_vs_tp1d": ("\"2d\" peak activation memory per rank / 1-D TP's, p = 4", 0.5, "<="),
    # the same target read as everything above the resident bytes (activations, gradients, temporaries)
    "peak_2d_vs_tp1d": ("the same, read as peak above parameters + optimizer state", 0.5, "<="),
    "max_seq_metp_vs_tp1d": ("METP max sequence / 1-D TP's, same cap", 2.38, ">="),
    # issue 25: torch's context parallelism and 1-D TP + SP as the long-context baselines, p = 8
    "max_seq_metp_vs_cp_p8": ("p = 8: METP max sequence / torch's context parallelism's (cp), same cap", 1.5, ">="),
    "max_seq_metp_vs_tp1d_sp_p8": ("p = 8: METP max sequence / 1-D TP + SP's, same cap", 3.0, ">="),
    "wire_2d_vs_tp1d_p16": ("\"2d\" communication bytes per rank / 1-D TP's, p >= 16", 1.0, "<"),
    "single_vs_hf_tokens": ("plain GPT2 tokens/s / transformers GPT2LMHeadModel (SDPA)", 0.95, ">="),
    # issue 11 (SUMMA v2), from the cost model's projection
    "proj_2d_vs_tp1d_sp_p4": ("cost model, 4 GPUs: \"2d\" step time / 1-D TP+SP's (blocking)", 0.8, "<="),
    "proj_2d_vs_tp1d_sp_async_p4": ("cost model, 4 GPUs: \"2d\" step time / 1-D TP+SP's with async TP", 1.0, "<="),
    "fair_speedup_p16": ("cost model, 16 GPUs: best 1-D (TP x DP) step time / best \"2d\" (grid x DP)", 1.3, ">="),
    "fair_speedup_p64": ("cost model, 64 GPUs: best 1-D (TP x DP) step time / best \"2d\" (grid x DP)", 1.3, ">="),
}


def _ok(rows, **match):
    for r in rows:
        if r.get("status") == "ok" and all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def evaluate_targets(results: dict) -> list[dict]:
    """Each target with its measured ratio, ``met`` (``None`` when this run did not measure it) and where from."""
    out = []

    def add(key, value, source):
        title, threshold, op = TARGETS[key]
        met = None if value is None else {"<=": value <= threshold, ">=": value >= threshold,
                                          "<": value < threshold}[op]
        out.append({"key": key, "target": title, "threshold": f"{op} {threshold}", "value": value, "met": met,
                    "source": source})

    scen = results.get("scenarios", [])
    a, b = _ok(scen, layout=GRID, p=4), _ok(scen, layout=TP1D.name, p=4)
    add("activation_2d_vs_tp1d", a["activation_bytes"] / b["activation_bytes"] if a and b else None,
        "scenarios (activation bytes alive at the end of the forward)")
    add("peak_2d_vs_tp1d", (a["peak_bytes"] - a["resident_bytes"]) / (b["peak_bytes"] - b["resident_bytes"])
        if a and b else None, "scenarios (peak of the step minus resident bytes)")
    ms = results.get("max_seq", [])
    m = next((r for r in ms if r["layout"] == RING and r.get("status") == "ok"), None)
    t = next((r for r in ms if r["layout"] == TP1D.name and r.get("status") == "ok" and m and r["p"] == m["p"]), None)
    ratio = m["max_seq"] / t["max_seq"] if m and t and t["max_seq"] else None
    add("max_seq_metp_vs_tp1d", ratio, f"max-sequence search at p = {m['p']}" if m else "max-sequence search")
    _lower_bound(out[-1], m)
    for key, baseline in (("max_seq_metp_vs_cp_p8", CP.name), ("max_seq_metp_vs_tp1d_sp_p8", TP1D_SP.name)):
        m, t = (next((r for r in ms if r["layout"] == name and r["p"] == 8 and r.get("status") == "ok"), None)
                for name in (RING, baseline))
        add(key, m["max_seq"] / t["max_seq"] if m and t and t["max_seq"] else None, "max-sequence search at p = 8")
        _lower_bound(out[-1], m)
    weak = results.get("weak_scaling", [])
    big = sorted({r["p"] for r in weak if r["p"] >= 16 and r.get("status") == "ok"})
    if big:
        a, b = _ok(weak, layout=GRID, p=big[0]), _ok(weak, layout=TP1D.name, p=big[0])
        add("wire_2d_vs_tp1d_p16", a["wire_bytes"] / b["wire_bytes"] if a and b else None,
            f"weak-scaling run at p = {big[0]} (wire bytes of the counted calls)")
    else:
        proj = [r for r in results.get("projection", {}).get("rows", []) if r["gpus"] >= 16]
        add("wire_2d_vs_tp1d_p16", proj[0]["wire_bytes_2d"] / proj[0]["wire_bytes_tp1d"] if proj else None,
            f"cost model at {proj[0]['gpus']} GPUs" if proj else "cost model")
    s, h = _ok(scen, layout=SINGLE.name), _ok(scen, layout=HF.name)
    add("single_vs_hf_tokens", s["tokens_per_s"] / h["tokens_per_s"] if s and h and "tokens_per_s" in s else None,
        "scenarios (median step time after warm-up)")
    proj = results.get("projection", {})
    p4 = next((r for r in proj.get("rows", []) if r["gpus"] == 4 and "time_tp1d_sp_s" in r), None)
    where = f"projection, {proj.get('model')} batch {proj.get('batch')} x {proj.get('seq')}"
    add("proj_2d_vs_tp1d_sp_p4", p4["time_2d_s"] / p4["time_tp1d_sp_s"] if p4 else None, where)
    add("proj_2d_vs_tp1d_sp_async_p4", p4["time_2d_s"] / p4["time_tp1d_sp_async_s"] if p4 else None, where)
    for n in (16, 64):
        f = next((x for x in proj.get("fair", []) if x["gpus"] == n), None)
        add(f"fair_speedup_p{n}", f["speedup"] if f else None,
            where + (f": 1-D {f['best_tp1d']['layout']} tp {f['best_tp1d']['tp']} x dp {f['best_tp1d']['dp']} against "
                     f"2d {f['best_2d']['tp']} ranks x dp {f['best_2d']['dp']}" if f else ""))
    return out


def _lower_bound(target: dict, metp: dict | None) -> None:
    """A METP max-sequence ratio measured while METP fitted every probe up to the search limit is only a lower
    bound (the true ratio is higher): neither met nor refuted while it is below the threshold."""
    if target["value"] is not None and metp.get("capped_by_limit") and not target["met"]:
        target.update(met=None, bound="lower", source=target["source"] + " (METP reached the search limit)")


def _mib(v) -> str:
    return "" if v is None else f"{v / MIB:.2f}"


def _fmt(v, spec=".3g") -> str:
    return "" if v is None else format(v, spec)


def verdict(target: dict) -> str:
    """A target's status in words: ``met``, ``not met``, ``not measured`` (this run has no value), or, for a measured
    value that is only a lower bound below the threshold, ``lower bound: ...`` (neither met nor refuted)."""
    if target.get("bound") == "lower":
        return (f"lower bound: at least {_fmt(target['value'])}, the search stopped at its limit "
                f"(undecided against {target['threshold']})")
    return {True: "met", False: "not met", None: "not measured"}[target["met"]]


def model_text(spec: dict) -> str:
    """The benchmarked model in words: ``gpt2-tiny (n_head=12)`` (the config fields ``--set`` changed in brackets)."""
    fields = ", ".join(f"{k}={v}" for k, v in (spec.get("overrides") or {}).items())
    return f"`{spec['model']}`" + (f" ({fields})" if fields else "")


def markdown(results: dict) -> str:
    lines = [f"# tp2d-bench results", "", f"Command: `{results['command']}`", "",
             f"Machine: {results['machine']['summary']}", "", f"Date: {results['date']}", ""]
    spec = results["spec"]
    lines += [f"Model {model_text(spec)}, {spec['dtype']}, device {spec['device']}"
              + (f"; scenarios at batch {spec['batch']} x sequence {spec['seq']}" if results.get("scenarios") else "")
              + (f"; the package's layouts with activation checkpointing `{spec['activation_checkpointing']}` "
                 "(baselines without)" if spec.get("activation_checkpointing", "none") != "none" else "")
              + (f"; models compiled (`{spec['compile']}`)" if spec.get("compile") else "")
              + ". Memory on CPU is live tensor bytes (parameters, gradients, optimizer state, activations), on GPU "
              "the CUDA allocator's; activation = allocated by the forward and alive at its end; peak = the most "
              "alive during one whole step. Communication: payload bytes per rank per step as counted (`= model`: "
              "equal, kind by kind and rank by rank, to the cost model); wire bytes: what the rank sends under "
              "ring/pipelined algorithms (cost model).", ""]
    lines += ["## Targets", "", "| target | measured | threshold | met | from |", "|---|---|---|---|---|"]
    for t in results.get("targets", []):
        met = verdict(t) if t["met"] is None else f"**{verdict(t)}**"
        lines.append(f"| {t['target']} | {_fmt(t['value'])} | {t['threshold']} | {met} | {t['source']} |")
    if results.get("scenarios"):
        lines += ["", "## Scenarios", "",
                  "| layout | ranks | status | loss | step ms | tokens/s | resident MiB | activation MiB | peak MiB "
                  "| comm calls | calls per block | comm MiB | = model | wire MiB | sent MiB |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results.get("scenarios", []):
        if r["status"] != "ok":
            lines.append(f"| {r['layout']} | {r['p']} | {r['status']}: {r['reason']} |" + " |" * 12)
            continue
        match = {True: "yes", False: "**no**", None: "n/a"}[r.get("comm_matches_model")]
        lines.append(
            f"| {r['layout']} | {r['p']} | ok | {r['loss']:.5f} | {_fmt(r.get('step_time_s', 0) * 1e3, '.1f')} "
            f"| {_fmt(r.get('tokens_per_s'), '.0f')} | {_mib(r['resident_bytes'])} | {_mib(r['activation_bytes'])} "
            f"| {_mib(r['peak_bytes'])} | {r['comm_calls']} | {r.get('calls_per_block', '')} | {_mib(r['comm_bytes'])} "
            f"| {match} "
            f"| {_mib(r.get('wire_bytes'))} | {_mib(r.get('sent_bytes'))} |")
    kernels = [f"{r['layout']}: `{r['attention_kernel']}`" for r in results.get("scenarios", [])
               if r.get("attention_kernel")]
    if kernels:
        lines += ["", "Ring attention's per-block kernel: " + ", ".join(kernels) + "."]
    if results.get("max_seq"):
        lines += ["", "## Maximum sequence length under a per-rank cap", "",
                  "| layout | ranks | batch | cap MiB | max seq | peak MiB there | sent bytes per token there "
                  "| probes | attention kernel |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += max_seq_rows(results["max_seq"])
    if results.get("weak_scaling"):
        lines += ["", "## Weak scaling (batch grows with p)", "",
                  "| layout | p | batch | status | step ms | comm MiB | wire MiB | activation MiB | note |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in results["weak_scaling"]:
            if r["status"] != "ok":
                lines.append(f"| {r['layout']} | {r['p']} | {r['batch']} | {r['status']}: {r['reason']} |" + " |" * 5)
                continue
            lines.append(f"| {r['layout']} | {r['p']} | {r['batch']} | ok | {_fmt(r.get('step_time_s', 0) * 1e3, '.1f')} "
                         f"| {_mib(r['comm_bytes'])} | {_mib(r.get('wire_bytes'))} | {_mib(r['activation_bytes'])} "
                         f"| {r.get('note', '')} |")
    proj = results.get("projection")
    if proj:
        lines += ["", f"## Cost model: projected step time, {proj['model']} batch {proj['batch']} x {proj['seq']}, "
                  f"{proj['hardware']}", "",
                  "| GPUs | 2d ms | 1-D TP ms | 1-D TP+SP ms | 1-D TP+SP async ms | speedup 2d / 1-D | 2d wire MiB "
                  "| 1-D wire MiB | 2d activation MiB | 1-D activation MiB | 1-D TP+SP activation MiB |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in proj["rows"]:
            sp, sp_async = (r.get(k) for k in ("time_tp1d_sp_s", "time_tp1d_sp_async_s"))
            lines.append(f"| {r['gpus']} | {r['time_2d_s'] * 1e3:.2f} | {r['time_tp1d_s'] * 1e3:.2f} | "
                         f"{_fmt(sp and sp * 1e3, '.2f')} | {_fmt(sp_async and sp_async * 1e3, '.2f')} | "
                         f"{r['speedup']:.2f} | {_mib(r['wire_bytes_2d'])} | {_mib(r['wire_bytes_tp1d'])} "
                         f"| {_mib(r.get('activation_bytes_2d'))} | {_mib(r.get('activation_bytes_tp1d'))} "
                         f"| {_mib(r.get('activation_bytes_tp1d_sp'))} |")
        variants = [r for r in proj["rows"] if "time_2d_keep_s" in r]
        if variants:
            lines += ["", "\"2d\" SUMMA variants (the default is collective SUMMA re-gathering panels in backward):", "",
                      "| GPUs | variant | step ms | exposed comm ms | activation MiB |", "|---|---|---|---|---|"]
            for r in variants:
                lines.append(f"| {r['gpus']} | collective (default) | {r['time_2d_s'] * 1e3:.2f} | "
                             f"{r['exposed_comm_2d_s'] * 1e3:.2f} | {_mib(r['activation_bytes_2d'])} |")
                for key, name in (("keep", "collective, keep panels"), ("broadcast", "broadcast (Optimus)")):
                    lines.append(f"| {r['gpus']} | {name} | {r[f'time_2d_{key}_s'] * 1e3:.2f} | "
                                 f"{r[f'exposed_comm_2d_{key}_s'] * 1e3:.2f} | {_mib(r[f'activation_bytes_2d_{key}'])} |")
        if proj.get("fair"):
            lines += ["", "Fair rows: every tensor x data parallel configuration (1-D: TP+SP inside a node, bf16 on "
                      "the wire, blocking or async TP, whichever is faster; TP 1 is plain data parallelism), the "
                      "float32 gradient all-reduce hierarchical across nodes and overlapped with the backward:", "",
                      "| GPUs | family | TP ranks | DP | batch/replica | step ms | DP all-reduce ms (exposed) | total ms |",
                      "|---|---|---|---|---|---|---|---|"]
            for f in proj["fair"]:
                for c in f["configurations"]:
                    best = " **best**" if c in (f["best_tp1d"], f["best_2d"]) else ""
                    lines.append(f"| {f['gpus']} | {c['layout']}{best} | {c['tp']} | {c['dp']} | {c['batch']} | "
                                 f"{c['step_s'] * 1e3:.2f} | {c['dp_comm_s'] * 1e3:.2f} ({c['dp_exposed_s'] * 1e3:.2f}) "
                                 f"| {c['total_s'] * 1e3:.2f} |")
                lines.append(f"| {f['gpus']} | speedup best 1-D / best 2d: {f['speedup']:.2f} (1-D with TP >= 2 "
                             f"only: {f['speedup_vs_tp_ge_2']:.2f}) | | | | | | |")
        cal = proj.get("gemm_calibration")
        if cal:
            lines += ["", f"GEMMs priced as FLOPs / {cal['rate_flops_per_s'] / 1e12:.3g} TFLOP/s + "
                      f"{cal['overhead_s'] * 1e6:.3g} us per kernel, the fit of the {cal['source']}:", "",
                      "| m | k | n | TFLOP/s | source |", "|---|---|---|---|---|"]
            lines += [f"| {p['m']} | {p['k']} | {p['n']} | {p['flops_per_s'] / 1e12:.3g} | {p['source']} |"
                      for p in cal["table"]]
        if "metp_overlap_threshold" in proj:
            lines += ["", f"METP full-overlap threshold ({proj['hardware']}): a ring step's attention covers its "
                      f"K/V transfer from {proj['metp_overlap_threshold']} tokens per rank."]
    check = results.get("model_check")
    if check:
        lines += ["", "## Cost model against this run", "", check["summary"]]
    return "\n".join(lines) + "\n"


def max_seq_rows(rows: list[dict]) -> list[str]:
    """The markdown rows of a maximum-sequence table (one per search: its answer, the peak and bytes sent per token
    of the longest probe that fitted)."""
    lines = []
    for r in rows:
        value = r.get("max_seq", r.get("reason", ""))
        value = f"{value} (the search limit: a lower bound)" if r.get("capped_by_limit") else value
        lines.append(f"| {r['layout']} | {r['p']} | {r['batch']} | {_mib(r['cap_bytes'])} | {value} "
                     f"| {_mib(r.get('peak_bytes'))} | {_fmt(r.get('sent_bytes_per_token'), '.0f')} "
                     f"| {len(r.get('probes', []))} | {r.get('attention_kernel', '')} |")
    return lines


def plot_probes(ax, rows: list[dict], title: str) -> None:
    """Peak bytes per rank against sequence length, one line per search of ``rows`` (its probes that fitted), the
    cap as a horizontal line."""
    for r in rows:
        pts = sorted((x["seq"], x["peak_bytes"] / MIB) for x in r.get("probes", [])
                     if x["status"] == "ok" and x.get("peak_bytes"))
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"{r['layout']} (p={r['p']}): {r.get('max_seq')}")
    for cap in sorted({r["cap_bytes"] for r in rows}):
        ax.axhline(cap / MIB, color="grey", ls="--", lw=0.8)
    ax.set(xlabel="sequence length", ylabel="peak MiB per rank", title=title)
    ax.title.set_fontsize(9)
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    if ax.get_lines():
        ax.legend(fontsize=8)


def plots(results: dict, out_dir: str) -> list[str]:
    """PNG plots of whatever sections the run has; returns the file names written."""
    import matplotlib  # deferred: heavy to import, and only the plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: as above, after choosing the Agg backend

    written = []
    mem = [r for r in results.get("memory_vs_seq", []) if r.get("status") == "ok"]
    if mem:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, key, title in ((axes[0], "peak_bytes", "peak of one step (after a warm-up: optimizer state resident)"),
                               (axes[1], "activation_bytes", "activations alive at the end of the forward")):
            for layout in dict.fromkeys(r["layout"] for r in mem):
                rows = [r for r in mem if r["layout"] == layout]
                pts = sorted((r["seq"], r[key] / MIB) for r in rows)
                ax.plot(*zip(*pts), marker="o", label=f"{layout} (p={rows[0]['p']})")
            ax.set(xlabel="sequence length", ylabel="MiB per rank", title=title)
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
            ax.legend()
        written.append(_save(fig, out_dir, "memory_vs_seq.png"))
    if any(x["status"] == "ok" for r in results.get("max_seq", []) for x in r.get("probes", [])):
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        plot_probes(ax, results["max_seq"], "Max-sequence probes that fitted (dashed: the cap); legend: longest")
        written.append(_save(fig, out_dir, "max_seq_probes.png"))
    weak = [r for r in results.get("weak_scaling", []) if r.get("status") == "ok"]
    if weak:
        fig, ax = plt.subplots(figsize=(6, 4))
        for layout in dict.fromkeys(r["layout"] for r in weak):
            pts = sorted((r["p"], r["wire_bytes"] / MIB) for r in weak if r["layout"] == layout)
            ax.plot(*zip(*pts), marker="o", label=f"{layout}")
        ax.set(xlabel="ranks p (batch grows with p)", ylabel="wire MiB per rank per step",
               title="Communication per rank vs p")
        ax.grid(alpha=0.3)
        ax.legend()
        written.append(_save(fig, out_dir, "comm_vs_p.png"))
    proj = results.get("projection")
    if proj:
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        where = f"{proj['model']}, batch {proj['batch']} x {proj['seq']}, {proj['hardware']}"
        fair = sorted(proj.get("fair", []), key=lambda f: f["gpus"])
        if fair:  # the fair rows of results.md: per GPU count the best configuration of each family
            gpus = [f["gpus"] for f in fair]
            ax.plot(gpus, [f["speedup"] for f in fair], marker="o",
                    label="best 2d (grid x DP) vs best 1-D TP+SP x DP (TP 1: plain DP)")
            if all("speedup_vs_tp_ge_2" in f for f in fair):
                ax.plot(gpus, [f["speedup_vs_tp_ge_2"] for f in fair], marker="s", ls="--",
                        label="best 2d (grid x DP) vs best 1-D TP+SP (TP >= 2) x DP")
            ax.set(xlabel="GPUs (tensor x data parallel)",
                   ylabel="best 1-D TP+SP x DP step time / best 2d's",
                   title=f"Cost model: best 2d vs best 1-D TP+SP x DP per GPU count\n{where}")
        else:  # a results.json without fair rows: one tensor-parallel group of all GPUs, as projected_speedup prices
            gpus = [r["gpus"] for r in proj["rows"]]
            ax.plot(gpus, [r["speedup"] for r in proj["rows"]], marker="o",
                    label="2d vs one 1-D TP group of all GPUs (no SP, blocking)")
            ax.set(xlabel="GPUs (one tensor-parallel group, across nodes beyond one)",
                   ylabel="1-D TP step time / 2d's",
                   title=f"Cost model: 2d vs one 1-D TP group (no SP, blocking) of all GPUs\n{where}")
        ax.title.set_fontsize(9)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(gpus, [str(g) for g in gpus])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend()
        written.append(_save(fig, out_dir, "speedup_vs_gpus.png"))
    return written


def _save(fig, out_dir: str, name: str) -> str:
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, name), dpi=110)
    import matplotlib.pyplot as plt  # deferred: heavy to import, and only the plots need it

    plt.close(fig)
    return name


def write(results: dict, out_dir: str) -> list[str]:
    """Write results.json, results.md and the plots into ``out_dir``; returns the file names."""
    os.makedirs(out_dir, exist_ok=True)
    results["targets"] = evaluate_targets(results)
    names = plots(results, out_dir)
    results["plots"] = names
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(markdown(results))
    return ["results.json", "results.md", *names]


def rerender(out_dir: str) -> list[str]:
    """Write results.md and the plots again from ``out_dir/results.json`` (e.g. after editing its ``command``)."""
    with open(os.path.join(out_dir, "results.json")) as f:
        results = json.load(f)
    return write(results, out_dir)


if __name__ == "__main__":  # python -m lightning_tp2d.bench.report <results folder>
    import sys

    print(", ".join(rerender(sys.argv[1])))
