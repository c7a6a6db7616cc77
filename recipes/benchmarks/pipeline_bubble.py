"""The pipeline schedules' bubble on CPU processes (gloo), measured against the cost model's prediction.

    python recipes/benchmarks/pipeline_bubble.py [--quick] [--pp 2 4] [--modes timed real] [--out DIR]

For pp 2 and 4 (one rank per stage, ``tp.init_mesh("2d", 1, 1, pipeline_parallel_size=pp)``), every schedule of
:class:`lightning_tp2d.pipeline.Pipeline`: GPipe and 1F1B with ``m = pp, 2 pp, 4 pp`` micro-batches, interleaved
1F1B with ``v = 2`` virtual stages and ``m = pp, 2 pp``; a GPT-2 of 8 blocks (gpt2-tiny's width), ``pp x v`` stages
of equal blocks, one thread per rank. Per rank and step (after warm-up steps, a ``dist.barrier()`` before each):

* ``W``: the wall time of ``Pipeline.step`` (the schedule, then the loss broadcast and the tied embedding's gradient
  all-reduce it adds);
* ``B``, busy: the wall time inside the rank's stage modules, forward and backward: each present block, the final
  norm and the head with its loss (the forward between a pre-hook and a hook; the backward between an autograd
  marker on the module's output, whose backward runs first, and one on its input, whose backward runs last), and
  the embedding lookup's forward (its backward, a scatter into a 257-row table, is not timed);
* measured bubble ``1 - B / W`` (median over the steps), against :func:`~lightning_tp2d.planning.pipeline_cost.
  bubble_fraction` ``= (pp - 1) / (m v + pp - 1)``, which prices equal chunks and no boundary cost.

Two modes:

* ``timed``: every block sleeps ``--block-ms`` after its forward of each micro-batch and twice that in its backward
  (an autograd function), so every chunk takes a known time (``8 / (pp v)`` blocks x 3 x ``block_ms``, the step
  ``m v + pp - 1`` of them) and the ranks, asleep, do not compete for the 2 cores: the schedule's own bubble shows.
  The blocks' real compute (4 pp rows of 16 tokens per step) is small beside the sleep and counted in ``B``.
* ``real``: the blocks' own compute (``--real-batch`` rows of 64 tokens per step, split into the micro-batches).
  At pp 4 four ranks share 2 cores: a chunk that runs while others compute is slowed down, which stretches ``B``
  too; the busy CPU / wall column (thread CPU time inside the modules over their wall time; 1.0 when a rank had a
  core to itself) shows how much.

Besides the bubble, each row fits the per-slot cost that :func:`~lightning_tp2d.planning.pipeline_cost.
pipeline_step_time` calls ``t_boundary``: ``W / (m v + pp - 1) - B / (m v)`` with the slowest rank's ``W`` and the
busiest rank's ``B`` (what a slot holds besides its chunk's work: the point-to-point transfers, torch's schedule
in Python, a busier neighbour).

Writes ``results.md`` (the table, machine, torch, date and command) into ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import lightning_tp2d as tp
from lightning_tp2d.bench.procs import run_ranks
from lightning_tp2d.models import GPT2, GPT2Config
from lightning_tp2d.nn.stage import Elsewhere
from lightning_tp2d.pipeline import Pipeline
from lightning_tp2d.planning.pipeline_cost import bubble_fraction, chunk_slots

OUT = Path(__file__).parent / "pipeline_bubble"
N_LAYER = 8  # pp x v = 8 stages of one block at pp 4, v 2


@dataclass(frozen=True)
class Mode:
    """One way to make a step's work: ``block_ms`` of sleep per block forward of each micro-batch (backward 2x), or
    ``None`` for the blocks' compute alone; ``batch`` rows of ``seq`` tokens per step, split into the micro-batches
    (0: 4 pp rows); ``warmup`` steps untimed, then ``steps`` timed."""

    name: str
    seq: int
    batch: int
    block_ms: float | None
    warmup: int
    steps: int


def modes(quick: bool, block_ms: float, real_batch: int) -> dict[str, Mode]:
    """The two modes; ``quick``: 1 warm-up and 3 timed steps, not 2 and 5, a 3x shorter sleep, a 4x smaller batch."""
    steps, warmup = (3, 1) if quick else (5, 2)
    return {"timed": Mode("timed", 16, 0, block_ms / 3 if quick else block_ms, warmup, steps),
            "real": Mode("real", 64, real_batch // 4 if quick else real_batch, None, warmup, steps)}


def cases(pp: int) -> list[tuple[str, int, int]]:
    """``(schedule, virtual_stages, microbatches)`` of one pipeline size, in the table's order."""
    out = [(schedule, 1, k * pp) for schedule in ("gpipe", "1f1b") for k in (1, 2, 4)]
    return out + [("interleaved_1f1b", 2, k * pp) for k in (1, 2)]


