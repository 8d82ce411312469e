"""NKI decode kernel (token generation) of a Gated DeltaNet layer: one token for every row and head
(`gated_delta_rule_tkg`); and its speculative-verification form, T = k + 1 consecutive tokens per row with the states
after each position stored (`gated_delta_rule_verify`: the same steps over the rows (b, t) in order, position t + 1
starting from position t's states on chip, bit for bit what T chained decode launches compute).

Per batch row b (initial states initial_conv[b], initial_recurrent[b]: the caller's, zeros for a fresh row) and per
value head h (key head kh = h // (nv / nk)), from the raw projections of the token:

    window = [initial_conv[b] | mixed_qkv[b]]                causal depthwise conv, kernel K
    x      = silu(sum_t window[:, t] * conv_weight[:, t])    -> q, k (per key head), v (per value head)
    q      = q * rsqrt(|q|^2 + 1e-6) * dk^-0.5,  k = k * rsqrt(|k|^2 + 1e-6)
    beta   = sigmoid(b_raw),  g = -exp(A_log) * softplus(a_raw + dt_bias),  decay = exp(g) (<= 1)
    mem    = S^T k,  Sq = S^T q                   (S = initial_recurrent[b, h], fp32, [dk, dv])
    delta  = beta * (v - decay * mem)
    S      = decay * S + k delta^T                (returned: state_out[b, h], fp32)
    o      = S^T q = decay * Sq + (k . q) delta
    conv_out[b] = window[:, 1:]                   (returned)

Layouts (HBM): mixed_qkv [B, C] with C = 2 nk dk + nv dv ordered [q | k | v] (the in_proj_qkv output before the
conv, activation dtype); a, b [B, nv] raw (activation dtype); A_log, dt_bias [nv] fp32; conv_weight [C, K];
initial_conv [B, C, K - 1] (activation dtype); initial_recurrent [B, nv, dk, dv] fp32. Returns (o [B, nv, dv] fp32 (the gated RMSNorm and out_proj follow outside), conv_out [B, C, K - 1],
state_out [B, nv, dk, dv] fp32); the kernel writes none of its inputs.

On chip, the state is laid out so that every transfer of it moves long runs: partition (head, block) holds R
consecutive rows of a head's [dk, dv] state (R dv fp32 contiguous in HBM: R = 8 at dv = 128, 4 KiB per partition;
nb = dk / R partitions per head), and a row's state moves in pieces of hp heads (hp nb <= 128 partitions: two
512 KiB pieces at the 2B shape). The q/k conv data moves in its HBM order, W = u R consecutive channels per
partition (Pl = 2 nk dk / W <= 128 partitions: 32 channels at the 2B shape), so every conv transfer (inputs, conv
state in and out, weights) is one contiguous run of HBM; the conv runs there, and TensorE brings its output to the
state layout (u accumulating selection matmuls per piece and q/k, exact), so the normalised q, k land next to the
state rows they multiply; v is convolved on nv vb partitions and brought to columns [dv, nv] by one matmul. The gates
load as contiguous rows and are repeated on the partitions by TensorE (exact). Per piece:

    mem, Sq  R accumulating TensorE matmuls: stationary = row r of every block (operand dtype), moving = k, q of that
             row placed in their head's column (a block selector), out [dv, (k|q), heads]
    delta    on [dv, heads] (VectorE from PSUM, GpSimd), repeated along each head's partitions by one matmul ->
             [Pn, dv] (PSUM)
    S        decay S (ScalarE, fp32) + k * delta row by row (VectorE scalar_tensor_tensor, fp32), one store
    o        decay Sq + (k . q) delta on [dv, heads], one TensorE transpose, one store

l2 norms and k . q are per-partition sums followed by one fp32 matmul with the same-head block matrix. With bf16
operands the matmul copies of a piece are made row by row, alternately on ScalarE and GpSimd, so the matmuls
start on the first rows while the others are copied; decay S follows on ScalarE (GpSimd's next step is delta's). The
next piece's copies are issued between a piece's short steps and its update, so every engine has queued work; the
fp32 k . q matmul (only o needs it) follows a row's first state matmuls, and a piece's o transpose the next piece's
state matmuls, so that neither holds TensorE's in-order stream. The tokens, gate rows and weights load first, then
every row's conv states, then every row's state pieces, all before any state store (the DMA
queue is in order). The first rows' q/k conv, then the gates, then row 0's norms (their copies on ScalarE, their
squares on GpSimd, the v conv on VectorE while the sums go through TensorE and ScalarE, issued after rsqrt), keeping
VectorE's stream for the way to the first delta; each row's conv state is stored as soon as it is computed.

Limits: dk, dv <= 128; nv <= 128; nv a multiple of nk; a piece holds whole GQA groups or part of one (asserted);
2 nk dk / W <= 128 load partitions; the activation dtype fp32 or bf16. Every exponent is <= 0
(decay = exp(g), g <= 0). The state is never rounded below fp32 (only the matmul copy of it, for bf16 operands).

Cost report (emulator cost model at the middle of its parameter ranges, trn2, the 2B layer on one rank: 16 heads,
dk = dv = 128; `benchmarks/deltanet_kernels.py`, docs/kernels.md, whose sensitivity table gives the ranges). The
floor is the rows' fp32 states read and written once at the model's DMA rate (0.85 x 362.5 GB/s): 6.81 us per row.
    bf16 activations, default (bf16) operands: batch 1 10.3 us (1.51x), batch 8 58.4 us (1.07x, DMA 100% busy)
    fp32 activations and operands:             batch 1 14.0 us (2.05x), batch 8 60.8 us (1.12x, DMA 100% busy)
The initial states are read from per-row tensors (the caller gathers them from its slots): no transfer waits for
slot ids any more (the slot-indexed version: 11.1 / 59.3 us and 14.9 / 61.2 us, the ids landing 1.3 us after their
load; docs/kernels.md keeps its analysis). The gather before the launch is the graph's, outside this figure. The q/k
selection runs once per group of rows (every row up to batch 16), which keeps an fp32 model's TensorE (its selection
matmuls at the 4x rate) under the DMA time at batch 8.

The verify kernel reads each row's states once and writes them after every position: 1 + T states of traffic per
row against a decode step's 2, so (k + 2) / 2 decode steps' traffic at best (docs/kernels.md, "Verify kernel";
`benchmarks/deltanet_verify.py`: batch 1, bf16 model, k = 1: 15.0 us = 1.46x a decode step; k = 4: 2.79x).
"""

