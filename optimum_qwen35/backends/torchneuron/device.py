"""Whether TorchNeuron is installed, and its import where a graph must run on the `neuron` device."""

from __future__ import annotations

import importlib
import importlib.util

import torch

from optimum_qwen35.errors import MissingDependencyError

# TorchNeuron (torch-neuronx 2.13+, Neuron SDK 2.33+) is built on torch 2.13 / 2.14; torch-neuronx releases before it
# are the torch-xla based package of SDK <= 2.33 (NxD's), on torch 2.8 / 2.9.
TORCHNEURON_MIN_TORCH = (2, 13)


def torchneuron_installed() -> bool:
    """torch-neuronx importable over a torch TorchNeuron is built on (the XLA-based torch-neuronx is not it)."""
    if importlib.util.find_spec("torch_neuronx") is None:
        return False
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) >= TORCHNEURON_MIN_TORCH


def import_torchneuron():
    """Import torch-neuronx (it registers the `neuron` device, the "neuron" compile backend and the "neuron"
    process-group backend); a one-line error without it."""
    if not torchneuron_installed():
        raise MissingDependencyError(
            "running a TorchNeuron export on the neuron device needs TorchNeuron (torch-neuronx 2.13+ of Neuron SDK "
            "2.33+, from AWS's package index on a trn2/trn3 instance), not installed here; to run its graphs on this "
            "machine's CPU pass compile_backend=\"eager\", device=\"cpu\" to from_pretrained"
        )
    return importlib.import_module("torch_neuronx")
