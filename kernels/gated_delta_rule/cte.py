"""NKI prefill kernel (context encoding, and the chunked-prefill continuation) of the gated delta rule.

All heads of a layer's rank and every batch row in one launch. Per batch row b (slot s = seq_ids[b]; -1: inactive,
reads and writes no state) and value head h (key head h // (nv / nk)), chunk by chunk of C = 128 tokens:

    q, k  <- l2-normalised (q also scaled by dk^-0.5) in the kernel, from the conv output
    g     =  -exp(A_log) softplus(a + dt_bias),  beta = sigmoid(b)   (computed in the kernel from the raw projections)
             tokens at or past lengths[b] get g = 0 and beta = 0: padding changes no state
    gc    =  cumulative sum of g inside the chunk (a matmul with the upper-triangular ones matrix)
    A     =  strictly_lower(beta_i k_i.k_j exp(gc_i - gc_j))
    T     =  (I + A)^-1
    u, w  =  T (beta v),  T (beta k exp(gc))
    v'    =  u - w S
    o     =  (q exp(gc)) S + lower(q_i.k_j exp(gc_i - gc_j)) v'
    S     =  exp(gc_C) S + (k exp(gc_C - gc))^T v'

Every exponent is <= 0: gc_i - gc_j for j <= i (the upper triangle is replaced by -3e38 before exp), gc, and
gc_C - gc. The initial state is read from recurrent_state[s] and the final state written back there in place, fp32.

Chunk size and the triangular solve. C = 128 tokens puts one token per partition (all 128 partitions work, and the
[C, C] matrices are single TensorE tiles). T is computed by recursive block inversion: starting from the identity
(the inverse of the unit diagonal), log2(C) = 7 rounds merge pairs of diagonal blocks of size s into blocks of 2s,

    T <- T - T (A * M_s) T,    M_s[i, j] = 1 where (i xor j) >> log2(s) == 1   (the lower-left s-block of each 2s-block)

which is exact ([[T11, 0], [A21, ...]] -> [[T11, 0], [-T22 A21 T11, T22]]) and only ever multiplies true inverse
blocks, so no entry grows beyond those of T itself. A truncated Neumann series (I - A + A^2 - ...) or its product
form would form powers of A, whose entries reach C(127, 63) ~ 1e37 for identical keys with beta = 1 and no decay
(the NaN seen in the seed); forward substitution is as exact but takes C sequential steps.

Layouts (HBM): q, k [B, nk, T, dk] and v [B, nv, T, dv] after the conv and SiLU (activation dtype); a, b [B, T, nv]
raw (activation dtype); A_log, dt_bias [nv] fp32; recurrent_state [slots, nv, dk, dv] fp32 (updated in place);
seq_ids, lengths [1, B] int32; solve_masks [7, 128, 128] fp32 (the M_s above, `solve_masks()`). Returns
o [B, nv, T, dv] fp32. On chip, tokens are on partitions ([C, dk], [C, dv], [C, C]) and the state is [dk, dv].

Limits: dk, dv <= 128; nv a multiple of nk; any T (the last chunk may be partial); matmuls run in fp32 (4x the bf16
TensorE cost), so bf16 and fp32 inputs give fp32-accurate results.

Cost report (emulator cost model, trn2, the 2B layer on one rank: 16 heads, dk = dv = 128, 4096 tokens, batch 1):
see `benchmarks/deltanet_kernels.py` and docs/kernels.md. It is far above the issue's 1.0 ms target: this kernel
is written for correctness first (one head and chunk at a time, fp32 operands, a 7-round solve).
"""

from __future__ import annotations

import numpy as np

from ..nki_import import nki, nisa, nl

CHUNK = 128
L2_EPS = 1e-6
NEG_BIG = -3.0e38


