"""Benchmark scenarios: one training step of the same model, batch and sequence under each layout.

A *scenario* is a baseline or a layout (:func:`lightning_tp2d.layouts.layout_names`) and a number of ranks:

=========  =====  ===========================================================================================
scenario   ranks  what runs
=========  =====  ===========================================================================================
single     1      the plain model (:class:`~lightning_tp2d.models.GPT2`, :class:`~lightning_tp2d.models.Llama`) on one device
hf         1      transformers' ``GPT2LMHeadModel`` (SDPA attention), same shapes (reference for ``single``; GPT-2)
tp1d       p      PyTorch's 1-D tensor parallelism (:mod:`lightning_tp2d.baselines.tp1d`)
tp1d-sp    p      the same with sequence parallelism (:mod:`lightning_tp2d.baselines.tp1d_sp`; seq divisible by p)
cp         p      torch's context parallelism x FSDP2, both over p (:mod:`lightning_tp2d.baselines.context_parallel`)
cp-tp      p      CP over p / t x 1-D TP + SP over t = ``BenchSpec.cp_tp_size`` (default 2), FSDP2 over the CP axis
ulysses    p      DeepSpeed's Ulysses SP + ALST's TiledMLP and tiled loss, checkpointing, FSDP2 (:mod:`~.baselines.ulysses`)
2d         p      TP2D, SUMMA on a q x q grid
metp       p      METP ring over p ranks
2d-metp    p      grid rows split the sequence, attention rings along rows
=========  =====  ===========================================================================================

The baselines are bench scenarios, not layouts; every rule about a layout (valid ``p``, what the model, batch and
sequence must divide by) is asked of its :class:`~lightning_tp2d.layouts.Layout` object, and of the model's family
(:mod:`lightning_tp2d.families`: the sizes it splits, the layouts it has a plan for). ``--model`` is a named size of
any family (``gpt2-tiny``, ``llama-tiny`` ...); the baseline ``hf`` and the cost model's communication prediction
describe GPT-2 only (a Llama's scenario rows leave the prediction columns empty); ``tp1d`` and ``tp1d-sp`` have a
plan for both families; ``cp`` and ``cp-tp`` run the Llama only (:func:`check_scenario` says why), float32, eager.

Per scenario every rank reports (:func:`measure_rank`): the first loss (the same model and data everywhere, so
the losses must agree), step times after warm-up, the bytes resident between steps (parameters and optimizer
state), the activation bytes (allocated by the forward and still alive at its end), the peak of one whole step
(resident + the most alive during forward, backward and optimizer step), and the communication calls and bytes
of one step (our collectives from :func:`lightning_tp2d.comm.count_comm`; DTensor's from
:mod:`lightning_tp2d.bench.collectives`; torch's ring's dK/dV permutes as ``all_to_all_single``), and the bytes it
sends (``sent_bytes``: every call priced by its group's size,
:class:`~lightning_tp2d.baselines.context_parallel.SentBytes`). On CPU memory is the live tensor bytes of
:class:`~lightning_tp2d.planning.live.LiveTensorBytes` (storage resizes counted for FSDP's gathered parameters); on
GPU the CUDA allocator's statistics.

:func:`max_sequence` searches the largest trainable sequence length under a per-rank memory cap, each probe on
fresh processes (:func:`lightning_tp2d.bench.procs.run_ranks`): a warm-up step, then the measured step under the
cap, so every layout is measured as it trains, its optimizer state resident (and FSDP's lazy initialisation and
DTensor's sharding propagation, which the tracker would count, done).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from lightning_tp2d import layouts
from lightning_tp2d.baselines import context_parallel as cp
from lightning_tp2d.planning import cost_model
from lightning_tp2d.baselines import ulysses
from lightning_tp2d.bench.collectives import FunctionalCollectiveCounter
from lightning_tp2d.baselines.context_parallel import SentBytes
from lightning_tp2d.planning.events import totals, wire_bytes
from lightning_tp2d.planning.live import LiveTensorBytes, MemoryCapExceeded, resident_bytes
from lightning_tp2d.bench.procs import RunResult, _oom_in, run_ranks
from lightning_tp2d.baselines.tp1d import check_tp1d, init_tp1d_mesh, param_groups_1d, parallelize_1d
from lightning_tp2d.planning.rivals import check_sequence_parallel, check_ulysses
from lightning_tp2d.planning.trace import trace_steps
from lightning_tp2d.comm_record import count_comm, recording
from lightning_tp2d.families import family_of_config, model_config
from lightning_tp2d.mesh import init_mesh
from lightning_tp2d.metp import block_kernel
from lightning_tp2d.models import GPT2, GPT2Config, Llama
from lightning_tp2d.models.config import max_seq_len
from lightning_tp2d.parallelize import checkpoint_activations
from lightning_tp2d.step import prepare_model
from lightning_tp2d.train_plan import TrainPlan
from lightning_tp2d.rivals import get_rival, is_rival, rival_names

BASELINES = rival_names()  # bench scenarios that are not layouts: the registered rivals (lightning_tp2d.rivals)
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
    cp_tp_size: int = 2  # cp-tp: the 1-D TP + SP size t inside p (CP over p / t ranks, adjacent ranks in a TP group)
    # every scenario's AdamW: "torch" its default implementation (the for-loop on CPU, foreach on CUDA), "fused" the
    # fused kernel (what CausalLMModule configures)
    optimizer: str = "torch"

    def config(self, seq: int | None = None):
        seq = self.seq if seq is None else seq
        base = replace(model_config(self.model), **self.overrides)  # any registered family's named size
        return replace(base, block_size=max(base.block_size, seq))

    @property
    def elem(self) -> int:
        return 4 if self.dtype == "float32" else 2


def ranks_of(layout: str, p: int) -> int:
    return get_rival(layout).ranks(p) if is_rival(layout) else p


def cp_sizes(layout: str, p: int, spec: BenchSpec) -> tuple[int, int]:
    """``(CP ranks, TP ranks)`` of a context-parallel scenario on ``p`` ranks: ``cp`` all ``p`` by 1, ``cp-tp``
    ``p / t`` by ``t = spec.cp_tp_size``."""
    return get_rival(layout).split(p, spec.cp_tp_size)


def input_multiples(layout: str, p: int, cp_tp_size: int = 2) -> tuple[int, int]:
    """``(batch, sequence)`` multiples the scenario's input needs on ``p`` ranks (a rival's
    :meth:`~lightning_tp2d.rivals.Rival.input_multiples`, or the layout's)."""
    if is_rival(layout):
        return get_rival(layout).input_multiples(p, cp_tp_size)
    return layouts.get_layout(layout).input_multiples(p)


