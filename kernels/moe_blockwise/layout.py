"""The blocked layout of a prompt's routed (token, expert) pairs, which every blocked form of the MoE block computes on:
`routed_blocks` (pairs sorted by expert, blocks of B rows, each block one expert's, every expert's blocks contiguous,
the static bound `block_count` of blocks) and `weighted_sum` (the pairs' outputs back to their tokens). For the
dynamic-count kernel (kernel.py), `block_layout` adds the tables its loops read:

- `used` [E, 1] int32: the local experts that hold at least one pair, in id order, then zeros;
- `start`, `end` [E, 1] int32: the block range [start, end) of used expert u (its row of `used`);
- `n_used` [1, 1] int32: how many experts are used (the outer loop's trip count);
- `filled`: the real number of filled blocks (sum of end - start), for the measurement only.

Static shapes, int32, no data-dependent shape: what a traced graph can compute before calling the kernel."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from optimum_qwen35.modeling.precision import upcast


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
    (token, block_expert, pair_row, nb), (blocks, block_end) = _routed_blocks(ids, experts, block_size)
    used_mask = blocks > 0
    # Used experts first, in id order (a stable sort on "unused"), then the unused ones (never read by the kernel).
    order = torch.sort((~used_mask).to(torch.int32), stable=True).indices.to(torch.int32)
    used = torch.where(used_mask.index_select(0, order), order, torch.zeros_like(order))
    end = block_end.index_select(0, order)
    start = end - blocks.index_select(0, order)
    n_used = used_mask.to(torch.int32).sum(dtype=torch.int32).reshape(1, 1)
    return BlockLayout(token, block_expert, pair_row, nb, used[:, None].contiguous(), start[:, None].contiguous(),
                       end[:, None].contiguous(), n_used, blocks.sum(dtype=torch.int32))


def routed_blocks(ids: torch.Tensor, experts: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The blocked layout of the pairs: ids [N, k] int32 local expert ids, `experts` (E_r) for a pair no local expert
    serves. Returns (token of each block row [nb B] int32, N for a padding row; expert of each block [nb] int32; the
    block row of each pair [N k] int32, nb B for a pair served elsewhere; nb). Static shapes: nb is the dropless
    bound `block_count`. Computed with a stable sort by expert and int32 sums (no cumsum, no float)."""
    return _routed_blocks(ids, experts, block_size)[0]


def _routed_blocks(ids: torch.Tensor, experts: int, block_size: int):
    """`routed_blocks`'s result, and each local expert's blocks and the first block after its own ([E_r] each), which
    `block_layout`'s tables are made of."""
    N, k = ids.shape
    P = N * k
    nb = block_count(P, experts, block_size)
    device = ids.device
    flat = ids.reshape(-1)
    counts, blocks, lower, block_end = _expert_blocks(ids, experts, block_size)
    pair_end = (lower * counts[None, :]).sum(1, dtype=torch.int32)  # [E_r] first sorted pair after expert e's
    sorted_ids, order = torch.sort(flat, stable=True)  # by expert, tokens in order within one
    order = order.to(torch.int32)
    served = sorted_ids < experts
    e = torch.clamp(sorted_ids, max=experts - 1)
    rank_in_expert = torch.arange(P, dtype=torch.int32, device=device) - (pair_end - counts).index_select(0, e)
    row = (block_end - blocks).index_select(0, e) * block_size + rank_in_expert
    row = torch.where(served, row, torch.full_like(row, nb * block_size))
    # Each block row's token (N: the zero padding row); the one extra row takes the pairs served elsewhere.
    token = torch.full((nb * block_size + 1,), N, dtype=torch.int32, device=device)
    # index_put with int32 indices (point scatters that assign; no s64 index in the graph).
    # The token of pair p is p // k, read from a static table (an integer division lowers to floor / sign ops).
    pair_token = torch.arange(N, dtype=torch.int32, device=device)[:, None].expand(N, k).reshape(-1)
    token = token.index_put((row,), pair_token.index_select(0, order))[: nb * block_size]
    pair_row = torch.zeros(P, dtype=torch.int32, device=device).index_put((order,), row)
    block_ids = torch.arange(nb, dtype=torch.int32, device=device)
    block_expert = (block_ids[:, None] >= block_end[None, :]).to(torch.int32).sum(1, dtype=torch.int32)
    return (token, torch.clamp(block_expert, max=experts - 1), pair_row, nb), (blocks, block_end)


def _expert_blocks(ids: torch.Tensor, experts: int, block_size: int):
    """Per local expert (ids [N, k], `experts` for a pair served elsewhere): its pairs [E_r], its blocks [E_r], the
    [E_r, E_r] lower-triangular int32 matrix of the prefix sums, and the first block after its own [E_r]."""
    device = ids.device
    expert_range = torch.arange(experts, dtype=torch.int32, device=device)
    counts = (ids.reshape(-1)[:, None] == expert_range).to(torch.int32).sum(0, dtype=torch.int32)
    # ceil(counts / B) as a count of block starts below it (no integer division: it lowers to floor ops); an expert
    # has at most N pairs (a token's k choices are distinct).
    starts = torch.arange(0, ids.shape[0], block_size, dtype=torch.int32, device=device)
    blocks = (counts[:, None] > starts[None, :]).to(torch.int32).sum(1, dtype=torch.int32)
    # Inclusive prefix sums over the experts as an int32 triangular sum (E_r x E_r: small).
    lower = (expert_range[:, None] >= expert_range[None, :]).to(torch.int32)
    block_end = (lower * blocks[None, :]).sum(1, dtype=torch.int32)
    return counts, blocks, lower, block_end


def block_count(pairs: int, experts: int, block_size: int) -> int:
    """Blocks enough for any routing of `pairs` pairs over `experts` local experts: sum_e ceil(n_e / B) with
    sum_e n_e = pairs and at most min(experts, pairs) experts used."""
    used = min(experts, pairs)
    return max(1, (pairs + used * (block_size - 1)) // block_size)


def weighted_sum(weights: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    """weights [N, m], outputs [N, m, H] -> [N, H]: sum_j weights[n, j] * outputs[n, j], in fp32 and in j order (one
    batched matmul [N, 1, m] @ [N, m, H]): how every form of the experts, on every backend, combines its outputs."""
    return torch.bmm(upcast(weights)[:, None, :], upcast(outputs))[:, 0]
