"""Test environments.

Reference parity needs transformers >= 5 (it has `qwen3_5`), while optimum-neuron 0.4.x pins
transformers ~= 4.57: the two cannot share one environment, so each gets its own session.
`torch==2.13.0` is named explicitly: it is the local CPU build, a looser pin may pull a CUDA build.

The third, `neuron`, is the Neuron targets' path as far as a machine without the Neuron SDK goes: torch 2.8 and
torch-xla 2.8 (what Neuron SDK 2.26 pins; PyPI has torch 2.8 only as a CUDA build, about 6 GB with its nvidia
wheels), optimum-neuron 0.4.5, neuronx-distributed 0.15 built from its open source in ../shared/upstream (PyPI has
a placeholder), and import stand-ins for the SDK's closed modules (tests/neuron_sdk_standin).

The fourth, `vllm`, is that environment plus vLLM 0.11.0 (optimum-neuron 0.4.5's `vllm` extra): `vllm serve` and
`vllm.LLM` on exports through optimum-neuron's vLLM platform (docs/serving.md). On 2 cores shared with other jobs
its tests took 17 minutes of wall time (3.8 minutes of CPU: vLLM's start-ups wait on imports and processes).

The fifth, `torchneuron`, is the TorchNeuron stack as AWS ships it (issue 48): Python 3.13, torch 2.14 (PyPI's build,
about 5 GB with its CUDA wheels; it runs on CPU), transformers 5.25, optimum 2.x's base CLI, upstream torch-mlir
from PyPI, and no optimum-neuron (asserted): the model's graphs through a torch.compile check backend that follows
TorchNeuron's pipeline down to StableHLO (tests/torchneuron, docs/torchneuron.md), the stack's entry points
(tests/torchneuron_stack, the command line) and the README's TorchNeuron quick start as written. The sixth,
`torchneuron_smoke`, is the same stack's smallest run on Python 3.12: install, export, generate.

`prefetch`, run first, starts the installs of the sessions after `reference` in the background, so that their
downloads overlap the reference session's tests ("installing ahead" below). Tests marked `matrix` (further points of
a dtype / TP / layout matrix CI runs at one point) run only with `-- --deep` (tests/conftest.py).
"""

import fcntl
import filecmp
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path
from stat import S_ISREG

import nox

nox.options.sessions = ["prefetch", "reference", "optimum", "neuron", "vllm", "torchneuron", "torchneuron_smoke"]
nox.options.reuse_existing_virtualenvs = True

TORCH = "torch==2.13.0"
HF_KERNELS = "kernels"  # Hugging Face's hub kernels package (PyPI `kernels`), pinned in constraints/reference.txt

# Every package each test session installs, pinned (constraints/<session>.txt: `pip freeze` of that session's
# environment), so that a session builds the same environment whatever PyPI serves that day. They are updated on
# purpose, in their own commit: `OPTIMUM_QWEN35_UPDATE_PINS=1 nox -s <session> --install-only` installs without the
# constraints, from today's PyPI, and writes the new freeze (docs/testing.md, "Pinned environments").
CONSTRAINTS = Path(__file__).parent / "constraints"
UPDATE_PINS = os.environ.get("OPTIMUM_QWEN35_UPDATE_PINS") == "1"
# Installed from this repository or from a local source, never from PyPI: not pinned.
LOCAL_PACKAGES = ("optimum_qwen35", "optimum-qwen35", "neuron_sdk_standin", "neuron-sdk-standin", "torch-neuronx",
                  "neuronx-cc", "libneuronxla", "neuronx-distributed", "neuronx_distributed")


def _install(session, *args, **kwargs):
    """session.install under the session's constraints (none while the pins are being updated), once the session's
    install started ahead by `prefetch` has ended; then the files it shares with an earlier session's environment
    become links to them ("disk" below)."""
    _await_prefetch(session)
    _log_free_disk(session)
    pins = () if UPDATE_PINS else ("-c", str(CONSTRAINTS / f"{session.name}.txt"))
    session.install(*NO_PIP_CACHE, *pins, *args, **kwargs)
    _share_identical_files(session)


