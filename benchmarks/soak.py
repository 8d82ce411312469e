"""A soak of `Qwen35Runtime.generate` under churn (issue 50 item 1): many seeded random requests through one loaded cpu
export at TP 1 and through the TP 2 worker pool, every answer checked against its solo run, then the faults.

    OMP_NUM_THREADS=1 nice -n 5 python benchmarks/soak.py --requests 2000 --tp 1 2

What one run does, per TP degree (everything seeded by --seed; only the product's code: optimum_qwen35.tiny for the
random checkpoint, the export code for the export, `Qwen35Runtime` for the rest):

- **The export.** A tiny random checkpoint (tiny-2b layout: 8 layers, 6 DeltaNet + 2 attention, vocab 512, with its
  multi-token-prediction head) exported for the cpu target in fp32 with the prefix cache's continuing context
  programs (block 64) and the speculative-decoding programs (`compile_graphs(..., prefix_block_size=64, mtp=True)`,
  what `Qwen35NeuronModelForCausalLM.export(..., mtp=True)` writes). Loaded once (`Qwen35Runtime.from_export`).
- **The requests.** Prompt lengths drawn bucket by bucket (every context bucket equally often, a length inside it),
  random `max_new_tokens` (1 .. 24, within the row's room), 30% starting with one of four shared prefixes, 20%
  speculative (greedy, k in 1 .. the export's most), 10% sampled with their own seed (temperature 1, one
  `torch.Generator` per row inside a batch sampler), the rest greedy.
- **The calls.** Plain rows (greedy and sampled mixed) run in `generate` calls of 1 .. B rows (B the export's batch
  size; one call in ten with B + 1 .. 2B greedy rows, so that prompts run in waves with per-row limits). Speculative
  rows cannot share a `generate` call with plain rows (`num_speculative_tokens` is one per call): they run in their
  own calls of 1 .. B rows, interleaved with the plain calls on the same loaded model, so slots, the prefix cache and
  the speculative state churn together. The prefix cache (on for every plain call; speculative prefill bypasses it)
  gets a budget of 24 blocks' snapshots (every prompt of 64 tokens or more stores one to three): eviction
  happens all the time.
- **The checks.** Every greedy row (plain or speculative) equals its solo run with the cache off (the same model, one
  prompt, `set_prefix_cache(None)`); every sampled row equals its solo run with the same seed. A mismatch is printed
  with the request, and classified against a solo run with a fresh cache on (a mismatch that equals the cache-on solo
  run is the block pieces' rounding, which docs/prefix_caching.md bounds by 1e-5; one that does not is a bug). After
  every call: the cache's bytes within its budget, every slot's encoded length within max_length. RSS (this process,
  plus the workers at TP 2) after the warm-up (the first tenth of the requests) and at the end.
- **Time per request**: the wall time of the `generate` call a request ran in (latency, not throughput: a shared
  machine makes it noisy); p50 and p99.
- **Faults** (--faults N each): a TP 2 worker process killed (SIGKILL) at a random moment of a `generate` call (the
  call must fail in one line within seconds, and the next call, which restarts the pool, must answer exactly);
  SIGINT (KeyboardInterrupt) at a random moment of a `generate` call (the next call must answer exactly).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from optimum_qwen35.checkpoint.sharded_files import save_mtp_weights, save_sharded
from optimum_qwen35.config import Qwen35Config
from optimum_qwen35.errors import WorkerLostError
from optimum_qwen35.export.compile import compile_graphs
from optimum_qwen35.export.layout import CHECKPOINT_DIR, COMPILED_DIR
from optimum_qwen35.runtime import Qwen35Runtime
from optimum_qwen35.runtime.prefix_cache import PrefixCache, snapshot_bytes
from optimum_qwen35.tiny import build_tiny_checkpoint

BLOCK = 64
MAX_NEW = 24


def build_export(out: Path, tp_degree: int, batch_size: int, max_length: int, buckets: list[int], seed: int = 0,
                 token_buckets: list[int] | None = None, logits_buckets: list[int] | None = None) -> Path:
    """A tiny random checkpoint exported for the cpu target (fp32) with prefix-cache and speculative programs.
    `token_buckets` / `logits_buckets`: `compile_graphs`' (fewer programs compile faster: the CI variant)."""
    source = build_tiny_checkpoint(out / "source", "tiny-2b", seed=seed)
    config = Qwen35Config.from_pretrained(source)
    folder = out / f"export-tp{tp_degree}"
    save_sharded(source, config, tp_degree, folder / CHECKPOINT_DIR, torch.float32, progress=False)
    save_mtp_weights(source, config, torch.float32, folder / CHECKPOINT_DIR, tp_degree)
    compile_graphs(config, tp_degree, batch_size, max_length, buckets, torch.float32, folder / COMPILED_DIR,
                   progress=False, token_buckets=token_buckets, logits_buckets=logits_buckets,
                   prefix_block_size=BLOCK, mtp=True)
    return folder


