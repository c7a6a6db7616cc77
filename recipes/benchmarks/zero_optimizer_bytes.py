"""Optimizer-state bytes per rank with ZeRO-1 over data_parallel (``TP2DStrategy(zero_stage=1)``) against the
replicated optimizer, for dp = 2 and 4, on CPU processes (gloo).

    python recipes/benchmarks/zero_optimizer_bytes.py [--model gpt2] [--out recipes/benchmarks/zero]

For each (layout, p, dp) every rank builds the model, an AdamW the way ``CausalLMModule`` does (decay and
no-decay groups), runs one training step (data-parallel averaging, global-norm clipping, the step; with ZeRO the
owner's broadcast) and reports its optimizer state bytes, parameter bytes and the largest difference between its
parameters and the replicated run's after the step (must be 0: the owner computes the same update). Writes
``results.json`` and ``results.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import lightning_tp2d as tp
from lightning_tp2d.bench.procs import run_ranks
from lightning_tp2d.models import GPT2, GPT2Config
from lightning_tp2d.training import GradientSync, clip_grad_norm_
from lightning_tp2d.zero import full_param_groups, optimizer_state_bytes, shard_optimizer_state

MIB = 2 ** 20


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _adamw(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=1e-4, foreach=True)


def _worker(rank: int, world_size: int, layout: str, p: int, model_name: str, batch: int, seq: int) -> dict:
    cfg = GPT2Config.from_name(model_name)
    mesh = tp.init_mesh(layout, p, world_size // p)
    torch.manual_seed(1 + mesh.get_local_rank("data_parallel"))
    idx = torch.randint(0, cfg.vocab_size, (batch, seq))
    out, params = {}, []
    for zero in (False, True):
        with torch.device("meta"):
            model = GPT2(cfg)
        torch.manual_seed(0)
        tp.parallelize(model, mesh, layout)  # materialised shard by shard from the seed: the same on every run
        optimizer = _adamw(model)
        if zero:
            shard_optimizer_state(optimizer, mesh)
        sync = GradientSync(model, mesh)
        started = time.perf_counter()
        model(idx, idx).backward()
        sync.finish()
        clip_grad_norm_([q for g in full_param_groups(optimizer) for q in g], 1.0, mesh)
        optimizer.step()
        out["zero" if zero else "replicated"] = {"optimizer_bytes": optimizer_state_bytes(optimizer),
                                                 "step_s": time.perf_counter() - started}
        out["parameter_bytes"] = sum(_local(q).numel() * q.element_size() for q in model.parameters())
        params.append([_local(q.detach()).clone() for q in model.parameters()])
        del model, optimizer, sync
    out["max_param_diff"] = max((a - b).abs().max().item() for a, b in zip(*params))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2", help="GPT2Config name")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--out", default="recipes/benchmarks/zero")
    args = ap.parse_args()
    cases = [("metp", 2, 2), ("metp", 2, 4), ("2d", 4, 2)]
    rows = []
    for layout, p, dp in cases:
        result = run_ranks(_worker, p * dp, layout, p, args.model, args.batch, args.seq, timeout=1800)
        if not result.ok:
            raise SystemExit(f"{layout} p={p} dp={dp}: {result.status}: {result.reason}")
        values = result.values
        replicated = max(v["replicated"]["optimizer_bytes"] for v in values)
        zero = max(v["zero"]["optimizer_bytes"] for v in values)
        rows.append({"layout": layout, "p": p, "dp": dp, "world": p * dp,
                     "parameter_mib_per_rank": max(v["parameter_bytes"] for v in values) / MIB,
                     "optimizer_mib_per_rank_replicated": replicated / MIB,
                     "optimizer_mib_per_rank_zero1_max": zero / MIB,
                     "optimizer_mib_per_rank_zero1_min": min(v["zero"]["optimizer_bytes"] for v in values) / MIB,
                     "ratio": zero / replicated, "ideal_ratio": 1 / dp,
                     "max_param_diff": max(v["max_param_diff"] for v in values)})
        print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model, "batch": args.batch, "seq": args.seq, "torch": torch.__version__,
            "device": "cpu (gloo)", "optimizer": "AdamW (decay / no-decay groups), float32 state"}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [f"# ZeRO-1 optimizer state per rank: {args.model}, AdamW float32", "",
             "Measured by `python recipes/benchmarks/zero_optimizer_bytes.py` (one step, CPU processes). "
             "Optimizer state is the largest rank's; parameters after the step equal the replicated run's "
             "exactly (max difference column).", "",
             "| layout | p | dp | parameters MiB/rank | optimizer MiB/rank, replicated | ZeRO-1 (max rank) | "
             "ZeRO-1 / replicated | ideal 1/dp | max param difference |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['p']} | {r['dp']} | {r['parameter_mib_per_rank']:.1f} | "
                     f"{r['optimizer_mib_per_rank_replicated']:.1f} | {r['optimizer_mib_per_rank_zero1_max']:.1f} | "
                     f"{r['ratio']:.3f} | {r['ideal_ratio']:.3f} | {r['max_param_diff']:.1e} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print((out / "results.md").read_text())


if __name__ == "__main__":
    main()
