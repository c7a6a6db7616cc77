"""Pipeline parallelism (:mod:`lightning_tp2d.pipeline`): pp stages x the layouts, torch's schedules.

* **Parity**: one step of pp 2 and pp 4 (GPipe, 1F1B, interleaved 1F1B with two virtual stages per rank) on every
  layout (a 1x1 grid, a ring of 2, a 2x2 grid for "2d" and "2d-metp") and both families (GPT-2's tied head, Llama):
  the loss and every gradient equal the plain model's on one process (fp32, 1e-5 relative); at dp 2 (ZeRO 0) each
  replica's batch averaged; with full and selective activation checkpointing.
* **Training**: three clipped AdamW steps at pp 2 give the plain model's losses and weights; the tied embedding's two
  copies (first and last stage) stay bit-equal; the clipping norm is the whole model's.
* **Stages**: balanced by FLOPs (a long vocabulary's head moves blocks off the last stage); bad sizes refused,
  naming the numbers, before any communication.

Ranks share one spawned group per world size (module-scoped fixtures).
"""

from __future__ import annotations

import copy

import pytest
import torch

import lightning_tp2d as tp
from lightning_tp2d.models import GPT2, GPT2Config, Llama, LlamaConfig
from lightning_tp2d.pipeline import Pipeline, block_costs, run_model_as_pipeline, split_blocks
from tests.distributed import run_distributed

BATCH, SEQ, MICRO = 8, 32, 4


def _model(family: str, n_layer: int = 4):
    torch.manual_seed(0)
    if family == "gpt2":
        return GPT2(GPT2Config.from_name("gpt2-tiny", dropout=0.0, n_layer=n_layer))
    return Llama(LlamaConfig.from_name("llama-tiny", n_layer=n_layer))


def _full(g: torch.Tensor) -> torch.Tensor:
    return g.full_tensor() if hasattr(g, "full_tensor") else g


def _one_step(world_size: int, case: tuple, zero_stage: int = 0) -> dict:
    """``case = (pp, layout, p, dp, family, schedule, virtual)``: one step against the plain model on this
    replica's batch (dp 1) or on both replicas' batches (dp 2: the plain model's gradient of their mean); at
    ``zero_stage`` 2 or 3 the stages sharded with FSDP2 over the replicas."""
    pp, layout, p, dp, family, schedule, virtual, *checkpointing = case
    ref = _model(family)
    model = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, ref.config.vocab_size, (BATCH, SEQ), generator=g) for _ in range(dp)]
    sum(ref(idx, idx) for idx in batches).div(dp).backward()
    mesh = tp.init_mesh(layout, p, dp, pipeline_parallel_size=pp)
    pipe = Pipeline(model, mesh, layout, schedule=schedule, microbatches=MICRO, virtual_stages=virtual,
                    activation_checkpointing=checkpointing[0] if checkpointing else "none", zero_stage=zero_stage)
    mine = batches[mesh.get_local_rank("data_parallel")]
    loss = pipe.step(mine, mine)
    if zero_stage >= 2:  # FSDP: every stage's matrices are cut over data_parallel
        assert pipe.fsdp and all(not q.placements[0].is_replicate() for q in pipe.parameters() if q.dim() > 1)
        norm = pipe.clip_grad_norm_(1e9).item()  # the whole model's, dp shards included
        want_norm = torch.nn.utils.get_total_norm([q.grad for q in ref.parameters()]).item()
        assert abs(norm - want_norm) <= 1e-5 * want_norm, (norm, want_norm)
    want = {name: q.grad for name, q in ref.named_parameters()}
    rel = max(((_full(q.grad) - want[name]).abs().max() / want[name].abs().max()).item()
              for name, q in pipe.named_parameters())
    return {"loss": loss.item(), "want": ref(mine, mine).item(), "rel": rel,
            "names": sorted(name for name, _ in pipe.named_parameters()), "all_names": sorted(want)}


CASES_2 = [(2, "2d", 1, 1, "gpt2", "1f1b", 1), (2, "2d", 1, 1, "llama", "gpipe", 1),
           (2, "2d", 1, 1, "gpt2", "interleaved_1f1b", 2), (2, "2d", 1, 1, "gpt2", "1f1b", 1, "full"),
           (2, "2d", 1, 1, "llama", "1f1b", 1, "selective")]
