"""The layer factory of TorchNeuron graphs: the cpu target's plain torch layers, shaped for a device graph."""

from __future__ import annotations

from optimum_qwen35.modeling.precision import NeuronPrecision
from optimum_qwen35.modeling.torch_layers import TorchLayers


class TorchNeuronLayers(TorchLayers):
    """`TorchLayers` (functional `_c10d_functional` collectives, the state written in place, which TorchNeuron keeps
    as aliased input mutations) with two changes a device graph needs:

    - the whole block in one pass (`token_block = None`): the CPU's row blocks bound host memory, a device graph is
      one program over the bucket, as the NxD graphs trace it;
    - the Neuron precision form (`NeuronPrecision`: the attention core as 3-D batched matmuls). The CPU form (SDPA
      with `enable_gqa`), decomposed, broadcasts K/V to rank-5 tensors, which neuronx-cc's contract refuses
      (docs/torchneuron.md, measured on tiny-2b)."""

    token_block = None
    precision = NeuronPrecision()
