"""Benchmark scenarios: one training step of the same model, batch and sequence under each layout.

A *scenario* is a baseline or a layout (:func:`lightning_tp2d.layouts.layout_names`) and a number of ranks:

=========  =====  ===========================================================================================
scenario   ranks  what runs
=========  =====  ===========================================================================================
single     1      the plain model (:class:`~lightning_tp2d.models.GPT2`, :class:`~lightning_tp2d.models.Llama`) on one device
hf         1      transformers' ``GPT2LMHeadModel`` (SDPA attention), same shapes (reference for ``single``; GPT-2)
tp1d       p      PyTorch's 1-D tensor parallelism (:mod:`lightning_tp2d.bench.tp1d`)
tp1d-sp    p      the same with sequence parallelism (:mod:`lightning_tp2d.bench.tp1d_sp`; seq divisible by p)
2d         p      TP2D, SUMMA on a q x q grid
metp       p      METP ring over p ranks
2d-metp    p      grid rows split the sequence, attention rings along rows
=========  =====  ===========================================================================================

The baselines are bench scenarios, not layouts; every rule about a layout (valid ``p``, what the model, batch and
sequence must divide by) is asked of its :class:`~lightning_tp2d.layouts.Layout` object, and of the model's family
(:mod:`lightning_tp2d.families`: the sizes it splits, the layouts it has a plan for). ``--model`` is a named size of
any family (``gpt2-tiny``, ``llama-tiny`` ...); the baselines ``hf``, ``tp1d`` and ``tp1d-sp`` and the cost model's
communication prediction describe GPT-2 only (a Llama's scenario rows leave the prediction columns empty).

Per scenario every rank reports (:func:`measure_rank`): the first loss (the same model and data everywhere, so
the losses must agree), step times after warm-up, the bytes resident between steps (parameters and optimizer
state), the activation bytes (allocated by the forward and still alive at its end), the peak of one whole step
(resident + the most alive during forward, backward and optimizer step), and the communication calls and bytes
of one step (our collectives from :func:`lightning_tp2d.comm.count_comm`; DTensor's from
:mod:`lightning_tp2d.bench.collectives`). On CPU memory is the live tensor bytes of
:class:`~lightning_tp2d.bench.measure.LiveTensorBytes`; on GPU the CUDA allocator's statistics.

:func:`max_sequence` searches the largest trainable sequence length under a per-rank memory cap, each probe one
step on fresh processes (:func:`lightning_tp2d.bench.procs.run_ranks`).
"""

from __future__ import annotations

import math
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from lightning_tp2d import layouts
from lightning_tp2d.bench import cost_model
from lightning_tp2d.bench.collectives import FunctionalCollectiveCounter
from lightning_tp2d.bench.events import totals, wire_bytes
from lightning_tp2d.bench.measure import LiveTensorBytes, resident_bytes
from lightning_tp2d.bench.procs import RunResult, run_ranks
from lightning_tp2d.bench.tp1d import check_tp1d, init_tp1d_mesh, param_groups_1d, parallelize_1d
from lightning_tp2d.bench.tp1d_sp import check_sequence_parallel
from lightning_tp2d.bench.trace import trace_steps
from lightning_tp2d.comm_record import count_comm
from lightning_tp2d.families import family_of_config, model_config
from lightning_tp2d.mesh import init_mesh
from lightning_tp2d.metp import block_kernel
from lightning_tp2d.models import GPT2, GPT2Config
from lightning_tp2d.parallelize import checkpoint_activations, parallelize

BASELINES = ("single", "hf", "tp1d", "tp1d-sp")  # bench scenarios that are not layouts
TP1D = ("tp1d", "tp1d-sp")  # torch's 1-D tensor parallelism, without and with sequence parallelism
SINGLE_DEVICE = ("single", "hf")
SCENARIOS = BASELINES + layouts.layout_names()


