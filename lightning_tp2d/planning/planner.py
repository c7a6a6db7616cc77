"""The planner: which layout and sizes train a model on ``gpus`` GPUs of ``gpu_memory_gib`` each, how fast, and how
that compares with what a user would run instead (torchtitan's 1-D tensor parallelism with sequence parallelism x
FSDP).

:func:`plan` enumerates configurations, keeps those whose predicted peak memory per GPU is at most
``memory_fraction`` (0.9) of the cap, and sorts them by predicted step time. A configuration is

* the package's: a layout (``"2d"``, ``"metp"``, ``"2d-metp"``) on ``p`` ranks x ``dp`` replicas, ZeRO stage 0-3
  (FSDP2 at 2 and 3), activation checkpointing ``none`` / ``selective`` / ``full``;
* or a 1-D baseline (``baseline=True``): ``"tp1d-sp"`` over ``tp <= gpus_per_node`` ranks (torch's colwise/rowwise
  styles, sequence-parallel norms, loss parallel; blocking or async TP, whichever is faster, bf16 on the wire) x
  ``dp`` replicas at the package's stages (DDP, ZeRO 1, FSDP at 2 and 3 -- stage 3 torchtitan's default -- and
  HSDP: FSDP inside a node, replicated across nodes), or plain FSDP / HSDP (``tp`` 1); checkpointing ``none``,
  ``full`` or torchtitan's per-op ``selective``; the loss unfused or chunked;

* priced by :func:`price` only, not enumerated by :func:`plan`: torch's context parallelism (``"cp"``, CP x FSDP2
  over the same ranks, :mod:`lightning_tp2d.baselines.context_parallel`; ``"cp-tp"``, torchtitan's CP x 1-D TP + SP,
  FSDP2 over the CP ranks);

each with a micro-batch of ``micro_batch`` sequences per replica and ``grad_accum`` micro-batches per step, so that
``dp * micro_batch * grad_accum * seq`` is the global batch (``global_batch_tokens``, rounded down to whole
sequences for every replica).

The search goes from the least memory up: for each layout and size, ZeRO stage 3 before 2, 1 and 0, checkpointing
``full`` before ``selective`` and ``none``, micro-batches ascending; a configuration that does not fit at its least
micro-batch leaves out those that keep more (a lower stage, a lighter checkpointing mode), as their memory is
never less. The memory model builds each configuration's least micro-batches and the largest a line through them
says fits, and reads those between from two profiles (exact: :func:`lightning_tp2d.planning.memory_model.shard_bytes`).

How a row is priced (per GPU, bf16 compute, float32 parameters and AdamW state):

* memory: the package's layouts :func:`lightning_tp2d.planning.memory_model.peak_bytes` (the model built on the
  fake process group, the activations traced; AdamW's fused step, as ``CausalLMModule`` runs it on a GPU and
  torchtitan does), the baseline
  :func:`~lightning_tp2d.planning.memory_model.baseline_peak_bytes` (analytic, from the tensors its ops save);
* one micro-batch's compute and tensor-parallel communication: :func:`lightning_tp2d.planning.cost_model.step_time`
  (the package's layouts traced, tensor-parallel rank 0 priced: the grid's ranks run the same shapes and the zigzag
  ring balances the causal work); every overlapped collective of either side hiding the same fraction,
  :data:`ASYNC_TP_OVERLAP` (``overlap="fitted"``), of what its overlapped compute could hide;
* elementwise work (norms, activations, residual adds, casts, the loss's softmax, the optimizer's reads of
  activations): ``ELEMENTWISE_PASSES`` passes over the bytes the micro-batch's forward saves, at the GPU's memory
  bandwidth -- one constant per execution mode, fitted to the one single-GPU measurement the project has
  (:data:`GPT2_H200`: transformers' GPT-2 124M on an H200, 160k tokens/s eager, 393k compiled); each side's bytes
  times its measured memory-bound quotient (:func:`lightning_tp2d.planning.host_cost.memory_bound_ratio`: what its
  layers move on CPU beyond what its model of the saved bytes says, against the plain model's), the layouts' extra
  at the eager passes even compiled (it is moved inside their registered ops);
* the optimizer: AdamW reads the parameter, gradient and two moments and writes three of them, 28 bytes per element
  this rank updates, at memory bandwidth;
* data parallelism, one rule for both families (:func:`data_parallel_time`): stage 0 and 1 all-reduce the float32
  gradients once per step (hierarchical across nodes), hidden behind the last micro-batch's backward; stage 1 then
  all-gathers the updated slices behind nothing; stages 2 and 3 all-gather each block's bf16 tensor shard (stage 3
  again in the backward, with the root groups resharded after the forward: the baseline's untied embedding, cp's
  root) and reduce-scatter its float32 gradients every micro-batch, each hidden behind the neighbouring block's
  compute;
* the host: a micro-batch takes the longer of its GPU time (the parts above) and the host's time to issue its ops
  (:func:`lightning_tp2d.planning.host_cost.micro_batch_host_seconds`: the aten ops one rank dispatches, measured
  per block on CPU, times the plain model's host seconds an op on the H200 and each side's measured ratio to it,
  eager or compiled: the layouts' and the rivals' own, measured on CPU one rank at a time; compiled, what the host
  spends beyond the compiled plain model, which costs none).

Pipeline stages (``pipeline_sizes``, ``tp2d-plan --pp``): both sides, the package's
:mod:`lightning_tp2d.pipeline` and torchtitan's PP, at every ZeRO stage, by one model
(:func:`price_stages`, :mod:`lightning_tp2d.planning.pipeline_cost`): each rank's blocks priced as a model of that many
blocks, the schedule's bubble, the boundary transfers not overlapped, the first rank's in-flight micro-batches.

Not modelled: float8's memory (its rows are priced at bf16's; the ring's float8 weight blocks
at bf16's bytes), the host's kernel launches under compile, the optimizer's host time, allocator fragmentation
(memory is live bytes; the 10% margin is for it), contention between the data-parallel and tensor-parallel links.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import functools
import logging
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from lightning_tp2d.planning import cache as plan_cache
from lightning_tp2d.planning import cost_model, host_cost, memory_model, trace
from lightning_tp2d.planning.cost_model import Hardware, collective_time, data_parallel_all_reduce_time, step_time
from lightning_tp2d.planning.memory_model import baseline_activation_bytes, parameter_split
from lightning_tp2d.planning.processes import in_processes
from lightning_tp2d.planning.rival_models import ELEMENT, LOSS_VARIANTS, RowPlan, model_of
from lightning_tp2d.planning.commands import command_for
from lightning_tp2d.planning.rivals import BASELINE, CP, CP_TP, ULYSSES  # the rivals' row names
from lightning_tp2d.planning.trace import ranks_as_asked
from lightning_tp2d.options import TPOptions, check_float8
from lightning_tp2d.rivals import SINGLE, TP1D_SP, get_rival, is_rival
from lightning_tp2d.train_plan import (CHECKPOINTING, FSDP_STAGES, ZERO_STAGES, TrainPlan, fsdp_shards,
                                       reshards_after_forward)
from lightning_tp2d.families import anatomy, family_of_config, fits, model_config
from lightning_tp2d.layouts import get_layout, layout_names
from lightning_tp2d.models.config import max_seq_len

__all__ = ["ULYSSES", "PlanRow", "plan", "price", "longest_sequence", "offload_memory", "offload_time", "HARDWARE", "CP", "CP_TP", "ELEMENTWISE_PASSES", "GPT2_H200", "ASYNC_TP_OVERLAP", "search_space", "count_configurations", "LOSS_VARIANTS",
           "data_parallel_time", "NothingFits", "pricing", "METHODS"]

GIB = 2**30
HARDWARE = {"h100": cost_model.H100_NVLINK4_NDR, "h200": cost_model.H200_NVLINK4_NDR,
            "h100-grand-teton": cost_model.H100_GRAND_TETON, "a100": cost_model.A100_NVLINK3_HDR}
OPTIMIZER_BYTES_PER_ELEMENT = 28  # AdamW: read param, grad, exp_avg, exp_avg_sq (16); write param and moments (12)
MAX_MICRO_BATCH = 16  # sequences per micro-batch tried at most by default (a layout needing more tries its least)
log = logging.getLogger(__name__)

# The fraction of the hideable collective time that is really hidden: fitted to torchtitan's published async /
# blocking TP gains on H100s (bf16, compile: 8B on 64 GPUs, FSDP 8 x TP 8: 1.098x; 70B on 256, FSDP 32 x TP 8:
# 1.092x), which one value, 0.57, reproduces for both (hiding all but the first chunk, 1.0, predicted 1.17-1.19x).
# The planner applies it to every overlapped collective of both sides (cost_model.OVERLAP["fitted"]); the overlap
# rule is plan()'s and price()'s ``overlap`` ("fitted", "pessimistic", "ideal" or a mapping kind -> efficiency).
ASYNC_TP_OVERLAP = cost_model.FITTED_OVERLAP
# transformers' GPT-2 124M, bf16 autocast, fused AdamW, batch 32 x 1024 on one H200: tokens/s, measured by
# recipes/gpu_issue12.py on 2026-12-04 (torch 2.11, transformers 5.17; recipes/results/gpu_issue12_h200.json). The GPU
# week's measurement (issue 24, older transformers) was 213k eager, 412k compiled.
GPT2_H200 = {"model": "gpt2", "batch": 32, "seq": 1024, "eager": 160.2e3, "compiled": 393.4e3}


class NothingFits(ValueError):
    """No configuration fits the memory cap; the message names the least memory any configuration needs."""


@dataclass(frozen=True)
class PlanRow:
    """One configuration and its prediction (per GPU): :attr:`plan`, what the row runs (for a package layout, the
    settings of its :attr:`train_plan`), and what :func:`price` predicts of it. The plan's fields read as the row's
    own (``row.layout``, ``row.tensor_parallel_size``, ...); :meth:`of` makes a row from them and the predictions."""

    plan: RowPlan
    baseline: bool
    memory_gib: float
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    parts: dict = dataclasses.field(default_factory=dict, compare=False)  # memory and time breakdowns

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "plan":  # (copy and pickle probe before the fields exist)
            raise AttributeError(name)
        return getattr(self.plan, name)

    @classmethod
    def of(cls, *, baseline: bool, memory_gib: float, step_s: float, tokens_per_s_per_gpu: float, mfu: float,
           parts: dict | None = None, **plan) -> PlanRow:
        """A row from its plan's fields (:class:`~lightning_tp2d.planning.rival_models.RowPlan`) and its
        predictions, as :meth:`to_dict` writes them."""
        plan.pop("context_parallel_size", None)  # (derived from the plan: to_dict writes it for readers)
        return cls(RowPlan(**plan), baseline, memory_gib, step_s, tokens_per_s_per_gpu, mfu, parts or {})

    @property
    def label(self) -> str:
        """What the row runs, named with every field that tells it apart beyond the sizes, ZeRO stage, checkpointing
        (and offload) and micro-batches that :meth:`describe` and :func:`table` show beside it: the package's layout;
        the baseline's 1-D TP + SP (``(async)``: async TP) or none, over DDP (stages 0 and 1), FSDP or ``HSDP s x r``
        (FSDP over groups of ``s = shard_group`` replicas, ``r`` groups); CP's split; ``chunked loss``."""
        p, dp, cp = self.tensor_parallel_size, self.data_parallel_size, self.context_parallel_size
        loss = (", chunked loss" if self.loss == "chunked" else "") + (f", float8 {self.float8}" if self.float8 else "")
        rival = get_rival(self.layout) if is_rival(self.layout) else None
        if rival is not None and rival.context_parallel:
            split = f"CP {cp}" + (f" x TP {p // cp}" if p != cp else "") + (", async" if self.async_tp else "")
            return f"{self.layout} ({split}){loss}"
        if rival is None or not rival.planned:
            return self.layout + loss
        data = ("" if dp == 1 else f"HSDP {self.shard_group}x{dp // self.shard_group}" if self.shard_group
                else "FSDP" if fsdp_shards(self.zero_stage, dp) else "DDP")
        if p == 1:
            return f"{data or 'one GPU'} (no TP){loss}"
        return f"1-D TP+SP{' (async)' if self.async_tp else ''}{f' x {data}' if data else ''}{loss}"

    @property
    def host_bound(self) -> bool:
        """The host's time to issue a micro-batch's ops is longer than the GPU's work on it (``micro_host_ops``,
        :mod:`lightning_tp2d.planning.host_cost`): the step waits on the host."""
        t = self.parts.get("time_s", {})
        gpu = t.get("micro_compute", 0.0) + t.get("micro_tp_exposed", 0.0) + t.get("micro_elementwise", 0.0)
        return t.get("micro_host_ops", 0.0) > gpu

    @property
    def unaligned(self) -> bool:
        """Some of its products have a width that is not a multiple of 8 (``micro_unaligned``: the seconds they add,
        :func:`~lightning_tp2d.planning.cost_model.unaligned_share`): a grid side or a vocabulary that pads or
        divides to aligned shards runs faster."""
        return self.parts.get("time_s", {}).get("micro_unaligned", 0.0) > 0.0

    @property
    def stages(self) -> str:
        """``" pp=4 1f1b"`` (``" pp=4 interleaved_1f1b v=2"``) for a row with pipeline stages, else ``""``."""
        if self.pipeline_parallel_size == 1:
            return ""
        return (f" pp={self.pipeline_parallel_size} {self.pp_schedule}"
                + (f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""))

    def describe(self) -> str:
        return (f"{self.label} p={self.tensor_parallel_size} dp={self.data_parallel_size}{self.stages} "
                f"zero={self.zero_stage} ckpt={self.checkpointing} micro={self.micro_batch}x{self.grad_accum}"
                f"{' offload' if self.activation_offload else ''}: {self.memory_gib:.1f} GiB, "
                f"{self.tokens_per_s_per_gpu:,.0f} tok/s/GPU, MFU {self.mfu:.1%}"
                f"{', host-bound' if self.host_bound else ''}{', unaligned shards' if self.unaligned else ''}")

    def to_dict(self) -> dict:
        """The plan's fields (with its ``context_parallel_size``) and the predictions, in one flat dict."""
        out = dataclasses.asdict(self.plan) | {"context_parallel_size": self.context_parallel_size}
        return out | {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "plan"}

    @property
    def train_plan(self) -> TrainPlan:
        """The :class:`~lightning_tp2d.train_plan.TrainPlan` that runs this package row (what the strategies take
        as ``plan=``; ``precision`` left to the run, bf16-mixed being what the row is priced for). A rival's row has
        none: its settings are :func:`~lightning_tp2d.planning.commands.command_for`'s."""
        if self.baseline or is_rival(self.layout):
            raise ValueError(f"a {self.layout!r} row is a rival's configuration, not a TrainPlan of this package "
                             f"(its settings: lightning_tp2d.planning.commands.command_for)")
        staged = {} if self.pipeline_parallel_size == 1 else {
            "pipeline_parallel_size": self.pipeline_parallel_size, "pp_schedule": self.pp_schedule,
            "virtual_stages": self.virtual_stages, "microbatches": self.grad_accum}
        return TrainPlan(self.layout, self.tensor_parallel_size, self.data_parallel_size, self.zero_stage,
                         self.checkpointing, self.activation_offload, self.micro_batch,
                         options=None if self.float8 is None else TPOptions(float8=self.float8), **staged)


