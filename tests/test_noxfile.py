"""noxfile.py's way to neuronx-distributed's source for the `neuron` session: the pinned tree hash, and the download
path a fresh clone without ../shared takes, run for real against an archive served on 127.0.0.1 (a good one, a
tampered one, and a closed port); and `prefetch`, the installs started ahead, on stand-in sessions."""

from __future__ import annotations

import functools
import http.server
import importlib.util
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest

pytest.importorskip("nox", reason="nox is in the `tests` extra")
ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def noxfile():
    spec = importlib.util.spec_from_file_location("noxfile_under_test", ROOT / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Session:
    """What _download_nxd_source uses of a nox session: its log."""

    def __init__(self):
        self.lines = []

    def log(self, line):
        self.lines.append(line)


def _source(noxfile) -> Path:
    if not (noxfile.NXD_BESIDE / "src" / "neuronx_distributed").is_dir():
        pytest.skip(f"needs the unchanged copy at {noxfile.NXD_BESIDE} (as in CI)")
    return noxfile.NXD_BESIDE


def _serve(folder: Path):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _archive(source: Path, folder: Path, name: str, tamper: bool = False) -> Path:
    """The archive GitHub serves for the commit: one top folder neuronx-distributed-<commit>."""
    top = f"neuronx-distributed-{name}"
    path = folder / f"{name}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        tar.add(source, arcname=top)
        if tamper:
            changed = folder / "setup.py"
            changed.write_bytes((source / "setup.py").read_bytes() + b"\n# changed\n")
            tar.add(changed, arcname=f"{top}/setup.py")  # the later member wins on extraction
    return path


def test_the_kept_copy_is_the_pinned_tree(noxfile):
    assert noxfile.nxd_tree_sha256(_source(noxfile)) == noxfile.NXD_TREE_SHA256


@pytest.mark.parametrize("case", ["good", "tampered", "unreachable"])
def test_download_is_checked_before_it_is_used(noxfile, tmp_path, monkeypatch, case):
    source = _source(noxfile)
    served = tmp_path / "served"
    served.mkdir()
    _archive(source, served, "pinned", tamper=case == "tampered")
    server = _serve(served)
    port = server.server_address[1]
    if case == "unreachable":
        server.shutdown()
        server.server_close()
    cache = tmp_path / "cache" / "neuronx-distributed-2.26.0"
    monkeypatch.setattr(noxfile, "NXD_CACHE", cache)
    monkeypatch.setattr(noxfile, "NXD_ARCHIVE", f"http://127.0.0.1:{port}/pinned.tar.gz")
    session = _Session()
    try:
        reason = noxfile._download_nxd_source(session)
    finally:
        if case != "unreachable":
            server.shutdown()
            server.server_close()
    assert "downloading" in session.lines[0]
    leftovers = sorted(p.name for p in cache.parent.iterdir()) if cache.parent.exists() else []
    if case == "good":
        assert reason is None
        assert noxfile.nxd_tree_sha256(cache) == noxfile.NXD_TREE_SHA256
        assert leftovers == [cache.name]  # no partial folder left beside it
    elif case == "tampered":
        assert reason == "the downloaded files do not hash to the pinned tree"
        assert leftovers == []  # nothing that a later run could take for a checked copy
    else:
        assert reason.startswith("the download failed")
        assert leftovers == []


# Two stand-in sessions whose install takes 2 s and leaves a marker; each session's first run step checks the marker
# is there before its own install, which holds only if it waited for the background install `prefetch` started.
PREFETCH_SESSIONS = '''

PREFETCH_CHAINS = [["first", "second"]]
nox.options.sessions = ["prefetch", "first", "second"]


def _stand_in(session):
    _await_prefetch(session)
    marker = Path(__file__).parent / f"{session.name}.installed"
    session.run("test", "-f", str(marker), external=True)  # skipped by --install-only: the real run's check
    session.run_install("sh", "-c", f"sleep 2; touch {marker}", external=True)


@nox.session(python=False)
def first(session):
    _stand_in(session)


@nox.session(python=False)
def second(session):
    _stand_in(session)
'''


def test_prefetch_installs_ahead_and_each_session_waits_for_its_own(tmp_path):
    """`prefetch` on stand-in sessions, through nox for real: each session's run step finds what its background
    install left (it waited for it), and says how that install ended."""
    (tmp_path / "noxfile.py").write_text((ROOT / "noxfile.py").read_text() + PREFETCH_SESSIONS)
    run = subprocess.run([sys.executable, "-m", "nox"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    for name in ("first", "second"):
        assert f"its install ran ahead (.nox/prefetch/{name}.log, exit status 0)" in run.stderr, run.stderr
        assert "--install-only is set" in (tmp_path / ".nox" / "prefetch" / f"{name}.log").read_text()


def test_identical_files_become_one_copy_and_nothing_else_changes(noxfile, tmp_path):
    """What a session shares with an earlier session's environment: only regular files of the minimum size or more,
    at the same place, holding the same bytes; the rest is left as it was, and removing the other's file (an
    uninstall there) leaves this one whole."""
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    for folder in (mine / "pkg", theirs / "pkg"):
        folder.mkdir(parents=True)
    data = bytes(range(256)) * 16  # 4 KiB
    (theirs / "pkg" / "same.so").write_bytes(data)
    (mine / "pkg" / "same.so").write_bytes(data)
    (theirs / "pkg" / "differs.so").write_bytes(data)
    (mine / "pkg" / "differs.so").write_bytes(data[:-1] + b"x")
    (theirs / "pkg" / "small.py").write_bytes(data[:100])
    (mine / "pkg" / "small.py").write_bytes(data[:100])
    (theirs / "pkg" / "real.so").write_bytes(data)
    (theirs / "pkg" / "linked.so").symlink_to("real.so")
    (mine / "pkg" / "linked.so").write_bytes(data)
    (mine / "pkg" / "only_mine.so").write_bytes(data)

    assert noxfile.share_identical_files(mine, theirs, min_bytes=1024) == (1, len(data))
    inode = lambda path: path.stat().st_ino  # noqa: E731
    assert inode(mine / "pkg" / "same.so") == inode(theirs / "pkg" / "same.so")
    for name in ("differs.so", "small.py", "linked.so", "only_mine.so"):
        assert (mine / "pkg" / name).stat().st_nlink == 1, name
    assert (mine / "pkg" / "differs.so").read_bytes().endswith(b"x")
    assert noxfile.share_identical_files(mine, theirs, min_bytes=1024) == (1, len(data))  # again: nothing new
    assert sorted(path.name for path in (mine / "pkg").iterdir()) == [
        "differs.so", "linked.so", "only_mine.so", "same.so", "small.py"]  # no file left half-made
    (theirs / "pkg" / "same.so").unlink()
    assert (mine / "pkg" / "same.so").read_bytes() == data
