"""Quantize a bf16 / fp32 Qwen3.5 checkpoint to Qwen's block-FP8 format (checkpoint/fp8.py), file by file.

Which tensors become float8 follows Qwen's FP8 releases (docs/fp8.md): every linear weight of the text decoder and
of the multi-token-prediction head, fused or per-expert MoE experts included; kept in bf16: embeddings, norms, the
DeltaNet conv filter and gate parameters, the vision tower, `lm_head`, the MoE router `mlp.gate`, the shared-expert
gate `mlp.shared_expert_gate` and the DeltaNet `in_proj_a` / `in_proj_b` (listed in `modules_to_not_convert`).
The output is written into a temporary folder beside the target and renamed into place: nothing half-written.

`lm_head=True` goes past Qwen's format (opt-in, `export(..., fp8_lm_head=True)`): `lm_head` is quantized too. It is
the largest single weight of the small sizes (a quarter of the 2B's decode bytes in bf16), read whole at every step.
A checkpoint with tied embeddings is untied for it: the embedding stays bf16 (a decode step reads one row of it),
`lm_head.weight` becomes its float8 copy and config.json says `tie_word_embeddings: false`. An FP8 checkpoint
takes it too: its float8 weights stay as they are and only its bf16 `lm_head` is quantized.
"""

from __future__ import annotations

import copy
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


LM_HEAD = "lm_head.weight"
_EMBEDDINGS = ("model.language_model.embed_tokens.weight", "model.embed_tokens.weight")


def is_quantized(key: str, ndim: int, lm_head: bool = False) -> bool:
    """Whether Qwen's FP8 release stores this checkpoint tensor as float8 (with a scale); `lm_head`: and lm_head."""
    if key == LM_HEAD:
        return lm_head and ndim == 2
    if key.startswith("model.visual.") or not key.startswith(("model.", "mtp.")):
        return False
    if _FUSED_EXPERTS.search(key):
        return ndim == 3
    if not key.endswith(".weight") or ndim != 2 or key.endswith("embed_tokens.weight"):
        return False
    return not key[: -len(".weight")].endswith(NOT_CONVERTED_SUFFIXES)


def quantization_config(names: list[str], lm_head: bool = False) -> dict:
    """config.json's `quantization_config` for a checkpoint of tensor `names`, every bf16 linear module listed."""
    kept = sorted({n[: -len(".weight")] for n in names
                   if n.endswith(".weight") and n[: -len(".weight")].endswith(NOT_CONVERTED_SUFFIXES)})
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(fp8.BLOCK),
            "modules_to_not_convert": [*([] if lm_head else ["lm_head"]), "model.visual", *kept]}


def quantize_tensors(tensors: dict[str, torch.Tensor], lm_head: bool = False) -> dict[str, torch.Tensor]:
    """The FP8 release's tensors of `tensors`: float8 + float32 `_scale_inv` where quantized, the rest bf16."""
    out = {}
    for key, tensor in tensors.items():
        if is_quantized(key, tensor.ndim, lm_head):
            out[key], out[fp8.scale_name(key)] = fp8.quantize(tensor)
        else:
            out[key] = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
    return out


def untied(config: dict) -> dict:
    """config.json with `tie_word_embeddings: false` wherever it was set (top level and `text_config`)."""
    config = copy.deepcopy(config)
    for level in (config, config.get("text_config") or {}):
        if level.get("tie_word_embeddings"):
            level["tie_word_embeddings"] = False
    return config


def ties_embeddings(config: dict) -> bool:
    """Whether a config.json ties lm_head to the embedding (as config/qwen35.py reads it)."""
    text = config.get("text_config") or {}
    return bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))


def _not_converted(config: dict) -> list[str]:
    """An FP8 config.json's `modules_to_not_convert` (the list itself: top level or in `text_config`)."""
    quantization = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    return quantization.setdefault("modules_to_not_convert", [])


def needs_quantizing(config: dict, lm_head: bool = False) -> bool:
    """Whether a checkpoint of this config.json has weights to quantize for FP8 weights (`lm_head`: with lm_head)."""
    return fp8.fp8_format(config) is None or (lm_head and "lm_head" in _not_converted(config))


