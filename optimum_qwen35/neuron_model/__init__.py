"""The Qwen3.5 export model without optimum-neuron: its metadata (neuron_config.py), the stack-neutral base of both
stacks' classes (base.py, running.py) and the class of the TorchNeuron stack (modeling.py); transformers 5's entry
points dispatch to it (auto.py). docs/torchneuron_stack.md says which class each stack gets.

Importing this package imports nothing; its names are loaded on first use.
"""

from __future__ import annotations

__all__ = ["Qwen35ModelForCausalLM", "NeuronModelForCausalLM", "neuron_model_class"]


def neuron_model_class():
    """The `NeuronModelForCausalLM` of this stack: optimum-neuron's subclass where optimum-neuron imports
    (`optimum_neuron/modeling.py`), else this package's own `Qwen35ModelForCausalLM` (the same API)."""
    from importlib.util import find_spec  # start-up time: `import optimum_qwen35` stays light

    if find_spec("optimum") is not None and find_spec("optimum.neuron") is not None:
        from optimum_qwen35.optimum_neuron.modeling import Qwen35NeuronModelForCausalLM  # start-up: imports optimum-neuron

        return Qwen35NeuronModelForCausalLM
    from optimum_qwen35.neuron_model.modeling import Qwen35ModelForCausalLM  # start-up: imports torch, transformers

    return Qwen35ModelForCausalLM


def __getattr__(name: str):
    if name == "NeuronModelForCausalLM":
        return neuron_model_class()
    if name == "Qwen35ModelForCausalLM":
        from optimum_qwen35.neuron_model.modeling import Qwen35ModelForCausalLM  # start-up: imports torch, transformers

        return Qwen35ModelForCausalLM
    raise AttributeError(name)
