"""Parity of the MoE models (`qwen3_5_moe`) with transformers 5's `Qwen3_5MoeForConditionalGeneration`, recorded in
tests/fixtures/<layout>/reference.npz for the tiny MoE layouts: tiny-moe (6 experts top-2, per-expert keys on disk)
and tiny-moe-top1 (4 experts top-1, fused keys on disk).

The same three checks as tests/test_parity.py, on these layouts: teacher-forced fp32 logits within 1e-4 at every
position of 8 prompts (1 to 520 tokens, right-padded batches of mixed lengths), 128 greedy tokens through the
traced context-encoding and token-generation graphs, and the bf16 error no worse than transformers' bf16.
"""

import pytest

from optimum_qwen35.testing import TINY_MOE_LAYOUTS

# The checks themselves, collected here again with this module's `layout` fixture.
from .test_parity import (  # noqa: F401
    test_bf16_error_no_worse_than_transformers_bf16,
    test_greedy_generation_through_traced_graphs,
    test_teacher_forced_logits,
)


@pytest.fixture(scope="module", params=sorted(TINY_MOE_LAYOUTS))
def layout(request):
    return request.param
