"""benchmarks/neuron_projection.py at its smallest case (the 0.8B at TP 2, 256 tokens), so that it cannot rot: the
graphs lower, what it reads from them agrees with what neuron_real_shapes computes, and it prints a labelled
projection (about 30 s)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).parents[2] / "benchmarks" / "neuron_projection.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("neuron_projection", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_projection_reads_the_graphs(bench):
    size, tp, tokens = "0.8B", 2, 256
    row = bench.project(size, tp, tokens, tokens)
    shapes = bench.shapes_bench.rank_shapes(size, tp, 1, tokens)
    for name, key in (("context", bench.CONTEXT), ("b1", bench.TOKENS)):
        graph = row["graphs"][name]
        # the collectives read from the HLO are the ones neuron_real_shapes computes (bytes included)
        computed = sorted((op, b) for op, _, b in bench.shapes_bench.collectives_per_step(shapes, key))
        assert sorted(graph["collectives"]) == computed, name
        assert graph["bf16_flops"] > 0
    # batch 1 decode: every weight once (the bytes-per-step table's 1.000: within 0.1% of the floor; 6 KiB above here)
    b1 = row["graphs"]["b1"]
    assert b1["floor"] <= b1["bytes"] <= 1.001 * b1["floor"], (b1["bytes"], b1["floor"])
    for figure in ("ttft", "b1", "b8", "floor"):
        low, high = row[figure]
        assert 0 < low <= high, figure
    assert row["b1"][0] >= row["floor"][0] and row["b8"][0] >= row["b1"][0]


def test_the_script_prints_a_labelled_projection(bench, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["neuron_projection.py", "--quick"])
    bench.main()
    out = capsys.readouterr().out
    assert "PROJECTION, not a measurement" in out
    assert "| 0.8B | 2 |" in out
