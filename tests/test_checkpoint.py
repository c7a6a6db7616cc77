"""Checkpoints: resume after a kill continues the loss curve; a 2x2 checkpoint loads under other meshes, on one
device and into transformers; a crash during a save never damages the previous checkpoint; a checkpoint of
another model is refused with the keys that differ."""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as L
import numpy as np
import pytest
import torch

import lightning_tp2d as tp
from lightning_tp2d import checkpoint as ckpt
from lightning_tp2d.models import GPT2, GPT2Config
from lightning_tp2d.module import WarmupCosine
from tests.distributed import run_distributed
from tests.lightning_ranks import run_ranks


# 12 heads of width 4: split alike by a 2x2 grid (q=2), a ring of 4 and one device
CONFIG = GPT2Config.from_name("gpt2-tiny", n_head=12)


class StepLosses(L.Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses[trainer.global_step] = trainer.callback_metrics["train_loss"].item()


class SaveEvery(L.Callback):
    """``trainer.save_checkpoint(path)`` every ``every`` steps; at step ``crash_at`` every rank dies in the middle
    of the save, after writing its shards and before the checkpoint is complete."""

    def __init__(self, path: Path, every: int, crash_at: int | None = None) -> None:
        self.path, self.every, self.crash_at = path, every, crash_at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step % self.every:
            return
        if step == self.crash_at:
            real = ckpt._dcp_save

            def save_then_die(*args, **kwargs):
                real(*args, **kwargs)
                os._exit(3)

            ckpt._dcp_save = save_then_die
        trainer.save_checkpoint(self.path)


def _fit(world_size, callbacks, max_steps, ckpt_path=None, strategy=None):
    L.seed_everything(0)
    checkpointing = any(isinstance(c, L.callbacks.ModelCheckpoint) for c in callbacks)
    trainer = L.Trainer(strategy=strategy or "tp2d", accelerator="cpu", devices=world_size, max_steps=max_steps,
                        logger=False, enable_checkpointing=checkpointing, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=callbacks)
    module = tp.CausalLMModule(CONFIG, learning_rate=3e-3, warmup_steps=3, max_steps=12)
    # 19 training windows: 4 batches per epoch, so 12 steps cross epochs and a resume lands mid-epoch
    data = tp.TextDataModule(block_size=32, batch_size=4, max_tokens=800, val_fraction=0.2)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer


def fit_and_save(rank, world_size, path, max_steps, crash_at, ckpt_path):
    losses = StepLosses()
    _fit(world_size, [losses, SaveEvery(Path(path), every=4, crash_at=crash_at)], max_steps, ckpt_path)
    return losses.losses


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    """Losses of 12 steps on 2x2 without interruption (the schedule is the module's 12 steps whatever max_steps)."""
    return run_ranks(fit_and_save, 4, tmp_path_factory.mktemp("uninterrupted") / "a.ckpt", 12, None, None)[0]


def test_resume_after_a_kill_during_save_continues_the_loss_curve(tmp_path, uninterrupted):
    path = tmp_path / "run.ckpt"
    # killed at step 8 in the middle of overwriting the step-4 checkpoint
    assert run_ranks(fit_and_save, 4, path, 12, 8, None, allow_exit=True) == [None] * 4
    assert ckpt.is_sharded(path) and ckpt.staging_path(path).exists()  # the old one, and the half-written one
    resumed = run_ranks(fit_and_save, 4, path, 12, None, str(path))[0]
    assert sorted(resumed) == list(range(5, 13))  # resumed after step 4: model, optimizer, schedule, data
    worst = max(abs(resumed[s] - uninterrupted[s]) for s in resumed)
    assert worst <= 1e-6, f"resumed losses differ from the uninterrupted run by {worst:.2e}"
    assert not ckpt.staging_path(path).exists()  # the next save cleared the debris


# ---- one 2x2 run, loaded everywhere else --------------------------------------------------------------------


class SaveBoth(L.Callback):
    """At step 3: a sharded and a full checkpoint, and the full weights as numpy (rank 0)."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.weights = directory, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != 3:
            return
        strategy = trainer.strategy
        trainer.save_checkpoint(self.directory / "sharded.ckpt")
        strategy._sharded_checkpoints = False
        trainer.save_checkpoint(self.directory / "full.ckpt")
        strategy._sharded_checkpoints = True
        self.weights = {k: v.numpy() for k, v in tp.full_state_dict(pl_module.model).items()}


def train_2x2_and_save(rank, world_size, directory):
    losses, saver = StepLosses(), SaveBoth(Path(directory))
    _fit(world_size, [losses, saver], max_steps=6)
    return losses.losses, saver.weights


@pytest.fixture(scope="module")
def saved_2x2(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpt_2x2")
    losses, weights = run_ranks(train_2x2_and_save, 4, directory)[0]
    return directory, losses, weights


def test_checkpoints_load_on_one_device_with_identical_weights(saved_2x2):
    directory, _, weights = saved_2x2
    for name in ("sharded.ckpt", "full.ckpt"):
        model = tp.load_gpt2(directory / name)  # the config is recorded in the checkpoint
        assert isinstance(model, GPT2) and model.lm_head.weight is model.transformer.wte.weight
        state = model.state_dict()
        assert list(state) == list(weights)
        assert all(np.array_equal(state[k].numpy(), weights[k]) for k in weights), name


def resume_on_one_device(rank, world_size, path):
    losses = StepLosses()
    _fit(1, [losses], max_steps=6, ckpt_path=path, strategy="auto")
    return losses.losses


def test_full_checkpoint_resumes_on_one_device_like_the_2x2_run(saved_2x2):
    directory, losses_2x2, _ = saved_2x2
    resumed = run_ranks(resume_on_one_device, 1, str(directory / "full.ckpt"))[0]
    assert sorted(resumed) == [4, 5, 6]
    assert max(abs(resumed[s] - losses_2x2[s]) for s in resumed) <= 2e-5


def load_on_mesh(rank, world_size, directory, layout, p, dp):
    torch.manual_seed(1)  # other weights than the saved ones
    module = torch.nn.Module()
    module.model = GPT2(CONFIG)
    try:
        tp.parallelize(module.model, tp.init_mesh(layout, p, dp), layout)
    except NotImplementedError as err:
        return str(err)
    out = {}
    for name in ("sharded.ckpt", "full.ckpt"):
        optimizer = torch.optim.AdamW([{"params": [q for q in module.parameters() if q.dim() >= 2]},
                                       {"params": [q for q in module.parameters() if q.dim() < 2]}])
        meta = ckpt.load_into(module, [optimizer], Path(directory) / name)
        exp_avg = optimizer.state[module.model.transformer.h[0].attn.c_attn.weight]["exp_avg"]
        out[name] = ({k: v.numpy() for k, v in tp.full_state_dict(module.model).items()}, meta["global_step"],
                     ckpt._full(exp_avg).numpy(), optimizer.param_groups[0]["lr"])
    return out


@pytest.mark.parametrize("layout, p, dp", [("2d", 1, 2), ("metp", 4, 1)])
def test_2x2_checkpoint_loads_under_another_mesh(saved_2x2, layout, p, dp):
    directory, _, weights = saved_2x2
    results = run_distributed(load_on_mesh, p * dp, str(directory), layout, p, dp)
    if isinstance(results[0], str):
        pytest.skip(f"layout {layout!r}: {results[0]}")
    sharded, full = results[0]["sharded.ckpt"], results[0]["full.ckpt"]
    for state, step, _, _ in (sharded, full):
        assert step == 3 and all(np.array_equal(state[k], weights[k]) for k in weights)
    assert np.array_equal(sharded[2], full[2]) and np.abs(sharded[2]).max() > 0  # optimizer state too
    assert sharded[3] == full[3] == pytest.approx(3e-3 * WarmupCosine(3, 12, 0.1)(3))  # the schedule's lr at step 3


def test_export_to_transformers_gives_the_same_logits(saved_2x2, tmp_path):
    transformers = pytest.importorskip("transformers")
    directory, _, weights = saved_2x2
    out = tp.export_hf(directory / "sharded.ckpt", tmp_path / "hf")
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    plain = tp.load_gpt2(directory / "full.ckpt").eval()
    idx = torch.randint(0, 257, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(hf(idx).logits, plain(idx), atol=1e-5)
    assert np.array_equal(hf.transformer.h[1].mlp.c_fc.weight.detach().numpy(),
                          weights["transformer.h.1.mlp.c_fc.weight"].T)  # Conv1D: [in, out]


# ---- crash safety and refusal, one process ------------------------------------------------------------------


def _module(seed: int, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    module = torch.nn.Module()
    module.model = GPT2(GPT2Config.from_name("gpt2-tiny", **overrides))
    return module


def _save_sharded(module, path: Path) -> None:
    staging = ckpt.staging_path(path)
    ckpt.clear(staging)
    staging.mkdir(parents=True)
    ckpt.write_sharded({"state_dict": module.state_dict(keep_vars=True), "global_step": 1}, staging, rank=0)
    ckpt.commit(staging, path)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_crash_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    old, new = _module(0), _module(1)
    _save_sharded(old, path)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "_dcp_save", crash)
    with pytest.raises(OSError, match="disk full"):
        _save_sharded(new, path)
    assert torch.equal(ckpt.read_state_dict(path)["model.transformer.wte.weight"], old.model.transformer.wte.weight)
    monkeypatch.undo()

    # dying between the two renames of a replacement: the previous checkpoint is found under its old name
    real_replace, calls = os.replace, []

    def replace_then_die(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_then_die)
    with pytest.raises(KeyboardInterrupt):
        _save_sharded(new, path)
    monkeypatch.undo()
    assert not path.exists()
    with pytest.warns(UserWarning, match="save was interrupted"):
        state = ckpt.read_state_dict(path)
    assert torch.equal(state["model.transformer.wte.weight"], old.model.transformer.wte.weight)

    _save_sharded(new, path)  # and the next save succeeds and leaves nothing behind
    assert torch.equal(ckpt.read_state_dict(path)["model.lm_head.weight"], new.model.transformer.wte.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_checkpoint_of_another_model_is_refused_naming_the_keys(tmp_path, fmt):
    path = tmp_path / "tiny.ckpt"
    if fmt == "sharded":
        _save_sharded(_module(0), path)
    else:
        ckpt.write_full({"state_dict": _module(0).state_dict()}, path)
    with pytest.raises(ValueError, match=r"missing in checkpoint: \['model\.transformer\.h\.2\.ln_1\.weight'"):
        ckpt.load_into(_module(0, n_layer=3), [], path)
    with pytest.raises(ValueError, match=r"model\.transformer\.wte\.weight: checkpoint \(257, 48\), model \(300, 48\)"):
        ckpt.load_into(_module(0, vocab_size=300), [], path)
    fresh = _module(5)
    ckpt.load_into(fresh, [], path)  # the same model loads
    assert torch.equal(fresh.model.lm_head.weight, _module(0).model.transformer.wte.weight)


def fit_with_step_checkpoint(rank, world_size, directory, max_steps, ckpt_path):
    from lightning_tp2d.callbacks import StepCheckpoint

    losses = StepLosses()
    saver = StepCheckpoint(dirpath=directory, every_n_train_steps=1000, save_top_k=1, save_last=True)
    _fit(world_size, [losses, saver], max_steps, ckpt_path)
    return losses.losses, saver.newest()


def test_the_final_checkpoint_resumes_exactly(tmp_path, uninterrupted):
    """``max_steps`` reached mid-epoch: the final checkpoint keeps the data position, so training on from it
    repeats the uninterrupted run's losses (it used to be written after the epoch was closed)."""
    first, final = run_ranks(fit_with_step_checkpoint, 4, str(tmp_path / "ckpts"), 6, None)[0]
    assert sorted(first) == list(range(1, 7)) and final
    resumed, _ = run_ranks(fit_with_step_checkpoint, 4, str(tmp_path / "more"), 10, final)[0]
    assert sorted(resumed) == list(range(7, 11))  # 6 steps done; 4 batches per epoch: mid-epoch
    worst = max(abs(resumed[s] - uninterrupted[s]) for s in resumed)
    assert worst <= 1e-6, f"resumed losses differ from the uninterrupted run by {worst:.2e}"
