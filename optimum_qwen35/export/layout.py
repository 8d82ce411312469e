"""The export folder's format, written down once: its files, manifests, model types and architectures.

Every writer and reader of an export (the cpu export, the sharded checkpoint, the runtime, the Hub push and
download, the compile-cache registry, the processor, vLLM's settings, the NxD backend) takes names from here.

    config.json              the text config (MODEL_TYPES' text types), `architectures` = EXPORT_ARCHITECTURES
    neuron_config.json       a plain optimum-neuron NxDNeuronConfig dict (`target` "cpu" or a Neuron target; a
                             TorchNeuron export adds `export_backend`: "torchneuron")
    generation_config.json, tokenizer and chat-template files (SIDE_FILES), processor files (PROCESSOR_FILES)
    compiled/graphs.json     cpu target: what was compiled (GRAPHS_FORMAT), then one program per graph
    checkpoint/tp_shards.json + checkpoint/rank_<r>.safetensors   cpu target: each rank's weights
    model.pt (+ checkpoint/weights/)                              an NxD export: optimum-neuron's own files

A TorchNeuron export (trn2; backends/torchneuron/) has the cpu target's two folders, with a graphs.json that lists
the graphs TorchNeuron compiles on first load and no program files (`torch.compile` has no ahead-of-time artifact).

The cpu target's two manifests (CPU_MANIFESTS) are each written last in their folder, so that a folder holding
both is complete. Standard library only: anything may import this module.
"""

from __future__ import annotations

import json
from pathlib import Path

from optimum_qwen35.errors import IncompatibleExportError, ModelNotFoundError

# ------------------------------------------------------------------------------------------------ model types
TASK = "text-generation"
# The model types a Qwen3.5 checkpoint or export carries: the whole (vision + text) configs and their text parts.
MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
# The text config's model type, which an export's config.json carries: dense and MoE.
TEXT_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")
# What a Qwen3.5 checkpoint's config.json names as its architecture (vLLM 0.11 knows none of them).
ARCHITECTURES = (
    "Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM", "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM",
)
# What an export's config.json names (the text model's class): vLLM refuses a config.json that names none.
EXPORT_ARCHITECTURES = {"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}

# ------------------------------------------------------------------------------------------------- the files
CONFIG_FILE = "config.json"
NEURON_CONFIG_FILE = "neuron_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# Copied from the source checkpoint next to the compiled model (those that exist).
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    GENERATION_CONFIG_FILE,
)
# A vision export also carries the checkpoint's processor files, unchanged.
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")
# What a Hub download of a source checkpoint needs (vision-only files are small: not skipped).
CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt"]

# The cpu target's folders and manifests.
COMPILED_DIR = "compiled"
CHECKPOINT_DIR = "checkpoint"
GRAPHS_FILE = "graphs.json"
GRAPHS_FORMAT = "optimum-qwen35-cpu-graphs"
GRAPHS_VERSION = 2  # 2: state updated in place, token-generation buckets
TP_SHARDS_FILE = "tp_shards.json"
TP_SHARDS_FORMAT = "optimum-qwen35-tp-shards"
TP_SHARDS_VERSION = 1
VISION_WEIGHTS_FILE = "vision.safetensors"
# The multi-token-prediction head's weights of an export made with mtp=True (`mtp_weights_file`: one per rank).
MTP_WEIGHTS_FILE = "mtp.safetensors"
CPU_MANIFESTS = (f"{COMPILED_DIR}/{GRAPHS_FILE}", f"{CHECKPOINT_DIR}/{TP_SHARDS_FILE}")
# optimum-neuron's compiled model of a Neuron target.
NXD_MODEL_FILE = "model.pt"
# Where a Neuron vision export's config.json carries the vision tower's config and image buckets:
# `{"config": VisionConfig fields, "image_buckets": [...]}` (the NxD class is built from the text config alone).
VISION_EXPORT_KEY = "qwen35_vision_export"
# Where a Neuron export made with mtp=True (the NxD backend) says so in its config.json: `{"max_speculative_tokens": K}`
# (the NxD class builds the speculative-decoding graphs and the head from it: backends/nxd/model.py).
MTP_EXPORT_KEY = "qwen35_mtp_export"
# Where a Neuron export with FP8 weights (the NxD backend) names them in its config.json: `{"weights": [decoder weight
# names]}` (the NxD class holds those as float8 with their scales: backends/nxd/fp8.py).
FP8_EXPORT_KEY = "qwen35_fp8_weights"

# The files of an export (what a Hub download of one fetches): configs, tokenizer, graphs, per-rank weights.
# README.md (the model card) and .gitattributes are not part of it.
# A TorchNeuron export's Hub repo may also hold the NEFF compile cache it was pushed with (neuron_model/compile_cache.py).
NEFF_CACHE_DIR = "neff_cache"
EXPORT_PATTERNS = ["*.json", "*.jinja", "*.txt", "tokenizer*", f"{COMPILED_DIR}/*", f"{CHECKPOINT_DIR}/*", NXD_MODEL_FILE,
                   f"{NEFF_CACHE_DIR}/*"]
