"""Each SUMMA product alone against ``torch.matmul`` on one device, on 2x2 (4 ranks) and 3x3 (9 ranks) grids, in
both algorithms (``collective`` and ``broadcast``) and, for ``A B``, with the forward's panels kept for the backward.

Every rank builds the same full operands from one seed, keeps block ``(row, col)`` of each, runs the product
and its backward, and compares its output block and gradient blocks with the blocks of the single-device
result (float64 to 1e-12, float32 to 1e-5, relative to the largest reference entry). Blocks are non-square
(``M/q=3``, ``K/q=5``, ``N/q=4``). The ``B`` operand is also passed as the transposed view of contiguous
storage, as ``Linear2D`` passes ``w_local.t()``. Communication is counted around forward and backward
separately and compared with the schedules in ``summa.py``, bytes derived from the block shapes.

All checks of one grid run in a single ``run_distributed`` call (module-scoped fixture).
"""

from __future__ import annotations

import pytest
import torch

from lightning_tp2d import comm
from lightning_tp2d.mesh import grid_coords, init_mesh
from lightning_tp2d.options import TPOptions
from lightning_tp2d.summa import summa_ab, summa_abt, summa_atb
from tests.distributed import run_distributed

MB, KB, NB = 3, 5, 4  # block shape factors: A is [M, K] = [MB*q, KB*q], and so on
TALL = 48  # MB of the "tall" cases: activation blocks outweigh the weight column, which is then all-gathered
#            (with MB = 3 the collective SUMMA streams the weight blocks instead: summa._streams)
PRODUCTS = ("ab", "abt", "atb")
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
# (algorithm, keep_panels, form); panels are kept, and the scatter form exists, for the A B product only
ALGOS = (("collective", False, "gather"), ("broadcast", False, "gather"), ("collective", True, "gather"),
         ("broadcast", True, "gather"), ("collective", False, "scatter"), ("collective", True, "scatter"),
         ("collective", False, "scatter-mirrored"))


def _algo_id(algo) -> str:
    return algo[0] + ("-keep" if algo[1] else "") + ("-" + algo[2] if algo[2] != "gather" else "")


def _shapes(product: str, q: int, mb: int = MB) -> tuple[tuple[int, int], tuple[int, int]]:
    """Full shapes of A and B for ``product``: C = A B, A Bᵀ or Aᵀ B."""
    M, K, N = mb * q, KB * q, NB * q
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


def _one_product(mesh, q: int, i: int, j: int, product: str, dtype: torch.dtype, b_transposed: bool,
                 algo: tuple[str, bool, str], mb: int) -> dict:
    """Forward and backward of one product on this rank's blocks; errors relative to torch.matmul."""
    g = torch.Generator().manual_seed(PRODUCTS.index(product) * 10 + q)
    shape_a, shape_b = _shapes(product, q, mb)
    a_full = torch.randn(shape_a, generator=g, dtype=torch.float64).requires_grad_()
    b_full = torch.randn(shape_b, generator=g, dtype=torch.float64).requires_grad_()
    c_full = _reference(product, a_full, b_full)
    dc_full = torch.randn(c_full.shape, generator=g, dtype=torch.float64)
    c_full.backward(dc_full)

    a = _block(a_full.detach(), q, i, j).to(dtype).clone().requires_grad_()
    bi, bj = (j, i) if algo[2] == "scatter-mirrored" else (i, j)  # mirrored: rank (i, j) holds B's block (j, i)
    if b_transposed:  # storage [.., ..]ᵀ contiguous, passed as its .t() view (Linear2D's w_local.t())
        storage = _block(b_full.detach(), q, bi, bj).to(dtype).t().contiguous().requires_grad_()
        b = storage.t()
    else:
        storage = b = _block(b_full.detach(), q, bi, bj).to(dtype).clone().requires_grad_()
    dc = _block(dc_full, q, i, j).to(dtype).contiguous()

    layout = []  # the gradient SUMMA hands to b: a transposed view of contiguous storage, or contiguous
    if b_transposed:
        b.register_hook(lambda grad: layout.append(grad.t().is_contiguous() and not grad.is_contiguous()))
    with comm.count_comm() as stats:
        form = {"form": algo[2].split("-")[0], "b_mirrored": algo[2] == "scatter-mirrored"} if product == "ab" else {}
        c = FUNCS[product](a, b, mesh, TPOptions(summa=algo[0], keep_panels=algo[1]), **form)
        fwd = stats.snapshot()
    with comm.count_comm() as stats:
        c.backward(dc)
        bwd = stats.snapshot()

    grad_b = storage.grad.t() if b_transposed else storage.grad
    return {
        "c": _rel(c.detach().double(), _block(c_full.detach(), q, i, j)),
        "c_shape": tuple(c.shape),
        "da": _rel(a.grad.double(), _block(a_full.grad, q, i, j)),
        "db": _rel(grad_b.double(), _block(b_full.grad, q, bi, bj)),
        "storage_grad_contiguous": storage.grad.is_contiguous(),
        "b_grad_transposed_view": layout[0] if layout else None,
        "fwd": fwd,
        "bwd": bwd,
        "diagonal": i == j,
    }


