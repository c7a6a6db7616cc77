"""The compiled forms of the communicating layers' local math (:mod:`lightning_tp2d.nn.traced`): plain torch with
functional all-reduces, against the hand-written autograd functions that run eagerly, in float64 on a 2x2 grid,
values and every gradient; and traced by Dynamo (``aot_eager``) to the same numbers.

``tests/test_compile.py`` runs whole compiled models against eager ones."""

from __future__ import annotations

import torch

from tests.distributed import run_distributed


def _grads(out, inputs, seed: int):
    g = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad(out, inputs, g)


def _worst(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _compare(rank: int, world: int) -> dict:
    import lightning_tp2d as tp
    from lightning_tp2d.nn import traced
    from lightning_tp2d.nn.cross_entropy import vocab_parallel_cross_entropy
    from lightning_tp2d.nn.functional import axis_index, sum_grads_along
    from lightning_tp2d.nn.layernorm import _LayerNormAlongCol
    from lightning_tp2d.nn.llama2d import _RMSNormAlongCol

    mesh = tp.init_mesh("2d", world, 1)
    r, _ = axis_index(mesh, "row")
    c, _ = axis_index(mesh, "col")
    gen = torch.Generator().manual_seed(10 * r + c)
    f64 = dict(dtype=torch.float64, generator=gen)
    out = {}

    x = torch.randn(6, 5, **f64).requires_grad_()
    w, b = torch.randn(5, **f64).requires_grad_(), torch.randn(5, **f64).requires_grad_()
    # the eager function sums its parameters' gradients over row itself; the traced form through sum_gradients
    y0 = _LayerNormAlongCol.apply(x, w, b, mesh, 10, 1e-5)
    y1 = traced.layer_norm(x, *traced.sum_gradients([w, b], mesh, "row"), mesh, 10, 1e-5)
    out["layer_norm"] = max(_worst([y0], [y1]), _worst(_grads(y0, (x, w, b), 1), _grads(y1, (x, w, b), 1)))
    y1 = traced.layer_norm(x, w, b, mesh, 10, 1e-5)
    y2 = torch.compile(traced.layer_norm, backend="aot_eager")(x, w, b, mesh, 10, 1e-5)
    out["layer_norm_compiled"] = max(_worst([y1], [y2]), _worst(_grads(y1, (x, w, b), 2), _grads(y2, (x, w, b), 2)))

    y0 = _RMSNormAlongCol.apply(x, w, mesh, 10, 1e-6)
    y1 = traced.rms_norm(x, traced.sum_gradient(w, mesh, "row"), mesh, 10, 1e-6)
    out["rms_norm"] = max(_worst([y0], [y1]), _worst(_grads(y0, (x, w), 3), _grads(y1, (x, w), 3)))

    # identity forward, gradients summed over row in one all-reduce
    a0, b0 = sum_grads_along([w, b], mesh, "row")
    a1, b1 = traced.sum_gradients([w, b], mesh, "row")
    out["sum_gradients"] = _worst(torch.autograd.grad(a0 * 2 + b0, (w, b), torch.ones(5, dtype=torch.float64)),
                                  torch.autograd.grad(a1 * 2 + b1, (w, b), torch.ones(5, dtype=torch.float64)))
    out["sum_gradient"] = _worst(torch.autograd.grad(traced.sum_gradient(w, mesh, "row") * 3, w,
                                                     torch.ones(5, dtype=torch.float64)),
                                 [torch.full((5,), 6.0, dtype=torch.float64)])  # 3 from each of the 2 row ranks

    # the vocab-parallel loss: V = 9 ids in blocks of 5 (the second block's last id is padding), a GPU-shaped width
    # of 8 (3 more padding columns per block), and a grid whose second block holds no id at all (V = 4, blocks of 5)
    tgen = torch.Generator().manual_seed(100 + r)  # the targets of a row's tokens, the same on its two ranks
    for name, vocab, block_vocab, width in (("ce", 9, 5, 5), ("ce_gpu_shaped", 9, 5, 8), ("ce_empty_block", 4, 5, 5)):
        logits = torch.randn(6, width, **f64).requires_grad_()
        targets = torch.randint(0, vocab, (6,), generator=tgen)
        targets[0] = -100
        loss0 = vocab_parallel_cross_entropy(logits * 1, targets, mesh, vocab, block_vocab)  # (overwrites its input)
        loss1 = traced.vocab_parallel_cross_entropy(logits, targets, mesh, vocab, block_vocab)
        g0, = torch.autograd.grad(loss0, logits)
        g1, = torch.autograd.grad(loss1, logits)
        out[name] = max(abs(loss0.item() - loss1.item()), _worst([g0], [g1]))
        out[name + "_loss"] = loss1.item()
    return out


def test_traced_layers_equal_the_eager_functions_on_a_2x2_grid():
    results = run_distributed(_compare, 4)
    for rank, out in enumerate(results):
        for name in ("layer_norm", "layer_norm_compiled", "rms_norm", "sum_gradients", "sum_gradient", "ce",
                     "ce_gpu_shaped", "ce_empty_block"):
            assert out[name] <= 1e-12, (rank, name, out[name])
    for name in ("ce", "ce_gpu_shaped", "ce_empty_block"):  # the loss is the same on every rank
        assert len({out[name + "_loss"] for out in results}) == 1
