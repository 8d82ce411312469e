"""Per-rank weight and state bytes of Qwen3.5-35B-A3B, from its published config, for each valid TP degree and both
ways of splitting the experts.

    python benchmarks/moe_memory.py [--config tests/qwen3.5-35b-a3b.config.json] [--max-length 8192]

The shard shapes come from the package's own sharding (`checkpoint.shard.sharded_shapes`, on the meta device: no
weight is made), so the bytes are those an export writes per rank: bf16 weights, the fp32 ones of the precision
policy (DeltaNet gates, the MoE router), zero padding included. Per sequence: the DeltaNet states (fp32 recurrent,
bf16 conv) and the bf16 KV cache of `--max-length` positions, per rank (`Qwen35Decoder.state_specs`). Vision tower
and MTP head not counted. Run by hand; prints a markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from optimum_qwen35.checkpoint.convert import stored_dtype
from optimum_qwen35.checkpoint.shard import sharded_shapes
from optimum_qwen35.config import Qwen35Config
from optimum_qwen35.modeling.decoder import Qwen35Decoder
from optimum_qwen35.modeling.parallel import TorchLayers

CONFIG = Path(__file__).parents[1] / "tests" / "qwen3.5-35b-a3b.config.json"
GIB = 1024**3


def weight_bytes(config: Qwen35Config, t: int) -> int:
    total = 0
    for name, shape in sharded_shapes(config, t).items():
        total += torch.Size(shape).numel() * stored_dtype(name, torch.bfloat16).itemsize
    return total


def state_bytes(config: Qwen35Config, t: int, max_length: int) -> int:
    with torch.device("meta"):
        decoder = Qwen35Decoder(config, t, TorchLayers(t) if t == 1 else _Layers(t)).to(torch.bfloat16)
    return sum(torch.Size(s.shape).numel() * s.dtype.itemsize for s in decoder.state_specs(1, max_length))


class _Layers(TorchLayers):
    """Builds a rank's modules without torch.distributed (only shapes are needed)."""

    def __init__(self, t: int):
        self.tp_degree, self.rank, self.group_name, self.kernel_backend = t, 0, "unused", None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(CONFIG))
    parser.add_argument("--max-length", type=int, default=8192)
    args = parser.parse_args(argv)
    base = Qwen35Config.from_pretrained(args.config)
    print(f"| TP degree | experts | weights per rank (GiB) | state per sequence per rank at {args.max_length} (MiB) |")
    print("|---|---|---|---|")
    for t in base.valid_tp_degrees():
        for mode in ("tp", "ep") if t > 1 else ("tp",):
            config = dataclasses.replace(base, moe_parallel=mode)
            label = "-" if t == 1 else ("inside experts" if mode == "tp" else "whole experts")
            auto = " (auto)" if t > 1 and base.expert_parallel_mode(t) == mode else ""
            print(f"| {t} | {label}{auto} | {weight_bytes(config, t) / GIB:.2f} | "
                  f"{state_bytes(config, t, args.max_length) / 2**20:.1f} |")


if __name__ == "__main__":
    main()
