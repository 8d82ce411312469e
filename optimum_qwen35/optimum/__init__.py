"""Qwen3.5 inside optimum-neuron: the model class, its export folder, and the hooks that register it.

Importing this package imports optimum-neuron; `Qwen35NeuronModelForCausalLM` is loaded on first use.
"""

from __future__ import annotations

__all__ = ["Qwen35NeuronModelForCausalLM", "register"]


# Where optimum (optimum-neuron) is not installed, e.g. the transformers 5 environment: one line saying where it is.
NEEDS_OPTIMUM_NEURON = (
    "optimum_qwen35.optimum (exports: Qwen35NeuronModelForCausalLM, NeuronModelForCausalLM) needs optimum-neuron, "
    "which is not installed in this environment: optimum-neuron pins transformers 4.57, so it has its own environment "
    "(pip install \"optimum-qwen35[optimum]\"); this one loads checkpoints (optimum_qwen35.Qwen35ForCausalLM, or "
    "transformers' own Qwen3.5 classes with transformers >= 5), not exports"
)


def __getattr__(name: str):
    try:
        if name == "Qwen35NeuronModelForCausalLM":
            from .modeling import Qwen35NeuronModelForCausalLM

            return Qwen35NeuronModelForCausalLM
        if name == "register":
            from .registration import register

            return register
    except ModuleNotFoundError as error:
        if error.name not in ("optimum", "optimum.neuron"):
            raise
        raise ModuleNotFoundError(NEEDS_OPTIMUM_NEURON, name=error.name) from None
    raise AttributeError(name)
