"""Single-device model definitions; parallel versions live elsewhere and swap submodules by name."""

from lightning_tp2d.models.gpt2 import GPT2, GPT2Config, LMHead
from lightning_tp2d.models.llama import Llama, LlamaConfig

__all__ = ["GPT2", "GPT2Config", "LMHead", "Llama", "LlamaConfig"]
