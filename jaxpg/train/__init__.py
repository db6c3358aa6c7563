"""The training recipe: ``python -m jaxpg.train CONFIG.toml`` trains a ``jaxpg.models``
model with FSDP x TP x CP, or pipelined (``[layout] pp``), from a TOML config, with
checkpoints, an eval loop and per-step metrics to a progress bar, JSONL and TensorBoard
(see docs/models.md, "Training recipe")."""

from jaxpg.train.config import TrainConfig, config_from_dict, load_config
from jaxpg.train.recipe import train

__all__ = ["TrainConfig", "config_from_dict", "load_config", "train"]
