"""Qwen3.5 inside optimum-neuron: the model class, its export folder, and the hooks that register it.

Importing this package imports optimum-neuron; `Qwen35NeuronModelForCausalLM` is loaded on first use.
"""

from __future__ import annotations

__all__ = ["Qwen35NeuronModelForCausalLM", "register"]


def __getattr__(name: str):
    if name == "Qwen35NeuronModelForCausalLM":
        from optimum_qwen35.optimum.modeling import Qwen35NeuronModelForCausalLM

        return Qwen35NeuronModelForCausalLM
    if name == "register":
        from optimum_qwen35.optimum.registration import register

        return register
    raise AttributeError(name)
