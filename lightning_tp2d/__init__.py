"""lightning_tp2d: 2-D (SUMMA) and memory-efficient ring tensor parallelism for GPT-2-class models.

Importing the package registers the Lightning strategy names ``"tp2d"`` (layout "2d"), ``"metp"`` and
``"tp2d_metp"`` ("2d-metp"), so ``Trainer(strategy="tp2d")`` works (Lightning has no entry-point discovery for
strategies).

The import itself stays light: the public names below are loaded on first access (PEP 562), and nothing here
imports torch or Lightning. The strategy names are registered as soon as ``lightning.pytorch.strategies`` exists:
at once when Lightning is already imported, otherwise by a one-shot import hook right after Lightning's strategy
package has executed. What is registered is a factory that imports :class:`~lightning_tp2d.strategy.TP2DStrategy`
when a Trainer asks for the name, so registration never imports this package's Lightning code in the middle of
Lightning's own import.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import types

from lightning_tp2d.layouts import STRATEGY_NAMES  # (imports neither torch nor Lightning)

__version__ = "0.1.0.dev0"

__all__ = [
    "GPT2", "GPT2Config", "CausalLMModule", "GPT2LightningModule", "ParallelDims", "TP2DStrategy", "TextDataModule", "export_hf",
    "full_state_dict", "gpt2_state_dict", "init_mesh", "load_gpt2", "load_hf_weights", "local_parameter_bytes",
    "parallelize", "read_state_dict", "Layout", "Grid2D", "Ring", "GridRing", "get_layout", "register_layout",
    "RingOptions", "TPOptions", "checkpoint_activations", "Llama", "LlamaConfig", "ModelFamily", "register_family",
    "family_of", "load_llama", "llama_state_dict", "load_model", "load_hf_model", "HFFormat", "plan", "PlanRow",
    "TrainPlan",
]

# public name -> the module that defines it (imported on first access)
_EXPORTS = {
    "ParallelDims": "train_plan", "init_mesh": "mesh",
    "GPT2": "models", "GPT2Config": "models", "Llama": "models", "LlamaConfig": "models",
    "full_state_dict": "parallelize", "local_parameter_bytes": "parallelize", "parallelize": "parallelize",
    "checkpoint_activations": "parallelize",
    "read_state_dict": "checkpoint",
    "export_hf": "export", "gpt2_state_dict": "export", "load_gpt2": "export", "load_hf_weights": "export",
    "load_llama": "export", "llama_state_dict": "export", "load_model": "export", "load_hf_model": "export",
    "HFFormat": "models.hf",
    "TextDataModule": "data",
    "CausalLMModule": "module", "GPT2LightningModule": "module",
    "TP2DStrategy": "strategy",
    "Layout": "layouts", "Grid2D": "layouts", "Ring": "layouts", "GridRing": "layouts", "get_layout": "layouts",
    "register_layout": "layouts",
    "RingOptions": "options", "TPOptions": "options",
    "ModelFamily": "families", "register_family": "families", "family_of": "families",
    "plan": "planning.planner", "PlanRow": "planning.planner",
    "TrainPlan": "train_plan",
}
# names that are also submodules: importing ``lightning_tp2d.parallelize`` must not rebind ``tp.parallelize``
_SHADOWED = {name for name, module in _EXPORTS.items() if name == module}

# Lightning strategy name -> layout: lightning_tp2d.layouts.STRATEGY_NAMES (pure Python, so registering needs no
# import of the strategy module, which imports Lightning)
_LIGHTNING_STRATEGIES = "lightning.pytorch.strategies"
_FABRIC_STRATEGIES = "lightning.fabric.strategies"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """This package's module type: the import system binds a submodule onto its package after loading it, which
    would turn ``lightning_tp2d.parallelize`` (the function) into the module of the same name."""

    def __setattr__(self, name: str, value) -> None:
        if name in _SHADOWED and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


# ---- strategy names -----------------------------------------------------------------------------------------------


def _make_strategy(**kwargs):
    """What the Trainer's ``StrategyRegistry.get(name)`` calls: ``TP2DStrategy(layout=<the name's layout>, **kwargs)``."""
    from lightning_tp2d.strategy import TP2DStrategy  # deferred: `import lightning_tp2d` does not import Lightning

    return TP2DStrategy(**kwargs)


def _make_fabric_strategy(**kwargs):
    """What Fabric's ``STRATEGY_REGISTRY.get(name)`` calls: ``TP2DFabricStrategy(layout=..., **kwargs)``."""
    from lightning_tp2d.fabric import TP2DFabricStrategy  # deferred: `import lightning_tp2d` does not import Lightning

    return TP2DFabricStrategy(**kwargs)


# Lightning module holding a strategy registry -> (the registry's name in it, the factory its names get)
_REGISTRIES = {_LIGHTNING_STRATEGIES: ("StrategyRegistry", _make_strategy),
               _FABRIC_STRATEGIES: ("STRATEGY_REGISTRY", _make_fabric_strategy)}


def _register_strategy_names(strategy_registry, factory=_make_strategy) -> None:
    """Register ``"tp2d"``, ``"metp"`` and ``"tp2d_metp"`` with a Lightning (Trainer or Fabric) strategy registry,
    lazily: ``factory`` imports the strategy class when a name is asked for."""
    for name, layout in STRATEGY_NAMES.items():
        strategy_registry.register(name, factory, description=f"tensor-parallel GPT-2, layout {layout!r}",
                                   layout=layout, override=True)


def _register_in(module) -> None:
    attribute, factory = _REGISTRIES[module.__name__]
    _register_strategy_names(getattr(module, attribute), factory)


class _RegisterAfterExec(importlib.abc.Loader):
    """Runs Lightning's own loader for a strategy package, then registers the names; afterwards the module's
    ``__loader__`` and ``__spec__.loader`` are Lightning's loader again."""

    def __init__(self, loader) -> None:
        self._loader = loader

    def __getattr__(self, name: str):  # get_source, get_filename, is_package, ... of the wrapped loader
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        try:
            self._loader.exec_module(module)
        finally:
            module.__loader__ = self._loader
            module.__spec__.loader = self._loader
        _register_in(module)
        if all(name in sys.modules for name in _REGISTRIES):
            sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _StrategyImportHook)]


class _StrategyImportHook(importlib.abc.MetaPathFinder):
    """Finds Lightning's two strategy packages (Trainer's and Fabric's) with the other finders and wraps their
    loaders; it leaves ``sys.meta_path`` once both have run (a lookup without an import, ``importlib.util.find_spec``,
    keeps it)."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _REGISTRIES:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RegisterAfterExec(spec.loader)
                return spec
        return None


def _register_when_lightning_loads() -> None:
    waiting = False
    for name, (attribute, _) in _REGISTRIES.items():
        module = sys.modules.get(name)
        if module is not None and hasattr(module, attribute):
            _register_in(module)
        else:
            waiting = True
    if waiting and not any(isinstance(finder, _StrategyImportHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, _StrategyImportHook())


_register_when_lightning_loads()
