"""docs/serving.md: every block is one the vLLM tests run as written (conftest.py's export, test_server.py's
`vllm serve` and curl, test_offline.py's Python block), and its install line names this session's pins."""

from __future__ import annotations

import shlex
from pathlib import Path

from .conftest import doc_blocks

ROOT = Path(__file__).resolve().parents[2]
# The commands the tests run, by how they start (conftest.doc_command); the pip line is checked below.
RUN = ("optimum-qwen35 export", "vllm serve", "curl", "pip install")


def test_every_block_is_run_by_the_vllm_tests():
    python = [code for language, code in doc_blocks() if language == "python"]
    assert len(python) == 1 and "LLM(" in python[0]  # test_offline.py's doc_run
    lines = [line for language, code in doc_blocks() if language == "bash" for line in code.splitlines() if line.strip()]
    assert [line for line in lines if not line.startswith(RUN)] == []
    assert sorted(next(p for p in RUN if line.startswith(p)) for line in lines) == sorted(RUN)


def test_the_install_line_names_the_sessions_pins():
    (line,) = [line for _, code in doc_blocks() for line in code.splitlines() if line.startswith("pip install")]
    pins = dict(p.split("==") for p in (ROOT / "constraints" / "vllm.txt").read_text().split() if "==" in p)
    named = [a for a in shlex.split(line)[2:] if "==" in a]
    assert named and all(pins[a.split("==")[0]] == a.split("==")[1] for a in named), (line, named)
