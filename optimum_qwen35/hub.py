"""The Hugging Face Hub half of an export: push it, load it back by id, and register it in the compile cache.

An exported folder (see `docs/hub.md` for the layout) holds `config.json` (the text config),
`neuron_config.json` (a plain optimum-neuron `NxDNeuronConfig` dict), the generation config and tokenizer, and
the graphs: `compiled/` + `checkpoint/` for the cpu target, `model.pt` (+ `checkpoint/weights/` when exported
from a local folder) for Neuron.

- `push_to_hub(folder, repo_id, ...)`: one commit holding the folder and a generated model card. Files that
  already match the remote revision are not sent; an unchanged folder makes no commit at all; remote files
  the folder no longer has are deleted in the same commit. The local folder is only read.
- `resolve_export(repo_id_or_path, ...)`: a local folder as is, or the export files of a Hub repo through the
  Hugging Face cache (`snapshot_download`), offline from that cache when `HF_HUB_OFFLINE=1`.
- `resolve_source_checkpoint(folder, ...)`: the source checkpoint a Neuron export exported from a Hub id
  needs at load time (optimum-neuron fetches `checkpoint_id`@`checkpoint_revision` the same way).
- `registry_entry(folder)` / `sync_registry(folder, cache_repo)`: optimum-neuron's own `SingleModelCacheEntry`
  for the export, uploaded where optimum-neuron 0.4.5's `get_hub_cached_entries` (and so
  `optimum-cli neuron cache lookup` and its vLLM integration) look for it.

Every failure a user can fix raises a `HubError` subclass (errors.py) with a one-line message. Nothing heavy
is imported at module import time: huggingface_hub when a function runs, optimum-neuron only for the registry.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optimum_qwen35.errors import (
    CheckpointError,
    HubAuthError,
    HubConnectionError,
    HubError,
    HubNotFoundError,
    HubOfflineError,
    IncompatibleExportError,
    MissingDependencyError,
    ModelNotFoundError,
    UsageError,
)

__all__ = [
    "EXPORT_PATTERNS",
    "lookup_registry",
    "PushResult",
    "RegistrySyncResult",
    "model_card",
    "push_to_hub",
    "registry_entry",
    "registry_paths",
    "resolve_export",
    "resolve_source_checkpoint",
    "sync_registry",
]

TASK = "text-generation"
NEURON_CONFIG = "neuron_config.json"
# A cpu export's manifests (runtime/compiled.py GRAPHS_FILE, checkpoint/shard.py MANIFEST; a test keeps them equal):
# each is written last, so a folder with both is complete.
CPU_MANIFESTS = ("compiled/graphs.json", "checkpoint/tp_shards.json")
# The files of an export (what `resolve_export` downloads): configs, tokenizer, graphs and per-rank weights.
# README.md (the model card) and .gitattributes are not part of it.
EXPORT_PATTERNS = [
    "*.json",
    "*.jinja",
    "*.txt",
    "tokenizer*",
    "compiled/*",
    "checkpoint/*",
    "model.pt",
]
# Never pushed: local metadata folders (the Hugging Face local_dir cache, git, editor files).
_SKIP_PARTS = {".git", ".cache", "__pycache__"}


# --------------------------------------------------------------------------------------------- the folder


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:
        raise IncompatibleExportError(f"{path} is not readable JSON: {e}") from e
    if not isinstance(data, dict):
        raise IncompatibleExportError(f"{path} holds a JSON {type(data).__name__}, not an object: export the model again")
    return data


def _neuron_config(folder: Path) -> dict:
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelNotFoundError(f"{folder} is not a folder")
    missing = [name for name in ("config.json", NEURON_CONFIG) if not (folder / name).is_file()]
    if missing:
        raise IncompatibleExportError(
            f"{folder} is not an exported model: it has no {' and no '.join(missing)} (export it first)"
        )
    return _read_json(folder / NEURON_CONFIG)


def _is_cpu(nc: dict) -> bool:
    return nc.get("target") == "cpu"


def _export_files(folder: Path, nc: dict) -> dict[str, Path]:
    """The files of `folder` to push, path in repo -> local path (sorted, posix paths)."""
    folder = Path(folder)
    skip_checkpoint = not _is_cpu(nc) and nc.get("checkpoint_id") is not None
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if not path.is_file() or _SKIP_PARTS.intersection(rel.parts):
            continue
        # As optimum-neuron's push_to_hub: a Neuron export of a Hub model does not carry the weights (they are
        # fetched from the source checkpoint at load).
        if skip_checkpoint and rel.parts[0] == "checkpoint":
            continue
        out[rel.as_posix()] = path
    return out


def _package_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _export_versions(folder: Path, nc: dict) -> dict[str, str | None]:
    """Versions to state in the card: the export's own records first, the installed packages otherwise."""
    from optimum_qwen35 import __version__

    recorded: dict[str, Any] = {}
    for manifest in CPU_MANIFESTS:
        try:
            recorded.update(json.loads((Path(folder) / manifest).read_text()))
        except (OSError, ValueError):
            pass
    config = _read_json(Path(folder) / "config.json")
    return {
        "optimum-qwen35": recorded.get("optimum_qwen35_version") or __version__,
        "optimum-neuron": nc.get("optimum_neuron_version"),
        "neuronx-cc": nc.get("neuronxcc_version"),
        "torch": recorded.get("torch_version") or _package_version("torch"),
        "transformers": config.get("transformers_version"),
    }


