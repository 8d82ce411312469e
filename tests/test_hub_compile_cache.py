"""TorchNeuron's compile cache on the Hub (optimum_qwen35/hub/compile_cache.py, `optimum-qwen35 neff-cache`), against
the loopback stand-in Hub with the real huggingface_hub client.

No NEFF exists here (no neuronx-cc): the cache folder holds real files in TorchNeuron's layout, each
`<key>/<key>.neff` with the key computed as torch-neuronx's `NEFFCacheKey` does (sha256 of the module's bytes and
of the compiler options), whose content is a real serialized program (`torch.export.save` of a small graph per
bucket) standing in for the NEFF. The functions move files by path and content only, so that is what is checked.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants

from optimum_qwen35.cli import main
from optimum_qwen35.errors import HubAuthError, UsageError
from optimum_qwen35.hub import compile_cache
from optimum_qwen35.hub.compile_cache import (
    CompileCacheKey,
    default_neff_cache_dir,
    fetch_compile_cache,
    list_compile_caches,
    push_compile_cache,
)

WRITE, READ = "hf_alice_write", "hf_alice_read"
REPO = "alice/neff-cache"
KEY = dict(
    model_id="Qwen/Qwen3.5-2B",
    revision="0123456789abcdef0123456789abcdef01234567",
    instance_type="trn2.48xlarge",
    tp_degree=4,
    dtype="bfloat16",
    buckets={"context": [128, 1024], "token": [1024]},
    torch_neuronx_version="2.13.1.0",
    torch_version="2.13.0",
)


class _Graph(torch.nn.Module):
    def forward(self, x, state):
        state.mul_(0.5).add_(x.sum(1))
        return torch.tanh(x) @ x.transpose(0, 1)


def _neff_key(module: bytes, options: str) -> str:
    """torch-neuronx's NEFFCacheKey: sha256 of (sha256 of the module, sha256 of the '|'-joined options)."""
    return hashlib.sha256(
        f"{hashlib.sha256(module).hexdigest()}:{hashlib.sha256(options.encode()).hexdigest()}".encode()
    ).hexdigest()


def write_cache_entry(cache_dir: Path, bucket: int, options: str = "trn2|transformer|2|none|XLA|2|2.22.0") -> str:
    """Compile-cache entry for one bucket, in TorchNeuron's layout; returns its relative path."""
    program = torch.export.export(_Graph(), (torch.randn(bucket, 8), torch.zeros(bucket)))
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    data = buffer.getvalue()
    key = _neff_key(data, options)
    path = cache_dir / key / f"{key}.neff"
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    return path.relative_to(cache_dir).as_posix()


def tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def hub(hub_server, monkeypatch, tmp_path):
    hub_server.create_repo(REPO)
    # The in-process client's download cache, away from the user's.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    return hub_server


@pytest.fixture
def neff_cache(tmp_path):
    cache = tmp_path / "neff_cache"
    cache.mkdir()
    for bucket in (16, 64):
        write_cache_entry(cache, bucket)
    (cache / "abc.neff.tmp").write_bytes(b"half")  # what TorchNeuron leaves mid-write: never pushed
    return cache


def test_push_then_fetch_into_an_empty_cache_gives_the_same_files(hub, neff_cache, tmp_path):
    key = CompileCacheKey(**KEY)
    before = len(hub.commits(REPO))
    pushed = push_compile_cache(neff_cache, REPO, key, token=WRITE, endpoint=hub.url)
    assert len(hub.commits(REPO)) == before + 1
    expected = {p: b for p, b in tree(neff_cache).items() if not p.endswith(".tmp")}
    assert len(expected) == 2 and pushed.uploaded == sorted(f"files/{p}" for p in expected)
    remote = hub.files(REPO)
    assert pushed.prefix == f"optimum-qwen35-torchneuron/Qwen/Qwen3.5-2B/trn2.48xlarge-tp4-bfloat16-{key.digest()}"
    assert json.loads(remote[f"{pushed.prefix}/key.json"]) == key.to_dict()
    assert {p: remote[f"{pushed.prefix}/files/{p}"] for p in expected} == expected
    assert not any(p.endswith(".tmp") for p in remote)

    fresh = tmp_path / "other_machine" / "neff_cache"
    fetched = fetch_compile_cache(fresh, REPO, CompileCacheKey(**KEY), token=READ, endpoint=hub.url)
    assert fetched.hit and sorted(fetched.fetched) == sorted(expected) and fetched.present == []
    assert tree(fresh) == expected  # same paths, same bytes, no temporary file left

    again = fetch_compile_cache(fresh, REPO, CompileCacheKey(**KEY), token=READ, endpoint=hub.url)
    assert again.fetched == [] and sorted(again.present) == sorted(expected)


