"""Parity with transformers' Qwen3.5, recorded in tests/fixtures/<layout>/reference.npz.

Teacher-forced logits at every position (right-padded batches of mixed lengths, fp32), greedy
generation through the context-encoding and token-generation graphs, and the bf16 error budget.
The reference outputs were produced by transformers >= 5 (tests/fixtures/make_reference.py; the nox
`reference` session regenerates them and fails if they drift), so these tests run in both environments.
"""

import numpy as np
import pytest
import torch

from optimum_qwen35.runtime import Qwen35Runtime

from .conftest import FIXTURES, LAYOUTS, load_reference, reference_prompts

# fp32 tolerance of the issue: max |logit difference| at every position, every layout.
LOGIT_ATOL = 1e-4
# A greedy divergence is only excused where the reference's top-2 margin is below this.
TIE_MARGIN = 1e-5


@pytest.fixture(scope="module", params=LAYOUTS)
def layout(request):
    return request.param


@pytest.mark.parametrize("batch_size", [4])
def test_teacher_forced_logits(layout, batch_size):
    ref = load_reference(layout)
    cases = reference_prompts(ref)
    assert sorted(len(p) for p, _ in cases) == [1, 2, 3, 63, 64, 65, 130, 520]
    # Mixed lengths in every batch: [1, 63, 130, 2], [64, 520, 3, 65] (right-padded to 256 and 1024).
    order = [0, 3, 6, 1, 4, 7, 2, 5]
    cases = [cases[i] for i in order]
    model = Qwen35Runtime.from_pretrained(FIXTURES / layout, batch_size=batch_size, max_length=1024)
    ours = model.logits([p for p, _ in cases])
    worst = 0.0
    for (prompt, expected), got in zip(cases, ours):
        expected = torch.from_numpy(expected)
        diff = (got - expected).abs().max().item()
        worst = max(worst, diff)
        mismatched = (got.argmax(-1) != expected.argmax(-1)).nonzero().flatten().tolist()
        assert diff <= LOGIT_ATOL, f"{layout} len {len(prompt)}: max |dlogit| {diff:.2e} > {LOGIT_ATOL}"
        assert not mismatched, f"{layout} len {len(prompt)}: top-1 differs at positions {mismatched[:10]}"
    print(f"\n{layout}: max |logit - transformers| over all positions = {worst:.2e} (tolerance {LOGIT_ATOL})")


def test_greedy_generation_through_traced_graphs(layout):
    ref = load_reference(layout)
    prompts = [ref[f"gen_prompt_{j}"].tolist() for j in range(2)]
    model = Qwen35Runtime.from_pretrained(FIXTURES / layout, batch_size=2, max_length=256, trace=True)
    generated = model.generate(prompts, max_new_tokens=128)
    for j, tokens in enumerate(generated):
        expected = ref[f"gen_tokens_{j}"].tolist()
        assert len(tokens) == 128
        if tokens != expected:
            step = next(i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b)
            margin = float(ref[f"gen_margin_{j}"][step])
            assert margin < TIE_MARGIN, (
                f"{layout} prompt {j}: greedy tokens part at step {step} ({tokens[step]} vs {expected[step]}), "
                f"where the reference's top-2 margin is {margin:.2e} (only a margin < {TIE_MARGIN} excuses it)"
            )
            print(f"\n{layout} prompt {j}: parted at step {step}, excused by a reference margin of {margin:.2e}")


# Top-1 agreement flips at near-ties of the fp32 reference (top-2 margins below ~0.2, inside bf16's error) with the
# CPU's bf16 kernels: on a CPU with AVX512-BF16 ours went from >= 0.954 to 0.950 on tiny-nv3x and transformers' from
# 0.954 to 0.953 (42 and 40 of 848 positions wrong; measured). So transformers' bf16 is run here, on the same CPU, and
# ours may trail it by at most this share of positions (4 of 848); the mean error must not be worse at all.
TOP1_SLACK = 0.005


@pytest.mark.reference  # (runs transformers >= 5's Qwen3.5: the reference session)
def test_bf16_error_no_worse_than_transformers_bf16(layout):
    """bf16 weights and activations, fp32 recurrent state, against the fp32 reference logits, with transformers' bf16
    model run on the same prompts on this CPU."""
    from tests.fixtures.make_reference import load_checked, teacher_forced_logits

    ref = load_reference(layout)
    cases = reference_prompts(ref)
    model = Qwen35Runtime.from_pretrained(FIXTURES / layout, batch_size=4, max_length=1024, dtype=torch.bfloat16)
    assert all(t.dtype == torch.float32 for s, t in zip(model.graphs.state_specs, model.state) if "recurrent" in s.name)
    ours = [o.numpy() for o in model.logits([p for p, _ in cases])]
    theirs = teacher_forced_logits(load_checked(FIXTURES / layout, layout, torch.bfloat16), [np.array(p) for p, _ in cases])

    def error_and_top1(logits):
        errors = np.concatenate([np.abs(o - e).ravel() for o, (_, e) in zip(logits, cases)])
        agree = np.concatenate([o.argmax(-1) == e.argmax(-1) for o, (_, e) in zip(logits, cases)])
        return float(errors.mean()), float(agree.mean())

    (our_mae, our_top1), (hf_mae, hf_top1) = error_and_top1(ours), error_and_top1(theirs)
    print(
        f"\n{layout} bf16 vs fp32 reference: ours mean |dlogit| {our_mae:.4f}, top-1 {our_top1:.3f}; "
        f"transformers bf16 {hf_mae:.4f}, top-1 {hf_top1:.3f} (when the fixture was made: "
        f"{float(ref['hf_bf16_mean_abs_err']):.4f}, {float(ref['hf_bf16_top1_agreement']):.3f})"
    )
    assert our_mae <= hf_mae, f"bf16 mean abs logit error {our_mae:.4f} is worse than transformers' {hf_mae:.4f}"
    assert our_top1 >= hf_top1 - TOP1_SLACK, f"bf16 top-1 agreement {our_top1:.3f} is worse than transformers' {hf_top1:.3f}"
