"""vLLM 0.11.0 serving exports through optimum-neuron 0.4.5's platform: the nox `vllm` session only (the `neuron`
environment plus vLLM; docs/serving.md). Elsewhere this folder is not collected; there it must be.

The export every test serves is made once, by docs/serving.md's own export command (the checkpoint path replaced
by a tiny checkpoint), in the session's folder.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("optimum.neuron") is None:
    collect_ignore_glob = ["*.py"]

# vLLM forks its engine process from this one (`vllm.LLM(...)` in test_offline.py). A fork taken after torch's OpenMP
# pool has started deadlocks the child's first parallel op (seen: the engine idle in `torch.zeros` for 37 minutes when
# the session ran with torch's default threads). One thread from the start, as this folder's subprocesses get.
os.environ["OMP_NUM_THREADS"] = "1"
if importlib.util.find_spec("torch") is not None:
    import torch

    torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "serving.md"
EXPORT = "qwen35-cpu/"  # the export folder docs/serving.md names
SEQUENCE_LENGTH, BATCH_SIZE = 256, 4  # what its export command compiles


def doc_blocks() -> list[tuple[str, str]]:
    return re.findall(r"^```(bash|python)\n(.*?)^```", DOC.read_text(), re.S | re.M)


def doc_command(start: str) -> str:
    """The one command of docs/serving.md that starts with `start`."""
    found = [line for _, code in doc_blocks() for line in code.splitlines() if line.startswith(start)]
    assert len(found) == 1, f"docs/serving.md should have one `{start}` command, found {found}"
    return found[0]


def doc_python(containing: str) -> str:
    found = [code for language, code in doc_blocks() if language == "python" and containing in code]
    assert len(found) == 1, f"docs/serving.md should have one python block with {containing!r}"
    return found[0]


def environment() -> dict:
    """This interpreter's commands first on PATH; one torch thread (two cores shared with the test process)."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "OMP_NUM_THREADS": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="session")
def work(tmp_path_factory) -> Path:
    """A folder holding docs/serving.md's export, made by its command."""
    from tests.kit import build_tiny_checkpoint

    folder = tmp_path_factory.mktemp("serving")
    checkpoint = build_tiny_checkpoint(folder / "checkpoint", "tiny-2b")
    command = doc_command("optimum-qwen35 export").replace("path/to/checkpoint", str(checkpoint))
    assert f"--batch_size {BATCH_SIZE} --sequence_length {SEQUENCE_LENGTH}" in command
    result = subprocess.run(shlex.split(command), cwd=folder, env=environment(), capture_output=True, text=True,
                            timeout=1200)
    assert result.returncode == 0, f"`{command}` fails:\n{result.stderr[-3000:]}"
    return folder


@pytest.fixture(scope="session")
def reference(work):
    """The export loaded by this package's class: `generate()` is what vLLM must return."""
    from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM

    model = Qwen35NeuronModelForCausalLM.from_pretrained(work / EXPORT)
    yield model
    model.close()


def greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """`generate()`'s greedy tokens for one prompt alone (stopping at the export's EOS, as vLLM does)."""
    import torch

    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    tokens = out[0, len(prompt):].tolist()
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or ())
    for i, token in enumerate(tokens):  # generate() pads a finished row; vLLM returns the EOS and stops
        if token in eos:
            return tokens[: i + 1]
    return tokens


def prompts(lengths, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of the given lengths (ordinary tokens of the tiny vocabulary, no special ones)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(n)] for n in lengths]