def _padded_by_inductor(micro: dict) -> dict:
    """``micro`` without its unaligned products' extra time: compiled, torch's own code is inductor's, whose
    ``shape_padding`` (on by default) pads an unaligned matmul's operands where its benchmark says that is faster.
    The package's SUMMA and ring products are registered ops the compiler does not enter: they keep theirs."""
    extra = micro.get("unaligned_s", 0.0)
    return {**micro, "compute_s": micro["compute_s"] - extra, "total_s": micro["total_s"] - extra,
            "unaligned_s": 0.0}


def measured_gpt2_config():
    """The config of the measured step :data:`GPT2_H200`: transformers' GPT-2 124M, its 50257-wide head unpadded
    (the named size ``"gpt2"`` pads it to 50304, as ``tp2d-train model=gpt2`` runs it; transformers does not)."""
    return dataclasses.replace(model_config(GPT2_H200["model"]), pad_vocab_multiple=1)


def _fit_elementwise_passes() -> dict[str, float]:
    """Passes over the saved bytes that close the gap between the matmul/attention/optimizer time and the measured
    GPT-2 step on the H200 (:data:`GPT2_H200`), eager and compiled."""
    cfg = measured_gpt2_config()
    hw = cost_model.H200_NVLINK4_NDR
    b, t = GPT2_H200["batch"], GPT2_H200["seq"]
    eager = step_time(SINGLE.name, cfg, b, t, 1, hw, ELEMENT)  # its 50257-wide head unaligned (the sm75 kernel)
    compute = {"eager": eager["total_s"], "compiled": _padded_by_inductor(eager)["total_s"]}
    saved = baseline_activation_bytes(cfg, b, t, 1, elem=ELEMENT, ep=4)["total"]  # as price() counts it
    optimizer = OPTIMIZER_BYTES_PER_ELEMENT * parameter_split(cfg).total / hw.hbm_bytes_per_s
    return {mode: (b * t / GPT2_H200[mode] - compute[mode] - optimizer) / (saved / hw.hbm_bytes_per_s)
            for mode in ("eager", "compiled")}


ELEMENTWISE_PASSES = _fit_elementwise_passes()


def model_flops_per_token(cfg, seq: int) -> float:
    """Training FLOPs per token without recomputation (the MFU numerator): the plain model's step / tokens."""
    return cost_model.flops(SINGLE.name, cfg, 1, seq, 1)["total"] / seq


