"""What the registration hook changes in vLLM, without starting an engine: the class vLLM inspects passes its
text-generation check without importing optimum-neuron's loader or the Neuron SDK; `vllm_settings` fits a Qwen3.5
export (cpu and Neuron targets) and leaves every other model alone."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

from optimum_qwen35.serving.vllm_plugin import VLLM_CPU_WORKER, vllm_settings

from .conftest import environment

INSPECT = r"""
import json, sys
from vllm.model_executor.models.registry import _ModelInfo
from optimum_qwen35.serving.vllm_model import Qwen35ForOptimumNeuron
info = _ModelInfo.from_model_cls(Qwen35ForOptimumNeuron)
print(json.dumps({"generate": info.is_text_generation_model, "pooling": info.is_pooling_model,
                  "loaded": sorted(m for m in ("optimum.neuron.vllm.model_loader", "neuronxcc", "neuronx_distributed",
                                               "torch_neuronx") if m in sys.modules)}))
"""


def test_vllms_inspection_passes_without_optimum_neurons_loader():
    result = subprocess.run([sys.executable, "-c", INSPECT], env=environment(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"generate": True, "pooling": False, "loaded": []}


def engine_config(model, max_model_len=262144, max_num_seqs=256, budget=256):
    return SimpleNamespace(
        model_config=SimpleNamespace(model=str(model), max_model_len=max_model_len),
        scheduler_config=SimpleNamespace(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                         max_num_batched_tokens=budget, enable_chunked_prefill=True,
                                         chunked_prefill_enabled=True, max_num_partial_prefills=1),
        parallel_config=SimpleNamespace(worker_cls="auto"),
    )


def folder(tmp_path, name, model_type, target):
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": ["X"]}))
    (path / "neuron_config.json").write_text(json.dumps({"target": target, "sequence_length": 512, "batch_size": 2}))
    return path


def test_a_qwen35_export_gets_its_length_slots_and_budget(tmp_path):
    for target, worker in (("cpu", VLLM_CPU_WORKER), ("trn2", "auto")):
        config = engine_config(folder(tmp_path, target, "qwen3_5_text", target))
        vllm_settings(config)
        assert config.model_config.max_model_len == config.scheduler_config.max_model_len == 512
        assert config.scheduler_config.max_num_seqs == 2
        assert not config.scheduler_config.chunked_prefill_enabled
        assert config.scheduler_config.max_num_batched_tokens == 512 + 2
        assert config.parallel_config.worker_cls == worker  # Neuron exports keep optimum-neuron's worker
    config = engine_config(folder(tmp_path, "short", "qwen3_5_text", "cpu"), max_model_len=100, budget=8192)
    vllm_settings(config)  # a shorter --max-model-len and a larger budget are kept
    assert (config.model_config.max_model_len, config.scheduler_config.max_num_batched_tokens) == (100, 8192)


def test_other_models_are_left_alone(tmp_path):
    for model in (folder(tmp_path, "llama", "llama", "trn2"), folder(tmp_path, "llama-cpu", "llama", "cpu"),
                  "Qwen/Qwen3.5-2B", tmp_path / "missing"):
        config = engine_config(model)
        before = json.dumps(config, default=vars)
        vllm_settings(config)
        assert json.dumps(config, default=vars) == before


def test_vllms_prefix_caching_is_turned_off_with_one_log_line(tmp_path, caplog):
    config = engine_config(folder(tmp_path, "cpu", "qwen3_5_text", "cpu"))
    config.cache_config = SimpleNamespace(enable_prefix_caching=True)
    with caplog.at_level("INFO", logger="optimum_qwen35.serving.vllm_plugin"):
        vllm_settings(config)
    assert config.cache_config.enable_prefix_caching is False
    assert [r.getMessage() for r in caplog.records if "prefix caching" in r.getMessage()] == [
        "prefix caching off for this Qwen3.5 export: vLLM's block hits cannot restore its DeltaNet states "
        "(docs/prefix_caching.md)"
    ]
