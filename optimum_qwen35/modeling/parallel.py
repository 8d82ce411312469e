"""The layer factory: one model definition, whatever builds its parallel layers.

The model asks the factory for column-parallel and row-parallel linears, a vocab-parallel embedding
and lm_head. Sizes are always given per rank. `TorchLayers` builds plain torch modules with
torch.distributed's functional collectives (tensor parallelism on CPU with gloo, or none at tp_degree 1).
The Neuron factory, with the same four methods over neuronx-distributed's parallel layers, is
`optimum_qwen35.neuron.layers.NxDLayers` (it multiplies these per-rank sizes back to the global ones NxD takes).

The collectives are the functional ones (`_c10d_functional`, named by process-group name, returning new
tensors): `torch.export` records them as graph ops, so one exported program serves every rank, and the
rank itself is a tensor (`embed_tokens.rank`), not a Python constant, for the same reason.

Weight shards follow neuronx-distributed's contract (ColumnParallelLinear splits the output dim into
contiguous rank blocks, RowParallelLinear the input dim, ParallelEmbedding the vocab), so both
backends load the same converted files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..config import Qwen35Config
from .precision import TorchPrecision, accumulation_dtype


@dataclass(frozen=True)
class ShardedDims:
    """Per-rank sizes of every sharded dimension, for a config and a tensor-parallel degree."""

    num_heads: int
    num_kv_heads: int  # 1 when KV heads < tp_degree: each rank holds a copy of one (checkpoint/shard.py)
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_conv_dim: int
    intermediate_size: int  # padded up to a multiple of tp_degree
    vocab_size: int  # padded up to a multiple of tp_degree

    @classmethod
    def from_config(cls, config: Qwen35Config, tp_degree: int = 1) -> "ShardedDims":
        config.check_tp_degree(tp_degree)
        t = tp_degree
        nk = config.linear_num_key_heads // t
        nv = config.linear_num_value_heads // t
        return cls(
            num_heads=config.num_attention_heads // t,
            num_kv_heads=max(1, config.num_key_value_heads // t),
            linear_num_key_heads=nk,
            linear_num_value_heads=nv,
            linear_conv_dim=2 * nk * config.linear_key_head_dim + nv * config.linear_value_head_dim,
            intermediate_size=math.ceil(config.intermediate_size / t),
            vocab_size=math.ceil(config.vocab_size / t),
        )


def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum over the ranks of the group (a new tensor)."""
    return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", group_name))


def all_gather_last_dim(x: torch.Tensor, tp_degree: int, group_name: str) -> torch.Tensor:
    """Concatenate every rank's x along the last dimension, in rank order."""
    gathered = torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), tp_degree, group_name)
    gathered = torch.ops._c10d_functional.wait_tensor(gathered)  # [t * d0, ...]: rank blocks along dim 0
    parts = gathered.view(tp_degree, *x.shape)
    return parts.movedim(0, -2).reshape(*x.shape[:-1], tp_degree * x.shape[-1])


