"""Benchmark: this package's CPU graphs against transformers' Qwen3.5 (eager), and against another commit of this
package, side by side in one run.

    python benchmarks/cpu_vs_transformers.py [--prompt 512] [--decode 64] [--batches 1 4 8]
        [--dtypes float32 bfloat16] [--long 4096] [--repeat 3] [--threads N] [--against REV]
        [--vocab 32000] [--layers LLLFLLLF]

Needs transformers >= 5 (the `reference` nox environment). Builds a random Qwen3.5 with transformers (by default
hidden 1024, 8 layers in the 3:1 pattern, vocab 32k: about 200M parameters; `--vocab` and `--layers`, a string of
L (DeltaNet) and F (full attention), change the vocabulary and the layer stack, e.g. `--vocab 248320 --layers
LLLFLF` for 0.8B's widths with its real tied vocabulary), saves it in the real on-disk format and loads it in each
side, in each dtype. Each side runs in its own worker process, loaded once per dtype:

- `transformers`: `generate` (eager, its own cache);
- `ours`: `Qwen35Runtime.generate` of this checkout, a static batch of that size, linears prepacked for it as
  `from_pretrained` does;
- with `--against REV`: the same through the package as it was at git revision REV (`git archive` of it, imported
  in place of this checkout), so that a regression shows as a ratio measured side by side, not as a remembered
  number.

For each batch size the same random prompts (all of --prompt tokens) go through each side's greedy generation of
--decode tokens, timed through each side's streamer:

- TTFT: from the call to the first new token of every row (prefill of the whole batch + its argmax);
- Throughput: new tokens per second after the first (batch x (decode - 1) / time from first to last token),

both by the wall clock and by the worker process's CPU time. The sides alternate, run by run, --repeat times (the
machine may be shared: a change in its load then hits every side alike); the tables give each side's median and,
per cell, the median and the range [min, max] of the per-run ratios (a run of one side against the run of the other
side next to it). The greedy tokens of ours and transformers are compared row by row. With --long, the same at
batch 1 after a --long-token prompt, and the peak RSS of a process during that prefill (each side in its own fresh
process, the high-water mark reset after loading; weights and each side's cache included: transformers' grows with
the prompt, ours is allocated for max_length = prompt + decode before the prefill; the output says how large each
is). Asserts nothing. Workers hold their models at once (three at `--against`): at `--vocab 248320` in fp32 about
1.5 GB for transformers and 2.5 GB for each of ours (the prepacked copy of the tied lm_head).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

VOCAB = 32000
# The decoder measured by default: 8 layers of Qwen3.5-0.8B's shapes (3 DeltaNet + 1 attention, twice), a 32k vocabulary.
TEXT_0_8B_8_LAYERS = dict(
    vocab_size=VOCAB, hidden_size=1024, intermediate_size=3584, num_hidden_layers=8, num_attention_heads=8,
    num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
    linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=True,
    rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                         mrope_section=[11, 11, 10], mrope_interleaved=True),
)
LAYER_LETTERS = {"L": "linear_attention", "F": "full_attention"}


def build(folder: str, vocab: int = VOCAB, layers: str | None = None) -> None:
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = dict(TEXT_0_8B_8_LAYERS, vocab_size=vocab)
    if layers:
        text.update(num_hidden_layers=len(layers), layer_types=[LAYER_LETTERS[c] for c in layers])
    vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=1024)
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True))
    model.save_pretrained(folder)


def prompts_for(batch: int, length: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, min(vocab, VOCAB), (batch, length), generator=torch.Generator().manual_seed(1))


def model_vocab(folder: str) -> int:
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    return config.get("text_config", config)["vocab_size"]


def load_hf(folder, dtype):
    from transformers import Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=dtype).eval()


def load_ours(folder, dtype):
    from optimum_qwen35.runtime.eager import load_decoder

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
    from optimum_qwen35.runtime import Qwen35Runtime

    B, T = prompts.shape
    # Packed as `Qwen35Runtime.from_pretrained` packs (done before the clock starts, like transformers' load).
    model = Qwen35Runtime.from_decoder(decoder, batch_size=B, max_length=T + decode, buckets=[T], pack_weights=True)
    clock = _Clock()
    clock.start = _now()
    out = model.generate(prompts.tolist(), max_new_tokens=decode, streamer=lambda step, tokens: clock.token())
    return clock, out


# ------------------------------------------------------------------ workers: one process per side
def worker(args) -> None:
    """Serve one side: JSON commands on stdin ("load" a dtype, "run" a batch), one JSON answer per line on stdout."""
    if args.worker != "transformers":
        import optimum_qwen35

        if args.expect_package and not os.path.realpath(optimum_qwen35.__file__).startswith(os.path.realpath(args.expect_package)):
            raise SystemExit(f"worker {args.worker}: imported {optimum_qwen35.__file__}, not the tree in {args.expect_package}")
    model = None
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "load":
            model = None
            dtype = getattr(torch, cmd["dtype"])
            model = load_hf(args.model, dtype) if args.worker == "transformers" else load_ours(args.model, dtype)
            answer = {"parameters": sum(p.numel() for p in model.parameters())}
        else:
            prompts = prompts_for(cmd["batch"], cmd["prompt"], model_vocab(args.model))
            with torch.no_grad():
                clock, tokens = (run_hf if args.worker == "transformers" else run_ours)(model, prompts, cmd["decode"])
            answer = {"ttft": [clock.first[i] - clock.start[i] for i in (0, 1)],
                      "steps": [clock.last[i] - clock.first[i] for i in (0, 1)], "tokens": tokens}
        print(json.dumps(answer), flush=True)


def checkout(rev: str, into: str) -> str:
    """This package as it was at git revision `rev`, laid out to import as `optimum_qwen35` (its `kernels/` folder
    installed inside `optimum_qwen35.kernels`, as setup.py does) under `into`. Returns the commit it resolved to."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "-C", repo, "rev-parse", "--verify", f"{rev}^{{commit}}"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        raise SystemExit(f"--against {rev}: not a git revision of {repo} (give a commit, tag or branch of this repository)")
    archive = subprocess.run(["git", "-C", repo, "archive", commit, "optimum_qwen35", "kernels"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    # kernels/<sub> goes to optimum_qwen35/kernels/<sub> (setup.py's package_dir); before the dispatch module moved to
    # optimum_qwen35/kernels/__init__.py, kernels/ held it too, and the same moves place it there.
    target = os.path.join(into, "optimum_qwen35", "kernels")
    os.makedirs(target, exist_ok=True)
    for name in os.listdir(os.path.join(into, "kernels")):
        shutil.move(os.path.join(into, "kernels", name), os.path.join(target, name))
    os.rmdir(os.path.join(into, "kernels"))
    return commit


class Worker:
    def __init__(self, side: str, args, pythonpath: str | None = None):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", side, "--model", args.model]
        env = dict(os.environ)
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        if pythonpath:
            cmd += ["--expect-package", pythonpath]
            env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
        self.side = side
        self.process = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def ask(self, **cmd) -> dict:
        self.process.stdin.write(json.dumps(cmd) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"the {self.side} worker stopped (its error is above)")
        return json.loads(line)

    def close(self):
        self.process.stdin.close()
        self.process.wait()


def measure(workers, batch, prompt, decode, repeat):
    """Every side `repeat` times, alternating: the order rotates, and every other round runs backwards, so that no
    side always runs first or after the same other side. Returns {side: [answer per run]}."""
    runs = {w.side: [] for w in workers}
    for r in range(repeat):
        k = (r // 2) % len(workers)
        order = workers[k:] + workers[:k]
        for w in order[::-1] if r % 2 else order:
            runs[w.side].append(w.ask(cmd="run", batch=batch, prompt=prompt, decode=decode))
    return runs


def agreement(a, b):
    """Per row, how many leading greedy tokens agree."""
    return [next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), len(ra)) for ra, rb in zip(a, b)]


def _cell(runs, side, base, metric, clock, batch, decode):
    """(median of side, median of base, median ratio, min ratio, max ratio): the ratio is how many times faster
    `side` is than `base`, run by run."""
    def value(run):
        t = run[metric][clock]
        return t if metric == "ttft" else batch * (decode - 1) / max(t, 1e-9)  # ms -> later; tok/s

    a, b = [value(r) for r in runs[side]], [value(r) for r in runs[base]]
    ratios = [y / x if metric == "ttft" else x / y for x, y in zip(a, b)]
    return statistics.median(a), statistics.median(b), statistics.median(ratios), min(ratios), max(ratios)


def print_tables(title, results, sides, decode):
    """One table per clock: per batch, each side's median TTFT and throughput, and ratios of ours against every
    other side (median [min-max] of the per-run ratios; > 1: ours is faster)."""
    others = [s for s in sides if s != "ours"]
    for clock, clock_name in ((0, "wall clock"), (1, "process CPU time")):
        print(f"\n{title} ({clock_name}; ratio = how many times faster ours is, median [min-max] over runs)")
        head = f"{'batch':>5s}  " + "  ".join(f"{'TTFT ms ' + s:>26s}" for s in sides)
        head += "  " + "  ".join(f"{'vs ' + s:>22s}" for s in others)
        head += "  " + "  ".join(f"{'tok/s ' + s:>24s}" for s in sides) + "  " + "  ".join(f"{'vs ' + s:>22s}" for s in others)
        print(head + "  equal greedy tokens (ours, transformers)")
        for batch, runs, same in results:
            line = f"{batch:>5d}  "
            for metric in ("ttft", "steps"):
                scale = 1e3 if metric == "ttft" else 1.0
                width = 26 if metric == "ttft" else 24
                line += "  ".join(f"{_cell(runs, s, s, metric, clock, batch, decode)[0] * scale:>{width}.1f}" for s in sides)
                for o in others:
                    _, _, med, lo, hi = _cell(runs, "ours", o, metric, clock, batch, decode)
                    line += f"  {med:>8.2f}x [{lo:.2f}-{hi:.2f}]"
                line += "  "
            print(line + (f"{min(same)}/{decode} (per row: {same})" if same is not None else ""))


def peak_rss_child(args) -> None:
    """In a fresh process: load one side, reset the RSS high-water mark, prefill, print the peak (MiB)."""
    dtype = getattr(torch, args.dtypes[0])
    prompt = prompts_for(1, args.long, model_vocab(args.model))
    model = load_hf(args.model, dtype) if args.rss_child == "transformers" else load_ours(args.model, dtype)
    if args.rss_child == "ours":
        from optimum_qwen35.runtime import Qwen35Runtime

        model = Qwen35Runtime.from_decoder(model, batch_size=1, max_length=args.long + args.decode, buckets=[args.long],
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
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--against", metavar="REV", help="also run this package as it was at git revision REV")
    parser.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary of the model built")
    parser.add_argument("--layers", help="layer stack of the model built: L (DeltaNet) and F (attention), e.g. LLLFLF")
    parser.add_argument("--model", help="a folder holding the benchmark model (built there if empty)")
    parser.add_argument("--rss-child", choices=["transformers", "ours"], help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--expect-package", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.layers and set(args.layers) - set(LAYER_LETTERS):
        parser.error(f"--layers takes letters L and F, got {args.layers!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rss_child:
        return peak_rss_child(args)
    if args.worker:
        return worker(args)

    with tempfile.TemporaryDirectory() as tmp:
        args.model = args.model or os.path.join(tmp, "model")
        os.makedirs(args.model, exist_ok=True)
        if not os.path.exists(os.path.join(args.model, "config.json")):
            build(args.model, args.vocab, args.layers)
        workers = [Worker("transformers", args), Worker("ours", args)]
        if args.against:
            tree = os.path.join(tmp, "against")
            os.makedirs(tree)
            commit = checkout(args.against, tree)
            side = f"{args.against}"
            workers.append(Worker(side, args, pythonpath=tree))
            print(f"--against {args.against}: commit {commit[:10]}")
        sides = [w.side for w in workers]
        import transformers

        print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
              f"{args.threads or torch.get_num_threads()} threads; prompt {args.prompt}, decode {args.decode}, "
              f"{args.repeat} runs per side and cell")
        try:
            for name in args.dtypes:
                sizes = [w.ask(cmd="load", dtype=name)["parameters"] for w in workers]
                print(f"\n{name}: ~{sizes[1] / 1e6:.0f}M parameters", flush=True)
                cells = [(b, args.prompt) for b in args.batches] + ([(1, args.long)] if args.long else [])
                results = {}
                for b, length in cells:
                    runs = measure(workers, b, length, args.decode, args.repeat)
                    same = agreement(runs["ours"][-1]["tokens"], runs["transformers"][-1]["tokens"])
                    results.setdefault(length, []).append((b, runs, same))
                    line = []
                    for metric, what in (("ttft", "TTFT"), ("steps", "decode")):
                        line += [f"{what} vs {o} " + "{2:.2f}x [{3:.2f}-{4:.2f}]".format(
                            *_cell(runs, "ours", o, metric, 1, b, args.decode)) for o in sides if o != "ours"]
                    print(f"  batch {b}, prompt {length} (CPU time, ours faster by): " + "; ".join(line), flush=True)
                for length, rows in results.items():
                    print_tables(f"{name}, prompt {length} tokens, {args.decode} new tokens", rows, sides, args.decode)
                if args.long:
                    hf_rss, our_rss = peak_rss(args.model, "transformers", name, args), peak_rss(args.model, "ours", name, args)
                    print(f"peak RSS during the {args.long}-token prefill ({name}, fresh processes): transformers "
                          f"{hf_rss['peak_mib']:.0f} MiB, ours {our_rss['peak_mib']:.0f} MiB "
                          f"({our_rss['peak_mib'] / hf_rss['peak_mib']:.2f}x)", flush=True)
                    print(f"  each includes its weights and its state after the prefill: transformers' cache "
                          f"{hf_rss['state_mib']:.0f} MiB (grown to the prompt's {args.long} positions), ours "
                          f"{our_rss['state_mib']:.0f} MiB (preallocated for max_length {args.long + args.decode}, "
                          f"one slot); RSS after the prefill: transformers {hf_rss['now_mib']:.0f} MiB, "
                          f"ours {our_rss['now_mib']:.0f} MiB", flush=True)
        finally:
            for w in workers:
                w.close()


if __name__ == "__main__":
    main()
