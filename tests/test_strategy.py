"""TP2DStrategy: training through ``Trainer(strategy="tp2d")`` matches one device, and bad input fails early.

Multi-rank runs fork Lightning ranks on CPU with an external-launcher environment (tests/lightning_ranks.py).
Parity: the first 20 logged losses of a tensor-parallel run equal those of a single-device run from the same
seed and data within float32 noise (the SUMMA sums round differently, nothing else differs).
"""

from __future__ import annotations

import copy
import functools
import re

import lightning.pytorch as L
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, DistributedSampler

import lightning_tp2d as tp
from lightning_tp2d import fsdp
from lightning_tp2d.data import ByteTokenizer, TokenWindows, load_tokens
from lightning_tp2d.models import GPT2, GPT2Config
from lightning_tp2d.families import auto_tensor_parallel_size
from lightning_tp2d.strategy import TP2DStrategy
from lightning_tp2d.training import clip_grad_norm_, grad_norm
from lightning_tp2d.zero import sharding_of
from tests.distributed import run_distributed
from tests.lightning_ranks import run_ranks

STEPS = 20


class _MatmulDtypes(TorchDispatchMode):
    """Records the dtypes of the matrix products (mm, addmm, bmm) run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.dtypes.add(str(out.dtype))
        return out


class LossRecorder(L.Callback):
    """The logged ``train_loss`` (averaged over data-parallel replicas) after every step; the parameters' dtype
    and the dtypes of the matrix products in the first forward."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.dtypes: dict[str, object] = {}
        self._mode: _MatmulDtypes | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0:
            self.dtypes["parameters"] = str(next(pl_module.parameters()).dtype)
            self._mode = _MatmulDtypes()
            self._mode.__enter__()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self.dtypes["matmuls"], self._mode = sorted(self._mode.dtypes), None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(trainer.callback_metrics["train_loss"].item())
        if batch_idx == 0:
            fused = trainer.optimizers[0].defaults.get("fused")
            self.dtypes["optimizer"] = f"{type(trainer.optimizers[0]).__name__}(fused={bool(fused)})"


def _trainer(strategy, devices, recorder, **kw) -> L.Trainer:
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                     callbacks=[recorder], **kw)


def fit_gpt2(rank, world_size, strategy, batch_size, trainer_kw=(), module_kw=()):
    L.seed_everything(0)
    recorder = LossRecorder()
    trainer = _trainer(strategy, world_size, recorder, max_steps=STEPS, **dict(trainer_kw))
    module = tp.CausalLMModule("gpt2-tiny", learning_rate=3e-3, warmup_steps=5, **dict(module_kw))
    data = tp.TextDataModule(block_size=32, batch_size=batch_size, max_tokens=40_000)
    trainer.fit(module, data)
    if getattr(strategy, "zero_stage", 0) >= 2:  # FSDP: every model parameter is split over data_parallel
        assert fsdp.is_sharded(module.model) and all(fsdp.is_sharded(b) for b in module.model.transformer.h)
        assert not any(p.placements[0].is_replicate() for p in module.parameters()
                       if p.dim() > 1), "a matrix left whole over data_parallel"
    elif getattr(strategy, "zero_stage", 0):  # the state really is sharded: this replica holds ~1/dp of it
        sharding = sharding_of(trainer.optimizers[0])
        held = {id(p) for p in trainer.optimizers[0].state}
        assert sharding is not None and held == {id(s) for s in sharding.shards}  # a slice of every parameter
        dp = trainer.strategy.parallel_dims.data_parallel_size
        assert 0 < sum(s.numel() for s in sharding.shards) <= sum(p.to_local().numel() / dp + 1
                                                                  for p in sharding.params)
    return recorder.losses if not dict(trainer_kw).get("precision") else (recorder.losses, recorder.dtypes)


@functools.cache
def reference(batch_size: int, trainer_kw=(), module_kw=()) -> list[float]:
    """The same run on one device (forked, so this process stays free of Lightning state)."""
    return run_ranks(fit_gpt2, 1, "auto", batch_size, trainer_kw, module_kw)[0]


def _assert_parity(losses, ref, tol):
    assert len(losses) == len(ref) == STEPS
    worst = max(abs(a - b) for a, b in zip(losses, ref))
    assert worst <= tol, f"losses differ from the single-device run by up to {worst:.2e}"
    assert losses[-1] < losses[0] - 1.0  # it learns


# ---- construction: names, sizes, precision (no processes) ---------------------------------------------------


