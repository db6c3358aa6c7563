"""The models users bring: Llama 3, Qwen 3 and Qwen3-MoE as Flax NNX modules, their configs
(published and tiny sizes), their parallel plans on the one mesh, pipeline stages, and
Hugging Face checkpoints in and out on any layout (see docs/models.md)."""

from jaxpg.models import config as _config
from jaxpg.models.config import (
    Llama3RopeScaling,
    LlamaConfig,
    ModelConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    config_for,
)
from jaxpg.models.hf_io import from_hf, to_hf
from jaxpg.models.layout import ModelLayout, parallelize
from jaxpg.models.model import CausalLM
from jaxpg.models.plans import tp_plan
from jaxpg.models.stages import Stage, pipeline_stages, stage_bounds

#: The published sizes by name (``"llama3-8b"``, ``"qwen3-0.6b"``, ``"qwen3-30b-a3b"``...):
#: each is its config class and the fields that differ from the class's defaults.
#: :func:`config_for` builds one.
PRESETS = _config.PRESETS

__all__ = [
    "ModelConfig", "LlamaConfig", "Qwen3Config", "Qwen3MoeConfig", "Llama3RopeScaling",
    "PRESETS", "config_for", "CausalLM", "tp_plan", "parallelize", "ModelLayout", "from_hf",
    "to_hf", "stage_bounds", "pipeline_stages", "Stage",
]
