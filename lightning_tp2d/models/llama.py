"""Llama on one device (Llama 2 / Llama 3 family), with transformers' ``LlamaForCausalLM`` parameter names.

Like :mod:`lightning_tp2d.models.gpt2`, the model knows nothing about parallelism: parallel plans swap its
submodules by name, so the names below and the generic :meth:`Llama.forward` are a contract.

Names: ``state_dict()`` keys *are* transformers' ``LlamaForCausalLM`` keys (same order too), so the HF conversion
is the identity apart from ignored RoPE buffers and the optional tied ``lm_head.weight`` (:data:`HF_FORMAT`)::

    model.embed_tokens                            nn.Embedding   weight [V, h]
    model.layers.{i}.self_attn.q_proj             nn.Linear      weight [nh*hs, h]   (no biases anywhere)
    model.layers.{i}.self_attn.k_proj / v_proj    nn.Linear      weight [nkv*hs, h]
    model.layers.{i}.self_attn.o_proj             nn.Linear      weight [h, nh*hs]
    model.layers.{i}.mlp.gate_proj / up_proj      nn.Linear      weight [I, h]
    model.layers.{i}.mlp.down_proj                nn.Linear      weight [h, I]
    model.layers.{i}.input_layernorm              RMSNorm        weight [h]
    model.layers.{i}.post_attention_layernorm     RMSNorm        weight [h]
    model.norm                                    RMSNorm        weight [h]
    lm_head                                       LMHead         weight [V, h]; the embed_tokens Parameter if tied

Shapes: B batch, T sequence length, h = n_embd, nh = n_head, nkv = n_kv_head, hs = h // nh, g = nh // nkv (query
heads per key/value head, GQA), I = intermediate_size, V = vocab_size. Block:
``x = x + o_proj(attn(rope(q), rope(k), v))`` on ``input_layernorm(x)``, then
``x = x + down_proj(silu(gate_proj(y)) * up_proj(y))`` with ``y = post_attention_layernorm(x)``. Query head ``j``
reads key/value head ``j // g`` (transformers' ``repeat_kv`` / SDPA ``enable_gqa`` grouping).

RoPE is the "rotate half" form of transformers (feature ``i`` pairs with ``i + hs/2`` inside each head; HF
checkpoints are already permuted for it), in :mod:`lightning_tp2d.models.rope`: no parameters or buffers;
:func:`rope_cache` computes cos/sin (float32, like transformers) for ``T`` or for any tensor of absolute positions
from the config's :attr:`LlamaConfig.rope` (base ``rope_theta``, and ``rope_scaling``: none, or Llama 3.1 / 3.2's
``"llama3"`` frequency scaling), and :func:`apply_rope` applies them, optionally gathering rows by a position
tensor. Having no position table, the model runs sequences of any length: ``block_size`` (transformers'
``max_position_embeddings``) is the context the model is made for, not a limit. The named ``llama-3.*`` configs have
those models' shapes, scaling and 131072-token context.

What the parallel plans need (the GPT-2 plans carry over role by role):

* Attention splits by heads: ``q_proj`` rows by query head, ``k_proj`` / ``v_proj`` rows by key/value head,
  ``o_proj`` columns by query head; a rank holding query heads ``[r*nh/q, (r+1)*nh/q)`` must hold key/value heads
  ``[r*nkv/q, (r+1)*nkv/q)`` (contiguous grouping), so head-split layouts need ``n_kv_head % q == 0`` as well as
  ``n_head % q == 0``. Heads are never split inside: RoPE pairs features ``i`` and ``i + hs/2``. Separate q/k/v
  matrices mean plain ``Shard(0)`` placements (no ``_StridedShard`` as for GPT-2's fused ``c_attn``).
  :meth:`LlamaAttention.forward` uses ``-1`` for head counts, so it runs unchanged on row-sharded local weights.
* MLP: ``gate_proj`` and ``up_proj`` like GPT-2's ``c_fc`` (split the same way, so ``silu(gate) * up`` is local),
  ``down_proj`` like ``mlp.c_proj``; ``intermediate_size % q == 0``.
* RMSNorm has a weight only; over a hidden dimension sharded on a grid the mean of squares needs a sum over the
  shards (an all-reduce of ``x.pow(2).sum(-1)``, then divide by the full ``h``); :func:`rms_norm` is the local
  formula.
* Ring / zigzag layouts: pass each chunk's absolute positions, ``rope_cache(positions, ...)`` or
  ``apply_rope(x, cos, sin, positions)`` with a full-length cache; both equal slicing the full sequence's result.
* ``lm_head`` is the shared :class:`~lightning_tp2d.models.gpt2.LMHead` (logits or loss); untied models own its
  weight, so a vocab-parallel head must shard ``lm_head.weight`` itself instead of reusing the embedding's shard.
* Materialising a meta model: call :meth:`Llama.init_module_` in ``named_modules()`` order (embed_tokens, then per
  layer self_attn, mlp, the two norms, then norm, lm_head); only Linear / Embedding / untied LMHead draw numbers.
"""

