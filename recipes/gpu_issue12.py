"""GPU-grade execution checks (issue 12) for one GPU, in one run of about 2 minutes on an H200 (run there on
2026-12-04: ``recipes/results/gpu_issue12_h200.json``); ``--smoke`` runs every part at toy sizes on CPU (as CI can).

    python recipes/gpu_issue12.py --out results.json           # one CUDA GPU (an H200 in the issue)
    python recipes/gpu_issue12.py --smoke --out smoke.json     # CPU, tiny sizes: checks the script itself

1. **Throughput**: tokens/s of one training step (bf16 autocast, fused AdamW) of our plain ``GPT2`` eager and
   compiled (inductor) against transformers' ``GPT2LMHeadModel`` eager and compiled, GPT-2 124M at B32 x 1024
   (anchor: transformers compiled ran 412k tokens/s on an H200; target: ours compiled >= 1.0x of it; measured
   2026-12-04: ours 492k, transformers' 393k, 1.25x).
2. **Ring attention kernels**: forward+backward of one ``metp.ring_attention`` block at T = 16k with 4 ranks sharing
   the GPU (gloo, point-to-point staged through host memory, so times include the staging): the fused kernel
   (``block_kernel``) against the tiled math kernel, time and peak memory per rank.
3. **No host syncs**: ``torch.cuda.set_sync_debug_mode("error")`` over one warmed-up training step of each layout on
   one rank (size-1 axes: no communication, so only the layers' own code is checked; several ranks on one GPU over
   gloo stage every transfer through the host, which syncs by design).
4. **Layer overhead** (``layer_overhead``): tokens/s and peak memory of an eager bf16 training step of each layout on
   one rank (size-1 axes: no communication; what the parallel layers' own code costs) against the plain model,
   GPT-2 medium at B8 x 1024 and Llama 3.2 1B at B2 x 2048 (``--models``), with the aten ops a step dispatches
   (:class:`~lightning_tp2d.bench.layer_cost.OpCounter`, the planner's unit of host cost). The cost model prices a layout's step as the plain model's FLOPs plus communication,
   so a layout slower than plain here is slower than priced. ``--profile``: two more steps of each under
   torch.profiler (host time, GPU kernel time and ops per step, and host seconds per aten op: what
   :data:`lightning_tp2d.planning.host_cost.SECONDS_PER_OP` takes; the operator tables beside ``--out``); ``--compile``:
   each model compiled with inductor (the first three steps' time, compilation included, as ``warmup_s``; the
   graph breaks' reasons and count; ``TORCH_LOGS=graph_breaks`` prints where in the code each one is).

``--parts`` runs a subset, e.g. ``--parts layer_overhead``.
"""

from __future__ import annotations

import argparse
import dataclasses
import contextlib
import datetime
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import lightning_tp2d as tp
from lightning_tp2d import metp
from lightning_tp2d.models import GPT2, GPT2Config
from lightning_tp2d.nn.sequence import zigzag_positions


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _training_step(model, loss_of, device, lr: float = 1e-4):
    """One bf16-autocast step of ``loss_of(model)`` with fused AdamW on CUDA (a fresh optimizer)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=device.type == "cuda")

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_of(model)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _timed(step, device, steps: int, warmup: int = 3) -> tuple[float, float]:
    """``(warm-up seconds, seconds of steps)``: ``warmup`` steps (compilation included), then ``steps`` timed."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    _sync(device)
    warm = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return warm, time.perf_counter() - t0


