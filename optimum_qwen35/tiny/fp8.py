"""Tiny random checkpoints in Qwen's block-wise FP8 format, quantized by our own code (checkpoint/fp8.py).

The same random model as `build_tiny_checkpoint(layout, seed)`, with every linear weight of the text decoder and of
the multi-token-prediction head stored as float8_e4m3fn plus a float32 `weight_scale_inv` per 128 x 128 block (the
ceiling grid where a dimension is not a multiple of 128), and the rest in bfloat16: embeddings, norms, the DeltaNet
conv filter and gate parameters, the vision tower, `lm_head`, and the modules config.json's
`quantization_config.modules_to_not_convert` names (the MoE router `mlp.gate`, the shared-expert gate
`mlp.shared_expert_gate`, the DeltaNet `in_proj_a` / `in_proj_b`), as Qwen's FP8 releases keep them (docs/fp8.md
gives the sources). Experts are stored as the layout stores them: per expert (`experts.N.gate_proj.weight` +
`.weight_scale_inv`, Qwen's on-disk form) or fused (`experts.gate_up_proj` + `experts.gate_up_proj_scale_inv`).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from optimum_qwen35.checkpoint.quantize import quantization_config, quantize_tensors
from optimum_qwen35.tiny.configs import _SHARDS, _generation_config, tiny_full_config
from optimum_qwen35.tiny.tokenizer import _write_json, build_tiny_tokenizer
from optimum_qwen35.tiny.weights import tiny_state_dict


def fp8_state_dict(layout: str, seed: int = 0, expert_form: str | None = None) -> dict[str, torch.Tensor]:
    """The tiny checkpoint's tensors as the FP8 release stores them: float8 + float32 scales, the rest bf16."""
    sd = tiny_state_dict(layout, seed, expert_form)
    return quantize_tensors({k: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)) for k, a in sd.items()})


def build_tiny_fp8_checkpoint(path: str | os.PathLike, layout: str = "tiny-2b", seed: int = 0,
                              expert_form: str | None = None) -> Path:
    """Write the tiny random checkpoint of `layout` in Qwen's block-FP8 format into folder `path` (config.json with
    `quantization_config` and dtype bfloat16, generation config, tokenizer, weights sharded as the layout is)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("model*.safetensors*"):
        stale.unlink()
    sd = fp8_state_dict(layout, seed, expert_form)
    config = tiny_full_config(layout, "bfloat16")
    config["quantization_config"] = quantization_config(list(sd))
    _write_json(path / "config.json", config)
    _write_json(path / "generation_config.json", _generation_config())
    names = sorted(sd)
    n_shards = _SHARDS[layout]
    if n_shards == 1:
        save_file(sd, os.fspath(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        per_shard = -(-len(names) // n_shards)
        weight_map = {}
        for i in range(n_shards):
            file = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
            group = names[i * per_shard : (i + 1) * per_shard]
            save_file({n: sd[n] for n in group}, os.fspath(path / file), metadata={"format": "pt"})
            weight_map.update({n: file for n in group})
        total = sum(t.numel() * t.element_size() for t in sd.values())
        _write_json(path / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    build_tiny_tokenizer(path)
    return path
