"""FP8 weights kept as float8 (modeling/fp8.py) through the TorchNeuron check backend: the bf16 context-encoding and
token-generation graphs of a tiny FP8 checkpoint (dense with partial blocks, MoE) hold float8_e4m3fn parameters, lower
to StableHLO with no graph break, the dequantization (an f8E4M3FN -> f32 convert and a multiply by the scale) inside
the graph beside each matmul, within the compiler contract; and run on CPU equal to the eager model (docs/fp8.md)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torch_mlir", reason="torch-mlir is installed by the torchneuron nox session")

from optimum_qwen35.backends.torchneuron.layers import TorchNeuronLayers
from optimum_qwen35.backends.torchneuron.runner import StateInPlaceGraph
from optimum_qwen35.backends.torchneuron.stablehlo_check import CheckBackend
from optimum_qwen35.checkpoint.fp8_shard import convert_and_shard_fp8
from optimum_qwen35.checkpoint.reader import CheckpointReader
from optimum_qwen35.config import Qwen35Config
from optimum_qwen35.modeling.decoder import ContextEncodingGraph, Qwen35Decoder, TokenGenerationGraph
from optimum_qwen35.modeling.fp8 import hold_fp8_weights, split_fp8
from optimum_qwen35.tiny.fp8 import build_tiny_fp8_checkpoint

from .conftest import check_lowered
from .models import state

BATCH, MAX_LENGTH, BUCKET = 2, 96, 16


def fp8_decoder(folder) -> Qwen35Decoder:
    config = Qwen35Config.from_pretrained(folder)
    with torch.device("meta"):
        decoder = Qwen35Decoder(config, 1, TorchNeuronLayers(1, 0, None))
    params = dict(convert_and_shard_fp8(CheckpointReader(folder), config, 1, 0, torch.bfloat16))
    if config.tie_word_embeddings:
        params["lm_head.weight"] = params["embed_tokens.weight"]
    params["embed_tokens.rank"] = torch.tensor([0], dtype=torch.int64)
    fp8_params = split_fp8(params)
    result = decoder.load_state_dict(params, strict=False, assign=True)
    assert not [k for k in result.missing_keys if k not in fp8_params] and not result.unexpected_keys
    if config.tie_word_embeddings:
        decoder.lm_head.weight = decoder.embed_tokens.weight
    assert hold_fp8_weights(decoder, fp8_params, torch.bfloat16) > 0
    return decoder.eval()


@pytest.mark.parametrize("layout", ["tiny-nv3x", "tiny-moe"])
def test_fp8_weight_graphs_lower_within_the_contract_and_follow_eager(layout, tmp_path, reference_census):
    decoder = fp8_decoder(build_tiny_fp8_checkpoint(tmp_path / layout, layout))
    context, decode = ContextEncodingGraph(decoder), TokenGenerationGraph(decoder, key_length=None)
    ids = torch.zeros(BATCH, BUCKET, dtype=torch.int32)
    ids[0, :5] = torch.tensor([3, 1, 4, 1, 5], dtype=torch.int32)
    mask = (ids != 0).to(torch.int32)
    positions = torch.where(mask.bool(), torch.arange(BUCKET, dtype=torch.int32), torch.ones((), dtype=torch.int32))
    seq_ids = torch.tensor([0, -1], dtype=torch.int32)
    step = (torch.tensor([[9], [0]], dtype=torch.int32), torch.tensor([[5], [0]], dtype=torch.int32), seq_ids)
    states = len(decoder.state_specs(BATCH, MAX_LENGTH))
    outputs = {}
    for name, compile_ in (("eager", False), ("check", True)):
        scratch = state(decoder, BATCH, MAX_LENGTH)
        backends = []
        graphs = []
        for graph in (context, decode):
            if compile_:
                backend = CheckBackend(name=f"{layout}-fp8")
                backends.append(backend)
                # as the product runner compiles them: states aliased in place, not also returned
                graph = torch.compile(StateInPlaceGraph(graph, states), backend=backend, fullgraph=True, dynamic=False)
            graphs.append(graph)
        with torch.no_grad():
            first = graphs[0](ids, mask, positions, seq_ids, *scratch)
            second = graphs[1](*step, *scratch)
        outputs[name] = (first[0] if isinstance(first, tuple) else first, second[0] if isinstance(second, tuple) else second)
        for backend in backends:
            for lowered in backend.graphs:
                check_lowered(lowered, reference_census, states)
                assert "f8E4M3FN" in lowered.stablehlo, "the float8 weights are not graph inputs"
    # bf16: the decomposed graph orders the arithmetic otherwise than eager (test_graphs.py holds bf16 to 0.05).
    for eager, checked in zip(outputs["eager"], outputs["check"]):
        assert (eager.float() - checked.float()).abs().max() <= 2e-2
