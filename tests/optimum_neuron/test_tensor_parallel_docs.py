"""docs/tensor_parallel.md's "Running on CPU" runs as written (issue 50, item 4): tensor parallelism through the
product, a TP 2 export made by the documented command and loaded by `Qwen35Runtime.from_export` and
`Qwen35NeuronModelForCausalLM.from_pretrained`, each giving the tokens of the same checkpoint exported at TP 1."""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("optimum.neuron", reason="needs optimum-neuron (the nox `optimum` session)")

DOC = Path(__file__).parents[2] / "docs" / "tensor_parallel.md"
CLI = [sys.executable, "-m", "optimum_qwen35"]


def section() -> str:
    text = DOC.read_text()
    return text[text.index("## Running on CPU") : text.index("\n## ", text.index("## Running on CPU") + 1)]


def commands() -> list[list[str]]:
    """The bash block's optimum-qwen35 commands (the pip line installs what this session has), as argument lists."""
    block = re.search(r"```bash\n(.*?)```", section(), re.S).group(1).replace("\\\n", " ")
    lines = [line.split("#")[0].strip() for line in block.splitlines()]
    return [shlex.split(line)[1:] for line in lines if line.startswith("optimum-qwen35 ")]


def test_the_documented_tensor_parallel_run_gives_the_tp1_tokens(tmp_path):
    assert "tests.kit" not in section().split("The sharded model is compared")[0]  # the product path, no test kit
    cmds = commands()
    assert [c[0] for c in cmds] == ["build-tiny", "export"]
    for cmd in cmds:
        subprocess.run(CLI + cmd, cwd=tmp_path, check=True, capture_output=True, timeout=900)
    export = cmds[1]
    tp1 = export[:-1] + ["tp1/"]
    tp1[tp1.index("--tensor_parallel_size") + 1] = "1"
    subprocess.run(CLI + tp1, cwd=tmp_path, check=True, capture_output=True, timeout=900)

    code = re.search(r"```python\n(.*?)```", section(), re.S).group(1)
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-4000:]
    runtime_tokens, model_out = run.stdout.strip().split("\n", 1)
    one = subprocess.run([sys.executable, "-c", code.replace('"tp2/"', '"tp1/"')], cwd=tmp_path, capture_output=True,
                         text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert one.returncode == 0, one.stderr[-4000:]
    want_tokens, want_out = one.stdout.strip().split("\n", 1)
    assert ast.literal_eval(runtime_tokens) == ast.literal_eval(want_tokens)
    assert len(ast.literal_eval(runtime_tokens)[0]) == 8
    assert model_out == want_out
