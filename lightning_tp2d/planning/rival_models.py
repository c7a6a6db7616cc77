"""Each side's cost and memory model for :func:`~lightning_tp2d.planning.planner.price`: one object per priced rival
(:data:`lightning_tp2d.rivals.TP1D_SP`, ``CP``, ``CP_TP``, ``ULYSSES``) and one for the package's layouts, all
answering the same questions about a :class:`RowPlan` (what a row runs), so that ``price`` and ``row_memory``
dispatch through :func:`model_of` alone:

* :meth:`~SideModel.check`: the settings it runs with (a ``ValueError`` naming the ones it does not);
* :meth:`~SideModel.micro`: one micro-batch's step (:mod:`~lightning_tp2d.planning.cost_model`), the async TP it
  chose, and the bytes its elementwise ops touch;
* :meth:`~SideModel.memory`: its predicted peak per GPU, with parts;
* :meth:`~SideModel.data_parallel`: how FSDP / ZeRO shards its parameters (over which ranks, gathered again when);
* :meth:`~SideModel.host_name`: the name its host time is priced under (:mod:`~.host_cost`, which reads a rival's
  :attr:`~lightning_tp2d.rivals.Rival.host_ops`).

The arithmetic lives in :mod:`lightning_tp2d.planning.rivals` (what each rival sends and holds), the cost model and
the memory model; this module only says which of it each side is. A new priced rival is a :class:`SideModel`
registered with :func:`register_model` under its :class:`~lightning_tp2d.rivals.Rival`'s name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lightning_tp2d import rivals as registry
from lightning_tp2d.planning import cost_model, gemm_rates
from lightning_tp2d.planning.cost_model import Hardware, collective_time, step_time
from lightning_tp2d.planning.events import Comm
from lightning_tp2d.planning.memory_model import baseline_activation_bytes, peak_bytes
from lightning_tp2d.planning.rivals import (CHUNK_TOKENS, baseline_row_peak_bytes, cp_peak_bytes,
                                            ulysses_peak_bytes)
from lightning_tp2d.layouts import get_layout
from lightning_tp2d.planning.closed_step import models as closed_models
from lightning_tp2d.planning.trace import trace_step
from lightning_tp2d.train_plan import fsdp_shards

ELEMENT = 2  # bf16 compute: the element size every row is priced at (planner.ELEMENT is this)
LOSS_VARIANTS = ("unfused", "chunked")  # the 1-D baseline's loss: the model's head + one cross-entropy, or chunked


@dataclass(frozen=True)
class Sharding:
    """How data parallelism shards one side's parameters (:func:`~lightning_tp2d.planning.planner.data_parallel_time`'s
    arguments): each parameter is first cut over ``tensor`` ranks (its vectors too when ``vectors_cut``, else they
    stay whole on every tensor rank), then FSDP / ZeRO shards it over ``sharding`` replicas of ``ranks`` consecutive
    ranks; ``regathered`` elements are all-gathered again in the backward at stage 3."""

    tensor: int
    vectors_cut: bool
    sharding: int
    ranks: int
    regathered: float = 0.0

    def shard(self, n: float, vectors: float) -> float:
        """Elements of ``n`` (``vectors`` of them in 1-D parameters) that one tensor rank holds before FSDP."""
        return n / self.tensor if self.vectors_cut else (n - vectors) / self.tensor + vectors


@dataclass(frozen=True)
class RowPlan:
    """What one priced row runs (:attr:`PlanRow.plan <lightning_tp2d.planning.planner.PlanRow.plan>`): the side (a
    package layout or a rival), its sizes and its settings. :func:`~lightning_tp2d.planning.planner.price` is asked
    one and returns it as run: ``async_tp`` the one chosen, ``shard_group`` 0 unless the baseline's HSDP splits its
    replicas, ``loss`` the loss the side runs (:meth:`SideModel.loss_label`)."""

    layout: str
    tensor_parallel_size: int
    data_parallel_size: int = 1
    zero_stage: int = 0
    checkpointing: str = "none"
    micro_batch: int = 1  # sequences per replica per micro-batch
    grad_accum: int = 1
    seq: int = 0  # tokens per sequence (0: not said, as a row built by hand)
    activation_offload: bool = False  # checkpointed block inputs in host memory (planner.offload_memory)
    async_tp: bool | None = None  # 1-D TP (the baseline's, cp-tp's): None asks for the faster of blocking and async
    cp_tp_size: int = 2  # "cp-tp": the 1-D TP ranks inside each CP rank
    cp_loss: str = "chunked"  # "cp" / "cp-tp"'s loss: "chunked" (as users run it) or "unfused" (torchtitan's runs)
    # the baseline's HSDP: FSDP over groups of this many replicas, replicated across groups (0: FSDP, or ZeRO, over
    # all data_parallel_size replicas; the package's rows: always 0)
    shard_group: int = 0
    # the baseline's loss, "unfused" (the head's logits, one cross-entropy) or "chunked"; as run, a package row's
    # is "own" (its layout's head and loss) and a CP row's its cp_loss
    loss: str = "unfused"
    # the linears in float8 by this torchao recipe ("tensorwise" / "rowwise"): a layout's parallel.float8, a rival's
    # torchao convert_to_float8_training (cost_model.float8_seconds); None: bf16
    float8: str | None = None
    # pipeline stages (lightning_tp2d.pipeline; torchtitan's PP for a rival): pp x dp x p GPUs, grad_accum the
    # micro-batches of the schedule (planning.pipeline_cost)
    pipeline_parallel_size: int = 1
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1

    @property
    def p(self) -> int:
        return self.tensor_parallel_size

    @property
    def dp(self) -> int:
        return self.data_parallel_size

    @property
    def side(self) -> SideModel:
        """Its cost and memory model (:func:`model_of`)."""
        return model_of(self.layout)

    @property
    def context_parallel_size(self) -> int:
        """``"cp"`` / ``"cp-tp"``: the CP ranks of its ``p`` (the rest, ``p / CP``, 1-D TP + SP inside each); 1
        otherwise."""
        return self.side.context_parallel_size(self.p, self.cp_tp_size)


class SideModel:
    """The package's layouts (module docstring): the traced (or closed-form) step of the layout named ``name``."""

    rival: registry.Rival | None = None
    baseline = False  # a row of the planner's enumerated baseline (PlanRow.baseline)

    def __init__(self, name: str) -> None:
        self.name = name

    @property
    def torch_code(self) -> bool:
        """Its products are torch's own, which inductor pads when compiled (the package's registered ops are not)."""
        return self.rival is not None

    def check(self, r: RowPlan) -> None:
        """A ``ValueError`` naming the settings of ``r`` this side does not run with."""
        if r.shard_group or r.loss != "unfused":
            raise ValueError(f"shard_group and loss price the {registry.TP1D_SP.name!r} baseline, not layout "
                             f"{self.name!r} (got shard_group={r.shard_group}, loss={r.loss!r})")
        if r.async_tp:
            raise ValueError(f"async_tp prices the {registry.TP1D_SP.name!r} baseline, not layout {self.name!r}")

    def inner(self, cp_tp_size: int) -> int:
        """The 1-D TP ranks inside each of its sequence ranks (``"cp-tp"``'s ``cp_tp_size``; 1 otherwise)."""
        return 1

    def micro(self, cfg, r: RowPlan, hw: Hardware, rule) -> tuple[dict, bool, float]:
        """``(step, async_tp, elementwise bytes)`` of one micro-batch of ``r``: ``micro_batch x seq`` tokens on
        ``p`` ranks."""
        micro = step_time(self.on_the_wire(cfg, r), cfg, r.micro_batch, r.seq, r.p, hw, ELEMENT,
                          checkpointing=r.checkpointing, ranks=[0], overlap=rule)
        return micro, False, trace_step(self.name, cfg, r.micro_batch, r.seq, r.p, ELEMENT, 0).activation_bytes

    def on_the_wire(self, cfg, r: RowPlan):
        """The layout whose communication ``r`` is priced with: under ``float8``, the layout with that recipe where
        the closed forms model its float8 wire (the grids, :mod:`~lightning_tp2d.planning.closed_grid`: tensorwise
        operand panels and weight columns at one byte per element, the amax all-reduces; rowwise sends what bf16
        does), else its name (the ring's float8 weight blocks are not modelled: priced in bf16, more bytes than it
        sends)."""
        if r.float8 is None:
            return self.name
        spec = get_layout(self.name).with_float8(r.float8)
        return spec if closed_models(spec, cfg, r.p, ELEMENT) is None else self.name

    def memory(self, cfg, r: RowPlan) -> dict:
        """Predicted peak bytes per GPU of ``r`` with their parts (tensor rank 0; AdamW's fused step)."""
        return peak_bytes(self.name, cfg, r.micro_batch, r.seq, r.p, dp=r.dp, zero_stage=r.zero_stage,
                          checkpointing=r.checkpointing, elem=ELEMENT, ranks=[0], fused=True)

    def data_parallel(self, split, r: RowPlan) -> Sharding:
        return Sharding(tensor=r.p, vectors_cut=True, sharding=r.dp, ranks=r.p)

    def host_name(self, p: int) -> str:
        return self.name

    def context_parallel_size(self, p: int, cp_tp_size: int) -> int:
        return 1

    def loss_label(self, r: RowPlan) -> str:
        """The loss ``r`` runs (its ``loss`` as run): the package's layouts run their own head and loss."""
        return "own"


