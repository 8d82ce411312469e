"""Qwen3.5 inside optimum-neuron: the model class (modeling.py), its neuron config, generation and scoring adapters,
its registration (registration.py) and the `optimum-cli export neuron` command (optimum_cli.py).

Importing this package imports nothing of optimum-neuron; `Qwen35NeuronModelForCausalLM` (which does) is loaded on
first use.
"""

from __future__ import annotations

__all__ = ["Qwen35NeuronModelForCausalLM", "register"]


def __getattr__(name: str):
    if name == "Qwen35NeuronModelForCausalLM":
        from optimum_qwen35.optimum_neuron.modeling import Qwen35NeuronModelForCausalLM  # start-up: imports optimum-neuron

        return Qwen35NeuronModelForCausalLM
    if name == "register":
        return register
    raise AttributeError(name)


def register() -> None:
    """Everything that can be registered in this process: the transformers configs, and the model class in
    optimum-neuron's registry (its module registers it when imported)."""
    from optimum_qwen35.optimum_neuron import modeling  # noqa: F401  start-up: imports optimum-neuron
    from optimum_qwen35.optimum_neuron.registration import register_transformers  # (the same module's neighbour)

    register_transformers()
