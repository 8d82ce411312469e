"""Qwen3.5 for AWS Trainium and Inferentia through optimum-neuron, with every part that can run on CPU tested there.

Importing this package imports only the standard library. It installs an import hook (`_startup`) that
registers Qwen3.5 with transformers 4.57 (optimum-neuron's pin, which predates it) and with optimum-neuron
as soon as the program imports them; the installed `optimum_qwen35.pth` does the same in every interpreter.
"""

from optimum_qwen35 import _startup
from optimum_qwen35.config import Qwen35Config, register_transformers_configs
from optimum_qwen35.errors import Qwen35Error, UnsupportedModelError
from optimum_qwen35.version import __version__

_startup.install()

__all__ = ["Qwen35Config", "Qwen35Error", "UnsupportedModelError", "register_transformers_configs", "__version__"]
