"""Predicted peak bytes of one training step per rank, for a layout, tensor size ``p``, ``dp`` replicas, ZeRO stage
and activation checkpointing: what exists before the step (parameters, optimizer state) plus the peak of what the
step allocates, profiled on fake tensors; with the sizes of its parts.

The step is the one :func:`lightning_tp2d.bench.measure.step_peak_bytes` measures (an AdamW with ``foreach``, or
``fused`` as the package runs it on a GPU and the planner prices it, float32 parameters): ``zero_grad(set_to_none=True)``, forward, backward, data-parallel averaging, global-norm
clipping, ``step``; its peak is the resident bytes plus :class:`~lightning_tp2d.planning.live.LiveTensorBytes`'s
(``count_resizes``). ``tests/test_memory_model.py`` and ``recipes/benchmarks/memory_model.py`` compare the two on 8
gloo ranks for every layout x stage {0, 1, 3} x checkpointing.

Where the numbers come from, per rank (``e`` = ``elem``):

* the model is built, parallelized, checkpointed and, at stages 2 and 3 with ``dp > 1``, sharded with
  :func:`lightning_tp2d.fsdp.shard_data_parallel` on torch's fake process group with fake tensors (in the tracer's
  forked worker, :func:`lightning_tp2d.planning.trace.in_worker`, whose fake-tensor caches stay warm): ``parameters`` are the local at-rest bytes; the tensor-shard bytes of each FSDP group (one per block,
  one for the root) are what FSDP gathers; the bytes of a block's input are what full checkpointing keeps per block;
* ``step``: the same :class:`~lightning_tp2d.planning.live.LiveTensorBytes` over the fake step (forward, backward,
  GradientSync's buckets at stages 0 and 1, FSDP's gathers and reduce-scatters, clipping, AdamW's step with its
  foreach temporaries and at stage 1 the all-gather of the updated slices), after FSDP's lazy initialisation and a
  step that creates AdamW's state: the live bytes over time, so activations freed as gradients appear are not counted beside them.
  The model is built with its own depth up to 5 blocks; deeper, with 4 and 5 and each phase's peak (the forward
  and the root's backward, the backward of each of the last two blocks and of blocks 1 and 0, what follows the
  backward) extended linearly (:func:`_extrapolated_step`);
* ``total`` = ``parameters`` + ``optimizer`` + ``step``. The other parts are sizes, never all alive at once:
* ``gradients``: equal to the parameters (float32, like them); at stages 2 and 3 the dp shards;
* ``optimizer``: AdamW's two float32 moments per element held: ``2 x parameters``; stage 1 keeps ``1 / dp`` of
  them (:func:`lightning_tp2d.zero.shard_optimizer_state`: an even split of the flat state);
* ``activations``: traced with the same ``checkpointing`` (:func:`lightning_tp2d.planning.trace.trace_step`'s
  ``activation_bytes``, the storages the checkpointed forward keeps for the backward);
* ``gathered`` (stages 2, 3, ``dp > 1``): stage 2 holds every block's and the root's tensor shard from the forward
  to the backward; stage 3 the root's and two blocks' (the one computing and the one prefetched);
* ``backward``: the transient bytes of the backward: one block's saved tensors while ``"full"`` recomputes it (the
  difference of the uncheckpointed two- and one-block traces), the root group's gradients less their dp share and at
  stages 2 and 3 a block's unsharded gradients before their reduce-scatter, at stage 0 with ``dp > 1``
  GradientSync's flat buckets.

Not modelled: allocator fragmentation (a GPU's caching allocator rounds and caches blocks; this is live bytes),
kernel workspaces, communication buffers inside one op.
"""

from __future__ import annotations

import array
import contextlib
import contextvars
import dataclasses
import warnings
import zlib

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_tp2d.planning.closed_memory import closed_form_problem, closed_peak_bytes
from lightning_tp2d.planning.live import LiveTensorBytes, adamw_kernel, tensors_in
from lightning_tp2d.planning.trace import config_key, fake_group, fake_mesh, in_worker, ranks_as_asked, trace_step
from lightning_tp2d.families import anatomy, family_of, family_of_config
from lightning_tp2d.layouts import get_layout
from lightning_tp2d.parallelize import ACTIVATION_CHECKPOINTING
from lightning_tp2d.step import assemble_step, prepare_model
from lightning_tp2d.train_plan import ZERO_STAGES, TrainPlan, fsdp_shards, reshards_after_forward

__all__ = ["Shards", "ParameterSplit", "peak_bytes", "shard_bytes", "parameter_split", "baseline_activation_bytes",
           "baseline_peak_bytes", "loss_input_bytes", "loss_forward_bytes"]


@dataclasses.dataclass(frozen=True)
class Shards:
    """One rank's bytes: parameters at rest, each FSDP group's tensor shard (what FSDP gathers), a block's input, and
    the profiled peak of what one step allocates."""

    at_rest: int  # local parameter bytes this rank holds between steps
    root: int  # tensor-shard bytes of the root group (embeddings, norms, head)
    blocks: tuple[int, ...]  # tensor-shard bytes of each block
    block_input: int  # bytes of one block's input (what full checkpointing saves per block)
    step: int = 0  # peak live bytes the step allocates: forward, backward, data-parallel averaging, clipping
    # the largest tensors alive at that peak (live.largest_entry dicts, largest first; deeper than 5 blocks: those
    # of the 5-block profile in the phase that peaks); reporting only
    largest: tuple = dataclasses.field(default=(), compare=False)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(params) -> int:
    return sum(_local(q).numel() * q.element_size() for q in params)