CASES_4 = [(4, "2d", 1, 1, "gpt2", "1f1b", 1), (4, "2d", 1, 1, "llama", "gpipe", 1),
           (2, "metp", 2, 1, "gpt2", "gpipe", 1), (2, "metp", 2, 1, "llama", "1f1b", 1),
           (2, "2d", 1, 2, "llama", "1f1b", 1)]
CASES_8 = [(2, "2d", 4, 1, "gpt2", "1f1b", 1, "selective"), (2, "2d-metp", 4, 1, "llama", "interleaved_1f1b", 2)]


def _cases_worker(rank: int, world_size: int, cases, zero_stage: int = 0) -> dict:
    return {case: _one_step(world_size, case, zero_stage) for case in cases}


def _training_worker(rank: int, world_size: int) -> dict:
    """Three clipped AdamW steps of GPT-2 (tied) at pp 2 against the plain model."""
    ref = _model("gpt2")
    model = copy.deepcopy(ref)
    mesh = tp.init_mesh("2d", 1, 1, pipeline_parallel_size=2)
    pipe = Pipeline(model, mesh, "2d", schedule="1f1b", microbatches=MICRO)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(2)
    out = {"losses": [], "ref_losses": [], "norms": [], "ref_norms": []}
    for _ in range(3):
        idx = torch.randint(0, ref.config.vocab_size, (BATCH, SEQ), generator=g)
        opt_ref.zero_grad()
        opt.zero_grad()
        loss_ref = ref(idx, idx)
        loss_ref.backward()
        out["ref_norms"].append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item())
        opt_ref.step()
        out["losses"].append(pipe.step(idx, idx).item())
        out["norms"].append(pipe.clip_grad_norm_(0.5).item())
        opt.step()
        out["ref_losses"].append(loss_ref.item())
    want = dict(ref.named_parameters())
    out["weights"] = max((_full(q) - want[n]).abs().max().item() for n, q in pipe.named_parameters())
    wte = _full(pipe.model.transformer.wte.weight).detach()
    gathered = [torch.empty_like(wte) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, wte)
    out["copies_equal"] = torch.equal(gathered[0], gathered[1])
    return out


@pytest.fixture(scope="module")
def two():
    return run_distributed(_cases_worker, 2, CASES_2)


@pytest.fixture(scope="module")
def four():
    return run_distributed(_cases_worker, 4, CASES_4)


CASES_ZERO = [(2, "2d", 1, 2, "gpt2", "1f1b", 1), (2, "2d", 1, 2, "llama", "interleaved_1f1b", 2, "full")]


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_zero_2_and_3_shard_the_stages_and_equal_the_plain_model(zero_stage):
    """FSDP2 over the replicas of each stage (GPT-2's tied copy on the last stage in the head's group; Llama
    interleaved and fully checkpointed): one step's loss, every gradient and the clipping norm equal the plain
    model's on both replicas' batches."""
    outs = run_distributed(_cases_worker, 4, CASES_ZERO, zero_stage)
    for case in CASES_ZERO:
        _check(outs, case)


@pytest.fixture(scope="module")
def eight():
    return run_distributed(_cases_worker, 8, CASES_8, timeout=600)


def _check(outs: list[dict], case) -> None:
    for rank, out in enumerate(outs):
        got = out[case]
        assert abs(got["loss"] - got["want"]) <= 1e-5 * got["want"], (rank, case, got)
        assert got["rel"] <= 1e-5, (rank, case, got)


def _id(case) -> str:
    pp, layout, p, dp, family, schedule, virtual, *checkpointing = case
    return f"pp{pp}-{layout}-p{p}-dp{dp}-{family}-{schedule}" + (f"-v{virtual}" if virtual > 1 else "") + \
        "".join(f"-{mode}" for mode in checkpointing)


@pytest.mark.parametrize("case", CASES_2, ids=_id)
def test_pp2_one_rank_stages_equal_the_plain_model(two, case):
    _check(two, case)


@pytest.mark.parametrize("case", CASES_4, ids=_id)
def test_pp_4_rings_and_data_parallel_equal_the_plain_model(four, case):
    _check(four, case)


@pytest.mark.parametrize("case", CASES_8, ids=_id)
def test_pp2_on_2x2_grids_equals_the_plain_model(eight, case):
    _check(eight, case)


