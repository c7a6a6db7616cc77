"""``tp2d-bench`` (also ``python -m lightning_tp2d.bench``): the layouts side by side with 1-D tensor parallelism.

Sections, each on when its options are given:

* scenarios (always): ``--layouts`` on ``--p`` ranks (single-device layouts on one), the same model, batch and
  sequence: loss, step time and tokens/s, resident / activation / peak memory per rank, communication per step
  (payload and bytes sent) and whether it equals the cost model's prediction; the baselines include torch's
  context parallelism, ``cp`` and ``cp-tp`` (``--cp-tp-size``), for a Llama;
* ``--memory-seqs``: peak memory per rank at several sequence lengths (plot ``memory_vs_seq.png``);
* ``--max-seq-layouts``: the largest trainable sequence length under ``--cap-mib`` per rank at ``--max-seq-p``,
  with its peak and bytes sent per token (plot ``max_seq_probes.png``: every probe's peak against its length);
* ``--weak-scaling``: the layouts at several p with the batch growing with p (plot ``comm_vs_p.png``);
* the cost model's projection for ``--projection-model`` on ``--hardware`` (plot ``speedup_vs_gpus.png``).

Everything lands in ``--out`` as results.json, results.md and PNG plots. A scenario that cannot run is a row
saying why; the others still run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, replace

import torch

from lightning_tp2d import layouts
from lightning_tp2d.bench import calibrate, report
from lightning_tp2d.planning import cost_model, gemm_rates
from lightning_tp2d.planning.events import wire_bytes
from lightning_tp2d.bench.runner import SCENARIOS, BenchSpec, max_sequence, run_scenario
from lightning_tp2d.options import TPOptions
from lightning_tp2d.rivals import TP1D, TP1D_SP, get_rival, is_rival

QUICK = dict(model="gpt2-tiny", set=["n_head=12"], batch=4, seq=64, p=4, steps=2, warmup=1,
             layouts="single,hf,tp1d,2d,metp,2d-metp", max_seq_layouts="tp1d,metp", max_seq_p=2, cap_mib=2.0,
             max_seq_limit=512, weak_scaling="1,4", weak_layouts="tp1d,2d", memory_seqs="32,64",
             projection_gpus="4,16")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in SCENARIOS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown layouts {bad}; choose from {list(SCENARIOS)}")
    return names


def _overrides(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"--set takes key=value, got {pair!r}")
        out[key] = json.loads(value) if value[:1].isdigit() or value in ("true", "false") else value
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tp2d-bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small CPU run of every section (about a minute)")
    ap.add_argument("--model", default="gpt2-tiny", help="a named size of any model family (gpt2-tiny, llama-tiny ...)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="model config override")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--p", type=int, default=4, help="ranks of the parallel scenarios")
    ap.add_argument("--layouts", default="single,hf,tp1d,tp1d-sp,2d,metp,2d-metp")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per scenario (median reported)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--activation-checkpointing", default="none", choices=["none", "full", "selective"],
                    help="for the package's layouts (the baselines run without)")
    ap.add_argument("--compile", nargs="?", const="inductor", default="", metavar="BACKEND",
                    help="torch.compile every scenario's model (default backend inductor); the timed steps run "
                         "compiled, memory and communication are measured on an eager step")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per scenario")
    ap.add_argument("--cp-tp-size", type=int, default=2,
                    help="cp-tp: the 1-D TP + SP size t inside p (torch's context parallelism over p / t ranks)")
    ap.add_argument("--memory-seqs", default="", help="sequence lengths for the memory-vs-sequence section")
    ap.add_argument("--memory-layouts", default="tp1d,2d,metp,2d-metp")
    ap.add_argument("--max-seq-layouts", default="", help="layouts for the maximum-sequence search")
    ap.add_argument("--max-seq-p", type=int, default=8)
    ap.add_argument("--cap-mib", type=float, default=64.0, help="per-rank memory cap of the search")
    ap.add_argument("--max-seq-unit", type=int, default=64)
    ap.add_argument("--max-seq-limit", type=int, default=65536)
    ap.add_argument("--weak-scaling", default="", help="p values, e.g. 1,4,9,16 (batch = --weak-batch * p)")
    ap.add_argument("--weak-layouts", default="tp1d,2d")
    ap.add_argument("--weak-batch", type=int, default=1)
    ap.add_argument("--projection-model", default="gpt2-medium")
    ap.add_argument("--projection-batch", type=int, default=64)
    ap.add_argument("--projection-seq", type=int, default=1024)
    ap.add_argument("--projection-gpus", default="4,16,64",
                    help="GPU counts of the projection (square numbers), each with its fair rows")
    ap.add_argument("--hardware", default="h100", choices=["h100", "a100"], help="preset of the projection")
    ap.add_argument("--measured-rates", action="store_true",
                    help="project with a GEMM table measured on this machine instead of the committed H200 one")
    ap.add_argument("--model-check", action="store_true",
                    help="calibrate this machine (matmul rate, link) and compare the cost model's step times")
    ap.add_argument("--out", default=None, help="results folder (default outputs/bench-<time>, as tp2d-train's runs)")
    return ap


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform()}
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    gpus = f", {len(info['gpus'])} x {info['gpus'][0]}" if info.get("gpus") else ", no GPU"
    info["summary"] = f"{info['cores']} cores ({cpu}){gpus}; torch {torch.__version__}, Python {info['python']}"
    return info


def _log(msg: str) -> None:
    print(msg, flush=True)


def _scenario_line(r: dict) -> str:
    if r["status"] != "ok":
        return f"{r['layout']:>8} p={r['p']}: {r['status']}: {r['reason']}"
    t = f" {r['step_time_s'] * 1e3:8.1f} ms" if "step_time_s" in r else ""
    return (f"{r['layout']:>8} p={r['p']}: loss {r['loss']:.5f}{t} peak {r['peak_bytes'] / report.MIB:8.2f} MiB "
            f"act {r['activation_bytes'] / report.MIB:8.2f} MiB comm {r['comm_bytes'] / report.MIB:8.3f} MiB "
            f"model-match {r.get('comm_matches_model')}")


def _drop_rank_detail(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "ranks"} | ({"per_rank": [
        {k: v for k, v in x.items() if k != "step_times"} for x in r["ranks"]]} if "ranks" in r else {})
        for r in rows]


def local_mlp_shape(layout: str, tokens: int, h: int, p: int) -> tuple[int, int, int]:
    """``(m, k, n)`` of one rank's first MLP product ``[m, k] @ [k, n]`` with ``tokens`` tokens on ``p`` ranks.

    Baselines: ``single`` (``p = 1``) holds everything, 1-D TP all tokens and ``4h/p`` columns, Ulysses ``tokens/p``
    tokens and every column (sequence-sharded around the attention, whole weights gathered by FSDP). A layout splits
    the tokens and the ``4h`` columns over its side (``q`` of a grid, ``p`` of a ring); a grid also splits the
    ``h`` inputs over ``col``, a ring keeps them whole (the weight blocks travel instead)."""
    if is_rival(layout):
        rival = get_rival(layout)
        if rival.ulysses:
            return tokens // p, h, 4 * h
        return tokens, h, 4 * h // p  # single runs on p = 1
    rules = layouts.get_layout(layout)
    side = rules.side(p)
    return tokens // side, (h // side if rules.square else h), 4 * h // side


def model_check(scenarios: list[dict], spec: BenchSpec, p: int) -> dict:
    """The cost model's step time for each measured scenario on this machine's calibrated rates.

    Rates: one matrix product of the scenario's local MLP shape (``[tokens/rank, h/width] @ [h/width, 4h/p]``),
    scaled by ``cores / ranks`` when the ranks outnumber the cores; the link is a ping-pong fit between two ranks
    of the same backend. Everything the model leaves out (Python and autograd overhead per op, LayerNorm, the
    optimizer step, element-wise kernels, contention of ranks sharing cores) shows in the error."""
    latency, bandwidth = calibrate.link(spec.device)
    cores = os.cpu_count() or 1
    rows = []
    for r in scenarios:
        if r.get("status") != "ok" or (is_rival(r["layout"]) and get_rival(r["layout"]).hf_weights) \
                or "step_time_s" not in r:
            continue
        layout, n, cfg = r["layout"], r["p"], spec.config(r["seq"])
        m, k, cols = local_mlp_shape(layout, r["batch"] * r["seq"], cfg.n_embd, n)
        rate = calibrate.matmul_rate(m, k, cols, spec.device) * (min(1.0, cores / n) if spec.device == "cpu" else 1)
        link = cost_model.Link(latency, bandwidth)
        hw = cost_model.Hardware("this machine", rate, rate, intra=link, inter=link, gpus_per_node=1 << 30)
        pred = cost_model.step_time(layout, cfg, r["batch"], r["seq"], n, hw, elem=spec.elem)
        rows.append({"layout": layout, "p": n, "predicted_s": pred["total_s"], "measured_s": r["step_time_s"],
                     "compute_s": pred["compute_s"], "exposed_comm_s": pred["exposed_comm_s"],
                     "matmul_flops_per_s": rate, "error": pred["total_s"] / r["step_time_s"] - 1})
    worst = max((abs(x["error"]) for x in rows), default=0.0)
    lines = [f"Link (ping-pong fit): {latency * 1e6:.1f} us + bytes / {bandwidth / 1e9:.2f} GB/s; {cores} cores.",
             "", "| layout | ranks | predicted ms | (compute + exposed comm) | measured ms | error |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {x['layout']} | {x['p']} | {x['predicted_s'] * 1e3:.1f} | {x['compute_s'] * 1e3:.1f} + "
              f"{x['exposed_comm_s'] * 1e3:.1f} | {x['measured_s'] * 1e3:.1f} | {x['error'] * 100:+.0f}% |"
              for x in rows]
    lines += ["", f"Largest error: {worst * 100:.0f}% (the model counts matrix products, attention and "
              "communication only)."]
    return {"latency_s": latency, "bandwidth_Bps": bandwidth, "rows": rows, "max_abs_error": worst,
            "summary": "\n".join(lines)}


def _summary(row: dict) -> dict:
    """A configuration of :func:`~lightning_tp2d.planning.cost_model.fair_configurations` without its step detail."""
    step = row["step"]
    return {"layout": row["layout"], "tp": row["tp"], "dp": row["dp"], "batch": row["batch"], "step_s": step["total_s"],
            "compute_s": step["compute_s"], "exposed_comm_s": step["exposed_comm_s"], "comm_s": step["comm_s"],
            "dp_comm_s": row["dp_comm_s"], "dp_exposed_s": row["dp_exposed_s"], "total_s": row["total_s"]}


def gemm_calibration(args: argparse.Namespace, cfg, batch: int, seq: int) -> dict:
    """The GEMM table the projection is priced with: the committed H200 one, or with ``--measured-rates`` one measured
    here (the local MLP product of 1x1, 2x2 and 3x3 grids; ``m`` capped at 4096 on CPU), and its fit."""
    if args.measured_rates:
        dtype = "bfloat16" if args.device == "cuda" else "float32"
        shapes = gemm_rates.table_shapes(batch * seq, cfg.n_embd, max_m=None if args.device == "cuda" else 4096)
        table, source = calibrate.measure_table(shapes, args.device, dtype), f"measured here ({args.device}, {dtype})"
    else:
        table, source = gemm_rates.H200_BF16, "committed H200 bf16 table (lightning_tp2d.planning.gemm_rates)"
    rate, overhead = gemm_rates.fit(table)
    return {"source": source, "table": [{"m": p.m, "k": p.k, "n": p.n, "flops_per_s": p.flops_per_s,
                                         "source": p.source} for p in table],
            "rate_flops_per_s": rate, "overhead_s": overhead}


def projection(args: argparse.Namespace) -> dict:
    """The cost model's "2d" against 1-D TP for one tensor-parallel group of 4, 16 and 64 GPUs (1-D TP without and
    with sequence parallelism, the latter blocking and with async TP modelled, bf16 on the wire), with "2d"'s
    broadcast SUMMA and kept panels beside its default; step time, exposed and hidden communication, bytes sent
    and saved activations per rank (bf16); the fair rows at every GPU count (the best tensor x data parallel
    configuration of each family, :func:`~lightning_tp2d.planning.cost_model.fair_configurations`: what
    ``speedup_vs_gpus.png`` plots); METP's
    full-overlap threshold. GEMMs are priced by :func:`gemm_calibration` (``--measured-rates``: this machine's
    table, the preset's links and attention-to-GEMM rate ratio)."""
    hw = {"h100": cost_model.H100_NVLINK4_NDR, "a100": cost_model.A100_NVLINK3_HDR}[args.hardware]
    cfg = BenchSpec(model=args.projection_model).config(args.projection_seq)
    batch, seq = args.projection_batch, args.projection_seq
    calibration = gemm_calibration(args, cfg, batch, seq)  # the h100 preset is the committed table's fit already
    if args.measured_rates:
        rate = calibration["rate_flops_per_s"]
        name = (f"{hw.name}; GEMMs {calibration['source']}: {rate / 1e12:.3g} TFLOP/s + "
                f"{calibration['overhead_s'] * 1e6:.2g} us per kernel")
        hw = replace(hw, name=name, matmul_flops_per_s=rate, gemm_overhead_s=calibration["overhead_s"],
                     attention_flops_per_s=hw.attention_flops_per_s * rate / hw.matmul_flops_per_s)
    grid = layouts.Grid2D.name
    variants = {"keep": layouts.Grid2D(options=TPOptions(keep_panels=True)),
                "broadcast": layouts.Grid2D(options=TPOptions(summa="broadcast"))}
    rows = []
    gpus = _ints(args.projection_gpus)
    for r in cost_model.projected_speedup(cfg, batch, seq, gpus=gpus, hw=hw):
        n = r["gpus"]
        # a layout's ranks send different amounts (grid position: one of each kind, as the layout says); 1-D TP's alike
        ranks = {grid: layouts.get_layout(grid).distinct_ranks(n), TP1D.name: [0], TP1D_SP.name: [0]}
        wire = {layout: max(wire_bytes(cost_model.comm_events(layout, cfg, batch, seq, n, 2, rank=k))
                            for k in ranks[layout]) for layout in ranks}
        row = {"gpus": n, "nodes": r["nodes"], "time_2d_s": r["2d_s"], "time_tp1d_s": r["tp1d_s"],
               "speedup": r["speedup"], "wire_bytes_2d": wire[grid], "wire_bytes_tp1d": wire[TP1D.name],
               "exposed_comm_2d_s": r[grid]["exposed_comm_s"],
               "exposed_comm_tp1d_s": r[cost_model.ONE_D]["exposed_comm_s"],
               "hidden_comm_2d_s": r[grid]["comm_s"] - r[grid]["exposed_comm_s"],
               "compute_2d_s": r[grid]["compute_s"], "compute_tp1d_s": r[cost_model.ONE_D]["compute_s"],
               "activation_bytes_2d": cost_model.activation_bytes(grid, cfg, batch, seq, n, 2),
               "activation_bytes_tp1d": cost_model.activation_bytes(TP1D.name, cfg, batch, seq, n, 2),
               # 1-D TP with sequence parallelism (bf16 on the wire), blocking and with torch's async TP modelled
               "time_tp1d_sp_s": r["tp1d_sp_s"], "time_tp1d_sp_async_s": r["tp1d_sp_async_s"],
               "speedup_vs_tp1d_sp": r["tp1d_sp_s"] / r["2d_s"],
               "speedup_vs_tp1d_sp_async": r["tp1d_sp_async_s"] / r["2d_s"],
               "wire_bytes_tp1d_sp": wire[TP1D_SP.name], "exposed_comm_tp1d_sp_s": r["tp1d_sp"]["exposed_comm_s"],
               "hidden_comm_tp1d_sp_s": r["tp1d_sp"]["comm_s"] - r["tp1d_sp"]["exposed_comm_s"],
               "exposed_comm_tp1d_sp_async_s": r["tp1d_sp_async"]["exposed_comm_s"],
               "hidden_comm_tp1d_sp_async_s": r["tp1d_sp_async"]["comm_s"] - r["tp1d_sp_async"]["exposed_comm_s"],
               "activation_bytes_tp1d_sp": cost_model.activation_bytes(TP1D_SP.name, cfg, batch, seq, n, 2)}
        if n == 4:  # the SUMMA variants of "2d" in one node: kept panels (no second gather) and broadcast SUMMA
            for key, spec in variants.items():
                t = cost_model.step_time(spec, cfg, batch, seq, n, hw)
                row[f"time_2d_{key}_s"] = t["total_s"]
                row[f"exposed_comm_2d_{key}_s"] = t["exposed_comm_s"]
                row[f"activation_bytes_2d_{key}"] = cost_model.activation_bytes(spec, cfg, batch, seq, n, 2)
        rows.append(row)
    fair = []
    for n in (g for g in gpus if g > 1):  # in one node too (1-D TP x DP, plain DP against one grid); 1 GPU: no grid
        f = cost_model.fair_configurations(cfg, batch, seq, n, hw)
        tp_only = min((c for c in f[cost_model.ONE_D] if c["tp"] > 1), key=lambda c: c["total_s"])
        fair.append({"gpus": n, "best_tp1d": _summary(f["best_tp1d"]), "best_2d": _summary(f["best_2d"]),
                     "speedup": f["speedup"], "best_tp1d_tp_ge_2": _summary(tp_only),
                     "speedup_vs_tp_ge_2": tp_only["total_s"] / f["best_2d"]["total_s"],
                     "configurations": [_summary(c) for c in f[cost_model.ONE_D] + f[cost_model.GRID_2D]]})
    return {"model": args.projection_model, "batch": batch, "seq": seq, "hardware": hw.name, "rows": rows,
            "fair": fair, "gemm_calibration": calibration,
            "metp_overlap_threshold": cost_model.metp_overlap_threshold(cfg, hw)}


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    spec = BenchSpec(model=args.model, overrides=_overrides(args.set), batch=args.batch, seq=args.seq,
                     steps=args.steps, warmup=args.warmup, dtype=args.dtype, device=args.device,
                     timeout=args.timeout, compile=args.compile,
                     activation_checkpointing=args.activation_checkpointing, cp_tp_size=args.cp_tp_size)
    results: dict = {"command": "tp2d-bench " + shlex.join(argv), "machine": machine(),
                     "date": datetime.datetime.now().isoformat(timespec="seconds"), "spec": asdict(spec)}
    t0 = time.perf_counter()
    _log(f"scenarios: {spec.model} batch {spec.batch} x seq {spec.seq}, p = {args.p}")
    results["scenarios"] = []
    for layout in _names(args.layouts):
        row = run_scenario(layout, args.p, spec)
        _log(_scenario_line(row))
        results["scenarios"].append(row)

    if args.model_check:
        results["model_check"] = model_check(results["scenarios"], spec, args.p)
        _log(results["model_check"]["summary"])

    if args.memory_seqs:
        results["memory_vs_seq"] = []
        for layout in _names(args.memory_layouts):
            for seq in _ints(args.memory_seqs):
                row = run_scenario(layout, args.p, spec, seq=seq, full=False)
                _log(f"memory seq={seq} " + _scenario_line(row))
                results["memory_vs_seq"].append(row)

    if args.max_seq_layouts:
        results["max_seq"] = []
        cap = int(args.cap_mib * report.MIB)
        for layout in _names(args.max_seq_layouts):
            row = max_sequence(layout, args.max_seq_p, spec, cap, unit=args.max_seq_unit, limit=args.max_seq_limit,
                               log=_log)
            _log(f"max seq {layout} p={row['p']}: {row.get('max_seq', row.get('reason'))}")
            results["max_seq"].append(row)

    if args.weak_scaling:
        results["weak_scaling"] = []
        cores = os.cpu_count() or 1
        for p in _ints(args.weak_scaling):
            weak = replace(spec, batch=args.weak_batch * p)
            for layout in _names(args.weak_layouts):
                row = run_scenario(layout, p, weak)
                if spec.device == "cpu" and p > cores:
                    row["note"] = f"{p} ranks on {cores} cores: times oversubscribed"
                _log(f"weak p={p} " + _scenario_line(row))
                results["weak_scaling"].append(row)

    results["projection"] = projection(args)
    results["wall_s"] = time.perf_counter() - t0
    for key in ("scenarios", "memory_vs_seq", "weak_scaling"):
        if key in results:
            results[key] = _drop_rank_detail(results[key])
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = parser()
    if "--quick" in argv:
        ap.set_defaults(**QUICK)
    args = ap.parse_args(argv)
    try:
        for names in (args.layouts, args.memory_layouts, args.max_seq_layouts, args.weak_layouts):
            _names(names)
        for model, sets in ((args.model, args.set), (args.projection_model, [])):
            BenchSpec(model=model, overrides=_overrides(sets)).config()  # a bad name or field fails here
    except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
        ap.error(str(e))
    out = args.out or os.path.join("outputs", "bench-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    results = run(args, argv)
    files = report.write(results, out)
    for t in results["targets"]:
        met = "NOT met" if t["met"] is False else report.verdict(t)
        value = "" if t["value"] is None else f"{t['value']:.3g}"
        _log(f"target {t['key']}: {value} ({t['threshold']}) {met}")
    _log(f"wrote {', '.join(os.path.join(out, f) for f in files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