def model_card(folder: str | os.PathLike, repo_id: str) -> str:
    """The README.md pushed with an export: metadata, the compiled shapes, versions and how to load it.

    Deterministic (no dates): pushing the same folder again produces the same card, so nothing changes."""
    folder = Path(folder)
    nc = _neuron_config(folder)
    config = _read_json(folder / "config.json")
    base = nc.get("checkpoint_id")
    target = nc.get("target")
    versions = _export_versions(folder, nc)
    front = ["---", "library_name: optimum-neuron", "pipeline_tag: text-generation"]
    if base:
        front.append(f"base_model: {base}")
    front += [
        "tags:",
        "- optimum-neuron",
        "- optimum-qwen35",
        "- qwen3_5",
        *(["- qwen3_5_moe"] if config.get("model_type") == "qwen3_5_moe_text" else []),
        f"- {'cpu' if target == 'cpu' else 'neuron'}",
    ]
    front.append("---")
    rows = [
        (
            "base model",
            f"`{base}`" + (f" @ `{nc['checkpoint_revision']}`" if nc.get("checkpoint_revision") else "")
            if base
            else "exported from a local folder",
        ),
        ("target", f"`{target}`"),
        ("batch size", nc.get("batch_size")),
        ("sequence length", nc.get("sequence_length")),
        ("tensor parallel degree", nc.get("tp_degree")),
        ("dtype", f"`{nc.get('torch_dtype')}`"),
        ("continuous batching", nc.get("continuous_batching")),
        ("model type", f"`{config.get('model_type')}`"),
    ]
    if not _is_cpu(nc):
        carries = (folder / "checkpoint").is_dir() and base is None
        weights = "in this repository (`checkpoint/weights/`)" if carries else f"fetched from `{base}` at load time"
    else:
        weights = "in this repository (`checkpoint/`, one file per rank)"
    rows.append(("weights", weights))
    lines = front + [
        "",
        f"# {repo_id}",
        "",
        f"A Qwen3.5 model exported with optimum-qwen35 for the `{target}` target: its graphs are compiled for the"
        " static shapes below and run only with them.",
        "",
        "| | |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in rows],
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v) + ".",
        "",
        "## Load it",
        "",
        "```python",
        "from optimum_qwen35.hub import resolve_export",
        "from optimum_qwen35.optimum import Qwen35NeuronModelForCausalLM",
        "",
        f'model = Qwen35NeuronModelForCausalLM.from_pretrained(resolve_export("{repo_id}"))',
        "```",
        "",
        "The graphs load only with the same optimum-neuron (and, on Neuron, neuronx-cc) versions as above.",
        "",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- Hub errors


def _endpoint_name(endpoint: str | None) -> str:
    if endpoint:
        return endpoint
    from huggingface_hub import constants

    return constants.ENDPOINT


def _offline() -> bool:
    from huggingface_hub import constants

    flag = getattr(constants, "is_offline_mode", None)
    if callable(flag):
        return bool(flag())
    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def _chain(error: BaseException):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _is_connection_error(error: BaseException) -> bool:
    for e in _chain(error):
        name = type(e).__name__
        # httpx (huggingface_hub 1.x+): a connection that drops mid-request is a RemoteProtocolError / ReadError.
        dropped = ("RemoteProtocolError", "ReadError", "WriteError", "RemoteDisconnected")
        if isinstance(e, (ConnectionError, TimeoutError)) or name in ("ConnectError", "ConnectTimeout", "ReadTimeout", *dropped):
            return True
        if "ConnectionError" in name or ("Timeout" in name and "Lock" not in name):
            return True
    return False


def _server_message(error: BaseException) -> str:
    msg = getattr(error, "server_message", None) or ""
    if not msg:
        response = getattr(error, "response", None)
        if response is not None:
            msg = response.headers.get("X-Error-Message", "") or ""
    return " ".join(str(msg).split())[:200]


def _status(error: BaseException) -> int | None:
    response = getattr(error, "response", None)
    return getattr(response, "status_code", None)