def test_each_stage_holds_its_own_blocks_under_their_global_names(four):
    """pp 4 x 1x1 GPT-2: stage ``s`` holds block ``s`` (``transformer.h.s.*``); the first the embeddings, the last
    the final norm and the tied embedding's copy; every parameter is on some stage."""
    case = CASES_4[0]
    names = [set(out[case]["names"]) for out in four]
    for s, held in enumerate(names):
        blocks = {n.split(".")[2] for n in held if n.startswith("transformer.h.")}
        assert blocks == {str(s)}, (s, sorted(held))
    assert "transformer.wpe.weight" in names[0] and "transformer.wpe.weight" not in names[3]
    assert {"transformer.ln_f.weight", "transformer.wte.weight"} <= names[3]
    assert set().union(*names) == set(four[0][case]["all_names"])


def test_three_clipped_steps_train_like_the_plain_model_and_keep_the_tied_copies_equal():
    for rank, out in enumerate(run_distributed(_training_worker, 2)):
        for got, want in ((out["losses"], out["ref_losses"]), (out["norms"], out["ref_norms"])):
            assert max(abs(a - b) / b for a, b in zip(got, want)) <= 1e-5, (rank, out)
        # AdamW's first steps move every weight by ~lr = 1e-2; a gradient element near 0 turns rounding noise into
        # an O(1) normalised update (as in test_fsdp): an absolute bound
        assert out["weights"] <= 2e-4, (rank, out["weights"])
        assert out["copies_equal"], rank


