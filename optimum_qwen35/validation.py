"""Checks of what callers pass in, shared by every entry point (Python API, command line, TP runtime,
export and Hub commands). Each check runs before any work starts and raises this package's errors
(`errors.py`) with a message that says what was wrong and what to do.

    ids = token_ids(prompts, config.vocab_size)      # list[list[int]], every id in range
    dtype = parse_dtype("bf16")                       # torch.bfloat16
    n = positive_int(max_new_tokens, "max_new_tokens")
    folder = model_folder(path, "generate")           # an existing checkpoint or export folder
"""

from __future__ import annotations

import numbers
import os
import re
from collections.abc import Sequence
from pathlib import Path

import torch

from .errors import CheckpointError, ModelNotFoundError, UsageError
from .export.layout import NEURON_CONFIG_FILE


# ------------------------------------------------------------------------------------------ numbers
def positive_int(value, name: str, minimum: int = 1) -> int:
    """`value` as an int >= minimum; bools, floats and strings are refused (2.0 would hide a bug)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise UsageError(f"{name} must be an integer >= {minimum}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise UsageError(f"{name} must be an integer >= {minimum}, got {value}")
    return int(value)


def is_int(value) -> bool:
    """An integer (Python or NumPy), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


# ------------------------------------------------------------------------------------------ token ids
def _as_list(value, name: str) -> list:
    """A prompt (list, tuple, 1-D tensor or array) as a Python list, refusing what is not a sequence of ids."""
    if isinstance(value, (str, bytes)):
        raise UsageError(f"{name} is a string; token ids are integers: tokenize the text first (tokenizer(text)['input_ids'])")
    if isinstance(value, torch.Tensor) or type(value).__module__ == "numpy":
        if value.ndim != 1:
            raise UsageError(f"{name} must be a 1-D sequence of token ids, got shape {tuple(value.shape)}")
        kind = str(value.dtype)
        if "int" not in kind:
            raise UsageError(f"{name} has dtype {kind}; token ids must be integers (pass the tokenizer's input_ids)")
        return value.tolist()
    if not isinstance(value, Sequence):
        raise UsageError(f"{name} must be a sequence of token ids, got {type(value).__name__}")
    return list(value)


def int_list(values, name: str, upper: int, beyond: str) -> list[int]:
    """A sequence of integers in [0, upper); `beyond` says what an id >= upper is (e.g. "past max_length 64")."""
    values = _as_list(values, name)
    out = []
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor) and v.ndim == 0 and not v.is_floating_point() and v.dtype != torch.bool:
            v = v.item()
        if not is_int(v):
            raise UsageError(f"{name}[{i}] = {v!r} ({type(v).__name__}) is not an integer; {name} must hold integers")
        if not 0 <= v < upper:
            raise UsageError(f"{name}[{i}] = {v} is {'negative' if v < 0 else beyond}: it must be in [0, {upper})")
        out.append(int(v))
    return out


def token_id_list(ids, vocab_size: int, name: str = "prompt", allow_empty: bool = False) -> list[int]:
    """One sequence of token ids, checked: integers in [0, vocab_size)."""
    ids = _as_list(ids, name)
    if not ids and not allow_empty:
        raise UsageError(f"empty prompt: {name} has no token; every prompt needs at least one")
    return int_list(
        ids, name, vocab_size,
        f"outside this model's vocabulary of {vocab_size} (was it tokenized with this model's tokenizer?)",
    )


def eos_ids(eos_token_id) -> set[int]:
    """`eos_token_id` (None, an id, or a sequence of ids) as a set of ints."""
    if eos_token_id is None:
        return set()
    if is_int(eos_token_id):
        eos_token_id = [eos_token_id]
    return set(int_list(eos_token_id, "eos_token_id", 2**63 - 1, "too large"))


def token_ids(prompts, vocab_size: int, name: str = "prompts", allow_no_prompt: bool = False) -> list[list[int]]:
    """A batch of prompts, checked: a sequence of non-empty sequences of integer ids in [0, vocab_size)."""
    if isinstance(prompts, torch.Tensor) or type(prompts).__module__ == "numpy":
        if prompts.ndim != 2:
            raise UsageError(f"{name} must be a list of prompts (a 2-D tensor [batch, length]), got shape {tuple(prompts.shape)}")
        prompts = list(prompts)
    elif isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise UsageError(f"{name} must be a list of prompts, each a list of token ids; got {type(prompts).__name__}")
    prompts = list(prompts)
    if not prompts and not allow_no_prompt:
        raise UsageError(f"{name} is empty: pass at least one prompt")
    if prompts and all(is_int(p) for p in prompts):
        raise UsageError(f"{name} must be a list of prompts, each a list of token ids: wrap one prompt as [[...]]")
    return [token_id_list(p, vocab_size, f"{name}[{i}]") for i, p in enumerate(prompts)]