@contextmanager
def _hub_errors(action: str, repo_id: str, endpoint: str | None, revision: str | None = None, token=None):
    """Turn huggingface_hub's exceptions into one-line package errors saying what to do."""
    from huggingface_hub import errors as hf_errors

    from optimum_qwen35.quiet import hub_retries

    where = f"{repo_id}" + (f" (revision {revision!r})" if revision and revision != "main" else "")
    try:
        with hub_retries():
            yield
    except (HubError, IncompatibleExportError, CheckpointError, UsageError):
        raise
    except hf_errors.OfflineModeIsEnabled as e:
        raise HubOfflineError(f"cannot {action} {where}: offline mode (HF_HUB_OFFLINE=1) is on") from e
    except hf_errors.RevisionNotFoundError as e:
        raise HubNotFoundError(f"cannot {action} {where}: revision {revision!r} does not exist in {repo_id}") from e
    except hf_errors.RepositoryNotFoundError as e:
        who = "without a token" if token is False or (token is None and not _has_token()) else "with this token"
        raise HubNotFoundError(
            f"cannot {action} {where}: repository {repo_id} not found on {_endpoint_name(endpoint)}"
            f" (or it is private and not readable {who})"
        ) from e
    except hf_errors.GatedRepoError as e:
        raise HubAuthError(f"cannot {action} {where}: the repository is gated; request access on the Hub") from e
    except getattr(hf_errors, "IncompleteSnapshotError", ()) as e:  # huggingface_hub 2.x: a partial cached snapshot
        found = re.search(r"(\d+ file\(s\) are missing \(.*?\))\.", " ".join(str(e).split()))
        what = found.group(1) if found else "files are missing"
        raise HubOfflineError(
            f"cannot {action} {where}: the Hub is not used (offline mode) or not reachable, and its cached snapshot"
            f" is incomplete, {what}; download it once online"
        ) from e
    except getattr(hf_errors, "LocalEntryNotFoundError", ()) as e:  # before EntryNotFoundError (its subclass in 0.x)
        if _offline():
            raise HubOfflineError(
                f"cannot {action} {where}: offline mode (HF_HUB_OFFLINE=1) and it is not in the local cache"
            ) from e
        if _is_connection_error(e) or "internet connection" in str(e):
            raise HubConnectionError(
                f"cannot {action} {where}: the Hub at {_endpoint_name(endpoint)} cannot be reached"
            ) from e
        raise HubNotFoundError(f"cannot {action} {where}: {' '.join(str(e).split())[:200]}") from e
    except hf_errors.EntryNotFoundError as e:
        raise HubNotFoundError(
            f"cannot {action} {where}: a file is missing from the repository ({_short_url(e)})"
        ) from e
    except hf_errors.HfHubHTTPError as e:
        status, message = _status(e), _server_message(e)
        if status == 401:
            if token is False or (token is None and not _has_token()):
                raise HubAuthError(
                    f"cannot {action} {where}: the Hub needs a token for this (401 {message or 'unauthorized'});"
                    " pass --token or set HF_TOKEN"
                ) from e
            raise HubAuthError(
                f"cannot {action} {where}: the Hub rejected the token (401 {message or 'unauthorized'});"
                " pass a valid --token or set HF_TOKEN"
            ) from e
        if status == 403:
            raise HubAuthError(
                f"cannot {action} {where}: the token has no write access (403 {message or 'forbidden'});"
                " use a token with write rights on the namespace"
            ) from e
        if status == 412:
            raise HubError(f"cannot {action} {where}: the branch changed during the push; push again") from e
        raise HubError(f"cannot {action} {where}: HTTP {status} {message}".rstrip()) from e
    except Exception as e:
        answered = _status_in_message(e)
        if answered:
            # hf_xet (huggingface_hub's Xet uploads and downloads) reports an HTTP error status as a ConnectionError.
            status, reason, url = answered
            hint = " (a server without Xet storage: set HF_HUB_DISABLE_XET=1)" if "xet" in url.lower() else ""
            said = f"cannot {action} {where}: the Hub at {_endpoint_name(endpoint)} answered {status} {reason} for {url}"
            if status == 404:
                raise HubNotFoundError(said + hint) from e
            raise (HubAuthError if status in (401, 403) else HubError)(said) from e
        if _is_connection_error(e):
            raise HubConnectionError(
                f"cannot {action} {where}: the Hub at {_endpoint_name(endpoint)} cannot be reached ({type(e).__name__})"
            ) from e
        raise


_STATUS_IN_MESSAGE = re.compile(r"HTTP status (?:client|server) error \((\d{3}) ([^)]*)\)(?:, domain: (\S+))?")


def _status_in_message(error: BaseException) -> tuple[int, str, str] | None:
    """(status, reason, url) when an error of the chain is a server's HTTP answer reported in words (hf_xet's
    "HTTP status client error (404 Not Found), domain: <url>"), else None."""
    for e in _chain(error):
        found = _STATUS_IN_MESSAGE.search(str(e))
        if found:
            return int(found.group(1)), found.group(2), found.group(3) or "a request"
    return None


def _short_url(error: BaseException) -> str:
    response = getattr(error, "response", None)
    url = str(getattr(response, "url", "") or "")
    return url.split("/resolve/", 1)[-1] if url else "unknown file"


def _has_token() -> bool:
    from huggingface_hub import get_token

    return get_token() is not None


