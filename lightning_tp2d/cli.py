"""``tp2d``: the LightningCLI entry point (``tp2d fit --trainer.strategy=tp2d --config run.yaml``).

The model is :class:`~lightning_tp2d.module.GPT2LightningModule` and the data
:class:`~lightning_tp2d.data.TextDataModule`; their arguments are ``--model.*`` and ``--data.*``. Importing this
module imports the package, which registers the strategy names ``tp2d``, ``metp`` and ``tp2d_metp``; a strategy
with arguments is given as ``class_path``/``init_args`` (see ``recipes/tp2d_cli.yaml``). With ``--trainer.devices=N``
Lightning starts the other local ranks by re-running this same command; under torchrun or SLURM it joins the
processes they started.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

import lightning_tp2d  # noqa: F401  (registers the strategy names)
from lightning_tp2d.data import TextDataModule
from lightning_tp2d.module import GPT2LightningModule


def cli(args: list[str] | None = None) -> LightningCLI:
    """Build and run the LightningCLI; returns it (its ``trainer``, ``model``, ``datamodule``) for scripts."""
    return LightningCLI(GPT2LightningModule, TextDataModule, args=args, save_config_kwargs={"overwrite": True})


def main(args: list[str] | None = None) -> None:
    """The ``tp2d`` console script: exits 0 after a successful run (the wrapper exits with what this returns, so
    returning the CLI object made it print the object and exit 1)."""
    cli(args)


if __name__ == "__main__":
    main()
