"""Model families: what :func:`~lightning_tp2d.parallelize` needs to know about a model class, and a registry.

A :class:`ModelFamily` describes one model class (GPT-2, Llama, or a user's own) by what the package asks of it:

* ``module_roles(model)``: the ordered ``(module path, role)`` pairs that a plan replaces, in materialisation
  (``named_modules()``) order; a role is a name such as ``"attn"`` that the family's plan maps to a parallel class;
* ``tied(model)``: the paths whose parallel module is built from another module's parallel weight instead of from
  the plain module (GPT-2's ``lm_head`` from ``transformer.wte``; a tied Llama's ``lm_head`` from
  ``model.embed_tokens``);
* ``plans``: layout name -> ``{role: parallel class}`` (or a function of the layout object returning one, for a
  plan that depends on the layout's options); each class is called
  ``cls(plain_module_or_weight, mesh, options=layout.options)``. A layout missing here cannot parallelize the
  family (a ``ValueError`` naming the layouts that can);
* ``split_sizes(config, layout)``: the named sizes that must divide by the layout's side (heads, key/value heads,
  width, MLP width), checked with one ``ValueError`` naming every number that does not fit;
* ``fused_qkv``: state-dict key suffixes of fused q/k/v tensors (GPT-2's ``attn.c_attn``): checkpoints store them as
  ``[3, n/3, ...]`` boxes (:mod:`lightning_tp2d.checkpoint`). Separate q/k/v projections need none; by default
  the transformers format's;
* ``blocks``: the path of the ``ModuleList`` of transformer blocks (activation checkpointing);
* ``hf`` / ``load_hf``: the family's transformers format (a :class:`~lightning_tp2d.models.hf.HFFormat`: keys,
  transposes, fused q/k/v, ``config.json`` reader and writer), through which :func:`~lightning_tp2d.export.export_hf`
  and :func:`~lightning_tp2d.export.load_hf_weights` read and write it, or the family's own loader
  (``load_hf(model, directory)``); :func:`~lightning_tp2d.export.hf_loader` picks;
* ``config_key``: the key checkpoints record the family's configs under (default ``"<name>_configs"``);
* ``anatomy(config)``: what a config's blocks are made of (an :class:`Anatomy`: gated MLP, rotary positions,
  RMSNorm, the MLP's and the key/value projections' widths, a tied head), which the cost and memory models read
  (:func:`anatomy`) instead of guessing a family from a config's fields.

:func:`register_family` makes a family known; :func:`family_of` finds the family of a model (by ``isinstance``, the
most derived registered class first), so the strategies and ``parallelize`` accept any registered model. GPT-2 and
Llama are registered on import. A new layout trains a family once the family has a plan for it
(:func:`register_plan`). The rules that need both a layout and a model's config live here: :func:`fits` and
:func:`auto_tensor_parallel_size`.

Floors: this module stands on :mod:`lightning_tp2d.layouts`, the models and the parallel layers (``nn/``); nothing
below it imports it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from lightning_tp2d.layouts import Layout, get_layout
from lightning_tp2d.models import gpt2, llama
from lightning_tp2d.models.gpt2 import GPT2, GPT2Config
from lightning_tp2d.models.hf import HFFormat
from lightning_tp2d.models.llama import Llama, LlamaConfig
from lightning_tp2d.nn import MLP2D, Attention2D, LayerNorm2D, LMHead2D, PositionEmbedding2D, TokenEmbedding2D
from lightning_tp2d.nn.grid_metp import Attention2DMetp, LMHead2DMetp, PositionEmbedding2DMetp, TokenEmbedding2DMetp
from lightning_tp2d.nn.llama2d import LlamaAttention2D, RMSNorm2D, SwiGLU2D, UntiedLMHead2D
from lightning_tp2d.nn.ring import (RingAttention, RingLayerNorm, RingLMHead, RingMLP, RingPositionEmbedding,
                                    RingTokenEmbedding)
from lightning_tp2d.nn.ring_llama import (LlamaAttention2DMetp, RingLlamaAttention, RingRMSNorm, RingSwiGLU,
                                          UntiedLMHead2DMetp, UntiedRingLMHead)


@dataclass(frozen=True)
class Anatomy:
    """What one config's blocks are made of, as the cost and memory models need it (:func:`anatomy`). The models'
    closed forms are checked against the traced step on GPT-2 (LayerNorm, GELU, learned positions, fused q/k/v,
    tied head) and Llama (RMSNorm, SwiGLU, RoPE, grouped queries, either head); a family that mixes these traits
    otherwise is priced by the same rules, unchecked."""

    gated_mlp: bool  # SwiGLU: gate, up and down matrices (else GELU: up and down)
    rotary: bool  # rotary position tables (else a learned position table, GPT-2's wpe)
    rms_norm: bool  # RMSNorm: one statistic, no bias (else LayerNorm: mean and rstd, weight and bias)
    fused_qkv: bool  # one q|k|v projection (GPT-2's c_attn) or three
    mlp_width: int  # the MLP's hidden width (GPT-2: 4 h; Llama: intermediate_size)
    kv_width: int  # the key and value projections' rows each (n_kv_head * head size; without GQA: h)
    kv_heads: int  # key/value heads (without GQA: n_head)
    tied_head: bool  # the head multiplies by the token embedding


@dataclass(frozen=True)
class ModelFamily:
    """One model class and its parallel plans (module docstring)."""

    name: str
    model_class: type
    config_class: type
    module_roles: Callable[[nn.Module], list[tuple[str, str]]]
    plans: Mapping[str, Mapping[str, type] | Callable[[Any], Mapping[str, type]]]  # layout -> role -> class
    blocks: str  # path of the ModuleList of blocks
    tied: Callable[[nn.Module], Mapping[str, str]] = lambda model: {}
    split_sizes: Callable[[Any, Any], list[tuple[str, int]]] | None = None
    fused_qkv: tuple[str, ...] = ()
    hf: HFFormat | None = None  # the transformers format export.load_hf_weights / export_hf read and write
    load_hf: Callable[..., Any] | None = None  # the family's own transformers loader (model, directory)
    config_key: str = ""  # the key checkpoints record this family's configs under; "" -> "<name>_configs"
    anatomy: Callable[[Any], Anatomy] | None = None  # what a config's blocks are made of (cost and memory models)

    def __post_init__(self) -> None:
        if not self.config_key:
            object.__setattr__(self, "config_key", f"{self.name}_configs")
        if not self.fused_qkv and self.hf is not None:
            object.__setattr__(self, "fused_qkv", self.hf.fused_qkv)

    # ---- plans ------------------------------------------------------------------------------------------------

    @property
    def layouts(self) -> tuple[str, ...]:
        """The names of the layouts this family has a plan for."""
        return tuple(self.plans)

    def plan(self, layout: Layout) -> Mapping[str, type]:
        """Role -> parallel class of this family in ``layout``; ``ValueError`` when the family has no such plan."""
        make = self.plans.get(layout.name)
        if make is None:
            raise ValueError(f"model family {self.name!r} has no plan for layout {layout.name!r} yet; "
                             f"layouts with a plan: {list(self.plans)}")
        return make(layout) if callable(make) else make

    def build(self, layout: Layout, role: str, module: Any, mesh: Any) -> Any:
        """The parallel module for ``role`` (``module`` itself when the plan keeps the role plain)."""
        cls = self.plan(layout).get(role)
        return module if cls is None else cls(module, mesh, options=layout.options)

    # ---- sizes ------------------------------------------------------------------------------------------------

    def sizes(self, config: Any, layout: Layout) -> list[tuple[str, int]]:
        """The named sizes of ``config`` that ``layout`` splits over its side."""
        if self.split_sizes is not None:
            return list(self.split_sizes(config, layout))
        return default_sizes(config, layout)

    def problems(self, layout: Layout, p: int, config: Any, prefix: str = "") -> list[str]:
        """Why ``p`` ranks of ``layout`` cannot hold one replica of ``config``: the layout's size rule, then each
        family size the side does not divide (``prefix``: how the sizes are named, e.g. ``"model."``). The one
        path every size check takes (:func:`problems`, :func:`fits`, :mod:`lightning_tp2d.sizes`)."""
        problem = layout.size_problem(p)
        return [problem] if problem else layout.split_problems(p, self.sizes(config, layout), prefix)

    def check_model(self, layout: Layout, p: int, config: Any, dropout: float = 0.0) -> None:
        """``ValueError`` naming the numbers when ``config`` cannot be split over ``p`` ranks in ``layout`` (and the
        sides that would split every size), or when ``dropout`` cannot train there."""
        layout.check_tensor_parallel_size(p)
        layout.check_sizes(p, self.sizes(config, layout), dropout)

    # ---- the model ----------------------------------------------------------------------------------------------

    def block_modules(self, model: nn.Module) -> Iterable[nn.Module]:
        return model.get_submodule(self.blocks)


_FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily, *, override: bool = False) -> ModelFamily:
    """Make ``family`` known by its name and model class (``override`` replaces one of the same name)."""
    old = _FAMILIES.get(family.name)
    if old is not None and not override and old is not family:
        raise ValueError(f"model family {family.name!r} is already registered (for {old.model_class.__name__})")
    _FAMILIES[family.name] = family
    return family


def unregister_family(name: str) -> None:
    _FAMILIES.pop(name, None)


def families() -> tuple[ModelFamily, ...]:
    return tuple(_FAMILIES.values())


def get_family(name: str) -> ModelFamily:
    if name not in _FAMILIES:
        raise ValueError(f"unknown model family {name!r}; registered: {list(_FAMILIES)}")
    return _FAMILIES[name]


def family_of(model: Any) -> ModelFamily | None:
    """The family of ``model`` (an instance of a registered model class; the most derived class wins), else
    ``None``."""
    best = None
    for fam in _FAMILIES.values():
        if isinstance(model, fam.model_class) and (best is None or issubclass(fam.model_class, best.model_class)):
            best = fam
    return best


def family_of_config(config: Any) -> ModelFamily | None:
    """The family whose config class ``config`` is an instance of, else ``None``."""
    for fam in _FAMILIES.values():
        if isinstance(config, fam.config_class):
            return fam
    return None


def anatomy(config: Any) -> Anatomy:
    """What ``config``'s blocks are made of (:class:`Anatomy`), as its registered family says; ``ValueError`` for a
    config of no registered family or of a family that does not say."""
    family = family_of_config(config)
    if family is None or family.anatomy is None:
        raise ValueError(f"{type(config).__name__} is not the config of a registered family that states its "
                         f"anatomy (registered: {model_names()})")
    return family.anatomy(config)


def model_names() -> str:
    """``"GPT2, Llama"``: the registered model classes, for messages."""
    return ", ".join(f.model_class.__name__ for f in _FAMILIES.values())


def fused_qkv_suffixes() -> tuple[str, ...]:
    """Every registered family's fused q/k/v key suffixes (checkpoint keys carry no model, so all are asked)."""
    return tuple(s for f in _FAMILIES.values() for s in f.fused_qkv)


