"""Qwen3.5 for AWS Trainium and Inferentia through optimum-neuron, with every part that can run on CPU tested there."""

from .config import Qwen35Config, UnsupportedModelError

__version__ = "0.1.0.dev0"

__all__ = ["Qwen35Config", "UnsupportedModelError", "__version__"]