# ----------------------------------------------------------------------------------------------- push


@dataclass
class PushResult:
    """What `push_to_hub` did: the commit the revision now points at, and what changed."""

    repo_id: str
    revision: str
    commit_sha: str
    commit_url: str
    uploaded: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.uploaded or self.deleted)


def _git_blob_oid(path: Path) -> str:
    h = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _same_as_remote(local: Path | bytes, remote) -> bool:
    """True if the local content equals the remote file (by the hash the Hub reports for it)."""
    size = len(local) if isinstance(local, bytes) else local.stat().st_size
    if remote.size != size and remote.lfs is None:
        return False
    if remote.lfs is not None:
        if remote.lfs.size != size:
            return False
        digest = hashlib.sha256(local).hexdigest() if isinstance(local, bytes) else _sha256(local)
        return digest == remote.lfs.sha256
    if isinstance(local, bytes):
        oid = hashlib.sha1(b"blob %d\0" % len(local) + local).hexdigest()
    else:
        oid = _git_blob_oid(local)
    return oid == remote.blob_id


def push_to_hub(
    folder: str | os.PathLike,
    repo_id: str,
    revision: str | None = None,
    private: bool | None = None,
    token: str | bool | None = None,
    endpoint: str | None = None,
    commit_message: str | None = None,
) -> PushResult:
    """Push an exported folder to the Hub model repo `repo_id` in one commit, with a generated model card.

    Creates the repo if needed (`private` applies only then) and the branch `revision` (from main) if it does
    not exist. Only files that differ from the remote revision are uploaded, remote files the folder no longer
    has are deleted in the same commit, and an unchanged folder makes no commit at all. The commit names its
    parent, so a concurrent push fails instead of mixing two exports; a failed commit leaves the repo as it was.
    The folder is only read: the card goes into the commit from memory.
    `token`: a Hub token (default: huggingface_hub's, i.e. HF_TOKEN or the stored login); `endpoint`: the Hub
    URL (default: huggingface_hub's, i.e. HF_ENDPOINT)."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi
    from huggingface_hub.hf_api import RepoFile

    folder = Path(folder)
    nc = _neuron_config(folder)
    _check_repo_id(repo_id)
    branch = revision or "main"
    local = _export_files(folder, nc)
    card = model_card(folder, repo_id).encode() if "README.md" not in local else None
    api = HfApi(endpoint=endpoint, token=token)
    with _hub_errors("push to", repo_id, endpoint, branch, token):
        _ensure_repo(api, repo_id, private)
        if branch != "main":
            api.create_branch(repo_id, branch=branch, exist_ok=True)
        head = api.repo_info(repo_id, revision=branch, repo_type="model").sha
        remote = {
            f.path: f
            for f in api.list_repo_tree(repo_id, recursive=True, revision=head, repo_type="model")
            if isinstance(f, RepoFile)
        }
        sources: dict[str, Path | bytes] = dict(local)
        if card is not None:
            sources["README.md"] = card
        changed = [p for p, src in sources.items() if p not in remote or not _same_as_remote(src, remote[p])]
        stale = sorted(p for p in remote if p not in sources and p != ".gitattributes")
        if not changed and not stale:
            return PushResult(repo_id, branch, head, _commit_url(api, repo_id, head))
        operations = [CommitOperationDelete(path_in_repo=p) for p in stale]
        for p in changed:
            src = sources[p]
            operations.append(
                CommitOperationAdd(path_in_repo=p, path_or_fileobj=src if isinstance(src, bytes) else str(src))
            )
        message = commit_message or _default_message(nc)
        sha, url = _create_commit(
            api,
            repo_id,
            operations=operations,
            commit_message=message,
            revision=branch,
            parent_commit=head,
            repo_type="model",
        )
    return PushResult(repo_id, branch, sha, url, sorted(changed), stale)


def _ensure_repo(api, repo_id: str, private: bool | None) -> None:
    """Create the repo unless it exists. (Asked first: it avoids a write attempt when it exists, and
    huggingface_hub 0.x's create_repo(exist_ok=True) mis-parses its own URL on an explicit endpoint after a 403.)"""
    from huggingface_hub import errors as hf_errors

    try:
        api.repo_info(repo_id, repo_type="model")
        return
    except hf_errors.RepositoryNotFoundError:
        pass
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")


def _create_commit(api, repo_id: str, **kwargs) -> tuple[str, str]:
    """`api.create_commit` -> (sha, url).

    huggingface_hub 0.x parses the returned commit URL against the *default* endpoint (HF_ENDPOINT), not the
    one the HfApi was given: with an explicit other `endpoint` the commit is made, then parsing its URL raises
    ValueError. The commit then exists: read the branch head instead of reporting a failure."""
    try:
        info = api.create_commit(repo_id, **kwargs)
    except ValueError as e:
        if "Unable to retrieve user and repo ID" not in str(e):
            raise
        sha = api.repo_info(repo_id, revision=kwargs.get("revision"), repo_type="model").sha
        return sha, _commit_url(api, repo_id, sha)
    # The URL on the endpoint pushed to (the server's own `commitUrl` may name another host).
    return info.oid, _commit_url(api, repo_id, info.oid)


def _commit_url(api, repo_id: str, sha: str) -> str:
    return f"{api.endpoint.rstrip('/')}/{repo_id}/commit/{sha}"


def _shape(nc: dict) -> str:
    return (
        f"target {nc.get('target')}, batch {nc.get('batch_size')}, sequence {nc.get('sequence_length')},"
        f" tp {nc.get('tp_degree')}, {nc.get('torch_dtype')}"
    )


def _default_message(nc: dict) -> str:
    return f"Upload optimum-qwen35 export ({_shape(nc)})"


def _repo_id_problem(repo_id) -> str | None:
    """Why `repo_id` breaks the Hub's naming rules (huggingface_hub's own validator), or None."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not isinstance(repo_id, str) or not repo_id:
        return "it is empty"
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        return " ".join(str(e).split())
    return None


def _check_repo_id(repo_id: str) -> None:
    problem = _repo_id_problem(repo_id)
    if problem:
        raise UsageError(f"{repo_id!r} is not a valid Hub repository id: {problem} (expected 'namespace/name')")


# ----------------------------------------------------------------------------------------------- load


def _required_files(folder: Path, nc: dict) -> list[str]:
    if _is_cpu(nc):
        return list(CPU_MANIFESTS)
    return ["model.pt"]


def _missing(folder: Path, names) -> list[str]:
    return [n for n in names if not (folder / n).exists()]


def resolve_export(
    repo_id_or_path: str | os.PathLike,
    revision: str | None = None,
    token: str | bool | None = None,
    endpoint: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
    force_download: bool = False,
    subfolder: str | None = None,
) -> Path:
    """The local folder of an export: `repo_id_or_path` itself if it is a folder, else the export files of
    that Hub repo at `revision`, downloaded into (or, offline, read from) the Hugging Face cache; `subfolder`: the
    export is that folder of the repo (or of the local folder).

    Only the export's files are fetched (configs, tokenizer, `compiled/`, `checkpoint/`, `model.pt`; not the
    model card). With `HF_HUB_OFFLINE=1` or `local_files_only=True` nothing is downloaded: a cached snapshot
    is used, or `HubOfflineError` names what is missing. For a Neuron export of a Hub model, the weights are
    not part of the export: see `resolve_source_checkpoint`."""
    path = Path(repo_id_or_path)
    if path.is_dir():
        path = path / (subfolder or "")
        _neuron_config(path)
        return path
    name = str(repo_id_or_path)
    problem = _repo_id_problem(name)
    if problem:
        raise ModelNotFoundError(f"{name} is neither a folder nor a valid Hub repository id ({problem})")
    offline = local_files_only or _offline()
    try:
        folder = _download_export(name, revision, token, endpoint, cache_dir, local_files_only, offline, force_download, subfolder)
    except (HubNotFoundError, HubConnectionError, HubOfflineError) as e:
        raise _no_folder_either(name, e) from e
    missing = _missing(folder, ["config.json", NEURON_CONFIG])
    if missing and not offline:
        raise IncompatibleExportError(
            f"{name}{_at(revision)} is not an exported model: it has no {' and no '.join(missing)}"
        )
    if not missing:
        missing = _missing(folder, _required_files(folder, _read_json(folder / NEURON_CONFIG)))
    if missing:
        if offline:
            raise HubOfflineError(
                f"cannot load {name}{_at(revision)} offline: the cached snapshot {folder} lacks {', '.join(missing)};"
                " download it once online, or unset HF_HUB_OFFLINE"
            )
        raise IncompatibleExportError(f"{name}{_at(revision)} is an incomplete export: it lacks {', '.join(missing)}")
    return folder


def _download_export(name, revision, token, endpoint, cache_dir, local_files_only: bool, offline: bool,
                     force_download: bool = False, subfolder: str | None = None) -> Path:
    from huggingface_hub import snapshot_download

    patterns = [f"{subfolder}/{p}" for p in EXPORT_PATTERNS] if subfolder else EXPORT_PATTERNS
    with _hub_errors("download", name, endpoint, revision, token):
        try:
            return Path(
                snapshot_download(
                    name,
                    revision=revision,
                    repo_type="model",
                    token=token,
                    endpoint=endpoint,
                    cache_dir=cache_dir,
                    allow_patterns=patterns,
                    local_files_only=local_files_only,
                    force_download=force_download,
                )
            ) / (subfolder or "")
        except Exception as e:
            if offline and type(e).__name__ in ("LocalEntryNotFoundError", "OfflineModeIsEnabled"):
                raise HubOfflineError(
                    f"cannot load {name}{_at(revision)} offline: it is not in the Hugging Face cache"
                    f" ({_cache_name(cache_dir)}); missing: the whole export (config.json, {NEURON_CONFIG}, graphs,"
                    " weights). Download it once online, or unset HF_HUB_OFFLINE"
                ) from e
            raise


def _at(revision: str | None) -> str:
    return f"@{revision}" if revision else ""


def _cache_name(cache_dir) -> str:
    if cache_dir is not None:
        return str(cache_dir)
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def download_checkpoint(
    repo_id: str,
    revision: str | None = None,
    token: str | bool | None = None,
    endpoint: str | None = None,
    allow_patterns: list[str] | None = None,
) -> Path:
    """A Hub model (a source checkpoint to export) in the Hugging Face cache; one-line errors as above."""
    from huggingface_hub import snapshot_download

    problem = _repo_id_problem(repo_id)
    if problem and repo_id.startswith((".", "/", "~")) or repo_id.endswith("/"):
        raise ModelNotFoundError(f"no such folder: {repo_id!r}")  # a path, by its form
    if problem:
        raise ModelNotFoundError(f"{repo_id} is neither a local folder nor a valid Hub repository id ({problem})")
    try:
        with _hub_errors("download", repo_id, endpoint, revision, token):
            return Path(snapshot_download(repo_id, revision=revision, token=token, endpoint=endpoint, allow_patterns=allow_patterns))
    except (HubNotFoundError, HubConnectionError, HubOfflineError) as e:
        raise _no_folder_either(repo_id, e) from e


def _no_folder_either(name: str, error: HubError) -> HubError:
    """A name that is no local folder and failed on the Hub may be a mistyped path (`tinyy`): say both."""
    if "no local folder" in str(error) or Path(name).exists():
        return error
    return type(error)(f"{error}; there is no local folder {name!r} either")


def resolve_source_checkpoint(
    folder: str | os.PathLike,
    token: str | bool | None = None,
    endpoint: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
) -> Path | None:
    """The source checkpoint a Neuron export needs at load time, or None when the export carries its weights.

    A cpu export, or a Neuron export made from a local folder (`checkpoint/weights/`), carries them. A Neuron
    export made from a Hub id does not: its safetensors (and config) are fetched from `checkpoint_id` at
    `checkpoint_revision`, as optimum-neuron's `load_weights` does, into the Hugging Face cache."""
    folder = Path(folder)
    nc = _neuron_config(folder)
    if _is_cpu(nc) or (folder / "checkpoint").is_dir():
        return None
    checkpoint_id = nc.get("checkpoint_id")
    if not checkpoint_id:
        raise CheckpointError(
            f"{folder} holds no weights (no checkpoint/) and names no source checkpoint (checkpoint_id is null):"
            " export it again"
        )
    from huggingface_hub import snapshot_download

    revision = nc.get("checkpoint_revision")
    with _hub_errors("download the source checkpoint", checkpoint_id, endpoint, revision, token):
        weights = Path(
            snapshot_download(
                checkpoint_id,
                revision=revision,
                repo_type="model",
                token=token,
                endpoint=endpoint,
                cache_dir=cache_dir,
                allow_patterns=["*.safetensors*", "config.json", "generation_config.json"],
                local_files_only=local_files_only,
            )
        )
    if not any(weights.glob("*.safetensors")):
        raise CheckpointError(
            f"the source checkpoint {checkpoint_id}{_at(revision)} of {folder} has no safetensors weights"
        )
    return weights


