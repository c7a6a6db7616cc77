"""``torch.compile`` of a parallelized model: one graph, no graph breaks, the eager loss and every gradient, with the
models' token-id checks on (``validate_inputs``, the default: device-side asserts when compiled, where eager reads
the ids on the host).

Every communicating layer is a registered op (:mod:`lightning_tp2d.ops`), so Dynamo sees the whole model —
embedding, every block, head and loss — as one graph in every layout. Compared in float32 on 4 ranks against the
same model run eagerly: loss and every parameter gradient for two steps (the second after an SGD step, with no
recompilation). ``aot_eager`` for all layouts (one process group), ``inductor`` for "metp" on one rank (it builds
C++ kernels, so it is kept small; the registered ops run there as everywhere, their communication size-1).
"""

from __future__ import annotations

import pytest
import torch

import lightning_tp2d as tp
from lightning_tp2d.models import GPT2, GPT2Config, Llama, LlamaConfig
from tests.distributed import run_distributed


def _model(layout: str, mesh, family: str = "gpt2", **overrides):
    if family == "llama":
        cfg = LlamaConfig.from_name("llama-tiny", n_layer=1, **overrides)
    else:
        cfg = GPT2Config.from_name("gpt2-tiny", n_head=4, dropout=0.0, **overrides)
    torch.manual_seed(0)
    model = tp.parallelize((Llama if family == "llama" else GPT2)(cfg), mesh, layout)
    # validate_inputs stays on (the default): compiled, the token-id checks are device-side asserts in the graph
    return model, cfg


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.to_local().clone() if hasattr(p.grad, "to_local") else p.grad.clone()
            for p in model.parameters()]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _compare(rank: int, world_size: int, layouts, backend: str, family: str = "gpt2") -> dict:
    from torch._dynamo.utils import counters

    out = {}
    for layout in layouts:
        torch._dynamo.reset()
        counters.clear()
        mesh = tp.init_mesh(layout, world_size, 1)
        eager, cfg = _model(layout, mesh, family)
        compiled_model, _ = _model(layout, mesh, family)
        compiled = torch.compile(compiled_model, backend=backend, dynamic=False)
        # SGD: linear in the gradients (AdamW's first step turns 1e-7 gradient differences into lr-sized ones)
        opts = [torch.optim.SGD(m.parameters(), lr=1e-1) for m in (eager, compiled_model)]
        g = torch.Generator().manual_seed(1)
        worst_loss = worst_grad = 0.0
        for _ in range(2):
            idx = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
            losses = []
            for model, opt in zip((eager, compiled), opts):
                loss = model(idx, idx)
                loss.backward()
                losses.append(loss.detach())
            worst_loss = max(worst_loss, _rel(losses[1], losses[0]))
            worst_grad = max(worst_grad, max(_rel(c, e) for e, c in zip(_grads(eager), _grads(compiled_model))))
            for opt in opts:
                opt.step()
                opt.zero_grad()
        out[layout] = {"loss": worst_loss, "grad": worst_grad, "graphs": counters["stats"]["unique_graphs"],
                       "breaks": sum(counters["graph_break"].values())}
    return out


@pytest.mark.parametrize("family, layouts", [
    ("gpt2", ("2d", "metp", "2d-metp")),
    # Llama's ring plans (the ring attention with groups > 1, the ring MLP with SwiGLU: registered ops)
    pytest.param("llama", ("metp", "2d-metp"), marks=pytest.mark.slow),
], ids=["gpt2", "llama-rings"])
def test_every_layout_compiles_to_one_graph_and_matches_eager(family, layouts):
    for rank, result in enumerate(run_distributed(_compare, 4, layouts, "aot_eager", family, timeout=600)):
        for layout in layouts:
            r = result[layout]
            assert r["breaks"] == 0 and r["graphs"] == 1, (rank, layout, r)
            assert r["loss"] < 1e-6 and r["grad"] < 1e-5, (rank, layout, r)


@pytest.mark.slow
def test_inductor_compiles_a_ring_model_and_matches_eager():
    for rank, result in enumerate(run_distributed(_compare, 1, ("metp",), "inductor", timeout=900)):
        r = result["metp"]
        assert r["breaks"] == 0, (rank, r)
        assert r["loss"] < 1e-6 and r["grad"] < 1e-5, (rank, r)