from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_tp2d.models.config import NamedSizes, check_divides, check_dropout, check_positive_ints, check_token_ids
from lightning_tp2d.models.documents import Documents
from lightning_tp2d.models.gpt2 import GPT2, LMHead, _fill_normal_, in_compute_dtype, logits_position
from lightning_tp2d.models.hf import (HEAD_WIDTH, HEADS, LAYERS, MLP_WIDTH, POSITIONS, VOCAB, WIDTH, HFFormat,
                                      check_hf_sizes, read_token_ids, write_token_ids)
from lightning_tp2d.models.rope import RoPE, apply_rope, rope_cache, rope_inv_freq, rotate_half

INIT_STD = 0.02  # transformers' initializer_range for Llama
# transformers' LlamaConfig defaults (a config.json may omit them)
HF_CONFIG_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=None, hidden_act="silu",
                          max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                          rope_theta=10000.0, rope_scaling=None, attention_bias=False, attention_dropout=0.0,
                          mlp_bias=False, head_dim=None)
HF_SIZE_LIMITS = dict(num_hidden_layers=LAYERS, hidden_size=WIDTH, intermediate_size=MLP_WIDTH,
                      num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=HEAD_WIDTH, vocab_size=VOCAB,
                      max_position_embeddings=POSITIONS)  # config.json sizes a Llama may have (models.hf)


