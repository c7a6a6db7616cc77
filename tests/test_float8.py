"""Float8 linears (``parallel.float8``, :mod:`lightning_tp2d.float8`) on the "2d" grid, against torchao's own float8.

* **One SUMMA product** on a 2x2 grid (4 gloo ranks), every algorithm and form, forward and both gradients:
  * ``tensorwise``: equal to the single-device float8 product built from torchao's pieces with the *global* scales
    (float32 outputs, to 1e-5 relative: only the order of the fp32 partial sums differs), because every rank casts
    its block with the all-reduced amax;
  * ``rowwise``: each partial casts its own operands; cosine >= 0.999 against torchao's rowwise product of the whole
    matrices (its scales span the whole contraction, the grid's a block of it);
  * the activation and weight blocks travel as float8: a quarter of float32's bytes on every transfer, plus one
    8-byte amax all-reduce per axis and pass; byte for byte, every float8 block sent or received (forward and
    backward, the ring's weight blocks too) is a tile of the whole operand cast with its global scale.
* **Whole models** on every layout (tiny GPT-2 and Llama, fp32 master weights, one forward and backward; fp32, and
  bf16 autocast on "2d" and the ring's GPT-2):
  every gradient's cosine >= 0.99 against the same layout in high precision and against the plain model converted by
  torchao's ``convert_to_float8_training`` (same recipe), losses within 1e-3; tensorwise GPT-2 in fp32 equals torchao's
  plain model to float32 rounding (the same scales).
* **One rank** (a 1x1 grid) runs torchao's own float8 linear: bit-equal to the converted plain model.
* **Refusals**: an unknown recipe, a layout that does not say its products run float8, ``layout="auto"``,
  ``tp2d-train parallel.float8`` with the planner.

All distributed checks of one grid run in one ``run_distributed`` call (module-scoped fixtures).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util

import pytest
import torch

if importlib.util.find_spec("torchao") is None:  # (not importorskip: torchao is imported quietly, by float8.py)
    pytest.skip("float8 needs torchao (the test extra)", allow_module_level=True)

import lightning_tp2d as tp  # noqa: E402
from lightning_tp2d import comm, float8  # noqa: E402
from lightning_tp2d.mesh import grid_coords, init_mesh  # noqa: E402
from lightning_tp2d.models import GPT2, GPT2Config, Llama, LlamaConfig  # noqa: E402
from lightning_tp2d.options import TPOptions  # noqa: E402
from lightning_tp2d.summa import summa_ab  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

Q = 2
M, K, N = 24, 40, 32  # full product shapes; blocks 12 x 20 and 20 x 16 on the 2x2 grid
# (summa algorithm, keep_panels, form): every path a Linear2D can take
ALGOS = (("collective", False, "gather"), ("collective", True, "gather"), ("collective", False, "scatter"),
         ("broadcast", False, "gather"), ("broadcast", True, "gather"))
RECIPES = float8.RECIPES
# whole-model cases (layout, family, recipe, bf16 autocast): every layout, family and recipe in fp32; bf16 on "2d"
# and on the ring's GPT-2, whose heads its blocks cut through (float8 blocks gathered as bytes, HeadBlocks.read)
CASES = [(la, f, r, b) for la in ("2d", "metp", "2d-metp") for f in ("gpt2", "llama") for r in RECIPES
         for b in (False, True) if not b or la == "2d" or (la, f) == ("metp", "gpt2")]


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def _block(x: torch.Tensor, i: int, j: int) -> torch.Tensor:
    bi, bj = x.shape[0] // Q, x.shape[1] // Q
    return x[i * bi:(i + 1) * bi, j * bj:(j + 1) * bj]


def _operands():
    g = torch.Generator().manual_seed(7)
    a = torch.randn(M, K, generator=g)
    a[3, 5] = 9.0  # one large entry: a global scale differs from most blocks' own
    w = torch.randn(N, K, generator=g) * 0.1  # a torch Linear weight [out, in]; B = wᵀ
    dc = torch.randn(M, N, generator=g)
    return a, w, dc


def _tensorwise_reference(a, w, dc):
    """C = A Wᵀ, dA, dW from torchao's casts with each tensor's global scale, one ``_scaled_mm`` per GEMM."""
    config = float8.recipe_config("tensorwise")
    (a8, w8, g8), (sa, sw, sg) = float8.tensorwise_cast(
        [a, w, dc], [config.cast_config_input.target_dtype, config.cast_config_weight.target_dtype,
                     config.cast_config_grad_output.target_dtype])
    mm = lambda x, y, s1, s2: torch._scaled_mm(x.contiguous(), y.t().contiguous().t(), s1.reciprocal(),  # noqa: E731
                                               s2.reciprocal(), out_dtype=torch.float32)
    return mm(a8, w8.t(), sa, sw), mm(g8, w8, sg, sw), mm(g8.t(), a8, sg, sa)


def _rowwise_reference(a, w, dc):
    """torchao's rowwise product of the whole matrices (its autograd function and config)."""
    a = a.clone().requires_grad_()
    w = w.clone().requires_grad_()
    out = float8.linear(a, w, None, float8.linear_configs("rowwise"))
    out.backward(dc)
    return out.detach(), a.grad, w.grad


