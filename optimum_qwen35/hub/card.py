"""The model card pushed with an export: metadata, the compiled shapes, versions and how to load it."""

from __future__ import annotations

import json
import os
from importlib import metadata
from pathlib import Path
from typing import Any

from optimum_qwen35.export import layout
from optimum_qwen35.version import __version__


def _package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _export_versions(folder: Path, nc: dict) -> dict[str, str | None]:
    """Versions to state in the card: the export's own records first, the installed packages otherwise."""
    recorded: dict[str, Any] = {}
    for manifest in layout.CPU_MANIFESTS:
        try:
            recorded.update(json.loads((Path(folder) / manifest).read_text()))
        except (OSError, ValueError):
            pass
    config = layout.read_json(Path(folder) / "config.json")
    return {
        "optimum-qwen35": recorded.get("optimum_qwen35_version") or __version__,
        "optimum-neuron": nc.get("optimum_neuron_version"),
        "neuronx-cc": nc.get("neuronxcc_version"),
        "torch": recorded.get("torch_version") or _package_version("torch"),
        "transformers": config.get("transformers_version"),
    }


def model_card(folder: str | os.PathLike, repo_id: str) -> str:
    """The README.md pushed with an export: metadata, the compiled shapes, versions and how to load it.

    Deterministic (no dates): pushing the same folder again produces the same card, so nothing changes."""
    folder = Path(folder)
    nc = layout.read_neuron_config(folder)
    config = layout.read_json(folder / "config.json")
    base = nc.get("checkpoint_id")
    target = nc.get("target")
    versions = _export_versions(folder, nc)
    front = ["---", "library_name: optimum-neuron", "pipeline_tag: text-generation"]
    if base:
        front.append(f"base_model: {base}")
    front += [
        "tags:",
        "- optimum-neuron",
        "- optimum-qwen35",
        "- qwen3_5",
        *(["- qwen3_5_moe"] if config.get("model_type") == "qwen3_5_moe_text" else []),
        f"- {'cpu' if target == 'cpu' else 'neuron'}",
    ]
    front.append("---")
    rows = [
        (
            "base model",
            f"`{base}`" + (f" @ `{nc['checkpoint_revision']}`" if nc.get("checkpoint_revision") else "")
            if base
            else "exported from a local folder",
        ),
        ("target", f"`{target}`"),
        ("backend", f"`{layout.export_backend(nc)}`"),
        ("batch size", nc.get("batch_size")),
        ("sequence length", nc.get("sequence_length")),
        ("tensor parallel degree", nc.get("tp_degree")),
        ("dtype", f"`{nc.get('torch_dtype')}`"),
        ("continuous batching", nc.get("continuous_batching")),
        ("model type", f"`{config.get('model_type')}`"),
    ]
    if not layout.holds_rank_shards(nc):
        carries = (folder / layout.CHECKPOINT_DIR).is_dir() and base is None
        weights = "in this repository (`checkpoint/weights/`)" if carries else f"fetched from `{base}` at load time"
    else:
        weights = "in this repository (`checkpoint/`, one file per rank)"
    rows.append(("weights", weights))
    lines = front + [
        "",
        f"# {repo_id}",
        "",
        f"A Qwen3.5 model exported with optimum-qwen35 for the `{target}` target: its graphs are compiled for the"
        " static shapes below and run only with them"
        + (" (TorchNeuron compiles them on the first load on a device)." if layout.export_backend(nc) == layout.TORCHNEURON_BACKEND else "."),
        "",
        "| | |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in rows],
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v) + ".",
        "",
        "## Load it",
        "",
        "```python",
        "from optimum_qwen35 import NeuronModelForCausalLM",
        "",
        f'model = NeuronModelForCausalLM.from_pretrained("{repo_id}")',
        "```",
        "",
        "`NeuronModelForCausalLM` is optimum-neuron's subclass where optimum-neuron is installed, this package's own"
        " class elsewhere (transformers 5's `AutoModelForCausalLM` and text-generation pipeline load it too)."
        + (" An NxD export loads only with the same optimum-neuron and neuronx-cc versions as above."
           if layout.export_backend(nc) == layout.NXD_BACKEND else ""),
        "",
    ]
    return "\n".join(lines)