@contextlib.contextmanager
def _one_rank_group(port: str):
    """A gloo group of this process alone (size-1 mesh axes: the layers run without communication)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def throughput(args, device) -> dict:
    from transformers import GPT2Config as HFConfig, GPT2LMHeadModel

    name, batch, seq, steps = ("gpt2-tiny", 2, 64, 2) if args.smoke else ("gpt2", 32, 1024, 10)
    cfg = GPT2Config.from_name(name, dropout=0.0, block_size=max(seq, 64))
    idx = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=device)
    x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    out = {"model": name, "batch": batch, "seq": seq}
    for label, compiled in (("ours", False), ("ours_compiled", True), ("hf", False), ("hf_compiled", True)):
        torch.manual_seed(0)
        if label.startswith("ours"):
            model = GPT2(cfg).to(device)
            model.validate_inputs = False
            loss_of = lambda m: m(x, y)  # noqa: E731
        else:
            hf = HFConfig(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, vocab_size=cfg.vocab_size,
                          n_positions=cfg.block_size, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                          bos_token_id=None, eos_token_id=None, attn_implementation="sdpa")
            model = GPT2LMHeadModel(hf).to(device)
            loss_of = lambda m: m(x, labels=x).loss  # noqa: E731
        if compiled:
            model.compile(backend="aot_eager" if args.smoke else "inductor", dynamic=False)
        _, seconds = _timed(_training_step(model, loss_of, device), device, steps)  # warm-up compiles
        out[label] = batch * seq * steps / seconds
        del model
    out["ours_compiled_vs_hf_compiled"] = out["ours_compiled"] / out["hf_compiled"]
    return out


def _ring_worker(rank, world, args, init_file, results):
    device = torch.device("cpu" if args.smoke else "cuda", 0)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        mesh = tp.init_mesh("metp", world, 1, device_type=device.type)
        T, H, d = (256, 2, 16) if args.smoke else (16384, 16, 64)
        dtype = torch.float32 if args.smoke else torch.bfloat16
        g = torch.Generator().manual_seed(0)
        pos = zigzag_positions(T, world, rank)
        qkv = torch.randn(3, 1, H, T, d, generator=g)[..., pos, :].to(device, dtype)
        dy = torch.randn(1, H, T, d, generator=g)[..., pos, :].to(device, dtype)
        out = {"rank": rank}
        for kernel in ("auto", "math"):
            options = metp.RingOptions(attention_kernel=kernel)
            out[f"{kernel}_kernel"] = metp.block_kernel(qkv[0], options)
            times = []
            for _ in range(3):
                x = qkv.clone().requires_grad_()
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                dist.barrier()
                _sync(device)
                t0 = time.perf_counter()
                metp.ring_attention(x, mesh, "ring", options=options).backward(dy)
                _sync(device)
                times.append(time.perf_counter() - t0)
            out[f"{kernel}_s"] = min(times)
            out[f"{kernel}_peak_bytes"] = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
        results.put(out)
    finally:
        dist.destroy_process_group()


def ring_attention(args) -> list[dict]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_ring_worker, args=(r, 4, args, init_file, results)) for r in range(4)]
        for p in procs:
            p.start()
        out = sorted((results.get(timeout=600) for _ in procs), key=lambda r: r["rank"])
        for p in procs:
            p.join()
    return out


def no_host_syncs(args, device) -> dict:
    out = {}
    with _one_rank_group("29571"):
        for layout in ("2d", "metp", "2d-metp"):
            cfg = GPT2Config.from_name("gpt2-tiny", n_head=4, dropout=0.0)
            torch.manual_seed(0)
            model = tp.parallelize(GPT2(cfg), tp.init_mesh(layout, 1, 1, device_type=device.type), layout)
            model.validate_inputs = False
            idx = torch.randint(0, cfg.vocab_size, (2, 64), device=device)
            step = _training_step(model, lambda m: m(idx, idx), device, lr=1e-3)
            step()  # warm-up
            try:
                if device.type == "cuda":
                    torch.cuda.set_sync_debug_mode("error")
                step()
                out[layout] = "no sync"
            except RuntimeError as err:
                out[layout] = f"sync: {err}"
            finally:
                if device.type == "cuda":
                    torch.cuda.set_sync_debug_mode(0)
    return out


def layer_overhead(args, device) -> dict:
    """Each ``--models`` entry (default GPT-2 medium at B8 x 1024 and Llama 3.2 1B at B2 x 2048): the layouts' one-rank
    step against the plain model's (module docstring), with the aten ops of a step as
    :class:`lightning_tp2d.bench.layer_cost.OpCounter` counts them (collectives apart: the unit of the planner's host
    price, :mod:`lightning_tp2d.planning.host_cost`) and, profiled, the host seconds per such op."""
    out = {}
    for entry in args.models.split(","):
        name, shape = entry.split(":") if ":" in entry else (entry, "")
        batch, seq = (int(x) for x in shape.split("x")) if shape else (8, 1024) if name.startswith("gpt2") else (2, 2048)
        if args.smoke:
            name, batch, seq = ("gpt2-tiny" if name.startswith("gpt2") else "llama-tiny"), 2, 64
        out[name] = _layer_overhead_of(args, device, name, batch, seq)
    return out


def _layer_overhead_of(args, device, name: str, batch: int, seq: int) -> dict:
    from lightning_tp2d.bench.layer_cost import OpCounter
    from lightning_tp2d.families import family_of_config, model_config

    steps = 2 if args.smoke else 10
    out = {"model": name, "batch": batch, "seq": seq, "compiled": args.compile}
    with _one_rank_group("29572"):
        for layout in ("plain", "2d", "metp", "2d-metp"):
            cfg = dataclasses.replace(model_config(name), dropout=0.0)
            cfg = dataclasses.replace(cfg, block_size=max(cfg.block_size, seq))
            torch.manual_seed(0)
            model = family_of_config(cfg).model_class(cfg).to(device)
            if layout != "plain":
                model = tp.parallelize(model, tp.init_mesh(layout, 1, 1, device_type=device.type), layout)
            model.validate_inputs = False
            if args.compile:
                torch._dynamo.reset()
                torch._dynamo.utils.counters.clear()
                model.compile(backend="aot_eager" if args.smoke else "inductor", dynamic=False)
            idx = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=device)
            x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
            step = _training_step(model, lambda m: m(x, y), device)
            warm_s, seconds = _timed(step, device, steps)
            counter = OpCounter()
            with counter:  # (compiled: the dispatch mode runs the step eagerly; these are eager's ops)
                step()
            out[layout] = {"tokens_per_s": batch * seq * steps / seconds, "seconds_per_step": seconds / steps,
                           "peak_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
                           "warmup_s": warm_s, "aten_ops_per_step": counter.cost.total}
            if args.compile:  # distinct reasons dynamo split the graph, with how often each was hit
                breaks = torch._dynamo.utils.counters["graph_break"]
                out[layout]["graph_breaks"] = {"hits": sum(breaks.values()), "reasons": len(breaks),
                                               "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
                                               "top": [r[:160] for r, _ in breaks.most_common(3)]}
            if args.profile:
                out[layout].update(_profiled(step, device, f"{args.out.removesuffix('.json')}_{name}_{layout}"
                                                           f"_profile.txt"))
                out[layout]["host_s_per_aten_op"] = out[layout]["host_s_per_step"] / counter.cost.total
            print(f"layer_overhead {name} {layout}: {out[layout]}", flush=True)
            del model, step
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for layout in ("2d", "metp", "2d-metp"):
        out[layout]["vs_plain"] = out[layout]["tokens_per_s"] / out["plain"]["tokens_per_s"]
    return out


def _profiled(step, device, path: str) -> dict:
    """Two steps under torch.profiler: per step, the host's time in the ops it dispatches (self CPU), the GPU's
    time in kernels (self device), and the ops dispatched; the operator tables (by GPU time, by host time) to
    ``path``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(2):
            step()
        _sync(device)
    ops = prof.key_averages()
    host = sum(e.self_cpu_time_total for e in ops) / 2e6
    gpu = sum(getattr(e, "self_device_time_total", 0) for e in ops if e.device_type.name == "CUDA") / 2e6
    by = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    with open(path, "w") as f:
        f.write(ops.table(sort_by=by, row_limit=30, max_name_column_width=70) + "\n")
        f.write(ops.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=70) + "\n")
    return {"host_s_per_step": host, "gpu_s_per_step": gpu, "ops_per_step": sum(e.count for e in ops) // 2,
            "profile": path}


PARTS = ("ring_attention", "throughput", "no_host_syncs", "layer_overhead")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="gpu_issue12.json")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on CPU (checks the script, measures nothing)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    ap.add_argument("--profile", action="store_true", help="layer_overhead: profile two steps of each layout too")
    ap.add_argument("--compile", action="store_true", help="layer_overhead: torch.compile each model (inductor)")
    ap.add_argument("--models", default="gpt2-medium:8x1024,llama-3.2-1b:2x2048",
                    help="layer_overhead: NAME[:BATCHxSEQ],... (a registered model size each)")
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    report = {"device": "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(0), "torch": torch.__version__}
    parts = {"ring_attention": lambda: ring_attention(args), "throughput": lambda: throughput(args, device),
             "no_host_syncs": lambda: no_host_syncs(args, device), "layer_overhead": lambda: layer_overhead(args, device)}
    for name in args.parts.split(","):
        fn = parts[name]
        t0 = time.perf_counter()
        try:
            report[name] = fn()
        except Exception as err:  # noqa: BLE001 - keep the other parts' results
            report[name] = f"failed: {type(err).__name__}: {err}"
        print(f"{name}: {time.perf_counter() - t0:.0f} s: {report[name]}", flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
