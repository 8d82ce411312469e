"""The product's TorchNeuron runner (backends/torchneuron/runner.py) under the check backend: a TorchNeuron export of
tiny-2b (made with the export code, tests/kit/torchneuron_export.py) loaded by `load_runtime` with the check backend
in place of "neuron". Every graph the runner compiles while generating and scoring is one Dynamo graph (no break),
lowers to StableHLO that passes the contract (aliases, static shapes, census), and the runtime's greedy tokens and
logits equal the eager runtime's: the graphs TorchNeuron would receive from the product, not a test-built model."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torch_mlir", reason="torch-mlir is installed by the torchneuron nox session")

from optimum_qwen35.backends.torchneuron.runner import load_runtime  # noqa: E402
from optimum_qwen35.runtime import Qwen35Runtime  # noqa: E402

from ..conftest import FIXTURES  # noqa: E402
from ..kit.torchneuron_export import torchneuron_export  # noqa: E402
from optimum_qwen35.backends.torchneuron.stablehlo_check import CheckBackend  # noqa: E402
from .conftest import check_lowered  # noqa: E402
from .models import EAGER_TOLERANCE  # noqa: E402

PROMPTS = [[5, 17, 42, 7, 99, 3, 250, 11], [8, 1, 300, 64, 2]]


def test_the_product_runner_lowers_every_graph_it_runs_and_matches_eager(tmp_path, reference_census):
    folder = torchneuron_export(FIXTURES / "tiny-2b", tmp_path / "export", max_length=128, buckets=(64, 128))
    backend = CheckBackend(name="product")
    runtime = load_runtime(folder, compile_backend=backend, device="cpu")
    eager = Qwen35Runtime.from_pretrained(FIXTURES / "tiny-2b", batch_size=2, max_length=128, buckets=[64, 128],
                                          pack_weights=False)
    try:
        assert runtime.generate(PROMPTS, 8) == eager.generate(PROMPTS, 8)
        for ours, theirs in zip(runtime.logits(PROMPTS), eager.logits(PROMPTS)):
            assert (ours - theirs).abs().max().item() <= EAGER_TOLERANCE
        compiled = sorted(runtime.graphs._compiled)
        assert compiled == ["context_encoding_64", "context_logits_64", "token_generation_64"]
        assert backend.dynamo_graphs == len(backend.graphs) == len(compiled)  # one graph each: no break
        states = len(runtime.graphs.state)
        for graph in backend.graphs:
            check_lowered(graph, reference_census, states)
    finally:
        runtime.close()
