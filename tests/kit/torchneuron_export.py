"""A TorchNeuron export folder made from a fixture checkpoint with the export code itself, without optimum-neuron:
the per-rank weights (`save_sharded`), the vision tower's weights and the graph list (`compile_graphs(backend=
"torchneuron")`), as `Qwen35NeuronModelForCausalLM.export` writes them for a trn2 export without the SDK."""

from __future__ import annotations

from pathlib import Path

import torch

from optimum_qwen35.checkpoint.sharded_files import save_sharded
from optimum_qwen35.config import Qwen35Config
from optimum_qwen35.export.compile import compile_graphs, save_vision_weights
from optimum_qwen35.export.layout import CHECKPOINT_DIR, COMPILED_DIR, TORCHNEURON_BACKEND
from optimum_qwen35.modeling.vision import VisionConfig


def torchneuron_export(source: Path, out: Path, tp_degree: int = 1, batch_size: int = 2, max_length: int = 128,
                       dtype: torch.dtype = torch.float32, buckets=(64, 128), vision: bool = False,
                       image_buckets=(32, 128), prefix_block_size: int | None = None) -> Path:
    config = Qwen35Config.from_pretrained(source)
    save_sharded(source, config, tp_degree, out / CHECKPOINT_DIR, dtype, progress=False)
    tower = None
    if vision:
        tower = VisionConfig.from_dict(config.raw)
        save_vision_weights(source, tower, dtype, out / CHECKPOINT_DIR)
    compile_graphs(config, tp_degree, batch_size, max_length, list(buckets), dtype, out / COMPILED_DIR, progress=False,
                   vision=tower, image_buckets=list(image_buckets) if vision else None,
                   prefix_block_size=prefix_block_size, backend=TORCHNEURON_BACKEND)
    return out
