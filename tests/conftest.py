"""Shared test helpers: the committed reference fixtures and transformers detection."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).parent / "fixtures"
LAYOUTS = ("tiny-2b", "tiny-nv2x", "tiny-nv3x")


def reference_import_error() -> str | None:
    """With transformers >= 5: why `transformers.models.qwen3_5.modeling_qwen3_5` does not import, or None."""
    try:
        import transformers.models.qwen3_5.modeling_qwen3_5  # noqa: F401
    except ImportError as error:
        return f"{type(error).__name__}: {error}"
    return None


def pytest_addoption(parser):
    parser.addoption(
        "--deep",
        action="store_true",
        default=False,
        help="before a release (docs/testing.md): the property-based scenario tests draw many more examples, and the "
        "`matrix` tests (further points of a matrix CI runs at one point) run too",
    )


@pytest.fixture(scope="session")
def deep(request) -> bool:
    """True under `pytest --deep`: the scenario tests draw many more examples (tests/test_scenarios.py)."""
    return bool(request.config.getoption("--deep"))


@pytest.fixture(scope="session")
def fitted_tiny_2b(tmp_path_factory) -> Path:
    """tiny-2b with its MTP head fitted to its own model (optimum_qwen35/tiny/mtp_fit.py: seeded, about 14 s of CPU),
    built once per test run: under xdist the first worker to ask builds it in the run's temporary folder and the
    others wait for it (a file lock). Read-only to its users (copy it to change it)."""
    from filelock import FileLock

    from optimum_qwen35.tiny.mtp_fit import fitted_checkpoint

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this run's folder, which its workers share
    folder = root / "fitted-tiny-2b"
    with FileLock(f"{folder}.lock"):
        if not folder.is_dir():
            building = root / f"fitted-tiny-2b.building-{os.getpid()}"
            fitted_checkpoint(FIXTURES / "tiny-2b", building)
            os.replace(building, folder)  # complete, or not there
    return folder


MATRIX_SKIP = ("another point of a matrix CI runs at one point (another dtype, TP degree or layout of the same path): "
               "`pytest --deep` (`nox -s <session> -- --deep`) runs it")


# Heavy test files of each session, collected first (estimated from CI's logs; the per-file summary below now
# measures them). The sessions' two workers take whole files in collection order (noxfile.py: `--dist loadfile
# --no-loadscope-reorder`), so these start first and the many short files fill the end (xdist's own order is by
# number of tests per file). Measured, what it gained was within the run-to-run noise (docs/testing.md, "CI's time").
SLOW_FILES_FIRST = [
    # reference
    "tests/test_speculative_export.py", "tests/test_soak.py", "tests/test_fp8_export.py",
    "tests/emulator/test_cost_model.py", "tests/test_speculative_sampling.py", "tests/test_speculative_tp.py",
    "tests/kernels/test_gated_delta_rule_verify.py", "tests/test_doc_snippets.py", "tests/test_fixtures_current.py",
    "tests/test_benchmark_commands.py",
    # optimum (test_doc_snippets.py above is its heaviest)
    "tests/optimum_neuron/test_speculative_optimum.py", "tests/optimum_neuron/test_registration.py",
    "tests/optimum_neuron/test_hub_end_to_end.py", "tests/optimum_neuron/test_tensor_parallel_docs.py",
    "tests/optimum_neuron/test_export_load.py", "tests/test_fp8_export_options.py",
    # torchneuron
    "tests/torchneuron/test_graphs.py", "tests/torchneuron/test_tensor_parallel.py",
    "tests/torchneuron/test_benchmark_vs_transformers.py", "tests/torchneuron/test_product_backend.py",
    "tests/torchneuron/test_speculative.py", "tests/torchneuron_stack/test_export_and_load.py",
]


def _slow_files_first(items) -> None:
    rank = {path: i for i, path in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the others keep their order


def pytest_collection_modifyitems(config, items):
    """`matrix` tests run only under `--deep` (CI's time limit: docs/testing.md, "CI's time"); the heaviest files
    first.

    The reference tests need transformers >= 5 (its `qwen3_5`): skipped where transformers < 5 is installed (the
    optimum environment). With transformers >= 5 its Qwen3.5 must import: an ImportError there (a package shadowing
    one transformers imports, a broken install) stops the session with the error instead of skipping every reference
    test."""
    _slow_files_first(items)
    if not config.getoption("--deep"):
        for item in items:
            if "matrix" in item.keywords:
                item.add_marker(pytest.mark.skip(reason=MATRIX_SKIP))
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        error = reference_import_error()
        if error is not None:
            raise pytest.UsageError(
                f"transformers {transformers.__version__} is installed but its Qwen3.5 does not import ({error}): "
                "the reference tests cannot run"
            )
        return
    skip = pytest.mark.skip(reason="needs transformers >= 5 (qwen3_5); runs in the nox `reference` session")
    for item in items:
        if "reference" in item.keywords:
            item.add_marker(skip)


SECONDS_BY_FILE: Counter = Counter()


def pytest_runtest_logreport(report):
    SECONDS_BY_FILE[report.nodeid.split("::")[0]] += report.duration  # setup, call and teardown


def pytest_terminal_summary(terminalreporter):
    """Where the session's time went, by file (under xdist, the workers' reports reach this process too)."""
    if not SECONDS_BY_FILE:
        return
    terminalreporter.write_sep("=", f"slowest files: worker-seconds, {sum(SECONDS_BY_FILE.values()):.0f} in all")
    for path, seconds in SECONDS_BY_FILE.most_common(12):
        terminalreporter.write_line(f"{seconds:8.1f}s {path}")


def load_reference(layout: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / layout / "reference.npz") as data:
        return {k: data[k] for k in data.files}


def reference_prompts(ref: dict[str, np.ndarray]) -> list[tuple[list[int], np.ndarray]]:
    """(prompt, logits [len, vocab]) for every teacher-forced prompt of a reference file."""
    out, i = [], 0
    while f"prompt_{i}" in ref:
        out.append((ref[f"prompt_{i}"].tolist(), ref[f"logits_{i}"]))
        i += 1
    return out


# ------------------------------------------------------------------------------------ the stand-in Hub server

# Tokens of the stand-in Hub: user alice with a write token and a read-only one, user bob with a write token.
HUB_TOKENS = {"hf_alice_write": ("alice", True), "hf_alice_read": ("alice", False), "hf_bob_write": ("bob", True)}


@pytest.fixture
def hub_server(monkeypatch):
    """A loopback stand-in Hub (tests.kit.hub_server) for this test, with the HUB_TOKENS.

    In-process clients pass `endpoint=hub_server.url` (and `token=`); subprocesses get
    `hub_server.client_env(hf_home, token)` (HF_ENDPOINT, their own HF_HOME). The stand-in speaks the LFS
    "basic" transfer, not Xet: huggingface_hub 2.x uploads through Xet whenever hf_xet is installed, so Xet is
    switched off for the client here (HF_HUB_DISABLE_XET, read at import, hence the constant)."""
    from huggingface_hub import constants

    from tests.kit.hub_server import HubServer

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True, raising=False)
    with HubServer(tokens=HUB_TOKENS) as server:
        yield server
