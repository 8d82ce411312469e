"""The stand-in Hub itself, driven by the installed huggingface_hub client (0.36 or 2.x): the client must get
the same answers, and raise the same exception types, as from the Hub."""

from __future__ import annotations

import pytest
from huggingface_hub import (
    CommitOperationAdd,
    CommitOperationDelete,
    HfApi,
    hf_hub_download,
)
from huggingface_hub import errors as hf_errors
from huggingface_hub.hf_api import RepoFile, RepoFolder


@pytest.fixture
def api(hub_server):
    return HfApi(endpoint=hub_server.url, token="hf_alice_write")


def _commit(api, repo_id, operations, **kw):
    # huggingface_hub 0.36 parses the returned commit URL against HF_ENDPOINT; read the head instead.
    try:
        return api.create_commit(repo_id, operations=operations, commit_message="test", **kw).oid
    except ValueError:
        return api.repo_info(repo_id, revision=kw.get("revision")).sha


def test_repos_branches_commits_and_downloads(hub_server, api, tmp_path):
    api.create_repo("alice/r")
    with pytest.raises(hf_errors.HfHubHTTPError) as info:
        api.create_repo("alice/r")
    assert info.value.response.status_code == 409
    api.create_repo("alice/r", exist_ok=True)
    assert [f.path for f in api.list_repo_tree("alice/r")] == [".gitattributes"]

    big = bytes(range(256)) * 64
    sha = _commit(
        api,
        "alice/r",
        [
            CommitOperationAdd(path_in_repo="a/config.json", path_or_fileobj=b'{"x": 1}'),
            CommitOperationAdd(path_in_repo="a/b/w.safetensors", path_or_fileobj=big),
        ],
    )
    assert api.repo_info("alice/r").sha == sha == hub_server.commits("alice/r")[0]
    top = list(api.list_repo_tree("alice/r"))
    assert {(type(e), e.path) for e in top} == {(RepoFile, ".gitattributes"), (RepoFolder, "a")}
    files = {e.path: e for e in api.list_repo_tree("alice/r", recursive=True) if isinstance(e, RepoFile)}
    assert files["a/b/w.safetensors"].lfs.size == len(big) and files["a/config.json"].lfs is None
    assert [e.path for e in api.list_repo_tree("alice/r", path_in_repo="a/b")] == ["a/b/w.safetensors"]
    assert hub_server.count("PUT", "/__lfs_upload__/") == 1  # the safetensors went through LFS

    path = hf_hub_download("alice/r", "a/b/w.safetensors", endpoint=hub_server.url, cache_dir=tmp_path)
    assert open(path, "rb").read() == big
    assert api.file_exists("alice/r", "a/config.json") and not api.file_exists("alice/r", "nope.json")

    api.create_branch("alice/r", branch="dev")
    api.create_branch("alice/r", branch="dev", exist_ok=True)
    _commit(api, "alice/r", [CommitOperationDelete(path_in_repo="a/config.json")], revision="dev")
    assert "a/config.json" not in hub_server.files("alice/r", "dev")
    assert "a/config.json" in hub_server.files("alice/r", "main")
    assert {b.name for b in api.list_repo_refs("alice/r").branches} == {"main", "dev"}


def test_errors_carry_the_hub_codes(hub_server, api, tmp_path):
    api.create_repo("alice/r")
    with pytest.raises(hf_errors.RepositoryNotFoundError):
        api.repo_info("alice/missing")
    with pytest.raises(hf_errors.RevisionNotFoundError):
        api.repo_info("alice/r", revision="nope")
    with pytest.raises(hf_errors.EntryNotFoundError):
        hf_hub_download("alice/r", "nope.json", endpoint=hub_server.url, cache_dir=tmp_path)
    with pytest.raises(hf_errors.HfHubHTTPError) as info:
        HfApi(endpoint=hub_server.url, token="hf_wrong").repo_info("alice/r")
    assert info.value.response.status_code == 401
    with pytest.raises(hf_errors.HfHubHTTPError) as info:
        HfApi(endpoint=hub_server.url, token="hf_alice_read").create_branch("alice/r", branch="x")
    assert info.value.response.status_code == 403
    api.create_repo("alice/private", private=True)
    with pytest.raises(hf_errors.RepositoryNotFoundError):
        HfApi(endpoint=hub_server.url, token="hf_bob_write").repo_info("alice/private")
    assert HfApi(endpoint=hub_server.url, token="hf_alice_read").repo_info("alice/private").private


def test_a_failed_commit_changes_nothing(hub_server, api):
    api.create_repo("alice/r")
    before = hub_server.commits("alice/r"), hub_server.files("alice/r")
    hub_server.fail_commits = True
    with pytest.raises(hf_errors.HfHubHTTPError):
        _commit(api, "alice/r", [CommitOperationAdd(path_in_repo="x.bin", path_or_fileobj=b"\0" * 100)])
    assert (hub_server.commits("alice/r"), hub_server.files("alice/r")) == before
