"""Deprecated module (one release): images on the eager runtime are `Qwen35Runtime.from_pretrained(path, vision=True)`
(optimum_qwen35.runtime); the image helpers moved to `optimum_qwen35.runtime.images`."""

from __future__ import annotations

import warnings

from optimum_qwen35.runtime.host_loop import Qwen35Runtime
from optimum_qwen35.runtime.images import DEFAULT_IMAGE_BUCKETS, ImageInputs, ImagePrompt, load_vision_encoder

MOVED = "optimum_qwen35.runtime.vision.Qwen35ForImageTextToText is deprecated and goes in the next release: use {new}"


class Qwen35ForImageTextToText(Qwen35Runtime):
    """Deprecated: `Qwen35Runtime.from_pretrained(path, vision=True)` / `Qwen35Runtime.from_decoder(decoder,
    vision_encoder=...)`."""

    def __new__(cls, decoder, vision, batch_size: int = 1, max_length: int = 1024, buckets=None,
                image_buckets=DEFAULT_IMAGE_BUCKETS, trace: bool = False, pack_weights: bool = False):
        warnings.warn(MOVED.format(new="Qwen35Runtime.from_decoder(decoder, vision_encoder=...)"), FutureWarning, stacklevel=2)
        return Qwen35Runtime.from_decoder(decoder, batch_size, max_length, buckets, trace, pack_weights, vision, image_buckets)

    @classmethod
    def from_pretrained(cls, path, *args, **kwargs) -> Qwen35Runtime:
        warnings.warn(MOVED.format(new="Qwen35Runtime.from_pretrained(path, vision=True)"), FutureWarning, stacklevel=2)
        return Qwen35Runtime.from_pretrained(path, *args, vision=True, **kwargs)


__all__ = ["DEFAULT_IMAGE_BUCKETS", "ImageInputs", "ImagePrompt", "Qwen35ForImageTextToText", "load_vision_encoder"]
