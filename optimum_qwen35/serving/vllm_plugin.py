"""vLLM's `general_plugins` entry point (setup.cfg): Qwen3.5 exports served through optimum-neuron's vLLM platform.

vLLM runs the entry point in each of its processes: `vllm_plugin` registers the transformers configs and the
optimum-neuron class, the architectures with vLLM (`vllm_model.py`: the class vLLM inspects; optimum-neuron's platform
loads the export itself), and fits vLLM's settings to a Qwen3.5 export before optimum-neuron's platform reads them
(`vllm_settings`, applied through `patches.platform_settings_first`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from optimum_qwen35 import patches
from optimum_qwen35.export.layout import ARCHITECTURES, CONFIG_FILE, MODEL_TYPES, NEURON_CONFIG_FILE
from optimum_qwen35.optimum_neuron.registration import register_transformers

logger = logging.getLogger(__name__)

# The class vLLM inspects for the Qwen3.5 architectures (torch only); optimum-neuron's platform loads the export itself.
VLLM_MODEL_CLASS = "optimum_qwen35.serving.vllm_model:Qwen35ForOptimumNeuron"
# optimum-neuron's worker, with the export loaded by this package's class: for cpu-target exports only.
VLLM_CPU_WORKER = "optimum_qwen35.serving.vllm_worker.Qwen35CpuExportWorker"


def vllm_plugin() -> list[str]:
    """vLLM's `general_plugins` entry point: registers what it can and returns what it registered.

    vLLM itself is optional: without it, the configs and the optimum-neuron class are still registered.
    """
    done = []
    if register_transformers():
        done.append("transformers configs")
    try:
        from optimum_qwen35.optimum_neuron import modeling  # noqa: F401  optional dependency; registers its class

        done.append("optimum-neuron model class")
    except ImportError as error:  # optimum-neuron not installed
        logger.info("optimum-neuron is not installed, its registry is skipped: %s", error)
    try:
        from vllm import ModelRegistry  # optional dependency: vLLM serving only
    except ImportError:
        return done
    for architecture in ARCHITECTURES:
        ModelRegistry.register_model(architecture, VLLM_MODEL_CLASS)
    done.append("vLLM architectures")
    try:
        from optimum.neuron.vllm.platform import OptimumNeuronPlatform  # optional dependency (imports vLLM only)
    except ImportError:
        return done
    patches.platform_settings_first(OptimumNeuronPlatform, vllm_settings)
    done.append("vLLM settings of Qwen3.5 exports")
    return done


def qwen35_export(model) -> tuple[dict, dict] | None:
    """(config.json, neuron_config.json) of a local folder holding a Qwen3.5 export, else None."""
    folder = Path(str(model))
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
        neuron_config = json.loads((folder / NEURON_CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None
    if config.get("model_type") not in MODEL_TYPES or not isinstance(neuron_config, dict):
        return None
    return config, neuron_config


def vllm_settings(vllm_config) -> None:
    """vLLM's settings for a Qwen3.5 export, before optimum-neuron's platform reads them; other models unchanged.

    - the longest sequence is the export's `sequence_length` (vLLM derives 262144 from the config), so that vLLM
      itself refuses longer requests; at most `batch_size` sequences at once (the export's slots);
    - every prompt is prefilled whole: optimum-neuron's runner runs each new request's whole prompt in one call,
      so chunked prefill is off and the step's token budget holds a full-length prompt beside a decode step of
      every slot (vLLM's default budget, 2048 to 8192 tokens, would never schedule a longer prompt);
    - a cpu-target export runs in optimum-neuron's worker with this package's loader (`vllm_worker.py`), which
      needs no Neuron core or compiler; Neuron exports keep optimum-neuron's worker;
    - vLLM's prefix caching is off (one log line when it was asked for): its hits skip the cached tokens of a
      request, but optimum-neuron's runner prefills every prompt whole into a slot whose DeltaNet states vLLM's
      block tables do not hold (docs/prefix_caching.md).
    """
    model_config, scheduler = vllm_config.model_config, vllm_config.scheduler_config
    export = None if model_config is None else qwen35_export(model_config.model)
    if export is None:
        return
    _, neuron_config = export
    length, slots = int(neuron_config["sequence_length"]), int(neuron_config["batch_size"])
    if model_config.max_model_len > length:
        logger.info("max_model_len %d -> %d: the export's sequence_length", model_config.max_model_len, length)
        model_config.max_model_len = length
    if scheduler is not None:
        scheduler.max_model_len = model_config.max_model_len
        scheduler.max_num_seqs = min(scheduler.max_num_seqs, slots)
        scheduler.enable_chunked_prefill = scheduler.chunked_prefill_enabled = False
        scheduler.max_num_batched_tokens = max(scheduler.max_num_batched_tokens, model_config.max_model_len + slots)
        scheduler.max_num_partial_prefills = 1
    cache = getattr(vllm_config, "cache_config", None)
    if cache is not None and getattr(cache, "enable_prefix_caching", False):
        logger.info("prefix caching off for this Qwen3.5 export: vLLM's block hits cannot restore its DeltaNet states "
                    "(docs/prefix_caching.md)")
        cache.enable_prefix_caching = False
    parallel = vllm_config.parallel_config
    if neuron_config.get("target") == "cpu" and parallel is not None and parallel.worker_cls == "auto":
        parallel.worker_cls = VLLM_CPU_WORKER
