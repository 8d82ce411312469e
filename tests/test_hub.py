"""The Hub half (optimum_qwen35/hub.py, the push/pull/cache commands) against the loopback stand-in Hub.

The real huggingface_hub client talks HTTP to `tests.kit.hub_server` (0.36 in the optimum
environment, 2.x in the reference one); the export folders are stand-ins in the exporter's layout
(`tests.kit.export_folder`): real config.json / neuron_config.json / tokenizer, placeholder graphs
and weights. "Fresh process" checks run a subprocess with its own empty HF_HOME and HF_ENDPOINT set.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from optimum_qwen35 import hub
from optimum_qwen35.cli import main
from optimum_qwen35.errors import (
    CheckpointError,
    HubAuthError,
    HubConnectionError,
    HubError,
    HubNotFoundError,
    IncompatibleExportError,
    Qwen35Error,
)
from tests.kit import build_tiny_checkpoint
from tests.kit.export_folder import build_fake_export
from tests.kit.hub_server import free_port

WRITE, READ, BOB = "hf_alice_write", "hf_alice_read", "hf_bob_write"
SOURCE_ID = "Qwen/Qwen3.5-tiny"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The tiny Qwen3.5 checkpoint the exports are made from (bf16 on disk, like the real ones)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("src") / "tiny", "tiny-2b", dtype="bfloat16")


@pytest.fixture
def export(tmp_path, source):
    """A cpu export of SOURCE_ID: batch 2, sequence 256, TP 2, bf16."""
    return build_fake_export(
        tmp_path / "export", source, SOURCE_ID, "main", batch_size=2, sequence_length=256, tp_degree=2
    )


def snapshot(folder: Path) -> dict[str, tuple[str, int]]:
    """path -> (sha256, mtime_ns) of every file below `folder` (follows the HF cache's symlinks)."""
    out = {}
    for p in sorted(Path(folder).rglob("*")):
        if p.is_file():
            out[p.relative_to(folder).as_posix()] = (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
    return out


def contents(folder: Path) -> dict[str, str]:
    return {k: v[0] for k, v in snapshot(folder).items()}


def run_py(code: str, env: dict, cwd=None, timeout=180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def run_cli(args: list[str], env: dict, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "optimum_qwen35", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=180
    )


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("optimum-qwen35: error:")]


# ------------------------------------------------------------------------------------------ push and load


def test_push_then_resolve_in_a_fresh_process_gives_the_same_files(hub_server, export, tmp_path):
    before = snapshot(export)
    result = hub.push_to_hub(export, "alice/tiny-cpu", token=WRITE, endpoint=hub_server.url)
    assert result.changed and result.commit_sha == hub_server.commits("alice/tiny-cpu")[0]
    assert snapshot(export) == before, "push must not touch the local folder"
    remote = hub_server.files("alice/tiny-cpu")
    card = remote["README.md"].decode()
    metadata = yaml.safe_load(card.split("---\n")[1])
    assert metadata["base_model"] == SOURCE_ID and metadata["pipeline_tag"] == "text-generation"
    for fact in (
        "base_model: Qwen/Qwen3.5-tiny",
        "| batch size | 2 |",
        "| sequence length | 256 |",
        "| tensor parallel degree | 2 |",
        "`bfloat16`",
        "`cpu`",
        "optimum-neuron 0.4.5",
        "torch ",
    ):
        assert fact in card, fact
    # The commit is one: the repo's initial commit, then the export.
    assert len(hub_server.commits("alice/tiny-cpu")) == 2
    # LFS files went through the LFS batch API, the others inline in the commit.
    assert hub_server.count("PUT", "/__lfs_upload__/") == 6  # 4 compiled .pt2 + 2 rank safetensors

    home = tmp_path / "fresh-home"
    proc = run_py(
        """
        from optimum_qwen35.hub import resolve_export
        print(resolve_export("alice/tiny-cpu"))
        """,
        hub_server.client_env(home),
    )
    assert proc.returncode == 0, proc.stderr
    folder = Path(proc.stdout.strip().splitlines()[-1])
    assert folder.is_relative_to(home)
    assert contents(folder) == contents(export)  # byte for byte, and no model card or .gitattributes


def test_pushing_an_unchanged_folder_makes_no_commit_and_uploads_nothing(hub_server, export):
    hub.push_to_hub(export, "alice/m", token=WRITE, endpoint=hub_server.url)
    commits = hub_server.commits("alice/m")
    posts = hub_server.count("POST", "/commit/"), hub_server.count("POST", "/preupload/"), hub_server.count("PUT", "")
    again = hub.push_to_hub(export, "alice/m", token=WRITE, endpoint=hub_server.url)
    assert not again.changed and again.commit_sha == commits[0]
    assert hub_server.commits("alice/m") == commits
    assert (
        hub_server.count("POST", "/commit/"),
        hub_server.count("POST", "/preupload/"),
        hub_server.count("PUT", ""),
    ) == posts

    # One changed file and one removed file: one commit that uploads the one and deletes the other.
    (export / "compiled" / "token_generation_rank1.pt2").write_bytes(b"new program")
    (export / "generation_config.json").unlink()
    puts = hub_server.count("PUT", "")
    third = hub.push_to_hub(export, "alice/m", token=WRITE, endpoint=hub_server.url)
    assert third.uploaded == ["compiled/token_generation_rank1.pt2"] and third.deleted == ["generation_config.json"]
    assert hub_server.commits("alice/m")[1:] == commits
    assert hub_server.count("PUT", "") == puts + 1
    assert "generation_config.json" not in hub_server.files("alice/m")


def test_a_revision_is_pushed_to_its_branch_and_resolved_by_revision(hub_server, export, source, tmp_path):
    hub.push_to_hub(export, "alice/m", token=WRITE, endpoint=hub_server.url)
    main_commits = hub_server.commits("alice/m")
    other = build_fake_export(tmp_path / "bs4", source, SOURCE_ID, "main", batch_size=4, seed=1)
    result = hub.push_to_hub(other, "alice/m", revision="bs4", token=WRITE, endpoint=hub_server.url)
    assert result.revision == "bs4" and hub_server.commits("alice/m") == main_commits  # main untouched
    cache = tmp_path / "cache"
    on_branch = hub.resolve_export("alice/m", revision="bs4", endpoint=hub_server.url, cache_dir=cache)
    on_main = hub.resolve_export("alice/m", endpoint=hub_server.url, cache_dir=cache)
    assert contents(on_branch) == contents(other) and contents(on_main) == contents(export)
    assert json.loads((on_branch / "neuron_config.json").read_text())["batch_size"] == 4
    # A commit sha is a revision too.
    pinned = hub.resolve_export("alice/m", revision=result.commit_sha, endpoint=hub_server.url, cache_dir=cache)
    assert contents(pinned) == contents(other)


def test_a_local_folder_resolves_to_itself(export):
    assert hub.resolve_export(export) == export
    assert hub.resolve_export(str(export)) == export


def test_a_failed_commit_leaves_the_repo_and_the_folder_as_they_were(hub_server, export, source, tmp_path):
    # A first push that fails: the new repo keeps only its initial commit, no half model.
    hub_server.fail_commits = True
    with pytest.raises(HubError, match="HTTP 500"):
        hub.push_to_hub(export, "alice/m", token=WRITE, endpoint=hub_server.url)
    assert len(hub_server.commits("alice/m")) == 1 and set(hub_server.files("alice/m")) == {".gitattributes"}

    hub_server.fail_commits = False
    hub.push_to_hub(export, "alice/m", token=WRITE, endpoint=hub_server.url)
    commits, files = hub_server.commits("alice/m"), hub_server.files("alice/m")
    other = build_fake_export(tmp_path / "other", source, SOURCE_ID, "main", batch_size=8, seed=2)
    before = snapshot(other)
    hub_server.fail_commits = True
    with pytest.raises(HubError) as info:
        hub.push_to_hub(other, "alice/m", token=WRITE, endpoint=hub_server.url)
    assert "\n" not in str(info.value)
    assert hub_server.commits("alice/m") == commits and hub_server.files("alice/m") == files
    assert snapshot(other) == before


# ------------------------------------------------------------------------------------------------ errors


def test_errors_are_one_line_package_errors(hub_server, export, tmp_path):
    url, cache = hub_server.url, tmp_path / "cache"
    hub.push_to_hub(export, "alice/m", token=WRITE, endpoint=url)
    changed = Path(shutil.copytree(export, tmp_path / "changed"))
    (changed / "compiled" / "graphs.json").write_text("{}")
    hub_server.create_repo("alice/not-an-export")
    hub_server.upload("alice/not-an-export", {"config.json": b"{}"})
    hub_server.create_repo("alice/no-graphs")
    hub_server.upload("alice/no-graphs", {"config.json": b"{}", "neuron_config.json": b'{"target": "trn1"}'})
    cases = [
        (HubNotFoundError, "repository alice/missing not found", lambda: hub.resolve_export("alice/missing", endpoint=url, cache_dir=cache)),
        (HubNotFoundError, "revision 'nope' does not exist", lambda: hub.resolve_export("alice/m", revision="nope", endpoint=url, cache_dir=cache)),
        (IncompatibleExportError, "has no neuron_config.json", lambda: hub.resolve_export("alice/not-an-export", endpoint=url, cache_dir=cache)),
        (IncompatibleExportError, "lacks model.pt", lambda: hub.resolve_export("alice/no-graphs", endpoint=url, cache_dir=cache)),
        (HubAuthError, "rejected the token (401", lambda: hub.resolve_export("alice/m", token="hf_wrong", endpoint=url, cache_dir=cache)),
        (HubAuthError, "rejected the token (401", lambda: hub.push_to_hub(export, "alice/m2", token="hf_wrong", endpoint=url)),
        (HubAuthError, "needs a token", lambda: hub.push_to_hub(export, "alice/m2", token=False, endpoint=url)),
        (HubAuthError, "no write access (403", lambda: hub.push_to_hub(export, "alice/m2", token=READ, endpoint=url)),
        (HubAuthError, "no write access (403", lambda: hub.push_to_hub(changed, "alice/m", token=BOB, endpoint=url)),
        (HubAuthError, "no write access (403", lambda: hub.push_to_hub(changed, "alice/m", token=READ, endpoint=url)),
        (HubConnectionError, "cannot be reached", lambda: hub.resolve_export("alice/m", endpoint=f"http://127.0.0.1:{free_port()}", cache_dir=tmp_path / "c2")),
        (HubConnectionError, "cannot be reached", lambda: hub.push_to_hub(export, "alice/m", token=WRITE, endpoint=f"http://127.0.0.1:{free_port()}")),
    ]  # fmt: skip
    for kind, words, call in cases:
        with pytest.raises(kind) as info:
            call()
        message = str(info.value)
        assert isinstance(info.value, Qwen35Error) and words in message and "\n" not in message, message
    # A private repo is invisible to others, without saying whether it exists.
    hub.push_to_hub(export, "alice/private", private=True, token=WRITE, endpoint=url)
    with pytest.raises(HubNotFoundError, match="or it is private"):
        hub.resolve_export("alice/private", token=BOB, endpoint=url, cache_dir=cache)
    assert hub.resolve_export("alice/private", token=READ, endpoint=url, cache_dir=cache).is_dir()


def test_the_command_line_pushes_pulls_and_fails_on_one_line(hub_server, export, tmp_path, capsys):
    url = hub_server.url
    assert main(["push", str(export), "alice/cli", "--revision", "v1", "--token", WRITE, "--endpoint", url]) == 0
    assert "pushed" in capsys.readouterr().out and len(hub_server.commits("alice/cli", "v1")) == 2
    assert main(["push", str(export), "alice/cli", "--revision", "v1", "--token", WRITE, "--endpoint", url]) == 0
    assert "nothing pushed" in capsys.readouterr().out and len(hub_server.commits("alice/cli", "v1")) == 2

    hub_server.create_repo("alice/not-an-export")
    hub_server.upload("alice/not-an-export", {"config.json": b"{}"})
    unreachable = f"http://127.0.0.1:{free_port()}"
    failures = [
        (["pull", "alice/not-an-export", "--endpoint", url], "has no neuron_config.json"),
        (["pull", "alice/missing", "--endpoint", url], "not found"),
        (["pull", "alice/cli", "--revision", "v2", "--endpoint", url], "revision 'v2' does not exist"),
        (["push", str(export), "alice/cli", "--token", "hf_wrong", "--endpoint", url], "401"),
        (["push", str(export), "alice/cli2", "--token", READ, "--endpoint", url], "403"),
        (["pull", "alice/cli", "--endpoint", unreachable], "cannot be reached"),
        (["push", str(tmp_path), "alice/cli", "--endpoint", url], "not an exported model"),
    ]
    for args, words in failures:
        assert main(args) == 1, args
        err = capsys.readouterr().err
        lines = error_lines(err)
        assert len(lines) == 1 and words in lines[0], err

    # A real process: the pull prints the folder; a failure is one line, exit status 1, no traceback.
    env = hub_server.client_env(tmp_path / "home")
    pulled = run_cli(["pull", "alice/cli", "--revision", "v1"], env)
    assert pulled.returncode == 0, pulled.stderr
    assert contents(Path(pulled.stdout.strip().splitlines()[-1])) == contents(export)
    failed = run_cli(["push", str(export), "alice/cli", "--token", "hf_wrong"], env)
    assert failed.returncode == 1 and len(error_lines(failed.stderr)) == 1 and "Traceback" not in failed.stderr


# ------------------------------------------------------------------------------------------------ offline


def test_offline_resolves_from_the_cache_or_names_what_is_missing(hub_server, export, tmp_path):
    hub.push_to_hub(export, "alice/m", token=WRITE, endpoint=hub_server.url)
    cache, empty = tmp_path / "home" / "hub", tmp_path / "empty-home" / "hub"
    folder = hub.resolve_export("alice/m", endpoint=hub_server.url, cache_dir=cache)  # one download, online
    requests = len(hub_server.requests)
    # Then, in an offline process: the cached export resolves, an empty cache and a damaged one are named.
    proc = run_py(
        f"""
        import json
        from pathlib import Path
        from optimum_qwen35.errors import Qwen35Error
        from optimum_qwen35.hub import resolve_export

        def attempt(cache):
            try:
                return str(resolve_export("alice/m", cache_dir=cache))
            except Qwen35Error as e:
                return f"{{type(e).__name__}}: {{e}}"

        results = [attempt({str(cache)!r}), attempt({str(empty)!r})]
        (Path(results[0]) / "checkpoint" / "tp_shards.json").unlink()
        results.append(attempt({str(cache)!r}))
        print(json.dumps(results))
        """,
        hub_server.client_env(tmp_path / "home", HF_HUB_OFFLINE="1"),
    )
    assert proc.returncode == 0, proc.stderr
    found, nothing, damaged = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(found) == folder
    assert len(hub_server.requests) == requests, "offline mode must not talk to the Hub"
    assert nothing.startswith("HubOfflineError:") and "alice/m" in nothing and "neuron_config.json" in nothing
    assert damaged.startswith("HubOfflineError:") and "checkpoint/tp_shards.json" in damaged
    assert "\n" not in nothing + damaged


# ------------------------------------------------------------------------------------- Neuron export weights


def test_a_neuron_export_of_a_hub_model_fetches_its_source_weights(hub_server, source, tmp_path):
    hub_server.create_repo("Qwen/Qwen3.5-tiny")
    files = {p.name: p.read_bytes() for p in source.iterdir() if p.is_file()}
    sha = hub_server.upload("Qwen/Qwen3.5-tiny", files)
    neuron = build_fake_export(tmp_path / "trn1", source, "Qwen/Qwen3.5-tiny", sha, target="trn1")
    local = build_fake_export(tmp_path / "trn1-local", source, None, target="trn1")
    cpu = build_fake_export(tmp_path / "cpu", source, "Qwen/Qwen3.5-tiny", sha)
    assert hub.resolve_source_checkpoint(cpu) is None and hub.resolve_source_checkpoint(local) is None
    weights = hub.resolve_source_checkpoint(neuron, endpoint=hub_server.url, cache_dir=tmp_path / "cache")
    assert sha in str(weights)
    assert {p.name for p in weights.iterdir()} == {
        n
        for n in files
        if n.endswith(".safetensors") or "safetensors" in n or n in ("config.json", "generation_config.json")
    }
    # Pushed, the Hub-id Neuron export carries no weights; the local one carries its sharded checkpoint.
    hub.push_to_hub(neuron, "alice/trn1", token=WRITE, endpoint=hub_server.url)
    hub.push_to_hub(local, "alice/trn1-local", token=WRITE, endpoint=hub_server.url)
    assert not any(p.startswith("checkpoint/") for p in hub_server.files("alice/trn1"))
    assert "checkpoint/weights/tp0_sharded_checkpoint.safetensors" in hub_server.files("alice/trn1-local")
    assert "fetched from `Qwen/Qwen3.5-tiny` at load time" in hub_server.files("alice/trn1")["README.md"].decode()
    # A source checkpoint without weights, or a revision that does not exist: one-line errors.
    hub_server.create_repo("alice/no-weights")
    hub_server.upload("alice/no-weights", {"config.json": files["config.json"]})
    for checkpoint_id, revision, kind, words in [
        ("alice/no-weights", None, CheckpointError, "has no safetensors"),
        ("Qwen/Qwen3.5-tiny", "nope", HubNotFoundError, "revision 'nope'"),
    ]:
        bad = build_fake_export(tmp_path / f"bad-{kind.__name__}", source, checkpoint_id, revision, target="trn1")
        with pytest.raises(kind, match=words):
            hub.resolve_source_checkpoint(bad, endpoint=hub_server.url, cache_dir=tmp_path / "cache")


# --------------------------------------------------------------------------------- compile-cache registry


@pytest.fixture
def cache_setup(hub_server, source, export):
    pytest.importorskip("optimum.neuron", reason="the registry needs optimum-neuron (nox session `optimum`)")
    hub_server.create_repo(SOURCE_ID)
    hub_server.upload(SOURCE_ID, {"config.json": (source / "config.json").read_bytes()})
    hub_server.create_repo("alice/neuron-cache")
    return export


def test_sync_registry_pushes_no_graphs_of_an_export_made_with_mtp(hub_server, cache_setup):
    """An export made with mtp=True holds speculative programs its cache key does not name: a plain export of the same
    configuration must not download them, so its graphs stay out of the cache (the entry is filed)."""
    export = cache_setup
    manifest = json.loads((export / "compiled" / "graphs.json").read_text())
    (export / "compiled" / "graphs.json").write_text(json.dumps({**manifest, "mtp": {"max_speculative_tokens": 4}}))
    result = hub.sync_registry(export, cache_repo="alice/neuron-cache", token=WRITE, endpoint=hub_server.url)
    files = hub_server.files("alice/neuron-cache")
    assert set(result.paths) <= set(files) and not any(f.endswith((".pt2", "graphs.json")) for f in files)
    (export / "compiled" / "graphs.json").write_text(json.dumps(manifest))  # the plain export pushes its graphs
    hub.sync_registry(export, cache_repo="alice/neuron-cache", token=WRITE, endpoint=hub_server.url)
    assert any(f.endswith("graphs.json") for f in hub_server.files("alice/neuron-cache"))


def test_sync_registry_files_an_entry_that_optimum_cli_lookup_lists(hub_server, cache_setup, source, tmp_path):
    export = cache_setup
    result = hub.sync_registry(export, cache_repo="alice/neuron-cache", token=WRITE, endpoint=hub_server.url)
    digest = result.arch_digest
    assert result.paths[0].startswith("neuronxcc-2.21.33363.0/0_REGISTRY/0.4.5/" + digest + "/")
    assert result.paths[1].startswith("neuronxcc-2.21.33363.0/0_REGISTRY/0.4.5/qwen3_5_text/Qwen/Qwen3.5-tiny/")
    commits = hub_server.commits("alice/neuron-cache")
    again = hub.sync_registry(export, cache_repo="alice/neuron-cache", token=WRITE, endpoint=hub_server.url)
    assert again.paths == result.paths and hub_server.commits("alice/neuron-cache") == commits  # no new commit
    # A trn1 export of the same model (batch 4, TP 8) lands under the same compiler folder and digest.
    trn1 = build_fake_export(
        tmp_path / "trn1", source, SOURCE_ID, "main", target="trn1", batch_size=4, sequence_length=4096, tp_degree=8
    )
    neuron = hub.sync_registry(trn1, cache_repo="alice/neuron-cache", token=WRITE, endpoint=hub_server.url)
    assert neuron.arch_digest == digest and neuron.paths[0].split("/")[0] == "neuronxcc-2.21.33363.0"

    # optimum-neuron's own lookup, in a fresh process pointed at the stand-in. AutoConfig must know qwen3_5 there:
    # until the package's registration hook (issue 7) is installed, a sitecustomize imports the package.
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import optimum_qwen35\n")
    env = hub_server.client_env(tmp_path / "home", CUSTOM_CACHE_REPO="alice/neuron-cache", PYTHONPATH=str(shim))
    cli = shutil.which("optimum-cli", path=str(Path(sys.executable).parent))

    def lookup(*extra):
        proc = subprocess.run(
            [cli, "neuron", "cache", "lookup", SOURCE_ID, "--task", "text-generation", *extra],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    listed = lookup()
    assert f"Cached entries for {SOURCE_ID}" in listed
    rows = sorted(line.split() for line in listed.splitlines() if line.split()[:1] in (["2"], ["4"]))
    assert rows == [["2", "256", "2", "bfloat16", "cpu"], ["4", "4096", "8", "bfloat16", "trn1"]], listed

    # select_hub_cached_entries (what `lookup --batch_size/--dtype/...` and vLLM call): the matching filters find
    # the entry, any other batch size, dtype, TP degree or target does not.
    proc = run_py(
        """
        import json
        from optimum.neuron.cache.hub_cache import get_hub_cached_entries, select_hub_cached_entries as select
        m = "Qwen/Qwen3.5-tiny"
        print(json.dumps([
            len(get_hub_cached_entries(m, task="text-generation")),
            len(select(m, task="text-generation", instance_type="cpu", batch_size=2, sequence_length=256,
                       tensor_parallel_size=2, torch_dtype="bfloat16")),
            len(select(m, task="text-generation", batch_size=1)),
            len(select(m, task="text-generation", torch_dtype="float32")),
            len(select(m, task="text-generation", tensor_parallel_size=4)),
            len(select(m, task="text-generation", instance_type="inf2")),
            len(select(m, task="text-generation", instance_type="trn1", batch_size=4, tensor_parallel_size=8)),
        ]))
        """,
        env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [2, 1, 0, 0, 0, 0, 1]


def test_the_entry_is_optimum_neurons_own(cache_setup, source):
    from optimum.neuron.cache.entries.cache_entry import ModelCacheEntry
    from optimum.neuron.cache.entries.single_model import SingleModelCacheEntry

    entry = registry_entry = hub.registry_entry(cache_setup)
    assert isinstance(entry, SingleModelCacheEntry) and entry.model_id == SOURCE_ID and entry.task == "text-generation"
    # The digest a lookup computes from the source checkpoint's config (here from its folder).
    assert registry_entry.arch_digest() == ModelCacheEntry.create(str(source), "text-generation").arch_digest()
    assert entry.neuron_config == json.loads((cache_setup / "neuron_config.json").read_text())
    # Round trip through the registry file format.
    assert ModelCacheEntry.deserialize(entry.serialize()).arch_digest() == entry.arch_digest()


def test_the_dtype_is_part_of_the_digest(cache_setup, source, tmp_path):
    """optimum-neuron's white list drops `torch_dtype` but not `dtype`: an fp32 export of a bf16 checkpoint
    has another digest than its source, so a lookup of the source does not see it (optimum-neuron's own entries
    behave the same); keying it on the source config restores the match."""
    from optimum.neuron.cache.entries.cache_entry import ModelCacheEntry

    fp32 = build_fake_export(tmp_path / "fp32", source, SOURCE_ID, torch_dtype="float32")
    lookup_digest = ModelCacheEntry.create(str(source), "text-generation").arch_digest()
    assert hub.registry_entry(fp32).arch_digest() != lookup_digest
    assert hub.registry_entry(fp32, config=source).arch_digest() == lookup_digest


def test_registry_errors(hub_server, cache_setup, tmp_path, source):
    with pytest.raises(HubNotFoundError, match="alice/no-such-cache"):
        hub.sync_registry(cache_setup, cache_repo="alice/no-such-cache", token=WRITE, endpoint=hub_server.url)
    with pytest.raises(HubAuthError, match="403"):
        hub.sync_registry(cache_setup, cache_repo="alice/neuron-cache", token=READ, endpoint=hub_server.url)
    local = build_fake_export(tmp_path / "local", source, None)
    with pytest.raises(Qwen35Error, match="--model-id"):
        hub.registry_entry(local)
    assert hub.registry_entry(local, model_id="alice/tiny").model_id == "alice/tiny"


def test_the_cache_commands(hub_server, cache_setup, tmp_path, capsys):
    url = hub_server.url
    assert (
        main(
            [
                "cache",
                "sync",
                str(cache_setup),
                "--cache-repo",
                "alice/neuron-cache",
                "--token",
                WRITE,
                "--endpoint",
                url,
            ]
        )
        == 0
    )
    assert "0_REGISTRY/0.4.5/" in capsys.readouterr().out
    assert (
        main(["cache", "sync", str(cache_setup), "--cache-repo", "alice/nope", "--token", WRITE, "--endpoint", url])
        == 1
    )
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "alice/nope" in lines[0]
    # `cache lookup` goes through optimum-neuron, which takes the endpoint from HF_ENDPOINT only: a subprocess.
    env = hub_server.client_env(tmp_path / "home", CUSTOM_CACHE_REPO="alice/neuron-cache")
    found = run_cli(["cache", "lookup", SOURCE_ID, "--batch-size", "2", "--dtype", "bfloat16"], env, cwd=tmp_path)
    assert found.returncode == 0 and "cpu  2  256  2  bfloat16" in found.stdout, found.stderr


def test_the_registry_without_optimum_neuron_is_a_one_line_error(export, capsys):
    try:
        import optimum.neuron  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("optimum-neuron is installed (nox session `reference` runs this)")
    assert main(["cache", "sync", str(export), "--cache-repo", "alice/cache"]) == 1
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "optimum-qwen35[optimum]" in lines[0]


# ------------------------------------------------------------------------- bad input at the Hub commands (issue 21)
def without_progress_bars(stderr: str) -> list[str]:
    """The lines of stderr that are not tqdm's upload progress bars (redrawn in place on a terminal): with a total
    ("name:  50%|#####     | 3/6 [00:00<00:00, 23.1it/s]"), or past it, when a retried upload has counted its bytes
    twice and tqdm drops the percentage ("name: 20.5kB [00:00, 194kB/s]"; whether a redraw catches that depends on
    timing)."""
    import re

    stderr = stderr.replace("optimum-qwen35: error:", "\noptimum-qwen35: error:")  # may follow a bar on its line
    lines = [re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", line).strip() for line in stderr.replace("\r", "\n").splitlines()]
    bar_tail = re.compile(r"\[\d+:\d\d(:\d\d)?(<[^,\]]*)?, [^\]]*/(s|it|B)\]$")
    return [line for line in lines if line and "%|" not in line and not bar_tail.search(line)]


BAD_REPO_IDS = ["alice/na--me", "alice/name-", "alice/model.git", "alice/" + "n" * 97]


@pytest.mark.parametrize("repo_id", BAD_REPO_IDS, ids=["double-dash", "trailing-dash", "dot-git", "97-chars"])
def test_repo_ids_against_the_hub_naming_rules_are_usage_errors(hub_server, export, repo_id, capsys):
    """Valid characters, names the Hub refuses: huggingface_hub's own validator answers before any request, with one
    line and exit status 2 (push, cache lookup); pull and export take a folder or an id: not found, exit 1."""
    url = hub_server.url
    for args, status in (
        (["push", str(export), repo_id, "--token", WRITE, "--endpoint", url], 2),
        (["cache", "lookup", repo_id], 2),
        (["pull", repo_id, "--endpoint", url], 1),
    ):
        assert main(args) == status, args
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and "a valid Hub repository id" in lines[0] and "HFValidationError" not in lines[0], lines
    assert hub_server.requests == [], "a refused repo id reached the Hub"


def test_push_prints_the_commit_url_of_the_endpoint_it_pushed_to(hub_server, export, capsys):
    """The Hub answers a commit with its public URL whatever endpoint the client used; the command prints the one
    on the endpoint pushed to (HF_ENDPOINT or --endpoint)."""
    hub_server.commit_url_base = "https://huggingface.co"
    assert main(["push", str(export), "alice/url", "--token", WRITE, "--endpoint", hub_server.url]) == 0
    out = capsys.readouterr().out
    assert f"{hub_server.url}/alice/url/commit/" in out and "huggingface.co" not in out


def test_a_push_whose_connection_drops_prints_one_line(hub_server, export, capsys, caplog, monkeypatch):
    """Every LFS upload loses its connection: huggingface_hub retries it (its waits are skipped here) and the command
    prints its one line, none of the client's per-retry warnings; the repo gets no commit. --verbose shows them."""
    from huggingface_hub.utils import _http

    monkeypatch.setattr(_http.time, "sleep", lambda seconds: None)
    hub_server.drop_uploads = True
    args = ["push", str(export), "alice/dropped", "--token", WRITE, "--endpoint", hub_server.url]
    assert main(args) == 1
    err = capsys.readouterr().err
    lines = without_progress_bars(err)
    assert len(lines) == 1 and "cannot push to alice/dropped" in lines[0], repr(err[-3000:])
    uploads = [r for r in hub_server.requests if r[1].startswith("/__lfs_upload__")]
    assert len(uploads) > 1, "the client did not retry: this test checks nothing"
    retries = [r for r in caplog.records if "Retrying in" in r.getMessage() or "thrown while requesting" in r.getMessage()]
    assert retries == []
    assert len(hub_server.commits("alice/dropped", "main")) == 1  # the repo's initial commit only
    monkeypatch.setenv("OPTIMUM_QWEN35_VERBOSE", "1")
    assert main(args) == 1
    assert any("Retrying in" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------- an unreachable Hub (issue 29)
def test_the_cache_commands_against_a_closed_port_answer_within_the_retry_bound(tmp_path, monkeypatch, capsys, caplog):
    """huggingface_hub retries a refused connection 5 times (1 + 2 + 4 + 8 + 8 s: `cache lookup` took 31 s before its
    line); within this package's Hub calls the waits are bounded to HUB_RETRY_SECONDS and announced once."""
    pytest.importorskip("optimum.neuron", reason="the registry needs optimum-neuron (nox session `optimum`)")
    import time

    from huggingface_hub import constants

    from optimum_qwen35.patches import HUB_RETRY_NOTICE, HUB_RETRY_SECONDS

    hub.cache._optimum_neuron()  # imports outside the timed part
    closed = f"http://127.0.0.1:{free_port()}"
    # optimum-neuron's lookup takes the endpoint from huggingface_hub's constants (HF_ENDPOINT at import).
    monkeypatch.setattr(constants, "ENDPOINT", closed)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    start = time.monotonic()
    assert main(["cache", "lookup", "alice/never-cached"]) == 1
    took = time.monotonic() - start
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "cannot be reached" in lines[0] and closed in lines[0], lines
    assert HUB_RETRY_SECONDS <= took < HUB_RETRY_SECONDS + 8, took  # 23 s of waits without the bound
    notices = [r.getMessage() for r in caplog.records if r.getMessage() == HUB_RETRY_NOTICE]
    assert len(notices) == 1 and not [r for r in caplog.records if "Retrying in" in r.getMessage()]

    export = build_fake_export(tmp_path / "export", build_tiny_checkpoint(tmp_path / "src", "tiny-2b"), SOURCE_ID)
    start = time.monotonic()
    assert main(["cache", "sync", str(export), "--cache-repo", "alice/cache", "--token", WRITE, "--endpoint", closed]) == 1
    assert time.monotonic() - start < HUB_RETRY_SECONDS + 8
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "cannot be reached" in lines[0], lines


def test_a_404_from_the_xet_token_endpoint_is_not_found_not_unreachable(hub_server, export, monkeypatch, capsys):
    """huggingface_hub 2.x uploads through Xet when hf_xet is installed; hf_xet reports the stand-in's 404 for the
    Xet write token as a ConnectionError ("HTTP status client error (404 Not Found)"): it is a not-found naming
    the repo and the URL, with what to do, never "cannot be reached"."""
    import huggingface_hub
    from huggingface_hub import constants

    pytest.importorskip("hf_xet", reason="Xet uploads need hf_xet")
    if int(huggingface_hub.__version__.split(".")[0]) < 1:
        pytest.skip("huggingface_hub 0.x uses Xet only when the server offers it (nox session `reference` runs this)")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False, raising=False)
    with pytest.raises(
        HubNotFoundError,
        match=r"alice/xet: .*answered 404 Not Found for http://127.0.0.1:\d+/api/models/alice/xet/xet-write-token/main"
        r" \(a server without Xet storage: set HF_HUB_DISABLE_XET=1\)$",
    ):
        hub.push_to_hub(export, "alice/xet", token=WRITE, endpoint=hub_server.url)
    assert main(["push", str(export), "alice/xet", "--token", WRITE, "--endpoint", hub_server.url]) == 1
    lines = error_lines(capsys.readouterr().err)  # (hf_xet draws its own progress bars)
    assert len(lines) == 1 and "404 Not Found" in lines[0] and "cannot be reached" not in lines[0], lines


def test_the_registry_files_an_entry_under_the_id_the_user_gives(hub_server, cache_setup, capsys):
    """`model_id` (`cache sync --model-id`) wins over the checkpoint_id the export records (SOURCE_ID here): the
    entry, its model-id alias path and the commit name the given id; without it, the recorded one."""
    export = cache_setup
    assert json.loads((export / "neuron_config.json").read_text())["checkpoint_id"] == SOURCE_ID
    assert hub.registry_entry(export).model_id == SOURCE_ID
    assert hub.registry_entry(export, model_id="alice/renamed").model_id == "alice/renamed"
    result = hub.sync_registry(
        export, cache_repo="alice/neuron-cache", token=WRITE, endpoint=hub_server.url, model_id="alice/renamed"
    )
    alias = result.paths[1].split("/0_REGISTRY/0.4.5/", 1)[1]
    assert alias.startswith("qwen3_5_text/alice/renamed/") and SOURCE_ID not in "".join(result.paths), result.paths
    # The digest is the config's, not the id's: the same entry under either id.
    assert result.arch_digest == hub.registry_entry(export).arch_digest()
    args = ["cache", "sync", str(export), "--cache-repo", "alice/neuron-cache", "--token", WRITE]
    assert main([*args, "--endpoint", hub_server.url, "--model-id", "alice/other"]) == 0
    out = capsys.readouterr().out
    assert "qwen3_5_text/alice/other/" in out and f"qwen3_5_text/{SOURCE_ID}/" not in out, out
