"""Parity of the MoE models (`qwen3_5_moe`) with transformers 5's `Qwen3_5MoeForConditionalGeneration`, recorded in
tests/fixtures/<layout>/reference.npz for the tiny MoE layouts: tiny-moe (6 experts top-2, per-expert keys on disk)
and tiny-moe-top1 (4 experts top-1, fused keys on disk).

The same three checks as tests/test_parity.py, on these layouts: teacher-forced fp32 logits within 1e-4 at every
position of 8 prompts (1 to 520 tokens, right-padded batches of mixed lengths), 128 greedy tokens through the
traced context-encoding and token-generation graphs, and the bf16 error no worse than transformers' bf16.
"""

import pytest

from tests.kit import TINY_MOE_LAYOUTS

# The checks themselves, collected here again with this module's `layout` fixture.
from .test_parity import (  # noqa: F401
    test_bf16_error_no_worse_than_transformers_bf16,
    test_greedy_generation_through_traced_graphs,
    test_teacher_forced_logits,
)


@pytest.fixture(scope="module", params=sorted(TINY_MOE_LAYOUTS))
def layout(request):
    return request.param


@pytest.mark.reference
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layout, tokens", [("tiny-moe", 1), ("tiny-moe", 40), ("tiny-moe-top1", 3), ("tiny-moe-top1", 40)])
def test_block_matches_transformers_including_router_ties(layout, tokens, dtype):
    """Our SparseMoeBlock against transformers' Qwen3_5MoeSparseMoeBlock (eager experts) on the same weights, in its
    looped form (eager) and its static one (fewer routed pairs than experts: the gathered form; else the dense form). Router rows 1, 3 and 5 (top-1: 1 and 3) are
    equal and the tokens lean towards them, so that k + 1 experts tie exactly at the top: the same experts chosen
    (torch.topk's tie order, which on CPU is not simply the lowest index), the same output to rounding."""
    import torch
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    from optimum_qwen35 import Qwen35Config
    from optimum_qwen35.modeling.moe import SparseMoeBlock, route
    from optimum_qwen35.modeling.torch_layers import TorchLayers
    from tests.kit import tiny_text_config

    dtype = getattr(torch, dtype)
    text = tiny_text_config(layout)
    theirs_config = Qwen3_5MoeTextConfig(**{k: v for k, v in text.items() if k not in ("model_type", "dtype")})
    theirs_config._experts_implementation = "eager"
    torch.manual_seed(1)
    theirs = Qwen3_5MoeSparseMoeBlock(theirs_config)
    for p in theirs.parameters():
        p.data.normal_(0, 0.3)
    k = text["num_experts_per_tok"]
    tied = [1, 3, 5][: k + 1]
    direction = theirs.gate.weight.data[1].clone()
    theirs.gate.weight.data[tied] = direction  # these experts tie on every token
    theirs.to(dtype)
    ours = SparseMoeBlock(Qwen35Config.from_dict(text), TorchLayers())
    ours.load_state_dict(theirs.state_dict())
    ours.to(dtype)
    x = (torch.randn(1, tokens, text["hidden_size"]) * 0.1 + direction / direction.norm() * 3).to(dtype)
    with torch.no_grad():
        _, their_weights, their_ids = theirs.gate(x.reshape(tokens, -1))
        our_weights, our_ids = route(ours.gate(x.reshape(tokens, -1)), text["num_experts_per_tok"], dtype)
        assert torch.equal(our_ids, their_ids)
        # Every token's choice is k of the k + 1 tied experts: which k is torch.topk's tie order, ours as theirs.
        assert torch.isin(their_ids, torch.tensor(tied)).all()
        torch.testing.assert_close(our_weights, their_weights, atol=0, rtol=0)
        looped, static, expected = ours(x), ours(x, static=True), theirs(x)
    # Outputs of magnitude ~3: fp32 rounding (a different summation order) is a few 1e-7 relative.
    tol = 2e-6 if dtype == torch.float32 else 1e-13
    for got in (looped, static):
        torch.testing.assert_close(got.to(dtype), expected, atol=tol, rtol=tol)
