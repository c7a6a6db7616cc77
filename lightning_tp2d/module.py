"""``CausalLMModule``: causal language-model training (GPT-2, Llama, any registered model family) for any
strategy, TP2DStrategy included.

The module holds a plain model of a registered family (:mod:`lightning_tp2d.families`: a
:class:`~lightning_tp2d.models.GPT2` or a :class:`~lightning_tp2d.models.Llama`, picked by the ``model`` argument:
a named size of any family, a config instance, or a config's fields) and no parallel code: under
:class:`~lightning_tp2d.strategy.TP2DStrategy` it is built on the meta device and the strategy materialises only
each rank's shards (from ``init_seed``, so the full weights equal an eager build with that seed on one device).
With ``init_from`` the weights come from a local transformers directory of the same family instead (fine-tuning):
on one device loaded right after the build in ``configure_model``; under TP2DStrategy each rank loads only its
shards, tensor by tensor, right after the strategy materialised them (the family's ``load_hf`` hook,
:func:`~lightning_tp2d.export.load_hf_weights`), which is before Lightning restores a ``ckpt_path``, so a resumed
fine-tuning run continues from its checkpoint's weights. ``GPT2LightningModule`` is an older name of the same class.

Optimisation: AdamW (the fused kernel where the device has one, else foreach; foreach under ``16-mixed`` with clipping,
whose scaled gradients a fused step unscales only after the clip; ``bf16-mixed`` clips a fused AdamW, on any strategy) with decoupled weight decay on
matrices and embeddings only (no decay on biases, LayerNorm and RMSNorm), learning rate ``lr * f(step)`` with linear warmup to 1 over ``warmup_steps`` then cosine decay to
``min_lr_ratio`` at ``max_steps`` (default: the Trainer's estimated optimizer steps).

Token ids are checked on the host batch before it moves to the device (``on_before_batch_transfer``); the model's
own per-forward value check is off, so a training step never waits for the device to read ids back.

Metrics: ``train_loss`` (every step) and ``val_loss`` / ``val_perplexity`` (per validation epoch), averaged over
data-parallel replicas. Perplexity is ``exp(Σ nll / Σ tokens)`` accumulated by a torchmetrics ``Metric``: the
vocab-parallel loss never forms full logits, so a logits-based perplexity metric does not apply.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torchmetrics import Metric

from lightning_tp2d.export import hf_loader, hf_model_config
from lightning_tp2d.families import family_of_config
from lightning_tp2d.layouts import handle_of
from lightning_tp2d.families import model_config
from lightning_tp2d.models.config import max_seq_len
from lightning_tp2d.models.gpt2 import GPT2, GPT2Config
from lightning_tp2d.models.llama import Llama, LlamaConfig
from lightning_tp2d.precision import allow_clipping_without_scaler
from lightning_tp2d.quiet import silence_known_noise
from lightning_tp2d.strategy import TP2DStrategy
from lightning_tp2d.values import check_number


class TokenPerplexity(Metric):
    """``exp(Σ nll / Σ tokens)`` over all updates and (on ``compute``) all ranks of its process group."""

    full_state_update = False
    higher_is_better = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("nll", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("tokens", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, mean_nll: torch.Tensor, tokens: torch.Tensor) -> None:
        self.nll += mean_nll.detach().double() * tokens
        self.tokens += tokens

    def compute(self) -> torch.Tensor:
        return torch.exp(self.nll / self.tokens)


class WarmupCosine:
    """``f(step)``: linear warmup ``(step+1)/warmup`` then cosine from 1 to ``min_ratio`` at ``total`` steps.

    The cosine's progress runs from ``anchor_progress`` at ``anchor_step`` (0 and the end of the warmup, unless the
    schedule was extended) linearly to 1 at ``total``. :meth:`extend_to` moves ``total`` (a run resumed with another
    ``max_steps``) without a jump: the rate at the resumed step stays what it was, and the rest of the cosine is
    spread over the new remaining steps. A finished schedule stays at ``min_ratio``. The whole state is plain
    attributes, which ``LambdaLR.state_dict`` saves and a resume restores."""

    def __init__(self, warmup: int, total: int, min_ratio: float) -> None:
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio
        self.anchor_step, self.anchor_progress = 0, 0.0

    def progress(self, step: int) -> float:
        """How far along the cosine ``step`` is: 0 at its start, 1 at ``total`` and after."""
        start = max(self.warmup, self.anchor_step)
        return min(1.0, self.anchor_progress + (1.0 - self.anchor_progress) * max(0, step - start)
                   / max(1, self.total - start))

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * self.progress(step)))

    def extend_to(self, step: int, total: int) -> None:
        """Make the schedule end at ``total`` from ``step`` on, with ``f(step)`` unchanged."""
        if total == self.total:
            return
        if step > self.warmup:  # inside the cosine: keep its phase at this step
            self.anchor_step, self.anchor_progress = step, self.progress(step)
        self.total = total


DEFAULT_MODEL = "gpt2-tiny"  # CausalLMModule's model when neither model nor init_from is given


class CausalLMModule(L.LightningModule):
    """Causal language model: GPT-2, Llama, or a model of any registered family (older name:
    ``GPT2LightningModule``).

    Args:
        model: a named size of any registered family (``"gpt2"``, ``"gpt2-medium"`` ... ``"gpt2-tiny"``,
            ``"llama-tiny"``, ``"llama-mini"``, ``"llama-3.2-1b"`` ...), a config (:class:`GPT2Config`,
            :class:`~lightning_tp2d.models.LlamaConfig`) or its fields as a dict (what the checkpoint's
            hyper-parameters record; the family is the one whose config has exactly those fields). ``None`` (the
            default): ``init_from``'s ``config.json`` (family, sizes, RoPE scaling, tied embeddings, vocabulary),
            or :data:`DEFAULT_MODEL` without ``init_from``.
        learning_rate: peak learning rate.
        weight_decay: AdamW decoupled weight decay for weights of dimension >= 2.
        betas, eps: AdamW's.
        warmup_steps: linear warmup length in optimizer steps.
        max_steps: end of the cosine decay; ``None``: the Trainer's estimated optimizer steps.
        min_lr_ratio: final learning rate as a fraction of ``learning_rate``.
        init_seed: the weights are drawn from this seed, the same whatever the strategy, layout or grid.
        init_from: a local transformers directory of the model's family (GPT-2 or Llama: ``config.json`` +
            ``model.safetensors`` or
            ``pytorch_model.bin``) to start from instead of the random init; a ``model`` given must have its sizes (a
            smaller ``block_size`` is fine); ``None`` takes them from its ``config.json``. Recorded in the
            hyper-parameters: ``load_from_checkpoint(path, init_from=None)`` skips re-reading it (the checkpoint's
            weights replace it anyway).
        meta_init: build on the meta device (materialised shard by shard by TP2DStrategy); ``None``: exactly when
            the strategy is a TP2DStrategy.
        predict_max_new_tokens, predict_temperature, predict_top_k: how ``trainer.predict`` continues each prompt
            (:meth:`generate`; temperature 0: greedy). Prompts come from ``TextDataModule(prompts=[...])``; decode
            the returned ids with its ``decode``.
        loss_on_progress_bar: log ``train_loss`` with ``prog_bar=True``. Lightning turns every progress-bar value
            into a float after every batch: on a GPU a host sync per step. ``tp2d-train`` sets ``False``: its bars
            (:class:`~lightning_tp2d.callbacks.ResumableProgressBar`, ``ResumableRichProgressBar``) show the loss
            read only on the steps Lightning writes its logs. The loggers and ``callback_metrics`` get
            ``train_loss`` every step either way.
    """

    def __init__(self, model: str | GPT2Config | LlamaConfig | dict | None = None, learning_rate: float = 6e-4,
                 weight_decay: float = 0.1, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 warmup_steps: int = 100, max_steps: int | None = None, min_lr_ratio: float = 0.1, init_seed: int = 0,
                 meta_init: bool | None = None, predict_max_new_tokens: int = 32, predict_temperature: float = 1.0,
                 predict_top_k: int | None = None, init_from: str | None = None,
                 loss_on_progress_bar: bool = True) -> None:
        super().__init__()
        check_optimizer_values(learning_rate=learning_rate, weight_decay=weight_decay, betas=betas, eps=eps,
                               warmup_steps=warmup_steps, max_steps=max_steps, min_lr_ratio=min_lr_ratio)
        check_number("init_seed", init_seed, integer=True, meaning="the seed the weights are drawn from")
        check_sampling(predict_max_new_tokens, predict_temperature, predict_top_k,
                       names=("predict_max_new_tokens", "predict_temperature", "predict_top_k"))
        silence_known_noise()  # e.g. Lightning's note that this module's on_before_batch_transfer is used
        if model is None:  # the directory's model, else the default size
            model = DEFAULT_MODEL if init_from is None else hf_model_config(init_from)
        self.config = model_config(model)
        self.family = family_of_config(self.config)
        self.save_hyperparameters(ignore=["model"])
        self.hparams["model"] = model if isinstance(model, str) else dict(vars(self.config))  # plain types only
        self.init_seed = init_seed
        # read by TP2DStrategy too: it loads this into the shards it materialises from the meta device
        self.init_from = None if init_from is None else str(init_from)
        self.model: GPT2 | Llama | None = None
        self.val_perplexity = TokenPerplexity()
        self._schedule_total: int | None = None  # the schedule's length this run (configure_optimizers)

    # ---- model ---------------------------------------------------------------------------------------------

    def configure_model(self) -> None:
        if self.model is not None:
            return
        meta = self.hparams.meta_init
        if meta is None:
            strategy = self.trainer.strategy if self._trainer is not None else None
            # (pipeline stages loading init_from: on the host, where the transformers weights are read whole)
            meta = isinstance(strategy, TP2DStrategy) and strategy.builds_on_meta(self.init_from)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.init_seed)
            if meta:
                with torch.device("meta"):
                    self.model = self.family.model_class(self.config)
            else:
                self.model = self.family.model_class(self.config)
        if self.init_from is not None and not meta:  # a meta model gets them from TP2DStrategy, shard by shard
            load = hf_loader(self.family)
            if load is None:
                raise ValueError(f"init_from: model family {self.family.name!r} has no transformers loader")
            load(self.model, self.init_from)
        # token ids are checked on the host batch before it moves to the device (on_before_batch_transfer), so the
        # training step itself never waits on the device to read them
        self.model.validate_inputs = False

    def setup(self, stage: str) -> None:
        """Check the data against the model before any training: ids within the vocabulary, windows that fit."""
        dm = self.trainer.datamodule if self._trainer is not None else None
        if dm is None:
            return
        V, T = self.config.vocab_size, self.config.block_size
        max_id = getattr(dm, "max_token_id", None)
        if max_id is not None and max_id >= V:
            raise ValueError(f"the data holds token id {max_id} but the model's vocab_size is {V}: use a model whose "
                             f"vocab_size is at least {max_id + 1} (tokenizer {getattr(dm, 'tokenizer_name', '?')!r})")
        self.check_data_sizes(dm)

    def check_data_sizes(self, datamodule) -> None:
        """Raise ``ValueError`` when the data's windows are longer than the positions the model embeds (cheap: no data
        is read; :class:`~lightning_tp2d.strategy.TP2DStrategy` calls it before Lightning starts the other ranks)."""
        block, T = getattr(datamodule, "block_size", None), max_seq_len(self.config)  # None: any length (RoPE)
        if block is not None and T is not None and block > T:
            raise ValueError(f"data block_size {block} exceeds the model's block_size {T}: lower the data module's "
                             f"block_size, or use a model with block_size >= {block}")

    def on_train_start(self) -> None:
        # resumed with another max_steps: the checkpoint restored the schedule it was saved with; end it at this
        # run's length from the step reached, keeping the rate continuous (WarmupCosine.extend_to)
        for config in self.trainer.lr_scheduler_configs if self._schedule_total is not None else ():
            for fn in getattr(config.scheduler, "lr_lambdas", ()):
                if isinstance(fn, WarmupCosine):
                    fn.extend_to(config.scheduler.last_epoch, self._schedule_total)

    def on_fit_start(self) -> None:
        # the fused AdamW (configure_optimizers) clips under bf16-mixed on any strategy, one device included:
        # Lightning refuses it there although no gradient scaler exists (lightning_tp2d.precision)
        allow_clipping_without_scaler(self.trainer.precision_plugin)

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        """Check the ``(idx, targets)`` (or packed ``(idx, targets, doc_ids)``) batch's token ids, and the document
        ids' shape and order, while it is still on the host (a ``ValueError`` naming the ids or shapes that do not
        fit), so no step reads them back from the device."""
        if isinstance(batch, (tuple, list)) and len(batch) in (2, 3) and all(isinstance(t, torch.Tensor)
                                                                               for t in batch[:2]):
            if self.model is not None and batch[0].device.type == "cpu":
                self.model.check_input(batch[0], batch[1], values=True)
                if len(batch) == 3:
                    self.model.check_documents(batch[0], batch[2], values=True)
        return batch

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, doc_ids=None) -> torch.Tensor:
        return self.model(idx, targets) if doc_ids is None else self.model(idx, targets, doc_ids=doc_ids)

    @staticmethod
    def _unpack(batch) -> tuple:
        """``(idx, targets, doc_ids or None)`` of a ``(idx, targets)`` or packed ``(idx, targets, doc_ids)`` batch
        (:class:`~lightning_tp2d.data.TextDataModule` with ``pack_documents=True``)."""
        idx, targets, *rest = batch
        return idx, targets, (rest[0] if rest else None)

    # ---- steps ---------------------------------------------------------------------------------------------

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        idx, targets, doc_ids = self._unpack(batch)
        loss = self.forward(idx, targets, doc_ids)
        self.log("train_loss", loss.detach(), on_step=True, on_epoch=False, sync_dist=True,
                 prog_bar=self.hparams.get("loss_on_progress_bar", True))  # (older checkpoints lack the key)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        idx, targets, doc_ids = self._unpack(batch)
        loss = self.forward(idx, targets, doc_ids)
        self.val_perplexity.update(loss, (targets != -100).sum())
        self.log("val_loss", loss, on_step=False, on_epoch=True, sync_dist=True, batch_size=idx.size(0))
        self.log("val_perplexity", self.val_perplexity, on_step=False, on_epoch=True)

    def predict_step(self, batch, batch_idx: int) -> torch.Tensor:
        """The prompt ``batch [B, T]`` (token ids) continued by ``predict_max_new_tokens`` sampled tokens; the same
        on every rank (one seed per batch)."""
        idx = batch[0] if isinstance(batch, (tuple, list)) else batch
        hp = self.hparams
        out = self.generate(idx, hp.predict_max_new_tokens, temperature=hp.predict_temperature, top_k=hp.predict_top_k,
                            seed=batch_idx)
        return out.cpu()

    def test_step(self, batch, batch_idx: int) -> None:
        idx, targets, doc_ids = self._unpack(batch)
        loss = self.forward(idx, targets, doc_ids)
        self.log("test_loss", loss, on_step=False, on_epoch=True, sync_dist=True, batch_size=idx.size(0))

    def on_validation_start(self) -> None:
        mesh = self.device_mesh
        if mesh is not None and "data_parallel" in (mesh.mesh_dim_names or ()):
            # tensor-parallel ranks hold equal sums; reduce over the replicas that saw different data
            self.val_perplexity.process_group = mesh.get_group("data_parallel")

    # ---- optimisation --------------------------------------------------------------------------------------

    def configure_optimizers(self):
        hp = self.hparams
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        groups = [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        kwargs = dict(lr=hp.learning_rate, betas=tuple(hp.betas), eps=hp.eps)
        # 16-mixed with clipping: the fused kernel unscales inside its step, after the clip would have seen scaled
        # gradients (Lightning refuses that pairing), so foreach; every other precision has no scaler
        scaled = self._trainer is not None and getattr(self.trainer.precision_plugin, "scaler", None) is not None
        clipped = self._trainer is not None and bool(self.trainer.gradient_clip_val)
        optimizer = None
        if not (scaled and clipped):
            try:  # the fused kernel: one launch for all parameters, and no .item() of the step count per parameter
                optimizer = torch.optim.AdamW(groups, fused=True, **kwargs)
            except (RuntimeError, ValueError):  # parameters on a device (or of a dtype) without the fused kernel
                pass
        if optimizer is None:
            optimizer = torch.optim.AdamW(groups, foreach=True, **kwargs)
        total = hp.max_steps or self.trainer.estimated_stepping_batches
        if not math.isfinite(total):
            raise ValueError("set max_steps (the cosine schedule needs a length) when training has no step limit")
        self._schedule_total = int(total)  # a resumed schedule is extended to it (on_train_start)
        schedule = WarmupCosine(hp.warmup_steps, int(total), hp.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ---- sampling ------------------------------------------------------------------------------------------

    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 seed: int = 0, eos_token_id: int | Sequence[int] | None | str = "model") -> torch.Tensor:
        """Append up to ``max_new_tokens`` sampled tokens to ``idx [B, T]``, stopping once every row has sampled an
        end-of-text id (:func:`sample`). Under tensor parallelism every rank must call it with the same ``idx`` and
        ``seed``: the gathered logits are identical on all ranks, and so are the samples drawn from one seeded
        generator (and so where they stop)."""
        return sample(self.model, idx, max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
                      eos_token_id=eos_token_id)


def check_optimizer_values(*, learning_rate, weight_decay, betas, eps, warmup_steps, max_steps, min_lr_ratio) -> None:
    """``ValueError`` naming the first of :class:`CausalLMModule`'s optimiser and schedule arguments that AdamW or
    the schedule cannot run with (checked where they are given, before any process starts, instead of in every
    rank's ``configure_optimizers``)."""
    check_number("learning_rate", learning_rate, low=0, low_open=True, meaning="the peak AdamW learning rate")
    check_number("weight_decay", weight_decay, low=0, meaning="AdamW's decoupled weight decay")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas={betas!r} must be two numbers in [0, 1) (AdamW's moment decay rates)")
    for k, beta in enumerate(betas):
        check_number(f"betas[{k}]", beta, low=0, high=1, high_open=True, meaning="AdamW's moment decay rates")
    check_number("eps", eps, low=0, low_open=True, meaning="AdamW's epsilon")
    check_number("warmup_steps", warmup_steps, low=0, integer=True, meaning="linear warmup, in optimizer steps")
    check_number("max_steps", max_steps, low=1, integer=True, optional=True,
                 meaning="the end of the cosine; null: the Trainer's step count")
    check_number("min_lr_ratio", min_lr_ratio, low=0, high=1, meaning="the final learning rate's share of the peak")


def check_sampling(max_new_tokens, temperature, top_k, names=("max_new_tokens", "temperature", "top_k"),
                   none: str = "null") -> None:
    """``ValueError`` naming the first sampling setting :func:`sample` cannot use: ``max_new_tokens`` an int >= 0,
    ``temperature`` a finite number >= 0 (0: greedy), ``top_k`` an int >= 1 or ``None``. ``names``: how the caller
    calls them (``sample.temperature``, ``--temperature`` ...); ``none``: how it calls ``None``."""
    check_number(names[0], max_new_tokens, low=0, integer=True, meaning="tokens to generate")
    check_number(names[1], temperature, low=0, meaning="softmax temperature; 0: greedy")
    check_number(names[2], top_k, low=1, integer=True, optional=True, none=none,
                 meaning=f"sample among the k most likely tokens; {none}: all")


def _stop_ids(model: GPT2 | Llama, eos_token_id) -> tuple[int, ...]:
    """The end-of-text ids :func:`sample` stops at: the model config's ``eos_token_id`` for ``"model"`` (none when it
    has none), else the int or ints given, ``None``: none."""
    if isinstance(eos_token_id, str):
        if eos_token_id != "model":
            raise ValueError(f"eos_token_id={eos_token_id!r}: an id, a list of ids, None or 'model' (the model's own)")
        eos_token_id = getattr(model.config, "eos_token_id", None)
    ids = () if eos_token_id is None else (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
    vocab = model.config.vocab_size
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab]
    if bad:
        raise ValueError(f"eos_token_id={eos_token_id!r}: {bad[0]!r} is not one of the model's {vocab} token ids")
    return ids


@torch.no_grad()
def sample(model: GPT2 | Llama, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
           seed: int = 0, eos_token_id: int | Sequence[int] | None | str = "model") -> torch.Tensor:
    """``idx [B, T]`` followed by up to ``max_new_tokens`` tokens sampled from ``model`` (plain or parallelized): from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely (all if ``None``), or greedy for
    ``temperature == 0`` (a negative temperature is refused: :func:`check_sampling`), drawn from one generator
    seeded with ``seed``. A model with a position table (GPT-2) takes ``T <= block_size`` and then sees the last
    ``block_size`` tokens; a RoPE model (Llama) sees them all. Each step
    asks the model for one position's logits (``logits_at``), so a long prompt's prefill holds ``[B, V]`` logits,
    not ``[B, T, V]``. A parallelized model needs the same call on every rank of its mesh (same tokens out).

    Generation stops early once every row has sampled an end-of-text id (``eos_token_id``: the model config's own by
    default, as transformers' ``generate`` stops at the generation config's; an id or ids; ``None``: never): a row that
    has ended is filled after its end with the config's ``pad_token_id``, else with its end-of-text id, while the
    others go on. Checking whether all have ended reads one flag a step on the host."""
    check_sampling(max_new_tokens, temperature, top_k)
    stops = _stop_ids(model, eos_token_id)
    was_training = model.training
    model.check_input(idx, values=True)
    model.eval()
    B = idx.size(0)
    batch_multiple, seq_multiple = _input_multiples(model)
    pad = (-B) % batch_multiple
    # ring layouts cut each sequence into 2p chunks: right-pad the context (causal attention keeps the
    # padding from touching earlier positions) and read the logits of the last real token
    limit = max_seq_len(model.config)  # None: no position table, the whole context every step
    window = None if limit is None else limit - limit % seq_multiple
    generator = torch.Generator(device=idx.device).manual_seed(seed)
    if stops:
        stop_ids = torch.tensor(stops, device=idx.device)
        pad = getattr(model.config, "pad_token_id", None)
        filler = torch.tensor(stops[0] if pad is None else pad, device=idx.device)
        ended = torch.zeros(B, 1, dtype=torch.bool, device=idx.device)
    for _ in range(max_new_tokens):
        cond = idx if window is None else idx[:, -window:]
        T = cond.size(1)
        if pad:
            cond = torch.cat([cond, cond[:1].expand(pad, -1)])  # the grid splits the batch into q rows
        if T % seq_multiple:
            cond = torch.cat([cond, cond[:, -1:].expand(-1, seq_multiple - T % seq_multiple)], dim=1)
        logits = model(cond, logits_at=T - 1)[:B, 0, :].float()  # the last real token's only: no [T, V] logits
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
        if stops:
            nxt = torch.where(ended, filler, nxt)
            ended |= torch.isin(nxt, stop_ids)
        idx = torch.cat([idx, nxt], dim=1)
        if stops and bool(ended.all()):
            break
    model.train(was_training)
    return idx


def _input_multiples(model: GPT2 | Llama) -> tuple[int, int]:
    """``(batch, sequence)`` multiples a parallelized model's input must have (its layout's rule; 1, 1 plain)."""
    handle = handle_of(model)
    return (1, 1) if handle is None else handle.input_multiples


GPT2LightningModule = CausalLMModule  # the name from when GPT-2 was the only model, kept for older code
