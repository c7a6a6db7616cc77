"""Packaging: ``import lightning_tp2d`` and its Lightning-free modules load neither Lightning nor (where promised)
torch; the strategy names are registered whichever of Lightning and the package is imported first; the wheel ships
``conf/`` as ``lightning_tp2d/conf`` and an installed copy reads it. No process groups.

Where the import order matters each check runs in an interpreter that has imported nothing of the package nor of
Lightning: one fresh interpreter (``IMPORT_CHECKS``) forks a child per check from the state the check starts in,
bare for the torch-free modules, with torch imported for the others (they import it first themselves), with
``import lightning.pytorch`` done for the Lightning-first order, and with ``import lightning_tp2d`` then
``import lightning.pytorch`` done for the package-first order. What each child finds is what a fresh interpreter
running the same imports would find; the parent pays for torch and Lightning once instead of once per check."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

import lightning_tp2d as tp
from lightning_tp2d import launch

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


def run_python(code: str, cwd: Path = ROOT, env: dict | None = None, timeout: float = 120) -> dict:
    """Run ``code`` in a fresh interpreter (``cwd`` first on sys.path) and return the JSON it prints last."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- checks of what an import order loads, each in a fork of one fresh interpreter ----------------------------

TORCH_FREE = ("lightning_tp2d", "lightning_tp2d.launch",
              "lightning_tp2d.comm_record")  # recording needs no torch (comm builds the calls)
WITH_TORCH = ("lightning_tp2d.planning.cost_model", "lightning_tp2d.mesh", "lightning_tp2d.models")

FORKS = """
import json, os, sys, traceback


def forked(code):
    \"\"\"Starts ``code`` in a fork of this interpreter as it is now; ``result`` reads the ``out`` it sets.\"\"\"
    sys.stdout.flush()
    sys.stderr.flush()
    read, write = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write)
        return pid, read
    os.close(read)  # the child: run, report, leave without the parent's clean-up
    try:
        scope = {"forked": forked, "result": result, **SNIPPETS}
        exec(code, scope)
        found = {"out": scope["out"]}
    except BaseException:
        found = {"error": traceback.format_exc()}
    with os.fdopen(write, "w") as f:
        json.dump(found, f)
    os._exit(0)


def result(job):
    pid, read = job
    with os.fdopen(read) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    return json.loads(text) if text else {"error": f"the fork ended (status {status}) without a result"}
"""
LOADED = """
import sys
import {module}
out = {{"lightning": sorted(m for m in sys.modules if m.split(".")[0] == "lightning"), "torch": "torch" in sys.modules}}
"""
PARALLELIZE = """
import lightning_tp2d as tp
import lightning_tp2d.strategy
from lightning_tp2d import parallelize
out = {"attr": [tp.parallelize.__module__, tp.parallelize.__name__],
       "from": [parallelize.__module__, parallelize.__name__]}
"""
REGISTRY = """
import sys
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry
import lightning.pytorch.strategies as strategies
out = {"lazy": "lightning_tp2d.strategy" not in sys.modules,
       "hooks": [type(f).__name__ for f in sys.meta_path if type(f).__module__ == "lightning_tp2d"],
       "loader": type(strategies.__spec__.loader).__module__,
       "registered": sorted(n for n in ("tp2d", "metp", "tp2d_metp") if n in StrategyRegistry)}
out["layouts"] = {n: [type(s).__name__, s.layout] for n in out["registered"] for s in [StrategyRegistry.get(n)]}
trainer = Trainer(strategy="metp", accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False)
out["trainer"] = [type(trainer.strategy).__module__, trainer.strategy.layout]
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
out["fabric"] = {n: [type(s).__name__, s.layout] for n in ("tp2d", "metp", "tp2d_metp")
                 for s in [FABRIC_REGISTRY.get(n)]}
"""
# the package first: lightning_tp2d imported (it loads no Lightning), then Lightning; both orders' checks fork here
PACKAGE_FIRST = """
import sys
import lightning_tp2d
assert "lightning" not in sys.modules, sorted(m for m in sys.modules if m.startswith("lightning."))
import lightning.pytorch
jobs = {"package_first": forked(REGISTRY), "parallelize": forked(PARALLELIZE)}
out = {name: result(job) for name, job in jobs.items()}
"""
IMPORT_CHECKS = FORKS + """
checks = {}
for module in TORCH_FREE:
    checks[module] = result(forked(LOADED.format(module=module)))
import torch  # the modules below import it first themselves: once, here
for module in WITH_TORCH:
    checks[module] = result(forked(LOADED.format(module=module)))
package_first = forked(PACKAGE_FIRST)  # runs while this interpreter imports Lightning
import lightning.pytorch
checks["lightning_first"] = result(forked("import lightning_tp2d\\n" + REGISTRY))
found = result(package_first)
checks.update(found.get("out") or {"package_first": found, "parallelize": found})
print(json.dumps(checks))
"""


