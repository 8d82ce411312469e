"""Qwen3.5 for AWS Trainium and Inferentia through optimum-neuron, with every part that can run on CPU tested there.

Importing this package imports only the standard library. It installs an import hook (`_startup`) that
registers Qwen3.5 with transformers 4.57 (optimum-neuron's pin, which predates it) and with optimum-neuron
as soon as the program imports them, and with transformers 5's Auto classes and pipelines (exports load with
this package's class, checkpoints with transformers' own); the installed `optimum_qwen35.pth` does the same in every
interpreter.

`optimum_qwen35.NeuronModelForCausalLM` (loaded on first use) is the Qwen3.5 export model of this stack:
optimum-neuron's subclass where optimum-neuron is installed (the NxD stack), else this package's own class with the
same API (the TorchNeuron stack; docs/torchneuron_stack.md).
"""

from optimum_qwen35 import _startup
from optimum_qwen35.config import Qwen35Config, register_transformers_configs
from optimum_qwen35.errors import Qwen35Error, UnsupportedModelError
from optimum_qwen35.version import __version__

_startup.install()

__all__ = ["NeuronModelForCausalLM", "Qwen35Config", "Qwen35Error", "UnsupportedModelError", "register_transformers_configs", "__version__"]


def __getattr__(name: str):
    if name == "NeuronModelForCausalLM":
        from optimum_qwen35.neuron_model import neuron_model_class  # start-up: imports torch, transformers (optimum-neuron)

        return neuron_model_class()
    raise AttributeError(f"module 'optimum_qwen35' has no attribute {name!r}")
