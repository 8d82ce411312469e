"""The short variant of `benchmarks/vllm_soak.py` (docs/soak.md): `vllm serve` on the harness's own tiny cpu export,
24 streamed requests at concurrency 4, two of them disconnecting mid-stream and one over-length. It is run as a user
runs it (`python benchmarks/vllm_soak.py ...` in a subprocess, from another working directory), and fails on any
mismatch against the export's solo greedy tokens, any failed or hung request, an over-length request not refused
with HTTP 400, a server that is down or holds a request at the end, or a final full-concurrency batch that does not
give its solo tokens (the harness's exit status and its PASS line)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from .conftest import environment

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "vllm_soak.py"


def test_a_short_vllm_soak_gives_every_completed_stream_its_solo_tokens(tmp_path):
    done = subprocess.run([sys.executable, str(BENCHMARK), "--requests", "24", "--concurrency", "4", "--seed", "0",
                           "--export", str(tmp_path / "soak")], cwd=tmp_path, env=environment(), capture_output=True,
                          text=True, timeout=1800)
    out = done.stdout
    assert done.returncode == 0 and "vllm soak: PASS" in out, f"{out[-4000:]}\n{done.stderr[-3000:]}"
    # 24 requests: round(10%) = 2 disconnect, round(5%) = 1 over-length, 21 complete; 0 mismatches, 0 failures.
    assert re.search(r"\| 24 at concurrency 4 \| 21 \| 2 \| 1 of 1 \| 0 \| 0 \|", out), out
    assert "/health 200; server process alive True; num_requests_running 0, waiting 0" in out, out
