"""Exports shared by the optimum-neuron tests: each (layout, TP, dtype) is exported once per session.

These tests need optimum-neuron 0.4.5 (the nox `optimum` session); elsewhere each module skips itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import FIXTURES

NEEDS_OPTIMUM_NEURON = "needs optimum-neuron (the nox `optimum` session)"

# Exports for the cpu target: one 128-token context bucket and the token-generation graph.
SEQUENCE_LENGTH = 128
BATCH_SIZE = 2


@pytest.fixture(scope="session")
def export_dir(tmp_path_factory):
    """export_dir(layout, tp, dtype="float32", batch_size=BATCH_SIZE, sequence_length=SEQUENCE_LENGTH) -> the folder
    of a saved export (cached)."""
    from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM

    root = tmp_path_factory.mktemp("exports")
    cache: dict[tuple, Path] = {}

    def get(
        layout: str, tp: int, dtype: str = "float32", batch_size: int = BATCH_SIZE, sequence_length: int = SEQUENCE_LENGTH
    ) -> Path:
        key = (layout, tp, dtype, batch_size, sequence_length)
        if key not in cache:
            neuron_config = Qwen35NeuronModelForCausalLM.get_neuron_config(
                FIXTURES / layout,
                batch_size=batch_size,
                sequence_length=sequence_length,
                tensor_parallel_size=tp,
                dtype=dtype,
                target="cpu",
            )
            model = Qwen35NeuronModelForCausalLM.export(FIXTURES / layout, neuron_config)
            folder = root / f"{layout}-tp{tp}-{dtype}-b{batch_size}-s{sequence_length}"
            model.save_pretrained(folder)
            cache[key] = folder
        return cache[key]

    return get


def run_python(code: str, *args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter; fails the test with its stderr if it exits non-zero."""
    result = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    if result.returncode != 0:
        raise AssertionError(f"subprocess failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result


def last_json_line(output: str):
    return json.loads([line for line in output.splitlines() if line.startswith(("{", "["))][-1])
