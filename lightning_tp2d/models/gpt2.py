"""GPT-2 on one device, in the shape of nanoGPT and with transformers' parameter names.

The model knows nothing about parallelism. A separate module swaps submodules by name
(``transformer.wte``, ``transformer.h[i].attn.c_attn``, ``lm_head`` ...) for parallel versions,
so those names, and the generic ``GPT2.forward``, are a contract. ``state_dict()`` keys equal
those of transformers' ``GPT2LMHeadModel``; ``hf_state_dict`` / ``load_hf_state_dict`` convert
the one layout difference (HF stores four weight matrices as Conv1D, transposed); :data:`HF_FORMAT` is the
whole transformers format (keys, transposes, fused q/k/v, ``config.json`` reader and writer).

Shapes: B batch, T sequence length, h = n_embd, nh = n_head, hs = h // nh, V = vocab_size.
"""

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_tp2d.models.config import (NamedSizes, check_divides, check_dropout, check_positive_ints,
                                          check_token_ids, max_seq_len)
from lightning_tp2d.models.documents import Documents, as_documents
from lightning_tp2d.models.hf import (HEADS, LAYERS, MLP_WIDTH, VOCAB, WIDTH, HFFormat, check_hf_sizes, read_token_ids,
                                      write_token_ids)

# Weights that transformers stores as Conv1D, i.e. [in, out], while nn.Linear stores [out, in].
# This is the transpose trap of every GPT-2 checkpoint: the shapes of c_attn and c_fc do not even
# match ours, but attn.c_proj is square, so forgetting the transpose there loads silently.
HF_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# transformers' GPT2Config defaults: save_pretrained writes only the values that differ from them.
HF_CONFIG_DEFAULTS = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
                          activation_function="gelu_new", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                          layer_norm_epsilon=1e-5, scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
                          reorder_and_upcast_attn=False, add_cross_attention=False)
# config.json sizes a GPT-2 may have (models.hf); n_positions rows are a learned table, so fewer than RoPE's
HF_SIZE_LIMITS = dict(n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, vocab_size=VOCAB, n_positions=(1 << 20, "positions"),
                      n_inner=MLP_WIDTH)


@dataclass
class GPT2Config(NamedSizes):
    n_layer: int  # number of transformer blocks
    n_head: int  # attention heads per block; must divide n_embd
    n_embd: int  # hidden size h of the residual stream
    vocab_size: int  # number of token ids; GPT-2's tokenizer has 50257
    block_size: int  # longest sequence the position embedding covers (HF: n_positions)
    dropout: float = 0.0  # one dropout probability for embeddings, attention and residual branches
    bias: bool = True  # biases in Linear and LayerNorm, like GPT-2; False is a bit faster and leaner
    # special tokens, for an export's config.json and generation_config.json (None: not known; the export then
    # writes GPT-2's convention, vocab_size - 1 for both, <|endoftext|> = 50256 of GPT-2's tokenizer)
    bos_token_id: int | None = None  # the token a sequence starts with
    eos_token_id: int | tuple[int, ...] | None = None  # end of text: generation stops there (or at any of several)
    pad_token_id: int | None = None  # the token that pads a batch
    # the LM head computes its logits over the vocabulary padded to a multiple of this (per vocab block of a parallel
    # head): a GPU runs GPT-2's 50257 on a slow kernel, 50304 (128) on the tensor cores, as nanoGPT pads. Only the
    # head's operands are padded: the padded logits are masked out of the loss and never returned, and parameters,
    # checkpoints and exports keep vocab_size rows. 1: no padding
    pad_vocab_multiple: int = 1

    KIND: ClassVar[str] = "GPT-2"

    def __post_init__(self):
        check_positive_ints(self, ("n_layer", "n_head", "n_embd", "vocab_size", "block_size", "pad_vocab_multiple"))
        check_divides(self, "n_embd", "n_head")
        check_dropout(self.dropout)
        check_token_ids(self)

    @classmethod
    def from_hf(cls, hf_config) -> "GPT2Config":
        """Our config for a transformers ``GPT2Config``; refuses implausible sizes (:data:`HF_SIZE_LIMITS`) and
        variants this model does not implement."""
        check_hf_sizes(hf_config, HF_SIZE_LIMITS)
        problems = []
        n_inner = getattr(hf_config, "n_inner", None)
        if n_inner not in (None, 4 * hf_config.n_embd):
            problems.append(f"n_inner={n_inner} (need 4 * n_embd = {4 * hf_config.n_embd})")
        if getattr(hf_config, "add_cross_attention", False):
            problems.append("add_cross_attention=True (need False)")
        if hf_config.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
            problems.append(f"activation_function={hf_config.activation_function!r} (need 'gelu_new')")
        if hf_config.layer_norm_epsilon != 1e-5:
            problems.append(f"layer_norm_epsilon={hf_config.layer_norm_epsilon} (need 1e-5)")
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if getattr(hf_config, flag, False):
                problems.append(f"{flag}=True (need False)")
        if not getattr(hf_config, "scale_attn_weights", True):
            problems.append("scale_attn_weights=False (need True)")
        drops = {hf_config.embd_pdrop, hf_config.attn_pdrop, hf_config.resid_pdrop}
        if len(drops) != 1:
            problems.append(f"embd/attn/resid_pdrop differ {sorted(drops)} (need one value)")
        if problems:
            raise ValueError("unsupported transformers GPT2Config: " + "; ".join(problems))
        return cls(n_layer=hf_config.n_layer, n_head=hf_config.n_head, n_embd=hf_config.n_embd,
                   vocab_size=hf_config.vocab_size, block_size=hf_config.n_positions,
                   dropout=float(drops.pop()), **read_token_ids(hf_config, hf_config.vocab_size))


