"""A TorchNeuron export's compile cache travels with it on the Hub.

TorchNeuron files each graph's NEFF in `TORCH_NEURONX_NEFF_CACHE_DIR` (default /tmp/neff_cache) under a key hashed
from the graph, the compiler options and the neuronx-cc version (docs/torchneuron.md, "The compile cache").
`push_to_hub` of a TorchNeuron export pushes every file of that folder (temporary files left out) in the same commit,
under `neff_cache/<relative path>`: point the variable at a folder used for this model, or it carries the NEFFs of
other models too. `from_pretrained(hub_id)` downloads them with the export and installs the missing ones into the
local cache folder before the first compile, each through a temporary file and a rename, so the first load on a
device with the same SDK finds its graphs compiled. The cache repos of `optimum-qwen35 neff-cache push/fetch`
(hub/compile_cache.py) are the other way, keyed by configuration.
"""

from __future__ import annotations

import logging
from pathlib import Path

from optimum_qwen35.export.layout import NEFF_CACHE_DIR
from optimum_qwen35.hub.compile_cache import _install, default_neff_cache_dir, local_cache_files

logger = logging.getLogger(__name__)


def compile_cache_files() -> dict[str, Path]:
    """path in repo -> file, for every file of the local NEFF cache folder (empty where there is none)."""
    cache_dir = default_neff_cache_dir()
    if not cache_dir.is_dir():
        return {}
    files = {f"{NEFF_CACHE_DIR}/{rel}": path for rel, path in local_cache_files(cache_dir).items()}
    if files:
        logger.warning("pushing the compile cache with the export: %d file(s) of %s", len(files), cache_dir)
    return files


def install_compile_cache(export: Path) -> list[str]:
    """Copy the export's `neff_cache/` files missing from the local NEFF cache folder into it; the files copied."""
    source = Path(export) / NEFF_CACHE_DIR
    if not source.is_dir():
        return []
    target = default_neff_cache_dir()
    copied = []
    for rel, path in sorted(local_cache_files(source).items()):
        final = target / rel
        if final.is_file() and final.stat().st_size == path.stat().st_size:
            continue
        _install(path, final)
        copied.append(rel)
    if copied:
        logger.info("compile cache of %s: %d file(s) installed in %s", export, len(copied), target)
    return copied
