"""Writing an export or a sharded checkpoint onto a full or a read-only disk (issue 50, faults): one line
(`ExportError` naming the folder and the cause), and nothing half-written left there.

The disks are small tmpfs mounts (1 MiB, and a read-only one): the test needs the right to mount (root in a
container that allows it) and skips otherwise. chmod cannot stand in for a read-only disk here: root writes through
file modes."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from optimum_qwen35.checkpoint.sharded_files import save_sharded
from optimum_qwen35.errors import ExportError
from optimum_qwen35.export.cpu import save_export
from tests.conftest import FIXTURES


def _mount(target: Path, options: str) -> None:
    target.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)], capture_output=True, text=True)
    if result.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")


@pytest.fixture(params=["full", "read-only"])
def disk(request, tmp_path):
    target = tmp_path / "disk"
    _mount(target, "size=1m" if request.param == "full" else "size=1m,ro")
    yield request.param, target
    subprocess.run(["umount", str(target)], check=True)


@pytest.fixture
def export(tmp_path):
    """A folder in an export's layout, 3 MiB: larger than the full disk."""
    folder = tmp_path / "export"
    (folder / "compiled").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "compiled" / "graphs.json").write_text("{}")
    (folder / "compiled" / "context_encoding_128.pt2").write_bytes(os.urandom(3 * 2**20))
    return folder


def test_saving_an_export_onto_a_full_or_read_only_disk(disk, export):
    kind, target = disk
    with pytest.raises(ExportError) as error:
        save_export(export, target / "out")
    message = str(error.value)
    assert "\n" not in message and str(target / "out") in message, message
    assert ("disk is full" if kind == "full" else "read-only") in message, message
    assert list(target.iterdir()) == []  # no partial folder, no half-written file


def test_sharding_a_checkpoint_onto_a_full_or_read_only_disk(disk):
    kind, target = disk
    with pytest.raises(ExportError) as error:
        save_sharded(FIXTURES / "tiny-2b", None, 2, target / "shards", progress=False)
    message = str(error.value)
    assert "\n" not in message and ("disk is full" if kind == "full" else "read-only") in message, message
    assert list(target.iterdir()) == []
