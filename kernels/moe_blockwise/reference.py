"""The PyTorch form of the kernel's call (kernel.py), over every block of the static bound: what the cpu target and NxD
compute (`Experts.blocks` of optimum_qwen35/modeling/moe.py), in the weights' layout of the model."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_blocks_reference(x_blocks: torch.Tensor, block_expert: torch.Tensor, gate_up: torch.Tensor,
                         down: torch.Tensor) -> torch.Tensor:
    """x_blocks [nb, B, H], block_expert [nb] int32, gate_up [E, 2I, H], down [E, H, I] -> [nb, B, H] fp32 (operands
    in the weights' dtype, fp32 accumulation as the kernel's PSUM)."""
    I = down.shape[-1]
    acc = torch.float64 if gate_up.dtype == torch.float64 else torch.float32
    h = torch.bmm(x_blocks.to(acc), gate_up.index_select(0, block_expert).transpose(1, 2).to(acc))
    act = (F.silu(h[..., :I]) * h[..., I:]).to(gate_up.dtype)
    return torch.bmm(act.to(acc), down.index_select(0, block_expert).transpose(1, 2).to(acc)).to(acc)
