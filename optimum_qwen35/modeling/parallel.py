"""The layer factory: one model definition, whatever builds its parallel layers.

The model asks the factory for column-parallel and row-parallel linears, a vocab-parallel embedding
and lm_head. Sizes are always given per rank. `TorchLayers` builds plain torch modules with
torch.distributed collectives (tensor parallelism on CPU with gloo, or none at tp_degree 1). A Neuron
factory, with the same four methods over neuronx-distributed's parallel layers, is not written yet.

Weight shards follow neuronx-distributed's contract (ColumnParallelLinear splits the output dim into
contiguous rank blocks, RowParallelLinear the input dim, ParallelEmbedding the vocab), so both
backends load the same converted files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..config import Qwen35Config


@dataclass(frozen=True)
class ShardedDims:
    """Per-rank sizes of every sharded dimension, for a config and a tensor-parallel degree."""

    tp_degree: int
    num_heads: int
    num_kv_heads: int
    kv_replication: int  # how many ranks hold a copy of each KV head (1 unless KV heads < tp_degree)
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_conv_dim: int
    intermediate_size: int  # padded up to a multiple of tp_degree
    vocab_size: int  # padded up to a multiple of tp_degree

    @classmethod
    def from_config(cls, config: Qwen35Config, tp_degree: int = 1) -> "ShardedDims":
        config.check_tp_degree(tp_degree)
        t = tp_degree
        kv_replication = max(1, t // config.num_key_value_heads)
        nk = config.linear_num_key_heads // t
        nv = config.linear_num_value_heads // t
        return cls(
            tp_degree=t,
            num_heads=config.num_attention_heads // t,
            num_kv_heads=max(1, config.num_key_value_heads // t),
            kv_replication=kv_replication,
            linear_num_key_heads=nk,
            linear_num_value_heads=nv,
            linear_conv_dim=2 * nk * config.linear_key_head_dim + nv * config.linear_value_head_dim,
            intermediate_size=math.ceil(config.intermediate_size / t),
            vocab_size=math.ceil(config.vocab_size / t),
        )


class RowParallelLinear(nn.Linear):
    """A linear over this rank's slice of the input features, summed across ranks."""

    def __init__(self, in_features: int, out_features: int, group=None, tp_degree: int = 1):
        super().__init__(in_features, out_features, bias=False)
        self.group, self.tp_degree = group, tp_degree

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if self.tp_degree > 1:
            dist.all_reduce(y, group=self.group)
        return y


class VocabParallelEmbedding(nn.Embedding):
    """This rank's contiguous block of vocabulary rows; other ids read zeros, then ranks sum."""

    def __init__(self, vocab_per_rank: int, hidden_size: int, rank: int = 0, group=None, tp_degree: int = 1):
        super().__init__(vocab_per_rank, hidden_size)
        self.start, self.group, self.tp_degree = rank * vocab_per_rank, group, tp_degree

    def reset_parameters(self) -> None:
        # On the meta device (weights loaded afterwards) skip the random init: meta normal_ imports torch._dynamo (~2 s).
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_degree == 1:
            return super().forward(ids)
        local = ids - self.start
        inside = (local >= 0) & (local < self.num_embeddings)
        y = super().forward(torch.where(inside, local, torch.zeros_like(local))) * inside[..., None]
        dist.all_reduce(y, group=self.group)
        return y


class VocabParallelHead(nn.Linear):
    """lm_head over this rank's vocabulary block; logits are gathered whole and the padding cut off."""

    def __init__(self, hidden_size: int, vocab_per_rank: int, vocab_size: int, group=None, tp_degree: int = 1):
        super().__init__(hidden_size, vocab_per_rank, bias=False)
        self.vocab_size, self.group, self.tp_degree = vocab_size, group, tp_degree

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Logits come out in fp32 (float64 for float64 models) whatever the weights' dtype: operands in
        # the model dtype, accumulation and result in fp32, as TensorE accumulates into PSUM. Rounding
        # logits to bf16 (steps of 1/32 at |logit| ~ 5) would flip near-tied top-1 tokens for nothing.
        acc = torch.promote_types(x.dtype, torch.float32)
        y = torch.nn.functional.linear(x.to(acc), self.weight.to(acc))
        if self.tp_degree > 1:
            parts = [torch.empty_like(y) for _ in range(self.tp_degree)]
            dist.all_gather(parts, y.contiguous(), group=self.group)
            y = torch.cat(parts, dim=-1)
        return y[..., : self.vocab_size]


class TorchLayers:
    """Plain torch layers; with tp_degree > 1, torch.distributed collectives over `group`."""

    def __init__(self, tp_degree: int = 1, rank: int = 0, group=None):
        if tp_degree > 1 and not dist.is_initialized():
            raise RuntimeError("tensor parallelism on CPU needs torch.distributed initialized (gloo) first")
        self.tp_degree, self.rank, self.group = tp_degree, rank, group

    def column_linear(self, in_features: int, out_features_per_rank: int) -> nn.Module:
        # Column-parallel output stays sharded: the next row-parallel layer consumes it as is.
        return nn.Linear(in_features, out_features_per_rank, bias=False)

    def row_linear(self, in_features_per_rank: int, out_features: int) -> nn.Module:
        return RowParallelLinear(in_features_per_rank, out_features, self.group, self.tp_degree)

    def embedding(self, vocab_per_rank: int, hidden_size: int) -> nn.Module:
        return VocabParallelEmbedding(vocab_per_rank, hidden_size, self.rank, self.group, self.tp_degree)

    def lm_head(self, hidden_size: int, vocab_per_rank: int, vocab_size: int) -> nn.Module:
        return VocabParallelHead(hidden_size, vocab_per_rank, vocab_size, self.group, self.tp_degree)
