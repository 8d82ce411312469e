"""Benchmark: this package's CPU graphs against transformers' Qwen3.5 (eager), side by side in one run.

    python benchmarks/cpu_vs_transformers.py [--prompt 512] [--decode 64] [--batches 1 4 8]
        [--dtypes float32 bfloat16] [--long 4096] [--repeat 2] [--threads N]

Needs transformers >= 5 (the `reference` nox environment). Builds a random Qwen3.5 with transformers (hidden
1024, 8 layers in the 3:1 pattern, vocab 32k: about 200M parameters), saves it in the real on-disk format and
loads it in both implementations, in each dtype. Then, for each batch size, the same random prompts (all of
--prompt tokens) go through both sides' greedy generation of --decode tokens (transformers: `generate`, with its
cache; ours: `Qwen35ForCausalLM.generate` with a static batch of that size, its linears prepacked for that batch size
as `from_pretrained` does), timed through each side's streamer:

- TTFT: from the call to the first new token of every row (prefill of the whole batch + its argmax);
- Throughput: new tokens per second after the first (batch x (decode - 1) / time from first to last token),

both by the wall clock and by the process's CPU time.

Each is the best of --repeat runs, the two sides alternating (the machine may be shared: only side-by-side
ratios mean much). The greedy
tokens of both sides are compared row by row. With --long, the same at batch 1 after a --long-token prompt, and
the peak RSS of a process during that prefill (each side in its own fresh process, the high-water mark reset
after loading; weights and each side's cache included: transformers' grows with the prompt, ours is allocated for
max_length = prompt + decode before the prefill; the output says how large each is). Prints tables in the format of the seed's
benchmark (Batch Size, TTFT (ms), Throughput (tok/s)) with ratios; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

VOCAB = 32000
# The decoder measured: 8 layers of Qwen3.5-0.8B's shapes (3 DeltaNet + 1 attention, twice), a 32k vocabulary.
TEXT_0_8B_8_LAYERS = dict(
    vocab_size=VOCAB, hidden_size=1024, intermediate_size=3584, num_hidden_layers=8, num_attention_heads=8,
    num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
    linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=True,
    rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                         mrope_section=[11, 11, 10], mrope_interleaved=True),
)


def build(folder: str) -> None:
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = TEXT_0_8B_8_LAYERS
    vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=1024)
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True))
    model.save_pretrained(folder)


def prompts_for(batch: int, length: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1))


def load_hf(folder, dtype):
    from transformers import Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=dtype).eval()


def load_ours(folder, dtype):
    from optimum_qwen35.runtime.cpu import load_decoder

    return load_decoder(folder, dtype)


def _now():
    """(wall clock, this process's CPU time)."""
    return time.perf_counter(), time.process_time()


class _Clock:
    """Times of the first and the last new token (streamer callbacks of both sides), wall and CPU."""

    def __init__(self):
        self.start, self.first, self.last = _now(), None, None

    def token(self):
        now = _now()
        self.first = self.first if self.first is not None else now
        self.last = now


def run_hf(hf, prompts, decode):
    from transformers.generation.streamers import BaseStreamer

    clock = _Clock()

    class Streamer(BaseStreamer):
        seen_prompt = False

        def put(self, value):
            if self.seen_prompt:
                clock.token()
            self.seen_prompt = True

        def end(self):
            pass

    clock.start = _now()
    out = hf.generate(
        prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=decode, min_new_tokens=decode,
        do_sample=False, streamer=Streamer(),
    )
    return clock, out[:, prompts.shape[1]:].tolist()


def run_ours(decoder, prompts, decode):
    from optimum_qwen35.runtime.cpu import Qwen35ForCausalLM

    B, T = prompts.shape
    # Packed as `Qwen35ForCausalLM.from_pretrained` packs (done before the clock starts, like transformers' load).
    model = Qwen35ForCausalLM(decoder, batch_size=B, max_length=T + decode, buckets=[T], pack_weights=True)
    clock = _Clock()
    clock.start = _now()
    out = model.generate(prompts.tolist(), max_new_tokens=decode, streamer=lambda step, tokens: clock.token())
    return clock, out


def measure(hf, ours, prompts, decode, repeat):
    """Both sides, `repeat` times, alternating (so that a change in the machine's load hits both alike): the best
    TTFT and the best decode throughput of each, and the tokens of their last runs."""
    inf = float("inf")
    best = {name: [[inf, inf], [inf, inf], None] for name in ("transformers", "ours")}  # [wall, cpu] each
    for _ in range(repeat):
        for name, run, model in (("transformers", run_hf, hf), ("ours", run_ours, ours)):
            with torch.no_grad():
                clock, tokens = run(model, prompts, decode)
            for i in (0, 1):
                best[name][0][i] = min(best[name][0][i], clock.first[i] - clock.start[i])
                best[name][1][i] = min(best[name][1][i], clock.last[i] - clock.first[i])
            best[name][2] = tokens
    B = prompts.shape[0]
    return [([ttft[i] for i in (0, 1)], [B * (decode - 1) / max(steps[i], 1e-9) for i in (0, 1)], tokens)
            for ttft, steps, tokens in best.values()]


def agreement(a, b):
    """Per row, how many leading greedy tokens agree."""
    return [next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), len(ra)) for ra, rb in zip(a, b)]


def table(title, rows):
    """Two tables: wall clock, then process CPU time (with --threads 1, the time on an unshared core: the
    fairer measure on a loaded machine, where a process gets a varying share of a core)."""
    for i, clock in enumerate(("wall clock", "process CPU time")):
        _table(f"{title} ({clock})", [(b, (h[0][i], h[1][i]), (o[0][i], o[1][i]), same, d) for b, h, o, same, d in rows])


