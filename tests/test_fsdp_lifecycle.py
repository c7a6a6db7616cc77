"""ZeRO stage 3 over a model's whole life under ``TP2DStrategy`` (dp 2 x a ring of 2, 4 CPU ranks forked once): the
meta-device setup holds the dp shards of the blocks built and one block in full, never the rank's whole tensor shard,
with stage 0's weights; ``init_from`` fills the dp shards; a fit with gradient accumulation trains like stage 0;
``validate`` / ``test`` / ``predict`` after it give what stage 0 gives from its checkpoint; ``tp.load_gpt2`` /
``tp.load_llama`` and ``tp.export_hf`` of that checkpoint give the same weights. On a grid (dp 2 x 2x2, plain torch):
the parameters FSDP keeps whole are averaged right under accumulation, also after the model was moved between
cutting its blocks and its root (as the strategies do)."""

from __future__ import annotations

import functools
from pathlib import Path

import lightning.pytorch as L
import numpy as np
import pytest
import torch

import lightning_tp2d as tp
from lightning_tp2d import fsdp
from lightning_tp2d.planning.live import LiveTensorBytes
from lightning_tp2d.models import GPT2, GPT2Config
from lightning_tp2d.parallelize import local_parameter_bytes
from lightning_tp2d.training import average_gradients_
from lightning_tp2d.zero import even_slices, shard_optimizer_state, sharding_of
from tests.distributed import run_distributed
from tests.lightning_ranks import run_ranks

DEEP = GPT2Config.from_name("gpt2-tiny", n_layer=6)  # 6 blocks: the blocks, not the embeddings, fill a rank
STEPS = 3  # optimizer steps, two micro-batches each


class SetupBytes(L.Callback):
    """The peak live tensor bytes from the Trainer's ``setup`` hook to ``on_fit_start`` (the strategy's setup: the
    model materialised, parallelized and, at stages 2/3, sharded), then the weights as stage 0 holds them, the
    bytes this rank holds per block and for the rest in that form, and the logged losses."""

    def __init__(self) -> None:
        self.peak, self.weights, self.losses = 0, None, []
        self.blocks: list[int] = []
        self.root = 0
        self._mode: LiveTensorBytes | None = None

    def setup(self, trainer, pl_module, stage) -> None:
        self._mode = LiveTensorBytes(record_shapes=False)
        self._mode.__enter__()

    def on_fit_start(self, trainer, pl_module) -> None:
        self._mode.__exit__(None, None, None)
        self.peak = self._mode.peak
        model = pl_module.model
        self.weights = _weights(model)
        with fsdp.gathered(model):
            blocks = list(tp.family_of(model).block_modules(model))
            self.blocks = [local_parameter_bytes(b) for b in blocks]
            self.root = local_parameter_bytes(model) - sum(self.blocks)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.losses.append(trainer.callback_metrics["train_loss"].item())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _weights(model) -> dict[str, np.ndarray]:
    """Every parameter in full (a collective), as stage 0 holds it."""
    with fsdp.gathered(model):
        return {n: p.full_tensor().detach().float().clone().numpy() for n, p in model.named_parameters()}


def _trainer(stage: int, callbacks=(), **kw) -> L.Trainer:
    return L.Trainer(strategy=tp.TP2DStrategy("metp", tensor_parallel_size=2, zero_stage=stage), accelerator="cpu",
                     devices=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=1, limit_test_batches=1,
                     callbacks=list(callbacks), **kw)


def _data() -> tp.TextDataModule:
    return tp.TextDataModule(block_size=32, batch_size=2, max_tokens=20_000, prompts=["The ", "x"])


def _evaluate(trainer, module, data, ckpt_path: str | None = None) -> tuple:
    """val_loss (after loading ``ckpt_path`` when given), test_loss and this rank's predictions (prompt ids
    continued)."""
    val = trainer.validate(module, data, verbose=False, ckpt_path=ckpt_path)[0]["val_loss"]
    test = trainer.test(module, data, verbose=False)[0]["test_loss"]
    return val, test, [ids.tolist() for ids in trainer.predict(module, data)]


