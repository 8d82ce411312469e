"""The layer factory of TorchNeuron graphs: the cpu target's plain torch layers, shaped for a device graph."""

from __future__ import annotations

import torch

from optimum_qwen35.kernels.backends import FOR_NEURON
from optimum_qwen35.modeling.precision import NeuronPrecision
from optimum_qwen35.modeling.torch_layers import TorchLayers


class TorchNeuronPrecision(NeuronPrecision):
    """`NeuronPrecision` with the vision tower's LayerNorm written out in the input's dtype (mean, then the mean of
    squared deviations): `F.layer_norm` decomposed through torch-mlir computes its variance in f64 (its `aten.var`
    decomposition upcasts fp32 to f64), which neuronx-cc does not take. Same formula, fp32 throughout."""

    name = "torchneuron"

    @staticmethod
    def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        centred = x - x.mean(-1, keepdim=True)
        variance = (centred * centred).mean(-1, keepdim=True)
        return centred * torch.rsqrt(variance + eps) * weight + bias


class TorchNeuronLayers(TorchLayers):
    """`TorchLayers` (functional `_c10d_functional` collectives, the state written in place, which TorchNeuron keeps
    as aliased input mutations) with what a device graph needs:

    - the whole block in one pass (`token_block = None`): the CPU's row blocks bound host memory, a device graph is
      one program over the bucket, as the NxD graphs trace it;
    - the Neuron precision form (`TorchNeuronPrecision`: the attention core as 3-D batched matmuls, the vision
      LayerNorm written out in fp32). The CPU form (SDPA
      with `enable_gqa`), decomposed, broadcasts K/V to rank-5 tensors, which neuronx-cc's contract refuses
      (docs/torchneuron.md, measured on tiny-2b);
    - the state writes in the device graphs' form (`state_graph_form`, `Slots` in modeling/state.py): int32 indices
      and rank <= 4 index forms, still in place;
    - the DeltaNet kernels in the form the Neuron compiler takes (`kernels.backends.FOR_NEURON`: the gate's softplus
      from exp / log) unless another backend is named."""

    token_block = None
    precision = TorchNeuronPrecision()
    state_graph_form = True

    def __init__(self, tp_degree: int = 1, rank: int = 0, group=None, kernel_backend: str | None = FOR_NEURON):
        super().__init__(tp_degree, rank, group, kernel_backend)
