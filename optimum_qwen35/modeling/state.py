"""The state layout: one ordered list of tensors, layer by layer, every tensor indexed by sequence slot.

    full attention layer -> K, V            [slots, kv_heads_per_rank, max_length, head_dim]  model dtype
    DeltaNet layer       -> conv state      [slots, conv_channels_per_rank, kernel - 1]       model dtype
                            recurrent state [slots, value_heads_per_rank, dk, dv]              fp32

Only the full-attention layers have a KV cache. Graphs take the whole list in and give it back updated
(only the slots named by `seq_ids` change): the CPU runtime keeps it in a Python list, the Neuron
backend aliases each tensor to a graph output so that it updates in place.

`seq_ids[b]` names the slot of batch row b; -1 marks an inactive row (a static-batch graph run with fewer
sequences than rows): it reads slot 0, and what it computes is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import FULL_ATTENTION, Qwen35Config
from .parallel import ShardedDims


class Slots:
    """Which batch row reads and which writes each slot, computed once per graph call (static shapes)."""

    def __init__(self, seq_ids: torch.Tensor, num_slots: int):
        seq_ids = seq_ids.to(torch.int64)
        self.seq_ids = seq_ids  # [B]: -1 marks an inactive row (the fused kernels take it as is)
        self.read = seq_ids.clamp(min=0)  # [B]: inactive rows read slot 0, harmlessly
        match = seq_ids[None, :] == torch.arange(num_slots, device=seq_ids.device)[:, None]  # [slots, B]
        self.row = match.to(torch.int64).argmax(1)  # [slots]: the row that writes each slot (0 if none)
        self.written = match.any(1)  # [slots]

    def gather(self, state: torch.Tensor) -> torch.Tensor:
        """[slots, ...] -> [B, ...]: each row's slot."""
        return state.index_select(0, self.read)

    def scatter(self, state: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """state with each slot named by an active row replaced by that row; every other slot unchanged."""
        new = rows.to(state.dtype).index_select(0, self.row)
        keep_old = ~self.written.view(-1, *([1] * (state.dim() - 1)))
        return torch.where(keep_old, state, new)


@dataclass(frozen=True)
class StateSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def state_specs(
    config: Qwen35Config, dims: ShardedDims, slots: int, max_length: int, dtype: torch.dtype
) -> list[StateSpec]:
    specs = []
    for i, layer_type in enumerate(config.layer_types):
        if layer_type == FULL_ATTENTION:
            kv_shape = (slots, dims.num_kv_heads, max_length, config.head_dim)
            specs += [StateSpec(f"layers.{i}.key_cache", kv_shape, dtype), StateSpec(f"layers.{i}.value_cache", kv_shape, dtype)]
        else:
            conv_shape = (slots, dims.linear_conv_dim, config.linear_conv_kernel_dim - 1)
            rec_shape = (slots, dims.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim)
            specs += [
                StateSpec(f"layers.{i}.conv_state", conv_shape, dtype),
                StateSpec(f"layers.{i}.recurrent_state", rec_shape, torch.float32),
            ]
    return specs


def allocate_state(specs: list[StateSpec], device: torch.device | str = "cpu") -> list[torch.Tensor]:
    return [torch.zeros(s.shape, dtype=s.dtype, device=device) for s in specs]


def state_bytes_per_slot(specs: list[StateSpec]) -> int:
    return sum(torch.Size(s.shape[1:]).numel() * s.dtype.itemsize for s in specs)
