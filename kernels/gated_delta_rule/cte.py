"""NKI prefill kernel (context encoding, and the chunked-prefill continuation) of the gated delta rule.

All heads of a layer's rank and every batch row in one launch (with LNC=2 on trn2, `kernel[2]`, each of the two
physical NeuronCores takes half of the heads). Per batch row b (initial state initial_recurrent[b]: the caller's,
zeros for a fresh row) and value head h (key head h // (nv / nk)), chunk by chunk of C = 128 tokens:

    q, k  <- l2-normalised (q also scaled by dk^-0.5) in the kernel, from the conv output
    g     =  -exp(A_log) softplus(a + dt_bias),  beta = sigmoid(b)   (computed in the kernel from the raw projections)
             tokens at or past lengths[b] get g = 0 and beta = 0: padding changes no state
    gc    =  cumulative sum of g inside the chunk (a matmul with the upper-triangular ones matrix)
    A     =  strictly_lower(beta_i k_i.k_j exp(gc_i - gc_j))
    T     =  (I + A)^-1
    v'    =  T (beta v - beta exp(gc) (k S))          (= u - w S of the WY form, u = T beta v, w = T beta k exp(gc))
    o     =  exp(gc) (q S) + lower(q_i.k_j exp(gc_i - gc_j)) v'
    S     =  exp(gc_C) S + (k exp(gc_C - gc))^T v'

Every exponent is <= 0: gc_i - gc_j for j <= i (the other triangle gets -3e38 added before exp), gc, and gc_C - gc.
The initial state is read from initial_recurrent[b]; the final state is returned (state_out[b], fp32). The kernel
writes none of its inputs (the caller puts the returned states into its slots).

Chunk size and the triangular solve. C = 128 tokens puts one token per partition (all 128 partitions work, and the
[C, C] matrices are single TensorE tiles). T is computed by recursive block inversion: starting from the identity
(the inverse of the unit diagonal), log2(C) = 7 rounds merge pairs of diagonal blocks of size s into blocks of 2s,

    T <- T - T (A * M_s) T,    M_s[i, j] = 1 where (i xor j) >> log2(s) == 1   (the lower-left s-block of each 2s-block)

which is exact ([[T11, 0], [A21, ...]] -> [[T11, 0], [-T22 A21 T11, T22]]) and only ever multiplies true inverse
blocks, so no entry grows beyond those of T itself. A truncated Neumann series (I - A + A^2 - ...) or its product
form would form powers of A, whose entries reach C(127, 63) ~ 1e37 for identical keys with beta = 1 and no decay
(the NaN seen in the seed); forward substitution is as exact but takes C sequential steps. The first round (s = 1)
needs no matmul (T = I - A * M_1); in the other six only the first-half columns of each 2s-block change, so both of
a round's matmuls stream those C / 2 columns only (a strided view), and T^T (the stationary of the next round) is a
TensorE transpose. Per head and chunk the solve is 6 x (2 matmuls + 1 transpose).

Layouts (HBM): q, k [B, nk, T, dk] and v [B, nv, T, dv] after the conv and SiLU (activation dtype); a, b [B, T, nv]
raw (activation dtype); A_log, dt_bias [nv] fp32; initial_recurrent [B, nv, dk, dv] fp32 (read only);
lengths [1, B] int32; solve_masks [7, 128, 128] fp32 (the M_s above, `solve_masks()`). Returns
(o [B, nv, T, dv] fp32, state_out [B, nv, dk, dv] fp32). On chip, tokens are on partitions ([C, dk], [C, dv],
[C, C]) and the state is [dk, dv].

Limits: dk, dv <= 128; nv a multiple of nk; any T (the last chunk may be partial). TensorE operands (operands.py):
by default bf16 for bf16 inputs (bf16's TensorE and VectorE rates; ~5e-3 relative error on outputs and ~8e-3 on the
state at the 2B layer shape, inside the 2e-2 bf16 tolerance) and fp32 for fp32 inputs (exact, 4x the bf16 TensorE
cost); `operands="fp32"` (exact) or `"tf32"` (bf16's TensorE rate, ~6e-4) for bf16 inputs. Gates, their cumulative
sums, the decay factors and the carried state stay fp32 in every mode.

Scheduling: 8 heads advance in lockstep (PSUM holds three [C, C] fp32 tiles per head at once), statement by
statement, so that each engine's in-order stream alternates between independent heads. Chunks are software-pipelined
in three stages: gates and norms of chunk c + 2, the state-free work (decay, A, intra-chunk attention, the solve) of
chunk c + 1, then the state chain of chunk c (k S -> R -> v' -> o and k^T v' -> S, each step for all heads before
the next), then the cumulative gates and diag(gc) of chunk c + 2; loads run three chunks ahead and each chunk's
outputs of all heads leave in one transfer.

Cost report (emulator cost model at the middle of its parameter ranges, trn2, bf16 activations, the 2B layer on one
rank: 16 heads, dk = dv = 128, 4096 tokens, batch 1; `benchmarks/deltanet_kernels.py`, docs/kernels.md, whose
sensitivity table gives the ranges); busy times of the busier physical core:
    LNC=2, bf16 operands (the default for bf16 activations): 0.79 ms, 0.73-1.11 ms over the parameter ranges
                          (TensorE 556 us busy, 70%; ScalarE 584, VectorE 408, GpSimd 328, DMA 171): under the
                          1.0 ms target, but ScalarE, not TensorE, is the busiest engine; tf32 operands: 0.80 ms
    LNC=2, fp32 operands: 1.64 ms (TensorE 1.46 ms busy, 89%; the same with fp32 activations, an fp32 model)
    LNC=1, bf16 operands: 1.58 ms (TensorE 1.11 ms busy, 71%)
(before this version, under the cost model of its time: 2.63 ms with tf32 and 6.01 ms with fp32 operands, LNC=1).
TensorE per head and chunk, at the bf16 rate: the solve 6 x 640 cycles, the other matmuls and transposes about
2800 cycles.
"""

