"""No training step waits on the device: zero ``.item()`` / ``nonzero`` / boolean-mask ops in a warmed-up step.

Counted with :class:`lightning_tp2d.bench.measure.HostSyncCounter` around forward, backward and the fused AdamW step
of every layout (4 ranks), as ``CausalLMModule`` runs them: token ids checked on the host batch beforehand; and
around whole Trainer steps with ``tp2d-train``'s stop vote and divergence guard installed (one async all-reduce a
step between them, read a step late).
"""

from __future__ import annotations

import importlib.util
import signal
import traceback
from pathlib import Path

import pytest
import torch

import lightning_tp2d as tp
from lightning_tp2d.bench.measure import HostSyncCounter
from lightning_tp2d.models import GPT2, GPT2Config
from lightning_tp2d.module import CausalLMModule
from tests.distributed import run_distributed
from tests.lightning_ranks import run_ranks


def _count(rank: int, world_size: int, layout: str, float8: str | None = None) -> dict:
    cfg = GPT2Config.from_name("gpt2-tiny", n_head=4, dropout=0.0)
    torch.manual_seed(0)
    model = tp.parallelize(GPT2(cfg), tp.init_mesh(layout, world_size, 1), layout, options=tp.TPOptions(float8=float8))
    model.validate_inputs = False  # the module checked the ids on the host batch
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    idx = torch.randint(0, cfg.vocab_size, (2, 16))

    def step():
        model(idx, idx).backward()
        opt.step()
        opt.zero_grad()

    step()  # warm-up: optimizer state, lazily built communicators
    with HostSyncCounter() as syncs:
        step()
    return syncs.counts


@pytest.mark.parametrize("layout", ["2d", "metp", "2d-metp"])
def test_a_training_step_never_reads_the_device(layout):
    for rank, counts in enumerate(run_distributed(_count, 4, layout)):
        assert counts == {}, (rank, counts)


@pytest.mark.parametrize("layout, recipe", [("2d", "tensorwise"), ("2d", "rowwise"), ("metp", "tensorwise"),
                                            ("2d-metp", "rowwise")])
def test_a_float8_step_never_reads_the_device(layout, recipe):
    """The global amaxes are all-reduced and turned into scales on the device."""
    if importlib.util.find_spec("torchao") is None:
        pytest.skip("float8 needs torchao")
    for rank, counts in enumerate(run_distributed(_count, 4, layout, recipe)):
        assert counts == {}, (rank, counts)


def test_the_counter_sees_item_nonzero_and_boolean_masks():
    x = torch.arange(6.0)
    with HostSyncCounter() as syncs:
        x.sum().item()
        x.nonzero()
        x[x > 2]
        x.masked_select(x > 1)
    assert syncs.counts == {"_local_scalar_dense": 1, "nonzero": 1, "index[bool]": 1, "masked_select": 1}


def test_the_module_checks_ids_on_the_host_batch_and_its_step_does_not():
    module = CausalLMModule("gpt2-tiny")
    module.configure_model()
    assert module.model.validate_inputs is False
    V = module.config.vocab_size
    good = torch.zeros(2, 8, dtype=torch.long)
    assert module.on_before_batch_transfer((good, good), 0)[0] is good
    with pytest.raises(ValueError, match=f"token ids must be in \\[0, {V}\\)"):
        module.on_before_batch_transfer((good + V, good), 0)
    with pytest.raises(ValueError, match="target ids must be in"):
        module.on_before_batch_transfer((good, good - 5), 0)
    with pytest.raises(ValueError, match="token ids must be in"):
        module.generate(good + V, 1)



def test_the_module_uses_the_fused_adamw_where_the_device_has_it():
    module = CausalLMModule("gpt2-tiny", max_steps=10)
    module.configure_model()
    optimizer = module.configure_optimizers()["optimizer"]
    assert optimizer.defaults["fused"] is True  # CPU has the fused kernel in torch 2.13


# ---- whole Trainer steps: the stop vote and the divergence flag ----------------------------------------------------

CALLBACKS = str(Path(tp.__file__).parent / "callbacks.py")
# the host syncs of a tp2d Trainer step that are not the callbacks' (named by a function on their stack)
OTHERS = {"on_before_batch_transfer": "the module's token-id check, on the host batch before it is moved",
          "convert_tensors_to_scalars": "Lightning's float() of the progress-bar value (train_loss, prog_bar=True)"}


