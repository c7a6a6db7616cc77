"""Each SUMMA product alone against ``torch.matmul`` on one device, on 2x2 (4 ranks) and 3x3 (9 ranks) grids.

Every rank builds the same full operands from one seed, keeps block ``(row, col)`` of each, runs the product
and its backward, and compares its output block and gradient blocks with the blocks of the single-device
result (float64 to 1e-12, float32 to 1e-5, relative to the largest reference entry). Blocks are non-square
(``M/q=3``, ``K/q=5``, ``N/q=4``). The ``B`` operand is also passed as the transposed view of contiguous
storage, as ``Linear2D`` passes ``w_local.t()``. Communication is counted around forward and backward
separately and compared with the schedule in ``summa.py``, bytes derived from the block shapes.

All checks of one grid run in a single ``run_distributed`` call (module-scoped fixture).
"""

from __future__ import annotations

import pytest
import torch

from lightning_tp2d import comm
from lightning_tp2d.mesh import grid_coords, init_mesh
from lightning_tp2d.summa import summa_ab, summa_abt, summa_atb
from tests.distributed import run_distributed

MB, KB, NB = 3, 5, 4  # block shape factors: A is [M, K] = [MB*q, KB*q], and so on
PRODUCTS = ("ab", "abt", "atb")
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def _shapes(product: str, q: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Full shapes of A and B for ``product``: C = A B, A Bᵀ or Aᵀ B."""
    M, K, N = MB * q, KB * q, NB * q
    return {"ab": ((M, K), (K, N)), "abt": ((M, K), (N, K)), "atb": ((M, K), (M, N))}[product]


def _reference(product: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return {"ab": lambda: torch.matmul(a, b), "abt": lambda: torch.matmul(a, b.t()),
            "atb": lambda: torch.matmul(a.t(), b)}[product]()


FUNCS = {"ab": summa_ab, "abt": summa_abt, "atb": summa_atb}


def _block(x: torch.Tensor, q: int, i: int, j: int) -> torch.Tensor:
    bi, bj = x.shape[0] // q, x.shape[1] // q
    return x[i * bi:(i + 1) * bi, j * bj:(j + 1) * bj]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _one_product(mesh, q: int, i: int, j: int, product: str, dtype: torch.dtype, b_transposed: bool) -> dict:
    """Forward and backward of one product on this rank's blocks; errors relative to torch.matmul."""
    g = torch.Generator().manual_seed(PRODUCTS.index(product) * 10 + q)
    shape_a, shape_b = _shapes(product, q)
    a_full = torch.randn(shape_a, generator=g, dtype=torch.float64).requires_grad_()
    b_full = torch.randn(shape_b, generator=g, dtype=torch.float64).requires_grad_()
    c_full = _reference(product, a_full, b_full)
    dc_full = torch.randn(c_full.shape, generator=g, dtype=torch.float64)
    c_full.backward(dc_full)

    a = _block(a_full.detach(), q, i, j).to(dtype).clone().requires_grad_()
    if b_transposed:  # storage [.., ..]ᵀ contiguous, passed as its .t() view (Linear2D's w_local.t())
        storage = _block(b_full.detach(), q, i, j).to(dtype).t().contiguous().requires_grad_()
        b = storage.t()
    else:
        storage = b = _block(b_full.detach(), q, i, j).to(dtype).clone().requires_grad_()
    dc = _block(dc_full, q, i, j).to(dtype).contiguous()

    layout = []  # the gradient SUMMA hands to b: a transposed view of contiguous storage, or contiguous
    if b_transposed:
        b.register_hook(lambda grad: layout.append(grad.t().is_contiguous() and not grad.is_contiguous()))
    with comm.count_comm() as stats:
        c = FUNCS[product](a, b, mesh)
        fwd = stats.snapshot()
    with comm.count_comm() as stats:
        c.backward(dc)
        bwd = stats.snapshot()

    grad_b = storage.grad.t() if b_transposed else storage.grad
    return {
        "c": _rel(c.detach().double(), _block(c_full.detach(), q, i, j)),
        "c_shape": tuple(c.shape),
        "da": _rel(a.grad.double(), _block(a_full.grad, q, i, j)),
        "db": _rel(grad_b.double(), _block(b_full.grad, q, i, j)),
        "storage_grad_contiguous": storage.grad.is_contiguous(),
        "b_grad_transposed_view": layout[0] if layout else None,
        "fwd": fwd,
        "bwd": bwd,
    }


def _summa_worker(rank: int, world_size: int, q: int) -> dict:
    mesh = init_mesh("2d", q * q, 1)
    i, j = grid_coords(mesh)
    return {(product, str(dtype), b_t): _one_product(mesh, q, i, j, product, dtype, b_t)
            for product in PRODUCTS for dtype in TOL for b_t in (False, True)}


@pytest.fixture(scope="module", params=[2, 3], ids=["2x2", "3x3"])
def grid(request):
    q = request.param
    return q, run_distributed(_summa_worker, q * q, q)


CASES = [(p, dtype, b_t) for p in PRODUCTS for dtype in TOL for b_t in (False, True)]
CASE_IDS = [f"{p}-{str(d).removeprefix('torch.')}-{'bT' if b_t else 'b'}" for p, d, b_t in CASES]


@pytest.mark.parametrize("product, dtype, b_transposed", CASES, ids=CASE_IDS)
def test_product_and_gradients_match_matmul(grid, product, dtype, b_transposed):
    q, outs = grid
    shape_a, shape_b = _shapes(product, q)
    c_rows = shape_a[1] if product == "atb" else shape_a[0]
    c_cols = shape_b[0] if product == "abt" else shape_b[1]
    tol = TOL[dtype]
    for rank, out in enumerate(outs):
        r = out[(product, str(dtype), b_transposed)]
        assert r["c_shape"] == (c_rows // q, c_cols // q), rank
        assert r["c"] < tol and r["da"] < tol and r["db"] < tol, (rank, r["c"], r["da"], r["db"])


@pytest.mark.parametrize("product", PRODUCTS)
def test_transposed_b_storage_receives_a_contiguous_correct_gradient(grid, product):
    q, outs = grid
    for rank, out in enumerate(outs):
        for dtype in TOL:
            r = out[(product, str(dtype), True)]
            assert r["storage_grad_contiguous"], rank
            assert r["db"] < TOL[dtype], (rank, dtype, r["db"])


@pytest.mark.parametrize("product", ["ab", "abt"])
def test_transposed_b_gets_its_gradient_as_a_transposed_view_without_copy(grid, product):
    # AB (Linear2D) and ABᵀ (tied LM head) compute dB directly in the storage layout (out_transposed).
    q, outs = grid
    for rank, out in enumerate(outs):
        for dtype in TOL:
            assert out[(product, str(dtype), True)]["b_grad_transposed_view"] is True, (rank, dtype)


def _expected_comm(product: str, q: int, itemsize: int) -> tuple[dict, dict]:
    """(forward, backward) count_comm snapshots of one product, from the schedule in summa.py and the block shapes.

    Per step l each broadcast moves one operand block and each reduce one output-shaped partial block:
      AB:  fwd bcast A, B                 bwd dA = dC Bᵀ (bcast B, reduce dA), dB = Aᵀ dC (bcast A, reduce dB)
      ABᵀ: fwd bcast B, reduce C          bwd dA = dC B (bcast dC, B),          dB = dCᵀ A (bcast dC, reduce dB)
      AᵀB: fwd bcast A, reduce C          bwd dA = B dCᵀ (bcast dC, reduce dA), dB = A dC (bcast A, dC)
    """
    shape_a, shape_b = _shapes(product, q)
    nbytes = {"A": shape_a[0] * shape_a[1] // (q * q) * itemsize, "B": shape_b[0] * shape_b[1] // (q * q) * itemsize}
    c_shape = {"ab": (shape_a[0], shape_b[1]), "abt": (shape_a[0], shape_b[0]), "atb": (shape_a[1], shape_b[1])}[product]
    nbytes["C"] = c_shape[0] * c_shape[1] // (q * q) * itemsize
    schedule = {  # (broadcast blocks, reduce blocks), each once per step
        "ab": (("A", "B"), ()), "abt": (("B",), ("C",)), "atb": (("A",), ("C",)),
    }
    backward = {
        "ab": (("B", "A"), ("A", "B")), "abt": (("C", "B", "C"), ("B",)), "atb": (("C", "A", "C"), ("A",)),
    }

    def snap(bcast, reduce):
        s = {k: {"calls": 0, "bytes": 0} for k in comm.KINDS}
        s["broadcast"] = {"calls": q * len(bcast), "bytes": q * sum(nbytes[x] for x in bcast)}
        s["reduce"] = {"calls": q * len(reduce), "bytes": q * sum(nbytes[x] for x in reduce)}
        return s

    return snap(*schedule[product]), snap(*backward[product])


@pytest.mark.parametrize("product, dtype, b_transposed", CASES, ids=CASE_IDS)
def test_communication_per_product_matches_the_summa_schedule(grid, product, dtype, b_transposed):
    q, outs = grid
    fwd, bwd = _expected_comm(product, q, torch.empty((), dtype=dtype).element_size())
    for rank, out in enumerate(outs):
        r = out[(product, str(dtype), b_transposed)]
        assert r["fwd"] == fwd, (rank, "forward")
        assert r["bwd"] == bwd, (rank, "backward")


def test_ab_forward_is_2q_broadcasts_and_backward_2q_broadcasts_2q_reduces(grid):
    # The headline numbers of DESIGN 3.1 / Linear2D, spelled out for C = A B.
    q, outs = grid
    f64 = 8
    a_blk, b_blk = MB * KB * f64, KB * NB * f64
    for out in outs:
        r = out[("ab", str(torch.float64), True)]
        assert r["fwd"]["broadcast"] == {"calls": 2 * q, "bytes": q * (a_blk + b_blk)}
        assert r["fwd"]["reduce"]["calls"] == 0
        assert r["bwd"]["broadcast"] == {"calls": 2 * q, "bytes": q * (a_blk + b_blk)}
        assert r["bwd"]["reduce"] == {"calls": 2 * q, "bytes": q * (a_blk + b_blk)}
