"""The layer factory over neuronx-distributed's parallel layers (needs the Neuron SDK; imported lazily).

Same four methods as `modeling.torch_layers.TorchLayers`, which the model calls with per-rank sizes. neuronx-distributed's
layers take global sizes and divide by the tensor-parallel degree themselves, so each per-rank size is multiplied
back by t: per-rank x t is exactly the size of the tensor's TP layout (`checkpoint/shard.py`: MLP and vocabulary
padded, KV heads repeated when t > KV heads), whose contiguous block r is rank r's shard -- neuronx-distributed's
split contract. Weights are created in the model dtype. Outputs of column-parallel layers stay sharded (the next
row-parallel layer takes them as they are); row-parallel layers all-reduce in the model dtype (`reduce_dtype`: neuronx-distributed's default is fp32, twice the
bytes of a bf16 activation; the cpu target's RowParallelLinear reduces its bf16 matmul result in bf16 too).

- embedding: ParallelEmbedding split by vocabulary, its rank read from a tensor (`use_spmd_rank`: the
  `embed_tokens.rank_util.rank` weight, arange(t) split by rank), so that one traced graph serves every rank;
- lm_head: a ColumnParallelLinear whose logits come out in fp32 (as `TorchLayers`' head: the host samples from
  fp32 logits), gathered across ranks along the vocabulary, the vocabulary padding cut off.

- the MoE block's routed experts: neuronx-distributed's `Experts` (modules/moe/experts.py: the fused
  `gate_up_proj` [E_r, H, 2 I_r] an ExpertFusedColumnParallelLinear split with stride 2, i.e. each rank its block of
  gate rows and the same block of up rows, `down_proj` [E_r, I_r, H] an ExpertFusedRowParallelLinear without its
  reduce), the mlp_op of its ExpertMLPs, run in the block's three forms: every token through every local expert (NxD's
  all-experts path), the chosen experts' weights gathered (NxD's selective loading, `expert_indices`), or blocks of
  tokens grouped by expert, each through its expert's gathered weights (prompts: `routed_blocks`);
- the shared expert: neuronx-distributed's `SharedExperts` (one expert, separate gate/up/down projections, no
  reduce); its sigmoid gate is a replicated linear of the block beside it (NxD's module has none);
- `reduce`: the block's one all-reduce (routed + gated shared), `reduce_from_tensor_model_parallel_region`, in the
  dtype the block hands it (the model dtype: `modeling.moe.SparseMoeBlock`).

The precision policy's Neuron form (`modeling.precision.NeuronPrecision`, SDK-free and tested on CPU) gives the
attention core, the lm_head's matmul and the operand casts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from neuronx_distributed.modules.moe.experts import Experts
from neuronx_distributed.modules.moe.moe_parallel_layers import (
    ExpertFusedColumnParallelLinear,
    ExpertFusedRowParallelLinear,
)
from neuronx_distributed.modules.moe.shared_experts import SharedExperts
from neuronx_distributed.parallel_layers.layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear
from neuronx_distributed.parallel_layers.mappings import (
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)

from optimum_qwen35.kernels.backends import FOR_NEURON
from optimum_qwen35.modeling.fp8 import select_experts
from optimum_qwen35.modeling.moe import weighted_sum
from optimum_qwen35.modeling.precision import NeuronPrecision


class VocabGatheringHead(ColumnParallelLinear):
    """lm_head over this rank's vocabulary rows: fp32 logits, gathered whole, the padding cut off."""

    def __init__(self, hidden_size: int, padded_vocab_size: int, vocab_size: int, dtype: torch.dtype, precision):
        super().__init__(hidden_size, padded_vocab_size, bias=False, gather_output=False, dtype=dtype)
        self.vocab_size, self.precision = vocab_size, precision

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Model-dtype operands, fp32 logits, no fp32 copy of the weight per call (the precision policy).
        logits = self.precision.logits(x, self.weight)
        logits = gather_from_tensor_model_parallel_region(logits, process_group=self.tensor_parallel_group)
        return logits[..., : self.vocab_size]


