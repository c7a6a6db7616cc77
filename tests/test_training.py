"""``GradientSync``: data-parallel averaging overlapped with the backward equals the blocking average."""

from __future__ import annotations

import torch

import lightning_tp2d as tp
from lightning_tp2d import comm
from lightning_tp2d.models import GPT2, GPT2Config
from lightning_tp2d.training import GradientSync, average_gradients_
from tests.distributed import run_distributed


def _sync_worker(rank: int, world_size: int) -> dict:
    cfg = GPT2Config.from_name("gpt2-tiny")
    mesh = tp.init_mesh("2d", 4, world_size // 4)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(tp.parallelize(GPT2(cfg), mesh))
    blocking, overlapped = models
    sync = GradientSync(overlapped, mesh, bucket_mib=0.005)  # small buckets: several go out during the backward
    torch.manual_seed(1 + mesh.get_local_rank("data_parallel"))  # each replica its own batch
    batches = [torch.randint(0, cfg.vocab_size, (2, 16)) for _ in range(3)]
    posted_in_backward = []
    for step, idx in enumerate(batches):
        for model in models:
            model.zero_grad(set_to_none=True)
        # step 1 accumulates two micro-batches, the first with the sync disabled (gradient accumulation)
        micro = [idx, batches[0]] if step == 1 else [idx]
        for k, x in enumerate(micro):
            blocking(x, x).backward()
            sync.enabled = k == len(micro) - 1
            with comm.count_comm() as stats:
                overlapped(x, x).backward()
            if sync.enabled:
                posted_in_backward.append(stats.snapshot()["all_reduce"]["calls"])
        average_gradients_(blocking, mesh)
        sync.finish()
    diffs = [(a.grad.to_local() - b.grad.to_local()).abs().max().item()
             for a, b in zip(blocking.parameters(), overlapped.parameters())]
    return {"max_diff": max(diffs), "buckets": len(sync.buckets), "posted": posted_in_backward}


def test_gradient_sync_overlaps_the_backward_and_equals_the_blocking_average():
    for out in run_distributed(_sync_worker, 8, timeout=300):
        assert out["max_diff"] <= 1e-6, out
        assert out["buckets"] > 2
        # the buckets' all-reduces went out inside backward() (besides the layers' own along the grid)
        assert all(n >= out["buckets"] for n in out["posted"]), out