def data_parallel_time(*, root: float, block: float, n_layer: int, dp: int, tp: int, stage: int, gpus_per_node: int,
                       hw: Hardware, forward_s: float, backward_s: float, grad_accum: int, elem: int = ELEMENT,
                       regathered: float = 0.0, shard_group: int = 0, block_elem: float | None = None) -> dict:
    """Seconds of data-parallel communication per step for ``dp`` replicas of ``tp`` consecutive ranks, one rank
    holding ``root`` + ``n_layer * block`` tensor-shard elements (float32 at rest, gradients reduced in float32),
    ``forward_s`` / ``backward_s`` one micro-batch's compute: ``{"comm_s", "exposed_s"}`` (module docstring).

    ``regathered``: the root's elements (of ``root``) that stage 3 resharded after the forward and so all-gathers
    again at the end of the backward, prefetched behind the first block's backward: the 1-D baseline's untied
    input embedding (torchtitan's ``apply_fsdp`` wraps it alone, resharded after forward), the whole root of torch's
    context parallelism (:func:`~lightning_tp2d.baselines.context_parallel.parallelize_cp`); 0 for the package's
    layouts, whose root group FSDP keeps gathered from the forward to the backward. Ignored below stage 3.

    ``block_elem``: bytes per element of the blocks' all-gathers where they differ from ``elem`` (a rival's float8
    all-gather, :func:`~lightning_tp2d.planning.cost_model.float8_gather_element`).

    ``shard_group`` (stages 2 and 3; 0 or ``dp``: FSDP over all ``dp`` replicas): HSDP, FSDP over groups of
    ``s = shard_group`` consecutive replicas (``s * tp`` consecutive ranks: inside a node when they fit one), each
    group replicated ``r = dp / s`` times (torchtitan's ``data_parallel_shard_degree`` x
    ``data_parallel_replicate_degree``). The gathers and reduce-scatters run as FSDP's over the ``s`` replicas, on
    their link, with shards ``1 / s``; the reduced gradient shards (float32, ``4 (root + n_layer block) / s`` bytes)
    are then all-reduced over the ``r`` groups, once per step (FSDP2's ``set_requires_all_reduce`` off for all but
    the last micro-batch: the strongest form), behind the last micro-batch's backward as stage 0's all-reduce
    is (``comm_s`` and ``exposed_s`` include it; ``hsdp_all_reduce_s``: its seconds)."""
    if dp <= 1:
        return {"comm_s": 0.0, "exposed_s": 0.0}
    if shard_group not in (0, dp):
        if stage not in FSDP_STAGES or shard_group < 2 or dp % shard_group:
            raise ValueError(f"HSDP: shard_group={shard_group} must divide dp={dp}, be at least 2, and shard stage 2 "
                             f"or 3 (got zero_stage {stage})")
        inside = data_parallel_time(root=root, block=block, n_layer=n_layer, dp=shard_group, tp=tp, stage=stage,
                                    gpus_per_node=gpus_per_node, hw=hw, forward_s=forward_s, backward_s=backward_s,
                                    grad_accum=grad_accum, elem=elem, regathered=regathered, block_elem=block_elem)
        replicas = dp // shard_group
        link = hw.intra if dp * tp <= gpus_per_node else hw.inter  # groups s * tp ranks apart
        across = collective_time("all_reduce", replicas, 4 * (root + n_layer * block) / shard_group, link)
        return {"comm_s": inside["comm_s"] + across, "exposed_s": inside["exposed_s"] + max(0.0, across - backward_s),
                "hsdp_all_reduce_s": across}
    total = root + n_layer * block
    if stage not in FSDP_STAGES:  # DDP's all-reduce (stage 1: then the updated slices gathered)
        reduce = data_parallel_all_reduce_time(4 * total, dp * tp, tp, hw)
        exposed = max(0.0, reduce - backward_s)
        comm = reduce
        if stage == 1:  # the updated slices, gathered after the step behind no compute
            gather = _dp_collective("all_gather", 4 * total / dp, dp, tp, gpus_per_node, hw)
            comm += gather
            exposed += gather
        return {"comm_s": comm, "exposed_s": exposed}
    gather_block = _dp_collective("all_gather", (elem if block_elem is None else block_elem) * block / dp, dp, tp,
                                  gpus_per_node, hw)
    scatter_block = _dp_collective("reduce_scatter", 4 * block, dp, tp, gpus_per_node, hw)
    gather_root = _dp_collective("all_gather", elem * root / dp, dp, tp, gpus_per_node, hw)
    scatter_root = _dp_collective("reduce_scatter", 4 * root, dp, tp, gpus_per_node, hw)
    fwd_block, bwd_block = forward_s / n_layer, backward_s / n_layer
    regather = reshards_after_forward(stage, dp)  # each block gathered again for its backward
    backward_calls = scatter_block + (gather_block if regather else 0.0)
    again = _dp_collective("all_gather", elem * regathered / dp, dp, tp, gpus_per_node, hw) \
        if regather and regathered else 0.0
    comm = gather_root + scatter_root + n_layer * (gather_block + backward_calls) + again
    exposed = (gather_root + gather_block  # the first gathers run behind nothing
               + (n_layer - 1) * max(0.0, gather_block - fwd_block)
               + n_layer * max(0.0, backward_calls - bwd_block) + scatter_root
               # the root's gather again shares the first block's backward with that block's own calls
               + max(0.0, backward_calls + again - bwd_block) - max(0.0, backward_calls - bwd_block))
    return {"comm_s": grad_accum * comm, "exposed_s": grad_accum * exposed}


def _dp_collective(kind: str, nbytes: float, dp: int, tp: int, gpus_per_node: int, hw: Hardware) -> float:
    """A collective over the ``dp`` replicas' ranks of one tensor rank (stride ``tp``): on NVLink when they share a
    node, else on the inter-node link."""
    link = hw.intra if dp * tp <= gpus_per_node else hw.inter
    return collective_time(kind, dp, nbytes, link)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ---- host offload of the checkpointed block inputs (activation_offload), one rule for every row ---------------------

RESIDENT_BLOCK_INPUTS = 2  # with offload: the block being recomputed and the one fetched ahead of it


def block_input_bytes(cfg, micro_batch: int, seq: int, ranks: int) -> float:
    """Bytes one GPU keeps per block under full checkpointing: the block's input, ``micro_batch x seq x h`` bf16
    values cut over the ``ranks`` of one replica. Every row cuts it that way: the package's layouts (the ring by
    sequence, the grid by both), torch's CP (and CP x TP + SP, whose norms' inputs are sequence-parallel), 1-D TP
    + SP and Ulysses (both sequence-sharded between blocks)."""
    return micro_batch * seq * cfg.n_embd * ELEMENT / ranks


def offload_memory(memory: dict, cfg, micro_batch: int, seq: int, ranks: int, gpus_per_node: int) -> dict:
    """``memory`` (a row's parts, full checkpointing) with the checkpointed block inputs in host memory: all but
    :data:`RESIDENT_BLOCK_INPUTS` of the ``n_layer`` leave the GPU, so the peak drops by that many inputs (the
    peak of a fully checkpointed step holds every block's input: the backward of the last block, or the loss);
    never below what the step holds without any activation (parameters, gradients, optimizer state). Adds
    ``offloaded`` (bytes moved off one GPU), ``host`` (host bytes per GPU) and ``host_per_node``."""
    one = block_input_bytes(cfg, micro_batch, seq, ranks)
    moved = max(0, cfg.n_layer - RESIDENT_BLOCK_INPUTS) * one
    floor = memory.get("parameters", 0) + memory.get("gradients", 0) + memory.get("optimizer", 0)
    total = max(memory["total"] - moved, floor)
    host = cfg.n_layer * one
    return {**memory, "total": total, "offloaded": memory["total"] - total, "host": host,
            "host_per_node": host * gpus_per_node}


def offload_time(cfg, micro_batch: int, seq: int, ranks: int, hw: Hardware, forward_s: float,
                 backward_s: float) -> dict:
    """Seconds of one micro-batch's host copies: each block's input goes to the host behind the next block's forward
    and comes back one block ahead, behind the recomputation and backward of the block after it; what a copy takes
    beyond the compute it hides behind is exposed. ``{"copy_s", "exposed_s"}``."""
    if not hw.host_bytes_per_s:
        raise ValueError(f"activation offload: hardware {hw.name!r} has no host_bytes_per_s to price the copies")
    copy = block_input_bytes(cfg, micro_batch, seq, ranks) / hw.host_bytes_per_s
    n = cfg.n_layer
    exposed = n * (max(0.0, copy - forward_s / n) + max(0.0, copy - backward_s / n))
    return {"copy_s": 2 * n * copy, "exposed_s": exposed}


