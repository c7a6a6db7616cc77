"""Single-device model definitions; parallel versions live elsewhere and swap submodules by name."""

import dataclasses
from collections.abc import Mapping
from typing import Any

from lightning_tp2d.models.gpt2 import GPT2, GPT2Config, LMHead
from lightning_tp2d.models.llama import Llama, LlamaConfig


def model_config(model: Any) -> Any:
    """The config a ``model`` argument stands for: a named size of any registered family (``"gpt2-tiny"``,
    ``"llama-tiny"`` ...: each family's config class's ``from_name``), a config instance of a registered family
    (itself), or a config's fields as a dict (the family whose config class has exactly those fields)."""
    from lightning_tp2d.families import families, family_of_config  # (the registry imports the models lazily)

    if isinstance(model, str):
        errors = []  # each family's own "unknown ... config" message, with its valid names
        for fam in families():
            from_name = getattr(fam.config_class, "from_name", None)
            if from_name is None:
                continue
            try:
                return from_name(model)
            except ValueError as err:
                errors.append(str(err))
        raise ValueError("; ".join(errors) or f"unknown model name {model!r}")
    if isinstance(model, Mapping):
        matches = []
        for fam in families():
            if not dataclasses.is_dataclass(fam.config_class):
                continue
            fields = dataclasses.fields(fam.config_class)
            required = {f.name for f in fields if f.default is dataclasses.MISSING
                        and f.default_factory is dataclasses.MISSING}
            if required <= set(model) <= {f.name for f in fields}:
                matches.append(fam)
        if len(matches) != 1:
            raise ValueError(f"model fields {sorted(model)} match the config of "
                             f"{[f.name for f in matches] or 'no registered model family'}; pass a config instance "
                             f"({', '.join(f.config_class.__name__ for f in families())}) or a named size")
        return matches[0].config_class(**model)
    if family_of_config(model) is None:
        raise TypeError(f"model must be a named size, a dict or a config of a registered model family "
                        f"({', '.join(f.config_class.__name__ for f in families())}), got {type(model).__name__}")
    return model


__all__ = ["GPT2", "GPT2Config", "LMHead", "Llama", "LlamaConfig", "model_config"]