def _fit(stage: int, config, directory: Path, steps: int = STEPS, accumulate: int = 2, **kw) -> tuple:
    """``steps`` clipped steps of ``config`` at ``stage`` (``accumulate`` micro-batches each; ``kw`` more Trainer
    arguments); a sharded checkpoint at the end."""
    L.seed_everything(0)
    record = SetupBytes()
    trainer = _trainer(stage, [record], max_steps=steps, accumulate_grad_batches=accumulate, gradient_clip_val=0.5,
                       **kw)
    module = tp.CausalLMModule(config, learning_rate=3e-3, warmup_steps=2, init_seed=3, predict_max_new_tokens=3)
    data = _data()
    trainer.fit(module, data)
    trainer.save_checkpoint(directory / f"stage{stage}.ckpt")
    return trainer, module, data, record


def _lifecycle(rank: int, world_size: int, directory: str, hf_directory: str) -> dict:
    directory = Path(directory)
    out = {}
    trainer, module, data, record = _fit(3, DEEP, directory)
    sharding = sharding_of(trainer.strategy.optimizers[0])  # the strategy shards the optimizer at stage 3 too
    out[3] = dict(peak=record.peak, setup=record.weights, losses=record.losses, trained=_weights(module.model),
                  sharded=fsdp.is_sharded(module.model), evaluated=_evaluate(trainer, module, data),
                  zero=sharding is not None and (len(sharding._hooks), all(s is q for s, q in zip(sharding.shards,
                                                                                               sharding.params))))
    trainer, module, data, record = _fit(0, DEEP, directory)
    out[0] = dict(peak=record.peak, setup=record.weights, losses=record.losses, trained=_weights(module.model),
                  blocks=record.blocks, root=record.root)
    # stage 0 from the stage-3 checkpoint: the same weights, so the same numbers
    out["from_3"] = _evaluate(trainer, module, data, ckpt_path=str(directory / "stage3.ckpt"))
    out["from_3_weights"] = _weights(module.model)
    # a meta-device model at stage 3 from a transformers directory: every tensor into the dp shards
    pretrained = tp.CausalLMModule(model=None, init_from=hf_directory)
    _trainer(3).validate(pretrained, _data(), verbose=False)
    out["init_from"] = (fsdp.is_sharded(pretrained.model), _weights(pretrained.model))
    trainer, module, _, _ = _fit(3, "llama-tiny", directory / "llama", steps=1, accumulate=1)
    out["llama"] = _weights(module.model)
    # bf16-true: the precision plugin converts the model after its blocks were cut at setup (FSDP re-registers
    # their shards); the root is cut after it
    for stage in (3, 0):
        _, module, _, record = _fit(stage, "gpt2-tiny", directory / f"bf16-{stage}", steps=3, accumulate=1,
                                    precision="bf16-true")
        out[f"bf16_true_{stage}"] = (record.losses, sorted({str(p.dtype) for p in module.parameters()}),
                                     fsdp.is_sharded(module.model))
    # blocks cut at stage 2 while built: finishing the model at stage 3 is refused before anything changes
    with torch.device("meta"):
        model = GPT2(GPT2Config.from_name("gpt2-tiny"))
    tp.parallelize(model, tp.init_mesh("metp", 2, 2), "metp", on_block=functools.partial(fsdp.shard_block, stage=2))
    with pytest.raises(ValueError) as refused:
        fsdp.shard_data_parallel(model, 3)
    out["refused"] = (str(refused.value), fsdp.is_sharded(model))
    out["finished"] = fsdp.is_sharded(fsdp.shard_data_parallel(model, 2))
    return out


