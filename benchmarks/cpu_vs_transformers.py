"""Benchmark: this package's CPU graphs against transformers' Qwen3.5, side by side in one run.

    python benchmarks/cpu_vs_transformers.py [--prompt 512] [--decode 64] [--dtype float32]

Needs transformers >= 5 (the `reference` nox environment). Builds a random Qwen3.5 with transformers
(hidden 1024, 8 layers in the 3:1 pattern, vocab 32k: about 200M parameters, printed), saves it in the real
on-disk format, loads it in both implementations and measures, batch 1:
prefill throughput (one prompt of --prompt tokens) and greedy decode throughput (--decode tokens after it),
plus the agreement of the generated tokens. Prints absolute numbers and ratios; asserts nothing.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch


def build(folder: str) -> None:
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = dict(
        vocab_size=32000, hidden_size=1024, intermediate_size=3584, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                             mrope_section=[11, 11, 10], mrope_interleaved=True),
    )
    vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=1024)
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True))
    model.save_pretrained(folder)


def timed(fn, repeat=1):
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)

    from transformers import Qwen3_5ForConditionalGeneration

    from optimum_qwen35.runtime.cpu import Qwen35ForCausalLM

    with tempfile.TemporaryDirectory() as folder:
        build(folder)
        hf = Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=dtype).eval()
        ours = Qwen35ForCausalLM.from_pretrained(
            folder, batch_size=1, max_length=args.prompt + args.decode, dtype=dtype, buckets=[args.prompt]
        )
    prompt = torch.randint(0, 32000, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, batch 1, "
          f"~{sum(p.numel() for p in ours.decoder.parameters()) / 1e6:.0f}M parameters")

    with torch.no_grad():
        hf_prefill, _ = timed(lambda: hf(input_ids=prompt, use_cache=False, logits_to_keep=1), repeat=2)
        our_prefill, _ = timed(lambda: ours.prefill([prompt[0].tolist()], [0]), repeat=2)
        hf_total, hf_out = timed(
            lambda: hf.generate(prompt, max_new_tokens=args.decode, min_new_tokens=args.decode, do_sample=False)
        )
        our_total, our_out = timed(lambda: ours.generate([prompt[0].tolist()], max_new_tokens=args.decode))
    hf_tokens = hf_out[0, args.prompt :].tolist()
    # generate = one prefill + (decode - 1) steps: subtract the measured prefill to get the decode rate.
    hf_decode = (args.decode - 1) / max(hf_total - hf_prefill, 1e-9)
    our_decode = (args.decode - 1) / max(our_total - our_prefill, 1e-9)
    same = next((i for i, (a, b) in enumerate(zip(hf_tokens, our_out[0])) if a != b), len(hf_tokens))

    print(f"{'':12s}{'transformers':>14s}{'optimum-qwen35':>16s}{'ratio':>8s}")
    print(f"{'prefill':12s}{args.prompt / hf_prefill:11.0f} t/s{args.prompt / our_prefill:13.0f} t/s"
          f"{hf_prefill / our_prefill:7.2f}x")
    print(f"{'decode':12s}{hf_decode:11.1f} t/s{our_decode:13.1f} t/s{our_decode / hf_decode:7.2f}x")
    print(f"greedy tokens equal for the first {same} of {args.decode}")


if __name__ == "__main__":
    main()
