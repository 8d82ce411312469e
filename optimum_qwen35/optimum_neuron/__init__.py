"""Qwen3.5 inside optimum-neuron: the model class (modeling.py), its neuron config, generation and scoring adapters,
its registration (registration.py); `optimum-cli export neuron` without the SDK is optimum_qwen35/cli/optimum_cli.py.

Importing this package imports nothing of optimum-neuron; `Qwen35NeuronModelForCausalLM` (which does) is loaded on
first use.
"""

from __future__ import annotations

__all__ = ["Qwen35NeuronModelForCausalLM", "register"]

# Where optimum (optimum-neuron) is not installed, e.g. the transformers 5 environment: one line saying where it is.
NEEDS_OPTIMUM_NEURON = (
    "optimum_qwen35.optimum_neuron (exports: Qwen35NeuronModelForCausalLM, NeuronModelForCausalLM) needs optimum-neuron, "
    "which is not installed in this environment (the TorchNeuron stack): use `from optimum_qwen35 import "
    "NeuronModelForCausalLM`, the same API without optimum-neuron (docs/torchneuron_stack.md)"
)


def __getattr__(name: str):
    if name == "Qwen35NeuronModelForCausalLM":
        try:
            from optimum_qwen35.optimum_neuron.modeling import Qwen35NeuronModelForCausalLM  # start-up: imports optimum-neuron
        except ModuleNotFoundError as error:
            if error.name not in ("optimum", "optimum.neuron"):
                raise
            raise ModuleNotFoundError(NEEDS_OPTIMUM_NEURON, name=error.name) from None
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
