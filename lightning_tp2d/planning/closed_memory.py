"""Peak bytes of one training step per rank as arithmetic on the config: the closed form of
:func:`lightning_tp2d.planning.memory_model.peak_bytes`, in milliseconds instead of minutes of fake steps.

It models what the traced step holds, phase by phase (the phases of ``memory_model``): the forward and the root's
backward, each block's backward, what follows the backward. Each phase's live bytes are sums of the per-rank tensor
sizes the layers hold (their docstrings state the shapes), and the step's peak is the largest of them. What it
covers, and what it refuses with a ``ValueError`` naming the numbers (``memory_model.closed_forms()`` then profiles
the step as before):

* layouts whose ranks form a ring (``arrangement == "ring"``: ``"metp"``); the grids (``"2d"``, ``"2d-metp"``)
  have their own closed form, :mod:`~lightning_tp2d.planning.closed_memory_grid`, which ``closed_form_problem``
  and ``closed_peak_bytes`` hand them to;
* ZeRO stages 0 and 1 (any ``dp``), stages 2 and 3 (FSDP2) with ``dp > 1`` (below); stages 2 and 3 on one
  replica are refused;
* checkpointing ``"none"``, ``"selective"`` and ``"full"``;
* ``elem`` 2 (bf16 autocast over float32 parameters), AdamW's fused step (``fused=True``): what the planner prices;
* GPT-2 (tied head) and Llama with a tied or untied head (``tie_embeddings``; 3.2-1b and 3.2-3b tie theirs).

Notation, per rank: ``e = elem``; ``N = B T / p`` local tokens, ``S = T / p`` local positions; ``h`` width, ``nh``
heads of width ``hs``, ``kv`` the key/value width (``n_kv_head * hs``; GPT-2: ``h``), ``F`` the MLP's width (GPT-2
``4h``, Llama ``I``), ``f = F/p``; ``Vb = ceil(V/p)`` vocabulary rows per block, ``v`` this rank's rows. ``M``:
one block's matrix elements held (``1/p`` of each), ``Mm`` of them the MLP's; ``G``: the float32 gradients, equal
to the parameters held (``P``).

* saved per block, ``"none"`` (``A``): each norm's input and output ``N h e`` and statistics (RMSNorm: ``rstd``
  ``4N``; LayerNorm: mean, ``rstd`` and its weight and bias cast ``2 N e + 2 h e``); q, k, v after RoPE
  ``N (h + 2 kv) e`` and the attention's output ``N h e`` and log-sum-exp ``4 N nh``; Llama's four RoPE tables
  cast for q and for k ``4 S hs e``; the ring MLP keeps only its input (the second norm's output); the bf16
  copies autocast makes of the block's matrices ``e M`` (the weights travel round the ring as these copies).
  ``"full"``: the block's input ``N h e``, one block's ``A`` while it is recomputed. ``"selective"``
  (:mod:`lightning_tp2d.recompute`: the ring norms mark their outputs, rebuilt from the saved input and statistics
  when a consumer unpacks them): ``A - 2 N h e``; the root loses the final norm's output ``N h e``. The rebuilt
  output lives while its consumer's backward runs: the second norm's in the block's MLP backward (the block holds
  ``A - N h e`` there), the final norm's in the loss's backward (the root holds ``R``); the first norm's is rebuilt
  after the attention's backward, for the q|k|v projection's, a smaller moment (the attention's backward holds
  ``N h e`` less than under ``"none"``); the recomputation itself (a norm's forward) is smaller than either;
* saved by the root (``R``): the zigzag ids ``8 N``, GPT-2's positions ``8 S``, the final norm's as a block's,
  the head's copy ``e Vb h``, the targets ``8 N`` and the loss's log-sum-exp ``4 N``;
* the ring's backward passes hold ``r = min(p, 3)`` receive buffers of what travels at once (two on a ring of
  two) and one wire copy;
* the forward and the root's backward peak in the loss's backward
  (:class:`~lightning_tp2d.nn.ring_stream._RingCrossEntropy`): two float32 gradient accumulators of a vocabulary
  block ``8 Vb h``, the receive buffers and the wire copy ``(r + 1) e Vb h``, one logits tile in float32 and ``e``
  ``(4 + e) t w`` (``t`` rows of a tile, ``w`` the columns of the widest block after the own one), the input's
  gradient ``N h e``, per-token masks and scales ``17 N`` and the loss's three scalars ``16``; Llama: or in the
  final RMSNorm's backward (composite: five float32 ``[N, h]`` temporaries) beside the head's gradient;
* a block's backward peaks in its ring MLP's (:class:`~lightning_tp2d.metp._RingMLP`), late (two float32
  gradient sets ``8 Mm``, the buffers ``(r + 1) e Mm``, the tile's weight-gradient products ``e Mm``, one hidden
  tile ``e t f``) or early (one gradient set, the buffers, the activation's backward: SwiGLU nine ``[t, f]``
  tensors, GELU four), with the input's and the output's gradients ``2 N h e`` (GELU: the bias gradient ``4 F``);
  or in its ring attention's (:class:`~lightning_tp2d.metp._RingAttention`): the float32 ``dqkv`` ``4 N (h + 2
  kv)``, two float32 K/V gradient accumulators ``16 N kv``, the output's gradient ``N h e``, the K/V buffers and
  wire copy ``2 (r + 1) N kv e``, the kernel's gradients of one block (``dq`` of half the rows, ``dk``, ``dv``:
  ``2.5 N kv e``, twice with grouped queries), beside the block's attention tensors, the residual's gradient and the
  gradients of its MLP, output projection and second norm; beside either, the saved tensors of the blocks not yet
  done, the root's ids, the gradients of the blocks done and of the head (and their flat buckets);
* the embedding's backward (ring, no operands): three float32 vocabulary blocks ``12 Vb h`` beside every other
  gradient (and its buckets); the end of the backward: ``G`` (and, ``dp > 1``, the buckets: ``G`` again);
* after the backward: ``G``, clipping's square of the largest gradient and four scalars; with ``dp > 1``
  :class:`~lightning_tp2d.training.GradientSync`'s flat buckets (:data:`_GRAD_BUCKET`, whole buckets counted as
  they fill); at stage 1 the all-gather of the updated slices (:class:`~lightning_tp2d.zero.ShardedOptimizer`: up
  to three buckets of gathered bytes and their slices).

At stages 2 and 3 (:func:`lightning_tp2d.fsdp.shard_data_parallel`, bf16 ``param_dtype``), per data-parallel rank 0:
each parameter's local shard is cut into ``ceil(rows / dp)`` rows (GPT-2's ``c_attn`` weight: columns), ``P`` the
float32 dp shards (:class:`_DataShards`); the gathered groups are bf16 copies of the padded local shards (``gr`` the
root's, ``gb`` a block's), so autocast makes no copies of the weights (``A`` and ``R`` lose ``e M``, the head's copy
and LayerNorm's weight casts). The forward holds the root group and, stage 2, every block (stage 3: the last
block's all-gather output, kept until the next all-gather); block ``i``'s backward holds the root's and, stage 2,
blocks ``0..i`` (stage 3: block ``i`` and the prefetched ``i-1``), the finished blocks' float32 gradient shards,
the head's bf16 gradients, the previous block's float32 reduce-scatter input (FSDP2 keeps it until the next
reduce-scatter), and at its end its reduce-scatter: bf16 gradients, their float32 copies, the padded float32 input
and the shard. After the backward: the gradient shards and clipping's square of the largest. Llama's blocks hold
``9216`` bytes per block more in the trace than this counts on llama-tiny (under 1% of the total; not found).

The sum for ``"full"`` is the same with each block's input in place of its saved tensors and one block's recomputed;
for ``"selective"``, with the blocks' saved tensors less their norms' outputs. ``parameters``, ``gradients`` and
``optimizer`` are exact; ``activations`` equals the traced forward's saved bytes (stage 0's, with autocast's copies,
at every stage, as the trace reports it); ``gathered`` is 0 at stages 0 and 1, at 2 and 3 the tensor shards in bf16
(root's and every block's, or two blocks'); ``backward`` is one block's recomputed tensors (``"full"``;
``"selective"`` none) plus, with ``dp > 1``, the buckets (stages 2 and 3: the root's and one block's tensor-shard
bytes); ``step`` the largest phase; ``total`` = parameters + optimizer + step. Not modelled: what the traced step also
leaves out (allocator rounding, kernel workspaces).

``tests/test_closed_memory.py`` checks it against the traced ``peak_bytes`` on a grid of small configurations.
"""

