"""The blocked layout of a prompt's routed pairs, for the dynamic-count kernel (kernel.py): the static layout of
`optimum_qwen35.modeling.moe.routed_blocks` (pairs sorted by expert, blocks of B rows, each block one expert's, every
expert's blocks contiguous, the static bound nb of blocks) plus the tables the kernel's loops read:

- `used` [E, 1] int32: the local experts that hold at least one pair, in id order, then zeros;
- `start`, `end` [E, 1] int32: the block range [start, end) of used expert u (its row of `used`);
- `n_used` [1, 1] int32: how many experts are used (the outer loop's trip count);
- `filled`: the real number of filled blocks (sum of end - start), for the measurement only.

Static shapes, int32, no data-dependent shape: what a traced graph can compute before calling the kernel."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BlockLayout:
    token: torch.Tensor       # [nb B] int32: the token of each block row (N: a zero padding row)
    block_expert: torch.Tensor  # [nb] int32
    pair_row: torch.Tensor    # [N k] int32: the block row of each pair (nb B: a pair no local expert serves)
    nb: int                   # the static bound of blocks
    used: torch.Tensor        # [E, 1] int32
    start: torch.Tensor       # [E, 1] int32
    end: torch.Tensor         # [E, 1] int32
    n_used: torch.Tensor      # [1, 1] int32
    filled: torch.Tensor      # [] int32


def block_layout(ids: torch.Tensor, experts: int, block_size: int) -> BlockLayout:
    """ids [N, k] int32 local expert ids (`experts` for a pair served elsewhere) -> the layout and the loop tables."""
    from optimum_qwen35.modeling.moe import routed_blocks  # (deferred: the model package imports the kernels package)

    token, block_expert, pair_row, nb = routed_blocks(ids, experts, block_size)
    expert_range = torch.arange(experts, dtype=torch.int32, device=ids.device)
    flat = ids.reshape(-1)
    counts = (flat[:, None] == expert_range).to(torch.int32).sum(0, dtype=torch.int32)
    starts = torch.arange(0, ids.shape[0], block_size, dtype=torch.int32, device=ids.device)
    blocks = (counts[:, None] > starts[None, :]).to(torch.int32).sum(1, dtype=torch.int32)  # ceil(counts / B)
    lower = (expert_range[:, None] >= expert_range[None, :]).to(torch.int32)
    block_end = (lower * blocks[None, :]).sum(1, dtype=torch.int32)
    used_mask = blocks > 0
    # Used experts first, in id order (a stable sort on "unused"), then the unused ones (never read by the kernel).
    order = torch.sort((~used_mask).to(torch.int32), stable=True).indices.to(torch.int32)
    used = torch.where(used_mask.index_select(0, order), order, torch.zeros_like(order))
    end = block_end.index_select(0, order)
    start = end - blocks.index_select(0, order)
    n_used = used_mask.to(torch.int32).sum(dtype=torch.int32).reshape(1, 1)
    return BlockLayout(token, block_expert, pair_row, nb, used[:, None].contiguous(), start[:, None].contiguous(),
                       end[:, None].contiguous(), n_used, blocks.sum(dtype=torch.int32))
