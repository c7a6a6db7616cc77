"""Ulysses sequence parallelism with ALST's tiling (Arctic Long Sequence Training, arXiv 2506.13996) as a
long-context baseline, run with DeepSpeed's own code on CPU gloo ranks.

**What runs.** DeepSpeed's (``deepspeed==0.19.8``, the optional extra ``bench``) ALST pieces from
``deepspeed.runtime.sequence_parallel.ulysses_sp``, unpatched, on transformers' ``LlamaForCausalLM``:

* ``UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", p, batch, seq_length=T,
  seq_length_is_variable=False)``: DeepSpeed builds its sequence-parallel groups (``parallel_state_sp``, over
  ``deepspeed.comm`` initialised with ``init_distributed(dist_backend="gloo")``) and puts its wrapper in place of
  transformers' ``"sdpa"`` attention function. Each rank holds ``T/p`` tokens of every activation; inside each
  attention DeepSpeed all-to-alls q, k, v (``all_to_all_single``) from sequence-sharded ``[T/p, nh, hs]`` to
  head-sharded ``[T, nh/p, hs]``, runs SDPA (causal, over the all-gathered position ids) and all-to-alls the output
  back. Its rule for heads: ``nh % p == 0``, and ``nkv % p == 0`` or ``p % nkv == 0`` -- when ``p`` is a multiple of
  the key/value heads, DeepSpeed *replicates* each K/V head ``p / nkv`` times (``kv_replication_factor``), so
  ``p`` is capped by the query heads, not the K/V heads. :func:`check_ulysses` raises the same rule as a
  ``ValueError`` naming the numbers before any process starts.
* ``TiledMLP`` on every decoder layer's SwiGLU (instance ``forward`` replaced as DeepSpeed's docstring and ALST do
  for ``LlamaMLP``): ``ceil(T/p / h)`` sequence tiles, no graph kept, recomputed tile by tile in backward.
* ``TiledFusedLogitsLoss`` for the head and cross-entropy: tiles of at most ``LOSS_TILE_BYTES`` float32 logits;
  DeepSpeed runs each tile's backward inside the forward, so no ``[T/p, V]`` tensor lives past one tile. The
  per-tile loss is the *summed* cross-entropy times ``p / n`` (``n`` counted targets in the whole sequence): the
  gradients reach ``lm_head`` inside the forward, so the scale has to be inside the tile function.
* Activation checkpointing of every decoder layer (transformers' ``gradient_checkpointing_enable``, non-reentrant),
  always: ALST's recipe. ALST also offloads the checkpointed block inputs to host memory; on a CPU host that is a
  no-op, so it is not run here (:func:`ulysses_peak_bytes` prices it with ``offload=True``).
* Weights: torch's FSDP2 ``fully_shard`` (each decoder layer, then the root: embedding, final norm, head) over the
  same ``p`` ranks, resharding after forward -- ZeRO-3 as ALST runs DeepSpeed's, and the same FSDP the ``cp``
  rival uses (:mod:`~lightning_tp2d.bench.context_parallel`). FSDP averages gradients, so each rank's loss is its
  share times ``p`` (:func:`sequence_loss`); :func:`mean_loss` is the global mean.

The weights are the package's :class:`~lightning_tp2d.models.Llama`'s (its state-dict keys *are* transformers'), so
the loss and gradients equal the plain single-device model's (``tests/test_ulysses.py``: float32, 2 and 4 ranks).

**Where it does not run.** Nothing here is CUDA-only on CPU: ``deepspeed.comm.init_distributed`` picks DeepSpeed's
CPU accelerator and JIT-builds its small ``deepspeed_shm_comm`` C++ op on first use (about a minute with g++, then
cached in ``~/.cache/torch_extensions``); ``all_to_all_single`` runs on gloo. Everything else (FlashAttention,
Liger kernels) is optional in ALST and not used.

**Memory.** :func:`ulysses_peak_bytes` is the analytic per-rank peak for the planner (named parts and the largest
tensor), checked against the measured CPU peak in the tests.
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_tp2d.models import Llama
from lightning_tp2d.models.llama import HF_FORMAT

IGNORE_INDEX = -100
LOSS_TILE_BYTES = 1 << 30  # ALST: tiles of about 1 GiB of float32 logits
DEEPSPEED_PIN = "deepspeed==0.19.8"


def deepspeed_problem() -> str | None:
    """Why DeepSpeed's Ulysses pieces cannot be imported here (``None`` when they can)."""
    try:
        from deepspeed.runtime.sequence_parallel import ulysses_sp  # noqa: F401 - optional (the "bench" extra)
        import transformers  # noqa: F401
    except ImportError as e:
        return f"the 'ulysses' baseline runs DeepSpeed's own code: pip install {DEEPSPEED_PIN} ({e})"
    return None


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


