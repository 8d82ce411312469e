"""The NKI Library (aws-neuron/nki-library) from a local snapshot, for the tests that run its kernels unmodified on
the emulator. The snapshot is a git directory (`OPTIMUM_QWEN35_NKI_LIBRARY_REPO`, default where `fetch` puts it);
without it those tests skip. None of the library is in this repository."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

LIBRARY_REPO = os.environ.get("OPTIMUM_QWEN35_NKI_LIBRARY_REPO", "/work/.mirror/aws-neuron+nki-library/repo")


def unpack_nki_library(dest: Path) -> Path:
    """The snapshot's `src/nkilib_src` (the importable `nkilib` package's parent) unpacked into `dest`; skips the
    calling test where there is no snapshot."""
    if not os.path.isdir(LIBRARY_REPO):
        pytest.skip(f"no local snapshot of aws-neuron/nki-library at {LIBRARY_REPO} (OPTIMUM_QWEN35_NKI_LIBRARY_REPO)")
    archive = subprocess.run(["git", "--git-dir", LIBRARY_REPO, "archive", "HEAD", "src/nkilib_src"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest / "src" / "nkilib_src"