def _summa_worker(rank: int, world_size: int, q: int) -> dict:
    mesh = init_mesh("2d", q * q, 1)
    i, j = grid_coords(mesh)
    return {(product, str(dtype), b_t, algo, mb): _one_product(mesh, q, i, j, product, dtype, b_t, algo, mb)
            for product, dtype, b_t, algo, mb in CASES}


@pytest.fixture(scope="module", params=[2, 3], ids=["2x2", "3x3"])
def grid(request):
    q = request.param
    return q, run_distributed(_summa_worker, q * q, q)


CASES = [(p, dtype, b_t, algo, mb) for p in PRODUCTS for dtype in TOL for b_t in (False, True) for algo in ALGOS
         for mb in (MB, TALL) if (p == "ab" or algo[1:] == (False, "gather")) and (mb == MB or algo[0] == "collective")]
CASE_IDS = [f"{p}-{str(d).removeprefix('torch.')}-{'bT' if b_t else 'b'}-{_algo_id(a)}{'-tall' if mb == TALL else ''}"
            for p, d, b_t, a, mb in CASES]


@pytest.mark.parametrize("product, dtype, b_transposed, algo, mb", CASES, ids=CASE_IDS)
def test_product_and_gradients_match_matmul(grid, product, dtype, b_transposed, algo, mb):
    q, outs = grid
    shape_a, shape_b = _shapes(product, q, mb)
    c_rows = shape_a[1] if product == "atb" else shape_a[0]
    c_cols = shape_b[0] if product == "abt" else shape_b[1]
    tol = TOL[dtype]
    for rank, out in enumerate(outs):
        r = out[(product, str(dtype), b_transposed, algo, mb)]
        assert r["c_shape"] == (c_rows // q, c_cols // q), rank
        assert r["c"] < tol and r["da"] < tol and r["db"] < tol, (rank, r["c"], r["da"], r["db"])


@pytest.mark.parametrize("product", PRODUCTS)
@pytest.mark.parametrize("algo", ALGOS[:2], ids=_algo_id)
def test_transposed_b_storage_receives_a_contiguous_correct_gradient(grid, product, algo):
    q, outs = grid
    for rank, out in enumerate(outs):
        for dtype in TOL:
            r = out[(product, str(dtype), True, algo, MB)]
            assert r["storage_grad_contiguous"], rank
            assert r["db"] < TOL[dtype], (rank, dtype, r["db"])


@pytest.mark.parametrize("product, algo", [("ab", a) for a in ALGOS] + [("abt", a) for a in ALGOS[:2]])
def test_transposed_b_gets_its_gradient_as_a_transposed_view_without_copy(grid, product, algo):
    # AB (Linear2D) and ABᵀ compute dB directly in the storage layout (out_transposed).
    q, outs = grid
    for rank, out in enumerate(outs):
        for dtype in TOL:
            assert out[(product, str(dtype), True, algo, MB)]["b_grad_transposed_view"] is True, (rank, dtype)


def _block_bytes(product: str, q: int, itemsize: int, mb: int = MB) -> dict[str, int]:
    shape_a, shape_b = _shapes(product, q, mb)
    c_shape = {"ab": (shape_a[0], shape_b[1]), "abt": (shape_a[0], shape_b[0]), "atb": (shape_a[1], shape_b[1])}[product]
    return {name: rows * cols // (q * q) * itemsize for name, (rows, cols) in
            (("A", shape_a), ("B", shape_b), ("C", c_shape))}


def _snap(q: int, calls: list[tuple[str, int, int]]) -> dict:
    """A count_comm snapshot from ``(kind, calls, bytes per call)`` entries."""
    s = {k: {"calls": 0, "bytes": 0} for k in comm.KINDS}
    for kind, n, nbytes in calls:
        s[kind] = {"calls": s[kind]["calls"] + n, "bytes": s[kind]["bytes"] + n * nbytes}
    return s


def _expected_broadcast(product: str, q: int, itemsize: int, keep: bool) -> tuple[dict, dict]:
    """Broadcast SUMMA: per step l each broadcast moves one operand block and each reduce one output-shaped block:
      AB:  fwd bcast A, B                 bwd dA = dC Bᵀ (bcast B, reduce dA), dB = Aᵀ dC (bcast A, reduce dB)
      ABᵀ: fwd bcast B, reduce C          bwd dA = dC B (bcast dC, B),          dB = dCᵀ A (bcast dC, reduce dB)
      AᵀB: fwd bcast A, reduce C          bwd dA = B dCᵀ (bcast dC, reduce dA), dB = A dC (bcast A, dC)
    With kept panels A B's backward broadcasts nothing."""
    nbytes = _block_bytes(product, q, itemsize)
    schedule = {"ab": (("A", "B"), ()), "abt": (("B",), ("C",)), "atb": (("A",), ("C",))}
    backward = {"ab": (() if keep else ("B", "A"), ("A", "B")), "abt": (("C", "B", "C"), ("B",)),
                "atb": (("C", "A", "C"), ("A",))}

    def snap(bcast, reduce):
        return _snap(q, [("broadcast", q, nbytes[x]) for x in bcast] + [("reduce", q, nbytes[x]) for x in reduce])

    return snap(*schedule[product]), snap(*backward[product])


def _column(q: int, nb: dict, against: str, keep: bool = False) -> tuple:
    """How a weight column of ``B`` blocks moves (summa._streams): streamed as ``q`` broadcasts when it outweighs
    the block ``against`` and is not kept, else one all-gather of the local block."""
    if not keep and q * nb["B"] > nb[against]:
        return ("broadcast", q, nb["B"])
    return ("all_gather", 1, nb["B"])


def _expected_scatter(q: int, itemsize: int, keep: bool, diagonal: bool, mb: int = MB) -> tuple[dict, dict]:
    """A B in the scatter form: forward swaps B's block with the mirror rank (diagonal ranks keep theirs), gathers
    (or streams) row k of B along ``row`` and passes C's partial sums round the ring; backward swaps and gathers
    again (not with kept panels), passes dC round, reduce-scatters the q stacked dB partials and swaps the result
    back."""
    nb = _block_bytes("ab", q, itemsize, mb)
    swap = [] if diagonal else [("send", 1, nb["B"]), ("recv", 1, nb["B"])]
    ring = ("ring_exchange", q // 2, (q - 1) * nb["C"] // (q // 2))
    fwd = swap + [_column(q, nb, "A", keep), ring]
    bwd = ([] if keep else swap + [_column(q, nb, "C")]) + [ring, ("reduce_scatter", 1, q * nb["B"])] + swap
    return _snap(q, fwd), _snap(q, bwd)


def _expected_collective(product: str, q: int, itemsize: int, keep: bool, mb: int = MB) -> tuple[dict, dict]:
    """Collective SUMMA (summa.py): a ring pass of an ``X``-sized block is ``q//2`` exchanges sending ``q-1``
    blocks in all; the weight-sized operand is one all-gather (its local block) or one reduce-scatter (``q``
    blocks) along ``row``:
      AB:  fwd gather B, ring A            bwd gather B + reduce ring dA; ring A + reduce-scatter dB
      ABᵀ: fwd gather B, reduce ring C     bwd dA = dC B (gather B, ring dC); dB = dCᵀ A (ring dC, reduce-scatter dB)
      AᵀB: fwd ring A, reduce-scatter C    bwd dA = B dCᵀ (gather dC, reduce ring dA); dB = A dC (gather dC, ring A)
    With kept panels A B's backward neither gathers B nor passes A round again. In a product ``X W`` the weight
    column is streamed block by block when it outweighs ``X``'s block (``_column``); ABᵀ alone always gathers."""
    nb = _block_bytes(product, q, itemsize, mb)
    ring = lambda x: ("ring_exchange", q // 2, (q - 1) * nb[x] // (q // 2))  # noqa: E731
    gather = lambda x: ("all_gather", 1, nb[x])  # noqa: E731
    scatter = lambda x: ("reduce_scatter", 1, q * nb[x])  # noqa: E731
    as_b = lambda w, x: _column(q, {"B": nb[w], x: nb[x]}, x)  # noqa: E731 - w the weight-side block of an X W
    fwd = {"ab": [_column(q, nb, "A", keep), ring("A")], "abt": [gather("B"), ring("C")],
           "atb": [ring("A"), scatter("C")]}
    bwd = {"ab": ([] if keep else [_column(q, nb, "C"), ring("A")]) + [ring("A"), scatter("B")],
           "abt": [as_b("B", "C"), ring("C"), ring("C"), scatter("B")],  # dA = dC B: B's column against dC
           "atb": [gather("C"), ring("A"), as_b("C", "A"), ring("A")]}  # dB = A dC: dC's column against A
    return _snap(q, fwd[product]), _snap(q, bwd[product])


@pytest.mark.parametrize("product, dtype, b_transposed, algo, mb", CASES, ids=CASE_IDS)
def test_communication_per_product_matches_the_summa_schedule(grid, product, dtype, b_transposed, algo, mb):
    q, outs = grid
    itemsize = torch.empty((), dtype=dtype).element_size()
    for rank, out in enumerate(outs):
        r = out[(product, str(dtype), b_transposed, algo, mb)]
        if algo[2].startswith("scatter"):
            fwd, bwd = _expected_scatter(q, itemsize, algo[1], r["diagonal"] or algo[2] == "scatter-mirrored", mb)
        elif algo[0] == "collective":
            fwd, bwd = _expected_collective(product, q, itemsize, algo[1], mb)
        else:
            fwd, bwd = _expected_broadcast(product, q, itemsize, algo[1])
        assert r["fwd"] == fwd, (rank, "forward")
        assert r["bwd"] == bwd, (rank, "backward")


def test_broadcast_ab_forward_is_2q_broadcasts_and_backward_2q_broadcasts_2q_reduces(grid):
    # The headline numbers of docs/layouts.md ("2d") / Linear2D, spelled out for C = A B.
    q, outs = grid
    f64 = 8
    a_blk, b_blk = MB * KB * f64, KB * NB * f64
    for out in outs:
        r = out[("ab", str(torch.float64), True, ("broadcast", False, "gather"), MB)]
        assert r["fwd"]["broadcast"] == {"calls": 2 * q, "bytes": q * (a_blk + b_blk)}
        assert r["fwd"]["reduce"]["calls"] == 0
        assert r["bwd"]["broadcast"] == {"calls": 2 * q, "bytes": q * (a_blk + b_blk)}
        assert r["bwd"]["reduce"] == {"calls": 2 * q, "bytes": q * (a_blk + b_blk)}


def test_collective_ab_sends_q_minus_1_activation_blocks_each_way_and_one_weight_collective(grid):
    # C = A B, collective: forward q//2 exchanges carrying q-1 A blocks plus one all-gather of the local B block;
    # backward twice the A traffic (the dA sums and A again) and the dB reduce-scatter; kept panels halve it.
    q, outs = grid
    f64 = 8
    a_blk, b_blk = TALL * KB * f64, KB * NB * f64
    for out in outs:
        r = out[("ab", str(torch.float64), True, ("collective", False, "gather"), TALL)]
        assert r["fwd"]["ring_exchange"] == {"calls": q // 2, "bytes": (q - 1) * a_blk}
        assert r["fwd"]["all_gather"] == {"calls": 1, "bytes": b_blk}
        assert r["fwd"]["broadcast"]["calls"] == r["fwd"]["reduce"]["calls"] == 0
        assert r["bwd"]["ring_exchange"] == {"calls": 2 * (q // 2), "bytes": 2 * (q - 1) * a_blk}
        assert r["bwd"]["reduce_scatter"] == {"calls": 1, "bytes": q * b_blk}
        kept = out[("ab", str(torch.float64), True, ("collective", True, "gather"), TALL)]
        assert kept["bwd"]["ring_exchange"] == {"calls": q // 2, "bytes": (q - 1) * a_blk}
        assert kept["bwd"]["all_gather"]["calls"] == 0


def _rings_worker(rank: int, world_size: int) -> dict:
    """The bidirectional rings alone on a 1 x n mesh (n = world_size): relaying (n >= 4) and odd/even splits."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_tp2d.summa import _GATHER, _REDUCE, _RingGather, _RingReduce, ring_order, ring_steps

    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("row", "col"))
    n, i = world_size, rank
    block = lambda k: torch.full((2, 3), float(k)) + torch.arange(6.0).view(2, 3) / 10  # noqa: E731
    gather, seen = _RingGather(block(i), mesh, _GATHER), []
    for s in range(ring_steps(n)):
        seen.append([(k, bool(torch.equal(t, block(k)))) for k, t in gather.step(s)])
    # partial of rank j for target k: (j + 1) * block(k); the sum over j is n(n+1)/2 * block(k)
    reduce, got = _RingReduce(mesh, _REDUCE), None
    for s in range(ring_steps(n)):
        got = reduce.step(s, lambda k: (i + 1) * block(k))
    with comm.count_comm() as stats:
        g2 = _RingGather(block(i), mesh, _GATHER)
        for s in range(ring_steps(n)):
            g2.step(s)
    return {"seen": seen, "order": ring_order(n, i), "sum_ok": bool(torch.allclose(got, n * (n + 1) / 2 * block(i))),
            "exchange": stats.snapshot()["ring_exchange"]}


@pytest.mark.parametrize("n", [4, 5])
def test_bidirectional_rings_deliver_every_block_once_and_sum_every_partial(n):
    outs = run_distributed(_rings_worker, n)
    for rank, out in enumerate(outs):
        held = [k for step in out["seen"] for k, _ in step]
        assert sorted(held) == list(range(n)), (rank, out["seen"])  # every block exactly once
        assert all(ok for step in out["seen"] for _, ok in step), (rank, out["seen"])  # and the right one
        assert [[k for k, _ in step] for step in out["seen"]] == out["order"]
        assert out["sum_ok"], rank
        # n//2 steps, n-1 blocks of 2x3 float32 sent in all (each travels the shorter way round)
        assert out["exchange"] == {"calls": n // 2, "bytes": (n - 1) * 6 * 4}, (rank, out["exchange"])


def test_bad_form_or_mirrored_weight_outside_the_scatter_form_is_refused():
    a = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="form='rows' is not one of 'gather', 'scatter'"):
        summa_ab(a, a, None, form="rows")
    with pytest.raises(ValueError, match="b_mirrored needs the collective scatter form, got summa='broadcast'"):
        summa_ab(a, a, None, TPOptions(summa="broadcast"), form="scatter", b_mirrored=True)
    with pytest.raises(ValueError, match="summa='nope' is not one of 'collective', 'broadcast'"):
        TPOptions(summa="nope")
    with pytest.raises(ValueError, match="keep_panels must be True or False, got 1"):
        TPOptions(keep_panels=1)