class _RivalModel(SideModel):
    """A rival's side: the :class:`~lightning_tp2d.rivals.Rival` it prices (its name the row's)."""

    def __init__(self, rival: registry.Rival) -> None:
        super().__init__(rival.name)
        self.rival = rival


class OneDimensional(_RivalModel):
    """torch's 1-D TP + SP x FSDP2 (``"tp1d-sp"``; ``p`` 1: plain FSDP / DDP), the planner's baseline: async TP
    where it is faster (or as asked), HSDP (``shard_group``), ZeRO 1, the unfused or chunked loss."""

    baseline = True

    def check(self, r: RowPlan) -> None:
        if r.loss not in LOSS_VARIANTS:
            raise ValueError(f"loss={r.loss!r} is not one of {LOSS_VARIANTS}")

    def micro(self, cfg, r: RowPlan, hw: Hardware, rule):
        tp, batch, seq, async_tp = r.p, r.micro_batch, r.seq, r.async_tp
        if tp == 1:
            micro = step_time(registry.SINGLE.name, cfg, batch, seq, 1, hw, ELEMENT, checkpointing=r.checkpointing)
            async_tp = False
        else:
            micro = min((step_time(self.name, cfg, batch, seq, tp, hw, ELEMENT, async_tp=a, lean_wire=True,
                                   checkpointing=r.checkpointing, overlap=rule) | {"async_tp": a}
                         for a in ((False, True) if async_tp is None else (async_tp,))),
                        key=lambda m: m["total_s"])
            async_tp = micro["async_tp"]
        if r.loss == "chunked":
            micro = chunked_loss_step(cfg, batch, seq, tp, hw, micro, rule)
        sharded = fsdp_shards(r.zero_stage, r.dp)  # FSDP's bf16 param_dtype: the residual stream is bf16 too
        return micro, async_tp, elementwise_bytes(cfg, batch, seq, tp, ep=ELEMENT if sharded else 4)

    def memory(self, cfg, r: RowPlan) -> dict:
        return baseline_row_peak_bytes(cfg, r.micro_batch, r.seq, r.p, dp=r.dp, zero_stage=r.zero_stage,
                                       shard_group=r.shard_group, checkpointing=r.checkpointing, elem=ELEMENT,
                                       loss=r.loss)

    def data_parallel(self, split, r: RowPlan) -> Sharding:
        # gathered again in the backward at stage 3: its untied embedding (its own FSDP group)
        return Sharding(tensor=r.p, vectors_cut=False, sharding=r.dp, ranks=r.p, regathered=split.embedding / r.p)

    def host_name(self, p: int) -> str:
        return registry.SINGLE.name if p == 1 else self.name

    def loss_label(self, r: RowPlan) -> str:
        return r.loss