# The named sizes are what `tp2d-train model=<name>` trains and `tp2d-plan <name>` prices (conf/model/<name>.yaml
# holds the same fields, tests/test_conf.py holds them equal). OpenAI's sizes pad the head's product to 50304 ids
# (pad_vocab_multiple=128, tensor-core shaped; parameters, logits, checkpoints and exports keep 50257); a config read
# from transformers (from_hf_config) keeps its own vocabulary unpadded.
_NAMED_CONFIGS = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, block_size=1024, pad_vocab_multiple=128),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, vocab_size=50257, block_size=1024,
                        pad_vocab_multiple=128),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, vocab_size=50257, block_size=1024,
                       pad_vocab_multiple=128),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, vocab_size=50257, block_size=1024,
                    pad_vocab_multiple=128),  # 1558M
    # Test sizes: 6 heads split over 2 or 3 ranks per grid side; vocab 257 divides by neither.
    "gpt2-tiny": dict(n_layer=2, n_head=6, n_embd=48, vocab_size=257, block_size=64),
    "gpt2-mini": dict(n_layer=4, n_head=6, n_embd=96, vocab_size=257, block_size=128),
}
GPT2Config.NAMED = _NAMED_CONFIGS


class CausalSelfAttention(nn.Module):
    """y = softmax(q kᵀ / sqrt(hs) + causal mask) v per head, then y @ W_projᵀ + b_proj.

    [q | k | v] = x @ W_attnᵀ + b_attn with W_attn of shape [3h, h]: one fused matmul, split along
    the output features into three blocks of h (each block holds all nh heads of width hs).
    """

    def __init__(self, config: GPT2Config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        """x (B, T, h) -> (B, T, h). ``documents`` (packed documents, :mod:`~lightning_tp2d.models.documents`): each
        query sees the keys of its own document at or before it, through SDPA with the ``[B, 1, T, T]`` bool mask
        (the one place it exists: the single-device reference; the ring layouts never build it)."""
        y = causal_attention(self.c_attn(x), self.n_head, self.dropout if self.training else 0.0, documents)
        return self.resid_dropout(self.c_proj(y))


def causal_attention(qkv: torch.Tensor, n_head: int, dropout_p: float = 0.0,
                     documents: Documents | None = None) -> torch.Tensor:
    """``qkv [B, T, 3w]`` (``[q | k | v]``, each ``n_head`` heads side by side) -> ``y [B, T, w]``: causal SDPA per
    head (with ``documents``, the ``[B, 1, T, T]`` mask of each query's own document). GPT-2's attention between its
    two projections, shared by the plain model and the parallel layers that hold whole heads of whole sequences."""
    B, T, three_w = qkv.shape
    w = three_w // 3
    hs = w // n_head
    q, k, v = qkv.split(w, dim=2)  # 3 x (B, T, w)
    q = q.view(B, T, n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
    k = k.view(B, T, n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
    v = v.view(B, T, n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
    mask = None if documents is None else documents.mask()  # (B, 1, T, T) bool
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=dropout_p)
    return y.transpose(1, 2).contiguous().view(B, T, w)  # (B, T, w), heads side by side again


class MLP(nn.Module):
    """y = dropout(gelu_tanh(x @ W_fcᵀ + b_fc) @ W_projᵀ + b_proj), hidden width 4h.

    gelu with the tanh approximation is transformers' ``gelu_new``, GPT-2's activation.
    """

    def __init__(self, config: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-LayerNorm residual block: x + attn(ln_1(x)), then + mlp(ln_2(x))."""

    def __init__(self, config: GPT2Config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        # Only submodule calls here: parallel versions may hand around a sharded x. ``documents`` reaches the
        # attention only when given, so attention classes that know no packed documents run as before.
        h = self.ln_1(x)
        x = x + (self.attn(h) if documents is None else self.attn(h, documents=documents))
        x = x + self.mlp(self.ln_2(x))
        return x


class LMHead(nn.Module):
    """logits = x @ Eᵀ with E = wte.weight of shape [V, h] (weight tying); optionally the loss.

    loss = mean over tokens with target != -100 of -log softmax(logits)[target].
    """

    def __init__(self, weight: nn.Parameter, pad_multiple: int = 1):
        super().__init__()
        self.weight = weight  # the same Parameter object as transformer.wte.weight
        self.pad_multiple = pad_multiple  # the config's pad_vocab_multiple (lm_head); parallelize hands it on

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None,
                logits_at: int | None = None) -> torch.Tensor:
        """``logits_at`` (a position ``0 <= t < T``, no targets): the logits of that position only, ``[B, 1, V]``."""
        return lm_head(x, self.weight, targets, logits_at, self.pad_multiple)

    def extra_repr(self) -> str:
        return f"pad_multiple={self.pad_multiple}" if self.pad_multiple > 1 else ""


def padded_rows(rows: int, multiple: int) -> int:
    """``rows`` rounded up to a multiple of ``multiple``."""
    return -(-rows // multiple) * multiple


def padded_weight(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight [V, h]`` as ``[rows, h]`` with zero rows below, in the autocast dtype when autocast is on: one copy,
    the one autocast's cast makes anyway (differentiable; ``weight`` itself when ``rows == V``)."""
    if rows == weight.shape[0]:
        return weight
    device = weight.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    out = weight.new_empty((rows, weight.shape[1]), dtype=dtype)
    out[weight.shape[0]:].zero_()
    out[:weight.shape[0]].copy_(weight)
    return out


def lm_head(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor | None = None,
            logits_at: int | None = None, pad_multiple: int = 1) -> torch.Tensor:
    """``logits = x weightᵀ`` ``[B, T, V]`` (``logits_at``: that one position's, ``[B, 1, V]``), or with ``targets``
    the mean cross-entropy (``-100`` ignored). The plain head; the parallel heads of a one-rank mesh call it too,
    where the whole vocabulary is local. ``pad_multiple``: the product runs over the vocabulary padded to that
    multiple (zero rows); the padded logits are ``-inf`` in the loss and left out of the returned logits (a view)."""
    if logits_at is not None:
        x = x[:, logits_at:logits_at + 1]  # (B, 1, h)
    V = weight.shape[0]
    logits = F.linear(x, padded_weight(weight, padded_rows(V, pad_multiple)))  # (B, T, Vp)
    if targets is None:
        return logits if logits.size(-1) == V else logits[..., :V]
    if logits.size(-1) > V:
        logits[..., V:] = float("-inf")  # out of the softmax: no probability, no gradient
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100)


def in_compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the autocast dtype when autocast is on for its device (``bf16-mixed``), else ``x``.

    A model with ``residual_in_compute_dtype`` (every model :func:`~lightning_tp2d.parallelize` parallelizes) calls
    it on the embedding output, so the residual stream, each block's input (the one tensor full activation
    checkpointing saves) and every activation saved for the backward are bf16 under ``bf16-mixed``, as under FSDP's
    bf16 ``param_dtype`` (and transformers' bf16 models); parameters, their gradients and the optimizer state stay
    float32. The norms keep the stream's dtype (their weights are cast to it, their statistics computed in float32),
    so nothing promotes it back. A plain model keeps autocast's float32 stream unless the attribute is set."""
    device = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        if x.dtype != dtype:
            return x.to(dtype)
    return x


def layer_norm(x: torch.Tensor, shape: tuple[int, ...], weight: torch.Tensor | None, bias: torch.Tensor | None,
               eps: float) -> torch.Tensor:
    """``F.layer_norm`` in ``x``'s dtype. Under autocast a bf16 ``x`` stays bf16: autocast would run
    ``layer_norm`` in float32, saving a float32 copy of the input for the backward and handing float32 on; here the
    weight and bias are cast to ``x``'s dtype and the kernel accumulates its statistics in float32. Outside autocast,
    or for a float32 ``x``, it is ``F.layer_norm`` exactly."""
    if x.dtype in (torch.float32, torch.float64) or not torch.is_autocast_enabled(x.device.type):
        return F.layer_norm(x, shape, weight, bias, eps)
    weight = None if weight is None else weight.to(x.dtype)
    bias = None if bias is None else bias.to(x.dtype)
    with torch.autocast(x.device.type, enabled=False):
        return F.layer_norm(x, shape, weight, bias, eps)


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` that keeps a bf16 input bf16 under autocast (:func:`layer_norm`); the same parameters and
    state-dict keys, and outside autocast exactly ``nn.LayerNorm``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


def logits_position(idx: torch.Tensor, targets: torch.Tensor | None, logits_at: int | None) -> int | None:
    """``logits_at`` as a position ``0 <= t < T`` of ``idx [B, T]`` (``None`` stays ``None``); ``ValueError`` for a
    position outside ``[-T, T)`` or given with targets (a loss reads every position)."""
    if logits_at is None:
        return None
    T = idx.size(1)
    if targets is not None:
        raise ValueError("logits_at selects the logits of one position and returns no loss: pass targets or "
                         "logits_at, not both")
    if not isinstance(logits_at, int) or isinstance(logits_at, bool) or not -T <= logits_at < T:
        raise ValueError(f"logits_at must be an int in [-{T}, {T}) for a sequence of {T} tokens, got {logits_at!r}")
    return logits_at % T


class GPT2(nn.Module):
    """GPT-2 language model: token + position embedding, n_layer Blocks, final LayerNorm, tied head."""

    # Check token-id *values* on every forward (shapes and dtypes are always checked). It reads the ids on the host: a
    # device-to-host sync per step on a GPU. CausalLMModule turns it off and checks each batch on the host before
    # it moves to the device instead; turn it off too where the ids cannot be read (a fake-tensor schedule trace).
    validate_inputs: bool = True
    # Under autocast, run the residual stream in the autocast dtype (in_compute_dtype): parallelize() sets it, so
    # every layout saves bf16 activations under bf16-mixed at every ZeRO stage; a plain model keeps float32.
    residual_in_compute_dtype: bool = False

    def __init__(self, config: GPT2Config):
        super().__init__()
        self.config = config
        # Default inits of the submodules are overwritten by init_weights(); keep them from consuming
        # the CPU seed, so that GPT2(config) right after manual_seed(s) equals a meta-device build
        # followed by to_empty(), manual_seed(s) and init_weights().
        with torch.random.fork_rng(devices=[]):
            self.transformer = nn.ModuleDict(dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),  # token embedding E [V, h]
                wpe=nn.Embedding(config.block_size, config.n_embd),  # position embedding [block_size, h]
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=LayerNorm(config.n_embd, bias=config.bias),
            ))
            self.lm_head = LMHead(self.transformer.wte.weight, config.pad_vocab_multiple)  # tied: one Parameter
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 init: Linear/Embedding weights ~ N(0, 0.02²), biases 0, LayerNorm 1 and 0; the residual
        projections attn.c_proj and mlp.c_proj ~ N(0, (0.02 / sqrt(2 n_layer))²), because each block adds
        two of them to the residual stream (GPT-2 paper, section 2.3).

        Draws come from the global CPU generator in float32 and are copied onto each parameter, so the
        same seed gives the same weights on any device and (up to rounding) any dtype. Meta tensors are
        skipped: build on meta, ``to_empty(device=...)``, then call this (it re-ties lm_head first).
        """
        self.tie_weights()
        for name, module in self.named_modules():
            self.init_module_(name, module)

    @torch.no_grad()
    def init_module_(self, name: str, module: nn.Module) -> None:
        """GPT-2 init of one module (its own parameters only), drawing from the global CPU generator.

        ``init_weights`` calls it for every module in ``named_modules()`` order; ``parallelize`` calls it in
        the same order to materialise a meta-device model one module at a time, so both give the same
        weights for the same seed.
        """
        if isinstance(module, (nn.Linear, nn.Embedding)):
            residual = name.endswith(("attn.c_proj", "mlp.c_proj"))
            std = 0.02 / math.sqrt(2 * self.config.n_layer) if residual else 0.02
            _fill_normal_(module.weight, std)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
            if module.bias is not None:
                module.bias.zero_()

    def tie_weights(self) -> None:
        """Make lm_head.weight the very Parameter transformer.wte.weight again.

        ``to_empty()`` from the meta device creates a fresh Parameter per name and so unties them
        (``.to(dtype/device)`` between real devices keeps the tie); init_weights and load_hf_state_dict
        call this first.
        """
        self.lm_head.weight = self.transformer.wte.weight

    def num_parameters(self) -> int:
        """Number of distinct parameter entries; the tied wte/lm_head matrix counts once."""
        return sum(p.numel() for p in self.parameters())  # parameters() yields each tensor once

    def check_input(self, idx: torch.Tensor, targets: torch.Tensor | None = None, values: bool | None = None) -> None:
        """Raise ValueError unless idx is (B, T) integer ids in [0, V) with T <= block_size (no limit where the
        config's :func:`~lightning_tp2d.models.config.max_seq_len` is ``None``: RoPE), and targets (if given) has
        idx's shape with values in [0, V) or -100 (ignored). ``values``: whether to read the ids (``None``:
        :attr:`validate_inputs`)."""
        V, block_size = self.config.vocab_size, max_seq_len(self.config)
        if idx.dim() != 2 or idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
            raise ValueError(f"idx must be a 2-D (B, T) integer tensor, got shape {tuple(idx.shape)} "
                             f"dtype {idx.dtype}")
        T = idx.size(1)
        if block_size is not None and T > block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {block_size}")
        if not (self.validate_inputs if values is None else values):
            if targets is not None and targets.shape != idx.shape:
                raise ValueError(f"targets must have idx's shape {tuple(idx.shape)}, got {tuple(targets.shape)}")
            return
        if torch.compiler.is_compiling():  # in a compiled graph: device-side asserts, no host read, no graph break
            self._assert_ids_on_device(idx, targets)
            return
        if idx.numel() > 0 and idx.device.type != "meta":
            lo, hi = idx.min().item(), idx.max().item()
            if lo < 0 or hi >= V:
                raise ValueError(f"token ids must be in [0, {V}) for vocab_size {V}, got min {lo} max {hi}")
        if targets is None:
            return
        if targets.shape != idx.shape or targets.is_floating_point() or targets.dtype == torch.bool:
            raise ValueError(f"targets must be an integer tensor of idx's shape {tuple(idx.shape)}, got "
                             f"shape {tuple(targets.shape)} dtype {targets.dtype}")
        if targets.numel() > 0 and targets.device.type != "meta":
            bad = targets[(targets != -100) & ((targets < 0) | (targets >= V))]
            if bad.numel() > 0:
                raise ValueError(f"target ids must be in [0, {V}) or -100 (ignored), got "
                                 f"{bad.numel()} outside, min {bad.min().item()} max {bad.max().item()}")

    def check_documents(self, idx: torch.Tensor, doc_ids, values: bool | None = None) -> Documents | None:
        """``doc_ids`` as :class:`~lightning_tp2d.models.documents.Documents` (``None``: none); ``ValueError`` naming
        both shapes unless they are idx's, and (``values``, default :attr:`validate_inputs`; host ids only) unless
        every row is non-decreasing."""
        values = self.validate_inputs if values is None else values
        return as_documents(doc_ids, idx, values=values and not torch.compiler.is_compiling())

    def _assert_ids_on_device(self, idx: torch.Tensor, targets: torch.Tensor | None) -> None:
        """:meth:`check_input`'s value checks as asserts the device runs (``torch._assert_async``: under
        ``torch.compile`` the graph keeps them, and nothing waits for a value on the host)."""
        V = self.config.vocab_size
        torch._assert_async(((idx >= 0) & (idx < V)).all(), f"token ids must be in [0, {V}) for vocab_size {V}")
        if targets is not None:
            if targets.shape != idx.shape:
                raise ValueError(f"targets must have idx's shape {tuple(idx.shape)}, got {tuple(targets.shape)}")
            ok = (targets == -100) | ((targets >= 0) & (targets < V))
            torch._assert_async(ok.all(), f"target ids must be in [0, {V}) or -100 (ignored)")

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                doc_ids: torch.Tensor | Documents | None = None, logits_at: int | None = None) -> torch.Tensor:
        """idx (B, T) -> logits (B, T, V), or the mean next-token loss (a scalar) if targets (B, T) given.
        ``doc_ids``: packed documents, a (B, T) integer tensor non-decreasing per row or a
        :class:`~lightning_tp2d.models.documents.Documents`: attention stays inside each document. Positions still
        count from the start of the row (as in nanoGPT-style packing). ``logits_at`` (no targets): the logits of
        that one position (an int, negative from the end), ``[B, 1, V]``: a generation prefill at long T never
        forms the ``[B, T, V]`` logits (nor, in the parallel heads, their ``[T/p, V]`` shards).

        Kept generic on purpose: parallel versions swap wte / wpe / blocks / lm_head and reuse this.
        """
        self.check_input(idx, targets)
        documents = self.check_documents(idx, doc_ids)
        at = logits_position(idx, targets, logits_at)
        x = self.embed(idx)
        for block in self.transformer.h:
            x = block(x) if documents is None else block(x, documents)
        x = self.final_norm(x)
        return self.lm_head(x, targets) if at is None else self.lm_head(x, logits_at=at)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """The first block's input: token plus position embeddings, after dropout (the forward's first part; a
        pipeline's first stage runs it alone, :mod:`lightning_tp2d.pipeline`)."""
        pos = torch.arange(idx.size(1), device=idx.device)  # (T,)
        tr = self.transformer
        x = tr.wte(idx) + tr.wpe(pos)  # (B, T, h) + (T, h) -> (B, T, h)
        return tr.drop(in_compute_dtype(x) if self.residual_in_compute_dtype else x)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The head's input: the last block's output through the final LayerNorm."""
        return self.transformer.ln_f(x)

    # ---- transformers GPT2LMHeadModel layout -------------------------------------------------------

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Our weights under transformers' keys, Conv1D weights transposed to [in, out]; includes the
        tied ``lm_head.weight`` as transformers' ``state_dict()`` does."""
        return HF_FORMAT.hf_state_dict(self)

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy a transformers ``GPT2LMHeadModel.state_dict()`` into this model's parameters.

        Ignores old mask buffers (``*.attn.bias``, ``*.attn.masked_bias``) and accepts ``GPT2Model`` keys (no
        ``transformer.`` prefix); ``lm_head.weight`` is optional but, if present, must equal
        ``transformer.wte.weight`` (this model is tied). All problems are collected and reported in one ValueError,
        shapes given in HF layout, and nothing is copied unless all is well
        (:func:`~lightning_tp2d.models.hf.check_keys`).
        """
        HF_FORMAT.load_state_dict(self, sd, "GPT-2 state dict")


def _fill_normal_(t: torch.Tensor, std: float) -> None:
    """t <- N(0, std²) drawn on CPU in float32 from the global generator (device-independent draws)."""
    if t.is_meta:
        return
    t.copy_(torch.randn(t.shape, dtype=torch.float32, device="cpu") * std)


# ---- transformers' GPT-2 format ------------------------------------------------------------------------------


def _read_hf_config(raw) -> GPT2Config:
    return GPT2Config.from_hf(SimpleNamespace(**{**HF_CONFIG_DEFAULTS, **raw}))


def _write_hf_config(cfg: GPT2Config) -> dict:
    return {
        "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd, "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size, "n_ctx": cfg.block_size, "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5, "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
        "scale_attn_weights": True, "tie_word_embeddings": True,
        # GPT-2's convention where the config has none: <|endoftext|>, the last id, starts and ends a text
        **write_token_ids(cfg, bos_token_id=cfg.vocab_size - 1, eos_token_id=cfg.vocab_size - 1),
    }


def _fit(ours: GPT2Config, theirs: GPT2Config) -> list[str]:
    problems = []
    if ours.block_size > theirs.block_size:
        problems.append(f"block_size: model {ours.block_size} exceeds the checkpoint's n_positions "
                        f"{theirs.block_size} (the rows of its position embedding; a smaller block_size is fine)")
    if not ours.bias:
        problems.append("bias: model False, but GPT-2 checkpoints hold biases")
    return problems


# GPT2LMHeadModel's keys are ours; the hub's original ``gpt2`` files (the bare GPT2Model) lack ``transformer.``.
HF_FORMAT = HFFormat(
    model_type="gpt2", architecture="GPT2LMHeadModel", read_config=_read_hf_config, write_config=_write_hf_config,
    embedding="transformer.wte.weight", prefix="transformer.",
    ignored=(".attn.bias", ".attn.masked_bias"),  # causal-mask buffers that older transformers versions saved
    transposed=HF_TRANSPOSED, fused_qkv=("attn.c_attn.weight", "attn.c_attn.bias"),
    sizes=("n_layer", "n_head", "n_embd", "vocab_size"), fit=_fit,
    longer_rows=("transformer.wpe.weight",))  # a smaller block_size uses the position table's first rows
