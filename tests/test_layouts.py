"""The layout objects own every layout rule: sizes, mesh, model/batch/sequence checks and the automatic size (the
module plan is each model family's). A fourth layout defined here alone, registered by name with GPT-2's plan for it,
is accepted by ``init_mesh``, by ``parallelize`` and by the strategy's size resolution, with no edit anywhere else.

Process-group work runs on torch's fake process group in this process (no ranks are spawned).
"""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import lightning_tp2d as tp
from lightning_tp2d.families import auto_tensor_parallel_size, get_family, register_family, register_plan
from lightning_tp2d.layouts import (Grid2D, GridRing, Layout, ParallelHandle, Ring, get_layout, handle_of,
                                    layout_names, register_layout, unregister_layout)
from lightning_tp2d.models import GPT2, GPT2Config
from lightning_tp2d.strategy import TP2DStrategy


class Pairs(Layout):
    """Toy layout: every rank keeps the whole model (the plan replaces nothing), on rings of at most 2 ranks."""

    name = "toy-pairs"
    tensor_axes = ("pair",)

    def size_problem(self, p: int) -> str | None:
        return None if p <= 2 else f"layout {self.name!r} holds one replica on at most 2 ranks, got {p}"


@pytest.fixture
def toy():
    gpt2 = get_family("gpt2")
    register_layout(Pairs)
    register_plan("gpt2", Pairs.name, lambda layout: {})  # GPT-2's plan for it replaces nothing
    yield Pairs
    unregister_layout(Pairs.name)
    register_family(gpt2, override=True)


@pytest.fixture
def fake_world():
    def start(world: int, rank: int = 0) -> None:
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_fourth_layout_defined_in_a_test_is_registered_by_name(toy):
    assert layout_names() == ("2d", "metp", "2d-metp", "toy-pairs")
    assert isinstance(get_layout("toy-pairs"), Pairs)
    with pytest.raises(ValueError, match=r"unknown layout 'toy'; choose one of \['2d', 'metp', '2d-metp', 'toy-pairs'\]"):
        get_layout("toy")


def test_init_mesh_builds_the_fourth_layouts_axes_and_refuses_its_bad_sizes(toy, fake_world):
    fake_world(4, rank=3)
    mesh = tp.init_mesh("toy-pairs", tensor_parallel_size=2, data_parallel_size=2)
    assert mesh.mesh_dim_names == ("data_parallel", "pair") and tuple(mesh.shape) == (2, 2)
    assert (mesh.get_local_rank("data_parallel"), mesh.get_local_rank("pair")) == (1, 1)
    with pytest.raises(ValueError, match="at most 2 ranks, got 4"):
        tp.init_mesh("toy-pairs", tensor_parallel_size=4)


def test_parallelize_validates_and_applies_the_fourth_layouts_plan(toy, fake_world):
    fake_world(2)
    mesh = tp.init_mesh("toy-pairs", 2, 1)
    cfg = GPT2Config.from_name("gpt2-tiny")  # 6 heads, 48 wide: both split over 2
    model = tp.parallelize(GPT2(cfg), mesh, "toy-pairs")
    handle = handle_of(model)
    assert isinstance(handle, ParallelHandle) and isinstance(handle.layout, Pairs) and handle.mesh is mesh
    assert (handle.tensor_parallel_size, handle.data_parallel_size, handle.input_multiples) == (2, 1, (1, 1))
    assert type(model.transformer.h[0].attn).__name__ == "CausalSelfAttention"  # the plan kept it plain
    with pytest.raises(ValueError, match="already parallelized with layout 'toy-pairs'"):
        tp.parallelize(model, mesh, "toy-pairs")
    odd = GPT2Config(n_layer=1, n_head=3, n_embd=12, vocab_size=17, block_size=8)
    with pytest.raises(ValueError, match=r"layout 'toy-pairs': n_head=3 is not divisible by p=2; use p in \[1, 3\]"):
        tp.parallelize(GPT2(odd), mesh, "toy-pairs")
    with pytest.raises(ValueError, match=r"layout '2d' needs a mesh with axes \('data_parallel', 'row', 'col'\)"):
        tp.parallelize(GPT2(cfg), mesh, "2d")