from __future__ import annotations

import numpy as np

from ..nki_import import nki, nisa, nl
from .operands import matmul_dtype

CHUNK = 128
L2_EPS = 1e-6
NEG_BIG = -3.0e38
HEADS_INTERLEAVED = 8  # heads in lockstep (PSUM: 3 [C, C] fp32 tiles per head live at once)


def solve_masks(chunk: int = CHUNK) -> np.ndarray:
    """M_s for s = 1, 2, 4, ..., chunk / 2: [log2(chunk), chunk, chunk] fp32 (a constant input of the kernel)."""
    i = np.arange(chunk)[:, None]
    j = np.arange(chunk)[None, :]
    levels = int(np.log2(chunk))
    return np.stack([(((i ^ j) >> lvl) == 1) for lvl in range(levels)]).astype(np.float32)


def _transpose(src, rows, cols, dtype, engine=None):
    """[rows, cols] SBUF -> a new [cols, rows] SBUF tile of `dtype` (TensorE transpose through PSUM; the PSUM -> SBUF
    copy on ScalarE by default, which has the most room)."""
    ps = nl.ndarray((cols, rows), dtype=src.dtype, buffer=nl.psum)
    nisa.nc_transpose(dst=ps, data=src)
    out = nl.ndarray((cols, rows), dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=out, src=ps, engine=engine or nisa.engine.scalar)
    return out


def _matmul(stationary, moving, rows, cols, dtype, engine=None):
    """stationary^T @ moving (fp32 PSUM) -> a new [rows, cols] SBUF tile of `dtype` (copied out on `engine`)."""
    ps = nl.ndarray((rows, cols), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=ps, stationary=stationary, moving=moving)
    out = nl.ndarray((rows, cols), dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=out, src=ps, engine=engine or nisa.engine.vector)
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


