"""Single-device model definitions; parallel versions live elsewhere and swap submodules by name. The bottom floor:
nothing here imports the rest of the package (a config from a name or a dict is the registry's:
:func:`lightning_tp2d.families.model_config`)."""

from lightning_tp2d.models.gpt2 import GPT2, GPT2Config, LMHead
from lightning_tp2d.models.llama import Llama, LlamaConfig


__all__ = ["GPT2", "GPT2Config", "LMHead", "Llama", "LlamaConfig"]
