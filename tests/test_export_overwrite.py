"""Exports never destroy weights they did not write. ``tp2d-train module.init_from=DIR export_hf=DIR`` (and an export
over an earlier export, over a run's checkpoints) is refused before launch in one line naming the directory, what it
holds and ``export_hf_overwrite=true``, leaving nothing on disk; so is a run directory (``hydra.run.dir``,
``TP2D_RUN_DIR``) holding weights, before Hydra writes into it, except for a run resumed from its own checkpoint.
``export_hf(...)`` refuses existing weight files unless ``overwrite=True``, and then writes staged: a crash
mid-export leaves the old files byte for byte, a complete one replaces the weights and keeps the other files.
``tp2d-generate`` writes nothing. The console script's ``main`` runs in this process (no rank starts)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import lightning_tp2d as tp
from lightning_tp2d import export, generate, launch, train
from lightning_tp2d.models import GPT2, GPT2Config
from lightning_tp2d.run_outputs import export_overwrite, export_transformers
from lightning_tp2d.train import ConfigError, check_outputs

from .test_refuse_before_launch import one_line_exit_2

launch.register_resolvers()
WAY_OUT = "or set export_hf_overwrite=true to replace them"


def _model(seed: int) -> GPT2:
    torch.manual_seed(seed)
    return GPT2(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=257, block_size=32)).eval()


def _hf_dir(path: Path, seed: int = 0) -> Path:
    """A transformers GPT-2 directory (our export of a seeded model) with a tokenizer.json and a README beside it."""
    tp.export_hf(_model(seed), path)
    (path / "tokenizer.json").write_text('{"model": "a tokenizer"}')
    (path / "README.md").write_text("my model\n")
    return path


def _snapshot(root: Path) -> dict[str, tuple[str, int]]:
    """Every file under ``root``: relative path -> (BLAKE2b of its bytes, modification time in ns)."""
    return {str(p.relative_to(root)): (hashlib.blake2b(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def _run_dir(path: Path) -> Path:
    """A finished tp2d-train run directory: Hydra's record and a checkpoint."""
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "config.yaml").write_text("seed: 0\n")
    (path / "checkpoints").mkdir()
    torch.save({"state_dict": {}, "global_step": 3}, path / "checkpoints" / "step=3.ckpt")
    (path / "checkpoints" / "last.ckpt").symlink_to("step=3.ckpt")
    return path


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(launch.CONF_DIR), version_base="1.3", job_name="test"):
        return compose(config_name="config", overrides=list(overrides))


CPU = ["trainer=cpu", "parallel=single", "trainer.devices=1", "data.max_tokens=20000", "data.block_size=32"]


# ---- tp2d-train: refused before launch -----------------------------------------------------------------------------


def test_exporting_over_init_from_is_one_line_exit_2_and_nothing_is_written(tmp_path, monkeypatch, capsys):
    """The command of the report: the directory it starts from is named, with the way out; every file of it stays."""
    source = _hf_dir(tmp_path / "my_gpt2")
    before = _snapshot(source)
    message = one_line_exit_2([*CPU, f"module.init_from={source}", f"export_hf={source}"], tmp_path, monkeypatch,
                              capsys)  # (exit 2, one line, no run directory left in the working directory)
    assert message.startswith(f"export_hf={str(source)!r} is module.init_from's directory: the export would be "
                              "written over the weights this run starts from (model.safetensors). Export to another "
                              "directory (e.g. export_hf=my_gpt2_ft), " + WAY_OUT)
    assert _snapshot(source) == before