def solve_masks(chunk: int = CHUNK) -> np.ndarray:
    """M_s for s = 1, 2, 4, ..., chunk / 2: [log2(chunk), chunk, chunk] fp32 (a constant input of the kernel)."""
    i = np.arange(chunk)[:, None]
    j = np.arange(chunk)[None, :]
    levels = int(np.log2(chunk))
    return np.stack([(((i ^ j) >> lvl) == 1) for lvl in range(levels)]).astype(np.float32)


def _transpose(src, rows, cols, f32):
    """[rows, cols] SBUF fp32 -> a new [cols, rows] SBUF fp32 tile (TensorE transpose through PSUM)."""
    ps = nl.ndarray((cols, rows), dtype=f32, buffer=nl.psum)
    nisa.nc_transpose(dst=ps, data=src)
    out = nl.ndarray((cols, rows), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=out, src=ps)
    return out


def _matmul(stationary, moving, rows, cols, f32):
    """stationary^T @ moving -> a new [rows, cols] SBUF fp32 tile."""
    ps = nl.ndarray((rows, cols), dtype=f32, buffer=nl.psum)
    nisa.nc_matmul(dst=ps, stationary=stationary, moving=moving)
    out = nl.ndarray((rows, cols), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=out, src=ps)
    return out


def _l2norm_rows(x, rows, n, eps_col, scale, f32):
    """x [rows, n] fp32 in place: x * rsqrt(sum x^2 + eps) * scale, per partition."""
    sq = nl.ndarray((rows, n), dtype=f32, buffer=nl.sbuf)
    ssum = nl.ndarray((rows, 1), dtype=f32, buffer=nl.sbuf)
    nisa.activation(dst=sq, op=nl.square, data=x, reduce_op=nl.add, reduce_res=ssum,
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)
    inv = nl.ndarray((rows, 1), dtype=f32, buffer=nl.sbuf)
    nisa.activation(dst=inv, op=nl.rsqrt, data=ssum, bias=eps_col[0:rows, :])
    nisa.tensor_scalar(dst=x, data=x, op0=nl.multiply, operand0=inv, op1=nl.multiply, operand1=scale)


