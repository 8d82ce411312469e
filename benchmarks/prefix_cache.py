"""Benchmark: time to first token with and without a prefix-cache hit, side by side in one run; the memory a cached
block takes per model size; the projected TTFT on trn2 (a projection, not a measurement).

    OMP_NUM_THREADS=1 .nox/reference/bin/python benchmarks/prefix_cache.py [--prefix 2048] [--suffix 64]
        [--block 256] [--repeat 3] [--layers LLLF] [--vocab 32000] [--dtype float32]

Needs transformers >= 5 (the `reference` nox environment) to build the random model: Qwen3.5-0.8B's widths
(benchmarks/cpu_vs_transformers.py `build`: hidden 1024, 16 DeltaNet heads of 128, 8 attention heads of 256, MLP
3584) with `--layers` (default LLLF: 3 DeltaNet + 1 attention, the 0.8B's pattern) and a 32k vocabulary, random
weights. One thread (torch.set_num_threads(1)), one slot; per run, alternating, each timed by the process's CPU time
(and the wall clock beside it):

- `no cache`: `prefill` of prefix + suffix as the runtime does without a cache (one call in the bucket covering it);
- `cache, cold`: the same prompt with an empty cache (block-aligned pieces, a snapshot after each full block);
- `cache, hit`: the cache first holds a prompt with the same prefix and another suffix (not timed); then the prompt.

TTFT here is the prefill and the argmax of its logits. The three greedy first tokens are compared (they must agree).
Asserts nothing else.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_vs_transformers import build  # noqa: E402 (a sibling script)

from optimum_qwen35.config import Qwen35Config  # noqa: E402
from optimum_qwen35.modeling.decoder import Qwen35Decoder  # noqa: E402
from optimum_qwen35.modeling.parallel import ShardedDims  # noqa: E402
from optimum_qwen35.runtime import Qwen35Runtime  # noqa: E402
from optimum_qwen35.runtime.prefix_cache import PrefixCache, block_bytes_per_layer, snapshot_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
REAL_CONFIG = ROOT / "tests" / "qwen3.5-0.8b.config.json"
MOE_CONFIG = ROOT / "tests" / "qwen3.5-35b-a3b.config.json"
# The dense sizes as benchmarks/neuron_real_shapes.py SIZES gives them (the 0.8B's config file with these fields
# changed; the same assumptions: 3:1 layer pattern, head_dim 256, DeltaNet heads of 128, conv kernel 4).
SIZES = {
    "0.8B": {},
    "2B": {"hidden_size": 2048, "intermediate_size": 6144},
    "9B": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
           "intermediate_size": 12288, "linear_num_value_heads": 32, "tie_word_embeddings": False},
    "27B": {"hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4,
            "intermediate_size": 17408, "linear_num_value_heads": 48, "tie_word_embeddings": False},
}
TP = {"0.8B": 1, "2B": 4, "9B": 4, "27B": 8, "35B-A3B": 8}  # the projection's degrees (natural ones on trn2)
# trn2 at LNC 2, per logical core (benchmarks/neuron_real_shapes.py TRN2, sources there): (optimistic, pessimistic).
TRN2_TFLOPS = (667 / 4, 2 * 79)
TRN2_HBM_GBS = (3000 / 4, 2900 / 4)
# Assumed, no source: host -> device copy of a restored prefix (the cache in host memory), per rank.
HOST_TO_DEVICE_GBS = (25.0, 8.0)


def size_config(name: str) -> Qwen35Config:
    if name == "35B-A3B":
        return Qwen35Config.from_dict(json.loads(MOE_CONFIG.read_text()))
    config = json.loads(REAL_CONFIG.read_text())
    text = config["text_config"]
    text.update(SIZES[name])
    n = text["num_hidden_layers"]
    text["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    config["tie_word_embeddings"] = text.get("tie_word_embeddings", True)
    return Qwen35Config.from_dict(config)


def fmt(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def memory_table(block: int, prefix: int) -> list[str]:
    lines = [f"Memory of one cached block of {block} tokens, bf16 model (KV bf16, conv state bf16, recurrent state fp32), "
             "whole model (TP 1):",
             "| size | attention layer (K+V of the block) | DeltaNet layer (conv + recurrent) | layers (attn / DeltaNet) | "
             f"per block | a {prefix}-token prefix |",
             "|---|---|---|---|---|---|"]
    for name in (*SIZES, "35B-A3B"):
        config = size_config(name)
        per = block_bytes_per_layer(config, block, 2)
        n_attn = sum(t == "full_attention" for t in config.layer_types)
        total = snapshot_bytes(config, block, 2)
        lines.append(f"| {name} | {fmt(per['attention'])} | {fmt(per['deltanet'])} ({fmt(per['deltanet_conv'])} + "
                     f"{fmt(per['deltanet_recurrent'])}) | {n_attn} / {len(config.layer_types) - n_attn} | {fmt(total)} | "
                     f"{fmt(total * (prefix // block))} |")
    return lines


def rank_params(config: Qwen35Config, tp: int) -> tuple[int, int, int]:
    """(matmul parameters a token goes through per rank, lm_head parameters per rank, weight bytes per rank in bf16):
    the whole model's divided by the degree (what TP splits; the small replicated norms counted split too)."""
    with torch.device("meta"):
        decoder = Qwen35Decoder(config, 1)
    lm = decoder.lm_head.weight.numel()
    total = sum(p.numel() for n, p in decoder.named_parameters() if not n.startswith("embed_tokens"))
    if config.is_moe:  # a token goes through its top-k routed experts of the stack's experts, all of them read
        experts = sum(p.numel() for n, p in decoder.named_parameters() if ".experts." in n)
        active = total - experts + experts * config.num_experts_per_tok // config.num_experts
    else:
        active = total
    return active // tp, lm // tp, 2 * total // tp  # every weight is read once (all experts, at one row: several tokens per expert)


