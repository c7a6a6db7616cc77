"""ZeRO stages 0-3 over data_parallel, per rank, on CPU processes (gloo): what each rank holds, its peak during a
training step, what it sends, and the deepest model that trains under a per-rank memory cap.

    python recipes/benchmarks/zero_stages.py [--out recipes/benchmarks/zero] [--cap-mib 64] [--skip-train]

Stage 0 is the replicated model and optimizer (``GradientSync``); 1 is :func:`lightning_tp2d.zero.
shard_optimizer_state`; 2 and 3 are :func:`lightning_tp2d.fsdp.shard_data_parallel` (FSDP2). For each (model,
layout, p, dp) every rank builds the model for each stage, an AdamW the way ``CausalLMModule`` does (decay and
no-decay groups), runs a warm-up step (the optimizer state exists after it) and then one measured step
(zero_grad, forward, backward, data-parallel averaging, global-norm clipping, the step). Per rank, largest rank:

* parameter, gradient (before the step) and optimizer bytes: local shards;
* peak bytes: what existed before the step (parameters, optimizer state) plus the peak of the tensor storages
  allocated during it (:class:`~lightning_tp2d.planning.live.LiveTensorBytes` with ``count_resizes``: FSDP's
  storage resizes too);
* bytes sent in the step, payload convention of :mod:`lightning_tp2d.comm` (the tensor handed to each call;
  receives left out), twice: ``sent_bytes_package`` as :func:`~lightning_tp2d.comm_record.count_comm` records them
  (the package's calls, and FSDP's where it records direct ``torch.distributed`` collectives), ``sent_bytes_all``
  every ``c10d`` or functional collective op that a dispatch mode of this script sees (the package's, FSDP's);
* the largest difference between its parameters after the two steps and stage 0's (stage 1: 0, it computes the
  same update; stages 2 and 3: FSDP averages in another order).

Then the largest model: GPT-2 at a fixed width, for each stage the deepest whose measured step keeps every rank's
peak under ``--cap-mib`` (from the previous stage's depth, doubled or halved, then bisected). Last, unless ``--skip-train``, ``tp2d-train`` at
stage 3 on 8 processes as a new user runs it: trains, checkpoints, resumes. Writes ``results.json`` and
``results.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import lightning_tp2d as tp
from lightning_tp2d import fsdp, training
from lightning_tp2d.planning.live import LiveTensorBytes, resident_bytes, tensors_in
from lightning_tp2d.bench.procs import run_ranks
from lightning_tp2d.comm_record import count_comm
from lightning_tp2d.models import GPT2, GPT2Config, Llama, LlamaConfig
from lightning_tp2d.zero import full_param_groups, optimizer_state_bytes, shard_optimizer_state

MIB = 2 ** 20
STAGES = (0, 1, 2, 3)
# the models of the per-stage table: GPT-2 small's width and vocabulary in 2 blocks (embeddings ~3/4 of the
# weights, as in small GPTs); llama-mini widened to 768 with Llama 2's vocabulary (untied embedding and head)
MODELS = {
    "gpt2 (2 blocks)": lambda: (GPT2, GPT2Config.from_name("gpt2", n_layer=2, dropout=0.0)),
    "llama (768 wide, 2 blocks)": lambda: (Llama, LlamaConfig.from_name(
        "llama-mini", n_layer=2, n_embd=768, intermediate_size=2048, vocab_size=32000)),
}
CASES = [("gpt2 (2 blocks)", "metp", 2, 2), ("gpt2 (2 blocks)", "metp", 2, 4), ("gpt2 (2 blocks)", "2d", 4, 2),
         ("llama (768 wide, 2 blocks)", "metp", 2, 4)]
# the depth search: gpt2-mini's vocabulary at width 384, on a ring of 2 x dp 4 (8 ranks)
DEPTH_WIDTH = dict(n_embd=384, n_head=6, vocab_size=257, block_size=64, dropout=0.0)
# c10d ops whose payload is their second argument (outputs come first); every other one's is the first
_OUTPUT_FIRST = ("allgather", "reduce_scatter", "alltoall", "gather", "scatter")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _tensor_bytes(tensors) -> int:
    return sum(_local(t).numel() * t.element_size() for t in tensors if t is not None)


class _CollectiveBytes(TorchDispatchMode):
    """Calls and payload bytes of every collective op dispatched inside the mode (``c10d`` and functional ops):
    FSDP's and the package's alike. Receives (``recv_``) carry no payload of this rank's."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace = func.namespace
        if namespace in ("c10d", "_c10d_functional", "c10d_functional") and not func.__name__.startswith("recv"):
            name = func.__name__
            payload = args[1] if namespace == "c10d" and name.lstrip("_").startswith(_OUTPUT_FIRST) else args[0]
            self.calls += 1
            self.bytes += _tensor_bytes(tensors_in(payload))
        return func(*args, **(kwargs or {}))


