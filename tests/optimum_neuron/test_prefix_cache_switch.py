"""The optimum-neuron class's prefix-cache switch (`set_prefix_cache`): "auto" by default, on for an export holding
continuing context programs (tests/optimum_neuron/test_prefix_cache_export.py runs it), off with one log line for an
older export, whose context programs start fresh sequences only; a cache given explicitly is refused there, naming
the reason."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

pytest.importorskip("optimum.neuron", reason="needs optimum-neuron (the nox `optimum` session)")

from optimum_qwen35.errors import IncompatibleExportError, UsageError  # noqa: E402
from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM, modeling  # noqa: E402
from optimum_qwen35.runtime.prefix_cache import PrefixCache  # noqa: E402


def older_export(folder, tmp_path):
    """A copy of an export as this package wrote it before continuing programs existed: no "prefix_cache" in its
    manifest, no continuing program files."""
    old = tmp_path / "older-export"
    shutil.copytree(folder, old)
    file = old / "compiled" / "graphs.json"
    manifest = json.loads(file.read_text())
    manifest.pop("prefix_cache")
    for name in [n for n in manifest["graphs"] if "_keys_" in n]:
        (old / "compiled" / manifest["graphs"].pop(name)["file"]).unlink()
    file.write_text(json.dumps(manifest, indent=2))
    return old


def test_an_older_export_runs_without_a_prefix_cache_and_refuses_one(export_dir, tmp_path, caplog):
    folder = older_export(export_dir("tiny-2b", 1), tmp_path)
    with caplog.at_level(logging.INFO, logger="optimum_qwen35.neuron_model.running"):
        model = Qwen35NeuronModelForCausalLM.from_pretrained(folder)
        assert model.runtime.prefix_cache is None  # "auto": off where the graphs cannot resume a sequence
    said = [r.getMessage() for r in caplog.records if "prefix caching off" in r.getMessage()]
    assert len(said) == 1 and "export it again" in said[0]
    with pytest.raises(IncompatibleExportError, match="continue a sequence"):
        model.set_prefix_cache(PrefixCache(block_size=64))
    with pytest.raises(UsageError, match="PrefixCache or None"):
        model.set_prefix_cache("on")
    model.set_prefix_cache(None)
    assert model.runtime.prefix_cache is None


def test_a_new_export_turns_it_on_and_takes_only_its_block_size(export_dir):
    model = Qwen35NeuronModelForCausalLM.from_pretrained(export_dir("tiny-2b", 1))  # sequence 128: blocks of 64
    assert model.runtime.prefix_cache is not None and model.runtime.prefix_cache.block_size == 64
    with pytest.raises(UsageError, match="blocks of 64 tokens"):
        model.set_prefix_cache(PrefixCache(block_size=128))
    model.set_prefix_cache(None)
    assert model.runtime.prefix_cache is None


def test_auto_takes_a_budget_in_bytes(export_dir):
    model = Qwen35NeuronModelForCausalLM.from_pretrained(export_dir("tiny-2b", 1))
    assert model.runtime.prefix_cache.budget_bytes == PrefixCache().budget_bytes  # 4 GiB unless asked
    model.set_prefix_cache("auto", budget_bytes=1 << 20)
    assert model.runtime.prefix_cache.budget_bytes == 1 << 20 and model.runtime.prefix_cache.block_size == 64
    with pytest.raises(UsageError, match="budget_bytes must be an integer >= 1, got 0"):
        model.set_prefix_cache("auto", budget_bytes=0)
    with pytest.raises(UsageError, match='budget of prefix_cache="auto"'):
        model.set_prefix_cache(PrefixCache(block_size=64), budget_bytes=1 << 20)
    model.set_prefix_cache()  # "auto" with the default budget again
    assert model.runtime.prefix_cache.budget_bytes == PrefixCache().budget_bytes