def hf_llama(model: Llama):
    """transformers' ``LlamaForCausalLM`` (SDPA attention) with ``model``'s config and weights."""
    from transformers import LlamaConfig as HFLlamaConfig, LlamaForCausalLM  # deferred: optional dependency

    cfg = model.config
    raw = {k: v for k, v in HF_FORMAT.write_config(cfg).items() if k not in ("torch_dtype",)}
    hf = LlamaForCausalLM(HFLlamaConfig(**raw, attn_implementation="sdpa", bos_token_id=None, eos_token_id=None,
                                        pad_token_id=None, use_cache=False))
    hf.load_state_dict(model.hf_state_dict(), strict=True)
    return hf


def _mlp_tiles(x: torch.Tensor) -> int:
    return max(1, math.ceil(x.shape[-2] / x.shape[-1]))  # DeepSpeed's / ALST's ceil(seqlen / hidden)


def _mlp_forward(self, x):
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _tiled_mlp_forward(self, x):
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP  # deferred: optional dependency

    # every rank has T/p tokens, so the tile count agrees without DeepSpeed's example's all-reduce
    return TiledMLP.apply(_mlp_forward, self, x, _mlp_tiles(x),
                          [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight])


def loss_tiles(tokens: int, vocab: int, tile_bytes: int = LOSS_TILE_BYTES) -> int:
    """ALST's tile count for the fused head + loss: float32 logits of ``tokens x vocab`` in tiles of at most
    ``tile_bytes``."""
    return max(1, min(tokens, math.ceil(tokens * vocab * 4 / tile_bytes)))


class UlyssesLM(nn.Module):
    """The root FSDP module: transformers' ``LlamaModel`` on this rank's ``T/p`` tokens, then DeepSpeed's
    ``TiledFusedLogitsLoss`` over the head. ``forward(idx, targets, positions, scale)`` returns the tiles' summed
    cross-entropy times ``scale``."""

    def __init__(self, hf, loss_tile_bytes: int = LOSS_TILE_BYTES):
        super().__init__()
        self.hf = hf
        self.loss_tile_bytes = loss_tile_bytes

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor,
                scale: float) -> torch.Tensor:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss  # deferred: optional

        if not getattr(self, "registered", False):  # else each rank would attend within its own T/p tokens only
            raise RuntimeError("DeepSpeed's Ulysses attention is not registered: run inside ulysses_attention(...)")
        hidden = self.hf.model(input_ids=idx, position_ids=positions, use_cache=False).last_hidden_state
        head = self.hf.lm_head
        vocab = head.weight.shape[0]

        def tile_loss(_, x, y):
            logits = head(x)
            if logits.dtype != torch.float32:
                logits = logits.float()
            return F.cross_entropy(logits.view(-1, vocab), y.reshape(-1), ignore_index=IGNORE_INDEX,
                                   reduction="sum") * scale

        tiles = loss_tiles(idx.numel(), vocab, self.loss_tile_bytes)
        return TiledFusedLogitsLoss.apply(tile_loss, self, hidden, targets, None, tiles, [head.weight], "sum")


