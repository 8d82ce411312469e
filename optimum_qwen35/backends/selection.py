"""Which backend builds and runs a Neuron target's graphs: NxD (optimum-neuron 0.4.5's `ModelBuilder`) or TorchNeuron.

Neuron SDK 2.34 (2026-11-30) ended support for NxD Inference and NxD Core's inference APIs (`ModelBuilder`,
`parallel_model_trace`) on trn2 / trn3 and points to TorchNeuron (`torch.compile(backend="neuron")`); trn1 and inf2
stay on NxD (maintenance at SDK 2.31; TorchNeuron supports trn2 / trn3 only). So, by target and what is installed:

    target       TorchNeuron installed   only NxD's SDK installed (SDK <= 2.33)   neither (no SDK)
    trn1 / inf2  nxd                     nxd                                      nxd (needs the SDK to export)
    trn2         torchneuron             nxd                                      torchneuron (its export needs no SDK)

`neuron_backend=` ("nxd" or "torchneuron") or the environment variable OPTIMUM_QWEN35_NEURON_BACKEND overrides it;
the choice is logged in one line. Standard library only (plus the two packages' presence).
"""

from __future__ import annotations

import importlib.util
import logging
import os

from optimum_qwen35.backends.torchneuron.device import torchneuron_installed
from optimum_qwen35.errors import UsageError
from optimum_qwen35.export.layout import NXD_BACKEND, TORCHNEURON_BACKEND

logger = logging.getLogger(__name__)

NEURON_BACKENDS = (NXD_BACKEND, TORCHNEURON_BACKEND)
BACKEND_ENV = "OPTIMUM_QWEN35_NEURON_BACKEND"
# TorchNeuron's targets (its docs: "relevant for Trn2, Trn3"); optimum-neuron 0.4.5 names trn2 (and trn3 none).
TORCHNEURON_TARGETS = ("trn2",)


def nxd_installed() -> bool:
    """NxD's inference SDK: neuronx-distributed beside a torch-neuronx (the XLA-based one of SDK <= 2.33)."""
    return all(importlib.util.find_spec(m) is not None for m in ("torch_neuronx", "neuronx_distributed"))


def choose_neuron_backend(target: str, requested: str | None = None) -> str:
    """"nxd" or "torchneuron" for a Neuron `target` ("trn1" or "trn2", optimum-neuron's compilation targets)."""
    requested = requested or os.environ.get(BACKEND_ENV) or None
    if requested is not None and requested not in NEURON_BACKENDS:
        raise UsageError(f"neuron_backend must be one of {', '.join(NEURON_BACKENDS)}, got {requested!r}")
    if target not in TORCHNEURON_TARGETS:
        if requested == TORCHNEURON_BACKEND:
            raise UsageError(
                f"neuron_backend 'torchneuron' runs on trn2 / trn3 only, not on target {target!r} (trn1, inf2): "
                "leave it out to use NxD, or export for --instance_type trn2"
            )
        return NXD_BACKEND
    if requested is not None:
        chosen, why = requested, "asked for"
    elif torchneuron_installed():
        chosen, why = TORCHNEURON_BACKEND, "TorchNeuron is installed"
    elif nxd_installed():
        chosen, why = NXD_BACKEND, "only NxD's Neuron SDK is installed (SDK <= 2.33)"
    else:
        chosen, why = TORCHNEURON_BACKEND, "no Neuron SDK here: a TorchNeuron export needs none, the device compiles it"
    logger.warning("%s export: %s backend (%s; choose with neuron_backend= or %s)", target, chosen, why, BACKEND_ENV)
    return chosen
