"""Sampling changes the distribution the way transformers' warpers do: temperature, top-k, top-p (issue 22).

`optimum_qwen35.optimum_neuron.generation._sampler` (what the optimum class's `generate(do_sample=True, ...)` samples
with) is given a fixed logits row repeated N = 4000 times; under a fixed torch seed its draws are compared with the
distribution written out here from the definitions (softmax of logits / temperature, then the k largest kept, then
the smallest set of the most likely tokens whose mass reaches top_p, renormalised):
- no token outside the kept set is ever drawn;
- total variation between the empirical and the expected distribution <= TV_BOUND, and the chi-square statistic
  below its mean + 6 standard deviations (a fixed seed: the same draws on every run, it cannot flake);
- the test can fail: every pair of configurations here is at least 3 x TV_BOUND apart, and so is each from itself with one warper skipped, so a warper that is
  skipped (a temperature validated but never applied, top-k or top-p ignored) moves the draws past the bound.
Runs in both sessions (transformers 5 and 4.57: each one's own warpers).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GenerationConfig

from optimum_qwen35.errors import UsageError
from optimum_qwen35.optimum_neuron.generation import _sampler

LOGITS = torch.tensor([2.0, 1.55, 1.2, 1.0, 0.8, 0.45, 0.3, 0.0, -0.5, -1.0, -2.0, -3.0])
DRAWS = 4000
TV_BOUND = 0.035  # sampling error at N = 4000 over <= 12 tokens: measured at most 0.021 over these configurations
SEED = 22

CONFIGS = {
    "T=0.3": dict(temperature=0.3),
    "T=1": dict(temperature=1.0),
    "T=3": dict(temperature=3.0),
    "top_k=3": dict(top_k=3),
    "T=2,top_k=6": dict(temperature=2.0, top_k=6),
    "top_p=0.45": dict(top_p=0.45),
    "T=1.5,top_p=0.7": dict(temperature=1.5, top_p=0.7),
    "T=3,top_k=5,top_p=0.7": dict(temperature=3.0, top_k=5, top_p=0.7),
}


def expected_distribution(logits, temperature=1.0, top_k=0, top_p=1.0) -> torch.Tensor:
    """The definitions, in float64: temperature, then top-k, then top-p (transformers' order)."""
    p = torch.softmax(logits.double() / temperature, -1)
    order = p.argsort(descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    keep[order[: top_k or len(p)]] = True
    p = torch.where(keep, p, 0.0)
    p = p / p.sum()
    mass_before = torch.cumsum(p[order], 0) - p[order]  # of the more likely tokens
    keep = torch.zeros_like(keep)
    keep[order[mass_before < top_p]] = True
    p = torch.where(keep, p, 0.0)
    return p / p.sum()


def total_variation(p, q) -> float:
    return 0.5 * (p - q).abs().sum().item()


def draws(options) -> torch.Tensor:
    sample = _sampler(GenerationConfig(do_sample=True, **{"top_k": 0, **options}))  # transformers defaults top_k to 50
    torch.manual_seed(SEED)
    tokens = sample(LOGITS.expand(DRAWS, -1).clone())
    assert tokens.shape == (DRAWS,)
    return torch.bincount(tokens, minlength=len(LOGITS)).double() / DRAWS


def skipping_one_warper(options):
    """The configurations a sampler that ignores one of the options would sample from."""
    neutral = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    return [{**options, name: neutral[name]} for name in options if options[name] != neutral[name]]


def test_the_configurations_are_far_apart():
    """The test below can tell each configuration from every other one, and from itself with any one warper
    skipped (temperature, top-k or top-p ignored)."""
    expected = {name: expected_distribution(LOGITS, **options) for name, options in CONFIGS.items()}
    names = sorted(expected)
    closest = min(total_variation(expected[a], expected[b]) for a in names for b in names if a < b)
    assert closest >= 3 * TV_BOUND, closest
    for name, options in CONFIGS.items():
        for wrong in skipping_one_warper(options):
            distance = total_variation(expected[name], expected_distribution(LOGITS, **wrong))
            assert distance >= 3 * TV_BOUND, (name, wrong, distance)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_sampling_matches_the_warped_distribution(name):
    options = CONFIGS[name]
    want = expected_distribution(LOGITS, **options)
    got = draws(options)
    assert (got[want == 0] == 0).all(), f"{name}: drew tokens outside the kept set: {torch.nonzero((got > 0) & (want == 0)).flatten().tolist()}"
    tv = total_variation(got, want)
    assert tv <= TV_BOUND, f"{name}: total variation {tv:.3f} from the warped distribution (bound {TV_BOUND})"
    kept = want > 0
    chi2 = (DRAWS * (got[kept] - want[kept]) ** 2 / want[kept]).sum().item()
    dof = int(kept.sum()) - 1
    if dof:
        assert chi2 <= dof + 6 * math.sqrt(2 * dof), f"{name}: chi-square {chi2:.1f} with {dof} degrees of freedom"


def test_greedy_and_invalid_temperature():
    assert _sampler(GenerationConfig(do_sample=False, temperature=0.3)) is None  # greedy: the runtime's argmax
    with pytest.raises(UsageError, match="temperature must be > 0"):
        _sampler(GenerationConfig(do_sample=True, temperature=-1.0))
