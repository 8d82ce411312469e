"""The tests' kit (not installed with the package): the tiny checkpoints' builder re-exported from `optimum_qwen35.tiny`,
a bitwise safetensors reader, and beside this file the stand-in Hub server (hub_server.py), the HLO compiler contract
(hlo_contract.py), the XLA graph helpers (neuron_xla.py), fake export folders (export_folder.py), the
tensor-parallel harness (tp.py) and the kernel-call counter (kernel_calls.py)."""

from __future__ import annotations

import os
from typing import Any

import torch
from safetensors import safe_open

from optimum_qwen35.tiny import (
    MOE_EXPERT_FORMS,
    SPECIAL_TOKENS,
    TINY_LAYOUTS,
    TINY_MOE_LAYOUTS,
    build_tiny_checkpoint,
    build_tiny_tokenizer,
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

_ST_CODES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def read_safetensors(file: str | os.PathLike) -> tuple[dict[str, dict[str, Any]], dict[str, bytes]]:
    """({name: {"dtype", "shape"}}, raw bytes per tensor) of a safetensors file; used to compare checkpoints bitwise."""
    codes = {getattr(torch, d): c for d, c in _ST_CODES.items()}
    header, raw = {}, {}
    with safe_open(os.fspath(file), framework="pt") as f:
        for name in f.keys():
            t = f.get_tensor(name).contiguous()
            header[name] = {"dtype": codes.get(t.dtype, str(t.dtype)), "shape": list(t.shape)}
            raw[name] = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return header, raw