@pytest.mark.parametrize("name, layout", [("tp2d", "2d"), ("metp", "metp"), ("tp2d_metp", "2d-metp")])
def test_strategy_names_resolve_after_import(name, layout):
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=4, logger=False)
    assert isinstance(trainer.strategy, TP2DStrategy) and trainer.strategy.layout == layout
    assert trainer.strategy.parallel_dims.world_size == 4


@pytest.mark.parametrize("kwargs, devices, message", [
    (dict(tensor_parallel_size=3), 3, "not a perfect square"),
    (dict(tensor_parallel_size=4, data_parallel_size=2), 4,
     re.escape("data_parallel_size=2 x tensor_parallel_size=4 = 8 processes, but world size 4")),
    (dict(data_parallel_size=3), 4, "data_parallel_size=3 does not divide the world size 4"),
    (dict(tensor_parallel_size=4), 6, "tensor_parallel_size=4 needs a multiple of 4 processes, but world size 6"),
    (dict(layout="3d"), 4, "unknown layout '3d'"),
    (dict(tensor_parallel_size=0), 4, "positive int"),
    (dict(), 3, r"no grid larger than 1 fits devices=3 per machine \(layout '2d' needs a q x q grid\)\. Use "
                r"devices=4, 9, 16 .*allow_fallback=True"),
])
def test_sizes_that_do_not_fit_fail_when_the_trainer_is_built(kwargs, devices, message):
    with pytest.raises(ValueError, match=message):
        L.Trainer(strategy=TP2DStrategy(**kwargs), accelerator="cpu", devices=devices, logger=False)


@pytest.mark.parametrize("precision", ["16-true", "64-true"])  # (CPU turns 16-mixed into bf16-mixed)
def test_unsupported_precision_fails_when_the_trainer_is_built(precision):
    with pytest.raises(ValueError, match=r"supports precision \['32-true', 'bf16-mixed', 'bf16-true'\]"):
        L.Trainer(strategy="tp2d", accelerator="cpu", devices=4, precision=precision, logger=False)


def test_auto_tensor_size_is_the_largest_valid_within_a_node():
    tiny, xl = GPT2Config.from_name("gpt2-tiny"), GPT2Config.from_name("gpt2-xl")
    assert auto_tensor_parallel_size("2d", 8, 16, None) == 4  # largest square dividing 8
    assert auto_tensor_parallel_size("2d", 9, 9, tiny) == 9  # q=3 splits 6 heads
    assert auto_tensor_parallel_size("metp", 8, 8, None) == 8
    assert auto_tensor_parallel_size("2d", 8, 8, xl) == 1  # 25 heads: q=2 does not divide them
    assert auto_tensor_parallel_size("metp", 8, 8, xl) == 8  # the ring splits the 1600 width, not the 25 heads
    assert auto_tensor_parallel_size("metp", 5, 10, xl) == 5
    trainer = L.Trainer(strategy="tp2d", accelerator="cpu", devices=4, num_nodes=2, logger=False)
    dims = trainer.strategy.parallel_dims
    assert (dims.tensor_parallel_size, dims.data_parallel_size) == (4, 2)
    trainer = L.Trainer(strategy=TP2DStrategy(allow_fallback=True), accelerator="cpu", devices=3, logger=False)
    dims = trainer.strategy.parallel_dims  # asked for: whole-model replicas
    assert (dims.tensor_parallel_size, dims.data_parallel_size) == (1, 3)


