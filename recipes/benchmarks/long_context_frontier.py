"""Long context at the frontier (projected): the longest sequence each scheme trains, with and without host offload
of the checkpointed block inputs, for Llama 3.1 8B on 1, 8 and 32 H100-80GB and 70B on 32 and 64, and its
tokens/s/GPU -- "metp" and "2d-metp" against torch's context parallelism with a chunked loss (``cp``), Ulysses with
ALST's tiling (DeepSpeed's own code, :mod:`lightning_tp2d.baselines.ulysses`) and 1-D TP + SP; calibrated against ALST's
published lengths.

    python recipes/benchmarks/long_context_frontier.py [--out recipes/benchmarks/long_context] [--only 8b-8]

Every scheme: one sequence per replica, bf16 compute with float32 master weights and AdamW state, full activation
checkpointing (ALST's recipe; the others need it at these lengths), the planner's 90% margin of 80 GiB
(:func:`lightning_tp2d.planning.planner.longest_sequence`); "with offload": the same rule for every scheme
(:func:`~lightning_tp2d.planning.planner.offload_memory`: all but two block inputs in pinned host memory, the node's
2 TB holding them; the copies priced by :func:`~lightning_tp2d.planning.planner.offload_time`). Memory: the package's
layouts from the traced memory model (:func:`~lightning_tp2d.planning.memory_model.peak_bytes`, the step run on fake
tensors), the rivals from their analytic estimates (``cp_peak_bytes``, ``ulysses_peak_bytes``,
``baseline_peak_bytes``), each checked against measured CPU steps in the tests. The traced model costs a minute or
more per evaluation on 2 cores, so each package configuration is traced at two lengths and its peak, linear in the
length under full checkpointing, is solved for the cap on that line; one row is traced again at its answer and the
line's error printed. Sizes: "metp" over every GPU (a ring of ``gpus``, across nodes beyond 8), "2d-metp" on the
largest square grid that divides the GPUs (``dp`` replicas of it, ZeRO 3), ``cp`` and Ulysses over every GPU (FSDP2
over the same), 1-D TP + SP over 8 GPUs of a node x ``gpus / 8`` replicas (ZeRO 3).

Writes ``frontier.json`` (after every configuration, so a stopped run keeps what it found) and ``frontier.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch

from lightning_tp2d.planning import planner
from lightning_tp2d.planning.memory_model import parameter_split
from lightning_tp2d.planning.rivals import check_ulysses
from lightning_tp2d.families import model_config

HERE = Path(__file__).resolve().parent / "long_context"
MEMORY_GIB, FRACTION, GPUS_PER_NODE = 80.0, 0.9, 8
SETTINGS = (("llama-3.1-8b", 1), ("llama-3.1-8b", 8), ("llama-3.1-8b", 32), ("llama-3.1-70b", 32),
            ("llama-3.1-70b", 64))
AT = 1 << 20  # tokens/s/GPU compared at 1M tokens (8B on 8)
# ALST (arXiv 2506.13996, Table/Fig. "maximum sequence length", Llama-8B on H100 80GB, bf16, with checkpoint offload,
# tiled MLP and loss, Ulysses SP; 1 GPU also offloads the optimizer states to the CPU)
ALST = {("llama-3.1-8b", 1): 500_000, ("llama-3.1-8b", 8): 3_700_000, ("llama-3.1-8b", 32): 15_000_000}
TRACED = ("metp", "2d-metp")


def schemes(cfg, gpus: int) -> list[dict]:
    """The configurations compared on ``gpus`` GPUs (module docstring); a rival that cannot run there is left out
    with its reason."""
    out = [{"scheme": "metp", "layout": "metp", "p": gpus, "dp": 1, "stage": 0}]
    q = max(q for q in range(1, math.isqrt(gpus) + 1) if gpus % (q * q) == 0)
    if q > 1:
        dp = gpus // (q * q)
        out.append({"scheme": f"2d-metp {q}x{q}" + (f" x dp {dp}" if dp > 1 else ""), "layout": "2d-metp",
                    "p": q * q, "dp": dp, "stage": 3 if dp > 1 else 0})
    out.append({"scheme": "cp (chunked loss)", "layout": planner.CP, "p": gpus, "dp": 1, "stage": 3})
    try:
        check_ulysses(cfg, gpus, gpus * 1024)
        out.append({"scheme": "Ulysses + ALST tiling", "layout": planner.ULYSSES, "p": gpus, "dp": 1, "stage": 3})
    except ValueError as err:
        out.append({"scheme": "Ulysses + ALST tiling", "layout": planner.ULYSSES, "skip": str(err)})
    tp = min(GPUS_PER_NODE, gpus)
    out.append({"scheme": f"1-D TP {tp} + SP" + (f" x FSDP {gpus // tp}" if gpus > tp else ""),
                "layout": planner.BASELINE, "p": tp, "dp": gpus // tp, "stage": 3 if gpus > tp else 0})
    return out


def _multiple(row: dict) -> int:
    return 1024 * 2 * row["p"]


class Line:
    """A package configuration's memory parts as lines in the sequence length through two traced evaluations."""

    def __init__(self, cfg, row: dict, t1: int) -> None:
        self.cfg, self.row = cfg, row
        self.t1, self.t2 = t1, 2 * t1
        started = time.time()
        self.m1, self.m2 = (self.traced(t) for t in (self.t1, self.t2))
        self.seconds = time.time() - started

    def traced(self, seq: int) -> dict:
        r = self.row
        return planner.row_memory(self.cfg, r["layout"], r["p"], r["dp"], r["stage"], "full", 1, seq)

    def __call__(self, seq: int) -> dict:
        out = {}
        for key, a in self.m1.items():
            b = self.m2.get(key)
            if isinstance(a, (int, float)) and isinstance(b, (int, float)):
                out[key] = a + (b - a) * (seq - self.t1) / (self.t2 - self.t1)
        out["largest"] = self.m2.get("largest")
        return out


