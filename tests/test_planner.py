"""The planner (:mod:`lightning_tp2d.planning.planner`, ``lightning_tp2d.plan``, ``tp2d-plan``): every row it returns
fits the cap by the memory models, accounts for the whole global batch, is sorted by predicted step time; nothing
fitting is one error naming the least memory; the elementwise constants reproduce the measurement they are fitted
to; the data-parallel rule prices what the tracer counts. A tiny Llama on 4 "GPUs" keeps it quick."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import lightning_tp2d as tp
from lightning_tp2d.planning import cost_model as cm
from lightning_tp2d.planning import planner
from lightning_tp2d.planning.memory_model import parameter_split, peak_bytes
from lightning_tp2d.planning.rivals import baseline_row_peak_bytes
from lightning_tp2d.families import model_config

MODEL = "llama-tiny"
SEQ, GPUS, TOKENS = 48, 4, 16 * 48
OPTIONS = dict(gpus=GPUS, gpu_memory_gib=0.05, gpus_per_node=4, seq=SEQ, global_batch_tokens=TOKENS,
               zero_stages=(0, 3), checkpointing=("none", "full"), max_micro_batch=2, layouts=("2d", "metp"))


@pytest.fixture(scope="module")
def rows():
    return tp.plan(MODEL, **OPTIONS)


def test_rows_fit_account_for_the_batch_and_are_sorted(rows):
    assert rows == sorted(rows, key=lambda r: r.step_s)
    cap = 0.9 * OPTIONS["gpu_memory_gib"]
    for r in rows:
        assert r.tensor_parallel_size * r.data_parallel_size == GPUS, r
        assert r.data_parallel_size * r.micro_batch * r.grad_accum * SEQ == TOKENS, r
        assert 0 < r.memory_gib <= cap, r
        assert r.tokens_per_s_per_gpu == pytest.approx(TOKENS / r.step_s / GPUS)
        assert 0 < r.mfu < 1
        assert r.zero_stage in (0, 3) and r.checkpointing in ("none", "full")
        assert r.micro_batch <= 2
        if r.zero_stage:
            assert r.data_parallel_size > 1
    kinds = {(r.baseline, r.layout) for r in rows}
    assert {(False, "2d"), (False, "metp"), (True, "tp1d-sp")} <= kinds
    assert any(r.baseline and r.tensor_parallel_size == 1 for r in rows)  # plain FSDP is a baseline too
    assert all(r.zero_stage in (0, 3) for r in rows if r.baseline)
    json.dumps([r.to_dict() for r in rows])  # plain data


def test_planning_candidates_in_parallel_processes_gives_the_same_rows(rows, monkeypatch):
    """``workers=2`` plans the (layout, size) candidates two at a time, each in a forked process with its own
    memory-model worker: the same rows in the same order as planning them in turn; a candidate that fails there
    raises its own error here."""
    from lightning_tp2d.planning import memory_model

    # the profiles forgotten, so that the forked processes build them (in workers of their own), not read this one's
    monkeypatch.setattr(memory_model, "_SHARDS", {})
    monkeypatch.setattr(memory_model, "_DERIVED", {})
    assert tp.plan(MODEL, **OPTIONS, workers=2, cache=False) == rows
    assert planner.in_processes(lambda x: x * x, range(5), 3) == [0, 1, 4, 9, 16]

    def broken(x):
        if x == 3:
            raise ValueError("candidate 3 does not fit")
        return x

    with pytest.raises(ValueError, match="candidate 3 does not fit"):
        planner.in_processes(broken, range(5), 2)
    with pytest.raises(ValueError, match="workers must be a positive int, got 0"):
        tp.plan(MODEL, **OPTIONS, workers=0)


def test_a_row_s_memory_is_the_memory_model_s(rows):
    cfg = model_config(MODEL)
    for r in (planner.best(rows, False), planner.best(rows, True)):
        if r.baseline:
            want = baseline_row_peak_bytes(cfg, r.micro_batch, SEQ, r.tensor_parallel_size, dp=r.data_parallel_size,
                                           zero_stage=r.zero_stage, shard_group=r.shard_group,
                                           checkpointing=r.checkpointing, elem=2, loss=r.loss)
        else:
            want = peak_bytes(r.layout, cfg, r.micro_batch, SEQ, r.tensor_parallel_size, dp=r.data_parallel_size,
                              zero_stage=r.zero_stage, checkpointing=r.checkpointing, elem=2, ranks=[0], fused=True)
        assert r.memory_gib * planner.GIB == want["total"]


def test_nothing_fits_names_the_model_and_the_least_memory():
    with pytest.raises(planner.NothingFits, match=r"nothing fits 'llama-tiny' on 4 GPUs of 0.0001 GiB .* least "
                                                  r"memory per GPU any configuration needs is [0-9.]+ GiB \(\S+ p="):
        tp.plan(MODEL, **{**OPTIONS, "gpu_memory_gib": 0.0001})
    with pytest.raises(ValueError, match="exceeds the model's block_size"):  # a position table (RoPE: any length)
        tp.plan("gpt2-tiny", **{**OPTIONS, "seq": 10**6})
    with pytest.raises(ValueError, match="less than one sequence"):
        tp.plan(MODEL, **{**OPTIONS, "global_batch_tokens": 3})


def test_elementwise_passes_reproduce_the_measured_gpt2_step_on_the_h200():
    cfg = planner.measured_gpt2_config()  # transformers' GPT-2 as measured: its head unpadded
    assert cfg == dataclasses.replace(model_config("gpt2"), pad_vocab_multiple=1)
    m = planner.GPT2_H200
    for mode in ("eager", "compiled"):
        row = planner.price(cfg, layout="tp1d-sp", p=1, dp=1, zero_stage=0, checkpointing="none",
                            micro_batch=m["batch"], grad_accum=1, seq=m["seq"], hw=planner.HARDWARE["h200"],
                            gpus_per_node=8, compiled=mode == "compiled")
        assert row.tokens_per_s_per_gpu == pytest.approx(m[mode], rel=1e-6)
    assert 1 < planner.ELEMENTWISE_PASSES["compiled"] < planner.ELEMENTWISE_PASSES["eager"]
    # the anchor is the committed measurement (recipes/gpu_issue12.py on an H200), to its 4 significant figures
    run = json.loads((Path(__file__).parents[1] / "recipes/results/gpu_issue12_h200.json").read_text())["throughput"]
    assert (run["model"], run["batch"], run["seq"]) == (m["model"], m["batch"], m["seq"])
    assert (m["eager"], m["compiled"]) == (pytest.approx(run["hf"], rel=5e-4), pytest.approx(run["hf_compiled"], rel=5e-4))


def test_data_parallel_rule_prices_the_bytes_the_tracer_counts():
    """Stage 3 on a ring of 2 x dp 2 (float32 compute here, so the gathers are float32): the rule's per-block
    all-gather and reduce-scatter payloads are the traced ones."""
    cfg = model_config(MODEL)
    events = cm.comm_events("metp", cfg, 2, SEQ, 2, 4, dp=2, zero_stage=3)
    traced = {k: sum(e.nbytes * e.calls for e in events if e.group == "data_parallel" and e.kind == k)
              for k in ("all_gather", "reduce_scatter")}
    split = parameter_split(cfg)
    elements = split.total / 2  # one tensor rank's shard
    # all-gather: every group twice (forward, backward) but the root once (FSDP keeps it after the forward); 1/dp
    want_gather = 4 * (split.root + 2 * split.n_layer * split.block) / 2 / 2
    assert traced["all_gather"] == pytest.approx(want_gather, rel=0.05)
    assert traced["reduce_scatter"] == pytest.approx(4 * elements, rel=0.05)
    hw = planner.HARDWARE["h100"]
    kw = dict(root=split.root / 2, block=split.block / 2, n_layer=split.n_layer, tp=2, gpus_per_node=8, hw=hw,
              forward_s=1.0, backward_s=2.0, grad_accum=1)
    assert planner.data_parallel_time(dp=1, stage=3, **kw) == {"comm_s": 0.0, "exposed_s": 0.0}
    three = planner.data_parallel_time(dp=2, stage=3, **kw)
    assert 0 < three["exposed_s"] < three["comm_s"]  # hidden behind long blocks, but for the first gathers
    zero = planner.data_parallel_time(dp=2, stage=0, **kw)
    assert zero["exposed_s"] == 0.0 < zero["comm_s"]  # the all-reduce hides behind a 2 s backward
    assert planner.data_parallel_time(dp=2, stage=3, **{**kw, "grad_accum": 3})["comm_s"] == pytest.approx(
        3 * three["comm_s"])


def test_tp2d_plan_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = [MODEL, "--gpus", "4", "--gpu-memory-gib", "0.05", "--gpus-per-node", "4", "--seq", str(SEQ),
            "--global-batch-tokens", str(TOKENS), "--layouts", "2d", "--zero-stages", "0", "3", "--checkpointing",
            "none", "full", "--max-micro-batch", "2", "--json", str(out)]
    assert planner.main(argv) == 0
    printed = capsys.readouterr().out
    assert "| 1 |" in printed and "best package: 2d" in printed and "best 1-D baseline" in printed
    data = json.loads(out.read_text())
    assert data["model"] == MODEL and data["rows"] and {r["layout"] for r in data["rows"]} == {"2d", "tp1d-sp"}
    assert planner.main(["no-such-model", "--gpus", "4", "--gpu-memory-gib", "80", "--seq", "64"]) == 2
    assert "tp2d-plan:" in capsys.readouterr().err


def test_async_overlap_scales_what_async_tp_hides_and_the_fit_reproduces_torchtitan_s_gains():
    cfg = model_config("llama-3.1-8b")
    hw = planner.HARDWARE["h100"]
    kw = dict(lean_wire=True, checkpointing="selective")
    blocking = cm.step_time("tp1d-sp", cfg, 2, 8192, 8, hw, **kw)["exposed_comm_s"]
    exposed = {a: cm.step_time("tp1d-sp", cfg, 2, 8192, 8, hw, async_tp=True, overlap=a, **kw)["exposed_comm_s"]
               for a in (0.0, planner.ASYNC_TP_OVERLAP, 1.0)}
    assert exposed[0.0] == pytest.approx(blocking)  # hides nothing: the blocking exposure
    assert exposed[1.0] < exposed[planner.ASYNC_TP_OVERLAP] < exposed[0.0]
    # torchtitan's published async / blocking gains, bf16 on its H100s (the fitted rows of recipes/benchmarks/scale.py)
    for model, tp, dp, ck, batch, gain in (("llama-3.1-8b", 8, 8, "selective", 12, 4809.4 / 4378),
                                           ("llama-3.1-70b", 8, 32, "full", 16, 652.4 / 597.3)):
        rows = {a: planner.price(model_config(model), layout="tp1d-sp", p=tp, dp=dp, zero_stage=3, checkpointing=ck,
                                 micro_batch=batch, grad_accum=1, seq=8192, hw=planner.HARDWARE["h100-grand-teton"],
                                 gpus_per_node=8, async_tp=a) for a in (False, True)}
        predicted = rows[True].tokens_per_s_per_gpu / rows[False].tokens_per_s_per_gpu
        assert predicted == pytest.approx(gain, abs=0.01), model


def test_data_parallel_time_gathers_the_root_groups_resharded_after_forward_again_at_stage_3():
    """The package's FSDP keeps its root gathered from the forward to the backward: its traced stage-3 schedule
    (every block's shard gathered twice, the root's once, each group's gradients reduce-scattered) priced call by call
    is ``data_parallel_time`` with nothing gathered again. The 1-D baseline's untied embedding is its own group,
    resharded after forward: ``price`` adds one all-gather of its bf16 tensor shard at stage 3, none at stage 2."""
    cfg = model_config(MODEL)
    hw = planner.HARDWARE["h100"]
    split = parameter_split(cfg)
    events = [e for e in cm.comm_events("metp", cfg, 2, SEQ, 2, 4, dp=2, zero_stage=3)
              if e.group == "data_parallel" and e.kind in ("all_gather", "reduce_scatter")]
    traced = sum(e.calls * cm.collective_time(e.kind, e.group_size, e.nbytes, hw.intra) for e in events)
    kw = dict(root=split.root / 2, block=split.block / 2, n_layer=split.n_layer, dp=2, tp=2, gpus_per_node=8, hw=hw,
              forward_s=1.0, backward_s=2.0, grad_accum=1, elem=4)
    assert planner.data_parallel_time(stage=3, **kw)["comm_s"] == pytest.approx(traced, rel=0.05)
    again = cm.collective_time("all_gather", 2, 4 * 1000 / 2, hw.intra)
    assert planner.data_parallel_time(stage=3, regathered=1000, **kw)["comm_s"] == pytest.approx(
        planner.data_parallel_time(stage=3, **kw)["comm_s"] + again, rel=1e-12)
    assert planner.data_parallel_time(stage=2, regathered=1000, **kw) == planner.data_parallel_time(stage=2, **kw)
    rows = {stage: planner.price(cfg, layout=planner.BASELINE, p=2, dp=2, zero_stage=stage, checkpointing="none",
                                 micro_batch=1, grad_accum=1, seq=SEQ, hw=hw, gpus_per_node=8) for stage in (2, 3)}
    assert split.embedding > 0  # llama-tiny's head is untied
    shard = lambda n, v: (n - v) / 2 + v  # noqa: E731  (1-D TP splits the matrices, keeps the vectors whole)
    kw = dict(kw, root=shard(split.root, split.root_vectors), block=shard(split.block, split.block_vectors), elem=2)
    for stage, row in rows.items():  # comm_s does not depend on the compute seconds
        want = planner.data_parallel_time(stage=stage, regathered=split.embedding / 2, **kw)["comm_s"]
        assert row.parts["time_s"]["dp_comm"] == pytest.approx(want, rel=1e-12), stage
    assert rows[3].parts["time_s"]["dp_comm"] > planner.data_parallel_time(stage=3, **kw)["comm_s"]


def test_auto_layout_plans_for_the_datas_window_and_refuses_a_long_block_size_without_seq(monkeypatch):
    """``TP2DStrategy(layout="auto")`` plans for the sequence the job trains on: ``plan_options["seq"]``, else the
    attached datamodule's ``block_size``, else the model's ``block_size`` when it is at most 8192; the named Llama 3.x
    configs' 131072 is their limit, not a job's, so without either the strategy refuses, naming the numbers."""
    from types import SimpleNamespace

    from lightning_tp2d.core import LONGEST_DEFAULT_SEQ
    from lightning_tp2d.strategy import TP2DStrategy

    asked = []
    row = SimpleNamespace(tensor_parallel_size=4, data_parallel_size=2, checkpointing="none", layout="2d")
    monkeypatch.setattr(planner, "plan", lambda cfg, **kw: asked.append(kw["seq"]) or [row])
    tiny, long = model_config("llama-tiny"), model_config("llama-3.1-8b")
    assert long.block_size == 131072 > LONGEST_DEFAULT_SEQ >= tiny.block_size
    strategy = TP2DStrategy(layout="auto", memory_gib=80.0)
    with pytest.raises(ValueError, match=r"block_size=131072 is more than 8192.*plan_options=\{'seq'"):
        strategy._plan(long, 80.0, 8, 1)
    strategy._plan(tiny, 80.0, 8, 1)  # a short block_size is a fine default
    data = SimpleNamespace(block_size=4096)
    strategy._lightning_module = SimpleNamespace(trainer=SimpleNamespace(datamodule=data))
    strategy._plan(long, 80.0, 8, 1)  # the data's windows
    strategy.plan_options = {"seq": 8192}
    strategy._plan(long, 80.0, 8, 1)  # the asked length first
    assert asked == [tiny.block_size, 4096, 8192]


def test_auto_layout_with_packed_documents_plans_only_layouts_that_keep_attention_inside_documents(monkeypatch):
    """Data that packs documents (``pack_documents=True``) trains only on layouts with per-document attention
    (``Layout.documents_problem() is None``: the rings), so ``layout="auto"`` plans among those; when the layouts
    asked for have none, the strategy refuses, quoting the layout's own reason."""
    from types import SimpleNamespace

    from lightning_tp2d.layouts import get_layout
    from lightning_tp2d.strategy import TP2DStrategy

    asked = []
    row = SimpleNamespace(tensor_parallel_size=4, data_parallel_size=2, checkpointing="none", layout="metp")
    monkeypatch.setattr(planner, "plan", lambda cfg, **kw: asked.append(tuple(kw["layouts"])) or [row])
    tiny = model_config("llama-tiny")
    strategy = TP2DStrategy(layout="auto", memory_gib=80.0)
    data = SimpleNamespace(block_size=64, pack_documents=False)
    strategy._lightning_module = SimpleNamespace(trainer=SimpleNamespace(datamodule=data))
    strategy._plan(tiny, 80.0, 8, 1)
    data.pack_documents = True
    strategy._plan(tiny, 80.0, 8, 1)
    everything, packing = asked
    assert "2d" in everything and get_layout("2d").documents_problem() is not None
    assert packing == tuple(n for n in everything if get_layout(n).documents_problem() is None)
    assert set(packing) == {"metp", "2d-metp"}
    strategy.plan_options = {"layouts": ("2d",)}
    with pytest.raises(ValueError, match=r"packs documents.*none of the layouts \['2d'\].*use one of"):
        strategy._plan(tiny, 80.0, 8, 1)


@pytest.mark.parametrize("baseline", [False, True], ids=["package", "baseline"])
def test_largest_model_is_the_deepest_whose_own_peak_fits(baseline):
    """:func:`planner.largest_model` answers a depth whose peak fits the cap and one block more that does not (a
    line through two depths would err where a later phase of the step overtakes the one that peaks at their
    depths)."""
    cap = 0.9 * 0.05 * planner.GIB
    found = planner.largest_model(GPUS, 0.05, SEQ, TOKENS, base=MODEL, baseline=baseline, layouts=("2d",),
                                  gpus_per_node=4)
    name, settings = found["configuration"].split(" ", 1)
    fields = dict(kv.split("=") for kv in settings.split())
    p, dp, stage, micro = (int(fields[k]) for k in ("p", "dp", "zero_stage", "micro_batch"))
    cfg = model_config(MODEL)

    def peak(n):
        deeper = dataclasses.replace(cfg, n_layer=n)
        with planner.ranks_as_asked():
            return planner.row_memory(deeper, name, p, dp, stage, "full", micro, SEQ)["total"]

    assert found["n_layer"] > cfg.n_layer
    assert peak(found["n_layer"]) <= cap < peak(found["n_layer"] + 1)
    assert found["parameters"] == parameter_split(dataclasses.replace(cfg, n_layer=found["n_layer"])).total