def check_scenario(layout: str, p: int, spec: BenchSpec, batch: int, seq: int) -> str | None:
    """Why ``layout`` cannot run on ``p`` ranks with this batch and sequence (``None`` when it can); checked
    before any process starts, so the reason names the numbers."""
    if layout not in SCENARIOS:
        return f"unknown layout {layout!r}; choose from {list(SCENARIOS)}"
    cfg = spec.config(seq)
    family = family_of_config(cfg)
    limit = max_seq_len(cfg)  # None: RoPE (Llama) runs any length; a position table has block_size rows
    if limit is not None and seq > limit:
        return f"seq {seq} > block_size {limit} (the rows of {spec.model!r}'s position table)"
    rival = get_rival(layout) if is_rival(layout) else None
    if rival is not None and rival.hf_weights and not rival.runs(family.name):
        return f"the {layout!r} baseline is GPT-2 only (model {spec.model!r} is a {family.model_class.__name__})"
    if rival is not None and rival.context_parallel:
        return context_parallel_problem(layout, p, spec, seq)
    if rival is not None and rival.ulysses:
        return ulysses_problem(p, spec, seq)
    if rival is None and layout not in family.layouts:
        return (f"model family {family.name!r} ({family.model_class.__name__}) has no plan for layout {layout!r} "
                f"yet; layouts it has: {list(family.layouts)}")
    if rival is not None and rival.hf_weights and (not cfg.bias or cfg.dropout):
        return f"transformers' GPT-2 has biases and is compared without dropout (bias={cfg.bias}, dropout={cfg.dropout})"
    if rival is not None and rival.one_device:
        return None
    if not isinstance(p, int) or p < 1:
        return f"p must be a positive int, got {p!r}"
    try:
        if rival is not None and rival.tensor_parallel:
            check_tp1d(cfg, p)
            if rival.sequence_parallel:
                check_sequence_parallel(seq, p)
            return None
        rules = layouts.get_layout(layout)
        rules.check_tensor_parallel_size(p)
        family.check_model(rules, p, cfg, getattr(cfg, "dropout", 0.0))  # the family's sizes (Llama: n_kv_head ...)
        rules.check_input(p, batch, seq)
    except ValueError as e:
        return str(e)
    return None


