"""Zigzag sequence sharding for the METP layouts (docs/layouts.md, "metp" and "2d-metp").

A sequence of ``T`` tokens is cut into ``2n`` chunks of ``c = T/(2n)``; coordinate ``i`` of an ``n``-rank axis
keeps chunks ``i`` and ``2n-1-i`` (an early and a late one, so causal attention work is balanced), in that
order: its ``S = 2c`` local rows are global positions ``[i*c, (i+1)*c) ∪ [(2n-1-i)*c, (2n-i)*c)``.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from lightning_tp2d.comm import all_gather_along, axis_rank, axis_size
from lightning_tp2d.layouts import Layout
from lightning_tp2d.ops import registered


def check_sequence_length(seq: int, layout: Layout, p: int) -> None:
    """``ValueError`` (the layout's message) unless ``seq`` splits into the layout's zigzag chunks on ``p`` ranks
    (checked before any communication)."""
    problem = layout.sequence_problem(p, seq)
    if problem:
        raise ValueError(problem)


def zigzag_positions(seq: int, n: int, i: int, device=None) -> torch.Tensor:
    """Global positions ``[2c]`` of the rows coordinate ``i`` of ``n`` keeps (chunks ``i`` and ``2n-1-i``)."""
    c = seq // (2 * n)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device),
                      torch.arange((2 * n - 1 - i) * c, (2 * n - i) * c, device=device)])


def zigzag_inverse(seq: int, n: int, device=None) -> torch.Tensor:
    """Index that puts rows gathered in coordinate order (``n`` blocks of ``2c``) back in sequence order."""
    order = torch.cat([zigzag_positions(seq, n, i) for i in range(n)])
    return torch.argsort(order).to(device)


@registered("gather_sequence")
class _GatherSequence(torch.autograd.Function):
    """Forward: all-gather the zigzag shards ``[B, S, ...]`` along ``axis`` into ``[B, T, ...]`` in sequence
    order on every rank. Backward: keep this rank's rows (the output is replicated: every rank computes the
    same function of it, as with :func:`~lightning_tp2d.nn.functional.gather_grid`)."""

    @staticmethod
    def forward(ctx, x, mesh, axis):
        n, i = axis_size(mesh, axis), axis_rank(mesh, axis)
        seq = x.shape[1] * n
        ctx.rows = zigzag_positions(seq, n, i, x.device)
        full = all_gather_along(x.contiguous(), mesh, axis, dim=1)
        return full.index_select(1, zigzag_inverse(seq, n, x.device))

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(1, ctx.rows), None, None


def gather_sequence(x: torch.Tensor, mesh: DeviceMesh, axis: str) -> torch.Tensor:
    return _GatherSequence.apply(x, mesh, axis)
