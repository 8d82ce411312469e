"""The layer factory of TorchNeuron graphs: the cpu target's plain torch layers, shaped for a device graph."""

from __future__ import annotations

from optimum_qwen35.kernels.backends import FOR_NEURON
from optimum_qwen35.modeling.precision import NeuronPrecision
from optimum_qwen35.modeling.torch_layers import TorchLayers


class TorchNeuronLayers(TorchLayers):
    """`TorchLayers` (functional `_c10d_functional` collectives, the state written in place, which TorchNeuron keeps
    as aliased input mutations) with three changes a device graph needs:

    - the whole block in one pass (`token_block = None`): the CPU's row blocks bound host memory, a device graph is
      one program over the bucket, as the NxD graphs trace it;
    - the Neuron precision form (`NeuronPrecision`: the attention core as 3-D batched matmuls). The CPU form (SDPA
      with `enable_gqa`), decomposed, broadcasts K/V to rank-5 tensors, which neuronx-cc's contract refuses
      (docs/torchneuron.md, measured on tiny-2b);
    - the DeltaNet kernels in the form the Neuron compiler takes (`kernels.backends.FOR_NEURON`: the gate's softplus
      from exp / log) unless another backend is named."""

    token_block = None
    precision = NeuronPrecision()

    def __init__(self, tp_degree: int = 1, rank: int = 0, group=None, kernel_backend: str | None = FOR_NEURON):
        super().__init__(tp_degree, rank, group, kernel_backend)
