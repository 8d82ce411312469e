"""A soak of `vllm serve` under churn (issue 50 item 1): seeded streamed requests at a fixed concurrency through
vLLM's OpenAI server on a cpu export (the NxD stack: vLLM 0.11 through optimum-neuron's platform and this package's
plugin), every completed stream checked against the export's own solo greedy tokens. Run it in the vllm environment
(docs/serving.md):

    OMP_NUM_THREADS=1 nice -n 5 python benchmarks/vllm_soak.py --requests 500 --concurrency 16 [--seed 0] [--export DIR]

What one run does (everything seeded by --seed; only the product's code and public tools):

- **The export.** A tiny random checkpoint (`optimum_qwen35.tiny`, tiny-2b: 8 layers, vocab 512) exported by the
  package's own command, `python -m optimum_qwen35 export ... --batch_size 4 --sequence_length 256 --torch_dtype
  float32 --target cpu` (context buckets 128 / 256, prefix-cache block 64). `--export DIR` keeps it there and reuses it.
- **The server.** `vllm serve EXPORT --host 127.0.0.1 --port P` (a free port), one torch thread, in its own process
  group, stopped by its pid at the end. Its process tree's RSS is sampled every second.
- **The requests.** Prompt lengths drawn bucket by bucket (every context bucket equally often), 30% starting with one
  of four shared prefixes (64 .. 200 tokens: the worker's prefix cache hits them), `max_tokens` 1 .. --max-new within
  the export's length; all greedy (temperature 0), streamed (`/v1/completions`, `stream: true`, `return_token_ids`),
  sent by --concurrency clients at once. Exactly round(10%) of them (at least one) disconnect after 1 .. n - 1 streamed
  tokens (the client closes the connection); exactly round(5%) (at least one) are over-length (a prompt longer than
  the export, or a prompt whose `max_tokens` does not fit) and must be refused with HTTP 400, neither hanging nor
  crashing the server. The server logs its requests (`--enable-log-requests`), so its aborts are counted.
- **The checks.** Every completed stream equals the request's solo greedy tokens computed by the export's own
  `Qwen35Runtime` in this process (prefix cache off, one prompt per call, cut after the first EOS as vLLM stops): it
  shares no state with the server, so a leak between the server's slots cannot hide in both sides, and it is exact
  (the same compiled fp32 programs; a batch's rows are computed independently, which tests/vllm/test_server.py checks
  bit for bit). At the end: `/health` answers 200; vLLM's `/metrics` shows `vllm:num_requests_running` and
  `vllm:num_requests_waiting` at 0 (every slot free; disconnected requests aborted); a final batch of --concurrency
  requests, sent at once, all give their solo tokens; the server process is still the one started.
- **The figures.** Counts (completed, disconnected, over-length refused, mismatches, failures), p50 / p99 time to first
  token and inter-token latency (wall time, client side), the server tree's RSS after the warm-up (the first tenth of
  the requests) and at the end. The exit status is 1 on any mismatch, failure, or end check not met.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

TOKENS = (3, 400)  # ordinary tokens of the tiny vocabulary (no special ones)
STARTUP_TIMEOUT = 900  # seconds: vLLM's imports and its engine process, on 2 shared cores
REQUEST_TIMEOUT = 600


@dataclass
class Request:
    index: int
    prompt: list[int]
    max_tokens: int
    kind: str  # "complete", "disconnect" or "over_length"
    disconnect_after: int = 0
    tokens: list[int] = field(default_factory=list)
    status: int = 0
    outcome: str = ""  # "completed", "disconnected", "refused" or a failure's description
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)


def export(folder: Path, seed: int) -> Path:
    """The tiny checkpoint exported by the package's own `export` command (kept and reused in `folder`)."""
    out = folder / "export"
    if (out / "compiled" / "graphs.json").is_file():
        return out
    from optimum_qwen35.tiny import build_tiny_checkpoint

    checkpoint = build_tiny_checkpoint(folder / "checkpoint", "tiny-2b", seed=seed)
    command = [sys.executable, "-m", "optimum_qwen35", "export", "--model", str(checkpoint), "--batch_size", "4",
               "--sequence_length", "256", "--torch_dtype", "float32", "--target", "cpu", str(out)]
    subprocess.run(command, check=True, env=environment(), stdout=subprocess.DEVNULL)
    return out


