"""bf16 operands in the chunked DeltaNet rule (kernels/gated_delta_rule/reference.py, `BF16_PRODUCTS`): in a bf16
model the prefill seam gives the rule's w S product bf16 operands with fp32 accumulation, and no other product; an
fp32 model rounds nothing. Environment-free: torch and the package only."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from optimum_qwen35.kernels.gated_delta_rule import fused, reference
from optimum_qwen35.kernels.gated_delta_rule.reference import (
    chunk_gated_delta_rule,
    invert_unit_lower,
    low_matmul,
    recurrent_gated_delta_rule,
)


class Casts(TorchDispatchMode):
    """The target dtype of every dtype conversion."""

    def __init__(self):
        super().__init__()
        self.to = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout):
            self.to.append(out.dtype)
        return out


def seam_inputs(dtype, B=2, nk=2, nv=4, T=150, dk=32, dv=16, seed=0):
    """The prefill seam's inputs: T = 150 makes 3 chunks (the last padded), a row shorter than the others."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, nk, T, dk, generator=gen) for _ in range(2))
    v = torch.randn(B, nv, T, dv, generator=gen)
    a, b = (torch.randn(B, T, nv, generator=gen) for _ in range(2))
    A_log, dt_bias = torch.rand(nv, generator=gen) * 2, torch.randn(nv, generator=gen)
    state = torch.randn(B, nv, dk, dv, generator=gen) * 0.1
    lengths = torch.tensor([T, T - 37])
    return [x.to(dtype) for x in (q, k, v, a, b)] + [A_log, dt_bias, state, lengths]


def rule_inputs(args):
    """What the seam hands the rule: q, k, v upcast and normalized, the gates, the state and lengths."""
    q, k, v, a, b, A_log, dt_bias, state, lengths = args
    qn = fused.l2norm(q.float()) * q.shape[-1] ** -0.5
    kn = fused.l2norm(k.float())
    g, beta = fused.gates(a, b, A_log, dt_bias)
    return qn, kn, v.float(), g.transpose(1, 2), beta.transpose(1, 2), state, lengths