def _adamw(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=1e-4, foreach=True)


def _build(model_class, cfg, mesh, layout: str, stage: int):
    with torch.device("meta"):
        model = model_class(cfg)
    torch.manual_seed(0)
    tp.parallelize(model, mesh, layout)  # materialised shard by shard from the seed: the same for every stage
    if stage >= 2:
        fsdp.shard_data_parallel(model, stage)  # before the optimizer: it sees the dp-sharded parameters
    optimizer = _adamw(model)
    if stage == 1:
        shard_optimizer_state(optimizer, mesh)
    return model, optimizer, (training.GradientSync(model, mesh) if stage < 2 else None)


def _step(model, optimizer, sync, mesh, idx) -> int:
    """One training step; returns the gradient bytes this rank holds when the optimizer steps."""
    optimizer.zero_grad(set_to_none=True)
    model(idx, idx).backward()
    if sync is not None:
        sync.finish()
        training.clip_grad_norm_([q for g in full_param_groups(optimizer) for q in g], 1.0, mesh)
    else:
        fsdp.clip_grad_norm_(model.parameters(), 1.0, mesh)  # dp shards of the gradients included
    grads = _tensor_bytes(p.grad for p in model.parameters())
    optimizer.step()
    return grads


def _measure(model, optimizer, sync, mesh, idx) -> dict:
    _step(model, optimizer, sync, mesh, idx)  # warm-up: optimizer state and FSDP's lazy init exist after it
    optimizer.zero_grad(set_to_none=True)
    before = resident_bytes(model, optimizer)
    tracker, wire = LiveTensorBytes(record_shapes=False, count_resizes=True), _CollectiveBytes()
    with count_comm() as package, tracker, wire:
        grads = _step(model, optimizer, sync, mesh, idx)
    return {"parameter_bytes": _tensor_bytes(model.parameters()), "gradient_bytes": grads,
            "optimizer_bytes": optimizer_state_bytes(optimizer), "peak_bytes": before + tracker.peak,
            "sent_bytes_package": sum(v["bytes"] for k, v in package.snapshot().items() if k != "recv"),
            "sent_bytes_all": wire.bytes, "collectives_all": wire.calls}


def _stage0_locals(model) -> dict[str, torch.Tensor]:
    with fsdp.gathered(model):  # at stage 2/3 the parameters as at stage 0 (tensor shards, gathered over dp)
        return {n: _local(p.detach()).clone() for n, p in model.named_parameters()}