# ---- the busy clock --------------------------------------------------------------------------------------------


class BusyClock:
    """Wall and thread-CPU seconds this rank spends inside the modules it instruments (:meth:`instrument`).
    Forward: from a module's pre-hook to its hook. Backward: the output goes through :class:`_Mark` (``opens``),
    whose backward runs before the module's own, the input through :class:`_Mark` (closes), whose backward runs
    after it; a module whose inputs need no gradient is timed in its forward only."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0
        self._open: list[tuple[float, float]] = []

    def reset(self) -> None:
        self.wall = self.cpu = 0.0
        self._open.clear()

    def start(self) -> None:
        self._open.append((time.perf_counter(), time.thread_time()))

    def stop(self) -> None:
        wall, cpu = self._open.pop()
        self.wall += time.perf_counter() - wall
        self.cpu += time.thread_time() - cpu

    def instrument(self, module: torch.nn.Module, sleep_s: float = 0.0) -> None:
        """Time ``module``; with ``sleep_s`` it also sleeps that long after each forward and twice as long in its
        backward (:class:`_SleepInBackward`), inside the timed spans."""
        timed_backward = [False]  # this call's inputs need a gradient: its backward span can be closed

        def before(mod, args):
            self.start()
            timed_backward[0] = any(_needs_grad(a) for a in args)
            return tuple(_Mark.apply(a, self, False) if _needs_grad(a) else a for a in args)

        def after(mod, args, out):
            if sleep_s:
                time.sleep(sleep_s)
                out = _SleepInBackward.apply(out, 2 * sleep_s)
            self.stop()
            return _Mark.apply(out, self, True) if timed_backward[0] and _needs_grad(out) else out

        module.register_forward_pre_hook(before)
        module.register_forward_hook(after)


def _needs_grad(x) -> bool:
    return isinstance(x, torch.Tensor) and x.requires_grad


class _Mark(torch.autograd.Function):
    """Identity; its backward opens (``opens``) or closes the clock's backward span."""

    @staticmethod
    def forward(ctx, x, clock: BusyClock, opens: bool):
        ctx.clock, ctx.opens = clock, opens
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.opens:
            ctx.clock.start()
        else:
            ctx.clock.stop()
        return grad, None, None


class _SleepInBackward(torch.autograd.Function):
    """Identity; its backward sleeps ``seconds`` (the timed mode's backward of a block)."""

    @staticmethod
    def forward(ctx, x, seconds: float):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


def instrument_stages(model: GPT2, clock: BusyClock, block_sleep_s: float = 0.0) -> None:
    """Put ``clock`` on the stage modules this rank holds (not :class:`Elsewhere`): the embedding tables, the
    blocks (each sleeping ``block_sleep_s`` per forward, twice that per backward), the final norm and the head."""
    tr = model.transformer
    for module in [tr.wte, tr.wpe, tr.ln_f, model.lm_head]:
        if not isinstance(module, Elsewhere):
            clock.instrument(module)
    for block in tr.h:
        if not isinstance(block, Elsewhere):
            clock.instrument(block, block_sleep_s)


# ---- one case on every rank ------------------------------------------------------------------------------------