def price(cfg, *, layout: str, p: int, dp: int, zero_stage: int, checkpointing: str, micro_batch: int,
          grad_accum: int, seq: int, hw: Hardware, gpus_per_node: int, compiled: bool = True,
          memory: dict | None = None, async_tp: bool | None = None, cp_tp_size: int = 2,
          offload: bool = False, cp_loss: str = "chunked", overlap="fitted", shard_group: int = 0,
          loss: str = "unfused", float8: str | None = None, pipeline_parallel_size: int = 1,
          pp_schedule: str = "1f1b", virtual_stages: int = 1) -> PlanRow:
    """Predict one configuration (module docstring). ``layout`` is a package layout, ``"tp1d-sp"`` (a baseline;
    ``p`` 1: plain FSDP; ``async_tp``: force blocking (``False``) or async TP (``True``), default the faster),
    ``"cp"``: torch's context parallelism over ``p`` ranks x FSDP2 (``zero_stage`` 3) over ``p * dp``, the step
    :func:`~lightning_tp2d.planning.cost_model.cp_step_time`, the memory
    :func:`~lightning_tp2d.planning.rivals.cp_peak_bytes`, FSDP's traffic and the optimizer as plain FSDP's
    over ``p * dp`` ranks, or ``"cp-tp"``: the same with CP over ``p / cp_tp_size`` ranks, each ``cp_tp_size`` ranks
    of 1-D TP + SP (``async_tp`` as for the baseline), FSDP2 over the ``p / cp_tp_size * dp`` ranks of each tensor
    rank, as the 1-D baseline's. ``memory``: its :func:`row_memory` parts, if already computed (without offload).
    ``offload``: the checkpointed block inputs live in host memory (``checkpointing`` must be ``"full"``): the
    memory :func:`offload_memory`, the exposed copies :func:`offload_time`, the same rule for every row.
    ``cp_loss``: ``"cp"`` / ``"cp-tp"``'s loss, ``"chunked"`` (the default: as users run it) or ``"unfused"`` (as
    torchtitan's published runs did, for calibration).

    Both sides by one rule: ``overlap`` (:func:`~lightning_tp2d.planning.cost_model.overlap_rule`: ``"fitted"``,
    the default, ``"pessimistic"``, ``"ideal"``, a number or a mapping kind -> efficiency) is the fraction of each
    collective's hideable time really hidden, for the package's SUMMA and ring calls, async TP's and CP's ring
    alike. The package assumes its traced schedule (each call behind the compute posted while it is in flight);
    the baseline assumes torch's async TP (each all-gather / reduce-scatter micro-pipelined with its matmul, the
    first chunk exposed) where that is faster than blocking, bf16 on the wire (``lean_wire``).

    The baseline (``"tp1d-sp"``) also takes ``shard_group`` (HSDP at stages 2 and 3: FSDP over groups of that many
    replicas, replicated across groups, :func:`data_parallel_time`; 0: FSDP over all ``dp``), ``zero_stage`` 1
    (DDP with AdamW's moments sharded) and ``loss``: ``"unfused"`` (the default: torchtitan's published runs) or
    ``"chunked"`` (the head and cross-entropy over chunks of
    :data:`~lightning_tp2d.planning.rivals.CHUNK_TOKENS` tokens: each chunk's logits recomputed in the backward,
    one more head matmul and 4 GEMM kernels a chunk instead of 3 in all, ``loss_parallel``'s three ``[n, 1]``
    all-reduces again per chunk; memory :func:`~lightning_tp2d.planning.rivals.baseline_row_peak_bytes`). Its
    elementwise work is priced on the bytes its elementwise ops touch: the norms' outputs sequence-sharded, as
    they are written, not the all-gathered copies the column-parallel linears save.

    ``float8`` (``"tensorwise"`` / ``"rowwise"``): the linears in float8, on every side by one rule
    (:func:`~lightning_tp2d.planning.cost_model.float8_seconds`: their GEMMs at the hardware's float8 rate, the casts'
    bytes at its memory rate; the layouts' ``parallel.float8``, the rivals as torchao's recipe runs them). On the wire
    under tensorwise: the grids' operand panels and weight columns at one byte per element with their amax
    all-reduces (their closed forms, :meth:`~lightning_tp2d.planning.rival_models.SideModel.on_the_wire`; the ring's
    float8 weight blocks are priced in bf16), a rival's FSDP2 all-gathers of its linears' weights at one byte
    (torchao's ``enable_fsdp_float8_all_gather``, :func:`~lightning_tp2d.planning.cost_model.float8_gather_element`,
    its weights cast as shards); rowwise sends what bf16 does. Memory is priced as bf16's.

    ``pipeline_parallel_size`` > 1: ``pp`` stages of whole blocks, each ``p x dp`` GPUs, running ``pp_schedule`` over
    ``grad_accum`` micro-batches with ``virtual_stages`` per rank (:func:`price_stages`), on either side (the
    package's :mod:`lightning_tp2d.pipeline`, torchtitan's PP for the baseline)."""
    if pipeline_parallel_size > 1:
        return price_stages(cfg, layout=layout, p=p, dp=dp, zero_stage=zero_stage, checkpointing=checkpointing,
                            micro_batch=micro_batch, grad_accum=grad_accum, seq=seq, hw=hw,
                            gpus_per_node=gpus_per_node, compiled=compiled, memory=memory, async_tp=async_tp,
                            cp_tp_size=cp_tp_size, offload=offload, cp_loss=cp_loss, overlap=overlap,
                            shard_group=shard_group, loss=loss, float8=float8, pp=pipeline_parallel_size,
                            schedule=pp_schedule, virtual_stages=virtual_stages)
    if offload and checkpointing != "full":
        raise ValueError(f"activation offload moves the inputs full checkpointing keeps; got checkpointing="
                         f"{checkpointing!r}")
    asked = RowPlan(layout, p, dp, zero_stage, checkpointing, micro_batch, grad_accum, seq, offload, async_tp,
                    cp_tp_size, cp_loss, shard_group, loss, float8)
    side = asked.side  # the rival's or the layout's cost and memory model: the only dispatch here
    side.check(asked)
    baseline = side.baseline
    rule = cost_model.overlap_rule(overlap)
    hw = dataclasses.replace(hw, gpus_per_node=gpus_per_node)
    passes = ELEMENTWISE_PASSES["compiled" if compiled else "eager"]
    split = parameter_split(cfg)
    micro, async_tp, saved = side.micro(cfg, asked, hw, rule)
    if compiled and side.torch_code:
        micro = _padded_by_inductor(micro)
    if memory is None:
        memory = side.memory(cfg, asked)
    float8_s = 0.0
    sharded = side.data_parallel(split, asked)  # FSDP / ZeRO over the replicas of each tensor shard
    # a rival's FSDP2 all-gathers its float8 linears' weights as float8 under tensorwise (torchao's
    # enable_fsdp_float8_all_gather, torchtitan's option), each shard cast before the gather
    float8_gather = float8 == "tensorwise" and side.torch_code and fsdp_shards(zero_stage, sharded.sharding)
    if float8 is not None:  # the linears' GEMMs faster, their casts' bytes added: the same rule for every side
        f8 = cost_model.float8_seconds(cfg, micro_batch * seq, p, checkpointing, float8, hw,
                                       weight_shards=sharded.sharding if float8_gather else 1)
        float8_s = f8["cast_s"] - f8["gemm_saved_s"]
        micro = {**micro, "compute_s": micro["compute_s"] + float8_s, "total_s": micro["total_s"] + float8_s}
    fl = micro["flops"]
    forward_s = micro["compute_s"] * fl["forward"] / fl["total"]
    backward_s = micro["compute_s"] - forward_s
    # the side's measured memory-bound bytes over what its elementwise model says (host_cost.memory_bound_ratio); the
    # layouts' extra, moved inside their registered ops, which the compiler does not enter, is priced eager
    ring = asked.context_parallel_size  # a CP rival's ring: its counts grow with it, as METP's
    ratio = host_cost.memory_bound_ratio(side.host_name(p), cfg, p, ring)
    extra_passes = ELEMENTWISE_PASSES["eager"] if compiled and not side.torch_code and ratio > 1 else passes
    elementwise_s = (passes + extra_passes * (ratio - 1.0)) * saved / hw.hbm_bytes_per_s
    # the host issues the micro-batch's ops while the GPU runs them: the slower of the two (planning.host_cost)
    issue_s = host_cost.micro_batch_host_seconds(side.host_name(p), cfg, p, checkpointing, compiled, ring)
    micro_s = max(micro["total_s"] + elementwise_s, issue_s)
    host = {"copy_s": 0.0, "exposed_s": 0.0}
    if offload:
        memory = offload_memory(memory, cfg, micro_batch, seq, p, gpus_per_node)
        host = offload_time(cfg, micro_batch, seq, p, hw, forward_s, backward_s)
        micro_s += host["exposed_s"]
    root, block = sharded.shard(split.root, split.root_vectors), sharded.shard(split.block, split.block_vectors)
    data = data_parallel_time(root=root, block=block, n_layer=split.n_layer, dp=sharded.sharding, tp=sharded.ranks,
                              stage=zero_stage, gpus_per_node=gpus_per_node, hw=hw, forward_s=forward_s,
                              backward_s=backward_s, grad_accum=grad_accum, regathered=sharded.regathered,
                              shard_group=shard_group if baseline else 0,
                              block_elem=cost_model.float8_gather_element(cfg, ELEMENT) if float8_gather else None)
    # HSDP: the optimizer's shard is 1 / group
    sharded_over = shard_group if baseline and shard_group else sharded.sharding
    updated = (root + split.n_layer * block) / (sharded_over if zero_stage >= 1 else 1)
    optimizer_s = OPTIMIZER_BYTES_PER_ELEMENT * updated / hw.hbm_bytes_per_s
    step_s = grad_accum * micro_s + data["exposed_s"] + optimizer_s
    tokens = dp * micro_batch * grad_accum * seq
    per_gpu = tokens / step_s / (p * dp)
    mfu = model_flops_per_token(cfg, seq) * per_gpu / hw.peak_flops_per_s if hw.peak_flops_per_s else 0.0
    parts = {"memory_bytes": memory,
             "time_s": {"micro_compute": micro["compute_s"], "micro_tp_exposed": micro["exposed_comm_s"],
                        "micro_elementwise": elementwise_s, "dp_comm": data["comm_s"], "dp_exposed": data["exposed_s"],
                        "optimizer": optimizer_s, "micro_host_copy": host["copy_s"],
                        "micro_host_exposed": host["exposed_s"], "micro_host_ops": issue_s,
                        "micro_unaligned": micro.get("unaligned_s", 0.0), "micro_float8": float8_s}}
    run = dataclasses.replace(asked, async_tp=async_tp, shard_group=shard_group if baseline and shard_group != dp
                              else 0, loss=side.loss_label(asked))
    return PlanRow(run, baseline, memory["total"] / GIB, step_s, per_gpu, mfu, parts)


def stage_blocks(cfg, seq: int, pp: int, virtual_stages: int = 1) -> list[int]:
    """Blocks each of ``pp`` pipeline ranks holds (its ``virtual_stages`` stages together): the package's own split,
    balanced by FLOPs (:func:`lightning_tp2d.pipeline.split_blocks`), which the baseline's priced split follows too."""
    from lightning_tp2d.pipeline import block_costs, split_blocks  # (torch: the pipeline module's import)

    splits = split_blocks(cfg.n_layer, pp * virtual_stages, block_costs(cfg, seq))
    return [sum(len(splits[r + k * pp]) for k in range(virtual_stages)) for r in range(pp)]


