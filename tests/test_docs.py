"""The documentation runs as written: every ```python block of README.md, CONTRIBUTING.md and docs/*.md is saved
as a script and run in one folder per document, in document order, on as many processes as the text starts
(``torchrun ...`` when the text before the block names that command for it, else ``python <file>``, where
Lightning's and Fabric's own launchers start ``devices=N`` processes). Two blocks start exactly so, in fresh
interpreters: the cheapest torchrun block and the cheapest Lightning-launched one (``STARTS_FRESH``). Every other
block runs with ``runpy`` in the session's pooled ranks (:mod:`tests.script_ranks`: torchrun's environment, the
file as ``__main__`` in its folder, each rank's output captured as a fresh interpreter shows it), which saves an
interpreter, torch and Lightning per process. Only the CPU-sized arguments the text itself offers are swapped in
(``CPU_SIZED``), and each swapped string must still be in the text. Each known block's output is checked for
numbers; every block's output for Lightning's known-harmless warnings and tips (``lightning_tp2d.quiet``).

Also, over the same documents: the Quick start installs torch's CPU build before the package; every ``tp2d fit``
command of a ```bash block parses its flags (with its config when this checkout has it, else with the recipe's);
every ``tp2d-bench`` and ``tp2d-generate`` command parses its arguments; and every relative link points to a file
that exists and, with ``#anchor``, to a heading of that file (``tp2d-train`` commands: tests/test_recipes.py)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from lightning_tp2d import generate
from lightning_tp2d.bench import cli as bench_cli
from lightning_tp2d.cli import main as tp2d_main
from tests.script_ranks import LAUNCH_VARS, run_script
from tests.test_cli import NOISE

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
# the text before a block names the command that starts it: `torchrun --nproc-per-node 4 layouts.py`
TORCHRUN = re.compile(r"`torchrun ((?:--[\w-]+[ =]\S+ )*)(\w+\.py)`")
# a Trainer or Fabric that a block builds, and the processes Lightning's launcher starts for it
LAUNCHER = re.compile(r"\b(?:Trainer|Fabric)\(")
DEVICES = re.compile(r"\bdevices=(\d+)\b")

# The CPU-sized arguments the documents offer, swapped in before a block runs: (the block's string, the CPU
# string, the sentence of the text that offers the swap). Each block's string must occur in exactly one block.
# (The README's own-loop example, layouts.py, runs as printed, with gpt2: a rank that aborted at exit was seen only
# at that size; tests/test_process_end.py runs it twice more.)
CPU_SIZED = [
    ('tp.plan("llama-3.1-70b", gpus=64, gpu_memory_gib=80, seq=8192, global_batch_tokens=4 * 2**20)',
     'tp.plan("llama-tiny", gpus=4, gpu_memory_gib=0.05, seq=48, global_batch_tokens=768, layouts=("2d",), '
     'checkpointing=("none",))',
     '`tp.plan("llama-tiny", gpus=4, gpu_memory_gib=0.05, seq=48, global_batch_tokens=768, layouts=("2d",), '
     'checkpointing=("none",))`\nanswers in seconds'),
]
# A block holding the first string uses the file (or folder) that the block holding the second one wrote: that block
# runs first, and what it wrote is copied into this block's folder when the two are in different documents.
NEEDS = [('ckpt_path="tiny.ckpt"', 'trainer.save_checkpoint("tiny.ckpt"', "tiny.ckpt")]


@dataclass(frozen=True)
class Block:
    doc: Path
    heading: str  # the nearest heading above it
    code: str
    script: str  # the file name the text gives it (or block<n>.py)
    torchrun: tuple[str, ...]  # torchrun's arguments when the text starts it with torchrun, else ()

    @property
    def id(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.heading.lower()).strip("-")
        return f"{self.doc.stem}:{slug}:{self.script}"


def python_blocks(doc: Path) -> list[Block]:
    text, blocks, start = doc.read_text(), [], 0
    for n, match in enumerate(m for m in FENCE.finditer(text) if m.group(1) == "python"):
        before = text[start:match.start()]  # the prose since the previous python block
        headings = re.findall(r"^#+ (.+)$", text[:match.start()], re.M)
        launch = TORCHRUN.findall(before)
        args, script = (tuple(shlex.split(launch[-1][0])), launch[-1][1]) if launch else ((), f"block{n}.py")
        after = text[match.end():].lstrip("\n").split("\n\n", 1)[0]  # the paragraph right after the block
        named = re.findall(r"`python (\w+\.py)`", after)
        if not launch and named:
            script = named[0]
        blocks.append(Block(doc, headings[-1] if headings else doc.stem, match.group(2), script, args))
        start = match.end()
    return blocks


BLOCKS = [block for doc in DOCS for block in python_blocks(doc)]


def world_size(block: Block) -> int | None:
    """How many processes the text starts the block as: torchrun's ``--nproc-per-node``; under ``python <file>``,
    the one ``devices=N`` of the Trainer or Fabric it builds (Lightning's launcher starts N), else 1. ``None`` when
    the text does not spell that as one number (more nodes, no ``devices=N``): the block then starts as written."""
    if block.torchrun:
        args = " ".join(block.torchrun)
        nproc = re.search(r"--nproc[-_]per[-_]node[ =](\d+)\b", args)
        return int(nproc.group(1)) if nproc and "--nnodes" not in args else None
    if not LAUNCHER.search(block.code):
        return 1
    devices = set(DEVICES.findall(block.code))
    return int(devices.pop()) if len(devices) == 1 and "num_nodes" not in block.code else None


# The blocks that start in fresh interpreters, as their text says: the one torchrun block, layouts.py (gpt2 on 4
# processes: 24 s on 2 cores), and the cheapest Lightning-launched one (the predict block, 21 s, against 22 s for
# fabric_tiny.py and 23 s for train_tiny.py). Every launcher the documents use is so started once.
STARTS_FRESH = ("layouts.py", "trainer.predict(")


def starts_fresh(block: Block) -> bool:
    """Whether ``block`` runs in a fresh interpreter (``STARTS_FRESH``, or a world size the text does not give)."""
    return block.script == STARTS_FRESH[0] or STARTS_FRESH[1] in block.code or world_size(block) is None


# what a process says when a gloo worker thread is left to interpreter shutdown (tests/test_process_end.py)
TEARDOWN_ABORT = "terminate called without an active exception"


def cpu_sized(block: Block) -> str:
    code = block.code
    for documented, cpu, _ in CPU_SIZED:
        code = code.replace(documented, cpu)
    return code


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return env


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """Runs blocks at most once each, in one folder per document; returns ``run(block) -> (folder, output)``."""
    folders, done = {}, {}

    def folder(doc: Path) -> Path:
        if doc not in folders:
            folders[doc] = tmp_path_factory.mktemp(doc.stem)
        return folders[doc]

    def run(block: Block) -> tuple[Path, str]:
        if block.id in done:
            return done[block.id]
        cwd = folder(block.doc)
        for needs, wrote, name in NEEDS:  # the blocks this one uses the files of run first
            if needs in block.code:
                there, _ = run(next(b for b in BLOCKS if wrote in b.code))
                if there != cwd and not (cwd / name).exists():
                    copy = shutil.copytree if (there / name).is_dir() else shutil.copy2
                    copy(there / name, cwd / name)
        (cwd / block.script).write_text(cpu_sized(block))
        if not starts_fresh(block):  # in the session's ranks, each rank's output in rank order
            outputs = run_script(cwd / block.script, world_size(block), own_group=bool(block.torchrun))
            assert len(outputs) == world_size(block), block.id  # every rank ran the file to its end
            output = "".join(outputs)
            done[block.id] = (cwd, output)
            return done[block.id]
        if block.torchrun:  # --standalone: a free rendezvous port (other test runs may hold torchrun's default)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", *block.torchrun, block.script]
        else:
            cmd = [sys.executable, block.script]
        proc = subprocess.run(cmd, cwd=cwd, env=environment(), capture_output=True, text=True, timeout=300)
        output = proc.stdout + proc.stderr
        assert TEARDOWN_ABORT not in output, f"{block.id}: a process aborted at exit:\n{output[-4000:]}"
        assert proc.returncode == 0, f"{block.id} ({' '.join(cmd)}) exited {proc.returncode}:\n{output[-4000:]}"
        done[block.id] = (cwd, output)
        return done[block.id]

    return run


def test_the_documents_hold_the_blocks_and_swaps_this_test_knows():
    assert {block.script for block in BLOCKS} >= {"train_tiny.py", "fabric_tiny.py", "layouts.py"}
    text = " ".join(" ".join(doc.read_text() for doc in DOCS).split())  # line breaks read as spaces
    for documented, cpu, offer in CPU_SIZED:  # the swap is still offered by the text, for one block
        assert " ".join(offer.split()) in text, offer
        assert sum(documented in block.code for block in BLOCKS) == 1, documented
    for needs, wrote, _ in NEEDS:
        assert sum(needs in b.code for b in BLOCKS) == 1 and sum(wrote in b.code for b in BLOCKS) == 1
    layouts = next(b for b in BLOCKS if b.script == "layouts.py")
    assert layouts.torchrun == ("--nproc-per-node", "4") and "import copy" not in layouts.code
    assert '"nccl" if cuda else "gloo"' in layouts.code
    fresh = [block for block in BLOCKS if starts_fresh(block)]  # one torchrun block, one Lightning-launched block
    assert [block.script for block in fresh] == ["layouts.py", fresh[1].script] and not fresh[1].torchrun
    assert LAUNCHER.search(fresh[1].code) and world_size(fresh[1]) == 4
    named = {block.script: world_size(block) for block in BLOCKS}  # (block<n>.py repeats across documents)
    assert named["train_tiny.py"] == named["fabric_tiny.py"] == named["layouts.py"] == 4
    sizes = [world_size(block) for block in BLOCKS]
    assert None not in sizes and sizes.count(1) >= 3


def _numbers(pattern: str, output: str) -> list[float]:
    return [float(v) for v in re.findall(pattern, output)]


def check_output(block: Block, cwd: Path, output: str) -> None:
    """The numbers each known block prints or leaves; any other block only has to run."""
    if block.script == "train_tiny.py":  # 20 steps of gpt2-tiny on a 2x2 grid, rank 0's progress bar
        shown = _numbers(r"train_loss[:=] ?(\d+(?:\.\d+)?)", output)
        assert "GPU available: False" in output  # Lightning's own log lines are in the text the noise check reads
        assert shown and shown[-1] < 4.5  # from ln(257) = 5.55
        shards = sorted(p.name for p in (cwd / "tiny.ckpt").glob("*.distcp"))
        assert shards == [f"__{r}_0.distcp" for r in range(4)]
    elif block.script == "fabric_tiny.py":  # one line per step, rank 0 only
        losses = _numbers(r"(?m)^step \d+: loss (\d+\.\d+)$", output)
        assert len(losses) == 10 and losses[0] == pytest.approx(5.55, abs=0.1) and losses[-1] < losses[0] - 0.5
        assert sorted(p.name for p in (cwd / "ckpt").glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    elif "trainer.predict(" in block.code:  # two prompts continued, printed once (rank 0)
        assert output.count("The meaning of") == 1 and output.count("def main(") == 1
    elif block.script == "layouts.py":  # one forward and backward of gpt2 (124M) at random init, as printed
        (line,) = re.findall(r"(?m)^loss (\d+\.\d+), logits \((\d+), (\d+), (\d+)\), (\d+) tensors$", output)
        assert float(line[0]) == pytest.approx(10.82, abs=0.2)  # ln(50257): random init, random tokens
        assert tuple(int(v) for v in line[1:]) == (4, 64, 50257, 149)  # gpt2's 149 tensors (the tied head once)


@pytest.mark.parametrize("block", BLOCKS, ids=[block.id for block in BLOCKS])
def test_python_block_runs_as_written_and_prints_no_known_noise(block, ran):
    cwd, output = ran(block)
    check_output(block, cwd, output)
    assert [line for line in output.splitlines() if NOISE.search(line)] == []


SHOWS = """
import logging, os, sys, warnings

import torch

assert __name__ == "__main__" and sys.argv == [__file__] and os.getcwd() == sys.path[0] == os.path.dirname(__file__)
print(f"rank {os.environ.get('RANK')} of {os.environ.get('WORLD_SIZE')}, seed {torch.initial_seed()}")
for _ in range(2):
    warnings.warn("shown once")  # Python's default filter: once per place
logging.getLogger("lightning.pytorch.utilities.rank_zero").info("💡 Tip: For seamless cloud logging")
logging.getLogger("lightning").info("from the lightning logger")
logging.getLogger("elsewhere").warning("a warning through logging's last resort")
logging.getLogger("elsewhere").info("an INFO record nobody handles")
os.write(2, b"straight to fd 2\\n")
sys.exit(EXIT)
"""


def test_a_pooled_script_shows_what_a_fresh_interpreter_shows_and_fails_as_it_would(tmp_path):
    (tmp_path / "shows.py").write_text(SHOWS.replace("EXIT", "0"))
    outputs = run_script(tmp_path / "shows.py", 4)
    assert len(outputs) == 4
    for rank, output in enumerate(outputs):
        assert f"rank {rank} of 4, seed 67280421310721\n" in output  # torchrun's variables, torch's fresh seed
        assert output.count("UserWarning: shown once") == 1 and output.count("💡 Tip: For seamless") == 1
        assert "INFO: from the lightning logger\n" in output  # `import lightning`'s own handler and format
        assert "a warning through logging's last resort\n" in output and "nobody handles" not in output
        assert output.endswith("straight to fd 2\n")
    (tmp_path / "fails.py").write_text(SHOWS.replace("EXIT", "3"))
    with pytest.raises(RuntimeError, match=r"(?s)fails\.py exited 3 on rank 0 of 1:.*rank None of None, seed"):
        run_script(tmp_path / "fails.py", 1)  # one rank: no launch variables, as under `python fails.py`


def _quick_start() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return next(code for lang, code in FENCE.findall(section) if lang == "bash")


def test_quick_start_installs_the_cpu_torch_before_the_package():
    lines = [line for line in _quick_start().splitlines() if line and not line.startswith("#")]
    cpu = lines.index("pip install torch --index-url https://download.pytorch.org/whl/cpu")
    package = next(i for i, line in enumerate(lines) if line.startswith("pip install -e ."))
    assert cpu < package


# ---- commands of the ```bash blocks ----------------------------------------------------------------------------

# where a command starts in a line's words: ``tp2d fit`` (also after ``srun``, ``torchrun ... -m lightning_tp2d.cli``
# or environment assignments), ``tp2d-bench``, ``tp2d-generate``
HEADS = {("tp2d", "fit"): "tp2d fit", ("lightning_tp2d.cli", "fit"): "tp2d fit", ("tp2d-bench",): "tp2d-bench",
         ("tp2d-generate",): "tp2d-generate"}
RECIPE_CONFIG = "recipes/tp2d_cli.yaml"  # stands in for a config a command names but this checkout has not


def bash_commands(name: str) -> list[tuple[str, list[str]]]:
    """``(doc, arguments)`` of every ``name`` command (a value of HEADS) in the ```bash blocks of the documents;
    backslash-continued lines are joined and ``#`` comments dropped."""
    found = []
    for doc in DOCS:
        for lang, code in FENCE.findall(doc.read_text()):
            if lang != "bash":
                continue
            for line in code.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                for i in range(len(words)):
                    for head, command in HEADS.items():
                        if command == name and tuple(words[i:i + len(head)]) == head:
                            found.append((doc.name, words[i + len(head):]))
    return found


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
def test_every_documented_tp2d_fit_command_parses_its_flags(capsys):
    commands = bash_commands("tp2d fit")
    assert len(commands) >= 6 and sum((ROOT / a[a.index("--config") + 1]).exists() for _, a in commands) >= 2
    for doc, args in commands:
        config = args.index("--config") + 1
        if not (ROOT / args[config]).exists():  # a user's run.yaml: the flags must still be keys of the recipe's
            args = [*args[:config], RECIPE_CONFIG, *args[config + 1:]]
        args = [a.replace("recipes/", f"{ROOT}/recipes/", 1) for a in args]
        with pytest.raises(SystemExit) as exit_:
            tp2d_main(["fit", *args, "--print_config"])
        assert exit_.value.code == 0, (doc, args, capsys.readouterr().err[-2000:])
        printed = capsys.readouterr().out
        for arg in args:  # every --trainer.key=value override is in the printed config
            if arg.startswith("--trainer.") and "=" in arg:
                key, value = arg[len("--trainer."):].split("=", 1)
                assert re.search(rf"^  {re.escape(key)}: '?{re.escape(value)}'?$", printed, re.M), (doc, arg)


class _Parsed(Exception):
    """Raised in place of tp2d-bench's run, once its arguments are parsed and checked."""


def test_every_documented_tp2d_bench_command_parses_and_names_known_layouts_and_models(monkeypatch, capsys):
    def parsed(args, argv):
        raise _Parsed(args)

    monkeypatch.setattr(bench_cli, "run", parsed)  # main parses, checks the layouts and models, then runs: not here
    commands = bash_commands("tp2d-bench")
    assert len(commands) >= 4
    for doc, args in commands:
        with pytest.raises(_Parsed) as done:
            bench_cli.main(args)
        assert done.value.args[0].p >= 1, (doc, args)
    assert capsys.readouterr().err == ""


def test_every_documented_tp2d_generate_command_parses():
    commands = bash_commands("tp2d-generate")
    assert len(commands) >= 2
    for doc, args in commands:
        parsed = generate.parse_args(args)
        assert parsed.prompt and (parsed.checkpoint is None) != (parsed.hf is None), (doc, args)


# ---- links ------------------------------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
ANCHOR_TAG = re.compile(r"<a (?:id|name)=\"([^\"]+)\"")


def _prose(text: str) -> str:
    """``text`` without its fenced blocks and code spans (where brackets are code, not links)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def anchors(doc: Path) -> set[str]:
    """The ``#anchors`` GitHub gives ``doc``'s headings (lower case, punctuation dropped, spaces to hyphens; a
    repeated heading gets ``-1``, ``-2`` ...), and its explicit ``<a id=...>`` anchors."""
    text, seen, out = FENCE.sub("", doc.read_text()), {}, set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out | set(ANCHOR_TAG.findall(text))


def test_github_anchors_of_headings():
    doc = ROOT / "docs" / "layouts.md"
    assert {"the-2d-layout-summa-on-a-grid", "the-metp-layout-a-ring-for-long-sequences",
            "the-fair-baseline-1-d-tp-with-sequence-parallelism"} <= anchors(doc)


def test_every_relative_link_points_to_an_existing_file_and_heading():
    checked, broken = 0, []
    for doc in DOCS:
        for target in LINK.findall(_prose(doc.read_text())):
            if re.match(r"^[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            checked += 1
            if not file.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no heading #{anchor} in {file.name})")
    assert checked >= 40 and broken == []