@pytest.fixture(scope="module")
def lifecycle(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fsdp_lifecycle")
    torch.manual_seed(11)
    hf = tp.export_hf(GPT2(GPT2Config.from_name("gpt2-tiny")), directory / "hf")
    runs = run_ranks(_lifecycle, 4, str(directory), str(hf), timeout=600)
    return directory, hf, runs


def _max_diff(a: dict, b: dict) -> float:
    assert list(a) == list(b)
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def test_stage_3_setup_holds_the_dp_shards_of_the_blocks_and_one_block_in_full(lifecycle):
    """Each block is cut over data_parallel as soon as it is built: the setup's peak stays within the dp shard of
    the blocks' tensor shards, the tensor shards of the rest (embeddings, final norm: cut last, with the root) and
    one block both in full and in its tensor shard (the module being materialised next to the shards made from
    it); stage 0's setup holds every block's tensor shard and goes past that. The weights equal stage 0's."""
    _, _, runs = lifecycle
    plain_block = sum(p.numel() * 4 for p in GPT2(DEEP).transformer.h[0].parameters())
    for run in runs:
        blocks, root = run[0]["blocks"], run[0]["root"]
        bound = sum(blocks) / 2 + root + plain_block + max(blocks)
        assert run[3]["peak"] <= bound, (run[3]["peak"], bound)
        assert run[0]["peak"] > bound, (run[0]["peak"], bound)  # what stage 3 used to hold too
        assert run[3]["sharded"] and _max_diff(run[3]["setup"], run[0]["setup"]) == 0
        # on the ring FSDP cuts every parameter: the optimizer's sharding passes each through, with no step hook
        assert run[3]["zero"] == (0, True), run[3]["zero"]


def test_gradient_accumulation_at_stage_3_trains_like_stage_0(lifecycle):
    """accumulate_grad_batches=2 under the Trainer: FSDP skips the reduce-scatter on the first micro-batch and
    reduce-scatters the sum on the second; the weights move by ~lr per step and stay within float32 noise of
    stage 0's (whose all-reduce rounds the sums differently)."""
    _, _, runs = lifecycle
    for run in runs:
        three, zero = run[3], run[0]
        assert len(three["losses"]) == len(zero["losses"]) == STEPS
        assert max(abs(a - b) / a for a, b in zip(three["losses"], zero["losses"])) <= 1e-5
        assert _max_diff(three["trained"], zero["trained"]) <= 2e-5
        assert _max_diff(three["trained"], zero["setup"]) > 1e-3  # it trained


def _accumulate(rank: int, world_size: int) -> dict:
    """3 AdamW steps of two micro-batches each on dp 2 x a 2x2 grid: stage 0 (local sums, then one average) and
    stage 3 built block by block and moved between cutting the blocks and the root, as the strategies do."""
    mesh = tp.init_mesh("2d", 4, 2)
    out = {}
    for stage in (0, 3):
        torch.manual_seed(3)
        with torch.device("meta"):
            model = GPT2(GPT2Config.from_name("gpt2-tiny"))
        tp.parallelize(model, mesh, "2d", on_block=functools.partial(fsdp.shard_block, stage=3) if stage else None)
        if stage:
            model.to("cpu")  # replaces the DTensor parameters FSDP does not manage by new Parameters
            fsdp.shard_data_parallel(model, 3)
            out["whole"] = sorted(f"{n}.{w}" for n, m in model.named_modules() for w in getattr(m, "tp2d_whole", ()))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if stage:  # as the strategies do: the whole-kept biases' AdamW state in ZeRO-1's slices
            sharding = shard_optimizer_state(optimizer, mesh)
        torch.manual_seed(10 + mesh.get_local_rank("data_parallel"))
        for _ in range(3):
            for micro in range(2):
                if stage:
                    model.set_requires_gradient_sync(micro == 1)
                idx = torch.randint(0, 257, (2, 16))
                (model(idx, idx) / 2).backward()
            if not stage:
                average_gradients_(model, mesh)
            optimizer.step()
            optimizer.zero_grad()
        out[stage] = _weights(model)
        if stage:  # (exp_avg elements on this rank, of the local bias) per whole-kept bias
            biases = [model.get_parameter(n) for n in out["whole"]]
            out["whole_state"] = [(_local(optimizer.state[sharding.shard_of(b)]["exp_avg"]).numel(), _local(b).numel())
                                  for b in biases]
    out["dp"] = (mesh.get_local_rank("data_parallel"), 2)
    return out


def test_parameters_kept_whole_average_over_dp_under_accumulation_on_a_grid():
    """The grids' fused c_attn.bias (strided over a tensor axis, 1-D: no dim FSDP can cut) stays whole; its hook
    averages it after each backward (the first micro-batch's average plus the second's gradients, averaged again:
    the mean of the sum). The hook survives ``model.to(...)`` between cutting the blocks and the root (a hook
    registered on the old Parameter was lost there: those biases then trained on one replica's gradients)."""
    for run in run_distributed(_accumulate, 8, timeout=600):
        assert run["whole"] == ["transformer.h.0.attn.c_attn.bias", "transformer.h.1.attn.c_attn.bias"]
        r, dp = run["dp"]  # each rank steps its ceil(n/dp) slice of them (or the rest), read from the average
        for held, n in run["whole_state"]:
            start, stop = even_slices(n, dp)[r]
            assert held == stop - start and 0 < held < n, run["whole_state"]
        # AdamW moves every weight by ~lr = 1e-2 a step, and turns rounding in ~0 gradients (the key bias: the
        # softmax ignores it) into noise of ~1e-5; unaveraged biases (the lost hook) were off by 4e-2
        assert _max_diff(run[3], run[0]) <= 2e-4


def test_bf16_true_at_stage_3_under_the_trainer_trains_like_stage_0(lifecycle):
    """precision="bf16-true" with a meta-device model: its blocks are cut over data_parallel while built, then the
    precision plugin converts the model to bf16, then the root is cut; bf16 parameters, gradients reduce-scattered
    in float32 and rounded once (fsdp.mixed_precision_policy): the same losses as stage 0's bf16 all-reduce at dp 2
    (the sum of two bf16 numbers is exact in float32, and rounds once either way)."""
    _, _, runs = lifecycle
    for run in runs:
        (three, dtypes3, sharded), (zero, dtypes0, _) = run["bf16_true_3"], run["bf16_true_0"]
        assert sharded and dtypes3 == dtypes0 == ["torch.bfloat16"]
        assert len(three) == len(zero) == 3
        assert max(abs(a - b) / a for a, b in zip(three, zero)) <= 1e-6, (three, zero)


def test_validate_test_and_predict_after_a_stage_3_fit_equal_stage_0_on_its_checkpoint(lifecycle):
    _, _, runs = lifecycle
    for run in runs:
        assert _max_diff(run["from_3_weights"], run[3]["trained"]) == 0
        (val, test, predicted), (val0, test0, predicted0) = run[3]["evaluated"], run["from_3"]
        assert 0 < val < 6 and 0 < test < 6
        assert (val, test) == pytest.approx((val0, test0), rel=1e-6)
        assert predicted == predicted0 and len(predicted) == 1  # 2 prompts over 2 replicas
        assert [len(p[0]) for p in predicted] in ([4 + 3], [1 + 3])


def test_load_and_export_of_a_stage_3_checkpoint_give_stage_0s_weights(lifecycle, tmp_path):
    directory, _, runs = lifecycle
    weights = runs[0]["from_3_weights"]
    loaded = tp.load_gpt2(directory / "stage3.ckpt")
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert _max_diff({n: p.detach().numpy() for n, p in loaded.named_parameters()}, weights) == 0
    exported = tp.load_hf_model(tp.export_hf(directory / "stage3.ckpt", tmp_path / "hf"))
    assert _max_diff({n: p.detach().numpy() for n, p in exported.named_parameters()}, weights) == 0
    llama = tp.load_llama(directory / "llama" / "stage3.ckpt")
    assert _max_diff({n: p.detach().numpy() for n, p in llama.named_parameters()}, runs[0]["llama"]) == 0


def test_init_from_at_stage_3_loads_every_tensor_into_the_dp_shards(lifecycle):
    _, hf, runs = lifecycle
    expected = {n: p.detach().numpy() for n, p in tp.load_hf_model(hf).named_parameters()}
    for run in runs:
        sharded, weights = run["init_from"]
        assert sharded and _max_diff(weights, expected) == 0


def test_blocks_cut_at_another_stage_are_refused_naming_it(lifecycle):
    _, _, runs = lifecycle
    for run in runs:
        message, sharded = run["refused"]
        assert "block 'transformer.h.0' is already sharded at stage 2" in message and not sharded
        assert run["finished"]  # the refusal changed nothing: the same stage finishes it


def test_shard_block_refuses_a_plain_block_and_other_stages():
    block = GPT2(GPT2Config.from_name("gpt2-tiny")).transformer.h[0]
    with pytest.raises(ValueError, match="shard_block expects a block of a model parallelized by"):
        fsdp.shard_block(block)
    with pytest.raises(ValueError, match=r"shard_block: stage=1 is not one of \(2, 3\)"):
        fsdp.shard_block(block, 1)