# ------------------------------------------------------------------------------------ compile-cache registry


def _optimum_neuron():
    from optimum_qwen35.quiet import optimum_neuron_import

    try:
        with optimum_neuron_import():
            from optimum.neuron.cache import hub_cache
            from optimum.neuron.cache.entries.single_model import SingleModelCacheEntry
            from optimum.neuron.version import __version__ as on_version
    except ImportError as e:
        raise MissingDependencyError(
            f"the compile-cache registry needs optimum-neuron 0.4.5 ({e}); install it with"
            " `pip install 'optimum-qwen35[optimum]'`"
        ) from e
    return hub_cache, SingleModelCacheEntry, on_version


def _load_config(config):
    """A transformers text config from a folder, a config.json path, a dict or a PretrainedConfig."""
    from transformers import AutoConfig, PretrainedConfig

    from optimum_qwen35.config import register_transformers_configs

    register_transformers_configs()
    if isinstance(config, PretrainedConfig):
        cfg = config
    elif isinstance(config, dict):
        rest = {k: v for k, v in config.items() if k != "model_type"}
        cfg = AutoConfig.for_model(config["model_type"], **rest)
    else:
        path = Path(config)
        cfg = AutoConfig.from_pretrained(path.parent if path.is_file() else path)
    text = cfg.get_text_config()
    return text if text is not None else cfg


