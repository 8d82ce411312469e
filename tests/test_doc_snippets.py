"""Every command and snippet of README.md and docs/*.md, run in order the way a user on a fresh machine would (a
doc that drifts from the code fails here).

Each document names the environment it runs in (`DOCUMENTS`): "optimum" (optimum-neuron 0.4.5, transformers 4.57:
the nox `optimum` session), "reference" (transformers 5: the `reference` session), "torchneuron" (the TorchNeuron
stack: Python 3.13, torch 2.14, transformers 5, optimum 2.x without optimum-neuron: the `torchneuron` session) or "vllm"
(docs/serving.md, whose blocks tests/vllm runs: `RUN_BY_OTHER_TESTS`); a section of a document may run in another
environment than the rest of it (`SECTIONS`: README's TorchNeuron quick start); a document with no runnable
block says None, and a new document fails `test_every_document_names_its_environment` until it is listed. Each
document runs in its own empty folder: its ```bash blocks line by line through bash (`python` and the
`optimum-qwen35` command are this environment's), its ```python blocks in one Python process that keeps its names
from block to block, as a session pasting them would. `pip install` lines are checked with pip itself
(`--dry-run --no-deps --no-index` on this checkout, after checking the torch pin and that only torch comes from
PyTorch's CPU index), not run; nor are `python -m venv DIR && source DIR/bin/activate` lines (the session's
environment stands in for the venv). Diagrams and other
text use plain ``` fences. A few substitutions keep the run small; each is listed below with the reason, and a block
that is neither run nor listed as not run fails the test. Hub commands talk to the loopback stand-in Hub through
HF_ENDPOINT (never huggingface.co).
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

ROOT = Path(__file__).resolve().parents[1]
TORCH_PIN = "torch==2.13.0"  # the noxfile's pin: a looser one pulls a CUDA build
TORCH_PINS = {"torchneuron": "torch==2.14.0"}  # the TorchNeuron stack's (the noxfile's TORCHNEURON_TORCH)
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # where a user's pip finds its CPU build
# `python -m venv DIR && source DIR/bin/activate`: checked (the same folder), not run: the snippets run in the nox
# session's environment, which is what such a venv holds after the documented installs.
VENV = re.compile(r"python -m venv (\S+)")
ACTIVATE = re.compile(r"source (\S+)/bin/activate")
HUB_TOKEN = "hf_doc_write"
HUB_USER = "my-org"  # the docs' namespace; the token may write there


def _environment() -> str | None:
    import importlib.util  # noqa: PLC0415

    import transformers  # noqa: PLC0415

    if int(transformers.__version__.split(".")[0]) >= 5:
        # optimum's CLI itself (this package's register file alone makes `optimum.commands` a namespace package)
        if importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.commands.base"):
            return "torchneuron"  # optimum 2.x's CLI with transformers 5: no optimum-neuron can be there
        return "reference"
    if importlib.util.find_spec("optimum.neuron") is not None:
        return "optimum"
    return None


ENVIRONMENT = _environment()
# Where each document runs (None: it has no bash/python block).
DOCUMENTS = {
    "README.md": "optimum",
    "docs/optimum_neuron.md": "optimum",
    "docs/hub.md": "optimum",  # the compile-cache registry functions need optimum-neuron
    "docs/kernels.md": "reference",
    "docs/nki_emulator.md": "reference",
    "docs/tensor_parallel.md": "reference",
    "docs/moe.md": "optimum",  # its second half exports through optimum-cli and optimum-neuron's class
    "docs/vision.md": "optimum",  # its second block exports through optimum-neuron's class
    "docs/evaluation.md": "optimum",  # lm-eval is in the optimum session (the `eval` extra)
    "docs/model.md": None,
    "docs/neuron_backend.md": None,
    "docs/testing.md": None,
    "docs/serving.md": "vllm",  # run by tests/vllm (RUN_BY_OTHER_TESTS)
    "docs/prefix_caching.md": "reference",
    "docs/speculative_decoding.md": "optimum",  # its export + generate blocks go through optimum-neuron's class
    "docs/torchneuron.md": "optimum",  # its block exports for trn2 through optimum-neuron's class
    "docs/torchneuron_stack.md": None,  # its flow runs as tests/torchneuron_stack (Python 3.13, no optimum-neuron)
    "docs/fp8.md": "reference",
    # its commands are benchmarks/soak.py's and vllm_soak.py's, run in small form by tests/test_soak.py and
    # tests/vllm/test_vllm_soak.py
    "docs/soak.md": None,
}
# Sections (document, the heading they start with, up to the next heading of level 2 or 3) whose blocks run in
# another environment than the rest of the document.
SECTIONS = {("README.md", "### TorchNeuron stack"): "torchneuron"}
# Documents whose blocks other tests run as written, and where: a server must be started, queried and stopped.
RUN_BY_OTHER_TESTS = {
    "docs/serving.md": "tests/vllm (the nox `vllm` session) runs its commands and its Python block as written, "
                       "starting and stopping the server (tests/vllm/test_docs.py checks that it runs them all)",
}
# Blocks not run, by their first line, and why.
NOT_RUN = {
    "pip install nox && nox": "it is the CI command itself (.ci/run runs it; tests/test_readme.py checks that)",
}
# (document, text in a block, replacement, why). Every substitution must apply, so a stale one fails too.
SUBSTITUTIONS = [
    ("README.md", "--sequence_length 256", "--sequence_length 128",
     "one context bucket: 3 graphs instead of 6 (docs/optimum_neuron.md gives the cost of each)"),
    ("docs/optimum_neuron.md", "--sequence_length 256", "--sequence_length 128", "one context bucket, as above"),
    ("docs/optimum_neuron.md", "sequence_length=256", "sequence_length=128", "the same export from Python"),
    ("docs/tensor_parallel.md", '"path/to/Qwen3.5-2B"', '"tiny-checkpoint"', "a tiny checkpoint stands in for the 2B"),
    ("docs/prefix_caching.md", '"path/to/Qwen3.5-checkpoint"', '"tiny-checkpoint"', "a tiny checkpoint stands in"),
    ("docs/speculative_decoding.md", '"path/to/checkpoint"', '"tiny-checkpoint"', "a tiny checkpoint stands in"),
    ("docs/speculative_decoding.md", "--model path/to/checkpoint", "--model tiny-checkpoint", "the same, exported"),
    ("docs/torchneuron.md", '"path/to/Qwen3.5-2B"', '"tiny-checkpoint"', "a tiny checkpoint stands in for the 2B"),
    ("docs/torchneuron.md", "tensor_parallel_size=4", "tensor_parallel_size=1",
     "one rank: the TP 4 worker pool is tests/test_torchneuron_backend.py's (at TP 2)"),
    ("docs/torchneuron.md", "sequence_length=4096", "sequence_length=128", "one context bucket"),
    ("docs/hub.md", "optimum-qwen35 neff-cache p", "TORCH_NEURONX_NEFF_CACHE_DIR=neff_cache optimum-qwen35 neff-cache p",
     "TorchNeuron's cache folder in the document's own folder (a stand-in cache, SETUP), not /tmp/neff_cache"),
    ("docs/hub.md", "--dtype bfloat16 --buckets", "--dtype bfloat16 --torch-neuronx-version 2.14.3.0 --buckets",
     "torch-neuronx is not installed here: its version is given"),
    ("docs/hub.md", 'dtype="bfloat16", buckets=', 'dtype="bfloat16", torch_neuronx_version="2.14.3.0", buckets=',
     "the same, from Python"),
    ("docs/hub.md", 'push_compile_cache("/tmp/neff_cache"', 'push_compile_cache("neff_cache"', "the stand-in cache"),
    ("docs/hub.md", "fetch_compile_cache(None,", 'fetch_compile_cache("neff_cache_fetched",',
     "a folder of the document's own, not /tmp/neff_cache"),
]
BUILD_TINY = f"{sys.executable} -m optimum_qwen35 build-tiny tiny-checkpoint"
# Set up before a document runs, in its folder: shell commands, and what the stand-in Hub must hold.
SETUP = {
    "docs/tensor_parallel.md": [BUILD_TINY],
    "docs/prefix_caching.md": [BUILD_TINY],
    "docs/speculative_decoding.md": [BUILD_TINY],
    "docs/torchneuron.md": [BUILD_TINY],
    # `out/`: an export of a local copy of "Qwen/Qwen3.5-2B" (here the tiny checkpoint, also on the stand-in Hub).
    "docs/hub.md": [
        BUILD_TINY,
        f"{sys.executable} -m optimum_qwen35 export --model tiny-checkpoint --batch_size 4 --sequence_length 128 "
        "--torch_dtype bfloat16 --target cpu out/",
        # A TorchNeuron cache folder for the neff-cache commands: one entry in its layout (not a NEFF: no compiler).
        f"{sys.executable} -c \"import pathlib; p = pathlib.Path('neff_cache/0f0f/0f0f.neff'); "
        "p.parent.mkdir(parents=True); p.write_bytes(b'a stand-in, not a NEFF')\"",
    ],
}
HUB_SETUP = {
    # The stand-in "Qwen/Qwen3.5-2B" holds the tiny checkpoint's config in bfloat16, the real model's dtype (the dtype
    # is part of the registry digest: docs/hub.md).
    "docs/hub.md": {"create": ["my-org/neuron-cache"], "upload": {"Qwen/Qwen3.5-2B": "tiny-checkpoint/config.json"},
                    "dtype": "bfloat16"},
}
# (document, text of the command or block, text its output must hold, why): running is not enough where the doc
# says what comes out. Every expectation must be met by some command or block.
EXPECTED_OUTPUT = [
    ("docs/hub.md", "optimum-cli neuron cache lookup", "bfloat16", "optimum-neuron's lookup lists the synced export"),
    ("docs/hub.md", "optimum-qwen35 cache lookup", "cpu  4  128  1  bfloat16", "this package's lookup finds it"),
    ("docs/hub.md", "print(lookup_registry(", "'batch_size': 4", "lookup_registry returns the entry"),
    ("docs/hub.md", "optimum-qwen35 pull", "snapshots", "pull prints the downloaded folder"),
    ("docs/hub.md", "optimum-qwen35 neff-cache push", "pushed 1 file(s)", "the stand-in cache's entry is pushed"),
    ("docs/hub.md", "optimum-qwen35 neff-cache list", "trn2.48xlarge  tp 4  bfloat16  context=128,1024;token=1024",
     "list names the pushed configuration"),
    ("docs/hub.md", "print(result.hit", "True ['0f0f/0f0f.neff'] []", "fetch writes the entry into a new folder"),
    ("docs/moe.md", "print(config.num_experts", "6 2 ['tp', 'ep', 'ep']", "the tiny MoE layout and the 'auto' rule"),
    ("docs/moe.md", "moe_parallel", "ep\n", "the TP 2 export records its experts split by whole experts"),
]

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


def blocks(document: str, environment: str | None = None) -> list[tuple[str, str]]:
    """(language, code) of each fenced bash/python block, in order; with `environment`, only those that run there."""
    text = (ROOT / document).read_text()
    found = [(m.start(), m.group(1), m.group(2)) for m in re.finditer(r"^```(bash|python)\n(.*?)^```", text, re.S | re.M)]
    if environment is None:
        return [(language, code) for _, language, code in found]
    return [(language, code) for start, language, code in found if block_environment(document, text, start) == environment]


def block_environment(document: str, text: str, start: int) -> str | None:
    """The environment of the block starting at `start`: its section's (SECTIONS), else its document's."""
    for (doc, heading), environment in SECTIONS.items():
        if doc == document:
            begin = text.index("\n" + heading) + 1
            following = re.search(r"^#{2,3} ", text[begin + len(heading):], re.M)
            end = begin + len(heading) + following.start() if following else len(text)
            if begin <= start < end:
                return environment
    return DOCUMENTS[document]


def runs() -> list[tuple[str, str]]:
    """(document, environment) of every document part that has blocks to run."""
    parts = [(d, e) for d, e in DOCUMENTS.items() if e is not None]
    return parts + [(d, e) for (d, _), e in SECTIONS.items() if (d, e) not in parts]


def substituted(document: str, code: str, used: set) -> str:
    for i, (doc, old, new, _why) in enumerate(SUBSTITUTIONS):
        if doc == document and old in code:
            code = code.replace(old, new)
            used.add(i)
    return code


def check_pip_line(line: str, environment: str | None = None) -> None:
    """A `pip install` line: torch pinned as the noxfile pins it, the rest accepted by pip for this checkout."""
    args = shlex.split(line, comments=True)
    assert args[:2] == ["pip", "install"], line
    args = args[2:]
    pin = TORCH_PINS.get(environment, TORCH_PIN)
    if any(a.startswith("torch") for a in args):
        assert pin in args, f"{line}: torch must be pinned as {pin}"
        args = [a for a in args if a != pin]
    if "--index-url" in args:  # torch alone, from PyTorch's CPU index; the rest comes from PyPI in the next line
        assert args == ["--index-url", TORCH_CPU_INDEX], f"{line}: only torch comes from {TORCH_CPU_INDEX}"
        return
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

    from tests.kit.hub_server import HubServer

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True, raising=False)
    with HubServer(tokens={HUB_TOKEN: (HUB_USER, True)}) as server:
        yield server


def documents() -> list[str]:
    return ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


def test_every_document_names_its_environment():
    unlisted = [d for d in documents() if d not in DOCUMENTS]
    assert unlisted == [], f"add {unlisted} to DOCUMENTS (the environment its blocks run in, or None)"
    gone = [d for d in DOCUMENTS if not (ROOT / d).is_file()]
    assert gone == [], f"DOCUMENTS lists documents that do not exist: {gone}"
    for document, environment in DOCUMENTS.items():
        if environment is None:
            assert blocks(document) == [], f"{document} has bash/python blocks: name its environment in DOCUMENTS"


# What a block writes into the reader's folder: (pattern, language); group 1 is the path.
WRITES = [
    (r"save_pretrained\(\s*[\"']([^\"']+)", "python"),
    (r"build_tiny_checkpoint\(\s*[\"']([^\"']+)", "python"),
    (r"\.save\(\s*[\"']([^\"']+)", "python"),
    (r"build-tiny\s+(\S+)", "bash"),
    (r"(?:optimum-qwen35|optimum-cli)\s+export\b.*\s(\S+)\s*$", "bash"),
    (r"optimum-qwen35\s+shard\b.*\s(\S+)\s*$", "bash"),
]


def written_paths(document: str, environment: str | None = None) -> set[str]:
    """The top-level files and folders a document's blocks (those of `environment`) create in the folder they run in."""
    found = set()
    for language, code in blocks(document, environment):
        lines = [line.split(" #")[0] for line in shell_lines(code)] if language == "bash" else [code]
        for line in lines:
            for pattern, kind in WRITES:
                if kind == language:
                    for match in re.finditer(pattern, line, re.M):
                        path = match.group(1).removeprefix("./").rstrip("/").split("/")[0]
                        if not path.startswith("-"):
                            found.add(path)
    return found


