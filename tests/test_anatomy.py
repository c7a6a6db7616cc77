"""Families answer for themselves (issue 49, part 4): :func:`lightning_tp2d.families.anatomy` says what a config's
blocks are made of, and the cost and memory models read it instead of guessing a family from a config's fields."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

import lightning_tp2d as tp
from lightning_tp2d.families import Anatomy, anatomy, model_config
from lightning_tp2d.planning.rivals import block_linears


def test_gpt2_and_llama_state_their_anatomy():
    gpt2 = model_config("gpt2-medium")
    assert anatomy(gpt2) == Anatomy(gated_mlp=False, rotary=False, rms_norm=False, fused_qkv=True, mlp_width=4096,
                                    kv_width=1024, kv_heads=16, tied_head=True)
    llama = model_config("llama-3.1-8b")  # GQA: 8 key/value heads of 128; untied
    assert anatomy(llama) == Anatomy(gated_mlp=True, rotary=True, rms_norm=True, fused_qkv=False, mlp_width=14336,
                                     kv_width=1024, kv_heads=8, tied_head=False)
    assert anatomy(model_config("llama-3.2-1b")).tied_head


def test_block_linears_read_the_anatomy():
    h = 1024
    assert block_linears(model_config("gpt2-medium")) == (((3 * h, h),), ((h, h),), ((4 * h, h),), ((h, 4 * h),))
    h, kv, inner = 4096, 1024, 14336
    assert block_linears(model_config("llama-3.1-8b")) == (((h, h), (kv, h), (kv, h)), ((h, h),),
                                                           ((inner, h), (inner, h)), ((h, inner),))


def test_a_config_of_no_family_is_refused_naming_the_families():
    @dataclass
    class Other:
        n_embd: int = 8

    with pytest.raises(ValueError, match="Other is not the config of a registered family .* GPT2, Llama"):
        anatomy(Other())


def test_the_planning_models_do_not_guess_a_family_from_config_fields():
    sniffing = re.compile(r"hasattr\(cfg, \"(intermediate_size|n_kv_head|rope_theta|tie_embeddings)\"\)"
                          r"|getattr\(cfg, \"(intermediate_size|n_kv_head|tie_embeddings)\"")
    planning = Path(tp.__file__).parent / "planning"
    found = [f"{path.name}:{n}" for path in sorted(planning.glob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if sniffing.search(line)]
    assert found == []