@pytest.fixture(scope="module")
def import_checks() -> dict:
    """What each check of an import order found: its ``out``, or the ``error`` it raised (module docstring)."""
    names = {"TORCH_FREE": TORCH_FREE, "WITH_TORCH": WITH_TORCH, "LOADED": LOADED, "PARALLELIZE": PARALLELIZE,
             "REGISTRY": REGISTRY, "PACKAGE_FIRST": PACKAGE_FIRST}
    code = f"SNIPPETS = {names!r}\nglobals().update(SNIPPETS)\n" + IMPORT_CHECKS
    return run_python(code, timeout=600)  # nine checks, each once given 120 s in a fresh interpreter of its own


def checked(import_checks: dict, name: str) -> dict:
    found = import_checks[name]
    assert "error" not in found, f"{name}:\n{found.get('error')}"
    return found["out"]


@pytest.mark.parametrize("module,torch_free", [(module, True) for module in TORCH_FREE] +
                         [(module, False) for module in WITH_TORCH])
def test_importing_a_core_module_loads_no_lightning(module, torch_free, import_checks):
    loaded = checked(import_checks, module)
    assert loaded["lightning"] == []
    if torch_free:
        assert loaded["torch"] is False


def test_every_public_name_resolves_to_its_defining_module():
    assert sorted(tp.__all__) == sorted(tp._EXPORTS)
    for name in tp.__all__:
        value = getattr(tp, name)
        assert value.__module__.startswith(f"lightning_tp2d.{tp._EXPORTS[name]}"), (name, value.__module__)
        assert name in dir(tp)
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        tp.not_a_name  # noqa: B018


def test_parallelize_stays_the_function_after_its_submodule_is_imported(import_checks):
    # the strategy imports lightning_tp2d.parallelize (the module) before anyone asks for tp.parallelize
    found = checked(import_checks, "parallelize")
    assert found["attr"] == found["from"] == ["lightning_tp2d.parallelize", "parallelize"]


# ---- strategy names -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("order", ["package_first", "lightning_first"])
def test_strategy_names_resolve_to_tp2d_strategies_in_either_import_order(order, import_checks):
    out = checked(import_checks, order)
    assert out["lazy"] is True  # registering imported no Lightning code of the package
    assert out["hooks"] == []  # the one-shot import hook is gone
    assert out["loader"] != "lightning_tp2d"  # Lightning's module keeps its own loader
    assert out["registered"] == ["metp", "tp2d", "tp2d_metp"]
    assert out["layouts"] == {"tp2d": ["TP2DStrategy", "2d"], "metp": ["TP2DStrategy", "metp"],
                              "tp2d_metp": ["TP2DStrategy", "2d-metp"]}
    assert out["trainer"] == ["lightning_tp2d.strategy", "metp"]
    assert out["fabric"] == {"tp2d": ["TP2DFabricStrategy", "2d"], "metp": ["TP2DFabricStrategy", "metp"],
                             "tp2d_metp": ["TP2DFabricStrategy", "2d-metp"]}


def test_registration_and_the_strategy_module_share_the_layouts_table():
    from lightning_tp2d import core, layouts

    assert core.STRATEGY_NAMES is layouts.STRATEGY_NAMES
    assert layouts.STRATEGY_NAMES == {"tp2d": "2d", "metp": "metp", "tp2d_metp": "2d-metp"}


# ---- conf/ in the wheel ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the checkout (so no build/ is left in the working tree)."""
    src, dist = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("lightning_tp2d", "conf"):
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src),
                           "-w", str(dist)], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    (whl,) = dist.glob("lightning_tp2d-*.whl")
    return whl


def test_wheel_ships_every_config_and_module(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        yamls = sorted(p.relative_to(CONF).as_posix() for p in CONF.rglob("*.yaml"))
        assert "config.yaml" in yamls and len(yamls) > 20
        for rel in yamls + ["README.md"]:
            assert zf.read(f"lightning_tp2d/conf/{rel}") == (CONF / rel).read_bytes(), rel
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "lightning_tp2d").rglob("*.py")
               if "__pycache__" not in p.parts}
    assert modules - names == set()  # a subpackage missing from pyproject.toml's package list shows here


def test_an_installed_copy_reads_the_configs_it_ships(wheel, tmp_path):
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    found = run_python("""
        import json
        import lightning_tp2d
        from hydra import compose, initialize_config_dir
        from lightning_tp2d import launch
        with initialize_config_dir(config_dir=str(launch.CONF_DIR), version_base="1.3", job_name="t"):
            cfg = compose(config_name="config", overrides=["experiment=quick"])
        print(json.dumps({"package": lightning_tp2d.__file__, "conf": str(launch.CONF_DIR),
                          "groups": launch.config_groups(), "layout": cfg.parallel.layout,
                          "max_steps": cfg.trainer.max_steps}))
    """, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)})
    assert found["package"] == str(site / "lightning_tp2d" / "__init__.py")
    assert found["conf"] == str(site / "lightning_tp2d" / "conf")
    groups = ["callbacks", "data", "experiment", "logger", "model", "parallel", "trainer"]
    assert found["groups"] == launch.config_groups(CONF) == groups
    assert (found["layout"], found["max_steps"]) == ("2d", 30)  # parallel/tp2d.yaml, experiment/quick.yaml


def test_a_source_checkout_reads_its_top_level_conf():
    assert launch.CONF_DIR == CONF == launch.SOURCE_CONF_DIR
    assert launch.PACKAGE_CONF_DIR == ROOT / "lightning_tp2d" / "conf"