@dataclass(frozen=True)
class BenchSpec:
    """One benchmark setting, shared by every scenario of a run."""

    model: str = "gpt2-tiny"
    overrides: dict = field(default_factory=dict)  # config fields, e.g. {"n_head": 12, "n_layer": 2}
    batch: int = 4
    seq: int = 64
    steps: int = 5  # timed steps (median reported)
    warmup: int = 2
    dtype: str = "float32"  # "float32" or "bfloat16" (autocast; parameters stay float32)
    device: str = "cpu"
    seed: int = 0
    timeout: float = 900.0
    compile: str = ""  # a torch.compile backend ("inductor", "aot_eager"): compile the model after sharding
    activation_checkpointing: str = "none"  # for the package's layouts: none | full | selective

    def config(self, seq: int | None = None):
        seq = self.seq if seq is None else seq
        base = replace(model_config(self.model), **self.overrides)  # any registered family's named size
        return replace(base, block_size=max(base.block_size, seq))

    @property
    def elem(self) -> int:
        return 4 if self.dtype == "float32" else 2


def ranks_of(layout: str, p: int) -> int:
    return 1 if layout in SINGLE_DEVICE else p


def input_multiples(layout: str, p: int) -> tuple[int, int]:
    """``(batch, sequence)`` multiples the scenario's input needs on ``p`` ranks (baselines take any, but
    sequence parallelism splits the sequence)."""
    if layout == "tp1d-sp":
        return 1, p
    return (1, 1) if layout in BASELINES else layouts.get_layout(layout).input_multiples(p)


def check_scenario(layout: str, p: int, spec: BenchSpec, batch: int, seq: int) -> str | None:
    """Why ``layout`` cannot run on ``p`` ranks with this batch and sequence (``None`` when it can); checked
    before any process starts, so the reason names the numbers."""
    if layout not in SCENARIOS:
        return f"unknown layout {layout!r}; choose from {list(SCENARIOS)}"
    cfg = spec.config(seq)
    family = family_of_config(cfg)
    if seq > cfg.block_size:
        return f"seq {seq} > block_size {cfg.block_size}"
    if family.name != "gpt2" and layout in ("hf", *TP1D):
        return f"the {layout!r} baseline is GPT-2 only (model {spec.model!r} is a {family.model_class.__name__})"
    if layout not in BASELINES and layout not in family.layouts:
        return (f"model family {family.name!r} ({family.model_class.__name__}) has no plan for layout {layout!r} "
                f"yet; layouts it has: {list(family.layouts)}")
    if layout == "hf" and (not cfg.bias or cfg.dropout):
        return f"transformers' GPT-2 has biases and is compared without dropout (bias={cfg.bias}, dropout={cfg.dropout})"
    if layout in SINGLE_DEVICE:
        return None
    if not isinstance(p, int) or p < 1:
        return f"p must be a positive int, got {p!r}"
    try:
        if layout in TP1D:
            check_tp1d(cfg, p)
            if layout == "tp1d-sp":
                check_sequence_parallel(seq, p)
            return None
        rules = layouts.get_layout(layout)
        rules.check_tensor_parallel_size(p)
        family.check_model(rules, p, cfg, getattr(cfg, "dropout", 0.0))  # the family's sizes (Llama: n_kv_head ...)
        rules.check_input(p, batch, seq)
    except ValueError as e:
        return str(e)
    return None


# ---- one rank ------------------------------------------------------------------------------------------


