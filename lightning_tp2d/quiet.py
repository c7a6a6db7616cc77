"""Known-harmless messages that every training run would print, silenced where they come from.

:func:`silence_known_noise` installs filters that each match one message of one library module, so nothing else a
user would want to see is hidden:

* torch >= 2.10's ``FutureWarning`` "`isinstance(treespec, LeafSpec)` is deprecated", raised by Lightning 2.6's own
  ``lightning.pytorch.utilities._pytree`` (``LeafSpec()`` in its data-loader flattening), once per rank and fit:
  Lightning's code to change, nothing a user can act on;
* Lightning's "You have overridden `on_before_batch_transfer` in `LightningModule` but have passed in a
  `LightningDataModule`": :class:`~lightning_tp2d.module.CausalLMModule` checks token ids in that hook on
  purpose (on the host, before the batch moves) and :class:`~lightning_tp2d.data.TextDataModule` has none, so the
  module's hook is used, as intended;
* Lightning's "💡 Tip: ..." advertisements (litlogger, litmodels), one INFO line each on rank 0 of every Trainer;
* while torchao is imported (``parallel.float8`` only, :func:`quiet_loggers`): its "Failed to load ..._C*.so" lines
  (CUDA kernels of other features; the float8 training path does not use them) and torch's pytree note on
  torchao's ``KernelPreference`` enum.

The entry points (``tp2d-train``, ``tp2d``), :class:`~lightning_tp2d.strategy.TP2DStrategy` and
``CausalLMModule`` call it when they are built, so ``Trainer(strategy="tp2d")`` users get the same output.
Calling it again changes nothing (``warnings.filterwarnings`` replaces an identical filter, a logger keeps one copy
of a filter object). Standard library only: no torch, no Lightning import.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

# (message regex, category, module regex) of each warning silenced; a regex matches the start of the text
WARNINGS = (
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning, r"lightning\.pytorch\.utilities\._pytree"),
    (r"You have overridden `on_before_batch_transfer` in `LightningModule` but have passed in a "
     r"`LightningDataModule`", UserWarning, r"lightning\.pytorch\.trainer\.connectors\.data_connector"),
)
# the loggers Lightning's rank_zero_info writes through (lightning.pytorch's, or fabric's when pytorch is not loaded)
TIP_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")
TIP_PREFIX = "💡 Tip: For seamless cloud"


def _not_a_tip(record: logging.LogRecord) -> bool:
    """Logging filter: drop Lightning's cloud-service tips, keep every other record."""
    return not str(record.msg).startswith(TIP_PREFIX)


def silence_known_noise() -> None:
    """Install the filters of the module docstring in this process (idempotent)."""
    for message, category, module in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name in TIP_LOGGERS:
        logging.getLogger(name).addFilter(_not_a_tip)


@contextlib.contextmanager
def quiet_loggers(*names: str, level: int = logging.ERROR):
    """Raise the named loggers to ``level`` for the ``with`` block (an import that logs what the user cannot act on),
    then restore their levels."""
    loggers = [logging.getLogger(name) for name in names]
    before = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(level)
    try:
        yield
    finally:
        for logger, old in zip(loggers, before):
            logger.setLevel(old)
