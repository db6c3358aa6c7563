"""The models users bring: Llama 3, Qwen 3 and Qwen3-MoE as Flax NNX modules, their configs
(published and tiny sizes), their parallel plans on the one mesh, pipeline stages, and
Hugging Face checkpoints in and out on any layout (see docs/models.md)."""

from jaxpg.models.config import (
    PRESETS,
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

__all__ = [
    "ModelConfig", "LlamaConfig", "Qwen3Config", "Qwen3MoeConfig", "Llama3RopeScaling",
    "PRESETS", "config_for", "CausalLM", "tp_plan", "parallelize", "ModelLayout", "from_hf",
    "to_hf", "stage_bounds", "pipeline_stages", "Stage",
]
