"""Per-rank weight and state bytes of the Qwen3.5 MoE models for each valid TP degree and both ways of splitting the
experts, and whether they fit a trn2.3xlarge and a trn2.48xlarge.

    python benchmarks/moe_memory.py [--configs tests/qwen3.5-35b-a3b.config.json ...] [--max-length 8192]

Configs: Qwen3.5-35B-A3B's published one, and the 122B-A10B and 397B-A17B shapes as third-party sources give
them (tests/qwen3.5-{122b-a10b,397b-a17b}.config.json, not the published files: see their `_comment`).

The shard shapes come from the package's own sharding (`checkpoint.shard.sharded_shapes`, on the meta device: no
weight is made), so the bytes are those an export writes per rank: bf16 weights, the fp32 ones of the precision
policy (DeltaNet gates, the MoE router), zero padding included. Per sequence: the DeltaNet states (fp32 recurrent,
bf16 conv) and the bf16 KV cache of `--max-length` positions, per rank (`Qwen35Decoder.state_specs`). Vision tower
and MTP head not counted. Run by hand; prints markdown tables.

The instances, at LNC=2 (two physical NeuronCores per logical core): a trn2.3xlarge is one Trainium2 chip, 96 GiB of
HBM, 4 logical cores of 24 GiB; a trn2.48xlarge is 16 chips, 1.5 TiB, 64 logical cores of 24 GiB. One rank runs on
one logical core. The package's degree is capped by the heads (16 attention or DeltaNet key heads: degree 16),
so on a trn2.48xlarge it uses 16 of the 64 cores (4 replicas to use them all); the "grid" line gives, as
arithmetic only, what a core would hold if the experts were split over all 64 cores and the rest at degree 16
(an expert-parallel x tensor-parallel grid, which this package does not build).
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
from optimum_qwen35.modeling.torch_layers import TorchLayers

TESTS = Path(__file__).parents[1] / "tests"
CONFIGS = [TESTS / f"qwen3.5-{size}.config.json" for size in ("35b-a3b", "122b-a10b", "397b-a17b")]
GIB = 1024**3
CORE_HBM = 24 * GIB  # one logical core at LNC=2: 96 GiB / 4 per Trainium2 chip
INSTANCES = {"trn2.3xlarge": 4, "trn2.48xlarge": 64}  # logical cores at LNC=2


def weight_bytes(config: Qwen35Config, t: int, experts: bool | None = None) -> int:
    """Bytes of one rank's bf16 shards (only the routed experts' with experts=True, all but them with False)."""
    total = 0
    for name, shape in sharded_shapes(config, t).items():
        if experts is None or experts == (".mlp.experts." in name):
            total += torch.Size(shape).numel() * stored_dtype(name, torch.bfloat16).itemsize
    return total


def parameters(config: Qwen35Config) -> tuple[float, float]:
    """(total, active per token) text-model parameters: all of them, and all but the unchosen routed experts."""
    routed = weight_bytes(config, 1, experts=True) // 2
    rest = sum(torch.Size(s).numel() for n, s in sharded_shapes(config, 1).items() if ".mlp.experts." not in n)
    return routed + rest, routed * config.num_experts_per_tok / config.num_experts + rest


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
    parser.add_argument("--configs", nargs="+", default=[str(c) for c in CONFIGS])
    parser.add_argument("--max-length", type=int, default=8192)
    args = parser.parse_args(argv)
    for path in args.configs:
        base = Qwen35Config.from_pretrained(path)
        total, active = parameters(base)
        print(f"\n{Path(path).name}: {total / 1e9:.1f}B text-model parameters, {active / 1e9:.1f}B active per token "
              f"({base.num_experts} experts, top-{base.num_experts_per_tok})\n")
        print(f"| TP degree | experts | weights per rank (GiB) | state per sequence per rank at {args.max_length} (MiB) |")
        print("|---|---|---|---|")
        per_rank = {}
        for t in base.valid_tp_degrees():
            for mode in ("tp", "ep") if t > 1 else ("tp",):
                config = dataclasses.replace(base, moe_parallel=mode)
                label = "-" if t == 1 else ("inside experts" if mode == "tp" else "whole experts")
                auto = base.expert_parallel_mode(t) == mode
                weights = weight_bytes(config, t)
                per_rank[t] = weights if auto else per_rank.get(t, weights)
                print(f"| {t} | {label}{' (auto)' if t > 1 and auto else ''} | {weights / GIB:.2f} | "
                      f"{state_bytes(config, t, args.max_length) / 2**20:.1f} |")
        print()
        for instance, cores in INSTANCES.items():
            t = max(d for d in base.valid_tp_degrees() if d <= cores)
            left = CORE_HBM - per_rank[t]
            verdict = f"fits, {left / GIB:.1f} GiB a core left" if left > 0 else f"does not fit ({-left / GIB:.1f} GiB over)"
            print(f"- {instance} ({cores} cores of 24 GiB): degree {t}, {per_rank[t] / GIB:.2f} GiB of weights a rank: {verdict}")
        t = max(base.valid_tp_degrees())
        grid = weight_bytes(base, t, experts=False) + weight_bytes(base, 1, experts=True) / INSTANCES["trn2.48xlarge"]
        print(f"- trn2.48xlarge grid (arithmetic, not built): routed experts over 64 cores, the rest at degree {t}: "
              f"{grid / GIB:.2f} GiB a core ({(CORE_HBM - grid) / GIB:.1f} GiB left)")


if __name__ == "__main__":
    main()
