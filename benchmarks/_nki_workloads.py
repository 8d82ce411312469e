"""Kernels that follow the Neuron documentation's own NKI examples, written for NKI 0.3, in this project's words.

They are the cost model's calibration workloads (benchmarks/nki_cost_model.py) and the emulator's end-to-end tests
(tests/emulator import them from here: benchmark code, neither the installed package nor the test kit):

* ``matmul_tiled``, ``matmul_hoisted``, ``matmul_block_free``, ``matmul_fully_blocked``: the four steps of the
  "Matrix multiplication" / "Introduction to NKI kernel optimization" tutorials.
* ``mamba_v1``, ``mamba_v2``: the "Fused Mamba" tutorial (selective scan with ``tensor_tensor_scan``).
* ``softmax_rows`` and ``attention_head``: the fused self-attention pattern of the "Fused Self Attention" tutorial
  (``QK^T`` on TensorE, a row softmax with ``activation`` + accumulate, a TensorE transpose, ``PV``).
* ``linear_recurrence``: ``h[t] = a[t] * h[t-1] + b[t]`` along the free axis with ``tensor_tensor_scan``, carried
  across tiles of the sequence.

They are written against the NKI 0.3 API and decorated with the emulator's ``nki.jit`` (they are the emulator's
workloads); on a Neuron host the undecorated function, ``kernel.__wrapped__``, can be given to the real ``nki.jit``.
"""

from __future__ import annotations

from optimum_qwen35.kernels.emulator import nki

nl, nisa = nki.language, nki.isa

TILE_K = 128  # partition (contraction) tile
TILE_M = 128  # stationary free size
TILE_N = 512  # moving free size


