"""Qwen3.5's configuration: the model's own view of a checkpoint's config.json (`qwen35.py`), and the transformers
4.57 config classes registered where transformers lacks Qwen3.5 (`transformers_configs.py`, imported on demand)."""

from optimum_qwen35.config.qwen35 import (
    FULL_ATTENTION,
    LAYER_TYPES,
    LINEAR_ATTENTION,
    MIN_EXPERT_ROWS_PER_RANK,
    MOE_MODEL_TYPES,
    NESTED_TEXT_TYPES,
    SUPPORTED_MODEL_TYPES,
    Qwen35Config,
    register_transformers_configs,
)

__all__ = [
    "FULL_ATTENTION", "LAYER_TYPES", "LINEAR_ATTENTION", "MIN_EXPERT_ROWS_PER_RANK", "MOE_MODEL_TYPES",
    "NESTED_TEXT_TYPES", "SUPPORTED_MODEL_TYPES", "Qwen35Config", "register_transformers_configs",
]
