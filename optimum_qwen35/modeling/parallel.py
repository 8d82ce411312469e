"""The layer factory: one model definition, whatever builds its parallel layers.

The model asks the factory for column-parallel and row-parallel linears, a vocab-parallel embedding
and lm_head. Sizes are always given per rank. `TorchLayers` builds plain torch modules with
torch.distributed's functional collectives (tensor parallelism on CPU with gloo, or none at tp_degree 1).
The Neuron factory, with the same four methods over neuronx-distributed's parallel layers, is
`optimum_qwen35.backends.nxd.layers.NxDLayers` (it multiplies these per-rank sizes back to the global ones NxD takes).

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
        self.register_buffer("rank", torch.tensor([rank], dtype=torch.int32, device="cpu"))  # int32: ids stay int32

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
