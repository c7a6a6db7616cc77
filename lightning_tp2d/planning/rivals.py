"""The rivals' costs as arithmetic on the config: what one training step of each runnable baseline
(:mod:`lightning_tp2d.baselines`) sends and holds, written out once from their code (torch 2.13, DeepSpeed 0.19.8)
and checked against the bytes real steps count (``tests/test_tp1d.py``, ``tests/test_context_parallel.py``,
``tests/test_ulysses.py``). The planner and cost model price the rivals from these, without building them.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from lightning_tp2d import rivals as rival_registry
from lightning_tp2d.models.gpt2 import GPT2Config
from lightning_tp2d.models.llama import Llama
from lightning_tp2d.families import anatomy
from lightning_tp2d.planning.events import Comm, float32_bytes
from lightning_tp2d.train_plan import FSDP_STAGES, ZERO_STAGES, fsdp_shards, reshards_after_forward
from lightning_tp2d.planning.memory_model import (baseline_block_backward_bytes, baseline_peak_bytes,
                                                  loss_forward_bytes, loss_input_bytes, parameter_split)

# The rivals' names in the planner's rows (PlanRow.layout of a rival's row), from their registry
# (lightning_tp2d.rivals). Planned by plan(): BASELINE; priced by price() only: the others.
BASELINE = rival_registry.TP1D_SP.name  # torch's 1-D TP + SP x FSDP2 (torchtitan's plan; tp 1: plain FSDP)
CP = rival_registry.CP.name  # torch's context parallelism x FSDP2 (lightning_tp2d.baselines.context_parallel)
CP_TP = rival_registry.CP_TP.name  # the same x 1-D TP + SP inside each CP rank (torchtitan's composition)
ULYSSES = rival_registry.ULYSSES.name  # DeepSpeed's Ulysses SP + ALST's tiling x FSDP2 (baselines.ulysses)

# ---- 1-D TP (torch's colwise / rowwise styles, loss parallel) ----------------------------------------------------------

def tp1d_comm_events(cfg: GPT2Config, batch: int, seq: int, p: int, elem: int) -> list[Comm]:
    """The communication one rank performs for one training step ``loss = model(idx, targets); loss.backward()``
    with ``idx`` of shape ``[batch, seq]`` (``elem`` bytes per element), counted as :func:`lightning_tp2d.comm.count_comm` counts.

    With ``N = batch * seq`` tokens and activations ``[N, h]``, all over the whole ``tp`` group, nothing overlapped
    with compute. Element sizes: ``e = elem`` for matmul outputs; ``ep`` (4, or 8 for float64) for what stays float32
    under bf16 autocast: the embedding output, the loss statistics, and the input gradients of the linears (the
    all-reduce runs after autocast's cast back to the float32 input):

    forward
        * token embedding (row-parallel, masked lookup): 1 all-reduce of ``[N, h]`` (``ep``);
        * each block: 2 all-reduces of ``[N, h]`` (``e``: outputs of attention ``c_proj`` and ``mlp.c_proj``);
        * vocab-parallel loss: 3 all-reduces of ``[N, 1]`` (``ep``): row max, row sum of exp (both in the
          log-softmax) and the target's log-probability (masked gather: only the rank holding the target's row
          contributes).
    backward
        * LM head: 1 all-reduce of ``[N, h]`` (``ep``: gradient of its replicated input);
        * each block: 2 all-reduces of ``[N, h]`` (``ep``: gradients of the inputs of ``mlp.c_fc`` and ``c_attn``);
        * the loss backward and the embedding's weight gradient are local; parameter gradients need nothing
          (sharded ones are local, replicated ones are computed identically everywhere).

    On one rank DTensor skips every redistribution but ``loss_parallel`` still issues its three ``[N, 1]``
    all-reduces (over a group of one: counted, nothing sent).
    """
    if p < 1 or batch < 1 or seq < 1 or elem < 1:
        raise ValueError(f"need positive sizes, got batch={batch} seq={seq} p={p} elem={elem}")
    N = batch * seq
    ep = float32_bytes(elem)
    act, act_p = N * cfg.n_embd * elem, N * cfg.n_embd * ep
    row = N * ep
    L = cfg.n_layer

    def ar(nbytes: int, calls: int, phase: str) -> Comm:
        return Comm("all_reduce", AXIS, p, nbytes, calls=calls, overlap_flops=0.0, phase=phase)

    loss = [ar(row, 2, "forward"),  # loss_parallel log-softmax: max and sum-exp over vocab shards, [N, 1]
            ar(row, 1, "forward")]  # loss_parallel nll: target log-probability, [N, 1]
    if p == 1:
        return loss
    return [
        ar(act_p, 1, "forward"),  # wte: MaskPartial -> Replicate
        ar(act, 2 * L, "forward"),  # attn.c_proj, mlp.c_proj: Partial -> Replicate
        *loss,
        ar(act_p, 1, "backward"),  # lm_head input gradient: Partial -> Replicate
        ar(act_p, 2 * L, "backward"),  # mlp.c_fc and attn.c_attn input gradients
    ]


# ---- 1-D TP + SP (torchtitan's plan) -----------------------------------------------------------------------------------

AXIS = "tp"


def check_sequence_parallel(seq: int, p: int) -> None:
    """Raise ``ValueError`` naming the numbers unless the sequence length ``seq`` splits evenly over ``p`` ranks."""
    if seq % p:
        fits = [k for k in range(1, p + 1) if seq % k == 0]
        raise ValueError(f"1-D tensor parallelism with sequence parallelism: sequence length T={seq} is not divisible "
                         f"by p={p}; use T a multiple of {p} (or p in {fits})")


def block_linears(cfg) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The ``(out, in)`` weight shapes of one block's linears, in four groups: those reading the attention input,
    the attention output projection, those reading the MLP input, the MLP output projection. GPT-2: ``c_attn``
    ``[3h, h]``, ``c_proj`` ``[h, h]``, ``c_fc`` ``[4h, h]``, ``mlp.c_proj`` ``[h, 4h]``. Llama (a config with
    ``n_kv_head`` and ``intermediate_size``): ``q_proj`` ``[h, h]``, ``k_proj`` and ``v_proj`` ``[nkv*hs, h]`` (GQA),
    ``o_proj`` ``[h, h]``, ``gate_proj`` and ``up_proj`` ``[I, h]``, ``down_proj`` ``[h, I]``. Read from the
    family's :func:`~lightning_tp2d.families.anatomy` (fused or separate q/k/v, gated MLP or not)."""
    h, a = cfg.n_embd, anatomy(cfg)
    kv, width = a.kv_width, a.mlp_width
    qkv = ((h + 2 * kv, h),) if a.fused_qkv else ((h, h), (kv, h), (kv, h))
    return qkv, ((h, h),), ((width, h),) * (2 if a.gated_mlp else 1), ((h, width),)


