"""The gated delta rule over a long sequence whose gates decay, against a float64 token-by-token recurrence.

tests/test_long_context.py holds the gates near 0 (nothing decays), where a chunked rule that forgets a decay factor
gives the same answer. Here every head decays at its own rate, from barely (g ~ -1e-4 per token) to fast (g ~ -3),
beta spans (0, 1), keys repeat in runs (so the UT system is far from the identity), the sequence starts from a
non-zero state and crosses 128 chunk boundaries, and 64 decode steps follow. A bug in any decay term of the chunked
form (the intra-chunk decay, the decayed keys of the state update, the chunk-end decay, the decayed queries) shows.
"""

import pytest
import torch

from optimum_qwen35.kernels.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule

from .test_long_context import prefill_then_decode

PREFILL, DECODE = 8192, 64
# fp32 chunked + steps against the float64 recurrence; outputs and states are O(1). Measured 7.2e-7 (outputs) and
# 1.3e-6 (state); the bound leaves room for other BLAS builds.
ATOL = 1e-4


def decaying_inputs(B=1, nk=2, nv=6, dk=32, dv=16, T=PREFILL + DECODE, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.nn.functional.normalize(torch.randn(B, nk, T // 16, dk, generator=g, dtype=torch.float64), dim=-1)
    k = keys.repeat_interleave(16, dim=2)  # runs of 16 identical keys
    q = torch.nn.functional.normalize(torch.randn(B, nk, T, dk, generator=g, dtype=torch.float64), dim=-1) * dk**-0.5
    v = torch.randn(B, nv, T, dv, generator=g, dtype=torch.float64)
    rates = torch.logspace(-4, 0.5, nv, dtype=torch.float64)[None, :, None]  # per head, 1e-4 .. 3.2
    decay = -rates * 2 * torch.rand(B, nv, T, generator=g, dtype=torch.float64)
    beta = torch.rand(B, nv, T, generator=g, dtype=torch.float64)
    state = torch.randn(B, nv, dk, dv, generator=g, dtype=torch.float64)
    return q, k, v, decay, beta, state


@pytest.mark.slow
def test_long_sequence_with_decaying_gates_against_float64():
    q, k, v, g, beta, s0 = decaying_inputs()
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    # The slow heads still remember the initial state at the end, and the fast ones do not: both regimes are seen.
    assert g[0, 0].sum() > -2 and g[0, -1].sum() < -1000

    o, state = prefill_then_decode([t.float() for t in (q, k, v, g, beta)], PREFILL, DECODE, s0.float())
    err_o = (o.double() - o_ref).abs().max().item()
    err_s = (state.double() - s_ref).abs().max().item()
    print(f"\n{PREFILL}+{DECODE} tokens, decaying gates, fp32 chunked+steps vs float64 recurrence: "
          f"max |do| {err_o:.2e}, max |dS| {err_s:.2e}")
    assert err_o <= ATOL and err_s <= ATOL


def test_chunked_float64_with_decaying_gates_and_padding_is_exact():
    """float64 in, float64 math: the chunked form equals the recurrence to rounding, padded rows included."""
    q, k, v, g, beta, s0 = decaying_inputs(B=2, T=320, seed=1)
    lengths = torch.tensor([320, 131])
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, s0, lengths)
    for b, L in enumerate(lengths.tolist()):
        sl = slice(b, b + 1)
        o_b, s_b = recurrent_gated_delta_rule(q[sl, :, :L], k[sl, :, :L], v[sl, :, :L], g[sl, :, :L], beta[sl, :, :L], s0[sl])
        torch.testing.assert_close(o[sl, :, :L], o_b, rtol=0, atol=1e-10)
        torch.testing.assert_close(s[sl], s_b, rtol=0, atol=1e-10)