def test_documents_read_in_order_in_one_folder_do_not_collide():
    """A reader runs README.md and then the docs in one folder of one environment: a page that writes a folder an
    earlier page wrote (docs/vision.md's `out/` after docs/optimum_neuron.md's) fails for them after minutes of
    compiling, although each page passes alone in its own folder (test_every_snippet_runs_as_written)."""
    for environment in {e for _, e in runs()}:
        seen: dict[str, str] = {}
        for document in (d for d, e in runs() if e == environment):
            for path in sorted(written_paths(document, environment)):
                assert path not in seen, f"{document} writes {path}/, which {seen[path]} wrote before it: rename one"
                seen[path] = document


def test_the_collision_check_sees_what_each_page_writes():
    assert {"tiny-qwen3.5", "qwen35-export", "shards"} <= written_paths("README.md", "optimum")
    assert written_paths("README.md", "torchneuron") == {"tiny-qwen3.5", "qwen35-trn2"}
    assert {"tiny-vl", "vision-export", "vision-cli-export", "photo.png"} <= written_paths("docs/vision.md")
    assert {"tiny", "out", "out-python"} <= written_paths("docs/optimum_neuron.md")


def _run_setup(document: str, work: Path, env: dict, hub) -> None:
    for command in SETUP.get(document, []):
        result = subprocess.run(shlex.split(command), cwd=work, env=env, capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, f"setup `{command}` fails:\n{result.stderr[-3000:]}"
    setup = HUB_SETUP.get(document, {})
    for repo_id in setup.get("create", []):
        hub.create_repo(repo_id)
    for repo_id, source in setup.get("upload", {}).items():
        config = json.loads((work / source).read_text())
        config.get("text_config", config)["dtype"] = setup["dtype"]
        hub.create_repo(repo_id)
        hub.upload(repo_id, {Path(source).name: json.dumps(config).encode()})


def _check_output(document: str, code: str, output: str, met: set) -> None:
    for i, (doc, text, expected, why) in enumerate(EXPECTED_OUTPUT):
        if doc == document and text in code:
            assert expected in output, f"{document}: `{text}` should print {expected!r} ({why}); it printed:\n{output[-2000:]}"
            met.add(i)


@pytest.mark.slow
@pytest.mark.parametrize("document, environment", runs())
def test_every_snippet_runs_as_written(document, environment, tmp_path, doc_hub):
    if document in RUN_BY_OTHER_TESTS:
        pytest.skip(f"{document}: {RUN_BY_OTHER_TESTS[document]}")
    if environment != ENVIRONMENT:
        pytest.skip(f"{document} ({environment} part) runs in the {environment} environment (this is {ENVIRONMENT})")
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "HF_ENDPOINT": doc_hub.url,
        "HF_TOKEN": HUB_TOKEN,
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_HUB_DISABLE_XET": "1",
        # The test kit (tests/kit: the stand-in Hub, the TP harness) is imported from a checkout, as the pages say.
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    }
    env.pop("CUSTOM_CACHE_REPO", None)
    work = tmp_path / "work"
    work.mkdir()
    _run_setup(document, work, env, doc_hub)
    used: set[int] = set()
    met: set[int] = set()
    python = None
    venv = None  # the folder of the last `python -m venv` line
    ran = 0
    try:
        for language, code in blocks(document, environment):
            first = code.strip().splitlines()[0]
            if first in NOT_RUN:
                continue
            code = substituted(document, code, used)
            if language == "python":
                python = python or PythonSession(work, env)
                status, output = python.run(code)
                assert status == "ok", f"{document}: this block fails:\n{code}\n{status}"
                _check_output(document, code, output, met)
            else:
                for line in shell_lines(code):
                    for part in line.split(" && "):
                        if part.strip().startswith("pip install"):
                            check_pip_line(part.strip(), environment)
                            continue
                        if VENV.fullmatch(part.strip()):
                            venv = VENV.fullmatch(part.strip()).group(1)
                            continue
                        if ACTIVATE.fullmatch(part.strip()):
                            assert ACTIVATE.fullmatch(part.strip()).group(1) == venv, f"{document}: `{line}`"
                            continue
                        result = subprocess.run(["bash", "-c", part], cwd=work, env=env, capture_output=True, text=True, timeout=900)
                        assert result.returncode == 0, f"{document}: `{part}` fails:\n{result.stderr[-3000:]}"
                        _check_output(document, part, result.stdout, met)
            ran += 1
        if python is not None:
            noise = [line for line in python.errors().splitlines() if "are not valid and may be ignored" in line
                     or "No major for neuron device" in line or "override the platform target" in line]
            assert noise == [], f"{document}: the snippets printed {noise}"
    finally:
        if python is not None:
            python.close()
    assert ran >= 1
    elsewhere = "".join(code for e in {e for d, e in runs() if d == document} - {environment}
                        for _, code in blocks(document, e))  # (the blocks of the document's other environments)
    stale = [s[:3] for i, s in enumerate(SUBSTITUTIONS) if s[0] == document and i not in used and s[1] not in elsewhere]
    assert stale == [], f"substitutions that no longer apply (the doc changed): {stale}"
    unmet = [e[:3] for i, e in enumerate(EXPECTED_OUTPUT) if e[0] == document and i not in met]
    assert unmet == [], f"expected outputs of commands the doc no longer has: {unmet}"
