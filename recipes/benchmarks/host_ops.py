"""Recount the planner's host-op table: the aten ops one rank dispatches for a micro-batch's forward (with the loss)
and backward, for every layout and rival, with one block and with two (``lightning_tp2d/planning/host_ops.json``,
``ops.counts``; how the planner uses them: :mod:`lightning_tp2d.planning.host_cost`).

    python recipes/benchmarks/host_ops.py [--only metp,2d-metp] [--check]
    python recipes/benchmarks/host_ops.py --rates [--repeats 3]
    python recipes/benchmarks/host_ops.py --bytes [--check]

A change to the layers' ops must come with a recount (``tests/test_host_cost.py`` recounts one entry and fails
otherwise). Each entry runs :func:`lightning_tp2d.bench.layer_cost.rank_phase_ops` on CPU processes (gloo) under
bf16 autocast, B12 x 96 tokens, and keeps the largest rank's count:

* the layouts and the plain model with 12 heads (Llama: 12 key/value heads), at grids of side 2, 3 and 4 (4, 9 and 16
  ranks) and rings of 2, 4 and 8;
* the rivals with 4 heads (Llama: 8 and 4 key/value heads), which torch's 1-D TP over 4 ranks needs: its 1-D TP + SP
  on 4 ranks, its context parallelism (a ring) on rings of 2, 4 and 8.

``--only`` recounts the named sides and keeps the rest of the table; ``--check`` writes nothing and exits 1 when a
count differs. The seconds per op (``seconds_per_op``, from a GPU run) are not touched. Counts are torch 2.13.0's
(its decompositions decide them); the script refuses another torch.

``--rates`` measures instead what an op costs the host on each side, against the plain model (``cpu_rates``): one
micro-batch's forward and backward, eager and compiled (inductor), timed by the thread's CPU seconds
(:func:`lightning_tp2d.bench.layer_cost.fake_rank_host_seconds`: rank 0 alone on torch's fake process group, so no
rank waits for another or shares its core), at one rank (the plain model and the layouts) and at four (a 2x2 grid, a
ring of 4, the rivals), B2 x 32 tokens in float32 (torch's context parallelism runs nothing else here), 4 heads
(Llama: 8 and 4), 2 blocks. Every side is built in one process and timed in alternating rounds; ``--repeats`` fresh
processes, and each ratio is the median of theirs. Per side, with ``t`` seconds per micro-batch and ``n`` the eager
micro-batch's ops: ``eager = (t / n) / (t_plain / n_plain)`` (the plain model of the same process, same shape);
``compiled = max(0, t_compiled - t_plain_compiled) / n / (t_plain / n_plain)``: what a compiled micro-batch costs the
host beyond the compiled plain model's, per eager op, in the plain model's eager ops. Torch's context parallelism
is not compiled by the harness, and torch's Llama 1-D TP + SP fails to compile in torch 2.13 (:data:`NOT_COMPILED`):
their compiled entries are left out (the planner prices them at none, the figure most favourable to them).

``--bytes`` counts the memory-bound bytes (:class:`~lightning_tp2d.bench.layer_cost.OpCounter`: not views,
allocations, GEMMs, attention kernels or collectives) of one micro-batch's forward and backward of rank 0 on
torch's fake process group, at one and two blocks and at 192 and 384 tokens (one sequence, a grid of side ``q``
``q``, :func:`bytes_batch`; float32; width 768 and 12 heads, :data:`BYTES_SHAPES`), for the plain model, for each
layout and torch's context parallelism at the axis sizes the ops are counted at, and for torch's 1-D TP + SP on 4
ranks. A block's
bytes per token (the slope over the two lengths; what does not grow with the tokens is the weights' traffic, left
out) is set beside the bytes per token of a block that the side's own elementwise model in the planner prices
(the traced layouts' saved activations; the rivals' :func:`~lightning_tp2d.planning.rival_models.elementwise_bytes`,
with float32 residuals, as measured). ``memory_bound`` keeps, per family, side and axis size, the measured /
modelled quotient over the plain model's (``ratio``: the factor the planner multiplies that side's elementwise bytes
by) and the measured bytes per token of a rank's block times its ranks over the plain model's (``x_plain``: 1.0
would be a side that moves the plain model's bytes over its ranks, no more). Counts are exact; ``--check`` recounts
and exits 1 on a change.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from lightning_tp2d.bench.layer_cost import fake_rank_host_seconds, fake_rank_phase_ops, rank_phase_ops
from lightning_tp2d.bench.procs import run_ranks
from lightning_tp2d.bench.runner import BenchSpec
from lightning_tp2d.layouts import get_layout, layout_names

TABLE = Path(__file__).resolve().parents[2] / "lightning_tp2d" / "planning" / "host_ops.json"
MODELS = {"gpt2": "gpt2-tiny", "llama": "llama-tiny"}
HEADS = {"gpt2": {"n_head": 12}, "llama": {"n_head": 12, "n_kv_head": 12}}
RIVAL_HEADS = {"gpt2": {"n_head": 4}, "llama": {"n_head": 8, "n_kv_head": 4}}
# side -> (axis sizes counted, ranks at each size): a grid's side q runs on q*q ranks, a ring of p on p
# (torch's context parallelism is a ring too: its merges and K|V gradient sums per ring step grow with its length, as
# METP's do, so it is counted at the rings' lengths; torch's 1-D TP + SP at 4, the ranks its 4 heads allow)
SIDES = {"single": ((1,), lambda k: 1), "2d": ((2, 3, 4), lambda q: q * q), "metp": ((2, 4, 8), lambda p: p),
         "2d-metp": ((2, 3, 4), lambda q: q * q), "tp1d-sp": ((4,), lambda k: 4), "cp": ((2, 4, 8), lambda p: p)}
FAMILIES_OF = {"cp": ("llama",)}  # torch's context parallelism baseline runs Llama only


def count(family: str, side: str, size: int) -> list[list[int]]:
    """``[[forward, backward] with one block, [forward, backward] with two]`` at axis size ``size``."""
    heads = RIVAL_HEADS[family] if side in ("tp1d-sp", "cp") else HEADS[family]
    ranks = SIDES[side][1](size)
    out = []
    for n_layer in (1, 2):
        spec = BenchSpec(model=MODELS[family], overrides={"n_layer": n_layer, "dropout": 0.0, **heads}, batch=12,
                         seq=96, dtype="bfloat16")
        result = run_ranks(rank_phase_ops, ranks, side, spec, timeout=900, tracebacks=True)
        if not result.ok:
            raise SystemExit(f"{family} {side} at {size} ({ranks} ranks): {result.reason}")
        worst = max(result.values, key=lambda c: c["forward"] + c["backward"])
        out.append([worst["forward"], worst["backward"]])
    return out


# --rates: sides timed at each world size (the layouts' one-rank form; a 2x2 grid, a ring of 4 and the rivals at 4)
RATE_SIDES = {1: ("single", "2d", "metp", "2d-metp"), 4: ("single", "2d", "metp", "2d-metp", "tp1d-sp", "cp")}
# sides whose compiled step is not measured: torch's context parallelism (the harness does not compile it) and
# torch's 1-D TP + SP of Llama (its blocks compiled fail in torch 2.13: "'Tensor' object has no attribute
# '_local_tensor'" in DTensor's redistribute backward)
NOT_COMPILED = {"gpt2": ("cp",), "llama": ("cp", "tp1d-sp")}


# --bytes: the shapes counted (GPT-2 small's width and heads, head dim 64; Llama with as many key/value heads, so that
# every grid side and ring length divides them), the lengths whose difference gives bytes per token
BYTES_SHAPES = {"gpt2": {"n_embd": 768, "n_head": 12, "vocab_size": 512, "block_size": 384},
                "llama": {"n_embd": 768, "n_head": 12, "n_kv_head": 12, "intermediate_size": 2064, "vocab_size": 512,
                          "block_size": 384}}
BYTES_TOKENS = (192, 384)  # (divisible by every zigzag: 2q for q = 2, 3, 4 and 2p for p = 8)
# the sides and axis sizes counted: the ops table's (SIDES)
BYTES_SIDES = ("2d", "metp", "2d-metp", "tp1d-sp", "cp")


def bytes_batch(side: str, size: int) -> int:
    """Sequences per counted micro-batch: one (torch's sequence-parallel all-gathers along the sequence are views
    then, funcol's ``_maybe_view_chunk_cat``, and copies with more: the figure most favourable to the 1-D baseline,
    whose reduce-scatters still copy their chunks into one buffer, in torch's ``reduce_scatter_single``, at any
    batch); a grid (a square layout) takes ``q``, as "2d" splits the batch over its ``q`` rows (and "2d-metp" is
    counted alike)."""
    return size if side in layout_names() and get_layout(side).square else 1


def block_bytes_per_token(family: str, side: str, size: int) -> tuple[float, float]:
    """``(measured, modelled)`` memory-bound bytes per token of one block of ``side`` on rank 0 at axis size ``size``
    (a grid's side, a ring's length; the rivals' ranks)."""
    import dataclasses

    from lightning_tp2d.families import model_config
    from lightning_tp2d.planning.rival_models import ELEMENT, elementwise_bytes
    from lightning_tp2d.planning.trace import trace_step

    measured, modelled = {}, {}
    for seq in BYTES_TOKENS:
        for n_layer in (1, 2):
            b, world = bytes_batch(side, size), SIDES.get(side, SIDES["tp1d-sp"])[1](size)
            spec = BenchSpec(model=MODELS[family], overrides={"n_layer": n_layer, "dropout": 0.0,
                                                              **BYTES_SHAPES[family]},
                             batch=b, seq=seq, dtype="float32")
            c = fake_rank_phase_ops(world, side, spec)
            measured[seq, n_layer] = c["forward_bytes"] + c["backward_bytes"]
            cfg = dataclasses.replace(model_config(MODELS[family]), n_layer=n_layer, dropout=0.0,
                                      **BYTES_SHAPES[family])
            if side == "single":  # the rivals' elementwise models, float32 residuals as measured
                modelled[seq, n_layer] = elementwise_bytes(cfg, b, seq, 1, ep=4)
            elif side == "tp1d-sp":
                modelled[seq, n_layer] = elementwise_bytes(cfg, b, seq, world, ep=4)
            elif side == "cp":
                modelled[seq, n_layer] = elementwise_bytes(cfg, b, seq // world, 1, ep=4)
            else:  # a layout: its traced saved activations, as the planner prices it
                modelled[seq, n_layer] = trace_step(side, cfg, b, seq, world, ELEMENT, 0).activation_bytes
    tokens = bytes_batch(side, size) * (BYTES_TOKENS[1] - BYTES_TOKENS[0])

    def per_token(table):
        block = {seq: table[seq, 2] - table[seq, 1] for seq in BYTES_TOKENS}
        return (block[BYTES_TOKENS[1]] - block[BYTES_TOKENS[0]]) / tokens

    return per_token(measured), per_token(modelled)


def measure_bytes() -> dict:
    """The ``memory_bound`` section (module docstring): per family, side and axis size."""
    out = {}
    for family in MODELS:
        plain_measured, plain_modelled = block_bytes_per_token(family, "single", 1)
        table = out.setdefault(family, {})
        for side in BYTES_SIDES:
            if family not in FAMILIES_OF.get(side, MODELS):
                continue
            for size in SIDES[side][0]:
                world = SIDES[side][1](size)
                measured, modelled = block_bytes_per_token(family, side, size)
                table.setdefault(side, {})[str(size)] = {
                    "ratio": round((measured / modelled) / (plain_measured / plain_modelled), 3),
                    "x_plain": round(measured * world / plain_measured, 3),
                    "measured_per_token": measured, "modelled_per_token": modelled}
                print(f"{family} {side} {size}: {table[side][str(size)]}", flush=True)
        table["single"] = {"1": {"ratio": 1.0, "x_plain": 1.0, "measured_per_token": plain_measured,
                                 "modelled_per_token": plain_modelled}}
    return out


def one_repeat(family: str, world: int) -> dict:
    """One fresh process's ``{side: {"ops", "seconds"}, side + ":compiled": ...}`` at ``world`` ranks."""
    sides = tuple(s for s in RATE_SIDES[world] if family in FAMILIES_OF.get(s, MODELS))
    spec = BenchSpec(model=MODELS[family], overrides={"n_layer": 2, "dropout": 0.0, **RIVAL_HEADS[family]}, batch=2,
                     seq=32, dtype="float32")
    compiled = tuple(s for s in sides if s not in NOT_COMPILED[family])
    return fake_rank_host_seconds(world, sides, spec, rounds=12, steps=2, compiled=compiled)


def ratios(run: dict) -> dict:
    """``{"eager": {side: x}, "compiled": {side: x}}`` of one repeat (module docstring)."""
    plain, plain_compiled = run["single"], run["single:compiled"]
    unit = plain["seconds"] / plain["ops"]
    out = {"eager": {}, "compiled": {}}
    for key, r in run.items():
        side, _, mode = key.partition(":")
        if mode:
            out["compiled"][side] = max(0.0, r["seconds"] - plain_compiled["seconds"]) / r["ops"] / unit
        else:
            out["eager"][side] = r["seconds"] / r["ops"] / unit
    return out


def measure_rates(repeats: int) -> dict:
    """The ``cpu_rates`` section: the median ratios over ``repeats`` fresh processes, and every repeat's raw times."""
    import concurrent.futures
    import multiprocessing
    import statistics

    out = {"eager": {}, "compiled": {}, "raw": {}}
    for family in MODELS:
        for world in RATE_SIDES:
            runs = []
            for i in range(repeats):
                with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
                    runs.append(ex.submit(one_repeat, family, world).result())
                print(f"{family} at {world}: repeat {i + 1}: " + ", ".join(
                    f"{k} {v['seconds'] * 1e3:.2f} ms / {v['ops']}" for k, v in runs[-1].items()), flush=True)
            each = [ratios(r) for r in runs]
            for mode in ("eager", "compiled"):
                out[mode].setdefault(family, {})[str(world)] = {
                    side: round(statistics.median(e[mode][side] for e in each), 3) for side in each[0][mode]}
            out["raw"].setdefault(family, {})[str(world)] = runs
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(SIDES), help="comma-separated sides to recount")
    parser.add_argument("--check", action="store_true", help="compare with the table, write nothing")
    parser.add_argument("--rates", action="store_true", help="measure the host seconds per op instead (cpu_rates)")
    parser.add_argument("--repeats", type=int, default=3, help="--rates: fresh processes per measurement")
    parser.add_argument("--bytes", action="store_true", help="count the memory-bound bytes instead (memory_bound)")
    args = parser.parse_args()
    if not torch.__version__.startswith("2.13."):
        print(f"the table counts torch 2.13.0's ops; this is torch {torch.__version__}", file=sys.stderr)
        return 2
    if args.bytes:
        data = json.loads(TABLE.read_text())
        counted = measure_bytes()
        if args.check:
            old = data.get("memory_bound", {}).get("families")
            same = old == json.loads(json.dumps(counted))
            print("every count as in the table" if same else "the counts differ from the table")
            return 0 if same else 1
        data["memory_bound"] = {
            "source": (f"recipes/benchmarks/host_ops.py --bytes: lightning_tp2d.bench.layer_cost.fake_rank_phase_ops "
                       f"on CPU, torch {torch.__version__.split('+')[0]}, {time.strftime('%Y-%m-%d')}, float32, "
                       f"B1 (a grid of side q: Bq) x {BYTES_TOKENS[0]} and {BYTES_TOKENS[1]} tokens, 1 and 2 blocks, "
                       "width 768, 12 heads"),
            "shape": "family -> side -> axis size -> ratio (measured / modelled over the plain model's), x_plain "
                     "(measured x ranks over the plain model's), bytes per token",
            "families": counted}
        TABLE.write_text(json.dumps(data, indent=1) + "\n")
        return 0
    if args.rates:
        data = json.loads(TABLE.read_text())
        rates = measure_rates(args.repeats)
        data["cpu_rates"] = {
            "source": (f"recipes/benchmarks/host_ops.py --rates: lightning_tp2d.bench.layer_cost."
                       f"fake_rank_host_seconds on CPU, torch {torch.__version__.split('+')[0]}, "
                       f"{time.strftime('%Y-%m-%d')}, "
                       f"{platform.machine()}, {torch.get_num_threads()} threads, float32, B2 x 32 tokens, 2 blocks, "
                       f"4 heads (Llama: 8 and 4), median of {args.repeats} processes"),
            "shape": "mode -> family -> world size -> side -> host seconds per op over the plain model's eager ones",
            **rates}
        TABLE.write_text(json.dumps(data, indent=1) + "\n")
        for mode in ("eager", "compiled"):
            print(mode, json.dumps(rates[mode]))
        return 0
    sides = args.only.split(",")
    unknown = sorted(set(sides) - set(SIDES))
    if unknown:
        print(f"--only: unknown sides {unknown}; known: {sorted(SIDES)}", file=sys.stderr)
        return 2
    data = json.loads(TABLE.read_text())
    counts = data["ops"]["counts"]
    differ = []
    start = time.time()
    for family in MODELS:
        for side in sides:
            if family not in FAMILIES_OF.get(side, MODELS):
                continue
            for size in SIDES[side][0]:
                new = count(family, side, size)
                old = counts.get(family, {}).get(side, {}).get(str(size))
                if new != old:
                    differ.append(f"{family} {side} {size}: {old} -> {new}")
                counts.setdefault(family, {}).setdefault(side, {})[str(size)] = new
                print(f"{family:6s} {side:8s} {size}: {new}  ({time.time() - start:.0f} s)", flush=True)
    print("\n".join(differ) or "every count as in the table")
    if args.check:
        return 1 if differ else 0
    data["ops"]["source"] = (f"recipes/benchmarks/host_ops.py: lightning_tp2d.bench.layer_cost.rank_phase_ops on CPU, "
                             f"torch {torch.__version__.split('+')[0]}, {time.strftime('%Y-%m-%d')}, bf16 autocast, "
                             "B12 x 96 tokens, 12 heads (Llama: 12 key/value heads); the rivals with 4 heads (Llama: "
                             "8 and 4): 1-D TP + SP on 4 ranks, CP on rings of 2, 4 and 8; the largest rank's count")
    TABLE.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