def test_blocks_are_split_by_cost():
    """Equal blocks split evenly; a head that costs two blocks moves two blocks off the last stage; too few blocks
    for the stages is refused naming both."""
    assert split_blocks(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert split_blocks(8, 2, (0.0, 1.0, 2.0)) == [range(0, 5), range(5, 8)]
    cfg = LlamaConfig.from_name("llama-3.1-8b")
    embed, block, head = block_costs(cfg, 8192)
    assert embed == 0 and 1.5 < head / block < 2.5  # the 128k-token head costs about two blocks at 8k tokens
    assert [len(r) for r in split_blocks(32, 4, (embed, block, head))] == [8, 9, 9, 6]
    with pytest.raises(ValueError, match="3 blocks cannot fill 4 pipeline stages"):
        split_blocks(3, 4)


def _refusals_worker(rank: int, world_size: int) -> dict:
    out = {}
    mesh = tp.init_mesh("2d", 1, 1, pipeline_parallel_size=2)
    flat = tp.init_mesh("2d", 1, 2)
    asks = {"no_axis": dict(mesh=flat), "schedule": dict(schedule="zb"),
            "few_micro": dict(microbatches=1), "interleaved_micro": dict(schedule="interleaved_1f1b", microbatches=3,
                                                                       virtual_stages=2),
            "virtual": dict(virtual_stages=2), "stages": dict(model=_model("gpt2", n_layer=1))}
    for key, ask in asks.items():
        kwargs = {"mesh": mesh, "model": _model("gpt2"), **ask}
        try:
            Pipeline(kwargs.pop("model"), kwargs.pop("mesh"), "2d", **kwargs)
            out[key] = None
        except ValueError as err:
            out[key] = str(err)
    pipe = Pipeline(_model("gpt2"), mesh, "2d", microbatches=4)
    try:
        pipe.check_batch(torch.zeros(6, SEQ, dtype=torch.long))
    except ValueError as err:
        out["batch"] = str(err)
    run_model_as_pipeline(pipe)  # the model's call is the pipeline's: logits and documents refused
    for key, call in (("logits", lambda: pipe.model(torch.zeros(4, SEQ, dtype=torch.long))),
                      ("documents", lambda: pipe.model(torch.zeros(4, SEQ, dtype=torch.long),
                                                       torch.zeros(4, SEQ, dtype=torch.long), doc_ids=1))):
        try:
            call()
        except ValueError as err:
            out[key] = str(err)
    return out


def test_bad_sizes_are_refused_naming_the_numbers():
    out = run_distributed(_refusals_worker, 2)[0]
    assert "'pipeline' axis" in out["no_axis"]
    assert "'zb' is not one of" in out["schedule"]
    assert "microbatches=1 < pipeline_parallel_size=2" in out["few_micro"]
    assert "microbatches=3 is not a multiple of pipeline_parallel_size=2" in out["interleaved_micro"]
    assert "virtual_stages=2 needs pp_schedule='interleaved_1f1b'" in out["virtual"]
    assert "1 blocks cannot fill 2 pipeline stages" in out["stages"]
    assert "batch size 6 does not split into microbatches=4" in out["batch"]
    assert "returns its loss, not logits" in out["logits"] and "packed documents" in out["documents"]


def test_the_mesh_puts_the_pipeline_outermost_and_counts_it_in_the_world():
    plan = tp.TrainPlan("2d", 4, 2, pipeline_parallel_size=3)
    assert plan.world_size == 24 and plan.mesh_shape == (3, 2, 2, 2)
    assert plan.mesh_dim_names[:2] == ("pipeline", "data_parallel")
    assert tp.TrainPlan("2d", 4, 2).mesh_dim_names[0] == "data_parallel"  # no axis for one stage
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 x data_parallel_size 2"):
        plan.check_world_size(16)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be a positive int"):
        tp.TrainPlan("2d", 4, 1, pipeline_parallel_size=0)


def _checkpoint_worker(rank: int, world_size: int, directory: str) -> dict:
    """GPT-2 (tied) at pp 2 x 1x1: two AdamW steps, a sharded save, a third step (the reference). The save then
    resumes (a) at pp 2 interleaved (other blocks per rank), (b) without stages on a ring of 2, (c) on one device
    (``read_state_dict``); a ring-of-2 save resumes at pp 2. Each resumed third step's loss and weights."""
    from lightning_tp2d import checkpoint

    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 257, (BATCH, SEQ), generator=g) for _ in range(3)]
    pp_mesh = tp.init_mesh("2d", 1, 1, pipeline_parallel_size=2)
    ring = tp.init_mesh("metp", 2, 1)

    def trained(pipe_or_model, optimizer, steps, one_step):
        losses = []
        for idx in steps:
            optimizer.zero_grad()
            losses.append(one_step(pipe_or_model, idx))
            optimizer.step()
        return losses

    pipe_step = lambda pipe, idx: pipe.step(idx, idx).item()  # noqa: E731

    def ring_step(model, idx):
        loss = model(idx, idx)
        loss.backward()
        return loss.item()

    def weights(named):
        return {n: _full(q).detach().clone() for n, q in named}

    pipe = Pipeline(_model("gpt2"), pp_mesh, "2d", microbatches=MICRO)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    trained(pipe, opt, batches[:2], pipe_step)
    pipe.save(f"{directory}/pp2", [opt], extra={"global_step": 2})
    want = trained(pipe, opt, batches[2:], pipe_step)[0]
    want_weights = weights(pipe.named_parameters())
    out = {}

    again = Pipeline(_model("gpt2"), pp_mesh, "2d", schedule="interleaved_1f1b", microbatches=MICRO, virtual_stages=2)
    opt = torch.optim.AdamW(again.parameters(), lr=1e-2)
    extra = again.load(f"{directory}/pp2", [opt])
    out["pp2_interleaved"] = (trained(again, opt, batches[2:], pipe_step)[0], want, extra.get("global_step"))
    out["pp2_interleaved_weights"] = max((w - want_weights[n]).abs().max().item()  # (the blocks both hold here)
                                         for n, w in weights(again.named_parameters()).items() if n in want_weights)

    flat = tp.parallelize(_model("gpt2"), ring, "metp")
    opt = torch.optim.AdamW(flat.parameters(), lr=1e-2)
    checkpoint.load_into(flat, [opt], f"{directory}/pp2")
    out["ring"] = (trained(flat, opt, batches[2:], ring_step)[0], want)
    flat_weights = weights(flat.named_parameters())
    out["ring_weights"] = max((w - want_weights[n]).abs().max().item() for n, w in flat_weights.items()
                              if n in want_weights)

    plain = checkpoint.read_state_dict(f"{directory}/pp2")  # (every rank: DCP's load is a collective here)
    out["one_device_keys"] = sorted(plain) == sorted(_model("gpt2").state_dict())
    # the ring's save (no stages) resumes at pp 2
    checkpoint.save({"state_dict": checkpoint.sharded_model_state(flat),
                     "optimizer_states": [checkpoint.sharded_optimizer_state(flat, opt)]},
                    __import__("pathlib").Path(f"{directory}/ring"), rank=rank, sharded=True,
                    barrier=lambda name: torch.distributed.barrier())
    back = Pipeline(_model("gpt2"), pp_mesh, "2d", microbatches=MICRO)
    opt = torch.optim.AdamW(back.parameters(), lr=1e-2)
    back.load(f"{directory}/ring", [opt])
    out["ring_to_pp2_weights"] = max((w - flat_weights[n]).abs().max().item()
                                     for n, w in weights(back.named_parameters()).items())
    out["batches"] = batches
    return out