def measure_case(pp: int, mode: Mode, schedule: str, virtual: int, microbatches: int) -> dict:
    """This rank's medians over ``mode.steps`` steps: ``step_s`` (W), ``busy_s`` (B), ``bubble`` (1 - B/W per
    step), ``cpu_share`` (busy thread CPU / busy wall)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = GPT2Config.from_name("gpt2-tiny", n_layer=N_LAYER, dropout=0.0)
    model = GPT2(cfg)
    mesh = tp.init_mesh("2d", 1, 1, pipeline_parallel_size=pp)
    pipe = Pipeline(model, mesh, "2d", schedule=schedule, microbatches=microbatches, virtual_stages=virtual,
                    seq=mode.seq)
    batch = mode.batch or 4 * pp
    clock = BusyClock()
    instrument_stages(pipe.model, clock, 0.0 if mode.block_ms is None else mode.block_ms / 1e3)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (batch, mode.seq), generator=g)
    walls, busies, bubbles, shares = [], [], [], []
    for step in range(mode.warmup + mode.steps):
        for q in pipe.parameters():
            q.grad = None
        dist.barrier()
        clock.reset()
        start = time.perf_counter()
        pipe.step(idx, idx)
        wall = time.perf_counter() - start
        if step >= mode.warmup:
            walls.append(wall)
            busies.append(clock.wall)
            bubbles.append(1.0 - clock.wall / wall)
            shares.append(clock.cpu / clock.wall)
    dist.barrier()
    return {"step_s": statistics.median(walls), "busy_s": statistics.median(busies),
            "bubble": statistics.median(bubbles), "cpu_share": statistics.median(shares)}


def measure_cases(rank: int, world_size: int, mode: Mode, todo: list[tuple[str, int, int]]) -> list[dict]:
    """:func:`measure_case` of each of ``todo`` on this rank (``world_size`` ranks: pp); run on every rank."""
    return [measure_case(world_size, mode, *case) for case in todo]


def run(pp: int, mode: Mode, todo: list[tuple[str, int, int]]) -> list[dict]:
    """Every case of ``todo`` on ``pp`` fresh gloo ranks: one row per case, with every rank's numbers."""
    result = run_ranks(measure_cases, pp, mode, todo, timeout=900.0)
    if not result.ok:
        raise RuntimeError(f"pp {pp}, {mode.name}: {result.status}: {result.reason}")
    return [summarize(pp, case, [ranks[i] for ranks in result.values]) for i, case in enumerate(todo)]


def summarize(pp: int, case: tuple[str, int, int], per_rank: list[dict]) -> dict:
    """One row: the prediction, the largest and rank 0's measured bubble, the slowest rank's step time, the fitted
    per-slot cost ``W / slots - B / (m v)`` (slowest ``W``, busiest ``B``), the least busy CPU share of the ranks."""
    schedule, virtual, m = case
    step, busy = max(r["step_s"] for r in per_rank), max(r["busy_s"] for r in per_rank)
    slot = step / chunk_slots(pp, m, virtual, schedule) - busy / (m * virtual)
    return {"pp": pp, "schedule": schedule, "v": virtual, "m": m,
            "predicted": bubble_fraction(pp, m, virtual, schedule),
            "bubble_max": max(r["bubble"] for r in per_rank), "bubble_rank0": per_rank[0]["bubble"],
            "step_ms": 1e3 * step, "slot_ms": 1e3 * slot,
            "cpu_share": min(r["cpu_share"] for r in per_rank), "per_rank": per_rank}


# ---- the table -------------------------------------------------------------------------------------------------


