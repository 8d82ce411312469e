"""The vision export's graphs through the TorchNeuron check backend, TP 1, fp32: the vision tower at one image bucket
(`VisionEncoder`, 64 patch rows holding an 8 x 6 grid), and the decoder's image graphs (`ImageContextEncodingGraph` at
16 tokens, `ImageTokenGenerationGraph` over the whole cache) on tiny-2b: lowered within the contract, and run against
eager (random pixels; transformers' image outputs are not among the fixtures)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("torch_mlir", reason="torch-mlir is installed by the torchneuron nox session")

from optimum_qwen35.modeling.decoder import ImageContextEncodingGraph, ImageTokenGenerationGraph  # noqa: E402
from optimum_qwen35.modeling.vision import VisionConfig, VisionEncoder, image_bucket_inputs  # noqa: E402

from optimum_qwen35.backends.torchneuron.layers import TorchNeuronLayers  # noqa: E402
from optimum_qwen35.backends.torchneuron.runner import StateInPlaceGraph  # noqa: E402
from optimum_qwen35.backends.torchneuron.stablehlo_check import CheckBackend  # noqa: E402
from .conftest import check_lowered  # noqa: E402
from .models import EAGER_TOLERANCE, FIXTURES, load_decoder, state  # noqa: E402

BATCH, MAX_LENGTH, BUCKET, PATCHES = 2, 96, 16, 64


def _within(actual, expected, what):
    excess = ((actual - expected).abs() - EAGER_TOLERANCE * (1 + expected.abs())).max().item()
    assert excess <= 0, f"{what}: max |diff| {(actual - expected).abs().max().item():.3g}"


def test_vision_tower_lowers_and_equals_eager(reference_census):
    config = VisionConfig.from_dict(json.loads((FIXTURES / "tiny-2b" / "config.json").read_text()))
    torch.manual_seed(0)
    tower = VisionEncoder(config, layers=TorchNeuronLayers(1)).eval()  # as the product runner builds it
    grid = (1, 8, 6)
    pixels = torch.randn(8 * 6, config.patch_dim)
    inputs = image_bucket_inputs(config, pixels, grid, PATCHES)
    backend = CheckBackend(name="vision")
    with torch.no_grad():
        out = torch.compile(tower, backend=backend, fullgraph=True, dynamic=False)(*inputs)
        _within(out, tower(*inputs), "vision tower")
    (graph,) = backend.graphs
    assert check_lowered(graph, reference_census, 0) == set()


def test_image_graphs_lower_and_equal_eager(reference_census):
    decoder = load_decoder("tiny-2b")
    hidden = decoder.config.hidden_size
    torch.manual_seed(0)
    ids = torch.randint(0, 500, (BATCH, BUCKET), dtype=torch.int32)
    mask = torch.ones(BATCH, BUCKET, dtype=torch.int32)
    positions = torch.arange(BUCKET, dtype=torch.int32).expand(BATCH, BUCKET).contiguous()
    rope = positions[:, None, :].expand(BATCH, 3, BUCKET).contiguous()
    rope[:, 1:, 4:8] += torch.tensor([[0, 1, 0, 1], [0, 0, 1, 1]], dtype=torch.int32)  # a 2 x 2 merged image
    embeds = torch.randn(BATCH, BUCKET, hidden)
    image_mask = torch.zeros(BATCH, BUCKET, dtype=torch.int32)
    image_mask[:, 4:8] = 1
    seq = torch.arange(BATCH, dtype=torch.int32)
    context_backend, decode_backend = CheckBackend(name="image-context"), CheckBackend(name="image-decode")
    mine, theirs = state(decoder, BATCH, MAX_LENGTH), state(decoder, BATCH, MAX_LENGTH)
    with torch.no_grad():
        context = ImageContextEncodingGraph(decoder)
        inputs = (ids, mask, positions, seq, rope, embeds, image_mask)
        a = torch.compile(StateInPlaceGraph(context, len(mine)), backend=context_backend, fullgraph=True,
                          dynamic=False)(*inputs, *mine)[0]
        _within(a, context(*inputs, *theirs)[0], "image context encoding")
        decode = ImageTokenGenerationGraph(decoder)
        step = (ids[:, :1], torch.full((BATCH, 1), BUCKET, dtype=torch.int32), seq,
                torch.full((BATCH, 1), BUCKET - 2, dtype=torch.int32))
        a = torch.compile(StateInPlaceGraph(decode, len(mine)), backend=decode_backend, fullgraph=True,
                          dynamic=False)(*step, *mine)[0]
        _within(a, decode(*step, *theirs)[0], "image token generation")
        for x, y in zip(mine, theirs):
            _within(x, y, "state")
    for graph in context_backend.graphs + decode_backend.graphs:
        check_lowered(graph, reference_census, len(mine))
