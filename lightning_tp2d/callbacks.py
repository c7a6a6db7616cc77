"""Callbacks of ``tp2d-train``: checkpoints by step that include the final step, Ctrl-C that stops every rank at
the same step, and speed / memory logging."""

from __future__ import annotations

import logging
import signal
import time

import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar, TQDMProgressBar

from lightning_tp2d.comm import naming_failures
from lightning_tp2d.errors import DivergenceError
from lightning_tp2d.values import check_number
from lightning_tp2d.zero import full_param_groups

log = logging.getLogger(__name__)


class StepCheckpoint(ModelCheckpoint):
    """:class:`~lightning.pytorch.callbacks.ModelCheckpoint` that also saves the final step when training stops
    between two periodic saves (``every_n_train_steps`` that does not divide ``max_steps``). The ``max_steps`` step
    is saved from the batch-end hook like a periodic one (Lightning's own end-of-training save comes after it has
    closed the epoch, so resuming from it would skip the rest of the epoch's data).

    Saving is collective (every rank writes its shards), so it runs on all ranks; an interrupted save leaves the
    previous checkpoint in place (:mod:`lightning_tp2d.checkpoint` writes to a staging path, then renames)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        # the last step, or a step that stops training (a signal: GracefulInterrupt, which runs before checkpoint
        # callbacks, as does DivergenceGuard, so a non-finite loss is seen before the save): saved here, at the step
        # boundary with the data position, not after the loop has closed the epoch (resume would skip data)
        if trainer.should_stop or 0 < trainer.max_steps <= trainer.global_step:
            self.save_now(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self.save_now(trainer)  # training that ended otherwise (max_epochs, early stopping); no-op if saved
        super().on_train_end(trainer, pl_module)

    def save_now(self, trainer) -> None:
        """Save this step (top-k and ``last``) unless it is saved already. Called from a batch-end hook the
        checkpoint is the same as a periodic one, data position included (exact resume)."""
        # Lightning's private helpers (stable since 2.0) decide "already saved at this step" and do the saving.
        if not self._should_skip_saving_checkpoint(trainer):
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)

    def newest(self) -> str:
        """Path of the newest complete checkpoint ('' if none): ``last.ckpt`` when it exists, else the newest one."""
        return self.last_model_path or self.best_model_path


VOTE = "the per-step stop vote (all_reduce over every rank)"
PREEMPTION_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1", "SIGUSR2") if hasattr(signal, name))


class StepVote:
    """What every rank must agree on after each optimizer step, ``[signal number, non-finite loss]``, in one small
    all-reduce (MAX) per step that nothing waits for: :class:`GracefulInterrupt` and :class:`DivergenceGuard` share
    it (both find it through ``trainer.callbacks``: the vote of the first of them listed), and either alone works.

    The vote of step N is launched at the end of step N (``all_reduce(async_op=True)``) and read at the end of the
    next step that votes, N+1: every rank reads the same reduced value at the same step, so a signal stops every rank
    after step N+1, one step later than a blocking read would, and a steady-state step never waits on the device.
    On CUDA the reduced pair is copied to pinned host memory (``non_blocking``) behind a CUDA event, and the read
    waits on that event, by then a step old (under NCCL, ``work.wait()`` at launch makes the stream, not the host,
    wait; gloo is for CPU runs, where the read waits on the work handle instead). One process: no collective, the
    same lag. :meth:`flush` launches what is not sent yet and reads it at once, a host sync: saves and the end of
    training call it, never a steady-state step. Launching depends only on the step count, so every rank launches
    the same votes. Nothing here is Lightning's: the callbacks pass the step count and the device.

    Fields: ``signal`` (this rank's signal, 0: none; written by the signal handler), ``stop_signal`` (the largest
    signal any rank voted, once read; 0: none), ``diverged`` (``(first, last)``: the window of steps whose vote
    said some rank's loss was not finite; ``None``: none yet), ``every`` (votes every that many steps: 1 with
    :class:`GracefulInterrupt`)."""

    def __init__(self) -> None:
        self.signal = 0
        self.stop_signal = 0
        self.diverged: tuple[int, int] | None = None
        self.every = 0  # 0: no voter registered yet
        self._step_bad: torch.Tensor | None = None  # this optimizer step's losses (cleared by drop_step)
        self._bad: torch.Tensor | None = None  # the unsent window's losses
        self._sent = 0  # the global_step of the last vote launched (or of the start)
        self._seen = 0  # the global_step at the last step end handled
        self._pending: tuple | None = None  # (host or reduced values, event or work or None, (first, last))
        self._host: torch.Tensor | None = None  # pinned host buffer of the CUDA read
        self._device = torch.device("cpu")

    def want_every(self, n: int) -> None:
        self.every = min(self.every, n) if self.every else n

    def start(self, step: int, device: torch.device) -> None:
        """A new run on ``device`` from optimizer step ``step``: nothing in flight, folded or agreed (``signal``,
        this rank's, stays); the first window starts after ``step``."""
        self._step_bad = self._bad = self._pending = self.diverged = None
        self._sent = self._seen = step
        self.stop_signal, self._device = 0, torch.device(device)

    def fold(self, loss: torch.Tensor) -> None:
        """Add a micro-batch's loss to this step's non-finite flag, on the device (no host sync)."""
        loss = loss.to_local() if hasattr(loss, "to_local") else loss  # a DTensor loss: this rank's part
        bad = ~torch.isfinite(loss.detach()).all()
        self._step_bad = bad if self._step_bad is None else self._step_bad | bad

    def drop_step(self) -> None:
        """This step's losses are not held against the run (its optimizer step is skipped)."""
        self._step_bad = None

    def end_step(self, step: int) -> None:
        """At a training batch end, ``step`` optimizer steps done: once per optimizer step (the first caller; later
        ones and the micro-batches of gradient accumulation find nothing to do), move this step's flag into the
        window and, when a vote is due, read the previous vote (``stop_signal``, ``diverged``) and launch this one."""
        if step == self._seen:
            return
        self._seen = step
        self._close_step()
        if step - self._sent >= max(1, self.every):
            self._read()
            self._launch(step)

    def flush(self, step: int) -> None:
        """Launch what is not voted yet and read it now (a host sync, and a collective every rank must make at the
        same point: saves and the end of training)."""
        self._close_step()
        if self._bad is not None or step > self._sent:
            self._read()
            self._launch(step)
        self._read()

    def drain(self) -> None:
        """Complete the vote in flight (the end of training: the collective must not outlive the loop)."""
        self._read()

    def _close_step(self) -> None:
        if self._step_bad is not None:
            self._bad = self._step_bad if self._bad is None else self._bad | self._step_bad
            self._step_bad = None

    def _launch(self, step: int) -> None:
        device = self._device
        bad = torch.zeros((), device=device) if self._bad is None else self._bad.to(torch.float32)
        values = torch.stack((torch.full((), float(self.signal), device=device), bad))  # a fill, no host copy
        window, self._sent, self._bad = (self._sent + 1, step), step, None
        done = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:  # every rank votes
            with naming_failures(VOTE):
                done = dist.all_reduce(values, op=dist.ReduceOp.MAX, async_op=True)
        if values.is_cuda:
            if done is not None:
                done.wait()  # NCCL: the current stream waits for the all-reduce; the host goes on
            if self._host is None:
                self._host = torch.empty(2, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            values = self._host
        self._pending = (values, done, window)

    def _read(self) -> None:
        if self._pending is None:
            return
        values, done, window = self._pending
        self._pending = None
        if isinstance(done, torch.cuda.Event):
            done.synchronize()  # recorded a step ago: complete unless the host is over a step ahead of the device
        elif done is not None:
            with naming_failures(VOTE):  # a rank that died or stalled since: one line, as in the layers
                done.wait()
        signal_seen, bad = values.tolist()  # host memory
        self.stop_signal = max(self.stop_signal, int(signal_seen))
        if bad and self.diverged is None:
            self.diverged = window

    def shared(self, trainer) -> StepVote:
        """The vote every voter of ``trainer`` shares: that of the first :class:`GracefulInterrupt` or
        :class:`DivergenceGuard` in ``trainer.callbacks`` (this one when none is listed)."""
        return next((c.vote for c in trainer.callbacks if isinstance(c, (GracefulInterrupt, DivergenceGuard))), self)


class GracefulInterrupt(Callback):
    """Ctrl-C and preemption (SIGTERM; SIGUSR1/2, which SLURM sends with ``--signal``) stop training at a step
    boundary on every rank together, instead of interrupting ranks in the middle of a collective (where the others
    would wait for them until the process-group timeout).

    A signal handler only records the signal (it writes nothing: the terminal's Ctrl-C may have closed the pipe
    the output goes to): rank 0 takes SIGINT (the other ranks of the machine ignore it, a terminal sends it to the
    whole process group), every rank takes the preemption signals. The signal rides the per-step :class:`StepVote`
    (shared with :class:`DivergenceGuard`: one small all-reduce per step, read a step late, so no step waits on the
    device): a signal that arrives during step N is voted at the end of step N and read by every rank at the end of
    step N+1, after which every rank stops; rank 0 logs it, Lightning ends the loop and the checkpoint callback saves
    step N+1. ``signum`` holds that signal afterwards (``tp2d-train`` exits with ``128 + signum``, 130 for Ctrl-C and
    143 for SIGTERM, as a process killed by it would, so shells and requeue scripts recognise it). A second signal
    aborts at once (an unfinished save never replaces the previous checkpoint). The preemption handlers replace
    Lightning's, which broadcasts from inside the handler and deadlocks when the other ranks sit in a tensor-parallel
    collective; they are installed when training starts, after Lightning's.
    """

    def __init__(self) -> None:
        self.vote = StepVote()  # replaced in setup by the vote shared with the trainer's other voters
        self.stopped = False  # every rank: training stopped because of a signal
        self.signum = 0  # every rank, once stopped: the signal that stopped training
        self._previous: dict = {}

    @property
    def requested(self) -> int:
        """The signal seen by this rank (0: none)."""
        return self.vote.signal

    def setup(self, trainer, pl_module, stage: str) -> None:
        shared = self.vote.shared(trainer)
        shared.signal, self.vote = max(shared.signal, self.vote.signal), shared
        self.vote.want_every(1)
        handler = self._on_signal if trainer.global_rank == 0 else signal.SIG_IGN
        self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, handler)

    def on_train_start(self, trainer, pl_module) -> None:
        self.vote.start(trainer.global_step, trainer.strategy.root_device)
        for signum in PREEMPTION_SIGNALS:
            self._previous.setdefault(signum, signal.signal(signum, self._on_signal))
        if trainer.received_sigterm:  # Lightning's handler took one before ours replaced it: vote it
            self.vote.signal = self.vote.signal or signal.SIGTERM
        # Lightning 2.6 broadcasts that handler's flag from rank 0 before every batch and reads it with .item() (a
        # host sync and a collective per step); with its handler replaced on every rank the flag stays False
        loop = trainer.fit_loop.epoch_loop
        if hasattr(loop, "_broadcast_sigterm_tensor"):
            loop._broadcast_sigterm_tensor = _nothing_to_broadcast

    def _on_signal(self, signum, frame) -> None:
        # only records: no output here (a print from a handler can hit a closed pipe, `| tee` ended by the same
        # Ctrl-C, or re-enter a write the signal interrupted); the step boundary reports it
        if self.vote.signal:  # the second signal: stop waiting for the step to end
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)
        self.vote.signal = signum

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.vote.end_step(trainer.global_step)
        signum = self.vote.stop_signal
        if signum and not self.stopped:
            self.signum, self.stopped = signum, True
            trainer.should_stop = True  # StepCheckpoint saves this step at its boundary
            if trainer.is_global_zero:
                what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
                log.warning("%s: stopping after step %d and saving it (the same signal again aborts at once)", what,
                            trainer.global_step)

    def on_train_end(self, trainer, pl_module) -> None:
        self.vote.drain()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        for signum, handler in self._previous.items():
            if handler is not None:
                signal.signal(signum, handler)
        self._previous = {}


