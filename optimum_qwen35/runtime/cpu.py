"""Deprecated module (one release): the eager runtime is `optimum_qwen35.runtime.Qwen35Runtime`.

    Qwen35ForCausalLM(decoder, ...)             -> Qwen35Runtime.from_decoder(decoder, ...)
    Qwen35ForCausalLM.from_pretrained(path, ...) -> Qwen35Runtime.from_pretrained(path, ...)
    load_decoder                                -> optimum_qwen35.runtime.eager.load_decoder
"""

from __future__ import annotations

import warnings

from optimum_qwen35.runtime.buckets import default_buckets, default_key_buckets
from optimum_qwen35.runtime.eager import EagerGraphs, load_decoder
from optimum_qwen35.runtime.host_loop import Qwen35Runtime

MOVED = "optimum_qwen35.runtime.cpu.Qwen35ForCausalLM is deprecated and goes in the next release: use {new}"


class Qwen35ForCausalLM(Qwen35Runtime):
    """Deprecated: `Qwen35Runtime.from_decoder` / `Qwen35Runtime.from_pretrained`."""

    def __init__(self, decoder, batch_size: int = 1, max_length: int = 1024, buckets=None, trace: bool = False,
                 pack_weights: bool = False):
        warnings.warn(MOVED.format(new="optimum_qwen35.runtime.Qwen35Runtime.from_decoder"), FutureWarning, stacklevel=2)
        graphs = EagerGraphs(decoder, batch_size, max_length, trace, pack_weights)
        super().__init__(graphs, decoder.config, batch_size, max_length, buckets)

    @classmethod
    def from_pretrained(cls, path, *args, **kwargs) -> Qwen35Runtime:
        warnings.warn(MOVED.format(new="optimum_qwen35.runtime.Qwen35Runtime.from_pretrained"), FutureWarning, stacklevel=2)
        return Qwen35Runtime.from_pretrained(path, *args, **kwargs)


__all__ = ["Qwen35ForCausalLM", "default_buckets", "default_key_buckets", "load_decoder"]