def _with_lm_head(tensors: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """`tensors` with a tied checkpoint's lm_head made its own tensor (the embedding's copy), where the file holds it."""
    embedding = next((k for k in _EMBEDDINGS if k in tensors), None)
    if tied and embedding is not None and LM_HEAD not in tensors:
        tensors[LM_HEAD] = tensors[embedding].clone()
    return tensors


def quantize_checkpoint(source: str | os.PathLike, out_dir: str | os.PathLike, overwrite: bool = False,
                        lm_head: bool = False) -> Path:
    """Write `source` (a bf16 / fp32 checkpoint folder) in Qwen's block-FP8 format into `out_dir`, shard by shard;
    `lm_head=True`: lm_head quantized too (an FP8 checkpoint's then, its other tensors as they are)."""
    source, out_dir = Path(source), Path(out_dir)
    config_file = source / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{source} has no config.json: pass a checkpoint folder")
    config = json.loads(config_file.read_text())
    already = fp8.fp8_format(config) is not None
    if not needs_quantizing(config, lm_head):
        raise UsageError(f"{source} is already an FP8 checkpoint: load it as it is (weights_dtype='fp8' keeps it)")
    tied = lm_head and ties_embeddings(config)
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
                tensors = _with_lm_head({k: f.get_tensor(k) for k in f.keys()}, tied)
            if already:  # an FP8 checkpoint: only its lm_head
                if LM_HEAD in tensors:
                    tensors.update(quantize_tensors({LM_HEAD: tensors.pop(LM_HEAD)}, lm_head=True))
            else:
                tensors = quantize_tensors(tensors, lm_head)
            save_file(tensors, str(work / file), metadata={"format": "pt"})
            weight_map.update({k: file for k in tensors})
            names += list(tensors)
        for side in source.iterdir():
            if side.is_file() and not side.name.endswith(".safetensors") and side.name not in ("config.json", "model.safetensors.index.json"):
                shutil.copy2(side, work / side.name)
        if (source / "model.safetensors.index.json").is_file():
            (work / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
        if already:
            _not_converted(config).remove("lm_head")
        else:
            config["quantization_config"] = quantization_config(names, lm_head)
        (work / "config.json").write_text(json.dumps(untied(config) if tied else config, indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(work, out_dir)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return out_dir


class QuantizingReader(CheckpointReader):
    """A checkpoint folder read as `quantize_checkpoint` would write it, without writing it: the tensors the rule
    above quantizes are served as float8 with their scales (`get(raw=True)`, `get_scale`), every other floating
    tensor in bf16. For an export with FP8 weights whose Neuron runtime splits the checkpoint itself at load (the NxD
    backend, backends/nxd/fp8.py): the same bytes at every load, no copy of the checkpoint on disk.

    `lm_head=True`: lm_head quantized too, a tied checkpoint's served untied (`lm_head.weight`, the embedding's
    float8 copy); an FP8 checkpoint is then served as stored but for its bf16 lm_head."""

    def __init__(self, folder: str | os.PathLike, mtp: bool = False, dequantize_dtype: torch.dtype | None = None,
                 lm_head: bool = False):
        self.lm_head = lm_head
        super().__init__(folder, mtp, dequantize_dtype)

    def _fp8_scales(self, weight_map: dict[str, str], dequantize_dtype: torch.dtype | None) -> dict[str, str]:
        config_file = self.folder / "config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.stored_fp8 = fp8.fp8_format(config) is not None
        if not needs_quantizing(config, self.lm_head):
            raise UsageError(f"{self.folder} is already an FP8 checkpoint: read it with CheckpointReader")
        if self.stored_fp8:
            weight_map = super()._fp8_scales(weight_map, dequantize_dtype)
        else:
            self.fp8_block, self.dequantize_dtype, self._scale_of = fp8.BLOCK, dequantize_dtype or torch.bfloat16, {}
        embedding = next((k for k in _EMBEDDINGS if k in weight_map), None)
        if self.lm_head and ties_embeddings(config) and LM_HEAD not in weight_map and embedding is not None:
            file = weight_map[LM_HEAD] = weight_map[embedding]
            header = self._header(file)[1]
            header[LM_HEAD] = header[embedding]  # the same bytes, read under lm_head's name
        # weight key -> (file, its scale's key: not in the file, made by `_read_raw`)
        quantized = {key: (file, fp8.scale_name(key)) for key, file in weight_map.items()
                     if (key == LM_HEAD or not self.stored_fp8)
                     and is_quantized(key, len(self._header(file)[1][key]["shape"]), self.lm_head)}
        self._scale_of.update(quantized)
        self._made_here = set(quantized)
        self._pending_scales: dict[str, torch.Tensor] = {}  # quantized, weight served, scale not yet
        return weight_map

    def _read_raw(self, file: str, key: str) -> torch.Tensor:
        weight_key = key[: -len(fp8.SCALE_SUFFIX)] if key.endswith(fp8.SCALE_SUFFIX) else None
        if weight_key in self._made_here:
            scale = self._pending_scales.pop(weight_key, None)
            return scale if scale is not None else fp8.quantize(super()._read_raw(file, weight_key))[1]
        tensor = super()._read_raw(file, key)
        if key in self._made_here:
            tensor, self._pending_scales[key] = fp8.quantize(tensor)
        elif tensor.is_floating_point() and not self.stored_fp8:
            tensor = tensor.to(torch.bfloat16)
        return tensor
