"""Float8 linear products (``parallel.float8``): torchao's recipes, on the layouts' own products.

A recipe names how each GEMM of a linear casts its operands to float8 (torchao's ``Float8LinearConfig``, read from
torchao itself so that the layouts and the torchao rivals run the same recipe):

==============  =======================================================================================================
``tensorwise``  one scale per tensor (input, weight: ``e4m3``; output gradient: ``e5m2``), from the tensor's global
                amax. Every rank casts its own block with the *global* scale: the amax of its block is all-reduced
                (``max``) over the axes that split the tensor first (``row`` and ``col`` on the grid, the ring; one
                small collective per product and pass, on the device: no host sync). The blocks then travel *as
                float8*: SUMMA's panels and weight columns, the ring's weight blocks carry one byte per element
                (half of bf16's), and every partial product is one ``torch._scaled_mm`` with the two global scales,
                so a product equals the plain model's float8 product up to the order of its fp32 partial sums. The
                ring MLP's hidden block and its gradient exist one step at a time: each is cast where it is
                multiplied, with its own amax (:class:`TensorwiseGemm`'s ``cast_dtype``).
``rowwise``     one scale per row of the left operand and per column of the right one, over the GEMM's contraction
                (``e4m3`` throughout, power-of-two scales), cast again for each of the three GEMMs from the operands
                in high precision (as torchao does). In the layouts each partial product's operands are cast where
                they are multiplied, with scales over that partial's block of the contraction: finer than torchao's
                scale over the whole row, so a product equals the plain model's within float8 rounding, not to its
                bits. Blocks travel in high precision (the scales of a block differ per partial).
==============  =======================================================================================================

Master weights, the optimizer, norms, attention, the LM head and the loss stay as they are; only the linears' GEMMs
change. On CPU ``torch._scaled_mm`` runs as an emulation (for numerics; it is not faster there). torchao is an
optional dependency (``pip install "lightning-tp2d[float8]"``); it is imported only when a recipe is chosen.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from lightning_tp2d.comm import FLOAT8_DTYPES, all_reduce_along
from lightning_tp2d.options import FLOAT8_RECIPES as RECIPES
from lightning_tp2d.options import check_float8 as check_recipe

__all__ = ["RECIPES", "check_recipe", "recipe_config", "float8_supported", "float8_notice", "cast", "tensorwise_cast",
           "Gemm", "HIGH", "TensorwiseGemm", "RowwiseGemm", "role_dtype", "cast_global", "product", "forward_products",
           "backward_products", "linear_configs", "linear", "is_float8_linear", "convert_plain",
           "precompute_fsdp_scales"]


_AO: tuple | None = None  # (torchao.float8, float8_ops, float8_utils) once imported


def _torchao():
    """torchao's float8 modules, imported once (outside any compiled region: a layer built with a recipe imports
    them, :func:`recipe_config`; torchao 0.18 fails to import inside a Dynamo trace)."""
    global _AO
    if _AO is not None:
        return _AO
    from lightning_tp2d.quiet import quiet_loggers

    try:
        with quiet_loggers("torchao", "torch.utils._pytree"):
            import torchao.float8 as ao_float8
            from torchao.float8 import float8_ops, float8_utils
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("float8 training needs torchao (pip install \"lightning-tp2d[float8]\" or "
                          "pip install torchao)") from err
    _AO = (ao_float8, float8_ops, float8_utils)
    return _AO


@functools.cache
def recipe_config(recipe: str):
    """torchao's ``Float8LinearConfig`` of ``recipe`` (its own ``from_recipe_name``)."""
    ao_float8, _, _ = _torchao()
    return ao_float8.Float8LinearConfig.from_recipe_name(check_recipe(recipe))