def test_an_export_over_other_weights_or_a_file_is_refused_naming_what_is_there(tmp_path, monkeypatch, capsys):
    earlier = _hf_dir(tmp_path / "earlier_export")
    (earlier / "pytorch_model.bin").write_bytes(b"old")
    run = _run_dir(tmp_path / "run")
    (tmp_path / "notes.txt").write_text("x")
    for target, held in ((earlier, "model.safetensors, pytorch_model.bin"), (run, "checkpoints/ (2 entries)")):
        before = _snapshot(target)
        message = one_line_exit_2([*CPU, "model=gpt2-tiny", f"export_hf={target}"], tmp_path, monkeypatch, capsys)
        assert message.startswith(f"export_hf={str(target)!r} already holds weights this run did not write ({held}): "
                                  "the export would be written over them. Export to a new directory, " + WAY_OUT)
        assert _snapshot(target) == before
    message = one_line_exit_2([*CPU, "model=gpt2-tiny", f"export_hf={tmp_path / 'notes.txt'}"], tmp_path,
                              monkeypatch, capsys)
    assert message.startswith(f"export_hf={str(tmp_path / 'notes.txt')!r} is a file, not a directory")
    # allowed: export_hf_overwrite=true, a new or empty directory, a directory of other files
    (tmp_path / "empty").mkdir()
    for overrides in ([f"export_hf={earlier}", "export_hf_overwrite=true"], [f"export_hf={tmp_path / 'new'}"],
                      [f"export_hf={tmp_path / 'empty'}"], [f"export_hf={tmp_path}"]):
        check_outputs(composed(*CPU, "model=gpt2-tiny", *overrides))


def test_a_run_directory_holding_weights_is_refused_before_hydra_writes_into_it(tmp_path, monkeypatch, capsys):
    """hydra.run.dir= a transformers directory, or another run's directory: one line, and not a byte of it changed
    (Hydra's .hydra/ and train.log would have been written there); TP2D_RUN_DIR is held to the same rule."""
    source, other = _hf_dir(tmp_path / "my_gpt2"), _run_dir(tmp_path / "other_run")
    for run_dir, held, hint in ((source, "model.safetensors", ""), (other, "checkpoints/ (2 entries)", ", or resume")):
        before = _snapshot(run_dir)
        message = one_line_exit_2([*CPU, "model=gpt2-tiny", f"hydra.run.dir={run_dir}"], tmp_path, monkeypatch,
                                  capsys)
        assert message.startswith(f"hydra.run.dir={str(run_dir)!r} already holds weights this run did not write "
                                  f"({held}): the run would write its checkpoints, logs and .hydra/ there. Leave "
                                  "hydra.run.dir out (each run gets a new outputs/<date>/<time>/) or choose a new "
                                  f"directory{hint}")
        assert _snapshot(run_dir) == before and not (run_dir / "train.log").exists()
    assert f"(ckpt_path={other / 'checkpoints' / 'last.ckpt'}: it continues in its run directory)" in message
    monkeypatch.setenv(launch.RUN_DIR_ENV, str(source))  # exported: main asks check_given_run_dir the same
    with pytest.raises(SystemExit) as done:
        train.check_given_run_dir(["model=gpt2-tiny"])
    assert done.value.code == 2
    assert capsys.readouterr().err.startswith(f"tp2d-train: error: TP2D_RUN_DIR={str(source)!r} already holds weights")


def test_a_resumed_run_continues_in_its_own_run_directory_and_replaces_its_own_export(tmp_path, monkeypatch):
    """The one exception: a run resuming from a checkpoint of its run directory writes there, and may replace the
    export it wrote inside it (experiment=finetune's <run dir>/hf); an export elsewhere is still refused."""
    run = _run_dir(tmp_path / "outputs" / "2020-01-01" / "00-00-00")
    _hf_dir(run / "hf")
    outside = _hf_dir(tmp_path / "exported")
    resume = f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}"
    train.check_given_run_dir([f"hydra.run.dir={run}", resume])  # passes: no SystemExit
    monkeypatch.setenv(launch.RUN_DIR_ENV, str(run))  # (what rank 0 sets for its job)
    check_outputs(composed(*CPU, "model=gpt2-tiny", resume, f"export_hf={run / 'hf'}"))
    assert export_overwrite(composed(*CPU, resume, f"export_hf={run / 'hf'}"), run)
    with pytest.raises(ConfigError, match=r"^export_hf=.*exported' already holds weights this run did not write"):
        check_outputs(composed(*CPU, "model=gpt2-tiny", resume, f"export_hf={outside}"))
    with pytest.raises(ConfigError, match=r"^hydra.run.dir=.*00-00-00' already holds weights .*checkpoints/ \(2 "):
        check_outputs(composed(*CPU, "model=gpt2-tiny", f"export_hf={run / 'hf'}"))  # not resuming: refused


