"""The package's own exceptions, importable without torch (``tp2d-train`` catches them before torch is loaded)."""

from __future__ import annotations

import re


class CommError(RuntimeError):
    """A collective or point-to-point transfer that failed or timed out (a rank stalled past the process group's
    timeout, or died), named by its kind, the mesh axis and the ranks involved; the backend's error is chained.
    ``call`` is that name alone (``"all_reduce along mesh axis 'col' (global ranks [0, 1])"``), for a report that
    knows more, such as which rank died (``tp2d-train``)."""

    def __init__(self, message: str, call: str = "") -> None:
        super().__init__(message)
        self.call = call


class DivergenceError(RuntimeError):
    """Training stopped because the loss stopped being finite (:class:`lightning_tp2d.callbacks.DivergenceGuard`)."""


class CheckpointError(OSError):
    """A checkpoint that could not be saved (the staging copy is removed, the previous checkpoint stays) or loaded
    (damaged, truncated or missing files, named)."""


def backend_detail(err: BaseException) -> str:
    """A communication backend's error in one short sentence: its first line without gloo's source location and
    advice (``"[.../pair.cc:537] Read error [127.0.0.1]:8332: Connection reset by peer. This is typically ..."`` ->
    ``"Read error [127.0.0.1]:8332: Connection reset by peer."``)."""
    text = str(err).strip()
    line = text.splitlines()[0] if text else type(err).__name__
    line = re.sub(r"^\[[^\]\s]+:\d+\]\s*", "", line)  # [/path/to/gloo/.../pair.cc:537]
    line = line.split(" This is typically caused by", 1)[0].strip()
    return line if line.endswith(".") else line + "."

