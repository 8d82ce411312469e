"""The version guard of every patch in this package: a patch of a library's internals applies only to the versions it
was read at; on any other version it is skipped with one warning."""

from __future__ import annotations

import functools
import logging
from importlib import metadata

logger = logging.getLogger("optimum_qwen35.patches")

# The versions each patched library was read at: a patch of its internals applies to these only. "transformers 5"
# is another range of transformers, for the patches written against it only.
SUPPORTED = {
    "optimum-neuron": ("0.4.5",),
    "vllm": ("0.11.",),
    "transformers": ("4.57.",),
    "transformers 5": ("5.25.",),
    "huggingface_hub": ("0.", "1.", "2."),
    "torch": ("2.8.", "2.13.", "2.14."),
}


@functools.lru_cache(maxsize=None)
def _supported(package: str, patch: str) -> bool:
    """Whether `package`'s installed version is one `patch` was written against; one warning where it is not."""
    try:
        version = metadata.version(package.split()[0])  # "transformers 5": transformers, another version range
    except metadata.PackageNotFoundError:
        return False
    if version.startswith(SUPPORTED[package]):
        return True
    logger.warning(
        "optimum-qwen35: %s %s is not a version its patch %r was written for (%s): not applied",
        package, version, patch, ", ".join(v + ("x" if v.endswith(".") else "") for v in SUPPORTED[package]),
    )
    return False
