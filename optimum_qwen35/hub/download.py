"""Load an export (or a source checkpoint) from the Hub into the Hugging Face cache, offline from it when asked."""

from __future__ import annotations

import os
from pathlib import Path

from huggingface_hub import constants, snapshot_download

from optimum_qwen35.errors import (
    CheckpointError,
    HubConnectionError,
    HubNotFoundError,
    HubOfflineError,
    IncompatibleExportError,
    ModelNotFoundError,
)
from optimum_qwen35.export import layout
from optimum_qwen35.hub.errors import at_revision, hub_errors, is_offline, no_folder_either, repo_id_problem


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
        layout.read_neuron_config(path)
        return path
    name = str(repo_id_or_path)
    problem = repo_id_problem(name)
    if problem:
        raise ModelNotFoundError(f"{name} is neither a folder nor a valid Hub repository id ({problem})")
    offline = local_files_only or is_offline()
    try:
        folder = _download_export(name, revision, token, endpoint, cache_dir, local_files_only, offline, force_download, subfolder)
    except (HubNotFoundError, HubConnectionError, HubOfflineError) as e:
        raise no_folder_either(name, e) from e
    missing = _missing(folder, ["config.json", layout.NEURON_CONFIG_FILE])
    if missing and not offline:
        raise IncompatibleExportError(
            f"{name}{at_revision(revision)} is not an exported model: it has no {' and no '.join(missing)}"
        )
    if not missing:
        missing = _missing(folder, layout.required_files(layout.read_json(folder / layout.NEURON_CONFIG_FILE)))
    if missing:
        if offline:
            raise HubOfflineError(
                f"cannot load {name}{at_revision(revision)} offline: the cached snapshot {folder} lacks {', '.join(missing)};"
                " download it once online, or unset HF_HUB_OFFLINE"
            )
        raise IncompatibleExportError(f"{name}{at_revision(revision)} is an incomplete export: it lacks {', '.join(missing)}")
    return folder


def _download_export(name, revision, token, endpoint, cache_dir, local_files_only: bool, offline: bool,
                     force_download: bool = False, subfolder: str | None = None) -> Path:
    patterns = [f"{subfolder}/{p}" for p in layout.EXPORT_PATTERNS] if subfolder else layout.EXPORT_PATTERNS
    with hub_errors("download", name, endpoint, revision, token):
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
                    f"cannot load {name}{at_revision(revision)} offline: it is not in the Hugging Face cache"
                    f" ({_cache_name(cache_dir)}); missing: the whole export (config.json, {layout.NEURON_CONFIG_FILE}, graphs,"
                    " weights). Download it once online, or unset HF_HUB_OFFLINE"
                ) from e
            raise



def _cache_name(cache_dir) -> str:
    if cache_dir is not None:
        return str(cache_dir)
    return constants.HF_HUB_CACHE


def download_checkpoint(
    repo_id: str,
    revision: str | None = None,
    token: str | bool | None = None,
    endpoint: str | None = None,
    allow_patterns: list[str] | None = None,
) -> Path:
    """A Hub model (a source checkpoint to export) in the Hugging Face cache; one-line errors as above."""
    problem = repo_id_problem(repo_id)
    if problem and repo_id.startswith((".", "/", "~")) or repo_id.endswith("/"):
        raise ModelNotFoundError(f"no such folder: {repo_id!r}")  # a path, by its form
    if problem:
        raise ModelNotFoundError(f"{repo_id} is neither a local folder nor a valid Hub repository id ({problem})")
    try:
        with hub_errors("download", repo_id, endpoint, revision, token):
            return Path(snapshot_download(repo_id, revision=revision, token=token, endpoint=endpoint, allow_patterns=allow_patterns))
    except (HubNotFoundError, HubConnectionError, HubOfflineError) as e:
        raise no_folder_either(repo_id, e) from e



def resolve_source_checkpoint(
    folder: str | os.PathLike,
    token: str | bool | None = None,
    endpoint: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
) -> Path | None:
    """The source checkpoint a Neuron export needs at load time, or None when the export carries its weights.

    A cpu or TorchNeuron export, or an NxD export made from a local folder (`checkpoint/weights/`), carries them. An
    NxD export made from a Hub id does not: its safetensors (and config) are fetched from `checkpoint_id` at
    `checkpoint_revision`, as optimum-neuron's `load_weights` does, into the Hugging Face cache."""
    folder = Path(folder)
    nc = layout.read_neuron_config(folder)
    if layout.holds_rank_shards(nc) or (folder / layout.CHECKPOINT_DIR).is_dir():
        return None
    checkpoint_id = nc.get("checkpoint_id")
    if not checkpoint_id:
        raise CheckpointError(
            f"{folder} holds no weights (no checkpoint/) and names no source checkpoint (checkpoint_id is null):"
            " export it again"
        )
    revision = nc.get("checkpoint_revision")
    with hub_errors("download the source checkpoint", checkpoint_id, endpoint, revision, token):
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
            f"the source checkpoint {checkpoint_id}{at_revision(revision)} of {folder} has no safetensors weights"
        )
    return weights

