"""Quantize a bf16 / fp32 Qwen3.5 checkpoint to Qwen's block-FP8 format (checkpoint/fp8.py), file by file.

Which tensors become float8 follows Qwen's FP8 releases (docs/fp8.md): every linear weight of the text decoder and
of the multi-token-prediction head, fused or per-expert MoE experts included; kept in bf16: embeddings, norms, the
DeltaNet conv filter and gate parameters, the vision tower, `lm_head`, the MoE router `mlp.gate`, the shared-expert
gate `mlp.shared_expert_gate` and the DeltaNet `in_proj_a` / `in_proj_b` (listed in `modules_to_not_convert`).
The output is written into a temporary folder beside the target and renamed into place: nothing half-written.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import CheckpointError, UsageError
from . import fp8
from .reader import CheckpointReader

# Module-name suffixes kept in bf16 besides lm_head and the vision tower (listed in full, per layer, in config.json).
NOT_CONVERTED_SUFFIXES = ("mlp.gate", "mlp.shared_expert_gate", "linear_attn.in_proj_a", "linear_attn.in_proj_b")
_FUSED_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")


def is_quantized(key: str, ndim: int) -> bool:
    """Whether Qwen's FP8 release stores this checkpoint tensor as float8 (with a scale)."""
    if key.startswith("model.visual.") or key == "lm_head.weight" or not key.startswith(("model.", "mtp.")):
        return False
    if _FUSED_EXPERTS.search(key):
        return ndim == 3
    if not key.endswith(".weight") or ndim != 2 or key.endswith("embed_tokens.weight"):
        return False
    return not key[: -len(".weight")].endswith(NOT_CONVERTED_SUFFIXES)


def quantization_config(names: list[str]) -> dict:
    """config.json's `quantization_config` for a checkpoint of tensor `names`, every bf16 linear module listed."""
    kept = sorted({n[: -len(".weight")] for n in names
                   if n.endswith(".weight") and n[: -len(".weight")].endswith(NOT_CONVERTED_SUFFIXES)})
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "weight_block_size": list(fp8.BLOCK), "modules_to_not_convert": ["lm_head", "model.visual", *kept]}


def quantize_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The FP8 release's tensors of `tensors`: float8 + float32 `_scale_inv` where quantized, the rest bf16."""
    out = {}
    for key, tensor in tensors.items():
        if is_quantized(key, tensor.ndim):
            out[key], out[fp8.scale_name(key)] = fp8.quantize(tensor)
        else:
            out[key] = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
    return out


def quantize_checkpoint(source: str | os.PathLike, out_dir: str | os.PathLike, overwrite: bool = False) -> Path:
    """Write `source` (a bf16 / fp32 checkpoint folder) in Qwen's block-FP8 format into `out_dir`, shard by shard."""
    source, out_dir = Path(source), Path(out_dir)
    config_file = source / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{source} has no config.json: pass a checkpoint folder")
    config = json.loads(config_file.read_text())
    if fp8.fp8_format(config) is not None:
        raise UsageError(f"{source} is already an FP8 checkpoint: load it as it is (weights_dtype='fp8' keeps it)")
    files = sorted(p.name for p in source.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{source} holds no safetensors weights")
    if out_dir.exists() and not overwrite:
        raise UsageError(f"{out_dir} exists: pass overwrite=True or another folder")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        weight_map, names = {}, []
        for file in files:
            with safe_open(source / file, "pt") as f:
                tensors = quantize_tensors({k: f.get_tensor(k) for k in f.keys()})
            save_file(tensors, str(work / file), metadata={"format": "pt"})
            weight_map.update({k: file for k in tensors})
            names += list(tensors)
        for side in source.iterdir():
            if side.is_file() and not side.name.endswith(".safetensors") and side.name not in ("config.json", "model.safetensors.index.json"):
                shutil.copy2(side, work / side.name)
        if (source / "model.safetensors.index.json").is_file():
            (work / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
        config["quantization_config"] = quantization_config(names)
        (work / "config.json").write_text(json.dumps(config, indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(work, out_dir)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return out_dir


class QuantizingReader(CheckpointReader):
    """A bf16 / fp32 checkpoint folder read as `quantize_checkpoint` would write it, without writing it: the tensors
    the rule above quantizes are served as float8 with their scales (`get(raw=True)`, `get_scale`), every other
    floating tensor in bf16. For an export with FP8 weights whose Neuron runtime splits the checkpoint itself at load
    (the NxD backend, backends/nxd/fp8.py): the same bytes at every load, no copy of the checkpoint on disk."""

    def _fp8_scales(self, weight_map: dict[str, str], dequantize_dtype: torch.dtype | None) -> dict[str, str]:
        config_file = self.folder / "config.json"
        if config_file.is_file() and fp8.fp8_format(json.loads(config_file.read_text())) is not None:
            raise UsageError(f"{self.folder} is already an FP8 checkpoint: read it with CheckpointReader")
        self.fp8_block, self.dequantize_dtype = fp8.BLOCK, dequantize_dtype or torch.bfloat16
        # weight key -> (file, its scale's key: not in the file, made by `_quantized`)
        self._scale_of = {key: (file, fp8.scale_name(key)) for key, file in weight_map.items()
                          if is_quantized(key, len(self._header(file)[1][key]["shape"]))}
        self._pending_scales: dict[str, torch.Tensor] = {}  # quantized, weight served, scale not yet
        return weight_map

    def _read_raw(self, file: str, key: str) -> torch.Tensor:
        weight_key = key[: -len(fp8.SCALE_SUFFIX)] if key.endswith(fp8.SCALE_SUFFIX) else None
        if weight_key in self._scale_of:
            scale = self._pending_scales.pop(weight_key, None)
            return scale if scale is not None else fp8.quantize(super()._read_raw(file, weight_key))[1]
        tensor = super()._read_raw(file, key)
        if key in self._scale_of:
            tensor, self._pending_scales[key] = fp8.quantize(tensor)
        elif tensor.is_floating_point():
            tensor = tensor.to(torch.bfloat16)
        return tensor
