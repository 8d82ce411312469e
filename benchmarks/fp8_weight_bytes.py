"""Bytes of one batch-1 decode step and of the export's weights, bf16 against FP8 weights (docs/fp8.md), computed
from the tensor shapes of each size's config (checkpoint/convert.expected_shapes) and the FP8 rule of Qwen's releases
(checkpoint/quantize.is_quantized): not counted from a lowered graph (benchmarks/neuron_bytes_per_step.py does that
for bf16 and needs the `neuron` environment, which this count does not).

    python benchmarks/fp8_weight_bytes.py

Per step, summed over the ranks: every weight read once, except the embedding (one row) and the routed experts (the
`num_experts_per_tok` selected ones; a batch-1 step reads only those, the gather placed before the dequantization);
float8 weights at 1 byte plus their float32 scales in the sharded form (checkpoint/fp8_shard.py: 4 bytes per 128
weights); the held state the step touches (4096-token bf16 KV cache read, DeltaNet conv and fp32 recurrent states
read and written), the same in both. Export size: every text weight, the MTP head included, the vision tower not.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from optimum_qwen35.checkpoint.convert import expected_shapes, mtp_shapes  # noqa: E402
from optimum_qwen35.checkpoint.quantize import is_quantized  # noqa: E402
from optimum_qwen35.config import Qwen35Config  # noqa: E402

REAL_CONFIG = ROOT / "tests" / "qwen3.5-0.8b.config.json"
# The dense sizes as benchmarks/neuron_real_shapes.py builds them (its SIZES: the 0.8B's real config with the
# table's fields changed); the 35B-A3B is its real config file.
DENSE = {
    "2B": {"hidden_size": 2048, "intermediate_size": 6144},
    "27B": {"hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4,
            "intermediate_size": 17408, "linear_num_value_heads": 48, "tie_word_embeddings": False},
}
CONTEXT = 4096


def config_of(size: str) -> Qwen35Config:
    if size == "35B-A3B":
        return Qwen35Config.from_dict(json.loads((ROOT / "tests" / "qwen3.5-35b-a3b.config.json").read_text()))
    config = json.loads(REAL_CONFIG.read_text())
    text = config["text_config"]
    text.update(DENSE[size])
    config["tie_word_embeddings"] = text["tie_word_embeddings"]
    text["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(text["num_hidden_layers"])]
    return Qwen35Config.from_dict(config)


def weight_bytes(shape: tuple[int, ...], fp8: bool) -> int:
    n = math.prod(shape)
    return n + 4 * math.ceil(n / 128) if fp8 else 2 * n


def state_bytes(c: Qwen35Config) -> int:
    attention = len(c.attention_layers) * 2 * c.num_key_value_heads * c.head_dim * CONTEXT * 2  # K and V, read
    recurrent = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    conv = c.linear_conv_dim * (c.linear_conv_kernel_dim - 1) * 2
    return attention + len(c.linear_layers) * 2 * (recurrent + conv)  # read and written


def step_and_export(size: str, fp8: bool, lm_head_fp8: bool = False) -> tuple[int, int]:
    """(decode-step bytes, export bytes); `lm_head_fp8`: the lm_head (the tied table for tied sizes) in FP8 too, beyond
    Qwen's rule (which keeps it bf16)."""
    c = config_of(size)
    step = export = 0
    shapes = dict(expected_shapes(c))
    shapes.update({f"mtp.{n}": s for n, s in mtp_shapes(c).items()})
    for name, shape in shapes.items():
        key = name if name.startswith(("mtp.", "lm_head")) else "model.language_model." + name
        head = lm_head_fp8 and (name == "lm_head.weight" or (name == "embed_tokens.weight" and c.tie_word_embeddings))
        nbytes = weight_bytes(shape, fp8 and (is_quantized(key, len(shape)) or head))
        export += nbytes
        if name.startswith("mtp."):
            continue
        if name == "embed_tokens.weight":
            nbytes //= shape[0]
        elif ".mlp.experts." in name:
            nbytes = nbytes * c.num_experts_per_tok // c.num_experts
        step += nbytes
    if c.tie_word_embeddings:
        step += weight_bytes(shapes["embed_tokens.weight"], lm_head_fp8)  # the lm_head reads the whole table
    return step + state_bytes(c), export


def main() -> None:
    print("| size | decode step, bf16 | FP8 (Qwen's rule) | ratio | FP8 + lm_head | ratio | export bf16 | FP8 | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for size in ("2B", "27B", "35B-A3B"):
        (s16, e16), (s8, e8), (sh, _) = (step_and_export(size, False), step_and_export(size, True),
                                         step_and_export(size, True, lm_head_fp8=True))
        gb = 1e9
        print(f"| {size} | {s16 / gb:.2f} GB | {s8 / gb:.2f} GB | {s8 / s16:.3f} | {sh / gb:.2f} GB | {sh / s16:.3f} "
              f"| {e16 / gb:.1f} GB | {e8 / gb:.1f} GB | {e8 / e16:.3f} |")


if __name__ == "__main__":
    main()
