"""Under ``bf16-mixed`` every layout passes and saves its activations in bf16, at every ZeRO stage.

Autocast casts matmul operands only: before, the residual stream of the plain model and of every layout stayed
float32 at ZeRO 0 and 1 (the embedding's output, the residual adds, the norms' float32 upcasts), so full activation
checkpointing kept each block's input in float32 (17.4 GiB of Llama 3.1 8B's 33.8 at 256k tokens on a ring of 8)
where FSDP's bf16 ``param_dtype`` (stages 2 and 3) keeps bf16. Now the models cast the embedding output to the
autocast dtype (``gpt2.in_compute_dtype``) and the norms keep their input's dtype, so the block inputs, the tensors
the blocks save for the backward and the blocks' outputs are bf16 whatever the stage; parameters, gradients and the
optimizer state stay float32. Statistics the kernels keep in float32 (log-sum-exp, reciprocal RMS: one number per
row and head) and the loss's float32 logits block are allowed.
"""

from __future__ import annotations

import collections

import torch

import lightning_tp2d as tp
from lightning_tp2d import fsdp
from lightning_tp2d.families import family_of
from lightning_tp2d.models.gpt2 import GPT2, GPT2Config
from lightning_tp2d.models.llama import Llama, LlamaConfig, rms_norm
from lightning_tp2d.parallelize import checkpoint_activations
from tests.distributed import run_distributed

# (family, layout, p, zero stage, checkpointing) on 4 ranks: dp = 4 // p
CASES = [
    ("llama", "metp", 4, 0, "full"), ("llama", "metp", 2, 1, "none"), ("llama", "metp", 2, 3, "full"),
    ("llama", "2d", 4, 0, "none"), ("llama", "2d-metp", 4, 0, "full"),
    ("gpt2", "metp", 4, 0, "none"), ("gpt2", "2d", 4, 0, "full"), ("gpt2", "2d-metp", 4, 0, "none"),
]


def _model(family: str):
    torch.manual_seed(0)
    if family == "llama":
        return Llama(LlamaConfig.from_name("llama-tiny"))
    return GPT2(GPT2Config.from_name("gpt2-tiny", dropout=0.0))


def _saves(family: str, layout: str, p: int, stage: int, checkpointing: str, world_size: int) -> dict:
    mesh = tp.init_mesh(layout, p, world_size // p)
    plain = _model(family)
    plain.residual_in_compute_dtype = True  # as parallelize() sets it: the same bf16 stream
    model = tp.parallelize(_model(family), mesh, layout)
    if stage >= 2:
        fsdp.shard_data_parallel(model, stage, mp_policy=fsdp.mixed_precision_policy("bf16-mixed"))
    checkpoint_activations(model, checkpointing)
    cfg = plain.config
    idx = torch.randint(0, cfg.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1))
    inside = [0]  # > 0 while a transformer block's forward runs
    saved = collections.Counter()  # (dtype, "block" | "outside", small) -> count
    boundary = set()  # dtypes of the blocks' inputs and outputs
    block_rows = []

    def enter(module, args):
        inside[0] += 1
        boundary.add(str(args[0].dtype))
        block_rows.append(args[0].numel())

    def leave(module, args, out):
        inside[0] -= 1
        boundary.add(str(out.dtype))

    for block in family_of(model).block_modules(model):
        block.register_forward_pre_hook(enter)
        block.register_forward_hook(leave)

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and inside[0]:
            small = block_rows and t.numel() * 4 <= block_rows[-1]  # statistics: under a quarter of the block input
            saved[str(t.dtype).removeprefix("torch."), "small" if small else "large"] += 1
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(idx, idx)
        reference = plain(idx, idx)
    loss.backward()
    grads = {str(p.grad.dtype) for p in model.parameters() if p.grad is not None}
    return {"saved": dict(saved), "boundary": sorted(boundary), "loss": loss.item(), "reference": reference.item(),
            "grads": sorted(grads)}


def _worker(rank: int, world_size: int) -> list[dict]:
    return [_saves(*case, world_size) for case in CASES]


