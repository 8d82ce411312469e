"""Benchmark: decode (and TTFT) of a Qwen3.5-35B-A3B-shaped MoE model with few layers, this package's CPU runtime
against transformers' `Qwen3_5MoeForCausalLM` (eager), side by side in one run, with the memory roofline.

    python benchmarks/moe_cpu_decode.py [--layers F] [--vocab 32000] [--prompt 128] [--decode 16]
        [--batches 1 4] [--dtypes float32 bfloat16] [--repeat 3] [--threads 1] [--hf-experts IMPL] [--model DIR]

Needs transformers >= 5 (the `reference` nox environment). The model is built from the published 35B-A3B text
config (tests/qwen3.5-35b-a3b.config.json: hidden 2048, 256 experts of 512 rows, top-8, shared expert 512, 16/2
attention heads, 16/32 DeltaNet heads) with `--layers` (L: DeltaNet, F: attention) in place of its 40 and
`--vocab` in place of its 248,320 (the real one's lm_head, 1 GB in bf16, would be most of a short stack's step),
random weights (transformers' init), saved by transformers in bf16 (the checkpoint's on-disk format: per-expert
keys). The default stack is one attention layer: every layer carries 1.5 GiB of routed experts in bf16 (3 GiB in
fp32), transformers' generate needs at least one attention layer in the stack, and its worker's peak RSS (the
mapped checkpoint included) was 7.8 GiB in bf16 with `--layers LF`, above what this shared machine allows a job.
Each side runs in its own worker process (benchmarks/cpu_vs_transformers.py's timing: greedy generation of
--decode tokens after a --prompt-token prompt, TTFT and the throughput after the first token, by the process CPU
time, medians and the range of the per-run ratios), but only one side holds the model at a time: a side loads it,
runs every batch size, and drops it before the other side loads it, --repeat times in alternating order (loading
is not timed). Each worker's peak RSS is printed after each dtype.

The roofline: at batch 1 a decode step must read every weight it uses once (the k chosen experts of every layer,
the shared expert, router, attention / DeltaNet projections, lm_head) and read and write the recurrent state and
the KV cache. `--threads` cores can stream those bytes at most at the read bandwidth this script measures (a sum
over 512 MiB with the same thread count, by CPU time, the best of 10, before and after each dtype's runs: the best
of those), so steps/s <= bandwidth / bytes per step. At batch B the experts are
those distinct among B x k choices (expected count for uniform routing). The table gives each side's step rate as
a fraction of that bound. Asserts nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_vs_transformers  # noqa: E402
from cpu_vs_transformers import _cell, agreement, model_vocab, prompts_for, run_hf, run_ours  # noqa: E402

CONFIG = Path(__file__).parents[1] / "tests" / "qwen3.5-35b-a3b.config.json"
LAYER_LETTERS = {"L": "linear_attention", "F": "full_attention"}


def text_config(layers: str, vocab: int) -> dict:
    text = dict(json.loads(CONFIG.read_text())["text_config"])
    text.update(num_hidden_layers=len(layers), layer_types=[LAYER_LETTERS[c] for c in layers], vocab_size=vocab)
    if text["eos_token_id"] >= vocab:
        text["eos_token_id"] = None  # both sides generate --decode tokens anyway
    return text


def build(folder: str, layers: str, vocab: int) -> None:
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    text = text_config(layers, vocab)
    config = Qwen3_5MoeTextConfig(**{k: v for k, v in text.items() if k not in ("model_type", "dtype")})
    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM._from_config(config, dtype=torch.bfloat16)  # built in bf16: 1.5 GiB a layer
    model.save_pretrained(folder)


def load_hf(folder: str, dtype: torch.dtype, experts: str | None):
    from transformers import Qwen3_5MoeForCausalLM

    kwargs = {"experts_implementation": experts} if experts else {}
    return Qwen3_5MoeForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs).eval()


def worker(args) -> None:
    """One side: JSON commands on stdin ("load" a dtype, "drop" it, "run" a batch), one JSON answer per line."""
    from optimum_qwen35.runtime.eager import load_decoder

    model = None
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "load":
            dtype = getattr(torch, cmd["dtype"])
            model = load_hf(args.model, dtype, args.hf_experts) if args.worker == "transformers" else load_decoder(args.model, dtype)
            answer = {"parameters": sum(p.numel() for p in model.parameters())}
            if args.worker == "transformers":
                answer["experts_implementation"] = model.config._experts_implementation
        elif cmd["cmd"] == "drop":
            model = None
            gc.collect()
            status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
            answer = {"peak_mib": int(status["VmHWM"].split()[0]) / 1024}  # this process's high-water mark so far
        else:
            prompts = prompts_for(cmd["batch"], cmd["prompt"], model_vocab(args.model))
            with torch.no_grad():
                clock, tokens = (run_hf if args.worker == "transformers" else run_ours)(model, prompts, cmd["decode"])
            answer = {"ttft": [clock.first[i] - clock.start[i] for i in (0, 1)],
                      "steps": [clock.last[i] - clock.first[i] for i in (0, 1)], "tokens": tokens}
        print(json.dumps(answer), flush=True)


class Worker(cpu_vs_transformers.Worker):
    """cpu_vs_transformers' worker process (its `ask` / `close`), started on this script with its own flags."""

    def __init__(self, side: str, args):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", side, "--model", args.model, "--threads",
               str(args.threads)]
        if args.hf_experts:
            cmd += ["--hf-experts", args.hf_experts]
        self.side = side
        self.process = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def read_bandwidth(threads: int, repeat: int = 10) -> float:
    """Bytes per second of process CPU time of a sum over 512 MiB (fp32), the best of `repeat`, with this process's
    torch threads: what the decode step's weight reads can stream at most. CPU time, as the runs are timed, and the
    best of several, since other jobs on a shared machine slow some of them down."""
    a = torch.ones(128 * 2**20)
    best = float("inf")
    for _ in range(repeat):
        t = time.process_time()
        a.sum()
        best = min(best, (time.process_time() - t) / threads)
    return a.numel() * a.element_size() / best