def test_the_strategy_resolves_sizes_with_the_fourth_layouts_rules(toy):
    trainer = L.Trainer(strategy=TP2DStrategy(layout="toy-pairs"), accelerator="cpu", devices=4, logger=False)
    dims = trainer.strategy.parallel_dims
    assert (dims.layout, dims.tensor_parallel_size, dims.data_parallel_size) == ("toy-pairs", 2, 2)  # auto: p <= 2
    with pytest.raises(ValueError, match="at most 2 ranks, got 4"):
        L.Trainer(strategy=TP2DStrategy(layout="toy-pairs", tensor_parallel_size=4), accelerator="cpu", devices=4,
                  logger=False)


# ---- the three layouts' rules, asked of their objects ------------------------------------------------------------


def test_each_layout_states_its_mesh_side_and_input_multiples():
    assert (Grid2D().mesh_shape(9, 2), Grid2D().side(9), Grid2D().input_multiples(9)) == ((2, 3, 3), 3, (3, 1))
    assert (Ring().mesh_shape(6, 1), Ring().side(6), Ring().input_multiples(6)) == ((1, 6), 6, (1, 12))
    assert (GridRing().mesh_shape(4, 1), GridRing().input_multiples(4)) == ((1, 2, 2), (1, 4))
    assert Grid2D().describe(9) == "3x3 grid" and Ring().describe(4) == "ring of 4"


def test_layout_messages_name_the_numbers_and_a_size_that_fits():
    assert Grid2D().batch_problem(4, 5, key="data.batch_size") == (
        "data.batch_size=5 is not divisible by q=2 (layout '2d' splits each batch over the 2 grid rows); use "
        "data.batch_size=6")
    assert Ring().sequence_problem(4, 60) == (
        "sequence length 60 is not divisible by 2*p=8 (layout 'metp' cuts every sequence into 8 zigzag chunks); use 56 "
        "or 64, the nearest multiples of 8")
    assert Ring().batch_problem(4, 5) is None and Grid2D().sequence_problem(4, 7) is None
    with pytest.raises(ValueError, match="does not support dropout"):
        GridRing().check_sizes(4, {"n_head": 6, "n_embd": 48}, dropout=0.1)
    Grid2D().check_sizes(4, {"n_head": 6, "n_embd": 48}, dropout=0.1)


def test_auto_size_is_the_layouts_largest_valid_size_within_a_node():
    xl = GPT2Config.from_name("gpt2-xl")  # 25 heads, 1600 wide
    assert auto_tensor_parallel_size(Grid2D(), 8, 16) == 4
    assert auto_tensor_parallel_size(Ring(), 8, 8, xl) == 8  # the ring splits the 1600 width, not the 25 heads
    assert auto_tensor_parallel_size(GridRing(), 8, 8, xl) == 1  # the grid splits heads: no q > 1 divides 25
    assert auto_tensor_parallel_size(Ring(), 8, 8) == 8
    assert auto_tensor_parallel_size(GridRing(), 9, 18, GPT2Config.from_name("gpt2-tiny")) == 9


def test_distinct_ranks_are_valid_ranks_of_the_replica():
    for layout, p in ((Grid2D(), 16), (GridRing(), 9), (Ring(), 4)):
        ranks = layout.distinct_ranks(p)
        assert ranks == sorted(set(ranks)) and all(0 <= r < p for r in ranks)
    assert Grid2D().distinct_ranks(16) == [0, 1, 12, 15]  # diagonal and not, first and last row


def test_layout_objects_with_equal_options_are_equal():
    from lightning_tp2d.metp import RingOptions

    assert Ring() == Ring() and Ring() != Grid2D()
    assert Ring(options=RingOptions(double_buffer=False)) != Ring()
    assert get_layout(Ring(), RingOptions(math_tile=64)).options == RingOptions(math_tile=64)
