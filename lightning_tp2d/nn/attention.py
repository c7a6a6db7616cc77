"""``Attention2D`` and ``MLP2D``: GPT-2's two sublayers with SUMMA linears and local compute.

Attention (docs/layouts.md, "2d"): after the QKV SUMMA, rank ``(r, c)`` holds q, k and v of its batch shard ``r`` for
head group ``c`` (heads split over ``col``), because ``c_attn``'s output columns are regrouped so that ``col``
block ``c`` holds ``[q_c | k_c | v_c]`` (see :class:`~lightning_tp2d.nn.linear.Linear2D` ``out_groups``).
Attention itself is local ``scaled_dot_product_attention`` (flash / memory-efficient kernels on GPU); its
output ``[B/q, T, h/q]`` is exactly ``c_proj``'s input block.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from lightning_tp2d import recompute
from lightning_tp2d.layouts import Grid2D, Layout, document_layouts
from lightning_tp2d.models.gpt2 import causal_attention
from lightning_tp2d.nn.functional import axis_index, is_local_grid
from lightning_tp2d.nn.linear import Linear2D

LAYOUT = Grid2D()  # the layout these layers serve (and llama2d's): named in their refusals


class Attention2D(nn.Module):
    """SUMMA QKV, local causal attention of head group ``c``, SUMMA output projection. ``options``
    (:class:`~lightning_tp2d.options.TPOptions`): the SUMMA fields, for both linears."""

    def __init__(self, attn: nn.Module, mesh: DeviceMesh, *, options=None) -> None:
        super().__init__()
        q = axis_index(mesh, "col")[1]
        self.n_head, self.n_embd, self.dropout = attn.n_head, attn.n_embd, attn.dropout
        self.local_heads = self.n_head // q
        self.c_attn = Linear2D(attn.c_attn, mesh, out_groups=3, options=options)
        self.c_proj = Linear2D(attn.c_proj, mesh, options=options)
        self.resid_dropout = nn.Dropout(attn.resid_dropout.p)
        self.local = is_local_grid(mesh)  # (read by "2d-metp"'s attention: a 1x1 grid needs no ring)

    def forward(self, x: torch.Tensor, documents=None) -> torch.Tensor:
        refuse_documents(documents, LAYOUT)
        qkv = self.c_attn(x)  # (B/q, T, 3h/q): [q_c | k_c | v_c], head group c of batch shard r
        y = causal_attention(qkv, self.local_heads, self.dropout if self.training else 0.0)  # (B/q, T, h/q)
        return self.resid_dropout(self.c_proj(y))


def refuse_documents(documents, layout: Layout) -> None:
    """``NotImplementedError`` when packed documents reach an attention layer of ``layout`` that has no document
    mask (the plain models and :func:`~lightning_tp2d.layouts.document_layouts` have one)."""
    if documents is not None:
        raise NotImplementedError(f"packed documents (doc_ids) are not implemented in layout {layout.name!r}; use "
                                  f"the plain model or one of {document_layouts()}")


class MLP2D(nn.Module):
    """``c_proj(gelu(c_fc(x)))``: two SUMMA linears around a local tanh-GELU. ``options``: as in
    :class:`Attention2D`."""

    def __init__(self, mlp: nn.Module, mesh: DeviceMesh, *, options=None) -> None:
        super().__init__()
        self.c_fc = Linear2D(mlp.c_fc, mesh, options=options)
        self.c_proj = Linear2D(mlp.c_proj, mesh, options=options)
        self.dropout = nn.Dropout(mlp.dropout.p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)
        g = recompute.mark(F.gelu(h, approximate="tanh"), lambda: F.gelu(h, approximate="tanh"))
        return self.dropout(self.c_proj(g))
