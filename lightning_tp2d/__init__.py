"""lightning_tp2d: 2-D (SUMMA) and memory-efficient ring tensor parallelism for GPT-2-class models.

Importing the package registers the Lightning strategy names ``"tp2d"`` (layout "2d"), ``"metp"`` and
``"tp2d_metp"`` ("2d-metp"), so ``Trainer(strategy="tp2d")`` works (Lightning has no entry-point discovery for
strategies).
"""

from lightning_tp2d.mesh import ParallelDims, init_mesh
from lightning_tp2d.models import GPT2, GPT2Config
from lightning_tp2d.parallelize import full_state_dict, local_parameter_bytes, parallelize
from lightning_tp2d.checkpoint import read_state_dict
from lightning_tp2d.export import export_hf, gpt2_state_dict, load_gpt2
from lightning_tp2d.data import TextDataModule
from lightning_tp2d.module import GPT2LightningModule
from lightning_tp2d.strategy import TP2DStrategy


def _register_strategies() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    TP2DStrategy.register_strategies(StrategyRegistry)


_register_strategies()

__version__ = "0.1.0.dev0"

__all__ = [
    "GPT2", "GPT2Config", "GPT2LightningModule", "ParallelDims", "TP2DStrategy", "TextDataModule", "export_hf",
    "full_state_dict", "gpt2_state_dict", "init_mesh", "load_gpt2", "local_parameter_bytes", "parallelize",
    "read_state_dict",
]
