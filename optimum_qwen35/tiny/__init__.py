"""Tiny random Qwen3.5 checkpoints, in exactly the on-disk format of the real Hub snapshots.

No real weights can be downloaded in the test environments, so every test builds (or reads) a small
random checkpoint with the same files, config fields, tensor names and layouts as `Qwen/Qwen3.5-*`:

- `config.json`: the nested vision-language config (`model_type: "qwen3_5"`, a `text_config` of type
  `qwen3_5_text` with every field the real file has, a small `vision_config`, the top-level vision token ids);
- `generation_config.json`;
- safetensors weights (metadata `{"format": "pt"}`): the text decoder under `model.language_model.*`, the
  vision tower under `model.visual.*`, the multi-token-prediction head under `mtp.*`, and `lm_head.weight`
  only when the embeddings are untied; sharded with a `model.safetensors.index.json` or a single file;
- a small byte-level BPE tokenizer (`tokenizer.json`, `tokenizer_config.json` with a ChatML template).

Everything is deterministic from `seed` (numpy's PCG64 `default_rng`, not torch's RNG), and this module does
not import transformers, so it runs in every environment of the project. It is what `optimum-qwen35 demo` and
`build-tiny` run; the tests build their checkpoints with it too.
"""


from __future__ import annotations

import os
from pathlib import Path

from optimum_qwen35.tiny.chat_templates import CHAT_TEMPLATES
from optimum_qwen35.tiny.configs import (
    MOE_EXPERT_FORMS,
    TINY_LAYOUTS,
    TINY_MOE_LAYOUTS,
    _SHARDS,
    _generation_config,
    tiny_full_config,
    tiny_text_config,
    tiny_vision_config,
)
from optimum_qwen35.tiny.tokenizer import (
    CHAT_MESSAGES,
    ENDOFTEXT_ID,
    IM_END_ID,
    SPECIAL_TOKENS,
    TOKENIZER_BASE_VOCAB,
    _write_json,
    build_tiny_tokenizer,
    special_token_id,
)
from optimum_qwen35.tiny.weights import _DTYPES, tiny_state_dict, write_safetensors

__all__ = [
    "CHAT_MESSAGES",
    "FAMILIES",
    "ENDOFTEXT_ID",
    "IM_END_ID",
    "MOE_EXPERT_FORMS",
    "PREPROCESSOR_CONFIG",
    "SPECIAL_TOKENS",
    "TINY_LAYOUTS",
    "TINY_MOE_LAYOUTS",
    "TOKENIZER_BASE_VOCAB",
    "build_tiny_checkpoint",
    "build_tiny_tokenizer",
    "special_token_id",
    "tiny_full_config",
    "tiny_state_dict",
    "tiny_text_config",
    "tiny_vision_config",
    "write_safetensors",
]

# The image processor config a Qwen3.5 checkpoint ships (`preprocessor_config.json`: 16-pixel patches, 2 x 2 merge,
# 2 frames per temporal patch, mean and std 0.5), with smaller pixel bounds so that the tiny tests' images fit
# small image buckets: 16 to 128 patches (64 x 64 to about 181 x 181 pixels of a square image).
PREPROCESSOR_CONFIG = {
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "image_std": [0.5, 0.5, 0.5],
    "merge_size": 2,
    "patch_size": 16,
    "processor_class": "Qwen3VLProcessor",
    "size": {"longest_edge": 32768, "shortest_edge": 4096},
    "temporal_patch_size": 2,
}


# The checkpoint families of this architecture a tiny checkpoint can be built as: they share the model (Qwen3.6-27B
# and Qwen3.8-27B are `tiny-nv3x`'s shape, Qwen3.6-35B-A3B `tiny-moe`'s) and differ in the chat template.
FAMILIES = ("qwen3.5", *CHAT_TEMPLATES)


def build_tiny_checkpoint(
    path: str | os.PathLike, layout: str = "tiny-2b", seed: int = 0, dtype: str = "float32",
    expert_form: str | None = None, family: str = "qwen3.5",
) -> Path:
    """Write a tiny random Qwen3.5 checkpoint into folder `path`, in the exact format of a real Hub snapshot.

    Files: config.json, generation_config.json, the weights (`model-0000i-of-0000n.safetensors` +
    `model.safetensors.index.json` for sharded layouts, else `model.safetensors`), tokenizer.json,
    tokenizer_config.json, preprocessor_config.json. `dtype` is the on-disk dtype: "float32", "bfloat16" or "float16".
    `expert_form` (MoE layouts): "fused" or "per_expert" expert tensors (default: the layout's, MOE_EXPERT_FORMS).
    `family`: "qwen3.5", or "qwen3.6" / "qwen3.8" for that release's chat template (in `chat_template.jinja`).
    Deterministic: the same arguments give byte-identical files on every machine.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {list(_DTYPES)}")
    if family not in FAMILIES:
        raise ValueError(f"unknown checkpoint family {family!r}; choose one of {list(FAMILIES)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("model*.safetensors*"):
        stale.unlink()
    _write_json(path / "config.json", tiny_full_config(layout, dtype))
    _write_json(path / "generation_config.json", _generation_config())

    sd = tiny_state_dict(layout, seed, expert_form)
    n_shards = _SHARDS[layout]
    if n_shards == 1:
        write_safetensors(path / "model.safetensors", sd, dtype)
    else:
        # Split the sorted names into n contiguous groups of about equal byte size.
        names = sorted(sd)
        itemsize = 4 if dtype == "float32" else 2
        sizes = [sd[n].size * itemsize for n in names]
        total = sum(sizes)
        groups: list[list[str]] = [[] for _ in range(n_shards)]
        acc = 0
        for name, size in zip(names, sizes):
            shard = min(int(acc * n_shards / total), n_shards - 1)
            groups[shard].append(name)
            acc += size
        weight_map = {}
        for i, group in enumerate(groups):
            file = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
            write_safetensors(path / file, {n: sd[n] for n in group}, dtype)
            weight_map.update({n: file for n in group})
        index = {
            "metadata": {"total_parameters": int(sum(sd[n].size for n in names)), "total_size": total},
            "weight_map": dict(sorted(weight_map.items())),
        }
        _write_json(path / "model.safetensors.index.json", index)
    build_tiny_tokenizer(path, CHAT_TEMPLATES.get(family))
    _write_json(path / "preprocessor_config.json", PREPROCESSOR_CONFIG)
    return path
