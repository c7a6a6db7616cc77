"""The grid layouts' closed-form peak memory at ZeRO stages 2 and 3 (FSDP2, ``dp > 1``): the data-parallel shards
one grid rank holds and the moments of its step, for :func:`lightning_tp2d.planning.closed_memory_grid.grid_peak_bytes`
(whose docstring states the terms; :mod:`lightning_tp2d.planning.closed_memory`'s ``_fsdp_moments`` is the ring's).
"""

from __future__ import annotations

import dataclasses

import torch

from lightning_tp2d.families import family_of, family_of_config

__all__ = ["GridDataShards", "fsdp_moments", "grid_data_shards"]


@dataclasses.dataclass(frozen=True)
class GridDataShards:
    """Element counts of one grid rank's FSDP groups over ``dp`` replicas, as data-parallel rank 0 holds them
    (:func:`lightning_tp2d.fsdp.shard_data_parallel`): each parameter's local ``[rows, cols]`` tensor shard cut into
    ``ceil(rows / dp)`` rows; GPT-2's ``c_attn`` weight, whose rows a tensor axis splits strided, into ``cols / dp``
    columns (kept whole when ``dp`` does not divide them), its bias kept whole (FSDP's ``ignored_params``, float32,
    averaged by a hook). ``padded``: ``dp`` x the cut, what a group's all-gather and reduce-scatter move."""

    block: int  # a block's elements at rest on this rank (the cuts and what is kept whole)
    block_padded: int  # a block's gathered elements
    block_whole: int  # a block's elements kept whole (not gathered, not cast)
    root: int
    root_padded: int
    largest: int  # elements of the largest parameter at rest


_DATA_SHARDS: dict[tuple, GridDataShards] = {}


