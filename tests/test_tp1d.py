"""The 1-D tensor-parallel baseline (torch's own TP styles on our GPT-2), without and with sequence parallelism,
against the plain model, and the counter of DTensor's functional collectives against the communication formulas
of ``tp1d_comm_events`` and ``tp1d_sp_comm_events``."""

import dataclasses
import copy

import pytest
import torch
import torch.distributed._functional_collectives as funcol
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_tp2d.bench.collectives import FunctionalCollectiveCounter, count_functional_collectives
from lightning_tp2d.planning.events import totals, wire_bytes
from lightning_tp2d.baselines.tp1d import (TP1DHandle, _loss_parallel_active, check_tp1d, full_state_dict_1d,
                                       init_tp1d_mesh, param_groups_1d, parallelize_1d, qkv_permutation)
from lightning_tp2d.planning.rivals import check_sequence_parallel, tp1d_comm_events, tp1d_sp_comm_events
from lightning_tp2d.layouts import handle_of
from lightning_tp2d.models import GPT2, GPT2Config, Llama, LlamaConfig
from tests.distributed import run_distributed

B, T = 3, 5  # N = 15 tokens: no dimension of gpt2-tiny (h 48, V 257, heads 12) is 15, 3 or 5 apart from these
T_SP = 8  # sequence parallelism: T divisible by p = 2 and 4
T_SP_LLAMA = {2: 8, 3: 6}  # llama-tiny splits over p = 2 and 3 (not 4: 6 key/value heads)


def tiny(**overrides) -> GPT2Config:
    return GPT2Config.from_name("gpt2-tiny", n_head=12, **overrides)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _shape_only(t: torch.Tensor) -> bool:
    """Meta and fake tensors (DTensor's sharding propagation computes output shapes with them) hold no memory."""
    return t.is_meta or isinstance(t, FakeTensor)


class VocabRows(TorchDispatchMode):
    """Records the shape of every local tensor (op output) that holds a vocabulary row per token:
    one of its dims is V and it also has N, or both B and T. DTensor ops desugar into local ops seen here;
    shape-only (meta / fake) tensors are ignored."""

    def __init__(self, V: int, b: int = B, t: int = T):
        super().__init__()
        self.V, self.found, self.b, self.t = V, [], b, t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and self.V in t.shape and not _shape_only(t):
                dims = list(t.shape)
                if self.b * self.t in dims or (self.b in dims and self.t in dims):
                    self.found.append((str(func), tuple(dims), type(t).__name__, str(t.device)))
        return out


def _batch(V: int, t: int = T):
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, V, (B, t), generator=g)
    targets = torch.randint(0, V, (B, t), generator=g)
    targets[0, 1] = -100  # ignored position
    return idx, targets


