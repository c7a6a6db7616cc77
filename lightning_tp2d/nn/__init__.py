"""Parallel layers for the ``"2d"`` layout. Each takes local shards ``[..., h/q]`` and holds DTensor
parameters with the plain layer's names and full shapes."""

from lightning_tp2d.nn.attention import MLP2D, Attention2D
from lightning_tp2d.nn.embedding import PositionEmbedding2D, TokenEmbedding2D
from lightning_tp2d.nn.head import LMHead2D
from lightning_tp2d.nn.layernorm import LayerNorm2D
from lightning_tp2d.nn.linear import Linear2D

__all__ = ["Attention2D", "LMHead2D", "LayerNorm2D", "Linear2D", "MLP2D", "PositionEmbedding2D", "TokenEmbedding2D"]
