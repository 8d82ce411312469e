"""The vision tower shards for tensor parallelism: TP = 2 with real gloo collectives against TP = 1.

Two spawned processes each build the encoder over `TorchLayers(2, rank)` and load only their shard
(`shard_vision_params`: q/k/v and the fc1 layers split by output rows, i.e. by heads, proj and the fc2 layers by input
columns); rank 0's merged tokens must equal the single-process tower's (fp32 within 1e-5; float64 within 1e-12,
which shows the sharded tower computes the same function). The exports do not write sharded vision weights yet
(a vision export needs tensor_parallel_size=1; docs/vision.md).
"""

from __future__ import annotations

import json
import os
import tempfile

import torch
import torch.distributed as dist

from optimum_qwen35.modeling.torch_layers import TorchLayers
from optimum_qwen35.modeling.vision import VisionConfig, VisionEncoder, image_bucket_inputs, shard_vision_params
from optimum_qwen35.runtime.images import load_vision_encoder

from .conftest import FIXTURES

FOLDER = FIXTURES / "tiny-2b"
GRID, BUCKET = (1, 8, 10), 128


def _inputs(vision):
    patches = torch.randn(GRID[1] * GRID[2], vision.patch_dim, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return image_bucket_inputs(vision, patches, GRID, BUCKET)


def _rank(rank, tp_degree, store, out_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=tp_degree)
    try:
        vision = VisionConfig.from_dict(json.loads((FOLDER / "config.json").read_text()))
        results = {}
        for dtype in (torch.float32, torch.float64):
            whole = load_vision_encoder(FOLDER, vision, dtype).state_dict()
            encoder = VisionEncoder(vision, tp_degree, TorchLayers(tp_degree, rank)).to(dtype)
            encoder.load_state_dict(shard_vision_params(whole, tp_degree, rank))
            with torch.no_grad():
                results[str(dtype)] = encoder(*_inputs(vision))
        if rank == 0:
            torch.save(results, out_file)
        # Leave together: a rank that tears gloo down while its peer is still in a collective aborts the peer
        # ("terminate called without an active exception"), as runtime/tp.py's workers do.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_tp2_vision_tower_matches_tp1(tmp_path):
    vision = VisionConfig.from_dict(json.loads((FOLDER / "config.json").read_text()))
    out_file = tmp_path / "rank0.pt"
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_rank, args=(2, os.path.join(tmp, "store"), out_file), nprocs=2, join=True)
    got = torch.load(out_file)
    for dtype, atol in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        with torch.no_grad():
            expected = load_vision_encoder(FOLDER, vision, dtype)(*_inputs(vision))
        sharded = got[str(dtype)]
        assert sharded.dtype == dtype and sharded.shape == expected.shape
        assert (sharded - expected).abs().max().item() <= atol, dtype