def registry_entry(folder: str | os.PathLike, model_id: str | None = None, config=None):
    """optimum-neuron's own `SingleModelCacheEntry` for an export, as its `_export` builds it.

    `model_id`: the Hub id the entry is filed under (default: the export's `checkpoint_id`). `config`: the text
    config its architecture digest is computed from (default: the export's config.json; a folder, a path, a
    dict or a PretrainedConfig). The digest covers the whole config except optimum-neuron's white list, which
    drops `torch_dtype` but keeps `dtype`: a lookup of `model_id` computes it from the Hub's config of
    `model_id`, so it finds this entry only if that config equals this one, dtype included (as with the entries
    optimum-neuron writes itself). Pass the source checkpoint's config when the export changed the dtype."""
    folder = Path(folder)
    nc = _neuron_config(folder)
    _, SingleModelCacheEntry, on_version = _optimum_neuron()
    model_id = model_id or nc.get("checkpoint_id")
    if not model_id:
        raise UsageError(
            f"{folder} was exported from a local folder (checkpoint_id is null): give the Hub id to file its"
            " cache entry under (--model-id)"
        )
    if nc.get("optimum_neuron_version") != on_version:
        raise IncompatibleExportError(
            f"{folder} was exported with optimum-neuron {nc.get('optimum_neuron_version')}, but {on_version} is"
            " installed: its cache entry would be filed for the wrong version"
        )
    text_config = _load_config(config if config is not None else folder)
    if config is None:
        # The export's config.json names the architecture vLLM looks up; the Hub's config of `model_id`, which a
        # lookup digests, does not (a text sub-config has none): leave it out so that the two digests agree.
        from optimum_qwen35.optimum.registration import EXPORT_ARCHITECTURES  # noqa: PLC0415

        if getattr(text_config, "architectures", None) == [EXPORT_ARCHITECTURES.get(text_config.model_type)]:
            text_config.architectures = None
    return SingleModelCacheEntry(model_id, TASK, text_config, neuron_config=dict(nc))


