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
import re
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from optimum_qwen35.checkpoint import fp8
from optimum_qwen35.tiny.configs import _SHARDS, _generation_config, tiny_full_config
from optimum_qwen35.tiny.tokenizer import _write_json, build_tiny_tokenizer
from optimum_qwen35.tiny.weights import tiny_state_dict

# Module-name suffixes kept in bf16 besides lm_head and the vision tower (listed in full, per layer, in config.json).
NOT_CONVERTED_SUFFIXES = ("mlp.gate", "mlp.shared_expert_gate", "linear_attn.in_proj_a", "linear_attn.in_proj_b")
_FUSED_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")


def is_quantized(key: str, ndim: int) -> bool:
    """Whether the FP8 release stores this checkpoint tensor as float8 (with a scale)."""
    if key.startswith("model.visual.") or key == "lm_head.weight" or not key.startswith(("model.language_model.", "mtp.")):
        return False
    if _FUSED_EXPERTS.search(key):
        return ndim == 3
    if not key.endswith(".weight") or ndim != 2 or key.endswith("embed_tokens.weight"):
        return False
    return not key[: -len(".weight")].endswith(NOT_CONVERTED_SUFFIXES)


def quantization_config(names: list[str]) -> dict:
    """The `quantization_config` of config.json, with every bf16 linear module of `names` listed."""
    kept = sorted({n[: -len(".weight")] for n in names if n.endswith(".weight") and n[: -len(".weight")].endswith(NOT_CONVERTED_SUFFIXES)})
    return {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(fp8.BLOCK),
        "modules_to_not_convert": ["lm_head", "model.visual", *kept],
    }


def fp8_state_dict(layout: str, seed: int = 0, expert_form: str | None = None) -> dict[str, torch.Tensor]:
    """The tiny checkpoint's tensors as the FP8 release stores them: float8 + float32 scales, the rest bf16."""
    out: dict[str, torch.Tensor] = {}
    for key, array in tiny_state_dict(layout, seed, expert_form).items():
        tensor = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
        if is_quantized(key, tensor.ndim):
            out[key], out[fp8.scale_name(key)] = fp8.quantize(tensor)
        else:
            out[key] = tensor.to(torch.bfloat16)
    return out


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
