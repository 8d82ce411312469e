"""An export made with mtp=True from a fixture checkpoint with the export code itself, without optimum-neuron: the
per-rank weights (`save_sharded`), the multi-token-prediction head's (`save_mtp_weights`) and the graphs
(`compile_graphs(..., mtp=True)`: `torch.export` programs on the cpu backend, the graph list on the torchneuron one), as
`Qwen35NeuronModelForCausalLM.export(..., mtp=True)` writes them (export/cpu.py `export_cpu`)."""

from __future__ import annotations

from pathlib import Path

import torch

from optimum_qwen35.checkpoint.sharded_files import save_mtp_weights, save_sharded
from optimum_qwen35.config import Qwen35Config
from optimum_qwen35.export.compile import compile_graphs
from optimum_qwen35.export.layout import CHECKPOINT_DIR, COMPILED_DIR, CPU_BACKEND


def mtp_export(source: Path, out: Path, dtype: torch.dtype = torch.float32, batch_size: int = 2, max_length: int = 128,
               buckets=(128,), backend: str = CPU_BACKEND, tp_degree: int = 1) -> Path:
    config = Qwen35Config.from_pretrained(source)
    save_sharded(source, config, tp_degree, out / CHECKPOINT_DIR, dtype, progress=False)
    save_mtp_weights(source, config, dtype, out / CHECKPOINT_DIR, tp_degree)
    compile_graphs(config, tp_degree, batch_size, max_length, list(buckets), dtype, out / COMPILED_DIR, progress=False,
                   backend=backend, mtp=True)
    return out