def environment() -> dict:
    """This interpreter's commands first on PATH; one torch thread; no telemetry, no Hub."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "OMP_NUM_THREADS": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}


def make_requests(n: int, rng: random.Random, buckets: list[int], max_length: int, max_new: int,
                  block: int) -> list[Request]:
    lo, hi = TOKENS
    prefixes = [[rng.randrange(lo, hi) for _ in range(rng.randint(block, 200))] for _ in range(4)]
    kinds = ["complete"] * n
    spots = rng.sample(range(n), n)
    n_disconnect, n_over = max(1, round(0.1 * n)), max(1, round(0.05 * n))
    for i in spots[:n_disconnect]:
        kinds[i] = "disconnect"
    for i in spots[n_disconnect:n_disconnect + n_over]:
        kinds[i] = "over_length"
    requests = []
    for index, kind in enumerate(kinds):
        if kind == "over_length":
            if rng.random() < 0.5:  # the prompt alone is longer than the export
                length, max_tokens = rng.randint(max_length + 1, max_length + 64), rng.randint(1, max_new)
            else:  # the prompt fits, its new tokens do not
                length = rng.randint(max_length - max_new, max_length - 1)
                max_tokens = rng.randint(max_length - length + 1, max_length - length + max_new)
            requests.append(Request(index, [rng.randrange(lo, hi) for _ in range(length)], max_tokens, kind))
            continue
        b = rng.randrange(len(buckets))
        low, high = (buckets[b - 1] + 1 if b else 1), min(buckets[b], max_length - 2)
        length = rng.randint(low, high)
        prompt = [rng.randrange(lo, hi) for _ in range(length)]
        if rng.random() < 0.3:  # a shared prefix, then this request's own tokens
            prefix = rng.choice(prefixes)[: max(1, length - rng.randint(1, 16))]
            prompt = prefix + prompt[len(prefix):]
        room = min(max_new, max_length - length)
        if kind == "disconnect":
            max_tokens = max(2, room)
            requests.append(Request(index, prompt, max_tokens, kind, disconnect_after=rng.randint(1, max_tokens - 1)))
        else:
            requests.append(Request(index, prompt, rng.randint(1, room), kind))
    return requests


class Reference:
    """Solo greedy tokens from the export's own runtime in this process: one prompt per call, prefix cache off."""

    def __init__(self, folder: Path):
        import torch

        from optimum_qwen35.runtime import Qwen35Runtime

        torch.set_num_threads(1)
        self.model = Qwen35Runtime.from_export(folder)
        self.model.set_prefix_cache(None)
        eos = json.loads((folder / "generation_config.json").read_text()).get("eos_token_id")
        self.eos = [eos] if isinstance(eos, int) else list(eos or [])
        self.known: dict[tuple, list[int]] = {}

    def __call__(self, prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in self.known:
            tokens = self.model.generate([prompt], max_new_tokens=max_tokens, eos_token_id=self.eos)[0]
            for i, token in enumerate(tokens):  # vLLM returns the EOS and stops
                if token in self.eos:
                    tokens = tokens[: i + 1]
                    break
            self.known[key] = tokens
        return self.known[key]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and every descendant (vLLM's engine core runs in a child process)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            pass
    return total


class RssSampler(threading.Thread):
    def __init__(self, pid: int, every: float = 1.0):
        super().__init__(daemon=True)
        self.pid, self.every, self.samples, self.done = pid, every, [], threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.every):
            self.samples.append(tree_rss(self.pid))

    def now(self) -> int:
        return tree_rss(self.pid)


def start_server(model: Path, port: int, log: Path, prefix_cache_bytes: int | None = None) -> subprocess.Popen:
    vllm = shutil.which("vllm", path=environment()["PATH"])
    if vllm is None:
        sys.exit("no `vllm` command next to this interpreter: run this in the vllm environment (docs/serving.md)")
    # --enable-log-requests: the log then says which requests the server aborted (a client that left mid-stream)
    command = [vllm, "serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--enable-log-requests"]
    if prefix_cache_bytes is not None:  # the worker's prefix-cache budget (serving/vllm_worker.py)
        command += ["--additional-config", json.dumps({"qwen35_prefix_cache_bytes": prefix_cache_bytes})]
    with open(log, "w") as out:
        return subprocess.Popen(command, cwd=model.parent, env=environment(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_healthy(process: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while True:
        if process.poll() is not None:
            sys.exit(f"vllm serve exited {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"vllm serve did not answer /health within {STARTUP_TIMEOUT} s")
        time.sleep(2)


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


async def stream(client: httpx.AsyncClient, url: str, model: str, r: Request) -> None:
    """One streamed completion; a "disconnect" request closes its connection after `disconnect_after` tokens."""
    body = {"model": model, "prompt": r.prompt, "max_tokens": r.max_tokens, "temperature": 0, "stream": True,
            "return_token_ids": True}
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT) as response:
            r.status = response.status_code
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                refused = response.status_code == 400 and "error" in text
                r.outcome = "refused" if refused else f"HTTP {r.status}: {text[:200]}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                ids = [t for choice in chunk.get("choices", []) for t in (choice.get("token_ids") or [])]
                if not ids:
                    continue
                now = time.perf_counter()
                if r.ttft is None:
                    r.ttft = now - start
                else:
                    r.gaps.append((now - last) / len(ids))
                last = now
                r.tokens += ids
                if r.kind == "disconnect" and len(r.tokens) >= r.disconnect_after:
                    r.outcome = "disconnected"
                    return  # leaving the block closes the connection mid-stream
        r.outcome = "completed"
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        r.outcome = f"failed: {type(error).__name__}: {error}"


async def run_load(url: str, model: str, requests: list[Request], concurrency: int, on_done=None) -> None:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits) as client:
        queue = list(reversed(requests))

        async def client_loop():
            while queue:
                r = queue.pop()
                await stream(client, url, model, r)
                if on_done:
                    on_done(r)

        await asyncio.gather(*(client_loop() for _ in range(concurrency)))


def metric(url: str, name: str) -> float:
    """The sum of a gauge's samples on vLLM's Prometheus endpoint."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + "{") or line.startswith(name + " ")]
    if not values:
        raise RuntimeError(f"/metrics has no {name}")
    return sum(values)


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-new", type=int, default=16, help="most new tokens a request asks for")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--export", type=Path, help="a folder to keep the export in (reused when it holds one)")
    parser.add_argument("--prefix-cache-bytes", type=int,
                        help="the worker's prefix-cache budget in bytes (default: 4 GiB; 0: off)")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    folder = args.export or Path(tempfile.mkdtemp(prefix="vllm-soak-"))
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    model_dir = export(folder, args.seed)
    manifest = json.loads((model_dir / "compiled" / "graphs.json").read_text())
    buckets, max_length = manifest["buckets"], manifest["max_length"]
    block = (manifest.get("prefix_cache") or {}).get("block_size", 64)
    requests = make_requests(args.requests, rng, buckets, max_length, args.max_new, block)
    print(f"export {model_dir} ready in {time.monotonic() - t0:.0f} s: batch {manifest['batch_size']}, length "
          f"{max_length}, buckets {buckets}; {len(requests)} requests at concurrency {args.concurrency}", flush=True)

    port, log = free_port(), folder / "vllm-serve.log"
    url = f"http://127.0.0.1:{port}"
    process = start_server(model_dir, port, log, args.prefix_cache_bytes)
    try:
        reference = Reference(model_dir)  # solo tokens computed while the server starts
        for r in requests:
            if r.kind == "complete":
                reference(r.prompt, r.max_tokens)
        finals = [r for r in requests if r.kind == "complete"][: args.concurrency]
        final_requests = [Request(len(requests) + i, r.prompt, r.max_tokens, "complete") for i, r in enumerate(finals)]
        for r in final_requests:
            reference(r.prompt, r.max_tokens)
        print(f"solo tokens of {len(reference.known)} prompts computed; waiting for the server", flush=True)
        wait_healthy(process, url, log)
        print(f"server up at {url} after {time.monotonic() - t0:.0f} s", flush=True)
        model = str(model_dir)
        sampler = RssSampler(process.pid)
        sampler.start()
        rss = {"start": sampler.now()}
        finished, curve = [], []
        warm = max(1, len(requests) // 10)

        def on_done(r: Request) -> None:
            finished.append(r)
            if len(finished) % warm == 0:  # the tree's RSS after each tenth of the requests
                curve.append(sampler.now())
                rss.setdefault("warm", curve[0])
            if len(finished) % 50 == 0:
                print(f"  {len(finished)} / {len(requests)} requests done ({time.monotonic() - t0:.0f} s)", flush=True)

        load_start = time.monotonic()
        asyncio.run(run_load(url, model, requests, args.concurrency, on_done))
        load_seconds = time.monotonic() - load_start
        rss["end"] = sampler.now()

        # The end checks: the server answers, every slot is free, a full-concurrency batch gives the solo tokens.
        deadline = time.monotonic() + 60
        while True:
            running = metric(url, "vllm:num_requests_running")
            waiting = metric(url, "vllm:num_requests_waiting")
            if running == waiting == 0 or time.monotonic() > deadline:
                break
            time.sleep(1)
        asyncio.run(run_load(url, model, final_requests, args.concurrency))
        running_after = metric(url, "vllm:num_requests_running")
        health = httpx.get(f"{url}/health", timeout=30).status_code
        alive = process.poll() is None
        rss["final"] = sampler.now()
        sampler.done.set()
    finally:
        stop_server(process)

    mismatches, failures = [], []
    for r in requests + final_requests:
        if r.kind == "over_length":
            if r.outcome != "refused":
                failures.append(f"request {r.index} (over-length, prompt {len(r.prompt)}, max_tokens {r.max_tokens}):"
                                f" {r.outcome or 'no answer'} (tokens {r.tokens[:8]})")
        elif r.kind == "disconnect":
            if r.outcome not in ("disconnected", "completed"):
                failures.append(f"request {r.index} (disconnect): {r.outcome}")
            expected = reference(r.prompt, r.max_tokens)
            if r.tokens != expected[: len(r.tokens)]:  # the tokens it saw before leaving are the solo ones too
                mismatches.append(f"request {r.index} (disconnect after {len(r.tokens)}): got {r.tokens},"
                                  f" solo {expected}")
        elif r.outcome != "completed":
            failures.append(f"request {r.index} (prompt {len(r.prompt)}, max_tokens {r.max_tokens}): {r.outcome}")
        elif r.tokens != reference(r.prompt, r.max_tokens):
            mismatches.append(f"request {r.index} (prompt {len(r.prompt)}, max_tokens {r.max_tokens}): got {r.tokens},"
                              f" solo {reference(r.prompt, r.max_tokens)}")
    for line in mismatches:
        print("MISMATCH " + line)
    for line in failures:
        print("FAILED " + line)

    count = {k: sum(r.outcome == k for r in requests) for k in ("completed", "disconnected", "refused")}
    aborted = sum(len(line.split("Aborted request(s) ", 1)[1].split(",")) for line in log.read_text().splitlines()
                  if "Aborted request(s) " in line)
    ttft = [r.ttft for r in requests if r.ttft is not None]
    itl = [g for r in requests for g in r.gaps]
    mib = 2**20
    growth = 100 * (rss["end"] - rss["warm"]) / rss["warm"]
    final_ok = all(r.outcome == "completed" and r.tokens == reference(r.prompt, r.max_tokens) for r in final_requests)
    slots_free = running == waiting == running_after == 0
    print(f"\n| requests | completed | disconnected | over-length refused | mismatches | failures | load wall time |")
    print(f"|---|---|---|---|---|---|---|")
    print(f"| {len(requests)} at concurrency {args.concurrency} | {count['completed']} | {count['disconnected']} |"
          f" {count['refused']} of {sum(r.kind == 'over_length' for r in requests)} | {len(mismatches)} |"
          f" {len(failures)} | {load_seconds:.0f} s |")
    print(f"\nthe server aborted {aborted} requests (its log; a client that leaves after the last token aborts none)")
    print(f"\n| TTFT p50 / p99 | ITL p50 / p99 |"
          f" server tree RSS: start / after warm-up ({warm} requests) / end / max |")
    print(f"|---|---|---|")
    print(f"| {percentile(ttft, .5) * 1e3:.0f} / {percentile(ttft, .99) * 1e3:.0f} ms |"
          f" {percentile(itl, .5) * 1e3:.0f} / {percentile(itl, .99) * 1e3:.0f} ms |"
          f" {rss['start'] / mib:.0f} / {rss['warm'] / mib:.0f} / {rss['end'] / mib:.0f} /"
          f" {max(sampler.samples + [rss['end']]) / mib:.0f} MiB ({growth:+.1f}% warm-up -> end) |")
    print("server tree RSS after each tenth of the requests: " + " ".join(f"{b / mib:.0f}" for b in curve) + " MiB")
    print(f"\nend: /health {health}; server process alive {alive}; num_requests_running {running:.0f}, waiting"
          f" {waiting:.0f} after the load, running {running_after:.0f} after the final batch; final batch of"
          f" {len(final_requests)} at once: {'every one its solo tokens' if final_ok else 'NOT its solo tokens'}")
    ok = not mismatches and not failures and health == 200 and alive and slots_free and final_ok
    print("vllm soak: " + ("PASS" if ok else "FAIL"), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
