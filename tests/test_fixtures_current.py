"""The committed fixtures (tests/fixtures/<layout>/) are what make_reference.py produces today.

Needs transformers >= 5 (the reference implementation of Qwen3.5): regenerates every checkpoint and its
reference outputs into a temporary folder and compares them with the committed files, so CI fails when the
builder, the prompts or transformers' Qwen3.5 change without the fixtures being regenerated. fp32 rounding is not a
change: the logits are held to a fresh float64 run (make_reference.compare_logits), and planted changes of the model
must still fail that rule.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

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


# Changes of transformers' Qwen3.5 the check must call a change, planted in both its fp32 and float64 models.
def _perturbed_weight(model):
    model.model.language_model.layers[0].mlp.down_proj.weight.data[0, 0] += 1e-3


def _rope_theta_1e4(model):
    # transformers' default rope_theta instead of the checkpoint's 1e7 (ANCHORS.md: "always read rope_theta")
    rotary = model.model.language_model.rotary_emb
    dim = 2 * rotary.inv_freq.numel()
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    rotary.inv_freq.copy_((1.0 / 1e4**exponents).to(rotary.inv_freq.dtype))


def _norm_eps_1e5(model):
    for module in model.modules():
        if type(module).__name__ == "Qwen3_5RMSNorm":
            module.eps = 1e-5


@pytest.mark.parametrize("patch", [None, _perturbed_weight, _rope_theta_1e4, _norm_eps_1e5],
                         ids=["unchanged", "perturbed-weight", "rope-theta", "norm-eps"])
def test_logits_check_fails_on_a_real_change_of_the_reference(patch):
    """The logits rule (make_reference.compare_logits) lets fp32 rounding through and fails on a changed model: the
    unchanged run passes on every prompt, each planted change fails on most of them (the one-token prompt sees no
    rope)."""
    mr = _load_make_reference()
    layout = "tiny-2b"
    prompts, _ = mr.make_prompts(layout)
    new, truth = mr.reference_logits(FIXTURES / layout, layout, prompts, patch)
    with np.load(FIXTURES / layout / "reference.npz") as committed:
        diffs = [d for i in range(len(prompts)) for d in mr.compare_logits(
            f"logits_{i}", new[i], committed[f"logits_{i}"], truth[i], float(committed[f"fp32_err_{i}"]))]
    if patch is None:
        assert diffs == []
    else:
        changed = [d for d in diffs if "the reference changed" in d]
        assert len(changed) >= len(prompts) - 1, diffs
