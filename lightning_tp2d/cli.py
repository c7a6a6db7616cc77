"""``tp2d``: the LightningCLI entry point (``tp2d fit --trainer.strategy=tp2d --config run.yaml``).

The model is :class:`~lightning_tp2d.module.CausalLMModule` and the data
:class:`~lightning_tp2d.data.TextDataModule`; their arguments are ``--model.*`` and ``--data.*``. Importing this
module imports the package, which registers the strategy names ``tp2d``, ``metp`` and ``tp2d_metp``; a strategy
with arguments is given as ``class_path``/``init_args`` (see ``recipes/tp2d_cli.yaml``). With ``--trainer.devices=N``
Lightning starts the other local ranks by re-running this same command; under torchrun or SLURM it joins the
processes they started.

Checkpoints: where Lightning would add its default ``ModelCheckpoint`` (checkpointing on, none listed in
``--trainer.callbacks``), ``tp2d`` adds a :class:`~lightning_tp2d.callbacks.StepCheckpoint` with the same defaults,
which also saves the final step, so a run always ends with a checkpoint (Lightning's saves only after validation
when there is a validation set). A ``ModelCheckpoint`` listed in ``--trainer.callbacks`` is used as it is.
"""

from __future__ import annotations

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI

import lightning_tp2d  # noqa: F401  (registers the strategy names)
from lightning_tp2d.callbacks import StepCheckpoint
from lightning_tp2d.data import TextDataModule
from lightning_tp2d.module import CausalLMModule
from lightning_tp2d.quiet import silence_known_noise


class TP2DCLI(LightningCLI):
    """LightningCLI whose default checkpoint callback is :class:`StepCheckpoint` (module docstring)."""

    def instantiate_trainer(self, **kwargs) -> Trainer:
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        trainer = config.get("trainer") or {}
        listed = kwargs.get("callbacks", trainer.get("callbacks")) or []
        listed = listed if isinstance(listed, list) else [listed]
        if trainer.get("enable_checkpointing") is not False and not any(isinstance(c, ModelCheckpoint) for c in listed):
            kwargs["callbacks"] = [*listed, StepCheckpoint()]
        return super().instantiate_trainer(**kwargs)


def cli(args: list[str] | None = None) -> LightningCLI:
    """Build and run the LightningCLI; returns it (its ``trainer``, ``model``, ``datamodule``) for scripts."""
    silence_known_noise()
    return TP2DCLI(CausalLMModule, TextDataModule, args=args, save_config_kwargs={"overwrite": True})


def main(args: list[str] | None = None) -> None:
    """The ``tp2d`` console script: exits 0 after a successful run (the wrapper exits with what this returns, so
    returning the CLI object made it print the object and exit 1)."""
    cli(args)


if __name__ == "__main__":
    main()
