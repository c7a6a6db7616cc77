"""Each side's cost and memory model for :func:`~lightning_tp2d.planning.planner.price`: one object per priced rival
(:data:`lightning_tp2d.rivals.TP1D_SP`, ``CP``, ``CP_TP``, ``ULYSSES``) and one for the package's layouts, all
answering the same questions, so that ``price`` and ``row_memory`` dispatch through :func:`model_of` alone:

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

from dataclasses import dataclass

from lightning_tp2d import rivals as registry
from lightning_tp2d.planning import cost_model, gemm_rates
from lightning_tp2d.planning.cost_model import Hardware, collective_time, step_time
from lightning_tp2d.planning.events import Comm
from lightning_tp2d.planning.memory_model import baseline_activation_bytes, peak_bytes
from lightning_tp2d.planning.rivals import (CHUNK_TOKENS, baseline_row_peak_bytes, cp_peak_bytes,
                                            ulysses_peak_bytes)
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

    def check(self, *, p: int, zero_stage: int, checkpointing: str, async_tp, cp_tp_size: int, shard_group: int,
              loss: str) -> None:
        if shard_group or loss != "unfused":
            raise ValueError(f"shard_group and loss price the {registry.TP1D_SP.name!r} baseline, not layout "
                             f"{self.name!r} (got shard_group={shard_group}, loss={loss!r})")
        if async_tp:
            raise ValueError(f"async_tp prices the {registry.TP1D_SP.name!r} baseline, not layout {self.name!r}")

    def inner(self, cp_tp_size: int) -> int:
        """The 1-D TP ranks inside each of its sequence ranks (``"cp-tp"``'s ``cp_tp_size``; 1 otherwise)."""
        return 1

    def micro(self, cfg, *, micro_batch: int, seq: int, p: int, dp: int, hw: Hardware, checkpointing: str,
              zero_stage: int, async_tp, rule, cp_tp_size: int, cp_loss: str, loss: str) -> tuple[dict, bool, float]:
        """``(step, async_tp, elementwise bytes)`` of one micro-batch of ``micro_batch x seq`` tokens on ``p`` ranks."""
        micro = step_time(self.name, cfg, micro_batch, seq, p, hw, ELEMENT, checkpointing=checkpointing, ranks=[0],
                          overlap=rule)
        return micro, False, trace_step(self.name, cfg, micro_batch, seq, p, ELEMENT, 0).activation_bytes

    def memory(self, cfg, *, p: int, dp: int, stage: int, mode: str, micro_batch: int, seq: int, cp_tp_size: int,
               cp_loss: str, shard_group: int, loss: str) -> dict:
        """Predicted peak bytes per GPU with their parts (tensor rank 0; AdamW's fused step)."""
        return peak_bytes(self.name, cfg, micro_batch, seq, p, dp=dp, zero_stage=stage, checkpointing=mode,
                          elem=ELEMENT, ranks=[0], fused=True)

    def data_parallel(self, split, p: int, dp: int, cp_tp_size: int) -> Sharding:
        return Sharding(tensor=p, vectors_cut=True, sharding=dp, ranks=p)

    def host_name(self, p: int) -> str:
        return self.name

    def context_parallel_size(self, p: int, cp_tp_size: int) -> int:
        return 1

    def loss_label(self, loss: str, cp_loss: str) -> str:
        """The row's ``loss`` (PlanRow.loss): the package's layouts run their own head and loss."""
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

    def check(self, *, p, zero_stage, checkpointing, async_tp, cp_tp_size, shard_group, loss) -> None:
        if loss not in LOSS_VARIANTS:
            raise ValueError(f"loss={loss!r} is not one of {LOSS_VARIANTS}")

    def micro(self, cfg, *, micro_batch, seq, p, dp, hw, checkpointing, zero_stage, async_tp, rule, cp_tp_size,
              cp_loss, loss):
        tp = p
        if tp == 1:
            micro = step_time(registry.SINGLE.name, cfg, micro_batch, seq, 1, hw, ELEMENT, checkpointing=checkpointing)
            async_tp = False
        else:
            micro = min((step_time(self.name, cfg, micro_batch, seq, tp, hw, ELEMENT, async_tp=a, lean_wire=True,
                                   checkpointing=checkpointing, overlap=rule) | {"async_tp": a}
                         for a in ((False, True) if async_tp is None else (async_tp,))),
                        key=lambda r: r["total_s"])
            async_tp = micro["async_tp"]
        if loss == "chunked":
            micro = chunked_loss_step(cfg, micro_batch, seq, tp, hw, micro, rule)
        sharded = fsdp_shards(zero_stage, dp)  # FSDP's bf16 param_dtype: the residual stream is bf16 too
        return micro, async_tp, elementwise_bytes(cfg, micro_batch, seq, tp, ep=ELEMENT if sharded else 4)

    def memory(self, cfg, *, p, dp, stage, mode, micro_batch, seq, cp_tp_size, cp_loss, shard_group, loss):
        return baseline_row_peak_bytes(cfg, micro_batch, seq, p, dp=dp, zero_stage=stage, shard_group=shard_group,
                                       checkpointing=mode, elem=ELEMENT, loss=loss)

    def data_parallel(self, split, p, dp, cp_tp_size):
        # gathered again in the backward at stage 3: its untied embedding (its own FSDP group)
        return Sharding(tensor=p, vectors_cut=False, sharding=dp, ranks=p, regathered=split.embedding / p)

    def host_name(self, p: int) -> str:
        return registry.SINGLE.name if p == 1 else self.name

    def loss_label(self, loss: str, cp_loss: str) -> str:
        return loss


class ContextParallel(_RivalModel):
    """torch's context parallelism x FSDP2 at stage 3 (``"cp"``), or with 1-D TP + SP inside each CP rank
    (``"cp-tp"``: CP over ``p / cp_tp_size`` ranks, FSDP2 over those of every replica)."""

    def inner(self, cp_tp_size: int) -> int:
        return cp_tp_size if self.rival.inner_tensor_parallel else 1

    def check(self, *, p, zero_stage, checkpointing, async_tp, cp_tp_size, shard_group, loss) -> None:
        SideModel.check(self, p=p, zero_stage=zero_stage, checkpointing=checkpointing, async_tp=False,
                        cp_tp_size=cp_tp_size, shard_group=shard_group, loss=loss)
        inner = self.inner(cp_tp_size)
        if zero_stage != 3 or (async_tp and inner == 1):
            raise ValueError(f"{self.name!r} runs FSDP2 at zero_stage 3{' and no async TP' if inner == 1 else ''}, "
                             f"got zero_stage={zero_stage}, async_tp={async_tp}")
        if self.rival.inner_tensor_parallel and (inner < 2 or p % inner or p // inner < 2):
            raise ValueError(f"{self.name!r} needs cp_tp_size >= 2 dividing p with at least 2 CP ranks, got p={p}, "
                             f"cp_tp_size={cp_tp_size}")

    def micro(self, cfg, *, micro_batch, seq, p, dp, hw, checkpointing, zero_stage, async_tp, rule, cp_tp_size,
              cp_loss, loss):
        inner = self.inner(cp_tp_size)
        ring = p // inner
        micro = min((cost_model.cp_step_time(cfg, micro_batch, seq, ring, hw, ELEMENT, dp=dp, tp=inner, async_tp=a,
                                             checkpointing=checkpointing, overlap=rule, loss=cp_loss)
                     | {"async_tp": a} for a in ((False, True) if async_tp is None and inner > 1
                                                 else (bool(async_tp),))), key=lambda r: r["total_s"])
        return micro, micro["async_tp"], elementwise_bytes(cfg, micro_batch, seq // ring, inner, ep=ELEMENT)

    def memory(self, cfg, *, p, dp, stage, mode, micro_batch, seq, cp_tp_size, cp_loss, shard_group, loss):
        inner = self.inner(cp_tp_size)
        return cp_peak_bytes(cfg, micro_batch, seq, p // inner, dp=dp, checkpointing=mode, elem=ELEMENT, tp=inner,
                             loss=cp_loss)

    def data_parallel(self, split, p, dp, cp_tp_size):
        # FSDP over the CP ranks of every replica, of each tensor rank's (cp: whole) parameters; the root regathered
        inner = self.inner(cp_tp_size)
        root = Sharding(tensor=inner, vectors_cut=False, sharding=1, ranks=1).shard(split.root, split.root_vectors)
        return Sharding(tensor=inner, vectors_cut=False, sharding=p // inner * dp, ranks=inner, regathered=root)

    def context_parallel_size(self, p: int, cp_tp_size: int) -> int:
        return p // self.inner(cp_tp_size)

    def loss_label(self, loss: str, cp_loss: str) -> str:
        return cp_loss


class Ulysses(_RivalModel):
    """DeepSpeed's Ulysses SP + ALST's tiling x FSDP2 over every rank (``"ulysses"``): stage 3, full
    checkpointing of every layer (ALST's), no async TP."""

    def check(self, *, p, zero_stage, checkpointing, async_tp, cp_tp_size, shard_group, loss) -> None:
        SideModel.check(self, p=p, zero_stage=zero_stage, checkpointing=checkpointing, async_tp=False,
                        cp_tp_size=cp_tp_size, shard_group=shard_group, loss=loss)
        if zero_stage != 3 or async_tp or checkpointing != "full":
            raise ValueError(f"{self.name!r} runs ALST's schedule: FSDP2 at zero_stage 3, full checkpointing, no "
                             f"async TP; got zero_stage={zero_stage}, checkpointing={checkpointing!r}, "
                             f"async_tp={async_tp}")

    def micro(self, cfg, *, micro_batch, seq, p, dp, hw, checkpointing, zero_stage, async_tp, rule, cp_tp_size,
              cp_loss, loss):
        micro = cost_model.ulysses_step_time(cfg, micro_batch, seq, p, hw, ELEMENT, checkpointing=checkpointing,
                                             overlap=rule)
        saved = baseline_activation_bytes(cfg, micro_batch, seq // p, 1, elem=ELEMENT, ep=ELEMENT)["total"]
        return micro, False, saved

    def memory(self, cfg, *, p, dp, stage, mode, micro_batch, seq, cp_tp_size, cp_loss, shard_group, loss):
        found = ulysses_peak_bytes(cfg, micro_batch, seq, p, dp=dp, checkpointing=mode, elem=ELEMENT)
        parts = found["parts"]
        return {**parts, "parameters": parts["states"], "total": found["peak"], "largest": found["largest"],
                "largest_bytes": found["largest_bytes"]}

    def data_parallel(self, split, p, dp, cp_tp_size):
        # FSDP2 over every rank of every replica; the root kept gathered from forward to backward
        return Sharding(tensor=1, vectors_cut=False, sharding=p * dp, ranks=1)


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


__all__ = ["ContextParallel", "LOSS_VARIANTS", "OneDimensional", "Sharding", "SideModel", "Ulysses",
           "chunked_loss_step", "elementwise_bytes", "model_of", "register_model"]
