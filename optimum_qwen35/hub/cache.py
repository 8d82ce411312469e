"""The compile-cache registry: optimum-neuron's own cache entries for an export, and the cpu target's compiled graphs
filed beside them, so that `optimum-cli neuron cache lookup` finds an export and a later export of the same
configuration downloads its graphs instead of compiling them."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import CommitOperationAdd, HfApi, hf_hub_download

from optimum_qwen35.config import register_transformers_configs
from optimum_qwen35.errors import HubNotFoundError, IncompatibleExportError, MissingDependencyError, UsageError
from optimum_qwen35.export import layout
from optimum_qwen35.hub.errors import check_repo_id, http_status, hub_errors
from optimum_qwen35.hub.push import create_commit, describe_shape
from optimum_qwen35.patches import optimum_neuron_import


def _optimum_neuron():
    try:
        with optimum_neuron_import():
            from optimum.neuron.cache import hub_cache  # optional dependency (the `optimum` extra)
            from optimum.neuron.cache.entries.single_model import SingleModelCacheEntry  # (the same)
            from optimum.neuron.version import __version__ as on_version  # (the same)
    except ImportError as e:
        raise MissingDependencyError(
            f"the compile-cache registry needs optimum-neuron 0.4.5 ({e}); install it with"
            " `pip install 'optimum-qwen35[optimum]'`"
        ) from e
    return hub_cache, SingleModelCacheEntry, on_version


def _load_config(config):
    """A transformers text config from a folder, a config.json path, a dict or a PretrainedConfig."""
    from transformers import AutoConfig, PretrainedConfig  # start-up time: only the registry reads configs

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
    nc = layout.read_neuron_config(folder)
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
        if getattr(text_config, "architectures", None) == [layout.EXPORT_ARCHITECTURES.get(text_config.model_type)]:
            text_config.architectures = None
    return SingleModelCacheEntry(model_id, layout.TASK, text_config, neuron_config=dict(nc))


def _compiler_dir(api, cache_repo: str, nc: dict) -> str:
    """The cache repo's top folder for this compiler, as optimum-neuron's `hub_registry_path` finds it: the
    first root folder starting with `neuronxcc-<neuronx-cc version pinned by optimum-neuron>`."""
    from optimum.neuron.utils.version_utils import get_pinned_version  # optional dependency (the `optimum` extra)

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
    for repo in (cache_repo, model_id):
        if repo is not None:
            check_repo_id(repo)
    entry = registry_entry(folder, model_id=model_id, config=config)
    nc = layout.read_neuron_config(Path(folder))
    if cache_repo is None:
        from optimum.neuron.utils.cache_utils import get_hf_hub_cache_repo  # optional dependency (the `optimum` extra)

        cache_repo = get_hf_hub_cache_repo()
    check_repo_id(cache_repo)
    api = HfApi(endpoint=endpoint, token=token)
    content = entry.serialize().encode()
    with hub_errors("sync the cache registry of", cache_repo, endpoint, None, token):
        compiler_dir = _compiler_dir(api, cache_repo, nc)
        paths = registry_paths(entry, compiler_dir)
        operations = [CommitOperationAdd(path_in_repo=p, path_or_fileobj=content) for p in paths]
        # An export made with mtp=True holds programs its cache key does not name: a plain export of the same
        # configuration must not download them (it has no MTP head's weights), so only its entry is registered.
        with_mtp = layout.is_cpu_export(nc) and "mtp" in layout.read_json(Path(folder) / layout.COMPILED_DIR / layout.GRAPHS_FILE)
        if layout.is_cpu_export(nc) and not with_mtp:
            # The cpu target's compiled graphs (its "NEFFs"), so that an export of this configuration downloads
            # them instead of compiling.
            graphs = cached_graphs_path(entry, compiler_dir, _graphs_torch_version(Path(folder)))
            operations += [
                CommitOperationAdd(path_in_repo=f"{graphs}/{f.name}", path_or_fileobj=str(f))
                for f in sorted((Path(folder) / layout.COMPILED_DIR).iterdir())
                if f.is_file()
            ]
        sha, _ = create_commit(
            api,
            cache_repo,
            operations=operations,
            commit_message=f"Register a compiled configuration of {entry.model_id}: {describe_shape(nc)}",
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
    return layout.read_json(folder / layout.COMPILED_DIR / layout.GRAPHS_FILE)["torch_version"]


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
    folder = Path(folder)
    nc = layout.read_neuron_config(folder)
    if not layout.is_cpu_export(nc) or not nc.get("checkpoint_id"):
        return False
    entry = registry_entry(folder)
    if cache_repo is None:
        from optimum.neuron.utils.cache_utils import get_hf_hub_cache_repo  # optional dependency (the `optimum` extra)

        cache_repo = get_hf_hub_cache_repo()
    api = HfApi(endpoint=endpoint, token=token)
    with hub_errors("read the compile cache", cache_repo, endpoint, None, token):
        base = cached_graphs_path(entry, _compiler_dir(api, cache_repo, nc), torch.__version__.split("+")[0])
        try:
            files = [f.path for f in api.list_repo_tree(cache_repo, path_in_repo=base, repo_type="model") if hasattr(f, "size")]
        except Exception as e:  # noqa: BLE001 (a missing folder is a cache miss)
            if http_status(e) == 404 or type(e).__name__ in ("EntryNotFoundError", "RemoteEntryNotFoundError"):
                return False
            raise
        if layout.GRAPHS_FILE not in {p.rsplit("/", 1)[-1] for p in files}:
            return False
        target = folder / layout.COMPILED_DIR
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
    check_repo_id(model_id)
    if cache_repo is not None:
        check_repo_id(cache_repo)
    hub_cache, _, _ = _optimum_neuron()
    register_transformers_configs()
    with hub_errors("look up the cache registry for", model_id, None):
        try:
            return hub_cache.select_hub_cached_entries(
                model_id,
                task=layout.TASK,
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