class RoutedExperts(Experts):
    """This rank's routed experts as neuronx-distributed's `Experts` holds them, in the two forms of
    `modeling.moe.Experts` (same arguments, same fp32 [N, H] result)."""

    def __init__(self, experts: int, intermediate: int, hidden_size: int, dtype: torch.dtype):
        # `intermediate` is per-rank x t: NxD's expert-fused linears divide it by t themselves. With whole experts a
        # rank ("ep") that is not the checkpoint layout's size, but only the per-rank shapes matter: the tensors
        # reach NxD already split per rank (neuron/state_dict.py), and NxD's expert-parallel group is one rank.
        super().__init__(
            num_experts=experts, hidden_size=hidden_size, intermediate_size=intermediate, glu=True,
            activation_fn=F.silu, dtype=dtype, device=torch.device("cpu"),
        )

    def dense(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, H], weights [N, E_r] -> [N, H] fp32: every token through every local expert (NxD's all-experts
        path), combined by one batched matmul in fp32."""
        out = self(x[None])  # [E_r, N, H]
        return weighted_sum(weights, out.transpose(0, 1))

    def blocks(self, x: torch.Tensor, block_expert: torch.Tensor) -> torch.Tensor:
        """x [nb, B, H] (rows grouped by expert), block_expert [nb] int32 -> [nb, B, H]: each block through its
        expert's weights, gathered (NxD's selective loading with one expert per block: hidden_states [E', C, H])."""
        return self(x, expert_indices=block_expert)

    def gathered(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [N, H], weights [N, k], local expert ids [N, k] int32 -> [N, H] fp32: each (token, expert) pair's
        weights gathered (NxD's selective loading, `expert_indices`), one batched matmul per projection."""
        N, k = ids.shape
        out = self(x.repeat_interleave(k, dim=0)[:, None, :], expert_indices=ids.reshape(-1))  # [N k, 1, H]
        return weighted_sum(weights, out.view(N, k, -1))


class _GathersFloat8Rows:
    """An expert-fused linear of neuronx-distributed holding a float8 weight (backends/nxd/fp8.py): called on some
    experts, it gathers their float8 rows and scales, then dequantizes them (`modeling.fp8.select_experts`); its own
    forward indexes `self.weight`, which would dequantize every expert's weight first, and read all of them."""

    def forward(self, input_: torch.Tensor, expert_indices: torch.Tensor | None = None, *_) -> torch.Tensor:
        if expert_indices is None:
            return super().forward(input_)
        # As neuronx-distributed's forward with expert indices, for what this model builds: no bias, no reduce (the
        # block reduces once), and no copy to the tensor-parallel region (an identity in a forward pass).
        assert self.bias is None and not getattr(self, "reduce_output", False)
        return self._forward_impl(
            input=input_, weight=select_experts(self, "weight", expert_indices), bias=None,
            async_grad_allreduce=False, sequence_parallel_enabled=False,
            autograd_func_class=self.autograd_func_class, process_group=self.tensor_parallel_group,
        )


class Float8ExpertColumnLinear(_GathersFloat8Rows, ExpertFusedColumnParallelLinear):
    pass


class Float8ExpertRowLinear(_GathersFloat8Rows, ExpertFusedRowParallelLinear):
    pass


def gather_float8_rows(linear: torch.nn.Module) -> None:
    """Before its weight becomes float8 (`fp8.hold_weights`): a routed experts' linear gathers float8 rows."""
    linear.__class__ = {ExpertFusedColumnParallelLinear: Float8ExpertColumnLinear,
                        ExpertFusedRowParallelLinear: Float8ExpertRowLinear}[type(linear)]


class SharedExpert(SharedExperts):
    """The shared SwiGLU expert (neuronx-distributed's SharedExperts: gate_proj / up_proj column-parallel,
    down_proj row-parallel without reduce); its partial output, summed by the block's one all-reduce."""

    def __init__(self, hidden_size: int, intermediate: int, dtype: torch.dtype):
        super().__init__(hidden_size, intermediate, num_shared_experts=1, hidden_act="silu", dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x, x.shape[0])


class NxDLayers:
    """The model's layer factory on Neuron (the interface of `modeling.torch_layers.TorchLayers`)."""

    # What every mixer asks for the forms of its bf16-operand / fp32-accumulator matmuls (modeling/precision.py).
    precision = NeuronPrecision()
    # Context encoding in one block (`TorchLayers.token_block` bounds CPU memory; neuronx-cc plans the graph's own).
    token_block = None
    # Functional state updates: each state output must be a new value aliased to its input (modeling/state.py).
    state_in_place = False
    # The functional updates already take int32 indices and rank <= 4 forms (`Slots`' XLA path): the TorchNeuron
    # layers' in-place graph form is not needed here.
    state_graph_form = False

    def __init__(self, tp_degree: int, dtype: torch.dtype, kernel_backend: str = FOR_NEURON, kernel_lnc: int = 1):
        # kernel_backend: what the DeltaNet layers of the traced module call (`adapter.kernel_backend`): "nki" launches
        # the `nki.jit` kernels inside the graph, "torch_for_neuron" traces the PyTorch references in neuronx-cc's
        # form (the gate's softplus from exp / log). kernel_lnc: the LNC degree
        # of the compiled target the kernels are launched with (`adapter.kernel_lnc`: 2 on trn2, 1 on trn1/inf2).
        self.tp_degree, self.dtype, self.kernel_backend, self.kernel_lnc = tp_degree, dtype, kernel_backend, kernel_lnc

    def column_linear(self, in_features: int, out_features_per_rank: int, bias: bool = False):
        return ColumnParallelLinear(
            in_features, out_features_per_rank * self.tp_degree, bias=bias, gather_output=False, dtype=self.dtype
        )

    def replicated_linear(self, in_features: int, out_features: int, bias: bool = False):
        # The whole weight on every rank, in the model dtype (the MTP head's fc at TP > 1: modeling/mtp.py).
        return torch.nn.Linear(in_features, out_features, bias=bias, dtype=self.dtype)

    def row_linear(self, in_features_per_rank: int, out_features: int, bias: bool = False):
        # reduce_dtype: the sum in the activation dtype (NxD's default, fp32, doubles every all-reduce's bytes; the
        # accuracy cost is measured by the bf16 tests, docs/neuron_backend.md "Collectives in the activation dtype").
        return RowParallelLinear(
            in_features_per_rank * self.tp_degree, out_features, bias=bias, input_is_parallel=True, dtype=self.dtype,
            reduce_dtype=self.dtype,
        )

    def embedding(self, vocab_per_rank: int, hidden_size: int):
        return ParallelEmbedding(
            vocab_per_rank * self.tp_degree, hidden_size, dtype=self.dtype, shard_across_embedding=False, use_spmd_rank=True
        )

    def lm_head(self, hidden_size: int, vocab_per_rank: int, vocab_size: int):
        return VocabGatheringHead(hidden_size, vocab_per_rank * self.tp_degree, vocab_size, self.dtype, self.precision)

    # The sparse MoE block's parts (modeling/moe.py), per-rank sizes (`moe.ExpertSharding`) x t.
    def routed_experts(self, experts_per_rank: int, intermediate_per_rank: int, hidden_size: int):
        return RoutedExperts(experts_per_rank, intermediate_per_rank * self.tp_degree, hidden_size, self.dtype)

    def shared_expert(self, hidden_size: int, intermediate_per_rank: int):
        return SharedExpert(hidden_size, intermediate_per_rank * self.tp_degree, self.dtype)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tensor_model_parallel_region(x)