def build_ulysses(model: Llama, p: int, batch: int, seq: int, *, loss_tile_bytes: int = LOSS_TILE_BYTES,
                  mesh=None) -> UlyssesLM:
    """``model``'s weights in transformers' Llama, TiledMLP and checkpointing on every layer, FSDP2 over ``p``
    ranks (the whole world). Register the attention with :func:`ulysses_attention` before the first forward."""
    check_ulysses(model.config, p, seq)
    if dist.get_world_size() != p:
        raise ValueError(f"Ulysses runs over the whole world here: world size {dist.get_world_size()} != p={p}")
    hf = hf_llama(model)
    hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    hf.train()
    for layer in hf.model.layers:
        layer.mlp.forward = types.MethodType(_tiled_mlp_forward, layer.mlp)
    lm = UlyssesLM(hf, loss_tile_bytes)
    mesh = init_device_mesh("cpu", (p,)) if mesh is None else mesh
    for layer in hf.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(lm, mesh=mesh, reshard_after_forward=True)
    lm.fsdp_mesh = mesh
    return lm


@contextlib.contextmanager
def ulysses_attention(lm: UlyssesLM, p: int, batch: int, seq: int) -> Iterator[dist.ProcessGroup]:
    """DeepSpeed's ``register_with_transformers`` for ``lm`` (its SP groups over the world, its wrapper in place
    of transformers' ``"sdpa"``), yielding the SP group; on exit transformers' function is put back and DeepSpeed's
    group globals released, so a process may register again (tests). :class:`UlyssesLM` refuses to run outside
    it. Entered by hand (``__enter__``), keep a reference to the context: a collected one runs its exit."""
    import deepspeed.comm as ds_comm  # deferred: optional (the "bench" extra)
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ds_comm.init_distributed(dist_backend="gloo")  # wraps the existing torch process group
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    try:
        mpu = UlyssesSPAttentionHF.register_with_transformers(lm.hf, "sdpa", sequence_parallel_size=p,
                                                               micro_batch_size=batch, seq_length=seq,
                                                               seq_length_is_variable=False)
        lm.registered = True
        yield mpu.get_sequence_parallel_group()
    finally:
        lm.registered = False
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
        parallel_state_sp._release_sequence_parallel_groups()


def shard(t: torch.Tensor, rank: int, p: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous ``T/p`` slice of the sequence dim 1 (Ulysses' split; no load balancing needed:
    every rank attends over the whole sequence for its heads)."""
    n = t.size(1) // p
    return t[:, rank * n:(rank + 1) * n].contiguous()


def sequence_loss(lm: UlyssesLM, idx: torch.Tensor, targets: torch.Tensor, rank: int, p: int) -> torch.Tensor:
    """This rank's summed cross-entropy over its ``T/p`` tokens times ``p / n`` (``n`` the counted targets of the
    full ``idx``/``targets`` ``(B, T)``, the same on every rank): the mean over ranks is the global mean loss, and
    FSDP's averaged gradients are its gradients."""
    counted = int((targets != IGNORE_INDEX).sum())
    positions = torch.arange(idx.size(1), device=idx.device).expand(idx.size(0), -1)
    return lm(shard(idx, rank, p), shard(targets, rank, p), shard(positions, rank, p), p / max(counted, 1))


def mean_loss(loss: torch.Tensor, p: int) -> torch.Tensor:
    """The global mean loss from each rank's :func:`sequence_loss` (one 4-byte all-reduce)."""
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    return loss / p


def group_sizes(sp_group: dist.ProcessGroup, mesh) -> dict[str, int]:
    """Group name -> size, for pricing calls by their group (:class:`~.context_parallel.SentBytes`)."""
    out = {dist.group.WORLD.group_name: dist.get_world_size()}
    out[sp_group.group_name] = dist.get_world_size(sp_group)
    out[mesh.get_group().group_name] = mesh.size()
    return out


# ---- analytic memory ---------------------------------------------------------------------------------------------


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