def _table(title, rows):
    print(f"\n{title}")
    print(f"{'Batch Size':>10s}  {'TTFT (ms)':>30s}  {'Throughput (tok/s)':>30s}  equal greedy tokens")
    print(f"{'':>10s}  {'transformers':>12s} {'ours':>8s} {'ratio':>7s}  {'transformers':>12s} {'ours':>8s} {'ratio':>7s}")
    for b, (hf_ttft, hf_tps), (our_ttft, our_tps), same, decode in rows:
        print(f"{b:>10d}  {hf_ttft * 1e3:12.1f} {our_ttft * 1e3:8.1f} {hf_ttft / our_ttft:6.2f}x  "
              f"{hf_tps:12.2f} {our_tps:8.2f} {our_tps / hf_tps:6.2f}x  {min(same)}/{decode} (per row: {same})")


def peak_rss_child(args) -> None:
    """In a fresh process: load one side, reset the RSS high-water mark, prefill, print the peak (MiB)."""
    dtype = getattr(torch, args.dtypes[0])
    prompt = prompts_for(1, args.long)
    model = load_hf(args.model, dtype) if args.rss_child == "transformers" else load_ours(args.model, dtype)
    if args.rss_child == "ours":
        from optimum_qwen35.runtime.cpu import Qwen35ForCausalLM

        model = Qwen35ForCausalLM(model, batch_size=1, max_length=args.long + args.decode, buckets=[args.long],
                                  pack_weights=True)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM (Linux >= 4.0)
    with torch.no_grad():
        if args.rss_child == "transformers":
            cache = model(input_ids=prompt, use_cache=True, logits_to_keep=1).past_key_values
            # Its cache grows with the sequence: K/V of the prompt's positions, conv and recurrent states.
            held = [v for layer in cache.layers for a in vars(layer).values() for v in (a.values() if isinstance(a, dict) else [a])]
            state = [t for t in held if isinstance(t, torch.Tensor)]  # K/V tensors; conv/recurrent states in dicts
        else:
            model.prefill(prompt.tolist(), [0])
            state = model.state  # preallocated for max_length = prompt + decode
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    print(json.dumps({"peak_mib": int(status["VmHWM"].split()[0]) / 1024, "now_mib": int(status["VmRSS"].split()[0]) / 1024,
                      "state_mib": sum(t.numel() * t.element_size() for t in state) / 2**20}))


def peak_rss(folder, side, dtype, args) -> dict:
    cmd = [sys.executable, __file__, "--rss-child", side, "--model", folder, "--dtypes", dtype, "--long", str(args.long),
           "--decode", str(args.decode)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--long", type=int, default=0, help="also decode after a prompt of this many tokens (batch 1), with peak RSS")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--model", help="a folder holding the benchmark model (built there if empty)")
    parser.add_argument("--rss-child", choices=["transformers", "ours"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rss_child:
        return peak_rss_child(args)

    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model or tmp
        if not os.path.exists(os.path.join(folder, "config.json")):
            build(folder)
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; prompt {args.prompt}, decode {args.decode}, "
              f"best of {args.repeat}")
        for name in args.dtypes:
            dtype = getattr(torch, name)
            hf, ours = load_hf(folder, dtype), load_ours(folder, dtype)
            print(f"\n{name}: ~{sum(p.numel() for p in ours.parameters()) / 1e6:.0f}M parameters")
            rows = []
            for b in args.batches:
                prompts = prompts_for(b, args.prompt)
                (hf_ttft, hf_tps, hf_tokens), (our_ttft, our_tps, our_tokens) = measure(hf, ours, prompts, args.decode, args.repeat)
                rows.append((b, (hf_ttft, hf_tps), (our_ttft, our_tps), agreement(hf_tokens, our_tokens), args.decode))
                print(f"  batch {b} (wall / CPU): transformers {hf_ttft[0] * 1e3:.0f} / {hf_ttft[1] * 1e3:.0f} ms, "
                      f"{hf_tps[0]:.2f} / {hf_tps[1]:.2f} tok/s; ours {our_ttft[0] * 1e3:.0f} / {our_ttft[1] * 1e3:.0f} ms, "
                      f"{our_tps[0]:.2f} / {our_tps[1]:.2f} tok/s", flush=True)
            table(f"{name}, prompt {args.prompt} tokens, {args.decode} new tokens", rows)
            if args.long:
                prompts = prompts_for(1, args.long)
                (hf_ttft, hf_tps, hf_tokens), (our_ttft, our_tps, our_tokens) = measure(hf, ours, prompts, args.decode, args.repeat)
                table(f"{name}, prompt {args.long} tokens, {args.decode} new tokens",
                      [(1, (hf_ttft, hf_tps), (our_ttft, our_tps), agreement(hf_tokens, our_tokens), args.decode)])
            del hf, ours
            if args.long:
                hf_rss, our_rss = peak_rss(folder, "transformers", name, args), peak_rss(folder, "ours", name, args)
                print(f"peak RSS during the {args.long}-token prefill ({name}, fresh processes): transformers "
                      f"{hf_rss['peak_mib']:.0f} MiB, ours {our_rss['peak_mib']:.0f} MiB "
                      f"({our_rss['peak_mib'] / hf_rss['peak_mib']:.2f}x)", flush=True)
                print(f"  each includes its weights and its state after the prefill: transformers' cache "
                      f"{hf_rss['state_mib']:.0f} MiB (grown to the prompt's {args.long} positions), ours "
                      f"{our_rss['state_mib']:.0f} MiB (preallocated for max_length {args.long + args.decode}, "
                      f"one slot); RSS after the prefill: transformers {hf_rss['now_mib']:.0f} MiB, "
                      f"ours {our_rss['now_mib']:.0f} MiB", flush=True)


if __name__ == "__main__":
    main()
