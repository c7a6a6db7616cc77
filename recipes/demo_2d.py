"""Train a small GPT-2 with the "2d" layout on a q x q grid of CPU processes, next to the plain model.

    python recipes/demo_2d.py                 # 2x2 grid (4 processes), 30 steps, about a minute on 2 cores
    python recipes/demo_2d.py --grid 3        # 3x3 grid (9 processes)

Each rank trains its parallel copy on the Python documentation that ships with every Python
(``pydoc_data.topics``, byte-level tokens); rank 0 also trains the plain single-device model on the same
batches. It prints both losses per step (they agree to float32 rounding), then each rank's parameter bytes
and the communication of one training step as counted by ``lightning_tp2d.comm``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import lightning_tp2d as tp
from lightning_tp2d import comm
from lightning_tp2d.models import GPT2, GPT2Config


def corpus_tokens() -> torch.Tensor:
    """Byte-level tokens of the Python documentation topics (ids 0..255 of the 257-entry vocabulary)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def batches(tokens: torch.Tensor, batch: int, seq: int, steps: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, tokens.numel() - seq - 1, (batch,), generator=g)
        window = torch.stack([tokens[s:s + seq + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


def worker(rank: int, args, init_file: str) -> None:
    torch.set_num_threads(1)
    world = args.grid * args.grid
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(0)
    cfg = GPT2Config.from_name(args.model)
    plain = GPT2(cfg)
    model = tp.parallelize(copy.deepcopy(plain), tp.init_mesh("2d", world, 1), layout="2d")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=args.lr) if rank == 0 else None

    tokens = corpus_tokens()
    if rank == 0:
        print(f"{args.model}: {plain.num_parameters():,} parameters, 2d layout on a {args.grid}x{args.grid} grid, "
              f"{tokens.numel():,} byte tokens")
        print(f"{'step':>4} {'2d loss':>10} {'plain loss':>10} {'ms/step (2d)':>12}")
    for step, (idx, targets) in enumerate(batches(tokens, args.batch, args.seq, args.steps, seed=1)):
        t0 = time.perf_counter()
        with comm.count_comm() as stats:
            loss = model(idx, targets)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ms = (time.perf_counter() - t0) * 1e3
        step_comm = stats.snapshot()
        if rank == 0:
            ref = plain(idx, targets)
            ref.backward()
            plain_opt.step()
            plain_opt.zero_grad(set_to_none=True)
            if step % args.log_every == 0 or step == args.steps - 1:
                print(f"{step:>4} {loss.item():>10.4f} {ref.item():>10.4f} {ms:>12.1f}")

    local = torch.tensor([tp.local_parameter_bytes(model)], dtype=torch.float64)
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    if rank == 0:
        full = sum(p.numel() * p.element_size() for p in plain.parameters())
        print(f"parameter bytes: plain {full:,}; per rank " + ", ".join(f"{int(g.item()):,}" for g in gathered)
              + f" ({gathered[0].item() / full:.1%} of the model each)")
        print("communication of one training step on rank 0 (forward + backward):")
        for kind, v in step_comm.items():
            if v["calls"]:
                print(f"  {kind:<14} {v['calls']:>5} calls {v['bytes']:>12,} bytes")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", type=int, default=2, help="grid side q (q*q processes)")
    parser.add_argument("--model", default="gpt2-tiny", help="named config (gpt2-tiny, gpt2-mini, gpt2, ...)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (a multiple of --grid)")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=5)
    args = parser.parse_args()
    if args.batch % args.grid:
        parser.error(f"--batch {args.batch} is not divisible by --grid {args.grid}")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.start_processes(worker, args=(args, init_file), nprocs=args.grid * args.grid, start_method="fork")


if __name__ == "__main__":
    main()