def _build(layout: str, spec: BenchSpec, seq: int, world_size: int):
    """The model of ``layout`` on this rank, its optimizer and the step function."""
    cfg = spec.config(seq)
    device = torch.device(spec.device, torch.cuda.current_device()) if spec.device == "cuda" else torch.device("cpu")
    torch.manual_seed(spec.seed)
    if layout == "hf":
        from transformers import GPT2Config as HFConfig, GPT2LMHeadModel  # deferred: optional (the "hf" baseline)

        hf_cfg = HFConfig(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, vocab_size=cfg.vocab_size,
                          n_positions=cfg.block_size, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                          bos_token_id=None, eos_token_id=None, attn_implementation="sdpa")
        model = GPT2LMHeadModel(hf_cfg).to(device)
        result = model.load_state_dict(GPT2(cfg).hf_state_dict(), strict=False)  # the same weights as "single"
        params = {n for n, _ in model.named_parameters()}
        missing = [k for k in result.missing_keys if k in params and k != "lm_head.weight"]  # lm_head is tied
        if missing or result.unexpected_keys:
            raise RuntimeError(f"transformers GPT-2 did not take our weights: missing {missing}, "
                               f"unexpected {result.unexpected_keys}")
    else:
        model = family_of_config(cfg).model_class(cfg)
        if layout == "single":
            model = model.to(device)
        elif layout in TP1D:
            parallelize_1d(model.to(device), init_tp1d_mesh(world_size, device_type=device.type),
                           sequence_parallel=layout == "tp1d-sp")
        else:
            parallelize(model, init_mesh(layout, world_size, 1, device_type=device.type), layout=layout)
            checkpoint_activations(model, spec.activation_checkpointing)
    model.train()
    if spec.compile:  # the timed steps run compiled; the measured step's dispatch modes make Dynamo run it eagerly
        if layout != "hf":
            model.validate_inputs = False  # the ids are drawn in range; value checks would read the device
        model.compile(backend=spec.compile, dynamic=False)
    if layout in TP1D:  # DTensor and plain parameters in separate groups (CUDA foreach kernels refuse a mix)
        optimizer = torch.optim.AdamW(param_groups_1d(model), lr=1e-4)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(spec.seed + 1)
    data = torch.randint(0, cfg.vocab_size, (spec.batch, seq + 1), generator=gen).to(device)
    idx, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    def forward():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec.dtype == "bfloat16"):
            if layout == "hf":
                # HF shifts the labels itself: the same next-token loss, less the last position's target
                return model(idx, labels=idx).loss
            return model(idx, targets)

    return model, optimizer, forward


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure_rank(rank: int, world_size: int, layout: str, spec: BenchSpec, seq: int, full: bool,
                 cap_bytes: int | None = None) -> dict:
    """One rank of a scenario. ``full``: time ``spec.steps`` steps after warm-up, then measure memory and
    communication on one more step; otherwise (a max-sequence probe) just that one measured step, which raises
    :class:`~lightning_tp2d.bench.measure.MemoryCapExceeded` (CPU) or an OOM (GPU) past the cap."""
    model, optimizer, forward = _build(layout, spec, seq, world_size)
    out: dict = {"rank": rank}
    kernel = ring_attention_kernel(layout, spec, seq)
    if kernel is not None:
        out["attention_kernel"] = kernel

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = forward()
        loss.backward()
        optimizer.step()
        return loss

    if full:
        times = []
        for i in range(spec.warmup + spec.steps):
            dist.barrier()
            _sync(spec.device)
            t0 = time.perf_counter()
            loss = step()
            _sync(spec.device)
            times.append(time.perf_counter() - t0)
            if i == 0:
                out["loss"] = loss.item()
        out["step_times"] = times[spec.warmup:]

    # the measured step: memory and communication
    optimizer.zero_grad(set_to_none=True)
    resident = resident_bytes(model, optimizer)
    on_gpu = spec.device == "cuda"
    tracker = LiveTensorBytes(cap=None if on_gpu else cap_bytes, base=resident, record_shapes=False)
    counter = FunctionalCollectiveCounter()
    dist.barrier()
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()
    with count_comm() as stats, counter, (nullcontext() if on_gpu else tracker):
        loss = forward()
        activation = (torch.cuda.memory_allocated() - resident) if on_gpu else tracker.live
        loss.backward()
        optimizer.step()
    if on_gpu:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resident + tracker.peak
    snapshot = stats.snapshot()
    for kind, value in counter.stats.snapshot().items():
        snapshot[kind] = {"calls": snapshot[kind]["calls"] + value["calls"],
                          "bytes": snapshot[kind]["bytes"] + value["bytes"]}
    out.update(resident_bytes=resident, activation_bytes=activation, peak_bytes=peak, comm=snapshot,
               measured_loss=loss.item())
    out.setdefault("loss", loss.item())
    return out


