"""Packaging: ``import lightning_tp2d`` and its Lightning-free modules load neither Lightning nor (where promised)
torch; the strategy names are registered whichever of Lightning and the package is imported first; the wheel ships
``conf/`` as ``lightning_tp2d/conf`` and an installed copy reads it. No process groups; fresh interpreters where
the import order matters."""

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


def run_python(code: str, cwd: Path = ROOT, env: dict | None = None) -> dict:
    """Run ``code`` in a fresh interpreter (``cwd`` first on sys.path) and return the JSON it prints last."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- lazy imports ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module,torch_free", [
    ("lightning_tp2d", True),
    ("lightning_tp2d.launch", True),
    ("lightning_tp2d.comm_record", True),  # recording needs no torch (comm builds the calls)
    ("lightning_tp2d.planning.cost_model", False),
    ("lightning_tp2d.mesh", False),
    ("lightning_tp2d.models", False),
])
def test_importing_a_core_module_loads_no_lightning(module, torch_free):
    loaded = run_python(f"""
        import json, sys
        import {module}
        print(json.dumps({{"lightning": sorted(m for m in sys.modules if m.split(".")[0] == "lightning"),
                           "torch": "torch" in sys.modules}}))
    """)
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


def test_parallelize_stays_the_function_after_its_submodule_is_imported():
    # the strategy imports lightning_tp2d.parallelize (the module) before anyone asks for tp.parallelize
    found = run_python("""
        import json
        import lightning_tp2d as tp
        import lightning_tp2d.strategy
        from lightning_tp2d import parallelize
        print(json.dumps({"attr": [tp.parallelize.__module__, tp.parallelize.__name__],
                          "from": [parallelize.__module__, parallelize.__name__]}))
    """)
    assert found["attr"] == found["from"] == ["lightning_tp2d.parallelize", "parallelize"]


# ---- strategy names -------------------------------------------------------------------------------------------

REGISTRY_CHECK = """
    import json, sys
    {imports}
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import StrategyRegistry
    import lightning.pytorch.strategies as strategies
    out = {{"lazy": "lightning_tp2d.strategy" not in sys.modules,
           "hooks": [type(f).__name__ for f in sys.meta_path if type(f).__module__ == "lightning_tp2d"],
           "loader": type(strategies.__spec__.loader).__module__,
           "registered": sorted(n for n in ("tp2d", "metp", "tp2d_metp") if n in StrategyRegistry)}}
    out["layouts"] = {{n: [type(s).__name__, s.layout] for n in out["registered"] for s in [StrategyRegistry.get(n)]}}
    trainer = Trainer(strategy="metp", accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    out["trainer"] = [type(trainer.strategy).__module__, trainer.strategy.layout]
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
    out["fabric"] = {{n: [type(s).__name__, s.layout] for n in ("tp2d", "metp", "tp2d_metp")
                     for s in [FABRIC_REGISTRY.get(n)]}}
    print(json.dumps(out))
"""


@pytest.mark.parametrize("imports", [
    "import lightning_tp2d\n    assert 'lightning' not in sys.modules",
    "import lightning.pytorch\n    import lightning_tp2d",
], ids=["package_first", "lightning_first"])
def test_strategy_names_resolve_to_tp2d_strategies_in_either_import_order(imports):
    out = run_python(REGISTRY_CHECK.format(imports=imports))
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
