"""The layers' local math as plain torch under ``torch.compile``, communication as functional collectives.

Eagerly, the communicating layers are hand-written autograd functions (:mod:`lightning_tp2d.ops` turns them into
opaque custom ops under ``torch.compile``). An opaque op is one kernel to the compiler: nothing inside it is fused
with its neighbours, its outputs that alias inputs are copied, and an input it overwrites (the vocab-parallel loss's
logits) is copied first. Where a layer's communication is a plain all-reduce, its compiled form is written here in
plain torch instead, with the all-reduce a functional collective (``torch.distributed._functional_collectives``) that
Dynamo traces: the norms' statistics, the vocab-parallel loss, and the identity whose gradient is summed over an
axis. Autograd derives their backward and inductor fuses their elementwise work with the layers around them.

Under ``torch.compile`` only (each ``compiled_*`` caller checks ``torch.compiler.is_compiling()``): the eager path
keeps the hand-written backward, which dispatches fewer ops than autograd's (``tests/test_lean_grid.py``). The same
numbers either way, to rounding (``tests/test_compile.py``). Group names are read from the mesh at trace time
(:func:`lightning_tp2d.ops.group_name`) and are constants of the graph.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from lightning_tp2d.comm import axis_rank, axis_size
from lightning_tp2d.ops import group_name

IGNORE_INDEX = -100  # the target that counts for nothing (F.cross_entropy's default; nn.cross_entropy's too)


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group, both ways: every rank's output depends on every rank's input alike, so the gradient of
    each input is the sum of the output gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", group))

    @staticmethod
    def backward(ctx, grad):
        return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", ctx.group)), None


class _AllReduceToReplica(torch.autograd.Function):
    """Sum over the group forward; the identity backward. For a sum every rank then carries through the same
    computation (a replicated loss): each rank's gradient of it is already the whole gradient (Megatron's
    "reduce from the model-parallel region")."""

    @staticmethod
    def forward(ctx, x, group):
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", group))

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumGradient(torch.autograd.Function):
    """Identity forward; the gradient summed over the group backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", ctx.group)), None


class _SumGradients(torch.autograd.Function):
    """Identity on each tensor forward; backward, their gradients summed over the group in one all-reduce of the
    concatenation."""

    @staticmethod
    def forward(ctx, group, *xs):
        ctx.group, ctx.shapes = group, [x.shape for x in xs]
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        flat = funcol.wait_tensor(funcol.all_reduce(torch.cat([g.reshape(-1) for g in grads]), "sum", ctx.group))
        return (None, *(part.view(shape) for part, shape in
                         zip(flat.split([shape.numel() for shape in ctx.shapes]), ctx.shapes)))


def all_reduce_sum(x: torch.Tensor, mesh: DeviceMesh, axis: str) -> torch.Tensor:
    """``x`` summed over ``axis``, differentiable (the gradient is summed over ``axis`` too); ``x`` for one rank."""
    if axis_size(mesh, axis) == 1:
        return x
    return _AllReduceSum.apply(x, group_name(mesh, axis))


def all_reduce_to_replica(x: torch.Tensor, mesh: DeviceMesh, axis: str) -> torch.Tensor:
    """``x`` summed over ``axis`` for a computation every rank of ``axis`` then repeats alike (a replicated loss):
    the gradient passes back unchanged."""
    if axis_size(mesh, axis) == 1:
        return x
    return _AllReduceToReplica.apply(x, group_name(mesh, axis))


def all_reduce_max(x: torch.Tensor, mesh: DeviceMesh, axis: str) -> torch.Tensor:
    """The maximum over ``axis`` of a tensor no gradient flows through (a softmax's shift)."""
    if axis_size(mesh, axis) == 1:
        return x
    return funcol.wait_tensor(funcol.all_reduce(x.detach(), "max", group_name(mesh, axis)))