def _load_chunk(q, k, v, a, b, bi, hs, group, c):
    """DMA chunk c of row bi for the heads `hs` (zeros past T): q, k, v [C, d] tiles per head in the activation dtype
    (one contiguous run each), raw a, b [C, nv]."""
    T, dk = q.shape[2], q.shape[3]
    nv, dv = v.shape[1], v.shape[3]
    C = CHUNK
    t0 = c * C
    n = min(C, T - t0)
    tiles = {"Q": [], "K": [], "V": []}
    ab = {}
    for name, src in (("a", a), ("b", b)):
        ab[name] = nl.ndarray((C, nv), dtype=src.dtype, buffer=nl.sbuf)
        if n < C:
            nisa.memset(ab[name], 0.0, engine=nisa.engine.gpsimd)
        nisa.dma_copy(dst=ab[name][0:n, :], src=src[bi, t0:t0 + n, :])
    for h in hs:
        kh = h // group
        for name, src, hh, d in (("Q", q, kh, dk), ("K", k, kh, dk), ("V", v, h, dv)):
            t = nl.ndarray((C, d), dtype=src.dtype, buffer=nl.sbuf)
            if n < C:
                nisa.memset(t, 0.0, engine=nisa.engine.gpsimd)
            nisa.dma_copy(dst=t[0:n, :], src=src[bi, hh, t0:t0 + n, :])
            tiles[name].append(t)
    return tiles, ab


