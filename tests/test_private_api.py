"""The list of private Lightning / torch APIs in :mod:`lightning_tp2d._private_api` is true: every private use in the
package's code is listed (under the file and function that holds it), and every listed use still exists.

A *private use* is found in the code (comments and docstrings are not code) as one of:

* ``obj._name`` on anything but ``self`` / ``cls``, a standard-library module, or a name the package defines itself;
* an import from a module path with a ``_part`` or of a ``_name`` (and every later use of the imported name);
* ``getattr`` / ``hasattr`` / ``setattr`` with a ``"_name"`` string;
* ``self._name`` in a class whose torch / Lightning base class holds ``_name`` (attribute or method, overrides too);
* ``obj.method = lambda ...``: a method replaced on another object's instance.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
from functools import cache
from pathlib import Path

from lightning_tp2d._private_api import PRIVATE_APIS

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_tp2d"
MODULE = "(module)"


def _files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "_private_api.py")


def _rel(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _module_name(path: Path) -> str:
    parts = ("lightning_tp2d", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own_names() -> set[str]:
    """Names the package defines itself: functions, classes, methods and module-level variables."""
    names = set()
    for path in _files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
        for node in ast.parse(path.read_text()).body:
            for target in getattr(node, "targets", [getattr(node, "target", None)]):
                if isinstance(target, ast.Name):
                    names.add(target.id)
    return names


@cache
def _external_bases(module: str, qualname: str) -> tuple[type, ...]:
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if not inspect.isclass(obj):
        return ()
    return tuple(k for k in obj.__mro__[1:] if k is not object and not k.__module__.startswith("lightning_tp2d"))


@cache
def _source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


def _base_holds(module: str, qualname: str, name: str) -> bool:
    """Whether a torch / Lightning base class of ``module.qualname`` has ``name`` (defined, or set on ``self``)."""
    pattern = re.compile(rf"\bself\.{re.escape(name)}\b")
    return any(name in vars(k) or pattern.search(_source(k)) for k in _external_bases(module, qualname))


class _Scanner(ast.NodeVisitor):
    """Collects ``(qualname of the enclosing function or class, private name)`` uses in one file."""

    def __init__(self, path: Path, own: set[str]) -> None:
        self.module, self.own = _module_name(path), own
        self.stack: list[str] = []
        self.classes: list[str | None] = []  # qualname of the enclosing class with torch/Lightning bases, or None
        self.imported: dict[str, list[str]] = {}  # local name -> the private parts of where it came from
        self.uses: set[tuple[str, str]] = set()

    def _add(self, name: str) -> None:
        self.uses.add((".".join(self.stack) or MODULE, name))

    def _scope(self, node, is_class: bool) -> None:
        self.stack.append(node.name)
        qualname = ".".join(self.stack)
        if is_class:
            external = bool(_external_bases(self.module, qualname)) if len(self.stack) == 1 else False
            self.classes.append(qualname if external else None)
        elif self.classes and self.classes[-1] and len(self.stack) == 2 and _is_private(node.name) \
                and _base_holds(self.module, self.classes[-1], node.name):
            self._add(node.name)  # overrides a private method of the base class
        self.generic_visit(node)
        if is_class:
            self.classes.pop()
        self.stack.pop()

    def visit_ClassDef(self, node):
        self._scope(node, True)

    def visit_FunctionDef(self, node):
        self._scope(node, False)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ImportFrom(self, node):
        if node.level == 0 and node.module and node.module.split(".")[0] != "lightning_tp2d":
            parts = [p for p in node.module.split(".") if _is_private(p)]
            for alias in node.names:
                private = parts + ([alias.name] if _is_private(alias.name) else [])
                for name in private:
                    self._add(name)
                if private:
                    self.imported[alias.asname or alias.name] = private

    def visit_Import(self, node):
        for alias in node.names:
            private = [p for p in alias.name.split(".") if _is_private(p)]
            for name in private:
                self._add(name)
            if private and alias.asname:
                self.imported[alias.asname] = private

    def visit_Name(self, node):
        for name in self.imported.get(node.id, ()):
            self._add(name)

    def visit_Attribute(self, node):
        receiver = node.value
        if _is_private(node.attr):
            if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls"):
                cls = next((c for c in reversed(self.classes) if c), None)
                if cls and _base_holds(self.module, cls, node.attr):
                    self._add(node.attr)
            elif not (isinstance(receiver, ast.Name) and receiver.id in sys.stdlib_module_names) \
                    and node.attr not in self.own:
                self._add(node.attr)
        self.generic_visit(node)

    def visit_Call(self, node):
        if isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1:
            arg = node.args[1]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and _is_private(arg.value) \
                    and arg.value not in self.own:
                self._add(arg.value)
        self.generic_visit(node)

    def visit_Assign(self, node):
        if isinstance(node.value, ast.Lambda):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and not (
                        isinstance(target.value, ast.Name) and target.value.id in ("self", "cls")):
                    self._add(target.attr)  # a method replaced on another object
        self.generic_visit(node)


@cache
def _found() -> frozenset[tuple[str, str, str]]:
    """Every private use in the package: ``(file, qualname, name)``."""
    own = _own_names()
    uses = set()
    for path in _files():
        scanner = _Scanner(path, own)
        scanner.visit(ast.parse(path.read_text()))
        uses |= {(_rel(path), qualname, name) for qualname, name in scanner.uses}
    return frozenset(uses)


def _tokens(api: str) -> set[str]:
    """The names the code shows for a listed API: its ``_private`` parts, or the method of an instance patch."""
    private = set(re.findall(r"(?<![\w.])_[A-Za-z]\w*|(?<=\.)_[A-Za-z]\w*", api))
    return private or set(re.findall(r"\.(\w+) = ", api))


def _places(used_in: tuple[str, ...]) -> list[tuple[str, str]]:
    return [tuple(place.split(":", 1)) for place in used_in]  # type: ignore[misc]


def _inside(qualname: str, function: str) -> bool:
    return qualname == function or qualname.startswith(function + ".")


def _listed(use: tuple[str, str, str]) -> bool:
    path, qualname, name = use
    for api, used_in, _ in PRIVATE_APIS:
        if name in _tokens(api):
            places = _places(used_in)
            # a module-level use (an import) is covered by any listed place in the file
            if any(f == path and (qualname == MODULE or _inside(qualname, fn)) for f, fn in places):
                return True
    return False


def test_every_private_use_in_the_package_is_listed():
    missing = sorted(use for use in _found() if not _listed(use))
    assert not missing, ("private APIs used but not listed in lightning_tp2d/_private_api.py "
                         f"(file, function, name): {missing}")


def test_every_listed_private_api_is_still_used_where_listed():
    found = _found()
    stale = []
    for api, used_in, why in PRIVATE_APIS:
        assert why.strip(), api
        tokens = _tokens(api)
        assert tokens, f"no private name or patched method in {api!r}"
        for path, function in _places(used_in):
            hits = {name for f, qualname, name in found if f == path and name in tokens
                    and (_inside(qualname, function) or function == MODULE == qualname)}
            if not hits:
                stale.append(f"{api} in {path}:{function}")
    assert not stale, f"listed in lightning_tp2d/_private_api.py but no longer used there: {stale}"


def test_every_listed_api_has_a_row_in_the_docstring_table():
    import lightning_tp2d._private_api as doc

    text = re.sub(r"\s+", "", doc.__doc__.replace("``", ""))
    for api, used_in, _ in PRIVATE_APIS:
        for token in _tokens(api):
            assert token in text, (api, token)
        for place in used_in:
            assert re.sub(r"\s+", "", place) in text or place.split(":")[1] in text, place


def test_the_scan_finds_each_kind_of_private_use():
    """The scanner itself: one example of each kind, from the package as it is."""
    found = _found()
    assert ("strategy.py", "TP2DStrategy._configure_launcher", "_configure_launcher") in found  # override
    assert ("nn/linear.py", "_out_shard", "_StridedShard") in found  # imported name, used
    assert ("baselines/tp1d.py", "_loss_parallel_active", "_op_dispatcher") in found  # getattr string
    assert ("callbacks.py", "StepCheckpoint.save_now", "_monitor_candidates") in found  # base method on self
    assert ("strategy.py", "TP2DStrategy._install_gradient_clipping", "clip_grad_by_norm") in found  # patch
    names = {name for _, _, name in found}
    assert not names & {"_int", "_cuda_devices", "_exit", "_run_plan", "_grad_sync_blocked"}  # ours, or stdlib
