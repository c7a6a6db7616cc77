"""Precision rules shared by the package's Lightning adapters (the Trainer strategy and the LightningModule).

Lightning's :class:`~lightning.pytorch.plugins.precision.MixedPrecision` refuses to clip gradients for any optimizer
that *can* unscale inside its own step (torch's fused AdamW / Adam / SGD set ``_step_supports_amp_scaling``):
"does not allow for gradient clipping because it performs unscaling of gradients internally". The refusal guards
``16-mixed``, whose :class:`~torch.amp.GradScaler` would hand the clip still-scaled gradients. ``bf16-mixed`` has no
scaler, so there is nothing to unscale, yet Lightning refuses all the same: a fused AdamW with
``gradient_clip_val`` (tp2d-train's GPU default) failed at the first optimizer step.
"""

from __future__ import annotations

import types

from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

__all__ = ["allow_clipping_without_scaler", "precision_name"]


def allow_clipping_without_scaler(plugin: Precision) -> Precision:
    """Let ``plugin`` clip for fused optimizers when it has no gradient scaler (``bf16-mixed``): its
    ``clip_gradients`` becomes the base :class:`Precision` rule (clip by norm or value through the plugin's own
    ``clip_grad_by_norm`` / ``clip_grad_by_value``, which :class:`~lightning_tp2d.strategy.TP2DStrategy` points at
    the shard-aware versions). A plugin with a scaler (``16-mixed``) keeps Lightning's refusal, which is right there.
    Idempotent; returns ``plugin``."""
    if isinstance(plugin, MixedPrecision) and plugin.scaler is None:
        plugin.clip_gradients = types.MethodType(Precision.clip_gradients, plugin)
    return plugin


def precision_name(plugin: Precision) -> str:
    """The Trainer ``precision`` string a plugin stands for (the class name when it is none we know)."""
    if isinstance(plugin, (MixedPrecision, HalfPrecision)):
        return plugin.precision
    if type(plugin) is Precision:
        return "32-true"
    return getattr(plugin, "precision", type(plugin).__name__)
