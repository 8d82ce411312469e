"""benchmarks/neuron_real_shapes.py's smallest case, so that it cannot rot (about 90 s).

The benchmark builds the export's graphs shape-only (modules on `meta`, torch-xla placeholders) and computes the
per-rank bytes, step traffic and collectives of configurations it does not lower. Here, at the real 0.8B shapes
(TP 2, batch 2, 1280 tokens: two query blocks of context encoding's attention): the shape-only graphs lower, their collectives are exactly the computed ones, their
entry parameters hold the computed weights and state, and the computed state traffic is what
`optimum_qwen35.backends.nxd.lowering.state_traffic` counts from the lowered HLO. Also the assumed 2B config has the 2B's published
parameter count.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.kit.neuron_xla import CONTEXT, TOKENS, lower, neuron_config, state_traffic, traced_parallel_state

BENCHMARK = Path(__file__).parents[2] / "benchmarks" / "neuron_real_shapes.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("neuron_real_shapes", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_shape_only_graphs_lower_and_match_the_computed_sizes(bench, tmp_path):
    size, tp, batch, sequence = "0.8B", 2, 2, 1280  # two query blocks (1024 + 256)
    folder = bench.config_folder(size, tmp_path)
    nc = neuron_config(folder, "trn2", tp, batch_size=batch, sequence_length=sequence, dtype=bench.torch.bfloat16)
    with traced_parallel_state(tp, nc.logical_nc_config):
        graphs = bench.build_modules(folder, nc)
        shapes = bench.rank_shapes(size, tp, batch, sequence, graphs)
        for key in (CONTEXT, TOKENS):
            graph = graphs[key]
            c = bench.census(bench.lower_text(graph))
            assert sorted(c.collectives) == sorted(bench.collectives_per_step(shapes, key))
            inputs = sum(t.numel() * t.element_size() for t in graph.example_inputs)
            # Entry parameters: the weights, the held state, the inputs, and a few scalars torch-xla passes in.
            assert 0 <= c.parameter_bytes - (shapes.weights + shapes.state + inputs) < 1024, key
            traffic = state_traffic(lower(graph), graph)
            computed = bench.step_traffic(shapes, key)
            assert sum(r for r, _ in traffic.values()) == computed["state_read"], key
            assert sum(w for _, w in traffic.values()) == computed["state_write"], key
            print(f"\n{size} TP {tp} {key}: {c.instructions} instructions, max rank {c.max_rank}, "
                  f"{c.collective_summary()}")
    # Placeholders, not weights: the process stays small (the 27B at TP 8 lowers in about as much).
    assert bench.rss_gib() < 4


def test_the_assumed_2b_config_has_the_published_parameter_count(bench):
    shapes = bench.rank_shapes("2B", 1, 1, 128)
    assert shapes.embedding // 2 == 248320 * 2048  # 508.6M
    # The tied embedding counted once: its table, or (as here) the lm_head's copy of it among the matmul weights.
    assert abs(shapes.matmul_params - 1.882e9) / 1.882e9 < 0.001, shapes.matmul_params
