"""The tiny checkpoints' config.json and generation_config.json: every field the real `Qwen/Qwen3.5-*` files have, at
tiny sizes, for each layout (TINY_LAYOUTS: nv = nk, 2 nk, 3 nk; TINY_MOE_LAYOUTS: mixture-of-experts)."""

from __future__ import annotations

import json
from typing import Any

from optimum_qwen35.tiny.tokenizer import ENDOFTEXT_ID, IM_END_ID, TINY_VOCAB_SIZE, special_token_id

def _layer_types(pattern_repeats: int) -> list[str]:
    return (["linear_attention"] * 3 + ["full_attention"]) * pattern_repeats


def _text_config(
    *,
    hidden_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    linear_num_key_heads: int,
    linear_num_value_heads: int,
    linear_key_head_dim: int,
    linear_value_head_dim: int,
    intermediate_size: int,
    tie_word_embeddings: bool,
    mrope_section: list[int],
) -> dict[str, Any]:
    # Field for field the text_config of the real Qwen3.5 config.json (same keys, same order).
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "dtype": "float32",
        "eos_token_id": IM_END_ID,
        "full_attention_interval": 4,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "layer_types": _layer_types(num_hidden_layers // 4),
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": linear_key_head_dim,
        "linear_num_key_heads": linear_num_key_heads,
        "linear_num_value_heads": linear_num_value_heads,
        "linear_value_head_dim": linear_value_head_dim,
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "model_type": "qwen3_5_text",
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": num_attention_heads,
        "num_hidden_layers": num_hidden_layers,
        "num_key_value_heads": num_key_value_heads,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": tie_word_embeddings,
        "use_cache": True,
        "vocab_size": TINY_VOCAB_SIZE,
        "mamba_ssm_dtype": "float32",
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": list(mrope_section),
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
        },
    }


TINY_LAYOUTS: dict[str, dict[str, Any]] = {
    # 2B-shaped: as many DeltaNet value heads as key heads, tied embeddings; saved sharded.
    "tiny-2b": _text_config(
        hidden_size=128,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,  # rotary dim 8 = 2 * sum(mrope_section)
        linear_num_key_heads=4,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        intermediate_size=256,
        tie_word_embeddings=True,
        mrope_section=[2, 1, 1],
    ),
    # 4B/9B-shaped: two value heads per key head, tied.
    "tiny-nv2x": _text_config(
        hidden_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        intermediate_size=192,
        tie_word_embeddings=True,
        mrope_section=[2, 1, 1],
    ),
    # 27B-shaped: three value heads per key head, untied (lm_head.weight on disk); dk != dv on purpose.
    "tiny-nv3x": _text_config(
        hidden_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=4,
        linear_num_value_heads=12,
        linear_key_head_dim=16,
        linear_value_head_dim=32,
        intermediate_size=192,
        tie_word_embeddings=False,
        mrope_section=[2, 1, 1],
    ),
}

def _moe_text_config(*, num_experts: int, num_experts_per_tok: int, moe_intermediate_size: int,
                     shared_expert_intermediate_size: int, **dense: Any) -> dict[str, Any]:
    # The text_config of the real Qwen3.5 MoE config.json (`qwen3_5_moe_text`): the dense keys without
    # `intermediate_size`, the expert sizes after `model_type`, as the published 35B-A3B file orders them.
    out: dict[str, Any] = {}
    for key, value in _text_config(intermediate_size=0, **dense).items():
        if key == "intermediate_size":
            continue
        if key == "model_type":
            out[key] = "qwen3_5_moe_text"
            out["moe_intermediate_size"] = moe_intermediate_size
            out["shared_expert_intermediate_size"] = shared_expert_intermediate_size
            out["num_experts"] = num_experts
            out["num_experts_per_tok"] = num_experts_per_tok
            continue
        out[key] = value
    return out


