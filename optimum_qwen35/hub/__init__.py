"""The Hugging Face Hub half of an export: push it, load it back by id, and register it in the compile cache.

- `push_to_hub(folder, repo_id, ...)` (push.py): one commit holding the folder and a generated model card (card.py).
  Files that already match the remote revision are not sent; an unchanged folder makes no commit at all; remote
  files the folder no longer has are deleted in the same commit. The local folder is only read.
- `resolve_export(repo_id_or_path, ...)` (download.py): a local folder as is, or the export files of a Hub repo
  through the Hugging Face cache (`snapshot_download`), offline from that cache when `HF_HUB_OFFLINE=1`;
  `download_checkpoint` a source checkpoint; `resolve_source_checkpoint(folder)` the source checkpoint a Neuron
  export of a Hub id needs at load time (optimum-neuron fetches `checkpoint_id`@`checkpoint_revision` the same way).
- `registry_entry(folder)` / `sync_registry(folder, cache_repo)` / `fetch_cached_graphs` / `lookup_registry`
  (cache.py): optimum-neuron's own `SingleModelCacheEntry` for the export, where optimum-neuron 0.4.5's
  `get_hub_cached_entries` (and so `optimum-cli neuron cache lookup` and its vLLM integration) look for it.
- `push_compile_cache` / `fetch_compile_cache` / `list_compile_caches` (compile_cache.py): TorchNeuron's NEFF cache
  folder, filed in a cache repo under a prefix keyed by the export's configuration (`CompileCacheKey`).

Every failure a user can fix raises a `HubError` subclass (errors.py) with a one-line message (hub/errors.py).
The export folder's format is export/layout.py's.
"""

from optimum_qwen35.export.layout import EXPORT_PATTERNS
from optimum_qwen35.hub.cache import (
    RegistrySyncResult,
    cached_graphs_path,
    fetch_cached_graphs,
    lookup_registry,
    registry_entry,
    registry_paths,
    sync_registry,
)
from optimum_qwen35.hub.card import model_card
from optimum_qwen35.hub.compile_cache import (
    CompileCacheKey,
    default_neff_cache_dir,
    fetch_compile_cache,
    list_compile_caches,
    push_compile_cache,
)
from optimum_qwen35.hub.download import download_checkpoint, resolve_export, resolve_source_checkpoint
from optimum_qwen35.hub.push import PushResult, push_to_hub

__all__ = [
    "CompileCacheKey",
    "EXPORT_PATTERNS",
    "PushResult",
    "RegistrySyncResult",
    "cached_graphs_path",
    "default_neff_cache_dir",
    "download_checkpoint",
    "fetch_cached_graphs",
    "fetch_compile_cache",
    "list_compile_caches",
    "lookup_registry",
    "model_card",
    "push_compile_cache",
    "push_to_hub",
    "registry_entry",
    "registry_paths",
    "resolve_export",
    "resolve_source_checkpoint",
    "sync_registry",
]
