"""Sampled speculative decoding (runtime/speculative.py, the rejection rule) draws its tokens from plain sampling's
distribution: a chi-square goodness-of-fit test over many seeded draws.

The model: tiny-2b with its MTP head fitted to its own main model (optimum_qwen35/tiny/mtp_fit.py), so that drafts are kept in a
good share of the rounds and rejected in the others (both branches of the rule run; asserted). The prompt: a prompt the
head was fitted on plus the start of its greedy continuation. The sampling distribution: the `TOP` most likely tokens at
temperature `TAU` (a small support, so that the joint law of the first `NEW` tokens has few cells).

What is tested: the joint law of the `NEW` = 3 generated tokens with k = 2 drafts (token 1 comes from prefill, tokens 2
and 3 from the first verify round: none, one or both drafts kept, or a residual draw). The expected law is computed
exactly, not sampled: P(t1) P(t2 | t1) P(t3 | t1, t2) from the main model's logits (prefill of every prefix), in
float64. Plain sampling (generate with a `sampler`) is held to the same law, so a wrong expected law fails both.

Power (chi-square, alpha = ALPHA = 1e-3, N = SAMPLES = 1024 draws, at most 8 cells, pooled to those of expected
count >= 5: at most 7 degrees of freedom): power 0.9 needs a non-centrality lambda = N * sum((p' - p)^2 / p) of 31.8 at
7 degrees of freedom (27.7 at 4; scipy.stats.ncx2), and sum((p' - p)^2 / p) >= (2 TV)^2 for any p' (Cauchy-Schwarz), so
any deviation of total variation TV >= sqrt(31.8 / (4 N)) = 0.088 from the law is detected with probability >= 0.9
(smaller ones may pass). Two broken rules are run as controls, with CONTROL_SAMPLES = 512 draws (TV >= 0.125 detected
with probability >= 0.9), and must be detected (`test_a_broken_rule_is_detected`): the residual drawn from p instead of
max(p - q, 0), and every draft kept; their deviations from the law are printed (-s).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from optimum_qwen35.runtime import Qwen35Runtime, speculative

ALPHA = 1e-3
SAMPLES = 1024
CONTROL_SAMPLES = 512
BATCH = 128  # rows per generate call: SAMPLES / BATCH calls
NEW, K, TOP, TAU = 3, 2, 2, 0.5


def distribution(logits: torch.Tensor) -> torch.Tensor:
    """The `TOP` most likely tokens at temperature `TAU`; probabilities [n, vocab]."""
    values, index = logits.topk(TOP, -1)
    return torch.zeros_like(logits).scatter(-1, index, torch.softmax(values / TAU, -1))


@pytest.fixture(scope="module")
def setup(fitted_tiny_2b):
    folder = fitted_tiny_2b
    fitted = json.loads((folder / "mtp_fit.json").read_text())["prompts"][0]
    model = Qwen35Runtime.from_pretrained(folder, batch_size=BATCH, max_length=40, buckets=[32], mtp=True)
    prompt = fitted + model.generate([fitted], max_new_tokens=12)[0]
    return model, prompt, exact_law(model, prompt)


def exact_law(model, prompt) -> dict[tuple, float]:
    """P(t1 .. tNEW) of plain sampling under `distribution`, from the main model's prefill logits of every prefix."""
    law = {(): 1.0}
    for _ in range(NEW):
        prefixes = list(law)
        logits = model.prefill([prompt + list(p) for p in prefixes], list(range(len(prefixes))))
        probs = distribution(logits.float()).double()
        law = {p + (t,): law[p] * float(probs[i, t]) for i, p in enumerate(prefixes) for t in probs[i].nonzero()[:, 0].tolist()}
    return law


def chi_square(samples: list[tuple], law: dict[tuple, float]) -> tuple[float, int, float, float]:
    """(statistic, degrees of freedom, p-value, total variation of the empirical law) of `samples` against `law`;
    cells of expected count < 5 are pooled into one (and one more cell for anything outside the law's support)."""
    n, counts = len(samples), Counter(samples)
    cells, pooled_expected, pooled_count = [], 0.0, 0
    for cell, p in law.items():
        if n * p >= 5:
            cells.append((counts[cell], n * p))
        else:
            pooled_expected, pooled_count = pooled_expected + n * p, pooled_count + counts[cell]
    outside = n - sum(counts[c] for c in law)
    if outside:  # a sample the law gives probability 0: the test must fail
        return float("inf"), len(cells), 0.0, 1.0
    if pooled_expected > 0:
        cells.append((pooled_count, pooled_expected))
    statistic = sum((c - e) ** 2 / e for c, e in cells)
    df = len(cells) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64)))
    tv = 0.5 * sum(abs(counts[c] / n - p) for c, p in law.items())
    return statistic, df, p_value, tv


def draws(model, prompt, speculative_k: int, seed: int, samples: int = SAMPLES, kept: Counter | None = None) -> list[tuple]:
    """`samples` seeded draws of the NEW generated tokens; `kept` counts the drafts kept per verify round."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(samples // BATCH):
        if speculative_k:
            rows = model.generate([prompt] * BATCH, max_new_tokens=NEW, num_speculative_tokens=speculative_k,
                                  distribution=distribution, generator=generator)
            if kept is not None:
                kept.update(model.speculation.accepted_per_round)
        else:
            def sampler(logits):
                return torch.multinomial(distribution(logits.float()), 1, generator=generator)[:, 0]

            rows = model.generate([prompt] * BATCH, max_new_tokens=NEW, sampler=sampler)
        out += [tuple(r) for r in rows]
    return out


def test_plain_sampling_follows_the_exact_law(setup):
    model, prompt, law = setup
    assert len(law) > 2 and abs(sum(law.values()) - 1) < 1e-6  # fp32 softmax
    statistic, df, p_value, tv = chi_square(draws(model, prompt, 0, seed=1), law)
    print(f"plain: chi2 {statistic:.1f} df {df} p {p_value:.3f} TV {tv:.3f}")
    assert p_value > ALPHA


def test_speculative_sampling_follows_plain_sampling_law(setup):
    model, prompt, law = setup
    kept = Counter()
    samples = draws(model, prompt, K, seed=2, kept=kept)
    statistic, df, p_value, tv = chi_square(samples, law)
    print(f"speculative k={K}: chi2 {statistic:.1f} df {df} p {p_value:.3f} TV {tv:.3f}; drafts kept per round {dict(kept)}")
    # Both branches ran: rounds that kept drafts (all of them, too) and rounds that drew a replacement.
    assert kept[0] > 0 and kept[K] > 0, kept
    assert p_value > ALPHA


@pytest.mark.parametrize("broken", ["residual_from_p", "keep_every_draft"])
def test_a_broken_rule_is_detected(setup, monkeypatch, broken):
    """The test's own check: a rejection rule with a classic mistake gives a law the chi-square test rejects."""
    model, prompt, law = setup
    right = speculative.reject

    def residual_from_p(p, q, draft, generator):
        token = right(p, q, draft, generator)
        return None if token is None else speculative._sample(p, generator)

    def keep_every_draft(p, q, draft, generator):
        return None

    monkeypatch.setattr(speculative, "reject", {"residual_from_p": residual_from_p, "keep_every_draft": keep_every_draft}[broken])
    statistic, df, p_value, tv = chi_square(draws(model, prompt, K, seed=3, samples=CONTROL_SAMPLES), law)
    print(f"{broken}: chi2 {statistic:.1f} df {df} p {p_value:.2e} TV {tv:.3f}")
    assert p_value < ALPHA