from __future__ import annotations

from ..nki_import import nki
from .tkg_steps import decode_steps


@nki.jit
def gated_delta_rule_tkg(mixed_qkv, a, b, A_log, dt_bias, conv_weight, initial_conv, initial_recurrent,
                         operands="auto", heads_per_piece=None):
    B, C = mixed_qkv.shape
    _, nv, dk, dv = initial_recurrent.shape
    K = conv_weight.shape[1]
    return decode_steps(mixed_qkv, a, b, A_log, dt_bias, conv_weight, initial_conv, initial_recurrent, operands,
                         heads_per_piece, T=1, o_shape=(B, nv, dv), conv_shape=(B, C, K - 1),
                         state_shape=(B, nv, dk, dv))


@nki.jit
def gated_delta_rule_verify(mixed_qkv, a, b, A_log, dt_bias, conv_weight, initial_conv, initial_recurrent,
                            operands="auto", heads_per_piece=None):
    """T = k + 1 decode steps per row (speculative verification), each position's states kept: the decode kernel's
    steps over the rows (b, t) in order, position t + 1 starting from position t's states on chip.

    mixed_qkv [B, T, C], a, b [B, T, nv]; the rest as `gated_delta_rule_tkg` (each row's states before position 0).
    Returns o [B, T, nv, dv] fp32, conv_out [B, T, C, K - 1] (the conv state after each position) and state_out
    [B, T * nv, dk, dv] fp32 (the recurrent state after each position, position-major within a row: rank 4, the
    layout `GatedDeltaNet.verify` returns). Each position computes exactly what a decode launch from the previous
    position's states computes (the same instructions on the same values)."""
    B, T, C = mixed_qkv.shape
    _, nv, dk, dv = initial_recurrent.shape
    K = conv_weight.shape[1]
    return decode_steps(mixed_qkv, a, b, A_log, dt_bias, conv_weight, initial_conv, initial_recurrent, operands,
                         heads_per_piece, T=T, o_shape=(B, T, nv, dv), conv_shape=(B, T, C, K - 1),
                         state_shape=(B, T * nv, dk, dv))