# --------------------------------------------------------------------------------------------------- matmul steps
@nki.jit
def matmul_tiled(lhsT, rhs):
    """``lhsT.T @ rhs``: for each output tile, load one lhsT and one rhs tile per K step and accumulate in PSUM."""
    K, M = lhsT.shape
    _, N = rhs.shape
    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in nl.affine_range(M // TILE_M):
        for n in nl.affine_range(N // TILE_N):
            acc = nl.ndarray((TILE_M, TILE_N), dtype=nl.float32, buffer=nl.psum)
            for k in nl.affine_range(K // TILE_K):
                a = nl.ndarray((TILE_K, TILE_M), dtype=lhsT.dtype, buffer=nl.sbuf)
                b = nl.ndarray((TILE_K, TILE_N), dtype=rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=a, src=lhsT[k * TILE_K:(k + 1) * TILE_K, m * TILE_M:(m + 1) * TILE_M])
                nisa.dma_copy(dst=b, src=rhs[k * TILE_K:(k + 1) * TILE_K, n * TILE_N:(n + 1) * TILE_N])
                nisa.nc_matmul(dst=acc, stationary=a, moving=b)
            out = nl.ndarray((TILE_M, TILE_N), dtype=result.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=out, src=acc)
            nisa.dma_copy(dst=result[m * TILE_M:(m + 1) * TILE_M, n * TILE_N:(n + 1) * TILE_N], src=out)
    return result


@nki.jit
def matmul_hoisted(lhsT, rhs):
    """As ``matmul_tiled``, with the lhsT column of tiles loaded once per ``m`` and the rhs column once per ``n``."""
    K, M = lhsT.shape
    _, N = rhs.shape
    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in nl.affine_range(M // TILE_M):
        a_tiles = []
        for k in nl.affine_range(K // TILE_K):
            a = nl.ndarray((TILE_K, TILE_M), dtype=lhsT.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=a, src=lhsT[k * TILE_K:(k + 1) * TILE_K, m * TILE_M:(m + 1) * TILE_M])
            a_tiles.append(a)
        del a
        for n in nl.affine_range(N // TILE_N):
            b_tiles = []
            for k in nl.affine_range(K // TILE_K):
                b = nl.ndarray((TILE_K, TILE_N), dtype=rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=b, src=rhs[k * TILE_K:(k + 1) * TILE_K, n * TILE_N:(n + 1) * TILE_N])
                b_tiles.append(b)
            acc = nl.ndarray((TILE_M, TILE_N), dtype=nl.float32, buffer=nl.psum)
            for k in nl.affine_range(K // TILE_K):
                nisa.nc_matmul(dst=acc, stationary=a_tiles[k], moving=b_tiles[k])
            del b
            out = nl.ndarray((TILE_M, TILE_N), dtype=result.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=out, src=acc)
            nisa.dma_copy(dst=result[m * TILE_M:(m + 1) * TILE_M, n * TILE_N:(n + 1) * TILE_N], src=out)
            del b_tiles
        del a_tiles
    return result


@nki.jit
def matmul_block_free(lhsT, rhs, tiles_m=2, tiles_n=2):
    """Blocks of ``tiles_m`` x ``tiles_n`` output tiles share their loaded lhsT/rhs tiles."""
    K, M = lhsT.shape
    _, N = rhs.shape
    block_m, block_n = TILE_M * tiles_m, TILE_N * tiles_n
    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in nl.affine_range(M // block_m):
        a_tiles = [[None] * (K // TILE_K) for _ in range(tiles_m)]
        for bm in range(tiles_m):
            for k in nl.affine_range(K // TILE_K):
                a = nl.ndarray((TILE_K, TILE_M), dtype=lhsT.dtype, buffer=nl.sbuf)
                col = m * block_m + bm * TILE_M
                nisa.dma_copy(dst=a, src=lhsT[k * TILE_K:(k + 1) * TILE_K, col:col + TILE_M])
                a_tiles[bm][k] = a
        del a
        for n in nl.affine_range(N // block_n):
            b_tiles = [[None] * (K // TILE_K) for _ in range(tiles_n)]
            for bn in range(tiles_n):
                for k in nl.affine_range(K // TILE_K):
                    b = nl.ndarray((TILE_K, TILE_N), dtype=rhs.dtype, buffer=nl.sbuf)
                    col = n * block_n + bn * TILE_N
                    nisa.dma_copy(dst=b, src=rhs[k * TILE_K:(k + 1) * TILE_K, col:col + TILE_N])
                    b_tiles[bn][k] = b
            del b
            for bm in range(tiles_m):
                for bn in range(tiles_n):
                    acc = nl.ndarray((TILE_M, TILE_N), dtype=nl.float32, buffer=nl.psum)
                    for k in nl.affine_range(K // TILE_K):
                        nisa.nc_matmul(dst=acc, stationary=a_tiles[bm][k], moving=b_tiles[bn][k])
                    out = nl.ndarray((TILE_M, TILE_N), dtype=result.dtype, buffer=nl.sbuf)
                    nisa.tensor_copy(dst=out, src=acc)
                    row, col = m * block_m + bm * TILE_M, n * block_n + bn * TILE_N
                    nisa.dma_copy(dst=result[row:row + TILE_M, col:col + TILE_N], src=out)
            del b_tiles
        del a_tiles
    return result


@nki.jit
def matmul_fully_blocked(lhsT, rhs, tiles_m=16, tiles_n=2, tiles_k=8):
    """All three dimensions blocked; partial sums over K blocks accumulate in SBUF with ``tensor_tensor``."""
    K, M = lhsT.shape
    _, N = rhs.shape
    block_m, block_n, block_k = TILE_M * tiles_m, TILE_N * tiles_n, TILE_K * tiles_k
    result = nl.ndarray((M, N), dtype=nl.float32, buffer=nl.shared_hbm)
    for n in nl.affine_range(N // block_n):
        partial = [[[None] * tiles_n for _ in range(tiles_m)] for _ in range(M // block_m)]
        for m in range(M // block_m):
            for bm in range(tiles_m):
                for bn in range(tiles_n):
                    t = nl.ndarray((TILE_M, TILE_N), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.memset(dst=t, value=0.0)
                    partial[m][bm][bn] = t
                    del t
        for k in nl.sequential_range(K // block_k):
            b_tiles = []
            for bk in range(tiles_k):
                b = nl.ndarray((TILE_K, block_n), dtype=rhs.dtype, buffer=nl.sbuf)
                row = (k * tiles_k + bk) * TILE_K
                nisa.dma_copy(dst=b, src=rhs[row:row + TILE_K, n * block_n:(n + 1) * block_n])
                b_tiles.append(b)
            del b
            for m in nl.affine_range(M // block_m):
                a_tiles = []
                for bk in range(tiles_k):
                    a = nl.ndarray((TILE_K, block_m), dtype=lhsT.dtype, buffer=nl.sbuf)
                    row = (k * tiles_k + bk) * TILE_K
                    nisa.dma_copy(dst=a, src=lhsT[row:row + TILE_K, m * block_m:(m + 1) * block_m])
                    a_tiles.append(a)
                del a
                for bn in range(tiles_n):
                    for bm in range(tiles_m):
                        acc = nl.ndarray((TILE_M, TILE_N), dtype=nl.float32, buffer=nl.psum)
                        for bk in range(tiles_k):
                            nisa.nc_matmul(dst=acc, stationary=a_tiles[bk][:, bm * TILE_M:(bm + 1) * TILE_M],
                                           moving=b_tiles[bk][:, bn * TILE_N:(bn + 1) * TILE_N])
                        nisa.tensor_tensor(dst=partial[m][bm][bn], data1=partial[m][bm][bn], data2=acc, op=nl.add)
                del a_tiles
            del b_tiles
        for m in range(M // block_m):
            for bm in range(tiles_m):
                packed = nl.ndarray((TILE_M, block_n), dtype=nl.float32, buffer=nl.sbuf)
                for bn in range(tiles_n):
                    nisa.tensor_copy(dst=packed[:, bn * TILE_N:(bn + 1) * TILE_N], src=partial[m][bm][bn])
                row = (m * tiles_m + bm) * TILE_M
                nisa.dma_copy(dst=result[row:row + TILE_M, n * block_n:(n + 1) * block_n], src=packed)
                del packed
        del partial
    return result


# ---------------------------------------------------------------------------------------------------- fused mamba
def _mamba_state_step(delta_i, u_i, A, B, C, i_batch, c0, i_state, accum, seq_len):
    a_col = nl.ndarray((128, 1), dtype=A.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=a_col, src=A[c0:c0 + 128, i_state:i_state + 1])
    decay = nl.ndarray((128, seq_len), dtype=delta_i.dtype, buffer=nl.sbuf)
    nisa.activation(dst=decay, op=nl.exp, data=delta_i, scale=a_col)  # exp(delta * A)
    b_row = nl.ndarray((1, seq_len), dtype=B.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=b_row, src=B[i_batch, i_state:i_state + 1, :])
    du = nl.ndarray((128, seq_len), dtype=delta_i.dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=du, data1=delta_i, data2=u_i, op=nl.multiply)
    dbu = nl.ndarray((128, seq_len), dtype=delta_i.dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=dbu, data1=du, data2=nl.broadcast_to(b_row, (128, seq_len)), op=nl.multiply)
    h = nl.ndarray((128, seq_len), dtype=delta_i.dtype, buffer=nl.sbuf)
    nisa.tensor_tensor_scan(dst=h, data0=decay, data1=dbu, initial=0.0, op0=nl.multiply, op1=nl.add)
    c_row = nl.ndarray((1, seq_len), dtype=C.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=c_row, src=C[i_batch, i_state:i_state + 1, :])
    y = nl.ndarray((128, seq_len), dtype=delta_i.dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=y, data1=h, data2=nl.broadcast_to(c_row, (128, seq_len)), op=nl.multiply)
    nisa.tensor_tensor(dst=accum, data1=accum, data2=y, op=nl.add)


@nki.jit
def mamba_v1(delta, u, A, B, C):
    """Selective scan of the Fused Mamba tutorial, first version: the state loop outside the channel-tile loop, so
    ``delta`` and ``u`` tiles are reloaded for every state. Shapes: delta, u (batch, channels, seq); A (channels,
    state); B, C (batch, state, seq). Output (batch, channels, seq)."""
    batch, channels, seq_len = delta.shape
    n_state = A.shape[1]
    out = nl.ndarray(delta.shape, dtype=delta.dtype, buffer=nl.shared_hbm)
    for i_batch in nl.affine_range(batch):
        accums = []
        for t in range(channels // 128):
            acc = nl.ndarray((128, seq_len), dtype=delta.dtype, buffer=nl.sbuf)
            nisa.memset(dst=acc, value=0.0)
            accums.append(acc)
        for i_state in nl.affine_range(n_state):
            for t in nl.affine_range(channels // 128):
                c0 = t * 128
                delta_i = nl.ndarray((128, seq_len), dtype=delta.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=delta_i, src=delta[i_batch, c0:c0 + 128, :])
                u_i = nl.ndarray((128, seq_len), dtype=u.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=u_i, src=u[i_batch, c0:c0 + 128, :])
                _mamba_state_step(delta_i, u_i, A, B, C, i_batch, c0, i_state, accums[t], seq_len)
        for t in nl.affine_range(channels // 128):
            nisa.dma_copy(dst=out[i_batch, t * 128:(t + 1) * 128, :], src=accums[t])
    return out


@nki.jit
def mamba_v2(delta, u, A, B, C):
    """Fused Mamba, second version: channel tiles outside, states inside, ``delta``/``u`` loaded once per tile."""
    batch, channels, seq_len = delta.shape
    n_state = A.shape[1]
    out = nl.ndarray(delta.shape, dtype=delta.dtype, buffer=nl.shared_hbm)
    for i_batch in nl.affine_range(batch):
        for t in nl.affine_range(channels // 128):
            c0 = t * 128
            acc = nl.ndarray((128, seq_len), dtype=delta.dtype, buffer=nl.sbuf)
            nisa.memset(dst=acc, value=0.0)
            delta_i = nl.ndarray((128, seq_len), dtype=delta.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=delta_i, src=delta[i_batch, c0:c0 + 128, :])
            u_i = nl.ndarray((128, seq_len), dtype=u.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=u_i, src=u[i_batch, c0:c0 + 128, :])
            for i_state in nl.affine_range(n_state):
                _mamba_state_step(delta_i, u_i, A, B, C, i_batch, c0, i_state, acc, seq_len)
            nisa.dma_copy(dst=out[i_batch, c0:c0 + 128, :], src=acc)
    return out


# --------------------------------------------------------------------------------------------- softmax, attention
@nki.jit
def softmax_rows(x):
    """Row softmax of an (R, F) HBM tensor, R tiled by 128 partitions: max with ``tensor_reduce``, ``exp(x - max)``
    with ``activation`` (bias = -max) summed by its accumulator, then a multiply by the reciprocal."""
    rows, cols = x.shape
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    for r in nl.affine_range((rows + 127) // 128):
        p = min(128, rows - r * 128)
        tile = nl.ndarray((p, cols), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x[r * 128:r * 128 + p, :])
        neg_max = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=neg_max, op=nl.maximum, data=tile, axis=1, negate=True, keepdims=True)
        e = nl.ndarray((p, cols), dtype=nl.float32, buffer=nl.sbuf)
        total = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=e, op=nl.exp, data=tile, bias=neg_max, reduce_op=nl.add, reduce_res=total,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        inv = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(dst=inv, data=total)
        y = nl.ndarray((p, cols), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=y, data=e, op0=nl.multiply, operand0=inv)
        nisa.dma_copy(dst=out[r * 128:r * 128 + p, :], src=y)
    return out


@nki.jit
def attention_head(qT, kT, v, causal=False):
    """One attention head, ``softmax(q k^T / sqrt(d)) v``, following the fused self-attention tutorial's layout.

    qT, kT: (d, S) with d <= 128 on partitions (the contraction of ``QK^T``); v: (S, d). S a multiple of 128, <= 512.
    Scores of a 128-query tile land in PSUM (128, S); softmax along the free axis; the probabilities are transposed
    128x128 at a time on TensorE so that ``P V`` contracts over keys on partitions.
    """
    d, S = qT.shape
    scale = 1.0 / float(d) ** 0.5
    out = nl.ndarray((S, d), dtype=v.dtype, buffer=nl.shared_hbm)
    q_sb = nl.ndarray((d, S), dtype=qT.dtype, buffer=nl.sbuf)
    k_sb = nl.ndarray((d, S), dtype=kT.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=q_sb, src=qT)
    nisa.dma_copy(dst=k_sb, src=kT)
    v_tiles = []
    for j in range(S // 128):
        vt = nl.ndarray((128, d), dtype=v.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=vt, src=v[j * 128:(j + 1) * 128, :])
        v_tiles.append(vt)
    for i in nl.affine_range(S // 128):
        scores_ps = nl.ndarray((128, S), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=scores_ps, stationary=q_sb[:, i * 128:(i + 1) * 128], moving=k_sb)
        scores = nl.ndarray((128, S), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=scores, data=scores_ps, op0=nl.multiply, operand0=scale)
        if causal:  # keep key j <= query i*128 + p, i.e. (i*128 + p) - j >= 0
            masked = nl.ndarray((128, S), dtype=nl.float32, buffer=nl.sbuf)
            nisa.affine_select(dst=masked, pattern=[[-1, S]], offset=i * 128, channel_multiplier=1,
                               on_true_tile=scores, on_false_value=-30000.0, cmp_op=nl.greater_equal)
            scores = masked
        neg_max = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=neg_max, op=nl.maximum, data=scores, axis=1, negate=True, keepdims=True)
        probs = nl.ndarray((128, S), dtype=v.dtype, buffer=nl.sbuf)
        total = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=probs, op=nl.exp, data=scores, bias=neg_max, reduce_op=nl.add, reduce_res=total,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        inv = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(dst=inv, data=total)
        o_ps = nl.ndarray((128, d), dtype=nl.float32, buffer=nl.psum)
        for j in range(S // 128):
            pT_ps = nl.ndarray((128, 128), dtype=probs.dtype, buffer=nl.psum)
            nisa.nc_transpose(dst=pT_ps, data=probs[:, j * 128:(j + 1) * 128], engine=nisa.engine.tensor)
            pT = nl.ndarray((128, 128), dtype=probs.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=pT, src=pT_ps)
            nisa.nc_matmul(dst=o_ps, stationary=pT, moving=v_tiles[j], accumulate=(j > 0))
        o = nl.ndarray((128, d), dtype=v.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=o, data=o_ps, op0=nl.multiply, operand0=inv)
        nisa.dma_copy(dst=out[i * 128:(i + 1) * 128, :], src=o)
    return out


# ----------------------------------------------------------------------------------------------------------- scan
@nki.jit
def linear_recurrence(a, b, h0, tile=512):
    """``h[:, t] = a[:, t] * h[:, t-1] + b[:, t]`` with ``h[:, -1] = h0``; a, b: (P <= 128, T); h0: (P, 1).

    The sequence is processed in tiles of ``tile`` steps; each tile's last state seeds the next tile's scan
    (``initial`` as a (P, 1) tile), as in the long-sequence version of the Fused Mamba tutorial."""
    P, T = a.shape
    out = nl.ndarray((P, T), dtype=a.dtype, buffer=nl.shared_hbm)
    carry = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=carry, src=h0)
    for s in nl.sequential_range((T + tile - 1) // tile):
        w = min(tile, T - s * tile)
        a_t = nl.ndarray((P, w), dtype=a.dtype, buffer=nl.sbuf)
        b_t = nl.ndarray((P, w), dtype=b.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=a_t, src=a[:, s * tile:s * tile + w])
        nisa.dma_copy(dst=b_t, src=b[:, s * tile:s * tile + w])
        h = nl.ndarray((P, w), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor_scan(dst=h, data0=a_t, data1=b_t, initial=carry, op0=nl.multiply, op1=nl.add)
        nisa.tensor_copy(dst=carry, src=h[:, w - 1:w])
        h_out = nl.ndarray((P, w), dtype=a.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=h_out, src=h)
        nisa.dma_copy(dst=out[:, s * tile:s * tile + w], src=h_out)
    return out
