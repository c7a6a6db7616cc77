"""The rate table the cost model and the planner are priced with, measured on one GPU in seconds (an H200's,
2026-12-04: ``recipes/benchmarks/gpu_rates/h200.json``, the table :data:`lightning_tp2d.planning.gemm_rates.H200_BF16`
holds); ``--smoke`` runs every part at toy sizes on the CPU (as CI does, ``tests/test_recipes.py``).

    python recipes/gpu_rates.py --out recipes/benchmarks/gpu_rates/h200.json   # one CUDA GPU, bf16, ~15 s on an H200
    python recipes/gpu_rates.py --smoke --out /tmp/rates.json                  # CPU, tiny sizes: checks the script
    tp2d-plan llama-3.1-70b --gpus 64 --gpu-memory-gib 80 --seq 8192 --rates recipes/benchmarks/gpu_rates/h200.json

The H100 and H200 presets (:data:`lightning_tp2d.planning.cost_model.H100_NVLINK4_NDR`) take their GEMM and attention
rates from that table. This measures, with CUDA events (:class:`Timer`), median of ``--repeats``:

1. **GEMMs** ``[m, k] @ [k, n]`` in bf16 at the shapes the planner prices: each linear of Llama 3.1 8B and 70B
   (q/k/v/o, gate/up/down) as 1-D TP cuts it over 1, 2, 4 and 8 ranks, at 8192 and 16384 tokens, and the MLP
   product of GPT-2 medium on the 1x1, 2x2 and 3x3 grids (the committed two points among them). The fit
   ``t = FLOPs / rate + overhead`` (:func:`lightning_tp2d.planning.gemm_rates.fit`) is the one the cost model takes.
2. **Attention**, head size 128, 32 query heads on 8 key/value heads (Llama's GQA), one sequence: torch's SDPA over
   the whole causal sequence (what the plain model, 1-D TP and each CP ring step run), forward and forward +
   backward, at 2k-32k tokens; and the METP ring's blocks through :func:`lightning_tp2d.metp.attend_block` /
   ``attend_block_backward`` (the fused kernel that returns the log-sum-exp): the causal diagonal block ``2c x 2c``
   and an off-diagonal ``2c x c`` half block, ``c`` 1k-8k. Rates in the cost model's convention: 4 FLOPs per visible
   score and head channel forward, 10 backward (flash recomputes the scores).
3. **Float8 GEMMs**: the same products through ``torch._scaled_mm`` in ``float8_e4m3fn`` (tensorwise scales, bf16
   out), beside the bf16 rate of each shape (issue 50's lever).
4. **Memory bandwidth**: a 1 GiB copy (bytes read + written per second), what elementwise work and the optimizer
   are priced at.

Writes ``--out`` (JSON: every point, the GEMM fit, the attention rate the planner takes -- causal SDPA forward +
backward at the longest length measured -- and the bandwidth) and a markdown summary beside it.
:func:`lightning_tp2d.planning.cost_model.with_measured_rates` turns the JSON into a hardware preset; ``tp2d-plan
--rates FILE`` plans with it.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lightning_tp2d import metp
from lightning_tp2d.planning import gemm_rates
from lightning_tp2d.families import model_config

HEAD, Q_HEADS, KV_HEADS = 128, 32, 8
SCORE_FLOPS = {"forward": 4, "backward": 10}  # per visible score and head channel (the cost model's convention)


class Timer:
    """Median seconds of ``fn()`` over ``repeats`` runs after ``warmup``. On a GPU: CUDA events around groups of
    back-to-back runs (as many as take about a millisecond, at most 50), one synchronization at the end, the group's
    time divided by its runs -- the GPU's own time, as in a training step whose host runs ahead of the GPU (one pair
    of events per run let the host's launches, not the GPU, set the pace of products under ~30 us). :meth:`synced`
    instead waits for each run before launching the next, so each time also holds the host's launch latency (the
    first call on 2026-12-04 timed only that way: small products lost up to 70% of their rate to it). Wall clock on
    the CPU."""

    def __init__(self, device: torch.device, repeats: int, warmup: int = 2) -> None:
        self.device, self.repeats, self.warmup = device, repeats, warmup

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        if self.device.type != "cuda":
            return self.synced(fn, warmup=False)
        one = self.synced(fn, warmup=False, repeats=3)  # an upper bound on one run's GPU time
        inner = max(1, min(50, round(1e-3 / one)))
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.repeats)]
        for start, end in events:
            start.record()
            for _ in range(inner):
                fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) / 1e3 / inner for start, end in events)

    def synced(self, fn, warmup: bool = True, repeats: int | None = None) -> float:
        """Median seconds of ``fn()`` with a synchronization after each run (launch latency included)."""
        for _ in range(self.warmup if warmup else 0):
            fn()
        times = []
        for _ in range(repeats or self.repeats):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def gemm_shapes(smoke: bool) -> list[tuple[str, int, int, int]]:
    """``(label, m, k, n)``: the linears of Llama 3.1 8B and 70B cut by 1-D TP over ``t`` ranks (column-parallel
    ``[in, out/t]``, row-parallel ``[in/t, out]``) at 8192 and 16384 tokens, and GPT-2 medium's MLP product on
    ``q x q`` grids (:func:`lightning_tp2d.planning.gemm_rates.table_shapes`) at 8192 tokens."""
    if smoke:
        return [("toy 64x32x96", 64, 32, 96), ("toy 128x64x128", 128, 64, 128), ("toy 32x32x32", 32, 32, 32)]
    shapes = []
    for name in ("llama-3.1-8b", "llama-3.1-70b"):
        cfg = model_config(name)
        h, kv, inter = cfg.n_embd, cfg.n_kv_head * (cfg.n_embd // cfg.n_head), cfg.intermediate_size
        for t in (1, 2, 4, 8):
            for m in (8192, 16384):
                for label, k, n in (("q", h, h // t), ("kv", h, kv // t), ("o", h // t, h), ("gate/up", h, inter // t),
                                    ("down", inter // t, h)):
                    shapes.append((f"{name} {label} tp{t}", m, k, n))
    for q, (m, k, n) in zip((1, 2, 3), gemm_rates.table_shapes(8192, model_config("gpt2-medium").n_embd)):
        shapes.append((f"gpt2-medium mlp {q}x{q} grid", m, k, n))
    # GPT-2 medium's LM head, forward (n = vocabulary) and input gradient (k = vocabulary), as it is and padded to a
    # multiple of 128 (pad_vocab_multiple: 50257 -> 50304; a 2x2 grid's block 25129 -> 25216)
    h = model_config("gpt2-medium").n_embd
    for label, vocab in (("head", 50257), ("head padded", 50304), ("head 2x2 block", 25129),
                         ("head 2x2 block padded", 25216)):
        shapes.append((f"gpt2-medium {label} V={vocab}", 8192, h, vocab))
        shapes.append((f"gpt2-medium {label} V={vocab} dx", 8192, vocab, h))
    return shapes


def measure_gemms(device, dtype, timer: Timer, smoke: bool) -> list[dict]:
    rows = []
    for label, m, k, n in gemm_shapes(smoke):
        a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        seconds, synced = timer(lambda: a @ b), timer.synced(lambda: a @ b)
        rows.append({"label": label, "m": m, "k": k, "n": n, "seconds": seconds,
                     "flops_per_s": 2.0 * m * k * n / seconds, "synced_seconds": synced,
                     "synced_flops_per_s": 2.0 * m * k * n / synced})
    return rows


def measure_float8_gemms(device, timer: Timer, smoke: bool) -> list[dict]:
    """The same products in float8 (``torch._scaled_mm``: ``float8_e4m3fn`` operands, one float32 scale each,
    tensorwise, bf16 out; the right operand column-major, as the kernel wants), beside the bf16 rate of the same
    shape: what Float8 training (issue 50) would buy per GEMM. Shapes ``_scaled_mm`` refuses (a dimension not a
    multiple of 16) are recorded with the error."""
    rows = []
    fp8 = torch.float8_e4m3fn
    for label, m, k, n in gemm_shapes(smoke):
        a = torch.randn(m, k, device=device).to(fp8)
        b = torch.randn(n, k, device=device).to(fp8).t()  # [k, n], column-major
        one = torch.ones((), device=device)

        def run():
            return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

        try:
            run()
        except (RuntimeError, NotImplementedError) as err:
            rows.append({"label": label, "m": m, "k": k, "n": n, "error": str(err).splitlines()[0][:200]})
            continue
        seconds = timer(run)
        rows.append({"label": label, "m": m, "k": k, "n": n, "seconds": seconds,
                     "flops_per_s": 2.0 * m * k * n / seconds})
    return rows


def _attention_flops(rows: int, cols: int, causal: bool, heads: int, d: int, backward: bool) -> float:
    scores = rows * (rows + 1) / 2 if causal else rows * cols
    per = SCORE_FLOPS["forward"] + (SCORE_FLOPS["backward"] if backward else 0)
    return per * d * heads * scores


def measure_sdpa(device, dtype, timer: Timer, smoke: bool) -> list[dict]:
    """Causal SDPA over one whole sequence (GQA: the key/value heads repeated as the plain Llama does)."""
    heads, kv_heads, d = (4, 2, 16) if smoke else (Q_HEADS, KV_HEADS, HEAD)
    rows = []
    for T in ((64, 128) if smoke else (2048, 8192, 16384, 32768)):
        q = torch.randn(1, heads, T, d, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(1, kv_heads, T, d, device=device, dtype=dtype).repeat_interleave(heads // kv_heads, 1)
        v = torch.randn_like(k)
        k.requires_grad_(True)
        v.requires_grad_(True)
        dout = torch.randn(1, heads, T, d, device=device, dtype=dtype)
        forward = timer(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        both = timer(lambda: torch.autograd.backward(F.scaled_dot_product_attention(q, k, v, is_causal=True), dout))
        rows.append({"seq": T, "heads": heads, "head_size": d,
                     "forward_s": forward, "forward_flops_per_s": _attention_flops(T, T, True, heads, d, False) / forward,
                     "step_s": both, "step_flops_per_s": _attention_flops(T, T, True, heads, d, True) / both})
    return rows


def measure_ring_blocks(device, dtype, timer: Timer, smoke: bool) -> list[dict]:
    """The METP ring's blocks through the package's kernel choice (:func:`lightning_tp2d.metp.block_kernel`): the
    causal diagonal ``2c x 2c`` block and an off-diagonal ``2c`` queries x ``c`` keys block, forward and backward
    (the backward given the block's output and log-sum-exp, as the ring's)."""
    heads, d = (4, 16) if smoke else (Q_HEADS, HEAD)
    rows = []
    for c in ((32, 64) if smoke else (1024, 4096, 8192)):
        for kind, rows_q, cols, causal in (("diagonal", 2 * c, 2 * c, True), ("half", 2 * c, c, False)):
            q = torch.randn(1, heads, rows_q, d, device=device, dtype=dtype)
            k, v = (torch.randn(1, heads, cols, d, device=device, dtype=dtype) for _ in range(2))
            scale = d ** -0.5
            out, lse = metp.attend_block(q, k, v, causal, scale)
            dout = torch.randn_like(out)
            forward = timer(lambda: metp.attend_block(q, k, v, causal, scale))
            backward = timer(lambda: metp.attend_block_backward(dout, q, k, v, out, lse, causal, scale))
            fwd_flops = _attention_flops(rows_q, cols, causal, heads, d, False)
            both = _attention_flops(rows_q, cols, causal, heads, d, True)
            rows.append({"block": kind, "c": c, "rows": rows_q, "cols": cols, "kernel": metp.block_kernel(q),
                         "forward_s": forward, "backward_s": backward,
                         "forward_flops_per_s": fwd_flops / forward, "step_flops_per_s": both / (forward + backward)})
    return rows


def measure_bandwidth(device, timer: Timer, smoke: bool) -> dict:
    n = (1 << 20) if smoke else (1 << 28)  # float32 elements: 4 MiB / 1 GiB
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    seconds = timer(lambda: dst.copy_(src))
    return {"bytes": 4 * n, "seconds": seconds, "bytes_per_s": 2 * 4 * n / seconds}


def summarize(result: dict) -> dict:
    points = [gemm_rates.GemmPoint(r["m"], r["k"], r["n"], r["flops_per_s"], r["label"]) for r in result["gemm"]]
    rate, overhead = gemm_rates.fit(points)
    longest = max(result["sdpa"], key=lambda r: r["seq"])
    return {"gemm_rate_flops_per_s": rate, "gemm_overhead_s": overhead,
            "attention_flops_per_s": longest["step_flops_per_s"], "attention_from": f"causal SDPA forward + backward "
            f"at {longest['seq']} tokens", "hbm_bytes_per_s": result["bandwidth"]["bytes_per_s"],
            "timing": "CUDA events around groups of runs launched back to back (GPU time); synced_*: a synchronization after each run"}


def markdown(result: dict) -> str:
    s = result["summary"]
    lines = [f"# Rates measured on {result['device']} ({result['dtype']})", "",
             f"torch {result['torch']}, {result['date']}; `python recipes/gpu_rates.py` "
             f"({result['seconds']:.0f} s). What the planner takes: GEMMs {s['gemm_rate_flops_per_s'] / 1e12:.3g} "
             f"TFLOP/s + {s['gemm_overhead_s'] * 1e6:.1f} us per kernel; attention "
             f"{s['attention_flops_per_s'] / 1e12:.3g} TFLOP/s ({s['attention_from']}); memory "
             f"{s['hbm_bytes_per_s'] / 1e12:.3g} TB/s.", "", "## GEMMs", "", "TFLOP/s of the GPU's time (runs launched back to back), and with a synchronization after each "
             "run (the host's launch latency included).", "",
             "| product | m | k | n | TFLOP/s | synchronized each run |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['label']} | {r['m']} | {r['k']} | {r['n']} | {r['flops_per_s'] / 1e12:.3g} | "
              f"{r['synced_flops_per_s'] / 1e12:.3g} |" for r in result["gemm"]]
    bf16 = {r["label"]: r for r in result["gemm"]}
    lines += ["", "## Float8 GEMMs (`_scaled_mm`, tensorwise scales, bf16 out)", "",
              "| product | m | k | n | TFLOP/s | x bf16 |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['label']} | {r['m']} | {r['k']} | {r['n']} | " + (
        f"{r['flops_per_s'] / 1e12:.3g} | {r['flops_per_s'] / bf16[r['label']]['flops_per_s']:.2f} |"
        if "error" not in r else f"refused: {r['error'][:60]} | |") for r in result.get("float8_gemm", [])]
    lines += ["", "## Causal SDPA, one sequence", "", "| tokens | forward TFLOP/s | forward + backward TFLOP/s |",
              "|---|---|---|"]
    lines += [f"| {r['seq']} | {r['forward_flops_per_s'] / 1e12:.3g} | {r['step_flops_per_s'] / 1e12:.3g} |"
              for r in result["sdpa"]]
    lines += ["", "## METP ring blocks", "", "| block | c | queries x keys | kernel | forward TFLOP/s | "
              "forward + backward TFLOP/s |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['block']} | {r['c']} | {r['rows']} x {r['cols']} | {r['kernel']} | "
              f"{r['forward_flops_per_s'] / 1e12:.3g} | {r['step_flops_per_s'] / 1e12:.3g} |" for r in result["ring"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON to write (markdown beside it)")
    parser.add_argument("--smoke", action="store_true", help="CPU, toy sizes: checks the script")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: this measures a GPU (use --smoke to check the script on the CPU)")
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    timer = Timer(device, 3 if args.smoke else args.repeats)
    started = time.time()
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
              "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "smoke": args.smoke}
    with torch.no_grad():
        result["gemm"] = measure_gemms(device, dtype, timer, args.smoke)
        result["bandwidth"] = measure_bandwidth(device, timer, args.smoke)
        result["float8_gemm"] = measure_float8_gemms(device, timer, args.smoke)
    result["sdpa"] = measure_sdpa(device, dtype, timer, args.smoke)
    with torch.no_grad():
        result["ring"] = measure_ring_blocks(device, dtype, timer, args.smoke)
    result["summary"] = summarize(result)
    result["seconds"] = time.time() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