def price_stages(cfg, *, layout: str, p: int, dp: int, zero_stage: int, checkpointing: str, micro_batch: int,
                 grad_accum: int, seq: int, hw: Hardware, gpus_per_node: int, pp: int, schedule: str = "1f1b",
                 virtual_stages: int = 1, memory: dict | None = None, **options) -> PlanRow:
    """One configuration with ``pp`` pipeline stages (:func:`price`'s ``pipeline_parallel_size``), by
    :mod:`lightning_tp2d.planning.pipeline_cost`'s model of a step:

    * each rank's blocks (:func:`stage_blocks`) priced as :func:`price` prices a model of that many blocks on its
      ``p x dp`` GPUs: a micro-batch's time is ``a + b k`` for ``k`` blocks (``b`` from models of ``k`` and ``k + 1``
      blocks), the ends ``a`` (the head and loss, the embedding) on the last rank only; the slowest rank's
      ``grad_accum`` micro-batches are the stage's work;
    * the schedule: ``(m v + pp - 1)`` chunk slots (:func:`~lightning_tp2d.planning.pipeline_cost.pipeline_step_time`),
      each chunk's two boundary transfers (its activation shard forward, its gradient back, bf16) on its critical
      path, over the inter-node link when a stage fills whole nodes, else NVLink;
    * the data-parallel collectives and the optimizer: the last rank's (its model holds the embedding too: an
      over-count on an untied model of one vocabulary matrix), once per step (FSDP gathers at the first
      micro-batch and reduce-scatters after the last under torch's schedules);
    * memory: :func:`row_memory` with the stages (the first rank's in-flight micro-batches, the last rank's head;
      under FSDP the stage's gathered parameters and unreduced gradients held across the micro-batches).

    ``grad_accum`` is the schedule's micro-batches ``m``; the tokens of a step are ``dp x micro_batch x m x seq``."""
    from lightning_tp2d.planning.pipeline_cost import bubble_fraction, chunk_slots, pipeline_step_time
    from lightning_tp2d.train_plan import pipeline_problem

    problem = pipeline_problem(pp, schedule, grad_accum, virtual_stages)
    if problem:
        raise ValueError(f"price_stages: {problem} (grad_accum is the micro-batches)")
    blocks = stage_blocks(cfg, seq, pp, virtual_stages)
    k = blocks[-1]
    options.pop("pipeline_parallel_size", None)
    common = dict(layout=layout, p=p, dp=dp, zero_stage=zero_stage, checkpointing=checkpointing,
                  micro_batch=micro_batch, grad_accum=grad_accum, seq=seq, hw=hw, gpus_per_node=gpus_per_node,
                  **options)
    if memory is None:
        memory = row_memory(cfg, layout, p, dp, zero_stage, checkpointing, micro_batch, seq,
                            pipeline_parallel_size=pp, pp_schedule=schedule, virtual_stages=virtual_stages,
                            **{key: options[key] for key in ("cp_tp_size", "cp_loss", "shard_group", "loss")
                               if key in options})
    last = price(dataclasses.replace(cfg, n_layer=k), memory=memory, **common)
    more = price(dataclasses.replace(cfg, n_layer=k + 1), memory=memory, **common)
    # the data-parallel collectives once per step: FSDP's groups gather at the first micro-batch and reduce after the
    # last (torch's PipelineStage), ZeRO 0/1 reduce once: priced as a step of one micro-batch
    once = price(dataclasses.replace(cfg, n_layer=k), memory=memory, **{**common, "grad_accum": 1})

    def micro_s(row: PlanRow) -> float:
        t = row.parts["time_s"]
        return (row.step_s - t["dp_exposed"] - t["optimizer"]) / grad_accum

    per_block = micro_s(more) - micro_s(last)
    ends = micro_s(last) - per_block * k
    slowest = max([per_block * b for b in blocks[:-1]] + [ends + per_block * k])
    shard = micro_batch * seq * cfg.n_embd / p * ELEMENT  # one chunk's activation shard (its gradient: as many)
    link = hw.inter if p * dp >= gpus_per_node else hw.intra
    boundary_s = 2 * collective_time("send", 2, shard, link)
    pipeline_s = pipeline_step_time(grad_accum * slowest, boundary_s, pp, grad_accum, virtual_stages, schedule)
    t = {**last.parts["time_s"], **{key: once.parts["time_s"][key] for key in ("dp_comm", "dp_exposed", "optimizer")}}
    step_s = pipeline_s + t["dp_exposed"] + t["optimizer"]
    tokens = dp * micro_batch * grad_accum * seq
    per_gpu = tokens / step_s / (p * dp * pp)
    mfu = model_flops_per_token(cfg, seq) * per_gpu / hw.peak_flops_per_s if hw.peak_flops_per_s else 0.0
    slots = chunk_slots(pp, grad_accum, virtual_stages, schedule)
    parts = {"memory_bytes": memory,
             "time_s": {**t, "stage_work": grad_accum * slowest,
                        "pp_bubble": bubble_fraction(pp, grad_accum, virtual_stages, schedule) * pipeline_s,
                        "pp_boundary": slots * boundary_s},
             "stage_blocks": blocks}
    run = dataclasses.replace(last.plan, pipeline_parallel_size=pp, pp_schedule=schedule,
                              virtual_stages=virtual_stages)
    return PlanRow(run, last.baseline, memory["total"] / GIB, step_s, per_gpu, mfu, parts)


def _micro_batches(per_replica: int, multiple: int, largest: int | None) -> list[int]:
    """Micro-batch sizes to try, ascending: ``multiple`` times the powers of two that divide ``per_replica``, up to
    ``largest`` (default :data:`MAX_MICRO_BATCH`, or ``multiple`` if that is more)."""
    largest = max(multiple, MAX_MICRO_BATCH if largest is None else largest)
    out, m = [], multiple
    while m <= per_replica and m <= largest:
        if per_replica % m == 0:
            out.append(m)
        m *= 2
    return out


MAX_GRID = 64  # grids up to 8 x 8 (8 nodes of 8): a larger one's SUMMA panels cross more nodes than any row helps


PP_SCHEDULE_VARIANTS = (("1f1b", 1), ("interleaved_1f1b", 2))  # the schedules planned with stages (and v)