def float8_supported(device: torch.device | str | None = None) -> tuple[bool, str]:
    """``(ok, why)``: whether ``torch._scaled_mm`` runs on ``device`` (a CUDA GPU needs compute capability 8.9 or
    later: Ada, Hopper, Blackwell; the CPU build runs it as an emulation)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda":
        return True, "emulated on the CPU (for numerics, not speed)"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return False, (f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) has no float8 "
                       f"GEMMs; float8 needs 8.9 or later (H100, H200, L40S, B200)")
    return True, f"float8 GEMMs on compute capability {major}.{minor}"


def float8_notice(recipe: str) -> str | None:
    """What a run with ``recipe`` says before it starts: ``None`` on a GPU with float8 GEMMs, one line when they are
    emulated (the CPU); a ``ValueError`` naming the GPU when it has none, or when torchao is missing."""
    _torchao()
    ok, why = float8_supported()
    if not ok:
        raise ValueError(f"float8={recipe!r}: {why}")
    if not torch.cuda.is_available():
        return f"float8={recipe!r}: torch._scaled_mm is {why}"
    return None


# ---- casts -----------------------------------------------------------------------------------------------------


def cast(tensor: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torchao's cast: ``tensor`` (in float32) times ``scale``, saturated to ``dtype``; keeps ``tensor``'s strides (a
    transposed view casts to a transposed view of contiguous codes)."""
    return _torchao()[2].to_fp8_saturated(tensor.to(torch.float32) * scale, dtype)


def tensorwise_cast(tensors, dtypes, mesh=None, axes=()):
    """Each of ``tensors`` cast to its ``dtypes`` entry with its *global* tensorwise scale: the amaxes of the local
    blocks, stacked, are all-reduced (``max``) over each of ``axes`` of ``mesh`` in one call per axis (on the device), then
    turned into scales by torchao. Returns ``(codes, scales)``, ``scales[i]`` the 0-d scale of ``tensors[i]``."""
    _, _, utils = _torchao()
    amax = torch.stack([t.detach().abs().amax() for t in tensors]).to(torch.float32)
    for axis in axes:
        all_reduce_along(amax, mesh, axis, op="max")
    scales = [utils.amax_to_scale(m, dtype) for m, dtype in zip(amax.unbind(0), dtypes)]
    return [cast(t.detach(), s, dtype) for t, s, dtype in zip(tensors, scales, dtypes)], scales


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _col_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(0) == 1 and t.dim() == 2 else t.t().contiguous().t()


# ---- GEMMs -----------------------------------------------------------------------------------------------------


