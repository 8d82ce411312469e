"""The token-by-token reference itself (`recurrent_gated_delta_rule`, the ground truth of the chunked form and the
NKI kernels) and the conv1d reference, against the equations written out with Python loops, head by head.

tests/test_kernels_reference.py checks the chunked form against the recurrence, so a bug shared by both (or in the
recurrence alone, in paths the comparison does not take: no initial state, padding by `lengths`, value heads
sharing key heads) would pass there."""

import torch
import torch.nn.functional as F

from optimum_qwen35.kernels.conv1d.reference import causal_conv1d, causal_conv1d_step
from optimum_qwen35.kernels.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule


def inputs(B=2, nk=2, nv=6, T=7, dk=5, dv=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, nk, T, dk, generator=g, dtype=torch.float64)
    k = F.normalize(torch.randn(B, nk, T, dk, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(B, nv, T, dv, generator=g, dtype=torch.float64)
    decay = -2 * torch.rand(B, nv, T, generator=g, dtype=torch.float64)
    beta = torch.rand(B, nv, T, generator=g, dtype=torch.float64)
    return q, k, v, decay, beta


def written_out(q, k, v, decay, beta, lengths, state=None):
    """Per batch row b and value head h (reading key head h // (nv / nk)), tokens t < lengths[b] only:
    S = e^g S; S += k (beta (v - S^T k))^T; o = S^T q. Outputs past the length are not defined (not compared)."""
    B, nk, T, dk = q.shape
    nv, dv = v.shape[1], v.shape[-1]
    o = torch.zeros(B, nv, T, dv, dtype=torch.float64)
    final = torch.zeros(B, nv, dk, dv, dtype=torch.float64)
    for b in range(B):
        for h in range(nv):
            j = h // (nv // nk)
            S = torch.zeros(dk, dv, dtype=torch.float64) if state is None else state[b, h].clone()
            for t in range(int(lengths[b])):
                S = decay[b, h, t].exp() * S
                S = S + torch.outer(k[b, j, t], beta[b, h, t] * (v[b, h, t] - S.T @ k[b, j, t]))
                o[b, h, t] = S.T @ q[b, j, t]
            final[b, h] = S
    return o, final


def test_recurrence_and_chunked_form_from_zero_state_with_padding():
    q, k, v, decay, beta = inputs()
    lengths = torch.tensor([7, 4])
    want_o, want_s = written_out(q, k, v, decay, beta, lengths)
    for rule in (recurrent_gated_delta_rule, chunk_gated_delta_rule):
        o, s = rule(q, k, v, decay, beta, None, lengths)
        assert o.shape == (2, 6, 7, 3) and s.shape == (2, 6, 5, 3) and s.dtype == torch.float64
        torch.testing.assert_close(s, want_s, rtol=0, atol=1e-12)
        for b, n in enumerate(lengths.tolist()):
            torch.testing.assert_close(o[b, :, :n], want_o[b, :, :n], rtol=0, atol=1e-12)


def test_recurrence_from_a_given_state_keeps_fp32_in_fp32():
    q, k, v, decay, beta = inputs(seed=1)
    state = torch.randn(2, 6, 5, 3, dtype=torch.float64)
    want_o, want_s = written_out(q, k, v, decay, beta, [7, 7], state)
    o, s = recurrent_gated_delta_rule(q, k, v, decay, beta, state)
    torch.testing.assert_close(o, want_o, rtol=0, atol=1e-12)
    torch.testing.assert_close(s, want_s, rtol=0, atol=1e-12)
    o32, s32 = recurrent_gated_delta_rule(*(x.float() for x in (q, k, v, decay, beta)), state.float())
    assert o32.dtype == s32.dtype == torch.float32
    torch.testing.assert_close(o32.double(), want_o, rtol=0, atol=1e-5)


def test_conv_written_out_with_padding_and_state():
    """y[t] = silu(sum_j w[j] x[t - (K - 1) + j]) over [state | x]; the final state is the K - 1 inputs before the
    end of each row's prompt (reaching into the initial state when the prompt is shorter than K - 1)."""
    g = torch.Generator().manual_seed(2)
    B, C, T, K = 3, 4, 6, 4
    x = torch.randn(B, C, T, generator=g, dtype=torch.float64)
    w = torch.randn(C, K, generator=g, dtype=torch.float64)
    s0 = torch.randn(B, C, K - 1, generator=g, dtype=torch.float64)
    lengths = torch.tensor([6, 2, 1])
    y, final = causal_conv1d(x, w, s0, lengths)
    full = torch.cat([s0, x], dim=-1)
    for b in range(B):
        for t in range(T):
            want = F.silu(sum(w[:, j] * full[b, :, t + j] for j in range(K)))
            torch.testing.assert_close(y[b, :, t], want, rtol=0, atol=1e-12)
        n = int(lengths[b])
        torch.testing.assert_close(final[b], full[b, :, n : n + K - 1], rtol=0, atol=0)
    y0, final0 = causal_conv1d(x, w)  # no state: zeros before the first token; no lengths: the last K - 1 inputs
    torch.testing.assert_close(final0, x[:, :, T - K + 1 :], rtol=0, atol=0)
    torch.testing.assert_close(y0[:, :, 0], F.silu(w[:, -1] * x[:, :, 0]), rtol=0, atol=1e-12)
    # bf16 activations: products summed in fp32, rounded once.
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    yb, _ = causal_conv1d(xb, wb)
    padded = torch.cat([torch.zeros(B, C, K - 1, dtype=torch.float32), xb.float()], dim=-1)
    want = F.silu(sum(wb.float()[None, :, j : j + 1] * padded[:, :, j : j + T] for j in range(K))).to(torch.bfloat16)
    assert yb.dtype == torch.bfloat16 and torch.equal(yb, want)
    stepb, _ = causal_conv1d_step(xb[:, :, 0], wb, torch.zeros(B, C, K - 1, dtype=torch.bfloat16))
    assert stepb.dtype == torch.bfloat16 and torch.equal(stepb, want[:, :, 0])
    step, new_state = causal_conv1d_step(x[:, :, 0], w, s0)
    torch.testing.assert_close(step, y[:, :, 0], rtol=0, atol=1e-12)
    torch.testing.assert_close(new_state, full[:, :, 1:K], rtol=0, atol=0)


def test_math_runs_in_the_widest_input_dtype_and_outputs_keep_their_dtypes():
    """Any one input in float64 makes the whole computation float64 (reference runs); bf16 activations with an fp32
    state compute in fp32 and return o in bf16 and the state in fp32. Compared exactly with the same values widened
    by hand."""
    from optimum_qwen35.kernels.gated_delta_rule import recurrent_gated_delta_rule_step

    q, k, v, decay, beta = (x.float() for x in inputs(T=3, seed=3))
    state = torch.randn(2, 6, 5, 3, dtype=torch.float32)
    base = [q, k, v, decay, beta, state]
    for rule, sl in ((recurrent_gated_delta_rule_step, slice(0, 1)), (chunk_gated_delta_rule, slice(0, 3))):
        cut = [x[:, :, sl] for x in base[:5]] + [state]
        want_o, want_s = rule(*(x.double() for x in cut))
        for i in range(6):
            args = list(cut)
            args[i] = args[i].double()
            o, s = rule(*args)
            assert s.dtype == torch.float64 and o.dtype == args[2].dtype, (rule.__name__, i)
            assert torch.equal(s, want_s), (rule.__name__, i)
            assert torch.equal(o, want_o.to(o.dtype)), (rule.__name__, i)
        low = [x.to(torch.bfloat16) for x in cut[:5]] + [cut[5]]
        o, s = rule(*low)
        want_o, want_s = rule(*(x.float() for x in low))
        assert o.dtype == torch.bfloat16 and s.dtype == torch.float32, rule.__name__
        assert torch.equal(s, want_s) and torch.equal(o, want_o.to(torch.bfloat16)), rule.__name__


def test_conv_keeps_the_activation_dtype():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 4, generator=g).to(torch.bfloat16)
    w = torch.randn(4, 4, generator=g)
    state = torch.randn(2, 4, 3, generator=g)  # fp32 state, bf16 activations
    y, new_state = causal_conv1d_step(x, w, state)
    assert y.dtype == new_state.dtype == torch.bfloat16
    window = torch.cat([state.to(torch.bfloat16), x[:, :, None]], dim=-1)
    assert torch.equal(new_state, window[:, :, 1:])
    assert torch.equal(y, F.silu((window.float() * w).sum(-1)).to(torch.bfloat16))
    # The whole-sequence conv too: an fp32 initial state with bf16 activations gives a bf16 final state.
    xs = torch.randn(2, 4, 5, generator=g).to(torch.bfloat16)
    ys, final = causal_conv1d(xs, w, state, torch.tensor([5, 2]))
    assert ys.dtype == final.dtype == torch.bfloat16
    padded = torch.cat([state.to(torch.bfloat16), xs], dim=-1)
    assert torch.equal(final[0], padded[0, :, 5:8]) and torch.equal(final[1], padded[1, :, 2:5])


def test_fp32_inputs_without_an_initial_state_start_from_zeros():
    q, k, v, decay, beta = (x.float() for x in inputs(seed=5))
    zeros = torch.zeros(2, 6, 5, 3)
    for rule in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        o, s = rule(q, k, v, decay, beta)
        o0, s0 = rule(q, k, v, decay, beta, zeros)
        assert o.dtype == s.dtype == torch.float32, rule.__name__
        assert torch.equal(o, o0) and torch.equal(s, s0), rule.__name__
