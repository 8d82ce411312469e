"""Deprecated package name (one release): `optimum_qwen35.optimum` is `optimum_qwen35.optimum_neuron` (a subpackage
named `optimum` read as the `optimum` library)."""

from __future__ import annotations

import warnings

__all__ = ["Qwen35NeuronModelForCausalLM", "register"]


def __getattr__(name: str):
    if name in __all__:
        warnings.warn(
            f"optimum_qwen35.optimum.{name} is deprecated and goes in the next release: use "
            f"optimum_qwen35.optimum_neuron.{name}", FutureWarning, stacklevel=2,
        )
        from optimum_qwen35 import optimum_neuron  # start-up: a name of it imports optimum-neuron

        return getattr(optimum_neuron, name)
    raise AttributeError(name)
