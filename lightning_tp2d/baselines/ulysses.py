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
  no-op, so it is not run here (:func:`~lightning_tp2d.planning.rivals.ulysses_peak_bytes` prices it with ``offload=True``).
* Weights: torch's FSDP2 ``fully_shard`` (each decoder layer, then the root: embedding, final norm, head) over the
  same ``p`` ranks, resharding after forward -- ZeRO-3 as ALST runs DeepSpeed's, and the same FSDP the ``cp``
  rival uses (:mod:`~lightning_tp2d.baselines.context_parallel`). FSDP averages gradients, so each rank's loss is its
  share times ``p`` (:func:`sequence_loss`); :func:`mean_loss` is the global mean.

The weights are the package's :class:`~lightning_tp2d.models.Llama`'s (its state-dict keys *are* transformers'), so
the loss and gradients equal the plain single-device model's (``tests/test_ulysses.py``: float32, 2 and 4 ranks).

**Where it does not run.** Nothing here is CUDA-only on CPU: ``deepspeed.comm.init_distributed`` picks DeepSpeed's
CPU accelerator and JIT-builds its small ``deepspeed_shm_comm`` C++ op on first use (about a minute with g++, then
cached in ``~/.cache/torch_extensions``); ``all_to_all_single`` runs on gloo. Everything else (FlashAttention,
Liger kernels) is optional in ALST and not used.

**Memory.** :func:`~lightning_tp2d.planning.rivals.ulysses_peak_bytes` is the analytic per-rank peak for the planner (named parts and the largest
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

from lightning_tp2d.planning.rivals import LOSS_TILE_BYTES, check_ulysses, loss_tiles
from lightning_tp2d.models import Llama
from lightning_tp2d.models.llama import HF_FORMAT

IGNORE_INDEX = -100
DEEPSPEED_PIN = "deepspeed==0.19.8"


def deepspeed_problem() -> str | None:
    """Why DeepSpeed's Ulysses pieces cannot be imported here (``None`` when they can)."""
    try:
        from deepspeed.runtime.sequence_parallel import ulysses_sp  # noqa: F401 - optional (the "bench" extra)
        import transformers  # noqa: F401
    except ImportError as e:
        return f"the 'ulysses' baseline runs DeepSpeed's own code: pip install {DEEPSPEED_PIN} ({e})"
    return None


def hf_llama(model: Llama):
    """transformers' ``LlamaForCausalLM`` (SDPA attention) with ``model``'s config and weights."""
    from transformers import LlamaConfig as HFLlamaConfig, LlamaForCausalLM  # deferred: optional dependency

    cfg = model.config
    # (the special-token ids are set below: a rival's model never generates)
    raw = {k: v for k, v in HF_FORMAT.write_config(cfg).items()
           if k not in ("torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id")}
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


