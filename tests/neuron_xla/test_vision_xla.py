"""The vision tower built over neuronx-distributed's layers (`NxDLayers`), run on the XLA CPU device.

How far the Neuron vision path has run: the one model definition (modeling/vision.py) over the NxD layer factory, in
neuronx-distributed's traced parallel state at TP 1, run on torch-xla's CPU device against the eager CPU tower
(itself checked against transformers 5 in tests/test_vision.py). Not done: a traced/compiled NxD vision graph, TP > 1,
neuronx-cc.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch_xla

from optimum_qwen35.modeling.vision import VisionConfig, VisionEncoder, image_bucket_inputs
from optimum_qwen35.neuron.layers import NxDLayers
from optimum_qwen35.runtime.vision import load_vision_encoder
from optimum_qwen35.testing.neuron_xla import traced_parallel_state

from ..conftest import FIXTURES

FEATURE_ATOL = 1e-5  # fp32, the same definition on two devices


@pytest.mark.parametrize("grid, bucket", [((1, 8, 10), 128), ((1, 4, 6), 32)])
def test_nxd_vision_tower_on_the_xla_device_matches_the_cpu_tower(grid, bucket):
    folder = FIXTURES / "tiny-2b"
    vision = VisionConfig.from_dict(json.loads((folder / "config.json").read_text()))
    eager = load_vision_encoder(folder, vision)
    patches = torch.randn(grid[1] * grid[2], vision.patch_dim, generator=torch.Generator().manual_seed(0))
    inputs = image_bucket_inputs(vision, patches, grid, bucket)
    expected = eager(*inputs)
    with traced_parallel_state(1):
        nxd = VisionEncoder(vision, 1, NxDLayers(1, torch.float32))
        missing, unexpected = nxd.load_state_dict(eager.state_dict(), strict=False)
        # neuronx-distributed's layers keep unsharded `master_weight` copies the forward never reads.
        assert not [m for m in missing if not m.endswith(".master_weight")] and not unexpected
        device = torch_xla.device()
        got = nxd.to(device)(*(t.to(device) for t in inputs)).cpu()
    assert got.shape == expected.shape == (bucket // vision.merge_unit, vision.out_hidden_size)
    assert (got - expected).abs().max().item() <= FEATURE_ATOL