def _compiler_dir(api, cache_repo: str, nc: dict) -> str:
    """The cache repo's top folder for this compiler, as optimum-neuron's `hub_registry_path` finds it: the
    first root folder starting with `neuronxcc-<neuronx-cc version pinned by optimum-neuron>`."""
    from optimum.neuron.utils.version_utils import get_pinned_version

    prefix = "neuronxcc-" + get_pinned_version("neuronx-cc")
    for entry in api.list_repo_tree(cache_repo, path_in_repo="", recursive=False, repo_type="model"):
        if entry.path.startswith(prefix):
            return entry.path
    version = nc.get("neuronxcc_version")
    return f"neuronxcc-{version}" if version and version.startswith(prefix[len("neuronxcc-") :]) else prefix


def registry_paths(entry, compiler_dir: str) -> list[str]:
    """Where optimum-neuron files an entry: under its arch digest (what lookups read) and the model-id alias."""
    hub_cache, _, _ = _optimum_neuron()
    registry = f"{compiler_dir}/{hub_cache.REGISTRY_FOLDER}"
    return [
        f"{registry}/{entry.arch_digest()}/{entry.hash}.json",
        f"{registry}/{entry.model_type}/{entry.model_id}/{entry.hash}.json",
    ]


@dataclass
class RegistrySyncResult:
    cache_repo: str
    paths: list[str]
    commit_sha: str
    arch_digest: str


def sync_registry(
    folder: str | os.PathLike,
    cache_repo: str | None = None,
    token: str | bool | None = None,
    endpoint: str | None = None,
    model_id: str | None = None,
    config=None,
) -> RegistrySyncResult:
    """Upload the export's registry entry to the compile-cache repo, in one commit.

    `cache_repo`: default optimum-neuron's choice (`CUSTOM_CACHE_REPO`, then the repo saved by
    `optimum-cli neuron cache set`, then aws-neuron/optimum-neuron-cache). The repo must exist. The entry goes to
    `<neuronxcc dir>/0_REGISTRY/<optimum-neuron version>/<arch digest>/<hash>.json` and to the alias
    `.../<model_type>/<model_id>/<hash>.json`, where `optimum-cli neuron cache lookup <model_id>` finds it.
    Syncing an entry that is already there makes no commit (huggingface_hub skips unchanged files).
    `model_id`, `config`: see `registry_entry`."""
    from huggingface_hub import CommitOperationAdd, HfApi

    for repo in (cache_repo, model_id):
        if repo is not None:
            _check_repo_id(repo)
    entry = registry_entry(folder, model_id=model_id, config=config)
    nc = _neuron_config(Path(folder))
    if cache_repo is None:
        from optimum.neuron.utils.cache_utils import get_hf_hub_cache_repo

        cache_repo = get_hf_hub_cache_repo()
    _check_repo_id(cache_repo)
    api = HfApi(endpoint=endpoint, token=token)
    content = entry.serialize().encode()
    with _hub_errors("sync the cache registry of", cache_repo, endpoint, None, token):
        compiler_dir = _compiler_dir(api, cache_repo, nc)
        paths = registry_paths(entry, compiler_dir)
        operations = [CommitOperationAdd(path_in_repo=p, path_or_fileobj=content) for p in paths]
        if _is_cpu(nc):
            # The cpu target's compiled graphs (its "NEFFs"), so that an export of this configuration downloads
            # them instead of compiling.
            graphs = cached_graphs_path(entry, compiler_dir, _graphs_torch_version(Path(folder)))
            operations += [
                CommitOperationAdd(path_in_repo=f"{graphs}/{f.name}", path_or_fileobj=str(f))
                for f in sorted((Path(folder) / "compiled").iterdir())
                if f.is_file()
            ]
        sha, _ = _create_commit(
            api,
            cache_repo,
            operations=operations,
            commit_message=f"Register a compiled configuration of {entry.model_id}: {_shape(nc)}",
            repo_type="model",
        )
    return RegistrySyncResult(cache_repo, paths, sha, entry.arch_digest())


