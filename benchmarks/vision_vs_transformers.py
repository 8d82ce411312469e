"""Benchmark: an image prompt's time to first token, this package's CPU graphs against transformers eager.

    python benchmarks/vision_vs_transformers.py [--sizes 256 448 512] [--dtypes float32 bfloat16] [--repeat 2]
        [--threads N]

Needs transformers >= 5 (the `reference` nox environment). Builds a random Qwen3.5 with transformers: the text
decoder of `cpu_vs_transformers.py` (hidden 1024, 8 layers, vocab 32k) and the vision tower of Qwen3.5-0.8B's
config (depth 12, hidden 768, 12 heads, merger to 1024: about 90M parameters), saves it in the real on-disk format
and loads it in both implementations. For each square image size (pixels; 16-pixel patches), the same random
patches and a prompt of 16 text tokens + the image + 16 text tokens go through both sides' greedy generation of
one token (TTFT: vision tower, prefill, argmax), best of --repeat, the sides alternating. Ours runs the image in
the smallest image bucket that holds it (buckets 256, 1024, 4096 patches), the prompt in the smallest context bucket
of 256, 512, 1024, 2048 tokens, its linears not prepacked (the configuration of the numbers in docs/vision.md). Also prints, for the vision tower
alone: its weights' size, the time to `torch.export` its graph per bucket (what a cpu export would add), and the
time of one call per bucket. Asserts nothing; the first tokens of both sides are compared.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cpu_vs_transformers import TEXT_0_8B_8_LAYERS, VOCAB  # noqa: E402  (a sibling script)
VISION_0_8B = dict(depth=12, hidden_size=768, intermediate_size=3072, num_heads=12, num_position_embeddings=2304,
                   out_hidden_size=1024, patch_size=16, spatial_merge_size=2, temporal_patch_size=2)


def build(folder: str) -> None:
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = TEXT_0_8B_8_LAYERS
    torch.manual_seed(0)
    config = Qwen3_5Config(text_config=text, vision_config=VISION_0_8B, tie_word_embeddings=True,
                           image_token_id=VOCAB - 4, vision_start_token_id=VOCAB - 3, vision_end_token_id=VOCAB - 2,
                           video_token_id=VOCAB - 1)
    Qwen3_5ForConditionalGeneration(config).save_pretrained(folder)


def best(fn, repeat):
    times, out = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 448, 512])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--image-buckets", type=int, nargs="+", default=None,
                        help="image buckets of ours (patch rows; default the runtime's); the smallest run: --sizes 64 "
                             "--dtypes float32 --repeat 1 --image-buckets 256")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import Qwen3_5ForConditionalGeneration

    from optimum_qwen35.modeling.vision import image_bucket_inputs
    from optimum_qwen35.runtime import Qwen35Runtime

    with tempfile.TemporaryDirectory() as folder:
        build(folder)
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            hf = Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=dtype).eval()
            ours = Qwen35Runtime.from_pretrained(folder, max_length=2048, dtype=dtype, buckets=[256, 512, 1024, 2048],
                                                    pack_weights=False, vision=True,
                                                 image_buckets=args.image_buckets)
            v = ours.vision_config
            tower = ours.graphs.vision_encoder  # the eager runtime's vision tower module (runtime/eager.py)
            size = sum(p.numel() * p.element_size() for p in tower.parameters())
            print(f"\n{dtype_name}: vision tower weights {size / 2**20:.0f} MiB, threads {torch.get_num_threads()}")
            for bucket in ours.images.image_buckets:
                side = int(bucket**0.5)
                inputs = image_bucket_inputs(v, torch.zeros(bucket, v.patch_dim), (1, side, side), bucket)
                start = time.perf_counter()
                torch.export.export(tower, inputs)
                exported = time.perf_counter() - start
                with torch.no_grad():
                    call, _ = best(lambda: tower(*inputs), args.repeat)
                print(f"  image bucket {bucket:5d} patches: torch.export {exported:.1f} s, one call {call * 1e3:.0f} ms")
            print(f"  {'image':>9} {'tokens':>7} {'TTFT ours (ms)':>15} {'TTFT transformers (ms)':>23} {'ratio':>6} first token equal")
            for pixels in args.sizes:
                grid = pixels // 16
                grid -= grid % 2
                thw = torch.tensor([[1, grid, grid]])
                patches = torch.randn(grid * grid, v.patch_dim, generator=torch.Generator().manual_seed(0))
                text = torch.randint(0, VOCAB - 8, (32,), generator=torch.Generator().manual_seed(1)).tolist()
                prompt = text[:16] + [v.vision_start_token_id] + [v.image_token_id] * (grid * grid // 4) + [VOCAB - 2] + text[16:]
                ids = torch.tensor([prompt])
                mm = (ids == v.image_token_id).int()
                with torch.no_grad():
                    t_hf, out_hf = best(lambda: hf.generate(input_ids=ids, pixel_values=patches, image_grid_thw=thw,
                                                           mm_token_type_ids=mm, max_new_tokens=1, do_sample=False), args.repeat)
                t_ours, out_ours = best(lambda: ours.generate([prompt], 1, eos_token_id=[], pixel_values=patches, image_grid_thw=thw), args.repeat)
                equal = out_hf[0, -1].item() == out_ours[0][0]
                print(f"  {pixels:>4}x{pixels:<4} {len(prompt):>7} {t_ours * 1e3:>15.0f} {t_hf * 1e3:>23.0f} "
                      f"{t_hf / t_ours:>5.2f}x {equal}")


if __name__ == "__main__":
    main()