@contextlib.contextmanager
def _float8_on_the_wire():
    """Every float8 tensor :mod:`lightning_tp2d.comm` sends or receives into (what ``comm._bits`` turns into bytes),
    recorded as it is handed over: a list, read after the calls have completed."""
    seen, bits = [], comm._bits

    def recording(tensor):
        if tensor.dtype in comm.FLOAT8_DTYPES:
            seen.append(tensor)
        return bits(tensor)

    comm._bits = recording
    try:
        yield seen
    finally:
        comm._bits = bits


def _wire_mismatches(seen: list, codes: list) -> tuple[int, int]:
    """``(checked, unmatched)``: each transferred float8 buffer (an all-gather's output: its ``n`` blocks, stacked or
    laid end to end along rows) must be, byte for byte, aligned tiles of ``codes`` (the whole operands cast with their
    global scales) or of their transposes: what arrives decodes to exactly what the sender's operand cast to."""

    def is_tile(block) -> bool:
        r, c = block.shape
        got = block.contiguous().view(torch.uint8)
        return any(torch.equal(got, ref[i:i + r, j:j + c].contiguous().view(torch.uint8))
                   for full in codes for ref in (full, full.t()) if ref.dtype == block.dtype
                   and ref.shape[0] % r == 0 and ref.shape[1] % c == 0
                   for i in range(0, ref.shape[0], r) for j in range(0, ref.shape[1], c))

    unmatched = 0
    for buffer in seen:
        stacks = [buffer.unbind(0)] if buffer.dim() == 3 else \
            [buffer.chunk(n, 0) for n in range(1, 9) if buffer.shape[0] % n == 0]
        unmatched += not any(all(is_tile(block) for block in blocks) for blocks in stacks)
    return len(seen), unmatched


def _global_codes(a, w, dc) -> list:
    config = float8.recipe_config("tensorwise")
    return float8.tensorwise_cast([a, w, dc], [config.cast_config_input.target_dtype,
                                               config.cast_config_weight.target_dtype,
                                               config.cast_config_grad_output.target_dtype])[0]


def _product_worker(rank: int, world_size: int) -> dict:
    mesh = init_mesh("2d", world_size, 1)
    i, j = grid_coords(mesh)
    a_full, w_full, dc_full = _operands()
    results = {}
    for recipe in (None, *RECIPES):
        for algo in ALGOS:
            summa, keep, form = algo
            a = _block(a_full, i, j).clone().requires_grad_()
            # rank (i, j) holds W's block [out_j, in_i] (Linear2D), or the mirror [out_i, in_j] in the scatter form
            w = (_block(w_full, i, j) if form == "scatter" else _block(w_full, j, i)).clone().requires_grad_()
            with _float8_on_the_wire() as wire:
                with comm.count_comm() as stats:
                    c = summa_ab(a, w.t(), mesh, TPOptions(summa=summa, keep_panels=keep), form, form == "scatter",
                                 float8=recipe)
                    fwd = stats.snapshot()
                c.backward(_block(dc_full, i, j).contiguous())
            results[(recipe, algo)] = {"c": c.detach(), "da": a.grad, "dw": w.grad, "fwd": fwd,
                                       "wire": _wire_mismatches(wire, _global_codes(a_full, w_full, dc_full))}
    refs = {"tensorwise": _tensorwise_reference(a_full, w_full, dc_full),
            "rowwise": _rowwise_reference(a_full, w_full, dc_full)}
    checks = {}
    for (recipe, algo), got in results.items():
        if recipe is None:
            continue
        c_ref, da_ref, dw_ref = refs[recipe]
        wi, wj = (i, j) if algo[2] == "scatter" else (j, i)
        blocks = {"c": _block(c_ref, i, j), "da": _block(da_ref, i, j), "dw": _block(dw_ref, wi, wj)}
        checks[(recipe, algo)] = {
            "rel": {k: _rel(got[k], blocks[k]) for k in blocks},
            "cos": {k: _cos(got[k], blocks[k]) for k in blocks},
            "bytes": {kind: s["bytes"] for kind, s in got["fwd"].items() if s["calls"]},
            "hp_bytes": {kind: s["bytes"] for kind, s in results[(None, algo)]["fwd"].items() if s["calls"]},
            "wire": got["wire"],
        }
    return checks