def can_pack(dtype: torch.dtype) -> bool:
    """Whether this torch build can prepack a weight of `dtype` for oneDNN's GEMM (`Linear.pack`): fp32, and bf16
    where oneDNN has bf16 kernels for this CPU (avx512_bf16 / AMX, or avx512 emulation)."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class Linear(nn.Linear):
    """A linear (bias-free unless asked: the decoder's are, the vision tower's are not) whose weight can be
    prepacked for CPU inference (`pack`).

    `F.linear` on CPU hands oneDNN (bf16) or MKL (fp32) the plain [out, in] weight, which they re-block on every
    call; `pack` re-blocks it once, for the batch size the calls will mostly have (the one torch's inductor uses for
    its CPU weight prepacking: `mkldnn._reorder_linear_weight` / `_linear_pointwise`). Same operands, same fp32
    accumulation; measured on one core (avx512_bf16, [3584, 1024] weights): 1.2x (fp32) and 1.6x (bf16) faster at
    one row, 2.2x and 2.1x at four rows, 1.1-1.2x at 1024 rows. The packed weight replaces the plain one (no second
    copy); `state_dict` still gives the plain one.
    """

    packed_for: int | None = None  # the batch size the weight is packed for

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)

    @property
    def packed(self) -> bool:
        return self.weight.is_mkldnn

    def pack(self, batch_size: int) -> None:
        """Re-block the weight for calls of about `batch_size` rows (`can_pack(weight.dtype)` must hold)."""
        if self.packed_for == batch_size:
            return
        plain = self.weight.detach().to_dense() if self.packed else self.weight.detach()
        self.weight = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(plain, batch_size), requires_grad=False)
        self.packed_for = batch_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.packed:
            destination[prefix + "weight"] = self.weight.detach().to_dense()


def pack_linears(module: nn.Module, batch_size: int) -> int:
    """Prepack every `Linear` of `module` (the lm_head too), and the MoE experts' matrices (`moe.Experts.pack`),
    whose dtype this build can pack, for calls of about `batch_size` rows (CPU inference: the module is not trained
    or re-loaded afterwards). Returns how many modules were packed. A packed weight replaces the plain one, except where the plain one is also used elsewhere: the lm_head
    of a model with tied embeddings gets a packed copy (vocab x hidden more in the model dtype), the embedding keeps
    the plain rows it looks up."""
    from .moe import Experts  # noqa: PLC0415 (moe imports this module)

    linears = [m for m in module.modules() if isinstance(m, Linear) and can_pack(m.weight.dtype)]
    for m in linears:
        m.pack(batch_size)
    experts = [m for m in module.modules() if isinstance(m, Experts) and can_pack(m.gate_up_proj.dtype)]
    for m in experts:
        m.pack(batch_size)
    return len(linears) + len(experts)


class RowParallelLinear(Linear):
    """A linear over this rank's slice of the input features, summed across ranks (a bias is added once, after
    the sum)."""

    def __init__(self, in_features: int, out_features: int, group_name: str | None = None, tp_degree: int = 1,
                 bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.group_name, self.tp_degree = group_name, tp_degree

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_degree == 1:
            return super().forward(x)
        if self.bias is None:
            return all_reduce(super().forward(x), self.group_name)
        if self.packed:
            y = torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        else:
            y = F.linear(x, self.weight)
        return all_reduce(y, self.group_name) + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """This rank's contiguous block of vocabulary rows; other ids read zeros, then ranks sum."""

    def __init__(self, vocab_per_rank: int, hidden_size: int, rank: int = 0, group_name: str | None = None, tp_degree: int = 1):
        super().__init__(vocab_per_rank, hidden_size)
        self.group_name, self.tp_degree = group_name, tp_degree
        # The rank as a tensor, loaded with the weights (as neuronx-distributed's rank_util does), so that the
        # same graph serves every rank. Built on the CPU even under the meta device: it is not a checkpoint tensor.
        self.register_buffer("rank", torch.tensor([rank], dtype=torch.int64, device="cpu"))

    def reset_parameters(self) -> None:
        # On the meta device (weights loaded afterwards) skip the random init: meta normal_ imports torch._dynamo (~2 s).
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_degree == 1:
            return super().forward(ids)
        local = ids - self.rank * self.num_embeddings
        inside = (local >= 0) & (local < self.num_embeddings)
        y = super().forward(torch.where(inside, local, torch.zeros_like(local))) * inside[..., None]
        return all_reduce(y, self.group_name)


class VocabParallelHead(Linear):
    """lm_head over this rank's vocabulary block; logits are gathered whole and the padding cut off.

    The padded rows (vocabulary not divisible by the TP degree: zero rows at the end of the last rank's
    block) are cut off here, inside the graph, so no argmax or sampler downstream can ever pick one."""

    def __init__(self, hidden_size: int, vocab_per_rank: int, vocab_size: int, group_name: str | None = None,
                 tp_degree: int = 1, precision=None):
        super().__init__(hidden_size, vocab_per_rank)
        self.vocab_size, self.group_name, self.tp_degree = vocab_size, group_name, tp_degree
        self.precision = precision or TorchPrecision()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Logits come out in fp32 (float64 for float64 models) whatever the weights' dtype: operands in the
        # model dtype, accumulated in fp32, in the form the backend's precision policy picks (no fp32 copy
        # of the weight per call).
        if self.packed:  # prepacked (CPU): the same model-dtype GEMM, its result made fp32
            y = super().forward(x.to(self.weight.dtype)).to(accumulation_dtype(self.weight.dtype))
        else:
            y = self.precision.logits(x, self.weight)
        if self.tp_degree > 1:
            y = all_gather_last_dim(y, self.tp_degree, self.group_name)
        return y[..., : self.vocab_size]