def table(rows: dict[str, list[dict]]) -> str:
    """The markdown table: one line per case, the modes side by side."""
    names = list(rows)
    head = ["pp", "schedule", "v", "m", "predicted"]
    for name in names:
        head += [f"{name}: max", f"{name}: rank 0", f"{name}: step ms", f"{name}: slot extra ms"]
    if "real" in names:
        head.append("real: busy CPU / wall")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, first in enumerate(rows[names[0]]):
        cells = [str(first["pp"]), first["schedule"], str(first["v"]), str(first["m"]), f"{first['predicted']:.3f}"]
        for name in names:
            r = rows[name][i]
            cells += [f"{r['bubble_max']:.3f}", f"{r['bubble_rank0']:.3f}", f"{r['step_ms']:.0f}",
                      f"{r['slot_ms']:.1f}"]
        if "real" in names:
            cells.append(f"{rows['real'][i]['cpu_share']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rank_table(rows: dict[str, list[dict]]) -> str:
    """Per rank, each mode's median busy B and step W in ms (``B / W``, rank 0 first): where the busy time differs
    between the ranks, the stages are not equal (the first stage's embedding, the last one's head and loss)."""
    names = list(rows)
    head = ["pp", "schedule", "v", "m", *(f"{name}: B / W ms per rank" for name in names)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, first in enumerate(rows[names[0]]):
        cells = [str(first["pp"]), first["schedule"], str(first["v"]), str(first["m"])]
        for name in names:
            cells.append(", ".join(f"{1e3 * r['busy_s']:.0f} / {1e3 * r['step_s']:.0f}"
                                   for r in rows[name][i]["per_rank"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def header(command: str, chosen: dict[str, Mode], seconds: float, load: tuple[float, float]) -> str:
    """The results' preamble: machine, torch, date, command, what each column means; ``load``: the machine's
    1-minute load average before and after the run (other processes on the 2 cores stretch the real mode)."""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or platform.machine()
    lines = [
        "# Pipeline schedules on CPU: bubble measured against predicted", "",
        f"Measured by `{command}` ({seconds:.0f} s) on {cpu}, {os.cpu_count()} cores (1-minute load average "
        f"{load[0]:.1f} before, {load[1]:.1f} after), torch {torch.__version__}, gloo, one thread per rank, "
        f"{datetime.date.today().isoformat()}. GPT-2 of {N_LAYER} blocks at gpt2-tiny's width (48, vocabulary 257), "
        "one rank per stage (`tp.init_mesh(\"2d\", 1, 1, pipeline_parallel_size=pp)`), "
        "`lightning_tp2d.pipeline.Pipeline` running torch's schedules, 8 / (pp v) blocks per stage.", "",
        "* *predicted*: `planning.pipeline_cost.bubble_fraction(pp, m, v, schedule)` = (pp - 1) / (m v + pp - 1).",
        "* *max*, *rank 0*: measured bubble 1 - B / W, the largest over the ranks and rank 0's (median over the "
        "steps). W: the wall time of `Pipeline.step` after a barrier; B: the wall time inside the rank's stage "
        "modules (blocks, final norm, head and loss, forward and backward; the embedding's forward).",
        "* *step ms*: the slowest rank's median W. *slot extra ms*: W / (m v + pp - 1) - B / (m v), the slowest W "
        "and the busiest B: what each chunk slot holds besides the chunk's own work (`pipeline_step_time`'s "
        "t_boundary: transfers, torch's schedule in Python, a busier stage).",
    ]
    for mode in chosen.values():
        if mode.block_ms is not None:
            lines.append(f"* *timed*: each block sleeps {mode.block_ms:g} ms after its forward of each micro-batch "
                         f"and {2 * mode.block_ms:g} ms in its backward (a chunk: 8 / (pp v) x {3 * mode.block_ms:g} "
                         f"ms), 4 pp rows x {mode.seq} tokens per step; {mode.warmup} warm-up + {mode.steps} timed "
                         "steps.")
        else:
            lines.append(f"* *real*: the blocks' own compute, {mode.batch} rows x {mode.seq} tokens per step; "
                         f"{mode.warmup} warm-up + {mode.steps} timed steps. *busy CPU / wall*: the least over the "
                         "ranks of the thread CPU time inside the modules over their wall time (1.0: a core to "
                         "itself).")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, a 3x shorter sleep, a 4x smaller batch")
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--modes", nargs="+", choices=["timed", "real"], default=["timed", "real"])
    parser.add_argument("--block-ms", type=float, default=15.0, help="timed: a block's forward sleep per micro-batch")
    parser.add_argument("--real-batch", type=int, default=128, help="real: rows of 64 tokens per step")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    chosen = {k: v for k, v in modes(args.quick, args.block_ms, args.real_batch).items() if k in args.modes}
    start, load = time.perf_counter(), os.getloadavg()[0]
    rows: dict[str, list[dict]] = {name: [] for name in chosen}
    for pp in args.pp:
        for name, mode in chosen.items():
            rows[name] += run(pp, mode, cases(pp))
            print(f"pp {pp} {name}: done ({time.perf_counter() - start:.0f} s)", flush=True)
    command = " ".join(["python recipes/benchmarks/pipeline_bubble.py", *(sys.argv[1:] if argv is None else argv)])
    text = "\n\n".join([header(command, chosen, time.perf_counter() - start, (load, os.getloadavg()[0])), table(rows),
                        "Per rank, rank 0 first: the median busy B and step W, ms (a B that differs between the "
                        "ranks: unequal stages, the first one's embedding, the last one's head and loss).",
                        rank_table(rows)]) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(text)


if __name__ == "__main__":
    main()