def prefill_ms(config: Qwen35Config, tp: int, tokens: int, past: int, bound: int) -> float:
    """Projected context encoding of `tokens` tokens after `past` cached ones, per rank: matmul FLOPs at the peak
    rate or the weights streamed once, whichever is longer (collectives left out)."""
    active, lm, weights = rank_params(config, tp)
    d = ShardedDims.from_config(config, tp)
    n_attn = sum(t == "full_attention" for t in config.layer_types)
    dense = 2 * (active - lm) * tokens + 2 * lm
    attention = n_attn * 4 * tokens * (past + tokens / 2) * d.num_heads * config.head_dim
    deltanet = (len(config.layer_types) - n_attn) * d.linear_num_value_heads * -(-tokens // 64) * (
        8 * 64 * config.linear_key_head_dim * config.linear_value_head_dim
        + 4 * 64 * 64 * (config.linear_key_head_dim + config.linear_value_head_dim))
    compute = (dense + attention + deltanet) / (TRN2_TFLOPS[bound] * 1e12)
    stream = weights / (TRN2_HBM_GBS[bound] * 1e9)
    return 1e3 * max(compute, stream)


def projection(prefix: int, suffix: int, block: int) -> list[str]:
    lines = [f"PROJECTION (not measured; no Neuron device here): TTFT of a {prefix}+{suffix}-token prompt on trn2 (LNC 2), "
             "bf16, one row, per rank at the TP degree given; optimistic .. pessimistic ends. Assumptions: context "
             f"encoding at the peak TensorE rate ({TRN2_TFLOPS[1]:.0f}-{TRN2_TFLOPS[0]:.0f} TFLOPS per logical core) or "
             f"weight streaming at HBM bandwidth ({TRN2_HBM_GBS[1]:.0f}-{TRN2_HBM_GBS[0]:.0f} GB/s per core), whichever "
             "is longer; collectives, kernel launch and host overheads left out (they add the same few ms to both); "
             "a hit restores the prefix's snapshot from host memory at an assumed "
             f"{HOST_TO_DEVICE_GBS[1]:.0f}-{HOST_TO_DEVICE_GBS[0]:.0f} GB/s per rank (no source) and encodes the suffix. "
             "It also assumes Neuron context graphs that continue a sequence (not built: docs/prefix_caching.md).",
             "| size | TP | cold TTFT | restore from host (bytes per rank) | hit TTFT | ratio | hit TTFT, snapshot kept in "
             "device HBM (an HBM-to-HBM copy) | ratio |", "|---|---|---|---|---|---|---|---|"]
    for name in ("2B", "27B"):
        config, tp = size_config(name), TP[name]
        restore_bytes = snapshot_bytes(config, block, 2, tp) * (prefix // block)
        cold = [prefill_ms(config, tp, prefix + suffix, 0, b) for b in (0, 1)]
        copy = [1e3 * restore_bytes / (HOST_TO_DEVICE_GBS[b] * 1e9) for b in (0, 1)]
        hit = [prefill_ms(config, tp, suffix, prefix, b) + copy[b] for b in (0, 1)]
        device = [prefill_ms(config, tp, suffix, prefix, b) + 2e3 * restore_bytes / (TRN2_HBM_GBS[b] * 1e9) for b in (0, 1)]
        lines.append(f"| {name} | {tp} | {cold[0]:.1f} - {cold[1]:.1f} ms | {copy[0]:.2f} - {copy[1]:.2f} ms "
                     f"({fmt(restore_bytes)}) | {hit[0]:.2f} - {hit[1]:.2f} ms | {cold[0] / hit[0]:.1f}x - "
                     f"{cold[1] / hit[1]:.1f}x | {device[0]:.2f} - {device[1]:.2f} ms | {cold[0] / device[0]:.1f}x - "
                     f"{cold[1] / device[1]:.1f}x |")
    return lines


def timed(fn):
    cpu, wall = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - cpu, time.perf_counter() - wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix", type=int, default=2048)
    parser.add_argument("--suffix", type=int, default=64)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--layers", default="LLLF")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--memory-only", action="store_true", help="only the memory table and the projection")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("\n".join(memory_table(args.block, args.prefix)), "\n")
    print("\n".join(projection(args.prefix, args.suffix, args.block)), "\n")
    if args.memory_only:
        return
    with tempfile.TemporaryDirectory() as folder:
        build(folder, args.vocab, args.layers)
        max_length = args.prefix + 2 * args.suffix
        model = Qwen35Runtime.from_pretrained(folder, batch_size=1, max_length=max_length, dtype=args.dtype)
    g = random.Random(0)
    rows = {"no cache": [], "cache, cold": [], "cache, hit": []}
    for run in range(args.repeat):
        prefix = [g.randrange(args.vocab) for _ in range(args.prefix)]
        prompt = prefix + [g.randrange(args.vocab) for _ in range(args.suffix)]
        other = prefix + [g.randrange(args.vocab) for _ in range(args.suffix)]
        firsts = {}
        for name in rows:
            cache = None if name == "no cache" else PrefixCache(args.block, 2**34)
            model.set_prefix_cache(cache)
            if name == "cache, hit":
                model.prefill([other], [0])
            out, cpu, wall = timed(lambda: model.prefill([prompt], [0]).argmax(-1))
            assert model.last_prefix_hits == [args.prefix if name == "cache, hit" else 0]
            firsts[name] = int(out[0])
            rows[name].append((cpu, wall))
            if cache is not None:
                held = cache.nbytes
        print(f"run {run}: " + ", ".join(f"{n} {c:.2f} s cpu / {w:.2f} s wall" for n, ((c, w)) in ((n, r[-1]) for n, r in rows.items()))
              + f"; first tokens {'agree' if len(set(firsts.values())) == 1 else 'DIFFER: ' + str(firsts)}")
    print(f"\nMeasured (cpu target, {args.layers} layers of 0.8B widths, vocab {args.vocab}, {args.dtype}, 1 thread, "
          f"{args.repeat} runs, block {args.block}): TTFT of a {args.prefix}-token shared prefix + {args.suffix}-token "
          "suffix, median [min, max] process CPU seconds")
    base = statistics.median(c for c, _ in rows["no cache"])
    for name, runs in rows.items():
        cpus = [c for c, _ in runs]
        med = statistics.median(cpus)
        print(f"  {name:12s} {med:7.3f} s [{min(cpus):.3f}, {max(cpus):.3f}]  wall {statistics.median(w for _, w in runs):.3f} s"
              f"  speedup vs no cache {base / med:5.2f}x")
    hit = statistics.median(c for c, _ in rows["cache, hit"])
    cold = statistics.median(c for c, _ in rows["cache, cold"])
    print(f"  hit vs cache-on cold: {cold / hit:.2f}x; cache-on cold vs no cache: {cold / base:.3f}x the time")
    print(f"  bytes held after one cold prompt: {fmt(held)} ({args.prefix // args.block + (args.suffix >= args.block)} "
          f"blocks; model {len(args.layers)} layers)")


if __name__ == "__main__":
    main()
