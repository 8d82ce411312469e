"""Every command and snippet of README.md and docs/optimum_neuron.md, run in order the way a user on a fresh machine
would (a doc that drifts from the code fails here).

Each document runs in its own empty folder: its ```bash blocks line by line through bash (`python` and the
`optimum-qwen35` command are this environment's), its ```python blocks in one Python process that keeps its names
from block to block, as a session pasting them would. `pip install` lines are checked with pip itself
(`--dry-run --no-deps --no-index` on this checkout, after checking the torch pin), not run. A few substitutions keep
the run small; each is listed below with the reason, and a block that is neither run nor listed as not run fails
the test. Hub commands talk to the loopback stand-in Hub through HF_ENDPOINT (never huggingface.co).

This runs in the `optimum` session: it has optimum-neuron, which the optimum sections name, and everything the
other blocks need (the blocks that need transformers 5 are none).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("optimum.neuron", reason="needs optimum-neuron (the nox `optimum` session)")

ROOT = Path(__file__).resolve().parents[2]
TORCH_PIN = "torch==2.13.0"  # the noxfile's pin: a looser one pulls a CUDA build
HUB_TOKEN = "hf_doc_write"

# Blocks not run, by their first line, and why.
NOT_RUN = {
    "pip install nox && nox": "it is the CI command itself (.ci/run runs it; tests/test_readme.py checks that)",
}
# (document, text in a block, replacement, why). Every substitution must apply, so a stale one fails too.
SUBSTITUTIONS = [
    ("README.md", '"path/to/checkpoint"', '"tiny-checkpoint"', "a tiny checkpoint built first stands in for a download"),
    ("README.md", "path/to/checkpoint", "tiny-checkpoint", "the same, in commands"),
    ("README.md", "--sequence_length 1024", "--sequence_length 128",
     "one context bucket: 3 graphs instead of 12 (docs/optimum_neuron.md gives the cost of each)"),
    ("docs/optimum_neuron.md", "--sequence_length 256", "--sequence_length 128", "one context bucket, as above"),
    ("docs/optimum_neuron.md", "sequence_length=256", "sequence_length=128", "the same export from Python"),
]
# Set up before a document runs (shell, in its folder): what the substitutions refer to.
SETUP = {"README.md": [f"{sys.executable} -m optimum_qwen35 build-tiny tiny-checkpoint"], "docs/optimum_neuron.md": []}
DOCS = list(SETUP)

PYTHON_DRIVER = r"""
import json, sys, traceback
namespace = {"__name__": "__main__"}
for line in sys.stdin:
    try:
        exec(compile(json.loads(line), "doc block", "exec"), namespace)
        status = "ok"
    except BaseException:
        status = traceback.format_exc()
    sys.stdout.flush(); sys.stderr.flush()
    print("\0DOC-BLOCK " + json.dumps(status), flush=True)
"""


def blocks(document: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced bash/python block, in order."""
    return re.findall(r"^```(bash|python)\n(.*?)^```", (ROOT / document).read_text(), re.S | re.M)


def substituted(document: str, code: str, used: set) -> str:
    for i, (doc, old, new, _why) in enumerate(SUBSTITUTIONS):
        if doc == document and old in code:
            code = code.replace(old, new)
            used.add(i)
    return code


def check_pip_line(line: str) -> None:
    """A `pip install` line: torch pinned as the noxfile pins it, the rest accepted by pip for this checkout."""
    args = shlex.split(line, comments=True)
    assert args[:2] == ["pip", "install"], line
    args = args[2:]
    if any(a.startswith("torch") for a in args):
        assert TORCH_PIN in args, f"{line}: torch must be pinned as {TORCH_PIN}"
        args = [a for a in args if a != TORCH_PIN]
    if args in (["nox"],):
        return
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--no-index", "--no-build-isolation", "-q", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, f"pip rejects `{line}`: {result.stderr.strip().splitlines()[-1:]}"


def shell_lines(code: str) -> list[str]:
    """The commands of a bash block: continuation lines joined, comments and blank lines dropped."""
    joined = code.replace("\\\n", " ")
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


class PythonSession:
    def __init__(self, cwd: Path, env: dict):
        self.stderr = open(cwd / ".python-stderr", "w+")
        self.process = subprocess.Popen(
            [sys.executable, "-c", PYTHON_DRIVER], cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.stderr, text=True,
        )

    def run(self, code: str) -> tuple[str, str]:
        self.process.stdin.write(json.dumps(code) + "\n")
        self.process.stdin.flush()
        out = []
        for line in self.process.stdout:
            if line.startswith("\0DOC-BLOCK "):
                return json.loads(line[len("\0DOC-BLOCK "):]), "".join(out)
            out.append(line)
        raise AssertionError("the Python session ended:\n" + self.errors())

    def errors(self) -> str:
        self.stderr.flush()
        self.stderr.seek(0)
        return self.stderr.read()

    def close(self):
        self.process.stdin.close()
        self.process.wait(timeout=120)
        self.stderr.close()


@pytest.fixture()
def doc_hub(monkeypatch):
    from huggingface_hub import constants

    from optimum_qwen35.testing.hub_server import HubServer

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True, raising=False)
    with HubServer(tokens={HUB_TOKEN: ("my-org", True)}) as server:
        yield server


@pytest.mark.slow
@pytest.mark.parametrize("document", DOCS)
def test_every_snippet_runs_as_written(document, tmp_path, doc_hub):
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "HF_ENDPOINT": doc_hub.url,
        "HF_TOKEN": HUB_TOKEN,
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_HUB_DISABLE_XET": "1",
    }
    work = tmp_path / "work"
    work.mkdir()
    for command in SETUP[document]:
        subprocess.run(shlex.split(command), cwd=work, env=env, check=True, capture_output=True, timeout=300)
    used: set[int] = set()
    python = None
    ran = 0
    try:
        for language, code in blocks(document):
            first = code.strip().splitlines()[0]
            if first in NOT_RUN:
                continue
            code = substituted(document, code, used)
            if language == "python":
                python = python or PythonSession(work, env)
                status, _ = python.run(code)
                assert status == "ok", f"{document}: this block fails:\n{code}\n{status}"
            else:
                for line in shell_lines(code):
                    for part in line.split(" && "):
                        if part.strip().startswith("pip install"):
                            check_pip_line(part.strip())
                            continue
                        result = subprocess.run(["bash", "-c", part], cwd=work, env=env, capture_output=True, text=True, timeout=900)
                        assert result.returncode == 0, f"{document}: `{part}` fails:\n{result.stderr[-3000:]}"
            ran += 1
        if python is not None:
            noise = [line for line in python.errors().splitlines() if "are not valid and may be ignored" in line
                     or "No major for neuron device" in line or "override the platform target" in line]
            assert noise == [], f"{document}: the snippets printed {noise}"
    finally:
        if python is not None:
            python.close()
    assert ran >= 2
    stale = [s[:3] for i, s in enumerate(SUBSTITUTIONS) if s[0] == document and i not in used]
    assert stale == [], f"substitutions that no longer apply (the doc changed): {stale}"