def context_parallel_problem(layout: str, p: int, spec: BenchSpec, seq: int) -> str | None:
    """Why ``cp`` / ``cp-tp`` cannot run on ``p`` ranks at this sequence length, or ``None``."""
    cfg = spec.config(seq)
    family = family_of_config(cfg)
    if not issubclass(family.model_class, Llama):
        return (f"the {layout!r} baseline runs the package's Llama only (model {spec.model!r} is a "
                f"{family.model_class.__name__}): the plain GPT-2 adds wpe(arange(T)) of its local length inside "
                "forward, so a CP shard (chunks r and 2p-1-r of 2p) would get positions 0..T/p-1; the Llama's "
                "attention takes the shard's absolute positions for RoPE")
    if spec.dtype != "float32" or spec.compile:
        return (f"the {layout!r} baseline runs eager float32 here (got dtype {spec.dtype}, compile "
                f"{spec.compile or 'off'}): torch's CP ring is not checked under autocast or torch.compile")
    if not isinstance(p, int) or p < 1:
        return f"p must be a positive int, got {p!r}"
    if cfg.dropout:
        return f"dropout={cfg.dropout}: torch's ring attention takes no dropout; use 0.0"
    rival = get_rival(layout)
    n_cp, tp = cp_sizes(layout, p, spec)
    if rival.inner_tensor_parallel and (p % tp or n_cp < 2):
        fits = [k for k in range(2, p // 2 + 1) if p % k == 0]
        return (f"cp-tp with TP size {tp} needs p a multiple of {tp} with at least 2 CP ranks, got p={p}; "
                f"use cp_tp_size in {fits}" if fits else f"cp-tp needs p >= 4 (2 CP x 2 TP ranks), got p={p}")
    if seq % (2 * n_cp):
        return (f"sequence length {seq} is not divisible by 2p = {2 * n_cp} (CP ranks {n_cp}): torch's head-tail "
                f"load balancer needs 2p equal chunks")
    if rival.inner_tensor_parallel:
        try:
            check_tp1d(cfg, tp)
            check_sequence_parallel(seq // n_cp, tp)
        except ValueError as e:
            return f"cp-tp, TP over {tp} of each CP rank's {seq // n_cp} tokens: {e}"
    return None


def ulysses_problem(p: int, spec: BenchSpec, seq: int) -> str | None:
    """Why ``ulysses`` cannot run on ``p`` ranks at this sequence length, or ``None``."""
    cfg = spec.config(seq)
    family = family_of_config(cfg)
    if not issubclass(family.model_class, Llama):
        return (f"the 'ulysses' baseline runs transformers' LlamaForCausalLM with the package's Llama weights (model "
                f"{spec.model!r} is a {family.model_class.__name__})")
    if spec.dtype != "float32" or spec.compile or spec.device != "cpu":
        return (f"the 'ulysses' baseline runs eager float32 on CPU gloo here (got dtype {spec.dtype}, compile "
                f"{spec.compile or 'off'}, device {spec.device})")
    if cfg.dropout:
        return f"dropout={cfg.dropout}: compared without dropout; use 0.0"
    try:
        check_ulysses(cfg, p, seq)
    except ValueError as e:
        return str(e)
    return ulysses.deepspeed_problem()


# ---- one rank ------------------------------------------------------------------------------------------


@dataclass
class _Built:
    """One rank's scenario: ``forward()`` returns the loss to call ``backward()`` on, both inside ``region()``;
    ``loss_value(loss)`` is the global mean loss (a collective for CP, whose ranks hold their shard's share);
    ``groups`` the size of the functional collectives' groups, or a map by group name (for :class:`SentBytes`);
    ``fsdp``: the weights are FSDP2's (its gathered parameters are storage resizes, counted after a warm-up)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    forward: Callable[[], torch.Tensor]
    region: Callable = contextlib.nullcontext
    loss_value: Callable[[torch.Tensor], float] = lambda loss: loss.item()  # noqa: E731
    groups: int | dict[str, int] = 1
    fsdp: bool = False


OPTIMIZERS = ("torch", "fused")


def _adamw(params, spec: BenchSpec) -> torch.optim.Optimizer:
    """The scenario's AdamW (``spec.optimizer``), the same on every side."""
    if spec.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={spec.optimizer!r} is not one of {', '.join(map(repr, OPTIMIZERS))}")
    return torch.optim.AdamW(params, lr=1e-4, **({"fused": True} if spec.optimizer == "fused" else {}))


def _context_parallel(layout: str, spec: BenchSpec, model: Llama, world_size: int, device: torch.device,
                      idx: torch.Tensor, targets: torch.Tensor) -> _Built:
    """``cp`` / ``cp-tp`` on this rank (:mod:`~lightning_tp2d.baselines.context_parallel`): the region shards the
    sequence (torch's ``context_parallel``), the forward is this rank's :func:`~.context_parallel.sequence_loss`."""
    n_cp, tp = cp_sizes(layout, world_size, spec)
    mesh = cp.init_cp_mesh(n_cp, tp, device_type=device.type)
    cp.parallelize_cp(model, mesh)
    optimizer = _adamw(model.parameters(), spec)
    shards: dict[str, torch.Tensor] = {}

    @contextlib.contextmanager
    def region():
        with cp.sharded_sequence(model, mesh, idx, targets) as (shards["idx"], shards["targets"]):
            yield

    return _Built(model, optimizer, lambda: cp.sequence_loss(model, mesh, shards["idx"], shards["targets"]), region,
                  lambda loss: cp.mean_loss(loss, mesh).item(), cp.group_sizes(mesh), fsdp=True)


def _ulysses(spec: BenchSpec, model: Llama, world_size: int, idx: torch.Tensor, targets: torch.Tensor) -> _Built:
    """``ulysses`` on this rank (:mod:`~lightning_tp2d.baselines.ulysses`): DeepSpeed's attention registered for the
    process (fresh processes per scenario), the forward this rank's :func:`~.ulysses.sequence_loss`."""
    rank, seq = dist.get_rank(), idx.size(1)
    lm = ulysses.build_ulysses(model, world_size, idx.size(0), seq)
    registered = ulysses.ulysses_attention(lm, world_size, idx.size(0), seq)
    sp_group = registered.__enter__()  # for the process's life: every step runs Ulysses
    lm.ulysses_registration = registered  # a collected context would run its exit and unregister
    optimizer = _adamw(lm.parameters(), spec)
    return _Built(lm, optimizer, lambda: ulysses.sequence_loss(lm, idx, targets, rank, world_size),
                  loss_value=lambda loss: ulysses.mean_loss(loss, world_size).item(),
                  groups=ulysses.group_sizes(sp_group, lm.fsdp_mesh), fsdp=True)


def _build(layout: str, spec: BenchSpec, seq: int, world_size: int) -> _Built:
    """The model of ``layout`` on this rank, its optimizer and the step function."""
    cfg = spec.config(seq)
    device = torch.device(spec.device, torch.cuda.current_device()) if spec.device == "cuda" else torch.device("cpu")
    torch.manual_seed(spec.seed)
    rival = get_rival(layout) if is_rival(layout) else None  # None: a package layout
    hf = rival is not None and rival.hf_weights
    one_d = rival is not None and rival.tensor_parallel  # torch's 1-D TP (+ SP)
    if hf:
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
        if rival is None:  # the package's layout: its model side as the strategies prepare it
            plan = TrainPlan(layout, world_size, 1, activation_checkpointing=spec.activation_checkpointing)
            prepare_model(model, init_mesh(layout, world_size, 1, device_type=device.type), plan)
        elif one_d:
            parallelize_1d(model.to(device), init_tp1d_mesh(world_size, device_type=device.type),
                           sequence_parallel=rival.sequence_parallel)
            checkpoint_activations(model, spec.activation_checkpointing)
        else:  # the plain model, or the one CP / Ulysses run
            model = model.to(device)
            if not rival.ulysses:  # (ulysses: ALST's own checkpointing of every layer, always)
                checkpoint_activations(model, spec.activation_checkpointing)  # the plain blocks, before FSDP / CP
    model.train()
    gen = torch.Generator().manual_seed(spec.seed + 1)
    data = torch.randint(0, cfg.vocab_size, (spec.batch, seq + 1), generator=gen).to(device)
    idx, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    if rival is not None and rival.context_parallel:  # sharded after the data is drawn (the same data as the rest)
        return _context_parallel(layout, spec, model, world_size, device, idx, targets)
    if rival is not None and rival.ulysses:
        return _ulysses(spec, model, world_size, idx, targets)
    if spec.compile:  # the timed steps run compiled; the measured step's dispatch modes make Dynamo run it eagerly
        if not hf:
            model.validate_inputs = False  # the ids are drawn in range; value checks would read the device
        if one_d:  # torchtitan's way: each block on its own (torch's loss_parallel does not trace)
            for block in family_of_config(cfg).block_modules(model):
                block.compile(backend=spec.compile, dynamic=False, fullgraph=True)
        else:
            model.compile(backend=spec.compile, dynamic=False)
    if one_d:  # DTensor and plain parameters in separate groups (CUDA foreach kernels refuse a mix)
        optimizer = _adamw(param_groups_1d(model), spec)
    else:
        optimizer = _adamw(model.parameters(), spec)

    def forward():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec.dtype == "bfloat16"):
            if hf:
                # HF shifts the labels itself: the same next-token loss, less the last position's target
                return model(idx, labels=idx).loss
            return model(idx, targets)

    return _Built(model, optimizer, forward, groups=world_size)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure_rank(rank: int, world_size: int, layout: str, spec: BenchSpec, seq: int, full: bool,
                 cap_bytes: int | None = None) -> dict:
    """One rank of a scenario. ``full``: time ``spec.steps`` steps after warm-up, then measure memory and
    communication on one more step; otherwise (a max-sequence probe) one warm-up step, then that measured step;
    either raises :class:`~lightning_tp2d.planning.live.MemoryCapExceeded` (CPU) or an OOM (GPU) past the cap."""
    run = _build(layout, spec, seq, world_size)
    model, optimizer, on_gpu = run.model, run.optimizer, spec.device == "cuda"
    cap = None if on_gpu else cap_bytes
    out: dict = {"rank": rank}
    kernel = ring_attention_kernel(layout, spec, seq)
    if kernel is not None:
        out["attention_kernel"] = kernel

    def step():
        optimizer.zero_grad(set_to_none=True)
        with run.region():
            loss = run.forward()
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
                out["loss"] = run.loss_value(loss)
        out["step_times"] = times[spec.warmup:]
    else:  # not under the cap: DTensor's first call of an op propagates its sharding on fake global-shape tensors
        out["loss"] = run.loss_value(step())

    # the measured step: memory and communication
    optimizer.zero_grad(set_to_none=True)
    resident = resident_bytes(model, optimizer)
    tracker = LiveTensorBytes(cap=cap, base=resident, record_shapes=False, count_resizes=run.fsdp)
    counter, sent = FunctionalCollectiveCounter(strict=not run.fsdp), SentBytes(run.groups)
    dist.barrier()
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()
    try:
        with count_comm() as stats, recording(sent), counter, (contextlib.nullcontext() if on_gpu else tracker):
            with run.region():
                loss = run.forward()
                activation = (torch.cuda.memory_allocated() - resident) if on_gpu else tracker.live
                loss.backward()
            optimizer.step()
    except Exception as exc:  # past the cap: name the largest tensors alive then (the probe's reason carries them)
        oom = _oom_in(exc)
        if oom is None or on_gpu or not tracker.largest:
            raise
        first = str(oom).splitlines()[0]
        raise MemoryCapExceeded(f"{first}; largest live: {describe_largest(tracker.largest)}") from exc
    if on_gpu:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resident + tracker.peak
    if cap is not None and peak > cap:  # reached by a storage resize (FSDP's gathers), which does not check the cap
        raise MemoryCapExceeded(f"tracked memory peaked at {peak} bytes (resident {resident}), over the cap of {cap}; "
                                f"largest live: {describe_largest(tracker.largest)}")
    snapshot = stats.snapshot()
    for kind, value in counter.stats.snapshot().items():
        snapshot[kind] = {"calls": snapshot[kind]["calls"] + value["calls"],
                          "bytes": snapshot[kind]["bytes"] + value["bytes"]}
    if counter.uncounted:  # torch's ring passes dK/dV on with all_to_all_single (a kind comm.KINDS does not have)
        snapshot["all_to_all_single"] = {"calls": len(counter.uncounted),
                                         "bytes": sum(nbytes for _, nbytes in counter.uncounted)}
    if not on_gpu:
        out["largest"] = tracker.largest  # the largest tensors alive at the step's peak
    out.update(resident_bytes=resident, activation_bytes=activation, peak_bytes=peak, comm=snapshot,
               sent_bytes=sent.total(counter), measured_loss=run.loss_value(loss))
    out.setdefault("loss", out["measured_loss"])
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
    if reason is None and is_rival(layout) and get_rival(layout).hf_weights:
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


def describe_largest(largest: list[dict] | None, n: int = 3) -> str:
    """``largest`` (:attr:`~lightning_tp2d.planning.live.LiveTensorBytes.largest` entries) in one line:
    ``[4096, 32000] float32 500.0 MiB (mm), ...``."""
    return ", ".join(f"{list(e['shape'])} {e['dtype']} {e['bytes'] / 2**20:.1f} MiB ({e['op']})"
                     for e in (largest or [])[:n])


def ring_attention_kernel(layout: str, spec: BenchSpec, seq: int) -> str | None:
    """The per-block kernel a ring layout's attention uses in this process (:func:`lightning_tp2d.metp.block_kernel`),
    ``None`` for layouts without ring attention."""
    if is_rival(layout) or not layouts.get_layout(layout).zigzag:  # ring attention: the zigzag layouts
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
    top = max(ranks, key=lambda r: r["peak_bytes"])
    if top.get("largest"):
        row["largest"] = top["largest"]  # on the rank with the highest peak, at that peak
    row["comm_calls"] = max(sum(v["calls"] for v in r["comm"].values()) for r in ranks)
    row["comm_bytes"] = max(sum(v["bytes"] for v in r["comm"].values()) for r in ranks)
    row["sent_bytes"] = max(r["sent_bytes"] for r in ranks)  # what the rank that sends most puts on the wire
    row["sent_bytes_per_token"] = row["sent_bytes"] / (spec.batch * seq)
    cfg = spec.config(seq)
    rival = get_rival(layout) if is_rival(layout) else None
    if not (rival is not None and rival.hf_weights) and isinstance(cfg, GPT2Config):  # the cost model describes GPT-2
        if rival is None:  # every rank is compared with its own count: trace them in one go
            trace_steps(layout, cfg, spec.batch, seq, p, spec.elem, range(p))
        model_events = [cost_model.comm_events(layout, cfg, spec.batch, seq, p, spec.elem, rank=r) for r in range(p)]
        predicted = [totals(ev) for ev in model_events]
        row["model_comm_bytes"] = max(sum(v["bytes"] for v in t.values()) for t in predicted)
        row["wire_bytes"] = max(wire_bytes(ev) for ev in model_events)
        # exact only in float32 and without checkpointing (the model does not count recomputation's collectives)
        if spec.dtype == "float32" and (rival is not None or spec.activation_checkpointing == "none"):
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
    if is_rival(layout):
        count = lambda n: sum(e.calls for e in cost_model.comm_events(layout, replace(cfg, n_layer=n), batch, seq,  # noqa: E731
                                                                       p, elem))
        return count(2) - count(1)
    if cfg.n_layer < 2:
        cfg = replace(cfg, n_layer=2)
    steps = trace_steps(layout, cfg, batch, seq, p, elem, layouts.get_layout(layout).distinct_ranks(p))
    return max(step.block_calls for step in steps.values())


def max_sequence(layout: str, p: int, spec: BenchSpec, cap_bytes: int, unit: int = 64, limit: int = 1 << 17,
                 log=print) -> dict:
    """Largest multiple of ``unit`` (rounded to what the layout needs) that trains one step under the cap, with
    its peak and bytes sent per token; every probe's too.

    Doubling from ``unit`` until a probe fails, then bisection; every probe is a fresh process group."""
    world = ranks_of(layout, p)
    batch, granule = input_multiples(layout, world, spec.cp_tp_size)  # the smallest batch; sequences: the granule
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
                       "sent_bytes": r.get("sent_bytes"), "sent_bytes_per_token": r.get("sent_bytes_per_token"),
                       "largest": r.get("largest"), "reason": r.get("reason", "")})
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
    longest = next(x for x in probes if x["seq"] == lo and x["status"] == "ok")  # what the answer costs
    over = min((x for x in probes if x["status"] == "oom"), key=lambda x: x["seq"], default=None)
    return {**row, "status": "ok", "max_seq": lo, "capped_by_limit": lo >= limit, "peak_bytes": longest["peak_bytes"],
            "sent_bytes_per_token": longest["sent_bytes_per_token"], "largest": longest.get("largest"),
            "over_cap": None if over is None else {"seq": over["seq"], "reason": over["reason"]}, "probes": probes}