@pytest.fixture(scope="module")
def products():
    return run_distributed(_product_worker, Q * Q)


def _algo_id(algo) -> str:
    return "-".join([algo[0], *(["keep"] if algo[1] else []), algo[2]])


@pytest.mark.parametrize("algo", ALGOS, ids=_algo_id)
def test_tensorwise_grid_product_equals_the_float8_product_with_global_scales(products, algo):
    for rank, checks in enumerate(products):
        rel = checks[("tensorwise", algo)]["rel"]
        assert max(rel.values()) < 1e-5, (rank, rel)


@pytest.mark.parametrize("algo", ALGOS, ids=_algo_id)
def test_rowwise_grid_product_agrees_with_torchao_rowwise_within_float8_rounding(products, algo):
    for rank, checks in enumerate(products):
        cos = checks[("rowwise", algo)]["cos"]
        assert min(cos.values()) > 0.999, (rank, cos)
        assert max(checks[("rowwise", algo)]["rel"].values()) < 0.1, (rank, checks[("rowwise", algo)]["rel"])


@pytest.mark.parametrize("algo", ALGOS, ids=_algo_id)
def test_tensorwise_blocks_travel_as_float8(products, algo):
    """Every operand transfer of the forward carries a quarter of float32's bytes (the scatter form's ring carries
    partial sums of the output, in high precision); the only other traffic is the amax all-reduce, 2 float32
    amaxes (A's and W's) once per grid axis."""
    for rank, checks in enumerate(products):
        got, hp = checks[("tensorwise", algo)]["bytes"], checks[("tensorwise", algo)]["hp_bytes"]
        assert got.pop("all_reduce") == 2 * 2 * 4, (rank, got)
        sums = ("ring_exchange",) if algo[2] == "scatter" else ()
        assert got == {kind: n if kind in sums else n // 4 for kind, n in hp.items()}, (rank, got, hp)
        rowwise = checks[("rowwise", algo)]["bytes"]
        assert rowwise == hp, (rank, rowwise, hp)  # rowwise: panels in high precision (their scales differ by block)
        assert checks[("rowwise", algo)]["wire"] == (0, 0), (rank, checks[("rowwise", algo)]["wire"])


@pytest.mark.parametrize("algo", ALGOS, ids=_algo_id)
def test_tensorwise_transfers_are_the_bytes_of_the_global_cast(products, algo):
    """Byte for byte, forward and backward: every float8 block a rank sends or receives is a block of the operand
    (A, W or dC) cast whole with its global scale, so the panel a rank multiplies decodes to exactly the value its
    owner's operand cast to (nothing re-quantized, reordered or torn on the way)."""
    for rank, checks in enumerate(products):
        checked, unmatched = checks[("tensorwise", algo)]["wire"]
        assert checked >= 2 and unmatched == 0, (rank, checked, unmatched)


def _ring_worker(rank: int, world_size: int) -> dict:
    from lightning_tp2d.metp import ring_mlp
    from lightning_tp2d.nn.ring_stream import ColumnBlocks, ring_linear_out

    mesh = init_mesh("metp", world_size, 1)
    a_full, w_full, dc_full = _operands()  # X [24, 40] rows over the ring (6 each), W [32, 40] rows (8 each)
    rows, out_rows = M // world_size, N // world_size
    mine = lambda t, n: t[rank * n:(rank + 1) * n]  # noqa: E731
    results = {}
    for recipe in (None, "tensorwise"):
        x = mine(a_full, rows).clone().requires_grad_()
        w = mine(w_full, out_rows).clone().requires_grad_()
        with _float8_on_the_wire() as wire:
            with comm.count_comm() as stats:
                y = ring_linear_out(x, w, None, mesh, "ring", ColumnBlocks(rows, world_size, out_rows),
                                    float8=recipe)
                fwd = stats.snapshot()
            y.backward(mine(dc_full, rows))
        results[recipe] = {"y": y.detach(), "dx": x.grad, "dw": w.grad, "bytes": fwd["ring_exchange"]["bytes"],
                           "wire": _wire_mismatches(wire, _global_codes(a_full, w_full, dc_full))}
        # the ring MLP: every GEMM in float8, its weight blocks travelling as float8
        w1 = mine(w_full, out_rows).clone().requires_grad_()
        w2 = mine(w_full, out_rows).t().contiguous().requires_grad_()
        with comm.count_comm() as stats:
            out = ring_mlp(x.detach(), w1, None, w2, None, mesh, "ring", float8=recipe)
            results[recipe]["mlp_bytes"] = stats.snapshot()["ring_exchange"]["bytes"]
        out.sum().backward()
        results[recipe]["mlp"] = (out.detach(), w1.grad, w2.grad)
    c_ref, da_ref, dw_ref = _tensorwise_reference(a_full, w_full, dc_full)
    got = results["tensorwise"]
    high_mlp, f8_mlp = results[None]["mlp"], got["mlp"]
    return {"rel": {"y": _rel(got["y"], mine(c_ref, rows)), "dx": _rel(got["dx"], mine(da_ref, rows)),
                    "dw": _rel(got["dw"], mine(dw_ref, out_rows))},
            "wire": got["wire"], "bytes": (got["bytes"], results[None]["bytes"]),
            "mlp_bytes": (got["mlp_bytes"], results[None]["mlp_bytes"]),
            "mlp_cos": min(_cos(a, b) for a, b in zip(f8_mlp, high_mlp))}


def test_ring_float8_linear_equals_the_float8_product_and_its_blocks_travel_as_float8():
    """``ring_linear_out`` (tensorwise, a ring of 4) against the single-device float8 product with global scales, to
    float32 rounding; its weight blocks, and the ring MLP's, carry a quarter of float32's bytes (the gradient sums
    travel in high precision); the ring MLP agrees with its high-precision self (cosine >= 0.99)."""
    for rank, got in enumerate(run_distributed(_ring_worker, 4)):
        assert max(got["rel"].values()) < 1e-5, (rank, got)
        assert got["bytes"][0] * 4 == got["bytes"][1] and got["mlp_bytes"][0] * 4 == got["mlp_bytes"][1], (rank, got)
        assert got["mlp_cos"] > 0.99, (rank, got)
        checked, unmatched = got["wire"]  # every weight block on the ring: bytes of W cast with its global scale
        assert checked >= 3 and unmatched == 0, (rank, got["wire"])


# ---- whole models ------------------------------------------------------------------------------------------------


def _model(family: str):
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = GPT2Config.from_name("gpt2-tiny", dropout=0.0)
        return cfg, GPT2(cfg)
    cfg = LlamaConfig.from_name("llama-tiny")
    return cfg, Llama(cfg)


def _model_worker(rank: int, world_size: int) -> dict:
    q = int(round(world_size ** 0.5))
    grads = lambda m: [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad  # noqa: E731
                       for p in m.parameters()]
    out = {}
    for layout, family, recipe, bf16 in CASES:
        mesh = init_mesh(layout, world_size, 1)
        cfg, plain = _model(family)
        high, par = copy.deepcopy(plain), copy.deepcopy(plain)
        float8.convert_plain(plain, recipe)
        tp.parallelize(par, mesh, layout=layout, options=TPOptions(float8=recipe))
        tp.parallelize(high, mesh, layout=layout)
        g = torch.Generator().manual_seed(1)
        idx = torch.randint(0, cfg.vocab_size, (2 * q, 32), generator=g)
        targets = torch.randint(0, cfg.vocab_size, (2 * q, 32), generator=g)
        losses = []
        for m in (plain, par, high):
            with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
                loss = m(idx, targets)
            loss.backward()
            losses.append(loss.item())
        mine = grads(par)
        out[(layout, family, recipe, bf16)] = {
            "losses": losses,
            "cos_plain": min(_cos(x, y) for x, y in zip(mine, grads(plain))),
            "cos_high": min(_cos(x, y) for x, y in zip(mine, grads(high))),
            "float8_linears": sum(float8.is_float8_linear(m) for m in plain.modules()),
            "recipe": par.tp.layout.options.float8,
        }
    return out


@pytest.fixture(scope="module")
def models():
    return run_distributed(_model_worker, Q * Q)[0]


@pytest.mark.parametrize("layout, family, recipe, bf16", CASES,
                         ids=[f"{la}-{f}-{r}-{'bf16' if b else 'fp32'}" for la, f, r, b in CASES])
def test_grid_float8_step_agrees_with_high_precision_and_with_torchao(models, layout, family, recipe, bf16):
    got = models[(layout, family, recipe, bf16)]
    plain, mine, high = got["losses"]
    assert abs(mine - high) / high < 1e-3 and abs(mine - plain) / plain < 1e-3, got
    assert got["cos_high"] > 0.99 and got["cos_plain"] > 0.99, got
    assert got["float8_linears"] > 0 and got["recipe"] == recipe


def test_tensorwise_grid_equals_torchao_plain_to_float32_rounding(models):
    got = models[("2d", "gpt2", "tensorwise", False)]
    plain, mine, _ = got["losses"]
    assert abs(mine - plain) / plain < 1e-6, got
    assert got["cos_plain"] > 0.99999, got


# (layout, tensor-parallel ranks, recipe) x dp over 4 ranks: the ring's float8 kernels and a 1x1 grid's torchao linear
ZERO_CASES = (("metp", 2, "tensorwise"), ("metp", 2, "rowwise"), ("2d", 1, "tensorwise"))


def _zero_worker(rank: int, world_size: int) -> dict:
    """Three clipped AdamW steps of a float8 GPT-2 at ZeRO 0 (GradientSync) and ZeRO 3 (FSDP2 over data_parallel),
    each replica its own batches, as tests/test_fsdp.py trains bf16 ones (its loop)."""
    from tests.test_fsdp import _train

    out = {}
    for layout, p, recipe in ZERO_CASES:
        mesh = init_mesh(layout, p, world_size // p)
        runs = {stage: _train("gpt2", layout, mesh, stage, options=TPOptions(float8=recipe), steps=3)
                for stage in (0, 3)}
        out[(layout, p, recipe)] = {stage: (got["losses"], got["norms"], got["model"].tp.layout.options.float8)
                                    for stage, got in runs.items()}
    return out


def test_zero_3_trains_a_float8_model_like_zero_0():
    """FSDP2 shards a float8 model's master weights like any other: it gathers them (in their own precision) before
    the layer casts them, so three clipped steps at ZeRO 3 give ZeRO 0's losses and gradient norms (the casts see the
    same weights; only fp32 summation order differs): the ring's float8 kernels on a ring of 2 x dp 2, and torchao's
    own float8 linear on a 1x1 grid x dp 4."""
    for rank, out in enumerate(run_distributed(_zero_worker, 4)):
        for case, runs in out.items():
            (l0, n0, _), (l3, n3, recipe) = runs[0], runs[3]
            assert max(abs(a - b) / a for a, b in zip(l0, l3)) < 1e-4, (rank, case, l0, l3)
            assert max(abs(a - b) / a for a, b in zip(n0, n3)) < 1e-3, (rank, case, n0, n3)
            assert recipe == case[2], (rank, case, recipe)



def _one_rank(rank: int, world_size: int, recipe: str) -> dict:
    cfg, plain = _model("gpt2")
    par = copy.deepcopy(plain)
    float8.convert_plain(plain, recipe)
    tp.parallelize(par, init_mesh("2d", 1, 1), layout="2d", options=TPOptions(float8=recipe))
    idx = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    losses = [m(idx, idx) for m in (plain, par)]
    for loss in losses:
        loss.backward()
    return {"loss": [loss.item() for loss in losses],
            "grads": max((p.grad.full_tensor() - p0.grad).abs().max().item()
                         for p, p0 in zip(par.parameters(), plain.parameters()))}


@pytest.mark.parametrize("recipe", RECIPES)
def test_one_rank_runs_torchaos_own_float8_linear(recipe):
    got = run_distributed(_one_rank, 1, recipe)[0]
    assert got["loss"][0] == got["loss"][1] and got["grads"] == 0.0, got


def _rival_worker(rank: int, world_size: int) -> dict:
    from lightning_tp2d.baselines.tp1d import init_tp1d_mesh, parallelize_1d, qkv_permutation

    out = {}
    for family in ("gpt2", "llama"):
        for recipe in RECIPES:
            torch.manual_seed(0)
            if family == "gpt2":
                cfg = GPT2Config.from_name("gpt2-tiny", n_head=4)
                plain = GPT2(cfg)
            else:
                cfg = LlamaConfig.from_name("llama-tiny", n_head=8, n_kv_head=4)
                plain = Llama(cfg)
            rival = copy.deepcopy(plain)
            float8.convert_plain(plain, recipe)
            parallelize_1d(rival, init_tp1d_mesh(world_size), sequence_parallel=True, float8=recipe)
            idx = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
            losses = [m(idx, idx) for m in (plain, rival)]
            for loss in losses:
                loss.backward()
            inverse = torch.argsort(qkv_permutation(cfg.n_embd, world_size))  # GPT-2's c_attn rows, regrouped
            full = lambda name, g: (g.full_tensor() if hasattr(g, "full_tensor") else g)[  # noqa: E731
                inverse if "c_attn" in name else slice(None)]
            plain_grads = dict(plain.named_parameters())
            out[(family, recipe)] = {
                "losses": [loss.item() for loss in losses],
                "float8_linears": sum(float8.is_float8_linear(m) for m in rival.modules()),
                "cos": min(_cos(full(name, p.grad), plain_grads[name].grad) for name, p in rival.named_parameters()
                           if name in plain_grads)}
    return out


def test_the_rival_runs_float8_with_torchaos_own_code():
    """torch's 1-D TP + SP (``parallelize_1d(..., float8=)``: torchao's ``convert_to_float8_training``, then torch's
    styles) against torchao's plain float8 model: tensorwise to float32 rounding (DTensor's global amax), rowwise
    within float8 rounding; every comparable gradient's cosine >= 0.99."""
    got = run_distributed(_rival_worker, 4)[0]
    for (family, recipe), r in got.items():
        plain, rival = r["losses"]
        assert r["float8_linears"] == (8 if family == "gpt2" else 14), (family, recipe, r)
        assert abs(plain - rival) / plain < (1e-6 if recipe == "tensorwise" else 1e-3), (family, recipe, r)
        assert r["cos"] > 0.99, (family, recipe, r)


def _rival_fsdp_worker(rank: int, world_size: int) -> dict:
    """The rival at 1-D TP 2 + SP x FSDP2 dp 2 (ZeRO 3), tensorwise, with and without torchao's float8 all-gather:
    three AdamW steps' losses and one step's FSDP all-gather bytes."""
    from lightning_tp2d.baselines.tp1d import parallelize_1d
    from lightning_tp2d.baselines.tp1d_sp import DP_AXIS, init_tp_dp_mesh, shard_1d_data_parallel

    mesh = init_tp_dp_mesh(2, world_size // 2)
    out = {}
    for gather in (False, True):
        torch.manual_seed(0)
        cfg = LlamaConfig.from_name("llama-tiny", n_head=8, n_kv_head=4)
        model = parallelize_1d(Llama(cfg), mesh["tp"], sequence_parallel=True, float8="tensorwise",
                               fsdp_float8_all_gather=gather)
        shard_1d_data_parallel(model, mesh[DP_AXIS], 3)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        torch.manual_seed(1 + mesh.get_local_rank(DP_AXIS))
        losses = []
        for step in range(3):
            idx = torch.randint(0, cfg.vocab_size, (2, 32))
            optimizer.zero_grad()
            with comm.count_comm() as stats:
                loss = model(idx, idx)
                loss.backward()
            optimizer.step()
            if gather:
                float8.precompute_fsdp_scales(model)
            losses.append(loss.item())
        out[gather] = {"losses": losses, "all_gather": stats.snapshot()["all_gather"]["bytes"]}
    return out


def test_the_rivals_fsdp_gathers_float8_weights_with_torchaos_own_code():
    """``parallelize_1d(..., fsdp_float8_all_gather=True)`` (torchtitan's option, tensorwise): FSDP2 all-gathers the
    float8 linears' weights as float8, a quarter of float32's bytes, and the model trains as without it (its weights
    are cast with the same global amax, before the gather instead of after)."""
    for rank, out in enumerate(run_distributed(_rival_fsdp_worker, 4)):
        plain, gathered = out[False], out[True]
        rel = [abs(a - b) / a for a, b in zip(plain["losses"], gathered["losses"])]
        # the first step to float8 rounding (torchao computes the gathered weights' scales its own way); AdamW's
        # normalised updates let that grow a little over the next steps
        assert rel[0] < 1e-4 and max(rel) < 2e-3, (rank, out)
        # the linears' weights dominate what FSDP gathers: under half of float32's bytes, not a quarter (the
        # embedding, head and norms stay float32)
        assert gathered["all_gather"] < 0.5 * plain["all_gather"], (rank, out)
    with pytest.raises(ValueError, match="tensorwise scaling only"):
        float8.convert_plain(torch.nn.Sequential(torch.nn.Linear(16, 16)), "rowwise", fsdp_float8_all_gather=True)


# ---- refusals ----------------------------------------------------------------------------------------------------


def test_an_unknown_recipe_is_refused_naming_the_recipes():
    with pytest.raises(ValueError, match=r"float8='fp8' is not one of None, 'tensorwise', 'rowwise'"):
        TPOptions(float8="fp8")
    assert TPOptions(float8="none").float8 is None


def test_a_layout_whose_products_do_not_run_float8_refuses_a_recipe():
    class NoFloat8(tp.layouts.Ring):  # a user's layout that has not said its products run float8
        name = "no-float8"
        float8_products = False

    with pytest.raises(ValueError, match=r"runs on the layouts '2d', 'metp', '2d-metp'; layout 'no-float8' does not"):
        NoFloat8(TPOptions(float8="tensorwise"))
    assert NoFloat8(TPOptions()).options.float8 is None


def test_strategy_carries_the_recipe_to_the_layers_and_says_it_is_emulated_on_cpu():
    with pytest.warns(UserWarning, match=r"float8='rowwise': torch._scaled_mm is emulated on the CPU"):
        strategy = tp.TP2DStrategy(layout="2d", float8="rowwise")
    assert strategy.float8 == "rowwise" and strategy.layout_spec.options.float8 == "rowwise"
    assert tp.TP2DStrategy(layout="2d").float8 is None
    with pytest.warns(UserWarning, match="emulated"):
        auto = tp.TP2DStrategy(layout="auto", float8="tensorwise", memory_gib=1.0)
    assert auto.float8 == "tensorwise" and auto.layout_spec is None  # kept for the planner


def test_tp2d_train_checks_the_recipe_before_launch():
    from omegaconf import OmegaConf

    from lightning_tp2d.train import ConfigError, check_parallel

    check_parallel(OmegaConf.create({"layout": "2d", "float8": "tensorwise"}))
    check_parallel(OmegaConf.create({"layout": "auto", "float8": "rowwise"}))  # the planner prices it
    with pytest.raises(ConfigError, match=r"parallel.float8: float8='e4m3' is not one of"):
        check_parallel(OmegaConf.create({"layout": "2d", "float8": "e4m3"}))
    with pytest.raises(ConfigError, match=r"parallel.float8: float8='e4m3' is not one of"):
        check_parallel(OmegaConf.create({"layout": "auto", "float8": "e4m3"}))


# ---- priced ------------------------------------------------------------------------------------------------------


def test_the_planner_prices_float8_on_every_side_by_one_rule():
    """``plan(..., float8=...)``: every row, package and rival, is its bf16 row with the linears' GEMMs at the float8
    rate and their casts' bytes added (cost_model.float8_seconds); rowwise casts twice as much; under tensorwise the
    grids' exposed tensor-parallel communication shrinks (float8 panels) and a rival under FSDP2 gathers its weights
    as float8 (less data-parallel traffic, its weights cast as shards); a GPU without float8 GEMMs is refused; the
    rows run what they priced (the plan's options, torchao's converter for torchtitan)."""
    from lightning_tp2d.planning import cost_model, rival_models
    from lightning_tp2d.planning.commands import command_for
    from lightning_tp2d.planning.memory_model import parameter_split
    from lightning_tp2d.train_plan import fsdp_shards
    from lightning_tp2d.planning.planner import HARDWARE, plan

    args = dict(gpus=8, gpu_memory_gib=80, seq=8192, global_batch_tokens=2 ** 22, cache=False)
    rows = {recipe: {(r.layout, r.tensor_parallel_size, r.data_parallel_size, r.zero_stage, r.checkpointing,
                      r.micro_batch, r.loss, r.async_tp): r for r in plan("llama-3.1-8b", float8=recipe, **args)}
            for recipe in (None, "tensorwise", "rowwise")}
    hw = HARDWARE["h100"]
    cfg = tp.families.model_config("llama-3.1-8b")
    sides, wire = set(), {}
    for key, high in rows[None].items():
        for recipe in RECIPES:
            row = rows[recipe][key]
            # a rival under FSDP2 at tensorwise gathers its weights as float8: cast as shards, one byte on the wire
            shards = rival_models.model_of(row.layout).data_parallel(parameter_split(cfg), row.plan).sharding
            gathered = recipe == "tensorwise" and row.baseline and fsdp_shards(row.zero_stage, shards)
            f8 = cost_model.float8_seconds(cfg, row.micro_batch * 8192, row.tensor_parallel_size, row.checkpointing,
                                           recipe, hw, weight_shards=shards if gathered else 1)
            assert row.float8 == recipe and row.parts["time_s"]["micro_float8"] == pytest.approx(
                f8["cast_s"] - f8["gemm_saved_s"], rel=1e-12)
            # the GEMMs gain more than the casts cost at these sizes, unless the host issuing the ops is the limit
            assert row.step_s < high.step_s or (row.host_bound and row.step_s == high.step_s), (row, high)
            sides.add(row.baseline)
            time_s, high_s = row.parts["time_s"], high.parts["time_s"]
            if recipe == "rowwise" or row.tensor_parallel_size == 1 or row.layout == "metp":
                # rowwise sends what bf16 does; the ring's float8 blocks are priced in bf16
                assert time_s["micro_tp_exposed"] == high_s["micro_tp_exposed"] or row.baseline, (row, high)
            elif not row.baseline:  # the grids' panels travel as float8: fewer bytes, never more exposed
                assert time_s["micro_tp_exposed"] <= high_s["micro_tp_exposed"], (row, high)
                wire[row.layout] = wire.get(row.layout, 0) + (time_s["micro_tp_exposed"] < high_s["micro_tp_exposed"])
            if gathered:
                assert time_s["dp_comm"] < high_s["dp_comm"], (row, high)
                wire["gathered"] = wire.get("gathered", 0) + 1
            else:
                assert time_s["dp_comm"] == high_s["dp_comm"], (row, high)
    assert sides == {True, False}
    assert wire.get("2d", 0) > 0 and wire.get("gathered", 0) > 0, wire
    tensorwise = cost_model.float8_seconds(cfg, 8192, 4, "none", "tensorwise", hw)
    rowwise = cost_model.float8_seconds(cfg, 8192, 4, "none", "rowwise", hw)
    assert rowwise["cast_s"] == pytest.approx(2 * tensorwise["cast_s"]) and \
        rowwise["gemm_saved_s"] == tensorwise["gemm_saved_s"]
    best = min(rows["tensorwise"].values(), key=lambda r: r.step_s if not r.baseline else float("inf"))
    assert best.train_plan.options.float8 == "tensorwise"
    assert "parallel.float8=tensorwise" in command_for(best, "llama-3.1-8b", 8192, gpus_per_node=8)
    baseline = min((r for r in rows["rowwise"].values() if r.baseline), key=lambda r: r.step_s)
    assert "--quantize.linear.float8.recipe_name=rowwise" in command_for(baseline, "llama-3.1-8b", 8192,
                                                                         gpus_per_node=8)
    gathered = min((r for r in rows["tensorwise"].values() if r.baseline and r.layout == "tp1d-sp"
                    and fsdp_shards(r.zero_stage, r.data_parallel_size)), key=lambda r: r.step_s)
    assert "--quantize.linear.float8.enable_fsdp_float8_all_gather" in command_for(gathered, "llama-3.1-8b", 8192,
                                                                                   gpus_per_node=8)
    with pytest.raises(ValueError, match="has no float8 GEMMs"):
        plan("llama-3.1-8b", float8="tensorwise", hardware="a100", **args)


def _compiled(rank: int, world_size: int) -> dict:
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    out = {}
    for layout, recipe in (("2d", "rowwise"), ("metp", "tensorwise")):  # each recipe, each kind of kernel
        cfg, model = _model("gpt2")
        tp.parallelize(model, init_mesh(layout, world_size, 1), layout=layout, options=TPOptions(float8=recipe))
        eager = copy.deepcopy(model)
        dynamo.reset()
        counters.clear()
        model.compile(backend="aot_eager", dynamic=False)
        idx = torch.randint(0, cfg.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1))
        losses = [m(idx, idx) for m in (eager, model)]
        for loss in losses:
            loss.backward()
        out[(layout, recipe)] = {"losses": [loss.item() for loss in losses], "breaks": sum(counters["graph_break"].values()),
                       "grads": max(_rel(p.grad.full_tensor(), p0.grad.full_tensor())
                                    for p, p0 in zip(model.parameters(), eager.parameters()))}
    return out


def test_float8_layouts_compile_into_one_graph_and_equal_eager():
    for rank, got in enumerate(run_distributed(_compiled, Q * Q)):
        for recipe, r in got.items():
            assert r["breaks"] == 0 and abs(r["losses"][0] - r["losses"][1]) < 1e-5 and r["grads"] < 1e-4, (rank, recipe, r)
