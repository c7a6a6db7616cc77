"""The planner's answers in seconds: the on-disk cache (:mod:`lightning_tp2d.planning.cache`) and the closed forms
``plan()`` reads by default (``method="closed"``) against the traced reference (``method="traced"``)."""

from __future__ import annotations

import json

import pytest

from lightning_tp2d.planning import cache as plan_cache
from lightning_tp2d.planning import planner

MODEL = "llama-tiny"
OPTIONS = dict(gpus=4, gpu_memory_gib=0.05, gpus_per_node=4, seq=48, global_batch_tokens=16 * 48,
               zero_stages=(0, 1), checkpointing=("none", "full"), max_micro_batch=2, layouts=("metp",))


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    """One cold answer into a fresh folder and the same question traced without a cache."""
    folder = tmp_path_factory.mktemp("plans")
    closed = planner.plan(MODEL, **OPTIONS, cache=folder)
    traced = planner.plan(MODEL, **OPTIONS, method="traced", cache=False)
    return folder, closed, traced


def test_the_closed_forms_give_the_traced_planners_rows(answers):
    """Where the closed forms model every package row (the ring at ZeRO 0 and 1), the rows, their memory and their
    step times are the traced planner's (the closed forms are exact there: tests/test_closed_step.py,
    tests/test_closed_memory.py)."""
    _, closed, traced = answers
    assert [r.describe() for r in closed] == [r.describe() for r in traced]
    for a, b in zip(closed, traced):
        assert a.memory_gib == pytest.approx(b.memory_gib, rel=0.02)
        assert a.step_s == pytest.approx(b.step_s, rel=0.02)
    assert any(not r.baseline for r in closed) and any(r.baseline for r in closed)


def test_a_second_answer_comes_from_the_cache_without_planning(answers, monkeypatch):
    folder, closed, _ = answers
    assert len(list(folder.glob("*.json"))) == 1

    def no_planning(*args, **kwargs):
        raise AssertionError("planned again instead of reading the cache")

    monkeypatch.setattr(planner, "_plan_candidate", no_planning)
    again = planner.plan(MODEL, **OPTIONS, cache=folder)
    assert again == closed and [r.parts for r in again] == json.loads(json.dumps([r.parts for r in closed]))
    with pytest.raises(AssertionError, match="planned again"):  # another question is not this answer
        planner.plan(MODEL, **{**OPTIONS, "gpu_memory_gib": 0.06}, cache=folder)
    with pytest.raises(AssertionError, match="planned again"):  # nor is the same question under other code
        monkeypatch.setattr(plan_cache, "source_digest", lambda: "edited")
        planner.plan(MODEL, **OPTIONS, cache=folder)


def test_the_cache_survives_bad_entries_and_keeps_nothing_fits(tmp_path, monkeypatch):
    small = {**OPTIONS, "gpu_memory_gib": 1e-4, "include_baselines": False}
    with pytest.raises(planner.NothingFits, match="least memory per GPU") as first:
        planner.plan(MODEL, **small, cache=tmp_path)
    monkeypatch.setattr(planner, "_plan_candidate", lambda *a, **k: pytest.fail("planned again"))
    with pytest.raises(planner.NothingFits) as second:
        planner.plan(MODEL, **small, cache=tmp_path)
    assert str(second.value) == str(first.value)
    for entry in tmp_path.glob("*.json"):  # a damaged entry is a miss, never an error
        entry.write_text("{not json")
    assert plan_cache.load(tmp_path, entry.stem) is None


def test_where_the_cache_lives(monkeypatch, tmp_path):
    monkeypatch.setenv("TP2D_PLAN_CACHE", str(tmp_path / "here"))
    assert plan_cache.cache_dir(True) == tmp_path / "here"
    assert plan_cache.cache_dir(tmp_path / "there") == tmp_path / "there"
    assert plan_cache.cache_dir(False) is None
    monkeypatch.setenv("TP2D_PLAN_CACHE", "0")
    assert plan_cache.cache_dir(True) is None
    monkeypatch.delenv("TP2D_PLAN_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert plan_cache.cache_dir(None) == tmp_path / "xdg" / "lightning_tp2d" / "plan"
    with pytest.raises(ValueError, match="method='fast' is not one of"):
        planner.plan(MODEL, **OPTIONS, method="fast")
    assert plan_cache.cache_key("plan", a=1) != plan_cache.cache_key("plan", a=2)
    with pytest.raises(TypeError, match="cannot key on a object"):
        plan_cache.cache_key("plan", a=object())


def test_every_package_row_is_a_train_plan(answers):
    """``plan()``'s package rows carry the :class:`~lightning_tp2d.train_plan.TrainPlan` the strategies take as
    ``plan=``; a rival's row is refused with where its settings are."""
    from lightning_tp2d.train_plan import TrainPlan

    _, closed, _ = answers
    for row in closed:
        if row.baseline:
            with pytest.raises(ValueError, match="rival's configuration"):
                row.train_plan
            continue
        plan = row.train_plan
        assert isinstance(plan, TrainPlan)
        assert (plan.layout, plan.tensor_parallel_size, plan.data_parallel_size, plan.zero_stage,
                plan.activation_checkpointing, plan.micro_batch) == (
            row.layout, row.tensor_parallel_size, row.data_parallel_size, row.zero_stage, row.checkpointing,
            row.micro_batch)
        assert plan.optimizer_sharded == (row.zero_stage == 1 or (row.zero_stage >= 2 and row.data_parallel_size > 1))
