"""Long context on CPU processes (gloo), p ranks: "metp" against torch's own context parallelism (``cp``, ``cp-tp``).

    python recipes/benchmarks/long_context_cpu.py [--p 4] [--seqs 256 1024 2048] [--vocabs 257 32000] [--batch 1]

``cp`` is :mod:`lightning_tp2d.bench.context_parallel`: torch's ``context_parallel`` (its ring attention, head-tail
load balancing, RoPE positions as a CP buffer) run with the CPU flash kernel, the weights sharded by FSDP2 over the
same p ranks (ZeRO stage 3), as torchtitan composes CP x FSDP; ``cp-tp`` is CP over p/2 ranks x 1-D TP + SP over
2 (:func:`~lightning_tp2d.bench.tp1d.parallelize_1d`, torchtitan's Llama plan), FSDP over the CP axis. ``metp`` is
the package's layout (``tp.init_mesh("metp", p, 1)``, ``tp.parallelize``), no data parallelism. The model is
llama-tiny (2 layers, width 96, 12 query and 6 key/value heads) with the vocabulary given, float32, the same batch
on every rank.

For each (vocabulary, sequence length, layout) every rank runs a warm-up training step (AdamW: its state exists
after it), then one measured step (zero_grad, forward, backward, the optimizer step), and reports, largest rank:

* peak bytes: the resident bytes before the step (parameter shards, optimizer state) plus the peak of the tensor
  storages allocated during it (:class:`~lightning_tp2d.bench.measure.LiveTensorBytes` with ``count_resizes``, so
  FSDP's gathered parameters count);
* bytes sent per token of the batch: every collective the rank issues (the package's ``comm.py`` calls, FSDP's
  ``torch.distributed`` ones, torch's functional collectives of the ring and of TP), each priced as the bytes the
  rank puts on the wire (:class:`~lightning_tp2d.bench.context_parallel.SentBytes`; it prices every functional
  collective over one group size: p for ``cp``, 2 for ``cp-tp``, whose CP and TP groups both have 2 ranks, so
  ``cp-tp`` runs at p = 4 only).

Prints a markdown table; writes nothing.
"""

from __future__ import annotations

import argparse

import torch

import lightning_tp2d as tp
from lightning_tp2d.bench import context_parallel as cp
from lightning_tp2d.bench.procs import run_ranks
from lightning_tp2d.models import Llama, LlamaConfig

MIB = 2 ** 20


def _worker(rank: int, world_size: int, layout: str, vocab: int, seq: int, batch: int) -> dict:
    cfg = LlamaConfig.from_name("llama-tiny", vocab_size=vocab, block_size=seq)
    data = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(seq))
    idx, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    torch.manual_seed(0)
    model = Llama(cfg)
    group = world_size
    if layout in ("cp", "cp-tp"):
        tp_size = 2 if layout == "cp-tp" else 1
        mesh = cp.init_cp_mesh(world_size // tp_size, tp_size)
        cp.parallelize_cp(model, mesh)
        group //= tp_size
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            return cp.train_step(model, optimizer, mesh, idx, targets)
    else:
        tp.parallelize(model, tp.init_mesh(layout, world_size, 1), layout)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            optimizer.zero_grad(set_to_none=True)
            model(idx, targets).backward()
            optimizer.step()

    return cp.measure_step(step, model, optimizer, group)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=int, default=4)
    parser.add_argument("--seqs", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--vocabs", type=int, nargs="+", default=[257, 32000])
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    print(f"p = {args.p}, batch {args.batch}, llama-tiny, float32, CPU gloo; largest rank\n")
    print("| vocab | T | layout | peak MiB / rank | sent bytes / token / rank |")
    print("|---|---|---|---|---|")
    for vocab in args.vocabs:
        for seq in args.seqs:
            for layout in ("metp", "cp", "cp-tp") if args.p == 4 else ("metp", "cp"):
                result = run_ranks(_worker, args.p, layout, vocab, seq, args.batch, timeout=1800)
                if not result.ok:
                    print(f"| {vocab} | {seq} | {layout} | {result.status}: {result.reason.splitlines()[-1]} | |")
                    continue
                peak = max(r["peak_bytes"] for r in result.values)
                sent = max(r["sent_bytes"] for r in result.values)
                print(f"| {vocab} | {seq} | {layout} | {peak / MIB:.2f} | {sent / (args.batch * seq):.0f} |",
                      flush=True)


if __name__ == "__main__":
    main()
