"""Layout names live in one place, and "does this size fit" has one owner.

The names of the registered layouts (``"2d"``, ``"metp"``, ``"2d-metp"``) may appear as code only in
``lightning_tp2d/layouts.py`` (the classes, their registry, the strategy names) and ``lightning_tp2d/families.py``
(each family's plan per layout). Every other module asks the layout object (``spec.square``, ``spec.zigzag``,
``spec.packs_documents`` ...), takes a name from the user, or names a layout through its class
(``Grid2D.name``, :data:`~lightning_tp2d.layouts.DEFAULT_LAYOUT`). No other file is allowed: the benchmark's
scenario tables (``bench/measure.py``) name layouts through the classes too, so a renamed layout changes two files.
Docstrings and messages inside longer strings are prose, not code, and are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lightning_tp2d
from lightning_tp2d.layouts import Grid2D, document_layouts, layout_names
from lightning_tp2d.nn.attention import LAYOUT, refuse_documents

PACKAGE = Path(lightning_tp2d.__file__).resolve().parent
ALLOWED = {"layouts.py", "families.py"}  # the layouts themselves, and the families' registrations of their plans


def _docstrings(tree: ast.AST) -> set[int]:
    """``id`` of every docstring constant (module, class and function) of ``tree``."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def layout_name_literals(source: str, names: tuple[str, ...]) -> list[tuple[int, str]]:
    """``(line, name)`` of each string constant in ``source`` equal to one of ``names``, docstrings left out."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    return sorted((node.lineno, node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
                  and id(node) not in docs)


def test_the_walk_finds_code_literals_and_skips_docstrings():
    source = ('"""Module on "2d"."""\n'
              'def f(layout="2d"):\n'
              '    """Docstring naming "metp"."""\n'
              '    return layout in ("metp", "2d-metp") or f"{layout} on 2d"\n')
    assert layout_name_literals(source, ("2d", "metp", "2d-metp")) == [(2, "2d"), (4, "2d-metp"), (4, "metp")]


def test_layout_names_are_code_only_in_layouts_and_families():
    names = layout_names()
    assert {"2d", "metp", "2d-metp"} <= set(names)
    offenders = []
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50  # the whole package is walked
    for path in files:
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in ALLOWED:
            continue
        offenders += [f"{rel}:{line}: {name!r}" for line, name in layout_name_literals(path.read_text(), names)]
    assert offenders == [], "layout names as code outside layouts.py / families.py:\n" + "\n".join(offenders)


def test_size_rules_have_one_owner():
    """``fits`` and ``auto_tensor_parallel_size`` are defined (at module or class level) in families.py only; the
    memory checks nested inside other functions that happen to be called ``fits`` are not size rules."""
    owners = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        top = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
        top += [m for c in tree.body if isinstance(c, ast.ClassDef) for m in c.body if isinstance(m, ast.FunctionDef)]
        owners += [(path.relative_to(PACKAGE).as_posix(), f.name) for f in top
                   if f.name in ("fits", "auto_tensor_parallel_size")]
    assert sorted(owners) == [("families.py", "auto_tensor_parallel_size"), ("families.py", "fits")]


def test_the_grids_document_refusal_names_layouts_from_the_registry():
    assert LAYOUT == Grid2D() and document_layouts() == ["2d-metp", "metp"]
    refuse_documents(None, LAYOUT)  # no documents: nothing to refuse
    with pytest.raises(NotImplementedError, match=r"not implemented in layout '2d'; use the plain model or one of "
                                                  r"\['2d-metp', 'metp'\]"):
        refuse_documents(object(), LAYOUT)