def register_plan(name: str, layout: str,
                  make: Mapping[str, type] | Callable[[Layout], Mapping[str, type]]) -> ModelFamily:
    """Give the registered family ``name`` a plan for ``layout`` (a layout registered after it: one registration
    per family that trains with it); returns the family as registered now."""
    family = get_family(name)
    return register_family(dataclasses.replace(family, plans={**family.plans, layout: make}), override=True)


# ---- rules of a layout and a model's config ------------------------------------------------------------------


def default_sizes(config: Any, layout: Layout) -> list[tuple[str, int]]:
    """The sizes a family without its own ``split_sizes`` splits: heads (where the layout splits them) and width."""
    return ([("n_head", config.n_head)] if layout.splits_heads else []) + [("n_embd", config.n_embd)]


def problems(layout: Layout, p: int, config: Any = None, prefix: str = "") -> list[str]:
    """Why ``p`` ranks of ``layout`` cannot hold one replica of ``config``: its family's rule
    (:meth:`ModelFamily.problems`); an unregistered config: the layout's rule and :func:`default_sizes`; no config:
    the layout's rule alone."""
    family = family_of_config(config) if config is not None else None
    if family is not None:
        return family.problems(layout, p, config, prefix)
    problem = layout.size_problem(p)
    if problem or config is None:
        return [problem] if problem else []
    return layout.split_problems(p, default_sizes(config, layout), prefix)