def _candidates(cfg, gpus: int, gpus_per_node: int, seq: int, sequences: int, layouts, include_baselines: bool,
                zero_stages, checkpointing, max_micro_batch: int | None, pipeline_sizes=(1,)):
    """``(layout, p, dp, stages, modes, micro-batches[, variant])`` to try, micro-batches ascending. Rings stay
    inside a node (their exchanges are sized for NVLink); grids may span nodes, up to :data:`MAX_GRID` ranks. Each
    ``pp`` of ``pipeline_sizes`` above 1 that divides the machines (or, on one machine, its GPUs) and the blocks
    adds the candidates of one stage's ``gpus / pp`` GPUs with each schedule of :data:`PP_SCHEDULE_VARIANTS`
    (``variant``: ``pipeline_parallel_size``, ``pp_schedule``, ``virtual_stages``), the micro-batches those whose
    count per step the schedule runs (:func:`~lightning_tp2d.train_plan.pipeline_problem`); both sides at every
    ZeRO stage (the package's FSDP2 per stage, torchtitan's PP x FSDP)."""
    from lightning_tp2d.train_plan import pipeline_problem

    out = _flat_candidates(cfg, gpus, gpus_per_node, seq, sequences, layouts, include_baselines, zero_stages,
                           checkpointing, max_micro_batch) if 1 in pipeline_sizes else []
    nodes = max(1, gpus // gpus_per_node)
    for pp in sorted(set(pipeline_sizes) - {1}):
        if gpus % pp or not (nodes % pp == 0 or (gpus <= gpus_per_node and gpus_per_node % pp == 0)):
            continue
        for schedule, v in PP_SCHEDULE_VARIANTS:
            if cfg.n_layer < pp * v:
                continue
            for name, p, dp, stages, modes, micros, *extra in _flat_candidates(
                    cfg, gpus // pp, gpus_per_node, seq, sequences, layouts, include_baselines, zero_stages,
                    checkpointing, max_micro_batch):
                per_replica = sequences // dp
                kept = [mb for mb in micros if pipeline_problem(pp, schedule, per_replica // mb, v) is None]
                if kept:
                    variant = {**(extra[0] if extra else {}), "pipeline_parallel_size": pp, "pp_schedule": schedule,
                               "virtual_stages": v}
                    out.append((name, p, dp, stages, modes, kept, variant))
    return out


def _flat_candidates(cfg, gpus: int, gpus_per_node: int, seq: int, sequences: int, layouts, include_baselines: bool,
                     zero_stages, checkpointing, max_micro_batch: int | None):
    """:func:`_candidates` without pipeline stages."""
    out = []
    for name in layouts:
        spec = get_layout(name)
        for p in _divisors(gpus):
            if p == 1 or p > MAX_GRID or not fits(spec, p, cfg) or spec.sequence_problem(p, seq):
                continue
            if not spec.square and p > gpus_per_node:
                continue
            dp = gpus // p
            micros = _micro_batches(sequences // dp, spec.input_multiples(p)[0], max_micro_batch)
            stages = [s for s in zero_stages if s == 0 or dp > 1]
            if micros and stages:
                out.append((name, p, dp, stages, list(checkpointing), micros))
    if include_baselines:
        heads = [cfg.n_head, anatomy(cfg).kv_heads]
        for tp in _divisors(min(gpus, gpus_per_node)):
            if gpus % tp or any(n % tp for n in heads) or cfg.n_embd % tp or seq % tp:
                continue
            dp = gpus // tp
            micros = _micro_batches(sequences // dp, 1, max_micro_batch)
            stages = list(zero_stages) if dp > 1 else [0]  # as the package's: DDP, ZeRO 1, FSDP 2 and 3
            group = gpus_per_node // tp  # HSDP: FSDP over the replicas inside a node, replicated across nodes
            hsdp = [s for s in stages if s >= 2] if 2 <= group < dp and dp % group == 0 else []
            for loss in LOSS_VARIANTS:
                for shard_group, shard_stages in ((0, stages), (group, hsdp)):
                    if micros and shard_stages:
                        out.append((BASELINE, tp, dp, shard_stages, list(checkpointing), micros,
                                    {"shard_group": shard_group, "loss": loss}))
    return out


def search_space(model, *, gpus: int, gpus_per_node: int = 8, seq: int, global_batch_tokens: int,
                 include_baselines: bool = True, layouts=None, zero_stages=ZERO_STAGES,
                 checkpointing=CHECKPOINTING, max_micro_batch: int | None = None,
                 activation_offload=(False,), pipeline_sizes=(1,)) -> dict[str, int]:
    """How many configurations :func:`plan` with these arguments considers on each side: ``{"package": n,
    "baseline": m}`` (:func:`count_configurations` of its candidates), whether or not they fit."""
    cfg = model_config(model)
    names = layout_names() if layouts is None else tuple(layouts)
    return count_configurations(_candidates(cfg, gpus, gpus_per_node, seq, global_batch_tokens // seq, names,
                                            include_baselines, zero_stages, checkpointing, max_micro_batch,
                                            tuple(pipeline_sizes)),
                                activation_offload)


def count_configurations(candidates, activation_offload=(False,)) -> dict[str, int]:
    """``{"package": n, "baseline": m}``: for every candidate of :func:`_candidates` its ZeRO stages x checkpointing
    modes x micro-batches (x the offload settings of the fully checkpointed rows). The baseline's variants (HSDP,
    the chunked loss) are candidates of their own."""
    counts = {"package": 0, "baseline": 0}
    for name, _, _, stages, modes, micros, *_ in candidates:
        settings = sum(len([off for off in activation_offload if mode == "full" or not off]) for mode in modes)
        counts["baseline" if is_rival(name) else "package"] += len(stages) * settings * len(micros)
    return counts


def plan(model, *, gpus: int, gpu_memory_gib: float, gpus_per_node: int = 8, seq: int,
         global_batch_tokens: int, hardware: str | Hardware = "h100", include_baselines: bool = True,
         layouts=None, zero_stages=ZERO_STAGES, checkpointing=CHECKPOINTING,
         memory_fraction: float = 0.9, max_micro_batch: int | None = None, compiled: bool = True,
         workers: int = 1, activation_offload=(False,), overlap="fitted", method: str = "closed",
         cache: bool | str | os.PathLike = True, float8: str | None = None, pipeline_sizes=(1,)) -> list[PlanRow]:
    """The configurations of ``model`` (a named size of any registered family, a config, or a config's fields)
    that fit ``gpus`` GPUs of ``gpu_memory_gib`` GiB (predicted peak at most ``memory_fraction`` of it), best first
    by predicted step time (module docstring). ``global_batch_tokens`` is rounded down to whole sequences of
    ``seq`` per replica. ``layouts``: the package layouts to consider (default: all registered);
    ``include_baselines``: the 1-D TP + SP x FSDP rows too (``baseline=True``). ``compiled``: price elementwise work
    as ``torch.compile`` runs it (else eager). ``workers``: how many (layout, size) candidates to plan at once, each
    in a forked process of its own (with its own memory-model worker; the rows are the same as with one).
    ``activation_offload``: the offload settings to consider (``(False, True)``: each fully checkpointed row also
    with its block inputs in host memory, :func:`offload_memory`, where the node's host memory holds them).
    ``overlap``: the overlap rule both sides are priced by (:func:`price`; ``"fitted"``, ``"pessimistic"``,
    ``"ideal"`` or a mapping kind -> efficiency); :func:`search_space` with the same arguments counts the
    configurations each side considers. ``method``: ``"closed"`` (the default) reads the package's rows from the
    closed forms (:func:`lightning_tp2d.planning.trace.closed_forms`,
    :func:`lightning_tp2d.planning.memory_model.closed_forms`: arithmetic on the config, held to the traced models
    by the tests) wherever they model the row and traces the rest; ``"traced"`` traces every row (the reference).
    ``cache``: keep the answer on disk and answer the same question from there (:mod:`lightning_tp2d.planning.cache`:
    keyed by every argument, the hardware's rates and the package's source; ``True`` the environment's folder, a
    path that folder, ``False`` none). Raises :class:`NothingFits` (a ``ValueError``; cached too) naming the model,
    the least memory per GPU any configuration needs and that configuration. ``float8``: every row, the package's
    and the rivals', with its linears in float8 by that torchao recipe (:func:`price`); the hardware must have
    float8 GEMMs. ``pipeline_sizes``: the pipeline sizes ``pp`` to consider on both sides (default ``(1,)``: none;
    :func:`_candidates`, :func:`price_stages`)."""
    cfg = model_config(model)
    pipeline_sizes = tuple(sorted(set(pipeline_sizes)))
    if not pipeline_sizes or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in pipeline_sizes):
        raise ValueError(f"plan: pipeline_sizes must be positive ints, got {pipeline_sizes!r}")
    if family_of_config(cfg) is None:
        raise ValueError(f"plan: {model!r} is not a named size or config of a registered model family")
    if gpus < 1 or gpus_per_node < 1 or gpu_memory_gib <= 0:
        raise ValueError(f"plan: need gpus >= 1, gpus_per_node >= 1 and gpu_memory_gib > 0, got gpus={gpus}, "
                         f"gpus_per_node={gpus_per_node}, gpu_memory_gib={gpu_memory_gib}")
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"plan: workers must be a positive int, got {workers!r}")
    if method not in METHODS:
        raise ValueError(f"plan: method={method!r} is not one of {METHODS}")
    if max_seq_len(cfg) is not None and seq > cfg.block_size:  # (None: RoPE, any length)
        raise ValueError(f"plan: seq={seq} exceeds the model's block_size={cfg.block_size}")
    hw = HARDWARE[hardware] if isinstance(hardware, str) else hardware
    float8 = check_float8(float8)
    if float8 is not None and hw.float8_gemm_speedup <= 0:
        raise ValueError(f"plan: float8={float8!r}, but {hw.name} has no float8 GEMMs (H100 and H200 have)")
    sequences = global_batch_tokens // seq
    if sequences < 1:
        raise ValueError(f"plan: global_batch_tokens={global_batch_tokens} is less than one sequence of {seq}")
    cap = memory_fraction * gpu_memory_gib * GIB
    names = layout_names() if layouts is None else tuple(layouts)
    folder = plan_cache.cache_dir(cache)
    key = plan_cache.cache_key("plan", model=cfg, gpus=gpus, gpu_memory_gib=gpu_memory_gib,
                               gpus_per_node=gpus_per_node, seq=seq, global_batch_tokens=global_batch_tokens,
                               hardware=hw, include_baselines=include_baselines, layouts=names,
                               zero_stages=tuple(zero_stages), checkpointing=tuple(checkpointing),
                               memory_fraction=memory_fraction, max_micro_batch=max_micro_batch, compiled=compiled,
                               activation_offload=tuple(activation_offload), overlap=overlap, method=method,
                               **({"float8": float8} if float8 is not None else {}),
                               **({"pipeline_sizes": pipeline_sizes} if pipeline_sizes != (1,) else {}))
    stored = plan_cache.load(folder, key)
    if stored is not None:
        if stored.get("error"):
            raise NothingFits(stored["error"])
        return [PlanRow.of(**row) for row in stored["rows"]]
    candidates = _candidates(cfg, gpus, gpus_per_node, seq, sequences, names, include_baselines, zero_stages,
                             checkpointing, max_micro_batch, pipeline_sizes)
    with ranks_as_asked(), pricing(method):
        planned = in_processes(functools.partial(_plan_candidate, cfg, seq=seq, sequences=sequences, hw=hw,
                                                 gpus_per_node=gpus_per_node, cap=cap, compiled=compiled,
                                                 offloads=tuple(activation_offload), overlap=overlap, float8=float8),
                               candidates, workers)
    rows = [row for found, _ in planned for row in found]
    smallest = min((least for _, least in planned if least is not None), default=None)
    if not rows:
        if smallest is None:
            error = (f"plan: no layout splits {model!r} over {gpus} GPUs ({gpus_per_node} per node) with seq={seq} "
                     f"and {sequences} sequences per step")
        else:
            error = (f"plan: nothing fits {model!r} on {gpus} GPUs of {gpu_memory_gib} GiB "
                     f"({memory_fraction:.0%} usable): the least memory per GPU any configuration needs is "
                     f"{smallest[0] / GIB:.1f} GiB ({smallest[1]})")
        plan_cache.store(folder, key, {"rows": [], "error": error})
        raise NothingFits(error)
    rows = sorted(rows, key=lambda r: r.step_s)
    plan_cache.store(folder, key, {"rows": [r.to_dict() for r in rows]})
    return rows


METHODS = ("closed", "traced")


@contextlib.contextmanager
def pricing(method: str = "closed") -> Iterator[None]:
    """Inside, the package's rows are read from the closed forms (``"closed"``, where they model the row; traced
    elsewhere) or traced (``"traced"``): :func:`plan`'s ``method``, for callers of :func:`row_memory` and
    :func:`price` too (``tp2d-train``'s fit check). Forked planning processes inherit the choice."""
    if method not in METHODS:
        raise ValueError(f"pricing: method={method!r} is not one of {METHODS}")
    with contextlib.ExitStack() as stack:
        if method == "closed":
            stack.enter_context(trace.closed_forms())
            stack.enter_context(memory_model.closed_forms())
        yield


def _plan_candidate(cfg, candidate, *, seq: int, sequences: int, hw: Hardware, gpus_per_node: int, cap: float,
                    compiled: bool, offloads=(False,), overlap="fitted",
                    float8: str | None = None) -> tuple[list[PlanRow], tuple[int, str] | None]:
    """One (layout, size) candidate of :func:`plan`: its rows that fit, and its least memory with the configuration
    that needs it. From the least memory up (ZeRO stage 3 before 2, 1, 0; full checkpointing before selective and
    none; micro-batches ascending): what does not fit at its least micro-batch leaves out every configuration that
    keeps more. A baseline candidate's seventh item: its ``shard_group`` and ``loss`` (:func:`_candidates`)."""
    name, p, dp, stages, modes, micros, *variant = candidate
    extra = variant[0] if variant else {}
    named = "".join(f" {k}={v}" for k, v in extra.items())
    per_replica = sequences // dp
    started = time.time()
    rows, smallest, previous = [], None, None
    for stage in sorted(stages, reverse=True):
        fitted = False
        for mode in sorted(modes, key=_LEAST_MEMORY_FIRST.index):
            settings = [off for off in (True, False) if off in offloads and (mode == "full" or not off)]
            if not settings:
                continue
            first_fits = False
            for i, m in enumerate(micros):  # ascending: memory grows with the micro-batch
                staged = {"microbatches": per_replica // m} if extra.get("pipeline_parallel_size", 1) > 1 else {}
                memory = row_memory(cfg, name, p, dp, stage, mode, m, seq, **extra, **staged)
                fits_here = False
                for off in settings:
                    held = offload_memory(memory, cfg, m, seq, p, gpus_per_node) if off else memory
                    if smallest is None or held["total"] < smallest[0]:
                        smallest = (held["total"], f"{name} p={p} dp={dp} zero_stage={stage} checkpointing={mode} "
                                                   f"micro_batch={m}{' activation_offload' if off else ''}{named}")
                    if held["total"] > cap or (off and held["host_per_node"] > hw.host_memory_bytes):
                        continue
                    fits_here = True
                    rows.append(price(cfg, layout=name, p=p, dp=dp, zero_stage=stage, checkpointing=mode,
                                      micro_batch=m, grad_accum=per_replica // m, seq=seq, hw=hw,
                                      gpus_per_node=gpus_per_node, compiled=compiled, memory=memory, offload=off,
                                      overlap=overlap, float8=float8, **extra))
                if not fits_here:
                    break
                first_fits = first_fits or i == 0
                if i == 1 and not is_rival(name) and not staged:
                    _bracket(cfg, name, p, dp, stage, mode, micros, seq, previous, memory, cap)
                previous = memory
            if not first_fits:
                break  # the modes that keep more do not fit either
            fitted = True
        if not fitted:
            break  # nor do the lower stages
    log.info("plan: %s p=%d dp=%d priced in %.1f s (%d rows)", name, p, dp, time.time() - started, len(rows))
    return rows, smallest


_LEAST_MEMORY_FIRST = ("full", "selective", "none")


def _bracket(cfg, layout: str, p: int, dp: int, stage: int, mode: str, micros: list[int], seq: int, first: dict,
             second: dict, cap: float) -> None:
    """Profile the largest micro-batch that the first two (``first``, ``second``: their parts) say will fit, read
    as a straight line through them, so that the memory model reads those between from it and the second
    (:func:`lightning_tp2d.planning.memory_model.shard_bytes`; exact: the line only picks which one to build)."""
    slope = (second["total"] - first["total"]) / (micros[1] - micros[0])
    likely = [m for m in micros[3:] if second["total"] + slope * (m - micros[1]) <= cap]
    if likely:
        row_memory(cfg, layout, p, dp, stage, mode, likely[-1], seq)


def row_memory(cfg, layout: str, p: int, dp: int, stage: int, mode: str, micro_batch: int, seq: int, *,
               cp_tp_size: int = 2, cp_loss: str = "chunked", shard_group: int = 0, loss: str = "unfused",
               pipeline_parallel_size: int = 1, pp_schedule: str = "1f1b", virtual_stages: int = 1,
               microbatches: int | None = None) -> dict:
    """Predicted peak bytes per GPU of one row, with their parts: a package layout's
    :func:`~lightning_tp2d.planning.memory_model.peak_bytes` (tensor rank 0; AdamW's fused step), the 1-D baseline's
    :func:`~lightning_tp2d.planning.memory_model.baseline_peak_bytes`, or ``"cp"`` / ``"cp-tp"``'s
    :func:`~lightning_tp2d.planning.rivals.cp_peak_bytes` (CP over ``p`` / ``p / cp_tp_size`` ranks; its FSDP2
    is stage 3 whatever ``stage`` says). The baseline's ``shard_group`` (HSDP), stage 1 and ``loss``:
    :func:`~lightning_tp2d.planning.rivals.baseline_row_peak_bytes`.

    With ``pipeline_parallel_size`` > 1 (``pp_schedule``, ``virtual_stages``, ``microbatches`` per step, default
    ``pp x virtual_stages``): the larger of the first rank's (a model of its blocks keeping
    :func:`~lightning_tp2d.planning.pipeline_cost.in_flight` micro-batches' activations: a batch of that many) and
    the last rank's (its blocks and the head, one micro-batch in flight under 1F1B). Each is a whole model of its
    blocks, the embedding and head included: an over-count of one vocabulary matrix and, on the first rank, of the
    head's transient logits."""
    if pipeline_parallel_size > 1:
        from lightning_tp2d.planning.pipeline_cost import in_flight

        pp, v = pipeline_parallel_size, virtual_stages
        m = pp * v if microbatches is None else microbatches
        blocks = stage_blocks(cfg, seq, pp, v)
        held = []
        split = parameter_split(cfg)
        for rank in (0, pp - 1):
            kept = math.ceil(in_flight(pp, m, v, pp_schedule, rank) - 1e-9)
            parts = dict(row_memory(dataclasses.replace(cfg, n_layer=blocks[rank]), layout, p, dp, stage, mode,
                                    micro_batch * kept, seq, cp_tp_size=cp_tp_size, cp_loss=cp_loss,
                                    shard_group=shard_group, loss=loss))
            if fsdp_shards(stage, shard_group or dp) and m > 1:
                # torch's PipelineStage keeps an FSDPModule's parameters gathered (bf16) and its gradients
                # unreduced (float32) from the first micro-batch's backward to the last's (set_reshard_after_backward,
                # set_requires_gradient_sync False): the rank's whole tensor shard, twice, on top of the row's
                # the first rank's embedding (tied: the shared matrix, counted in vocab); the last rank's head, final
                # norm (and a tied embedding's copy): the root less an untied embedding
                ends = (split.embedding or split.vocab) if rank == 0 else split.root - split.embedding
                shard = (blocks[rank] * split.block + ends) / p
                parts["pp_fsdp_held"] = shard * (ELEMENT + 4)
                parts["total"] += parts["pp_fsdp_held"]
            held.append(parts)
        return max(held, key=lambda parts: parts["total"])
    side = model_of(layout)
    if not side.baseline and (shard_group or loss != "unfused"):
        raise ValueError(f"shard_group and loss are the {TP1D_SP.name!r} baseline's, not layout {layout!r}'s")
    return side.memory(cfg, RowPlan(layout, p, dp, stage, mode, micro_batch, seq=seq, cp_tp_size=cp_tp_size,
                                    cp_loss=cp_loss, shard_group=shard_group, loss=loss))


def longest_sequence(cfg, *, layout: str, p: int, dp: int = 1, zero_stage: int, gpu_memory_gib: float,
                     hw: Hardware, gpus_per_node: int = 8, memory_fraction: float = 0.9, offload: bool = False,
                     multiple: int | None = None, start: int = 131072, memory_fn=None, cp_tp_size: int = 2) -> dict:
    """The longest sequence (one per replica, full checkpointing) whose predicted peak fits ``memory_fraction`` of
    ``gpu_memory_gib`` on ``layout`` over ``p`` ranks x ``dp`` replicas, with (``offload``) or without the block
    inputs in host memory (then the node's host memory must hold them too): ``{"seq", "memory", "evaluations",
    "limit"}``, ``limit`` naming what stops it (``"gpu"`` or ``"host"``). Every scheme's peak grows about linearly
    in the sequence under full checkpointing, so the memory model is read at two lengths, the line through them
    solved for the cap, and the answer checked (and moved by secant steps) until it fits and ``multiple`` tokens more
    do not: a handful of evaluations, not a bisection. ``memory_fn(seq)``: the row's memory parts (default
    :func:`row_memory`), so the rivals' own estimates plug in."""
    cap = memory_fraction * gpu_memory_gib * GIB
    multiple = multiple or 1024 * 2 * p
    read = memory_fn or (lambda seq: row_memory(cfg, layout, p, dp, zero_stage, "full", 1, seq, cp_tp_size=cp_tp_size))
    seen: dict[int, dict] = {}

    def memory(seq: int) -> dict:
        if seq not in seen:
            parts = read(seq)
            seen[seq] = offload_memory(parts, cfg, 1, seq, p, gpus_per_node) if offload else parts
        return seen[seq]

    host_limit = None
    if offload:
        if not hw.host_memory_bytes:
            raise ValueError(f"longest_sequence: hardware {hw.name!r} has no host_memory_bytes for offload")
        per_token = cfg.n_layer * block_input_bytes(cfg, 1, 1, p) * gpus_per_node
        host_limit = int(memory_fraction * hw.host_memory_bytes / per_token) // multiple * multiple
    a = max(multiple, start // multiple * multiple)
    b = 2 * a
    flat = 0
    while memory(b)["total"] <= memory(a)["total"]:  # e.g. offload at short lengths: the step's floor holds
        flat += 1
        if flat > 12:
            raise ValueError(f"longest_sequence: {layout} p={p}: the peak does not grow with the sequence "
                             f"({memory(a)['total'] / GIB:.2f} GiB at {a}, {memory(b)['total'] / GIB:.2f} at {b})")
        a, b = b, 2 * b
    for _ in range(8):
        ma, mb = memory(a)["total"], memory(b)["total"]
        slope = (mb - ma) / (b - a)
        if slope <= 0:
            a, b = min(a, b), max(a, b) * 2
            continue
        guess = int((a + (cap - ma) / slope) // multiple * multiple)
        if host_limit is not None:
            guess = min(guess, host_limit)
        guess = max(multiple, guess)
        if memory(guess)["total"] <= cap and (guess == host_limit or memory(guess + multiple)["total"] > cap):
            break
        a, b = (guess, guess + multiple) if memory(guess)["total"] <= cap else (max(multiple, guess - multiple), guess)
    else:
        raise RuntimeError(f"longest_sequence: {layout} p={p} did not settle within 8 secant steps")
    if memory(guess)["total"] > cap:
        raise NothingFits(f"longest_sequence: {layout} p={p}: even {guess} tokens need "
                          f"{memory(guess)['total'] / GIB:.1f} GiB of {cap / GIB:.1f}")
    return {"seq": guess, "memory": memory(guess), "evaluations": len(seen),
            "limit": "host" if guess == host_limit else "gpu"}


def best(rows: list[PlanRow], baseline: bool) -> PlanRow | None:
    """The fastest package row (``baseline=False``) or baseline row."""
    return next((r for r in rows if r.baseline == baseline), None)


def largest_model(gpus: int, gpu_memory_gib: float, seq: int, global_batch_tokens: int, *, base="llama-3.1-70b",
                  baseline: bool, layouts=None, gpus_per_node: int = 8, memory_fraction: float = 0.9) -> dict:
    """The most blocks of ``base``'s shape (its width, heads and vocabulary; more layers) that some configuration
    of the package (``baseline=False``) or of the 1-D baseline fits on ``gpus`` GPUs: ``{"n_layer", "parameters",
    "configuration"}``. Memory only: each configuration at its least memory (ZeRO stage 3, full checkpointing, its
    smallest micro-batch). Its peak grows with the depth (the memory model extends a deep model from two builds,
    phase by phase, so any depth costs no build of its own), and the deepest that fits is found by bisection."""
    cfg = model_config(base)
    cap = memory_fraction * gpu_memory_gib * GIB
    names = () if baseline else (layout_names() if layouts is None else tuple(layouts))
    found = {"n_layer": 0, "parameters": 0, "configuration": None}
    with ranks_as_asked():
        for candidate in _candidates(cfg, gpus, gpus_per_node, seq, global_batch_tokens // seq, names, baseline,
                                     (0, 3), ("full",), None):
            found = _deepest(cfg, candidate, seq, cap, found)
    return found


def _deepest(cfg, candidate, seq: int, cap: float, found: dict) -> dict:
    """``found``, or this candidate's deepest model if it is deeper (:func:`largest_model`): the peak is the largest
    of several phases, each affine in the depth, so no line through two depths predicts it; bisection on the peak
    itself (every depth read from the same two builds) answers a depth that fits, one block more not."""
    name, p, dp, stages, _, micros, *variant = candidate
    stage = max(stages)
    extra = variant[0] if variant else {}

    def fits(n: int) -> bool:
        deeper = dataclasses.replace(cfg, n_layer=n)
        return row_memory(deeper, name, p, dp, stage, "full", micros[0], seq, **extra)["total"] <= cap

    lo, hi = 0, cfg.n_layer  # lo fits (0 blocks: nothing to fit, never asked), hi is tried
    while fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    if lo <= found["n_layer"]:
        return found
    deeper = dataclasses.replace(cfg, n_layer=lo)
    return {"n_layer": lo, "parameters": parameter_split(deeper).total,
            "configuration": f"{name} p={p} dp={dp} zero_stage={stage} checkpointing=full micro_batch={micros[0]}"
                             + "".join(f" {k}={v}" for k, v in extra.items())}


# ---- tp2d-plan ------------------------------------------------------------------------------------------------


def table(rows: list[PlanRow], limit: int | None = 12) -> str:
    """A markdown table of ``rows`` (the first ``limit``), each named by :attr:`PlanRow.label`: two rows whose
    configuration columns read the same are the same configuration; a step the host's time sets
    (:attr:`PlanRow.host_bound`) reads ``(host)``, one with unaligned shards (:attr:`PlanRow.unaligned`)
    ``(unaligned)``."""
    head = ("| # | configuration | p | dp | ZeRO | checkpointing | micro x accum | GiB/GPU | step s | tok/s/GPU | MFU |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for i, r in enumerate(rows[:limit] if limit else rows, 1):
        offload = " + offload" if r.activation_offload else ""
        marks = (" (host)" if r.host_bound else "") + (" (unaligned)" if r.unaligned else "")
        lines.append(f"| {i} | {r.label}{r.stages} | {r.tensor_parallel_size} | {r.data_parallel_size} | "
                     f"{r.zero_stage} | "
                     f"{r.checkpointing}{offload} | {r.micro_batch} x {r.grad_accum} | {r.memory_gib:.1f} | "
                     f"{r.step_s:.2f}{marks} | {r.tokens_per_s_per_gpu:,.0f} | {r.mfu:.1%} |")
    return "\n".join(lines)


def run_commands(rows: list[PlanRow], model: str, seq: int, *, gpus_per_node: int,
                 gpu_memory_gib: float | None = None, compiled: bool = True) -> str:
    """What runs the best package row (``tp2d-train`` overrides) and the best baseline row (torchtitan's settings and
    Lightning's strategy), as ``tp2d-plan`` prints them after the table (:func:`~lightning_tp2d.planning.commands.
    command_for`); ``""`` when ``rows`` holds neither."""
    lines = []
    for baseline, title in ((False, "run the best package configuration"), (True, "run the best 1-D baseline")):
        row = best(rows, baseline)
        if row is None:
            continue
        try:
            command = command_for(row, model, seq, gpus_per_node=gpus_per_node, gpu_memory_gib=gpu_memory_gib,
                                  compiled=compiled)
        except ValueError as err:  # e.g. GPUs that are not whole nodes: the table stands, the command cannot
            command = f"(no command: {err})"
        lines += [f"{title} ({row.describe()}):", command]
    return "\n".join(lines)


PROGRESS_EVERY_S = 5.0  # tp2d-plan: at most one progress line per this many seconds (and the last)
PRICED = "plan: %s p=%d dp=%d priced in"  # the start of the line _plan_candidate logs when a candidate is done


class PlanProgress(logging.Handler):
    """``tp2d-plan``'s progress lines on stderr: ``tp2d-plan: 7/40 candidates priced, 12 s``, read from the line
    each (layout, size) candidate logs when it is priced (:data:`PRICED`), counted across the forked planning
    processes (``workers``) in shared memory, at most one line per ``every`` seconds and always the last. Use as a
    context manager around :func:`plan`: it attaches itself to the planner's logger (at INFO) and detaches."""

    def __init__(self, total: int, every: float | None = None, stream=None) -> None:
        super().__init__(logging.INFO)
        ctx = mp.get_context("fork")  # the planning processes are forked: they share these
        self.total, self.stream = total, stream
        self.every = PROGRESS_EVERY_S if every is None else every
        self.started = time.monotonic()
        self.done, self.last = ctx.Value("i", 0), ctx.Value("d", self.started)

    def emit(self, record: logging.LogRecord) -> None:
        if not str(record.msg).startswith(PRICED):
            return
        with self.done.get_lock():
            self.done.value += 1
            done, now = self.done.value, time.monotonic()
            if done < self.total and now - self.last.value < self.every:
                return
            self.last.value = now
        stream = self.stream or sys.stderr
        print(f"tp2d-plan: {done}/{self.total} candidates priced, {now - self.started:.0f} s", file=stream,
              flush=True)

    def __enter__(self) -> "PlanProgress":
        self._level = log.level
        log.setLevel(min(log.getEffectiveLevel(), logging.INFO))
        log.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        log.removeHandler(self)
        log.setLevel(self._level)


def main(argv=None) -> int:
    """``tp2d-plan MODEL --gpus N --gpu-memory-gib G --seq T [--global-batch-tokens K] ...``: print the fitting
    configurations, best first, and the commands that run the best package and baseline rows (:func:`run_commands`);
    with ``--json PATH``, also write every row as JSON there (without it, nothing is written)."""
    import argparse
    import json
    import sys

    parser = argparse.ArgumentParser(prog="tp2d-plan", description="Which layout and sizes train MODEL on these GPUs, "
                                     "how fast, against torch's 1-D TP + SP x FSDP (predicted, not measured).")
    parser.add_argument("model", help="a named size of any registered family, e.g. llama-3.1-70b, gpt2-medium")
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--gpu-memory-gib", type=float, required=True)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--seq", type=int, required=True)
    parser.add_argument("--global-batch-tokens", type=int, default=4 * 2**20)
    parser.add_argument("--hardware", choices=sorted(HARDWARE), default="h100")
    parser.add_argument("--rates", default=None, help="a rate table measured on your GPU (recipes/gpu_rates.py's "
                        "JSON): its GEMM, attention and memory rates replace the preset's; links stay the preset's")
    parser.add_argument("--layouts", nargs="*", default=None, help="package layouts to consider (default: all)")
    parser.add_argument("--no-baselines", action="store_true", help="leave out the 1-D TP + SP x FSDP rows")
    parser.add_argument("--zero-stages", type=int, nargs="*", default=list(ZERO_STAGES), help="ZeRO stages to consider")
    parser.add_argument("--checkpointing", nargs="*", default=list(CHECKPOINTING),
                        help="activation checkpointing modes to consider")
    parser.add_argument("--max-micro-batch", type=int, default=None, help="largest micro-batch (sequences) to try")
    parser.add_argument("--eager", action="store_true", help="price elementwise work as eager runs it")
    parser.add_argument("--offload", action="store_true",
                        help="also consider fully checkpointed rows with their block inputs in host memory")
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1),
                        help="candidates planned at once, each in a process of its own (default: up to 4 cores)")
    parser.add_argument("--method", choices=METHODS, default="closed",
                        help="closed: the package's rows from the closed forms (seconds); traced: every row from "
                             "fake-tensor traces of the real layers, the reference (minutes to hours)")
    parser.add_argument("--float8", choices=("tensorwise", "rowwise"), default=None,
                        help="every row's linears in float8 by torchao's recipe (the package's parallel.float8, the "
                             "rivals' convert_to_float8_training): float8 GEMM rates and cast bytes on both sides")
    parser.add_argument("--pp", type=int, nargs="*", default=[1], metavar="PP",
                        help="pipeline sizes to consider on both sides, e.g. --pp 1 2 4 8 (default: 1, no stages): "
                             "1F1B and interleaved 1F1B over the blocks, on both sides (torchtitan's PP)")
    parser.add_argument("--top", type=int, default=12, help="rows to print (0: all)")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="also write every row as JSON to PATH (default: nothing is written)")
    args = parser.parse_args(argv)
    hardware = HARDWARE[args.hardware]
    try:
        if args.rates:
            with open(args.rates) as f:
                hardware = cost_model.with_measured_rates(hardware, json.load(f))
        # the (layout, size) candidates plan() prices, counted as it does, for the progress lines
        total = len(_candidates(model_config(args.model), args.gpus, args.gpus_per_node, args.seq,
                                args.global_batch_tokens // max(args.seq, 1),
                                layout_names() if args.layouts is None else tuple(args.layouts), not args.no_baselines,
                                tuple(args.zero_stages), tuple(args.checkpointing), args.max_micro_batch,
                                tuple(args.pp)))
        print(f"tp2d-plan: pricing {total} (layout, size) candidates of {args.model} on {args.gpus} GPUs "
              f"({args.workers} at a time; a progress line every {PROGRESS_EVERY_S:g} s)...", file=sys.stderr,
              flush=True)
        with PlanProgress(total):
            rows = plan(args.model, gpus=args.gpus, gpu_memory_gib=args.gpu_memory_gib,
                        gpus_per_node=args.gpus_per_node, seq=args.seq, global_batch_tokens=args.global_batch_tokens,
                        hardware=hardware, include_baselines=not args.no_baselines, layouts=args.layouts,
                        compiled=not args.eager, zero_stages=tuple(args.zero_stages),
                        checkpointing=tuple(args.checkpointing), max_micro_batch=args.max_micro_batch,
                        workers=args.workers, activation_offload=(False, True) if args.offload else (False,),
                        method=args.method, float8=args.float8, pipeline_sizes=tuple(args.pp))
    except (ValueError, KeyError, OSError) as err:
        print(f"tp2d-plan: {err}", file=sys.stderr)
        return 2
    print(f"{args.model} on {args.gpus} GPUs ({args.gpus_per_node}/node, {args.gpu_memory_gib:g} GiB, "
          f"{hardware.name}), seq {args.seq}, {args.global_batch_tokens:,} tokens per step: "
          f"{len(rows)} configurations fit")
    print(table(rows, args.top or None))
    package, baseline = best(rows, False), best(rows, True)
    if package and baseline:
        print(f"best package: {package.describe()}\nbest 1-D baseline: {baseline.describe()}\n"
              f"package / baseline tokens/s/GPU: {package.tokens_per_s_per_gpu / baseline.tokens_per_s_per_gpu:.2f}x")
    print(run_commands(rows, args.model, args.seq, gpus_per_node=args.gpus_per_node,
                       gpu_memory_gib=args.gpu_memory_gib, compiled=not args.eager))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "gpus": args.gpus, "gpu_memory_gib": args.gpu_memory_gib,
                       "gpus_per_node": args.gpus_per_node, "seq": args.seq,
                       "global_batch_tokens": args.global_batch_tokens, "hardware": hardware.name,
                       "rows": [r.to_dict() for r in rows]}, f, indent=1)
        print(f"wrote {len(rows)} rows to {args.json}")
    return 0