def step_bytes(text: dict, dtype: torch.dtype, batch: int, positions: int) -> dict[str, float]:
    """Bytes one decode step of `batch` rows at about `positions` cached positions must move, by part (weights
    read once; states read and written; the KV cache read). Expected distinct experts for uniform routing."""
    b = dtype.itemsize
    H, E, k, I = text["hidden_size"], text["num_experts"], text["num_experts_per_tok"], text["moe_intermediate_size"]
    S, V = text["shared_expert_intermediate_size"], text["vocab_size"]
    heads, kv, hd = text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
    nk, nv, dk, dv = (text[f"linear_{n}"] for n in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim"))
    conv = text["linear_conv_kernel_dim"]
    distinct = E * (1 - (1 - k / E) ** batch)
    parts = {"experts": 0.0, "shared expert + router": 0.0, "attention / DeltaNet": 0.0, "states": 0.0}
    for kind in text["layer_types"]:
        parts["experts"] += distinct * 3 * I * H * b
        parts["shared expert + router"] += 3 * S * H * b + H * b + E * H * 4  # the router is held in fp32
        if kind == "full_attention":
            parts["attention / DeltaNet"] += (H * heads * hd * 2 + 2 * H * kv * hd + heads * hd * H) * b
            parts["states"] += batch * 2 * kv * hd * positions * b
        else:
            qkv = 2 * nk * dk + nv * dv
            parts["attention / DeltaNet"] += (H * (qkv + nv * dv + 2 * nv) + nv * dv * H + qkv * conv) * b
            parts["states"] += batch * 2 * (nv * dk * dv * 4 + qkv * (conv - 1) * b)
    parts["lm_head"] = V * H * b
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="F", help="layer stack: L (DeltaNet) and F (attention), e.g. LF")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every process (default 1)")
    parser.add_argument("--hf-experts", help="transformers' experts_implementation (default: its own default)")
    parser.add_argument("--model", help="a folder holding the benchmark model (built there if empty)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if set(args.layers) - set(LAYER_LETTERS) or "F" not in args.layers:
        parser.error(f"--layers takes letters L and F, at least one F (transformers' cache needs one), got {args.layers!r}")
    torch.set_num_threads(args.threads)
    if args.worker:
        return worker(args)

    with tempfile.TemporaryDirectory() as tmp:
        args.model = args.model or os.path.join(tmp, "model")
        os.makedirs(args.model, exist_ok=True)
        if not os.path.exists(os.path.join(args.model, "config.json")):
            build(args.model, args.layers, args.vocab)
        text = json.loads(Path(args.model, "config.json").read_text())
        bandwidth = read_bandwidth(args.threads)
        import transformers

        print(f"torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} thread(s); layers "
              f"{args.layers}, vocab {text['vocab_size']}; prompt {args.prompt}, decode {args.decode}, {args.repeat} runs "
              f"per side and cell; read bandwidth {bandwidth / 1e9:.1f} GB/s at the start (sum over 512 MiB, CPU time)")
        workers = [Worker("transformers", args), Worker("ours", args)]
        peak: dict[str, float] = {}
        try:
            for name in args.dtypes:
                runs = {b: {w.side: [] for w in workers} for b in args.batches}
                for r in range(args.repeat):
                    for w in workers[::-1] if r % 2 else workers:
                        info = w.ask(cmd="load", dtype=name)
                        if r == 0 and "experts_implementation" in info:
                            print(f"\n{name}: {info['parameters'] / 1e6:.0f}M parameters; transformers' experts: "
                                  f"{info['experts_implementation']}", flush=True)
                        for b in args.batches:
                            runs[b][w.side].append(w.ask(cmd="run", batch=b, prompt=args.prompt, decode=args.decode))
                        peak[w.side] = max(peak.get(w.side, 0), w.ask(cmd="drop")["peak_mib"])
                bandwidth = max(bandwidth, read_bandwidth(args.threads))
                report(name, runs, args, text, bandwidth)
                print("peak RSS of each worker so far (MiB): " + ", ".join(f"{s} {m:.0f}" for s, m in peak.items()))
        finally:
            for w in workers:
                w.close()


def report(name, runs, args, text, bandwidth) -> None:
    dtype = getattr(torch, name)
    print(f"\n{name} (process CPU time; ratio = how many times faster ours is, median [min-max] over runs; roofline at "
          f"{bandwidth / 1e9:.1f} GB/s)")
    print("| batch | TTFT transformers / ours (ms) | TTFT ratio | decode transformers / ours (tok/s) | decode ratio "
          "| bytes per step (MB) | roofline (steps/s) | transformers / ours of roofline | equal greedy tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for b, cell in runs.items():
        ttft = _cell(cell, "ours", "transformers", "ttft", 1, b, args.decode)
        tps = _cell(cell, "ours", "transformers", "steps", 1, b, args.decode)
        parts = step_bytes(text, dtype, b, args.prompt + args.decode // 2)
        total = sum(parts.values())
        roof = bandwidth / total
        steps = [tps[1] / b, tps[0] / b]  # steps/s: transformers, ours
        same = agreement(cell["ours"][-1]["tokens"], cell["transformers"][-1]["tokens"])
        print(f"| {b} | {ttft[1] * 1e3:.0f} / {ttft[0] * 1e3:.0f} | {ttft[2]:.2f}x [{ttft[3]:.2f}-{ttft[4]:.2f}] "
              f"| {tps[1]:.1f} / {tps[0]:.1f} | {tps[2]:.2f}x [{tps[3]:.2f}-{tps[4]:.2f}] | {total / 1e6:.0f} | {roof:.1f} "
              f"| {steps[0] / roof:.0%} / {steps[1] / roof:.0%} | {min(same)}/{args.decode} |")
        print("    bytes per step: " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in parts.items()), flush=True)


if __name__ == "__main__":
    main()
