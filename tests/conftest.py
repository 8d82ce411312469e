"""Shared test helpers: the committed reference fixtures and transformers detection."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).parent / "fixtures"
LAYOUTS = ("tiny-2b", "tiny-nv2x", "tiny-nv3x")


def has_reference_transformers() -> bool:
    """transformers >= 5 with `qwen3_5`: the reference implementation is importable."""
    try:
        import transformers.models.qwen3_5.modeling_qwen3_5  # noqa: F401
    except ImportError:
        return False
    return True


def pytest_collection_modifyitems(config, items):
    if has_reference_transformers():
        return
    skip = pytest.mark.skip(reason="needs transformers >= 5 (qwen3_5); runs in the nox `reference` session")
    for item in items:
        if "reference" in item.keywords:
            item.add_marker(skip)


def load_reference(layout: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / layout / "reference.npz") as data:
        return {k: data[k] for k in data.files}


def reference_prompts(ref: dict[str, np.ndarray]) -> list[tuple[list[int], np.ndarray]]:
    """(prompt, logits [len, vocab]) for every teacher-forced prompt of a reference file."""
    out, i = [], 0
    while f"prompt_{i}" in ref:
        out.append((ref[f"prompt_{i}"].tolist(), ref[f"logits_{i}"]))
        i += 1
    return out