@dataclass
class Request:
    index: int
    prompt: list[int]
    max_new: int
    kind: str  # "greedy", "sampled" or "speculative"
    seed: int = 0
    k: int = 0
    tokens: list[int] = field(default_factory=list)
    seconds: float = 0.0


def make_requests(n: int, rng: random.Random, buckets: list[int], max_length: int, vocab: int, max_k: int) -> list[Request]:
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randrange(BLOCK, 3 * BLOCK + 20))] for _ in range(4)]
    requests = []
    for index in range(n):
        b = rng.randrange(len(buckets))
        low, high = (buckets[b - 1] + 1 if b else 1), min(buckets[b], max_length - 1)
        length = rng.randint(low, high)
        prompt = [rng.randrange(vocab) for _ in range(length)]
        if rng.random() < 0.3:  # a shared prefix, then this request's own tokens
            prefix = rng.choice(prefixes)[: max(1, length - rng.randint(1, 16))]
            prompt = prefix + prompt[len(prefix):]
        max_new = rng.randint(1, min(MAX_NEW, max_length - length))
        roll = rng.random()
        if roll < 0.2:
            requests.append(Request(index, prompt, max_new, "speculative", k=rng.randint(1, max_k)))
        elif roll < 0.3:
            requests.append(Request(index, prompt, max_new, "sampled", seed=rng.randrange(2**31)))
        else:
            requests.append(Request(index, prompt, max_new, "greedy"))
    return requests


def row_sampler(seeds: dict[int, int]):
    """A `generate` sampler: rows in `seeds` sampled (temperature 1) with their own generator, the others greedy. A
    row's tokens depend on its logits and its seed alone, never on the other rows."""
    generators = {row: torch.Generator().manual_seed(seed) for row, seed in seeds.items()}

    def sample(logits: torch.Tensor) -> torch.Tensor:
        out = logits.argmax(-1)
        for row, generator in generators.items():
            if row < len(logits):
                probs = torch.softmax(logits[row].double(), -1)
                out[row] = torch.multinomial(probs, 1, generator=generator)[0]
        return out

    return sample


def solo(model: Qwen35Runtime, request: Request, cache: PrefixCache | None) -> list[int]:
    """The request alone in a call: greedy (speculative requests too: speculation equals greedy) or seeded."""
    previous = model.prefix_cache
    model.set_prefix_cache(cache)
    try:
        sampler = row_sampler({0: request.seed}) if request.kind == "sampled" else None
        return model.generate([request.prompt], max_new_tokens=request.max_new, sampler=sampler)[0]
    finally:
        model.set_prefix_cache(previous)


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/statm") as f:
            total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return total


def pids_of(model: Qwen35Runtime) -> list[int]:
    return [os.getpid(), *getattr(model.graphs, "pids", [])]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