# The phases of a profiled step, in the order the step runs them (:class:`_PhasePeaks`): the forward and the root's
# backward; the backward of the last block, of the one before it, of the blocks between that and block 1, of block 1,
# of block 0; what follows the backward (data-parallel averaging, clipping, the optimizer's step).
FORWARD, LAST_BLOCK, BLOCK_BEFORE_LAST, MIDDLE_BLOCKS, BLOCK_1, BLOCK_0, AFTER_BACKWARD = range(7)
_PHASES = 7
EXTRAPOLATED_FROM = (4, 5)  # the depths built for a deeper model (:func:`_extrapolated_step`)


def _block_phase(i: int, layers: int) -> int:
    """The phase of block ``i``'s backward in a model of ``layers`` blocks (the backward runs them last to first)."""
    if i == 0:
        return BLOCK_0
    if i == layers - 1:
        return LAST_BLOCK
    if i == layers - 2:
        return BLOCK_BEFORE_LAST
    return BLOCK_1 if i == 1 else MIDDLE_BLOCKS


class _PhasePeaks(LiveTensorBytes):
    """Live bytes of a fake step with the peak of each phase (:data:`FORWARD` ... :data:`AFTER_BACKWARD`;
    :func:`_extrapolated_step`)."""

    def __init__(self, mode) -> None:
        super().__init__(record_shapes=False, count_resizes=True, fake=mode)
        self.phase, self.peaks, self.tracing = 0, [0] * _PHASES, True
        self.series = array.array("q")  # the live bytes at every rise, in order (:func:`_at_batch`)
        self.starts = [0] * _PHASES  # where each phase's rises begin in ``series``
        self.kinds: list[str] = []
        self.phase_largest: list[list[dict]] = [[] for _ in range(_PHASES)]  # the largest tensors at each phase's peak

    def _track(self, t: torch.Tensor) -> None:
        self.kinds.append(f"{t.ndim}{t.dtype}")  # what the step allocates, batch aside (:func:`_at_batch`)
        super()._track(t)

    def signature(self) -> int:
        return zlib.crc32(";".join(self.kinds).encode())

    def enter(self, phase: int) -> None:
        if phase > self.phase:
            self.starts[self.phase + 1:phase + 1] = [len(self.series)] * (phase - self.phase)
            self.phase = phase
        self._rose()

    def _rose(self) -> None:
        super()._rose()
        if self.live > self.peaks[self.phase]:
            self.peaks[self.phase] = self.live
            self.phase_largest[self.phase] = self.live_largest()
        self.series.append(self.live)


def _marks_backward(block, tracker: _PhasePeaks, phase: int) -> None:
    """When the gradient of the block's output arrives (its backward starts), ``tracker`` enters ``phase``."""

    def hook(module, args, out) -> None:
        if tracker.tracing:  # the forward, not a recomputation in the backward
            for t in tensors_in(out):
                if t.requires_grad:
                    t.register_hook(lambda grad: tracker.enter(phase))

    block.register_forward_hook(hook, prepend=True)  # before FSDP's pre-backward hook


