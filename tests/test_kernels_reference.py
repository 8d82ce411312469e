"""The PyTorch reference kernels: chunked vs token-by-token gated delta rule, conv1d whole vs step."""

import pytest
import torch
import torch.nn.functional as F

from optimum_qwen35 import kernels
from optimum_qwen35.kernels.conv1d.reference import causal_conv1d, causal_conv1d_step
from optimum_qwen35.kernels.gated_delta_rule import (
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
    recurrent_gated_delta_rule_step,
)
from optimum_qwen35.kernels.gated_delta_rule.reference import invert_unit_lower


def solve_unit_lower(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """X with (I + A) X = B, for strictly lower-triangular A [..., C, C], by row-by-row forward substitution: the
    plain solver (C - 1 dependent steps) the chunked rule used before the blocked `invert_unit_lower`, kept here as
    what the blocked inverse is tested against."""
    X = B.clone()
    for i in range(1, A.shape[-1]):
        X[..., i : i + 1, :] = B[..., i : i + 1, :] - A[..., i : i + 1, :i] @ X[..., :i, :]
    return X


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


# ------------------------------------------------------------------------------------ the blocked triangular solve
def unit_lower_system(kind, M=64, C=64, d=64, seed=0):
    """A (strictly lower, as the chunked rule builds it) and right-hand sides, float64.

    adversarial: identical keys, beta ~ 1, no decay (I + A is as far from the identity as it gets);
    near-identical: keys within a few degrees of each other, beta = 1; ordinary: random keys, beta, decay."""
    g = torch.Generator().manual_seed(seed)
    f64 = dict(generator=g, dtype=torch.float64)
    if kind == "adversarial":
        k = F.normalize(torch.randn(d, **f64), dim=0).expand(M, C, d)
        beta = 1 - 1e-3 * torch.rand(M, C, **f64)
        gc = (-1e-6 * torch.rand(M, C, **f64)).cumsum(-1)
    elif kind == "near-identical":
        k = F.normalize(torch.randn(d, **f64) + 0.05 * torch.randn(M, C, d, **f64), dim=-1)
        beta, gc = torch.ones(M, C, dtype=torch.float64), torch.zeros(M, C, dtype=torch.float64)
    else:
        k = F.normalize(torch.randn(M, C, d, **f64), dim=-1)
        beta = torch.rand(M, C, **f64)
        gc = (-0.5 * torch.rand(M, C, **f64)).cumsum(-1)
    decay = (gc[:, :, None] - gc[:, None, :]).clamp(max=0).exp()
    A = ((k * beta[..., None]) @ k.transpose(1, 2) * decay).tril(-1)
    return A, torch.randn(M, C, 2 * d, **f64)


def test_blocked_inverse_is_exact_in_float64():
    A, rhs = unit_lower_system("ordinary", M=8)
    want = torch.linalg.solve_triangular(torch.eye(64, dtype=torch.float64) + A, rhs, upper=False, unitriangular=True)
    torch.testing.assert_close(invert_unit_lower(A) @ rhs, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(solve_unit_lower(A, rhs), want, rtol=0, atol=1e-12)
    # Only the strict lower triangle is read (the chunked rule passes A with its diagonal and above filled).
    torch.testing.assert_close(invert_unit_lower(A + torch.randn(8, 64, 64, dtype=torch.float64).triu()), invert_unit_lower(A))
    for C, block in [(16, 16), (32, 16), (128, 16), (64, 8)]:  # other chunk sizes and blocks
        A, rhs = unit_lower_system("ordinary", M=4, C=C)
        torch.testing.assert_close(invert_unit_lower(A, block) @ rhs, solve_unit_lower(A, rhs), rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["adversarial", "near-identical", "ordinary"])
def test_blocked_solve_no_less_accurate_than_row_by_row(kind):
    """fp32, against the float64 solution: the blocked inverse + one matmul vs row-by-row substitution.

    Measured (max relative error over 5 seeds, row-by-row / blocked): adversarial 4.2e-7 / 2.2e-7,
    near-identical 4.1e-7 / 3.3e-7, ordinary 9.6e-8 / 9.8e-8 (the same rounding noise)."""
    worst_row = worst_blocked = 0.0
    for seed in range(5):
        A, rhs = unit_lower_system(kind, seed=seed)
        want = torch.linalg.solve_triangular(torch.eye(64, dtype=torch.float64) + A, rhs, upper=False, unitriangular=True)
        scale = want.abs().max()
        row = solve_unit_lower(A.float(), rhs.float()).double()
        blocked = (invert_unit_lower(A.float()) @ rhs.float()).double()
        worst_row = max(worst_row, ((row - want).abs().max() / scale).item())
        worst_blocked = max(worst_blocked, ((blocked - want).abs().max() / scale).item())
    print(f"\n{kind}: max relative error vs float64, row by row {worst_row:.2e}, blocked {worst_blocked:.2e}")
    slack = 1.0 if kind != "ordinary" else 1.1  # ordinary systems: both at fp32 rounding noise
    assert worst_blocked <= worst_row * slack


def test_deltanet_layer_at_4096_tokens_traces_to_few_ops():
    """One 2B-sized DeltaNet layer's context encoding over 4096 tokens, traced op by op (make_fx, on the meta
    device: every aten op, views included). The row-by-row solve and an op-per-token-row chunk loop made
    it ~3,300; the blocked solve and a four-matmul chunk loop make it a few hundred."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from optimum_qwen35.config import LINEAR_ATTENTION, Qwen35Config
    from optimum_qwen35.modeling.deltanet import GatedDeltaNet
    from optimum_qwen35.modeling.parallel import ShardedDims
    from optimum_qwen35.modeling.torch_layers import TorchLayers
    from optimum_qwen35.modeling.state import Slots

    config = Qwen35Config(
        vocab_size=248320, hidden_size=2048, intermediate_size=6144, num_hidden_layers=1, layer_types=(LINEAR_ATTENTION,),
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128,
    )
    dims = ShardedDims.from_config(config)
    with torch.device("meta"):
        mixer = GatedDeltaNet(config, dims, TorchLayers())
        T = 4096
        inputs = (
            torch.zeros(1, T, config.hidden_size), torch.full((1,), T), torch.zeros(1, dtype=torch.int64),
            torch.zeros(1, dims.linear_conv_dim, 3), torch.zeros(1, 16, 128, 128),
        )

    def layer(x, lengths, seq_ids, conv_state, recurrent_state):
        fresh = torch.ones_like(lengths, dtype=torch.bool)  # a fresh prompt
        return mixer.context_encoding(x, lengths, Slots(seq_ids, fresh), conv_state, recurrent_state)

    graph = make_fx(layer)(*inputs).graph
    ops = [n for n in graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]
    print(f"\n4096-token DeltaNet layer: {len(ops)} aten ops")
    assert len(ops) < 800, len(ops)


@pytest.mark.parametrize("size", [48, 96, 40])
def test_blocked_inverse_refuses_a_size_it_cannot_split(size):
    """The blocked inverse needs C = b x 2^k (b = 16): other sizes are refused, not silently mis-merged."""
    with pytest.raises(ValueError):
        invert_unit_lower(torch.zeros(1, size, size), 16)


def test_decode_step_is_the_delta_rule_on_any_state_layout():
    """The step (batched products, in-place rank-1 update) against the rule written out, float64, GQA 2x, on a
    transposed (non-contiguous) state, which it must not modify."""
    from optimum_qwen35.kernels.gated_delta_rule.reference import recurrent_gated_delta_rule_step

    B, nk, nv, dk, dv = 2, 2, 4, 8, 6
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, nk, 1, dk, generator=g, dtype=torch.float64)
    k = F.normalize(torch.randn(B, nk, 1, dk, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(B, nv, 1, dv, generator=g, dtype=torch.float64)
    gate = -torch.rand(B, nv, 1, generator=g, dtype=torch.float64)
    beta = torch.rand(B, nv, 1, generator=g, dtype=torch.float64)
    state = torch.randn(B, nv, dv, dk, generator=g, dtype=torch.float64).transpose(-1, -2)
    before = state.clone()
    o, new_state = recurrent_gated_delta_rule_step(q, k, v, gate, beta, state)
    kh, qh = k.repeat_interleave(nv // nk, 1)[:, :, 0], q.repeat_interleave(nv // nk, 1)[:, :, 0]
    S = state * gate.exp()[..., None]
    delta = (v[:, :, 0] - torch.einsum("bhk,bhkv->bhv", kh, S)) * beta
    S = S + kh[..., None] * delta[:, :, None, :]
    torch.testing.assert_close(new_state, S, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(o[:, :, 0], torch.einsum("bhk,bhkv->bhv", qh, S), rtol=1e-12, atol=1e-12)
    assert o.shape == (B, nv, 1, dv) and torch.equal(state, before)
