"""transformers 5's entry points for an export: `AutoModelForCausalLM.from_pretrained(export_or_hub_id)` and
`pipeline("text-generation", model=export_or_hub_id)` load this stack's `NeuronModelForCausalLM`; checkpoints still load
with transformers' own classes (patches/ `exports_through_auto_model` asks `is_export` first).

Run options come as `from_pretrained` keywords, so through a pipeline as its `model_kwargs`:

    pipeline("text-generation", model="out/", model_kwargs={"device": "cpu", "compile_backend": "eager"})

(the pipeline's own `device=` is where it puts tensors, not where the export runs; left out it is the CPU, where the
export's host loop takes its inputs). Registered in every process by the start-up hook (`_startup.py`) when
transformers' Auto classes import.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from optimum_qwen35.export.layout import CONFIG_FILE, MODEL_TYPES, NEURON_CONFIG_FILE
from optimum_qwen35.patches import exports_through_auto_model, image_text_to_text_pipeline

# transformers' own keywords of a loading call, which mean nothing for an export (the pipeline adds `_from_pipeline`).
TRANSFORMERS_INTERNAL = ("_from_pipeline", "_from_auto", "_commit_hash", "code_revision", "adapter_kwargs")


def _is_qwen35_folder(folder: Path) -> bool:
    try:
        return json.loads((folder / CONFIG_FILE).read_text()).get("model_type") in MODEL_TYPES
    except (OSError, ValueError, AttributeError):
        return False


def is_export(model_id, kwargs: dict) -> bool:
    """Whether `model_id` (a folder, or a Hub id) is a Qwen3.5 export: a neuron_config.json beside a Qwen3.5 config.json.
    A Hub id costs one request (none where the Hub cache already holds the file); any Hub error answers False, and
    transformers' own loading reports it."""
    subfolder = kwargs.get("subfolder") or ""
    if isinstance(model_id, (str, os.PathLike)) and Path(model_id).is_dir():
        folder = Path(model_id, subfolder)
        return (folder / NEURON_CONFIG_FILE).is_file() and _is_qwen35_folder(folder)
    if not isinstance(model_id, str) or Path(model_id).exists():
        return False
    from huggingface_hub import hf_hub_download  # start-up: only a Hub id's check imports it

    options = {"revision": kwargs.get("revision"), "token": kwargs.get("token"), "subfolder": subfolder or None,
               "cache_dir": kwargs.get("cache_dir")}
    offline = kwargs.get("local_files_only") or os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    for local_only in (True,) if offline else (True, False):
        try:
            hf_hub_download(model_id, NEURON_CONFIG_FILE, local_files_only=local_only, **options)
            config = hf_hub_download(model_id, CONFIG_FILE, local_files_only=local_only, **options)
        except Exception:  # noqa: BLE001 (not cached: ask the Hub; no such file or repo, offline: transformers says)
            continue
        return _is_qwen35_folder(Path(config).parent)
    return False


def load_export(model_id, **kwargs):
    """`NeuronModelForCausalLM.from_pretrained(model_id, **kwargs)` of this stack, without transformers' internal
    keywords."""
    from optimum_qwen35.neuron_model import neuron_model_class  # start-up: imports torch (and optimum-neuron there)

    for key in TRANSFORMERS_INTERNAL:
        kwargs.pop(key, None)
    return neuron_model_class().from_pretrained(model_id, **kwargs)


def register_auto_model() -> None:
    """transformers >= 5: exports through `AutoModelForCausalLM` and the text-generation pipeline (idempotent)."""
    exports_through_auto_model(is_export, load_export)
    image_text_to_text_pipeline(["Qwen35ModelForCausalLM"], task="text-generation")
