"""The Neuron benchmarks no other test runs, each in its smallest form from a fresh clone (issue 50 item 8; as
tests/test_benchmark_commands.py: a subprocess from another working directory, the repository root not on the path):
benchmarks/neuron_graphs.py (the 0.8B at TP 1, 256 tokens) and neuron_bytes_per_step.py (the 0.8B at TP 1, batch
1, 256 tokens). neuron_real_shapes.py and neuron_projection.py run in test_real_shapes.py and test_projection.py."""

from __future__ import annotations

import os

from tests.test_benchmark_commands import run_benchmark


def test_neuron_graphs_runs_from_a_fresh_clone(tmp_path):
    out = run_benchmark("neuron_graphs", "--size", "0.8B", "--tp", "1", "--batch-size", "1", "--sequence-length", "256",
                        cwd=tmp_path)
    assert "token_generation" in out


def test_neuron_bytes_per_step_runs_from_a_fresh_clone(tmp_path):
    out = run_benchmark("neuron_bytes_per_step", "--only", "0.8B:1:1", "--sequence", "256", "--fp8", "--fp8-lm-head",
                        cwd=tmp_path)
    assert "0.8B" in out
    # The same export with FP8 weights beside it (the float8 dequantization streamed, not spilled), and with its
    # lm_head (tied: a third of the 0.8B's bf16 weights) in FP8 too.
    rows = {line.split("|")[4].strip(): float(line.split("|")[6]) for line in out.splitlines()
            if line.startswith("| 0.8B | 1 | 1 |") and line.count("|") == 9}
    assert rows["bf16"] == 1 and rows["fp8 + lm_head"] < 0.55 < rows["fp8"] < 0.8, rows


def test_the_traced_parallel_state_sets_local_world_size_on_trn1_at_tp_4(monkeypatch):
    """neuronx-distributed 0.15 reads LOCAL_WORLD_SIZE on trn1 at TP 4 (issue 50: neuron_real_shapes.py --only
    9B:4:1:4096:trn1 stopped on a KeyError when it built the graphs in the kit's parallel state, which did not set
    it; the product's `tracing.traced_parallel_state` sets it as the export does)."""
    from neuronx_distributed.parallel_layers import parallel_state
    from optimum.neuron.utils.instance import align_compilation_target

    from optimum_qwen35.backends.nxd.tracing import traced_parallel_state

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn1")
    align_compilation_target("trn1", override=True)
    with traced_parallel_state(4):
        assert parallel_state.get_tensor_model_parallel_size() == 4
        assert parallel_state.get_tensor_model_parallel_src_rank() == 0
    assert os.environ["LOCAL_WORLD_SIZE"] == "4"
