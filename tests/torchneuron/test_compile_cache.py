"""The TorchNeuron compile cache's Hub flow on what the check backend writes, across two processes.

TorchNeuron files each NEFF under a key hashed from the module handed to neuronx-cc and the compiler options
(docs/torchneuron.md, "The compile cache"): a cache filled on one machine serves another only if the other lowers
byte-identical modules. Here process A lowers tiny-2b's token-generation graphs (decode buckets 64 and 96) with the
check backend, files one entry per graph in TorchNeuron's layout (`<key>/<key>.neff`, the key computed as
torch-neuronx's `NEFFCacheKey`; the content is the StableHLO module itself, standing in for the NEFF neuronx-cc would
write) and pushes the folder to the stand-in Hub; process B, a fresh interpreter with its own Hugging Face cache and
an empty cache folder, lowers the same graphs, fetches the cache and must find the entry of every graph it lowered.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("torch_mlir", reason="torch-mlir is installed by the torchneuron nox session")

from optimum_qwen35.hub.compile_cache import CompileCacheKey, fetch_compile_cache, push_compile_cache
from optimum_qwen35.modeling.decoder import TokenGenerationGraph

from optimum_qwen35.backends.torchneuron.stablehlo_check import CheckBackend, loaded_context
from .models import load_decoder, state

REPO = "alice/neff-cache"
LAYOUT, BATCH, MAX_LENGTH, DECODE_BUCKETS = "tiny-2b", 2, 96, (64, 96)
# The compiler options TorchNeuron hashes beside the module (target, model type, -O level, auto-cast, framework, LNC,
# neuronx-cc version): fixed strings here, as no neuronx-cc runs.
OPTIONS = "trn2|transformer|2|none|XLA|2|2.22.0"
KEY = dict(
    model_id="Qwen/Qwen3.5-tiny", revision="0" * 40, instance_type="trn2.48xlarge", tp_degree=1, dtype="float32",
    buckets={"token": list(DECODE_BUCKETS)}, torch_neuronx_version="2.13.1.0",
)
REPO_ROOT = Path(__file__).resolve().parents[2]


def without_debug_info(stablehlo: str) -> str:
    from torch_mlir import ir  # torch-mlir is only in the torchneuron session (skipped above without it)

    with loaded_context():
        return ir.Module.parse(stablehlo).operation.get_asm(enable_debug_info=False)


def neff_key(module: bytes) -> str:
    """torch-neuronx's NEFFCacheKey: sha256 of (sha256 of the module, sha256 of the '|'-joined options)."""
    return hashlib.sha256(
        f"{hashlib.sha256(module).hexdigest()}:{hashlib.sha256(OPTIONS.encode()).hexdigest()}".encode()
    ).hexdigest()


def lower_token_graphs() -> list[tuple[str, str]]:
    """(StableHLO with debug info, without) of each decode bucket's token-generation graph."""
    torch.manual_seed(0)
    decoder = load_decoder(LAYOUT)
    out = []
    with torch.no_grad():
        for bucket in DECODE_BUCKETS:
            backend = CheckBackend(name=f"decode-{bucket}")
            graph = torch.compile(TokenGenerationGraph(decoder, key_length=bucket), backend=backend, fullgraph=True,
                                  dynamic=False)
            graph(torch.tensor([[4], [5]], dtype=torch.int32), torch.tensor([[3], [0]], dtype=torch.int32),
                  torch.tensor([0, -1], dtype=torch.int32), *state(decoder, BATCH, MAX_LENGTH))
            (lowered,) = backend.graphs
            out.append((lowered.stablehlo, without_debug_info(lowered.stablehlo)))
    return out


def fill_cache(cache_dir: Path, modules: list[str]) -> list[str]:
    """One entry per module in TorchNeuron's layout; returns the keys."""
    keys = []
    for text in modules:
        key = neff_key(text.encode())
        entry = cache_dir / key / f"{key}.neff"
        entry.parent.mkdir(parents=True, exist_ok=True)
        entry.write_bytes(text.encode())
        keys.append(key)
    return keys


def second_machine(cache_dir: str, endpoint: str) -> None:
    """Process B: lower, fetch, report which of its keys the fetched cache holds (JSON on stdout's last line)."""
    t = time.process_time()
    lowered = lower_token_graphs()
    lower_seconds = time.process_time() - t
    fetched = fetch_compile_cache(cache_dir, REPO, CompileCacheKey(**KEY), endpoint=endpoint)
    keys = [neff_key(plain.encode()) for _, plain in lowered]
    print(json.dumps({
        "present": [(Path(cache_dir) / k / f"{k}.neff").is_file() for k in keys],
        "fetched": sorted(fetched.fetched),
        "plain_sha": [hashlib.sha256(p.encode()).hexdigest() for _, p in lowered],
        "debug_sha": [hashlib.sha256(d.encode()).hexdigest() for d, _ in lowered],
        "lower_cpu_seconds": lower_seconds,
    }))


def test_a_second_process_lowers_the_same_modules_and_finds_them_in_the_fetched_cache(hub_server, tmp_path):
    hub_server.create_repo(REPO)
    t = time.process_time()
    lowered = lower_token_graphs()
    lower_seconds = time.process_time() - t
    plain = [p for _, p in lowered]
    assert all("stablehlo." in p and "loc(" not in p for p in plain)
    cache_a = tmp_path / "machine_a" / "neff_cache"
    keys = fill_cache(cache_a, plain)
    assert len(set(keys)) == len(DECODE_BUCKETS)  # one entry per bucket
    pushed = push_compile_cache(cache_a, REPO, CompileCacheKey(**KEY), token="hf_alice_write", endpoint=hub_server.url)
    assert len(pushed.uploaded) == len(DECODE_BUCKETS)

    cache_b = tmp_path / "machine_b" / "neff_cache"
    env = hub_server.client_env(tmp_path / "hf_b", token="hf_alice_read",
                                PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
                                OMP_NUM_THREADS="1")
    code = ("from tests.torchneuron.test_compile_cache import second_machine; "
            f"second_machine({str(cache_b)!r}, {hub_server.url!r})")
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    b = json.loads(done.stdout.strip().splitlines()[-1])
    # Process B's modules are byte-identical to A's (without debug info): every key it computes is in the cache.
    assert b["plain_sha"] == [hashlib.sha256(p.encode()).hexdigest() for p in plain]
    assert b["present"] == [True] * len(DECODE_BUCKETS)
    assert sorted(b["fetched"]) == sorted(f"{k}/{k}.neff" for k in keys)
    # The debug-info form names source locations: identical here (same checkout), which the next line reports.
    same_debug = b["debug_sha"] == [hashlib.sha256(d.encode()).hexdigest() for d, _ in lowered]
    paths = sorted({line.split('"')[1] for d, _ in lowered for line in d.splitlines() if 'loc("' in line})
    print(f"\nlowered {len(plain)} token-generation graphs: {lower_seconds:.1f} s CPU (process A),"
          f" {b['lower_cpu_seconds']:.1f} s (process B); module sizes {[len(p) for p in plain]} bytes;"
          f" debug-info text identical across the two processes: {same_debug}; source files named in it:"
          f" {len(paths)}, absolute: {sum(p.startswith('/') for p in paths)}")
