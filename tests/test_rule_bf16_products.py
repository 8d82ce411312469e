"""bf16 products in the chunked DeltaNet rule (kernels/gated_delta_rule/reference.py, `BF16_PRODUCTS`): a bf16 model's
prefill seam gives the rule bf16 operands for those products only; an fp32 model never rounds anything."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from optimum_qwen35.kernels.gated_delta_rule import fused, reference
from optimum_qwen35.kernels.gated_delta_rule.reference import (
    BF16_PRODUCTS,
    chunk_gated_delta_rule,
    low_matmul,
    recurrent_gated_delta_rule,
)


class Casts(TorchDispatchMode):
    """The target dtypes of every dtype conversion."""

    def __init__(self):
        super().__init__()
        self.to = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout):
            self.to.append(out.dtype)
        return out


def seam_inputs(dtype, B=2, nk=2, nv=4, T=150, dk=32, dv=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, nk, T, dk, generator=gen) for _ in range(2))
    v = torch.randn(B, nv, T, dv, generator=gen)
    a, b = (torch.randn(B, T, nv, generator=gen) for _ in range(2))
    A_log, dt_bias = torch.rand(nv, generator=gen) * 2, torch.randn(nv, generator=gen)
    state = torch.randn(B, nv, dk, dv, generator=gen) * 0.1
    lengths = torch.tensor([T, T - 37])
    return [x.to(dtype) for x in (q, k, v, a, b)] + [A_log, dt_bias, state, lengths]


def test_an_fp32_model_never_rounds():
    """The fp32 seam converts nothing to bf16 (or any 16-bit type) and equals the rule without matmul_dtype."""
    args = seam_inputs(torch.float32)
    with Casts() as casts:
        o, s = fused.deltanet_prefill_reference(*args)
    assert not {torch.bfloat16, torch.float16} & set(casts.to), casts.to
    # bf16 products would change it (so the comparison below can tell)
    q, k, v, a, b, A_log, dt_bias, state, lengths = args
    qn = fused.l2norm(q) * q.shape[-1] ** -0.5
    kn = fused.l2norm(k)
    g, beta = fused.gates(a, b, A_log, dt_bias)
    plain = chunk_gated_delta_rule(qn, kn, v, g.transpose(1, 2), beta.transpose(1, 2), state, lengths)
    low = chunk_gated_delta_rule(qn, kn, v, g.transpose(1, 2), beta.transpose(1, 2), state, lengths,
                                 matmul_dtype=torch.bfloat16)
    assert torch.equal(o, plain[0]) and torch.equal(s, plain[1])
    assert not torch.equal(o, low[0])


def test_a_bf16_seam_gives_the_rule_bf16_products():
    args = seam_inputs(torch.bfloat16)
    with Casts() as casts:
        o, s = fused.deltanet_prefill_reference(*args)
    assert torch.bfloat16 in casts.to
    q, k, v, a, b, A_log, dt_bias, state, lengths = args
    up = [x.float() for x in (q, k, v)]
    qn = fused.l2norm(up[0]) * q.shape[-1] ** -0.5
    kn = fused.l2norm(up[1])
    g, beta = fused.gates(a, b, A_log, dt_bias)
    rule = (qn, kn, up[2], g.transpose(1, 2), beta.transpose(1, 2), state, lengths)
    low = chunk_gated_delta_rule(*rule, matmul_dtype=torch.bfloat16)
    fp32 = chunk_gated_delta_rule(*rule)
    assert torch.equal(o, low[0]) and torch.equal(s, low[1])
    assert o.dtype == s.dtype == torch.float32
    assert not torch.equal(o, fp32[0])


def test_low_matmul_is_bf16_operands_with_fp32_accumulation():
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(3, 64, 128, generator=gen), torch.randn(3, 128, 96, generator=gen)
    got = low_matmul(a, b, torch.bfloat16)
    exact = a.bfloat16().double() @ b.bfloat16().double()  # the products of the rounded operands, summed exactly
    assert got.dtype == torch.float32
    assert (got.double() - exact).abs().max() < 1e-4 * exact.abs().max()  # fp32 accumulation
    # bf16 accumulation (a bf16 result) would be ~2^-9 of the values away
    assert (torch.bmm(a.bfloat16(), b.bfloat16()).double() - exact).abs().max() > 1e-3 * exact.abs().max()
    assert torch.equal(low_matmul(a, b, None), a @ b) and torch.equal(low_matmul(a, b, torch.float32), a @ b)


def test_bf16_products_keep_the_state_at_fp32_accuracy():
    """2B head sizes (dk = dv = 128), 512 tokens, chunk 64, against the float64 recurrent rule. The products that feed
    the carried state (u / w = T (...), the state update) stay fp32: the state's error stays an order under bf16's
    unit roundoff (measured 1.2e-4 at this decay; u / w or the state update in bf16 as well: 2.5e-3 / 3.9e-3, written
    out with benchmarks/deltanet_bf16_products.py's rule); the output's error under two bf16 roundings (measured
    3.0e-3; with (Q K^T decay) v' in bf16 too: 5.0e-3)."""
    assert {"KKt", "solve", "wS", "QS"} <= BF16_PRODUCTS
    gen = torch.Generator().manual_seed(2)
    B, nv, T, d = 1, 2, 512, 128
    q = torch.nn.functional.normalize(torch.randn(B, nv, T, d, generator=gen), dim=-1) * d**-0.5
    k = torch.nn.functional.normalize(torch.randn(B, nv, T, d, generator=gen), dim=-1)
    v = torch.randn(B, nv, T, d, generator=gen)
    beta = torch.sigmoid(torch.randn(B, nv, T, generator=gen))
    g = -0.5 * torch.nn.functional.softplus(torch.randn(B, nv, T, generator=gen))  # slow decay: the state carries
    o64, s64 = recurrent_gated_delta_rule(q.double(), k.double(), v.double(), g.double(), beta.double())
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, matmul_dtype=torch.bfloat16)
    err_o = ((o.double() - o64).abs().max() / o64.abs().max()).item()
    err_s = ((s.double() - s64).abs().max() / s64.abs().max()).item()
    assert err_s < 5e-4, err_s
    assert err_o < 2**-8, err_o
    o32, s32 = chunk_gated_delta_rule(q, k, v, g, beta)
    assert not torch.equal(o, o32)


def test_the_product_names_are_the_rules():
    assert BF16_PRODUCTS <= {"KKt", "solve", "wS", "QS", "QKt", "attn_v"}
    assert reference.BF16_PRODUCTS is BF16_PRODUCTS