class ContextParallel(_RivalModel):
    """torch's context parallelism x FSDP2 at stage 3 (``"cp"``), or with 1-D TP + SP inside each CP rank
    (``"cp-tp"``: CP over ``p / cp_tp_size`` ranks, FSDP2 over those of every replica)."""

    def inner(self, cp_tp_size: int) -> int:
        return cp_tp_size if self.rival.inner_tensor_parallel else 1

    def check(self, r: RowPlan) -> None:
        SideModel.check(self, dataclasses.replace(r, async_tp=False))
        inner = self.inner(r.cp_tp_size)
        if r.zero_stage != 3 or (r.async_tp and inner == 1):
            raise ValueError(f"{self.name!r} runs FSDP2 at zero_stage 3{' and no async TP' if inner == 1 else ''}, "
                             f"got zero_stage={r.zero_stage}, async_tp={r.async_tp}")
        if self.rival.inner_tensor_parallel and (inner < 2 or r.p % inner or r.p // inner < 2):
            raise ValueError(f"{self.name!r} needs cp_tp_size >= 2 dividing p with at least 2 CP ranks, got "
                             f"p={r.p}, cp_tp_size={r.cp_tp_size}")

    def micro(self, cfg, r: RowPlan, hw: Hardware, rule):
        inner = self.inner(r.cp_tp_size)
        ring = r.p // inner
        asked = (False, True) if r.async_tp is None and inner > 1 else (bool(r.async_tp),)
        micro = min((cost_model.cp_step_time(cfg, r.micro_batch, r.seq, ring, hw, ELEMENT, dp=r.dp, tp=inner,
                                             async_tp=a, checkpointing=r.checkpointing, overlap=rule, loss=r.cp_loss)
                     | {"async_tp": a} for a in asked), key=lambda m: m["total_s"])
        return micro, micro["async_tp"], elementwise_bytes(cfg, r.micro_batch, r.seq // ring, inner, ep=ELEMENT)

    def memory(self, cfg, r: RowPlan) -> dict:
        inner = self.inner(r.cp_tp_size)
        return cp_peak_bytes(cfg, r.micro_batch, r.seq, r.p // inner, dp=r.dp, checkpointing=r.checkpointing,
                             elem=ELEMENT, tp=inner, loss=r.cp_loss)

    def data_parallel(self, split, r: RowPlan) -> Sharding:
        # FSDP over the CP ranks of every replica, of each tensor rank's (cp: whole) parameters; the root regathered
        inner = self.inner(r.cp_tp_size)
        root = Sharding(tensor=inner, vectors_cut=False, sharding=1, ranks=1).shard(split.root, split.root_vectors)
        return Sharding(tensor=inner, vectors_cut=False, sharding=r.p // inner * r.dp, ranks=inner, regathered=root)

    def context_parallel_size(self, p: int, cp_tp_size: int) -> int:
        return p // self.inner(cp_tp_size)

    def loss_label(self, r: RowPlan) -> str:
        return r.cp_loss


class Ulysses(_RivalModel):
    """DeepSpeed's Ulysses SP + ALST's tiling x FSDP2 over every rank (``"ulysses"``): stage 3, full
    checkpointing of every layer (ALST's), no async TP."""

    def check(self, r: RowPlan) -> None:
        SideModel.check(self, dataclasses.replace(r, async_tp=False))
        if r.zero_stage != 3 or r.async_tp or r.checkpointing != "full":
            raise ValueError(f"{self.name!r} runs ALST's schedule: FSDP2 at zero_stage 3, full checkpointing, no "
                             f"async TP; got zero_stage={r.zero_stage}, checkpointing={r.checkpointing!r}, "
                             f"async_tp={r.async_tp}")

    def micro(self, cfg, r: RowPlan, hw: Hardware, rule):
        micro = cost_model.ulysses_step_time(cfg, r.micro_batch, r.seq, r.p, hw, ELEMENT,
                                             checkpointing=r.checkpointing, overlap=rule)
        saved = baseline_activation_bytes(cfg, r.micro_batch, r.seq // r.p, 1, elem=ELEMENT, ep=ELEMENT)["total"]
        return micro, False, saved

    def memory(self, cfg, r: RowPlan) -> dict:
        found = ulysses_peak_bytes(cfg, r.micro_batch, r.seq, r.p, dp=r.dp, checkpointing=r.checkpointing,
                                   elem=ELEMENT)
        parts = found["parts"]
        return {**parts, "parameters": parts["states"], "total": found["peak"], "largest": found["largest"],
                "largest_bytes": found["largest_bytes"]}

    def data_parallel(self, split, r: RowPlan) -> Sharding:
        # FSDP2 over every rank of every replica; the root kept gathered from forward to backward
        return Sharding(tensor=1, vectors_cut=False, sharding=r.p * r.dp, ranks=1)


_MODELS: dict[str, SideModel] = {}


def register_model(model: SideModel) -> SideModel:
    """Price the rival ``model.rival`` with ``model`` (replacing any model it had)."""
    if model.rival is None or registry.get_rival(model.rival.name) != model.rival:
        raise ValueError(f"register_model: {model!r} prices no registered rival")
    _MODELS[model.rival.name] = model
    return model


for _model in (OneDimensional(registry.TP1D_SP), ContextParallel(registry.CP), ContextParallel(registry.CP_TP),
               Ulysses(registry.ULYSSES)):
    register_model(_model)


def model_of(name: str) -> SideModel:
    """The cost and memory model of the row named ``name``: a priced rival's, else a package layout's."""
    model = _MODELS.get(name)
    return model if model is not None else SideModel(name)


def elementwise_bytes(cfg, batch: int, seq: int, tp: int, *, ep: int) -> float:
    """Bytes the elementwise ops of the 1-D baseline's forward touch (``"tp1d-sp"`` over ``tp`` ranks on ``batch x
    seq`` tokens, the residual stream and norm inputs in ``ep`` bytes): what it saves
    (:func:`~lightning_tp2d.planning.memory_model.baseline_activation_bytes`) with each of the ``2 L + 1``
    all-gathered norm outputs (``N h e`` saved for the column-parallel linears) counted as the ``N h e / tp``
    shard the norm writes: the gather is a collective's output, not an elementwise op's, and the package's traced
    bytes count each rank's own shards the same way. ``tp`` 1: the saved bytes."""
    saved = baseline_activation_bytes(cfg, batch, seq, tp, elem=ELEMENT, ep=ep)["total"]
    gathered = (2 * cfg.n_layer + 1) * batch * seq * cfg.n_embd * ELEMENT
    return saved - gathered * (1 - 1 / tp)


def chunked_loss_step(cfg, batch: int, seq: int, tp: int, hw: Hardware, micro: dict, rule: dict) -> dict:
    """``micro`` (the 1-D baseline's :func:`~lightning_tp2d.planning.cost_model.step_time` on ``batch x seq``
    tokens over ``tp`` ranks) with the chunked loss, as :func:`~lightning_tp2d.planning.cost_model.cp_step_time`
    prices CP's: each chunk of :data:`~lightning_tp2d.planning.rivals.CHUNK_TOKENS` tokens recomputes its logits in
    the backward (``2 N h ceil(V/tp)`` more matmul FLOPs), the head runs 4 GEMM kernels a chunk instead of 3 in
    all, and over ``tp`` > 1 ranks each chunk's ``loss_parallel`` forward runs its three all-reduces of the
    chunk's float32 ``[n, 1]`` rows again (inside the node; no overlapped FLOPs, so the overlap rule hides none).
    A vocabulary shard that is not aligned (:func:`~lightning_tp2d.planning.cost_model.unaligned_share`) slows the
    recomputed products as it slows the head's own."""
    tokens = batch * seq
    recomputed = 2.0 * tokens * cfg.n_embd * -(-cfg.vocab_size // tp)
    full, rest = divmod(tokens, CHUNK_TOKENS)
    gemms = 4 * (full + (1 if rest else 0)) - 3
    fl = micro["flops"]
    fl = {**fl, "backward": fl["backward"] + recomputed, "total": fl["total"] + recomputed,
          "matmul": fl["matmul"] + recomputed, "gemms": fl["gemms"] + gemms}
    unaligned = (0.0 if gemm_rates.aligned(cost_model.vocab_block_rows(cfg, tp), cfg.n_embd)
                 else recomputed / hw.matmul_flops_per_s * (hw.unaligned_gemm_slowdown - 1.0))
    compute = micro["compute_s"] + recomputed / hw.matmul_flops_per_s + unaligned + gemms * hw.gemm_overhead_s
    comm = exposed = 0.0
    rates = {"matmul": hw.matmul_flops_per_s, "attention": hw.attention_flops_per_s}
    for n, calls in ((CHUNK_TOKENS, full), (rest, 1 if rest else 0)):
        if tp > 1 and calls:
            t = collective_time("all_reduce", tp, 4 * n, hw.intra)
            hidden = cost_model._hidden(Comm("all_reduce", "tp", tp, 4 * n), t, 0.0, 0.0, rates, False, rule)[0]
            comm += 3 * calls * t
            exposed += 3 * calls * (t - hidden)
    return {**micro, "compute_s": compute, "comm_s": micro["comm_s"] + comm,
            "exposed_comm_s": micro["exposed_comm_s"] + exposed, "total_s": compute + micro["exposed_comm_s"] + exposed,
            "flops": fl, "unaligned_s": micro.get("unaligned_s", 0.0) + unaligned}


__all__ = ["ContextParallel", "LOSS_VARIANTS", "OneDimensional", "RowPlan", "Sharding", "SideModel", "Ulysses",
           "chunked_loss_step", "elementwise_bytes", "model_of", "register_model"]
