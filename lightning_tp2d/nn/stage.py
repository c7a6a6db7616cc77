"""What a pipeline stage holds in place of the modules another stage owns (:mod:`lightning_tp2d.pipeline`)."""

from __future__ import annotations

import torch.nn as nn

__all__ = ["Elsewhere", "present"]


class Elsewhere(nn.Module):
    """A module another pipeline stage holds: no parameters, nothing to run (this stage never calls it). It keeps
    the names of the modules around it: a stage's block ``i`` is still ``transformer.h.i`` (checkpoints, the
    optimizer's parameter names and exports see the global names)."""

    def __init__(self, stage: int) -> None:
        super().__init__()
        self.stage = stage  # the first stage that holds it (for messages)

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"this module lives on pipeline stage {self.stage}; this stage does not run it")

    def extra_repr(self) -> str:
        return f"stage={self.stage}"


def present(model: nn.Module, path: str) -> bool:
    """Whether the module at ``path`` is on this stage: it and every module above it exist and none is an
    :class:`Elsewhere`."""
    module = model
    for name in path.split(".") if path else ():
        module = getattr(module, name, None) if not isinstance(module, nn.ModuleList) else \
            (module[int(name)] if name.isdigit() and int(name) < len(module) else None)
        if module is None or isinstance(module, Elsewhere):
            return False
    return True
