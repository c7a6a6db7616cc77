"""Scale tables: Llama 3.1 8B / 70B / 405B on H100-80GB nodes of 8, seq 8192, ~4M tokens per step -- the
package's best configuration against the best 1-D TP + SP x FSDP one (async TP where it is faster), as the planner
predicts them (:mod:`lightning_tp2d.planning.planner`; predictions, not measurements: no GPU has run them).

    python recipes/benchmarks/scale.py [--out recipes/benchmarks/scale] [--tiny] [--cache DIR] [--only 8b:8,70b:64]
                                       [--workers N] [--float8 tensorwise|rowwise] [--pp 1 2 4 8 16]

For each (model, GPUs): every configuration that fits (memory <= 90% of 80 GiB), the best package row and the best
baseline row (tokens/s/GPU, MFU, memory per GPU) and their ratio. Then the largest Llama-shaped model (70B's width,
heads and vocabulary, more layers) each trains on 64 GPUs, and calibration rows: torchtitan's published
configurations priced on the hardware they ran on (``h100-grand-teton``), beside the published figures, and the one
single-GPU measurement the elementwise constants are fitted to. Writes ``results.json``, ``results.md`` and
``tokens_per_gpu.png`` (when matplotlib is installed) into ``--out``. ``--tiny`` runs the same on llama-tiny
(a check that the recipe works, seconds). ``--cache DIR`` keeps each finished scenario's result there and reuses
it on the next run, so a long run that stops part way resumes (planning all six took 5.6 minutes on 2 cores on 2026-12-04);
``--only`` plans just the named scenarios (``MODEL:GPUS``, the model without its ``llama-3.1-`` prefix) into the
cache and writes nothing else. ``--float8 RECIPE``: every row of both sides with its linears in float8 by torchao's
recipe (the planner's ``float8``: float8 GEMM rates and cast bytes, one rule for both sides; default ``--out``
``scale_float8_<recipe>``), and the calibration rows torchtitan published with Float8 priced the same way.
``--pp``: the pipeline sizes both sides may use (default :data:`PIPELINE_SIZES`; the planner's ``pipeline_sizes``:
the package's stages and torchtitan's PP, 1F1B and interleaved 1F1B); ``--pp 1`` plans without stages.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import platform
import time
from pathlib import Path

import torch

from lightning_tp2d.planning import memory_model, planner, trace
from lightning_tp2d.families import model_config

HERE = Path(__file__).resolve().parent
SEQ, TOKENS, MEMORY_GIB, PER_NODE = 8192, 4 * 2**20, 80.0, 8
PIPELINE_SIZES = (1, 2, 4, 8, 16)  # both sides' pipeline sizes (planner.plan's pipeline_sizes)
SCENARIOS = [("llama-3.1-8b", 8), ("llama-3.1-8b", 64), ("llama-3.1-70b", 64), ("llama-3.1-70b", 256),
             ("llama-3.1-405b", 256), ("llama-3.1-405b", 1024)]
# torchtitan's published bf16 configurations (benchmarks/llama3_h100_202412_torchtitan.md, Table 1;
# benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md): (name, model, tp, dp, checkpointing, local batch,
# async TP, published tokens/s/GPU, published memory GiB or None)
TORCHTITAN = [
    ("8B, 8 H100, FSDP 8 + compile, selective AC, local batch 2", "llama-3.1-8b", 1, 8, "selective", 2, False,
     6667, 77.0),
    ("8B, 64 H100, FSDP 8 x TP 8 + compile, per-op SAC, local batch 12", "llama-3.1-8b", 8, 8, "selective", 12,
     False, 4378, None),
    ("8B, 64 H100, FSDP 8 x TP 8 + compile + async TP, per-op SAC, local batch 12", "llama-3.1-8b", 8, 8,
     "selective", 12, True, 4809.4, None),
    ("70B, 256 H100, FSDP 32 x TP 8 + compile, full AC, local batch 16", "llama-3.1-70b", 8, 32, "full", 16, False,
     597.3, None),
    ("70B, 256 H100, FSDP 32 x TP 8 + compile + async TP, full AC, local batch 16", "llama-3.1-70b", 8, 32, "full",
     16, True, 652.4, None),
]
FLOAT8_NOTE = ("torchtitan's 829 / 876 tokens/s/GPU for 70B on 256 H100s (FSDP 32 x TP 8, Table 4 of its December "
               "2024 benchmarks) ran with Float8 linears; the bf16 tables' calibration rows are the bf16 figures of the "
               "same configuration (597.3 / 652.4, its June 2025 async-TP benchmarks), and `--float8 tensorwise` "
               "prices the Float8 ones.")
# torchtitan's published Float8 configuration (benchmarks/llama3_h100_202412_torchtitan.md, Table 4: tensorwise
# scaling, Float8 all-gathers in FSDP, compile), as TORCHTITAN's entries
TORCHTITAN_FLOAT8 = [
    ("70B, 256 H100, FSDP 32 x TP 8 + compile + Float8, full AC, local batch 16", "llama-3.1-70b", 8, 32, "full", 16,
     False, 829.0, None),
    ("70B, 256 H100, FSDP 32 x TP 8 + compile + Float8 + async TP, full AC, local batch 16", "llama-3.1-70b", 8, 32,
     "full", 16, True, 876.0, None),
    # Table 5: 3-D parallelism, 405B on 512 H100s, FSDP 8 x TP 8 x PP 8, local batch 32 in micro-batches of 1
    # (torchtitan's pipeline_parallel_microbatch_size default), interleaved with 2 stages per rank (its default for
    # looped schedules); the extra fields: (pp, schedule, virtual stages, micro-batches)
    ("405B, 512 H100, FSDP 8 x TP 8 x PP 8 1F1B + compile + Float8 + async TP, full AC, local batch 32",
     "llama-3.1-405b", 8, 8, "full", 1, True, 100.0, 82.5, (8, "1f1b", 1, 32)),
    ("405B, 512 H100, FSDP 8 x TP 8 x PP 8 interleaved 1F1B + compile + Float8 + async TP, full AC, local batch 32",
     "llama-3.1-405b", 8, 8, "full", 1, True, 128.0, 72.7, (8, "interleaved_1f1b", 2, 32)),
]


def calibration(float8: str | None = None) -> list[dict]:
    hw = planner.HARDWARE["h100-grand-teton"]
    rows = []
    for name, model, tp, dp, ck, batch, async_tp, published, memory, *staged in (TORCHTITAN_FLOAT8 if float8
                                                                                  else TORCHTITAN):
        pp, schedule, virtual, micro = staged[0] if staged else (1, "1f1b", 1, 1)
        row = planner.price(model_config(model), layout=planner.BASELINE, p=tp, dp=dp, zero_stage=3,
                            checkpointing=ck, micro_batch=batch, grad_accum=micro, seq=SEQ, hw=hw,
                            gpus_per_node=PER_NODE, async_tp=async_tp if tp > 1 else None, float8=float8,
                            pipeline_parallel_size=pp, pp_schedule=schedule, virtual_stages=virtual)
        rows.append({"configuration": name, "published_tokens_per_s_per_gpu": published,
                     "predicted_tokens_per_s_per_gpu": row.tokens_per_s_per_gpu,
                     "ratio": row.tokens_per_s_per_gpu / published, "published_memory_gib": memory,
                     "predicted_memory_gib": row.memory_gib, "row": row.to_dict()})
    gpt2 = planner.measured_gpt2_config()  # transformers' GPT-2 as measured: its head unpadded
    for mode in (() if float8 else ("eager", "compiled")):
        row = planner.price(gpt2, layout=planner.BASELINE, p=1, dp=1, zero_stage=0, checkpointing="none",
                            micro_batch=planner.GPT2_H200["batch"], grad_accum=1, seq=planner.GPT2_H200["seq"],
                            hw=planner.HARDWARE["h200"], gpus_per_node=PER_NODE, compiled=mode == "compiled")
        rows.append({"configuration": f"transformers GPT-2 124M, 1 H200, bf16, batch 32 x 1024, {mode} (fitted)",
                     "published_tokens_per_s_per_gpu": planner.GPT2_H200[mode],
                     "predicted_tokens_per_s_per_gpu": row.tokens_per_s_per_gpu,
                     "ratio": row.tokens_per_s_per_gpu / planner.GPT2_H200[mode], "published_memory_gib": None,
                     "predicted_memory_gib": row.memory_gib, "row": row.to_dict()})
    return rows


def scenario(model: str, gpus: int, seq: int, tokens: int, memory_gib: float, per_node: int, **options) -> dict:
    started = time.time()
    try:
        rows = planner.plan(model, gpus=gpus, gpu_memory_gib=memory_gib, gpus_per_node=per_node, seq=seq,
                            global_batch_tokens=tokens, **options)
    except planner.NothingFits as err:
        return {"model": model, "gpus": gpus, "status": "nothing fits", "error": str(err)}
    package, baseline = planner.best(rows, False), planner.best(rows, True)
    ratio = package.tokens_per_s_per_gpu / baseline.tokens_per_s_per_gpu if package and baseline else None
    space = planner.search_space(model, gpus=gpus, gpus_per_node=per_node, seq=seq, global_batch_tokens=tokens,
                                 **{k: v for k, v in options.items() if k not in ("workers", "float8")})
    staged = {"package": any(r.pipeline_parallel_size > 1 for r in rows if not r.baseline),
              "baseline": any(r.pipeline_parallel_size > 1 for r in rows if r.baseline)}
    pessimistic = _pessimistic(rows, model, seq, per_node, options.get("float8"))
    return {"model": model, "gpus": gpus, "status": "ok", "configurations": len(rows),
            "best_package": package.to_dict() if package else None,
            "best_baseline": baseline.to_dict() if baseline else None, "package_over_baseline": ratio,
            "search_space": space, "stage_rows_fit": staged, **pessimistic,
            "top": [r.to_dict() for r in rows[:8]], "seconds": time.time() - started}


def _pessimistic(rows: list, model: str, seq: int, per_node: int, float8: str | None = None) -> dict:
    """Every fitting row priced again with nothing of any collective hidden, on both sides (``overlap=
    "pessimistic"``; memory does not depend on it), and each side's best: ``{"pessimistic_package",
    "pessimistic_baseline", "pessimistic_ratio"}``."""
    cfg, hw = model_config(model), planner.HARDWARE["h100"]
    with contextlib.ExitStack() as stack:  # the closed forms the planner priced with (held to the traces in tests)
        stack.enter_context(trace.closed_forms())
        stack.enter_context(memory_model.closed_forms())
        again = _priced_again(rows, cfg, hw, seq, per_node, float8)
    package, baseline = (max((r for r in again if r.baseline == side), key=lambda r: r.tokens_per_s_per_gpu,
                             default=None) for side in (False, True))
    ratio = package.tokens_per_s_per_gpu / baseline.tokens_per_s_per_gpu if package and baseline else None
    return {"pessimistic_package": package.to_dict() if package else None,
            "pessimistic_baseline": baseline.to_dict() if baseline else None, "pessimistic_ratio": ratio}


def _priced_again(rows: list, cfg, hw, seq: int, per_node: int, float8: str | None) -> list:
    return [planner.price(cfg, layout=r.layout, p=r.tensor_parallel_size, dp=r.data_parallel_size,
                          zero_stage=r.zero_stage, checkpointing=r.checkpointing, micro_batch=r.micro_batch,
                          grad_accum=r.grad_accum, seq=seq, hw=hw, gpus_per_node=per_node,
                          memory=r.parts["memory_bytes"], offload=r.activation_offload, overlap="pessimistic",
                          float8=float8, **({"shard_group": r.shard_group, "loss": r.loss} if r.baseline else {}),
                          pipeline_parallel_size=r.pipeline_parallel_size, pp_schedule=r.pp_schedule,
                          virtual_stages=r.virtual_stages)
            for r in rows]


def _name(r: dict | None) -> str:
    if r is None:
        return "none fits"
    pp = r.get("pipeline_parallel_size", 1)  # (older caches: no stages)
    stages = "" if pp == 1 else (f" x PP {pp} {r['pp_schedule']}"
                                 + (f" v={r['virtual_stages']}" if r.get("virtual_stages", 1) > 1 else ""))
    return _flat_name(r) + stages


def _flat_name(r: dict) -> str:
    if r["baseline"]:
        tp = r["tensor_parallel_size"]
        kind = f"1-D TP {tp}{' async' if r['async_tp'] else ''} + SP" if tp > 1 else "no TP"
        dp, group = r["data_parallel_size"], r.get("shard_group", 0)  # (older caches: no shard_group, no loss)
        data = f"HSDP {group} x {dp // group}" if group else f"FSDP {dp}" if r["zero_stage"] >= 2 else f"DDP {dp}"
        return f"{kind} x {data}{', chunked loss' if r.get('loss') == 'chunked' else ''}"
    return f"{r['layout']} p={r['tensor_parallel_size']} x dp {r['data_parallel_size']}"


def _cells(r: dict | None) -> str:
    if r is None:
        return "- | - | - | -"
    return (f"{_name(r)}, ZeRO {r['zero_stage']}, {r['checkpointing']} AC, micro {r['micro_batch']} x "
            f"{r['grad_accum']} | {r['tokens_per_s_per_gpu']:,.0f} | {r['mfu']:.1%} | {r['memory_gib']:.1f}")


def markdown(results: dict) -> str:
    float8 = results.get("float8")
    title = f", Float8 linears ({float8}) on both sides" if float8 else ""
    lines = [f"# Scale tables (predicted): Llama 3.1 on H100-80GB, {PER_NODE} per node, seq {results['seq']}, "
             f"{results['tokens']:,} tokens per step{title}", "",
             "Predictions of `lightning_tp2d.plan` (`lightning_tp2d/planning/planner.py`, which says how each term is "
             "priced), not measurements: no GPU has run these. Regenerate: `python recipes/benchmarks/scale.py"
             + (f" --float8 {float8}`. Float8: every row's linears, the package's (`parallel.float8`) and the "
                f"baseline's (torchao's recipe, as torchtitan runs it), at 2.0x the bf16 GEMM rate (torchao's roofline "
                f"constants for the H100, not a measurement) plus the casts' bytes "
                f"(`cost_model.float8_seconds`); memory as bf16's; float8 operands on the wire not priced on either "
                f"side." if float8 else "`."),
             "", "## Best package configuration against the best 1-D TP + SP x FSDP configuration", "",
             "| model | GPUs | package: configuration | tok/s/GPU | MFU | GiB/GPU | baseline: configuration | "
             "tok/s/GPU | MFU | GiB/GPU | package / baseline | pessimistic overlap: package / baseline | "
             "configurations searched: package / baseline |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in results["scenarios"]:
        if s["status"] != "ok":
            lines.append(f"| {s['model']} | {s['gpus']} | {s['error']} | | | | | | | | | | |")
            continue
        ratio = f"{s['package_over_baseline']:.2f}x" if s["package_over_baseline"] else "-"
        worst = f"{s['pessimistic_ratio']:.2f}x" if s.get("pessimistic_ratio") else "-"  # (older caches: none)
        space = f"{s['search_space']['package']} / {s['search_space']['baseline']}" if "search_space" in s else "-"
        lines.append(f"| {s['model']} | {s['gpus']} | {_cells(s['best_package'])} | {_cells(s['best_baseline'])} "
                     f"| {ratio} | {worst} | {space} |")
    big = results["largest_model"]
    lines += ["", f"## Largest Llama-shaped model on {big['gpus']} GPUs ({big['base']}'s width, more layers)", "",
              "| family | blocks | parameters | configuration |", "|---|---|---|---|"]
    for kind in ("package", "baseline"):
        r = big[kind]
        lines.append(f"| {kind} | {r['n_layer']} | {r['parameters'] / 1e9:.1f}B | {r['configuration']} |")
    if big["baseline"]["parameters"]:
        lines.append(f"\nPackage / baseline parameters: {big['package']['parameters'] / big['baseline']['parameters']:.2f}x")
    lines += ["", "## Calibration: published figures priced by the same model", "",
              "| configuration | published tok/s/GPU | predicted | predicted / published | published GiB | predicted GiB |",
              "|---|---|---|---|---|---|"]
    for c in results["calibration"]:
        mem = f"{c['published_memory_gib']:.1f}" if c["published_memory_gib"] else "-"
        lines.append(f"| {c['configuration']} | {c['published_tokens_per_s_per_gpu']:,.0f} | "
                     f"{c['predicted_tokens_per_s_per_gpu']:,.0f} | {c['ratio']:.2f} | {mem} | "
                     f"{c['predicted_memory_gib']:.1f} |")
    lines += ["", FLOAT8_NOTE, "",
              *([] if not float8 else [f"The Float8 calibration rows price torchtitan's published Float8 runs with "
                                       f"the `{float8}` recipe and the H100's assumed 2.0x float8 GEMM rate "
                                       f"(`cost_model._H100_FLOAT8_SPEEDUP`), on the Grand Teton preset.", ""]),
              f"The async-TP rows are in sample for one constant: async TP hides {planner.ASYNC_TP_OVERLAP} of the "
              "collective time it could hide behind its matmul (`planner.ASYNC_TP_OVERLAP`), fitted to these two "
              "published async / blocking gains; hiding all of it predicted 1.17-1.19x where torchtitan measured "
              "1.09-1.10x.", "",
              "torchtitan's H100s (Grand Teton) are 96 GB HBM2e cards at 500 W whose peak, it says, lies between the "
              "SXM's and the NVL's: they are priced on `h100-grand-teton` (the H100 preset's rates x 835/989, 2.4 TB/s); "
              "the scale tables above use the 700 W H100 SXM preset (`h100`).", ""]
    return "\n".join(lines)


def plot(results: dict, out: Path) -> None:
    try:
        import matplotlib  # deferred: optional, for the figure only

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ok = [s for s in results["scenarios"] if s["status"] == "ok"]
    labels = [f"{s['model'].removeprefix('llama-3.1-')}\n{s['gpus']} GPUs" for s in ok]
    xs = range(len(ok))
    fig, ax = plt.subplots(figsize=(8, 4))
    for offset, key, label in ((-0.2, "best_package", "package (best layout)"),
                               (0.2, "best_baseline", "1-D TP + SP x FSDP (best)")):
        ax.bar([x + offset for x in xs], [s[key]["tokens_per_s_per_gpu"] if s[key] else 0 for s in ok], 0.4,
               label=label)
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("predicted tokens/s per GPU")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title(f"Llama 3.1, H100-80GB, seq {results['seq']}, {results['tokens'] // 2**20}M tokens/step (predicted)")
    fig.tight_layout()
    fig.savefig(out / "tokens_per_gpu.png", dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(HERE / "scale"))
    parser.add_argument("--tiny", action="store_true", help="llama-tiny on 4 GPUs of 0.05 GiB: checks the recipe")
    parser.add_argument("--cache", default=None, help="keep and reuse each scenario's result in this folder")
    parser.add_argument("--workers", type=int, default=1, help="candidates each scenario plans at once (plan's workers)")
    parser.add_argument("--only", default=None, help="plan only these scenarios into --cache, e.g. 8b:8,70b:64")
    parser.add_argument("--float8", choices=("tensorwise", "rowwise"), default=None,
                        help="every row's linears in float8 by this torchao recipe, both sides")
    parser.add_argument("--pp", type=int, nargs="*", default=list(PIPELINE_SIZES),
                        help="pipeline sizes both sides may use (1: none)")
    args = parser.parse_args(argv)
    if args.float8 and args.out == str(HERE / "scale"):
        args.out = str(HERE / f"scale_float8_{args.float8}")
    if args.only and not args.cache:
        parser.error("--only needs --cache: it plans scenarios into the cache and writes no tables")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        seq, tokens, memory, per_node, base, big_gpus = 48, 16 * 48, 0.05, 4, "llama-tiny", 4
        scenarios = [("llama-tiny", 4)]
        options = dict(zero_stages=(0, 3), checkpointing=("none", "full"), max_micro_batch=2, layouts=("2d",))
    else:
        seq, tokens, memory, per_node, base, big_gpus = SEQ, TOKENS, MEMORY_GIB, PER_NODE, "llama-3.1-70b", 64
        scenarios, options = SCENARIOS, {"pipeline_sizes": tuple(args.pp)}
    options["workers"] = args.workers
    if args.float8:
        options["float8"] = args.float8
    results = {"seq": seq, "tokens": tokens, "gpu_memory_gib": memory, "gpus_per_node": per_node, "float8": args.float8,
               "pipeline_sizes": list(options.get("pipeline_sizes", (1,))),
               "hardware": planner.HARDWARE["h100"].name, "torch": torch.__version__,
               "python": platform.python_version(), "scenarios": []}
    cache = Path(args.cache) if args.cache else None
    only = {tuple(item.split(":")) for item in args.only.split(",")} if args.only else None
    for model, gpus in scenarios:
        if only is not None and (model.removeprefix("llama-3.1-"), str(gpus)) not in only:
            continue
        pps = options.get("pipeline_sizes", (1,))
        kept = cache / (f"{model}-{gpus}{'-float8-' + args.float8 if args.float8 else ''}"
                        f"{'' if tuple(pps) == (1,) else '-pp' + '-'.join(map(str, pps))}.json") if cache else None
        if kept is not None and kept.exists():
            results["scenarios"].append(json.loads(kept.read_text()))
        else:
            results["scenarios"].append(scenario(model, gpus, seq, tokens, memory, per_node, **options))
            if kept is not None:
                kept.parent.mkdir(parents=True, exist_ok=True)
                kept.write_text(json.dumps(results["scenarios"][-1], default=str) + "\n")
        print(json.dumps({k: v for k, v in results["scenarios"][-1].items() if k != "top"})[:400], flush=True)
    if only is not None:
        return 0
    layouts = options.get("layouts")  # (largest_model plans each candidate in turn: it takes no workers)
    results["largest_model"] = {
        "gpus": big_gpus, "base": base,
        "package": planner.largest_model(big_gpus, memory, seq, tokens, base=base, baseline=False, layouts=layouts,
                                         gpus_per_node=per_node),
        "baseline": planner.largest_model(big_gpus, memory, seq, tokens, base=base, baseline=True,
                                          gpus_per_node=per_node)}
    results["calibration"] = calibration(args.float8)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / "results.md").write_text(markdown(results))
    plot(results, out)
    print(f"wrote {out / 'results.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