def test_every_layout_saves_bf16_activations_at_every_stage_under_bf16_mixed():
    for rank, results in enumerate(run_distributed(_worker, 4, timeout=600)):
        for case, got in zip(CASES, results):
            large = {dtype: n for (dtype, size), n in got["saved"].items() if size == "large"}
            assert set(large) == {"bfloat16"}, (rank, case, got["saved"])
            assert got["boundary"] == ["torch.bfloat16"], (rank, case, got)  # every block's input and output
            assert got["grads"] == ["torch.float32"], (rank, case, got)  # master gradients stay float32
            # the plain model under the same autocast runs a bf16 residual stream too: the same loss to bf16 rounding
            assert abs(got["loss"] - got["reference"]) <= 2e-2 * abs(got["reference"]), (rank, case, got)


def test_plain_models_keep_their_float32_stream_unless_asked_and_the_norms_keep_bf16():
    """Outside autocast nothing changes (the float32 and float64 parity tests keep their tolerances). Under it a
    plain model keeps autocast's float32 residual stream (the 1-D TP and CP baselines run it so, and their
    analytic rules count it so) unless ``residual_in_compute_dtype`` is set, as :func:`parallelize` sets it; then
    the stream is bf16 and the norms keep it bf16. The bf16 RMSNorm's backward agrees with float64 autograd."""
    for family in ("llama", "gpt2"):
        model = _model(family)
        idx = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
        seen = set()
        for block in family_of(model).block_modules(model):
            block.register_forward_hook(lambda m, a, out: seen.add(out.dtype))
        for flag, expected in ((False, torch.float32), (True, torch.bfloat16)):
            model.residual_in_compute_dtype = flag
            model(idx, idx)
            assert seen == {torch.float32}, (family, flag)  # no autocast: float32 either way
            seen.clear()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(idx, idx).backward()
            assert seen == {expected}, (family, flag, seen)
            seen.clear()
    x = torch.randn(8, 32, dtype=torch.float64)
    w64 = torch.randn(32, dtype=torch.float64).requires_grad_()
    w32 = w64.detach().float().requires_grad_()
    xb = x.to(torch.bfloat16).requires_grad_()
    x64 = xb.detach().double().requires_grad_()
    g = torch.randn(8, 32, dtype=torch.float64)
    rms_norm(xb, w32, 1e-5).backward(g.to(torch.bfloat16))
    rms_norm(x64, w64, 1e-5).backward(g)
    assert xb.grad.dtype == torch.bfloat16 and w32.grad.dtype == torch.float32
    assert torch.allclose(xb.grad.double(), x64.grad, rtol=3e-2, atol=3e-2)
    assert torch.allclose(w32.grad.double(), w64.grad, rtol=3e-2, atol=3e-2)


def test_bf16_rms_norm_in_row_chunks_equals_one_chunk(monkeypatch):
    """The bf16 RMSNorm bounds its float32 temporaries by running chunks of rows: the output and the input gradient
    equal one chunk's bit for bit (row-wise arithmetic), the weight gradient to float32 summation order."""
    from lightning_tp2d.models import llama
    x = torch.randn(3, 700, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).requires_grad_()
    w = torch.randn(64, generator=torch.Generator().manual_seed(4)).requires_grad_()
    g = torch.randn(3, 700, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    runs = []
    for elements in (1 << 24, 64 * 100):  # one chunk; 21 chunks of 100 rows
        monkeypatch.setattr(llama, "NORM_CHUNK_ELEMENTS", elements)
        assert len(llama._row_chunks(2100, 64)) == (1 if elements > 2100 * 64 else 21)
        x.grad = w.grad = None
        y = rms_norm(x, w, 1e-5)
        y.backward(g)
        runs.append((y.detach(), x.grad.clone(), w.grad.clone()))
    (y1, dx1, dw1), (y2, dx2, dw2) = runs
    assert torch.equal(y1, y2) and torch.equal(dx1, dx2)
    assert torch.allclose(dw1, dw2, rtol=1e-5, atol=1e-4)
