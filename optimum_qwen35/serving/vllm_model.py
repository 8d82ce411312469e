"""The class this package registers with vLLM for Qwen3.5 exports (`serving/vllm_plugin.py`).

vLLM resolves `config.json`'s architecture and inspects the registered class (in a child interpreter) before any
worker starts: it must be an `nn.Module` taking `vllm_config`, with `input_ids` and `positions` in `forward` and a
`compute_logits`. optimum-neuron's vLLM platform never builds it: its worker loads the export with
`NeuronModelForCausalLM.from_pretrained` (this package's class, through optimum-neuron's registry). So this module
imports torch only (no Neuron SDK, no optimum-neuron loader), and building the class means optimum-neuron's platform
is not the active one: one line says so.
"""

from __future__ import annotations

import torch
from torch import nn

NOT_THROUGH_OPTIMUM_NEURON = (
    "Qwen3.5 exports are served through optimum-neuron's vLLM platform (installed with optimum-neuron 0.4.5), "
    "which was not the active platform here: install optimum-neuron in this environment and do not exclude "
    "its plugin from VLLM_PLUGINS"
)


class Qwen35ForOptimumNeuron(nn.Module):
    """What vLLM inspects for `Qwen3_5ForCausalLM` / `Qwen3_5ForConditionalGeneration` (and their `Qwen3_5Moe` forms):
    a text-generation model."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        raise RuntimeError(NOT_THROUGH_OPTIMUM_NEURON)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, **kwargs) -> torch.Tensor:
        raise RuntimeError(NOT_THROUGH_OPTIMUM_NEURON)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(NOT_THROUGH_OPTIMUM_NEURON)
