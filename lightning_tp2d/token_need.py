"""The tokens a data split needs: one rule for :class:`~lightning_tp2d.data.TextDataModule` (its ``setup``, its
loaders and ``check_size``, which ``tp2d-train`` calls before any process starts) and for ``tp2d-plan``, which names
the data its printed ``tp2d-train`` command needs (:mod:`lightning_tp2d.planning.commands`).

A split of ``n`` tokens holds ``(n - 1) // block_size`` windows (targets are shifted by one). Without a separate
validation source the stream's last ``int(n * val_fraction)`` tokens are the validation split. Each loader needs
``batch_size`` windows per data-parallel replica (every replica gets a full batch); the validation split needs as many
where validation runs, else one window.

Arithmetic only: nothing of the package (nor torch, nor Lightning) is imported, so the planner reads it without
importing the data module.
"""

from __future__ import annotations

__all__ = ["least_tokens", "split_need", "split_needs", "split_tokens", "stream_need"]


def split_tokens(n: int, val_fraction: float) -> tuple[int, int]:
    """``(train, validation)`` tokens of an ``n``-token stream without ``val_path``: the last ``int(n * val_fraction)``
    are held out."""
    n_val = int(n * val_fraction)
    return n - n_val, n_val


def split_need(block_size: int, batch_size: int | None = None, replicas: int = 1, key: str = "") -> tuple[int, str]:
    """``(tokens, why)``: a split needs ``w * block_size + 1`` tokens for ``w`` windows (targets are shifted by one):
    one window for :meth:`TextDataModule.setup`, ``batch_size x replicas`` for its loader (every data-parallel
    replica gets a full batch). ``key``: how ``why`` names the settings (``"data."``)."""
    if batch_size is None:
        return block_size + 1, f"one window of {key}block_size+1 = {block_size + 1} tokens"
    w = batch_size * replicas
    return w * block_size + 1, (f"{key}batch_size={batch_size} x {replicas} data-parallel replica(s) = {w} windows of "
                                f"{key}block_size={block_size} tokens, +1 = {w * block_size + 1} tokens")


def split_needs(block_size: int, batch_size: int, replicas: int = 1, *, validates: bool = True,
                key: str = "") -> tuple[tuple[int, str], tuple[int, str]]:
    """``(train, validation)`` needs (:func:`split_need` each) of a run's loaders: ``batch_size x replicas`` windows
    for training, as many for validation where validation runs (``validates``), else the one window ``setup`` cuts."""
    train = split_need(block_size, batch_size, replicas, key)
    return train, train if validates else split_need(block_size, key=key)


def stream_need(train: int, val: int, val_fraction: float) -> int:
    """The fewest tokens whose split (:func:`split_tokens`) leaves at least ``train`` and ``val`` tokens."""
    n = max(train + val, int(val / val_fraction) - 2, int((train - 1) / (1 - val_fraction)) - 2)  # a lower bound
    while True:  # both splits grow with n: the first n that fits is the fewest
        n_train, n_val = split_tokens(n, val_fraction)
        if n_train >= train and n_val >= val:
            return n
        n += 1


def least_tokens(block_size: int, batch_size: int, replicas: int = 1, *, validates: bool = True,
                 val_fraction: float) -> int:
    """The fewest tokens one source (no ``val_path``: its tail is the validation split) may hold for a run of
    ``batch_size`` windows of ``block_size`` per replica on ``replicas`` data-parallel replicas: what
    :meth:`~lightning_tp2d.data.TextDataModule.check_size` accepts, one token fewer it refuses."""
    train, val = split_needs(block_size, batch_size, replicas, validates=validates)
    return stream_need(train[0], val[0], val_fraction)
