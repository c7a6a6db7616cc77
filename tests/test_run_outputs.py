"""What a ``tp2d-train`` run writes and shows stays true after Ctrl-C and resume: ``metrics.csv``'s speed rows are
each their own window's measurement, ``loss.png`` names the step of the validation perplexity it quotes, and the
progress bar of a run resumed mid-epoch has its total. In-process Trainers on one CPU, a tiny linear model."""

from __future__ import annotations

import csv
import logging
import types
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from matplotlib.figure import Figure
from omegaconf import OmegaConf

from lightning_tp2d import callbacks, train
from lightning_tp2d.data import ResumableLoader, ResumableSampler

CONF = Path(__file__).resolve().parents[1] / "conf"


class Tiny(L.LightningModule):
    """A linear model whose training step takes ``global_step + 1`` seconds of a fake clock."""

    def __init__(self, clock: list[float] | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.clock = clock

    def training_step(self, batch, batch_idx):
        if self.clock is not None:
            self.clock[0] += self.global_step + 1
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def loader(windows: int = 40, batch: int = 2) -> ResumableLoader:
    data = torch.utils.data.TensorDataset(torch.ones(windows, 4))
    sampler = ResumableSampler(data, num_replicas=1, rank=0, shuffle=False, drop_last=True)
    return ResumableLoader(data, batch_size=batch, sampler=sampler, drop_last=True)


def trainer(tmp_path, callbacks_, **kwargs) -> L.Trainer:
    options = dict(accelerator="cpu", devices=1, max_epochs=-1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    return L.Trainer(callbacks=callbacks_, **{**options, **kwargs})


class StopAt(L.Callback):
    """Sets ``should_stop`` after optimizer step ``step``, as GracefulInterrupt does on Ctrl-C (listed before the
    other callbacks, as tp2d-train lists it)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True


def test_speed_row_at_a_stop_is_the_partial_window_not_the_previous_one(tmp_path, monkeypatch):
    """Windows of 3 steps; step k takes k seconds. Steps 4-6 log 5 s per step; Ctrl-C after step 8: Lightning writes
    a row for step 8 anyway, and it must hold steps 7-8 (7.5 s, 16 tokens in 15 s), not steps 4-6 again."""
    clock = [0.0]
    monkeypatch.setattr(callbacks, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    logger = CSVLogger(str(tmp_path), name="", version="")
    run = trainer(tmp_path, [StopAt(8), callbacks.SpeedMonitor()], max_steps=20, log_every_n_steps=3, logger=logger)
    run.fit(Tiny(clock), loader())
    assert run.global_step == 8
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("step_time_s")]
    got = [(int(r["step"]), float(r["step_time_s"]), float(r["tokens_per_s"])) for r in rows]
    # (Lightning's CSV "step" is the step index: the row of optimizer step 6 says 5)
    assert got == [(5, 5.0, pytest.approx(24 / 15)), (7, 7.5, pytest.approx(16 / 15))]


def test_speed_rows_are_only_whole_windows_when_training_reaches_max_steps(tmp_path, monkeypatch):
    """max_steps=8 with windows of 3: steps 7-8 are an incomplete window at the end; Lightning writes no row for them
    and neither does the monitor (nothing repeats the last window)."""
    clock = [0.0]
    monkeypatch.setattr(callbacks, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    logger = CSVLogger(str(tmp_path), name="", version="")
    trainer(tmp_path, [callbacks.SpeedMonitor()], max_steps=8, log_every_n_steps=3, logger=logger).fit(
        Tiny(clock), loader())
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(int(r["step"]), float(r["step_time_s"])) for r in rows if r.get("step_time_s")] == [(5, 5.0)]


@pytest.mark.parametrize("max_steps, logged", [(8, [2, 5, 7]), (9, [2, 5, 8])])
def test_the_last_steps_loss_is_on_record_whatever_the_logging_interval(tmp_path, max_steps, logged):
    """Rows every 3 steps: a run of 8 ended with the row of step 6 (index 5), so tp2d-train's report said
    ``train_loss a -> b`` for step 6, not the last; LastStepLog adds the last step's row (index 7) with its loss
    and epoch. A run of 9 steps has it already (no second row for step 9)."""
    logger = CSVLogger(str(tmp_path), name="", version="")
    run = trainer(tmp_path, [callbacks.LastStepLog()], max_steps=max_steps, log_every_n_steps=3, logger=logger)
    run.fit(Tiny(), loader())
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train_loss")]
    assert [int(r["step"]) for r in rows] == logged and {r["epoch"] for r in rows} == {"0"}
    assert float(rows[-1]["train_loss"]) == pytest.approx(float(run.callback_metrics["train_loss"]))
    assert float(rows[-1]["train_loss"]) < float(rows[0]["train_loss"])  # (SGD on a quadratic: it falls)


def test_tp2d_train_logs_the_last_step_by_default():
    default = OmegaConf.load(CONF / "callbacks" / "default.yaml")
    assert "last_step_log" in default.defaults
    node = OmegaConf.load(CONF / "callbacks" / "last_step_log.yaml").last_step_log
    assert isinstance(instantiate(node), callbacks.LastStepLog)


# metrics.csv of a run resumed in its run directory: the first run's rows up to its checkpoint, then the resumed
# run's; Lightning's writer may put an older step's validation row after a newer one
METRICS = """epoch,step,train_loss,val_loss,val_perplexity
0,99,3.1,,
0,199,2.6,,
0,299,2.3,2.242,9.41
0,249,2.4,,
0,149,2.8,2.526,12.50
"""


def test_loss_plot_and_report_quote_the_newest_validation_perplexity_with_its_step(tmp_path, monkeypatch, caplog):
    metrics = tmp_path / "metrics.csv"
    metrics.write_text(METRICS)
    figures, save = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: figures.append(fig) or save(fig, *a, **k))
    assert train.plot_losses(metrics, tmp_path / "loss.png") == tmp_path / "loss.png"
    (ax,) = figures[0].axes
    assert ax.get_title().endswith("validation perplexity 9.41 at step 299")
    curves = {line.get_label(): list(line.get_xdata()) for line in ax.get_lines()}
    assert curves == {"train loss": [99, 149, 199, 249, 299], "validation loss": [149, 299]}  # in step order

    run = types.SimpleNamespace(loggers=[CSVLogger(str(tmp_path), name="", version="")], global_step=300)
    with caplog.at_level(logging.INFO, logger="tp2d-train"):
        train.report(OmegaConf.create({"plot": False}), run, None, tmp_path, None, 60.0)
    assert "validation perplexity 9.41 at step 299" in caplog.text


@pytest.mark.parametrize("name", ["progress_bar", "rich_progress_bar"])
def test_progress_bar_of_a_run_resumed_mid_epoch_counts_to_max_steps(tmp_path, name):
    """A run saved at step 6 of a 20-batch epoch, resumed to max_steps=8. Lightning skips on_train_epoch_start when
    it resumes mid-epoch, so its tqdm bar kept on_train_start's 'Training 7/?' (its rich bar: 7/1): the bars of
    ``conf/callbacks/`` say 'Epoch 0', 8 of 8."""
    if name == "rich_progress_bar":
        pytest.importorskip("rich")
    node = OmegaConf.load(CONF / "callbacks" / f"{name}.yaml")[name]
    saves = dict(dirpath=str(tmp_path / "checkpoints"), every_n_train_steps=6, save_last=True)

    def shown(bar) -> tuple[int, int, str]:
        if name == "progress_bar":
            return bar.train_progress_bar.n, bar.train_progress_bar.total, bar.train_progress_bar.desc
        (task,) = [t for t in bar.progress.tasks if t.id == bar.train_progress_bar_id]
        return task.completed, task.total, task.description

    first = instantiate(node)
    trainer(tmp_path, [ModelCheckpoint(**saves), first], max_steps=6, enable_checkpointing=True,
            enable_progress_bar=True).fit(Tiny(), loader())
    assert shown(first)[:2] == (6, 6) and shown(first)[2].startswith("Epoch 0")  # a fresh run: as Lightning's
    bar = instantiate(node)
    trainer(tmp_path, [bar], max_steps=8, enable_progress_bar=True).fit(
        Tiny(), loader(), ckpt_path=str(tmp_path / "checkpoints" / "last.ckpt"))
    assert shown(bar)[:2] == (8, 8) and shown(bar)[2].startswith("Epoch 0")
    if name == "progress_bar":
        assert bar.train_progress_bar.initial == 6  # its rate counts this run's batches only


def test_progress_bar_total_counts_accumulated_batches():
    """accumulate_grad_batches=2, max_steps=5: 10 batches. Lightning's bar counts one batch per step (total 5) and
    loses its total at batch 6; the package's has 10."""
    bar = callbacks.ResumableProgressBar()
    run = L.Trainer(accelerator="cpu", devices=1, max_steps=5, max_epochs=-1, accumulate_grad_batches=2, logger=False,
                    enable_checkpointing=False, enable_model_summary=False, callbacks=[bar])
    run.fit(Tiny(), loader())
    assert run.global_step == 5 and (bar.train_progress_bar.n, bar.train_progress_bar.total) == (10, 10)


def test_the_end_of_run_sample_leaves_out_ids_its_tokenizer_cannot_decode(caplog):
    """Token files of a Llama (128256 ids) with data.tokenizer left at its default: the sample's ids beyond the
    tokenizer's are left out with a WARNING naming both sizes, instead of failing after training (ids 300 and 500
    here, for the 257-id byte tokenizer)."""
    from lightning_tp2d.data import ByteTokenizer

    cfg = OmegaConf.create({"sample": {"max_new_tokens": 3, "prompt": "ab", "temperature": 0.0, "top_k": None},
                            "seed": 0, "data": {"tokenizer": "byte"}})
    module = types.SimpleNamespace(generate=lambda idx, n, **kw: torch.tensor([[97, 98, 300, 99, 500]]),
                                   config=types.SimpleNamespace(vocab_size=600))
    run = types.SimpleNamespace(strategy=types.SimpleNamespace(root_device=torch.device("cpu")))
    with caplog.at_level(logging.INFO, logger="tp2d-train"):
        text = train.generate_sample(cfg, module, types.SimpleNamespace(tokenizer=ByteTokenizer()), run)
    assert text == "abc"
    assert "the sample holds 2 ids that data.tokenizer=byte (257 ids) cannot decode" in caplog.text
    assert "the model has 600 ids" in caplog.text
