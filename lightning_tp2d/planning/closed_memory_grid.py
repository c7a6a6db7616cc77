"""Peak bytes of one training step per rank for the grid layouts, as arithmetic on the config: the closed form of
:func:`lightning_tp2d.planning.memory_model.peak_bytes` for the layouts whose ranks form a ``q x q`` grid
(``"2d"``: SUMMA, rows split the batch; ``"2d-metp"``: the same layers, rows holding zigzag sequence chunks and
the attention a METP ring along ``row``), as :mod:`lightning_tp2d.planning.closed_memory` is for the ring.

It models what the traced step holds, phase by phase (the phases of ``memory_model``): the forward and the root's
backward, the last block's backward, block 0's backward and the end of the backward, what follows the backward;
the step's peak is the largest. What it covers, and what it refuses (:func:`grid_problem`, a sentence naming the
numbers; ``memory_model.closed_forms()`` then profiles the step as before):

* a square layout whose ranks form a ``"grid"`` (:attr:`~lightning_tp2d.layouts.Layout.square`,
  :attr:`~lightning_tp2d.layouts.Layout.arrangement`) with the default options, its rows splitting the batch
  (:attr:`~lightning_tp2d.layouts.Layout.splits_batch`) or cutting the sequence into zigzag chunks
  (:attr:`~lightning_tp2d.layouts.Layout.zigzag`);
* ZeRO stages 0 and 1 (any ``dp``), stages 2 and 3 (FSDP2) with ``dp > 1``
  (:mod:`~lightning_tp2d.planning.closed_memory_grid_fsdp`, below); stages 2 and 3 on one replica are refused;
* checkpointing ``"none"``, ``"selective"`` and ``"full"``;
* ``elem`` 2 (bf16 autocast over float32 parameters), AdamW's fused step; GPT-2 (tied head) and Llama (GQA,
  tied or untied head: the tied head's block is the token table's, swapped with the mirror rank, as GPT-2's).

Notation, per rank ``(r, c)`` of the grid of side ``q``: ``e = elem``; ``N`` local tokens (``"2d"``: ``B/q``
sequences of ``T`` rows; ``"2d-metp"``: ``B`` sequences of ``S = T/q`` rows), ``R_T`` the rows of one local
sequence; ``hq = h/q``, ``kq`` the local key/value width (``n_kv_head hs / q``; GPT-2 ``hq``), ``fq`` the local MLP
width (``F/q``), ``nq`` the local heads; ``Vb = ceil(V/q)`` the vocabulary rows of a block (the head pads its block
to them); ``M`` the local elements of one block's matrices (``1/p`` of each), ``P`` the float32 parameters held
(and their gradients).

* parameters: every block matrix ``1/p``, every vector ``1/q`` (split over ``col``, replicated over ``row``); the
  token embedding ``rows(r) x hq`` (vocabulary over ``row``, DTensor's ceil chunks), Llama's untied head
  ``rows(c) x hq``, GPT-2's position table ``block_size x hq``;
* saved per block, ``"none"`` (``A``): each norm's input ``N hq e`` and statistics (RMSNorm ``rstd`` ``4N``, LayerNorm
  mean and ``rstd`` ``8N``); the matmuls' bf16 operands: Llama casts each norm's float32 output once per linear that
  reads it (five ``N hq e``), GPT-2's LayerNorm returns bf16 (its two outputs ``N hq e``); the bf16 copies of the
  block's matrices ``e M``; q, k, v ``N (hq + 2 kq) e``, the attention's output ``N hq e`` (the ring's too: written
  token-major, the output projection reads it as a view) and log-sum-exp ``4 N nq``; Llama's RoPE tables cast for q
  and k ``4 R_T hs e``; the MLP: SwiGLU's gate, up, ``silu(gate)`` and product ``4 N fq e``, GELU's pre-activation and
  output ``2 N fq e``. ``"full"``: the block's input ``N hq e``. ``"selective"`` (:mod:`lightning_tp2d.recompute`):
  ``A`` less its recipes, the norms' outputs (Llama: the five casts of them) and the MLP's activation output (SwiGLU's
  product, GELU's output) ``N fq e``, which its down projection's backward rebuilds (the block holds it then); the
  root loses the final norm's output and GPT-2's mirrored head block, rebuilt in the head's backward;
* saved by the root (``R``): the softmax block ``4 N Vb`` (float32, overwritten in place), the targets' offsets
  and two masks ``10 N``, the final norm's input ``N hq e``, statistics and bf16 output ``N hq e``, the head's
  bf16 weight block ``e Vb hq``; GPT-2's position ids ``8 R_T``; ``"2d-metp"``'s zigzag shards of the ids ``8 q N``;
* the forward and the root's backward peak in the cross-entropy's backward: the float32 gradient of the logits and
  its bf16 cast ``6 N Vb``, the target column ``8 N`` and the loss's scalars ``16``; or, the softmax block and the
  targets freed, in the head's backward (gather form): the bf16 gradient of the logits ``e N Vb``, the
  weight-gradient partials ``q e Vb hq``, the weight's column (streamed when ``q hq > N``: ``min(q, 3)`` blocks;
  gathered: ``q`` and the wire) and the input gradient's partial sums round ``col`` ``w e N hq``;
* a block's backward peaks in its MLP's down projection (SUMMA's scatter form): the gradient of its input
  ``e N fq``, the weight-gradient partials ``q e hq fq`` and the weight's column along ``row`` (streamed block by
  block when ``q hq fq > N hq``: ``min(q, 3)`` blocks; gathered: ``q`` and the wire), the gradient arriving round the
  ``col`` ring ``w e N hq`` (``w = min(q - 1, 2)``: one neighbour on a grid of side 2, both beyond) and the
  residual's gradient ``N hq e`` (GPT-2: the projection's bias gradient ``4 hq``); ``"2d-metp"``: or in its ring
  attention's backward (the ring's terms of :mod:`~lightning_tp2d.planning.closed_memory` on a ring of ``q`` along
  ``row``, in local widths); ``"full"``: or in its forward run again, at the MLP's down projection (the residual
  after attention, Llama's two float32 ``[N, hq]`` norm outputs, the MLP's live activations, the weight's bf16 copy
  and its column, the partial sums round ``col`` and their receive buffers); beside each, the saved tensors of the
  blocks not yet done, the gradients of the blocks done and of the head (GPT-2: the tied embedding's), what the root
  keeps (the loss's scalars, GPT-2's position ids ``8 R_T``, ``"2d-metp"``'s id shards ``8 q N``) and the flat
  buckets; under ``"full"`` the forward phase also peaks in the last block's forward, at the same moment;
* the end of the backward: ``G`` and (``dp > 1``) GradientSync's buckets ``G`` again;
* after the backward: ``G``, clipping's square of the largest gradient and its scalars; with ``dp > 1``
  :class:`~lightning_tp2d.training.GradientSync`'s buckets; at stage 1 the all-gather of the updated slices.

At stages 2 and 3 (:func:`lightning_tp2d.fsdp.shard_data_parallel`, bf16 ``param_dtype``) ``P`` is the float32 dp
shards (:func:`~lightning_tp2d.planning.closed_memory_grid_fsdp.grid_data_shards`: ``ceil(rows / dp)`` rows of each
local tensor shard, GPT-2's ``c_attn`` weight cut by columns and its bias kept whole); the gathered groups are bf16,
so autocast copies no weight (the blocks lose ``e M``, Llama's norms save one bf16 output instead of a cast per
linear, the head's block is the weight itself where no padding or mirror rank copies it), and the blocks' and the
head's gradients are bf16 until their reduce-scatter; the moments are
:func:`~lightning_tp2d.planning.closed_memory_grid_fsdp.fsdp_moments`'s (its docstring states them).

``parameters``, ``gradients``, ``optimizer`` and ``activations`` (the traced forward's saved bytes, stage 0's at every
stage, as the trace reports them) are exact; ``gathered`` is 0 at stages 0 and 1, at 2 and 3 the tensor shards in
bf16 (the root's and every block's, or two blocks'); ``backward`` is one block's saved tensors (``"full"``:
recomputed) plus, with ``dp > 1``, the buckets (stages 2 and 3: the root's and one block's tensor-shard bytes);
``step`` the largest phase; ``total`` = parameters + optimizer + step. On the small configurations of
``tests/test_closed_memory_grid.py`` (both layouts and families, ``q`` 2 and 3, stages 0 to 3, every
checkpointing) the step equals the traced one to the byte, and so does every phase, but: GPT-2's block-0 phase,
where the traced profile, in a worker whose DTensor propagation cache is cold, counts three global ``[V, h]``
tensors of the tied embedding's gradient accumulation (fake tensors of sharding propagation, which hold no memory
in a real step); and, short by under 1% where they do not peak, a block's backward at 16 tokens per rank and a
moment of the forward at three blocks (at 16 tokens and a vocabulary of 257 the first peaks, 3% short: a moment of
the MLP's gate and up projections' backward, where the weight gradients outweigh the activations). Not modelled:
the tail of a block's backward after its input's gradient exists (the embedding's backward, the 2-D attention's
local backward: below the MLP's at the sizes checked), allocator rounding, kernel workspaces.
"""

