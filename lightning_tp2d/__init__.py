"""lightning_tp2d: 2-D (SUMMA) and memory-efficient ring tensor parallelism for GPT-2-class models."""

from lightning_tp2d.mesh import ParallelDims, init_mesh
from lightning_tp2d.models import GPT2, GPT2Config
from lightning_tp2d.parallelize import full_state_dict, local_parameter_bytes, parallelize

__version__ = "0.1.0.dev0"

__all__ = ["GPT2", "GPT2Config", "ParallelDims", "full_state_dict", "init_mesh", "local_parameter_bytes", "parallelize"]