class Soak:
    def __init__(self, model: Qwen35Runtime, cache: PrefixCache, rng: random.Random, log=print):
        self.model, self.cache, self.rng, self.log = model, cache, rng, log
        self.mismatches: list[str] = []
        self.leaks: list[str] = []
        self.calls = 0
        self.max_cache_bytes = 0
        self.every = 100  # requests between progress lines

    def run_call(self, batch: list[Request]) -> None:
        model = self.model
        prompts = [r.prompt for r in batch]
        limits = [r.max_new for r in batch]
        start = time.perf_counter()
        if batch[0].kind == "speculative":
            out = model.generate(prompts, max_new_tokens=limits, num_speculative_tokens=batch[0].k)
        else:
            seeds = {row: r.seed for row, r in enumerate(batch) if r.kind == "sampled"}
            out = model.generate(prompts, max_new_tokens=limits, sampler=row_sampler(seeds) if seeds else None)
        seconds = time.perf_counter() - start
        self.calls += 1
        for r, tokens in zip(batch, out):
            r.tokens, r.seconds = tokens, seconds
        self.check_bounds()
        for row, r in enumerate(batch):
            expected = solo(model, r, None)
            if r.tokens != expected:
                fresh = PrefixCache(block_size=self.cache.block_size, budget_bytes=self.cache.budget_bytes)
                cached_solo = solo(model, r, fresh)
                what = "equals the cache-on solo run (block-piece rounding)" if r.tokens == cached_solo else "BUG"
                self.mismatches.append(
                    f"request {r.index} ({r.kind}, k={r.k}, prompt {len(r.prompt)} tokens, max_new {r.max_new}, row {row}"
                    f" of {len(batch)}): got {r.tokens}, solo cache-off {expected}: {what}"
                )
                self.log("MISMATCH " + self.mismatches[-1])

    def check_bounds(self) -> None:
        self.max_cache_bytes = max(self.max_cache_bytes, self.cache.nbytes)
        if self.cache.nbytes > self.cache.budget_bytes:
            self.leaks.append(f"after call {self.calls}: cache holds {self.cache.nbytes} bytes > budget {self.cache.budget_bytes}")
        if any(not 0 <= e <= self.model.max_length for e in self.model.encoded):
            self.leaks.append(f"after call {self.calls}: slot lengths {self.model.encoded} outside 0..{self.model.max_length}")

    def churn(self, requests: list[Request], warmup: int) -> dict:
        B = self.model.batch_size
        plain = [r for r in requests if r.kind != "speculative"]
        speculative = [r for r in requests if r.kind == "speculative"]
        done, rss_warm, started = 0, None, time.perf_counter()
        while plain or speculative:
            take_speculative = speculative and (not plain or self.rng.random() < len(speculative) / (len(plain) + len(speculative)))
            if take_speculative:
                n = self.rng.randint(1, B)
                batch, speculative[:] = speculative[:n], speculative[n:]
            else:
                waves = self.rng.random() < 0.1 and not any(r.kind == "sampled" for r in plain[: 2 * B])
                n = self.rng.randint(B + 1, 2 * B) if waves else self.rng.randint(1, B)
                batch = plain[:n]
                if not waves:  # a sampled row's sampler knows its row in a one-wave call only
                    batch = batch[:B]
                plain[:] = plain[len(batch):]
            self.run_call(batch)
            done += len(batch)
            if rss_warm is None and done >= warmup:
                rss_warm = rss_bytes(pids_of(self.model))
            if done // self.every != (done - len(batch)) // self.every:
                times = [r.seconds for r in requests if r.tokens]
                rss = rss_bytes(pids_of(self.model))
                growth = f"{100 * (rss / rss_warm - 1):+.1f}% since warm-up" if rss_warm else "warming up"
                self.log(f"  {done} requests, {len(self.mismatches)} mismatches, {len(self.leaks)} leaks, cache "
                         f"{self.cache.nbytes} B of {self.cache.budget_bytes} ({self.cache.evictions} evictions, "
                         f"{self.cache.hits} block hits), RSS {rss / 2**20:.1f} MiB ({growth}), per request p50 "
                         f"{1000 * statistics.median(times):.0f} ms p99 {1000 * percentile(times, 0.99):.0f} ms, "
                         f"{time.perf_counter() - started:.0f} s")
        rss_end = rss_bytes(pids_of(self.model))
        return {"rss_warm": rss_warm or rss_end, "rss_end": rss_end}


def interrupt_during_generate(model: Qwen35Runtime, request: Request, how: str, delay: float) -> tuple[str, float]:
    """Run a long generate call and, after `delay` seconds, SIGKILL a worker ("kill") or SIGINT this process
    ("interrupt"). Returns what the call ended with and how long after the fault it ended."""
    fault_time = []

    def fault():
        fault_time.append(time.perf_counter())
        if how == "kill":
            os.kill(model.graphs.pids[-1], signal.SIGKILL)
        else:
            os.kill(os.getpid(), signal.SIGINT)

    timer = threading.Timer(delay, fault)
    prompts = [request.prompt] * model.batch_size * 4  # several waves: long enough for the fault to land inside
    # Python's own SIGINT handler: a shell starts a background command with SIGINT ignored, and Python then keeps it so.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer.start()
    try:
        try:
            model.generate(prompts, max_new_tokens=request.max_new)
            outcome = "finished before the fault"
        finally:
            timer.cancel()
            timer.join()
    except KeyboardInterrupt:
        outcome = "KeyboardInterrupt"
    except WorkerLostError as error:
        outcome = f"WorkerLostError: {error}"
    finally:
        signal.signal(signal.SIGINT, previous)
    return outcome, (time.perf_counter() - fault_time[0]) if fault_time else 0.0


def faults(model: Qwen35Runtime, requests: list[Request], n: int, rng: random.Random, log=print) -> dict:
    """n SIGINTs (and, at TP > 1, n worker kills) at random moments of generate calls; after each, a request must
    give its solo answer. Returns counts."""
    survived, failed, seconds = 0, [], []
    kinds = ["interrupt"] + (["kill"] if hasattr(model.graphs, "pids") else [])
    greedy = [r for r in requests if r.kind == "greedy" and r.max_new >= 8]
    for how in kinds:
        for _ in range(n):
            request = rng.choice(greedy)
            expected = request.tokens
            outcome, after = interrupt_during_generate(model, request, how, rng.uniform(0.05, 0.5))
            seconds.append(after)
            again = model.generate([request.prompt], max_new_tokens=request.max_new)[0]
            ok = again == expected and after < 10 and outcome != "finished before the fault"
            log(f"  fault {how}: {outcome.splitlines()[0][:160]} ({after:.2f} s after it); next call "
                f"{'equals' if again == expected else 'DIFFERS from'} the solo answer")
            if ok:
                survived += 1
            else:
                failed.append(f"{how}: {outcome[:200]}, {after:.2f} s, next call equal: {again == expected}")
    return {"survived": survived, "failed": failed, "max_seconds_to_error": max(seconds, default=0.0)}