from __future__ import annotations

import dataclasses

import torch

from lightning_tp2d.families import anatomy, family_of_config
from lightning_tp2d.layouts import get_layout
from lightning_tp2d.options import TPOptions
from lightning_tp2d.planning.steps import closed_family_problem
from lightning_tp2d.planning.closed_memory_grid_fsdp import fsdp_moments, grid_data_shards, one_block_model
from lightning_tp2d.train_plan import CHECKPOINTING, FSDP_STAGES, ZERO_STAGES, fsdp_shards

__all__ = ["grid_peak_bytes", "grid_problem", "is_grid"]

_GRAD_BUCKET = 25 * 2 ** 20  # GradientSync's default bucket bytes
_GATHER_BUCKET = 64 * 2 ** 20  # ShardedOptimizer's gathered bytes per all-gather (zero.BUCKET_MIB)
_GATHERS_IN_FLIGHT = 3  # ShardedOptimizer: at most three all-gathers' receive blocks at once
_LOSS_SCALARS = 16  # the loss's stacked totals, the mean and its gradient: float32 scalars
_CLIP_SCALARS = 20  # clipping's norms and coefficient, the stacked sums


@dataclasses.dataclass(frozen=True)
class _Sizes:
    """Element counts one grid rank holds, read from the plain model built on the meta device."""

    block: int  # local elements of one block's parameters
    block_matrices: int  # ... of its 2-D parameters (``M``)
    root: int  # local elements of the root's parameters (embeddings, final norm, untied head)
    embedding: int  # ... of the input embeddings whose gradient the embedding's backward makes (Llama: the token
    # table; GPT-2: the position table, the tied token table's gradient made by the head first)
    largest: int  # local elements of the largest parameter tensor
    before_attention: int  # local elements of the block's first norm and q/k/v projections (weights, biases)
    late: int  # local elements of the output projection's weight and the MLP's matrices (``Wo + Mm``)