def _pp4_resume_worker(rank: int, world_size: int, directory: str, batch: torch.Tensor) -> float:
    """The pp 2 save resumed at pp 4 (one block per stage): the third step's loss."""
    pipe = Pipeline(_model("gpt2"), tp.init_mesh("2d", 1, 1, pipeline_parallel_size=4), "2d", microbatches=MICRO)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    pipe.load(f"{directory}/pp2", [opt])
    opt.zero_grad()
    loss = pipe.step(batch, batch).item()
    opt.step()
    return loss


def test_a_pipeline_checkpoint_resumes_at_another_stage_split_at_pp_4_without_stages_and_on_one_device(tmp_path):
    outs = run_distributed(_checkpoint_worker, 2, str(tmp_path))
    want = outs[0]["ring"][1]
    for loss in run_distributed(_pp4_resume_worker, 4, str(tmp_path), outs[0]["batches"][2]):
        assert abs(loss - want) <= 1e-5 * want, (loss, want)  # resumed at pp 4: the uninterrupted third step
    for rank, out in enumerate(outs):
        got, want, step = out["pp2_interleaved"]
        assert abs(got - want) <= 1e-5 * want and step == 2, (rank, out)
        got, want = out["ring"]
        assert abs(got - want) <= 1e-5 * want, (rank, out)
        assert out["pp2_interleaved_weights"] <= 2e-4 and out["ring_weights"] <= 2e-4, (rank, out)
        assert out["ring_to_pp2_weights"] == 0.0, (rank, out)
        assert out["one_device_keys"], out


def _kept_worker(rank: int, world_size: int) -> dict:
    """Bytes autograd keeps for the backward over one pp 2 step, by checkpointing mode (what ``"selective"`` keeps as
    it is, not its recipes)."""
    from lightning_tp2d import recompute

    mesh = tp.init_mesh("2d", 1, 1, pipeline_parallel_size=2)
    idx = torch.randint(0, 257, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    out = {}
    for mode in ("none", "selective", "full"):
        pipe = Pipeline(_model("gpt2"), mesh, "2d", microbatches=MICRO, activation_checkpointing=mode)
        kept = [0]

        def count(t):
            kept[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t), recompute.observing_kept(count):
            pipe.step(idx, idx)
        out[mode] = kept[0]
    return out


def test_activation_checkpointing_keeps_less_on_every_stage():
    for rank, kept in enumerate(run_distributed(_kept_worker, 2)):
        assert kept["full"] < kept["selective"] < kept["none"], (rank, kept)


def _meta_worker(rank: int, world_size: int) -> dict:
    """A meta-device build at pp 2 (GPT-2 tied, 1F1B; Llama interleaved) against the eager build from the same
    seed: every parameter this rank holds, bit for bit."""
    out = {}
    mesh = tp.init_mesh("2d", 1, 1, pipeline_parallel_size=2)
    for family, schedule, virtual in (("gpt2", "1f1b", 1), ("llama", "interleaved_1f1b", 2)):
        want = dict(_model(family).named_parameters())
        with torch.device("meta"):
            model = _model(family)  # (its seed: the build below draws from the one seeded here)
        torch.manual_seed(0)
        pipe = Pipeline(model, mesh, "2d", schedule=schedule, microbatches=MICRO, virtual_stages=virtual)
        out[family] = {"held": len(list(pipe.named_parameters())),
                       "worst": max((_full(q) - want[n]).abs().max().item() for n, q in pipe.named_parameters()),
                       "meta_left": any(q.is_meta for q in pipe.parameters())}
        idx = torch.randint(0, 257, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        out[family]["loss"] = pipe.step(idx, idx).item()
        out[family]["want"] = _model(family)(idx, idx).item()
    return out


def test_a_meta_device_build_gives_every_stage_the_eager_weights():
    """No rank builds the whole model: the other stages' modules are drawn and dropped in init order, so each
    stage's weights are the eager build's from the same seed (and the first step its loss)."""
    for rank, out in enumerate(run_distributed(_meta_worker, 2)):
        for family, got in out.items():
            assert got["worst"] == 0.0 and not got["meta_left"] and got["held"] > 0, (rank, family, got)
            assert abs(got["loss"] - got["want"]) <= 1e-5 * got["want"], (rank, family, got)
