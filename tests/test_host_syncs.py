"""No training step waits on the device: zero ``.item()`` / ``nonzero`` / boolean-mask ops in a warmed-up step.

Counted with :class:`lightning_tp2d.bench.measure.HostSyncCounter` around forward, backward and the fused AdamW step
of every layout (4 ranks), as ``CausalLMModule`` runs them: token ids checked on the host batch beforehand.
"""

from __future__ import annotations

import pytest
import torch

import lightning_tp2d as tp
from lightning_tp2d.bench.measure import HostSyncCounter
from lightning_tp2d.models import GPT2, GPT2Config
from lightning_tp2d.module import CausalLMModule
from tests.distributed import run_distributed


def _count(rank: int, world_size: int, layout: str) -> dict:
    cfg = GPT2Config.from_name("gpt2-tiny", n_head=4, dropout=0.0)
    torch.manual_seed(0)
    model = tp.parallelize(GPT2(cfg), tp.init_mesh(layout, world_size, 1), layout)
    model.validate_inputs = False  # the module checked the ids on the host batch
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    idx = torch.randint(0, cfg.vocab_size, (2, 16))

    def step():
        model(idx, idx).backward()
        opt.step()
        opt.zero_grad()

    step()  # warm-up: optimizer state, lazily built communicators
    with HostSyncCounter() as syncs:
        step()
    return syncs.counts


@pytest.mark.parametrize("layout", ["2d", "metp", "2d-metp"])
def test_a_training_step_never_reads_the_device(layout):
    for rank, counts in enumerate(run_distributed(_count, 4, layout)):
        assert counts == {}, (rank, counts)


def test_the_counter_sees_item_nonzero_and_boolean_masks():
    x = torch.arange(6.0)
    with HostSyncCounter() as syncs:
        x.sum().item()
        x.nonzero()
        x[x > 2]
        x.masked_select(x > 1)
    assert syncs.counts == {"_local_scalar_dense": 1, "nonzero": 1, "index[bool]": 1, "masked_select": 1}


def test_the_module_checks_ids_on_the_host_batch_and_its_step_does_not():
    module = CausalLMModule("gpt2-tiny")
    module.configure_model()
    assert module.model.validate_inputs is False
    V = module.config.vocab_size
    good = torch.zeros(2, 8, dtype=torch.long)
    assert module.on_before_batch_transfer((good, good), 0)[0] is good
    with pytest.raises(ValueError, match=f"token ids must be in \\[0, {V}\\)"):
        module.on_before_batch_transfer((good + V, good), 0)
    with pytest.raises(ValueError, match="target ids must be in"):
        module.on_before_batch_transfer((good, good - 5), 0)
    with pytest.raises(ValueError, match="token ids must be in"):
        module.generate(good + V, 1)



def test_the_module_uses_the_fused_adamw_where_the_device_has_it():
    module = CausalLMModule("gpt2-tiny", max_steps=10)
    module.configure_model()
    optimizer = module.configure_optimizers()["optimizer"]
    assert optimizer.defaults["fused"] is True  # CPU has the fused kernel in torch 2.13
