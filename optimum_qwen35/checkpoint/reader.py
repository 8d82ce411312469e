"""Lazy, tensor-by-tensor reading of a Qwen3.5 safetensors checkpoint folder (a Hub snapshot is one).

Single file (`model.safetensors`) or sharded (`model.safetensors.index.json` + shards). The text decoder
(`model.language_model.*` in the vision-language checkpoints Qwen ships, or bare `model.*` in text-only ones)
is what `names`/`get` serve; the vision tower (`model.visual.*`) is served apart (`vision_names`/`get_vision`),
read only when a vision export asks for it; the multi-token-prediction head (`mtp.*`) is read only when asked
(`CheckpointReader(folder, mtp=True)`: served apart too, `mtp_names`/`get_mtp`, so the text names never change).

Files are read directly (the JSON header, then plain reads of each tensor's bytes) rather than through
the safetensors library's memory map: the mapped pages a long conversion touches all count in its RSS,
and converting must stay within a small multiple of one output shard of memory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..errors import CheckpointError, MissingWeightsError
from . import experts, fp8

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def _torch_dtype(code: str, where: str) -> torch.dtype:
    if code not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"{where}: safetensors dtype {code!r} is not supported (supported: {sorted(SAFETENSORS_DTYPES)})")
    return SAFETENSORS_DTYPES[code]

VISION_PREFIX = "model.visual."
MTP_PREFIXES = ("mtp.", "model.mtp.")
SKIPPED_PREFIXES = (VISION_PREFIX, *MTP_PREFIXES)
TEXT_PREFIXES = ("model.language_model.", "model.")


def text_name(key: str) -> str | None:
    """Checkpoint key -> decoder-relative name (`layers.0.mlp.up_proj.weight`, `lm_head.weight`), or None."""
    if key.startswith(SKIPPED_PREFIXES):
        return None
    if key == "lm_head.weight":
        return key
    for prefix in TEXT_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return None


class CheckpointReader:
    """Maps text tensor names to their file and reads each tensor only when asked. With `mtp=True` the
    multi-token-prediction head's tensors are served too, by their name under `mtp.` (`mtp_names`, `get_mtp`).

    A block-FP8 checkpoint (config.json's `quantization_config`, checkpoint/fp8.py) is served dequantized: each
    float8 weight is read with its `weight_scale_inv`, multiplied in float32 and cast to `dequantize_dtype` (default:
    the dtype config.json declares, bfloat16 for Qwen's FP8 releases); the scales are not served as tensors. Any other
    quantization, a float8 weight without its scale, or a scale of the wrong shape is refused here, in one line."""

    def __init__(self, folder: str | os.PathLike, mtp: bool = False, dequantize_dtype: torch.dtype | None = None):
        self.folder = Path(folder)
        self._headers: dict[str, tuple[int, dict]] = {}
        index = self.folder / "model.safetensors.index.json"
        single = self.folder / "model.safetensors"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif single.is_file():
            weight_map = {key: single.name for key in self._tensor_keys(single.name)}
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
            if (self.folder / "tp_shards.json").is_file() or (files and all(f.startswith("rank_") for f in files)):
                raise CheckpointError(
                    f"{self.folder} is a sharded export (written by `shard`), not a checkpoint: its rank files hold "
                    "shards, not the checkpoint's tensors. Load it as it is, or shard the original checkpoint"
                )
            if not files:
                from ..validation import missing_weights_message  # start-up time: validation imports torch only when a folder is checked

                raise MissingWeightsError(f"no safetensors weights: {missing_weights_message(self.folder)}")
            weight_map = {}
            for name in files:
                weight_map.update({key: name for key in self._tensor_keys(name)})
        missing_files = sorted({f for f in weight_map.values() if not (self.folder / f).is_file()})
        if missing_files:
            raise MissingWeightsError(
                f"{self.folder} is incomplete: the index names missing files {missing_files}; download them again"
            )
        weight_map = self._fp8_scales(weight_map, dequantize_dtype)
        self._files: dict[str, str] = {}
        self._keys: dict[str, str] = {}
        self._vision: dict[str, tuple[str, str]] = {}  # name under model.visual. -> (file, key)
        self._mtp: dict[str, tuple[str, str]] = {}  # name under mtp. -> (file, key), only with mtp=True
        for key, file in weight_map.items():
            name = text_name(key)
            if name is not None:
                self._files[name], self._keys[name] = file, key
            elif key.startswith(VISION_PREFIX):
                self._vision[key[len(VISION_PREFIX) :]] = (file, key)
            elif mtp and key.startswith(MTP_PREFIXES):
                self._mtp[key[key.index("mtp.") + len("mtp.") :]] = (file, key)
        # An MoE head's experts stored per expert are served under the fused names, as the decoder's are.
        self._mtp_fused = experts.fuse_expert_names(list(self._mtp))
        self._mtp_parts = {part: self._mtp.pop(part) for parts in self._mtp_fused.values() for part in parts}
        # MoE experts stored per expert are served under the fused names (checkpoint/experts.py).
        self._fused: dict[str, list[str]] = experts.fuse_expert_names(list(self._files))
        self.missing_expert_tensors = experts.missing_expert_tensors(list(self._files))
        self._part_locations: dict[str, tuple[str, str]] = {}
        for parts in self._fused.values():
            for part in parts:
                self._part_locations[part] = (self._files.pop(part), self._keys.pop(part))

    def _fp8_scales(self, weight_map: dict[str, str], dequantize_dtype: torch.dtype | None) -> dict[str, str]:
        """Pair each float8 weight of a block-FP8 checkpoint with its scale (checked against the weight's shape);
        returns the weight map without the scales."""
        config_file = self.folder / "config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.fp8_block = fp8.fp8_format(config)
        self._scale_of: dict[str, tuple[str, str]] = {}  # weight key -> (file, scale key)
        if self.fp8_block is None:
            return weight_map
        declared = config.get("torch_dtype") or config.get("dtype") or (config.get("text_config") or {}).get("dtype")
        self.dequantize_dtype = dequantize_dtype or getattr(torch, str(declared), None) or torch.bfloat16
        weights = {k: f for k, f in weight_map.items() if not k.endswith(fp8.SCALE_SUFFIX)}
        orphans, unscaled, wrong = [], [], []
        for key, file in weight_map.items():
            if key.endswith(fp8.SCALE_SUFFIX):
                if key[: -len(fp8.SCALE_SUFFIX)] in weights:
                    self._scale_of[key[: -len(fp8.SCALE_SUFFIX)]] = (file, key)
                else:
                    orphans.append(key)
        for key, file in weights.items():
            info = self._header(file)[1][key]
            if key in self._scale_of:
                s_file, s_key = self._scale_of[key]
                s_info = self._header(s_file)[1][s_key]
                expected = fp8.scale_grid(tuple(info["shape"]), self.fp8_block)
                if tuple(s_info["shape"]) != expected or s_info["dtype"] != "F32":
                    wrong.append(f"{s_key} {s_info['dtype']} {tuple(s_info['shape'])} (F32 {expected} expected)")
            elif info["dtype"] in ("F8_E4M3", "F8_E5M2"):
                unscaled.append(key)
        if orphans or unscaled or wrong:
            problems = [f"{title} ({len(items)}): {', '.join(items[:5])}{' ...' if len(items) > 5 else ''}"
                        for title, items in (("float8 weights without their weight_scale_inv", unscaled),
                                             ("scales of the wrong shape", wrong), ("scales without a weight", orphans))
                        if items]
            raise CheckpointError(f"FP8 checkpoint {self.folder} is inconsistent: {'; '.join(problems)}; download it again")
        return weights

    def vision_names(self) -> list[str]:
        """The vision tower's tensors, by name under `model.visual.` (empty for a text-only checkpoint)."""
        return list(self._vision)

    def vision_shape(self, name: str) -> tuple[int, ...]:
        file, key = self._vision[name]
        return tuple(self._header(file)[1][key]["shape"])

    def get_vision(self, name: str) -> torch.Tensor:
        """Read one vision tensor (named under `model.visual.`)."""
        return self._read(*self._vision[name])

    def mtp_names(self) -> list[str]:
        """The multi-token-prediction head's tensors, by name under `mtp.` (empty unless read with mtp=True)."""
        return list(self._mtp) + list(self._mtp_fused)

    def mtp_shape(self, name: str) -> tuple[int, ...]:
        if name in self._mtp_fused:
            shapes = [tuple(self._header(f)[1][k]["shape"]) for f, k in (self._mtp_parts[p] for p in self._mtp_fused[name])]
            return experts.fused_shape(name, shapes)
        file, key = self._mtp[name]
        return tuple(self._header(file)[1][key]["shape"])

    def get_mtp(self, name: str) -> torch.Tensor:
        """Read one tensor of the multi-token-prediction head (named under `mtp.`)."""
        if name in self._mtp_fused:
            return experts.fuse(name, [self._read(*self._mtp_parts[p]) for p in self._mtp_fused[name]])
        return self._read(*self._mtp[name])

    def names(self) -> list[str]:
        return list(self._files) + list(self._fused)

    def __contains__(self, name: str) -> bool:
        return name in self._files or name in self._fused

    def _part_info(self, part: str) -> dict:
        file, key = self._part_locations[part]
        return self._header(file)[1][key]

    def _tensor_keys(self, file: str) -> list[str]:
        return [key for key in self._header(file)[1] if key != "__metadata__"]

    def _header(self, file: str) -> tuple[int, dict]:
        """(data start, header) of a safetensors file, parsed once."""
        if file not in self._headers:
            path = self.folder / file
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                try:
                    if size > os.path.getsize(path) - 8:
                        raise ValueError(f"header length {size} is past the end of the file")
                    header = json.loads(f.read(size))
                except ValueError as e:
                    raise CheckpointError(f"{path} is not a valid safetensors file ({e}); re-download it") from None
                self._headers[file] = (8 + size, header)
        return self._headers[file]

    def _info(self, name: str) -> tuple[int, dict]:
        base, header = self._header(self._files[name])
        return base, header[self._keys[name]]

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._fused:
            return experts.fused_shape(name, [tuple(self._part_info(p)["shape"]) for p in self._fused[name]])
        return tuple(self._info(name)[1]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        """The on-disk dtype of a tensor, read from the file header (no data is read)."""
        if name in self._fused:
            part = self._fused[name][0]
            file, key = self._part_locations[part]
            if key in self._scale_of:
                return self.dequantize_dtype
            return _torch_dtype(self._part_info(part)["dtype"], f"{self.folder / file}: {key}")
        if self._keys[name] in self._scale_of:
            return self.dequantize_dtype
        return _torch_dtype(self._info(name)[1]["dtype"], f"{self.folder / self._files[name]}: {self._keys[name]}")

    def get(self, name: str, raw: bool = False) -> torch.Tensor:
        """Read one tensor into its own memory with plain file reads (`raw`: a float8 weight as stored, not
        dequantized; its scale is `get_scale`).

        Not through a memory map: the pages of a mapping that stays open count in the process's RSS, so
        reading a whole checkpoint through one would hold all of it in memory.
        """
        read = self._read_raw if raw else self._read
        if name in self._fused:
            return experts.fuse(name, [read(*self._part_locations[p]) for p in self._fused[name]])
        return read(self._files[name], self._keys[name])

    def _locations(self, name: str) -> list[tuple[str, str]]:
        if name in self._fused:
            return [self._part_locations[p] for p in self._fused[name]]
        return [(self._files[name], self._keys[name])]

    def is_fp8(self, name: str) -> bool:
        """Whether text tensor `name` is stored as float8 with a block scale (all its parts, for fused experts)."""
        return all(key in self._scale_of for _, key in self._locations(name))

    def get_scale(self, name: str, along: str) -> torch.Tensor:
        """The block scale of float8 tensor `name`, repeated along its weight's rows (`along="rows"`: [..., rows,
        ceil(cols / 128)]) or columns (`"cols"`: [..., ceil(rows / 128), cols]); per-expert parts are expanded first,
        then fused as their weights are (checkpoint/experts.py), so that every row / column keeps its own block's scale."""
        parts = []
        for file, key in self._locations(name):
            shape = tuple(self._header(file)[1][key]["shape"])
            parts.append(fp8.expand_along(self._read_raw(*self._scale_of[key]), shape, along, self.fp8_block))
        return experts.fuse(name, parts) if name in self._fused else parts[0]

    def _read(self, file: str, key: str) -> torch.Tensor:
        """One tensor; a float8 weight of an FP8 checkpoint dequantized with its scale (checkpoint/fp8.py)."""
        tensor = self._read_raw(file, key)
        if key in self._scale_of:
            tensor = fp8.dequantize(tensor, self._read_raw(*self._scale_of[key]), self.dequantize_dtype, self.fp8_block)
        return tensor

    def _read_raw(self, file: str, key: str) -> torch.Tensor:
        base, header = self._header(file)
        info = header[key]
        start, end = info["data_offsets"]
        out = torch.empty(info["shape"], dtype=_torch_dtype(info["dtype"], f"{self.folder / file}: {key}"))
        nbytes = out.numel() * out.element_size()
        if end - start != nbytes:
            raise CheckpointError(f"{self.folder / file}: tensor {key} has {end - start} bytes, {nbytes} expected")
        if nbytes:
            view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
            with open(self.folder / file, "rb", buffering=0) as f:
                f.seek(base + start)
                done = 0
                while done < nbytes:
                    n = f.readinto(view[done:])
                    if not n:
                        raise CheckpointError(f"{self.folder / file} is truncated (tensor {key})")
                    done += n
        return out