from __future__ import annotations

import dataclasses

import torch

from lightning_tp2d.families import anatomy, family_of, family_of_config
from lightning_tp2d.layouts import get_layout
from lightning_tp2d.metp import ring_options
from lightning_tp2d.planning.closed_memory_grid import (_CLIP_SCALARS, _GRAD_BUCKET, _LOSS_SCALARS, after_backward,
                                                        check_peak_entry, grid_peak_bytes, grid_problem, is_grid,
                                                        peak_of, step_memory_problem)
from lightning_tp2d.train_plan import fsdp_shards

__all__ = ["closed_peak_bytes", "closed_form_problem"]



@dataclasses.dataclass(frozen=True)
class _Sizes:
    """Element counts one ring rank holds, read from the plain model built on the meta device."""

    block_matrices: tuple[int, ...]  # local elements of each 2-D block parameter (registration order)
    block_vectors: int  # elements of the block's 1-D parameters (replicated over the ring)
    mlp: int  # local elements of the MLP's matrices (``Mm``)
    root: int  # local elements of the root's parameters (embeddings, final norm, untied head)
    vocab_rows: int  # this rank's vocabulary rows of the embedding (``v``)
    largest: int  # local elements of the largest parameter tensor


_SIZES: dict[tuple, _Sizes] = {}


