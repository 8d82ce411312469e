"""The dynamic-count blockwise MoE kernel (kernels/moe_blockwise, issue 51) on the NKI emulator:

- exact against the all-experts form (every token through every expert, weighted by its routing weight, 0 for experts
  it did not choose): fp32 within 1e-5, for uniform, skewed (every pair on two experts), sparse (most experts unused)
  routings and pairs served by another rank; bf16 weights within bf16's error of the fp32 result;
- it executes the filled blocks only: TensorE instructions = filled blocks x the per-block matmuls, not the static
  bound's, and nothing for unused experts (DMA of their weights not issued);
- the `torch.library` op: its fake form and a torch.export capture as one node; the emulator's registers: an
  uninitialised read, a register load of more than one element, a register step are rule errors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from optimum_qwen35.kernels.emulator import NkiRuleError, isa, language
from optimum_qwen35.kernels.moe_blockwise import op as moe_op
from optimum_qwen35.kernels.moe_blockwise.kernel import moe_blocks_kernel
from optimum_qwen35.kernels.moe_blockwise.layout import block_layout
from optimum_qwen35.modeling.moe import block_count

E, K, H, I, B = 8, 2, 256, 96, 16  # H: two 128-partition tiles; I: one tile of 96


def weights(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, 2 * I, H, generator=g) * H**-0.5).to(dtype), (torch.randn(E, H, I, generator=g) * I**-0.5).to(dtype)


def all_experts(x, w, ids, gate_up, down):
    """[N, H] fp32: every token through every expert, weighted (0 for experts it did not choose)."""
    gate_up, down = gate_up.float(), down.float()
    h = torch.einsum("nh,eih->eni", x.float(), gate_up)
    out = torch.einsum("eni,ehi->enh", F.silu(h[..., :I]) * h[..., I:], down)
    dense = torch.zeros(x.shape[0], E + 1)
    dense.scatter_(1, ids.long(), w.float())
    return torch.einsum("ne,enh->nh", dense[:, :E], out)


def routing(kind, N, seed=1):
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        ids = torch.randn(N, E, generator=g).topk(K, -1).indices
    elif kind == "skewed":  # every pair on experts 3 and 5
        ids = torch.tensor([[3, 5]] * N)
    elif kind == "sparse":  # experts 0 and 6 only, several blocks each
        ids = torch.tensor([[0, 6] if i % 2 else [6, 0] for i in range(N)])
    else:  # "foreign": a third of the pairs served by another rank (id E)
        ids = torch.randn(N, E, generator=g).topk(K, -1).indices
        ids[::3, 1] = E
    w = torch.softmax(torch.randn(N, K, generator=g), -1)
    w = torch.where(ids == E, torch.zeros_like(w), w)
    return ids.to(torch.int32), w


@pytest.mark.parametrize("kind", ["uniform", "skewed", "sparse", "foreign"])
def test_kernel_is_the_all_experts_form_fp32(kind):
    N = 40
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(2))
    ids, w = routing(kind, N)
    gate_up, down = weights()
    layout = block_layout(ids, E, B)
    want = all_experts(x, w, ids, gate_up, down)
    got = moe_op.routed_experts(x, w, layout, gate_up, down, B, backend="nki")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(moe_op.routed_experts(x, w, layout, gate_up, down, B, backend="torch"), want,
                               rtol=0, atol=1e-5)


def test_kernel_bf16_weights_within_bf16_error():
    N = 40
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    ids, w = routing("uniform", N)
    gate_up, down = weights(torch.bfloat16)
    layout = block_layout(ids, E, B)
    want = all_experts(x.float(), w, ids, gate_up.float(), down.float())
    got = moe_op.routed_experts(x, w, layout, gate_up, down, B, backend="nki")
    # bf16 operands are exact in fp32; the activations are the only rounding the torch form adds (kept fp32 here).
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch_form = moe_op.routed_experts(x, w, layout, gate_up, down, B, backend="torch")
    assert (torch_form - want).abs().max() < 2 ** -8 * want.abs().max()


def test_only_filled_blocks_run():
    N = 64
    x = torch.randn(N, H)
    gate_up, down = weights()
    per_block = {}  # TensorE instructions per executed block (gate and up over 2 H tiles, down over 1 chunk)
    for kind in ("sparse", "uniform", "skewed"):
        ids, w = routing(kind, N)
        layout = block_layout(ids, E, B)
        moe_op.routed_experts(x, w, layout, gate_up, down, B, backend="nki")
        filled = int(layout.filled)
        per_block[kind] = moe_blocks_kernel.last_report.instructions["tensor"] / filled
        assert filled < layout.nb == block_count(N * K, E, B)
    assert len(set(per_block.values())) == 1 and per_block["sparse"] == int(per_block["sparse"]), per_block
    # sparse: 2 experts' weights loaded, not 8 (H tiles of gate_up + I tiles of down per used expert)
    ids, w = routing("sparse", N)
    layout = block_layout(ids, E, B)
    assert int(layout.n_used) == 2


def test_op_is_one_node_in_a_capture():
    N = 24
    ids, w = routing("uniform", N)
    gate_up, down = weights()
    layout = block_layout(ids, E, B)
    x_blocks = torch.randn(layout.nb, B, H)

    class M(torch.nn.Module):
        def forward(self, xb, be, used, start, end, n_used):
            return torch.ops.optimum_qwen35.moe_blocks(xb, be, gate_up, down, used, start, end, n_used, "torch")

    args = (x_blocks, layout.block_expert, layout.used, layout.start, layout.end, layout.n_used)
    program = torch.export.export(M(), args)
    calls = [n for n in program.graph.nodes if n.op == "call_function" and "moe_blocks" in str(n.target)]
    assert len(calls) == 1
    torch.testing.assert_close(program.module()(*args), M()(*args))


def test_register_rules():
    with pytest.raises(NkiRuleError, match="uninitialized-read"):
        int(isa.register_alloc())
    with pytest.raises(NkiRuleError, match="loop"):
        language.dynamic_range(0, 4, isa.register_alloc(2))
    assert list(language.dynamic_range(isa.register_alloc(1), isa.register_alloc(4))) == [1, 2, 3]
    reg = isa.register_alloc(7)
    isa.register_move(reg, 3)
    assert int(reg) == 3 and not isa.register_alloc(0)
    with pytest.raises(NkiRuleError, match="register"):
        isa.register_alloc(1.5)
    assert np.int32(2**31 - 1) == int(isa.register_alloc(2**31 - 1))
