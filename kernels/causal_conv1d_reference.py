"""Causal depthwise conv1d with SiLU, PyTorch reference: whole sequence (prefill) and one step (decode).

Layout shared by every implementation behind `optimum_qwen35.kernels`:
    x       [B, C, T]       channels first, as the DeltaNet projections are transposed to
    weight  [C, K]          one filter per channel, no bias (Qwen3.5 has none)
    state   [B, C, K - 1]   the last K - 1 inputs before the current one (zeros for a new sequence)
    lengths [B]             tokens >= lengths[b] are padding

Written as K shifted multiply-adds instead of `F.conv1d` so that the same graph traces for Neuron with
an explicit incoming state, and so that prompts shorter than K - 1 take their state columns correctly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (silu(conv(x)) [B, C, T], final_state [B, C, K - 1]).

    The final state holds the K - 1 inputs just before position lengths[b] (reaching back into the
    initial state when a prompt is shorter than K - 1), so padding never enters it.
    """
    B, C, T = x.shape
    K = weight.shape[-1]
    if initial_state is None:
        initial_state = x.new_zeros(B, C, K - 1)
    padded = torch.cat([initial_state.to(x.dtype), x], dim=-1)  # [B, C, K - 1 + T]
    # Accumulate in fp32 whatever the activation dtype: rounding each partial sum to bf16 costs accuracy.
    acc = torch.promote_types(x.dtype, torch.float32)
    w = weight.to(acc)
    y = padded[:, :, 0:T].to(acc) * w[None, :, 0:1]
    for j in range(1, K):
        y = y + padded[:, :, j : j + T].to(acc) * w[None, :, j : j + 1]
    if lengths is None:
        final_state = padded[:, :, T:]
    else:
        index = lengths.to(torch.int64)[:, None, None] + torch.arange(K - 1, device=x.device)  # [B, 1, K-1]
        final_state = torch.gather(padded, 2, index.expand(B, C, K - 1))
    return F.silu(y).to(x.dtype), final_state


def causal_conv1d_step(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step: x [B, C] -> (silu(conv) [B, C], new_state [B, C, K - 1])."""
    window = torch.cat([state.to(x.dtype), x[:, :, None]], dim=-1)  # [B, C, K]
    acc = torch.promote_types(x.dtype, torch.float32)
    y = (window.to(acc) * weight.to(acc)[None]).sum(-1)
    return F.silu(y).to(x.dtype), window[:, :, 1:]
