"""The package is one-way: no import cycle among its modules, counting imports inside functions too (a
function-local import hides a cycle at run time, not from a reader). ``if TYPE_CHECKING:`` imports are left out
(annotations only). The floors, bottom up, are in docs/architecture.md."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_tp2d"


def _module_of(path: Path) -> str:
    parts = ("lightning_tp2d", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_of(p): p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "_private_api.py"}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for n in ast.walk(node)}
    return skipped


def imports_of(module: str) -> set[str]:
    """The package modules ``module`` imports, anywhere in its code."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    skipped = _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "lightning_tp2d"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "lightning_tp2d":
                continue
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in MODULES else base)
    return {m for m in found if m in MODULES and m != module}


def cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph = {m: sorted(imports_of(m)) for m in MODULES}
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for m in graph:
        if m not in index:
            visit(m)
    return out


def test_the_walk_sees_function_local_imports():
    assert "lightning_tp2d.families" in imports_of("lightning_tp2d.train")  # imported inside check_layout


def test_no_import_cycle_among_the_package_modules():
    found = cycles()
    assert not found, "import cycles (each: modules that import one another, directly or not): " + "; ".join(
        " <-> ".join(c) for c in found)


def _in(module: str, folder: str) -> bool:
    return module == f"lightning_tp2d.{folder}" or module.startswith(f"lightning_tp2d.{folder}.")


def _crossings(importers, forbidden) -> list[str]:
    return sorted(f"{m} imports {dep}" for m in MODULES if importers(m)
                  for dep in imports_of(m) if any(_in(dep, folder) for folder in forbidden))


def test_the_runtime_never_imports_the_harness_or_the_rivals():
    """The runtime (everything outside ``bench/``, ``baselines/`` and ``planning/``) imports neither the measuring
    harness nor the runnable rivals: ``tp2d-train``, the strategies and ``layout="auto"`` stand on ``planning/``."""
    outside = lambda m: not any(_in(m, f) for f in ("bench", "baselines", "planning"))  # noqa: E731
    assert not _crossings(outside, ("bench", "baselines")), _crossings(outside, ("bench", "baselines"))


def test_planning_never_imports_the_harness_or_the_rivals():
    """``planning/`` prices the rivals as arithmetic on the config (``planning.rivals``), never by importing them."""
    inside = lambda m: _in(m, "planning")  # noqa: E731
    assert not _crossings(inside, ("bench", "baselines")), _crossings(inside, ("bench", "baselines"))
    assert "lightning_tp2d.planning.planner" in MODULES and "lightning_tp2d.baselines.tp1d" in MODULES