def _shards_here(spec, cfg, batch: int, seq: int, p: int, dp: int, stage: int, checkpointing: str, elem: int,
                 rank: int, fused: bool = False) -> dict:
    """The model of ``cfg`` (built as given: :func:`shard_bytes` asks for 1 to 5 blocks) parallelized, checkpointed
    and sharded as the strategies do (:func:`lightning_tp2d.step.assemble_step`) on the fake process group, its shards read, then one step profiled with
    :class:`_PhasePeaks`: forward and backward under the fake tensors, :class:`~lightning_tp2d.training.GradientSync`
    at stages 0 and 1 (``dp > 1``), global-norm clipping. FSDP's lazy initialisation runs first (a no-grad forward,
    then every group resharded), as the measured step's warm-up does."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # private: see lightning_tp2d._private_api

    fake_group(p * dp, rank)  # the worker's live group when it is this one (shard_bytes: in_worker's group)
    mesh = fake_mesh(spec, p, dp)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        plan = TrainPlan(spec, p, dp, stage, checkpointing, precision="bf16-mixed" if elem == 2 else "32-true")
        model = family_of_config(cfg).model_class(cfg)
        prepare_model(model, mesh, plan)  # parallelized and checkpointed as the strategies do
        model.validate_inputs = False  # fake ids cannot be read
        blocks = list(family_of(model).block_modules(model))
        in_blocks = {id(q) for b in blocks for q in b.parameters()}
        root = _nbytes(q for q in model.parameters() if id(q) not in in_blocks)
        tensor_shards = [_nbytes(b.parameters()) for b in blocks]
        with warnings.catch_warnings():  # stage 2/3 on one replica: nothing to shard (assemble_step warns)
            warnings.simplefilter("ignore", UserWarning)
            step = assemble_step(model, mesh, plan)  # FSDP and GradientSync as the strategies assemble them
        rest = [_nbytes(b.parameters()) for b in blocks]
        at_rest = _nbytes(model.parameters())
        seen: list[int] = []
        blocks[0].register_forward_pre_hook(
            lambda m, args: seen.append(sum(_local(t).untyped_storage().nbytes() for t in tensors_in(args))))
        tracker = _PhasePeaks(mode)
        for i, block in enumerate(blocks):
            _marks_backward(block, tracker, _block_phase(i, len(blocks)))
        idx = torch.zeros(batch, seq, dtype=torch.long)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=elem == 2)
        if plan.fsdp:  # FSDP's lazy init (its buffers exist before the measured step), then all resharded
            with torch.no_grad(), autocast:
                model(idx, idx)
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **adamw_kernel(fused))
        step.shard_optimizer(optimizer)  # (stages 2/3: the parameters FSDP keeps whole, as the strategies do)
        for q in model.parameters():  # a step on zero gradients: AdamW's state exists before the profiled one
            q.grad = torch.zeros_like(q)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with tracker:
            with autocast:
                loss = model(idx, idx)
            tracker.tracing = False
            loss.backward()
            tracker.enter(AFTER_BACKWARD)
            if step.gradient_sync is not None:
                step.gradient_sync.finish()
            step.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        return {"root_at_rest": at_rest - sum(rest), "rest": rest, "root": root, "tensor_shards": tensor_shards,
                "block_input": seen[0], "phases": tracker.peaks, "series": tracker.series, "starts": tracker.starts,
                "signature": tracker.signature(), "largest": tracker.phase_largest}


def _at_batch(a: dict, b: dict, batch_a: int, batch_b: int, batch: int) -> dict | None:
    """The profile at ``batch`` sequences, between ``batch_a`` and ``batch_b``, from the two profiles of the same
    model there; ``None`` when they do not make one. The step's choices that depend on sizes (e.g. SUMMA streams a
    weight column when it outweighs the activation block) each switch once as the batch grows, so when the two
    profiles allocate tensors of the same ranks and dtypes in the same order, rise as often and start their phases
    at the same rises (the check), every batch between them runs the same ops on the same tensors, each tensor's
    bytes constant or proportional to the batch: the live bytes at every rise are affine in it, each exactly an
    integer at ``batch`` (else: ``None``), and each phase's peak is the largest of them. What holds no activation
    (parameters, shards) must be equal."""
    if not (batch_a < batch < batch_b or batch_b < batch < batch_a):
        return None
    if (len(a["series"]) != len(b["series"]) or a["starts"] != b["starts"] or a["signature"] != b["signature"]
            or any(a[k] != b[k] for k in ("root_at_rest", "rest", "root", "tensor_shards"))):
        return None
    span, step = batch_b - batch_a, batch - batch_a
    series = array.array("q")
    for x, y in zip(a["series"], b["series"]):
        value, exact = divmod(x * span + (y - x) * step, span)
        if exact:
            return None
        series.append(value)
    block_input, exact = divmod(a["block_input"] * span + (b["block_input"] - a["block_input"]) * step, span)
    if exact:
        return None
    starts = a["starts"]
    ends = starts[1:] + [len(series)]
    phases = [max(series[i:j], default=0) for i, j in zip(starts, ends)]  # (a phase never entered: 0)
    largest = [_largest_at(x, y, span, step) for x, y in zip(a["largest"], b["largest"])]
    return dict(a, block_input=block_input, phases=phases, series=series, largest=largest)


def _largest_at(a: list[dict], b: list[dict], span: int, step: int) -> list[dict]:
    """A phase's largest tensors between two batches (:func:`_at_batch`): each entry's bytes and sizes read off the
    line through ``a``'s and ``b``'s (the same ops, dtypes and ranks in the same order, each exact), else ``[]``
    (not known there). Reporting only."""
    out = []
    if len(a) != len(b):
        return []
    for x, y in zip(a, b):
        if (x["op"], x["dtype"], len(x["shape"])) != (y["op"], y["dtype"], len(y["shape"])):
            return []
        values = [divmod(u * span + (v - u) * step, span) for u, v in
                  zip((x["bytes"], *x["shape"]), (y["bytes"], *y["shape"]))]
        if any(rest for _, rest in values):
            return []
        out.append(dict(x, bytes=values[0][0], shape=tuple(v for v, _ in values[1:])))
    return sorted(out, key=lambda e: -e["bytes"])


def _depths(layers: int) -> tuple[int, ...]:
    """The depths built for a model of ``layers`` blocks: itself up to 5, else :data:`EXTRAPOLATED_FROM`
    (:func:`_extrapolated_step`)."""
    return (layers,) if layers <= max(EXTRAPOLATED_FROM) else EXTRAPOLATED_FROM


def _extrapolated_step(built: list[dict], layers: int) -> int:
    """The step's peak at ``layers`` blocks from the profiles of :func:`_depths`: the largest phase peak of a model
    built whole; deeper, each phase's peak read at 4 and 5 blocks and extended linearly, the largest taken.

    Blocks are identical, so a block added shifts every later point of the step by the same bytes: what a block
    holds from its forward to its backward (its saved activations, its input under full checkpointing), then its
    gradients (whole, or FSDP's dp shards) and whatever follows from them (GradientSync's buckets, AdamW's foreach
    temporaries). Each phase that is one block's backward, or what precedes or follows the backward, therefore peaks
    at an affine function of the depth; the blocks between the one before last and block 1 peak affinely in their
    position too, so never above those two. Each phase needs its own line: one phase's peak overtakes another's as
    the depth grows (2d-metp at ZeRO 3 with full checkpointing, Llama 3.1 8B's width: block 0's backward peaks
    highest up to 7 blocks, the optimizer's step from 8), so a line through the whole step's peaks at two depths --
    or through a phase that runs several of these situations, as the earlier three phases did -- misses the later
    slope (at 126 blocks it put a ring of 8 at ZeRO 3 at 216 GiB per GPU for Llama 3.1 405B; the step holds a third
    of that)."""
    return _phase_peaks(built, layers)[_peak_phase(built, layers)]


def _phase_peaks(built: list[dict], layers: int) -> dict[int, int]:
    """Each phase's peak at ``layers`` blocks (:func:`_extrapolated_step`), by phase."""
    if len(built) == 1:
        return dict(enumerate(built[0]["phases"]))
    shallow, deep = (p["phases"] for p in built)
    extend = layers - EXTRAPOLATED_FROM[1]
    return {phase: y + extend * (y - x) for phase, (x, y) in enumerate(zip(shallow, deep)) if phase != MIDDLE_BLOCKS}


def _peak_phase(built: list[dict], layers: int) -> int:
    """The phase whose peak is the step's (the first of equals)."""
    peaks = _phase_peaks(built, layers)
    return max(peaks, key=lambda phase: (peaks[phase], -phase))


def _extrapolated(built: list[dict], layers: int) -> Shards:
    first = built[0]
    rest, shards = first["rest"], first["tensor_shards"]
    largest = built[-1].get("largest") or [[]] * _PHASES
    return Shards(first["root_at_rest"] + rest[0] + (layers - 1) * rest[-1], first["root"],
                  (shards[0], *(shards[-1],) * (layers - 1)), first["block_input"], _extrapolated_step(built, layers),
                  tuple(largest[_peak_phase(built, layers)]))


_SHARDS: dict[tuple, dict[int, dict]] = {}  # per model shape and rank: the profiles built, by batch
_DERIVED: dict[tuple, dict[int, dict]] = {}  # ... and those read from two of them (:func:`_at_batch`)


def _profile(spec, built, batch: int, seq: int, p: int, dp: int, stage: int, checkpointing: str, elem: int,
             rank: int, fused: bool = False) -> dict:
    """:func:`_shards_here`'s profile of rank ``rank``: cached; read from the nearest profiles of the same model at a
    smaller and a larger batch when they make one (:func:`_at_batch`: exact; the planner builds a configuration's
    least and largest micro-batch, then asks for those between), else built in the worker kept for the group."""
    shape = (type(spec), spec.options, config_key(built), seq, p, dp, stage, checkpointing, elem, rank, fused)
    made, derived = _SHARDS.setdefault(shape, {}), _DERIVED.setdefault(shape, {})
    if batch in made or batch in derived:
        return made.get(batch) or derived[batch]
    below, above = [m for m in made if m < batch], [m for m in made if m > batch]
    if below and above:
        got = _at_batch(made[max(below)], made[min(above)], max(below), min(above), batch)
        if got is not None:
            derived[batch] = got
            return got
    if dist.is_initialized():
        raise RuntimeError("shard_bytes builds the model on its own fake process group; call it from a process "
                           "without a default process group")
    try:
        made[batch] = in_worker(_shards_here, spec, built, batch, seq, p, dp, stage, checkpointing, elem, rank, fused,
                                group=(p * dp, rank))
    except RuntimeError as err:
        raise RuntimeError(f"building layout {spec.name!r} on the fake process group failed: {err}") from None
    return made[batch]


def shard_bytes(layout, cfg, batch: int, seq: int, p: int, *, dp: int = 1, zero_stage: int = 0,
                checkpointing: str = "none", elem: int = 4, ranks=None, fused: bool = False) -> dict[int, Shards]:
    """:class:`Shards` of the tensor-parallel ranks ``ranks`` (default: all ``p``) of the first replica, by rank,
    read from the model built (1 to 5 blocks, :func:`_depths`; deeper models extrapolated) on the fake process group
    in a worker process kept for the group (:func:`lightning_tp2d.planning.trace.in_worker`; this process must have no
    default process group). Cached per rank and model shape; a third batch of one shape is read from two profiles
    (:func:`_profile`). ``fused``: the step's AdamW is the fused kernel (as :class:`~lightning_tp2d.CausalLMModule`
    runs it on a GPU), else the foreach one (the measured CPU steps')."""
    spec = get_layout(layout)
    wanted = list(range(p) if ranks is None else ranks)
    out = {}
    for rank in wanted:
        built = [_profile(spec, dataclasses.replace(cfg, n_layer=depth), batch, seq, p, dp, zero_stage, checkpointing,
                          elem, rank, fused) for depth in _depths(cfg.n_layer)]
        out[rank] = _extrapolated(built, cfg.n_layer)
    return out


_CLOSED_FORMS: contextvars.ContextVar[bool] = contextvars.ContextVar("closed_forms", default=False)


@contextlib.contextmanager
def closed_forms(enabled: bool = True):
    """Inside, :func:`peak_bytes` answers from :func:`~lightning_tp2d.planning.closed_memory.closed_peak_bytes`
    (arithmetic on the config, milliseconds) for every step that closed form models, and profiles the rest as
    outside (``closed_form_problem`` says which). Nests; ``enabled=False`` turns it off inside an enclosing one."""
    token = _CLOSED_FORMS.set(enabled)
    try:
        yield
    finally:
        _CLOSED_FORMS.reset(token)


def peak_bytes(layout, cfg, batch: int, seq: int, p: int, *, dp: int = 1, zero_stage: int = 0,
               checkpointing: str = "none", elem: int = 4, rank: int | None = None, ranks=None,
               fused: bool = False) -> dict:
    """Predicted peak bytes of one step on tensor-parallel rank ``rank`` (``None``: the rank with the largest
    total; ``ranks``: the largest over these): ``{"parameters", "gradients", "optimizer", "activations", "gathered",
    "backward", "step", "total", "largest"}`` (module docstring; ``largest``: the largest tensors alive at the
    step's peak, :attr:`Shards.largest`, reporting only). ``batch`` is per replica. ``fused``: AdamW's fused step (a
    GPU's), whose only temporaries are per kernel, instead of the foreach step, which holds a float32 copy of the
    parameters (``sqrt`` of the second moments) at once: at ZeRO 3 in a deep model the step's peak. Inside
    :func:`closed_forms`, a step :mod:`~lightning_tp2d.planning.closed_memory` models is answered by its arithmetic
    (the same keys, ``largest`` naming parts, plus ``"phases"``), the rest profiled."""
    if checkpointing not in ACTIVATION_CHECKPOINTING:
        raise ValueError(f"checkpointing={checkpointing!r} is not one of {ACTIVATION_CHECKPOINTING}")
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage={zero_stage!r} is not one of {', '.join(map(str, ZERO_STAGES))}")
    ranks = [rank] if rank is not None else list(range(p) if ranks is None else ranks)
    if _CLOSED_FORMS.get() and not closed_form_problem(layout, cfg, batch, seq, p, dp=dp, zero_stage=zero_stage,
                                                       checkpointing=checkpointing, elem=elem, fused=fused):
        return max((closed_peak_bytes(layout, cfg, batch, seq, p, dp=dp, zero_stage=zero_stage,
                                      checkpointing=checkpointing, elem=elem, rank=r, fused=fused) for r in ranks),
                   key=lambda d: d["total"])
    shards = shard_bytes(layout, cfg, batch, seq, p, dp=dp, zero_stage=zero_stage, checkpointing=checkpointing,
                         elem=elem, ranks=ranks, fused=fused)
    with ranks_as_asked():  # the activations of these ranks only (a small group's others are not asked for)
        parts = [_parts(layout, cfg, batch, seq, p, dp, zero_stage, checkpointing, elem, r, shards[r]) for r in ranks]
    return max(parts, key=lambda d: d["total"])


def _parts(layout, cfg, batch, seq, p, dp, stage, checkpointing, elem, rank, s: Shards) -> dict:
    sharded = fsdp_shards(stage, dp)
    params = s.at_rest
    grads = params  # float32 gradients of what this rank holds (dp shards at stages 2 and 3)
    optimizer = 2 * params // (dp if stage == 1 else 1)
    activations = trace_step(layout, cfg, batch, seq, p, elem, rank, checkpointing=checkpointing).activation_bytes
    recompute = 0
    if checkpointing == "full":  # one block's saved tensors, recomputed: what the uncheckpointed trace saves per block
        plain = trace_step(layout, cfg, batch, seq, p, elem, rank)
        one = trace_step(layout, dataclasses.replace(cfg, n_layer=1), batch, seq, p, elem, rank)
        recompute = (plain.activation_bytes - one.activation_bytes) // max(1, cfg.n_layer - 1) if cfg.n_layer > 1 \
            else one.activation_bytes  # n_layer 1: the whole step's, an overestimate of one block's
    gathered = 0
    if sharded:  # FSDP gathers in the compute dtype under bf16 (fsdp.mixed_precision_policy: param_dtype bf16)
        gathered = (s.root + (sum(s.blocks) if stage == 2 else sum(sorted(s.blocks)[-2:]))) * min(elem, 4) // 4
    full_grads = s.root + sum(s.blocks)  # the tensor shards' gradients, before any dp reduction
    if sharded:
        transient = s.root + max(s.blocks)  # root's and one block's unsharded gradients before the reduce-scatter
    elif dp > 1:
        transient = full_grads  # GradientSync's flat buckets
    else:
        transient = 0
    backward = recompute + transient
    total = params + optimizer + s.step
    return {"parameters": params, "gradients": grads, "optimizer": optimizer, "activations": activations,
            "gathered": gathered, "backward": backward, "step": s.step, "total": total, "largest": list(s.largest)}


# ---- the 1-D baseline: torch's tensor parallelism with sequence parallelism x FSDP (torchtitan's recipe) --------


@dataclasses.dataclass(frozen=True)
class ParameterSplit:
    """Parameter counts of a model: the root (embeddings, final norm, head) and one block, each with how many of
    them are vectors (norm weights, biases: replicated by 1-D tensor parallelism); of the root, ``vocab`` the
    elements of the matrices 1-D tensor parallelism splits by vocabulary rows (the token embedding and an untied
    head; a position table stays whole on every rank) and ``embedding`` the input embedding's when the head is untied
    (then torchtitan's FSDP wraps it alone; 0 when tied)."""

    root: int
    root_vectors: int
    block: int
    block_vectors: int
    n_layer: int
    vocab: int = 0
    embedding: int = 0

    @property
    def total(self) -> int:
        return self.root + self.n_layer * self.block

    def root_shard(self, tp: int) -> float:
        """Root elements one of ``tp`` tensor ranks holds in the 1-D baseline: ``1 / tp`` of the vocabulary rows."""
        return self.vocab / tp + self.root - self.vocab

    def block_shard(self, tp: int) -> float:
        """Block elements one of ``tp`` tensor ranks holds: ``1 / tp`` of every matrix, the vectors whole."""
        return (self.block - self.block_vectors) / tp + self.block_vectors


_SPLITS: dict[tuple, ParameterSplit] = {}


def parameter_split(cfg) -> ParameterSplit:
    """Counted from the plain model of ``cfg``'s family built with one block on the meta device (no memory)."""
    key = config_key(cfg)
    if key not in _SPLITS:
        with torch.device("meta"):
            model = family_of_config(cfg).model_class(dataclasses.replace(cfg, n_layer=1))
        block = next(iter(family_of(model).block_modules(model)))
        in_block = {id(q) for q in block.parameters()}
        params = list(model.parameters())
        root = [q for q in params if id(q) not in in_block]
        head = model.lm_head.weight
        embedding = next(m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)
                         and m.weight.shape[0] == head.shape[0])
        tied = embedding is head
        _SPLITS[key] = ParameterSplit(sum(q.numel() for q in root), sum(q.numel() for q in root if q.ndim == 1),
                                      sum(q.numel() for q in block.parameters()),
                                      sum(q.numel() for q in block.parameters() if q.ndim == 1), cfg.n_layer,
                                      vocab=embedding.numel() * (1 if tied else 2),
                                      embedding=0 if tied else embedding.numel())
    return _SPLITS[key]