def longest(cfg, row: dict, hw, offload: bool, memory_fn) -> dict:
    found = planner.longest_sequence(cfg, layout=row["layout"], p=row["p"], dp=row["dp"], zero_stage=row["stage"],
                                     gpu_memory_gib=MEMORY_GIB, hw=hw, gpus_per_node=GPUS_PER_NODE,
                                     memory_fraction=FRACTION, offload=offload, multiple=_multiple(row),
                                     memory_fn=memory_fn)
    memory = found["memory"]
    return {"seq": found["seq"], "limit": found["limit"], "gib": memory["total"] / planner.GIB,
            "host_gib_per_node": memory.get("host_per_node", 0.0) / planner.GIB,
            "largest": _largest(memory), "evaluations": found["evaluations"]}


def _largest(memory: dict) -> str:
    big = memory.get("largest")
    if isinstance(big, dict):  # the traced model's record: the largest live tensor at its peak
        return f"{tuple(big.get('shape', ()))} {big.get('dtype', '')} ({big.get('bytes', 0) / planner.GIB:.2f} GiB)"
    if isinstance(big, list) and big:
        return _largest({"largest": big[0]})
    if isinstance(big, str) and "largest_bytes" in memory:  # Ulysses' estimate names its largest tensor
        return f"{big} ({memory['largest_bytes'] / planner.GIB:.2f} GiB)"
    phases, at = memory.get("phases"), memory.get("peak_at")
    if isinstance(phases, dict) and at in phases:  # cp's estimate: parts of the phase at its peak, not tensors
        parts = {k: v for k, v in phases[at].items() if k not in _RESIDENT}
        name = max(parts, key=parts.get)
        return f"part '{name}' of '{at}' ({parts[name] / planner.GIB:.2f} GiB)"
    parts = {k: v for k, v in memory.items() if isinstance(v, (int, float)) and k not in _RESIDENT
             and k not in ("total", "host", "host_per_node", "offloaded", "largest_bytes")}
    name = max(parts, key=parts.get) if parts else "?"
    return f"part '{name}' ({parts.get(name, 0) / planner.GIB:.2f} GiB)"


# the step's state and the checkpointed block inputs (what offload moves): not the working set that sets the peak
_RESIDENT = ("parameters", "gradients", "optimizer", "activations", "states", "checkpoints")