# Where the cpu target's compiled graphs of a registered configuration live in the cache repo.
CPU_GRAPHS_FOLDER = "optimum-qwen35-cpu"


def cached_graphs_path(entry, compiler_dir: str, torch_version: str) -> str:
    """`<compiler dir>/optimum-qwen35-cpu/torch-<version>/<entry hash>`: programs are tied to the torch
    version that exported them, and the entry hash covers the model config and the neuron config."""
    return f"{compiler_dir}/{CPU_GRAPHS_FOLDER}/torch-{torch_version}/{entry.hash}"


def _graphs_torch_version(folder: Path) -> str:
    return _read_json(folder / CPU_MANIFESTS[0])["torch_version"]


def fetch_cached_graphs(
    folder: str | os.PathLike,
    cache_repo: str | None = None,
    token: str | bool | None = None,
    endpoint: str | None = None,
) -> bool:
    """Download the compiled graphs of an export being built in `folder` (its config.json and
    neuron_config.json written, its checkpoint_id a Hub id) from the compile-cache repo, if that configuration
    was synced there by the installed torch. True if it did (then `folder/compiled` is complete), False if the
    cache has no such graphs. The caller compiles when this is False or raises a `HubError`."""
    from huggingface_hub import HfApi, hf_hub_download

    import torch

    folder = Path(folder)
    nc = _neuron_config(folder)
    if not _is_cpu(nc) or not nc.get("checkpoint_id"):
        return False
    entry = registry_entry(folder)
    if cache_repo is None:
        from optimum.neuron.utils.cache_utils import get_hf_hub_cache_repo

        cache_repo = get_hf_hub_cache_repo()
    api = HfApi(endpoint=endpoint, token=token)
    with _hub_errors("read the compile cache", cache_repo, endpoint, None, token):
        base = cached_graphs_path(entry, _compiler_dir(api, cache_repo, nc), torch.__version__.split("+")[0])
        try:
            files = [f.path for f in api.list_repo_tree(cache_repo, path_in_repo=base, repo_type="model") if hasattr(f, "size")]
        except Exception as e:  # noqa: BLE001 (a missing folder is a cache miss)
            if _status(e) == 404 or type(e).__name__ in ("EntryNotFoundError", "RemoteEntryNotFoundError"):
                return False
            raise
        if CPU_MANIFESTS[0].split("/")[-1] not in {p.rsplit("/", 1)[-1] for p in files}:
            return False
        target = folder / "compiled"
        staging = folder / ".compiled.partial"
        staging.mkdir(parents=True, exist_ok=True)
        for path in files:
            local = hf_hub_download(cache_repo, path, repo_type="model", token=token, endpoint=endpoint)
            shutil.copyfile(local, staging / path.rsplit("/", 1)[-1])
        os.replace(staging, target)
    return True


def lookup_registry(
    model_id: str,
    cache_repo: str | None = None,
    target: str | None = None,
    batch_size: int | None = None,
    sequence_length: int | None = None,
    tp_degree: int | None = None,
    torch_dtype: str | None = None,
) -> list[dict]:
    """optimum-neuron's `select_hub_cached_entries` for `model_id`: the neuron configs registered for it.

    optimum-neuron reads the endpoint and token from the environment (HF_ENDPOINT, HF_TOKEN), not arguments."""
    _check_repo_id(model_id)
    if cache_repo is not None:
        _check_repo_id(cache_repo)
    hub_cache, _, _ = _optimum_neuron()
    from optimum_qwen35.config import register_transformers_configs

    register_transformers_configs()
    with _hub_errors("look up the cache registry for", model_id, None):
        try:
            return hub_cache.select_hub_cached_entries(
                model_id,
                task=TASK,
                cache_repo_id=cache_repo,
                instance_type=target,
                batch_size=batch_size,
                sequence_length=sequence_length,
                tensor_parallel_size=tp_degree,
                torch_dtype=torch_dtype,
            )
        except ValueError as e:
            if "No hub cache registry" in str(e) or "Unable to evaluate model type" in str(e):
                raise HubNotFoundError(f"cannot look up {model_id}: {' '.join(str(e).split())}") from e
            raise
