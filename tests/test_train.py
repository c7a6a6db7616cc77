"""``tp2d-train`` end to end on CPU processes (gloo): the run directory a 4-process job leaves, a two-machine launch
simulated on loopback that matches it loss for loss, sweeps that launch each job once, Ctrl-C that keeps the last
checkpoint, a ZeRO stage-3 run resumed from a checkpoint with the uninterrupted run's losses, and bad input refused
before any process starts.

The 4-process run directory test runs the real command, ``python -m lightning_tp2d.train`` (what the ``tp2d-train``
console script runs) with this checkout first on ``PYTHONPATH``, Lightning starting the ranks; so do the slow tests
of launches, sweeps and signals. The other runs call the console script's code in already-spawned ranks, or in this
process when nothing starts (:mod:`tests.hydra_runs`)."""

from __future__ import annotations

import csv
import glob
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from lightning_tp2d import load_gpt2
from lightning_tp2d.models import GPT2, GPT2Config
from tests.waiting import wait_until

from .hydra_runs import tp2d_train_here, tp2d_train_ranks
from .lightning_ranks import free_port
from .test_cli import NOISE

ROOT = Path(__file__).resolve().parents[1]
# gpt2-tiny on one 2x2 grid, 6 steps, validation (and a checkpoint) after steps 3 and 6
SMALL = ["experiment=quick", "parallel.tensor_parallel_size=4", "trainer.max_steps=6", "trainer.val_check_interval=3",
         "trainer.log_every_n_steps=1", "data.max_tokens=20000", "sample.max_new_tokens=8"]
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "SLURM_PROCID", "TP2D_RUN_DIR", "PL_GLOBAL_SEED")
RUN_DIR = re.compile(r"^outputs/\d{4}-\d{2}-\d{2}/\d{2}-\d{2}-\d{2}$")