def _stages_worker(rank: int, world_size: int, model_name: str, layout: str, p: int, batch: int, seq: int) -> dict:
    model_class, cfg = MODELS[model_name]()
    mesh = tp.init_mesh(layout, p, world_size // p)
    torch.manual_seed(1 + mesh.get_local_rank("data_parallel"))
    idx = torch.randint(0, cfg.vocab_size, (batch, seq))
    out, reference = {}, None
    for stage in STAGES:
        model, optimizer, sync = _build(model_class, cfg, mesh, layout, stage)
        out[stage] = _measure(model, optimizer, sync, mesh, idx)
        weights = _stage0_locals(model)
        reference = reference or weights
        out[stage]["max_param_diff"] = max((weights[n] - w).abs().max().item() for n, w in reference.items())
        del model, optimizer, sync, weights
    return out


def _depth_worker(rank: int, world_size: int, cap: int, p: int, batch: int, seq: int) -> tuple[dict, dict]:
    """The depth search (:func:`deepest`) run by every rank in step: each probe builds the model at one depth and
    stage, measures the step and takes the largest rank's peak (an all-reduce), so every rank decides alike."""
    mesh = tp.init_mesh("metp", p, world_size // p)
    torch.manual_seed(1 + mesh.get_local_rank("data_parallel"))
    idx = torch.randint(0, DEPTH_WIDTH["vocab_size"], (batch, seq))
    peaks: dict[tuple[int, int], int] = {}

    def fits(n_layer: int, stage: int) -> bool:
        if (n_layer, stage) not in peaks:
            cfg = GPT2Config.from_name("gpt2-mini", n_layer=n_layer, **DEPTH_WIDTH)
            model, optimizer, sync = _build(GPT2, cfg, mesh, "metp", stage)
            peak = torch.tensor([_measure(model, optimizer, sync, mesh, idx)["peak_bytes"]], dtype=torch.float64)
            del model, optimizer, sync
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            peaks[(n_layer, stage)] = int(peak.item())
            if rank == 0:
                print(f"  n_layer={n_layer} stage {stage}: {peak.item() / MIB:.1f} MiB", flush=True)
        return peaks[(n_layer, stage)] <= cap

    deepest_ = {}
    for stage in STAGES:
        n = deepest_.get(stage - 1, 1)  # start where the stage before stopped
        if fits(n, stage):
            low, high = n, 2 * n
            while fits(high, stage):  # double until a depth does not fit ...
                low, high = high, 2 * high
        else:
            low, high = n // 2, n
            while low and not fits(low, stage):  # ... or halve until one does
                low, high = low // 2, low
        if low == 0:
            raise ValueError(f"stage {stage}: 1 block already passes the cap of {cap / MIB:.0f} MiB")
        while high - low > 1:  # then bisect between the two
            mid = (low + high) // 2
            low, high = (mid, high) if fits(mid, stage) else (low, mid)
        deepest_[stage] = low
    return deepest_, {f"{n}/{s}": b for (n, s), b in peaks.items()}


def stage_rows(batch: int, seq: int) -> list[dict]:
    rows = []
    for model_name, layout, p, dp in CASES:
        started = time.perf_counter()
        result = run_ranks(_stages_worker, p * dp, model_name, layout, p, batch, seq, timeout=1200)
        if not result.ok:
            raise SystemExit(f"{model_name} {layout} p={p} dp={dp}: {result.status}: {result.reason}")
        for stage in STAGES:
            values = [v[stage] for v in result.values]
            row = {"model": model_name, "layout": layout, "p": p, "dp": dp, "stage": stage}
            row.update({key: max(v[key] for v in values) for key in values[0]})
            rows.append(row)
            print(json.dumps(row), flush=True)
        print(f"  ({time.perf_counter() - started:.0f} s)", flush=True)
    return rows


def deepest(cap: int, p: int, dp: int, batch: int, seq: int) -> tuple[dict, dict]:
    """For each stage the deepest n_layer whose step peaks under ``cap`` on every rank (from the previous stage's
    depth: doubling or halving, then bisection); returns it and every probe's largest-rank peak by depth, stage."""
    result = run_ranks(_depth_worker, p * dp, cap, p, batch, seq, timeout=3000)
    if not result.ok:
        raise SystemExit(f"depth search: {result.status}: {result.reason}")
    deepest_, peaks = result.values[0]
    probes: dict[int, dict[int, int]] = {}
    for key, peak in peaks.items():
        n, s = key.split("/")
        probes.setdefault(int(n), {})[int(s)] = peak
    return deepest_, probes


def _tp2d_train(args: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                       os.environ.get("PYTHONPATH", "")]))
    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "lightning_tp2d.train", *args], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=1200)
    if run.returncode != 0:
        raise SystemExit(f"tp2d-train {' '.join(args)} failed:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}")
    return run, time.perf_counter() - started


def train_and_resume() -> dict:
    """``tp2d-train`` at ZeRO stage 3 on 8 CPU processes (the quick recipe: gpt2-tiny, 30 steps, checkpoints at 15
    and 30), then resumed from its ``last.ckpt`` to step 40 in the same run directory."""
    first = ["experiment=quick", "parallel.zero_stage=3", "trainer.devices=8", "sample.max_new_tokens=0"]
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        _, first_s = _tp2d_train(first, cwd)
        (run_dir,) = cwd.glob("outputs/*/*")
        shards = sorted(p.name for p in (run_dir / "checkpoints" / "step=30.ckpt").glob("*.distcp"))
        resumed = first[:-1] + ["trainer.max_steps=40", f"ckpt_path={run_dir}/checkpoints/last.ckpt"]
        _, resume_s = _tp2d_train(resumed, cwd)
        with open(run_dir / "logs" / "metrics.csv", newline="") as f:
            rows = [r for r in csv.DictReader(f) if r.get("train_loss")]
        log = (run_dir / "train.log").read_text()
        return {"commands": ["tp2d-train " + " ".join(first), "tp2d-train " + " ".join(resumed[:-1]) +
                             " ckpt_path=<run dir>/checkpoints/last.ckpt"],
                "summary": next(line for line in log.splitlines() if "replica(s)" in line).split(" - ", 1)[-1],
                "seconds": [round(first_s), round(resume_s)], "checkpoint_shards": len(shards),
                "run_dirs": len(list(cwd.glob("outputs/*/*"))),
                "steps_logged": [int(r["step"]) + 1 for r in rows][-3:],
                "train_loss_first": float(rows[0]["train_loss"]),
                "train_loss_at_30": next(float(r["train_loss"]) for r in rows if int(r["step"]) == 29),
                "train_loss_last": float(rows[-1]["train_loss"]),
                "last_checkpoint": os.readlink(run_dir / "checkpoints" / "last.ckpt"),
                "resumed_in_run_dir": "resuming from" in log and "in its run directory" in log}


