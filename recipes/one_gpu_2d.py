"""Run the "2d" layout with q*q ranks sharing ONE GPU (gloo over CUDA tensors) and report what a single GPU
can tell: parity with the plain model, the attention kernel the local heads get, and per-rank peak memory.

    python recipes/one_gpu_2d.py --out results.json          # q=2: 4 processes on cuda:0

Speed is not measured here: q*q processes time-share one GPU and gloo stages through host memory. Peak
memory per rank is real (each process has its own CUDA caching allocator). Each rank runs
  1. parity: gpt2-tiny in float32 (TF32 off), loss and gradients against the plain model on the same GPU;
  2. memory: one forward+backward of --model at --batch x --seq under bf16 autocast, peak allocated bytes
     above the weights and gradients, against the plain model run alone in the parent process.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import queue
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import distribute_tensor

import lightning_tp2d as tp
from lightning_tp2d.models import GPT2, GPT2Config


def _step_peak(model, idx, targets):
    """Peak bytes allocated above the baseline (weights, gradients) during one bf16 forward+backward."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(idx, targets)
    loss.backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, loss.item()


def _batch(vocab, batch, seq, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab, (batch, seq), generator=g).cuda(),
            torch.randint(0, vocab, (batch, seq), generator=g).cuda())


def worker(rank, world, args, init_file, results):
    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    mesh = tp.init_mesh("2d", world, 1, device_type="cuda")
    out = {"rank": rank}

    torch.manual_seed(0)
    cfg = GPT2Config.from_name("gpt2-tiny")
    plain = GPT2(cfg).cuda()
    par = tp.parallelize(copy.deepcopy(plain), mesh)
    idx, targets = _batch(cfg.vocab_size, 2 * args.grid, 64)
    l0, l1 = plain(idx, targets), par(idx, targets)
    l0.backward()
    l1.backward()
    out["parity_loss"] = [l0.item(), l1.item()]
    # compare local shards (DTensor's own all-gather of CUDA tensors is not supported under gloo)
    out["parity_grad_rel"] = max(
        ((p.grad.to_local() - distribute_tensor(p0.grad, mesh, p.placements, src_data_rank=None).to_local()).norm()
         / p0.grad.norm()).item() for p, p0 in zip(par.parameters(), plain.parameters()))
    del plain, par

    torch.manual_seed(0)
    cfg = GPT2Config.from_name(args.model)
    model = tp.parallelize(GPT2(cfg).cuda(), mesh)
    idx, targets = _batch(cfg.vocab_size, args.batch, args.seq)
    _step_peak(model, idx, targets)  # warm-up: allocates gradients
    for p in model.parameters():
        p.grad = None
    weights = torch.cuda.memory_allocated()
    peak, loss = _step_peak(model, idx, targets)
    out.update(model=args.model, batch=args.batch, seq=args.seq, weights_bytes=weights, step_peak_bytes=peak,
               loss=loss, local_param_bytes=tp.local_parameter_bytes(model))
    results.put(out)
    dist.destroy_process_group()


def plain_reference(args):
    torch.manual_seed(0)
    cfg = GPT2Config.from_name(args.model)
    model = GPT2(cfg).cuda()
    idx, targets = _batch(cfg.vocab_size, args.batch, args.seq)
    _step_peak(model, idx, targets)
    for p in model.parameters():
        p.grad = None
    weights = torch.cuda.memory_allocated()
    peak, loss = _step_peak(model, idx, targets)
    hs = cfg.n_embd // cfg.n_head
    q = torch.randn(args.batch // args.grid, cfg.n_head // args.grid, args.seq, hs, device="cuda", dtype=torch.bfloat16)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        flash = True
    except RuntimeError as e:
        flash = f"no: {e}"
    del model
    torch.cuda.empty_cache()
    return {"weights_bytes": weights, "step_peak_bytes": peak, "loss": loss, "local_heads_flash": flash,
            "device": torch.cuda.get_device_name(0), "torch": torch.__version__}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--grid", type=int, default=2)
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = {"plain": plain_reference(args)}
    world = args.grid * args.grid
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=worker, args=(r, world, args, os.path.join(tmp, "rdzv"), results))
                 for r in range(world)]
        for p in procs:
            p.start()
        ranks = []
        while len(ranks) < world:
            try:
                ranks.append(results.get(timeout=5))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):  # a rank died: stop, do not hang
                    for p in procs:
                        p.kill()
                    raise SystemExit("a rank failed; see its traceback above")
        ranks.sort(key=lambda o: o["rank"])
        for p in procs:
            p.join()
    report["ranks"] = ranks
    report["peak_ratio_rank_vs_plain"] = max(r["step_peak_bytes"] for r in ranks) / report["plain"]["step_peak_bytes"]
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