def fits(layout: str | Layout, p: int, config: Any = None) -> bool:
    """Whether ``p`` ranks are a valid replica size of ``layout`` and, when ``config`` is given, split the sizes its
    family names (:func:`problems`). The one answer to "does this size fit": the strategies' size resolver
    (:mod:`lightning_tp2d.sizes`), ``tp2d-train``'s checks, the planner and the trace all ask it."""
    return not problems(get_layout(layout), p, config)


def auto_tensor_parallel_size(layout: str | Layout, per_node: int, world: int, config: Any = None) -> int:
    """Largest ``p`` dividing the devices of one node (and so the world) that :func:`fits` ``layout`` and, if
    ``config`` is known, splits its family's sizes; 1 when no larger one does."""
    spec = get_layout(layout)
    return next((p for p in range(per_node, 1, -1) if per_node % p == 0 and world % p == 0 and fits(spec, p, config)),
                1)


# ---- GPT-2 ---------------------------------------------------------------------------------------------------


def _gpt2_roles(model: nn.Module) -> list[tuple[str, str]]:
    roles = [("transformer.wte", "wte"), ("transformer.wpe", "wpe")]
    for i in range(len(model.transformer.h)):
        prefix = f"transformer.h.{i}"
        roles += [(f"{prefix}.ln_1", "norm"), (f"{prefix}.attn", "attn"), (f"{prefix}.ln_2", "norm"),
                  (f"{prefix}.mlp", "mlp")]
    return roles + [("transformer.ln_f", "norm"), ("lm_head", "lm_head")]


