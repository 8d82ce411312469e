"""Test helpers: tiny random Qwen3.5 checkpoints in the exact on-disk format of the real ones."""

from optimum_qwen35.testing.tiny import (
    SPECIAL_TOKENS,
    MOE_EXPERT_FORMS,
    TINY_LAYOUTS,
    TINY_MOE_LAYOUTS,
    build_tiny_checkpoint,
    build_tiny_tokenizer,
    read_safetensors,
    special_token_id,
    tiny_full_config,
    tiny_state_dict,
    tiny_text_config,
    tiny_vision_config,
    write_safetensors,
)

__all__ = [
    "SPECIAL_TOKENS",
    "MOE_EXPERT_FORMS",
    "TINY_LAYOUTS",
    "TINY_MOE_LAYOUTS",
    "build_tiny_checkpoint",
    "build_tiny_tokenizer",
    "read_safetensors",
    "special_token_id",
    "tiny_full_config",
    "tiny_state_dict",
    "tiny_text_config",
    "tiny_vision_config",
    "write_safetensors",
]