def _stack() -> tuple[set[str], set[str]]:
    frames = [f for f, _ in traceback.walk_stack(None)]
    return {f.f_code.co_filename for f in frames}, {f.f_code.co_name for f in frames}


class _SyncSites(HostSyncCounter):
    """:class:`HostSyncCounter` that also names where each sync came from: ``callbacks.py``, one of ``OTHERS``,
    Lightning's per-batch SIGTERM broadcast, or the innermost function."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.total
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.total > before:
            files, names = _stack()
            site = "callbacks.py" if CALLBACKS in files else next((n for n in OTHERS if n in names), None)
            self.sites.append(site or ("sigterm broadcast" if "_broadcast_sigterm_tensor" in names else
                                       traceback.extract_stack()[-3].name))
        return out


class _Probe:
    """Counts, from the start of step 3 to the start of step 5 (two whole steps, every callback hook included),
    host syncs and the all-reduces made from ``callbacks.py`` (directly or through the strategy), with the step each
    was launched at and the step its wait came at; raises SIGUSR1 on rank 0 when step ``signal_step`` starts."""

    def __init__(self, trainer, signal_step: int | None) -> None:
        import lightning.pytorch as L

        probe, self.signal_step = self, signal_step
        self.syncs: _SyncSites | None = None
        self.all_reduces: list[dict] = []
        self.counting = False
        plain = torch.distributed.all_reduce

        def all_reduce(tensor, *args, async_op=False, **kwargs):
            work = plain(tensor, *args, async_op=async_op, **kwargs)
            if not probe.counting or CALLBACKS not in _stack()[0]:
                return work
            call = {"async": async_op, "launched": trainer.global_step, "waited": None}
            probe.all_reduces.append(call)
            return _Waited(work, call, trainer) if async_op else work

        torch.distributed.all_reduce = all_reduce  # this forked rank only

        class Hooks(L.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                probe.on_step_start(trainer)

        self.callback = Hooks()

    def on_step_start(self, trainer) -> None:
        step = trainer.global_step + 1  # the step starting
        if step == 3:
            self.counting, self.syncs = True, _SyncSites()
            self.syncs.__enter__()
        elif step == 5:
            self.counting = False
            self.syncs.__exit__(None, None, None)
        if step == self.signal_step and trainer.global_rank == 0:
            signal.raise_signal(signal.SIGUSR1)  # recorded by GracefulInterrupt's handler, voted at this step's end


class _Waited:
    def __init__(self, work, call: dict, trainer) -> None:
        self.work, self.call, self.trainer = work, call, trainer

    def wait(self):
        self.call["waited"] = self.trainer.global_step
        return self.work.wait()


def _fit_with_vote(rank: int, world_size: int, nan_step: int | None, as_tp2d_train: bool = False) -> dict:
    import lightning.pytorch as L

    from lightning_tp2d.callbacks import DivergenceGuard, GracefulInterrupt, ResumableProgressBar
    from lightning_tp2d.errors import DivergenceError

    class Spiky(tp.CausalLMModule):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            bad = self.global_step + 1 == nan_step and self.trainer.global_rank == world_size - 1
            return loss * float("nan") if bad else loss  # one rank's loss of step nan_step

    L.seed_everything(0)
    interrupt, guard = GracefulInterrupt(), DivergenceGuard()
    bar = [ResumableProgressBar()] if as_tp2d_train else []  # tp2d-train's bar, the loss read on logging steps
    trainer = L.Trainer(strategy="tp2d", accelerator="cpu", devices=world_size, max_steps=20, logger=False,
                        enable_checkpointing=False, enable_progress_bar=as_tp2d_train, enable_model_summary=False,
                        limit_val_batches=0, log_every_n_steps=5, callbacks=[interrupt, guard, *bar])
    probe = _Probe(trainer, signal_step=None if nan_step else 6)
    trainer.callbacks.append(probe.callback)
    module = Spiky("gpt2-tiny", learning_rate=1e-3, warmup_steps=0, loss_on_progress_bar=not as_tp2d_train)
    try:
        trainer.fit(module, tp.TextDataModule(block_size=32, batch_size=4, max_tokens=20_000))
        error = None
    except DivergenceError as err:
        error = str(err)
    return {"sites": probe.syncs.sites, "all_reduces": probe.all_reduces, "stopped_at": trainer.global_step,
            "signum": interrupt.signum, "error": error, "bar_loss": bar[0]._loss if bar else None,
            "bar_loss_step": bar[0]._loss_step if bar else None}


def test_trainer_steps_with_the_stop_vote_and_divergence_guard_never_read_the_device_for_them_and_vote_once():
    """Two steady-state steps (3 and 4) of a 4-rank ``tp2d`` Trainer with GracefulInterrupt and DivergenceGuard:
    no host sync from either callback, nor from Lightning's per-batch SIGTERM broadcast (which GracefulInterrupt
    makes moot); the only ones left are the two of ``OTHERS``, once a step each. From the two callbacks together:
    one async all-reduce per step, waited on at the next step. A SIGUSR1 on rank 0 as step 6 starts is voted at
    step 6's end and read by every rank at step 7's end: all ranks stop after step 7 (one step later than a
    blocking read, never a different step on different ranks)."""
    for rank, r in enumerate(run_ranks(_fit_with_vote, 4, None)):
        assert sorted(set(r["sites"])) == sorted(OTHERS), (rank, r["sites"])
        assert r["sites"].count("convert_tensors_to_scalars") == 2, (rank, r["sites"])  # once a step
        assert r["all_reduces"] == [{"async": True, "launched": 3, "waited": 4},
                                    {"async": True, "launched": 4, "waited": 5}], (rank, r["all_reduces"])
        assert r["stopped_at"] == 7 and r["signum"] == signal.SIGUSR1 and r["error"] is None, (rank, r)


def test_as_tp2d_train_builds_it_a_steady_state_step_reads_nothing_from_the_device():
    """``tp2d-train``'s module (``loss_on_progress_bar=False``) and bar (``ResumableProgressBar``, shown on rank 0):
    the two steady-state steps make no host sync but the module's token-id check on the host batch; the bar still
    shows ``train_loss``, read on the logging steps, and the run stops after the step the vote says."""
    for rank, r in enumerate(run_ranks(_fit_with_vote, 4, None, True)):
        assert set(r["sites"]) == {"on_before_batch_transfer"}, (rank, r["sites"])  # the host batch's check only
        assert r["stopped_at"] == 7 and r["signum"] == signal.SIGUSR1, (rank, r)
        if rank == 0:  # the bar shows train_loss, last read at the stopping step (a step Lightning logs)
            assert r["bar_loss"] is not None and r["bar_loss_step"] == 7, r


def test_a_non_finite_loss_on_one_rank_stops_every_rank_a_step_later_naming_the_step():
    for rank, r in enumerate(run_ranks(_fit_with_vote, 4, 5)):
        assert r["error"] is not None and "non-finite (NaN or inf) at step 5;" in r["error"], (rank, r)
        assert r["stopped_at"] == 6 and r["signum"] == 0, (rank, r)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_the_step_vote_is_read_a_step_late_and_on_cuda_never_synchronizes_the_stream(device):
    """Each step's signal or non-finite loss is read at the end of the next step. On CUDA the vote is a fill, a stack
    and a non-blocking copy into pinned memory behind an event: the five steps run under
    ``set_sync_debug_mode("error")``, which raises on any op that waits for the stream."""
    from lightning_tp2d.callbacks import StepVote

    vote = StepVote()
    vote.want_every(1)
    vote.start(0, torch.device(device))
    x = torch.randn(256, 256, device=device)
    seen = []
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(1, 6):
            vote.fold((x @ x).mean() * (float("nan") if step == 3 else 1.0))
            if step == 2:
                vote.signal = int(signal.SIGUSR1)  # what GracefulInterrupt's handler writes
            vote.end_step(step)
            seen.append((vote.stop_signal, vote.diverged))
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    usr1 = int(signal.SIGUSR1)
    assert seen == [(0, None), (0, None), (usr1, None), (usr1, (3, 3)), (usr1, (3, 3))]
