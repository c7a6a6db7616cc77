"""The rivals are registered objects (:mod:`lightning_tp2d.rivals`), and the registries are the only dispatch.

* The registry answers what the bench, the cost model and the planner ask of a rival: its ranks, how it cuts them,
  the input it needs, the families it runs, whether it is planned or priced, and whose host counts price it.
* :func:`lightning_tp2d.planning.rival_models.model_of` is how ``price`` and ``row_memory`` find a row's cost and
  memory model: every priced rival has one, and a package layout gets the layouts' model.
* A rival's name is code only in ``rivals.py``: everywhere else it is read from the registry
  (``TP1D_SP.name``, ``get_rival(name).context_parallel`` ...). The few strings spelled like a rival but naming
  something else (a mesh axis ``"cp"``, a tokenizer and a family attribute ``"hf"``) are listed here with the reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import lightning_tp2d
from lightning_tp2d import rivals
from lightning_tp2d.layouts import layout_names
from lightning_tp2d.planning import rival_models
from lightning_tp2d.rivals import (CP, CP_TP, HF, SINGLE, TP1D, TP1D_SP, ULYSSES, Rival, get_rival, is_rival,
                                   register_rival, rival_names)
from tests.test_layout_names import layout_name_literals

PACKAGE = Path(lightning_tp2d.__file__).resolve().parent

# strings spelled like a rival that name something else: (file, line text) -> why
NOT_RIVALS = {
    ("baselines/context_parallel.py", 'CP_AXIS, TP_AXIS = "cp", "tp"'): "torch CP's mesh axis",
    ("planning/rivals.py", 'RING_AXIS = "cp"'): "the CP ring's group in the declared events",
    ("data/tokenizers.py", 'name = "hf"'): "the transformers tokenizer's name",
    ("train.py", 'getattr(family_of_config(model), "hf", None)'): "a family's transformers format",
}


def test_the_registry_holds_every_rival_once_and_no_layout():
    assert rival_names() == ("single", "hf", "tp1d", "tp1d-sp", "cp", "cp-tp", "ulysses")
    assert not set(rival_names()) & set(layout_names())
    assert get_rival("cp") is CP and get_rival(CP) is CP and is_rival("cp-tp") and not is_rival("2d")
    assert not is_rival(None) and not is_rival(3)
    with pytest.raises(ValueError, match=r"unknown rival 'tp3d'; registered: \['single', 'hf', 'tp1d'"):
        get_rival("tp3d")
    with pytest.raises(ValueError, match="already registered"):
        register_rival(Rival("cp", "again"))
    with pytest.raises(ValueError, match="would hide the layout"):
        register_rival(Rival(layout_names()[0], "a rival named as a layout"))
    assert rivals.rivals(priced=True) == (TP1D_SP, CP, CP_TP, ULYSSES)
    assert rivals.rivals(planned=True) == (TP1D_SP,)
    assert rivals.rivals(torchtitan=True) == (TP1D_SP, CP, CP_TP)


def test_a_rival_says_how_it_runs():
    assert [r.ranks(8) for r in (SINGLE, HF, TP1D, TP1D_SP, CP, CP_TP, ULYSSES)] == [1, 1, 8, 8, 8, 8, 8]
    assert SINGLE.split(8) == (1, 1) and TP1D_SP.split(8) == (1, 8) and ULYSSES.split(8) == (8, 1)
    assert CP.split(8) == (8, 1) and CP_TP.split(8) == (4, 2) and CP_TP.split(8, cp_tp_size=4) == (2, 4)
    # (batch, sequence) multiples: SP and Ulysses cut the sequence by p; CP cuts 2 x (CP ranks) chunks, each pair
    # split again by cp-tp's inner SP
    assert SINGLE.input_multiples(4) == TP1D.input_multiples(4) == (1, 1)
    assert TP1D_SP.input_multiples(4) == ULYSSES.input_multiples(4) == (1, 4)
    assert CP.input_multiples(4) == (1, 8) and CP_TP.input_multiples(8) == (1, 8)
    assert CP.input_multiples(6) == (1, 12) and CP_TP.input_multiples(6, cp_tp_size=3) == (1, 12)
    assert HF.runs("gpt2") and not HF.runs("llama") and TP1D_SP.runs("llama") and not CP.runs("gpt2")
    assert (CP_TP.host_ops, ULYSSES.host_ops, TP1D_SP.host_ops) == ("cp", "single", None)


def test_every_priced_rival_has_a_cost_and_memory_model():
    for rival in rivals.rivals(priced=True):
        model = rival_models.model_of(rival.name)
        assert model.rival is rival and model.torch_code
    assert rival_models.model_of(TP1D_SP.name).baseline
    assert not any(rival_models.model_of(r.name).baseline for r in (CP, CP_TP, ULYSSES))
    for name in layout_names():
        model = rival_models.model_of(name)
        assert model.rival is None and not model.baseline and not model.torch_code and model.name == name
    with pytest.raises(ValueError, match="prices no registered rival"):
        rival_models.register_model(rival_models.SideModel("2d"))


def test_rival_names_are_code_only_in_the_registry():
    names = rival_names()
    offenders, seen = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "rivals.py":
            continue
        lines = path.read_text().splitlines()
        for line, name in layout_name_literals(path.read_text(), names):
            allowed = [key for key in NOT_RIVALS if key[0] == rel and key[1] in lines[line - 1]]
            seen.update(allowed)
            if not allowed:
                offenders.append(f"{rel}:{line}: {name!r}")
    assert offenders == [], "rival names as code outside rivals.py:\n" + "\n".join(offenders)
    assert seen == set(NOT_RIVALS)  # every exception is still there (else drop it from the list)