def _mib(n: int) -> str:
    return f"{n / MIB:.1f}"


def write_markdown(out: Path, meta: dict, rows: list[dict], depth: dict, train: dict | None) -> str:
    fsdp_rows = [r for r in rows if r["stage"] >= 2]
    agree = ("the two agree on every row: count_comm records FSDP's collectives too"
             if all(r["sent_bytes_package"] == r["sent_bytes_all"] for r in rows) else
             "at stages 2-3 all minus count_comm is FSDP's, which count_comm does not record"
             if all(r["sent_bytes_package"] == r["sent_bytes_all"] for r in rows if r["stage"] < 2) and
             all(r["sent_bytes_package"] < r["sent_bytes_all"] for r in fsdp_rows) else
             "they differ where the table shows")
    lines = ["# ZeRO stages 0-3 per rank", "",
             f"Measured by `{meta['command']}` ({meta['seconds'] / 60:.0f} min) on {meta['machine']}, torch "
             f"{meta['torch']}, gloo, "
             f"{meta['threads']} thread per rank; batch {meta['batch']} x {meta['seq']} tokens per replica, AdamW "
             "(float32 state). Every number is the largest rank's. Stage 0: replicated; 1: optimizer state sharded "
             "(`zero.shard_optimizer_state`); 2: gradients too, 3: parameters too (FSDP2 over data_parallel).", "",
             "Gradients are those held when the optimizer steps. Peak: parameters and optimizer state before the "
             "step plus the peak of the tensors the step allocates (FSDP's gathered parameters included). Sent: "
             "payload bytes of one step (the tensor handed to each call, receives left out, as "
             "`lightning_tp2d.comm` counts); *count_comm* is `lightning_tp2d.comm_record.count_comm`, *all* every "
             f"c10d collective a dispatch mode sees, FSDP's all-gathers and reduce-scatters included; {agree}. Max "
             "diff: parameters after two steps against stage 0's.", "",
             "| model | layout | p | dp | stage | params MiB | grads MiB | optimizer MiB | peak MiB | "
             "sent MiB, count_comm | sent MiB, all | max diff |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['layout']} | {r['p']} | {r['dp']} | {r['stage']} | "
                     f"{_mib(r['parameter_bytes'])} | {_mib(r['gradient_bytes'])} | {_mib(r['optimizer_bytes'])} | "
                     f"{_mib(r['peak_bytes'])} | {_mib(r['sent_bytes_package'])} | {_mib(r['sent_bytes_all'])} | "
                     f"{r['max_param_diff']:.1e} |")
    lines += ["", f"## Deepest model under {meta['cap_mib']} MiB per rank", "",
              f"GPT-2 blocks at width {DEPTH_WIDTH['n_embd']} ({DEPTH_WIDTH['n_head']} heads, vocabulary "
              f"{DEPTH_WIDTH['vocab_size']}), layout metp, ring of {meta['depth_p']} x dp {meta['depth_dp']} = "
              f"{meta['depth_p'] * meta['depth_dp']} ranks, the same step as above; each stage's search starts at "
              "the depth where the stage before stopped (doubling or halving, then bisection on n_layer). A depth "
              "fits when every rank's peak stays under the cap.", "",
              "| stage | deepest n_layer | its peak MiB | peak MiB one block deeper |", "| --- | --- | --- | --- |"]
    probes = depth["probes"]
    for s in STAGES:
        n = depth["deepest"][str(s)]
        lines.append(f"| {s} | {n} | {_mib(probes[str(n)][str(s)])} | {_mib(probes[str(n + 1)][str(s)])} |")
    lines += ["", "## Summary", "", *summary(rows, depth)]
    if train:
        lines += ["", "## tp2d-train at stage 3 on 8 processes, as a new user", "",
                  "```", *train["commands"], "```", "",
                  f"{train['summary']}. The first run ({train['seconds'][0]} s) trained 30 steps, train_loss "
                  f"{train['train_loss_first']:.3f} -> {train['train_loss_at_30']:.3f}, and wrote sharded checkpoints "
                  f"({train['checkpoint_shards']} `.distcp` files in `step=30.ckpt`). The second "
                  f"({train['seconds'][1]} s) resumed from `last.ckpt` in the same run directory "
                  f"({'said so in train.log' if train['resumed_in_run_dir'] else 'train.log did not say so'}; "
                  f"{train['run_dirs']} run directory in all) and trained steps 31-40 (logged steps "
                  f"{train['steps_logged']}, train_loss {train['train_loss_last']:.3f} at step 40; last.ckpt -> "
                  f"{train['last_checkpoint']}). `tests/test_train.py` checks that a resumed stage-3 run's losses "
                  "equal the uninterrupted run's (ring of 2 x dp 2)."]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    return "\n".join(lines)