TINY_MOE_LAYOUTS: dict[str, dict[str, Any]] = {
    # 35B-A3B-shaped: two DeltaNet value heads per key head, untied, top-2 of 6 experts (6 does not divide by
    # TP 4), expert and shared-expert widths differing; saved with per-expert keys (what save_pretrained writes).
    "tiny-moe": _moe_text_config(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        tie_word_embeddings=False,
        mrope_section=[2, 1, 1],
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),
    # Top-1 routing over 4 experts, as many value heads as key heads; saved with the fused 3-D expert tensors.
    "tiny-moe-top1": _moe_text_config(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=4,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        tie_word_embeddings=False,
        mrope_section=[2, 1, 1],
        num_experts=4,
        num_experts_per_tok=1,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
    ),
}
# How each MoE layout stores its experts on disk: "per_expert" (`mlp.experts.N.{gate,up,down}_proj.weight`) or
# "fused" (`mlp.experts.gate_up_proj` [E, 2I, H], gate rows first, and `mlp.experts.down_proj` [E, H, I]).
# transformers 5 reads both (conversion_mapping.py, the qwen2_moe rules).
MOE_EXPERT_FORMS = {"tiny-moe": "per_expert", "tiny-moe-top1": "fused"}

# Layouts saved as several safetensors shards (+ index json); the others are a single model.safetensors.
_SHARDS = {"tiny-2b": 2, "tiny-nv2x": 1, "tiny-nv3x": 1, "tiny-moe": 2, "tiny-moe-top1": 1}


def _layout(layout: str) -> dict[str, Any]:
    if layout in TINY_LAYOUTS:
        return TINY_LAYOUTS[layout]
    if layout in TINY_MOE_LAYOUTS:
        return TINY_MOE_LAYOUTS[layout]
    raise ValueError(f"unknown tiny layout {layout!r}; choose one of {sorted(TINY_LAYOUTS) + sorted(TINY_MOE_LAYOUTS)}")


def _is_moe(t: dict[str, Any]) -> bool:
    return t["model_type"] == "qwen3_5_moe_text"


def tiny_text_config(layout: str = "tiny-2b", dtype: str = "float32") -> dict[str, Any]:
    """A copy of the text config of `layout` (the `text_config` of its config.json)."""
    text = json.loads(json.dumps(_layout(layout)))
    text["dtype"] = dtype
    return text


def tiny_vision_config(layout: str = "tiny-2b") -> dict[str, Any]:
    """A small vision tower config, with the real file's fields (and its `model_type: "qwen3_5"`)."""
    return {
        "deepstack_visual_indexes": [],
        "depth": 2,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 32,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 64,
        # The MoE checkpoints' file says "qwen3_5_moe" here (transformers reads it as qwen3_5_moe_vision).
        "model_type": "qwen3_5_moe" if _is_moe(_layout(layout)) else "qwen3_5",
        "num_heads": 2,
        "num_position_embeddings": 64,
        "out_hidden_size": _layout(layout)["hidden_size"],
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }


def tiny_full_config(layout: str = "tiny-2b", dtype: str = "float32") -> dict[str, Any]:
    """The nested `config.json` of a tiny checkpoint, shaped like the real Qwen3.5 one."""
    text = tiny_text_config(layout, dtype)
    moe = _is_moe(text)
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "image_token_id": special_token_id("<|image_pad|>"),
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": text,
        "tie_word_embeddings": text["tie_word_embeddings"],
        "transformers_version": "4.57.0.dev0",
        "video_token_id": special_token_id("<|video_pad|>"),
        "vision_config": tiny_vision_config(layout),
        "vision_end_token_id": special_token_id("<|vision_end|>"),
        "vision_start_token_id": special_token_id("<|vision_start|>"),
    }


def _generation_config() -> dict[str, Any]:
    return {
        "bos_token_id": ENDOFTEXT_ID,
        "do_sample": True,
        "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
        "pad_token_id": ENDOFTEXT_ID,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
        "transformers_version": "4.57.0.dev0",
    }


