"""The Gated DeltaNet mixer (three of every four Qwen3.5 layers).

x -> in_proj_qkv -> causal depthwise conv1d + SiLU -> q, k, v per head; beta = sigmoid(in_proj_b x);
g = -exp(A_log) * softplus(in_proj_a x + dt_bias); q, k l2-normalized (q scaled by dk^-0.5); the gated
delta rule -> per-head gated RMSNorm with z = in_proj_z x -> out_proj. The gates, the normalisation and the rule
(and, in decode, the conv step) run behind the fused kernel seams `kernels.deltanet_prefill` /
`kernels.deltanet_decode` (`kernels.deltanet_verify`: k + 1 decode steps for speculative verification), which take the raw projections and each row's initial states and give back the output and
each row's final states; this mixer reads the rows from the slots (`Slots.gather_initial`: zeros for a fresh row) and
writes the final ones back (`Slots.write`).

Its state per sequence slot: the conv state [slots, conv_channels, kernel - 1] (model dtype) and the
recurrent state [slots, value_heads, dk, dv] (fp32).

Tensor parallelism splits by heads: each rank holds its key heads and the value heads that read them,
with in_proj_qkv rows (and conv channels) ordered [q_r | k_r | v_r] per rank.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import kernels
from ..config import Qwen35Config
from .layers import GatedRMSNorm
from .parallel import ShardedDims


class GatedDeltaNet(nn.Module):
    def __init__(self, config: Qwen35Config, dims: ShardedDims, layers):
        super().__init__()
        self.nk, self.nv = dims.linear_num_key_heads, dims.linear_num_value_heads
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.conv_dim = dims.linear_conv_dim
        hidden = config.hidden_size
        self.in_proj_qkv = layers.column_linear(hidden, self.conv_dim)
        self.in_proj_z = layers.column_linear(hidden, self.nv * self.dv)
        self.in_proj_b = layers.column_linear(hidden, self.nv)
        self.in_proj_a = layers.column_linear(hidden, self.nv)
        self.conv_weight = nn.Parameter(torch.zeros(self.conv_dim, config.linear_conv_kernel_dim))
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.norm = GatedRMSNorm(self.dv, config.rms_norm_eps)
        self.out_proj = layers.row_linear(self.nv * self.dv, hidden)
        self.precision = layers.precision  # modeling/precision.py
        # Which kernel backend answers this mixer's kernel calls: the factory's choice (the Neuron builder names
        # "nki" there), or None for the process-wide one (`kernels.set_backend`).
        self.kernel_backend = layers.kernel_backend
        # The LNC degree the kernels are launched with: the factory's (the Neuron one knows the compiled target: 2 on
        # trn2, 1 on trn1/inf2), None on CPU (the NKI emulator takes the target it emulates).
        self.kernel_lnc = layers.kernel_lnc

    def _output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o [B, nv, T, dv] -> gated norm with z -> out_proj."""
        B, T, _ = x.shape
        z = self.in_proj_z(x).reshape(B, T, self.nv, self.dv)
        o = self.norm(o.transpose(1, 2), z).reshape(B, T, self.nv * self.dv)  # fp32 (the norm's policy)
        return self.out_proj(self.precision.operand(o, self.out_proj.weight))

    def _raw_heads(self, mixed: torch.Tensor):
        """mixed [B, T, conv_dim] -> q, k [B, nk, T, dk], v [B, nv, T, dv], as they are (the seam normalises)."""
        B, T, _ = mixed.shape
        q, k, v = torch.split(mixed, [self.nk * self.dk, self.nk * self.dk, self.nv * self.dv], dim=-1)
        q = q.reshape(B, T, self.nk, self.dk).transpose(1, 2).contiguous()
        k = k.reshape(B, T, self.nk, self.dk).transpose(1, 2).contiguous()
        v = v.reshape(B, T, self.nv, self.dv).transpose(1, 2).contiguous()
        return q, k, v

    def context_encoding(self, x, lengths, slots, conv_state, recurrent_state):
        """x [B, T, hidden] right-padded, lengths [B]. A fresh row (`slots.fresh`: it starts at position 0) starts
        from zero conv and recurrent states; another continues its slot from the slot's states. Returns the output
        and the states with the active rows' slots updated (`slots.write`)."""
        initial_conv = slots.gather_initial(conv_state)
        mixed, new_conv = kernels.causal_conv1d(
            self.in_proj_qkv(x).transpose(1, 2), self.conv_weight, initial_conv, lengths, backend=self.kernel_backend
        )
        q, k, v = self._raw_heads(mixed.transpose(1, 2))
        initial_recurrent = slots.gather_initial(recurrent_state)
        o, final_recurrent = kernels.deltanet_prefill(
            q, k, v, self.in_proj_a(x).contiguous(), self.in_proj_b(x).contiguous(), self.A_log, self.dt_bias,
            initial_recurrent, lengths, backend=self.kernel_backend, lnc=self.kernel_lnc,
        )
        conv_state = slots.write(conv_state, new_conv, initial_conv)
        return self._output(o, x), conv_state, slots.write(recurrent_state, final_recurrent, initial_recurrent)

    def token_generation(self, x, slots, conv_state, recurrent_state):
        """x [B, 1, hidden]: one step from each slot's states (zero states for a fresh row) -> the output and the
        updated states."""
        initial_conv, initial_recurrent = slots.gather_initial(conv_state), slots.gather_initial(recurrent_state)
        o, final_conv, final_recurrent = kernels.deltanet_decode(
            self.in_proj_qkv(x)[:, 0].contiguous(), self.in_proj_a(x)[:, 0].contiguous(),
            self.in_proj_b(x)[:, 0].contiguous(), self.A_log, self.dt_bias, self.conv_weight, initial_conv,
            initial_recurrent, backend=self.kernel_backend, lnc=self.kernel_lnc,
            # The gathered rows are this call's own copies: on CPU (in-place slots) the kernel may reuse them for
            # the final states (the reference's in-place step, issue 31); the Neuron graphs keep every value new.
            donate_initial=slots.in_place,
        )
        conv_state = slots.write(conv_state, final_conv, initial_conv)
        return self._output(o[:, :, None], x), conv_state, slots.write(recurrent_state, final_recurrent, initial_recurrent)

    def verify(self, x, slots, conv_state, recurrent_state):
        """x [B, T, hidden]: T consecutive decode steps per row from its slot's states (speculative verification),
        the projections of all T tokens at once, then the verify seam (`kernels.deltanet_verify`: each position runs
        exactly a decode step's numbers; the NKI backend in one kernel launch). The slot states are left as they
        are. Returns the output [B, T, hidden] and the states after each position, rank 4 (the Neuron compiler takes
        no rank-5 tensor): conv [B, T, conv_dim, kernel - 1], recurrent [B, T * nv, dk, dv] (position-major within a
        row; `Qwen35Decoder.commit` keeps one position's nv heads)."""
        o, convs, recurrents = kernels.deltanet_verify(
            self.in_proj_qkv(x).contiguous(), self.in_proj_a(x).contiguous(), self.in_proj_b(x).contiguous(),
            self.A_log, self.dt_bias, self.conv_weight, slots.gather_initial(conv_state),
            slots.gather_initial(recurrent_state), backend=self.kernel_backend, lnc=self.kernel_lnc,
        )
        return self._output(o, x), convs, recurrents