def baseline_activation_bytes(cfg, batch: int, seq: int, tp: int, *, checkpointing: str = "none", elem: int = 2,
                              ep: int | None = None, composite: bool = False, sequence_parallel: bool = True) -> dict:
    """Bytes one rank's forward saves for the backward in the 1-D baseline (``"tp1d-sp"``: torch's colwise /
    rowwise styles with sequence-parallel norms, loss parallel, as torchtitan's ``parallelize_llama`` applies them),
    counted from the tensors its ops save; ``{"blocks", "root", "recompute", "total"}``. ``N = batch * seq`` tokens,
    ``t = tp``, ``e = elem`` (matmul operands and outputs), ``ep`` the residual stream, norm inputs and loss
    (default ``e``: under FSDP's bf16 ``param_dtype`` torchtitan's whole forward runs in bf16; 4 under autocast).

    Per block, ``"none"``: each norm's input ``N h ep / t`` and ``rstd`` ``4 N / t``; each all-gathered norm
    output ``N h e`` (the column-parallel linears save their gathered input, shared); attention's q, k, v after
    RoPE and its output ``N (h + 2 kv + h) e / t`` (RoPE saves only its tables) and log-sum-exp ``4 N H / t``;
    the MLP's hidden activations, ``e N I / t`` each: SwiGLU gate, up, ``silu(gate)`` and their product (4), GELU
    pre-activation and output (2, ``I = 4h``). ``"full"``: each block's input ``N h ep / t``, plus one block's
    ``"none"`` bytes while it is recomputed (``recompute``). ``"selective"`` (torchtitan's per-op policy: the
    outputs of every other matmul, attention and the reduce-scatters are kept): the kept matmuls' outputs (``q``,
    ``v``, ``gate``, and ``down``'s unreduced ``[N, h]``; GPT-2 ``c_attn``, ``c_fc``), attention's output and
    log-sum-exp, the two reduce-scatter outputs ``N h e / t`` and the block input; ``recompute`` the rest of one
    block. Root: the final norm's input and statistics, its gathered output ``N h e``, the float32 log-softmax of
    the local logits ``4 N ceil(V/t)`` (torchtitan upcasts the logits for the loss; the bf16 logits are not saved),
    the ids. For GPT-2 in float32 this is :func:`lightning_tp2d.planning.cost_model.activation_bytes`'s ``"tp1d-sp"``
    count, which ``tests/test_cost_model.py`` checks against measured runs. ``composite``: the model as this
    package's eager code computes it (what the CPU check measures): Llama's RMSNorm, made of elementwise ops, saves
    its input upcast to float32 (``N h max(ep, 4) / t``) and its normalized output ``N h ep / t``, and each attention
    its RoPE tables, float32 ``cos`` and ``sin`` ``8 T hs`` or, when q is in another dtype, the four copies cast for
    q and for k ``4 T hs e`` (torchtitan fuses the norm and keeps one table for the model: neither is counted by
    default); both families' head hands its logits to the loss uncast, so the saved log-softmax is in ``ep``
    bytes (:func:`loss_input_bytes`). ``sequence_parallel=False``: ``"tp1d"``
    (torch's styles without sequence parallelism), whose norms run on the whole sequence on every rank: their
    inputs, statistics (and composite outputs) are not divided by ``t``; everything else is the same."""
    if checkpointing not in ACTIVATION_CHECKPOINTING:
        raise ValueError(f"checkpointing={checkpointing!r} is not one of {ACTIVATION_CHECKPOINTING}")
    ep = elem if ep is None else ep
    h, H, V, L = cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.n_layer
    t, e, N = tp, elem, batch * seq
    s = tp if sequence_parallel else 1  # what sequence parallelism shards: the norms' inputs and statistics
    a = anatomy(cfg)
    kv, inner = a.kv_width, a.mlp_width
    stats = (4 if a.rms_norm else 8) * N  # RMSNorm's rstd; LayerNorm's mean and rstd (float32)
    eager_norm = composite and a.rms_norm
    extra_norm = N * h * ep / s if eager_norm else 0  # the composite RMSNorm's normalized output
    norm_in = max(ep, 4) if eager_norm else ep  # the composite RMSNorm saves its input upcast to float32
    norms = 2 * (N * h * norm_in + stats) / s + 2 * extra_norm
    gathered = 2 * N * h * e
    attention = N * (h + 2 * kv + h) * e / t + 4 * N * H / t
    if composite and a.rotary:  # float32 cos and sin per attention, or, in another dtype, their copies cast for q and k
        attention += 2 * seq * (h // H) * (4 if e == 4 else 2 * e)
    mlp = (4 if a.gated_mlp else 2) * N * inner * e / t  # SwiGLU: gate, up, their product, its input; GELU: two
    plain = norms + gathered + attention + mlp
    block_input = N * h * ep / s
    if checkpointing == "none":
        per_block, recompute = plain, 0.0
    elif checkpointing == "full":
        per_block, recompute = block_input, plain
    else:
        kept_mm = N * e * ((h + kv + inner) / t + h) if a.gated_mlp else N * e * (3 * h + inner) / t
        kept = kept_mm + N * h * e / t + 4 * N * H / t + 2 * N * h * e / t + block_input
        per_block, recompute = kept, max(0.0, plain - kept)
    vocab = -(-V // t)
    # the final norm's input and statistics, its gathered output, the log-softmax of the local logits (float32, or
    # composite: in the loss's input dtype, loss_input_bytes), the ids (GPT-2: its position ids 8 T; over several
    # ranks the embedding's masked copy of the ids, 8 N)
    root = ((N * h * norm_in + stats) / s + extra_norm + N * h * e + loss_input_bytes(ep, composite) * N * vocab
            + (0 if a.rotary else 8 * seq) + (8 * N if t > 1 else 0))
    total = L * per_block + root
    return {"blocks": int(L * per_block), "root": int(root), "recompute": int(recompute), "total": int(total)}


def loss_input_bytes(ep: int, composite: bool) -> int:
    """Bytes per element of the local logits the vocab-parallel log-softmax reads, and so of the output it saves:
    torchtitan upcasts the logits to float32 before the loss (``max(ep, 4)``); this package's head passes them as
    they are, in ``ep`` (bf16 under FSDP's bf16 ``param_dtype``; float32 under autocast, which runs log-softmax in
    float32)."""
    return ep if composite else max(ep, 4)


def loss_forward_bytes(elem: int, ep: int, composite: bool) -> int:
    """Peak bytes per element of the local logits ``[N, ceil(V/t)]`` while the loss's forward runs: the logits
    (``elem``) when the loss reads a cast copy of them, the loss input (:func:`loss_input_bytes`), the float32 copy
    torch's ``_log_softmax`` makes of a half input, its float32 shifted logits and their exponentials (or the
    output after the sum frees them), and a half input's output cast back. Sharded bf16, composite: ``2 + 2 + 4 + 8
    + 2 = 16``; float32: ``12``; under autocast or torchtitan's upcast from bf16: ``14``."""
    li = loss_input_bytes(ep, composite)
    return (elem if li != elem else 0) + li + (4 if li < 4 else 0) + 2 * max(li, 4) + (li if li < 4 else 0)


def baseline_block_backward_bytes(cfg, batch: int, seq: int, tp: int, *, dp: int = 1, zero_stage: int = 3,
                                  checkpointing: str = "none", elem: int = 2, composite: bool = False) -> float:
    """The most a block's backward adds to the saved tensors in the 1-D baseline x FSDP (``dp`` replicas at
    ``zero_stage``; ``tp`` 1: plain FSDP), the ``in_block`` term of :func:`baseline_peak_bytes`: the block's
    recomputed activations (checkpointing), the larger of the MLP's gradients in flight and the unsharded gradients
    beside FSDP's float32 reduce-scatter buffers, the head's gradients already computed, and each finished block's
    gradient shard held while its saved tensors (stage 2: its gathered parameters) are freed. Shared with
    ``cp_peak_bytes``, whose blocks run as plain FSDP's on ``T/p`` tokens."""
    split = parameter_split(cfg)
    root, block = split.root_shard(tp), split.block_shard(tp)
    L, h, N = split.n_layer, cfg.n_embd, batch * seq
    inner = anatomy(cfg).mlp_width
    sharded = fsdp_shards(zero_stage, dp)
    ep = elem if sharded else 4
    acts = baseline_activation_bytes(cfg, batch, seq, tp, checkpointing=checkpointing, elem=elem, ep=ep,
                                     composite=composite)
    plain = baseline_activation_bytes(cfg, batch, seq, tp, elem=elem, ep=ep, composite=composite)["blocks"] / L
    g = elem if sharded else 4  # gradients of FSDP's bf16 parameters are bf16; autocast's parameters stay float32
    reduce = (g + 4) * block + 4 * block / dp if sharded else 0.0
    mlp = g * h * inner / tp + elem * N * inner / tp
    head = root - split.embedding / tp  # the final norm and the head (tied: the embedding too)
    if not sharded:
        head_grads = 4 * head  # float32 gradients, kept where the backward puts them
    elif split.embedding:
        head_grads = 4 * head / dp  # their own group, reduce-scattered when the backward has passed them
    else:
        head_grads = g * root  # the root group's, reduce-scattered at the very end
    kept = acts["blocks"] / L  # what a block keeps for its backward, freed with it
    # per block whose backward is over: its gradient (shard) held, its saved tensors and (stage 2) its gathered
    # parameters freed: FSDP reshards a group after its backward
    done = 4 * block / (dp if sharded else 1) - kept - (elem * block if sharded and zero_stage == 2 else 0)
    return acts["recompute"] + max(mlp, reduce - plain) + head_grads + max(0.0, (L - 1) * done)


def baseline_peak_bytes(cfg, batch: int, seq: int, tp: int, *, dp: int = 1, zero_stage: int = 3,
                        checkpointing: str = "none", elem: int = 2, composite: bool = False) -> dict:
    """Predicted peak bytes per GPU of the 1-D baseline (``"tp1d-sp"`` over ``tp`` ranks) x FSDP2 over ``dp``
    replicas at ZeRO ``zero_stage``, grouped as torchtitan's ``apply_fsdp`` groups it
    (:func:`lightning_tp2d.baselines.tp1d_sp.shard_1d_data_parallel`: the input embedding, each block, the final norm
    with the head, the root; a tied head in the root), float32 parameters, gradients and AdamW moments, compute in
    ``elem`` bytes (FSDP's ``param_dtype``; its gradients reduced in float32): the parts of :func:`peak_bytes`.
    Stage 0 or ``dp`` 1 is plain tensor parallelism under autocast (``ep`` 4 for the residual stream, float32
    gradients). Analytic: the saved tensors are those of :func:`baseline_activation_bytes` (``composite`` passed on),
    and, per rank (``root``, ``block``: the tensor shards of :meth:`ParameterSplit.root_shard` /
    :meth:`~ParameterSplit.block_shard`; ``g`` the gradients' bytes, ``e`` sharded, else 4):

    * ``gathered``: stage 3 the root's groups but the embedding (resharded after its forward, gathered again at the
      end of the backward) and two blocks (the one computing and the one prefetched), stage 2 every group, in
      ``e`` bytes; unsharded with ``elem`` < 4 autocast's copies of the weights, saved for the backward;
    * ``loss_forward``: what the loss's forward adds to the saved tensors: its temporaries beyond the saved
      log-softmax (:func:`loss_forward_bytes` less :func:`loss_input_bytes`, per element of the local logits
      ``[N, ceil(V/t)]``) beside FSDP's flat all-gather output of the last group gathered (FSDP2 keeps it until the
      next all-gather: the head's group, tied the last block's); then at stage 3 only the root's groups are
      gathered (the blocks were resharded after their forward), at stage 2 every group;
    * ``backward``: the most the backward adds to the saved tensors at any point, the largest of: the loss's float32
      gradient of the local logits ``4 N ceil(V/t)`` when it starts; in a block's backward the MLP's gradients in
      flight (its down projection's weight gradient ``g h I / t`` and its input's gradient ``e N I / t``) on top of
      the block's recomputed activations (checkpointing); when a block's backward ends, its unsharded gradients
      beside FSDP's float32 reduce-scatter input and output (``(g + 4) block + 4 block / dp``), the block's own
      activations freed by then;
    * at the end of the backward, when the activations are gone: the sharded gradients and the embedding's gradient,
      which torch computes as a replicated ``[V, h]`` on every tensor rank before slicing it.

    ``total`` = parameters + optimizer + the largest of activations + gathered + backward, the loss's forward
    (activations + what is gathered then + ``loss_forward``) and that end point.
    ``tests/test_memory_model.py`` checks it against measured CPU runs of the real step
    (:func:`lightning_tp2d.bench.measure.baseline_measured_peaks`)."""
    if zero_stage not in (0, 2, 3):
        raise ValueError(f"the baseline runs FSDP at zero_stage 2 or 3 (or 0: no data-parallel sharding), "
                         f"got {zero_stage}")
    split = parameter_split(cfg)
    root, block = split.root_shard(tp), split.block_shard(tp)
    L, h, V, N = split.n_layer, cfg.n_embd, cfg.vocab_size, batch * seq
    sharded = fsdp_shards(zero_stage, dp)
    local = (root + L * block) / (dp if sharded else 1)
    params = grads = 4 * local
    optimizer = 8 * local
    ep = elem if sharded else 4
    acts = baseline_activation_bytes(cfg, batch, seq, tp, checkpointing=checkpointing, elem=elem, ep=ep,
                                     composite=composite)
    g = elem if sharded else 4  # gradients of FSDP's bf16 parameters are bf16; autocast's parameters stay float32
    if sharded:
        kept_root = root - (split.embedding / tp if reshards_after_forward(zero_stage, dp) else 0)
        gathered = elem * (kept_root + (L if zero_stage == 2 else min(2, L)) * block)
    else:
        gathered = elem * (root + L * block) if elem < 4 else 0.0
    vocab = N * -(-V // tp)
    loss = 4 * vocab
    # the loss's forward: its temporaries beside the saved log-softmax and, sharded, FSDP's flat all-gather output
    # of the last group gathered (kept until the next all-gather: the head's group, or tied the last block)
    head = root - split.embedding / tp  # the final norm and the head (tied: the embedding too)
    last_gather = (elem * (head if split.embedding else block)) if sharded else 0.0
    loss_forward = (loss_forward_bytes(elem, ep, composite) - loss_input_bytes(ep, composite)) * vocab + last_gather
    in_block = baseline_block_backward_bytes(cfg, batch, seq, tp, dp=dp, zero_stage=zero_stage,
                                             checkpointing=checkpointing, elem=elem, composite=composite)
    # at stage 3 the blocks were resharded after their forward: the loss's forward has the root's groups gathered
    at_loss = elem * kept_root if reshards_after_forward(zero_stage, dp) else gathered
    backward = max(loss, in_block)
    end = grads + gathered + g * V * h
    total = params + optimizer + max(acts["total"] + gathered + backward, acts["total"] + at_loss + loss_forward, end)
    return {"parameters": int(params), "gradients": int(grads), "optimizer": int(optimizer),
            "activations": acts["total"], "gathered": int(gathered), "loss_forward": int(loss_forward),
            "backward": int(backward), "total": int(total)}