def command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "lightning_tp2d.train", *args]


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def tp2d_train(args: list[str], cwd: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(command(args), cwd=cwd, env=environment(**env), capture_output=True, text=True,
                          timeout=timeout)


def run_dirs(cwd: Path) -> list[str]:
    return sorted(str(p.relative_to(cwd)) for p in cwd.glob("outputs/*/*"))


def losses(run_dir: Path) -> tuple[list[float], list[float], list[float]]:
    with open(run_dir / "logs" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    column = lambda name: [float(r[name]) for r in rows if r.get(name)]  # noqa: E731
    return column("train_loss"), column("val_loss"), column("val_perplexity")


@pytest.fixture(scope="module")
def single_node(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    cwd = tmp_path_factory.mktemp("single_node")
    run = tp2d_train(SMALL, cwd)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return cwd, run


def test_4_process_run_leaves_metrics_checkpoint_plot_and_sample(single_node):
    cwd, run = single_node
    (run_dir,) = run_dirs(cwd)  # one timestamped folder: the ranks Lightning started made none of their own
    assert RUN_DIR.match(run_dir) and sorted(p.name for p in cwd.iterdir()) == ["outputs"]
    run_dir = cwd / run_dir

    train, val, perplexity = losses(run_dir)
    assert len(train) == 6 and train[-1] < train[0] - 0.3  # the loss fell (5.54 -> ~4.8)
    assert len(val) == 2 and val[1] < val[0] and perplexity[1] < perplexity[0] < 257
    assert perplexity == pytest.approx([torch.tensor(v).exp().item() for v in val], rel=1e-4)

    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in (checkpoints / "step=6.ckpt").glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    assert (checkpoints / "last.ckpt").is_symlink() and os.readlink(checkpoints / "last.ckpt") == "step=6.ckpt"
    assert not list(checkpoints.glob("step=3.ckpt*"))  # save_top_k=1 keeps the newest
    trained = load_gpt2(checkpoints / "last.ckpt")
    assert trained.config == GPT2Config.from_name("gpt2-tiny")
    torch.manual_seed(0)  # module.init_seed: the weights training started from
    initial = GPT2(trained.config).state_dict()
    moved = {k: (v - initial[k]).abs().max().item() for k, v in trained.state_dict().items()}
    assert min(moved.values()) > 1e-4  # every tensor was trained

    png = (run_dir / "logs" / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    sample = (run_dir / "sample.txt").read_text(encoding="utf-8")
    assert sample.startswith("The ") and len(sample.encode()) >= len("The ")
    assert "Epoch 0: 100%" in run.stdout + run.stderr  # Lightning's progress bar
    assert [line for line in (run.stdout + run.stderr).splitlines() if NOISE.search(line)] == []  # lightning_tp2d.quiet
    log = (run_dir / "train.log").read_text()
    assert "1 replica(s) x 2x2 grid (p=4)" in log and "tp2d-train: done" in log and "----- sample" in log
    assert "max_steps: 6" in (run_dir / ".hydra" / "config.yaml").read_text()


@pytest.mark.slow
def test_two_machines_on_loopback_match_the_single_machine_run(single_node, tmp_path):
    """NODE_RANK 0 and 1, two processes each (Lightning starts the second on each machine), one 2x2 grid across
    both: rows 0 and 1 of the grid live on different 'machines'."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for n in nodes:
        n.mkdir()
    args = SMALL + ["trainer=cpu", "trainer.devices=2", "trainer.num_nodes=2"]
    port = str(free_port())
    procs = [subprocess.Popen(command(args), cwd=n, env=environment(MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                                                                    NODE_RANK=str(i)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i, n in enumerate(nodes)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert "GLOBAL_RANK: 2" in outs[1] and "GLOBAL_RANK: 3" in outs[1]
    (run_dir,) = run_dirs(nodes[0])
    assert list(nodes[1].iterdir()) == []  # machine 1 wrote nothing of its own
    cwd, _ = single_node
    (reference,) = run_dirs(cwd)
    got, want = losses(nodes[0] / run_dir), losses(cwd / reference)
    for a, b in zip(got, want):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    assert sorted(p.name for p in (nodes[0] / run_dir / "checkpoints" / "step=6.ckpt").glob("*.distcp")) == \
        [f"__{r}_0.distcp" for r in range(4)]


def test_resume_continues_in_the_run_directory_and_command_line_callbacks_are_used(single_node, tmp_path):
    """``ckpt_path=<run>/checkpoints/last.ckpt`` continues the 6-step run to step 8 in that run directory (metrics.csv
    keeps the first run's rows), and ``+callbacks.<name>._target_=...`` is built and used (the learning rate logged)."""
    cwd, _ = single_node
    (reference,) = run_dirs(cwd)
    run_dir = tmp_path / "outputs" / "2020-01-01" / "00-00-00"
    shutil.copytree(cwd / reference, run_dir, symlinks=True)
    args = [a for a in SMALL if not a.startswith(("trainer.max_steps=", "sample."))] + [
        "trainer.max_steps=8", "sample.max_new_tokens=0", f"ckpt_path={run_dir}/checkpoints/last.ckpt",
        "+callbacks.lr._target_=lightning.pytorch.callbacks.LearningRateMonitor"]
    done = tp2d_train_here([a.replace("max_steps=8", "max_steps=6") for a in args], tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]  # at max_steps already: it says so, once
    assert "nothing to train:" in done.stdout + done.stderr and "Initializing distributed" not in done.stdout + done.stderr
    assert "was saved at step 6 and trainer.max_steps=6. To train on, resume with a larger trainer.max_steps" in \
        (run_dir / "train.log").read_text()
    run = tp2d_train_ranks(args, tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert run_dirs(tmp_path) == ["outputs/2020-01-01/00-00-00"]  # no new run directory
    assert f"in its run directory {run_dir} (logs/metrics.csv continues" in (run_dir / "train.log").read_text()
    train, val, _ = losses(run_dir)
    first_train, first_val, _ = losses(cwd / reference)
    assert len(train) == 8 and train[:6] == first_train and val == first_val  # (no validation after step 6)
    with open(run_dir / "logs" / "metrics.csv", newline="") as f:
        assert [float(r["lr-AdamW/pg1"]) > 0 for r in csv.DictReader(f) if r.get("lr-AdamW/pg1")] == [True, True]
    assert os.readlink(run_dir / "checkpoints" / "last.ckpt") == "step=8.ckpt"


def test_a_damaged_checkpoint_at_resume_is_one_line_naming_the_file_before_any_process_starts(single_node, tmp_path):
    """A shard of the checkpoint overwritten, then its meta.pt garbage: the launching process reads every checksum
    before any rank starts, and the user reads one line naming the file, exit 2 (it used to be a Hydra traceback from
    every rank, then one line from the ranks after they had started)."""
    cwd, _ = single_node
    (reference,) = run_dirs(cwd)
    damaged = tmp_path / "step=6.ckpt"
    shutil.copytree(cwd / reference / "checkpoints" / "step=6.ckpt", damaged)
    shard = damaged / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-8] + bytes(8))
    args = [a for a in SMALL if not a.startswith("trainer.max_steps=")] + ["trainer.max_steps=8", f"ckpt_path={damaged}"]
    for broken in ("__1_0.distcp", "meta.pt"):
        if broken == "meta.pt":
            (damaged / "meta.pt").write_bytes(b"not a checkpoint")
        run = tp2d_train_here(args, tmp_path)
        out = run.stdout + run.stderr
        assert run.returncode == 2, out[-3000:]
        errors = [line for line in run.stderr.splitlines() if line.startswith("tp2d-train: error:")]
        assert len(errors) == 1 and "ckpt_path" in errors[0] and broken in errors[0], out[-3000:]
        assert "Traceback" not in out and "Error executing job" not in out and "Initializing distributed" not in out


@pytest.mark.slow
def test_multirun_launches_each_job_once_in_its_own_folder(tmp_path):
    args = ["-m", "experiment=quick", "trainer.max_steps=2,3", "trainer.val_check_interval=2",
            "trainer.limit_val_batches=1", "data.max_tokens=20000", "sample.max_new_tokens=0"]
    run = tp2d_train(args, tmp_path, timeout=400)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    out = run.stdout + run.stderr
    for rank in range(4):  # two jobs of 4 ranks: every rank started exactly twice, not once per job and child
        assert out.count(f"Initializing distributed: GLOBAL_RANK: {rank},") == 2
    (sweep,) = [p for p in tmp_path.glob("outputs/*/*")]
    assert sorted(p.name for p in sweep.iterdir()) == ["0", "1", "multirun.yaml"]
    for job, steps in (("0", 2), ("1", 3)):
        train, _, _ = losses(sweep / job)
        assert len(train) == steps and (sweep / job / "checkpoints" / f"step={steps}.ckpt" / ".metadata").is_file()


def long_run_until_checkpoint(cwd: Path, every: int, step: int, stdout=subprocess.PIPE, extra=()) -> subprocess.Popen:
    """A 4-process ``experiment=quick`` run of 500 steps saving every ``every`` steps, in its own process group,
    returned once the checkpoint of ``step`` is complete (for signal tests); ``extra``: more overrides."""
    args = ["experiment=quick", "trainer.max_steps=500", f"callbacks.model_checkpoint.every_n_train_steps={every}",
            "trainer.val_check_interval=1000", "data.max_tokens=20000", *extra]
    proc = subprocess.Popen(command(args), cwd=cwd, env=environment(), stdout=stdout,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    written = str(cwd / f"outputs/*/*/checkpoints/step={step}.ckpt/.metadata")
    wait_until(lambda: glob.glob(written), time.monotonic() + 240, gone=lambda: proc.poll() is not None,
               interval=0.1, what=f"step {step}'s checkpoint")
    assert glob.glob(written)
    return proc


READER = "import sys\nfor line in sys.stdin:\n    sys.stdout.write(line)\n"  # `tee`: dies of the Ctrl-C it gets


@pytest.mark.slow
def test_ctrl_c_under_a_pipe_saves_the_step_and_exits_130(tmp_path):
    """``tp2d-train ... | tee run.log`` and Ctrl-C (SIGINT to the whole process group, the reader included, which
    dies of it) while checkpoints are written every two steps: rank 0 outlives the closed pipe (its signal handler
    used to print into it and die of BrokenPipeError, the other ranks then failed with "Connection closed by peer"
    and nothing was saved); every rank stops after the same step, that very step is saved and loads, and the
    command exits with the signal's code, 128 + 2. ``train.log`` has what the pipe no longer showed."""
    read_end, write_end = os.pipe()
    proc = long_run_until_checkpoint(tmp_path, every=2, step=6, stdout=write_end)
    reader = subprocess.Popen([sys.executable, "-c", READER], stdin=read_end, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    os.close(read_end), os.close(write_end)
    time.sleep(0.3)  # somewhere in the next steps (and saves)
    os.kill(reader.pid, signal.SIGINT)  # the terminal's Ctrl-C reaches both (reader first: the pipe closes before
    os.killpg(proc.pid, signal.SIGINT)  # rank 0 gets to write about the signal)
    assert reader.wait(timeout=30) != 0  # the pipe's reader is gone
    assert proc.wait(timeout=90) == 128 + signal.SIGINT
    (log,) = tmp_path.glob("outputs/*/*/train.log")
    out = log.read_text()
    found = re.search(r"interrupted at step (\d+); the last complete checkpoint is (\S+)", out)
    assert found, out[-3000:]
    step, newest = int(found.group(1)), Path(found.group(2))
    assert f"Ctrl-C: stopping after step {step} and saving it" in out
    checkpoints = newest.parent
    assert not list(checkpoints.glob("*.tmp-tp2d"))  # half-written saves removed
    target = checkpoints / os.readlink(newest)
    saved = int(re.match(r"step=(\d+)\.ckpt", target.name).group(1))
    assert saved == step > 6 and (target / ".metadata").is_file()  # every rank stopped at one step and saved it
    assert load_gpt2(newest).config == GPT2Config.from_name("gpt2-tiny")


def test_bad_input_is_refused_before_any_process_starts(tmp_path, monkeypatch):
    """(Unknown keys and device counts that do not fit are checked in-process in test_conf.py.)"""
    unknown_option = tp2d_train_here(["model=gpt3"], tmp_path)
    assert unknown_option.returncode == 2  # refused on the command line, before Hydra composes (issue 38)
    assert "model/ has no option 'gpt3'; its options: " in unknown_option.stderr
    assert ", gpt2-medium, " in unknown_option.stderr

    missing = tp2d_train_here(["data=text", "data.path=corpus/missing.txt"], tmp_path)
    assert missing.returncode == 2
    assert f"data.path='corpus/missing.txt' does not exist (looked for {tmp_path}/corpus/missing.txt" in missing.stderr
    assert list(tmp_path.iterdir()) == []  # the run directory Hydra had made is gone again

    monkeypatch.setitem(sys.modules, "tiktoken", types.ModuleType("tiktoken"))  # whose BPE files cannot be fetched
    sys.modules["tiktoken"].get_encoding = offline_encoding
    offline = tp2d_train_here(["model=gpt2", "data.tokenizer=gpt2"], tmp_path)
    assert offline.returncode == 2, offline.stderr[-2000:]
    assert offline.stderr.strip().count("\n") == 0, offline.stderr  # one line
    assert "tp2d-train: error: data.tokenizer: tokenizer 'gpt2' needs" in offline.stderr
    assert "Error executing job" not in offline.stderr and list(tmp_path.iterdir()) == []


def offline_encoding(name):
    """tiktoken's ``get_encoding`` on a machine without network."""
    raise ConnectionError("HTTPSConnectionPool: Max retries exceeded\n" * 20)


@pytest.mark.parametrize("parallel, p, devices, log_every, precision, zero_stage",
                         [("metp", 2, 4, 20, "bf16-mixed", 3),
                          pytest.param("tp2d_metp", 4, 4, 1, "bf16-true", 0, marks=pytest.mark.slow)])
def test_ring_layouts_train_and_sample_from_the_command_line(tmp_path, parallel, p, devices, log_every, precision,
                                                             zero_stage):
    """In bf16 with gradient clipping (the GPU default's bf16-mixed + clipping used to fail at the first optimizer
    step: Lightning refused to clip for the fused AdamW). (metp also runs shorter than its logging interval: the
    interval shrinks to the run, so the run still leaves its metrics and plot.) metp runs 2 rings of 2 at ZeRO
    stage 3 (FSDP2 over data_parallel) and keeps every checkpoint: resumed from step 3 in a copy of its run
    directory, it logs the uninterrupted run's losses for steps 4-6."""
    args = [*SMALL, f"parallel={parallel}", f"parallel.tensor_parallel_size={p}", f"trainer.devices={devices}",
            f"trainer.log_every_n_steps={log_every}", f"trainer.precision={precision}", "trainer.gradient_clip_val=0.5",
            f"parallel.zero_stage={zero_stage}", "callbacks.model_checkpoint.save_top_k=-1",
            f"data.max_tokens={20000 * devices // p}"]  # 2 validation batches per replica
    run = tp2d_train_ranks(args, tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    (run_dir,) = run_dirs(tmp_path)
    first = losses(tmp_path / run_dir)
    train, val, _ = first
    assert len(train) == (6 if log_every == 1 else 1) and len(val) == 2 and val[1] < val[0]
    assert log_every == 1 or (tmp_path / run_dir / "logs" / "loss.png").is_file() or importlib.util.find_spec(
        "matplotlib") is None
    if log_every == 1:
        assert train[-1] < train[0] - 0.3
    assert (tmp_path / run_dir / "sample.txt").read_text(encoding="utf-8").startswith("The ")
    if zero_stage:
        assert f"{devices // p} replica(s) x ring of {p}" in (tmp_path / run_dir / "train.log").read_text()
        copy = tmp_path / "resumed" / "outputs" / "2020-01-01" / "00-00-00"
        shutil.copytree(tmp_path / run_dir, copy, symlinks=True)
        resumed = tp2d_train_ranks([*args, "sample.max_new_tokens=0", f"ckpt_path={copy}/checkpoints/step=3.ckpt"],
                                   tmp_path / "resumed")
        assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
        assert f"resuming from {copy}/checkpoints/step=3.ckpt" in (copy / "train.log").read_text()
        for got, want in zip(losses(copy), first):  # train_loss at 6; val_loss, perplexity at 3 and 6
            assert got == pytest.approx(want, rel=1e-6, abs=0), (got, want)  # steps 4-6 as if never stopped


def test_llama_trains_in_float8_on_a_2x2_grid_and_its_checkpoint_exports_to_transformers(tmp_path):
    """``tp2d-train model=llama-tiny parallel=tp2d parallel.float8=rowwise``: the LightningModule builds the Llama,
    the strategy splits it over the grid with float8 linears (emulated on CPU: one line says so), the sample is drawn
    from it, and the checkpoint (no float8 state in it) exports to a LlamaForCausalLM with its logits."""
    if importlib.util.find_spec("torchao") is None:
        pytest.skip("float8 needs torchao")
    from lightning_tp2d import export_hf, load_llama

    args = ["experiment=quick", "model=llama-tiny", "parallel=tp2d", "parallel.tensor_parallel_size=4",
            "parallel.float8=rowwise", "trainer.max_steps=4", "trainer.val_check_interval=2",
            "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1", "data.max_tokens=20000",
            "sample.max_new_tokens=8", "trainer.enable_progress_bar=false"]
    run = tp2d_train_ranks(args, tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert (run.stdout + run.stderr).count("float8='rowwise': torch._scaled_mm is emulated on the CPU") == 1, \
        run.stderr[-3000:]
    (run_dir,) = run_dirs(tmp_path)
    train, val, _ = losses(tmp_path / run_dir)
    assert len(train) == 4 and len(val) == 2 and train[-1] < train[0]
    assert (tmp_path / run_dir / "sample.txt").read_text(encoding="utf-8").startswith("The ")
    transformers = pytest.importorskip("transformers")
    ckpt = tmp_path / run_dir / "checkpoints" / "last.ckpt"
    model = load_llama(ckpt).eval()
    hf = transformers.LlamaForCausalLM.from_pretrained(export_hf(ckpt, tmp_path / "hf")).eval()
    idx = torch.randint(0, 257, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx), rtol=1e-4, atol=1e-4)


def test_llama_trains_in_pipeline_stages_from_the_command_line_and_exports(tmp_path):
    """``tp2d-train parallel=metp parallel.pipeline_parallel_size=2`` (issue 51): two stages of a 4-block Llama,
    each a ring of 2, interleaved 1F1B with two virtual stages per rank; the run learns, validates, says it
    has no sample (generation across stages is not built), and its checkpoint (each stage's part) exports to a
    LlamaForCausalLM with the plain model's logits."""
    from lightning_tp2d import export_hf, load_llama

    args = ["experiment=quick", "model=llama-tiny", "model.n_layer=4", "parallel=metp",
            "parallel.tensor_parallel_size=2", "parallel.pipeline_parallel_size=2",
            "parallel.pp_schedule=interleaved_1f1b", "parallel.virtual_stages=2", "parallel.microbatches=2",
            "trainer.max_steps=4", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
            "trainer.log_every_n_steps=1", "trainer.gradient_clip_val=0.5", "data.max_tokens=20000",
            "sample.max_new_tokens=8", "trainer.enable_progress_bar=false"]
    run = tp2d_train_ranks(args, tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    (run_dir,) = run_dirs(tmp_path)
    log = (tmp_path / run_dir / "train.log").read_text()
    assert "2 pipeline stages (interleaved_1f1b, 2 micro-batches) x 1 replica(s) x ring of 2" in log
    assert "no sample: generation across pipeline stages is not supported" in log + run.stdout + run.stderr
    train, val, _ = losses(tmp_path / run_dir)
    assert len(train) == 4 and len(val) == 2 and train[-1] < train[0]
    transformers = pytest.importorskip("transformers")
    ckpt = tmp_path / run_dir / "checkpoints" / "last.ckpt"
    model = load_llama(ckpt).eval()
    assert model.config.n_layer == 4
    hf = transformers.LlamaForCausalLM.from_pretrained(export_hf(ckpt, tmp_path / "hf")).eval()
    idx = torch.randint(0, 257, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx), rtol=1e-4, atol=1e-4)