@dataclass
class LlamaConfig(NamedSizes):
    vocab_size: int  # number of token ids (Llama 2: 32000, Llama 3: 128256)
    n_layer: int  # number of decoder layers (HF: num_hidden_layers)
    n_head: int  # query heads per layer; must divide n_embd (HF: num_attention_heads)
    n_kv_head: int  # key/value heads; must divide n_head, < n_head is GQA (HF: num_key_value_heads)
    n_embd: int  # hidden size h (HF: hidden_size)
    intermediate_size: int  # width I of the SwiGLU MLP
    block_size: int  # the context it is made for (HF: max_position_embeddings); RoPE runs longer sequences too
    rope_theta: float = 10000.0  # RoPE base (Llama 3: 500000)
    norm_eps: float = 1e-5  # RMSNorm epsilon (HF: rms_norm_eps)
    tie_embeddings: bool = False  # lm_head.weight is model.embed_tokens.weight (HF: tie_word_embeddings)
    dropout: float = 0.0  # attention-probability dropout (HF: attention_dropout); Llama has no other dropout
    # RoPE frequency scaling (HF: rope_scaling / rope_parameters): None, or {"rope_type": "llama3", "factor": 8.0,
    # "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192} (Llama 3.1)
    rope_scaling: dict | None = None
    # special tokens, for an export's config.json and generation_config.json (None: not known, written as null;
    # Llama 3: bos 128000 <|begin_of_text|>, eos 128001 <|end_of_text|>, its instruct models a list with 128009)
    bos_token_id: int | None = None  # the token a sequence starts with
    eos_token_id: int | tuple[int, ...] | None = None  # end of text: generation stops there (or at any of several)
    pad_token_id: int | None = None  # the token that pads a batch
    # the LM head's logits over the vocabulary padded to a multiple of this, as GPT2Config.pad_vocab_multiple (Llama
    # 3's 128256 is a multiple of 128 already); parameters, checkpoints and exports keep vocab_size rows
    pad_vocab_multiple: int = 1

    KIND: ClassVar[str] = "Llama"

    def __post_init__(self):
        check_positive_ints(self, ("vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "intermediate_size",
                                   "block_size", "pad_vocab_multiple"))
        check_divides(self, "n_embd", "n_head")
        check_divides(self, "n_head", "n_kv_head", "each key/value head serves a whole group of query heads")
        if self.head_size % 2 != 0:
            raise ValueError(f"head_size = n_embd // n_head = {self.n_embd} // {self.n_head} = {self.head_size} is "
                             f"odd; RoPE rotates pairs of features and needs an even head size")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive number, got {value!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"LlamaConfig.tie_embeddings must be a bool, got {self.tie_embeddings!r}")
        check_dropout(self.dropout)
        check_token_ids(self)
        self.rope_scaling = self.rope.scaling  # checked, as a plain dict (a YAML node arrives as a DictConfig)

    @property
    def rope(self) -> RoPE:
        """The RoPE this config describes (``rope_theta`` and ``rope_scaling``); ``ValueError`` naming a scaling
        field that is missing, unknown or does not fit."""
        return RoPE.from_scaling(self.rope_theta, self.rope_scaling, "LlamaConfig.rope_scaling")

    @property
    def max_seq_len(self) -> None:
        """``None``: RoPE has no position table, so any sequence length runs (``block_size`` is no limit)."""
        return None

    @property
    def kv_groups(self) -> int:
        """g = n_head // n_kv_head, query heads per key/value head (1: multi-head attention)."""
        return self.n_head // self.n_kv_head

    @classmethod
    def from_hf(cls, hf_config) -> "LlamaConfig":
        """Our config for a transformers ``LlamaConfig``; refuses implausible sizes (:data:`HF_SIZE_LIMITS`) and
        variants this model does not implement."""
        check_hf_sizes(hf_config, HF_SIZE_LIMITS)
        problems = []
        if hf_config.hidden_act != "silu":
            problems.append(f"hidden_act={hf_config.hidden_act!r} (need 'silu')")
        for flag in ("attention_bias", "mlp_bias"):
            if getattr(hf_config, flag, False):
                problems.append(f"{flag}=True (need False: this model has no biases)")
        n_head = hf_config.num_attention_heads
        n_kv_head = getattr(hf_config, "num_key_value_heads", None) or n_head
        head_dim = getattr(hf_config, "head_dim", None)
        if head_dim is not None and head_dim * n_head != hf_config.hidden_size:
            problems.append(f"head_dim={head_dim} (need hidden_size // num_attention_heads = "
                            f"{hf_config.hidden_size} // {n_head})")
        theta, scaling = _hf_rope(hf_config)
        try:
            RoPE.from_scaling(theta, scaling, "rope_scaling/rope_parameters")
        except ValueError as err:
            problems.append(str(err))
        if problems:
            raise ValueError("unsupported transformers LlamaConfig: " + "; ".join(problems))
        return cls(vocab_size=hf_config.vocab_size, n_layer=hf_config.num_hidden_layers, n_head=n_head,
                   n_kv_head=n_kv_head, n_embd=hf_config.hidden_size, intermediate_size=hf_config.intermediate_size,
                   block_size=hf_config.max_position_embeddings, rope_theta=float(theta), rope_scaling=scaling,
                   norm_eps=float(hf_config.rms_norm_eps), tie_embeddings=bool(hf_config.tie_word_embeddings),
                   dropout=float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
                   **read_token_ids(hf_config, hf_config.vocab_size))