_SIZES: dict[tuple, _Sizes] = {}


def _grid_sizes(cfg, q: int, rank: int) -> _Sizes:
    key = (repr(dataclasses.replace(cfg, n_layer=1)), q, rank)  # (a config may hold a dict: rope_scaling)
    if key not in _SIZES:
        model, block, in_block, rows = one_block_model(cfg, q)
        V, hq = cfg.vocab_size, cfg.n_embd // q
        r, c = divmod(rank, q)

        local = [t.numel() // (q * q) if t.ndim == 2 else t.numel() // q for t in block.parameters()]
        matrices = sum(t.numel() // (q * q) for t in block.parameters() if t.ndim == 2)
        first = ("ln_1.", "input_layernorm.", "attn.c_attn.", "self_attn.q_proj.", "self_attn.k_proj.",
                 "self_attn.v_proj.")
        named = [(name, t.numel() // (q * q) if t.ndim == 2 else t.numel() // q, t.ndim)
                 for name, t in block.named_parameters()]
        before = sum(n for name, n, _ in named if name.startswith(first))
        late = sum(n for name, n, ndim in named if ndim == 2 and name.startswith(("mlp.", "attn.c_proj.",
                                                                                  "self_attn.o_proj.")))
        head = model.lm_head.weight
        tied = any(m.weight is head for m in model.modules() if isinstance(m, torch.nn.Embedding))
        root = embedding = 0
        largest = max(local)
        for t in model.parameters():
            if id(t) in in_block:
                continue
            if t.ndim == 2 and t.shape[0] == V:  # the untied head W[V_c, h_r] by col; the token table by row
                untied_head = t is head and not tied
                n = (rows(c) if untied_head else rows(r)) * hq
                if not (untied_head or tied):
                    embedding += n  # Llama's token table
            else:  # GPT-2's position table [block_size, h] and the norms: split over col
                n = t.numel() // q
                if t.ndim == 2:
                    embedding += n
            root += n
            largest = max(largest, n)
        _SIZES[key] = _Sizes(sum(local), matrices, root, embedding, largest, before, late)
    return _SIZES[key]


def step_memory_problem(cfg, *, dp: int, zero_stage: int, checkpointing: str, elem: int, fused: bool) -> str | None:
    """What both closed-form memory models (the ring's, :mod:`~lightning_tp2d.planning.closed_memory`, and the
    grids') refuse whatever the layout: a family other than GPT-2 and Llama, a ZeRO stage or checkpointing mode they
    do not model (FSDP's stages on one replica), an element size other than bf16 autocast's, AdamW's foreach step
    (``None``: none of these)."""
    problem = closed_family_problem(cfg)
    if problem:
        return problem
    if zero_stage not in ZERO_STAGES or (zero_stage in FSDP_STAGES and not fsdp_shards(zero_stage, dp)):
        return (f"zero_stage={zero_stage} (dp={dp}): the closed form models stages 0 and 1, and 2 and 3 (FSDP) "
                f"with dp > 1")
    if checkpointing not in CHECKPOINTING:
        return f"checkpointing={checkpointing!r}: the closed form models 'none', 'selective' and 'full'"
    if elem != 2:
        return f"elem={elem}: the closed form models bf16 autocast (elem 2)"
    if not fused:
        return "fused=False: the closed form models AdamW's fused step (foreach holds a copy of the parameters)"
    return None


def peak_of(moments: dict[str, list[dict]]) -> tuple[dict[str, int], int, list[dict]]:
    """``(phases, step, largest)`` of each phase's candidate moments (named parts of the live bytes): each phase's
    peak, the step's (the largest), and the parts of the phase that peaks, largest first (the first such phase when
    two tie)."""
    peaks = {phase: max(candidates, key=lambda m: sum(m.values())) for phase, candidates in moments.items()}
    phases = {phase: int(sum(m.values())) for phase, m in peaks.items()}
    peak_phase = max(phases, key=lambda phase: (phases[phase], -list(phases).index(phase)))
    largest = [{"part": name, "bytes": int(b)} for name, b in sorted(peaks[peak_phase].items(), key=lambda x: -x[1])
               if b]
    return phases, max(phases.values()), largest


def is_grid(layout) -> bool:
    """Whether ``layout``'s ranks form a square grid (the layouts this module models)."""
    spec = get_layout(layout)
    return spec.square and spec.arrangement == "grid"


def check_peak_entry(problem: str | None, rank: int, p: int, dp: int) -> None:
    """The refusals both memory closed forms (the ring's and the grids') make on entry: a step it does not model
    (``problem``, a sentence naming the numbers), a rank outside ``[0, p)``, ``dp`` below 1."""
    if problem:
        raise ValueError(problem)
    if not 0 <= rank < p:
        raise ValueError(f"rank={rank} is not in [0, {p})")
    if dp < 1:
        raise ValueError(f"dp={dp} must be at least 1")


def after_backward(P: int, largest: int, dp: int, zero_stage: int) -> list[dict]:
    """The moments after the backward (both memory closed forms): the gradients (``P`` bytes) and gradient clipping's
    temporaries (``largest``: the largest gradient's elements), then with ``dp`` > 1 GradientSync's buckets beside the
    gradients and at stage 1 the all-gathers of the updated slices."""
    after = [{"gradients": P, "clipping": 4 * largest + _CLIP_SCALARS}]
    if dp > 1:  # GradientSync's finish: the buckets beside the gradients
        after.append({"gradients": P, "buckets": P + _CLIP_SCALARS - 8})
    if zero_stage == 1 and dp > 1:  # the all-gathers of the updated slices
        gathered = min(P, _GATHERS_IN_FLIGHT * _GATHER_BUCKET)
        after.append({"gradients": P, "all-gather": gathered + gathered // dp + _CLIP_SCALARS - 8})
    return after


def grid_problem(layout, cfg, batch: int, seq: int, p: int, *, dp: int = 1, zero_stage: int = 0,
                 checkpointing: str = "none", elem: int = 2, fused: bool = True) -> str | None:
    """Why :func:`grid_peak_bytes` does not model this step, a sentence naming the numbers (``None``: it does)."""
    spec = get_layout(layout)
    if not is_grid(spec):
        return f"layout {spec.name!r} ({spec.arrangement}) is not a square grid"
    if spec.splits_batch == spec.zigzag:
        return (f"layout {spec.name!r} splits_batch={spec.splits_batch}, zigzag={spec.zigzag}: the closed form "
                f"models a grid whose rows split the batch or cut the sequence")
    if spec.options not in (None, TPOptions()):
        return f"options {spec.options!r}: the closed form models the default options"
    family = family_of_config(cfg)
    problem = step_memory_problem(cfg, dp=dp, zero_stage=zero_stage, checkpointing=checkpointing, elem=elem,
                                  fused=fused)
    if problem:
        return problem
    if getattr(cfg, "dropout", 0.0):
        return f"dropout={cfg.dropout}: the closed form models training without dropout"
    if spec.size_problem(p) or p < 4:
        return f"p={p}: the grid needs a square p >= 4"
    problems = family.problems(spec, p, cfg)
    if problems:
        return "; ".join(problems)
    if batch < 1:
        return f"batch={batch}: needs at least one sequence"
    return spec.batch_problem(p, batch) or spec.sequence_problem(p, seq)


def grid_peak_bytes(layout, cfg, batch: int, seq: int, p: int, *, dp: int = 1, zero_stage: int = 0,
                    checkpointing: str = "none", elem: int = 2, rank: int = 0, fused: bool = True) -> dict:
    """Predicted peak bytes of one step on grid rank ``rank`` (module docstring): the dict of
    :func:`~lightning_tp2d.planning.memory_model.peak_bytes` (``largest`` naming the parts of the phase that
    peaks, largest first) plus ``"phases"``, each phase's peak by name. ``ValueError`` naming the numbers for a
    step it does not model (:func:`grid_problem`)."""
    check_peak_entry(grid_problem(layout, cfg, batch, seq, p, dp=dp, zero_stage=zero_stage,
                               checkpointing=checkpointing, elem=elem, fused=fused), rank, p, dp)
    spec = get_layout(layout)
    q = spec.side(p)
    z = _grid_sizes(cfg, q, rank)
    e, L = elem, cfg.n_layer
    llama, a = family_of_config(cfg).name == "llama", anatomy(cfg)
    tied = a.tied_head  # the head multiplies by the token table (GPT-2's always does)
    h, nh = cfg.n_embd, cfg.n_head
    hs = h // nh
    hq, nq = h // q, nh // q
    kq = a.kv_width // q
    fq = a.mlp_width // q
    sequences, rows = (batch // q, seq) if spec.splits_batch else (batch, seq // q)
    N = sequences * rows
    Vb = -(-cfg.vocab_size // q)
    ring = spec.zigzag  # the attention is a ring along row, the ids cut into zigzag shards

    block_params = 4 * z.block
    P = 4 * z.root + L * block_params  # float32 parameters held, and their gradients
    # saved per block ("none") and by the root
    stats = 4 * N if llama else 8 * N  # RMSNorm's rstd; LayerNorm's mean and rstd
    norms = 2 * (N * hq * e + stats) + (5 if llama else 2) * N * hq * e  # inputs, statistics, bf16 outputs
    attention = N * (hq + 2 * kq) * e + N * hq * e + 4 * N * nq + (4 * rows * hs * e if llama else 0)
    mlp = (4 if llama else 2) * N * fq * e
    A = norms + e * z.block_matrices + attention + mlp
    positions = 0 if llama else 8 * rows
    R = 4 * N * Vb + 10 * N + 2 * N * hq * e + stats + e * Vb * hq + positions + (8 * q * N if ring else 0)
    block_input = N * hq * e
    # "selective": the norms' outputs (and the casts of them, Llama's five), the MLP's activation output (SwiGLU's
    # product, GELU's output) and a tied head's mirrored block are recipes, rebuilt when a backward unpacks them
    selective = checkpointing == "selective"
    rebuilt_mlp = N * fq * e if selective else 0  # in the MLP's down projection's backward
    recipes = (5 if llama else 2) * N * hq * e + rebuilt_mlp if selective else 0
    root_recipes = N * hq * e + (e * Vb * hq if tied else 0) if selective else 0  # in the head's backward
    kept = block_input if checkpointing == "full" else A - recipes
    activations = L * kept + R - root_recipes
    # the forward and the root's backward: the cross-entropy's backward
    loss_backward = 6 * N * Vb + 8 * N + _LOSS_SCALARS
    # a block's backward: its MLP's down projection (scatter form)
    w = min(q - 1, 2)
    streams = q * hq * fq > N * hq  # the weight column streams block by block when it outweighs the gradient
    column = min(q, 3) if streams else q + 1
    mlp_backward = (e * N * fq + (q + column) * e * hq * fq + (1 + w) * e * N * hq
                    + (0 if llama else 4 * hq))  # GPT-2: the output projection's bias gradient
    # the head's backward (gather form): the bf16 gradient of the logits, the weight-gradient partials and the
    # weight's column (streamed when q hq > N), the partial sums of the input's gradient round col
    head_column = min(q, 3) if q * hq > N else q + 1
    head_backward = e * N * Vb + (q + head_column) * e * Vb * hq + w * e * N * hq
    # the ring attention's backward ("2d-metp", a ring of q along row): the float32 dq|dk|dv and two float32 K/V
    # gradient accumulators, the output's gradient and its re-laid copy, the K/V blocks travelling (r receive
    # buffers and the wire copy), the kernel's gradients of one block (dq of half the rows, dk, dv; twice with GQA)
    recv = min(q, 3)
    attention_backward = (4 * N * (hq + 2 * kq) + 16 * N * kq + 2 * N * hq * e + (recv + 1) * 2 * N * kq * e
                          + (5 if nq > kq // hs else 5 / 2) * N * kq * e)
    # what the block still holds then: its saved tensors less its second norm's, its MLP's and the bf16 copies of
    # the output projection and the MLP, plus the residual's gradient; the gradients of its MLP, output projection
    # and second norm
    attention_kept = (A - (N * hq * e + stats + (2 if llama else 1) * N * hq * e) - e * z.late - mlp + N * hq * e
                      - ((3 if llama else 1) * N * hq * e if selective else 0))  # (the first norm's, not rebuilt)
    attention_grads = 4 * (z.block - z.before_attention)
    # "full": a block's forward at its MLP's down projection (scatter form, the partial sums round col): the
    # residual after attention, Llama's two float32 [N, hq] norm outputs, the MLP's live activations (SwiGLU gate,
    # up, product; GELU pre-activation, output), the weight's bf16 copy and its column along row (gathered:
    # q blocks, beside the partial sums and their receive buffers 2 w N hq e; streamed: the larger of the blocks
    # posted ahead beside the first partial sum and the partial sums with their receive buffers)
    forward_streams = q * hq > N
    mlp_live = (3 if llama else 2) * e * N * fq
    if forward_streams:
        down_column = max(min(q - 1, 2) * e * hq * fq + e * N * hq, 2 * w * e * N * hq)
    else:
        down_column = q * e * hq * fq + 2 * w * e * N * hq
    forward_block = N * hq * e + (8 * N * hq if llama else 0) + mlp_live + e * hq * fq + down_column
    head_grads = 4 * (z.root - z.embedding)  # the head's, the final norm's (tied: the token table's)
    left = _LOSS_SCALARS + positions + (8 * q * N if ring else 0)  # what the root keeps through the blocks' backward
    # rebuilt for the block's backward: "full" its saved tensors, "selective" its MLP's activation output
    recomputed = A - kept - recipes + rebuilt_mlp

    def in_block(i: int) -> list[dict]:
        done = (L - 1 - i) * block_params + head_grads
        base = {"saved activations": (i + 1) * kept + recomputed + left, "gradients": done,
                "buckets": _flat_buckets(done, dp)}
        out = [dict(base, **{"MLP backward": mlp_backward})]
        if ring:
            out.append(dict(base, **{"saved activations": i * kept + left + attention_kept,
                                     "gradients": done + attention_grads,
                                     "buckets": _flat_buckets(done + attention_grads, dp),
                                     "attention backward": attention_backward}))
        if checkpointing == "full":  # the block's forward run again, at its MLP's down projection
            out.append(dict(base, **{"saved activations": (i + 1) * kept + left + A - mlp_live - e * hq * fq
                                     - N * hq * e, "recomputed forward": forward_block}))
        return out

    ending = {"gradients": P + _LOSS_SCALARS, "buckets": P if dp > 1 else 0}
    after = after_backward(P, z.largest, dp, zero_stage)
    forward = [{"saved activations": activations, "loss backward": loss_backward},
               {"saved activations": L * kept + R - 4 * N * Vb - 10 * N + _LOSS_SCALARS,  # (recipes rebuilt)
                "head backward": head_backward}]
    if checkpointing == "full":  # the last block's forward, at its MLP's down projection
        forward.append({"saved activations": L * kept + left - _LOSS_SCALARS, "block forward": forward_block})
    moments = {"forward": forward, "last block": in_block(L - 1), "block 0": in_block(0) + [ending],
               "after backward": after}
    fsdp = fsdp_shards(zero_stage, dp)
    if fsdp:  # FSDP's dp shards at rest, gathered in bf16 (closed_memory_grid_fsdp)
        d, clip_scalars, loss_scalars = grid_data_shards(cfg, q, dp, rank), _CLIP_SCALARS, _LOSS_SCALARS
        P = 4 * (d.root + L * d.block)
        moments = fsdp_moments(locals())
    phases, step, largest = peak_of(moments)
    optimizer = 2 * P // (dp if zero_stage == 1 else 1)
    transient = P if dp > 1 else 0  # GradientSync's flat buckets
    recompute = A if checkpointing == "full" else 0  # one block's saved tensors, rebuilt in its backward
    gathered = 0
    if fsdp:  # what the traced model reports (memory_model._parts): tensor shards in bf16, unsharded gradients
        gathered = (z.root + (L if zero_stage == 2 else min(2, L)) * z.block) * e
        transient = 4 * (z.root + z.block)
    return {"parameters": P, "gradients": P, "optimizer": optimizer, "activations": int(activations),
            "gathered": int(gathered), "backward": int(recompute + transient), "step": step,
            "total": int(P + optimizer + step), "largest": largest, "phases": phases}


def _flat_buckets(done: int, dp: int) -> int:
    """Bytes of GradientSync's flat buckets filled once ``done`` gradient bytes exist (``dp > 1``): whole buckets
    of :data:`_GRAD_BUCKET`."""
    if dp == 1:
        return 0
    return (done // _GRAD_BUCKET) * _GRAD_BUCKET