def priced(cfg, row: dict, seq: int, hw, offload: bool, memory: dict) -> dict:
    """tokens/s/GPU of ``row`` at ``seq`` (the planner's price; the package's step traced by the cost model)."""
    r = planner.price(cfg, layout=row["layout"], p=row["p"], dp=row["dp"], zero_stage=row["stage"],
                      checkpointing="full", micro_batch=1, grad_accum=1, seq=seq, hw=hw,
                      gpus_per_node=GPUS_PER_NODE, memory=memory, offload=offload)
    t = r.parts["time_s"]
    return {"tokens_per_s_per_gpu": r.tokens_per_s_per_gpu, "mfu": r.mfu, "step_s": r.step_s,
            "host_copy_s": t["micro_host_copy"], "host_exposed_s": t["micro_host_exposed"],
            "tp_exposed_s": t["micro_tp_exposed"]}


def setting(model: str, gpus: int, hw, log) -> dict:
    cfg = model_config(model)
    split = parameter_split(cfg)
    state_gib = 16 * split.total / gpus / planner.GIB
    out = {"model": model, "gpus": gpus, "state_gib_per_gpu": state_gib, "rows": []}
    if gpus == 1:
        out["note"] = (f"nothing fits: {split.total / 1e9:.2f}B parameters x 16 bytes (float32 weights, gradients, AdamW "
                       f"moments) = {state_gib:.0f} GiB on one GPU before any activation, over the "
                       f"{FRACTION * MEMORY_GIB:.0f} GiB margin; ALST's 500K on one H100 offloads the optimizer "
                       "state to host memory (DeepSpeed ZeRO-Offload), which neither the package nor the other rivals "
                       "here do")
        return out
    for row in schemes(cfg, gpus):
        entry = dict(row)
        if "skip" in row:
            out["rows"].append(entry)
            continue
        started = time.time()
        if row["layout"] in TRACED:
            line = Line(cfg, row, t1=max(_multiple(row), (1 << 19) * gpus // 8 // _multiple(row) * _multiple(row)))
            fn = line
            entry["traced_at"] = [line.t1, line.t2]
            entry["trace_s"] = line.seconds
        else:
            fn = None
        for offload in (False, True):
            key = "offload" if offload else "resident"
            try:
                entry[key] = longest(cfg, row, hw, offload, fn)
            except (planner.NothingFits, ValueError, RuntimeError) as err:
                entry[key] = {"seq": 0, "error": str(err)}
                continue
            seq = entry[key]["seq"]
            if fn is not None:  # the traced record: the step traced at the line's longer length
                entry[key]["largest"] += f", traced at {fn.t2:,} tokens"
            memory = fn(seq) if fn is not None else None
            try:
                entry[key] |= priced(cfg, row, seq, hw, offload, memory)
            except (ValueError, RuntimeError) as err:
                entry[key]["price_error"] = str(err)
            log(f"{model} on {gpus}: {row['scheme']} {key}: {seq:,} tokens, {entry[key]['gib']:.1f} GiB, "
                f"{entry[key].get('tokens_per_s_per_gpu', 0):,.0f} tok/s/GPU ({time.time() - started:.0f} s)")
        entry["seconds"] = time.time() - started
        out["rows"].append(entry)
    return out


def check_line(cfg, row: dict, seq: int, line_memory: dict) -> dict:
    """Trace ``row`` at ``seq`` (its answer) and compare with the line's prediction there."""
    traced = planner.row_memory(cfg, row["layout"], row["p"], row["dp"], row["stage"], "full", 1, seq)
    return {"seq": seq, "traced_gib": traced["total"] / planner.GIB, "line_gib": line_memory["total"] / planner.GIB,
            "largest": _largest(traced)}


def at_one_million(hw, log) -> list[dict]:
    """tokens/s/GPU of every scheme at 1M tokens, Llama 3.1 8B on 8 GPUs, with offload where it needs it to fit."""
    cfg = model_config("llama-3.1-8b")
    cap = FRACTION * MEMORY_GIB * planner.GIB
    out = []
    for row in schemes(cfg, 8):
        if "skip" in row:
            continue
        memory = planner.row_memory(cfg, row["layout"], row["p"], row["dp"], row["stage"], "full", 1, AT)
        offload = memory["total"] > cap
        held = planner.offload_memory(memory, cfg, 1, AT, row["p"], GPUS_PER_NODE) if offload else memory
        entry = {"scheme": row["scheme"], "layout": row["layout"], "offload": offload,
                 "gib": held["total"] / planner.GIB, "fits": held["total"] <= cap, "largest": _largest(memory)}
        entry |= priced(cfg, row, AT, hw, offload, memory)
        log(f"1M: {row['scheme']}: {entry['tokens_per_s_per_gpu']:,.0f} tok/s/GPU, {entry['gib']:.1f} GiB")
        out.append(entry)
    return out


def _seq(x: dict) -> str:
    if not x or "error" in x:
        return "does not fit" if x else ""
    return f"{x['seq'] / 1e6:.2f}M" + (" (host)" if x.get("limit") == "host" else "")


def markdown(results: dict) -> str:
    lines = ["# Long context at the frontier (projected): longest sequence per scheme, with and without offload", "",
             "Predictions of the planner's memory and cost models (`recipes/benchmarks/long_context_frontier.py`), "
             f"not measurements: no GPU has run them. {results['seconds'] / 60:.0f} min on {results['machine']}, "
             f"{results['date']}.", "",
             f"Hardware: {results['hardware']}; host link {results['host_gbps']:.0f} GB/s per GPU per direction and "
             f"{results['host_tb']:.0f} TB of host memory per node (assumed). One sequence per replica, bf16, full "
             f"checkpointing, {FRACTION:.0%} of {MEMORY_GIB:g} GiB. \"offload\": all but two block inputs in host "
             "memory, the same rule for every scheme; \"(host)\": the node's host memory, not the GPU, sets the length. "
             "Largest tensor: the traced model's record for the package's layouts (at the longer traced length), the "
             "named tensor or part of the rivals' estimates.", ""]
    for s in results["settings"]:
        lines += [f"## {s['model']} on {s['gpus']} GPU{'s' if s['gpus'] > 1 else ''}", ""]
        if "note" in s:
            lines += [s["note"][0].upper() + s["note"][1:] + ".", ""]
            continue
        lines += ["| scheme | longest | GiB/GPU | tok/s/GPU | longest with offload | GiB/GPU | host GiB/node | "
                  "tok/s/GPU | exposed PCIe s/step | largest tensor at the peak (offload) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in s["rows"]:
            if "skip" in r:
                lines.append(f"| {r['scheme']} | cannot run: {r['skip']} | | | | | | | | |")
                continue
            a, b = r.get("resident", {}), r.get("offload", {})
            lines.append(f"| {r['scheme']} | {_seq(a)} | {a.get('gib', 0):.1f} | "
                         f"{a.get('tokens_per_s_per_gpu', 0):,.0f} | {_seq(b)} | {b.get('gib', 0):.1f} | "
                         f"{b.get('host_gib_per_node', 0):,.0f} | {b.get('tokens_per_s_per_gpu', 0):,.0f} | "
                         f"{b.get('host_exposed_s', 0):.2f} | {b.get('largest', a.get('largest', ''))} |")
        lines.append("")
    lines += ["## Targets", ""] + [f"* {t}" for t in results["targets"]] + [""]
    lines += ["## Tokens/s/GPU at 1M tokens, Llama 3.1 8B on 8 GPUs", "",
              "| scheme | offload | GiB/GPU | fits | tok/s/GPU | MFU | exposed PCIe s | exposed ring / all-to-all s |",
              "|---|---|---|---|---|---|---|---|"]
    for r in results["at_1m"]:
        lines.append(f"| {r['scheme']} | {'yes' if r['offload'] else 'no'} | {r['gib']:.1f} | "
                     f"{'yes' if r['fits'] else 'no'} | {r['tokens_per_s_per_gpu']:,.0f} | {r['mfu']:.1%} | "
                     f"{r['host_exposed_s']:.2f} | {r['tp_exposed_s']:.2f} |")
    lines += ["", "## Calibration against ALST's published lengths (Llama-8B, H100 80GB)", "",
              "| GPUs | ALST published | Ulysses + ALST here, with offload | predicted / published |",
              "|---|---|---|---|"]
    for c in results["calibration"]:
        ratio = f"{c['ratio']:.2f}" if c.get("ratio") else "n/a"
        lines.append(f"| {c['gpus']} | {c['published'] / 1e6:.1f}M | {c['predicted']} | {ratio} |")
    if results.get("line_check"):
        c = results["line_check"]
        lines += ["", f"Line check: {c['scheme']} traced again at its answer ({c['seq']:,} tokens), before the "
                  f"offload rule (applied to both alike): {c['traced_gib']:.2f} GiB traced, {c['line_gib']:.2f} GiB "
                  f"on the line through the two traced lengths; the largest tensor there {c['largest']}."]
    lines += ["", NOTES]
    return "\n".join(lines) + "\n"


NOTES = """## What the numbers say

**Every scheme here keeps `T/p`-sized tensors, so the race is bytes per token per GPU.** With the loss tiled or
chunked everywhere, bf16 saves and full checkpointing, what remains per token is each scheme's one-block working set
plus, without offload, one bf16 `h`-vector per block. METP's working set is the ring attention's backward: float32
dQ, dK and dV accumulators (`1.5 T/p x h` float32 at Llama 8B, the largest tensor at every METP peak) beside the
saved q, k, v, the output, its gradient and the travelling K/V blocks, about 15 `T/p x h` bf16 tensors. Ulysses'
(ALST's) is about 12.5 (q, k, v and the output after its all-to-alls, `[T, nh/p, hs]`, and their gradients; its
estimate is +8.6% over a measured CPU peak, so its lengths may be a little short). METP wins anyway because it
gathers no weights: Ulysses and cp keep FSDP's gathered layers, the gathered embedding and head and their unsharded
gradients (about 7.5 GiB at 8B on 8, 18 at 70B on 64), while METP streams weight blocks round the ring. Without offload the
block inputs dominate and METP's lead is larger (8B on 8: 1.38M against Ulysses' 1.16M and cp's 1.05M).

**Where METP stops.** At 8B on 8 GPUs, 0.5% short of 4M: the attention backward's accumulators (the next thing to
cut: accumulate dQ in the kernel's own tiles, or send dK/dV on in bf16 sooner). At 70B the node's host memory stops
it first (`(host)`: 80 blocks of `T/p x h` per GPU, 8 GPUs on 2 TB), not the GPU (44.7-57.2 GiB there). On 32 and 64
GPUs the 1.5x target over the best rival is met for 70B on 32 (1.73x over cp) and missed for 8B on 32 (1.36x) and
70B on 64 (1.32x): Ulysses needs no K/V-head ceiling (DeepSpeed replicates K/V heads up to `p`), so its tensors are
`T/p`-sized too, and the gap is METP's smaller fixed cost, not a different scaling.

**Speed is the same for every ring-like scheme at 1M tokens** (METP 418 tok/s/GPU, cp 418, Ulysses 416): attention
is almost all of the FLOPs, every scheme computes exactly the causal scores over its GPUs, and the ring or
all-to-all traffic hides behind them (exposed: 0.5-0.7 s in steps of about 5 minutes); offload's copies hide behind
each block's compute. All of them are priced at the attention rate torch's SDPA reached over whole 32k sequences on
an H200 (541 TFLOP/s, cuDNN); there the ring's blocks through the flash kernel reached 189-316, so METP's and cp's
rows are optimistic against Ulysses' (whose heads attend over whole sequences) unless their blocks run cuDNN's kernel
(METP's now do on Hopper; not yet measured). "2d-metp" and 1-D TP + SP hold `[T/q, V/q]` or `[T, V/p]` float32 loss blocks and stay far behind.

**Calibration.** The Ulysses rows reproduce ALST's published lengths within 3% on 8 GPUs and 11% on 32 (ALST measured
them on H100s; our rival is priced, not run there). ALST's 500K on one GPU offloads the optimizer state, which no
scheme here does; with it, METP and the others would be limited by the same per-token working set as above.
"""


def targets(results: dict) -> list[str]:
    out = []
    by = {(s["model"], s["gpus"]): s for s in results["settings"]}
    for (model, gpus), goal, factor in ((("llama-3.1-8b", 8), 4_000_000, 1.0), (("llama-3.1-8b", 32), 15_000_000, 1.5),
                                        (("llama-3.1-70b", 32), None, 1.5), (("llama-3.1-70b", 64), None, 1.5)):
        s = by.get((model, gpus))
        if not s or not s["rows"]:
            continue
        seqs = {r["scheme"]: r.get("offload", {}).get("seq", 0) for r in s["rows"] if "skip" not in r}
        ours = max((v, k) for k, v in seqs.items() if "metp" in k)
        rival = max((v, k) for k, v in seqs.items() if "metp" not in k)
        ratio = ours[0] / rival[0] if rival[0] else float("inf")
        line = (f"{model} on {gpus}, with offload: {ours[1]} {ours[0] / 1e6:.2f}M against the best rival "
                f"({rival[1]}) {rival[0] / 1e6:.2f}M: {ratio:.2f}x (target >= {factor}x): "
                f"**{'met' if ratio >= factor else 'not met'}**")
        if goal:
            line += f"; >= {goal / 1e6:g}M: **{'met' if ours[0] >= goal else 'not met'}**"
        out.append(line)
    fast = max((r for r in results["at_1m"] if "metp" not in r["layout"]),
               key=lambda r: r["tokens_per_s_per_gpu"] if r["fits"] else 0)
    ours = max((r for r in results["at_1m"] if "metp" in r["layout"] and r["fits"]),
               key=lambda r: r["tokens_per_s_per_gpu"], default=None)
    if ours:
        ratio = ours["tokens_per_s_per_gpu"] / fast["tokens_per_s_per_gpu"]
        out.append(f"tok/s/GPU at 1M on 8: {ours['scheme']} {ours['tokens_per_s_per_gpu']:,.0f} against the fastest "
                   f"rival that fits ({fast['scheme']}) {fast['tokens_per_s_per_gpu']:,.0f}: {ratio:.2f} (target >= 0.9): "
                   f"**{'met' if ratio >= 0.9 else 'not met'}**")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument("--only", default=None, help="one setting, e.g. 8b-8 or 70b-64")
    parser.add_argument("--render", action="store_true", help="frontier.md again from frontier.json")
    args = parser.parse_args(argv)
    if args.render:
        results = json.loads((args.out / "frontier.json").read_text())
        results["targets"] = targets(results) if results["at_1m"] else []
        (args.out / "frontier.md").write_text(markdown(results))
        return 0
    hw = planner.HARDWARE["h100"]
    started = time.time()
    results = {"hardware": hw.name, "host_gbps": hw.host_bytes_per_s / 1e9, "host_tb": hw.host_memory_bytes / 1e12,
               "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "settings": [], "at_1m": [], "calibration": [],
               "targets": [], "seconds": 0.0,
               "machine": f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
                          f"torch {torch.__version__}"}
    args.out.mkdir(parents=True, exist_ok=True)
    if args.only and (args.out / "frontier.json").exists():  # one setting again: the others as they were
        kept = json.loads((args.out / "frontier.json").read_text())
        results |= {k: kept[k] for k in ("settings", "at_1m", "calibration", "line_check") if k in kept}

    def log(message: str) -> None:
        print(f"[{time.time() - started:6.0f} s] {message}", flush=True)

    def save() -> None:
        results["seconds"] = time.time() - started
        (args.out / "frontier.json").write_text(json.dumps(results, indent=1, default=str))

    for model, gpus in SETTINGS:
        if args.only and args.only != f"{model.split('-')[-1]}-{gpus}":
            continue
        found = setting(model, gpus, hw, log)
        at = next((i for i, s in enumerate(results["settings"]) if (s["model"], s["gpus"]) == (model, gpus)), None)
        if at is None:
            results["settings"].append(found)
        else:
            results["settings"][at] = found
        save()
    if not args.only or args.only == "8b-8":
        results["at_1m"] = at_one_million(hw, log)
        cfg = model_config("llama-3.1-8b")
        s8 = next(s for s in results["settings"] if s["model"] == "llama-3.1-8b" and s["gpus"] == 8)
        metp = next(r for r in s8["rows"] if r["layout"] == "metp")
        line = Line(cfg, metp, metp["traced_at"][0]) if "traced_at" in metp else None
        if line is not None and metp.get("offload", {}).get("seq"):
            seq = metp["offload"]["seq"]
            results["line_check"] = {"scheme": "metp p=8 (offload)"} | check_line(cfg, metp, seq, line(seq))
    for (model, gpus), published in ALST.items():
        s = next((s for s in results["settings"] if s["model"] == model and s["gpus"] == gpus), None)
        row = next((r for r in (s or {}).get("rows", []) if r["layout"] == planner.ULYSSES), None)
        seq = (row or {}).get("offload", {}).get("seq", 0)
        results["calibration"].append({"gpus": gpus, "published": published,
                                       "predicted": f"{seq / 1e6:.2f}M" if seq else "does not fit",
                                       "ratio": seq / published if seq else None})
    results["calibration"] = results["calibration"][-len(ALST):]
    results["targets"] = targets(results) if results["at_1m"] else []
    save()
    (args.out / "frontier.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