def _hf_rope(hf_config) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling)`` of a transformers config. transformers 5 keeps theta, the rope type and its
    fields in ``rope_parameters`` (``rope_scaling`` is an alias of it; in a ``config.json`` a non-null
    ``rope_scaling`` wins, as there); transformers 4 has ``rope_theta`` and ``rope_scaling`` (``None`` unless
    scaled; old files say ``type`` for ``rope_type``) as attributes."""
    rope = dict(getattr(hf_config, "rope_scaling", None) or getattr(hf_config, "rope_parameters", None) or {})
    theta = rope.pop("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":  # as transformers: the pre-training context defaults to max_position_embeddings
        rope.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
    return theta, {"rope_type": rope_type, **rope}


# Llama 3.1 and 3.2: RoPE scaled from the 8192-token pre-training context to 131072 (their config.json files).
_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5, block_size=131072)
_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}
_LLAMA32_ROPE = {**_LLAMA31_ROPE, "factor": 32.0}
_NAMED_CONFIGS = {
    # Test sizes: 12 query and 6 key/value heads (GQA, g = 2) split over 2 or 3 ranks per grid side; hs = 8;
    # n_embd 96 and intermediate 264 divide by 2, 3, 4 and 6; vocab 257 (bytes + 1) divides by none of them.
    "llama-tiny": dict(vocab_size=257, n_layer=2, n_head=12, n_kv_head=6, n_embd=96, intermediate_size=264,
                       block_size=64),
    "llama-mini": dict(vocab_size=257, n_layer=4, n_head=12, n_kv_head=6, n_embd=192, intermediate_size=528,
                       block_size=128),
    # Real models (shapes, RoPE and context of their config.json), loading exactly from their checkpoints.
    "llama-2-7b": dict(vocab_size=32000, n_layer=32, n_head=32, n_kv_head=32, n_embd=4096, intermediate_size=11008,
                       block_size=4096),  # 6.74B
    "llama-3.2-1b": dict(_LLAMA3, n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, intermediate_size=8192,
                         tie_embeddings=True, rope_scaling=_LLAMA32_ROPE),  # 1.24B
    "llama-3.2-3b": dict(_LLAMA3, n_layer=28, n_head=24, n_kv_head=8, n_embd=3072, intermediate_size=8192,
                         tie_embeddings=True, rope_scaling=_LLAMA32_ROPE),  # 3.21B
    "llama-3.1-8b": dict(_LLAMA3, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, intermediate_size=14336,
                         rope_scaling=_LLAMA31_ROPE),  # 8.03B
    "llama-3.1-70b": dict(_LLAMA3, n_layer=80, n_head=64, n_kv_head=8, n_embd=8192, intermediate_size=28672,
                          rope_scaling=_LLAMA31_ROPE),  # 70.6B
    "llama-3.1-405b": dict(_LLAMA3, n_layer=126, n_head=128, n_kv_head=8, n_embd=16384, intermediate_size=53248,
                           rope_scaling=_LLAMA31_ROPE),  # 405.9B
}
LlamaConfig.NAMED = _NAMED_CONFIGS


# ---- functions the parallel layers reuse ---------------------------------------------------------------------------

NORM_CHUNK_ELEMENTS = 1 << 24  # float32 temporaries of a bf16 RMSNorm: rows in chunks of at most 64 MiB of them


def _row_chunks(rows: int, width: int) -> list[slice]:
    step = max(1, NORM_CHUNK_ELEMENTS // width)
    return [slice(i, min(rows, i + step)) for i in range(0, rows, step)]


class _HalfRMSNorm(torch.autograd.Function):
    """:func:`rms_norm` of a bf16 / float16 ``x`` that saves ``x`` itself and the float32 reciprocal RMS (one number
    per row) for the backward, where autograd through the float32 upcast would save float32 copies of ``x``: twice
    the bytes of the activation it normalises. Forward and backward run in float32 over chunks of rows
    (:data:`NORM_CHUNK_ELEMENTS`), so their float32 temporaries stay bounded at any sequence length (unchunked,
    five float32 ``[T/p, h]`` temporaries of the backward set a long-context block's peak). The forward's
    arithmetic is :func:`rms_norm`'s, row by row."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        h = x.shape[-1]
        rows = x.reshape(-1, h)
        out = torch.empty_like(rows)
        rstd = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=x.device)
        w = weight.to(x.dtype)
        for part in _row_chunks(rows.shape[0], h):
            xf = rows[part].float()
            r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            rstd[part] = r
            torch.mul(w, (xf * r).to(x.dtype), out=out[part])
        ctx.save_for_backward(x, weight, rstd)
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        h = x.shape[-1]
        rows, grads = x.reshape(-1, h), grad.reshape(-1, h)
        dx = torch.empty_like(rows)
        dweight = torch.zeros(h, dtype=torch.float32, device=x.device)
        w = weight.to(x.dtype).float()
        for part in _row_chunks(rows.shape[0], h):
            r = rstd[part]
            xhat = rows[part].float() * r
            g = grads[part].float()
            dweight += (g * xhat.to(x.dtype).float()).sum(0)
            dxhat = g * w
            dx[part] = (r * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))).to(x.dtype)
        return dx.view(x.shape), dweight.to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x², last dim) + eps), normalised in at least float32 and cast back before the
    weight multiplies, as transformers' ``LlamaRMSNorm`` (which also downcasts float64; this keeps float64). The
    result has x's dtype: a float32 weight is cast to a bf16 x (``bf16-mixed``) rather than promoting the result,
    and a bf16 x is saved for the backward as it is (:class:`_HalfRMSNorm`), never as a float32 copy."""
    dtype = x.dtype
    # a plain (or fake) tensor; a DTensor (torch's sequence-parallel norms in the 1-D baseline) takes the ops below
    if dtype in (torch.bfloat16, torch.float16) and torch.is_grad_enabled() and not hasattr(x, "placements"):
        return _HalfRMSNorm.apply(x, weight, eps)
    xf = x.to(torch.promote_types(dtype, torch.float32))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(dtype) * xf.to(dtype)  # in x's dtype: bf16 stays bf16 under autocast (float32 weights)


# ---- modules -------------------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension with a learned scale (no bias, no mean subtraction)."""

    def __init__(self, n_embd: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n_embd))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class LlamaAttention(nn.Module):
    """Causal GQA self-attention with RoPE: q = x Wqᵀ (nh heads), k, v = x Wkᵀ, x Wvᵀ (nkv heads each),
    y = softmax(rope(q) rope(k)ᵀ / sqrt(hs) + causal mask) v, out = y Woᵀ. No biases."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        h, hs = config.n_embd, config.head_size
        self.q_proj = nn.Linear(h, config.n_head * hs, bias=False)
        self.k_proj = nn.Linear(h, config.n_kv_head * hs, bias=False)
        self.v_proj = nn.Linear(h, config.n_kv_head * hs, bias=False)
        self.o_proj = nn.Linear(config.n_head * hs, h, bias=False)
        self.head_size = hs
        self.rope = config.rope  # theta and scaling (the parallel layers read it here)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                documents: Documents | None = None) -> torch.Tensor:
        """x (B, T, h) -> (B, T, h). ``positions``: absolute positions of x's T rows ((T,) or (B, T)); default
        ``0 .. T-1``. The causal mask is by row order, so rows must be in increasing position order. ``documents``
        (packed documents): each query sees the keys of its own document at or before it, through SDPA with the
        ``[B, 1, T, T]`` bool mask (the single-device reference; the ring layouts never build it)."""
        y = rope_attention(self.q_proj(x), self.k_proj(x), self.v_proj(x), self.head_size, self.rope,
                           self.dropout if self.training else 0.0, positions, documents)
        return self.o_proj(y)


def rope_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_size: int, rope, dropout_p: float = 0.0,
                   positions: torch.Tensor | None = None, documents: Documents | None = None) -> torch.Tensor:
    """Projected ``q [B, T, nh*hs]``, ``k``, ``v [B, T, nkv*hs]`` -> ``y [B, T, nh*hs]``: RoPE at ``positions``
    (default ``0 .. T-1``), then causal GQA SDPA (with ``documents``, each query's own document). Llama's attention
    between its projections, shared by the plain model and the parallel layers that hold whole sequences."""
    B, T, _ = q.shape
    q = q.view(B, T, -1, head_size).transpose(1, 2)  # (B, nh, T, hs)
    k = k.view(B, T, -1, head_size).transpose(1, 2)  # (B, nkv, T, hs)
    v = v.view(B, T, -1, head_size).transpose(1, 2)  # (B, nkv, T, hs)
    cos, sin = rope_cache(T if positions is None else positions, head_size, rope, q.device)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    mask = None if documents is None else documents.mask()  # (B, 1, T, T) bool
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=dropout_p,
                                       enable_gqa=q.size(1) != k.size(1))  # query head j reads kv head j // g
    return y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh*hs)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``down(silu(x gateᵀ) * (x upᵀ))``: Llama's MLP from its three weights (the ring layers' one-rank path)."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


class LlamaMLP(nn.Module):
    """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x)), hidden width intermediate_size, no biases."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """Pre-RMSNorm residual block: x + self_attn(input_layernorm(x)), then + mlp(post_attention_layernorm(x)).

    Submodules are declared in transformers' order (self_attn, mlp, input_layernorm, post_attention_layernorm), so
    state-dict keys come in ``LlamaForCausalLM``'s order."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.n_embd, config.norm_eps)
        self.post_attention_layernorm = RMSNorm(config.n_embd, config.norm_eps)

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        # Only submodule calls here: parallel versions may hand around a sharded x; ``documents`` as GPT-2's Block.
        h = self.input_layernorm(x)
        x = x + (self.self_attn(h) if documents is None else self.self_attn(h, documents=documents))
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class Llama(nn.Module):
    """Llama language model: token embedding, n_layer LlamaBlocks, final RMSNorm, LM head (tied or not)."""

    # Check token-id values on every forward (see GPT2.validate_inputs: a host sync per step on a GPU).
    validate_inputs: bool = True
    residual_in_compute_dtype: bool = False  # as GPT2's: set by parallelize()

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        # As in GPT2: default inits are overwritten by init_weights(); keep them from consuming the CPU seed, so
        # Llama(config) right after manual_seed(s) equals a meta build + to_empty() + manual_seed(s) + init_weights().
        with torch.random.fork_rng(devices=[]):
            self.model = nn.ModuleDict(dict(
                embed_tokens=nn.Embedding(config.vocab_size, config.n_embd),  # E [V, h]
                layers=nn.ModuleList([LlamaBlock(config) for _ in range(config.n_layer)]),
                norm=RMSNorm(config.n_embd, config.norm_eps),
            ))
            head = (self.model.embed_tokens.weight if config.tie_embeddings
                    else nn.Parameter(torch.empty(config.vocab_size, config.n_embd)))
            self.lm_head = LMHead(head, config.pad_vocab_multiple)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """transformers' Llama init: Linear / Embedding weights (and an untied lm_head) ~ N(0, 0.02²), RMSNorm
        weights 1. Draws come from the global CPU generator in float32 (device- and dtype-independent, as GPT2's);
        meta tensors are skipped: build on meta, ``to_empty(device=...)``, then call this (it re-ties first)."""
        self.tie_weights()
        for name, module in self.named_modules():
            self.init_module_(name, module)

    @torch.no_grad()
    def init_module_(self, name: str, module: nn.Module) -> None:
        """Init of one module (its own parameters only), drawing from the global CPU generator. Called in
        ``named_modules()`` order it equals :meth:`init_weights` (the materialisation contract of
        :meth:`GPT2.init_module_ <lightning_tp2d.models.gpt2.GPT2.init_module_>`). A tied ``lm_head`` draws nothing
        (it is ``embed_tokens``)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            _fill_normal_(module.weight, INIT_STD)
        elif isinstance(module, LMHead):
            if not self.config.tie_embeddings:
                _fill_normal_(module.weight, INIT_STD)
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)

    def tie_weights(self) -> None:
        """With ``tie_embeddings``, make lm_head.weight the very Parameter model.embed_tokens.weight again (after
        ``to_empty()`` from meta, which unties); otherwise nothing."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def num_parameters(self) -> int:
        """Number of distinct parameter entries; a tied embed_tokens/lm_head matrix counts once."""
        return sum(p.numel() for p in self.parameters())

    # The same checks and messages as GPT-2 (they read config.vocab_size / max_seq_len and validate_inputs).
    check_input = GPT2.check_input
    check_documents = GPT2.check_documents
    _assert_ids_on_device = GPT2._assert_ids_on_device

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                doc_ids: torch.Tensor | Documents | None = None, logits_at: int | None = None) -> torch.Tensor:
        """idx (B, T) -> logits (B, T, V), or the mean next-token loss (a scalar; targets -100 ignored) if targets
        (B, T) given. ``doc_ids``: packed documents, as :meth:`GPT2.forward`'s (RoPE positions still count from the
        start of the row); ``logits_at``: one position's logits ``[B, 1, V]``, as :meth:`GPT2.forward`'s. Generic
        on purpose: parallel versions swap embed_tokens / layers / norms / lm_head."""
        self.check_input(idx, targets)
        documents = self.check_documents(idx, doc_ids)
        at = logits_position(idx, targets, logits_at)
        x = self.embed(idx)
        for layer in self.model.layers:
            x = layer(x) if documents is None else layer(x, documents)
        x = self.final_norm(x)
        return self.lm_head(x, targets) if at is None else self.lm_head(x, logits_at=at)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """The first block's input: the token embedding (the forward's first part; a pipeline's first stage runs it
        alone, :mod:`lightning_tp2d.pipeline`)."""
        x = self.model.embed_tokens(idx)  # (B, T, h)
        return in_compute_dtype(x) if self.residual_in_compute_dtype else x  # bf16 under bf16-mixed

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The head's input: the last block's output through the final RMSNorm."""
        return self.model.norm(x)

    # ---- transformers LlamaForCausalLM layout ------------------------------------------------------------------

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Our weights under transformers' keys (the same keys; copies), including ``lm_head.weight`` when tied,
        as transformers' ``state_dict()`` does."""
        return HF_FORMAT.hf_state_dict(self)

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy a transformers ``LlamaForCausalLM.state_dict()`` (or ``LlamaModel``'s plus ``lm_head.weight``)
        into this model's parameters.

        Ignores RoPE buffers (``rotary_emb.inv_freq``); with ``tie_embeddings`` ``lm_head.weight`` is optional (tied
        checkpoints often omit it) but, if present, must equal ``model.embed_tokens.weight``. All problems are
        collected and reported in one ValueError, and nothing is copied unless all is well
        (:func:`~lightning_tp2d.models.hf.check_keys`)."""
        HF_FORMAT.load_state_dict(self, sd, "Llama state dict")


# ---- transformers' Llama format ------------------------------------------------------------------------------------


def _read_hf_config(raw) -> LlamaConfig:
    return LlamaConfig.from_hf(SimpleNamespace(**{**HF_CONFIG_DEFAULTS, **raw}))


def _write_hf_config(cfg: LlamaConfig) -> dict:
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.n_embd, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_size, "max_position_embeddings": cfg.block_size, "rms_norm_eps": cfg.norm_eps,
        "hidden_act": "silu",
        # transformers 5 reads rope_parameters (or rope_scaling where it is set), 4 rope_theta and rope_scaling
        "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
        "rope_parameters": {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "attention_dropout": cfg.dropout, "torch_dtype": "float32",
        **write_token_ids(cfg),  # null where unknown: transformers' LlamaConfig would say 1 and 2
    }


# LlamaForCausalLM's keys are ours, nothing is transposed, q/k/v are separate; the bare LlamaModel lacks "model.".
# RoPE has no position table, so any block_size fits; its theta and scaling must match.
HF_FORMAT = HFFormat(
    model_type="llama", architecture="LlamaForCausalLM", read_config=_read_hf_config, write_config=_write_hf_config,
    embedding="model.embed_tokens.weight", prefix="model.",
    # non-persistent RoPE buffers that some transformers versions saved (Llama 2 era files carry
    # model.layers.{i}.self_attn.rotary_emb.inv_freq); this model recomputes them
    ignored=("rotary_emb.inv_freq", "rotary_emb.original_inv_freq"),
    sizes=("n_layer", "n_head", "n_kv_head", "n_embd", "intermediate_size", "vocab_size", "rope_theta",
           "rope_scaling", "norm_eps"),
    tie_option="tie_embeddings")


__all__ = ["Llama", "LlamaConfig", "LlamaAttention", "LlamaBlock", "LlamaMLP", "RMSNorm", "apply_rope",
           "HF_FORMAT", "rms_norm", "rope_cache", "rope_inv_freq", "rotate_half"]