def _freeze_pins(session):
    """With OPTIMUM_QWEN35_UPDATE_PINS=1: write the environment just built as the session's constraints."""
    if not UPDATE_PINS:
        return
    frozen = session.run_install("python", "-m", "pip", "freeze", "--exclude-editable", silent=True)
    pins = [line for line in frozen.splitlines()
            if line and not line.startswith(LOCAL_PACKAGES) and " @ " not in line and not line.startswith("-e ")]
    header = (f"# pip freeze of the nox `{session.name}` session "
              f"(written by OPTIMUM_QWEN35_UPDATE_PINS=1 nox -s {session.name}).\n")
    (CONSTRAINTS / f"{session.name}.txt").write_text(header + "\n".join(pins) + "\n")
    session.log(f"wrote {len(pins)} pins to constraints/{session.name}.txt")


# ------------------------------------------------------------------------------------------------ disk
# The six environments took 33 GB as pip installs them (torch 2.8's CUDA wheels are 4.1 GB in each of neuron and
# vllm, torch 2.14's 3.2 GB in each of torchneuron and torchneuron_smoke), and pip's cache kept every download again
# (about 9 GB more on a fresh machine): a CI run once failed with "No space left on device" in the reference tests,
# while `prefetch` had installed all of them. Three things keep it down:
# - pip keeps no cache of what it downloads (the files come from a PyPI mirror; only the second download of torch 2.8
#   and of the CUDA wheels of torch 2.14 is repeated, in the background);
# - a session whose environment holds much of an earlier session's (the same torch and CUDA wheels) shares those
#   files with it: after its install, each of its files of 1 MiB or more that is byte for byte the earlier session's
#   file at the same place in site-packages becomes a hard link to it (pip never writes into an installed file: an
#   upgrade or uninstall removes the link and leaves the other environment's file as it was);
# - pytest removes a passing test's tmp_path when the test ends (setup.cfg, tmp_path_retention_policy).
NO_PIP_CACHE = ("--no-cache-dir",)
SHARES_FILES_WITH = {"vllm": "neuron", "torchneuron_smoke": "torchneuron"}
SHARED_FILE_MIN_BYTES = 1 << 20


def _site_packages(environment: Path) -> Path | None:
    found = sorted(environment.glob("lib/python3*/site-packages"))
    return found[0] if found else None


def share_identical_files(mine: Path, theirs: Path, min_bytes: int = SHARED_FILE_MIN_BYTES) -> tuple[int, int]:
    """Hard-link each file of `mine` (of `min_bytes` or more) to the file at the same relative path in `theirs` when
    the two hold the same bytes: (files now shared, bytes they hold). Files already shared are counted again."""
    files = shared = 0
    for folder, _, names in os.walk(mine):
        for name in names:
            path = Path(folder, name)
            twin = theirs / path.relative_to(mine)
            try:
                own, other = path.lstat(), twin.lstat()  # symbolic links are left as they are
                if not (S_ISREG(own.st_mode) and S_ISREG(other.st_mode)):
                    continue
                if own.st_size < min_bytes or own.st_size != other.st_size:
                    continue
                if (own.st_dev, own.st_ino) != (other.st_dev, other.st_ino):
                    if own.st_dev != other.st_dev or not filecmp.cmp(path, twin, shallow=False):
                        continue
                    linking = path.with_name(f".{name}.sharing")
                    linking.unlink(missing_ok=True)
                    os.link(twin, linking)
                    os.replace(linking, path)  # the file is whole under its name at every moment
            except OSError:  # a file that moved or a folder that cannot be written: left as it is
                continue
            files, shared = files + 1, shared + own.st_size
    return files, shared


def _share_identical_files(session) -> None:
    other = SHARES_FILES_WITH.get(session.name)
    if other is None:
        return
    location = Path(session.virtualenv.location)
    mine, theirs = _site_packages(location), _site_packages(location.parent / other)
    if mine is None or theirs is None:  # the other session not installed (yet): nothing to share
        return
    files, shared = share_identical_files(mine, theirs)
    session.log(f"{files} files ({shared / 2**30:.1f} GiB) are the same as the {other} session's: one copy on disk")


def _log_free_disk(session) -> None:
    free = shutil.disk_usage(Path(__file__).parent).free
    session.log(f"{free / 2**30:.1f} GiB free on this disk")


