"""Checkpoints: lazy safetensors reading, conversion to the decoder's layout, tensor-parallel shards."""

from .convert import CheckpointError, convert_checkpoint, expected_shapes
from .reader import CheckpointReader

__all__ = ["CheckpointError", "CheckpointReader", "convert_checkpoint", "expected_shapes"]