class TorchLayers:
    """Plain torch layers; with tp_degree > 1, torch.distributed collectives over `group`.

    `group` may be a process group or its name. Building the layers does not need torch.distributed
    (a graph can be built on the meta device and exported anywhere); running them at tp_degree > 1 does.
    `kernel_backend` names the kernel backend the model's DeltaNet layers call (e.g. "nki": the NKI kernels, on
    the emulator on CPU); None uses the process-wide one (`kernels.set_backend`).
    """

    # The precision policy of these layers' backend (modeling/precision.py): the model asks it for the forms of
    # its bf16-operand / fp32-accumulator matmuls.
    precision = TorchPrecision()
    # Context encoding runs the layers over at most this many rows (batch x tokens) at a time, in whole delta-rule
    # chunks (DecoderLayer.block_tokens). On CPU: the activations of a 4096-token prompt at once (projections, the
    # delta rule's per-chunk tensors, the MLP) would outweigh the KV cache; and glibc's malloc hands an allocation
    # above its mmap threshold (at most 32 MiB) back to the OS when freed, so such intermediates are fresh,
    # page-faulting memory on every call (elementwise ops on 50 MB tensors measured 4-5x slower than in place).
    # 1024 rows keep the largest (the conv's fp32 [rows, 6144] at the 2B shape: 24 MiB) below it: a bf16 prefill
    # of 4 x 512 tokens went from 7.3 to 5.1 s (1 thread) with 256-token blocks instead of one 2048-row block.
    # None: the whole block at once.
    token_block = 1024
    # State updates in place (modeling/state.py): a decode step moves only the slots it writes. A graph whose state
    # outputs are aliased to its inputs (the Neuron backend) needs updated copies instead: False.
    state_in_place = True

    def __init__(self, tp_degree: int = 1, rank: int = 0, group=None, kernel_backend: str | None = None):
        if group is None and tp_degree > 1:
            if not dist.is_initialized():
                raise RuntimeError("tensor parallelism on CPU needs torch.distributed initialized (gloo) first")
            group = dist.group.WORLD
        self.tp_degree, self.rank = tp_degree, rank
        self.group_name = group if isinstance(group, str) or group is None else group.group_name
        # The kernel backend of the model built over these layers (`optimum_qwen35.kernels`); None: the
        # process-wide one.
        self.kernel_backend = kernel_backend

    # The LNC degree the DeltaNet kernels are launched with (`kernels.deltanet_prefill(lnc=)`): on CPU none (the NKI
    # emulator takes that of the target it emulates); the Neuron factory passes its compiled target's.
    kernel_lnc = None

    def column_linear(self, in_features: int, out_features_per_rank: int, bias: bool = False) -> nn.Module:
        # Column-parallel output stays sharded: the next row-parallel layer consumes it as is.
        return Linear(in_features, out_features_per_rank, bias)

    def row_linear(self, in_features_per_rank: int, out_features: int, bias: bool = False) -> nn.Module:
        return RowParallelLinear(in_features_per_rank, out_features, self.group_name, self.tp_degree, bias)

    def embedding(self, vocab_per_rank: int, hidden_size: int) -> nn.Module:
        return VocabParallelEmbedding(vocab_per_rank, hidden_size, self.rank, self.group_name, self.tp_degree)

    def lm_head(self, hidden_size: int, vocab_per_rank: int, vocab_size: int) -> nn.Module:
        return VocabParallelHead(hidden_size, vocab_per_rank, vocab_size, self.group_name, self.tp_degree, self.precision)

    # The sparse MoE block's parts (modeling/moe.py), per-rank sizes (`moe.ExpertSharding`).
    def routed_experts(self, experts_per_rank: int, intermediate_per_rank: int, hidden_size: int) -> nn.Module:
        from .moe import Experts  # noqa: PLC0415 (moe.py imports this module)

        return Experts(experts_per_rank, intermediate_per_rank, hidden_size)

    def shared_expert(self, hidden_size: int, intermediate_per_rank: int) -> nn.Module:
        from .moe import SharedExpert  # noqa: PLC0415

        return SharedExpert(hidden_size, intermediate_per_rank)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's partial x (the MoE block's routed and shared outputs, summed once)."""
        return x if self.tp_degree == 1 else all_reduce(x, self.group_name)
