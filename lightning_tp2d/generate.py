"""``tp2d-generate``: sample text from a checkpoint on one device.

Reads any checkpoint this package writes (a sharded directory or one full file, whatever layout, grid and data
parallelism trained it, of any registered model family: GPT-2, Llama ...; :func:`~lightning_tp2d.export.load_model`
reassembles the full weights) or a transformers directory of such a family (``--hf DIR``, or detected by its
``config.json``: :func:`~lightning_tp2d.export.load_hf_model`), and prints the prompt followed by the sampled
continuation. The model's sizes come from the checkpoint (what TP2DStrategy records, else the LightningModule's
``model`` hyper-parameter), the tokenizer from the run's ``TextDataModule`` hyper-parameters when recorded, else from
``--tokenizer`` (default: ``gpt2`` for a 50257-token vocabulary, ``byte`` otherwise). An explicit ``--tokenizer`` wins.

Sampling is :func:`lightning_tp2d.module.sample`, the code behind ``CausalLMModule.generate``, so one device
samples exactly what a tensor-parallel ``trainer.predict`` with the same seed samples. Any error (missing checkpoint,
a prompt the model cannot read, no CUDA) is one line on stderr and exit code 2.

Example::

    tp2d-generate outputs/2025-01-01/12-00-00/checkpoints/last.ckpt --prompt "def main(" --max-new-tokens 200
    tp2d-generate --hf ./gpt2 --prompt "Hello" --tokenizer gpt2 --temperature 0.8 --top-k 40
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from lightning_tp2d.checkpoint import is_sharded, open_checkpoint, resolve
from lightning_tp2d.data import get_tokenizer
from lightning_tp2d.export import is_hf_directory, load_hf_model
from lightning_tp2d.export import load_model as load_plain_model
from lightning_tp2d.families import families
from lightning_tp2d.families import model_config
from lightning_tp2d.models.config import max_seq_len
from lightning_tp2d.module import check_sampling, sample

PROG = "tp2d-generate"


class _OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (``tp2d-generate: error: ...``) and exit code 2, as
    every other error of the command is; ``--help`` shows the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = _OneLineParser(prog=PROG, description="Sample text from a lightning_tp2d checkpoint (any "
                                     "layout, sharded or full) or a transformers GPT-2 or Llama directory, on one "
                                     "device.")
    parser.add_argument("checkpoint", nargs="?", help="checkpoint: a sharded directory, a full .ckpt file, or a "
                        "transformers GPT-2 or Llama directory (config.json + weights)")
    parser.add_argument("--hf", metavar="DIR", help="a transformers GPT-2 or Llama directory to sample from "
                        "(instead of CHECKPOINT)")
    parser.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    parser.add_argument("--max-new-tokens", type=int, default=100, help="tokens to sample (default 100)")
    parser.add_argument("--temperature", type=float, default=1.0, help="softmax temperature, >= 0; 0: greedy (default 1)")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens only")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (default 0)")
    parser.add_argument("--ignore-eos", action="store_true", help="sample all --max-new-tokens tokens, past the "
                        "model's end-of-text id (default: stop once it is sampled, when the model names one)")
    parser.add_argument("--tokenizer", choices=("byte", "gpt2"), default=None,
                        help="default: the checkpoint's run's, else gpt2 for a 50257-token vocabulary, else byte")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--trust-checkpoint", action="store_true", help="load a checkpoint whose pickles ask for "
                        "code (an old or foreign file) the old way, which runs it: only for files you trust")
    parser.add_argument("--no-verify", action="store_true", help="skip the checksums (a checkpoint without "
                        "checksums.json loads without a warning)")
    args = parser.parse_args(argv)
    if (args.checkpoint is None) == (args.hf is None):
        parser.error("give one checkpoint: CHECKPOINT or --hf DIR")
    try:  # the rules sample() and the training module's own sampling settings use
        check_sampling(args.max_new_tokens, args.temperature, args.top_k,
                       names=("--max-new-tokens", "--temperature", "--top-k"), none="left out")
    except ValueError as err:
        parser.error(str(err))
    return args


def checkpoint_meta(path: Path, *, trust_checkpoint: bool = False, verify: bool = True) -> dict[str, Any]:
    """The non-tensor part of one of our checkpoints: ``hyper_parameters``, ``datamodule_hyper_parameters``,
    ``tp2d`` (what the strategy records) ..., after its checks (checksums, pickles read as data:
    :func:`~lightning_tp2d.checkpoint.open_checkpoint`)."""
    if path.is_dir() and not is_sharded(path):
        raise ValueError(f"{str(path)!r} is a directory but neither a sharded checkpoint (no .metadata) nor a "
                         "transformers GPT-2 directory (config.json + model.safetensors or pytorch_model.bin)")
    meta = open_checkpoint(path, trust_checkpoint=trust_checkpoint, verify=verify)
    return {k: v for k, v in meta.items() if k not in ("state_dict", "optimizer_states")}


def checkpoint_config(meta: dict[str, Any], path: Path):
    """The model config a checkpoint was trained with (``GPT2Config``, ``LlamaConfig``, ... any registered family):
    the strategy's record, else the LightningModule's ``model`` hyper-parameter (a size name or the config's
    fields)."""
    recorded = meta.get("tp2d", {})
    found = [(family, fields) for family in families() if family.config_key
             for fields in recorded.get(family.config_key, {}).values()]
    if len(found) == 1:
        family, fields = found[0]
        return family.config_class(**fields)
    if len(found) > 1:
        raise ValueError(f"checkpoint {str(path)!r} holds {len(found)} models; tp2d-generate samples from "
                         "checkpoints of one")
    model = meta.get("hyper_parameters", {}).get("model")
    if model is not None:
        return model_config(model)
    raise ValueError(f"checkpoint {str(path)!r} records no model config (neither the strategy's nor a 'model' "
                     "hyper-parameter)")


def recorded_tokenizer(meta: dict[str, Any]) -> str | None:
    """The tokenizer of the run's TextDataModule, when the checkpoint records one that was used (a ``.bin`` token
    file carries ids of an unknown tokenizer)."""
    data = meta.get("datamodule_hyper_parameters") or {}
    name, path = data.get("tokenizer"), data.get("path")
    if not isinstance(name, str) or (path is not None and str(path).endswith(".bin")):
        return None
    return name


def load_model(source: str, hf: bool, *, trust_checkpoint: bool = False, verify: bool = True):
    """``(plain model on the CPU, recorded tokenizer name or None)`` for a checkpoint or transformers directory
    (any registered family: the one its config names); a checkpoint is checked first (:func:`checkpoint_meta`)."""
    if hf or (Path(source).is_dir() and not is_sharded(Path(source)) and is_hf_directory(source)):
        return load_hf_model(source), None
    path = resolve(source)
    meta = checkpoint_meta(path, trust_checkpoint=trust_checkpoint, verify=verify)
    config = checkpoint_config(meta, path)
    model = load_plain_model(path, config, trust_checkpoint=trust_checkpoint, verify=False)  # checked above
    return model, recorded_tokenizer(meta)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        print(generate(args))
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        message = " ".join(line.strip() for line in str(err).strip().splitlines()) or type(err).__name__
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 2
    return 0


def generate(args: argparse.Namespace) -> str:
    """The text ``main`` prints: prompt and continuation, decoded together."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"--device {args.device}: CUDA is not available here (use --device cpu)")
    model, recorded = load_model(args.hf or args.checkpoint, args.hf is not None,
                                 trust_checkpoint=args.trust_checkpoint, verify=not args.no_verify)
    cfg = model.config
    tokenizer = get_tokenizer(args.tokenizer or recorded or ("gpt2" if cfg.vocab_size == 50257 else "byte"))
    ids = [int(i) for i in tokenizer.encode(args.prompt)] or [tokenizer.eot]
    if max(ids) >= cfg.vocab_size:
        raise ValueError(f"the prompt holds token id {max(ids)} (tokenizer {tokenizer.name!r}, {tokenizer.vocab_size} "
                         f"ids) but the model's vocab_size is {cfg.vocab_size}: use the tokenizer the model was "
                         "trained with (--tokenizer)")
    if max_seq_len(cfg) is not None and len(ids) > cfg.block_size:  # None: a RoPE model takes any length
        raise ValueError(f"the prompt is {len(ids)} tokens, more than the model's block_size {cfg.block_size}")
    model = model.to(device)
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    out = sample(model, idx, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                 eos_token_id=None if args.ignore_eos else "model")
    return tokenizer.decode(out[0].tolist())


if __name__ == "__main__":
    sys.exit(main())
