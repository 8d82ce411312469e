"""The optimum-neuron class's prefix-cache switch (`set_prefix_cache`): "auto" by default, off on a cpu export, whose
context programs cannot resume a sequence; a cache given explicitly is refused there, naming the reason."""

from __future__ import annotations

import pytest

pytest.importorskip("optimum.neuron", reason="needs optimum-neuron (the nox `optimum` session)")

from optimum_qwen35.errors import IncompatibleExportError, UsageError  # noqa: E402
from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM  # noqa: E402
from optimum_qwen35.runtime.prefix_cache import PrefixCache  # noqa: E402


def test_a_cpu_export_runs_without_a_prefix_cache_and_refuses_one(export_dir):
    model = Qwen35NeuronModelForCausalLM.from_pretrained(export_dir("tiny-2b", 1))
    assert model.runtime.prefix_cache is None  # "auto": off where the graphs cannot resume a sequence
    with pytest.raises(IncompatibleExportError, match="continue a sequence"):
        model.set_prefix_cache(PrefixCache(block_size=64))
    with pytest.raises(UsageError, match="PrefixCache or None"):
        model.set_prefix_cache("on")
    model.set_prefix_cache(None)
    assert model.runtime.prefix_cache is None