def _parity(rank, world_size, dtype, sp=False):
    cfg = tiny()
    t = T_SP if sp else T
    torch.manual_seed(0)
    ref = GPT2(cfg).to(dtype)
    model = copy.deepcopy(ref)
    mesh = init_tp1d_mesh(world_size)
    assert mesh.mesh_dim_names == ("tp",)
    with pytest.raises(ValueError, match=rf"p={world_size + 1}.*world size {world_size}"):
        init_tp1d_mesh(world_size + 1)
    bad_heads = 6 if world_size == 4 else 3
    with pytest.raises(ValueError, match=rf"n_head={bad_heads} is not divisible by p={world_size}"):
        parallelize_1d(GPT2(GPT2Config.from_name("gpt2-tiny", n_layer=1, n_head=bad_heads)), mesh)
    parallelize_1d(model, mesh, sequence_parallel=sp)
    assert model.tp == TP1DHandle(mesh, world_size, sp) and handle_of(model) is None  # a baseline, not our layout
    assert model.lm_head.weight is model.transformer.wte.weight
    V, p = cfg.vocab_size, world_size
    assert model.transformer.wte.weight.to_local().shape[0] == len(torch.arange(V).chunk(p)[rank])  # uneven

    idx, targets = _batch(V, t)
    elem = torch.finfo(dtype).bits // 8
    events = (tp1d_sp_comm_events if sp else tp1d_comm_events)(cfg, B, t, p, elem)
    stream = []  # the residual stream's local shape between blocks
    hook = model.transformer.h[1].register_forward_pre_hook(lambda m, args: stream.append(tuple(args[0].shape)))
    with count_functional_collectives() as fwd, VocabRows(V, B, t) as vocab_rows:
        loss = model(idx, targets)
    hook.remove()
    assert stream == [(B, t // p if sp else t, cfg.n_embd)]
    with count_functional_collectives() as bwd, VocabRows(V, B, t) as vocab_rows_bwd:
        loss.backward()
    assert not _loss_parallel_active()  # the hooks left torch's loss_parallel handlers as they found them
    for stats, phase in ((fwd, "forward"), (bwd, "backward")):
        assert stats.snapshot() == totals([e for e in events if e.phase == phase]), phase
    assert vocab_rows.found == [] and vocab_rows_bwd.found == [], vocab_rows.found + vocab_rows_bwd.found

    with VocabRows(V, B, t) as control:  # the detector does see the plain model's [B, T, V] logits
        ref_loss = ref(idx, targets)
        ref_loss.backward()
    assert control.found

    tol = 1e-10 if dtype == torch.float64 else 1e-5
    out = {"loss": rel(loss.detach(), ref_loss.detach())}
    with torch.no_grad():
        out["logits"] = rel(model(idx), ref(idx))
    inverse = torch.argsort(qkv_permutation(cfg.n_embd, p))
    ref_params = dict(ref.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    assert names == list(ref_params)
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        if "attn.c_attn" in name:
            grad = grad[inverse]
        grads[name] = rel(grad, ref_params[name].grad)
    out["grad"] = max(grads.values())

    # AdamW's first step is ~lr * sign(grad): fine in float64, but in float32 it blows the rounding noise of
    # gradients that are exactly 0 in exact arithmetic (the key bias: softmax ignores q·b_k) up to lr. SGD there.
    for m, groups in ((ref, ref.parameters()), (model, param_groups_1d(model))):
        if dtype == torch.float64:
            torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, foreach=True).step()  # foreach: CUDA's default
        else:
            torch.optim.SGD(groups, lr=0.5, foreach=True).step()
    sd, ref_sd = full_state_dict_1d(model), ref.state_dict()
    assert list(sd) == list(ref_sd)
    out["step"] = max(rel(sd[k], ref_sd[k]) for k in ref_sd)
    assert all(v < tol for v in out.values()), out
    if sp:  # the sequence must split over the ranks, checked before any communication
        bad = f"T={t - 1} is not divisible by p={p}"
        with count_functional_collectives() as none, pytest.raises(ValueError, match=bad):
            model(idx[:, :t - 1])
        assert sum(v["calls"] for v in none.snapshot().values()) == 0
    # replicated parameters (plain, or Replicate DTensors): returned so the parent can check every rank holds the
    # same values
    return {n: (q.to_local() if isinstance(q, DTensor) else q).detach().flatten().tolist()
            for n, q in model.named_parameters() if not isinstance(q, DTensor) or q.placements == (Replicate(),)}


def _llama_parity(rank, world_size, dtype, sp, tied):
    """Our Llama under torchtitan's 1-D plan (GQA: n_head/p query heads on n_kv_head/p key/value heads) against the
    plain model: loss, logits, gradients, optimizer steps, the collectives against the formula, and no rank holding
    [tokens, V] logits. Returns the replicated parameters (every rank must hold the same)."""
    cfg = LlamaConfig.from_name("llama-tiny", tie_embeddings=tied)
    p, V, t = world_size, cfg.vocab_size, T_SP_LLAMA[world_size] if sp else T
    torch.manual_seed(0)
    ref = Llama(cfg).to(dtype)
    model = parallelize_1d(copy.deepcopy(ref), init_tp1d_mesh(p), sequence_parallel=sp)
    assert model.tp == TP1DHandle(model.tp.mesh, p, sp)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert model.lm_head.weight.to_local().shape[0] == len(torch.arange(V).chunk(p)[rank])  # vocab rows, uneven
    q_local = model.model.layers[0].self_attn.q_proj.weight.to_local()
    k_local = model.model.layers[0].self_attn.k_proj.weight.to_local()
    assert (q_local.shape[0], k_local.shape[0]) == (cfg.n_head // p * cfg.head_size, cfg.n_kv_head // p * cfg.head_size)
    idx, targets = _batch(V, t)
    events = (tp1d_sp_comm_events if sp else tp1d_comm_events)(cfg, B, t, p, torch.finfo(dtype).bits // 8)
    with count_functional_collectives() as fwd, VocabRows(V, B, t) as rows:
        loss = model(idx, targets)
    with count_functional_collectives() as bwd, VocabRows(V, B, t) as rows_bwd:
        loss.backward()
    for stats, phase in ((fwd, "forward"), (bwd, "backward")):
        assert stats.snapshot() == totals([e for e in events if e.phase == phase]), (phase, sp)
    assert rows.found == [] and rows_bwd.found == [], rows.found + rows_bwd.found
    ref_loss = ref(idx, targets)
    ref_loss.backward()
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    out = {"loss": rel(loss.detach(), ref_loss.detach())}
    with torch.no_grad():
        out["logits"] = rel(model(idx), ref(idx))
    ref_params = dict(ref.named_parameters())
    assert [n for n, _ in model.named_parameters()] == list(ref_params)
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        out[name] = rel(grad, ref_params[name].grad)
    for m, groups in ((ref, ref.parameters()), (model, param_groups_1d(model))):
        # AdamW in float64; in float32 its ~lr * sign(grad) first steps turn rounding noise into 1e-4 (see _parity)
        opt = (torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, foreach=True) if dtype == torch.float64
               else torch.optim.SGD(groups, lr=0.5, foreach=True))  # foreach: CUDA's default
        opt.step()  # on the gradients compared above, then two more steps on fresh ones
        for _ in range(2):
            opt.zero_grad()
            m(idx, targets).backward()
            opt.step()
    sd, ref_sd = full_state_dict_1d(model), ref.state_dict()
    assert list(sd) == list(ref_sd)
    out["steps"] = max(rel(sd[k], ref_sd[k]) for k in ref_sd)
    assert all(v < tol for v in out.values()), {k: v for k, v in out.items() if v >= tol}
    return {n: (q.to_local() if isinstance(q, DTensor) else q).detach().flatten().tolist()
            for n, q in model.named_parameters() if not isinstance(q, DTensor) or q.placements == (Replicate(),)}


def _parity_without_and_with_sp(rank, world_size, dtype):
    out = [_parity(rank, world_size, dtype), _parity(rank, world_size, dtype, sp=True)]
    if world_size == 4:  # the float32 count at p = 4 (p = 2: test_float32_parity_and_counter_conventions)
        _count(world_size, True, autocast=False)
        with pytest.raises(ValueError, match=r"n_kv_head=6 is not divisible by p=4; use p in \[1, 2, 3, 6\]"):
            parallelize_1d(Llama(LlamaConfig.from_name("llama-tiny", n_layer=1)), init_tp1d_mesh(world_size))
    else:  # Llama: untied head without, tied head with sequence parallelism
        out += [_llama_parity(rank, world_size, dtype, sp=False, tied=False),
                _llama_parity(rank, world_size, dtype, sp=True, tied=True)]
    return out


def _count(world_size, sp, autocast, cfg=None, t=T_SP):
    """One training step of a float32 model (GPT-2 unless ``cfg`` is a Llama config; optionally under bf16
    autocast), counted against the formula."""
    torch.manual_seed(0)
    cfg = cfg or tiny(n_layer=1)
    model = (Llama if isinstance(cfg, LlamaConfig) else GPT2)(cfg)
    model = parallelize_1d(model, init_tp1d_mesh(world_size), sequence_parallel=sp)
    idx, targets = _batch(cfg.vocab_size, t)
    events = (tp1d_sp_comm_events if sp else tp1d_comm_events)(cfg, B, t, world_size, 2 if autocast else 4)
    with count_functional_collectives() as fwd, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(idx, targets)
    with count_functional_collectives() as bwd:
        loss.backward()
    for stats, phase in ((fwd, "forward"), (bwd, "backward")):
        assert stats.snapshot() == totals([e for e in events if e.phase == phase]), (phase, sp, autocast)
    if not sp:
        return
    # every LayerNorm / RMSNorm gradient was all-reduced to Replicate (in the one flat all-reduce counted above)
    norms = [q for n, q in model.named_parameters() if ".ln_" in n or "norm" in n]
    assert norms and all(q.grad.placements == (Replicate(),) for q in norms)


@pytest.mark.parametrize("world_size", [2, 4])
def test_parity_and_communication_float64(world_size):
    """Without (tp1d) and with sequence parallelism (tp1d-sp), in one process group per world size."""
    results = run_distributed(_parity_without_and_with_sp, world_size, torch.float64)
    for mode in range(len(results[0])):
        for other in results[1:]:
            assert other[mode] == results[0][mode]


def _float32_and_counter(rank, world_size):
    _parity(rank, world_size, torch.float32)
    for sp in (False, True):
        _count(world_size, sp, autocast=True)
    _count(world_size, True, autocast=False)
    mesh = init_tp1d_mesh(world_size)
    # a caller inside its own loss_parallel() (torch's documented usage) gets the same loss and gradients
    torch.manual_seed(0)
    model = parallelize_1d(GPT2(tiny(n_layer=1)).double(), mesh)
    idx, targets = _batch(model.config.vocab_size)
    loss = model(idx, targets)
    loss.backward()
    grads = [q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad for q in model.parameters()]
    model.zero_grad()
    with loss_parallel():
        loss2 = model(idx, targets)
        loss2.backward()
    assert not _loss_parallel_active()
    assert torch.equal(loss, loss2)
    grads2 = [q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad for q in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads, grads2))
    with pytest.raises(ValueError, match="already parallelized"):
        parallelize_1d(model, mesh)
    group = (mesh, 0)
    x = torch.arange(12, dtype=torch.float64).view(4, 3)
    sharded = distribute_tensor(x, mesh, [Shard(0)])
    partial = DTensor.from_local(torch.ones(4, 3, dtype=torch.float64), mesh, [Partial()])
    with count_functional_collectives() as stats:
        assert torch.equal(sharded.full_tensor(), x)  # all-gather: local input [2, 3]
        assert torch.equal(partial.redistribute(mesh, [Shard(0)]).to_local(), 2 * torch.ones(2, 3, dtype=torch.float64))
        funcol.broadcast(torch.zeros(5, dtype=torch.float32), 0, group)
        funcol.all_reduce_coalesced([torch.ones(2), torch.ones(3)], "sum", group)  # gloo: one dtype
    snap = stats.snapshot()
    assert snap["all_gather"] == {"calls": 1, "bytes": 6 * 8}
    assert snap["reduce_scatter"] == {"calls": 1, "bytes": 12 * 8}  # the full input
    assert snap["broadcast"] == {"calls": 1, "bytes": 20}
    assert snap["all_reduce"] == {"calls": 1, "bytes": (2 + 3) * 4}  # coalesced: one call
    with pytest.raises(RuntimeError, match="all_to_all_single"):
        with count_functional_collectives():
            funcol.all_to_all_single(torch.ones(4), None, None, group)
    with FunctionalCollectiveCounter(strict=False) as counter:
        funcol.wait_tensor(funcol.all_to_all_single(torch.ones(4), None, None, group))
    assert counter.uncounted == [("_c10d_functional.all_to_all_single.default", 16)]
    assert sum(counter.stats.snapshot()[k]["calls"] for k in counter.stats.snapshot()) == 0
    return True


def _llama_three_ranks(rank, world_size):
    for sp in (False, True):  # bf16 autocast: which collectives carry float32 (module docstrings)
        _count(world_size, sp, autocast=True, cfg=LlamaConfig.from_name("llama-tiny", n_layer=1), t=T_SP_LLAMA[3])
    return [_llama_parity(rank, world_size, torch.float32, sp=sp, tied=not sp) for sp in (False, True)]


def test_llama_float32_parity_on_three_ranks():
    """p = 3 divides llama-tiny's 12 query and 6 key/value heads (2 key/value heads per rank, GQA g = 2)."""
    results = run_distributed(_llama_three_ranks, 3)
    for mode in range(2):
        assert results[1][mode] == results[0][mode] and results[2][mode] == results[0][mode]


def test_float32_parity_and_counter_conventions():
    assert run_distributed(_float32_and_counter, 2) == [True, True]


def test_bad_configs_name_numbers():
    with pytest.raises(ValueError, match="n_head=6 is not divisible by p=4"):
        check_tp1d(GPT2Config.from_name("gpt2-tiny"), 4)
    with pytest.raises(ValueError, match="n_head=6 is not divisible by p=5; n_embd=48 is not divisible by p=5"):
        check_tp1d(GPT2Config.from_name("gpt2-tiny"), 5)
    with pytest.raises(ValueError, match="dropout=0.1"):
        check_tp1d(tiny(dropout=0.1), 2)
    with pytest.raises(ValueError, match="positive int"):
        init_tp1d_mesh(0)


def test_qkv_permutation_groups_heads():
    h, p = 8, 2
    perm = qkv_permutation(h, p)
    # shard 0 = q rows 0-3, k rows 8-11, v rows 16-19; shard 1 the other halves
    assert perm.tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]


def test_comm_events_formula():
    cfg = GPT2Config.from_name("gpt2")
    N, h, L, e, ep = 4 * 1024, 768, 12, 2, 4  # bf16 autocast: embeddings, loss rows, input gradients in float32
    ev = tp1d_comm_events(cfg, 4, 1024, 8, e)
    assert {(x.kind, x.group, x.group_size, x.overlap_flops) for x in ev} == {("all_reduce", "tp", 8, 0.0)}
    fwd = totals([x for x in ev if x.phase == "forward"])["all_reduce"]
    bwd = totals([x for x in ev if x.phase == "backward"])["all_reduce"]
    assert fwd == {"calls": 2 * L + 4, "bytes": N * h * ep + 2 * L * N * h * e + 3 * N * ep}
    assert bwd == {"calls": 2 * L + 1, "bytes": (2 * L + 1) * N * h * ep}
    # one rank: only loss_parallel's three [N, 1] all-reduces remain (over a group of one, nothing sent)
    assert totals(tp1d_comm_events(cfg, 4, 1024, 1, e))["all_reduce"] == {"calls": 3, "bytes": 3 * N * ep}
    assert wire_bytes(tp1d_comm_events(cfg, 4, 1024, 1, e)) == 0


def test_sp_comm_events_formula():
    cfg = GPT2Config.from_name("gpt2")
    B_, T_, p, e, ep = 4, 1024, 8, 2, 4
    N, h, L = B_ * T_, cfg.n_embd, cfg.n_layer
    ev = tp1d_sp_comm_events(cfg, B_, T_, p, e)
    fwd = totals([x for x in ev if x.phase == "forward"])
    bwd = totals([x for x in ev if x.phase == "backward"])
    assert fwd["all_gather"] == {"calls": 2 * L + 1, "bytes": (2 * L + 1) * N * h * ep // p}
    assert fwd["reduce_scatter"] == {"calls": 2 * L + 1, "bytes": N * h * ep + 2 * L * N * h * e}
    assert fwd["all_reduce"] == {"calls": 3, "bytes": 3 * N * ep}
    assert bwd["all_gather"] == {"calls": 2 * L + 2,
                                 "bytes": 2 * L * N * h * e // p + N * h * ep // p + T_ * h * ep // p}
    assert bwd["reduce_scatter"] == {"calls": 2 * L + 1, "bytes": (2 * L + 1) * N * h * ep}
    assert bwd["all_reduce"] == {"calls": 1, "bytes": (2 * L + 1) * 2 * h * ep}  # LayerNorm grads, one buffer
    # on the wire SP sends what tp1d's all-reduces send (ring all-reduce = reduce-scatter + all-gather), less the
    # loss rows, plus the small embedding and LayerNorm terms
    assert wire_bytes(ev) < wire_bytes(tp1d_comm_events(cfg, B_, T_, p, ep))
    assert totals(tp1d_sp_comm_events(cfg, B_, T_, 1, e))["all_reduce"] == {"calls": 3, "bytes": 3 * N * ep}
    fits = r"T=1020 is not divisible by p=8; use T a multiple of 8 \(or p in \[1, 2, 3, 4, 5, 6\]\)"
    with pytest.raises(ValueError, match=fits):
        tp1d_sp_comm_events(cfg, B_, 1020, p, e)
    with pytest.raises(ValueError, match="T=6 is not divisible by p=4"):
        check_sequence_parallel(6, 4)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_planners_1d_shapes_are_the_plans(family):
    """``planning.rivals.tp1d_local_shapes`` (arithmetic on the config, for the planner) equals what
    :func:`local_shapes_1d` reads from the baseline's plan, for a vocabulary and widths that do not divide."""
    from lightning_tp2d.baselines.tp1d import local_shapes_1d
    from lightning_tp2d.families import model_config
    from lightning_tp2d.planning.rivals import tp1d_local_shapes

    cfg = dataclasses.replace(model_config(f"{family}-tiny"), vocab_size=1001, n_layer=2)
    from lightning_tp2d.models import GPT2, Llama

    with torch.device("meta"):
        model = (GPT2 if family == "gpt2" else Llama)(cfg)
    for p in (2, 3, 4):
        assert tp1d_local_shapes(model, p) == local_shapes_1d(model, p)