def test_pushing_again_sends_only_new_entries_and_deletes_nothing(hub, neff_cache, tmp_path):
    key = CompileCacheKey(**KEY)
    first = push_compile_cache(neff_cache, REPO, key, token=WRITE, endpoint=hub.url)
    commits = len(hub.commits(REPO))
    uploads = hub.count("PUT", "/__lfs_upload__/")
    unchanged = push_compile_cache(neff_cache, REPO, key, token=WRITE, endpoint=hub.url)
    assert unchanged.commit_sha is None and unchanged.uploaded == []
    assert len(hub.commits(REPO)) == commits and hub.count("PUT", "/__lfs_upload__/") == uploads

    # Another machine compiled one more bucket of the same configuration: only it is sent.
    other = tmp_path / "second"
    other.mkdir()
    added = write_cache_entry(other, 96)
    second = push_compile_cache(other, REPO, key, token=WRITE, endpoint=hub.url)
    assert second.uploaded == [f"files/{added}"] and len(hub.commits(REPO)) == commits + 1
    remote = hub.files(REPO)
    assert all(f"{first.prefix}/{p}" in remote for p in first.uploaded)  # the first machine's files stay


@pytest.mark.parametrize(
    "change",
    [
        {"tp_degree": 8},
        {"instance_type": "trn3.48xlarge"},
        {"dtype": "float32"},
        {"buckets": {"context": [128, 2048], "token": [2048]}},
        {"torch_neuronx_version": "2.14.0.0"},
        {"torch_version": "2.14.0"},
        {"revision": "fedcba9876543210fedcba9876543210fedcba98"},
        {"model_id": "Qwen/Qwen3.5-9B"},
    ],
)
def test_another_configuration_is_a_miss_and_writes_nothing(hub, neff_cache, tmp_path, change):
    push_compile_cache(neff_cache, REPO, CompileCacheKey(**KEY), token=WRITE, endpoint=hub.url)
    other = CompileCacheKey(**{**KEY, **change})
    fresh = tmp_path / "fresh"
    result = fetch_compile_cache(fresh, REPO, other, token=READ, endpoint=hub.url)
    assert not result.hit and result.fetched == [] and not fresh.exists()


def test_the_key_does_not_depend_on_the_order_of_buckets():
    same = CompileCacheKey(**{**KEY, "buckets": {"token": [1024], "context": [1024, 128, 128]}})
    assert same.prefix() == CompileCacheKey(**KEY).prefix()


def test_an_interrupted_fetch_leaves_no_half_written_entry(hub, neff_cache, tmp_path, monkeypatch):
    push_compile_cache(neff_cache, REPO, CompileCacheKey(**KEY), token=WRITE, endpoint=hub.url)
    fresh = tmp_path / "fresh"
    real_copy = compile_cache.shutil.copyfileobj
    calls = []

    def copy_then_fail_on_the_second(src, dst, *args):
        calls.append(1)
        if len(calls) == 2:
            dst.write(src.read(100))  # part of the file reached the disk
            raise OSError(28, "No space left on device")
        return real_copy(src, dst, *args)

    monkeypatch.setattr(compile_cache.shutil, "copyfileobj", copy_then_fail_on_the_second)
    with pytest.raises(OSError, match="No space left"):
        fetch_compile_cache(fresh, REPO, CompileCacheKey(**KEY), token=READ, endpoint=hub.url)
    expected = {p: b for p, b in tree(neff_cache).items() if not p.endswith(".tmp")}
    got = tree(fresh)
    assert len(got) == 1 and all(expected[p] == b for p, b in got.items())  # one complete entry, no partial one
    monkeypatch.setattr(compile_cache.shutil, "copyfileobj", real_copy)
    resumed = fetch_compile_cache(fresh, REPO, CompileCacheKey(**KEY), token=READ, endpoint=hub.url)
    assert len(resumed.fetched) == 1 and len(resumed.present) == 1 and tree(fresh) == expected


