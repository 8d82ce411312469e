"""The committed fixtures (tests/fixtures/<layout>/) are what make_reference.py produces today.

Needs transformers >= 5 (the reference implementation of Qwen3.5): regenerates every checkpoint and its
reference outputs into a temporary folder and compares them with the committed files, so CI fails when the
builder, the prompts or transformers' Qwen3.5 change without the fixtures being regenerated.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


def _reference_transformers_reason() -> str | None:
    try:
        import transformers
    except ImportError:
        return "transformers is not installed"
    if int(transformers.__version__.split(".")[0]) < 5 or not hasattr(transformers, "Qwen3_5ForConditionalGeneration"):
        return f"needs transformers >= 5 with qwen3_5 (installed: {transformers.__version__})"
    return None


_REASON = _reference_transformers_reason()
pytestmark = [pytest.mark.reference, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


def _load_make_reference():
    spec = importlib.util.spec_from_file_location("make_reference", FIXTURES / "make_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fixtures_are_current():
    mr = _load_make_reference()
    diffs = mr.check(FIXTURES, verbose=False)
    assert not diffs, "the committed fixtures are stale (regenerate with tests/fixtures/make_reference.py):\n" + "\n".join(
        f"  - {d}" for d in diffs
    )