class _NoGPT2(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_without_gpt2(rank, world_size):
    trainer = _trainer("tp2d", world_size, LossRecorder(), max_steps=1)
    with pytest.raises(TypeError, match="_NoGPT2 holds no lightning_tp2d.models.GPT2"):
        trainer.fit(_NoGPT2(), DataLoader(torch.randn(8, 4), batch_size=2))
    return True


def test_module_without_gpt2_fails_before_training():
    assert run_ranks(_fit_without_gpt2, 1) == [True]


def _fit_with_batch_3(rank, world_size):
    trainer = _trainer("tp2d", world_size, LossRecorder(), max_steps=1)
    with pytest.raises(ValueError, match="batch size 3 is not divisible by q=2"):
        trainer.fit(tp.CausalLMModule("gpt2-tiny"), tp.TextDataModule(batch_size=3, max_tokens=4000))
    return trainer.global_step


def test_batch_that_the_grid_rows_cannot_split_fails_before_training():
    assert run_ranks(_fit_with_batch_3, 4) == [0] * 4


# ---- parity with one device --------------------------------------------------------------------------------


def test_tp2d_trains_gpt2_module_like_one_device():
    losses = run_ranks(fit_gpt2, 4, "tp2d", 4)
    assert all(run == losses[0] for run in losses)  # every rank logs the same
    _assert_parity(losses[0], reference(4), tol=2e-5)


@pytest.mark.parametrize("name, devices", [("metp", 2), ("tp2d_metp", 4)])
def test_ring_layouts_train_gpt2_module_like_one_device(name, devices):
    losses = run_ranks(fit_gpt2, devices, name, 4)
    assert all(run == losses[0] for run in losses)
    _assert_parity(losses[0], reference(4), tol=2e-5)


class _Losses(L.Callback):
    """Only the logged losses (``LossRecorder``'s dispatch mode would keep Dynamo from tracing the first step)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(trainer.callback_metrics["train_loss"].item())


def _fit_compiled(rank, world_size, layout):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()  # a fork inherits what the test process compiled before
    L.seed_everything(0)
    recorder = _Losses()
    strategy = tp.TP2DStrategy(layout=layout, compile="aot_eager")
    trainer = _trainer(strategy, world_size, recorder, max_steps=STEPS)
    module = tp.CausalLMModule("gpt2-tiny", learning_rate=3e-3, warmup_steps=5)
    trainer.fit(module, tp.TextDataModule(block_size=32, batch_size=4, max_tokens=40_000))
    return recorder.losses, counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def test_compiled_model_trains_like_one_device():
    assert tp.TP2DStrategy(compile="aot_eager").compile_options == {"backend": "aot_eager", "dynamic": False}
    runs = run_ranks(_fit_compiled, 2, "metp")
    for losses, graphs, breaks in runs:
        assert graphs == 1 and breaks == 0, (graphs, breaks)  # one graph, compiled once, used every step
        assert losses == runs[0][0]
    _assert_parity(runs[0][0], reference(4), tol=2e-5)


def test_compile_argument_is_checked():
    assert tp.TP2DStrategy().compile_options is None
    assert tp.TP2DStrategy(compile=True).compile_options == {"dynamic": False}
    assert tp.TP2DStrategy(compile={"mode": "max-autotune", "dynamic": True}).compile_options == {
        "mode": "max-autotune", "dynamic": True}
    with pytest.raises(ValueError, match="compile must be a bool, a backend name or a dict"):
        tp.TP2DStrategy(compile=3)
    with pytest.raises(ValueError, match="not supported for layout '2d' yet"):
        tp.TP2DStrategy(compile=True, activation_checkpointing="full")
    with pytest.raises(ValueError, match="activation_checkpointing='selective' is not supported"):
        tp.TP2DStrategy(layout="metp", compile=True, activation_checkpointing="selective")


class UserModule(L.LightningModule):
    """What a user writes: a GPT2 and a training step, no parallel code at all (optionally a fused AdamW)."""

    def __init__(self, fused: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.gpt = GPT2(GPT2Config.from_name("gpt2-tiny"))
        self.fused = fused

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        loss = self.gpt(idx, targets)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, fused=self.fused or None)


def fit_user_module(rank, world_size, strategy, trainer_kw=(), fused=False):
    recorder = LossRecorder()
    trainer = _trainer(strategy, world_size, recorder, max_steps=STEPS, **dict(trainer_kw))
    windows = TokenWindows(load_tokens(None, ByteTokenizer(), 20_000), block_size=32)
    if strategy == "auto":  # the order Lightning's distributed sampler gives a training set: shuffled, seed 0
        loader = DataLoader(windows, batch_size=4, sampler=DistributedSampler(windows, 1, 0, shuffle=True, seed=0))
    else:  # Lightning replaces the sampler with one over the data-parallel replicas
        loader = DataLoader(windows, batch_size=4)
    trainer.fit(UserModule(fused), loader)
    return recorder.losses


def test_users_own_module_holding_a_gpt2_trains_like_one_device():
    losses = run_ranks(fit_user_module, 4, "tp2d")[0]
    _assert_parity(losses, run_ranks(fit_user_module, 1, "auto")[0], tol=2e-5)


def test_users_fused_adamw_clips_under_bf16_mixed():
    """A user's module stepping torch's fused AdamW, with bf16-mixed and gradient_clip_val under the strategy: it
    clips (by the global norm) and trains like one device stepping the foreach AdamW (Lightning alone refuses the
    fused one on one device: "does not allow for gradient clipping")."""
    kw = (("precision", "bf16-mixed"), ("gradient_clip_val", 0.05))
    losses = run_ranks(fit_user_module, 4, "tp2d", kw, True)[0]
    _assert_parity(losses, run_ranks(fit_user_module, 1, "auto", kw, False)[0], tol=5e-3)


def test_gradient_clipping_clips_the_global_norm_in_training():
    clip = (("gradient_clip_val", 0.05),)
    losses = run_ranks(fit_gpt2, 4, "tp2d", 4, clip)[0]
    _assert_parity(losses, reference(4, clip), tol=2e-5)
    unclipped = reference(4)
    assert max(abs(a - b) for a, b in zip(reference(4, clip), unclipped)) > 1e-2  # clipping was active


def _clip_parity(rank, world_size):
    torch.manual_seed(0)
    plain = GPT2(GPT2Config.from_name("gpt2-tiny"))
    par = copy.deepcopy(plain)
    mesh = tp.init_mesh("2d", 4, 1)
    tp.parallelize(par, mesh, "2d")
    g = torch.Generator().manual_seed(1)
    idx, targets = torch.randint(0, 257, (4, 16), generator=g), torch.randint(0, 257, (4, 16), generator=g)
    plain(idx, targets).backward()
    par(idx, targets).backward()
    norm = grad_norm(par.parameters(), mesh).item()
    inf_norm = grad_norm(par.parameters(), mesh, norm_type=float("inf")).item()
    ref_inf = max(p.grad.abs().max().item() for p in plain.parameters())
    ref = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1).item()
    clip_grad_norm_(par.parameters(), 0.1, mesh)
    worst = max((p.grad.full_tensor() - p0.grad).abs().max().item() for p, p0 in zip(par.parameters(), plain.parameters()))
    return norm, ref, inf_norm, ref_inf, worst


def test_grad_norm_counts_every_shard_once():
    for norm, ref, inf_norm, ref_inf, worst in run_distributed(_clip_parity, 4):
        assert norm == pytest.approx(ref, rel=1e-5) and inf_norm == pytest.approx(ref_inf, rel=1e-6)
        assert ref > 0.1 and worst < 1e-8  # it clipped, to the single-device gradients


@pytest.mark.parametrize("precision, parameters, tol", [("bf16-mixed", "torch.float32", 5e-3),
                                                         ("bf16-true", "torch.bfloat16", 0.06)])
def test_bf16_training_with_clipping_runs_in_bf16_and_matches_one_device(precision, parameters, tol):
    """The SUMMA products run in bfloat16 (parameters float32 under bf16-mixed, bfloat16 under bf16-true) and
    the losses follow a single-device bf16 run (bf16-true: the one-device loss itself is rounded to bf16, the
    vocab-parallel one is computed in float32, hence the looser bound), with the module's fused AdamW and gradient
    clipping: Lightning refused to clip for a fused optimizer under bf16-mixed (no scaler there), on one device too."""
    kw = (("precision", precision), ("gradient_clip_val", 0.05))
    losses, dtypes = run_ranks(fit_gpt2, 4, "tp2d", 4, kw)[0]
    ref_losses, ref_dtypes = reference(4, kw)
    assert dtypes == ref_dtypes == {"parameters": parameters, "matmuls": ["torch.bfloat16"],
                                    "optimizer": "AdamW(fused=True)"}
    _assert_parity(losses, ref_losses, tol=tol)
    unclipped = reference(4, kw[:1])[0]
    assert max(abs(a - b) for a, b in zip(ref_losses, unclipped)) > 1e-2  # clipping was active (as in float32)


@pytest.mark.slow
def test_dp2_by_2x2_on_8_processes_trains_like_one_device():
    """Data parallel 2 x a 2x2 grid, with gradient accumulation, clipping and the optimizer state sharded over the
    replicas (ZeRO-1): replicas take batches of 2 (the sampler interleaves them), one device takes both as one
    batch of 4; gradients average over replicas, each replica steps its share and broadcasts it."""
    _assert_dp2_parity(tp.TP2DStrategy("2d", tensor_parallel_size=4, zero_stage=1), 8)


def _assert_dp2_parity(strategy, world_size: int) -> None:
    """dp 2 replicas taking batches of 2 with accumulation and clipping: every rank logs the same losses, those of
    one device taking both replicas' batches as one batch of 4."""
    options = (("accumulate_grad_batches", 2), ("gradient_clip_val", 0.05))
    losses = run_ranks(fit_gpt2, world_size, strategy, 2, options, timeout=400)
    assert all(run == losses[0] for run in losses)
    ref = reference(4, options)
    assert len(losses[0]) == len(ref)
    worst = max(abs(a - b) for a, b in zip(losses[0], ref))
    assert worst <= 2e-5, f"losses differ from the single-device run by up to {worst:.2e}"


@pytest.mark.parametrize("stage, checkpointing", [(2, "none"), (3, "full")])
def test_zero_stage_2_and_3_on_dp2_by_ring_2_train_like_one_device(stage, checkpointing):
    """FSDP2 over data_parallel (dp 2 x a ring of 2, 4 processes), with gradient accumulation, clipping by the
    global norm (dp shards included) and, at stage 3, activation checkpointing: the losses of one device taking
    both replicas' batches as one; FSDP's reduce-scatter is the only data-parallel average (no GradientSync)."""
    _assert_dp2_parity(tp.TP2DStrategy("metp", tensor_parallel_size=2, zero_stage=stage,
                                       activation_checkpointing=checkpointing), 4)


def _lifecycle(rank, world_size, directory):
    L.seed_everything(0)
    module = tp.CausalLMModule("gpt2-tiny", learning_rate=3e-3, warmup_steps=2, predict_max_new_tokens=6)
    data = tp.TextDataModule(block_size=32, batch_size=4, max_tokens=20_000, prompts=["The ", "def f(x):"])

    def trainer(**kw):
        return L.Trainer(strategy="tp2d", accelerator="cpu", devices=world_size, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=4, limit_test_batches=2, **kw)

    best = L.callbacks.ModelCheckpoint(dirpath=directory, monitor="val_loss", save_last=True)
    first = trainer(max_steps=3, num_sanity_val_steps=0, val_check_interval=3, callbacks=[best])
    first.fit(module, data)
    validated = first.validate(module, data, verbose=False)[0]["val_loss"]
    tested = first.test(module, data, verbose=False)[0]["test_loss"]
    again = trainer(enable_checkpointing=False).validate(module, data, verbose=False)[0]["val_loss"]
    texts = [(ids.shape[1], data.decode(ids[0].tolist())) for ids in first.predict(module, data)]
    with torch.no_grad():  # spoil the weights: the checkpoints must bring the trained ones back
        for p in module.parameters():
            p.mul_(0.5)
    spoiled = first.validate(module, data, verbose=False)[0]["val_loss"]
    from_ckpt = [first.validate(module, data, ckpt_path=which, verbose=False)[0]["val_loss"] for which in ("best", "last")]
    return validated, tested, again, texts, spoiled, from_ckpt


def test_validate_test_and_predict_after_fit_and_on_a_second_trainer(tmp_path):
    """The same process keeps the module's shards and mesh: validate, test and predict (prompts continued) after
    fit, then another Trainer (each entry used to build a new mesh and refuse the already parallelized model);
    validate(ckpt_path="best" | "last") restores the checkpointed weights."""
    runs = run_ranks(_lifecycle, 4, str(tmp_path))
    assert all(run == runs[0] for run in runs)  # predictions too: every rank of the grid samples the same text
    validated, tested, again, texts, spoiled, from_ckpt = runs[0]
    assert [n for n, _ in texts] == [4 + 6, 9 + 6]  # each prompt's tokens and 6 new ones
    assert texts[0][1].startswith("The ") and texts[1][1].startswith("def f(x):")
    assert 0 < validated < 6 and 0 < tested < 6
    assert abs(spoiled - validated) > 0.01
    assert from_ckpt == pytest.approx([validated, validated], rel=1e-5)
    assert again == pytest.approx(validated, rel=1e-5)  # the same model and the same validation windows


MISMATCH = """
import sys
import lightning.pytorch as L
import lightning_tp2d as tp
model = tp.CausalLMModule("gpt2-tiny")
data = tp.TextDataModule(tokenizer="byte", block_size=int(sys.argv[1]), batch_size=int(sys.argv[2]), max_tokens=20_000)
trainer = L.Trainer(strategy="tp2d", accelerator="cpu", devices=4, max_steps=1, logger=False, enable_checkpointing=False)
trainer.fit(model, data)
"""


@pytest.mark.parametrize("block, batch, message", [
    (1024, 4, "data block_size 1024 exceeds the model's block_size 64: lower the data module's block_size"),
    (64, 5, "batch size 5 is not divisible by q=2 (layout '2d' splits each batch over the 2 grid rows)"),
])
def test_data_that_does_not_fit_the_model_fails_once_before_the_other_ranks_start(tmp_path, block, batch, message):
    """A script's ``trainer.fit(module, data)`` whose data does not fit: one error in the launching process, before
    Lightning starts the other 3 ranks (it used to start them all and fail in each, 4 tracebacks)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "fit.py"
    script.write_text(MISMATCH)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"):
        env.pop(key, None)
    run = subprocess.run([sys.executable, str(script), str(block), str(batch)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode == 1 and message in run.stderr, out[-3000:]
    assert out.count("Traceback") == 1 and "Initializing distributed" not in out
