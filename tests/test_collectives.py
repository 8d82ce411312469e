"""The collectives of the CPU tensor-parallel layers (`modeling/parallel.py`), run in this process as rank 0 of a real
two-rank gloo group (rank 1 is a spawned process). The TP tests run every rank in spawned processes; this one keeps
rank 0 here, where a failure points at the collective itself."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
import torch.distributed as dist

from optimum_qwen35.modeling.parallel import all_gather_last_dim, all_reduce
from optimum_qwen35.modeling.torch_layers import TorchLayers

WORLD = 2


def rank_input(rank: int) -> torch.Tensor:
    """A [2, 3, 4] tensor that differs on each rank and in every position (3-D: a gather along a wrong dim shows)."""
    return torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) + 100 * rank


@torch.no_grad()  # as the runtime runs the model
def run_collectives(rank: int, store: str):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        group = dist.group.WORLD.group_name
        gathered = all_gather_last_dim(rank_input(rank), WORLD, group)
        gathered_2d = all_gather_last_dim(rank_input(rank)[0], WORLD, group)  # any rank of tensor, not only 3-D
        reduced = all_reduce(rank_input(rank), group)
        # The layers as the model gets them from its factory (the process group given as the default WORLD).
        layers = TorchLayers(tp_degree=WORLD, rank=rank)
        # An embedding of 6 ids split 3 per rank: each rank looks up the ids it owns, the sum gives every row.
        embedding = layers.embedding(3, 2)
        embedding.weight.copy_(torch.arange(6, dtype=torch.float32).reshape(3, 2) + 6 * rank)
        looked_up = embedding(torch.tensor([[0, 5, 3, 2]]))
        linear = layers.row_linear(2, 1)
        linear.weight.fill_(rank + 1.0)
        summed = linear(torch.ones(1, 2))
        # A vocabulary of 3 over 2 ranks (2 rows each, the last one padding): logits gathered, the padding cut off.
        head = layers.lm_head(2, 2, 3)
        head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]) * (rank + 1))
        logits = head(torch.tensor([[[3.0, 5.0]]]))
        dist.barrier()  # leave together (see runtime/tp.py): a rank tearing gloo down early can abort its peer
        return gathered, gathered_2d, reduced, looked_up, summed, logits
    finally:
        dist.destroy_process_group()


def _rank1(store: str):
    run_collectives(1, store)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_collectives_across_two_ranks(tmp_path):
    store = str(tmp_path / "store")
    peer = multiprocessing.get_context("spawn").Process(target=_rank1, args=(store,))
    peer.start()
    try:
        gathered, gathered_2d, reduced, looked_up, summed, logits = run_collectives(0, store)
    finally:
        peer.join(timeout=120)
    assert peer.exitcode == 0
    assert torch.equal(gathered, torch.cat([rank_input(0), rank_input(1)], dim=-1))
    assert torch.equal(gathered_2d, torch.cat([rank_input(0)[0], rank_input(1)[0]], dim=-1))
    assert torch.equal(reduced, rank_input(0) + rank_input(1))
    table = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    assert torch.equal(looked_up, table[[0, 5, 3, 2]][None])
    assert torch.equal(summed, torch.tensor([[2.0 * 1 + 2.0 * 2]]))
    assert logits.dtype == torch.float32 and torch.equal(logits, torch.tensor([[[3.0, 5.0, 6.0]]]))
