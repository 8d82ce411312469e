"""Lazy, tensor-by-tensor reading of a Qwen3.5 safetensors checkpoint folder (a Hub snapshot is one).

Single file (`model.safetensors`) or sharded (`model.safetensors.index.json` + shards). Only the text
decoder is read: `model.language_model.*` in the vision-language checkpoints Qwen ships, or bare
`model.*` in text-only ones; the vision tower (`model.visual.*`) and the multi-token-prediction head
(`mtp.*`) are skipped without being read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

SKIPPED_PREFIXES = ("model.visual.", "mtp.", "model.mtp.")
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
    """Maps text tensor names to their file and reads each tensor only when asked."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        single = self.folder / "model.safetensors"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif single.is_file():
            with safe_open(single, framework="pt") as f:
                weight_map = {key: single.name for key in f.keys()}
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(
                    f"no safetensors weights in {self.folder} (expected model.safetensors or "
                    "model.safetensors.index.json); convert .bin checkpoints to safetensors first"
                )
            weight_map = {}
            for name in files:
                with safe_open(self.folder / name, framework="pt") as f:
                    weight_map.update({key: name for key in f.keys()})
        missing_files = sorted({f for f in weight_map.values() if not (self.folder / f).is_file()})
        if missing_files:
            raise FileNotFoundError(f"{self.folder} is incomplete: the index names missing files {missing_files}")
        self._files: dict[str, str] = {}
        self._keys: dict[str, str] = {}
        for key, file in weight_map.items():
            name = text_name(key)
            if name is not None:
                self._files[name], self._keys[name] = file, key
        self._handles: dict[str, object] = {}

    def names(self) -> list[str]:
        return list(self._files)

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def _handle(self, file: str):
        if file not in self._handles:
            self._handles[file] = safe_open(self.folder / file, framework="pt")
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self._files[name]).get_slice(self._keys[name]).get_shape())

    def get(self, name: str) -> torch.Tensor:
        return self._handle(self._files[name]).get_tensor(self._keys[name])