def _nothing_to_broadcast() -> None:
    """Lightning's per-batch SIGTERM broadcast when :class:`GracefulInterrupt` handles SIGTERM: nothing to send."""


class SpeedMonitor(Callback):
    """Logs, every ``log_every_n_steps`` optimizer steps, the mean over that window of

    * ``step_time_s``: wall time per optimizer step (validation excluded),
    * ``tokens_per_s``: tokens of the whole job per second (batch x sequence x data-parallel replicas / time),
    * ``peak_memory_gib`` (CUDA only): this rank's peak allocated memory since the start.

    The first window (start-up, first steps) is not logged. When training stops between two window ends (Ctrl-C,
    preemption: a stop set before this callback's batch end, as :class:`GracefulInterrupt`, always listed first,
    sets it), Lightning writes a row for the stopping step anyway, and a value logged ``on_step`` stays in its
    results until the epoch ends: that row would repeat the previous window's numbers. The steps since the last
    window are logged there as their own, shorter window instead. (The incomplete window at ``max_steps`` gets no
    row, so nothing is logged for it.)
    """

    def __init__(self) -> None:
        self._start: float | None = None
        self._start_step = 0
        self._tokens = 0
        self._first = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._start is None:
            if trainer.strategy.root_device.type == "cuda":
                torch.cuda.synchronize()
            self._start, self._start_step, self._tokens = time.perf_counter(), trainer.global_step, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._start is None:
            return
        self._tokens += batch[0].numel()
        steps = trainer.global_step - self._start_step
        window_end = trainer.global_step % max(1, trainer.log_every_n_steps) == 0
        if steps < 1 or not (window_end or trainer.should_stop):  # a stop: Lightning logs this step's row
            return
        cuda = trainer.strategy.root_device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - self._start
        self._start = None
        if self._first:
            self._first = False
            return
        replicas = (getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}).get("num_replicas", 1)
        metrics = {"step_time_s": elapsed / steps, "tokens_per_s": self._tokens * replicas / elapsed}
        if cuda:
            metrics["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._start = None  # the next window starts after validation


class LastStepLog(Callback):
    """Writes the last optimizer step's ``train_loss`` to the loggers when Lightning did not: it writes a step's
    row only every ``log_every_n_steps`` steps, so a run of 8 steps logging every 5 ended with the row of step 5,
    and ``tp2d-train``'s report read ``train_loss 6.804 -> 6.804`` (one point, like no learning) for a run that
    learned. The row has Lightning's own step numbering (the step index, from 0) and epoch. Nothing is written when
    Lightning wrote that step's row itself (a step count that is a multiple of the interval, or a stop it logged)."""

    def __init__(self) -> None:
        self._logged_step = -1  # the last step (count) whose row Lightning wrote
        self._epoch = 0  # the epoch of the last batch (at on_train_end Lightning has counted the epoch as ended)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        every, self._epoch = trainer.log_every_n_steps, trainer.current_epoch
        if trainer.should_stop or (every > 0 and trainer.global_step % every == 0):
            self._logged_step = trainer.global_step  # Lightning writes this step's row after this hook

    def on_train_end(self, trainer, pl_module) -> None:
        value = trainer.callback_metrics.get("train_loss")
        if trainer.global_step in (0, self._logged_step) or value is None or not trainer.loggers:
            return
        row = {"train_loss": float(value), "epoch": self._epoch}
        for logger in trainer.loggers:  # (rank zero only: Lightning's loggers write on rank 0)
            logger.log_metrics(row, step=trainer.global_step - 1)
            logger.save()


class _ResumedEpochBar:
    """For Lightning's progress bars: a run resumed in the middle of an epoch shows the epoch and its total, and
    ``train_loss`` shows without a host sync per step (read on logging steps only, when the module does not put it
    on the bar itself: ``CausalLMModule(loss_on_progress_bar=False)``, as ``tp2d-train`` builds it).

    Lightning does not call ``on_train_epoch_start`` when it resumes mid-epoch, so its bar keeps what
    ``on_train_start`` made: tqdm's says "Training" with no total (``7/?``), rich's counts the steps left from the
    first resumed batch on (``7/1``). Here the first training batch that follows ``on_train_start`` without an
    ``on_train_epoch_start`` sets the bar up as that hook does, starting at ``batch_idx``. An epoch's total is its
    batches up to ``max_steps``: those trained before a resume (``batch_idx``) plus ``accumulate_grad_batches`` per
    step left, at most the epoch's length (Lightning's own counts one batch per step, so under gradient
    accumulation its tqdm bar loses the total half-way)."""

    def __init__(self, refresh_rate: int = 1, **kwargs) -> None:
        check_number("refresh_rate", refresh_rate, low=0, integer=True, meaning="redraw every N steps; 0: never")
        super().__init__(refresh_rate=refresh_rate, **kwargs)

    _epoch_started = True  # on_train_epoch_start has run since on_train_start
    _epoch_total: int | float | None = None  # this epoch's total (None: Lightning's own)
    _loss: float | None = None  # train_loss as last read (CausalLMModule(loss_on_progress_bar=False))
    _loss_step = -1  # the step it was read at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # train_loss not on the bar already: read it on the host only on the steps Lightning writes its logs (and
        # the first one), where the loggers read it anyway, so the steps between make no host sync for the bar
        every, step = trainer.log_every_n_steps, trainer.global_step
        due = self._loss is None or trainer.should_stop or (every > 0 and step % every == 0)
        if due and step != self._loss_step and not self.is_disabled:
            value = trainer.callback_metrics.get("train_loss")
            if value is not None and "train_loss" not in trainer.progress_bar_metrics:
                self._loss, self._loss_step = float(value), step
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def get_metrics(self, trainer, pl_module) -> dict:
        metrics = super().get_metrics(trainer, pl_module)
        if self._loss is not None and "train_loss" not in metrics:
            metrics["train_loss"] = self._loss
        return metrics

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self._epoch_started, self._epoch_total = False, None

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._epoch_started, self._epoch_total = True, self._batches_to_max_steps(trainer, 0)
        super().on_train_epoch_start(trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if self._epoch_started:
            return
        self._epoch_started = True  # resumed mid-epoch: batch_idx batches of this epoch are trained already
        self._epoch_total = self._batches_to_max_steps(trainer, batch_idx)
        super().on_train_epoch_start(trainer, pl_module)  # the bar's own set-up, with this total
        self._start_at(batch_idx)

    @staticmethod
    def _batches_to_max_steps(trainer, done: int) -> int | float:
        total = trainer.num_training_batches
        if trainer.max_epochs == -1 and trainer.max_steps > 0:  # Lightning's rule: max_steps bounds the epoch
            total = min(total, done + (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches)
        return total

    @property
    def total_train_batches(self) -> int | float:
        return super().total_train_batches if self._epoch_total is None else self._epoch_total

    def _start_at(self, batch_idx: int) -> None:
        raise NotImplementedError


class ResumableProgressBar(_ResumedEpochBar, TQDMProgressBar):
    """Lightning's :class:`~lightning.pytorch.callbacks.TQDMProgressBar` (``callbacks/progress_bar.yaml``), whose
    bar has its epoch and total in a run resumed mid-epoch too (``Epoch 0: 7/8``; its rate counts this run's
    batches)."""

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if self.train_progress_bar is not None:  # a resumed epoch's start, gone before the reset redraws the bar
            self.train_progress_bar.initial = 0
        super().on_train_epoch_start(trainer, pl_module)

    def _start_at(self, batch_idx: int) -> None:
        bar = self.train_progress_bar
        bar.initial = bar.n = batch_idx
        bar.refresh()


class ResumableRichProgressBar(_ResumedEpochBar, RichProgressBar):
    """Lightning's :class:`~lightning.pytorch.callbacks.RichProgressBar` (``callbacks/rich_progress_bar.yaml``),
    whose bar has its epoch and total in a run resumed mid-epoch too."""

    def _start_at(self, batch_idx: int) -> None:
        if self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, completed=batch_idx)

    def _get_train_description(self, current_epoch: int) -> str:
        """``Epoch 3/9`` under a ``max_epochs`` limit, plain ``Epoch 3`` without one (Lightning's own writes
        ``max_epochs - 1`` whatever it is: ``Epoch 0/-2`` under ``max_epochs=-1``, tp2d-train's setting)."""
        last = self.trainer.max_epochs
        text = f"Epoch {current_epoch}" + (f"/{last - 1}" if last is not None and last > 0 else "")
        width = len(self.validation_description)  # as Lightning pads it: no flicker between the two bars
        return f"{text:{width}}" if width > len(text) else text


class DivergenceGuard(Callback):
    """Stops training when the loss stops being finite, and never lets a non-finite model be checkpointed.

    Each step's loss is checked on the device (``isfinite`` of every micro-batch's loss, folded into one flag: no
    host sync) and the flag rides the per-step :class:`StepVote` (shared with :class:`GracefulInterrupt`: one small
    all-reduce, read by every rank a vote late, at the same step). With :class:`GracefulInterrupt` installed
    (``tp2d-train`` always) the vote runs every step, so a non-finite loss at step N is seen at the end of step N+1;
    alone, this callback votes every ``check_every_n_steps`` optimizer steps (default: the trainer's
    ``log_every_n_steps``). Before every checkpoint save and at the end of training the flag is voted and read at
    once (a host sync; saves are not steady-state steps). A non-finite loss raises :class:`DivergenceError` (the
    job exits non-zero) naming the window of steps; a save requested after it is refused by raising before anything
    is written, so the previous checkpoint (the last finite one) survives whatever ``save_top_k`` says, since
    :class:`ModelCheckpoint` removes an older checkpoint only after a newer one is saved. Non-finite gradients make
    the next loss non-finite and are caught one step later.

    ``skip_bad_steps=True`` skips an optimizer step whose gradients are not all finite instead (as large-run
    trainers do: a rare loss spike passes, a real divergence still trips the loss check): every rank agrees before
    the step (one all-reduce and host read per step: this mode costs a sync), the gradients are dropped so the
    optimizer leaves the parameters and its state untouched, and ``skipped`` counts the steps skipped."""

    def __init__(self, check_every_n_steps: int | None = None, skip_bad_steps: bool = False) -> None:
        if check_every_n_steps is not None and (not isinstance(check_every_n_steps, int) or check_every_n_steps < 1):
            raise ValueError(f"check_every_n_steps must be a positive int or None, got {check_every_n_steps!r}")
        self.check_every_n_steps = check_every_n_steps
        self.skip_bad_steps = skip_bad_steps
        self.skipped = 0
        self.vote = StepVote()  # replaced in setup by the vote shared with the trainer's other voters

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.vote = self.vote.shared(trainer)
        self.vote.want_every(self.check_every_n_steps or max(1, trainer.log_every_n_steps))

    def on_train_start(self, trainer, pl_module) -> None:
        self.vote.start(trainer.global_step, trainer.strategy.root_device)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.vote.fold(loss)  # before any batch-end hook: in the vote whichever voter's hook launches it

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not self.skip_bad_steps:
            return
        params = [p for group in full_param_groups(optimizer) for p in group]  # ZeRO-1: not only the slices
        grads = [p.grad for p in params if p.grad is not None]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        bad = bool(local) and not bool(torch.stack([torch.isfinite(g).all() for g in local]).all())
        if trainer.strategy.reduce_boolean_decision(bad, all=False):
            for p in params:
                p.grad = None  # the optimizer skips parameters without gradients: nothing changes
            self.vote.drop_step()  # this step's loss is not held against the run
            self.skipped += 1
            if trainer.is_global_zero:
                print(f"tp2d: step {trainer.global_step}: non-finite gradients, step skipped ({self.skipped} so far)",
                      flush=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.vote.end_step(trainer.global_step)
        self._raise_if_diverged()

    def check(self, trainer) -> None:
        """Vote the flag now and read it (a host sync, and an all-reduce unless this step is voted already); raise if
        any rank saw a non-finite loss."""
        self.vote.flush(trainer.global_step)
        self._raise_if_diverged()

    def _raise_if_diverged(self) -> None:
        if self.vote.diverged is None:
            return
        first, last = self.vote.diverged
        when = f"at step {first}" if first >= last else f"between steps {first} and {last}"
        raise DivergenceError(
            f"the training loss became non-finite (NaN or inf) {when}; "
            f"training stopped and no checkpoint of the diverged model was saved (the last saved checkpoint, if "
            f"any, is the last finite one). Lower the learning rate, or enable gradient clipping "
            f"(trainer.gradient_clip_val), and resume from that checkpoint.")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.check(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self.check(trainer)