# Roles: wte and wpe (the token and position embeddings), norm (every LayerNorm: ln_1, ln_2, ln_f), attn, mlp and
# lm_head (built from the token embedding's parallel weight, to which it is tied).


GPT2_PLANS = {
    "2d": {"wte": TokenEmbedding2D, "wpe": PositionEmbedding2D, "norm": LayerNorm2D, "attn": Attention2D,
           "mlp": MLP2D, "lm_head": LMHead2D},
    "metp": {"wte": RingTokenEmbedding, "wpe": RingPositionEmbedding, "norm": RingLayerNorm, "attn": RingAttention,
             "mlp": RingMLP, "lm_head": RingLMHead},
    "2d-metp": {"wte": TokenEmbedding2DMetp, "wpe": PositionEmbedding2DMetp, "norm": LayerNorm2D,
                "attn": Attention2DMetp, "mlp": MLP2D, "lm_head": LMHead2DMetp},
}


register_family(ModelFamily(
    name="gpt2", model_class=GPT2, config_class=GPT2Config, module_roles=_gpt2_roles,
    plans=GPT2_PLANS, blocks="transformer.h",
    tied=lambda model: {"lm_head": "transformer.wte"}, hf=gpt2.HF_FORMAT,
    anatomy=lambda c: Anatomy(gated_mlp=False, rotary=False, rms_norm=False, fused_qkv=True, mlp_width=4 * c.n_embd,
                              kv_width=c.n_embd, kv_heads=c.n_head, tied_head=True)))


# ---- Llama ---------------------------------------------------------------------------------------------------


def _llama_roles(model: nn.Module) -> list[tuple[str, str]]:
    roles = [("model.embed_tokens", "embed")]
    for i in range(len(model.model.layers)):
        prefix = f"model.layers.{i}"
        roles += [(f"{prefix}.self_attn", "attn"), (f"{prefix}.mlp", "mlp"), (f"{prefix}.input_layernorm", "norm"),
                  (f"{prefix}.post_attention_layernorm", "norm")]
    return roles + [("model.norm", "norm"), ("lm_head", "lm_head" if model.config.tie_embeddings else "untied_head")]