def tp1d_sp_comm_events(cfg: GPT2Config, batch: int, seq: int, p: int, elem: int,
                        async_tp: bool = False, lean_wire: bool = False) -> list[Comm]:
    """The communication one rank performs for one training step ``loss = model(idx, targets); loss.backward()``
    with ``idx [batch, seq]`` (``seq`` divisible by ``p``), in the byte convention of :func:`lightning_tp2d.comm.count_comm`: an all-gather
    counts its local input, a reduce-scatter its full input.

    ``N = batch * seq`` tokens, ``e = elem`` (matmul outputs and their gradients), ``ep`` (4, or 8 for float64:
    what stays float32 under autocast: embeddings, LayerNorm outputs, the residual stream and their gradients):

    forward
        * token embedding: 1 reduce-scatter of ``[N, h]`` (``ep``) to sequence shards;
        * each block: 2 all-gathers of ``[N/p, h]`` (``ep``: the ``ln_1`` / ``ln_2`` outputs for c_attn, c_fc) and
          2 reduce-scatters of ``[N, h]`` (``e``: the attention and MLP ``c_proj`` outputs);
        * LM head: 1 all-gather of ``[N/p, h]`` (``ep``: the ``ln_f`` output);
        * vocab-parallel loss: 3 all-reduces of ``[N, 1]`` (``ep``; row max, sum of exp, target log-probability).
    backward
        * LM head: 1 reduce-scatter of ``[N, h]`` (``ep``: gradient of the gathered ``ln_f`` output);
        * each block: 2 all-gathers of ``[N/p, h]`` (``e``: gradients of the ``c_proj`` outputs) and
          2 reduce-scatters of ``[N, h]`` (``ep``: gradients of the gathered LayerNorm outputs);
        * LayerNorm weights (and biases): 1 all-reduce of all their gradients in one flat buffer,
          ``(2L + 1) h`` (``x2`` with biases, ``ep``), issued when the last of them is accumulated
          (:class:`_NormGradReducer`: they are Partial over the sequence shards);
        * token embedding: 1 all-gather of ``[N/p, h]`` (``ep``: the shard gradients back to the full lookup);
        * position embedding: 1 all-gather of ``[T/p, h]`` (``ep``).

    Llama (``cfg`` a :class:`~lightning_tp2d.models.llama.LlamaConfig`; torchtitan's plan, module docstring): the
    same calls and bytes, ``q/k/v_proj`` sharing the all-gather of ``input_layernorm``'s output (``gate/up_proj``
    that of ``post_attention_layernorm``), ``o_proj`` / ``down_proj`` in place of the ``c_proj``\ s, RMSNorm weights
    without biases, and no position embedding (RoPE) and so no last all-gather.

    Every call is blocking in this code (``overlap_flops`` 0). ``async_tp=True`` prices torch's async TP
    (micro-pipelined collective matmuls) instead: each all-gather / reduce-scatter next to a column- / row-parallel
    linear carries that linear's matmul FLOPs as ``overlap_flops`` (the forward product; in backward the
    input-gradient product, the same count); the embedding, LayerNorm-gradient and loss collectives stay exposed.
    Calls and bytes are the same either way.

    ``lean_wire=True`` counts every activation collective in the compute dtype (``e`` for ``ep`` above), as Megatron-LM
    with bf16 parameters runs them (its LayerNorm outputs, residual stream and their gradients are bf16): the strongest
    form of this baseline, used by the projection. torch's code under autocast sends the ``ep`` bytes.

    On one rank DTensor skips every redistribution; ``loss_parallel``'s three all-reduces remain (counted, nothing
    sent), as in :func:`~lightning_tp2d.baselines.tp1d.tp1d_comm_events`.
    """
    if p < 1 or batch < 1 or seq < 1 or elem < 1:
        raise ValueError(f"need positive sizes, got batch={batch} seq={seq} p={p} elem={elem}")
    check_sequence_parallel(seq, p)
    h, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    e, ep = elem, float32_bytes(elem)
    ea = e if lean_wire else ep  # the float32 activations' bytes on the wire
    N = batch * seq
    full_e, full_ep, shard_e, shard_ep = N * h * e, N * h * ea, N * h * e // p, N * h * ea // p
    # matmul FLOPs per rank of each linear's forward (= its input-gradient product in backward)
    qkv, proj, fc, fc_proj = (2 * N * sum(o * i for o, i in group) / p for group in block_linears(cfg))
    head = 2 * N * h * -(-V // p)

    def ev(kind: str, nbytes: int, calls: int, phase: str, matmul: float = 0.0) -> Comm:
        return Comm(kind, AXIS, p, nbytes, calls=calls, overlap_flops=matmul if async_tp else 0.0, phase=phase)

    loss = [ev("all_reduce", N * ep, 3, "forward")]
    if p == 1:
        return loss
    norm_grads = (2 * L + 1) * (2 if getattr(cfg, "bias", False) else 1) * h * ep  # RMSNorm: weights only
    # a learned position table (GPT-2's wpe); rotary positions (Llama's RoPE) have none
    positions = [] if anatomy(cfg).rotary else [ev("all_gather", seq * h * ea // p, 1, "backward")]
    return [
        ev("reduce_scatter", full_ep, 1, "forward"),  # wte: MaskPartial -> Shard(1)
        ev("all_gather", shard_ep, L, "forward", qkv),  # ln_1 output -> c_attn
        ev("reduce_scatter", full_e, L, "forward", proj),  # attn.c_proj output: Partial -> Shard(1)
        ev("all_gather", shard_ep, L, "forward", fc),  # ln_2 output -> c_fc
        ev("reduce_scatter", full_e, L, "forward", fc_proj),  # mlp.c_proj output: Partial -> Shard(1)
        ev("all_gather", shard_ep, 1, "forward", head),  # ln_f output -> lm_head
        *loss,
        ev("reduce_scatter", full_ep, 1, "backward", head),  # lm_head input gradient
        ev("all_gather", shard_e, L, "backward", fc_proj),  # mlp.c_proj output gradient
        ev("reduce_scatter", full_ep, L, "backward", fc),  # c_fc input gradient
        ev("all_gather", shard_e, L, "backward", proj),  # attn.c_proj output gradient
        ev("reduce_scatter", full_ep, L, "backward", qkv),  # c_attn input gradient
        ev("all_reduce", norm_grads, 1, "backward"),  # LayerNorm weight / bias gradients, one flat buffer
        ev("all_gather", shard_ep, 1, "backward"),  # wte output gradient
        *positions,  # wpe output gradient
    ]


def recomputed_sp_events(cfg, events: list[Comm], checkpointing: str, **kw) -> list[Comm]:
    """The sequence-parallel baseline's collectives its checkpointed blocks run again in the backward: ``"full"``
    every block's forward all-gathers and reduce-scatters; ``"selective"`` (torchtitan's per-op policy, which saves
    reduce-scatter outputs) the two all-gathers of each block. Phase ``"backward"``. A block's calls are those one
    more block adds."""
    if checkpointing == "none":
        return []
    deeper = tp1d_sp_comm_events(dataclasses.replace(cfg, n_layer=cfg.n_layer + 1), **kw)
    again = []
    for ev, more in zip(events, deeper):
        per_block = ev.phase == "forward" and more.calls > ev.calls and ev.kind in ("all_gather", "reduce_scatter")
        if per_block and (checkpointing == "full" or ev.kind == "all_gather"):
            again.append(dataclasses.replace(ev, phase="backward"))
    return again


# ---- torch's context parallelism x FSDP2 (and x 1-D TP + SP) -----------------------------------------------------------

LOSSES = ("chunked", "unfused")


# tokens per chunk of the chunked loss: one chunk's float32 logits are 1024 x V x 4 bytes, 501 MiB for Llama 3's
# 128256-row vocabulary (Liger's fused linear cross-entropy takes about T / ceil(V / h) tokens, 1/32 of the sequence
# for Llama 3.1 8B; torchtune 8 chunks)
CHUNK_TOKENS = 1024


RING_AXIS = "cp"  # the ring's group


FSDP_AXIS = "data_parallel"  # FSDP's (the same ranks as the ring's when dp is 1)


_SCORE_FLOPS = {"forward": 4, "backward": 10}  # per visible score and head channel (the cost model's convention)


def _shards(shapes, world: int) -> int:
    """Elements of one rank's FSDP2 shard of parameters of these ``shapes``: each one's dim 0 padded to a multiple
    of ``world``."""
    return sum(-(-shape[0] // world) * math.prod(shape[1:]) for shape in shapes)


# torchtitan's Llama plan (lightning_tp2d.baselines.tp1d's): column-parallel (dim 0) and row-parallel (dim 1)
# linears, the embedding's vocabulary rows (dim 0), the head's vocabulary rows; norms whole
_COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "c_attn", "c_fc")
_ROWWISE = ("o_proj", "down_proj", "c_proj")


def tp1d_local_shapes(model, p: int) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape on tensor rank 0 of 1-D TP over ``p`` ranks, as
    :func:`lightning_tp2d.baselines.tp1d.local_shapes_1d` reads it from the plan (``tests/test_tp1d.py`` checks
    they agree): column-parallel linears cut on dim 0 (weight and bias), row-parallel ones' weights on dim 1, the
    token embedding and the head on vocabulary rows, the rest whole; ``ceil(n / p)`` (``torch.chunk``'s first
    piece)."""
    shapes = {}
    for name, param in model.named_parameters():
        shape, parts = list(param.shape), name.split(".")
        module = parts[-2] if len(parts) > 1 else ""
        dim = None
        if module in _COLWISE:
            dim = 0
        elif module in _ROWWISE and parts[-1] == "weight":
            dim = 1
        elif module in ("embed_tokens", "wte", "lm_head"):
            dim = 0
        if dim is not None:
            shape[dim] = -(-shape[dim] // p)
        shapes[name] = tuple(shape)
    return shapes


def fsdp_shard_elements(cfg, world: int, tp: int = 1) -> tuple[int, int]:
    """``(root, block)``: elements of one rank's FSDP2 shard of the root group (embedding, final norm, head) and
    of one decoder layer, sharded over ``world`` ranks (counted on the meta device). ``tp`` > 1 (``cp-tp``): FSDP2
    cuts each parameter's 1-D TP shard (:func:`~lightning_tp2d.baselines.tp1d.local_shapes_1d`, tensor rank 0's: the
    largest where the vocabulary does not divide)."""
    with torch.device("meta"):
        model = Llama(dataclasses.replace(cfg, n_layer=1))
    shapes = tp1d_local_shapes(model, tp)
    in_layer = {f"model.layers.0.{name}" for name, _ in model.model.layers[0].named_parameters()}
    return (_shards([v for k, v in shapes.items() if k not in in_layer], world),
            _shards([v for k, v in shapes.items() if k in in_layer], world))


def _kv_width(cfg) -> int:
    return cfg.n_kv_head * (cfg.n_embd // cfg.n_head)


def diagonal_share(seq: int, p: int) -> tuple[float, float]:
    """``(diagonal, off-diagonal)``: the fraction of one rank's visible causal scores in the ring's first step (its
    own two chunks, ``c (2c + 1)`` scores for ``c = seq / (2p)``) and in each of the other ``p - 1`` (``2c²``: the
    head-tail balancer's half blocks); ``diagonal + (p - 1) * off-diagonal == 1``."""
    c = seq // (2 * p)
    total = c * (2 * c + 1) + (p - 1) * 2 * c * c
    return c * (2 * c + 1) / total, 2 * c * c / total


def _chunks(tokens: int, chunk_tokens: int) -> dict[int, int]:
    """Chunk size -> how many chunks of it :func:`chunked_cross_entropy` cuts ``tokens`` tokens into."""
    full, rest = divmod(tokens, chunk_tokens)
    return {size: n for size, n in ((chunk_tokens, full), (rest, 1)) if n and size}


def _check_loss(loss: str, chunk_tokens: int) -> None:
    if loss not in LOSSES or chunk_tokens < 1:
        raise ValueError(f"loss={loss!r} must be one of {LOSSES} and chunk_tokens={chunk_tokens} positive")


def cp_comm_events(cfg, batch: int, seq: int, p: int, elem: int = 2, *, dp: int = 1,
                   checkpointing: str = "none", tp: int = 1, async_tp: bool = False, loss: str = "chunked",
                   chunk_tokens: int = CHUNK_TOKENS) -> list[Comm]:
    """The communication of one :func:`train_step` on one rank: CP over ``p`` ranks x FSDP2 over ``p * dp``
    (torchtitan shards the weights over ``dp_shard x cp``), and with ``tp`` > 1 (``cp-tp``) 1-D TP + SP over ``tp``
    ranks inside each CP rank. ``elem``: the activations' and gathered weights' bytes (4: float32, as the CPU runs;
    2: torchtitan's FSDP ``param_dtype`` bf16); gradients are reduced in float32.

    * FSDP (axis ``"data_parallel"``; :func:`fsdp_shard_elements`, ``S_root`` / ``S_block`` per rank, of the TP
      shards when ``tp`` > 1): forward all-gathers of the root's and each block's shard (``elem`` bytes each),
      backward all-gathers of each again (:func:`parallelize_cp` reshards the root after forward too),
      reduce-scatters of the root's and each block's float32 gradients (payload ``p dp S``).
    * torch's ring (axis ``"cp"``) per layer, ``kv = 2 B (T/p) n_kv hs elem / tp`` (the local K and V of this
      rank's key/value heads, concatenated): one all-gather in the forward (posted at ring step 0, waited at step 1:
      it runs behind the diagonal block's attention, ``overlap_flops``), one in the backward (behind the diagonal
      block's backward kernel), with ``"full"`` checkpointing one more for the recomputed forward; ``p`` permutes of
      the float32 dK/dV partial sums (``all_to_all_single`` to the next rank, kind ``"send"``,
      ``2 B (T/p) n_kv hs 4 / tp`` bytes): the one posted at step ``i`` runs behind step ``i + 1``'s backward
      kernel, the last behind nothing.
    * ``tp`` > 1: 1-D TP + SP's calls on this CP rank's ``T/p`` tokens (axis ``"tp"``,
      :func:`~lightning_tp2d.baselines.tp1d_sp.tp1d_sp_comm_events` with its activations in ``elem`` as FSDP's
      ``param_dtype`` runs them, and :func:`~lightning_tp2d.baselines.tp1d_sp.recomputed_sp_events` for
      ``checkpointing``); ``async_tp``: they carry the FLOPs of the matmul torch's async TP fuses them with.
      With the chunked loss (``loss="chunked"``, :func:`chunked_cross_entropy`) the backward recomputes each
      chunk's ``loss_parallel`` forward: its three all-reduces of the chunk's float32 ``[n, 1]`` rows again.
    * :func:`sequence_loss`'s 8-byte target count and :func:`mean_loss`'s 4-byte loss, all-reduced over ``"cp"``.

    FLOPs behind the ring are attention FLOPs (``4`` / ``10`` per visible score and channel, forward / backward)."""
    if seq % (2 * p):
        raise ValueError(f"sequence length {seq} is not divisible by 2p = {2 * p} (torch's head-tail balancer)")
    _check_loss(loss, chunk_tokens)
    if tp < 1 or cfg.n_kv_head % tp or cfg.n_head % tp:
        raise ValueError(f"cp-tp: n_head={cfg.n_head} and n_kv_head={cfg.n_kv_head} must divide by tp={tp}")
    world, L, tokens = p * dp, cfg.n_layer, batch * seq // p
    root, block = fsdp_shard_elements(cfg, world, tp)
    grad = float32_bytes(elem)
    kv = 2 * tokens * _kv_width(cfg) // tp
    diagonal, off = diagonal_share(seq, p)
    scores = batch * cfg.n_embd / tp * (seq * (seq + 1) // 2) / p  # one layer's visible scores x channels, per rank
    fwd, bwd = (_SCORE_FLOPS[k] * scores for k in ("forward", "backward"))
    gathers = 2 if checkpointing == "full" else 1  # forward all-gathers per layer in the backward phase
    events = [Comm("all_gather", FSDP_AXIS, world, elem * root, 1),
              Comm("all_gather", FSDP_AXIS, world, elem * block, L),
              Comm("all_gather", FSDP_AXIS, world, elem * block, L, phase="backward"),
              Comm("all_gather", FSDP_AXIS, world, elem * root, 1, phase="backward"),
              Comm("reduce_scatter", FSDP_AXIS, world, grad * world * block, L, phase="backward"),
              Comm("reduce_scatter", FSDP_AXIS, world, grad * world * root, 1, phase="backward"),
              Comm("all_gather", RING_AXIS, p, elem * kv, L, diagonal * fwd),
              Comm("all_gather", RING_AXIS, p, elem * kv, L * (gathers - 1), diagonal * fwd, "backward"),
              Comm("all_gather", RING_AXIS, p, elem * kv, L, diagonal * bwd, "backward"),
              Comm("send", RING_AXIS, p, grad * kv, L * (p - 1), off * bwd, "backward"),
              Comm("send", RING_AXIS, p, grad * kv, L, 0.0, "backward"),
              Comm("all_reduce", RING_AXIS, p, 8, 1), Comm("all_reduce", RING_AXIS, p, 4, 1, phase="backward")]
    if tp > 1:
        kw = dict(batch=batch, seq=seq // p, p=tp, elem=elem, async_tp=async_tp, lean_wire=True)
        inside = tp1d_sp_comm_events(cfg, **kw)
        events += inside + recomputed_sp_events(cfg, inside, checkpointing, **kw)
        if loss == "chunked":  # each chunk's loss_parallel forward recomputed in the backward: 3 [n, 1] all-reduces
            events += [Comm("all_reduce", AXIS, tp, 4 * n, 3 * calls, phase="backward")
                       for n, calls in _chunks(tokens, chunk_tokens).items()]
    return [ev for ev in events if ev.calls and ev.group_size > 1]


def chunked_loss_phases(cfg, parts: dict, batch: int, seq: int, tp: int, *, dp: int, zero_stage: int,
                        checkpointing: str, elem: int = 2,
                        chunk_tokens: int = CHUNK_TOKENS) -> tuple[dict[str, dict], float, float]:
    """The phases of the 1-D baseline's step (``"tp1d-sp"`` over ``tp`` ranks, or plain FSDP at ``tp`` 1) x FSDP2
    over ``dp`` ranks at ``zero_stage`` on ``batch x seq`` tokens per rank when its loss is chunked
    (:func:`~lightning_tp2d.baselines.context_parallel.chunked_cross_entropy` over chunks of ``chunk_tokens``),
    from ``parts``, that configuration's :func:`~lightning_tp2d.planning.memory_model.baseline_peak_bytes`:
    ``(phases, activations, loss)``, ``phases`` name -> its parts (:func:`cp_peak_bytes` adds the ring's). ``N =
    batch * seq``, ``c = min(chunk_tokens, N)`` tokens a chunk, ``v = ceil(V/tp)`` local vocabulary rows, ``e =
    elem``, ``ep`` the loss input's bytes (``e`` sharded at stage 2 or 3, else 4: autocast):

    * nothing of the loss is saved but the chunks' inputs (views of the final norm's output, already counted), so
      ``activations`` are the unfused step's less its saved ``N v`` log-softmax;
    * ``"loss forward"``: one chunk's forward (and its recomputation in the backward),
      :func:`~lightning_tp2d.planning.memory_model.loss_forward_bytes` per element of ``[c, v]``, beside what is
      gathered then (stage 3: the root's groups but the resharded embedding) and FSDP's last flat all-gather
      output;
    * ``"loss backward"``: the chunk's recomputed float32 log-softmax, its gradient and its input's gradient (``12 c
      v``), then the logits' gradient cast to ``e`` beside the float32 one and the chunk's ``[v, h]`` head gradient
      (``e v h``), with, from the second chunk on, the head gradient accumulated so far (another ``e v h``);
    * ``"block backward"``: :func:`~lightning_tp2d.planning.memory_model.baseline_block_backward_bytes`;
    * ``"end of backward"``: the gradients, what is gathered and the embedding's replicated ``[V, h]`` gradient.

    ``loss``: the largest the loss adds (its forward or backward chunk)."""
    sharded = fsdp_shards(zero_stage, dp)
    ep = elem if sharded else 4
    g = elem if sharded else 4  # FSDP's bf16 parameters' gradients; autocast's float32 ones
    split = parameter_split(cfg)
    tokens, vocab = batch * seq, -(-cfg.vocab_size // tp)
    c = min(chunk_tokens, tokens)
    logsoftmax = loss_input_bytes(ep, False) * tokens * vocab  # what the unfused step's activations save
    activations = parts["activations"] - logsoftmax
    head_grad = elem * vocab * cfg.n_embd  # one chunk's [v, h] head gradient (and the accumulated one)
    accumulated = head_grad if tokens > c else 0
    chunk_forward = loss_forward_bytes(elem, ep, False) * c * vocab
    chunk_backward = accumulated + max(chunk_forward, 12 * c * vocab,
                                       (4 + (elem if elem < 4 else 0)) * c * vocab + head_grad)
    # FSDP's flat all-gather output of the last group gathered, kept until the next all-gather (baseline_peak_bytes'
    # last_gather): what the unfused loss's forward adds beyond its own temporaries
    last_gather = parts["loss_forward"] - (loss_forward_bytes(elem, ep, False)
                                           - loss_input_bytes(ep, False)) * tokens * vocab
    # at stage 3 the blocks were resharded after their forward: the root's groups gathered, not the blocks
    at_loss = (elem * (split.root_shard(tp) - split.embedding / tp) if reshards_after_forward(zero_stage, dp)
               else parts["gathered"])
    in_block = baseline_block_backward_bytes(cfg, batch, seq, tp, dp=dp, zero_stage=zero_stage,
                                             checkpointing=checkpointing, elem=elem)
    end = parts["gradients"] + parts["gathered"] + g * cfg.vocab_size * cfg.n_embd
    resident = {"parameters": parts["parameters"], "optimizer": parts["optimizer"]}
    phases = {"loss forward": {**resident, "activations": activations, "gathered": at_loss,
                               "loss": chunk_forward, "last gather": last_gather},
              "loss backward": {**resident, "activations": activations, "gathered": parts["gathered"],
                                "loss": chunk_backward},
              "block backward (plain FSDP)": {**resident, "activations": activations,
                                              "gathered": parts["gathered"], "block backward": in_block},
              "end of backward": {**resident, "gradients": end}}
    return phases, activations, max(chunk_forward, chunk_backward)


def baseline_row_peak_bytes(cfg, batch: int, seq: int, tp: int, *, dp: int = 1, zero_stage: int = 3,
                            shard_group: int = 0, checkpointing: str = "none", elem: int = 2, loss: str = "unfused",
                            chunk_tokens: int = CHUNK_TOKENS) -> dict:
    """Predicted peak bytes per GPU of a planner row of the 1-D baseline (``"tp1d-sp"`` over ``tp`` ranks, or plain
    FSDP at ``tp`` 1) x ``dp`` replicas, as its users run it:

    * ``zero_stage`` 0, 2, 3: :func:`~lightning_tp2d.planning.memory_model.baseline_peak_bytes` (DDP; FSDP2 with
      gradients / parameters sharded); 1: DDP's step with the AdamW moments sharded over the ``dp`` replicas
      (ZeRO 1: ``ZeroRedundancyOptimizer`` beside DDP), stage 0's peak less ``(1 - 1/dp)`` of the moments;
    * ``shard_group`` (stages 2 and 3; 0 or ``dp``: FSDP over all ``dp`` replicas): HSDP, FSDP over groups of
      ``shard_group`` replicas, each group replicated ``dp / shard_group`` times (torchtitan's
      ``data_parallel_shard_degree`` x ``data_parallel_replicate_degree``): every shard is ``1 / shard_group``, the
      peak FSDP's over ``shard_group`` ranks;
    * ``loss="chunked"``: the head and cross-entropy over chunks of ``chunk_tokens`` (:func:`chunked_loss_phases`),
      ``"unfused"`` the model's head and one cross-entropy over the local ``[N, ceil(V/tp)]`` logits.

    The parts of ``baseline_peak_bytes`` with ``total``, and for the chunked loss ``loss``, ``phases`` and
    ``peak_at``."""
    shard = _shard_group(dp, zero_stage, shard_group)
    if loss not in LOSSES:
        raise ValueError(f"loss={loss!r} is not one of {LOSSES}")
    parts = baseline_peak_bytes(cfg, batch, seq, tp, dp=shard, zero_stage=0 if zero_stage == 1 else zero_stage,
                                checkpointing=checkpointing, elem=elem)
    if zero_stage == 1 and dp > 1:  # the moments sharded over the replicas; parameters and gradients whole
        kept = parts["optimizer"] // dp
        parts = {**parts, "optimizer": kept, "total": parts["total"] - (parts["optimizer"] - kept)}
    if loss == "unfused":
        return parts
    phases, activations, loss_bytes = chunked_loss_phases(cfg, parts, batch, seq, tp, dp=shard,
                                                          zero_stage=zero_stage, checkpointing=checkpointing,
                                                          elem=elem, chunk_tokens=chunk_tokens)
    phases = {name: {k: int(v) for k, v in terms.items()} for name, terms in phases.items()}
    peak_at = max(phases, key=lambda name: sum(phases[name].values()))
    return {**parts, "activations": int(activations), "loss": int(loss_bytes),
            "total": sum(phases[peak_at].values()), "peak_at": peak_at, "phases": phases}


def _shard_group(dp: int, zero_stage: int, shard_group: int) -> int:
    """The replicas FSDP shards over: ``dp`` unless ``shard_group`` (HSDP, stages 2 and 3) names a divisor of it."""
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage must be one of {ZERO_STAGES}, got {zero_stage}")
    if shard_group in (0, dp):
        return dp
    if zero_stage not in FSDP_STAGES:
        raise ValueError(f"shard_group={shard_group} (HSDP) shards FSDP's stages 2 and 3, not zero_stage {zero_stage}")
    if shard_group < 2 or dp % shard_group:
        raise ValueError(f"shard_group={shard_group} must divide dp={dp} and be at least 2 (1: plain replication, "
                         f"zero_stage 0); use one of {[d for d in range(2, dp + 1) if dp % d == 0]}")
    return shard_group


def cp_peak_bytes(cfg, batch: int, seq: int, p: int, *, dp: int = 1, checkpointing: str = "none",
                  elem: int = 2, tp: int = 1, loss: str = "chunked", chunk_tokens: int = CHUNK_TOKENS) -> dict:
    """Predicted peak bytes per GPU of CP over ``p`` x FSDP2 (stage 3) over ``p * dp`` ranks, bf16 compute
    (FSDP ``param_dtype``), float32 parameters, gradients and AdamW moments: the parts of
    :func:`~lightning_tp2d.planning.memory_model.baseline_peak_bytes` for plain FSDP over ``p * dp`` ranks on this
    rank's ``T/p`` tokens (every layer sees ``T/p`` tokens; attention saves its local q, k, v, output and
    log-sum-exp), plus the ring's transients ``ring``: in the forward the gathered K/V (``2 B T n_kv hs e``), the
    local K/V it was gathered from and the merger's float32 output and log-sum-exp; in the backward the gathered
    K/V, the float32 dQ/dK/dV accumulators, one step's ``e``-byte block gradients and two float32 dK/dV permute
    buffers; and the loss's, ``loss``, the largest it adds to what is held:

    * ``loss="chunked"`` (:func:`chunked_cross_entropy`, the default; ``c = min(chunk_tokens, B T/p)`` tokens a
      chunk, ``v = ceil(V/tp)`` local vocabulary rows): nothing of the loss is saved but the chunks' inputs (views of
      the final norm's output, already counted), so the activations are plain FSDP's less its saved
      ``4 (B T/p) v`` log-softmax. One chunk at a time: its forward (and its recomputation in the backward)
      :func:`~lightning_tp2d.planning.memory_model.loss_forward_bytes` per element of ``[c, v]``; its backward the
      recomputed float32 log-softmax, its gradient and its input's gradient (``12 c v``), then the logits' gradient
      cast to ``e`` beside the float32 one and the chunk's ``[v, h]`` head gradient (``e v h``), with, from the
      second chunk on, the head gradient accumulated so far (another ``e v h``).
    * ``loss="unfused"`` (the model's head and ``F.cross_entropy`` on the ``[B T/p, v]`` logits; the earlier
      numbers): the activations hold the ``T/p`` rows' float32 log-softmax, and the loss adds the float32 gradient of
      the ``T/p x v`` logits when the backward starts (what a fused or compiled cross-entropy holds; eager's
      separate ``nll_loss`` gradient would add as much again), before any parameter gradient exists; plain FSDP's
      own peak on ``T/p`` tokens is ``baseline_peak_bytes``'s total.

    ``total``: the largest of the phases in ``phases`` (name -> its parts, name -> bytes): plain FSDP's peak on
    ``T/p`` tokens (unfused: ``baseline_peak_bytes``'s total; chunked: its block backward, the loss's forward and
    backward and the end of the step, with the chunked loss), the ring's forward on top of the activations and
    gathered groups, and the last block's backward (those, the gradients, FSDP's unsharded block gradients in ``e``
    and float32, the ring's backward transients). ``peak_at``: the phase at the peak; ``largest``: the largest part
    there. ``tp`` > 1 (``cp-tp``): the 1-D TP + SP baseline's parts over ``tp`` ranks on the ``T/p`` tokens instead
    of plain FSDP's, and the ring's heads, the loss's vocabulary and the unsharded block ``1 / tp`` of each.
    Analytic; not checked against a GPU."""
    _check_loss(loss, chunk_tokens)
    world = p * dp
    parts = baseline_peak_bytes(cfg, batch, seq // p, tp, dp=world, zero_stage=3, checkpointing=checkpointing,
                                elem=elem)
    tokens, kv, h, heads = batch * seq // p, _kv_width(cfg) // tp, cfg.n_embd // tp, cfg.n_head // tp
    vocab = -(-cfg.vocab_size // tp)
    gathered_kv = 2 * batch * seq * kv * elem
    forward = gathered_kv + 2 * tokens * kv * elem + tokens * (h + heads) * 4
    backward = gathered_kv + tokens * (h + 2 * kv) * (4 + elem) + 2 * 2 * tokens * kv * 4
    ring = {"ring": int(max(forward, backward))}
    resident = {"parameters": parts["parameters"], "optimizer": parts["optimizer"]}
    # the last block's backward: FSDP's unsharded block gradients before their reduce-scatter (bf16 and their float32
    # copy)
    unsharded = (elem + 4) * parameter_split(cfg).block_shard(tp)
    if loss == "unfused":
        loss_bytes = 4 * tokens * vocab
        activations = parts["activations"]
        logsoftmax = loss_input_bytes(elem, False) * tokens * vocab  # saved: among plain FSDP's activations
        rest = parts["total"] - parts["parameters"] - parts["optimizer"] - activations
        plain = {"plain FSDP": {**resident, "activations": activations - logsoftmax, "log-softmax": logsoftmax,
                                "loss, gathered and transients": rest}}
    else:
        plain, activations, loss_bytes = chunked_loss_phases(cfg, parts, batch, seq // p, tp, dp=world, zero_stage=3,
                                                             checkpointing=checkpointing, elem=elem,
                                                             chunk_tokens=chunk_tokens)
    held = {"activations": activations, "gathered": parts["gathered"]}
    phases = {**plain,
              "ring forward": {**resident, **held, "ring": forward},
              "last block backward": {**resident, **held, "gradients": parts["gradients"],
                                      "unsharded block gradients": unsharded, "ring": backward}}
    phases = {name: {k: int(v) for k, v in terms.items()} for name, terms in phases.items()}
    peak_at = max(phases, key=lambda name: sum(phases[name].values()))
    largest = max(phases[peak_at], key=phases[peak_at].get)
    out = {**parts, "activations": int(activations), **ring, "loss": int(loss_bytes),
           "total": sum(phases[peak_at].values()), "peak_at": peak_at, "largest": largest, "phases": phases}
    return out


# ---- DeepSpeed's Ulysses SP + ALST -------------------------------------------------------------------------------------

LOSS_TILE_BYTES = 1 << 30  # ALST: tiles of about 1 GiB of float32 logits


def check_ulysses(cfg, p: int, seq: int) -> None:
    """DeepSpeed's Ulysses rules for ``p`` ranks, raised as a ``ValueError`` naming the numbers (``UlyssesSPAttentionHF``
    would raise them inside the ranks): the sequence splits in ``p`` equal shards, the query heads in ``p`` groups,
    and the key/value heads split in ``p`` or are replicated ``p / nkv`` times (``p`` a multiple of ``nkv``)."""
    if not isinstance(p, int) or p < 1:
        raise ValueError(f"p must be a positive int, got {p!r}")
    if seq % p:
        raise ValueError(f"Ulysses: sequence length {seq} is not divisible by the sequence-parallel size p={p}")
    if cfg.n_head % p:
        raise ValueError(f"Ulysses: the sequence-parallel size p={p} must divide the query head count "
                         f"n_head={cfg.n_head} (each rank attends with n_head/p whole heads over the full sequence)")
    if cfg.n_kv_head % p and p % cfg.n_kv_head:
        raise ValueError(f"Ulysses: key/value heads n_kv_head={cfg.n_kv_head} and p={p}: p must divide n_kv_head, "
                         f"or be a multiple of it (DeepSpeed then replicates each K/V head p/n_kv_head times)")


def local_kv_heads(cfg, p: int) -> int:
    """Key/value heads per rank after the all-to-all (DeepSpeed's ``local_kv_head_count``: 1 when replicated)."""
    return max(1, cfg.n_kv_head // p)


def loss_tiles(tokens: int, vocab: int, tile_bytes: int = LOSS_TILE_BYTES) -> int:
    """ALST's tile count for the fused head + loss: float32 logits of ``tokens x vocab`` in tiles of at most
    ``tile_bytes``."""
    return max(1, min(tokens, math.ceil(tokens * vocab * 4 / tile_bytes)))


def _param_counts(cfg) -> tuple[int, int]:
    """(root, one block) parameter counts: embedding (+ untied head) and final norm; one decoder layer."""
    h, hs, i = cfg.n_embd, cfg.head_size, cfg.intermediate_size
    block = h * cfg.n_head * hs * 2 + 2 * h * cfg.n_kv_head * hs + 3 * h * i + 2 * h
    root = cfg.vocab_size * h * (1 if cfg.tie_embeddings else 2) + h
    return root, block


def ulysses_peak_bytes(cfg, batch: int, seq: int, p: int, *, dp: int = 1, checkpointing: str = "full",
                       offload: bool = False, elem: int = 2, loss_tile_bytes: int = LOSS_TILE_BYTES) -> dict:
    """Per-rank peak bytes of one training step of Ulysses + ALST (this module's schedule) on ``p`` SP ranks x
    ``dp`` replicas, ZeRO-3 over all ``p * dp`` ranks; ``elem`` the compute dtype's bytes (4: float32 as measured
    on CPU, 2: bf16 with float32 master weights and Adam state). Named parts:

    * ``states``: 16 bytes per parameter / ranks (``elem=2``: bf16 gathers of fp32 master, fp32 grads, Adam m, v;
      ``elem=4``: fp32 params, grads, m, v) -- FSDP's even shards;
    * ``gathered_root``: the root's gathered embedding and head (FSDP2 keeps the root unsharded from forward to
      backward) and ``root_grads``: their unsharded gradients (the head's computed inside the tiled loss's forward,
      alive until the root's reduce-scatter at the end of backward);
    * ``gathered_blocks``: two gathered decoder layers (the one computing and FSDP's prefetch of the next) plus one
      layer's unsharded gradients;
    * ``checkpoints``: the block inputs ``n_layer x B x T/p x h`` (with ``offload``: two blocks, the rest on host);
    * ``block``: the working set of one layer's recompute + backward: what the recompute keeps (the norms' inputs
      and outputs, SDPA's q ``[T, nh/p, hs]`` and k, v ``[T, nkv/p, hs]`` -- full sequence, head-sharded -- its
      output, o_proj's input), plus the larger of the attention backward (dq, dk, dv, d_out and their all-to-alls)
      and the MLP backward (``mlp_tile`` and TiledMLP's two ``[T/p, h]`` gradients);
    * ``mlp_tile``: one TiledMLP tile (gate, up, their product and gradients over ``ceil(T/p / h)``-th of the
      tokens; inside ``block``);
    * ``loss_tile``: one tile of float32 logits with their softmax and gradient.

    ``peak`` is the sum of the first five and the larger of ``block`` (backward) and ``loss_tile`` (end of forward); ``largest`` names the largest single tensor and its bytes."""
    if checkpointing != "full":
        raise ValueError(f"ulysses_peak_bytes models ALST's schedule, checkpointing='full' (got {checkpointing!r})")
    check_ulysses(cfg, p, seq)
    ranks = p * dp
    root, block = _param_counts(cfg)
    h, hs, L = cfg.n_embd, cfg.head_size, cfg.n_layer
    nh_l, nkv_l = cfg.n_head // p, local_kv_heads(cfg, p)
    t_l, T = batch * seq // p, batch * seq  # tokens per rank; full-sequence rows after the all-to-all
    grad_elem = 4  # gradients and states in float32
    head_rows = cfg.vocab_size * h
    parts = {
        "states": 16 * (root + L * block) // ranks,
        "gathered_root": elem * root,
        "root_grads": grad_elem * head_rows * (1 if cfg.tie_embeddings else 2),
        "gathered_blocks": 2 * elem * block + grad_elem * block,
        "checkpoints": elem * t_l * h * (min(2, L) if offload else L),
    }
    a = t_l * h  # one [T/p, h] tensor; q after the all-to-all, [T, nh/p, hs], has as many elements
    kv = T * nkv_l * hs  # k or v after the all-to-all (full sequence, K/V heads split or replicated)
    # the layer's recompute keeps: the two norms' inputs and outputs (4a), SDPA's q, k, v and output (2a + 2kv),
    # o_proj's input (a); the attention backward adds dq, dk, dv, d_out and their all-to-all results (4a + 4kv)
    saved, attn_backward = 7 * a + 2 * kv, 4 * a + 4 * kv
    mlp_tile_tokens = math.ceil(t_l / max(1, math.ceil((seq // p) / h)))
    # gate, up, silu, product and their gradients over one tile, plus TiledMLP's x_grad and incoming grad (2a)
    mlp_backward = mlp_tile_tokens * cfg.intermediate_size * 6 + 2 * a
    parts["block"] = elem * (saved + max(attn_backward, mlp_backward))
    parts["mlp_tile"] = elem * mlp_tile_tokens * cfg.intermediate_size * 6
    tiles = loss_tiles(t_l, cfg.vocab_size, loss_tile_bytes)
    tile_tokens = math.ceil(t_l / tiles)
    parts["loss_tile"] = 4 * tile_tokens * cfg.vocab_size * 3 + elem * t_l * h * 2  # logits, softmax, grad; x, dx
    # the loss tile lives in forward, before the blocks' backward: the larger of the two phases
    activation = parts["checkpoints"] + max(parts["block"], parts["loss_tile"])
    peak = (parts["states"] + parts["gathered_root"] + parts["root_grads"] + parts["gathered_blocks"]
            + activation)
    tensors = {
        "embedding or head (gathered)": elem * head_rows,
        "head gradient (unsharded)": grad_elem * head_rows,
        "q after all-to-all [T, nh/p, hs]": elem * T * nh_l * hs,
        "logits tile [T/p/tiles, V] float32": 4 * tile_tokens * cfg.vocab_size,
        "MLP tile [tile, I]": elem * mlp_tile_tokens * cfg.intermediate_size,
        "checkpointed block input [T/p, h]": elem * t_l * h,
    }
    name = max(tensors, key=tensors.get)
    return {"parts": parts, "peak": peak, "largest": name, "largest_bytes": tensors[name], "loss_tiles": tiles}
