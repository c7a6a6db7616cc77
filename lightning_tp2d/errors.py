"""The package's own exceptions, importable without torch (``tp2d-train`` catches them before torch is loaded)."""

from __future__ import annotations


class CommError(RuntimeError):
    """A collective or point-to-point transfer that failed or timed out (a rank stalled past the process group's
    timeout, or died), named by its kind, the mesh axis and the ranks involved; the backend's error is chained."""


class DivergenceError(RuntimeError):
    """Training stopped because the loss stopped being finite (:class:`lightning_tp2d.callbacks.DivergenceGuard`)."""


class CheckpointError(OSError):
    """A checkpoint that could not be saved (the staging copy is removed, the previous checkpoint stays) or loaded
    (damaged, truncated or missing files, named)."""