def summary(rows: list[dict], depth: dict) -> list[str]:
    """Plain words from the numbers: the per-rank bytes of stage 3 against stage 0, the wire, the depths."""
    lines = []
    by = {(r["model"], r["layout"], r["dp"], r["stage"]): r for r in rows}
    for model, layout, _, dp in CASES:
        s0, s1, s2, s3 = (by[(model, layout, dp, s)] for s in STAGES)
        held = lambda r: r["parameter_bytes"] + r["gradient_bytes"] + r["optimizer_bytes"]  # noqa: E731
        lines.append(f"* {model}, {layout}, dp {dp}: parameters + gradients + optimizer state per rank "
                     f"{_mib(held(s0))} MiB at stage 0, {held(s1) / held(s0):.2f}x at stage 1, "
                     f"{held(s2) / held(s0):.2f}x at 2, {held(s3) / held(s0):.2f}x at 3 (ideal at 3: {1 / dp:.2f}x); "
                     f"peak {s3['peak_bytes'] / s0['peak_bytes']:.2f}x of stage 0's at stage 3, "
                     f"{s2['peak_bytes'] / s0['peak_bytes']:.2f}x at 2; sent per step "
                     f"{s3['sent_bytes_all'] / max(1, s0['sent_bytes_all']):.2f}x at stage 3.")
    lines.append("* Peaks fall less than the held bytes: the step's own tensors (gradients as they are made, "
                 "activations, METP's weight blocks in flight, AdamW's foreach temporaries) are not sharded over "
                 "data_parallel, and FSDP gathers each block's tensor shard whole (stage 2: every block, from its "
                 "forward to its backward; stage 3: one or two at a time) and keeps the root group (embeddings, "
                 "head: three quarters or more of these models' weights) gathered from the forward to the backward.")
    deepest_ = depth["deepest"]
    lines.append(f"* Under the cap, ring 2 x dp {depth['dp']}: " + ", ".join(
        f"stage {s} trains {deepest_[str(s)]} blocks" for s in STAGES) + ".")
    return lines


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=2, help="sequences per replica")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--cap-mib", type=int, default=64, help="per-rank cap of the depth search")
    ap.add_argument("--skip-train", action="store_true", help="skip the tp2d-train stage-3 run and resume")
    ap.add_argument("--out", default="recipes/benchmarks/zero")
    args = ap.parse_args()
    started = time.perf_counter()
    rows = stage_rows(args.batch, args.seq)
    depth_p, depth_dp = 2, 4
    deepest_, probes = deepest(args.cap_mib * MIB, depth_p, depth_dp, args.batch, args.seq)
    depth = {"p": depth_p, "dp": depth_dp, "deepest": {str(s): n for s, n in deepest_.items()},
             "probes": {str(n): {str(s): b for s, b in v.items()} for n, v in sorted(probes.items())}}
    train = None if args.skip_train else train_and_resume()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python recipes/benchmarks/zero_stages.py" + (" --skip-train" if args.skip_train else ""),
            "machine": f"{_cpu_name()}, {os.cpu_count()} cores", "torch": torch.__version__,
            "threads": int(os.environ.get("TP2D_BENCH_THREADS", "1")), "batch": args.batch, "seq": args.seq,
            "cap_mib": args.cap_mib, "depth_p": depth_p, "depth_dp": depth_dp,
            "seconds": round(time.perf_counter() - started)}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows, "depth": depth, "tp2d_train": train},
                                                 indent=2) + "\n")
    print(write_markdown(out, meta, rows, depth, train))


if __name__ == "__main__":
    main()