# ---- scenarios -----------------------------------------------------------------------------------------


def run_scenario(layout: str, p: int, spec: BenchSpec, seq: int | None = None, cap_bytes: int | None = None,
                 full: bool = True) -> dict:
    """Run one scenario and summarise it (``status`` ``ok`` or the reason it could not run)."""
    seq = spec.seq if seq is None else seq
    world = ranks_of(layout, p)
    row = {"layout": layout, "p": world, "batch": spec.batch, "seq": seq, "model": spec.model,
           "dtype": spec.dtype, "device": spec.device}
    reason = check_scenario(layout, world, spec, spec.batch, seq)
    if reason is None and spec.device == "cuda" and not torch.cuda.is_available():
        reason = "no CUDA device"
    if reason is None and layout == "hf":
        try:
            import transformers  # noqa: F401 - deferred: optional (the "hf" baseline); is it installed?
        except ImportError:
            reason = "transformers is not installed"
    if reason is not None:
        return {**row, "status": "cannot run", "reason": reason}
    result: RunResult = run_ranks(measure_rank, world, layout, spec, seq, full, cap_bytes, device=spec.device,
                                  cap_bytes=cap_bytes, timeout=spec.timeout)
    if not result.ok:
        return {**row, "status": result.status, "reason": result.reason}
    return {**row, "status": "ok", **summarise(layout, world, spec, seq, result.values)}


