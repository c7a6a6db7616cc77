"""Mesh sizes and their validation, then every collective of ``comm.py`` on real gloo process groups.

Validation tests need no process group (docs/layouts.md, validation: bad configurations raise ``ValueError`` naming
the numbers before any group work). The multi-rank tests run once per world size, 4 ranks (dp=1, 2x2 grid) and 8 ranks
(dp=2 x 2x2), through one ``run_distributed`` call each (a module-scoped fixture); each rank returns numbers
(coordinates, max errors, ``count_comm`` snapshots) and the tests below assert them.

Every rank's tensor is a formula of its global rank ``d*p + r*q + c``, so the expected result of a
collective along an axis is computed from the global ranks of the axis members. Collectives issued through
``torch.distributed`` itself (as FSDP2 issues them) are recorded too, once, in ``comm``'s convention.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
import torch.distributed as dist

from lightning_tp2d import comm, comm_record
from lightning_tp2d.layouts import get_layout
from lightning_tp2d.mesh import ParallelDims, grid_coords, init_mesh, parallel_dims_of
from tests.distributed import run_distributed

Q, P = 2, 4  # grid side and tensor-parallel size of the multi-rank tests

# ---- validation, no process group -------------------------------------------------------------------


def test_non_square_tensor_size_for_grid_layouts_raises_naming_the_size():
    with pytest.raises(ValueError, match=r"'2d'.*\b6 is not a perfect square \(nearest: \[4, 9\]\)"):
        ParallelDims("2d", 6)
    with pytest.raises(ValueError, match=r"'2d-metp'.*\b8 is not a perfect square"):
        ParallelDims("2d-metp", 8, 2)


def test_ring_layout_accepts_any_tensor_size_and_uses_it_as_q():
    dims = ParallelDims("metp", 6, 2)
    assert (dims.q, dims.world_size, dims.mesh_shape, dims.mesh_dim_names) == (6, 12, (2, 6), ("data_parallel", "ring"))


def test_grid_layout_sizes_give_q_world_and_mesh_shape():
    dims = ParallelDims("2d", 9, 2)
    assert (dims.q, dims.world_size, dims.mesh_shape) == (3, 18, (2, 3, 3))
    assert dims.mesh_dim_names == ("data_parallel", "row", "col")


def test_unknown_layout_raises_listing_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown layout '3d'.*\['2d', 'metp', '2d-metp'\]"):
        ParallelDims("3d", 4)


@pytest.mark.parametrize("sizes, message", [((0, 1), "tensor_parallel_size must be a positive int, got 0"),
                                            ((4, -1), "data_parallel_size must be a positive int, got -1"),
                                            ((4.0, 1), "tensor_parallel_size must be a positive int, got 4.0")])
def test_non_positive_or_non_int_sizes_raise_naming_the_field_and_value(sizes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ParallelDims("2d", *sizes)


def test_check_model_names_heads_hidden_q_and_suggests_q_values():
    # q=5: 12 heads and 768 hidden both fail; the q values that divide both are the divisors of gcd=12.
    with pytest.raises(ValueError) as err:
        get_layout("2d").check_sizes(25, {"n_head": 12, "n_embd": 768})
    msg = str(err.value)
    assert "n_head=12 is not divisible by q=5" in msg
    assert "n_embd=768 is not divisible by q=5" in msg
    assert "use q in [1, 2, 3, 4, 6, 12]" in msg


def test_check_model_names_only_the_failing_number():
    with pytest.raises(ValueError) as err:
        get_layout("2d").check_sizes(9, {"n_head": 12, "n_embd": 100})  # 12 % 3 == 0, 100 % 3 == 1
    msg = str(err.value)
    assert "n_embd=100 is not divisible by q=3" in msg and "n_head" not in msg
    assert "use q in [1, 2, 4]" in msg  # divisors of gcd(12, 100) = 4


def test_check_model_accepts_heads_and_hidden_divisible_by_q():
    get_layout("2d").check_sizes(9, {"n_head": 12, "n_embd": 96})
    get_layout("metp").check_sizes(4, {"n_embd": 96})


def test_check_world_size_names_world_dp_and_p():
    with pytest.raises(ValueError, match=r"world size 6 != data_parallel_size 2 x tensor_parallel_size 4 = 8"):
        ParallelDims("2d", 4, 2).check_world_size(6)


def test_init_mesh_without_process_group_raises_runtime_error():
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        init_mesh("2d", 4, 1)


def test_init_mesh_validates_sizes_before_looking_for_a_process_group():
    # A bad size must be reported as such (ValueError), not hidden behind the missing group.
    with pytest.raises(ValueError, match=r"\b5 is not a perfect square"):
        init_mesh("2d", 5, 1)


# ---- multi-rank: mesh coordinates and every collective -----------------------------------------------


def _only(kind: str, calls: int, nbytes: int) -> dict[str, dict[str, int]]:
    """A count_comm snapshot with ``calls`` and ``nbytes`` for ``kind`` and nothing for the other kinds."""
    snap = {k: {"calls": 0, "bytes": 0} for k in comm.KINDS}
    snap[kind] = {"calls": calls, "bytes": nbytes}
    return snap


NOTHING = {k: {"calls": 0, "bytes": 0} for k in comm.KINDS}


@contextlib.contextmanager
def _no_process_group_calls():
    """Make any torch.distributed collective issued through comm.py raise (proves 'sends nothing')."""
    def refuse(*args, **kwargs):
        raise AssertionError("a collective was issued on a size-1 axis")

    names = ("broadcast", "reduce", "all_reduce")
    saved = {n: getattr(comm.dist, n) for n in names}
    saved_single = (comm._all_gather_single, comm._reduce_scatter_single)
    try:
        for n in names:
            setattr(comm.dist, n, refuse)
        comm._all_gather_single = comm._reduce_scatter_single = refuse
        yield
    finally:
        for n, f in saved.items():
            setattr(comm.dist, n, f)
        comm._all_gather_single, comm._reduce_scatter_single = saved_single


def _counted(fn):
    """Run ``fn()`` inside count_comm, itself inside an outer count (counts nest: the inner one starts from zero and
    the outer one sees the inner block's calls too), and return the inner snapshot."""
    assert not comm_record._RECORDERS  # off unless asked for
    with comm.count_comm() as outer:
        with comm.count_comm() as stats:
            out = fn()
        assert outer.snapshot() == stats.snapshot()
    assert not comm_record._RECORDERS
    return out, stats.snapshot()


def _axis_checks(mesh, axis: str, rank: int, member) -> dict:
    """Every collective along ``axis``; returns {check: (max abs error, count_comm snapshot)}.

    ``member(k)`` is the global rank at coordinate ``k`` of this axis (other coordinates as this rank's)."""
    n, mine = comm.axis_size(mesh, axis), comm.axis_rank(mesh, axis)
    ranks = [member(k) for k in range(n)]
    out: dict[str, tuple[float, dict]] = {}

    def err(got, want):
        return (got.double() - want.double()).abs().max().item()

    # broadcast from every coordinate; float64 [3, 5]
    for src in range(n):
        t = torch.full((3, 5), float(rank), dtype=torch.float64)
        _, snap = _counted(lambda: comm.broadcast_along(t, mesh, axis, src=src))
        out[f"broadcast_src{src}"] = (err(t, torch.full((3, 5), float(ranks[src]))), snap)

    # reduce (sum) to every coordinate; float32 [4]; only the destination's buffer is defined
    for dst in range(n):
        t = torch.arange(4, dtype=torch.float32) + rank
        _, snap = _counted(lambda: comm.reduce_along(t, mesh, axis, dst=dst))
        want = sum(torch.arange(4, dtype=torch.float32) + m for m in ranks)
        out[f"reduce_dst{dst}"] = (err(t, want) if mine == dst else 0.0, snap)

    # all-reduce sum / max / min; float64 [6]
    base = torch.arange(6, dtype=torch.float64)
    for op, value, want in (("sum", base * (rank + 1), base * sum(m + 1 for m in ranks)),
                            ("max", base * rank - 3, base * max(ranks) - 3),
                            ("min", base * rank - 3, base * min(ranks) - 3)):
        t = value.clone()
        _, snap = _counted(lambda: comm.all_reduce_along(t, mesh, axis, op=op))
        out[f"all_reduce_{op}"] = (err(t, want), snap)

    # all-gather along dim 0 and -1; float64 [2, 3] with distinct entries per rank
    def block(m):
        return 100.0 * m + torch.arange(6, dtype=torch.float64).view(2, 3)

    for dim in (0, -1):
        got, snap = _counted(lambda: comm.all_gather_along(block(rank), mesh, axis, dim=dim))
        out[f"all_gather_dim{dim}"] = (err(got, torch.cat([block(m) for m in ranks], dim=dim)), snap)

    # reduce-scatter along dim 0 ([2n, 3]) and dim -1 ([3, 2n]); float32
    def full(m, dim):
        shape = (2 * n, 3) if dim == 0 else (3, 2 * n)
        return (m + 1) * torch.arange(6 * n, dtype=torch.float32).view(shape)

    for dim in (0, -1):
        got, snap = _counted(lambda: comm.reduce_scatter_along(full(rank, dim), mesh, axis, dim=dim))
        want = sum(full(m, dim) for m in ranks).chunk(n, dim=dim)[mine]
        out[f"reduce_scatter_dim{dim}"] = (err(got, want) if got.shape == want.shape else float("inf"), snap)

    # async broadcast / reduce / all-reduce complete on wait(); a second wait() is harmless
    t_b = torch.full((2, 2), float(rank), dtype=torch.float64)
    t_r = torch.full((3,), float(rank + 1), dtype=torch.float64)
    t_a = torch.full((5,), float(rank + 1), dtype=torch.float64)

    def post_all():
        handles = [comm.broadcast_along(t_b, mesh, axis, src=n - 1, async_op=True),
                   comm.reduce_along(t_r, mesh, axis, dst=0, async_op=True),
                   comm.all_reduce_along(t_a, mesh, axis, async_op=True)]
        for h in handles:
            h.wait()
            h.wait()

    _, snap = _counted(post_all)
    total = float(sum(m + 1 for m in ranks))
    out["async"] = (max(err(t_b, torch.full((2, 2), float(ranks[-1]))),
                        err(t_r, torch.full((3,), total)) if mine == 0 else 0.0,
                        err(t_a, torch.full((5,), total))), snap)

    # BroadcastPipeline: get(l) is coordinate l's tensor, in order; float64 [2, 2]
    mine_t = torch.full((2, 2), float(rank), dtype=torch.float64)

    def pipe():
        pipeline = comm.BroadcastPipeline(mine_t, mesh, axis)
        return [pipeline.get(l).clone() for l in range(n)]

    got, snap = _counted(pipe)
    out["broadcast_pipeline"] = (max(err(g, torch.full((2, 2), float(ranks[l]))) for l, g in enumerate(got)), snap)

    # ReducePipeline: partial for owner l is (rank+1)*(l+1); owner gets (l+1) * sum(m+1); float32 [3]
    def red():
        pipeline = comm.ReducePipeline(mesh, axis)
        for l in range(n):
            pipeline.push(torch.full((3,), float((rank + 1) * (l + 1))), dst=l)
        return pipeline.finish()

    got, snap = _counted(red)
    out["reduce_pipeline"] = (err(got, torch.full((3,), (mine + 1) * total)), snap)
    return out


def _direct_checks(mesh, axis: str, rank: int) -> dict:
    """torch.distributed collectives called directly (not through comm) on ``axis``'s group, recorded: the calls
    as recorders see them, their values, and a count_comm snapshot of the same calls."""
    group, n = comm.axis_group(mesh, axis), comm.axis_size(mesh, axis)
    seen: list = []
    recorder = type("Recorder", (), {"posted": lambda self, call: seen.append(("posted", call)),
                                     "waited": lambda self, call: seen.append(("waited", call))})()

    def calls():
        mine = torch.full((2, 3), float(rank), dtype=torch.float64)
        gathered = torch.empty(2 * n, 3, dtype=torch.float64)
        dist.all_gather_single(gathered, mine, group=group)  # what FSDP2 calls
        full = torch.ones(4 * n, dtype=torch.float32) * (rank + 1)
        out = torch.empty(4, dtype=torch.float32)
        dist.reduce_scatter_single(out, full, group=group)
        t = torch.ones(5, dtype=torch.float64)
        dist.all_reduce(t, group=group, async_op=True).wait()
        comm.all_reduce_along(torch.ones(3), mesh, axis)  # comm's own: recorded once, not direct
        return gathered, out, t

    with comm_record.recording(recorder), comm.count_comm() as stats:
        gathered, out, t = calls()
    return {"seen": [(event, c.kind, c.axis, c.ranks, c.nbytes, c.direct) for event, c in seen],
            "snapshot": stats.snapshot(), "gathered": gathered[::2, 0].tolist(), "out": out.tolist(),
            "t": t.tolist()}


def _size_one_checks(mesh, axis: str, rank: int) -> dict:
    """On a one-rank axis every call returns its input untouched, issues no collective and counts nothing."""
    t = torch.full((2, 3), float(rank), dtype=torch.float64)
    keep = t.clone()
    with _no_process_group_calls():
        def calls():
            handles = [comm.broadcast_along(t, mesh, axis, src=0), comm.reduce_along(t, mesh, axis, dst=0),
                       comm.all_reduce_along(t, mesh, axis, op="max"),
                       comm.broadcast_along(t, mesh, axis, src=0, async_op=True)]
            same = [comm.all_gather_along(t, mesh, axis, dim=-1) is t, comm.reduce_scatter_along(t, mesh, axis) is t,
                    comm.BroadcastPipeline(t, mesh, axis).get(0) is t]
            reducer = comm.ReducePipeline(mesh, axis)
            reducer.push(t, dst=0)
            same.append(reducer.finish() is t)
            return all(h is comm.DONE for h in handles), all(same)

        (all_done, all_same), snap = _counted(calls)
    return {"size": comm.axis_size(mesh, axis), "all_done": all_done, "all_same": all_same,
            "err": (t - keep).abs().max().item(), "stats": snap}


def _comm_worker(rank: int, world_size: int, dp: int) -> dict:
    res: dict = {}
    # world size != dp * p, with a live group: ValueError naming the numbers, raised before any group work.
    wrong_dp = 3 - dp  # 2 on 4 ranks, 1 on 8 ranks
    try:
        init_mesh("2d", P, wrong_dp)
        res["wrong_world"] = None
    except ValueError as e:
        res["wrong_world"] = str(e)

    mesh = init_mesh("2d", P, dp)
    d = mesh.get_local_rank("data_parallel")
    r, c = grid_coords(mesh)
    res["coords"] = (d, r, c)
    res["mesh_shape"] = tuple(mesh.shape)
    dims = parallel_dims_of(mesh, "2d")
    res["dims"] = (dims.layout, dims.tensor_parallel_size, dims.data_parallel_size)
    try:
        parallel_dims_of(mesh, "metp")
        res["wrong_layout"] = None
    except ValueError as e:
        res["wrong_layout"] = str(e)

    def at(dd, rr, cc):
        return dd * P + rr * Q + cc

    members = {"row": lambda k: at(d, k, c), "col": lambda k: at(d, r, k), "data_parallel": lambda k: at(k, r, c)}
    axes = ("row", "col") + (("data_parallel",) if dp > 1 else ())
    res["axes"] = {axis: _axis_checks(mesh, axis, rank, members[axis]) for axis in axes}
    res["direct"] = {axis: _direct_checks(mesh, axis, rank) for axis in axes}
    if dp == 1:
        res["size_one"] = _size_one_checks(mesh, "data_parallel", rank)
    # reduce-scatter of a dim the axis does not divide: ValueError before any communication
    try:
        _counted(lambda: comm.reduce_scatter_along(torch.zeros(3, 2), mesh, "col", dim=0))
        res["indivisible"] = None
    except ValueError as e:
        res["indivisible"] = str(e)
    return res


@pytest.fixture(scope="module", params=[4, 8], ids=["world4-2x2", "world8-dp2x2x2"])
def ranks(request):
    world = request.param
    return world, run_distributed(_comm_worker, world, world // P)


def _expected_axis_stats(n: int) -> dict[str, dict]:
    """count_comm snapshots per check of _axis_checks on an axis of ``n`` ranks, from the shapes and dtypes used there."""
    f64, f32 = 8, 4
    exp = {f"broadcast_src{s}": _only("broadcast", 1, 3 * 5 * f64) for s in range(n)}
    exp |= {f"reduce_dst{s}": _only("reduce", 1, 4 * f32) for s in range(n)}
    exp |= {f"all_reduce_{op}": _only("all_reduce", 1, 6 * f64) for op in ("sum", "max", "min")}
    exp |= {f"all_gather_dim{dim}": _only("all_gather", 1, 2 * 3 * f64) for dim in (0, -1)}  # local input
    exp |= {f"reduce_scatter_dim{dim}": _only("reduce_scatter", 1, 2 * n * 3 * f32) for dim in (0, -1)}  # full input
    exp["async"] = {**NOTHING, "broadcast": {"calls": 1, "bytes": 4 * f64}, "reduce": {"calls": 1, "bytes": 3 * f64},
                    "all_reduce": {"calls": 1, "bytes": 5 * f64}}
    exp["broadcast_pipeline"] = _only("broadcast", n, n * 4 * f64)
    exp["reduce_pipeline"] = _only("reduce", n, n * 3 * f32)
    return exp


def test_mesh_coordinates_follow_global_rank_d_p_plus_r_q_plus_c(ranks):
    world, outs = ranks
    for rank, out in enumerate(outs):
        assert out["coords"] == (rank // P, rank % P // Q, rank % Q), rank
        assert out["mesh_shape"] == (world // P, Q, Q)


def test_parallel_dims_of_recovers_sizes_and_rejects_wrong_axes(ranks):
    world, outs = ranks
    for out in outs:
        assert out["dims"] == ("2d", P, world // P)
        assert "('data_parallel', 'ring')" in out["wrong_layout"]
        assert "('data_parallel', 'row', 'col')" in out["wrong_layout"]


def test_init_mesh_with_world_not_dp_times_p_names_the_numbers(ranks):
    world, outs = ranks
    wrong_dp = 3 - world // P
    for out in outs:
        assert out["wrong_world"] == (f"world size {world} != data_parallel_size {wrong_dp} x tensor_parallel_size "
                                      f"{P} = {wrong_dp * P}")


@pytest.mark.parametrize("axis", ["row", "col", "data_parallel"])
def test_every_collective_gives_exact_values(ranks, axis):
    world, outs = ranks
    if axis == "data_parallel" and world == P:
        pytest.skip("data_parallel has one rank here (size-1 bypass is tested separately)")
    for rank, out in enumerate(outs):
        errs = {check: e for check, (e, _) in out["axes"][axis].items()}
        assert set(errs) == set(_expected_axis_stats(2)), rank
        assert errs == dict.fromkeys(errs, 0.0), (rank, axis)


@pytest.mark.parametrize("axis", ["row", "col", "data_parallel"])
def test_every_collective_counts_one_call_and_its_payload_bytes(ranks, axis):
    world, outs = ranks
    if axis == "data_parallel" and world == P:
        pytest.skip("data_parallel has one rank here (size-1 bypass is tested separately)")
    want = _expected_axis_stats(2)
    for rank, out in enumerate(outs):
        got = {check: snap for check, (_, snap) in out["axes"][axis].items()}
        assert got == want, (rank, axis)


def test_size_one_axis_sends_nothing_counts_nothing_and_returns_input(ranks):
    world, outs = ranks
    if world != P:
        pytest.skip("data_parallel has two ranks here")
    for out in outs:
        assert out["size_one"] == {"size": 1, "all_done": True, "all_same": True, "err": 0.0, "stats": NOTHING}


def test_reduce_scatter_of_indivisible_dim_raises_naming_sizes(ranks):
    _, outs = ranks
    for out in outs:
        assert out["indivisible"] == "reduce_scatter along 'col': dim 0 of size 3 is not divisible by 2"


@pytest.mark.parametrize("axis", ["row", "col", "data_parallel"])
def test_direct_torch_distributed_collectives_are_recorded_once_in_comms_convention(ranks, axis):
    """What FSDP2 issues (dist.all_gather_single, reduce_scatter_single; an async all_reduce) reaches the recorders
    as direct calls named by their mesh axis, with the group's global ranks and comm's payload: the local input of
    an all-gather, the full input of a reduce-scatter; comm's own calls stay single."""
    world, outs = ranks
    if axis == "data_parallel" and world == P:
        pytest.skip("data_parallel has one rank here")
    for rank, out in enumerate(outs):
        d, r, c = rank // P, rank % P // Q, rank % Q
        members = {"row": [d * P + k * Q + c for k in range(Q)], "col": [d * P + r * Q + k for k in range(Q)],
                   "data_parallel": [k * P + r * Q + c for k in range(world // P)]}[axis]
        n = len(members)
        got = out["direct"][axis]
        calls = [("all_gather", 2 * 3 * 8, True), ("reduce_scatter", 4 * n * 4, True), ("all_reduce", 5 * 8, True),
                 ("all_reduce", 3 * 4, False)]
        assert got["seen"] == [(event, kind, axis, tuple(members), nbytes, direct)
                               for kind, nbytes, direct in calls for event in ("posted", "waited")], rank
        assert got["snapshot"] == {**NOTHING, "all_gather": {"calls": 1, "bytes": 48},
                                   "reduce_scatter": {"calls": 1, "bytes": 16 * n},
                                   "all_reduce": {"calls": 2, "bytes": 52}}, rank
        assert got["gathered"] == [float(m) for m in members], rank  # the calls ran as called
        assert got["out"] == [float(sum(m + 1 for m in members))] * 4 and got["t"] == [float(n)] * 5, rank
