"""The PyTorch reference kernels: chunked vs token-by-token gated delta rule, conv1d whole vs step."""

import pytest
import torch
import torch.nn.functional as F

from optimum_qwen35 import kernels
from optimum_qwen35.kernels.causal_conv1d_reference import causal_conv1d, causal_conv1d_step
from optimum_qwen35.kernels.gated_delta_rule import (
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
    recurrent_gated_delta_rule_step,
)


def random_inputs(B, T, nk, nv, dk, dv, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, nk, T, dk, generator=g, dtype=dtype), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(B, nk, T, dk, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, nv, T, dv, generator=g, dtype=dtype)
    decay = -torch.rand(B, nv, T, generator=g, dtype=dtype) * 3
    beta = torch.rand(B, nv, T, generator=g, dtype=dtype)
    state = torch.randn(B, nv, dk, dv, generator=g, dtype=dtype) * 0.3
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("T", [1, 2, 3, 63, 64, 65, 130])
@pytest.mark.parametrize("groups, dk, dv", [(1, 16, 16), (2, 16, 32), (3, 32, 16)])
def test_chunked_equals_recurrent(T, groups, dk, dv):
    q, k, v, g, beta, s0 = random_inputs(2, T, 2, 2 * groups, dk, dv)
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, s0)  # float64 in, float64 math
    assert o.shape == (2, 2 * groups, T, dv) and s.shape == (2, 2 * groups, dk, dv)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=1e-10)
    # fp32 inputs: math in fp32, state returned fp32, within fp32 noise of the float64 truth.
    o32, s32 = chunk_gated_delta_rule(*(x.float() for x in (q, k, v, g, beta, s0)))
    assert s32.dtype == torch.float32
    torch.testing.assert_close(o32.double(), o_ref, rtol=0, atol=2e-5)
    torch.testing.assert_close(s32.double(), s_ref, rtol=0, atol=2e-5)


def test_padding_leaves_the_state_where_the_prompt_ended():
    q, k, v, g, beta, s0 = random_inputs(3, 100, 2, 4, 16, 16)
    lengths = torch.tensor([100, 37, 1])
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, s0, lengths)
    for b, L in enumerate(lengths.tolist()):
        sl = slice(b, b + 1)
        o_b, s_b = recurrent_gated_delta_rule(
            q[sl, :, :L], k[sl, :, :L], v[sl, :, :L], g[sl, :, :L], beta[sl, :, :L], s0[sl]
        )
        torch.testing.assert_close(s[sl], s_b, rtol=0, atol=1e-10)
        torch.testing.assert_close(o[sl, :, :L], o_b, rtol=0, atol=1e-10)


def test_step_is_one_token_of_the_recurrence():
    q, k, v, g, beta, s0 = random_inputs(2, 1, 2, 6, 16, 8)
    o, s = recurrent_gated_delta_rule_step(q, k, v, g, beta, s0)
    o_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, s0)
    torch.testing.assert_close(o, o_c, rtol=0, atol=1e-12)
    torch.testing.assert_close(s, s_c, rtol=0, atol=1e-12)


def test_step_matches_the_rule_written_out():
    """Independent check of the recurrence itself on one head: S = e^g S; S += k (beta (v - S^T k))^T; o = S^T q."""
    q, k, v, g, beta, s0 = random_inputs(1, 1, 1, 1, 4, 3)
    S = s0[0, 0] * g[0, 0, 0].exp()
    S = S + torch.outer(k[0, 0, 0], beta[0, 0, 0] * (v[0, 0, 0] - S.T @ k[0, 0, 0]))
    o, s = recurrent_gated_delta_rule_step(q, k, v, g, beta, s0)
    torch.testing.assert_close(s[0, 0], S)
    torch.testing.assert_close(o[0, 0, 0], S.T @ q[0, 0, 0])


def conv_reference(x, weight, state):
    """transformers' formulation: F.conv1d over [state | x] with groups = channels, then SiLU."""
    full = torch.cat([state, x], dim=-1)
    y = F.conv1d(full, weight[:, None, :], groups=x.shape[1])
    return F.silu(y)


@pytest.mark.parametrize("T", [1, 2, 3, 4, 17])
def test_conv_whole_sequence_and_steps(T):
    g = torch.Generator().manual_seed(T)
    B, C, K = 2, 12, 4
    x = torch.randn(B, C, T, generator=g, dtype=torch.float64)
    w = torch.randn(C, K, generator=g, dtype=torch.float64)
    s0 = torch.randn(B, C, K - 1, generator=g, dtype=torch.float64)
    y, s = causal_conv1d(x, w, s0)
    torch.testing.assert_close(y, conv_reference(x, w, s0))
    torch.testing.assert_close(s, torch.cat([s0, x], -1)[:, :, -(K - 1) :])
    state = s0
    for t in range(T):
        y_t, state = causal_conv1d_step(x[:, :, t], w, state)
        torch.testing.assert_close(y_t, y[:, :, t])
    torch.testing.assert_close(state, s)


def test_conv_state_of_short_and_padded_prompts():
    """Prompts of 1 to 3 tokens (shorter than the kernel) keep the right columns; padding never enters."""
    B, C, K, T = 4, 5, 4, 8
    x = torch.randn(B, C, T, dtype=torch.float64)
    w = torch.randn(C, K, dtype=torch.float64)
    lengths = torch.tensor([1, 2, 3, 8])
    _, s = causal_conv1d(x, w, None, lengths)
    for b, L in enumerate(lengths.tolist()):
        expected = torch.cat([torch.zeros(C, K - 1, dtype=x.dtype), x[b, :, :L]], -1)[:, -(K - 1) :]
        torch.testing.assert_close(s[b], expected)


def test_dispatch_point():
    assert kernels.get_backend() == "torch"
    with pytest.raises(ValueError, match="unknown kernel backend 'nki-missing'"):
        kernels.set_backend("nki-missing")
    with pytest.raises(ValueError, match="unknown kernel entry points"):
        kernels.register_backend("bad", {"flash": lambda: None})
    calls = []

    def traced_conv_step(x, w, s):
        calls.append(x.shape)
        return causal_conv1d_step(x, w, s)

    kernels.register_backend("probe", {"causal_conv1d_step": traced_conv_step})
    try:
        kernels.set_backend("probe")
        x, w, s = torch.randn(1, 3), torch.randn(3, 4), torch.zeros(1, 3, 3)
        kernels.causal_conv1d_step(x, w, s)
        kernels.causal_conv1d(x[:, :, None], w)  # not overridden: falls back to the reference
        assert calls == [(1, 3)]
    finally:
        kernels.set_backend("torch")


def test_dispatch_functions_are_not_shadowed_by_modules():
    """`kernels.causal_conv1d` is the dispatched function; no module of that name can replace it on import."""
    import importlib.util

    from optimum_qwen35 import kernels

    for name in ("causal_conv1d", "causal_conv1d_step", "chunk_gated_delta_rule", "recurrent_gated_delta_rule_step"):
        assert importlib.util.find_spec(f"optimum_qwen35.kernels.{name}") is None, name
        assert callable(getattr(kernels, name)) and not isinstance(getattr(kernels, name), type(kernels)), name