def test_the_default_cache_folder_is_torchneurons(hub, neff_cache, tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_NEURONX_NEFF_CACHE_DIR", raising=False)
    assert default_neff_cache_dir() == Path("/tmp/neff_cache")
    chosen = tmp_path / "chosen"
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", str(chosen))
    assert default_neff_cache_dir() == chosen
    push_compile_cache(neff_cache, REPO, CompileCacheKey(**KEY), token=WRITE, endpoint=hub.url)
    result = fetch_compile_cache(None, REPO, CompileCacheKey(**KEY), token=READ, endpoint=hub.url)
    assert len(result.fetched) == 2 and len(tree(chosen)) == 2


def test_list_names_every_configuration(hub, neff_cache):
    push_compile_cache(neff_cache, REPO, CompileCacheKey(**KEY), token=WRITE, endpoint=hub.url)
    push_compile_cache(neff_cache, REPO, CompileCacheKey(**{**KEY, "tp_degree": 8}), token=WRITE, endpoint=hub.url)
    entries = list_compile_caches(REPO, token=READ, endpoint=hub.url)
    assert sorted(e.key.tp_degree for e in entries) == [4, 8]
    assert all(e.files == 2 and e.bytes == sum(len(b) for p, b in tree(neff_cache).items() if not p.endswith(".tmp")) for e in entries)
    assert list_compile_caches(REPO, model_id="Qwen/Qwen3.5-9B", token=READ, endpoint=hub.url) == []


def test_key_and_folder_errors_are_one_line_usage_errors(hub, tmp_path):
    no_version = {k: v for k, v in KEY.items() if k != "torch_neuronx_version"}
    with pytest.raises(UsageError, match="torch-neuronx is not installed here"):
        CompileCacheKey(**no_version)
    with pytest.raises(UsageError, match="at least one positive bucket"):
        CompileCacheKey(**{**KEY, "buckets": {"context": []}})
    with pytest.raises(UsageError, match="TP degree"):
        CompileCacheKey(**{**KEY, "tp_degree": 0})
    with pytest.raises(UsageError, match="is not a folder"):
        push_compile_cache(tmp_path / "missing", REPO, CompileCacheKey(**KEY), token=WRITE, endpoint=hub.url)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="holds no cache file"):
        push_compile_cache(tmp_path / "empty", REPO, CompileCacheKey(**KEY), token=WRITE, endpoint=hub.url)


def test_a_read_only_token_cannot_push(hub, neff_cache):
    with pytest.raises(HubAuthError):
        push_compile_cache(neff_cache, REPO, CompileCacheKey(**KEY), token=READ, endpoint=hub.url)


def test_the_command_line_pushes_pulls_and_lists(hub, neff_cache, tmp_path, capsys):
    key_args = [
        "--model-id", KEY["model_id"], "--revision", KEY["revision"], "--instance-type", KEY["instance_type"],
        "--tensor-parallel-size", "4", "--dtype", "bfloat16", "--buckets", "context=128,1024;token=1024",
        "--torch-neuronx-version", KEY["torch_neuronx_version"], "--torch-version", KEY["torch_version"],
        "--cache-repo", REPO, "--endpoint", hub.url,
    ]  # fmt: skip
    assert main(["neff-cache", "push", "--cache-dir", str(neff_cache), "--token", WRITE, *key_args]) == 0
    assert "pushed 2 file(s)" in capsys.readouterr().out
    fresh = tmp_path / "fresh"
    assert main(["neff-cache", "pull", "--cache-dir", str(fresh), "--token", READ, *key_args]) == 0
    assert f"fetched 2 file(s) into {fresh}" in capsys.readouterr().out
    assert tree(fresh) == {p: b for p, b in tree(neff_cache).items() if not p.endswith(".tmp")}
    assert main(["neff-cache", "list", "--cache-repo", REPO, "--endpoint", hub.url, "--token", READ]) == 0
    out = capsys.readouterr().out
    assert f"{KEY['model_id']}@{KEY['revision']}  trn2.48xlarge  tp 4  bfloat16  context=128,1024;token=1024" in out
    miss = [a if a != "4" else "8" for a in key_args]
    assert main(["neff-cache", "pull", "--cache-dir", str(tmp_path / "miss"), "--token", READ, *miss]) == 0
    assert "has no compile cache under" in capsys.readouterr().out
    # Without a torch-neuronx version (none installed here): one line, exit status 2.
    no_version = key_args[: key_args.index("--torch-neuronx-version")] + key_args[key_args.index("--torch-version") :]
    assert main(["neff-cache", "pull", "--token", READ, *no_version]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "torch-neuronx is not installed here" in err[0]
