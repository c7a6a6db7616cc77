"""Both sides priced by one rule (DESIGN.md section 10): the same overlap efficiency for every collective of a kind,
the package's and the baseline's alike; the baseline as its users run it (HSDP, ZeRO 1, a chunked loss) with its
elementwise work on the bytes its elementwise ops touch; each side's search space counted. The baseline's rows are
arithmetic (fast); the package's traced rows use a tiny Llama."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_tp2d.families import model_config
from lightning_tp2d.planning import cost_model as cm
from lightning_tp2d.planning import planner
from lightning_tp2d.planning.events import Comm
from lightning_tp2d.planning.memory_model import baseline_activation_bytes, baseline_peak_bytes, parameter_split
from lightning_tp2d.planning.rivals import CHUNK_TOKENS, baseline_row_peak_bytes

HW = planner.HARDWARE["h100"]
RATES = {"matmul": HW.matmul_flops_per_s, "attention": HW.attention_flops_per_s}
SEQ = 8192


def test_one_overlap_rule_hides_the_same_share_of_a_package_call_and_an_async_tp_call():
    """The same all-gather with the same overlapped matmul FLOPs: as the package's traced call and as async TP's
    micro-pipelined one, both hide ``OVERLAP[kind]`` of their hideable time; async TP's first chunk
    (``t / n``) is the only difference, and only when the matmul could cover more than the rest."""
    rule = cm.overlap_rule("fitted")
    assert rule == cm.OVERLAP["fitted"] and set(rule.values()) == {0.57} and planner.ASYNC_TP_OVERLAP == 0.57
    event = Comm("all_gather", "tp", 8, 64 << 20)
    t = cm.collective_time("all_gather", 8, event.nbytes, HW.intra)
    short = 0.3 * t * RATES["matmul"]  # the matmul covers 30% of the call: both hide 0.57 of it
    package, _ = cm._hidden(event, t, short, 0.0, RATES, False, rule)
    async_tp, chunks = cm._hidden(event, t, short, 0.0, RATES, True, rule)
    assert package == pytest.approx(async_tp) == pytest.approx(0.57 * 0.3 * t)
    assert chunks == 7
    long = 10 * t * RATES["matmul"]  # the matmul could hide it all: the package t, async TP all but t / 8
    assert cm._hidden(event, t, long, 0.0, RATES, False, rule)[0] == pytest.approx(0.57 * t)
    assert cm._hidden(event, t, long, 0.0, RATES, True, rule)[0] == pytest.approx(0.57 * t * 7 / 8)
    for name, share in (("pessimistic", 0.0), ("ideal", 1.0)):
        assert cm._hidden(event, t, short, 0.0, RATES, True, cm.overlap_rule(name))[0] == pytest.approx(share * 0.3 * t)
    assert cm.overlap_rule({"broadcast": 0.2})["broadcast"] == 0.2 and cm.overlap_rule(0.4)["send"] == 0.4
    with pytest.raises(ValueError, match=r"overlap efficiencies must lie in \[0, 1\], got \{'send': 1.5\}"):
        cm.overlap_rule({"send": 1.5})
    with pytest.raises(ValueError, match="unknown collective kinds \\['gossip'\\]"):
        cm.overlap_rule({"gossip": 0.5})
    with pytest.raises(ValueError, match="overlap='hopeful' is not one of"):
        cm.overlap_rule("hopeful")


@pytest.fixture(scope="module")
def tiny():
    return model_config("llama-tiny")


def test_the_step_of_either_side_exposes_what_the_rule_leaves(tiny):
    """``step_time`` of a traced package layout (2-D grid of 4) and of async TP over 4: under ``"pessimistic"``
    every call is exposed on both sides; ``"fitted"`` exposes ``t - 0.57 * (ideal's hidden)`` call by call, so the
    exposed time is the linear mix of the two bounds on both sides."""
    for layout, kw in (("2d", {}), ("tp1d-sp", {"async_tp": True, "lean_wire": True})):
        steps = {name: cm.step_time(layout, tiny, 4, 64, 4, HW, 2, overlap=name, ranks=[0], **kw)
                 for name in ("ideal", "fitted", "pessimistic")}
        comm = steps["ideal"]["comm_s"]
        assert comm > 0 and all(s["comm_s"] == pytest.approx(comm) for s in steps.values())
        assert steps["pessimistic"]["exposed_comm_s"] == pytest.approx(comm)
        hidden_ideal = comm - steps["ideal"]["exposed_comm_s"]
        assert hidden_ideal > 0, layout
        assert steps["fitted"]["exposed_comm_s"] == pytest.approx(comm - 0.57 * hidden_ideal), layout


def test_price_threads_the_rule_to_both_sides(tiny):
    """A package row and a baseline row priced under each preset: the pessimistic rule exposes more of each side's
    tensor-parallel calls than the fitted one, the fitted more than the ideal."""
    common = dict(p=4, dp=1, zero_stage=0, checkpointing="none", micro_batch=4, grad_accum=1, seq=64, hw=HW,
                  gpus_per_node=4)
    for layout, extra in (("2d", {}), ("tp1d-sp", {"async_tp": True})):
        exposed = [planner.price(tiny, layout=layout, overlap=name, **common, **extra).parts["time_s"]["micro_tp_exposed"]
                   for name in ("ideal", "fitted", "pessimistic")]
        assert exposed[0] < exposed[1] < exposed[2], (layout, exposed)


def test_hsdp_moves_fewer_inter_node_bytes_than_fsdp_over_64_gpus():
    """Llama 3.1 8B, plain FSDP (tp 1) over 64 GPUs against HSDP with groups of 8 (one node): on hardware whose
    NVLink costs nothing, the data-parallel time is the inter-node time. HSDP's is one float32 all-reduce of the
    group's shards across the 8 nodes per step; FSDP's the gathers and reduce-scatters of every micro-batch over 64
    ranks; the planner's rows show the same, HSDP the faster."""
    cfg = model_config("llama-3.1-8b")
    free_nvlink = dataclasses.replace(HW, intra=cm.Link(0.0, 1e30))
    split = parameter_split(cfg)
    common = dict(root=split.root, block=split.block, n_layer=split.n_layer, dp=64, tp=1, stage=3, gpus_per_node=8,
                  hw=free_nvlink, forward_s=0.1, backward_s=0.2, grad_accum=4)
    fsdp = planner.data_parallel_time(**common)
    hsdp = planner.data_parallel_time(**common, shard_group=8)
    across = cm.collective_time("all_reduce", 8, 4 * split.total / 8, HW.inter)
    assert hsdp["hsdp_all_reduce_s"] == pytest.approx(across)
    assert hsdp["comm_s"] == pytest.approx(across)  # inside the node nothing costs: only the all-reduce is left
    assert hsdp["comm_s"] < fsdp["comm_s"] / 10
    rows = {group: planner.price(cfg, layout="tp1d-sp", p=1, dp=64, zero_stage=3, checkpointing="full", micro_batch=2,
                                 grad_accum=4, seq=SEQ, hw=HW, gpus_per_node=8, shard_group=group)
            for group in (0, 8)}
    assert rows[8].shard_group == 8 and rows[0].shard_group == 0
    assert rows[8].parts["time_s"]["dp_comm"] < rows[0].parts["time_s"]["dp_comm"]
    assert rows[8].tokens_per_s_per_gpu > rows[0].tokens_per_s_per_gpu
    assert rows[8].memory_gib > rows[0].memory_gib  # the shards are 1/8, not 1/64
    with pytest.raises(ValueError, match="shard_group=3 must divide dp=64"):
        baseline_row_peak_bytes(cfg, 1, SEQ, 1, dp=64, zero_stage=3, shard_group=3)


def test_the_chunked_loss_lowers_the_baseline_s_memory_and_prices_its_recomputed_head():
    """Llama 3.1 8B, FSDP over 8 (tp 1): the chunked loss never holds the ``[N, V]`` log-softmax or its gradient,
    so its peak is lower by GiBs; its step recomputes every chunk's logits, ``2 N h V`` FLOPs more, and runs 4
    head kernels a chunk instead of 3 in all."""
    cfg = model_config("llama-3.1-8b")
    kw = dict(dp=8, zero_stage=3, checkpointing="full", elem=2)
    unfused = baseline_row_peak_bytes(cfg, 2, SEQ, 1, **kw)
    chunked = baseline_row_peak_bytes(cfg, 2, SEQ, 1, **kw, loss="chunked")
    assert unfused == baseline_peak_bytes(cfg, 2, SEQ, 1, **kw)
    logsoftmax = 2 * SEQ * cfg.vocab_size * 4  # batch 2, float32: saved by the unfused loss
    assert chunked["activations"] == unfused["activations"] - logsoftmax
    assert unfused["total"] - chunked["total"] > 4 * planner.GIB
    common = dict(layout="tp1d-sp", p=1, dp=8, zero_stage=3, checkpointing="full", micro_batch=2, grad_accum=1,
                  seq=SEQ, hw=HW, gpus_per_node=8)
    rows = {loss: planner.price(cfg, **common, loss=loss) for loss in ("unfused", "chunked")}
    assert rows["chunked"].loss == "chunked" and rows["chunked"].memory_gib * planner.GIB == chunked["total"]
    head = 2.0 * 2 * SEQ * cfg.n_embd * cfg.vocab_size
    kernels = 4 * (2 * SEQ // CHUNK_TOKENS) - 3
    extra = head / HW.matmul_flops_per_s + kernels * HW.gemm_overhead_s
    assert (rows["chunked"].parts["time_s"]["micro_compute"] - rows["unfused"].parts["time_s"]["micro_compute"]
            == pytest.approx(extra, rel=1e-9))


def test_the_baseline_considers_zero_1_and_the_package_s_stages():
    """At dp > 1 the baseline's candidates carry every stage the package's do (DDP, ZeRO 1, FSDP 2 and 3), HSDP
    inside a node and both losses; a ZeRO 1 row keeps whole float32 parameters and gradients and 1/dp of the moments
    (stage 0's peak less the rest of them), and pays the gradient all-reduce and the slices' all-gather."""
    cfg = model_config("llama-3.1-8b")
    candidates = planner._candidates(cfg, 64, 8, SEQ, 512, (), True, (0, 1, 2, 3), ("none", "selective", "full"),
                                     None)
    baseline = [(c[1], tuple(c[3]), c[6]["shard_group"], c[6]["loss"]) for c in candidates]
    assert (8, (0, 1, 2, 3), 0, "unfused") in baseline and (8, (0, 1, 2, 3), 0, "chunked") in baseline
    assert (1, (2, 3), 8, "unfused") in baseline and (2, (2, 3), 4, "chunked") in baseline
    assert not any(group for tp, _, group, _ in baseline if tp == 8)  # a node is one tensor group: no HSDP
    zero0 = baseline_row_peak_bytes(cfg, 1, SEQ, 8, dp=8, zero_stage=0, checkpointing="full")
    zero1 = baseline_row_peak_bytes(cfg, 1, SEQ, 8, dp=8, zero_stage=1, checkpointing="full")
    assert zero1["optimizer"] == zero0["optimizer"] // 8
    assert zero1["total"] == zero0["total"] - (zero0["optimizer"] - zero1["optimizer"])
    row = planner.price(cfg, layout="tp1d-sp", p=8, dp=8, zero_stage=1, checkpointing="full", micro_batch=1,
                        grad_accum=8, seq=SEQ, hw=HW, gpus_per_node=8)
    assert row.zero_stage == 1 and row.memory_gib * planner.GIB == zero1["total"]
    assert row.parts["time_s"]["dp_comm"] > 0


def test_baseline_elementwise_work_counts_the_norm_shards_not_their_gathered_copies():
    """The 1-D baseline's elementwise seconds per token and GPU no longer grow with its TP degree: the ``2 L + 1``
    norm outputs it all-gathers are counted as the ``N h e / tp`` shards the norms write (they were counted whole,
    which made TP 8 pay ~1.7x plain FSDP's elementwise time per token); then the side's measured memory-bound
    quotient (:func:`~lightning_tp2d.planning.host_cost.memory_bound_ratio`, the same at every TP degree above 1:
    what torch's code moves beyond that model, its reduce-scatters' chunk copies among it) multiplies them."""
    from lightning_tp2d.planning import host_cost

    cfg = model_config("llama-3.1-8b")
    per_token = {}
    for tp in (1, 2, 8):
        row = planner.price(cfg, layout="tp1d-sp", p=tp, dp=64 // tp, zero_stage=3, checkpointing="full",
                            micro_batch=1, grad_accum=1, seq=SEQ, hw=HW, gpus_per_node=8)
        seconds = row.parts["time_s"]["micro_elementwise"]
        saved = baseline_activation_bytes(cfg, 1, SEQ, tp, elem=2, ep=2)["total"]
        gathered = (2 * cfg.n_layer + 1) * SEQ * cfg.n_embd * 2
        passes = planner.ELEMENTWISE_PASSES["compiled"]
        ratio = host_cost.memory_bound_ratio("tp1d-sp" if tp > 1 else "single", cfg, tp)
        assert ratio == (1.0 if tp == 1 else host_cost.MEMORY_BOUND["llama"]["tp1d-sp"][4])
        modelled = saved - gathered * (1 - 1 / tp)
        assert seconds == pytest.approx(passes * ratio * modelled / HW.hbm_bytes_per_s, rel=1e-12)
        per_token[tp] = seconds / ratio / (SEQ / tp)
    assert per_token[8] == pytest.approx(per_token[1], rel=0.02)
    assert per_token[2] == pytest.approx(per_token[1], rel=0.02)


def test_search_space_counts_each_side_s_configurations(tiny):
    """:func:`planner.search_space` counts stages x modes x micro-batches of every candidate, per side."""
    candidates = planner._candidates(tiny, 4, 4, 48, 16, ("2d", "metp"), True, (0, 3), ("none", "full"), 2)
    counts = planner.count_configurations(candidates)
    assert counts == planner.search_space("llama-tiny", gpus=4, gpus_per_node=4, seq=48, global_batch_tokens=16 * 48,
                                          layouts=("2d", "metp"), zero_stages=(0, 3), checkpointing=("none", "full"),
                                          max_micro_batch=2)
    want = {"package": 0, "baseline": 0}
    for name, _, _, stages, modes, micros, *_ in candidates:
        want["baseline" if name == planner.BASELINE else "package"] += len(stages) * len(modes) * len(micros)
    assert counts == want and counts["package"] > 0 and counts["baseline"] > 0
    with_offload = planner.count_configurations(candidates, activation_offload=(False, True))
    full = {"package": 0, "baseline": 0}
    for name, _, _, stages, modes, micros, *_ in candidates:
        full["baseline" if name == planner.BASELINE else "package"] += len(stages) * len(micros) * ("full" in modes)
    assert with_offload == {k: counts[k] + full[k] for k in counts}