# ------------------------------------------------------------------------------------------------ installing ahead
# The sessions run one after another and their installs are mostly downloads (torch 2.8 with its CUDA wheels for
# neuron and vllm, torch 2.14 for torchneuron and torchneuron_smoke, vLLM: about 14 of the first six-session CI run's
# 85 minutes). `prefetch`, the first session, starts the other sessions' installs in the background
# (`nox --install-only -s <name>`, niced, logged to .nox/prefetch/<name>.log) and returns: they download while the
# reference session's tests run. Each session waits for its own before installing (what is left is then a check).
# Within a chain the installs follow one another, so that the second of two sessions with the same torch finds the
# first's environment whole and shares its files ("disk" above).
PREFETCH_CHAINS = [["optimum"], ["neuron", "vllm"], ["torchneuron", "torchneuron_smoke"]]
PREFETCH = Path(__file__).parent / ".nox" / "prefetch"
PREFETCHING = "OPTIMUM_QWEN35_PREFETCHING"  # set in the background installs: they must not wait for themselves


@nox.session(python=False)
def prefetch(session):
    """Start the other sessions' installs in the background; each session waits for its own before it installs."""
    PREFETCH.mkdir(parents=True, exist_ok=True)
    _log_free_disk(session)
    (PREFETCH / "nox.pid").write_text(str(os.getpid()))  # this nox run's: a later run ignores what this one left
    for chain in PREFETCH_CHAINS:
        locks = []
        for name in chain:
            # Held by the background chain until that session's install has ended (its end releases it), so that a
            # session cannot start before the chain has taken its lock.
            lock = os.open(PREFETCH / f"{name}.lock", os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                session.error(f"another `nox -s prefetch` is installing {name}: wait for it to end")
            (PREFETCH / f"{name}.status").unlink(missing_ok=True)
            locks.append(lock)
        command = [sys.executable, __file__, "--prefetch-chain", *(f"{lock}:{name}" for lock, name in zip(locks, chain))]
        subprocess.Popen(command, pass_fds=locks, start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for lock in locks:
            os.close(lock)
        session.log(f"installing {' then '.join(chain)} in the background (.nox/prefetch/<name>.log)")


def _prefetch_chain(pairs: list[str]) -> None:
    """The background side of `prefetch`: each session's install in turn, each lock released when it ends."""
    os.nice(10)  # the tests running meanwhile come first
    env = {**os.environ, PREFETCHING: "1"}
    for pair in pairs:
        lock, name = pair.split(":", 1)
        with open(PREFETCH / f"{name}.log", "w") as log:
            code = subprocess.call([sys.executable, "-m", "nox", "-f", __file__, "--install-only", "-s", name],
                                   stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
        (PREFETCH / f"{name}.status").write_text(str(code))
        os.close(int(lock))


def _await_prefetch(session) -> None:
    """Wait for this session's background install, if `prefetch` started one; say how it ended."""
    path, owner = PREFETCH / f"{session.name}.lock", PREFETCH / "nox.pid"
    if os.environ.get(PREFETCHING) or not path.exists() or not owner.exists() or owner.read_text() != str(os.getpid()):
        return
    start = time.monotonic()
    with open(path) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # free at once if nothing holds it
    status = PREFETCH / f"{session.name}.status"
    code = status.read_text() if status.exists() else "unknown"
    session.log(f"its install ran ahead (.nox/prefetch/{session.name}.log, exit status {code}); "
                f"waited {time.monotonic() - start:.0f} s for it")
    path.unlink(missing_ok=True)
    status.unlink(missing_ok=True)


# Two pytest workers (pytest-xdist), each test file on one worker (module fixtures are built once), one torch thread
# each: on CI's 2 cores the optimum session's tests took 11 to 13 minutes this way, 15 with torch's default two
# threads per worker, 18 to 22 in one process (docs/testing.md). Child interpreters (optimum-cli, the doc snippets)
# inherit the one thread.
PARALLEL = ("-n", "2", "--dist", "loadfile", "--no-loadscope-reorder")  # (tests/conftest.py: the heaviest files first)
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def _pytest(session, *marks, parallel=False):
    # Exit code 5 means "no test collected": always an error here, since every session selects tests.
    # The slowest tests in every log: where CI's time goes.
    args = (*PARALLEL,) if parallel else ()
    session.run("pytest", "-q", "-rs", "--durations=15", *args, *marks, *session.posargs,
                env=ONE_THREAD if parallel else None)


@nox.session
def reference(session):
    """Everything, with transformers >= 5: parity against the reference and the fixture check."""
    # Hugging Face's `kernels` (which transformers imports where installed): the package must not shadow it, nor it
    # the package (tests/test_kernels_package.py).
    _install(session, TORCH, "-e", ".[tests,reference]", HF_KERNELS, "pytest-xdist>=3.5")
    _freeze_pins(session)
    _pytest(session, parallel=True)


# Tests that import none of transformers, tokenizers, huggingface_hub or optimum (tests/test_ci_layout.py checks it):
# the same torch and the same code in both environments, so the reference session alone runs them. What they reach of
# the environment, through the package (the config classes registered with transformers, the tiny checkpoints'
# tokenizer, the stack's model class), every optimum-session test of tests/optimum_neuron reaches too.
ENVIRONMENT_FREE_TESTS = [
    "tests/emulator", "tests/kernels", "tests/test_benchmark_commands.py", "tests/test_checkpoint_errors.py",
    "tests/test_collectives.py", "tests/test_conversion_memory.py", "tests/test_export_disk_faults.py",
    "tests/test_fp8_export.py", "tests/test_fuzz_inputs.py", "tests/test_gate_precision.py",
    "tests/test_generate_rows.py", "tests/test_generation_loop.py", "tests/test_graphs.py",
    "tests/test_kernels_decay.py", "tests/test_kernels_reference.py", "tests/test_kernels_rule.py",
    "tests/test_layout.py", "tests/test_long_context.py", "tests/test_moe.py", "tests/test_moe_parallel.py",
    "tests/test_mtp.py", "tests/test_mtp_speculation_benchmark.py", "tests/test_noxfile.py", "tests/test_oracle.py",
    "tests/test_packed_linear.py", "tests/test_precision.py", "tests/test_prefix_cache.py",
    "tests/test_rule_bf16_products.py", "tests/test_scenarios.py", "tests/test_shard.py", "tests/test_soak.py",
    "tests/test_speculative.py", "tests/test_speculative_draft_vocab.py", "tests/test_speculative_export.py",
    "tests/test_speculative_sampling.py", "tests/test_speculative_tp.py", "tests/test_state_in_place.py",
    "tests/test_tensor_parallel.py", "tests/test_tensor_parallel_nv3x.py", "tests/test_torch_export_files.py",
    "tests/test_torchneuron_backend.py",
    "tests/test_vision_tensor_parallel.py",
]


# The patch of torch.export's file code (optimum_qwen35/patches/torch_export.py) differs by torch version: its test
# runs under every torch CI installs (2.13 in reference, 2.8 in neuron, 2.14 in torchneuron).
TORCH_PATCH_TESTS = ["tests/test_torch_export_files.py"]


@nox.session
def optimum(session):
    """The optimum-neuron 0.4.5 entry points and transformers 4.57 support (no Neuron SDK), images included."""
    _install(session, TORCH, "-e", ".[tests,optimum,vision,eval]", "pytest-xdist>=3.5")
    _freeze_pins(session)
    _pytest(session, "-m", "not reference", *(f"--ignore={path}" for path in ENVIRONMENT_FREE_TESTS), parallel=True)


# neuronx-distributed 0.15's source (tag v2.26.0), the version optimum-neuron 0.4.5 pins; PyPI holds a placeholder.
# Found in this order: OPTIMUM_QWEN35_NXD_SOURCE; the unchanged copy kept beside the repository (../shared/upstream,
# as in CI); a copy downloaded earlier into NXD_CACHE; else downloaded from GitHub (about 1 MB, at the tag's commit).
# Whichever it is, its files must hash to NXD_TREE_SHA256 (the tag's LICENSE, setup.py and src/neuronx_distributed).
NXD_COMMIT = "fecfe75b0d40ff8831718e02584bcac8eb9550ae"  # tag v2.26.0
NXD_ARCHIVE = os.environ.get(  # a mirror of the same archive may be named instead
    "OPTIMUM_QWEN35_NXD_ARCHIVE", f"https://github.com/aws-neuron/neuronx-distributed/archive/{NXD_COMMIT}.tar.gz")
NXD_TREE_SHA256 = "a10229aa9ab345143f6b839ab4a91cd39417d8fedd38ceeca4ca7d5ae48430a1"
NXD_BESIDE = Path(__file__).parent.parent / "shared" / "upstream" / "neuronx-distributed-2.26.0"
NXD_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "optimum-qwen35", "neuronx-distributed-2.26.0")
NXD_HOW = ("set OPTIMUM_QWEN35_NXD_SOURCE to a checkout of github.com/aws-neuron/neuronx-distributed at tag v2.26.0 "
           f"(commit {NXD_COMMIT[:12]})")


def nxd_tree_sha256(root: Path) -> str:
    """sha256 over the relative paths and bytes of LICENSE, setup.py and src/neuronx_distributed/**/*.py."""
    digest = hashlib.sha256()
    files = [root / "LICENSE", root / "setup.py", *sorted((root / "src" / "neuronx_distributed").rglob("*.py"))]
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _download_nxd_source(session) -> str | None:
    """Download and unpack the tag's archive into NXD_CACHE; the reason it could not be had, or None."""
    session.log(f"neuronx-distributed's source: downloading {NXD_ARCHIVE} (about 1 MB, 30 s at most)")
    partial = NXD_CACHE.with_name(NXD_CACHE.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        with urllib.request.urlopen(NXD_ARCHIVE, timeout=30) as response, tempfile.TemporaryFile() as archive:
            shutil.copyfileobj(response, archive)
            archive.seek(0)
            with tarfile.open(fileobj=archive, mode="r:gz") as tar:
                tar.extractall(partial, filter="data")
    except (OSError, tarfile.TarError) as error:  # urllib's URLError and timeouts are OSErrors
        shutil.rmtree(partial, ignore_errors=True)
        return f"the download failed ({error})"
    (top,) = partial.iterdir()  # the archive's one folder, neuronx-distributed-<commit>
    if nxd_tree_sha256(top) != NXD_TREE_SHA256:
        shutil.rmtree(partial, ignore_errors=True)
        return "the downloaded files do not hash to the pinned tree"
    shutil.rmtree(NXD_CACHE, ignore_errors=True)
    top.rename(NXD_CACHE)  # complete and checked: only now where the next run looks
    shutil.rmtree(partial, ignore_errors=True)
    return None


def _nxd_source(session) -> Path:
    """The checked source folder, or the session skipped with one line saying how to provide it."""
    given = os.environ.get("OPTIMUM_QWEN35_NXD_SOURCE")
    candidates = [Path(given)] if given else [NXD_BESIDE, NXD_CACHE]
    for folder in candidates:
        if (folder / "src" / "neuronx_distributed").is_dir():
            if nxd_tree_sha256(folder) != NXD_TREE_SHA256:
                session.error(f"{folder} is not neuronx-distributed 2.26.0's source (its files hash otherwise): {NXD_HOW}")
            return folder
    if given:
        session.error(f"OPTIMUM_QWEN35_NXD_SOURCE={given} holds no src/neuronx_distributed: {NXD_HOW}")
    reason = _download_nxd_source(session)
    if reason:
        session.skip(f"neuronx-distributed 2.26.0's source is not here and {reason}: {NXD_HOW}")
    return NXD_CACHE


def _neuron_environment(session, *extra):
    """The `neuron` session's environment (plus `extra` packages): torch 2.8, torch-xla 2.8, optimum-neuron 0.4.5,
    neuronx-distributed 0.15 from its source and the SDK import stand-ins; skipped with one line where that source
    cannot be had."""
    nxd_source = _nxd_source(session)
    _install(session, "torch==2.8.0", "torch-xla==2.8.0", "-e", ".[tests,optimum]",
             # neuronx-distributed's own imports (its setup.py names the closed SDK instead; --no-deps below)
             "boto3", "scipy", "tenacity", *extra)
    _freeze_pins(session)
    session.install("--no-deps", "tests/neuron_sdk_standin")
    # Built from a writable copy (the source folder is read-only); the version optimum-neuron 0.4.5 pins.
    with tempfile.TemporaryDirectory() as build:
        shutil.copytree(nxd_source, build, dirs_exist_ok=True)
        for folder, _, files in os.walk(build):
            os.chmod(folder, 0o755)
            for name in files:
                os.chmod(os.path.join(folder, name), 0o644)
        session.install("--no-deps", build, env={"VERSION_PATCH": "22404", "SUFFIX": "v2.26.0"})


@nox.session
def neuron(session):
    """The trn1/inf2/trn2 graphs built as the export builds them, lowered and run on torch-xla's CPU device."""
    _neuron_environment(session, "pytest-xdist>=3.5")
    _pytest(session, "tests/neuron_xla", *TORCH_PATCH_TESTS, parallel=True)


# vLLM 0.11.0 is what optimum-neuron 0.4.5's `vllm` extra pins (torch 2.8, as the neuron session); it forces numpy
# < 2.3 (numba 0.61.2), the one pin that differs from constraints/neuron.txt; 123 more packages, 2.9 GB installed
# (vLLM itself 1.35 GB).
VLLM = "vllm==0.11.0"


@nox.session
def vllm(session):
    """`vllm serve` and `vllm.LLM` on exports through optimum-neuron's vLLM platform (docs/serving.md), loopback only;
    the Neuron graphs on the XLA CPU device driven by optimum-neuron's vLLM model wrapper."""
    _neuron_environment(session, VLLM)
    _pytest(session, "tests/vllm")


# upstream torch-mlir from PyPI (its fx importer and the torch -> StableHLO pipeline): what TorchNeuron's compile
# pipeline does up to its closed torch-mlir fork and Neuron passes (docs/torchneuron.md). Its cp312-abi3 wheel serves
# Python 3.12 to 3.14.
TORCH_MLIR = "torch-mlir==20261001"
# TorchNeuron's newest torch (torch-neuronx 2.14, Neuron SDK 2.34), PyPI's build: it runs on CPU.
TORCHNEURON_TORCH = "torch==2.14.0"
PYENV_ROOT = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))


def pyenv_python(version: str) -> str:
    """pyenv's interpreter of `version` ("3.13"), by path: its `python3.13` shim answers only with PYENV_VERSION set,
    so nox would not find it on PATH. Without pyenv, `version` itself: nox looks for `python3.13` on PATH and, where
    there is none, skips the session in one line ("Python interpreter 3.13 not found"; an error on CI systems)."""
    found = [path for path in PYENV_ROOT.glob(f"versions/{version}.*/bin/python{version}") if path.is_file()]
    patch = lambda path: int(path.parent.parent.name.split(".")[2]) if path.parent.parent.name.split(".")[2].isdigit() else -1  # noqa: E731
    return str(max(found, key=patch)) if found else version


NO_OPTIMUM_NEURON = ("import importlib.util, sys; sys.exit('optimum-neuron is installed: the TorchNeuron stack has "
                     "none' if importlib.util.find_spec('optimum.neuron') else 0)")
# What the torchneuron session runs besides tests/torchneuron: the stack's entry points (tests/torchneuron_stack),
# the command line without optimum-neuron, the README's TorchNeuron quick start as written (test_doc_snippets.py runs
# the parts of the docs whose environment is "torchneuron").
TORCHNEURON_STACK_TESTS = ["tests/torchneuron_stack", "tests/test_cli_stacks.py", "tests/test_doc_snippets.py",
                           *TORCH_PATCH_TESTS]


@nox.session(python=pyenv_python("3.13"))
def torchneuron(session):
    """The TorchNeuron stack (Python 3.13, torch 2.14, transformers 5.25, no optimum-neuron): the model's graphs
    through a torch.compile check backend that follows TorchNeuron's pipeline (Dynamo -> AOT Autograd -> torch-mlir
    -> StableHLO) on CPU, checked against the compiler contract and run against eager and transformers' recorded
    outputs (tests/torchneuron, docs/torchneuron.md); the stack's entry points and the README's quick start."""
    _install(session, TORCHNEURON_TORCH, TORCH_MLIR, "-e", ".[tests,torchneuron]", HF_KERNELS, "pytest-xdist>=3.5")
    _freeze_pins(session)
    session.run("python", "-c", NO_OPTIMUM_NEURON)
    # Two workers, one test file each (test_graphs.py, test_tensor_parallel.py: each compiles its graphs once).
    session.run("pytest", "-q", "-rsx", "--durations=15", *PARALLEL, "tests/torchneuron", *TORCHNEURON_STACK_TESTS,
                *session.posargs, env=ONE_THREAD)


# The Python 3.12 smoke run: a plain (not editable) install of the TorchNeuron stack, then, in a fresh folder, the
# smallest export and generate: from the checkpoint (the command line) and from the export (NeuronModelForCausalLM).
SMOKE_COMMANDS = [
    ["optimum-qwen35", "build-tiny", "tiny-qwen3.5/"],
    ["optimum-qwen35", "export", "--model", "tiny-qwen3.5/", "--sequence_length", "64", "--instance_type", "cpu",
     "qwen35-export/"],
    ["optimum-qwen35", "generate", "--model", "tiny-qwen3.5/", "--prompt", "Hello", "--max-new-tokens", "4"],
    ["python", "-c", "import torch; from optimum_qwen35 import NeuronModelForCausalLM; "
     "model = NeuronModelForCausalLM.from_pretrained('qwen35-export/'); "
     "tokens = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False); "
     "assert tokens.shape == (1, 7), tokens.shape; print('generated from the export:', tokens.tolist())"],
]


@nox.session(python=pyenv_python("3.12"))
def torchneuron_smoke(session):
    """The TorchNeuron stack on Python 3.12 (torch 2.14, transformers 5.25, no optimum-neuron): install, export,
    generate."""
    _install(session, TORCHNEURON_TORCH, ".[torchneuron]")
    _freeze_pins(session)
    session.run("python", "-c", NO_OPTIMUM_NEURON)
    with tempfile.TemporaryDirectory() as folder, session.chdir(folder):
        for command in SMOKE_COMMANDS:
            session.run(*command, env=ONE_THREAD)


# ------------------------------------------------------------------------------------------------ mutation testing
# What `nox -s mutation` mutates (paths as the package installs them: `kernels/<sub>` is
# `optimum_qwen35/kernels/<sub>`) and the fast test selection each mutant runs against (mutmut runs, per mutant, only
# the selected tests that call the mutated function). docs/testing.md has the score and the survivors.
MUTATED = [
    "optimum_qwen35/modeling/*",
    "optimum_qwen35/kernels/gated_delta_rule/reference.py",
    "optimum_qwen35/kernels/conv1d/reference.py",
    "optimum_qwen35/checkpoint/shard.py",
]
MUTATION_TESTS = [
    "tests/test_kernels_rule.py",
    "tests/test_kernels_reference.py",
    "tests/test_kernels_decay.py",
    "tests/test_oracle.py",
    "tests/test_shard.py",
    "tests/test_shard_export.py",
    "tests/test_state_in_place.py",
    "tests/test_precision.py",
    "tests/test_packed_linear.py",
    "tests/test_collectives.py",
    "tests/test_checkpoint_errors.py",
    "tests/test_bad_input.py",
    "tests/test_graphs.py",
    "tests/kernels/test_nki_neuron_graph.py",
    "tests/test_neuron_backend.py",
]
# Within those: not the slow tests, not the fixtures' own check, not the bf16 cpu export (17 s; the in-memory bf16 model
# tests check the same policy), and the model against the oracle on one layout (tiny-nv3x: GQA in both mixers,
# nv = 3 nk, dk != dv, untied); the other layouts run in CI. The TP-equivalence tests are left out (each run spawns
# every rank: ~10 s a mutant); test_collectives.py runs the collectives with rank 0 in the test's own process, where
# mutmut sees what it calls. The NKI wiring and Neuron-backend tests run on their two layouts.
MUTATION_SELECT = (
    "(not recorded_greedy and not tiny-2b and not tiny-nv2x and not compiled_export) or test_nki_neuron_graph"
    " or test_neuron_backend"
)


@nox.session
def mutation(session):
    """Mutation testing with mutmut (not run by CI: it is not in nox.options.sessions; ~1 hour on 2 cores).

    mutmut runs from a staging folder (.mutation/) holding the committed tree (HEAD) laid out as the package installs,
    kernels/<sub> inside optimum_qwen35/kernels/, so that the module names mutmut derives from file paths are the
    imported ones. `nox -s mutation` runs everything; `nox -s mutation -- <mutmut run arguments>` runs those in the
    same staging folder (made from HEAD if absent), e.g. one module at a time: `nox -s mutation -- "optimum_qwen35.kernels.*"`, then
    `"optimum_qwen35.modeling.*"`, then `"optimum_qwen35.checkpoint.*"`; `nox -s mutation -- results` lists them.
    """
    import shutil
    import subprocess
    import tarfile
    from pathlib import Path

    session.install(TORCH, "-e", ".[tests]", "mutmut==3.8.1")
    root, stage = Path.cwd(), Path(".mutation")
    if not session.posargs:
        shutil.rmtree(stage, ignore_errors=True)
    if not stage.exists():
        stage.mkdir()
        # The committed tree (HEAD), not the work tree: the score belongs to a commit.
        archive = stage / "head.tar"
        session.run("git", "archive", "--format=tar", "-o", str(archive), "HEAD", "optimum_qwen35", "kernels", "tests",
                    external=True)
        with tarfile.open(archive) as tar:
            tar.extractall(stage / "head")
        shutil.move(stage / "head" / "optimum_qwen35", stage / "optimum_qwen35")
        # kernels/<sub> is optimum_qwen35.kernels.<sub> (setup.py's package_dir), beside the dispatch module
        # optimum_qwen35/kernels/__init__.py.
        for sub in (stage / "head" / "kernels").iterdir():
            shutil.move(sub, stage / "optimum_qwen35" / "kernels" / sub.name)
        shutil.move(stage / "head" / "tests", stage / "tests")
        shutil.rmtree(stage / "head")
        archive.unlink()
        session.log(f"mutation testing commit {subprocess.check_output(['git', 'rev-parse', 'HEAD'], text=True).strip()}")
        lines = ["[mutmut]", "source_paths = optimum_qwen35", "only_mutate ="]
        lines += [f"    {p}" for p in MUTATED]
        lines += ["pytest_add_cli_args_test_selection ="] + [f"    {t}" for t in MUTATION_TESTS]
        # Error paths (`raise ...(message)`) are left alone: their messages are checked by tests outside the fast
        # selection (test_bad_input.py, test_checkpoint_errors.py).
        lines += ["do_not_mutate_patterns =", r"    ^\s*raise "]
        lines += ["pytest_add_cli_args =", "    -p", "    no:cacheprovider", "    -m", "    not slow", "    -k", f"    {MUTATION_SELECT}"]
        # torch is not fork-safe once its thread pool runs: workers fork from a server that has run no torch op.
        lines += ["process_isolation = forkserver", ""]
        lines += ["[tool:pytest]", "markers =", "    reference: needs transformers >= 5", "    slow: slow", ""]
        (stage / "setup.cfg").write_text("\n".join(lines))
    with session.chdir(stage):
        if session.posargs and session.posargs[0] == "results":
            session.run("mutmut", "results", *session.posargs[1:])
        else:
            threads = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # one thread per worker, two workers
            threads["OPTIMUM_QWEN35_ORACLE_CACHE"] = str(Path.cwd() / "oracle-cache")  # the oracle does not mutate
            session.run("nice", "-n", "10", "mutmut", "run", "--max-children", "2", *session.posargs, env=threads, external=True)
            session.run("mutmut", "results")


@nox.session
def mutation_boundaries(session):
    """Boundary mutants (`<`/`<=`, `n` -> `n - 1` / `n + 1`) of the runtime's bucket, chunk and slot arithmetic, which
    mutmut has no operator for, scored separately (tests/mutation_boundaries.py; not run by CI; ~30 min on 2 cores).
    `nox -s mutation_boundaries -- --list` lists them, `-- 3 17` runs only those."""
    session.install(TORCH, "-e", ".[tests]")
    session.run("nice", "-n", "10", "python", "tests/mutation_boundaries.py", *session.posargs, external=True)


if __name__ == "__main__" and sys.argv[1:2] == ["--prefetch-chain"]:
    _prefetch_chain(sys.argv[2:])
