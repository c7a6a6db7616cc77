"""CausalLMModule: weights from its seed, AdamW groups, warmup + cosine, perplexity, generation."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import lightning_tp2d as tp
from lightning_tp2d.models import GPT2, GPT2Config
from lightning_tp2d.module import TokenPerplexity, WarmupCosine
from tests.distributed import run_distributed


def _built(**kwargs) -> tp.CausalLMModule:
    module = tp.CausalLMModule("gpt2-tiny", **kwargs)
    module.configure_model()
    return module


def test_weights_come_from_init_seed_whatever_the_global_seed():
    torch.manual_seed(123)
    module = _built(init_seed=7)
    torch.manual_seed(7)
    expected = GPT2(GPT2Config.from_name("gpt2-tiny"))
    assert all(torch.equal(a, b) for a, b in zip(module.model.state_dict().values(), expected.state_dict().values()))
    assert not any(p.is_meta for p in module.parameters())  # no TP2DStrategy: built eagerly
    meta = _built(meta_init=True)
    assert all(p.is_meta for p in meta.parameters())


def test_adamw_decays_matrices_only():
    module = _built(weight_decay=0.2, max_steps=100)
    optimizer = module.configure_optimizers()["optimizer"]
    decay, no_decay = optimizer.param_groups
    names = {id(p): n for n, p in module.named_parameters()}
    assert decay["weight_decay"] == 0.2 and no_decay["weight_decay"] == 0.0
    assert sorted(names[id(p)].rsplit(".", 1)[-1] for p in decay["params"]) == ["weight"] * (1 + 1 + 2 * 4)
    assert all(names[id(p)].endswith("bias") or ".ln_" in names[id(p)] for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(module.parameters()))


def test_schedule_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    f = WarmupCosine(warmup=10, total=110, min_ratio=0.1)
    assert [f(s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(10, 200))


def test_perplexity_is_exp_of_the_token_weighted_mean_loss():
    metric = TokenPerplexity()
    metric.update(torch.tensor(2.0), torch.tensor(10))
    metric.update(torch.tensor(4.0), torch.tensor(30))
    assert metric.compute().item() == pytest.approx(math.exp((2 * 10 + 4 * 30) / 40))


def _generate(rank, world_size, layout):
    module = _built(init_seed=3)
    plain = copy.deepcopy(module)
    tp.parallelize(module.model, tp.init_mesh(layout, world_size, 1), layout)
    prompt = torch.tensor([[72, 101, 108, 108, 111]])  # one sequence of 5: padded to 2 rows / 2p chunks inside
    out = module.generate(prompt, 12, temperature=0.8, top_k=20, seed=5)
    ref = plain.generate(prompt, 12, temperature=0.8, top_k=20, seed=5)
    greedy = module.generate(prompt.repeat(2, 1), 6, temperature=0)
    return out.tolist(), ref.tolist(), greedy.tolist(), plain.generate(prompt.repeat(2, 1), 6, temperature=0).tolist()


@pytest.mark.parametrize("layout, world_size", [("2d", 4), ("metp", 2), ("2d-metp", 4)])
def test_generate_under_tensor_parallelism_samples_what_one_device_samples(layout, world_size):
    results = run_distributed(_generate, world_size, layout)
    out, ref, greedy, greedy_ref = results[0]
    assert all(r == results[0] for r in results)  # every rank drew the same tokens
    assert len(out[0]) == 17 and out[0][:5] == [72, 101, 108, 108, 111]
    assert out == ref and greedy == greedy_ref


# ---- Llama (and any registered family) through the same module -------------------------------------------------


def _llama(**kwargs) -> tp.CausalLMModule:
    module = tp.CausalLMModule("llama-tiny", **kwargs)
    module.configure_model()
    return module


def test_module_builds_the_family_of_its_model_argument():
    from lightning_tp2d.models import Llama, LlamaConfig
    from lightning_tp2d.module import CausalLMModule

    assert CausalLMModule is tp.CausalLMModule
    module = _llama(init_seed=4)
    torch.manual_seed(4)
    expected = Llama(LlamaConfig.from_name("llama-tiny"))
    assert type(module.model) is Llama and module.config == LlamaConfig.from_name("llama-tiny")
    assert all(torch.equal(a, b) for a, b in zip(module.model.state_dict().values(), expected.state_dict().values()))
    config = LlamaConfig.from_name("llama-tiny", tie_embeddings=True)
    by_instance = tp.CausalLMModule(config)
    assert by_instance.config is config and by_instance.hparams["model"] == vars(config)
    again = tp.CausalLMModule(by_instance.hparams["model"])  # the dict a checkpoint's hyper-parameters hold
    assert again.config == config
    assert tp.CausalLMModule(dict(vars(GPT2Config.from_name("gpt2-tiny")))).config == GPT2Config.from_name(
        "gpt2-tiny")
    with pytest.raises(ValueError, match=r"unknown GPT-2 config 'llama-huge'.*'gpt2-tiny'.*unknown Llama config "
                                         r"'llama-huge'.*'llama-tiny'"):
        tp.CausalLMModule("llama-huge")
    with pytest.raises(ValueError, match="match the config of no registered model family"):
        tp.CausalLMModule({"n_layer": 2})


def test_llama_adamw_decays_matrices_only():
    module = _llama(weight_decay=0.2, max_steps=100)
    decay, no_decay = module.configure_optimizers()["optimizer"].param_groups
    names = {id(p): n for n, p in module.named_parameters()}
    assert {names[id(p)].rsplit(".", 2)[-2] for p in no_decay["params"]} == {
        "input_layernorm", "post_attention_layernorm", "norm"}
    assert len(decay["params"]) == 1 + 2 * 7 + 1  # embedding, 7 matrices a layer, untied head


def test_llama_init_from_a_transformers_directory(tmp_path):
    transformers = pytest.importorskip("transformers")
    source = _llama(init_seed=9)
    hf_dir = tp.export_hf(source.model, tmp_path / "hf")
    module = tp.CausalLMModule(None, init_from=str(hf_dir), init_seed=1)
    module.configure_model()
    assert module.config == source.config
    assert all(torch.equal(a, b) for a, b in zip(module.model.state_dict().values(),
                                                 source.model.state_dict().values()))
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
    idx = torch.randint(0, 257, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(module.model.eval()(idx), hf(idx).logits)
    other = tp.CausalLMModule("llama-mini", init_from=str(hf_dir))
    with pytest.raises(ValueError, match=r"does not fit this model: n_layer: model 4, checkpoint 2"):
        other.configure_model()


def _llama_generate_and_load(rank, world_size, hf_dir):
    from lightning_tp2d.export import load_hf_weights

    module = _llama(init_seed=3)
    plain = copy.deepcopy(module)
    tp.parallelize(module.model, tp.init_mesh("2d", world_size, 1), "2d")
    prompt = torch.tensor([[72, 101, 108, 108, 111]])
    out = module.generate(prompt, 8, temperature=0.8, top_k=20, seed=5)
    ref = plain.generate(prompt, 8, temperature=0.8, top_k=20, seed=5)
    load_hf_weights(module.model, hf_dir)  # each rank keeps its shards of the directory's tensors
    loaded = tp.CausalLMModule(None, init_from=hf_dir)
    loaded.configure_model()
    idx = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (module.model.eval()(idx) - loaded.model.eval()(idx)).abs().max().item()
    return out.tolist(), ref.tolist(), diff


def test_llama_generates_and_loads_transformers_weights_under_2d(tmp_path):
    hf_dir = str(tp.export_hf(_llama(init_seed=11).model, tmp_path / "hf"))
    results = run_distributed(_llama_generate_and_load, 4, hf_dir)
    out, ref, diff = results[0]
    assert all(r[0] == out for r in results) and out == ref and len(out[0]) == 13
    assert max(r[2] for r in results) < 1e-4


class _Rates:
    """The learning rate each optimizer step runs with, by step (Lightning's callback interface, duck-typed)."""

    def __init__(self) -> None:
        self.rates: dict[int, float] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.rates[trainer.global_step] = trainer.optimizers[0].param_groups[0]["lr"]


def _fit_for_rates(max_steps: int, directory, ckpt_path=None) -> dict[int, float]:
    import lightning.pytorch as L

    class Rates(_Rates, L.Callback):
        pass

    L.seed_everything(0)
    rates = Rates()
    saves = L.callbacks.ModelCheckpoint(dirpath=directory, filename="{step}", every_n_train_steps=5, save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[rates, saves])
    module = tp.CausalLMModule("gpt2-tiny", learning_rate=1e-3, warmup_steps=2, min_lr_ratio=0.1)
    trainer.fit(module, tp.TextDataModule(block_size=16, batch_size=2, max_tokens=8_000), ckpt_path=ckpt_path)
    return {step: rate / 1e-3 for step, rate in rates.rates.items()}


def test_resuming_with_more_steps_keeps_the_rate_and_spreads_the_rest_of_the_cosine(tmp_path):
    """A 10-step run saved at step 5, resumed with max_steps=30: the rate at the resumed step is the one the run had
    there (the checkpoint's), and the rest of the cosine now ends at step 30 (it used to finish at the checkpoint's
    step 10 and stay at the floor for the 20 steps asked for). A finished schedule resumed for more steps stays at
    its floor (no jump back up)."""
    first = _fit_for_rates(10, tmp_path)
    resumed = _fit_for_rates(30, tmp_path, ckpt_path=str(tmp_path / "step=5.ckpt"))
    assert min(resumed) == 5 and resumed[5] == pytest.approx(first[5], rel=1e-9)
    after = [resumed[s] for s in range(5, 30)]
    assert all(b < a for a, b in zip(after, after[1:]))  # decays every step to the new end
    assert after[-1] == pytest.approx(0.1, abs=2e-3) and resumed[20] > 0.2  # the floor at 30, not at 10
    finished = _fit_for_rates(20, tmp_path / "more", ckpt_path=str(tmp_path / "step=10.ckpt"))
    assert min(finished) == 10 and all(rate == pytest.approx(0.1) for rate in finished.values())


def test_extending_the_schedule_keeps_its_value_at_the_step():
    schedule = WarmupCosine(warmup=4, total=40, min_ratio=0.1)
    for step, total in ((2, 80), (10, 100), (60, 30), (120, 200)):
        before = schedule(step)
        schedule.extend_to(step, total)
        assert schedule(step) == pytest.approx(before, rel=1e-12) and schedule.total == total
    assert schedule(200) == pytest.approx(0.1)
