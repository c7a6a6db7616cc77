"""SUMMA matrix products on the ``q x q`` grid, as autograd functions.

Every operand is a matrix cut into ``q x q`` equal blocks, block ``(i, j)`` held by grid rank ``(i, j)``
(``row`` coordinate ``i``, ``col`` coordinate ``j``). The three products and their communication per step
``l = 0..q-1`` (Optimus, Xu et al. 2021):

=================  =========================================================  ================================
product            rank (i, j) at step l                                      result block at (i, j)
=================  =========================================================  ================================
``C = A B``        bcast ``A_il`` along col, ``B_lj`` along row; ``C_ij += A_il B_lj``   ``C_ij``
``C = A Bᵀ``       bcast ``B_lj`` along row; ``P = A_ij B_ljᵀ``; reduce P along col to col l  ``C_ij``
``C = Aᵀ B``       bcast ``A_il`` along col; ``P = A_ilᵀ B_ij``; reduce P along row to row l  ``C_ij``
=================  =========================================================  ================================

Each backward is written with its two siblings (``d(AB)``: ``dA = dC Bᵀ``, ``dB = Aᵀ dC``; and so on), so
a forward broadcast becomes a backward reduce to the owning rank. The broadcast for step ``l+1`` is posted
before the multiply of step ``l`` (double-buffered panels); the reduce of step ``l`` runs while step ``l+1``
multiplies. No rank ever holds more than two panels of an operand, never a full matrix.

Blocks may be passed as transposed views of contiguous storage (``w_local.t()`` for a torch ``Linear``
weight stored ``[out, in]``): the storage is what travels, and the receiver transposes its view. All ranks
must pass blocks of the same shape and layout.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from lightning_tp2d.comm import BroadcastPipeline, ReducePipeline, axis_size


def _is_transposed(t: torch.Tensor) -> bool:
    """True for a 2-D transposed view of contiguous storage (``x.t()`` of a contiguous ``x``)."""
    return t.dim() == 2 and not t.is_contiguous() and t.t().is_contiguous()


def _wire(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The contiguous tensor to send for block ``t``, and whether the receiver must transpose it back."""
    if _is_transposed(t):
        return t.t(), True
    return t.contiguous(), False


class _Panels:
    """Double-buffered broadcasts of one operand's blocks along ``axis`` (see :class:`BroadcastPipeline`),
    sending transposed views as their contiguous storage."""

    def __init__(self, block: torch.Tensor, mesh: DeviceMesh, axis: str) -> None:
        wire, self.transposed = _wire(block)
        self.pipeline = BroadcastPipeline(wire, mesh, axis)

    def get(self, l: int) -> torch.Tensor:
        buf = self.pipeline.get(l)
        return buf.t() if self.transposed else buf


def summa_ab_local(a: torch.Tensor, b: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``C = A B`` on local blocks, no autograd. ``a`` [M/q, K/q], ``b`` [K/q, N/q] -> [M/q, N/q]."""
    q = axis_size(mesh, "col")
    a_panels, b_panels = _Panels(a, mesh, "col"), _Panels(b, mesh, "row")
    out = None
    for l in range(q):
        a_l, b_l = a_panels.get(l), b_panels.get(l)
        out = a_l @ b_l if out is None else out.addmm_(a_l, b_l)
    return out


def summa_abt_local(a: torch.Tensor, b: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``C = A Bᵀ`` on local blocks, no autograd. ``a`` [M/q, K/q], ``b`` [N/q, K/q] -> [M/q, N/q]."""
    q = axis_size(mesh, "col")
    b_panels, reducer = _Panels(b, mesh, "row"), ReducePipeline(mesh, "col")
    for l in range(q):
        reducer.push(a @ b_panels.get(l).t(), dst=l)
    return reducer.finish()


def summa_atb_local(a: torch.Tensor, b: torch.Tensor, mesh: DeviceMesh, out_transposed: bool = False) -> torch.Tensor:
    """``C = Aᵀ B`` on local blocks, no autograd. ``a`` [M/q, K/q], ``b`` [M/q, N/q] -> [K/q, N/q].

    With ``out_transposed`` the result is returned as the transposed view of a contiguous ``[N/q, K/q]``
    block (the layout of a torch ``Linear`` weight gradient), computed as ``Bᵀ A`` with no extra copy.
    """
    q = axis_size(mesh, "col")
    a_panels, reducer = _Panels(a, mesh, "col"), ReducePipeline(mesh, "row")
    for l in range(q):
        a_l = a_panels.get(l)
        reducer.push(b.t() @ a_l if out_transposed else a_l.t() @ b, dst=l)
    out = reducer.finish()
    return out.t() if out_transposed else out


class _SummaAB(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, mesh):
        ctx.save_for_backward(a, b)
        ctx.mesh = mesh
        return summa_ab_local(a, b, mesh)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad = grad.contiguous()
        da = summa_abt_local(grad, b, ctx.mesh) if ctx.needs_input_grad[0] else None  # dA = dC Bᵀ
        db = summa_atb_local(a, grad, ctx.mesh, _is_transposed(b)) if ctx.needs_input_grad[1] else None  # dB = Aᵀ dC
        return da, db, None


class _SummaABt(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, mesh):
        ctx.save_for_backward(a, b)
        ctx.mesh = mesh
        return summa_abt_local(a, b, mesh)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad = grad.contiguous()
        da = summa_ab_local(grad, b, ctx.mesh) if ctx.needs_input_grad[0] else None  # dA = dC B
        db = summa_atb_local(grad, a, ctx.mesh, _is_transposed(b)) if ctx.needs_input_grad[1] else None  # dB = dCᵀ A
        return da, db, None


class _SummaAtB(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, mesh):
        ctx.save_for_backward(a, b)
        ctx.mesh = mesh
        return summa_atb_local(a, b, mesh)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad = grad.contiguous()
        da = summa_abt_local(b, grad, ctx.mesh) if ctx.needs_input_grad[0] else None  # dA = B dCᵀ
        db = summa_ab_local(a, grad, ctx.mesh) if ctx.needs_input_grad[1] else None  # dB = A dC
        return da, db, None


def summa_ab(a: torch.Tensor, b: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``C = A B`` with ``A``, ``B``, ``C`` block-distributed on the grid; differentiable."""
    return _SummaAB.apply(a, b, mesh)


def summa_abt(a: torch.Tensor, b: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``C = A Bᵀ`` with ``A``, ``B``, ``C`` block-distributed on the grid; differentiable."""
    return _SummaABt.apply(a, b, mesh)


def summa_atb(a: torch.Tensor, b: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``C = Aᵀ B`` with ``A``, ``B``, ``C`` block-distributed on the grid; differentiable."""
    return _SummaAtB.apply(a, b, mesh)
