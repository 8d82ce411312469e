"""What `Qwen35NeuronModelForCausalLM.from_pretrained` and `export` take: the source (a folder, or a Hub id downloaded
into the Hugging Face cache) and the keywords of optimum-neuron's and transformers' loading calls."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from huggingface_hub import HfApi

from optimum_qwen35 import hub
from optimum_qwen35.errors import ModelNotFoundError, UsageError
from optimum_qwen35.export import layout

logger = logging.getLogger(__name__)


def local_or_download(model_id: str | os.PathLike, revision=None, token=None, allow_patterns=None) -> Path:
    """A local folder as is, or a Hub model downloaded into the Hugging Face cache."""
    path = Path(model_id)
    if path.is_dir():
        return path
    if path.exists():
        raise ModelNotFoundError(f"{model_id} is a file, not a model folder")
    return hub.download_checkpoint(os.fspath(model_id), revision, token, allow_patterns=allow_patterns)


# from_pretrained's keywords, optimum-neuron's and transformers' (`loading_options`).
# Where the export is read from (a Hub download's options; `subfolder` also for a local folder).
SOURCE_KEYWORDS = ("cache_dir", "force_download", "local_files_only", "subfolder")
# What the export must have been compiled for, by the caller's keyword (aliases: transformers' torch_dtype, and the
# keywords of optimum-neuron before 0.1, which lm-eval's `neuronx` model still passes).
EXPECTED_KEYWORDS = {
    "target": "target", "instance_type": "target", "batch_size": "batch_size", "sequence_length": "sequence_length",
    "tensor_parallel_size": "tensor_parallel_size", "num_cores": "tensor_parallel_size", "tp_degree": "tensor_parallel_size",
    "dtype": "dtype", "torch_dtype": "dtype", "auto_cast_type": "dtype",
}
# How a TorchNeuron export's graphs run (backends/torchneuron/runner.py `load_runtime`): the `torch.compile` backend
# ("neuron" by default; "eager" runs them on a CPU) and the device ("neuron"; "cpu").
RUN_KEYWORDS = ("compile_backend", "device")
EXPORT_TRUE_REFUSED = (
    "{model_id} is not an export, and from_pretrained(export=True) does not compile one (optimum-neuron 0.4.5 ignores "
    "it for decoders): call get_neuron_config() then export(), or `optimum-qwen35 export --model {model_id} --target cpu OUT`"
)


def loading_options(kwargs: dict) -> tuple[dict, dict, dict]:
    """Sort from_pretrained's keywords: (where to read the export, what it must be compiled for, the keyword each
    expectation was given as). Keywords that mean nothing for an export are ignored with one warning, as
    optimum-neuron's own `_from_pretrained` does (transformers' `trust_remote_code`, `low_cpu_mem_usage`,
    `device_map`, `attn_implementation`...); a dtype of "auto" or None expects nothing."""
    source, expected, given_as, ignored = {}, {}, {}, {}
    for key, value in kwargs.items():
        if key in SOURCE_KEYWORDS:
            if value not in (None, ""):
                source[key] = value
        elif key == "export":
            expected["export"] = bool(value)
        elif key in EXPECTED_KEYWORDS:
            name = EXPECTED_KEYWORDS[key]
            if value is None or (name == "dtype" and value == "auto"):
                continue
            if name in expected and given_as[name] != key:
                raise UsageError(f"from_pretrained() got both {given_as[name]}= and {key}=: pass one of them")
            expected[name], given_as[name] = value, key
        else:
            ignored[key] = value
    ignored = sorted(k for k, v in ignored.items() if v is not None)
    if ignored:
        logger.warning("from_pretrained(): ignoring %s (they do not apply to a compiled export)", ", ".join(ignored))
    return source, expected, given_as


def is_export_repo(model_id, revision, token, subfolder=None) -> bool:
    """Whether a Hub repo holds an export (a neuron_config.json); errors (missing repo, offline...) are left
    to the download that follows."""
    api = HfApi(token=token)
    path = f"{subfolder}/{layout.NEURON_CONFIG_FILE}" if subfolder else layout.NEURON_CONFIG_FILE
    try:
        api.repo_info(os.fspath(model_id), revision=revision)  # a missing repo or revision: resolve_export says so
        return api.file_exists(os.fspath(model_id), path, revision=revision)
    except Exception:  # noqa: BLE001
        return True


def snapshot_revision(folder: Path) -> str | None:
    """The commit of a Hub snapshot folder (its name in the cache), or None."""
    return folder.name if folder.parent.name == "snapshots" else None


def run_options(kwargs: dict) -> dict:
    """Take the keywords saying how a TorchNeuron export runs out of from_pretrained's keywords (`RUN_KEYWORDS`)."""
    options = {}
    for key in RUN_KEYWORDS:
        value = kwargs.pop(key, None)
        if value is not None:
            options[key] = value
    return options