def sum_gradient(x: torch.Tensor, mesh: DeviceMesh, axis: str) -> torch.Tensor:
    """Identity, with the gradient summed over ``axis`` (a parameter replicated over ranks that see other tokens)."""
    if axis_size(mesh, axis) == 1:
        return x
    return _SumGradient.apply(x, group_name(mesh, axis))


def sum_gradients(xs, mesh: DeviceMesh, axis: str) -> tuple[torch.Tensor, ...]:
    """:func:`sum_gradient` of each of ``xs`` (one dtype), their gradients summed in one all-reduce."""
    xs = tuple(xs)
    if axis_size(mesh, axis) == 1:
        return xs
    return _SumGradients.apply(group_name(mesh, axis), *xs)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mesh: DeviceMesh, hidden: int,
               eps: float) -> torch.Tensor:
    """LayerNorm of ``x [..., h/q]`` over the hidden size ``h`` split along ``col`` (as ``LayerNorm2D``'s eager
    function): the shard's ``E[x]`` and ``E[x²]``, weighted by its share of ``h``, summed along ``col`` in one
    all-reduce; the statistics in float32 (float64 for float64)."""
    stat = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(stat)
    share = x.shape[-1] / hidden
    moments = torch.cat([xf.mean(-1, keepdim=True), (xf * xf).mean(-1, keepdim=True)], -1) * share
    mean, sq = all_reduce_sum(moments, mesh, "col").split(1, -1)
    rstd = torch.rsqrt((sq - mean * mean).clamp_min(0) + eps)
    y = (xf - mean) * rstd * weight
    return (y if bias is None else y + bias).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, mesh: DeviceMesh, hidden: int, eps: float) -> torch.Tensor:
    """RMSNorm of ``x [..., h/q]`` over the hidden size ``h`` split along ``col``: ``E[x²]`` summed along ``col``;
    the statistic in float32 (float64 for float64), the result cast back before the weight, as Llama's."""
    stat = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(stat)
    sq = all_reduce_sum((xf * xf).sum(-1, keepdim=True) / hidden, mesh, "col")
    return weight * (xf * torch.rsqrt(sq + eps)).to(x.dtype)


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, mesh: DeviceMesh, vocab_size: int,
                                 block_vocab: int | None = None) -> torch.Tensor:
    """The mean cross-entropy of vocab-split logits ``[N/q, width]`` (rank ``(r, c)``: block ``c``'s ids
    ``[c, c + 1) * block_vocab`` in its first columns, padding after), as
    :func:`lightning_tp2d.nn.cross_entropy.vocab_parallel_cross_entropy`; ``logits`` is not overwritten."""
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    c = axis_rank(mesh, "col")
    width = z.shape[-1]
    block_vocab = width if block_vocab is None else block_vocab
    start = c * block_vocab
    valid = max(0, min(block_vocab, vocab_size - start))
    if valid < width:  # padding columns (past V, or a GPU-shaped block's tail): out of the softmax
        z = z.masked_fill(torch.arange(width, device=z.device) >= valid, float("-inf"))
    shift = all_reduce_max(z.amax(-1, keepdim=True), mesh, "col")
    z = z - shift
    local_t = (targets - start).unsqueeze(-1)
    elsewhere = (local_t < 0) | (local_t >= valid)
    picked = z.gather(-1, local_t.masked_fill(elsewhere, 0)).masked_fill(elsewhere, 0)
    # every rank of the row goes on with the same per-token losses, every rank with the same mean
    sums = all_reduce_to_replica(torch.cat([z.exp().sum(-1, keepdim=True), picked], -1), mesh, "col")
    keep = (targets != IGNORE_INDEX).unsqueeze(-1)
    per_token = (torch.log(sums[:, :1]) - sums[:, 1:]) * keep
    totals = all_reduce_to_replica(torch.cat([per_token, keep.to(per_token.dtype)], -1).sum(0), mesh, "row")
    return totals[0] / totals[1].detach()
