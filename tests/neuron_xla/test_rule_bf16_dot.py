"""The chunked rule's bf16 products on the XLA device: each is one dot with bf16 operands and an f32 result in the
lowered HLO (TensorE's bf16 x bf16 -> fp32 PSUM), equal to the CPU rule's numbers; an fp32 rule has no bf16 dot."""

import re

import torch
import torch_xla
import torch_xla.core.xla_model as xm

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


def test_bf16_products_lower_to_bf16_dots_with_f32_results():
    device = xm.xla_device()
    args = rule_inputs()
    o_cpu, s_cpu = chunk_gated_delta_rule(*args, matmul_dtype=torch.bfloat16)
    o, s = chunk_gated_delta_rule(*(x.to(device) for x in args), matmul_dtype=torch.bfloat16)
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([o, s])
    found = dots(hlo)
    assert ("f32", "bf16", "bf16") in found, found
    assert not any(r == "bf16" for r, _, _ in found), found  # never a bf16 result (that would round the sum)
    assert any(lhs == rhs == "f32" for _, lhs, rhs in found)  # u / w and the state update stay fp32
    assert torch.allclose(o.cpu(), o_cpu, rtol=0, atol=1e-5) and torch.allclose(s.cpu(), s_cpu, rtol=0, atol=1e-5)
    assert "QKt" in BF16_PRODUCTS


def test_an_fp32_rule_has_no_bf16_dot():
    device = xm.xla_device()
    o, s = chunk_gated_delta_rule(*(x.to(device) for x in rule_inputs()))
    found = dots(torch_xla._XLAC._get_xla_tensors_hlo([o, s]))
    assert found and all(lhs == rhs == "f32" for _, lhs, rhs in found), found