class Gemm:
    """The products of one matrix multiply's partial GEMMs, in high precision: what the SUMMA algorithms call for
    every partial (``a @ b``, the first partial with its bias, accumulation, a product into a slot)."""

    def out_dtype(self, a: torch.Tensor) -> torch.dtype:
        return a.dtype

    def mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b

    def first(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``[bias +] a @ b``, the bias added by the GEMM itself (no pass of its own)."""
        return a @ b if bias is None else torch.addmm(bias, a, b)

    def addmm_(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return out.addmm_(a, b)

    def into(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        torch.mm(a, b, out=out)


HIGH = Gemm()


class TensorwiseGemm(Gemm):
    """Partial GEMMs under tensorwise scaling: ``torch._scaled_mm`` with the operands' inverse scales (0-d, so their
    order does not matter), accumulating in float32, written in ``out_dtype``. An operand that arrives as float8 was
    cast with its global scale (``scales``: one per such operand); one that arrives in high precision (a ring's
    per-step MLP hidden block or its gradient, which never exist whole) is cast here with its own amax, to
    ``cast_dtype``."""

    def __init__(self, scales, out_dtype: torch.dtype, fast_accum: bool, cast_dtype: torch.dtype | None = None) -> None:
        self.inverse = [s.reciprocal() for s in scales]
        self.dtype, self.fast_accum, self.cast_dtype = out_dtype, fast_accum, cast_dtype

    def out_dtype(self, a: torch.Tensor) -> torch.dtype:
        return self.dtype

    def _operand(self, t: torch.Tensor, inverse: list) -> torch.Tensor:
        if t.dtype in FLOAT8_DTYPES:
            return t
        (t,), (scale,) = tensorwise_cast([t], [self.cast_dtype])
        inverse.append(scale.reciprocal())
        return t

    def _scaled(self, a, b, bias=None, out=None):
        inverse = list(self.inverse)
        a, b = self._operand(a, inverse), self._operand(b, inverse)
        return torch._scaled_mm(_row_major(a), _col_major(b), inverse[0], inverse[1], bias=bias,
                                out_dtype=self.dtype, use_fast_accum=self.fast_accum,
                                **({} if out is None else {"out": out}))

    def mm(self, a, b):
        return self._scaled(a, b)

    def first(self, a, b, bias):
        if bias is None:
            return self._scaled(a, b)
        if self.dtype == torch.float32:  # _scaled_mm adds no bias to a float32 output on CUDA
            return self._scaled(a, b).add_(bias)
        return self._scaled(a, b, bias=bias)

    def addmm_(self, out, a, b):
        return out.add_(self._scaled(a, b))

    def into(self, a, b, out):
        self._scaled(a, b, out=out)


class RowwiseGemm(Gemm):
    """Partial GEMMs of two high-precision operands, each cast where it is multiplied: the left one per row, the
    right one per column, over this GEMM's contraction (torchao's axiswise cast and its ``_scaled_mm`` call)."""

    def __init__(self, dtype: torch.dtype, round_pow2: bool, fast_accum: bool) -> None:
        self.dtype, self.round_pow2, self.fast_accum = dtype, round_pow2, fast_accum

    def _cast(self, t: torch.Tensor, dim: int):
        _, _, utils = _torchao()
        t = t.detach()
        scale = utils.amax_to_scale(t.abs().amax(dim=dim, keepdim=True), self.dtype, self.round_pow2)
        return cast(t, scale, self.dtype), scale

    def mm(self, a, b, bias=None):
        a8, sa = self._cast(a, -1)
        b8, sb = self._cast(b, 0)
        return _torchao()[1].addmm_float8_unwrapped(_row_major(a8), sa, _col_major(b8), sb, a.dtype, bias=bias,
                                                    use_fast_accum=self.fast_accum)

    def first(self, a, b, bias):
        return self.mm(a, b, bias=None if bias is None else bias.to(a.dtype))

    def addmm_(self, out, a, b):
        return out.add_(self.mm(a, b))

    def into(self, a, b, out):
        out.copy_(self.mm(a, b))


# ---- one kernel's casts and GEMMs -------------------------------------------------------------------------------

_ROLE_CAST = {"input": "cast_config_input", "weight": "cast_config_weight", "grad": "cast_config_grad_output"}
_PASS_GEMM = {"output": "gemm_config_output", "grad_input": "gemm_config_grad_input",
              "grad_weight": "gemm_config_grad_weight"}


def role_dtype(recipe: str, role: str) -> torch.dtype:
    """The float8 dtype ``recipe`` casts a GEMM operand of ``role`` (``"input"``, ``"weight"``, ``"grad"``) to."""
    return getattr(recipe_config(recipe), _ROLE_CAST[role]).target_dtype


def cast_global(recipe: str, tensors, roles, mesh=None, axes=()):
    """``(tensors, scales)`` of a kernel's operands that travel or are reused: under ``tensorwise`` cast once with
    their global scales (amaxes all-reduced over ``axes``: the ones that split them); under ``rowwise`` as they are,
    no scales (each GEMM casts its own)."""
    if recipe != "tensorwise":
        return list(tensors), ()
    return tensorwise_cast(tensors, [role_dtype(recipe, r) for r in roles], mesh, axes)


def product(recipe: str, scales, out_dtype: torch.dtype, gemm_pass: str = "output",
            cast_role: str | None = None) -> Gemm:
    """The GEMMs of one product of a kernel: ``scales`` of its operands cast by :func:`cast_global` (tensorwise),
    ``gemm_pass`` the linear's GEMM it is (``"output"``, ``"grad_input"``, ``"grad_weight"``: torchao's fast
    accumulation setting of each), ``cast_role`` the role of an operand that arrives in high precision (cast at the
    product with its own amax)."""
    config = recipe_config(recipe)
    fast = getattr(config, _PASS_GEMM[gemm_pass]).use_fast_accum
    if recipe == "tensorwise":
        return TensorwiseGemm(scales, out_dtype, fast, None if cast_role is None else role_dtype(recipe, cast_role))
    return RowwiseGemm(config.cast_config_input.target_dtype, config.round_scales_to_power_of_2, fast)


def forward_products(recipe: str, x: torch.Tensor, w: torch.Tensor, mesh, axes, out_dtype: torch.dtype):
    """``(x, w, gemm, scales)`` of a linear's forward ``x @ w`` (``w`` as the product takes it) split over ``axes``:
    the operands cast by :func:`cast_global` (tensorwise: cast once, saved and sent as float8) and its GEMMs."""
    (x, w), scales = cast_global(recipe, [x, w], ["input", "weight"], mesh, axes)
    return x, w, product(recipe, scales, out_dtype), scales


def backward_products(recipe: str, grad: torch.Tensor, scales, mesh, axes, input_grad_dtype: torch.dtype,
                      weight_grad_dtype: torch.dtype):
    """``(grad, (input-gradient GEMMs, weight-gradient GEMMs))`` of the backward of a linear whose forward
    :func:`forward_products` made (``scales``: its tensorwise scales, input's then weight's; none under rowwise):
    ``grad`` cast by :func:`cast_global`; ``dX = dY Wᵀ`` multiplies it with the weight, ``dW = Xᵀ dY`` with the
    input, each written in its dtype (a ring's weight gradients in its float32 accumulation dtype)."""
    (grad,), grad_scale = cast_global(recipe, [grad], ["grad"], mesh, axes)
    scale_x, scale_w = scales or (None, None)
    pick = lambda s: (*grad_scale, s) if grad_scale else ()  # noqa: E731 - tensorwise: the operands' scales
    return grad, (product(recipe, pick(scale_w), input_grad_dtype, "grad_input"),
                  product(recipe, pick(scale_x), weight_grad_dtype, "grad_weight"))


# ---- a layout's local linear (a 1x1 grid, a ring of one) -------------------------------------------------------


def linear_configs(recipe: str) -> tuple:
    """``(Float8LinearConfig, LinearMMConfig)`` of ``recipe``, as torchao's ``Float8Linear`` builds them: what a layer
    keeps as attributes and passes to :func:`linear` (under ``torch.compile`` Dynamo reads them from the module)."""
    return recipe_config(recipe), _mm_config(recipe)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, configs: tuple) -> torch.Tensor:
    """``F.linear`` in float8: torchao's own ``Float8Linear`` product (its autograd function; ``configs`` from
    :func:`linear_configs`), what a layout's local linear runs on one rank so that it equals the plain model
    converted by torchao."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    if torch.is_autocast_enabled():
        x = x.to(torch.get_autocast_dtype("cuda" if x.is_cuda else "cpu"))
    out = matmul_with_hp_or_float8_args.apply(x, weight.t(), configs[1], configs[0])
    return out if bias is None else out + bias.to(out.dtype)


@functools.cache
def _mm_config(recipe: str):
    ao_float8, _, _ = _torchao()
    c = recipe_config(recipe)
    make = lambda gemm: ao_float8.ScaledMMConfig(c.emulate, gemm.use_fast_accum, False, c.pad_inner_dim)  # noqa: E731
    return ao_float8.LinearMMConfig(make(c.gemm_config_output), make(c.gemm_config_grad_input),
                                    make(c.gemm_config_grad_weight))


def is_float8_linear(module: torch.nn.Module) -> bool:
    """True for a torchao ``Float8Linear`` (what :func:`convert_plain` makes of an ``nn.Linear``)."""
    return type(module).__name__ == "Float8Linear"


def convert_plain(model: torch.nn.Module, recipe: str | None, skip=("lm_head",),
                  fsdp_float8_all_gather: bool = False) -> torch.nn.Module:
    """The plain model's ``nn.Linear`` layers as torchao's ``Float8Linear`` (``convert_to_float8_training``), all but
    those named in ``skip`` (the head stays in high precision, as in the layouts); in place, returned.
    ``fsdp_float8_all_gather`` (tensorwise only): torchao's ``enable_fsdp_float8_all_gather``, so that FSDP2
    all-gathers those weights as float8 (each shard cast with the weight's global amax before the gather: one byte
    per element instead of bf16's two), as torchtitan offers with tensorwise scaling; call
    :func:`precompute_fsdp_scales` after each optimizer step to compute every weight's amax in one all-reduce."""
    if check_recipe(recipe) is None:
        if fsdp_float8_all_gather:
            raise ValueError("fsdp_float8_all_gather needs a float8 recipe (tensorwise)")
        return model
    if fsdp_float8_all_gather and recipe != "tensorwise":
        raise ValueError(f"fsdp_float8_all_gather: torchao gathers float8 weights with tensorwise scaling only, "
                         f"got float8={recipe!r}")
    ao_float8, _, _ = _torchao()
    config = recipe_config(recipe)
    if fsdp_float8_all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    keep = lambda module, name: not any(name == s or name.endswith("." + s) for s in skip)  # noqa: E731
    return ao_float8.convert_to_float8_training(model, config=config, module_filter_fn=keep)


def precompute_fsdp_scales(model: torch.nn.Module) -> None:
    """torchao's ``precompute_float8_dynamic_scale_for_fsdp``: after an optimizer step, every float8-gathered
    weight's amax in one all-reduce (else each FSDP all-gather computes its own). A no-op for a model without
    them."""
    ao_float8, _, _ = _torchao()
    ao_float8.precompute_float8_dynamic_scale_for_fsdp(model)
