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
    # Time-major inside ([B, T, C]: x is the transpose of a projection's output, so this is a view), which
    # makes the shifted slices contiguous runs of channels; returned as the [B, C, T] view of the result.
    xt = x.transpose(1, 2)
    if initial_state is None:
        padded = torch.cat([xt.new_zeros(B, K - 1, C), xt], dim=1)  # [B, K - 1 + T, C]
    else:
        padded = torch.cat([initial_state.to(x.dtype).transpose(1, 2), xt], dim=1)
    # Accumulate in fp32 whatever the activation dtype (rounding each partial sum to bf16 costs accuracy).
    # The inputs are upcast once (mixed-dtype multiply-adds take a slow, unvectorized path on CPU); the
    # weight is [C, K], a few KiB.
    acc = torch.promote_types(x.dtype, torch.float32)
    wide, w = padded.to(acc), weight.t().to(acc)  # [K, C]
    y = wide[:, 0:T] * w[0]
    for j in range(1, K):
        y = torch.addcmul(y, wide[:, j : j + T], w[j])
    if lengths is None:
        final_state = padded[:, T:]
    else:
        # Rows of padded [B * (K - 1 + T), C] (an index_select, in the dtype of `lengths`: torch.gather takes int64
        # indices only, and its per-element index tensor is rank 4 here).
        span = K - 1 + T
        columns = torch.arange(K - 1, device=x.device, dtype=lengths.dtype)
        rows = (torch.arange(B, device=x.device, dtype=lengths.dtype) * span + lengths)[:, None] + columns  # [B, K-1]
        final_state = padded.reshape(B * span, C).index_select(0, rows.reshape(-1)).view(B, K - 1, C)
    return F.silu(y).to(x.dtype).transpose(1, 2), final_state.transpose(1, 2)


def causal_conv1d_step(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step: x [B, C] -> (silu(conv) [B, C], new_state [B, C, K - 1])."""
    window = torch.cat([state.to(x.dtype), x[:, :, None]], dim=-1)  # [B, C, K]
    acc = torch.promote_types(x.dtype, torch.float32)
    y = (window.to(acc) * weight.to(acc)[None]).sum(-1)
    return F.silu(y).to(x.dtype), window[:, :, 1:]
