"""Push an export to a Hub model repo in one commit, sending only what changed."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi
from huggingface_hub import errors as hf_errors
from huggingface_hub.hf_api import RepoFile

from optimum_qwen35.export import layout
from optimum_qwen35.hub.card import model_card
from optimum_qwen35.hub.errors import check_repo_id, hub_errors


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


def same_as_remote(local: Path | bytes, remote) -> bool:
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
    extra_files: dict[str, Path] | None = None,
) -> PushResult:
    """Push an exported folder to the Hub model repo `repo_id` in one commit, with a generated model card.

    Creates the repo if needed (`private` applies only then) and the branch `revision` (from main) if it does
    not exist. Only files that differ from the remote revision are uploaded, remote files the folder no longer
    has are deleted in the same commit, and an unchanged folder makes no commit at all. The commit names its
    parent, so a concurrent push fails instead of mixing two exports; a failed commit leaves the repo as it was.
    The folder is only read: the card goes into the commit from memory.
    `token`: a Hub token (default: huggingface_hub's, i.e. HF_TOKEN or the stored login); `endpoint`: the Hub
    URL (default: huggingface_hub's, i.e. HF_ENDPOINT). `extra_files`: path in repo -> local file, pushed in the same
    commit (a TorchNeuron export's compile cache)."""
    folder = Path(folder)
    nc = layout.read_neuron_config(folder)
    check_repo_id(repo_id)
    branch = revision or "main"
    local = layout.export_files(folder, nc)
    card = model_card(folder, repo_id).encode() if "README.md" not in local else None
    api = HfApi(endpoint=endpoint, token=token)
    with hub_errors("push to", repo_id, endpoint, branch, token):
        _ensure_repo(api, repo_id, private)
        if branch != "main":
            api.create_branch(repo_id, branch=branch, exist_ok=True)
        head = api.repo_info(repo_id, revision=branch, repo_type="model").sha
        remote = {
            f.path: f
            for f in api.list_repo_tree(repo_id, recursive=True, revision=head, repo_type="model")
            if isinstance(f, RepoFile)
        }
        sources: dict[str, Path | bytes] = {**local, **(extra_files or {})}
        if card is not None:
            sources["README.md"] = card
        changed = [p for p, src in sources.items() if p not in remote or not same_as_remote(src, remote[p])]
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
        sha, url = create_commit(
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
    try:
        api.repo_info(repo_id, repo_type="model")
        return
    except hf_errors.RepositoryNotFoundError:
        pass
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")


def create_commit(api, repo_id: str, **kwargs) -> tuple[str, str]:
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


def describe_shape(nc: dict) -> str:
    return (
        f"target {nc.get('target')}, batch {nc.get('batch_size')}, sequence {nc.get('sequence_length')},"
        f" tp {nc.get('tp_degree')}, {nc.get('torch_dtype')}"
    )


def _default_message(nc: dict) -> str:
    return f"Upload optimum-qwen35 export ({describe_shape(nc)})"

