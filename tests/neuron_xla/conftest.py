"""The Neuron targets on torch-xla's CPU device: the nox `neuron` session only (torch 2.8, torch-xla 2.8,
optimum-neuron 0.4.5, neuronx-distributed 0.15 from ../shared/upstream, the SDK import stand-ins).

Elsewhere this folder is not collected. In that session it must be (a broken environment then collects nothing,
and pytest's "no tests ran" fails the session).
"""

from __future__ import annotations

import importlib.util
import os

NEEDED = ("torch_xla", "neuronx_distributed", "neuron_sdk_standin")

if not all(importlib.util.find_spec(m) for m in NEEDED):
    collect_ignore_glob = ["*.py"]
else:
    # XLA's CPU backend at LLVM -O0: a graph compiles in seconds instead of minutes; what it computes is the same
    # HLO, and the numbers are checked against transformers' at the stated tolerances. Set before torch-xla starts.
    os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
    # optimum-neuron sets the compilation target on import (trn1 on a machine without a device), and
    # neuronx-distributed reads it at import time: optimum.neuron first, as every optimum-neuron entry point does.
    import optimum.neuron  # noqa: F401