# ------------------------------------------------------------------------------------------ dtypes
# Floating-point dtypes the model runs in, by their usual names.
DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "f32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "f16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
    "fp64": torch.float64,
    "f64": torch.float64,
    "double": torch.float64,
}
MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def parse_dtype(dtype, name: str = "dtype") -> torch.dtype:
    """A torch dtype or its usual name ("bfloat16", "bf16", "torch.float32", ...) -> a model dtype."""
    if isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        if key not in DTYPE_NAMES:
            raise UsageError(f"{name} {dtype!r} is not a dtype this model runs in; use one of {sorted(set(DTYPE_NAMES))}")
        return DTYPE_NAMES[key]
    if isinstance(dtype, torch.dtype):
        if dtype not in MODEL_DTYPES:
            raise UsageError(
                f"{name} {dtype} is not a floating-point dtype this model runs in; use torch.float32 or torch.bfloat16 "
                "(also float16, float64)"
            )
        return dtype
    raise UsageError(f"{name} must be a torch dtype or its name (e.g. torch.bfloat16 or 'bfloat16'), got {dtype!r}")


# ------------------------------------------------------------------------------------------ folders
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def looks_like_hub_id(path) -> bool:
    """`owner/name` with no other slash and no leading `.`, `/` or `~`: what a Hub repo id looks like."""
    text = os.fspath(path)
    return bool(_HUB_ID.match(text)) and ".." not in text


def missing_folder_error(path, command: str = "this command") -> ModelNotFoundError:
    """The error for a path that does not exist; one that looks like a Hub id gets a word about Hub ids."""
    text = os.fspath(path)
    if looks_like_hub_id(text):
        # A relative path of two parts looks the same: the message covers both readings.
        return ModelNotFoundError(
            f"no such folder: {text!r}. If it is a Hugging Face Hub id, {command} needs a local checkpoint "
            f"folder: download it first (`hf download {text} --local-dir DIR`) and pass DIR"
        )
    return ModelNotFoundError(f"no such folder: {text!r}; pass the path of a Qwen3.5 checkpoint folder")


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "tp_shards.json")


def model_folder(path, command: str = "this command") -> Path:
    """An existing local folder holding a Qwen3.5 checkpoint or a sharded export (config.json + weights).

    Never reaches the network: a missing path that looks like a Hub id gets a message about Hub ids.
    """
    if path is None or (isinstance(path, str) and not path.strip()):
        raise UsageError(f"{command} needs a model: pass a Qwen3.5 checkpoint folder")
    if not isinstance(path, (str, os.PathLike)):
        raise UsageError(f"the model path must be a string or a path, got {type(path).__name__}")
    folder = Path(path).expanduser()
    if not folder.exists():
        raise missing_folder_error(path, command)
    if not folder.is_dir():
        raise ModelNotFoundError(f"{os.fspath(path)!r} is a file, not a folder; pass the checkpoint folder that holds config.json")
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(
            f"{os.fspath(path)!r} has no config.json: it is not a Qwen3.5 checkpoint folder (pass the folder that holds "
            "config.json and the *.safetensors weights)"
        )
    if (folder / NEURON_CONFIG_FILE).is_file():
        raise CheckpointError(export_folder_message(folder))
    has_weights = any((folder / f).is_file() for f in WEIGHT_FILES) or any(folder.glob("*.safetensors"))
    half_export = any(folder.glob("rank_*.safetensors")) and not (folder / "tp_shards.json").is_file()
    if not has_weights or half_export:
        raise CheckpointError(missing_weights_message(folder))
    return folder


def export_folder_message(folder: Path) -> str:
    """An optimum-neuron export (neuron_config.json) given where a checkpoint is read: what loads it, and where."""
    return (
        f"{folder} is an optimum-neuron export (it has a neuron_config.json), not a checkpoint: load it with "
        "optimum.neuron's NeuronModelForCausalLM.from_pretrained (or optimum_qwen35.optimum_neuron's "
        "Qwen35NeuronModelForCausalLM) in the environment that has optimum-neuron and transformers 4.57 "
        "(pip install \"optimum-qwen35[optimum]\"); here, pass the checkpoint it was exported from"
    )


def missing_weights_message(folder: Path) -> str:
    """Why a folder with a config.json has no loadable weights, and what to do."""
    if (folder / NEURON_CONFIG_FILE).is_file():
        return export_folder_message(folder)
    if any(folder.glob(".rank_*.safetensors.tmp-*")) or any(folder.glob("rank_*.safetensors")):
        return (
            f"{folder} is not a complete sharded export (no tp_shards.json: an interrupted `shard` leaves none); "
            "run `shard` again"
        )
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        return f"{folder} holds PyTorch .bin weights, not safetensors: convert them to safetensors first"
    return (
        f"{folder} has a config.json but no weights (no model.safetensors, model.safetensors.index.json or "
        "tp_shards.json): copy or download the *.safetensors files into it"
    )
