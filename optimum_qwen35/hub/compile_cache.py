"""TorchNeuron's compile cache on the Hub: push a local NEFF cache folder to a cache repo under a prefix keyed by
the export's configuration, and fetch it back into the local cache folder before the first compile.

TorchNeuron (`torch.compile(backend="neuron")`) compiles each graph on its first call and files the NEFF in a
persistent cache folder, `TORCH_NEURONX_NEFF_CACHE_DIR` (default `/tmp/neff_cache`), under a key hashed from the
StableHLO module, the compiler options and the neuronx-cc version (docs/torchneuron.md, "The compile cache"). The
key names no machine, so a folder filled on one trn2 serves another with the same SDK. These functions move such a
folder as it is: every file below it keeps its relative path.

Each fetched file is written to a temporary file beside its final path and renamed into place (what TorchNeuron's
own cache writes do), so that a cache entry is either absent or complete; `*.tmp` files are never pushed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi, hf_hub_download
from huggingface_hub.hf_api import RepoFile

from optimum_qwen35.errors import UsageError
from optimum_qwen35.hub.errors import check_repo_id, http_status, hub_errors
from optimum_qwen35.hub.push import same_as_remote, create_commit

# TorchNeuron's cache folder: its environment variable and default (torch-neuronx's cache_utils).
NEFF_CACHE_ENV = "TORCH_NEURONX_NEFF_CACHE_DIR"
DEFAULT_NEFF_CACHE_DIR = "/tmp/neff_cache"
# The cache repo's top folder for these caches, beside optimum-neuron's `neuronxcc-*` folders.
CACHE_ROOT = "optimum-qwen35-torchneuron"
KEY_FILE = "key.json"
FILES_DIR = "files"
KEY_FORMAT = "optimum-qwen35-torchneuron-cache"
KEY_VERSION = 1
# What TorchNeuron writes before its rename (and what `fetch_compile_cache` writes before its own).
TEMPORARY_SUFFIX = ".tmp"


def default_neff_cache_dir() -> Path:
    """The folder TorchNeuron compiles into: `TORCH_NEURONX_NEFF_CACHE_DIR`, else `/tmp/neff_cache`."""
    return Path(os.environ.get(NEFF_CACHE_ENV) or DEFAULT_NEFF_CACHE_DIR)


def _installed_version(package: str) -> str | None:
    try:
        return metadata.version(package).split("+")[0]
    except metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class CompileCacheKey:
    """The configuration a NEFF cache was compiled for: what decides which graphs an export compiles.

    `revision` should be the source checkpoint's commit (a branch moves); `buckets` maps a graph kind to its
    bucket sizes, e.g. {"context": [128, 1024], "token": [1024]}. `torch_neuronx_version` defaults to the
    installed torch-neuronx (required where it is not installed), `torch_version` to the installed torch."""

    model_id: str
    revision: str
    instance_type: str
    tp_degree: int
    dtype: str
    buckets: dict[str, list[int]]
    torch_neuronx_version: str | None = None
    torch_version: str | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        check_repo_id(self.model_id)
        torch_neuronx = self.torch_neuronx_version or _installed_version("torch-neuronx")
        if torch_neuronx is None:
            raise UsageError(
                "torch-neuronx is not installed here: give the torch-neuronx version the cache was compiled with"
                " (torch_neuronx_version=, --torch-neuronx-version)"
            )
        object.__setattr__(self, "torch_neuronx_version", torch_neuronx)
        object.__setattr__(self, "torch_version", self.torch_version or _installed_version("torch"))
        if not self.revision or not self.instance_type or not self.dtype:
            raise UsageError("a compile-cache key needs a revision, an instance type and a dtype")
        if int(self.tp_degree) < 1:
            raise UsageError(f"the TP degree must be at least 1, got {self.tp_degree}")
        buckets = {str(kind): sorted({int(b) for b in sizes}) for kind, sizes in self.buckets.items()}
        if not buckets or any(not sizes or sizes[0] < 1 for sizes in buckets.values()):
            raise UsageError(f"give every graph kind at least one positive bucket size, got {self.buckets}")
        object.__setattr__(self, "buckets", dict(sorted(buckets.items())))
        object.__setattr__(self, "tp_degree", int(self.tp_degree))

    def to_dict(self) -> dict:
        return {"format": KEY_FORMAT, "version": KEY_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict) -> CompileCacheKey:
        if data.get("format") != KEY_FORMAT or data.get("version") != KEY_VERSION:
            raise UsageError(f"not an {KEY_FORMAT} key of version {KEY_VERSION}: {data.get('format')} {data.get('version')}")
        return cls(**{k: v for k, v in data.items() if k not in ("format", "version")})

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def prefix(self) -> str:
        """`optimum-qwen35-torchneuron/<model id>/<instance>-tp<N>-<dtype>-<digest>`: readable, and the digest
        covers the whole key (revision, buckets, versions, extra)."""
        shape = _path_part(f"{self.instance_type}-tp{self.tp_degree}-{self.dtype}")
        return f"{CACHE_ROOT}/{self.model_id}/{shape}-{self.digest()}"


def _path_part(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)


def local_cache_files(cache_dir: str | os.PathLike) -> dict[str, Path]:
    """relative path -> file of every cache file below `cache_dir` (temporary files left out)."""
    cache_dir = Path(cache_dir)
    if not cache_dir.is_dir():
        raise UsageError(f"{cache_dir} is not a folder: give the TorchNeuron cache folder ({NEFF_CACHE_ENV})")
    return {
        p.relative_to(cache_dir).as_posix(): p
        for p in sorted(cache_dir.rglob("*"))
        if p.is_file() and not p.name.endswith(TEMPORARY_SUFFIX)
    }


def _remote_files(api, cache_repo: str, prefix: str) -> dict[str, RepoFile]:
    """path below `prefix` -> the repo file; empty when the prefix does not exist."""
    try:
        entries = list(api.list_repo_tree(cache_repo, path_in_repo=prefix, recursive=True, repo_type="model"))
    except Exception as e:  # noqa: BLE001 (a missing folder is an empty cache)
        if http_status(e) == 404 or type(e).__name__ in ("EntryNotFoundError", "RemoteEntryNotFoundError"):
            return {}
        raise
    return {f.path[len(prefix) + 1 :]: f for f in entries if isinstance(f, RepoFile)}


@dataclass
class CompileCachePushResult:
    cache_repo: str
    prefix: str
    uploaded: list[str]
    commit_sha: str | None  # None: the repo already held every file, no commit was made


def push_compile_cache(
    cache_dir: str | os.PathLike,
    cache_repo: str,
    key: CompileCacheKey,
    token: str | bool | None = None,
    endpoint: str | None = None,
) -> CompileCachePushResult:
    """Upload the files of the local cache folder `cache_dir` to `cache_repo` under `key.prefix()`, in one
    commit: `<prefix>/key.json` (the key) and `<prefix>/files/<relative path>`. Files the repo already holds
    unchanged are not sent, and nothing is deleted (another machine may have added graphs of the same key); a
    cache with nothing new makes no commit. The repo must exist."""
    check_repo_id(cache_repo)
    local = local_cache_files(cache_dir)
    if not local:
        raise UsageError(f"{cache_dir} holds no cache file: run the model once to compile, then push")
    prefix = key.prefix()
    key_bytes = (json.dumps(key.to_dict(), indent=2, sort_keys=True) + "\n").encode()
    sources: dict[str, Path | bytes] = {KEY_FILE: key_bytes, **{f"{FILES_DIR}/{p}": f for p, f in local.items()}}
    api = HfApi(endpoint=endpoint, token=token)
    with hub_errors("push the compile cache to", cache_repo, endpoint, None, token):
        remote = _remote_files(api, cache_repo, prefix)
        changed = [p for p, src in sources.items() if p not in remote or not same_as_remote(src, remote[p])]
        if not changed:
            return CompileCachePushResult(cache_repo, prefix, [], None)
        operations = [
            CommitOperationAdd(
                path_in_repo=f"{prefix}/{p}", path_or_fileobj=sources[p] if p == KEY_FILE else str(sources[p])
            )
            for p in changed
        ]
        sha, _ = create_commit(
            api,
            cache_repo,
            operations=operations,
            commit_message=f"TorchNeuron compile cache of {key.model_id}: {key.instance_type}, tp {key.tp_degree},"
            f" {key.dtype} ({len(changed) - (KEY_FILE in changed)} file(s))",
            repo_type="model",
        )
    return CompileCachePushResult(cache_repo, prefix, sorted(p for p in changed if p != KEY_FILE), sha)


@dataclass
class CompileCacheFetchResult:
    cache_repo: str
    prefix: str
    fetched: list[str]  # written into the cache folder
    present: list[str]  # already there with the same size, left alone

    @property
    def hit(self) -> bool:
        return bool(self.fetched or self.present)


def fetch_compile_cache(
    cache_dir: str | os.PathLike | None,
    cache_repo: str,
    key: CompileCacheKey,
    token: str | bool | None = None,
    endpoint: str | None = None,
) -> CompileCacheFetchResult:
    """Download the cache filed under `key` into the local cache folder `cache_dir` (default: TorchNeuron's,
    `default_neff_cache_dir()`), before the first compile. A key the repo lacks is a miss (nothing fetched,
    `hit` False): the caller compiles. Each file goes to a temporary file beside its final path and is renamed
    into place, so an interrupted fetch leaves no half-written entry; a file already there with the remote size
    is kept (cache files are named by their content's key)."""
    check_repo_id(cache_repo)
    target = Path(cache_dir) if cache_dir is not None else default_neff_cache_dir()
    prefix = key.prefix()
    api = HfApi(endpoint=endpoint, token=token)
    fetched, present = [], []
    with hub_errors("fetch the compile cache from", cache_repo, endpoint, None, token):
        remote = _remote_files(api, cache_repo, prefix)
        for rel, info in sorted(remote.items()):
            if not rel.startswith(f"{FILES_DIR}/"):
                continue
            path = rel[len(FILES_DIR) + 1 :]
            final = target / path
            if not final.resolve().is_relative_to(target.resolve()):
                raise UsageError(f"{cache_repo} names a cache file outside the cache folder: {path}")
            size = info.lfs.size if info.lfs is not None else info.size
            if final.is_file() and final.stat().st_size == size:
                present.append(path)
                continue
            local = hf_hub_download(cache_repo, f"{prefix}/{rel}", repo_type="model", token=token, endpoint=endpoint)
            _install(Path(local), final)
            fetched.append(path)
    return CompileCacheFetchResult(cache_repo, prefix, fetched, present)


def _install(source: Path, final: Path) -> None:
    """Copy `source` to `final` through a temporary file in `final`'s folder and a rename."""
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=TEMPORARY_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as out, open(source, "rb") as src:
            shutil.copyfileobj(src, out)
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass
class CompileCacheEntry:
    prefix: str
    key: CompileCacheKey
    files: int
    bytes: int


def list_compile_caches(
    cache_repo: str,
    model_id: str | None = None,
    token: str | bool | None = None,
    endpoint: str | None = None,
) -> list[CompileCacheEntry]:
    """The TorchNeuron caches filed in `cache_repo` (of `model_id` only, if given), with their keys."""
    check_repo_id(cache_repo)
    if model_id is not None:
        check_repo_id(model_id)
    root = CACHE_ROOT if model_id is None else f"{CACHE_ROOT}/{model_id}"
    api = HfApi(endpoint=endpoint, token=token)
    entries = []
    with hub_errors("list the compile caches of", cache_repo, endpoint, None, token):
        remote = _remote_files(api, cache_repo, root)
        prefixes = sorted(rel[: -len(KEY_FILE) - 1] for rel in remote if rel.rsplit("/", 1)[-1] == KEY_FILE)
        for rel in prefixes:
            local = hf_hub_download(cache_repo, f"{root}/{rel}/{KEY_FILE}", repo_type="model", token=token, endpoint=endpoint)
            key = CompileCacheKey.from_dict(json.loads(Path(local).read_text()))
            files = [f for p, f in remote.items() if p.startswith(f"{rel}/{FILES_DIR}/")]
            size = sum(f.lfs.size if f.lfs is not None else f.size for f in files)
            entries.append(CompileCacheEntry(f"{root}/{rel}", key, len(files), size))
    return entries