def test_compiled_token_id_checks_stay_in_the_graph_and_still_refuse_bad_ids():
    """With ``validate_inputs`` on (the default) a compiled plain GPT-2 is one graph with no break (the host reads of
    eager are device-side asserts there), gives the eager loss, and still refuses an id outside the vocabulary."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    try:
        torch.manual_seed(0)
        model = GPT2(GPT2Config.from_name("gpt2-tiny"))
        compiled = torch.compile(model, backend="aot_eager", dynamic=False)
        idx = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        assert compiled(idx, idx).item() == pytest.approx(model(idx, idx).item(), rel=1e-6)
        assert counters["stats"]["unique_graphs"] == 1 and sum(counters["graph_break"].values()) == 0
        bad = idx.clone()
        bad[0, 3] = model.config.vocab_size
        with pytest.raises(RuntimeError, match=r"token ids must be in \[0, 257\)"):
            compiled(bad, idx)
        with pytest.raises(RuntimeError, match=r"target ids must be in \[0, 257\) or -100"):
            compiled(idx, bad)
    finally:  # this process forks later tests' ranks: leave them no compiled state or counts
        torch._dynamo.reset()
        counters.clear()


def _compare_packed(rank: int, world_size: int) -> dict:
    """"metp" over 2 ranks with packed documents, compiled (aot_eager) against eager: loss and gradients, graphs
    and breaks, and the ids the ring-attention op was handed: the batch's CPU ids, not its moved copy (the move is
    simulated by a copy on the same device)."""
    from torch._dynamo.utils import counters

    from lightning_tp2d import metp
    from lightning_tp2d.models.documents import Documents

    torch._dynamo.reset()
    counters.clear()
    mesh = tp.init_mesh("metp", world_size, 1)
    eager, cfg = _model("metp", mesh)
    compiled_model, _ = _model("metp", mesh)
    compiled = torch.compile(compiled_model, backend="aot_eager", dynamic=False)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
    host = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 11 + [1] * 5])  # starts 5, 12 and 11: pairs cut
    moved = Documents(host).to(torch.device("cpu"), copy=True)  # as Lightning's batch transfer moves it
    handed, real = [], metp._op_documents
    metp._op_documents = lambda documents, ids: handed.append(ids) or real(documents, ids)
    try:
        losses = []
        for model in (eager, compiled):
            loss = model(idx, idx, doc_ids=moved)
            loss.backward()
            losses.append(loss.detach())
    finally:
        metp._op_documents = real
    # (the compiler's shape pass hands fake tensors, which have no data: the calls that run have plain ones)
    on_host = [ids.data_ptr() == host.data_ptr() for ids in handed if type(ids) is torch.Tensor]
    grad = max(_rel(c, e) for e, c in zip(_grads(eager), _grads(compiled_model)))
    return {"loss": _rel(losses[1], losses[0]), "grad": grad, "graphs": counters["stats"]["unique_graphs"],
            "breaks": sum(counters["graph_break"].values()), "on_host": on_host,
            "moved": moved.ids.data_ptr() != host.data_ptr()}


def test_packed_documents_compile_to_one_graph_and_the_ring_reads_the_batchs_host_ids():
    """Compiled, the ring-attention op takes the documents as their ids tensor; it is handed the CPU ids the batch
    came with (``Documents.host_ids``, kept when the batch moves), so deciding its blocks reads nothing from the
    device: in the forward and in the backward of each block, the loss and gradients those of eager."""
    for rank, r in enumerate(run_distributed(_compare_packed, 2, timeout=300)):
        assert r["breaks"] == 0 and r["graphs"] == 1, (rank, r)
        assert r["loss"] < 1e-6 and r["grad"] < 1e-5, (rank, r)
        assert r["moved"] and r["on_host"] and all(r["on_host"]), (rank, r)


def test_op_constants_of_plain_values_never_ask_whether_they_are_dataclasses(monkeypatch):
    """torch 2.11's Dynamo cannot trace ``dataclasses.is_dataclass(None)`` (``hasattr`` on ``NoneType``): every layer
    whose op takes a ``None`` argument broke the graph there (43-48 breaks per layout on an H200). Plain values are
    op constants as they are, before any dataclass check; dataclasses are still packed with their fields."""
    import dataclasses

    from lightning_tp2d import ops

    def refuse(value):
        raise AssertionError(f"is_dataclass asked of {value!r}")

    is_dataclass = dataclasses.is_dataclass
    monkeypatch.setattr(ops.dataclasses, "is_dataclass", refuse)
    for value in (None, 3, 2.5, "col", True, torch.bfloat16, torch.device("cpu")):
        assert ops._pack(value) == value
    monkeypatch.setattr(ops.dataclasses, "is_dataclass", is_dataclass)
    packed = ops._pack(tp.TPOptions(attention_kernel="math"))
    assert packed[0] == ops._DATACLASS and packed[1] is tp.TPOptions and "math" in packed[2]