# ---- the export itself: refused over weights, staged when allowed ---------------------------------------------------


def test_export_hf_refuses_existing_weights_unless_overwrite_and_then_keeps_the_other_files(tmp_path):
    target = _hf_dir(tmp_path / "hf", seed=0)
    (target / "pytorch_model.bin").write_bytes(b"stale weights")  # replaced by the new model.safetensors, as are
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]  # an index and its shards
    (target / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": shards[0], "b": shards[1]}}))
    for shard in shards:
        (target / shard).write_bytes(b"stale shard")
    before = _snapshot(target)
    new = _model(1)
    with pytest.raises(FileExistsError, match=r"^export_hf: '.*hf' already holds transformers weights \(model-00001-"
                                              r"of-00002.safetensors, model-00002-of-00002.safetensors, "
                                              r"model.safetensors, model.safetensors.index.json, pytorch_model.bin\); "
                                              r"pass overwrite=True"):
        tp.export_hf(new, target)
    assert _snapshot(target) == before
    assert tp.export_hf(new, target, overwrite=True) == target
    assert sorted(p.name for p in target.iterdir()) == ["README.md", "config.json", "generation_config.json",
                                                        "model.safetensors", "tokenizer.json"]
    assert (target / "README.md").read_text() == "my model\n"  # kept, as is the tokenizer it was not given
    assert before["tokenizer.json"] == _snapshot(target)["tokenizer.json"]
    loaded = tp.load_hf_model(target)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), new.state_dict().values()))


def test_a_crash_mid_export_leaves_the_old_weights_whole(tmp_path, monkeypatch):
    """The last file fails after the weights were written in full: nothing was moved into place, nothing staged is
    left behind, and every old file is the same bytes (mtime too)."""
    target = _hf_dir(tmp_path / "hf")
    before = _snapshot(target)
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text("{}")

    def full_disk(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export.shutil, "copyfile", full_disk)  # the tokenizer, written after the weights
    with pytest.raises(OSError, match="No space left on device"):
        tp.export_hf(_model(1), target, overwrite=True, tokenizer=tokenizer)
    assert _snapshot(target) == before and not list(target.glob("*tmp-tp2d"))
    with pytest.raises(OSError, match="No space left on device"):  # a new directory: none is left behind
        tp.export_hf(_model(1), tmp_path / "new", tokenizer=tokenizer)
    assert not (tmp_path / "new").exists()


def test_tp2d_train_writes_over_init_from_only_when_told_and_then_staged(tmp_path):
    """export_hf_overwrite=true with export_hf=init_from: the new weights and ids replace the directory's, its
    README stays, and the data's tokenizer.json (here the directory's own) is written whole."""
    source = _hf_dir(tmp_path / "my_gpt2")
    config = json.loads((source / "config.json").read_text())
    cfg = composed(*CPU, f"module.init_from={source}", f"export_hf={source}", "export_hf_overwrite=true")
    check_outputs(cfg)
    tuned = _model(2)
    assert export_transformers(cfg, tuned, None) == source
    assert json.loads((source / "config.json").read_text()) == config  # the same sizes and ids
    assert (source / "README.md").read_text() == "my model\n"
    assert (source / "tokenizer.json").read_text() == '{"model": "a tokenizer"}'
    assert torch.equal(tp.load_hf_model(source).lm_head.weight, tuned.lm_head.weight)


# ---- tp2d-generate --------------------------------------------------------------------------------------------------


def test_tp2d_generate_leaves_every_file_of_a_transformers_directory_byte_identical(tmp_path, monkeypatch, capsys):
    source = _hf_dir(tmp_path / "hf")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    before = _snapshot(tmp_path)
    for args in ([str(source)], ["--hf", str(source)]):
        assert generate.main([*args, "--prompt", "ab", "--max-new-tokens", "3", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.count("ab") == 2
    assert _snapshot(tmp_path) == before  # every file the same bytes and time, and none added (cwd included)