# Files that mark a folder as a model or an export this package (or transformers, optimum-neuron) wrote.
MODEL_MARKERS = (CONFIG_FILE, TP_SHARDS_FILE, NEURON_CONFIG_FILE, "model.safetensors.index.json", NXD_MODEL_FILE)
# Never pushed: local metadata folders (the Hugging Face local_dir cache, git, editor files).
NOT_EXPORT_PARTS = {".git", ".cache", "__pycache__"}


def rank_file(rank: int) -> str:
    return f"rank_{rank}.safetensors"


# The cpu target's programs, one per graph and bucket.
def context_graph_name(length: int) -> str:
    return f"context_encoding_{length}"


def continuing_context_graph_name(length: int, key_length: int) -> str:
    """A context-encoding program of bucket `length` attending over `key_length` cache positions: it continues a
    sequence (what a prefix cache's resumed prompts run)."""
    return f"context_encoding_{length}_keys_{key_length}"


def logits_graph_name(length: int) -> str:
    return f"context_logits_{length}"


def token_graph_name(key_length: int) -> str:
    return f"token_generation_{key_length}"


def vision_graph_name(bucket: int) -> str:
    return f"vision_{bucket}"


def image_context_graph_name(length: int) -> str:
    return f"image_context_encoding_{length}"


def image_token_graph_name(key_length: int) -> str:
    return f"image_token_generation_{key_length}"


# Speculative decoding with the MTP head (an export made with mtp=True; graphs.json "mtp").
def context_hidden_graph_name(length: int) -> str:
    """Context encoding of a fresh prompt that also returns every position's hidden state (what the head reads)."""
    return f"context_hidden_{length}"


def verify_graph_name(length: int, key_length: int) -> str:
    return f"verify_{length}_keys_{key_length}"


def commit_graph_name(length: int) -> str:
    return f"commit_{length}"


def mtp_weights_file(rank: int, tp_degree: int) -> str:
    """The file of rank `rank`'s share of the MTP head: mtp.safetensors at TP 1 (the name exports have always had
    there), mtp_rank_<r>.safetensors above."""
    return MTP_WEIGHTS_FILE if tp_degree == 1 else f"mtp_rank_{rank}.safetensors"


def mtp_graph_name(length: int, key_length: int) -> str:
    return f"mtp_{length}_keys_{key_length}"


# --------------------------------------------------------------------------------------------- reading one
def read_json(path: Path) -> dict:
    """A JSON object of an export; a one-line error for a file that is not one (FileNotFoundError as is)."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:
        raise IncompatibleExportError(f"{path} is not readable JSON: {e}") from e
    if not isinstance(data, dict):
        raise IncompatibleExportError(f"{path} holds a JSON {type(data).__name__}, not an object: export the model again")
    return data


def is_export(folder: Path) -> bool:
    return (Path(folder) / NEURON_CONFIG_FILE).is_file()


def read_neuron_config(folder: Path) -> dict:
    """The neuron_config.json of an export folder as a dict; a one-line error for a folder that is not an export."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelNotFoundError(f"{folder} is not a folder")
    missing = [name for name in (CONFIG_FILE, NEURON_CONFIG_FILE) if not (folder / name).is_file()]
    if missing:
        raise IncompatibleExportError(f"{folder} is not an exported model: it has no {' and no '.join(missing)} (export it first)")
    return read_json(folder / NEURON_CONFIG_FILE)


# How an export's graphs are built and run: the cpu target's `torch.export` programs, optimum-neuron's NxD model
# (model.pt), or TorchNeuron's `torch.compile(backend="neuron")` on first load. neuron_config.json names it under
# BACKEND_KEY where it is not implied by the target (a Neuron target without it is an NxD export, as before).
CPU_BACKEND, NXD_BACKEND, TORCHNEURON_BACKEND = "cpu", "nxd", "torchneuron"
BACKEND_KEY = "export_backend"


def is_cpu_export(neuron_config: dict) -> bool:
    return neuron_config.get("target") == "cpu"


def export_backend(neuron_config: dict) -> str:
    if is_cpu_export(neuron_config):
        return CPU_BACKEND
    return neuron_config.get(BACKEND_KEY) or NXD_BACKEND


def holds_rank_shards(neuron_config: dict) -> bool:
    """Whether the export keeps each rank's weights and a graphs.json (the cpu and TorchNeuron backends)."""
    return export_backend(neuron_config) in (CPU_BACKEND, TORCHNEURON_BACKEND)


def required_files(neuron_config: dict) -> list[str]:
    """What a complete export holds besides its configs."""
    return list(CPU_MANIFESTS) if holds_rank_shards(neuron_config) else [NXD_MODEL_FILE]


def export_files(folder: Path, neuron_config: dict) -> dict[str, Path]:
    """The files of an export, path in repo -> local path (sorted, posix paths). A Neuron export of a Hub model does
    not carry the weights, as optimum-neuron's push_to_hub: they are fetched from the source checkpoint at load."""
    folder = Path(folder)
    skip_checkpoint = not holds_rank_shards(neuron_config) and neuron_config.get("checkpoint_id") is not None
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if not path.is_file() or NOT_EXPORT_PARTS.intersection(rel.parts):
            continue
        if skip_checkpoint and rel.parts[0] == CHECKPOINT_DIR:
            continue
        out[rel.as_posix()] = path
    return out
