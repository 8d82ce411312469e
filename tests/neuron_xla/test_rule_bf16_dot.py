"""The chunked rule's bf16 product on the XLA device: w S lowers to dots with bf16 operands and an f32 result
(TensorE's bf16 x bf16 -> fp32 PSUM), one per chunk, equal to the CPU rule's numbers; every other dot stays f32 x f32;
an fp32 rule has no bf16 dot."""

import re

import torch
import torch_xla

from optimum_qwen35.kernels.gated_delta_rule.reference import BF16_PRODUCTS, chunk_gated_delta_rule


def rule_inputs(B=1, nv=2, T=128, d=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, nv, T, d, generator=gen), dim=-1) * d**-0.5
    k = torch.nn.functional.normalize(torch.randn(B, nv, T, d, generator=gen), dim=-1)
    v = torch.randn(B, nv, T, d, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(B, nv, T, generator=gen))
    beta = torch.sigmoid(torch.randn(B, nv, T, generator=gen))
    return q, k, v, g, beta


def dots(hlo: str) -> list[tuple[str, str, str]]:
    """(result, lhs, rhs) element types of every dot in an HLO text (`%d = f32[..] dot(bf16[..] %a, bf16[..] %b)`)."""
    return re.findall(r"= (\w+)\[[^\]]*\]\S* dot\((\w+)\[[^\]]*\]\S* %[\w.\-]+, (\w+)\[", hlo)


def test_w_s_lowers_to_bf16_dots_with_f32_results():
    assert BF16_PRODUCTS == {"wS"}
    device = torch_xla.device()
    args = rule_inputs()  # 128 tokens: 2 chunks of 64
    o_cpu, s_cpu = chunk_gated_delta_rule(*args, matmul_dtype=torch.bfloat16)
    o, s = chunk_gated_delta_rule(*(x.to(device) for x in args), matmul_dtype=torch.bfloat16)
    found = dots(torch_xla._XLAC._get_xla_tensors_hlo([o, s]))
    low = [d for d in found if d[1:] == ("bf16", "bf16")]
    assert low == [("f32", "bf16", "bf16")] * 2, found  # w S of each chunk, summed in f32, never a bf16 result
    assert all(lhs == rhs == "f32" for _, lhs, rhs in set(found) - set(low)), found
    assert torch.allclose(o.cpu(), o_cpu, rtol=0, atol=1e-5) and torch.allclose(s.cpu(), s_cpu, rtol=0, atol=1e-5)


def test_an_fp32_rule_has_no_bf16_dot():
    device = torch_xla.device()
    o, s = chunk_gated_delta_rule(*(x.to(device) for x in rule_inputs()))
    found = dots(torch_xla._XLAC._get_xla_tensors_hlo([o, s]))
    assert found and all(lhs == rhs == "f32" for _, lhs, rhs in found), found