def w_s_rounded_by_hand(q, k, v, g, beta, state, lengths, C=reference.CHUNK_SIZE):
    """The chunked rule written out with only w and S rounded to bf16 before their product (fp32 accumulation): what
    `BF16_PRODUCTS = {"wS"}` must compute. Same operations as the rule otherwise, so the comparison is exact."""
    B, nv, T, dv = v.shape
    dk = q.shape[-1]
    q, k = reference.expand_key_heads(q, nv), reference.expand_key_heads(k, nv)
    g, beta = reference.mask_padding(g, beta, lengths)
    pad = (-T) % C
    q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
    N = (T + pad) // C
    BH, M = B * nv, B * nv * N
    q, k, v = (x.reshape(M, C, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(M, C) for x in (g, beta))
    gc = g.cumsum(-1)
    causal = torch.ones(C, C, dtype=torch.bool).tril()
    decay = torch.where(causal, gc[:, :, None] - gc[:, None, :], torch.tensor(float("-inf"))).exp()
    k_beta = k * beta[:, :, None]
    A = torch.bmm(k_beta, k.transpose(1, 2)) * decay
    uw = torch.bmm(invert_unit_lower(A), torch.cat([v * beta[:, :, None], k_beta * gc.exp()[:, :, None]], dim=-1))
    u, w = uw[:, :, :dv], uw[:, :, dv:]
    q_decayed = q * gc.exp()[:, :, None]
    k_to_end = (k * (gc[:, -1:] - gc).exp()[:, :, None]).transpose(1, 2)
    chunk_decay = gc[:, -1].exp()[:, None, None]
    intra = torch.bmm(q, k.transpose(1, 2)) * decay
    S = state.float().reshape(BH, dk, dv)
    bf = lambda x: x.to(torch.bfloat16).float()  # noqa: E731
    v_new, q_state = [], []
    for u_n, w_n, q_n, k_n, d_n in zip(*(x.reshape(BH, N, *x.shape[1:]).unbind(1)
                                          for x in (u, w, q_decayed, k_to_end, chunk_decay))):
        v_n = u_n - torch.bmm(bf(w_n), bf(S))
        q_state.append(torch.bmm(q_n, S))
        S = torch.baddbmm(S * d_n, k_n, v_n)
        v_new.append(v_n)
    v_new = torch.cat(v_new, dim=1).reshape(M, C, dv)
    o = torch.cat(q_state, dim=1) + torch.bmm(intra, v_new).reshape(BH, N * C, dv)
    return o.reshape(B, nv, N * C, dv)[:, :, :T], S.reshape(B, nv, dk, dv)


def test_the_default_is_w_s_only():
    assert reference.BF16_PRODUCTS == {"wS"}
    assert reference.BF16_PRODUCTS <= reference.PRODUCTS


def test_a_bf16_seam_rounds_the_operands_of_w_s_and_nothing_else():
    """The bf16 seam equals, bit for bit, the rule with w and S rounded to bf16 before their product and every other
    product (K K^T, the solve, (Q e^g) S, Q K^T, u / w, attention-times-v', the state update) in fp32."""
    args = seam_inputs(torch.bfloat16)
    with Casts() as casts:
        o, s = fused.deltanet_prefill_reference(*args)
    assert torch.bfloat16 in casts.to
    want_o, want_s = w_s_rounded_by_hand(*rule_inputs(args))
    assert o.dtype == s.dtype == torch.float32  # the seam hands the rule fp32 values; the state stays fp32
    assert torch.equal(o, want_o) and torch.equal(s, want_s)
    # and it is not the all-fp32 rule (so the comparison above can tell the two apart)
    plain_o, _ = chunk_gated_delta_rule(*rule_inputs(args))
    assert not torch.equal(o, plain_o)


def test_an_fp32_model_never_rounds():
    """The fp32 seam converts nothing to a 16-bit type and equals the rule without matmul_dtype, bit for bit."""
    args = seam_inputs(torch.float32)
    with Casts() as casts:
        o, s = fused.deltanet_prefill_reference(*args)
    assert not {torch.bfloat16, torch.float16} & set(casts.to), casts.to
    plain_o, plain_s = chunk_gated_delta_rule(*rule_inputs(args))
    assert torch.equal(o, plain_o) and torch.equal(s, plain_s)
    # matmul_dtype equal to the compute dtype is no rounding either
    same_o, same_s = chunk_gated_delta_rule(*rule_inputs(args), matmul_dtype=torch.float32)
    assert torch.equal(same_o, plain_o) and torch.equal(same_s, plain_s)


@pytest.mark.parametrize("name", sorted(reference.PRODUCTS - {"wS"}))
def test_each_other_product_is_a_separate_switch(name, monkeypatch):
    """Naming another product in BF16_PRODUCTS changes the numbers (the switch exists and is read on every call);
    the default leaves it fp32, which the bit-for-bit test above shows."""
    rule = rule_inputs(seam_inputs(torch.float32))
    default = chunk_gated_delta_rule(*rule, matmul_dtype=torch.bfloat16)
    monkeypatch.setattr(reference, "BF16_PRODUCTS", frozenset({"wS", name}))
    more = chunk_gated_delta_rule(*rule, matmul_dtype=torch.bfloat16)
    assert not torch.equal(more[0], default[0])


def test_an_unknown_product_name_is_refused(monkeypatch):
    monkeypatch.setattr(reference, "BF16_PRODUCTS", frozenset({"wS", "state_update"}))
    with pytest.raises(ValueError, match="state_update"):
        chunk_gated_delta_rule(*rule_inputs(seam_inputs(torch.float32)), matmul_dtype=torch.bfloat16)


def test_another_backends_rule_gets_the_seven_tensors_only():
    """A replaced rule (e.g. the recurrent one) is called as before: no matmul_dtype keyword."""
    args = seam_inputs(torch.bfloat16)
    o, s = fused.deltanet_prefill_reference(*args, chunk_rule=recurrent_gated_delta_rule)
    want_o, want_s = recurrent_gated_delta_rule(*rule_inputs(args))
    assert torch.equal(o, want_o) and torch.equal(s, want_s)


def test_low_matmul_is_bf16_operands_with_fp32_accumulation():
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(3, 64, 128, generator=gen), torch.randn(3, 128, 96, generator=gen)
    got = low_matmul(a, b, torch.bfloat16)
    exact = a.bfloat16().double() @ b.bfloat16().double()  # the rounded operands' products, summed exactly
    assert got.dtype == torch.float32
    assert (got.double() - exact).abs().max() < 1e-5 * exact.abs().max()  # fp32 accumulation
    # a bf16 result (bf16 accumulation or rounding) would be ~2^-9 of the values away
    assert (torch.bmm(a.bfloat16(), b.bfloat16()).double() - exact).abs().max() > 1e-3 * exact.abs().max()
    assert torch.equal(low_matmul(a, b, None), torch.bmm(a, b)) and torch.equal(low_matmul(a, b, torch.float32), a @ b)


def test_w_s_in_bf16_keeps_the_rule_at_fp32_accuracy():
    """2B head sizes (dk = dv = 128), 512 tokens, slow decay (the state carries across chunks), against the float64
    recurrent rule (max abs error / max abs value). Measured here, fp32 products -> w S in bf16: o 7.6e-7 -> 9.5e-5,
    S 5.6e-7 -> 5.6e-7; the output stays 40x under bf16's unit roundoff (2^-8 = 3.9e-3), the carried state at fp32's."""
    gen = torch.Generator().manual_seed(2)
    B, nv, T, d = 1, 2, 512, 128
    q = torch.nn.functional.normalize(torch.randn(B, nv, T, d, generator=gen), dim=-1) * d**-0.5
    k = torch.nn.functional.normalize(torch.randn(B, nv, T, d, generator=gen), dim=-1)
    v = torch.randn(B, nv, T, d, generator=gen)
    beta = torch.sigmoid(torch.randn(B, nv, T, generator=gen))
    g = -0.5 * torch.nn.functional.softplus(torch.randn(B, nv, T, generator=gen))
    o64, s64 = recurrent_gated_delta_rule(q.double(), k.double(), v.double(), g.double(), beta.double())

    def errors(o, s):
        return (((o.double() - o64).abs().max() / o64.abs().max()).item(),
                ((s.double() - s64).abs().max() / s64.abs().max()).item())

    fp32_o, fp32_s = errors(*chunk_gated_delta_rule(q, k, v, g, beta))
    low_o, low_s = errors(*chunk_gated_delta_rule(q, k, v, g, beta, matmul_dtype=torch.bfloat16))
    print(f"\nw S in bf16: o {fp32_o:.1e} -> {low_o:.1e}, S {fp32_s:.1e} -> {low_s:.1e}")
    assert low_o < 2**-8 / 10 and low_s < 1e-5, (low_o, low_s)