def soak(folder: Path, n: int, seed: int, n_faults: int, log=print, budget_blocks: int = 24) -> dict:
    """The churn, then the faults, on the export `folder`; a prefix cache of `budget_blocks` blocks' snapshots."""
    rng = random.Random(seed)
    model = Qwen35Runtime.from_export(folder)
    try:
        config = model.config
        per_block = snapshot_bytes(config, BLOCK, 4) + 4 * model.max_length
        cache = PrefixCache(block_size=BLOCK, budget_bytes=budget_blocks * per_block)
        model.set_prefix_cache(cache)
        requests = make_requests(n, rng, model.buckets, model.max_length, config.vocab_size,
                                 model.graphs.max_speculative_tokens)
        run = Soak(model, cache, rng, log)
        run.every = max(1, min(20, n // 10))
        rss = run.churn(requests, warmup=max(1, n // 10))
        times = [r.seconds for r in requests]
        figures = {
            "tp_degree": getattr(model.graphs, "tp_degree", 1),
            "requests": n,
            "calls": run.calls,
            "kinds": {k: sum(r.kind == k for r in requests) for k in ("greedy", "sampled", "speculative")},
            "shared_prefix_block_hits": cache.hits,
            "evictions": cache.evictions,
            "cache_bytes_end": cache.nbytes,
            "cache_bytes_max": run.max_cache_bytes,
            "cache_budget": cache.budget_bytes,
            "mismatches": run.mismatches,
            "leaks": run.leaks,
            "rss_warm_mib": rss["rss_warm"] / 2**20,
            "rss_end_mib": rss["rss_end"] / 2**20,
            "rss_growth": rss["rss_end"] / rss["rss_warm"] - 1,
            "p50_ms": 1000 * statistics.median(times),
            "p99_ms": 1000 * percentile(times, 0.99),
        }
        figures["faults"] = faults(model, requests, n_faults, rng, log) if n_faults else {"survived": 0, "failed": []}
        return figures
    finally:
        model.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--buckets", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--faults", type=int, default=3, help="SIGINTs (and worker kills at TP > 1) per TP degree")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--exports", type=Path, help="a folder to keep the exports in (reused when already there)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    failures = 0
    with tempfile.TemporaryDirectory(prefix="qwen35-soak-") as tmp:
        for tp in args.tp:
            started = time.perf_counter()
            root = (args.exports or Path(tmp)) / f"tp{tp}"
            folder = root / f"export-tp{tp}"
            if not (folder / COMPILED_DIR / "graphs.json").is_file():
                folder = build_export(root, tp, args.batch_size, args.max_length, args.buckets, args.seed)
            print(f"TP {tp}: exported in {time.perf_counter() - started:.0f} s; soaking {args.requests} requests", flush=True)
            f = soak(folder, args.requests, args.seed, args.faults, log=lambda s: print(s, flush=True))
            print(
                f"TP {f['tp_degree']}: {f['requests']} requests in {f['calls']} calls {f['kinds']}; "
                f"mismatches {len(f['mismatches'])}; leaks {len(f['leaks'])}; "
                f"cache {f['cache_bytes_end']} B at the end, at most {f['cache_bytes_max']} of {f['cache_budget']} B, "
                f"{f['evictions']} evictions, {f['shared_prefix_block_hits']} block hits; "
                f"RSS {f['rss_warm_mib']:.1f} MiB after warm-up -> {f['rss_end_mib']:.1f} MiB ({100 * f['rss_growth']:+.1f}%); "
                f"time per request p50 {f['p50_ms']:.0f} ms, p99 {f['p99_ms']:.0f} ms (wall); "
                f"faults survived {f['faults']['survived']}, failed {len(f['faults']['failed'])}"
                + (f", slowest error {f['faults']['max_seconds_to_error']:.2f} s after its fault" if args.faults else ""),
                flush=True,
            )
            for line in f["mismatches"] + f["leaks"] + f["faults"]["failed"]:
                print("  " + line)
            failures += len(f["mismatches"]) + len(f["leaks"]) + len(f["faults"]["failed"]) + (f["rss_growth"] >= 0.05)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
