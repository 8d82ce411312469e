"""Qwen3.5 for AWS Trainium and Inferentia through optimum-neuron, with every part that can run on CPU tested there."""

from .config import Qwen35Config, UnsupportedModelError, register_transformers_configs

__version__ = "0.1.0.dev0"

# transformers 4.57 (optimum-neuron's pin) has no `qwen3_5`: teach its AutoConfig to read Qwen3.5 folders.
register_transformers_configs()

__all__ = ["Qwen35Config", "UnsupportedModelError", "register_transformers_configs", "__version__"]