@nki.jit
def gated_delta_rule_cte(q, k, v, a, b, A_log, dt_bias, initial_recurrent, lengths, solve_masks,
                         operands="auto"):
    B, nk, T, dk = q.shape
    nv, dv = v.shape[1], v.shape[3]
    group = nv // nk
    C = CHUNK
    f32 = nl.float32
    # TensorE operands (operands.py): by default bf16 for bf16 activations (bf16's TensorE rate and VectorE's bf16 lane
    # width, ~1e-2 relative error, inside the bf16 tolerance), fp32 for fp32 ones. Gates, their cumulative sums (which
    # are exponentiated), the decay factors and the carried state stay fp32 in every mode.
    mm = matmul_dtype(operands, q.dtype)
    levels = solve_masks.shape[0]
    assert dk <= 128 and dv <= 128 and nv % nk == 0 and solve_masks.shape[1] == C
    n_chunks = (T + C - 1) // C
    # LNC: the heads are split over the launch's programs (kernel[2] on trn2: two physical NeuronCores).
    n_prog = nl.num_programs(0)
    per_prog = (nv + n_prog - 1) // n_prog
    h_begin = nl.program_id(0) * per_prog
    h_end = min(nv, h_begin + per_prog)

    o_out = nl.ndarray((B, nv, T, dv), dtype=f32, buffer=nl.shared_hbm)
    state_out = nl.ndarray((B, nv, dk, dv), dtype=f32, buffer=nl.shared_hbm)
    if h_begin >= h_end:
        return o_out, state_out

    # ---------------------------------------------------------------- constants
    ones = nl.ndarray((C, C), dtype=f32, buffer=nl.sbuf)
    nisa.memset(ones, 1.0)
    upper = nl.ndarray((C, C), dtype=f32, buffer=nl.sbuf)  # upper[j, i] = 1 for j <= i (cumsum as a matmul)
    nisa.affine_select(dst=upper, pattern=[[1, C]], channel_multiplier=-1, on_true_tile=ones, on_false_value=0.0,
                       cmp_op=nl.greater_equal)
    ident = nl.shared_identity_matrix(n=C, dtype=f32)
    zeros = nl.ndarray((C, C), dtype=f32, buffer=nl.sbuf)
    nisa.memset(zeros, 0.0)
    below = nl.ndarray((C, C), dtype=f32, buffer=nl.sbuf)  # 0 where f < p, NEG_BIG elsewhere (added before exp)
    nisa.affine_select(dst=below, pattern=[[-1, C]], channel_multiplier=1, on_true_tile=zeros,
                       on_false_value=NEG_BIG, cmp_op=nl.greater)
    on_above = nl.ndarray((C, C), dtype=f32, buffer=nl.sbuf)  # 0 where f >= p, NEG_BIG elsewhere
    nisa.affine_select(dst=on_above, pattern=[[1, C]], channel_multiplier=-1, on_true_tile=zeros,
                       on_false_value=NEG_BIG, cmp_op=nl.greater_equal)
    ident_mm = ident
    if mm != f32:
        ident_mm = nl.ndarray((C, C), dtype=mm, buffer=nl.sbuf)
        nisa.tensor_copy(dst=ident_mm, src=ident)
    eps_col = nl.ndarray((C, 1), dtype=f32, buffer=nl.sbuf)
    nisa.memset(eps_col, L2_EPS)
    masks = nl.ndarray((C, levels, C), dtype=f32, buffer=nl.sbuf)
    nisa.dma_copy(dst=masks, src=solve_masks.ap(pattern=[[C, C], [C * C, levels], [1, C]], offset=0))
    masks_mm = masks
    if mm != f32:
        masks_mm = nl.ndarray((C, levels, C), dtype=mm, buffer=nl.sbuf)
        nisa.tensor_copy(dst=masks_mm, src=masks)
    token = nl.ndarray((C, 1), dtype=f32, buffer=nl.sbuf)  # token index inside a chunk, one per partition
    nisa.iota(dst=token, pattern=[[0, 1]], offset=0, channel_multiplier=1)
    alog_bc = nl.ndarray((C, nv), dtype=f32, buffer=nl.sbuf)
    nisa.dma_copy(dst=alog_bc, src=A_log.ap(pattern=[[0, C], [1, nv]], offset=0))
    rate = nl.ndarray((C, nv), dtype=f32, buffer=nl.sbuf)  # exp(A_log)
    nisa.activation(dst=rate, op=nl.exp, data=alog_bc)
    dtb_bc = nl.ndarray((C, nv), dtype=f32, buffer=nl.sbuf)
    nisa.dma_copy(dst=dtb_bc, src=dt_bias.ap(pattern=[[0, C], [1, nv]], offset=0))
    len_bc = nl.ndarray((C, B), dtype=f32, buffer=nl.sbuf)
    nisa.dma_copy(dst=len_bc, src=lengths.ap(pattern=[[0, C], [1, B]], offset=0))

    for bi in range(B):
        for h0 in range(h_begin, h_end, HEADS_INTERLEAVED):
            # The heads advance in lockstep, statement by statement, so that each engine's instruction stream
            # alternates between independent heads and one head's dependency chain does not idle the others.
            hs = list(range(h0, min(h_end, h0 + HEADS_INTERLEAVED)))
            G = len(hs)
            views, S = [], []
            for h in hs:
                views.append(initial_recurrent.ap(pattern=[[dv, dk], [1, dv]], offset=(bi * nv + h) * dk * dv))
                s_tile = nl.ndarray((dk, dv), dtype=f32, buffer=nl.sbuf)
                nisa.dma_copy(dst=s_tile, src=views[-1])
                S.append(s_tile)

            # Software pipelining over chunks, in three stages per chunk, issued so that each engine's in-order
            # stream has independent work queued when a chunk's dependency chain stalls it:
            #   stage 1 (chunk c + 2): gates and q/k norms (VectorE/ScalarE/GpSimd only, inputs loaded a chunk ago);
            #   stage 2 (chunk c + 1): everything else that does not depend on the carried state: cumulative gates,
            #            decay, A, the intra-chunk attention, the solve T;
            #   stage 3 (chunk c): v' = T (beta v - beta exp(gc) K S), o, and the state update (the chain
            #            K S -> R -> v' -> o, k^T v' -> S, each step for all heads before the next).
            # The loads of chunk c + 3 go out before chunk c's output store.
            def stage1(pending, c):
                t0 = c * C
                n = min(C, T - t0)
                tiles, ab = pending
                Q, K, V = tiles["Q"], tiles["K"], tiles["V"]
                # gates of all the heads at once: [C, G]
                valid = nl.ndarray((C, 1), dtype=f32, buffer=nl.sbuf)  # t0 + p < lengths[b]
                nisa.tensor_scalar(dst=valid, data=token, op0=nl.add, operand0=float(t0), op1=nl.less,
                                   operand1=len_bc[:, bi:bi + 1])
                g_all = nl.ndarray((C, G), dtype=f32, buffer=nl.sbuf)
                nisa.tensor_tensor(dst=g_all, data1=ab["a"][:, hs[0]:hs[0] + G], data2=dtb_bc[:, hs[0]:hs[0] + G],
                                   op=nl.add)
                nisa.activation(dst=g_all, op=nl.softplus, data=g_all)
                nisa.tensor_tensor(dst=g_all, data1=g_all, data2=rate[:, hs[0]:hs[0] + G], op=nl.multiply)
                # g = -(exp(A_log) softplus(a + dt_bias)) * valid
                nisa.tensor_scalar(dst=g_all, data=g_all, op0=nl.multiply, operand0=valid, op1=nl.multiply,
                                   operand1=-1.0)
                # beta = sigmoid(b) rounded to the activation dtype, as the unfused model computes it
                beta_act = nl.ndarray((C, G), dtype=b.dtype, buffer=nl.sbuf)
                nisa.activation(dst=beta_act, op=nl.sigmoid, data=ab["b"][:, hs[0]:hs[0] + G])
                beta = nl.ndarray((C, G), dtype=f32, buffer=nl.sbuf)
                nisa.tensor_scalar(dst=beta, data=beta_act, op0=nl.multiply, operand0=valid)
                # q, k l2 norms: sums of squares on ScalarE, one rsqrt for all, the scaling on VectorE / GpSimd
                ssum = nl.ndarray((C, 2 * G), dtype=f32, buffer=nl.sbuf)
                for j in range(G):
                    for x, col in ((Q[j], j), (K[j], G + j)):
                        sq = nl.ndarray((C, dk), dtype=f32, buffer=nl.sbuf)
                        nisa.activation(dst=sq, op=nl.square, data=x, reduce_op=nl.add,
                                        reduce_res=ssum[:, col:col + 1], reduce_cmd=nisa.reduce_cmd.reset_reduce)
                inv = nl.ndarray((C, 2 * G), dtype=f32, buffer=nl.sbuf)
                nisa.activation(dst=inv, op=nl.rsqrt, data=ssum, bias=eps_col)
                nisa.tensor_scalar(dst=inv[:, 0:G], data=inv[:, 0:G], op0=nl.multiply, operand0=float(dk) ** -0.5)
                Qn, Kn = [], []  # on ScalarE, in order after the sums: the other engines' streams do not wait here
                for j in range(G):
                    Qn.append(nl.ndarray((C, dk), dtype=mm, buffer=nl.sbuf))
                    nisa.activation(dst=Qn[j], op=nl.copy, data=Q[j], scale=inv[:, j:j + 1])
                    Kn.append(nl.ndarray((C, dk), dtype=mm, buffer=nl.sbuf))
                    nisa.activation(dst=Kn[j], op=nl.copy, data=K[j], scale=inv[:, G + j:G + j + 1])
                return dict(t0=t0, n=n, V=V, Qn=Qn, Kn=Kn, g_all=g_all, beta=beta)

            def gc_prep(P):
                # cumulative gates of every head (two matmuls, fp32: they are exponentiated), their exponentials and
                # diag(gc) for the decay matrices; issued after the previous chunk's state chain, so that the
                # matmuls find their inputs ready and diag(gc) is there when stage 2 needs it
                g_all, beta = P["g_all"], P["beta"]
                gc_all = _matmul(upper, g_all, C, G, f32)
                g_tot_all = _matmul(ones, g_all, C, G, f32)
                e_gc = nl.ndarray((C, G), dtype=f32, buffer=nl.sbuf)  # exp(gc_i)
                nisa.activation(dst=e_gc, op=nl.exp, data=gc_all)
                e_tot = nl.ndarray((C, G), dtype=f32, buffer=nl.sbuf)  # exp(gc_C)
                nisa.activation(dst=e_tot, op=nl.exp, data=g_tot_all)
                to_end = nl.ndarray((C, G), dtype=f32, buffer=nl.sbuf)  # exp(gc_C - gc_i)
                nisa.tensor_tensor(dst=to_end, data1=g_tot_all, data2=gc_all, op=nl.subtract)
                nisa.activation(dst=to_end, op=nl.exp, data=to_end)
                nbe = nl.ndarray((C, G), dtype=f32, buffer=nl.sbuf)  # -beta exp(gc)
                nisa.scalar_tensor_tensor(dst=nbe, data=beta, op0=nl.multiply, operand0=-1.0, op1=nl.multiply,
                                          operand1=e_gc)
                diag_gc = []
                for j in range(G):
                    diag_gc.append(nl.ndarray((C, C), dtype=f32, buffer=nl.sbuf))
                    nisa.tensor_scalar(dst=diag_gc[j], data=ident, op0=nl.multiply, operand0=gc_all[:, j:j + 1],
                                       engine=nisa.engine.gpsimd)
                P.update(gc_all=gc_all, e_gc=e_gc, e_tot=e_tot, to_end=to_end, nbe=nbe, diag_gc=diag_gc)

            def stage2(P):
                Qn, Kn, beta, gc_all, diag_gc = P["Qn"], P["Kn"], P["beta"], P["gc_all"], P["diag_gc"]
                # TensorE transposes k while the decay factors are formed
                KT = [_transpose(Kn[j], C, dk, mm) for j in range(G)]
                # decay[i, j] = exp(gc_i - gc_j) for j < i and decayT[j, i] for j <= i, from gc_j along the free
                # axis: ones^T diag(gc) (the ones stay loaded)
                decay, decayT = [], []
                for j in range(G):
                    gc_rows = nl.ndarray((C, C), dtype=f32, buffer=nl.psum)  # [p, f] = gc_f
                    nisa.nc_matmul(dst=gc_rows, stationary=ones, moving=diag_gc[j])
                    logd = nl.ndarray((C, C), dtype=f32, buffer=nl.sbuf)  # gc_p - gc_f for f < p, else -3e38
                    nisa.scalar_tensor_tensor(dst=logd, data=gc_rows, op0=nl.subtract,
                                              operand0=gc_all[:, j:j + 1], reverse0=True, op1=nl.add, operand1=below)
                    decay.append(nl.ndarray((C, C), dtype=f32, buffer=nl.sbuf))
                    nisa.activation(dst=decay[j], op=nl.exp, data=logd)
                    logdT = nl.ndarray((C, C), dtype=f32, buffer=nl.sbuf)  # gc_f - gc_p for f >= p, else -3e38
                    nisa.scalar_tensor_tensor(dst=logdT, data=gc_rows, op0=nl.subtract,
                                              operand0=gc_all[:, j:j + 1], op1=nl.add, operand1=on_above)
                    decayT.append(nl.ndarray((C, C), dtype=f32, buffer=nl.sbuf))
                    nisa.activation(dst=decayT[j], op=nl.exp, data=logdT)
                # TensorE: q transposes and k.k, k.q while the decay factors are formed
                QT = [_transpose(Qn[j], C, dk, mm) for j in range(G)]
                A, intraT = [], []
                for j in range(G):
                    KK = nl.ndarray((C, C), dtype=f32, buffer=nl.psum)  # k_i . k_j
                    nisa.nc_matmul(dst=KK, stationary=KT[j], moving=KT[j])
                    KQ = nl.ndarray((C, C), dtype=f32, buffer=nl.psum)  # [j, i] = k_j . q_i (same stationary)
                    nisa.nc_matmul(dst=KQ, stationary=KT[j], moving=QT[j])
                    # A = strictly_lower(beta_i k_i.k_j decay[i, j]); intra^T[j, i] = k_j.q_i decay[i, j], j <= i
                    A.append(nl.ndarray((C, C), dtype=mm, buffer=nl.sbuf))
                    nisa.scalar_tensor_tensor(dst=A[j], data=KK, op0=nl.multiply, operand0=beta[:, j:j + 1],
                                              op1=nl.multiply, operand1=decay[j])
                    intraT.append(nl.ndarray((C, C), dtype=mm, buffer=nl.sbuf))
                    nisa.tensor_tensor(dst=intraT[j], data1=KQ, data2=decayT[j], op=nl.multiply)
                AT = [_transpose(A[j], C, C, mm) for j in range(G)]
                # T = (I + A)^-1, recursive block inversion. Level 0 (s = 1) needs no matmul: T = I - A * M_1.
                Tm, TmT = [], []
                for j in range(G):
                    Tm.append(nl.ndarray((C, C), dtype=mm, buffer=nl.sbuf))
                    nisa.tensor_tensor(dst=Tm[j], data1=A[j], data2=masks_mm[:, 0, :], op=nl.multiply,
                                       engine=nisa.engine.gpsimd)
                    nisa.tensor_tensor(dst=Tm[j], data1=ident_mm, data2=Tm[j], op=nl.subtract)
                    TmT.append(nl.ndarray((C, C), dtype=mm, buffer=nl.sbuf))
                    nisa.tensor_tensor(dst=TmT[j], data1=AT[j], data2=masks_mm[:, 0, :], op=nl.multiply,
                                       engine=nisa.engine.gpsimd)
                    nisa.tensor_tensor(dst=TmT[j], data1=ident_mm, data2=TmT[j], op=nl.subtract)
                # (A * M_s)^T of every level, as soon as A^T is there (GpSimd runs ahead of the solve's matmuls)
                AoffT = []
                for lvl in range(1, levels):
                    AoffT.append([])
                    for j in range(G):
                        t = nl.ndarray((C, C), dtype=mm, buffer=nl.sbuf)  # M_s is symmetric
                        nisa.tensor_tensor(dst=t, data1=AT[j], data2=masks_mm[:, lvl, :], op=nl.multiply,
                                           engine=nisa.engine.gpsimd)
                        AoffT[-1].append(t)

                for lvl in range(1, levels):
                    # Only the first-half columns of each 2s-block change at this level (T A_s T is zero elsewhere):
                    # the moving operands and the update are those C / 2 columns, a strided view [C, C / 2s, s].
                    half = 1 << lvl
                    cols = [t[:, :].reshape((C, C // (2 * half), 2, half))[:, :, 0, :] for t in Tm]
                    Y = []
                    for j in range(G):
                        Yp = nl.ndarray((C, C // (2 * half), half), dtype=f32, buffer=nl.psum)
                        nisa.nc_matmul(dst=Yp, stationary=AoffT[lvl - 1][j], moving=cols[j])  # (A * M_s) T
                        Ys = nl.ndarray((C, C // (2 * half), half), dtype=mm, buffer=nl.sbuf)
                        nisa.tensor_copy(dst=Ys, src=Yp, engine=nisa.engine.scalar)
                        Y.append(Ys)
                    for j in range(G):
                        Z = nl.ndarray((C, C // (2 * half), half), dtype=f32, buffer=nl.psum)
                        nisa.nc_matmul(dst=Z, stationary=TmT[j], moving=Y[j])  # T (A * M_s) T
                        nisa.tensor_tensor(dst=cols[j], data1=cols[j], data2=Z, op=nl.subtract)
                    for j in range(G):
                        TmT[j] = _transpose(Tm[j], C, C, mm)
                P.update(KT=KT, QT=QT, intraT=intraT, TmT=TmT)
                return P

            def stage3(P):
                t0, n, V, Kn, KT, QT = P["t0"], P["n"], P["V"], P["Kn"], P["KT"], P["QT"]
                intraT, TmT, beta, nbe = P["intraT"], P["TmT"], P["beta"], P["nbe"]
                e_gc, e_tot, to_end = P["e_gc"], P["e_tot"], P["to_end"]
                # v' = T (beta v - beta exp(gc) K S)  (= u - w S of the WY form: one solve, one right-hand side)
                S_mm, bv, Kd = [], [], []
                for j in range(G):
                    if mm == f32:
                        S_mm.append(S[j])
                    else:
                        S_mm.append(nl.ndarray((dk, dv), dtype=mm, buffer=nl.sbuf))
                        nisa.tensor_copy(dst=S_mm[j], src=S[j], engine=nisa.engine.gpsimd)
                    bv.append(nl.ndarray((C, dv), dtype=f32, buffer=nl.sbuf))
                    nisa.tensor_scalar(dst=bv[j], data=V[j], op0=nl.multiply, operand0=beta[:, j:j + 1],
                                       engine=nisa.engine.gpsimd)
                    Kd.append(nl.ndarray((C, dk), dtype=mm, buffer=nl.sbuf))  # k exp(gc_C - gc)
                    nisa.tensor_scalar(dst=Kd[j], data=Kn[j], op0=nl.multiply, operand0=to_end[:, j:j + 1],
                                       engine=nisa.engine.gpsimd)
                KS = []
                for j in range(G):
                    KS.append(nl.ndarray((C, dv), dtype=f32, buffer=nl.psum))
                    nisa.nc_matmul(dst=KS[j], stationary=KT[j], moving=S_mm[j])
                R = []
                for j in range(G):
                    R.append(nl.ndarray((C, dv), dtype=mm, buffer=nl.sbuf))
                    nisa.scalar_tensor_tensor(dst=R[j], data=KS[j], op0=nl.multiply, operand0=nbe[:, j:j + 1],
                                              op1=nl.add, operand1=bv[j])
                qs = []
                for j in range(G):  # q S, while R is formed
                    qs.append(nl.ndarray((C, dv), dtype=f32, buffer=nl.psum))
                    nisa.nc_matmul(dst=qs[j], stationary=QT[j], moving=S_mm[j])
                v_new = [_matmul(TmT[j], R[j], C, dv, mm, engine=nisa.engine.scalar) for j in range(G)]
                o_stage = nl.ndarray((C, G, dv), dtype=f32, buffer=nl.sbuf)
                for j in range(G):
                    o1 = nl.ndarray((C, dv), dtype=f32, buffer=nl.sbuf)
                    nisa.activation(dst=o1, op=nl.copy, data=qs[j], scale=e_gc[:, j:j + 1])
                    o2 = nl.ndarray((C, dv), dtype=f32, buffer=nl.psum)
                    nisa.nc_matmul(dst=o2, stationary=intraT[j], moving=v_new[j])
                    nisa.tensor_tensor(dst=o_stage[:, j, :], data1=o1, data2=o2, op=nl.add)
                for j in range(G):
                    kv = nl.ndarray((dk, dv), dtype=f32, buffer=nl.psum)
                    nisa.nc_matmul(dst=kv, stationary=Kd[j], moving=v_new[j])
                    S_next = nl.ndarray((dk, dv), dtype=f32, buffer=nl.sbuf)
                    nisa.scalar_tensor_tensor(dst=S_next, data=S[j], op0=nl.multiply, operand0=e_tot[0:dk, j:j + 1],
                                              op1=nl.add, operand1=kv)
                    S[j] = S_next
                return o_stage

            def store(o_stage, t0, n):
                # every head's output of the chunk in one transfer: o_out[bi, h, t0 + p, :] <- o_stage[p, h, :]
                nisa.dma_copy(dst=o_out.ap(pattern=[[dv, n], [T * dv, G], [1, dv]],
                                           offset=((bi * nv + hs[0]) * T + t0) * dv),
                              src=o_stage[0:n, :, :])

            def load(c):
                return _load_chunk(q, k, v, a, b, bi, hs, group, c) if c < n_chunks else None

            loads = {c: load(c) for c in range(3)}
            s1 = {c: stage1(loads.pop(c), c) for c in range(2) if c < n_chunks}
            for P in s1.values():
                gc_prep(P)
            s2 = {0: stage2(s1.pop(0))}
            for c in range(n_chunks):
                if c + 2 < n_chunks:
                    s1[c + 2] = stage1(loads.pop(c + 2), c + 2)
                    loads[c + 3] = load(c + 3)
                if c + 1 < n_chunks:
                    s2[c + 1] = stage2(s1.pop(c + 1))
                P = s2.pop(c)
                store(stage3(P), P["t0"], P["n"])
                if c + 2 < n_chunks:
                    gc_prep(s1[c + 2])

            for j in range(G):
                nisa.dma_copy(dst=state_out[bi, hs[j]], src=S[j])
    return o_out, state_out

