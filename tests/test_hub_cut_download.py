"""A Hub download cut mid-file (issue 50, faults): `resolve_export` through the real huggingface_hub client against
the loopback stand-in Hub (tests/kit/hub_server.py `cut_downloads`: half the announced bytes, then the connection
closes). A cut the client can resume is retried and gives the exact files; downloads cut every time end in one line,
with nothing in the Hugging Face cache that looks complete (no snapshot file of the cut file), and a later download
that is not cut completes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from optimum_qwen35 import hub
from optimum_qwen35.errors import Qwen35Error
from tests.kit import build_tiny_checkpoint
from tests.kit.export_folder import build_fake_export

WRITE = "hf_alice_write"


@pytest.fixture
def pushed(hub_server, tmp_path):
    source = build_tiny_checkpoint(tmp_path / "tiny", "tiny-2b", dtype="bfloat16")
    export = build_fake_export(tmp_path / "export", source, "Qwen/Qwen3.5-tiny", "main", tp_degree=2,
                               weights_bytes=256 * 1024)
    hub.push_to_hub(export, "alice/cut", token=WRITE, endpoint=hub_server.url)
    return export


def digests(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.skipif(int(__import__("huggingface_hub").__version__.split(".")[0]) < 1,
                    reason="huggingface_hub 0.36 (the NxD stack's pin) does not resume a body cut mid-file: measured "
                    "in the optimum session, its ChunkedEncodingError is not retried (docs/soak.md)")
def test_a_download_cut_once_is_retried_and_gives_the_exact_files(hub_server, pushed, tmp_path):
    hub_server.cut_downloads = 1
    folder = hub.resolve_export("alice/cut", token=WRITE, endpoint=hub_server.url, cache_dir=tmp_path / "hf")
    assert hub_server.cut_downloads == 0 and any(r[2] == "cut" for r in hub_server.requests)
    assert digests(folder) == digests(pushed)


def test_downloads_cut_every_time_fail_in_one_line_and_cache_nothing_as_complete(hub_server, pushed, tmp_path):
    cache = tmp_path / "hf"
    hub_server.cut_downloads = 10_000
    with pytest.raises((Qwen35Error, OSError)) as error:
        hub.resolve_export("alice/cut", token=WRITE, endpoint=hub_server.url, cache_dir=cache)
    message = str(error.value)
    assert isinstance(error.value, Qwen35Error) and "\n" not in message.strip(), f"{type(error.value).__name__}: {message}"
    expected = digests(pushed)
    for snapshot in cache.glob("models--alice--cut/snapshots/*"):
        for name, digest in digests(snapshot).items():  # whatever the cache calls complete is whole
            assert expected[name] == digest, name
    assert not list(cache.glob("models--alice--cut/blobs/*")) or all(
        p.name.endswith(".incomplete") or hashlib.sha256(p.read_bytes()).hexdigest() in expected.values()
        or p.stat().st_size < 4096 for p in cache.glob("models--alice--cut/blobs/*"))
    hub_server.cut_downloads = 0
    folder = hub.resolve_export("alice/cut", token=WRITE, endpoint=hub_server.url, cache_dir=cache)
    assert digests(folder) == expected