@nki.jit
def gated_delta_rule_cte(q, k, v, a, b, A_log, dt_bias, recurrent_state, seq_ids, lengths, solve_masks):
    B, nk, T, dk = q.shape
    nv, dv = v.shape[1], v.shape[3]
    group = nv // nk
    C = CHUNK
    f32 = nl.float32
    levels = solve_masks.shape[0]
    assert dk <= 128 and dv <= 128 and nv % nk == 0 and solve_masks.shape[1] == C
    n_chunks = (T + C - 1) // C

    o_out = nl.ndarray((B, nv, T, dv), dtype=f32, buffer=nl.shared_hbm)

    # ---------------------------------------------------------------- constants
    ones = nl.ndarray((C, C), dtype=f32, buffer=nl.sbuf)
    nisa.memset(ones, 1.0)
    upper = nl.ndarray((C, C), dtype=f32, buffer=nl.sbuf)  # upper[j, i] = 1 for j <= i (cumsum as a matmul)
    nisa.affine_select(dst=upper, pattern=[[1, C]], channel_multiplier=-1, on_true_tile=ones, on_false_value=0.0,
                       cmp_op=nl.greater_equal)
    ident = nl.shared_identity_matrix(n=C, dtype=f32)
    eps_col = nl.ndarray((C, 1), dtype=f32, buffer=nl.sbuf)
    nisa.memset(eps_col, L2_EPS)
    masks = nl.ndarray((C, levels, C), dtype=f32, buffer=nl.sbuf)
    nisa.dma_copy(dst=masks, src=solve_masks.ap(pattern=[[C, C], [C * C, levels], [1, C]], offset=0))
    token = nl.ndarray((C, 1), dtype=f32, buffer=nl.sbuf)  # token index inside a chunk, one per partition
    nisa.iota(dst=token, pattern=[[0, 1]], offset=0, channel_multiplier=1)
    alog_bc = nl.ndarray((C, nv), dtype=f32, buffer=nl.sbuf)
    nisa.dma_copy(dst=alog_bc, src=A_log.ap(pattern=[[0, C], [1, nv]], offset=0))
    rate = nl.ndarray((C, nv), dtype=f32, buffer=nl.sbuf)  # exp(A_log)
    nisa.activation(dst=rate, op=nl.exp, data=alog_bc)
    dtb_bc = nl.ndarray((C, nv), dtype=f32, buffer=nl.sbuf)
    nisa.dma_copy(dst=dtb_bc, src=dt_bias.ap(pattern=[[0, C], [1, nv]], offset=0))
    seq = nl.ndarray((1, B), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=seq, src=seq_ids)
    len_bc = nl.ndarray((C, B), dtype=f32, buffer=nl.sbuf)
    nisa.dma_copy(dst=len_bc, src=lengths.ap(pattern=[[0, C], [1, B]], offset=0))

    for bi in range(B):
        slot = seq[0:1, bi:bi + 1]
        for h in range(nv):
            kh = h // group
            state_view = recurrent_state.ap(pattern=[[nv * dk * dv, 1], [dv, dk], [1, dv]], offset=h * dk * dv,
                                            scalar_offset=slot, indirect_dim=0)
            S = nl.ndarray((dk, dv), dtype=f32, buffer=nl.sbuf)
            nisa.memset(S, 0.0)  # an inactive row starts from (and keeps) nothing
            nisa.dma_copy(dst=S, src=state_view, oob_mode=nisa.oob_mode.skip)

            for c in range(n_chunks):
                t0 = c * C
                n = min(C, T - t0)
                # ---------------------------------------------------- load (zeros past T), normalise
                Q = nl.ndarray((C, dk), dtype=f32, buffer=nl.sbuf)
                K = nl.ndarray((C, dk), dtype=f32, buffer=nl.sbuf)
                V = nl.ndarray((C, dv), dtype=f32, buffer=nl.sbuf)
                a_col = nl.ndarray((C, 1), dtype=f32, buffer=nl.sbuf)
                b_col = nl.ndarray((C, 1), dtype=f32, buffer=nl.sbuf)
                if n < C:
                    for t in (Q, K, V, a_col, b_col):
                        nisa.memset(t, 0.0)
                nisa.dma_copy(dst=Q[0:n, :], src=q[bi, kh, t0:t0 + n, :])
                nisa.dma_copy(dst=K[0:n, :], src=k[bi, kh, t0:t0 + n, :])
                nisa.dma_copy(dst=V[0:n, :], src=v[bi, h, t0:t0 + n, :])
                nisa.dma_copy(dst=a_col[0:n, :], src=a.ap(pattern=[[nv, n], [1, 1]], offset=(bi * T + t0) * nv + h))
                nisa.dma_copy(dst=b_col[0:n, :], src=b.ap(pattern=[[nv, n], [1, 1]], offset=(bi * T + t0) * nv + h))
                _l2norm_rows(Q, C, dk, eps_col, float(dk) ** -0.5, f32)
                _l2norm_rows(K, C, dk, eps_col, 1.0, f32)

                # ---------------------------------------------------- gates, padding mask
                valid = nl.ndarray((C, 1), dtype=f32, buffer=nl.sbuf)  # t0 + p < lengths[b]
                nisa.tensor_scalar(dst=valid, data=token, op0=nl.add, operand0=float(t0), op1=nl.less,
                                   operand1=len_bc[:, bi:bi + 1])
                g = nl.ndarray((C, 1), dtype=f32, buffer=nl.sbuf)
                nisa.tensor_tensor(dst=g, data1=a_col, data2=dtb_bc[:, h:h + 1], op=nl.add)
                nisa.activation(dst=g, op=nl.softplus, data=g)
                nisa.scalar_tensor_tensor(dst=g, data=g, op0=nl.multiply, operand0=-1.0, op1=nl.multiply,
                                          operand1=rate[:, h:h + 1])
                nisa.tensor_tensor(dst=g, data1=g, data2=valid, op=nl.multiply)
                # beta = sigmoid(b) rounded to the activation dtype, as the unfused model computes it
                beta_act = nl.ndarray((C, 1), dtype=b.dtype, buffer=nl.sbuf)
                nisa.activation(dst=beta_act, op=nl.sigmoid, data=b_col)
                beta = nl.ndarray((C, 1), dtype=f32, buffer=nl.sbuf)
                nisa.tensor_copy(dst=beta, src=beta_act)
                nisa.tensor_tensor(dst=beta, data1=beta, data2=valid, op=nl.multiply)

                # gc (column), gc_C (every partition), gc_j along the free axis
                gc = _matmul(upper, g, C, 1, f32)
                g_tot = _matmul(ones, g, C, 1, f32)
                g_rows = nl.ndarray((C, C), dtype=f32, buffer=nl.sbuf)
                nisa.tensor_scalar(dst=g_rows, data=ones, op0=nl.multiply, operand0=g)
                gc_rows = _matmul(g_rows, upper, C, C, f32)  # [i, j] = gc_j
                # decay[i, j] = exp(gc_i - gc_j) for j <= i, 0 above the diagonal
                logd = nl.ndarray((C, C), dtype=f32, buffer=nl.sbuf)
                nisa.tensor_scalar(dst=logd, data=gc_rows, op0=nl.subtract, operand0=gc, reverse0=True)
                nisa.affine_select(dst=logd, pattern=[[-1, C]], channel_multiplier=1, on_true_tile=logd,
                                   on_false_value=NEG_BIG, cmp_op=nl.greater_equal)
                decay = nl.ndarray((C, C), dtype=f32, buffer=nl.sbuf)
                nisa.activation(dst=decay, op=nl.exp, data=logd)
                e_gc = nl.ndarray((C, 1), dtype=f32, buffer=nl.sbuf)
                nisa.activation(dst=e_gc, op=nl.exp, data=gc)
                to_end = nl.ndarray((C, 1), dtype=f32, buffer=nl.sbuf)  # exp(gc_C - gc_i)
                nisa.tensor_tensor(dst=to_end, data1=g_tot, data2=gc, op=nl.subtract)
                nisa.activation(dst=to_end, op=nl.exp, data=to_end)
                e_tot = nl.ndarray((C, 1), dtype=f32, buffer=nl.sbuf)
                nisa.activation(dst=e_tot, op=nl.exp, data=g_tot)

                # ---------------------------------------------------- A, intra-chunk attention
                KT = _transpose(K, C, dk, f32)
                QT = _transpose(Q, C, dk, f32)
                KK = _matmul(KT, KT, C, C, f32)  # k_i . k_j
                QK = _matmul(QT, KT, C, C, f32)  # q_i . k_j
                A = nl.ndarray((C, C), dtype=f32, buffer=nl.sbuf)
                nisa.tensor_tensor(dst=A, data1=KK, data2=decay, op=nl.multiply)
                nisa.tensor_scalar(dst=A, data=A, op0=nl.multiply, operand0=beta)
                nisa.affine_select(dst=A, pattern=[[-1, C]], channel_multiplier=1, on_true_tile=A,
                                   on_false_value=0.0, cmp_op=nl.greater)
                intra = nl.ndarray((C, C), dtype=f32, buffer=nl.sbuf)
                nisa.tensor_tensor(dst=intra, data1=QK, data2=decay, op=nl.multiply)

                # ---------------------------------------------------- T = (I + A)^-1, recursive block inversion
                Tm = nl.ndarray((C, C), dtype=f32, buffer=nl.sbuf)
                nisa.tensor_copy(dst=Tm, src=ident)
                TmT = nl.ndarray((C, C), dtype=f32, buffer=nl.sbuf)
                nisa.tensor_copy(dst=TmT, src=ident)
                AT = _transpose(A, C, C, f32)
                for lvl in range(levels):
                    AoffT = nl.ndarray((C, C), dtype=f32, buffer=nl.sbuf)  # (A * M_s)^T; M_s is symmetric
                    nisa.tensor_tensor(dst=AoffT, data1=AT, data2=masks[:, lvl, :], op=nl.multiply)
                    Y = _matmul(AoffT, Tm, C, C, f32)  # (A * M_s) T
                    Z = nl.ndarray((C, C), dtype=f32, buffer=nl.psum)
                    nisa.nc_matmul(dst=Z, stationary=TmT, moving=Y)  # T (A * M_s) T
                    Tn = nl.ndarray((C, C), dtype=f32, buffer=nl.sbuf)
                    nisa.tensor_tensor(dst=Tn, data1=Tm, data2=Z, op=nl.subtract)
                    Tm = Tn
                    TmT = _transpose(Tm, C, C, f32)

                # ---------------------------------------------------- u, w; v' = u - w S; o; S
                rhs = nl.ndarray((C, dv + dk), dtype=f32, buffer=nl.sbuf)
                nisa.tensor_scalar(dst=rhs[:, 0:dv], data=V, op0=nl.multiply, operand0=beta)
                nisa.tensor_scalar(dst=rhs[:, dv:dv + dk], data=K, op0=nl.multiply, operand0=beta, op1=nl.multiply,
                                   operand1=e_gc)
                uw = _matmul(TmT, rhs, C, dv + dk, f32)  # T [beta v | beta k exp(gc)]
                WT = _transpose(uw[:, dv:dv + dk], C, dk, f32)
                ws = nl.ndarray((C, dv), dtype=f32, buffer=nl.psum)
                nisa.nc_matmul(dst=ws, stationary=WT, moving=S)
                v_new = nl.ndarray((C, dv), dtype=f32, buffer=nl.sbuf)
                nisa.tensor_tensor(dst=v_new, data1=uw[:, 0:dv], data2=ws, op=nl.subtract)

                qs = nl.ndarray((C, dv), dtype=f32, buffer=nl.psum)
                nisa.nc_matmul(dst=qs, stationary=QT, moving=S)
                o1 = nl.ndarray((C, dv), dtype=f32, buffer=nl.sbuf)
                nisa.tensor_scalar(dst=o1, data=qs, op0=nl.multiply, operand0=e_gc)
                intraT = _transpose(intra, C, C, f32)
                o2 = nl.ndarray((C, dv), dtype=f32, buffer=nl.psum)
                nisa.nc_matmul(dst=o2, stationary=intraT, moving=v_new)
                o_sb = nl.ndarray((C, dv), dtype=f32, buffer=nl.sbuf)
                nisa.tensor_tensor(dst=o_sb, data1=o1, data2=o2, op=nl.add)
                nisa.dma_copy(dst=o_out[bi, h, t0:t0 + n, :], src=o_sb[0:n, :])

                Kd = nl.ndarray((C, dk), dtype=f32, buffer=nl.sbuf)
                nisa.tensor_scalar(dst=Kd, data=K, op0=nl.multiply, operand0=to_end)
                kv = nl.ndarray((dk, dv), dtype=f32, buffer=nl.psum)
                nisa.nc_matmul(dst=kv, stationary=Kd, moving=v_new)
                S_next = nl.ndarray((dk, dv), dtype=f32, buffer=nl.sbuf)
                nisa.scalar_tensor_tensor(dst=S_next, data=S, op0=nl.multiply, operand0=e_tot[0:dk, :], op1=nl.add,
                                          operand1=kv)
                S = S_next

            nisa.dma_copy(dst=state_view, src=S, oob_mode=nisa.oob_mode.skip)
    return o_out