def one_block_model(cfg, q: int) -> tuple:
    """The plain model of ``cfg`` with one block, built on the meta device; that block; the ids of its parameters;
    and ``rows(i)``: the vocabulary rows grid row (or column) ``i`` holds of a ``[V, ...]`` table (DTensor's
    ``Shard``: ceil chunks, the last short or empty)."""
    with torch.device("meta"):
        model = family_of_config(cfg).model_class(dataclasses.replace(cfg, n_layer=1))
    block = next(iter(family_of(model).block_modules(model)))
    V = cfg.vocab_size
    chunk = -(-V // q)

    def rows(i: int) -> int:
        return max(0, min(chunk, V - i * chunk))

    return model, block, {id(t) for t in block.parameters()}, rows


def grid_data_shards(cfg, q: int, dp: int, rank: int) -> GridDataShards:
    """:class:`GridDataShards` of grid rank ``rank`` (``(r, c) = divmod(rank, q)``) on a grid of side ``q`` over
    ``dp`` replicas, read from the plain model built with one block on the meta device; cached."""
    key = (repr(dataclasses.replace(cfg, n_layer=1)), q, dp, rank)  # (a config may hold a dict: rope_scaling)
    if key in _DATA_SHARDS:
        return _DATA_SHARDS[key]
    model, block, in_block, rows = one_block_model(cfg, q)
    V, hq = cfg.vocab_size, cfg.n_embd // q
    r, c = divmod(rank, q)
    head = model.lm_head.weight
    tied = any(m.weight is head for m in model.modules() if isinstance(m, torch.nn.Embedding))

    counts = {True: [0, 0, 0], False: [0, 0, 0]}  # in a block: held, padded, whole
    largest = 0
    for name, t in model.named_parameters():
        mine = id(t) in in_block
        if t.ndim == 1:
            local = (t.numel() // q,)  # split over col
        elif not mine and t.shape[0] == V:  # the untied head W[V_c, h_r]; the token table W[V_r, h_c]
            local = (rows(c) if t is head and not tied else rows(r), hq)
        elif not mine:  # GPT-2's position table [block_size, h/q]
            local = (t.shape[0], hq)
        else:
            local = (t.shape[0] // q, t.shape[1] // q)
        strided = mine and name.endswith(("c_attn.weight", "c_attn.bias"))  # [q_c | k_c | v_c] rows
        size = local[0] * (local[1] if len(local) == 2 else 1)
        if strided and (len(local) == 1 or local[1] % dp):  # no dim FSDP can cut: kept whole
            held, padded, whole = size, 0, size
        elif strided:  # cut along dim 1, evenly
            held, padded, whole = size // dp, size, 0
        else:
            held = -(-local[0] // dp) * (size // local[0] if local[0] else 0)
            padded, whole = dp * held, 0
        counts[mine][0] += held
        counts[mine][1] += padded
        counts[mine][2] += whole
        largest = max(largest, held)
    _DATA_SHARDS[key] = GridDataShards(*counts[True], counts[False][0], counts[False][1], largest)
    return _DATA_SHARDS[key]


def fsdp_moments(v: dict) -> dict:
    """The phases' candidate moments at stages 2 and 3 (FSDP2, ``dp > 1``), from the names of
    :func:`~lightning_tp2d.planning.closed_memory_grid.grid_peak_bytes` (``v``: its locals; ``gr``, ``gb`` a
    root's and a block's gathered bf16 group, padded; ``sb`` a block's float32 gradient shard):

    * the forward: the loss's backward, or the head's, beside the saved tensors, the root's group and every block's
      (stage 3: the last block's all-gather output, which FSDP2 keeps until the next all-gather); the last block's
      all-gather, its output and the previous one's beside the blocks unsharded; ``"full"``: the last block's
      forward at its MLP's down projection beside its all-gather output;
    * block ``i``'s backward: its MLP's (``"2d-metp"``: or its ring attention's; ``"full"``: or its recomputed
      forward) as at stage 0 without weight copies (``"selective"``: each norm's one output and the MLP's activation
      output are recipes, the latter rebuilt there), beside the saved tensors of the blocks before it, the root's
      group and (stage 2) blocks ``0..i`` (stage 3: block ``i`` and the prefetched ``i - 1``'s all-gather output),
      the finished blocks' shards, the head's bf16 gradients and the previous block's float32 reduce-scatter input
      (held until the next reduce-scatter); its reduce-scatter after it is resharded: the padded float32 input and
      the shard;
    * the end of the backward: the root's reduce-scatter after it is resharded (the float32 padded input and the
      shard) beside every block's shard and the token embedding's bf16 gradient; after the backward: the shards and
      clipping's square of the largest."""
    L, stage, e, N, hq, Vb = v["L"], v["zero_stage"], v["e"], v["N"], v["hq"], v["Vb"]
    z, d, llama, ring, ck = v["z"], v["d"], v["llama"], v["ring"], v["checkpointing"]
    gr, gb, sb = e * d.root_padded, e * d.block_padded, 4 * d.block
    # saved without autocast's copies: the block's matrices are bf16 already, Llama's norms return bf16 (one saved
    # output each instead of a cast per linear); the head's block is the gathered weight itself where no padding
    # copies it (untied: rows(c) = Vb) and no mirror rank sends it (tied: the grid's diagonal, rows(r) = Vb)
    A = v["A"] - e * z.block_matrices - (3 * N * hq * e if llama else 0)
    r, c = divmod(v["rank"], v["q"])
    full_rows = [v["cfg"].vocab_size - i * Vb >= Vb for i in (r, c)]  # the vocabulary blocks of row r, col c
    whole_block = r == c and full_rows[0] if v["tied"] else full_rows[1]
    R = v["R"] - (e * Vb * hq if whole_block else 0)
    # "selective": each norm's one output and the MLP's activation output are recipes (a tied head's mirrored block
    # too, where a mirror rank sends it), the MLP's rebuilt in its down projection's backward
    selective = ck == "selective"
    recipes = 2 * N * hq * e + v["rebuilt_mlp"] if selective else 0
    saved_root = R - (N * hq * e + (e * Vb * hq if v["tied"] and not whole_block else 0) if selective else 0)
    kept = {"none": A, "selective": A - recipes, "full": v["block_input"]}[ck]
    current = A - recipes + v["rebuilt_mlp"]  # the block whose MLP's backward runs
    # the ring attention's backward keeps the block's tensors less its second norm's and MLP's (Llama: one norm
    # output, not two casts); the recomputed forward holds no copy of the down projection's weight, and Llama's
    # norm outputs are the bf16 ones saved
    attention_kept = (v["attention_kept"] - e * (z.block_matrices - z.late)
                      - (2 * N * hq * e if llama and not selective else 0))
    forward_block = v["forward_block"] - e * hq * v["fq"] - (8 * N * hq if llama else 0)
    norm_outputs = 2 * N * hq * e if llama else 0  # Llama's two bf16 norm outputs, live in the forward
    left = v["left"]
    forward = [{"saved activations": L * kept + saved_root, "loss backward": v["loss_backward"],
                "gathered": gr + (L if stage == 2 else 1) * gb},
               {"saved activations": L * kept + R - 4 * N * Vb - 10 * N + v["loss_scalars"],
                "head backward": v["head_backward"], "gathered": gr + (L if stage == 2 else 1) * gb}]
    if ck == "full":  # the last block's forward, at its MLP's down projection
        forward.append({"saved activations": L * kept + left - v["loss_scalars"],
                        "block forward": forward_block + norm_outputs,
                        "gathered": gr + (L if stage == 2 else 1) * gb, "all-gather": gb})
    if L >= 2:  # the last block's all-gather: its output and the one before (FSDP2 keeps each until the next), the
        # blocks unsharded (stage 3: this one), beside the saved tensors of the blocks before and the hidden state
        forward.append({"saved activations": (L - 1) * kept + left - v["loss_scalars"] + v["block_input"],
                        "gathered": gr + (L if stage == 2 else 1) * gb, "all-gather": 2 * gb})

    def gathered(i: int) -> int:
        return gr + ((i + 1) * gb if stage == 2 else gb + (gb if i > 0 else 0))

    def in_block(i: int) -> list[dict]:
        done = (L - 1 - i) * sb + v["head_grads"] // 2
        base = {"saved activations": i * kept + left, "gradients": done, "gathered": gathered(i),
                "held reduce-scatter input": 4 * d.block_padded if i < L - 1 else 0}
        # its reduce-scatter, after it is resharded: the float32 padded input (the one held before is freed first)
        # and the shard; gathered the root and the next block's all-gather output (stage 3) or the blocks before
        # (stage 2)
        out = [dict(base, **{"saved activations": i * kept + left + current,  # (GPT-2's bias gradient in bf16)
                             "MLP backward": v["mlp_backward"] - (0 if llama else 2 * hq)}),
               dict(base, **{"gathered": gr + (i * gb if stage == 2 else gb if i > 0 else 0),
                             "held reduce-scatter input": 0, "reduce-scatter": 4 * d.block_padded + sb})]
        if ring:  # the ring attention's backward: the gradients of the block's later half in bf16
            out.append(dict(base, **{"saved activations": i * kept + left + attention_kept,
                                     "gradients": done + v["attention_grads"] // 2,
                                     "attention backward": v["attention_backward"]}))
        if ck == "full":  # the block's forward run again, at its MLP's down projection (no weight copies)
            out.append(dict(base, **{"saved activations": (i + 1) * kept + left + A - v["mlp_live"] - N * hq * e,
                                     "recomputed forward": forward_block}))
        return out

    # the root's reduce-scatter, after it is resharded: the padded float32 input and the shard, beside the token
    # embedding's bf16 gradient (the last made)
    token_rows = max(0, min(Vb, v["cfg"].vocab_size - r * Vb))
    ending = [{"gradients": L * sb + v["loss_scalars"], "reduce-scatter": 4 * d.root_padded + 4 * d.root,
               "embedding gradient": e * token_rows * hq}]
    after = [{"gradients": v["P"], "clipping": 4 * d.largest + v["clip_scalars"]}]
    moments = {"forward": forward, "last block": in_block(L - 1), "block 0": in_block(0) + ending,
               "after backward": after}
    if L >= 3:
        moments["block before last"] = in_block(L - 2)
    return moments
