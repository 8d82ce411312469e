"""Tensor-parallel sharding of converted Qwen3.5 weights, and per-rank safetensors exports.

The contract is neuronx-distributed's, so that the CPU runtime (`TorchLayers`) and the Neuron backend
load the very same files: a ColumnParallelLinear holds a contiguous block of output rows, a
RowParallelLinear a contiguous block of input columns, a ParallelEmbedding (and the lm_head) a
contiguous block of vocabulary rows. Where a contiguous split would cut across heads, the converted
whole tensor is first brought into a *TP layout* (rows permuted, zero padding appended, KV heads
replicated) so that rank r's shard is simply block r of that layout along the split dimension:

    shard_tensor(name, whole, config, t, r) == tp_layout(name, whole, config, t).chunk(t, dim)[r]

and `unshard_tensor` inverts it (strips padding, undoes the permutation, checks that replicas agree).

Per tensor (decoder names; see docs/tensor_parallel.md for the table):

- DeltaNet `in_proj_qkv` rows and `conv_weight` channels: [q | k | v] -> [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]
  where rank r holds key heads r*nk/t .. and the value heads that read them (value head h reads key
  head h // (nv/nk), so they are value heads r*nv/t .. (r+1)*nv/t - 1); `in_proj_z`, `in_proj_a`,
  `in_proj_b`, `A_log`, `dt_bias` rows by value head (already contiguous); `out_proj` columns by value
  head; `norm.weight` (per dv, shared by all heads) replicated.
- Attention `q_proj` rows by query head (each head's [q | gate] is contiguous); `k_proj`/`v_proj` rows
  by KV head, and when t > num_key_value_heads each KV head is repeated t / kv times so that rank r
  holds KV head r // (t / kv): exactly the KV head its query heads r*H/t .. use (query head j reads KV
  head j // (H / kv)); `o_proj` columns by query head; `q_norm`/`k_norm` replicated.
- MLP `gate_proj`/`up_proj` rows, `down_proj` columns, with the intermediate size zero-padded to a
  multiple of t; `embed_tokens` and (untied) `lm_head` rows by vocabulary, zero-padded to a multiple of t.
- Layer norms and the final norm replicated.
- MoE blocks (modeling/moe.py): the router `mlp.gate` and `mlp.shared_expert_gate` replicated; the shared expert
  like the MLP (its own width zero-padded); the routed experts by `Qwen35Config.expert_parallel_mode`: "ep" splits
  `experts.gate_up_proj` / `experts.down_proj` by whole experts (dim 0, zero experts appended to a multiple of t),
  "tp" splits every expert's intermediate rows (`gate_up_proj` dim 1 in the layout [gate_0 up_0 | gate_1 up_1 | ..],
  `down_proj` dim 2; zero-padded to a multiple of t). The manifest records the mode.

The per-rank files of a sharded export are written and read by checkpoint/sharded_files.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..config import Qwen35Config
from ..export import layout
from .convert import (
    convert_checkpoint,
    convert_mtp,
    decoder_name,
    expected_shapes,
    stored_dtype,
)
from .reader import SAFETENSORS_DTYPES, CheckpointReader

MANIFEST, MANIFEST_FORMAT, MANIFEST_VERSION = layout.TP_SHARDS_FILE, layout.TP_SHARDS_FORMAT, layout.TP_SHARDS_VERSION
rank_file = layout.rank_file  # a rank's file name in a sharded folder (the format is export/layout.py's)

_DTYPE_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}

# Sharding kinds.
REPLICATED = "replicated"
COLUMN = "column"  # output rows, contiguous blocks (ColumnParallelLinear)
ROW = "row"  # input columns, contiguous blocks (RowParallelLinear)
COLUMN_PADDED = "column_padded"  # MLP gate/up rows, intermediate zero-padded to a multiple of t
ROW_PADDED = "row_padded"  # MLP down columns, intermediate zero-padded
VOCAB = "vocab"  # embedding / lm_head rows, vocabulary zero-padded (ParallelEmbedding)
KV_HEADS = "kv_heads"  # k_proj / v_proj rows by KV head, heads repeated when t > num_key_value_heads
DELTANET_QKV = "deltanet_qkv"  # in_proj_qkv rows / conv channels, permuted to per-rank [q_r | k_r | v_r]
SHARED_COLUMN = "shared_column"  # MoE shared expert gate/up rows, its width zero-padded to a multiple of t
SHARED_ROW = "shared_row"  # MoE shared expert down columns, zero-padded
EXPERTS_GATE_UP = "experts_gate_up"  # routed experts [E, 2I, H]: whole experts ("ep") or [gate_r up_r] rows ("tp")
EXPERTS_DOWN = "experts_down"  # routed experts [E, H, I]: whole experts ("ep") or intermediate columns ("tp")
_EXPERT_KINDS = (EXPERTS_GATE_UP, EXPERTS_DOWN)

_SUFFIX_KINDS = (
    ("mlp.gate.weight", REPLICATED),  # the MoE router
    ("mlp.shared_expert_gate.weight", REPLICATED),
    ("mlp.shared_expert.gate_proj.weight", SHARED_COLUMN),
    ("mlp.shared_expert.up_proj.weight", SHARED_COLUMN),
    ("mlp.shared_expert.down_proj.weight", SHARED_ROW),
    ("mlp.experts.gate_up_proj", EXPERTS_GATE_UP),
    ("mlp.experts.down_proj", EXPERTS_DOWN),
    ("linear_attn.in_proj_qkv.weight", DELTANET_QKV),
    ("linear_attn.conv_weight", DELTANET_QKV),
    ("linear_attn.in_proj_z.weight", COLUMN),
    ("linear_attn.in_proj_a.weight", COLUMN),
    ("linear_attn.in_proj_b.weight", COLUMN),
    ("linear_attn.A_log", COLUMN),
    ("linear_attn.dt_bias", COLUMN),
    ("linear_attn.out_proj.weight", ROW),
    ("self_attn.q_proj.weight", COLUMN),
    ("self_attn.k_proj.weight", KV_HEADS),
    ("self_attn.v_proj.weight", KV_HEADS),
    ("self_attn.o_proj.weight", ROW),
    ("mlp.gate_proj.weight", COLUMN_PADDED),
    ("mlp.up_proj.weight", COLUMN_PADDED),
    ("mlp.down_proj.weight", ROW_PADDED),
    ("norm.weight", REPLICATED),  # input/post_attention layernorms, final norm, q/k norms, DeltaNet norm
    # The MTP head (modeling/mtp.py): its fc and input norms whole on every rank (fc's output is the head's residual
    # stream); `mtp.layers.N.*` and `mtp.norm` take the main layers' rules above.
    ("mtp.fc.weight", REPLICATED),
    ("mtp.pre_fc_norm_embedding.weight", REPLICATED),
    ("mtp.pre_fc_norm_hidden.weight", REPLICATED),
)


def shard_kind(name: str) -> str:
    """How the decoder parameter `name` is split across ranks (one of the kinds above)."""
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return VOCAB
    for suffix, kind in _SUFFIX_KINDS:
        if name.endswith(suffix):
            return kind
    raise KeyError(f"no tensor-parallel sharding rule for tensor {name!r}")


def shard_dim(name: str, config: Qwen35Config | None = None, tp_degree: int = 1) -> int | None:
    """The dimension split into contiguous rank blocks (None: every rank holds the whole tensor). The routed experts'
    depends on the expert-parallel mode: pass the config and the degree for them."""
    kind = shard_kind(name)
    if kind == REPLICATED:
        return None
    if kind in _EXPERT_KINDS:
        if config is None:
            raise ValueError(f"{name}: the split dim of routed experts depends on the config and the degree")
        if config.expert_parallel_mode(tp_degree) == "ep":
            return 0
        return 1 if kind == EXPERTS_GATE_UP else 2
    return 1 if kind in (ROW, ROW_PADDED, SHARED_ROW) else 0


# ------------------------------------------------------------------------------------------ index maps
def deltanet_rank_heads(config: Qwen35Config, tp_degree: int, rank: int) -> tuple[range, range]:
    """(key heads, value heads) of a rank: a block of key heads and the value heads that read them."""
    nk, nv = config.linear_num_key_heads // tp_degree, config.linear_num_value_heads // tp_degree
    return range(rank * nk, (rank + 1) * nk), range(rank * nv, (rank + 1) * nv)


def deltanet_qkv_permutation(config: Qwen35Config, tp_degree: int) -> torch.Tensor:
    """Row order of the TP layout of in_proj_qkv / conv channels: index i of the layout reads row perm[i].

    Checkpoint rows are [q (nk*dk) | k (nk*dk) | v (nv*dv)]; the layout is [q_r | k_r | v_r] for r = 0..t-1.
    """
    dk, dv, key_dim = config.linear_key_head_dim, config.linear_value_head_dim, config.linear_key_dim
    blocks = []
    for rank in range(tp_degree):
        key_heads, value_heads = deltanet_rank_heads(config, tp_degree, rank)
        k0, k1 = key_heads.start * dk, key_heads.stop * dk
        v0, v1 = value_heads.start * dv, value_heads.stop * dv
        blocks += [torch.arange(k0, k1), torch.arange(key_dim + k0, key_dim + k1), torch.arange(2 * key_dim + v0, 2 * key_dim + v1)]
    return torch.cat(blocks)


def kv_replication(config: Qwen35Config, tp_degree: int) -> int:
    """How many ranks hold each KV head (1 unless tp_degree > num_key_value_heads)."""
    return max(1, tp_degree // config.num_key_value_heads)


def kv_heads_of_rank(config: Qwen35Config, tp_degree: int, rank: int) -> range:
    """The KV heads a rank holds: a block of them, or the single head rank // (t / kv) when replicated."""
    kv = config.num_key_value_heads
    if tp_degree <= kv:
        per_rank = kv // tp_degree
        return range(rank * per_rank, (rank + 1) * per_rank)
    head = rank // (tp_degree // kv)
    return range(head, head + 1)