def _ring_sizes(cfg, p: int, rank: int) -> _Sizes:
    key = (repr(dataclasses.replace(cfg, n_layer=1)), p, rank)  # (a config may hold a dict: rope_scaling)
    if key not in _SIZES:
        with torch.device("meta"):
            model = family_of_config(cfg).model_class(dataclasses.replace(cfg, n_layer=1))
        block = next(iter(family_of(model).block_modules(model)))
        in_block = {id(q) for q in block.parameters()}
        V, h = cfg.vocab_size, cfg.n_embd
        rows = -(-V // p)
        mine = max(0, min(rows, V - rank * rows))
        matrices = tuple(q.numel() // p for q in block.parameters() if q.ndim == 2)
        mlp = sum(q.numel() // p for name, q in block.named_parameters() if q.ndim == 2 and name.startswith("mlp."))
        root, largest = 0, max(matrices)
        for q in model.parameters():
            if id(q) in in_block:
                continue
            n = mine * h if q.ndim == 2 and q.shape[0] == V else q.numel()  # vocab rows split, the rest whole
            root += n
            largest = max(largest, n)
        _SIZES[key] = _Sizes(matrices, sum(q.numel() for q in block.parameters() if q.ndim == 1), mlp, root, mine,
                             largest)
    return _SIZES[key]


_ROW_SPLIT_BY_COLUMNS = ("c_proj.weight", "o_proj.weight", "down_proj.weight")  # the ring's Shard(1) matrices


@dataclasses.dataclass(frozen=True)
class _DataShards:
    """Element counts of one ring rank's FSDP groups over ``dp`` replicas (stages 2 and 3), as data-parallel rank 0
    holds them: FSDP cuts each parameter's local shard along dim 0 into ``ceil(rows / dp)`` rows (GPT-2's strided
    ``c_attn`` weight along dim 1, evenly: :func:`lightning_tp2d.fsdp._dp_shard_dim`); ``padded`` = ``dp`` x that,
    what its all-gather and reduce-scatter move."""

    block: int  # a block's elements at rest on this rank
    block_padded: int  # a block's gathered elements (padded rows)
    root: int
    root_padded: int
    largest: int  # elements of the largest parameter shard at rest


_DATA_SHARDS: dict[tuple, _DataShards] = {}


def _data_shards(cfg, p: int, dp: int, rank: int) -> _DataShards:
    key = (repr(dataclasses.replace(cfg, n_layer=1)), p, dp, rank)
    if key not in _DATA_SHARDS:
        with torch.device("meta"):
            model = family_of_config(cfg).model_class(dataclasses.replace(cfg, n_layer=1))
        block = next(iter(family_of(model).block_modules(model)))
        in_block = {id(q) for q in block.parameters()}
        V, rows = cfg.vocab_size, -(-cfg.vocab_size // p)
        counts = {True: [0, 0], False: [0, 0]}
        largest = 0
        for name, q in model.named_parameters():
            if q.ndim == 1:
                local = (q.numel(), 1)
            elif id(q) not in in_block:
                local = (rows if q.shape[0] == V else q.shape[0], q.shape[1])  # vocabulary rows, zero-padded
            elif name.endswith(_ROW_SPLIT_BY_COLUMNS):
                local = (q.shape[0], q.shape[1] // p)
            else:
                local = (q.shape[0] // p, q.shape[1])
            if name.endswith("c_attn.weight"):  # strided rows: cut along dim 1 (evenly)
                held = local[0] * local[1] // dp
                padded = local[0] * local[1]
            else:
                held = -(-local[0] // dp) * local[1]
                padded = dp * held
            counts[id(q) in in_block][0] += held
            counts[id(q) in in_block][1] += padded
            largest = max(largest, held)
        _DATA_SHARDS[key] = _DataShards(*counts[True], *counts[False], largest)
    return _DATA_SHARDS[key]


def closed_form_problem(layout, cfg, batch: int, seq: int, p: int, *, dp: int = 1, zero_stage: int = 0,
                        checkpointing: str = "none", elem: int = 2, fused: bool = True) -> str | None:
    """Why :func:`closed_peak_bytes` does not model this step (``None``: it does)."""
    spec = get_layout(layout)
    if is_grid(spec):  # the grid layouts' closed form (closed_memory_grid)
        return grid_problem(spec, cfg, batch, seq, p, dp=dp, zero_stage=zero_stage, checkpointing=checkpointing,
                            elem=elem, fused=fused)
    if spec.arrangement != "ring" or spec.square:
        return (f"layout {spec.name!r} (p={p} ranks as a {spec.arrangement}) is not a ring; the closed form models "
                f"the ring layouts only")
    if p < 2:
        return f"p={p}: the closed form models rings of at least 2 ranks"
    problem = step_memory_problem(cfg, dp=dp, zero_stage=zero_stage, checkpointing=checkpointing, elem=elem,
                                  fused=fused)
    if problem:
        return problem
    if batch < 1 or seq % (2 * p) or seq < 2 * p:
        return f"batch={batch}, seq={seq}: the ring needs batch >= 1 and seq a multiple of 2p={2 * p}"
    return None


def closed_peak_bytes(layout, cfg, batch: int, seq: int, p: int, *, dp: int = 1, zero_stage: int = 0,
                      checkpointing: str = "none", elem: int = 2, rank: int = 0, fused: bool = True) -> dict:
    """Predicted peak bytes of one step on tensor-parallel rank ``rank`` (module docstring), the dict of
    :func:`~lightning_tp2d.planning.memory_model.peak_bytes`: ``{"parameters", "gradients", "optimizer",
    "activations", "gathered", "backward", "step", "total", "largest"}``, plus ``"phases"`` (each phase's peak of
    the step's live bytes, by name). ``largest`` is shorter than the traced one: the named parts of the phase that
    peaks, ``{"part", "bytes"}`` dicts, largest first (the traced model names tensors). ``ValueError`` naming the
    numbers for a step it does not model (:func:`closed_form_problem`)."""
    if is_grid(layout):  # the grid layouts' closed form (closed_memory_grid)
        return grid_peak_bytes(layout, cfg, batch, seq, p, dp=dp, zero_stage=zero_stage, checkpointing=checkpointing,
                               elem=elem, rank=rank, fused=fused)
    check_peak_entry(closed_form_problem(layout, cfg, batch, seq, p, dp=dp, zero_stage=zero_stage,
                                      checkpointing=checkpointing, elem=elem, fused=fused), rank, p, dp)
    spec = get_layout(layout)
    problems = family_of_config(cfg).problems(spec, p, cfg)
    if problems:
        raise ValueError("; ".join(problems))
    z = _ring_sizes(cfg, p, rank)
    e, L = elem, cfg.n_layer
    h, nh = cfg.n_embd, cfg.n_head
    hs = h // nh
    llama, a = family_of_config(cfg).name == "llama", anatomy(cfg)  # the closed form models GPT-2 and Llama
    tied = a.tied_head  # the head multiplies by the embedding (GPT-2's always does)
    kv, F = a.kv_width, a.mlp_width
    f = F // p
    S = seq // p
    N = batch * S
    Vb = -(-cfg.vocab_size // p)
    options = ring_options(spec.options)
    tile = len(range(*options.row_tiles(N)[0].indices(N)))

    M = sum(z.block_matrices)
    block_params = 4 * (M + z.block_vectors)
    P = 4 * z.root + L * block_params  # float32 parameters held, and their gradients
    fsdp = fsdp_shards(zero_stage, dp)  # (stages 2 and 3 on one replica: refused by closed_form_problem)
    if fsdp:  # FSDP's dp shards at rest; gathered in bf16 (FSDP's param_dtype: no autocast copies of weights)
        d = _data_shards(cfg, p, dp, rank)
        P = 4 * (d.root + L * d.block)
        gr, gb = e * d.root_padded, e * d.block_padded
    # saved per block ("none") and by the root
    if llama:
        norm = 2 * N * h * e + 4 * N  # input, output, rstd
    else:
        norm = 2 * N * h * e + 2 * N * e + (0 if fsdp else 2 * h * e)  # input, output, mean and rstd, (the cast)
    final_norm = norm
    attention = N * (h + 2 * kv) * e + N * h * e + 4 * N * nh + (4 * S * hs * e if llama else 0)
    A = 2 * norm + attention + (0 if fsdp else e * M)
    R = 8 * N + (0 if llama else 8 * S) + final_norm + (0 if fsdp else e * Vb * h) + 8 * N + 4 * N
    block_input = N * h * e
    out = N * h * e if checkpointing == "selective" else 0  # each norm's output: a recipe under "selective"
    kept = {"none": A, "selective": A - 2 * out, "full": block_input}[checkpointing]
    current = A - out  # the block being done: its second norm's output recomputed for the MLP's backward
    # the reported activations are the autocast forward's (trace_step's, at every stage): its copies of the weights
    A0 = A + (e * M + (0 if llama else 4 * h * e) if fsdp else 0)
    R0 = R + (e * Vb * h + (0 if llama else 2 * h * e) if fsdp else 0)
    activations = L * (block_input if checkpointing == "full" else A0 - 2 * out) + R0 - out
    recv = min(p, 3)  # ring_backward's receive buffers in use at once (two when the ring has two ranks)
    # the loss's backward (root's backward)
    widest = max(max(0, min(Vb, cfg.vocab_size - j * Vb)) for j in range(p) if j != rank)  # after the own one
    loss_backward = (8 * Vb * h + (recv + 1) * e * Vb * h + (4 + e) * tile * widest + N * h * e + 17 * N
                     + _LOSS_SCALARS)
    # the root's gradients once the head's backward is done: all but an untied embedding's and GPT-2's positions'
    head_grads = 4 * (z.root - (0 if tied else z.vocab_rows * h) - (0 if llama else cfg.block_size * h))
    # each phase's candidate moments, as named parts (the phase peaks at the largest sum)
    forward = [{"saved activations": L * kept + R, "loss backward": loss_backward}]
    if llama:  # the final RMSNorm's backward: five float32 [N, h] temporaries (the norm is composite)
        forward.append({"saved activations": L * kept + 8 * N + final_norm - out, "head gradients": 4 * Vb * h + 8 * h,
                        "norm backward": 20 * N * h + 2 * N * h * e + _LOSS_SCALARS})
    # a block's backward: its ring MLP's, early (the activation's backward, one gradient set) or late (two sets
    # and the tile's weight-gradient products), or its ring attention's
    Mm = z.mlp
    rows = tile if f > h else N
    hidden = 9 if llama else 4  # [t, f] tensors alive in the activation's backward (SwiGLU: 9, GELU: 4)
    mlp_late = (8 + (recv + 2) * e) * Mm + e * rows * f + 2 * N * h * e + (0 if llama else 4 * F)
    mlp_early = (4 + (recv + 1) * e) * Mm + hidden * e * rows * f + 2 * N * h * e + (0 if llama else 4 * F)
    Wo = h * h // p
    attention_backward = (4 * N * (h + 2 * kv) + 16 * N * kv + N * h * e + (recv + 1) * 2 * N * kv * e
                          + (5 if nh > kv // hs else 5 / 2) * N * kv * e)
    # the block's saved tensors still alive in its attention's backward (its MLP and second norm are done), the
    # residual's gradient, and the gradients of its MLP, output projection and second norm
    attention_kept = A - norm - (0 if fsdp else e * Wo + e * Mm) + N * h * e - out
    attention_grads = 4 * (Mm + Wo + (h if llama else 4 * h + F))
    left = 8 * N + (0 if llama else 8 * S) + _LOSS_SCALARS  # what the root keeps through the blocks' backward

    def in_block(i: int) -> list[dict]:
        done = (L - 1 - i) * block_params + head_grads
        base = {"saved activations": i * kept + left, "gradients": done, "buckets": _flat_buckets(done, dp)}
        return [dict(base, **{"saved activations": base["saved activations"] + current, "MLP backward":
                              max(mlp_late, mlp_early)}),
                dict(base, **{"saved activations": base["saved activations"] + attention_kept,
                              "gradients": done + attention_grads, "attention backward": attention_backward})]

    # the embedding's backward: every other gradient (and its buckets), the ring's three float32 vocabulary blocks
    # (the one computed, the sum being sent, the one arriving) and the ids' masks; then the end of the backward:
    # every gradient, every bucket
    others = P - 4 * z.vocab_rows * h
    ending = [{"gradients": others, "buckets": _flat_buckets(others, dp), "embedding backward": 12 * Vb * h + 17 * N,
               "saved activations": left},
              {"gradients": P + _LOSS_SCALARS, "buckets": P if dp > 1 else 0}]
    after = after_backward(P, z.largest, dp, zero_stage)
    moments = {"forward": forward, "last block": in_block(L - 1), "block 0": in_block(0) + ending,
               "after backward": after}
    if fsdp:
        moments = _fsdp_moments(locals())
    phases, step, largest = peak_of(moments)
    optimizer = 2 * P // (dp if zero_stage == 1 else 1)
    recompute = A0 if checkpointing == "full" else 0
    transient = P if dp > 1 else 0  # GradientSync's flat buckets
    gathered = 0
    if fsdp:  # what the traced model reports (memory_model._parts): tensor shards in bf16, unsharded gradients
        tensor_root, tensor_block = 4 * z.root, block_params
        gathered = (tensor_root + (L if zero_stage == 2 else min(2, L)) * tensor_block) * e // 4
        transient = tensor_root + tensor_block
    return {"parameters": P, "gradients": P, "optimizer": optimizer, "activations": int(activations),
            "gathered": int(gathered), "backward": int(recompute + transient), "step": step,
            "total": int(P + optimizer + step), "largest": largest, "phases": phases}


def _fsdp_moments(v: dict) -> dict:
    """The phases' candidate moments at stages 2 and 3 (FSDP2, ``dp > 1``)."""
    L, i_stage, P, e = v["L"], v["zero_stage"], v["P"], v["e"]
    d, gr, gb = v["d"], v["gr"], v["gb"]
    kept, left, current = v["kept"], v["left"], v["current"]
    sb = 4 * d.block  # a block's float32 gradient shard
    forward = [dict(m, gathered=gr + (L if i_stage == 2 else 1) * gb) for m in v["forward"]]

    def gathered(i: int) -> int:
        return gr + ((i + 1) * gb if i_stage == 2 else gb + (gb if i > 0 else 0))

    def in_block(i: int) -> list[dict]:
        done = (L - 1 - i) * sb + v["head_grads"] // 2
        base = {"saved activations": i * kept + left, "gradients": done, "gathered": gathered(i),
                "held reduce-scatter input": 4 * d.block_padded if i < L - 1 else 0}
        return [dict(base, **{"saved activations": base["saved activations"] + current, "MLP backward":
                              max(v["mlp_late"], v["mlp_early"])}),
                dict(base, **{"saved activations": base["saved activations"] + v["attention_kept"],
                              "gradients": done + v["attention_grads"] // 2,
                              "attention backward": v["attention_backward"]}),
                dict(base, **{"reduce-scatter": e * d.block_padded + v["block_params"] + 4 * d.block_padded + sb})]

    ending = [{"gradients": L * sb, "gathered": gr, "embedding backward": 12 * v["Vb"] * v["h"] + 17 * v["N"],
               "saved activations": left},
              {"gradients": L * sb, "gathered": gr, "reduce-scatter": e * d.root_padded + 4 * d.root_padded
               + 4 * d.root}]
    after = [{"gradients": P, "clipping": 4 * d.largest + _CLIP_SCALARS}]
    moments = {"forward": forward, "last block": in_block(L - 1), "block 0": in_block(0) + ending,
               "after backward": after}
    if L >= 3:
        moments["block before last"] = in_block(L - 2)
    return moments


def _flat_buckets(done: int, dp: int) -> int:
    """Bytes of GradientSync's flat buckets filled once ``done`` gradient bytes exist (``dp > 1``): whole
    buckets of :data:`_GRAD_BUCKET` (a bucket is cut once it reaches that size)."""
    if dp == 1:
        return 0
    return (done // _GRAD_BUCKET) * _GRAD_BUCKET
