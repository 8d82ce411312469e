"""The benchmarks that no other test runs, each in its smallest form, as a user runs it from a fresh clone (issue 50
item 8): `python benchmarks/<name>.py ...` in a subprocess, from another working directory and without PYTHONPATH,
so that only the installed package and the benchmark's own folder are importable (an import of the tests or their
kit fails here; tests/test_layout.py checks the same statically). The figures are not checked (speed belongs to
the benchmarks); that each runs to its last table is. The other benchmarks' smallest forms: test_conversion_memory.py,
test_mtp_speculation_benchmark.py, test_soak.py, vllm/test_vllm_soak.py (vllm session: it needs vLLM), test_moe.py,
emulator/test_cost_model.py, kernels/, neuron_xla/ (test_real_shapes.py, test_projection.py,
test_benchmark_commands.py), torchneuron/ (docs/testing.md lists them)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run_benchmark(name: str, *args: str, cwd: Path, timeout: int = 600) -> str:
    """`python benchmarks/<name>.py args` from `cwd`, one torch thread, without the PYTHONPATH entries that hold a
    `tests` folder (a repository root): its stdout (its stderr in the assertion on failure)."""
    env = dict(os.environ)
    kept = [p for p in env.pop("PYTHONPATH", "").split(os.pathsep) if p and not (Path(p) / "tests").is_dir()]
    if kept:
        env["PYTHONPATH"] = os.pathsep.join(kept)
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{name} {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done.stdout


# name, smallest arguments, a line of its output that says it ran to the end
SMALLEST = {
    "fp8_weight_bytes": ((), "| 35B-A3B |"),
    "deltanet_bf16_products": (("--tokens", "128", "--seeds", "1"), "unit roundoff"),
    "moe_blockwise_kernel": (("--hidden", "128", "--tokens", "128", "--blocks", "32", "--static", "32"), "static form"),
    "moe_memory": (("--max-length", "256"), "trn2.48xlarge"),
    "prefix_cache": (("--prefix", "128", "--suffix", "8", "--block", "64", "--repeat", "1", "--vocab", "512"),
                     "bytes held after one cold prompt"),
}


@pytest.mark.parametrize("name", sorted(SMALLEST))
def test_the_benchmark_runs_from_a_fresh_clone(name, tmp_path):
    args, last = SMALLEST[name]
    assert last in run_benchmark(name, *args, cwd=tmp_path)


@pytest.mark.reference  # transformers 5's Qwen3.5 classes
def test_the_vision_benchmark_runs_from_a_fresh_clone(tmp_path):
    out = run_benchmark("vision_vs_transformers", "--sizes", "64", "--dtypes", "float32", "--repeat", "1",
                        "--image-buckets", "256", cwd=tmp_path)
    assert "64x64" in out and "first token equal" in out


@pytest.mark.reference  # transformers 5's Qwen3.5 classes
def test_the_cpu_benchmark_runs_from_a_fresh_clone(tmp_path):
    out = run_benchmark("cpu_vs_transformers", "--prompt", "8", "--decode", "2", "--batches", "1", "--dtypes", "float32",
                        "--repeat", "1", "--vocab", "512", "--layers", "LF", "--threads", "1", cwd=tmp_path)
    assert "equal greedy tokens" in out and "2/2" in out


ROOT = Path(__file__).resolve().parents[1]
# Where commands are documented: the README, docs/, and each benchmark's own usage lines.
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(BENCHMARKS.glob("*.py"))]
COMMAND = re.compile(r"python benchmarks/(\w+)\.py([^`#|\n]*)")


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(doc, benchmark, its flags) of every `python benchmarks/<name>.py ...` in README.md, docs/ and benchmarks/."""
    found = []
    for doc in DOCS:
        for name, rest in COMMAND.findall(doc.read_text()):
            found.append((doc.name, name, re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest)))
    return found


def test_every_documented_benchmark_command_names_a_benchmark_and_its_flags():
    """A documented command runs as written only if its file exists and takes every flag it is given (the runs
    above and the other sessions' tests run the smallest forms; this checks every documented spelling)."""
    commands = documented_commands()
    assert len(commands) > 20, "the docs' commands are read"
    wrong = []
    for doc, name, flags in commands:
        path = BENCHMARKS / f"{name}.py"
        if not path.is_file():
            wrong.append(f"{doc}: benchmarks/{name}.py does not exist")
            continue
        source = path.read_text()
        wrong += [f"{doc}: benchmarks/{name}.py takes no {flag}" for flag in flags
                  if f'"{flag}"' not in source and flag != "--help"]
    assert not wrong, "\n".join(wrong)