def ring_attention_kernel(layout: str, spec: BenchSpec, seq: int) -> str | None:
    """The per-block kernel a ring layout's attention uses in this process (:func:`lightning_tp2d.metp.block_kernel`),
    ``None`` for layouts without ring attention."""
    if layout in BASELINES or not layouts.get_layout(layout).zigzag:  # ring attention: the zigzag layouts
        return None
    cfg = spec.config(seq)
    dtype = torch.bfloat16 if spec.dtype == "bfloat16" else torch.float32
    device = torch.device(spec.device, torch.cuda.current_device()) if spec.device == "cuda" else torch.device("cpu")
    sample = torch.empty(1, 1, 1, cfg.n_embd // cfg.n_head, dtype=dtype, device=device)
    return block_kernel(sample, layouts.get_layout(layout).options)


def summarise(layout: str, p: int, spec: BenchSpec, seq: int, ranks: list[dict]) -> dict:
    """Per-scenario numbers from the per-rank reports, with the cost model's communication prediction."""
    row: dict = {"loss": ranks[0]["loss"], "ranks": ranks}
    if "attention_kernel" in ranks[0]:
        row["attention_kernel"] = ranks[0]["attention_kernel"]
    if "step_times" in ranks[0]:
        per_step = [max(r["step_times"][i] for r in ranks) for i in range(len(ranks[0]["step_times"]))]
        row["step_time_s"] = statistics.median(per_step)
        row["tokens_per_s"] = spec.batch * seq / row["step_time_s"]
    for key in ("resident_bytes", "activation_bytes", "peak_bytes"):
        row[key] = max(r[key] for r in ranks)
    row["comm_calls"] = max(sum(v["calls"] for v in r["comm"].values()) for r in ranks)
    row["comm_bytes"] = max(sum(v["bytes"] for v in r["comm"].values()) for r in ranks)
    cfg = spec.config(seq)
    if layout != "hf" and isinstance(cfg, GPT2Config):  # the cost model (and its tracer) describe GPT-2
        if layout not in BASELINES:  # every rank is compared with its own count: trace them in one go
            trace_steps(layout, cfg, spec.batch, seq, p, spec.elem, range(p))
        model_events = [cost_model.comm_events(layout, cfg, spec.batch, seq, p, spec.elem, rank=r) for r in range(p)]
        predicted = [totals(ev) for ev in model_events]
        row["model_comm_bytes"] = max(sum(v["bytes"] for v in t.values()) for t in predicted)
        row["wire_bytes"] = max(wire_bytes(ev) for ev in model_events)
        # exact only in float32 and without checkpointing (the model does not count recomputation's collectives)
        if spec.dtype == "float32" and (layout in BASELINES or spec.activation_checkpointing == "none"):
            row["comm_matches_model"] = all(
                {k: v for k, v in r["comm"].items() if v["calls"]} == {k: v for k, v in t.items() if v["calls"]}
                for r, t in zip(ranks, predicted))
        row["model_activation_bytes"] = cost_model.activation_bytes(layout, cfg, spec.batch, seq, p, spec.elem)
        row["calls_per_block"] = calls_per_block(layout, cfg, spec.batch, seq, p, spec.elem)
    return row


def calls_per_block(layout: str, cfg, batch: int, seq: int, p: int, elem: int) -> int:
    """Communication calls one transformer block adds to a step, forward and backward, on the rank that makes the
    most: read from the traced step of a layout (no extra trace unless the model has one block), the difference of
    the closed forms for the 1-D baselines."""
    if layout in BASELINES:
        count = lambda n: sum(e.calls for e in cost_model.comm_events(layout, replace(cfg, n_layer=n), batch, seq,  # noqa: E731
                                                                       p, elem))
        return count(2) - count(1)
    if cfg.n_layer < 2:
        cfg = replace(cfg, n_layer=2)
    steps = trace_steps(layout, cfg, batch, seq, p, elem, layouts.get_layout(layout).distinct_ranks(p))
    return max(step.block_calls for step in steps.values())


def max_sequence(layout: str, p: int, spec: BenchSpec, cap_bytes: int, unit: int = 64, limit: int = 1 << 17,
                 log=print) -> dict:
    """Largest multiple of ``unit`` (rounded to what the layout needs) that trains one step under the cap.

    Doubling from ``unit`` until a probe fails, then bisection; every probe is a fresh process group."""
    world = ranks_of(layout, p)
    batch, granule = input_multiples(layout, world)  # the smallest batch; sequences a multiple of the granule
    unit = unit * granule // math.gcd(unit, granule)
    probe_spec = replace(spec, batch=batch)
    probes: list[dict] = []

    def fits(seq: int) -> bool:
        reason = check_scenario(layout, world, probe_spec, batch, seq)
        if reason is not None:
            probes.append({"seq": seq, "status": "cannot run", "reason": reason})
            return False
        r = run_scenario(layout, p, probe_spec, seq=seq, cap_bytes=cap_bytes, full=False)
        probes.append({"seq": seq, "status": r["status"], "peak_bytes": r.get("peak_bytes"),
                       "reason": r.get("reason", "")})
        if r.get("attention_kernel"):
            row["attention_kernel"] = r["attention_kernel"]
        log(f"  probe {layout} p={world} seq={seq}: {r['status']} {r.get('peak_bytes', '')}")
        if r["status"] not in ("ok", "oom"):
            raise RuntimeError(f"probe {layout} seq={seq} failed: {r['reason']}")
        return r["status"] == "ok"

    row = {"layout": layout, "p": world, "batch": batch, "cap_bytes": cap_bytes, "unit": unit, "model": spec.model}
    try:
        lo, hi = 0, unit
        while hi <= limit and fits(hi):
            lo, hi = hi, hi * 2
        if lo == 0:
            return {**row, "status": "ok", "max_seq": 0, "probes": probes}
        hi = min(hi, limit + unit)
        while hi - lo > unit:
            mid = (lo + hi) // 2 // unit * unit
            if fits(mid):
                lo = mid
            else:
                hi = mid
    except RuntimeError as e:
        return {**row, "status": "error", "reason": str(e), "probes": probes}
    return {**row, "status": "ok", "max_seq": lo, "capped_by_limit": lo >= limit, "probes": probes}