def _padded(size: int, tp_degree: int) -> int:
    return -(-size // tp_degree) * tp_degree


def _pad(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    extra = size - tensor.shape[dim]
    if extra == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = extra
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)


# ------------------------------------------------------------------------------------------ pure math
def tp_layout(name: str, tensor: torch.Tensor, config: Qwen35Config, tp_degree: int) -> tuple[torch.Tensor, int | None]:
    """The converted whole tensor brought into its TP layout, and the split dim (None: replicated).

    Rank r's shard is block r of t equal contiguous blocks of the layout along that dim (a view when
    no permutation, padding or replication is needed).
    """
    config.check_tp_degree(tp_degree)
    kind, dim = shard_kind(name), shard_dim(name, config, tp_degree)
    t = tp_degree
    if kind in _EXPERT_KINDS and dim == 0:
        tensor = _pad(tensor, 0, _padded(config.num_experts, t))
    elif kind == EXPERTS_GATE_UP:
        E, _, H = tensor.shape
        inter, padded = config.moe_intermediate_size, _padded(config.moe_intermediate_size, t)
        halves = _pad(tensor.reshape(E, 2, inter, H), 2, padded)  # [E, gate/up, I, H]
        tensor = halves.reshape(E, 2, t, padded // t, H).transpose(1, 2).reshape(E, 2 * padded, H)
    elif kind == EXPERTS_DOWN:
        tensor = _pad(tensor, 2, _padded(config.moe_intermediate_size, t))
    elif kind in (SHARED_COLUMN, SHARED_ROW):
        tensor = _pad(tensor, dim, _padded(config.shared_expert_intermediate_size, t))
    elif kind == DELTANET_QKV:
        tensor = tensor.index_select(0, deltanet_qkv_permutation(config, t).to(tensor.device))
    elif kind == KV_HEADS:
        rep = kv_replication(config, t)
        if rep > 1:
            kv, hd = config.num_key_value_heads, config.head_dim
            tensor = tensor.reshape(kv, hd, -1).repeat_interleave(rep, dim=0).reshape(kv * rep * hd, -1)
    elif kind in (COLUMN_PADDED, ROW_PADDED):
        tensor = _pad(tensor, dim, _padded(config.intermediate_size, t))
    elif kind == VOCAB:
        tensor = _pad(tensor, 0, _padded(config.vocab_size, t))
    if dim is not None and tensor.shape[dim] % t:
        raise ValueError(f"{name}: dim {dim} of size {tensor.shape[dim]} does not split into {t} equal blocks")
    return tensor, dim


def shard_tensor(name: str, tensor: torch.Tensor, config: Qwen35Config, tp_degree: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s shard of the converted whole tensor `name` (may be a view of `tensor`)."""
    if not 0 <= rank < tp_degree:
        raise ValueError(f"rank {rank} is outside 0..{tp_degree - 1}")
    layout, dim = tp_layout(name, tensor, config, tp_degree)
    return layout if dim is None else layout.chunk(tp_degree, dim)[rank]


def unshard_tensor(name: str, shards: list[torch.Tensor], config: Qwen35Config) -> torch.Tensor:
    """Reassemble the converted whole tensor from every rank's shard (the inverse of `shard_tensor`).

    Raises if replicated copies (norms, repeated KV heads) differ between ranks.
    """
    t = len(shards)
    config.check_tp_degree(t)
    kind, dim = shard_kind(name), shard_dim(name, config, t)
    if kind == REPLICATED:
        for rank, s in enumerate(shards[1:], 1):
            if not torch.equal(s, shards[0]):
                raise ValueError(f"{name}: the replicated copy on rank {rank} differs from rank 0's")
        return shards[0]
    layout = torch.cat(shards, dim=dim)
    if kind in _EXPERT_KINDS and dim == 0:
        return layout.narrow(0, 0, config.num_experts)
    if kind == EXPERTS_GATE_UP:
        E, rows, H = layout.shape
        padded = rows // 2
        halves = layout.reshape(E, t, 2, padded // t, H).transpose(1, 2).reshape(E, 2, padded, H)
        return halves.narrow(2, 0, config.moe_intermediate_size).reshape(E, 2 * config.moe_intermediate_size, H)
    if kind == EXPERTS_DOWN:
        return layout.narrow(2, 0, config.moe_intermediate_size)
    if kind in (SHARED_COLUMN, SHARED_ROW):
        return layout.narrow(dim, 0, config.shared_expert_intermediate_size)
    if kind == DELTANET_QKV:
        inverse = torch.argsort(deltanet_qkv_permutation(config, t))
        return layout.index_select(0, inverse)
    if kind == KV_HEADS:
        rep = kv_replication(config, t)
        if rep == 1:
            return layout
        kv, hd = config.num_key_value_heads, config.head_dim
        copies = layout.reshape(kv, rep, hd, -1)
        if not torch.equal(copies, copies[:, :1].expand_as(copies)):
            raise ValueError(f"{name}: the replicated KV heads differ between ranks")
        return copies[:, 0].reshape(kv * hd, -1)
    if kind in (COLUMN_PADDED, ROW_PADDED):
        return layout.narrow(dim, 0, config.intermediate_size)
    if kind == VOCAB:
        return layout.narrow(0, 0, config.vocab_size)
    return layout


def sharded_shapes(config: Qwen35Config, tp_degree: int) -> dict[str, tuple[int, ...]]:
    """Decoder name -> the shape of each rank's shard (the same on every rank)."""
    config.check_tp_degree(tp_degree)
    shapes = {}
    for name, shape in expected_shapes(config).items():
        name = decoder_name(name)
        if name.endswith("linear_attn.conv_weight"):
            shape = (shape[0], shape[2])
        meta = torch.empty(shape, device="meta")
        shapes[name] = tuple(shard_tensor(name, meta, config, tp_degree, 0).shape)
    return shapes


# ------------------------------------------------------------------------------------------ from a checkpoint
def convert_and_shard(
    reader: CheckpointReader, config: Qwen35Config, tp_degree: int, rank: int, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (decoder name, this rank's shard) lazily, tensor by tensor, each shard an owned copy.

    The checkpoint is checked first (one error listing every missing, unexpected or wrongly shaped
    tensor). With tied embeddings no `lm_head.weight` is yielded: the lm_head shares `embed_tokens`.
    """
    config.check_tp_degree(tp_degree)
    for name, tensor in convert_checkpoint(reader, config):
        shard = shard_tensor(name, tensor, config, tp_degree, rank)
        # A copy, so that the shard does not keep the whole tensor's storage alive.
        yield name, shard.to(dtype=stored_dtype(name, dtype) or shard.dtype, memory_format=torch.contiguous_format, copy=True)
        del tensor, shard


def convert_and_shard_mtp(
    reader: CheckpointReader, config: Qwen35Config, tp_degree: int, rank: int, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The multi-token-prediction head's (decoder name `mtp.*`, this rank's shard), from a reader opened with
    mtp=True (`convert_mtp` checks the head's tensors against the config first)."""
    config.check_tp_degree(tp_degree)
    for name, tensor in convert_mtp(reader, config, dtype):
        yield name, shard_tensor(name, tensor, config, tp_degree, rank).to(memory_format=torch.contiguous_format, copy=True)
        del tensor
