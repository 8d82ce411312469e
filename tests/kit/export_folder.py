"""A stand-in export folder, in the layout the exporter writes, for tests of the Hub half.

The files that matter to the Hub code are real: `config.json` is the text config transformers writes for a
Qwen3.5 checkpoint (`save_pretrained` of `get_text_config()`, with the export dtype, as optimum-neuron's
export sets it), `neuron_config.json` is a plain optimum-neuron `NxDNeuronConfig` dict, the tokenizer and
generation config are copied from the checkpoint. The graphs and weights are placeholders with the right
names (`compiled/*.pt2` + manifest and `checkpoint/rank_{r}.safetensors` + manifest for the cpu target,
`model.pt` for Neuron): they are not loadable models.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

__all__ = ["build_fake_export", "neuron_config_dict"]


def neuron_config_dict(
    checkpoint_id: str | None,
    checkpoint_revision: str | None = None,
    target: str = "cpu",
    batch_size: int = 1,
    sequence_length: int = 128,
    tp_degree: int = 1,
    torch_dtype: str = "bfloat16",
    optimum_neuron_version: str = "0.4.5",
) -> dict:
    """The neuron_config.json of an export: NxDNeuronConfig's fields, as its to_dict writes them."""
    return {
        "_serialized_key": "NxDNeuronConfig",
        "optimum_neuron_version": optimum_neuron_version,
        "neuronxcc_version": None if target == "cpu" else "2.21.33363.0+82129205",
        "checkpoint_id": checkpoint_id,
        "checkpoint_revision": checkpoint_revision,
        "batch_size": batch_size,
        "max_batch_size": batch_size,
        "continuous_batching": batch_size > 1,
        "speculation_length": 0,
        "sequence_length": sequence_length,
        "max_context_length": sequence_length,
        "n_active_tokens": sequence_length,
        "tp_degree": tp_degree,
        "ep_degree": 1,
        "pp_degree": 1,
        "torch_dtype": torch_dtype,
        "output_logits": False,
        "fused_qkv": False,
        "target": target,
        "on_device_sampling": False,
        "max_topk": 256,
        "start_rank_id": 0,
        "local_ranks_size": tp_degree,
        "capacity_factor": None,
        "glu_mlp": True,
    }


def _torch_version() -> str:
    from importlib.metadata import version

    return version("torch").split("+")[0]


def build_fake_export(
    out: str | os.PathLike,
    source: str | os.PathLike,
    checkpoint_id: str | None,
    checkpoint_revision: str | None = None,
    target: str = "cpu",
    batch_size: int = 1,
    sequence_length: int = 128,
    tp_degree: int = 1,
    torch_dtype: str = "bfloat16",
    weights_bytes: int = 4096,
    seed: int = 0,
) -> Path:
    """Write an export folder for the checkpoint folder `source` (e.g. from `build_tiny_checkpoint`)."""
    import numpy as np
    from transformers import AutoConfig

    from optimum_qwen35 import register_transformers_configs

    register_transformers_configs()
    out, source = Path(out), Path(source)
    out.mkdir(parents=True, exist_ok=True)
    text_config = AutoConfig.from_pretrained(source).get_text_config()
    text_config.torch_dtype = torch_dtype  # as optimum-neuron's export does before saving
    text_config.save_pretrained(out)
    nc = neuron_config_dict(
        checkpoint_id, checkpoint_revision, target, batch_size, sequence_length, tp_degree, torch_dtype
    )
    (out / "neuron_config.json").write_text(json.dumps(nc, indent=2, sort_keys=True) + "\n")
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    rng = np.random.default_rng(seed)
    if target == "cpu":
        compiled = out / "compiled"
        compiled.mkdir(exist_ok=True)
        programs = []
        for graph in ("context_encoding", "token_generation"):
            for rank in range(tp_degree):
                name = f"{graph}_rank{rank}.pt2"
                (compiled / name).write_bytes(rng.bytes(weights_bytes // 4))
                programs.append(name)
        # The real manifest's fields that the Hub side reads (runtime/compiled.py writes the whole of it).
        manifest = {"format": "optimum-qwen35-cpu-graphs", "torch_version": _torch_version(), "programs": programs}
        (compiled / "graphs.json").write_text(json.dumps(manifest, indent=2) + "\n")
        checkpoint = out / "checkpoint"
        checkpoint.mkdir(exist_ok=True)
        ranks = []
        for rank in range(tp_degree):
            name = f"rank_{rank}.safetensors"
            (checkpoint / name).write_bytes(rng.bytes(weights_bytes))
            ranks.append(name)
        (checkpoint / "tp_shards.json").write_text(json.dumps({"ranks": ranks}, indent=2) + "\n")
    else:
        (out / "model.pt").write_bytes(rng.bytes(weights_bytes))
        if checkpoint_id is None:
            weights = out / "checkpoint" / "weights"
            weights.mkdir(parents=True, exist_ok=True)
            for rank in range(tp_degree):
                (weights / f"tp{rank}_sharded_checkpoint.safetensors").write_bytes(rng.bytes(weights_bytes))
    return out
