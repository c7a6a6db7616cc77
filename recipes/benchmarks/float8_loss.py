"""Float8 training on CPU: 200 steps of every layout in bf16 and in torchao's two float8 recipes, loss against loss.

    python recipes/benchmarks/float8_loss.py [--out recipes/benchmarks/float8_loss] [--steps 200]

Per layout ("2d" on a 2x2 grid, "metp" on a ring of 4, "2d-metp" on a 2x2 grid; 4 gloo ranks) and per recipe
(none, ``tensorwise``, ``rowwise``), gpt2-mini (4 blocks, width 96, 257-token vocabulary) trains ``--steps`` AdamW
steps (lr 3e-3, fp32 master weights, bf16 autocast) from one seed on one stream of batches (8 sequences of 64
tokens from a fixed random first-order chain: each token has 4 equally likely successors, so the loss cannot fall
below ln 4 = 1.386 and a relative band stays meaningful to the end). The plain model trains the same steps in
bf16 and with torchao's own ``convert_to_float8_training`` (one process): the reference each layout's float8 run is
held against. ``torch._scaled_mm`` is emulated on the CPU: this measures numerics, not speed.

The band: per step, the float8 run's loss minus the same layout's bf16 loss, relative to the bf16 loss; the table
gives its largest absolute value over all steps and over the last 50, and the last 50 steps' mean loss of each run.
Writes ``results.json``, ``results.md`` and ``loss.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch

import lightning_tp2d as tp
from lightning_tp2d import float8
from lightning_tp2d.bench.procs import run_ranks
from lightning_tp2d.models import GPT2, GPT2Config

LAYOUTS = ("2d", "metp", "2d-metp")
RECIPES = (None, "tensorwise", "rowwise")
BATCH, SEQ, LR, SEED, SUCCESSORS = 8, 64, 3e-3, 0, 4


def _config() -> GPT2Config:
    return GPT2Config.from_name("gpt2-mini", dropout=0.0)


def _batches(steps: int, vocab: int) -> torch.Tensor:
    """``[steps, BATCH, SEQ + 1]`` token ids: random starts, then each next token one of its current token's
    ``SUCCESSORS`` fixed random successors, uniformly (entropy ln SUCCESSORS per token)."""
    g = torch.Generator().manual_seed(1234)
    chain = torch.randint(0, vocab, (vocab, SUCCESSORS), generator=g)
    out = torch.empty(steps, BATCH, SEQ + 1, dtype=torch.long)
    out[..., 0] = torch.randint(0, vocab, (steps, BATCH), generator=g)
    for t in range(SEQ):
        pick = torch.randint(0, SUCCESSORS, (steps, BATCH), generator=g)
        out[..., t + 1] = chain[out[..., t], pick]
    return out


def _train(model: torch.nn.Module, batches: torch.Tensor) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for batch in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _layout_rank(rank: int, world_size: int, layout: str, recipe: str | None, steps: int) -> list[float]:
    torch.manual_seed(SEED)
    cfg = _config()
    model = tp.parallelize(GPT2(cfg), tp.init_mesh(layout, world_size, 1), layout, options=tp.TPOptions(float8=recipe))
    return _train(model, _batches(steps, cfg.vocab_size))


def _plain(recipe: str | None, steps: int) -> list[float]:
    torch.manual_seed(SEED)
    cfg = _config()
    model = float8.convert_plain(GPT2(cfg), recipe)
    return _train(model, _batches(steps, cfg.vocab_size))


def _band(losses: list[float], reference: list[float], last: int = 0) -> float:
    pairs = list(zip(losses, reference))[-last:] if last else list(zip(losses, reference))
    return max(abs(a - b) / b for a, b in pairs)


def _mean_last(losses: list[float], n: int = 50) -> float:
    return sum(losses[-n:]) / len(losses[-n:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="recipes/benchmarks/float8_loss")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    runs: dict[str, list[float]] = {}
    seconds: dict[str, float] = {}
    for recipe in RECIPES:
        name = f"plain/{recipe or 'bf16'}"
        start = time.perf_counter()
        runs[name] = _plain(recipe, args.steps)
        seconds[name] = time.perf_counter() - start
        print(name, f"{runs[name][0]:.3f} -> {runs[name][-1]:.3f}", flush=True)
    for layout in LAYOUTS:
        for recipe in RECIPES:
            name = f"{layout}/{recipe or 'bf16'}"
            start = time.perf_counter()
            result = run_ranks(_layout_rank, 4, layout, recipe, args.steps, timeout=3600.0)
            if not result.ok:
                raise SystemExit(f"{name}: {result.reason}")
            runs[name] = result.values[0]
            seconds[name] = time.perf_counter() - start
            print(name, f"{runs[name][0]:.3f} -> {runs[name][-1]:.3f}", flush=True)

    rows = []
    for name, losses in runs.items():
        side, recipe = name.split("/")
        reference = runs[f"{side}/bf16"]
        plain_same = runs[f"plain/{recipe}"]
        rows.append({"run": name, "first": losses[0], "last50_mean": _mean_last(losses),
                     "band_vs_bf16": None if recipe == "bf16" else _band(losses, reference),
                     "band_vs_bf16_last50": None if recipe == "bf16" else _band(losses, reference, 50),
                     "band_vs_plain_same_recipe": None if side == "plain" else _band(losses, plain_same),
                     "seconds": seconds[name]})
    meta = {"command": f"python recipes/benchmarks/float8_loss.py --steps {args.steps}",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "machine": f"{platform.machine()}, {torch.get_num_threads()} thread per rank",
            "model": "gpt2-mini (4 blocks, width 96, vocabulary 257), bf16 autocast, fp32 master weights",
            "data": f"{BATCH} x {SEQ} tokens a step, a fixed random first-order chain of {SUCCESSORS} equally likely "
                    f"successors per token (loss floor ln {SUCCESSORS} = {math.log(SUCCESSORS):.3f})",
            "lr": LR, "steps": args.steps}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows, "losses": runs}, indent=1) + "\n")
    _markdown(out, meta, rows)
    _plot(out, runs)


def _pct(x) -> str:
    return "" if x is None else f"{100 * x:.2f}%"


def _markdown(out: Path, meta: dict, rows: list[dict]) -> None:
    lines = ["# Float8 training on CPU: every layout's loss in bf16 and in torchao's recipes", "",
             f"`{meta['command']}` on {meta['date']} (torch {meta['torch']}, {meta['machine']}). {meta['model']}; "
             f"{meta['data']}; AdamW lr {meta['lr']}. `torch._scaled_mm` is emulated on the CPU: numerics, not speed.",
             "", "Band: per step, |float8 loss - the same side's bf16 loss| / bf16 loss, largest over all steps and "
             "over the last 50; against plain: the same recipe on the plain model converted by torchao.", "",
             "| run | first loss | mean of the last 50 | band vs bf16 (all) | band vs bf16 (last 50) | "
             "band vs plain, same recipe (all) |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['first']:.3f} | {r['last50_mean']:.4f} | {_pct(r['band_vs_bf16'])} | "
                     f"{_pct(r['band_vs_bf16_last50'])} | {_pct(r['band_vs_plain_same_recipe'])} |")
    lines += ["", "![loss](loss.png)", ""]
    (out / "results.md").write_text("\n".join(lines))


def _plot(out: Path, runs: dict[str, list[float]]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the plot is optional; the table holds the numbers
        return
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6), sharey=True)
    for ax, side in zip(axes, ("plain", *LAYOUTS)):
        for recipe in RECIPES:
            losses = runs[f"{side}/{recipe or 'bf16'}"]
            ax.plot(range(1, len(losses) + 1), losses, label=recipe or "bf16", linewidth=1)
        ax.set_title(side)
        ax.axhline(math.log(SUCCESSORS), color="grey", linewidth=0.5, linestyle=":")
        ax.set_xlabel("step")
    axes[0].set_ylabel("loss")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)


if __name__ == "__main__":
    main()
