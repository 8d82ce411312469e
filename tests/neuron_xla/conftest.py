"""The Neuron targets on torch-xla's CPU device: the nox `neuron` session only (torch 2.8, torch-xla 2.8,
optimum-neuron 0.4.5, neuronx-distributed 0.15 from ../shared/upstream, the SDK import stand-ins).

Elsewhere this folder is not collected. In that session it must be (a broken environment then collects nothing,
and pytest's "no tests ran" fails the session).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

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


@pytest.fixture(scope="session")
def reference() -> set[str]:
    """The compiler contract's reference census (tests/kit/hlo_contract.py): optimum-neuron 0.4.5's own Qwen3, Llama
    and Qwen3-MoE NxD graphs, TP 1 and 2, fp32 and bf16, lowered once per session for every test that checks it."""
    from tests.kit import hlo_contract  # needs torch-xla: only in the neuron session

    hlos = []
    for kind in hlo_contract.REFERENCE_MODELS:
        for tp, dtype in ((1, torch.float32), (1, torch.bfloat16), (2, torch.float32), (2, torch.bfloat16)):
            hlos += list(hlo_contract.reference_hlos(kind, "trn2", tp, dtype).values())
    census = hlo_contract.reference_census(hlos)
    print(f"\nreference census ({len(hlos)} graphs): {sorted(census)}")
    return census