def _llama_sizes(config: Any, layout: Layout) -> list[tuple[str, int]]:
    # head-split layouts split whole heads; otherwise ("metp") the k/v projections' rows are split as blocks
    heads = ([("n_head", config.n_head), ("n_kv_head", config.n_kv_head)] if layout.splits_heads
             else [("n_kv_head*head_size", config.n_kv_head * config.head_size)])
    return heads + [("n_embd", config.n_embd), ("intermediate_size", config.intermediate_size)]


LLAMA_PLANS = {
    "2d": {"embed": TokenEmbedding2D, "norm": RMSNorm2D, "attn": LlamaAttention2D, "mlp": SwiGLU2D,
           "lm_head": LMHead2D, "untied_head": UntiedLMHead2D},
    "metp": {"embed": RingTokenEmbedding, "norm": RingRMSNorm, "attn": RingLlamaAttention, "mlp": RingSwiGLU,
             "lm_head": RingLMHead, "untied_head": UntiedRingLMHead},
    "2d-metp": {"embed": TokenEmbedding2DMetp, "norm": RMSNorm2D, "attn": LlamaAttention2DMetp, "mlp": SwiGLU2D,
                "lm_head": LMHead2DMetp, "untied_head": UntiedLMHead2DMetp},
}


# Roles: embed (model.embed_tokens), norm (every RMSNorm), attn, mlp, lm_head (tied: from embed_tokens' parallel
# weight) or untied_head (its own weight).
register_family(ModelFamily(
    name="llama", model_class=Llama, config_class=LlamaConfig, module_roles=_llama_roles,
    plans=LLAMA_PLANS, blocks="model.layers",
    tied=lambda model: {"lm_head": "model.embed_tokens"} if model.config.tie_embeddings else {},
    split_sizes=_llama_sizes, hf=llama.HF_FORMAT,
    anatomy=lambda c: Anatomy(gated_mlp=True, rotary=True, rms_norm=True, fused_qkv=False,
                              mlp_width=c.intermediate_size, kv_width=c.n_kv_head * c.head_size,
                              kv_heads=c.n_kv_head, tied_head=bool(c.tie_embeddings))))

def model_config(model: Any) -> Any:
    """The config a ``model`` argument stands for: a named size of any registered family (``"gpt2-tiny"``,
    ``"llama-tiny"`` ...: each family's config class's ``from_name``), a config instance of a registered family
    (itself), or a config's fields as a dict (the family whose config class has exactly those fields)."""
    if isinstance(model, str):
        errors = []  # each family's own "unknown ... config" message, with its valid names
        for fam in families():
            from_name = getattr(fam.config_class, "from_name", None)
            if from_name is None:
                continue
            try:
                return from_name(model)
            except ValueError as err:
                errors.append(str(err))
        raise ValueError("; ".join(errors) or f"unknown model name {model!r}")
    if isinstance(model, Mapping):
        matches = []
        for fam in families():
            if not dataclasses.is_dataclass(fam.config_class):
                continue
            fields = dataclasses.fields(fam.config_class)
            required = {f.name for f in fields if f.default is dataclasses.MISSING
                        and f.default_factory is dataclasses.MISSING}
            if required <= set(model) <= {f.name for f in fields}:
                matches.append(fam)
        if len(matches) != 1:
            raise ValueError(f"model fields {sorted(model)} match the config of "
                             f"{[f.name for f in matches] or 'no registered model family'}; pass a config instance "
                             f"({', '.join(f.config_class.__name__ for f in families())}) or a named size")
        return matches[0].config_class(**model)
    if family_of_config(model) is None:
        raise TypeError(f"model must be a named size, a dict or a config of a registered model family "
                        f"({', '.join(f.config_class.__name__ for f in families())}), got {type(model).__name__}")
    return model


__all__ = ["Anatomy", "ModelFamily", "anatomy", "auto_tensor_parallel_size", "default_sizes", "families",
           "family_of", "family_of_config", "fits", "fused_qkv_suffixes", "get_family", "model_config", "problems",
           "register_family", "register_plan", "unregister_family"]
