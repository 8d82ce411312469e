"""NKI kernel: a prompt's routed experts over the filled blocks only (issue 51).

    out = moe_blocks_kernel(x_t, gate_up_t, down_t, used, start, end, n_used, out)

- x_t [nb, H, B]: the block rows (layout.py), transposed (hidden on the partitions: the contraction of gate/up);
- gate_up_t [E, H, 2I], down_t [E, I, H]: each expert's weights, contraction first (gate columns then up columns);
- used, start, end [E, 1] int32, n_used [1, 1] int32: the loop tables (layout.py);
- out [nb, B, H] fp32, the caller's buffer (as the NKI Library's MoE kernels take `output_out`), returned: each
  filled block's expert output, SiLU(x Wg) * (x Wu) Wd, written; blocks past the filled ones are left as they were
  (the caller reads only filled rows; the op hands a zeroed buffer, so its result is defined).

Control flow (nl.dynamic_range over registers, the NKI Dynamic Loops page): the outer loop runs n_used times (read
into a register from `n_used`), one iteration per used expert u: its id, start and end are loaded into registers,
its weights loaded into SBUF once, then the inner loop runs over its blocks [start, end). Unused experts cost nothing,
padding blocks past the filled ones are never visited: executed work is sum over used experts of ceil(n_e / B) blocks,
whatever the static bound nb. As the NKI Library's `bwmm_shard_on_block` ("dynamic early-exit") skips padded blocks;
written here from the NKI documentation, nothing of that kernel copied (its source is not in reach here).

Tiling: H in tiles of 128 partitions (H <= 128 or a multiple of 128), I in tiles of <= 128 (the gate/up PSUM
partitions and the down projection's contraction), B <= 128 (the down projection's stationary free size), the down
projection's output in chunks of <= 512 columns (one PSUM bank). Operands in the weights' dtype, fp32 PSUM.
"""

from __future__ import annotations

from optimum_qwen35.kernels.nki_import import nki, nisa, nl

P = 128
CHUNK = 512


def _tiles(n: int, size: int) -> list[tuple[int, int]]:
    return [(i, min(size, n - i)) for i in range(0, n, size)]


@nki.jit
def moe_blocks_kernel(x_t, gate_up_t, down_t, used, start, end, n_used, out):
    nb, H, B = x_t.shape
    E, _, I2 = gate_up_t.shape
    I = I2 // 2
    assert B <= P and (H <= P or H % P == 0), "block rows <= 128; hidden <= 128 or a multiple of 128"
    f32, wdt = nl.float32, gate_up_t.dtype
    h_tiles, i_tiles, h_chunks = _tiles(H, P), _tiles(I, P), _tiles(H, CHUNK)

    # Weights of the current expert (SBUF, reused by all its blocks), the block's rows, the activations.
    w_gu = [nl.ndarray((hs, I2), dtype=wdt, buffer=nl.sbuf) for _, hs in h_tiles]
    w_d = [nl.ndarray((isz, H), dtype=wdt, buffer=nl.sbuf) for _, isz in i_tiles]
    x_sb = [nl.ndarray((hs, B), dtype=wdt, buffer=nl.sbuf) for _, hs in h_tiles]
    act = [nl.ndarray((isz, B), dtype=wdt, buffer=nl.sbuf) for _, isz in i_tiles]
    gate = nl.ndarray((P, B), dtype=f32, buffer=nl.sbuf)
    o_sb = nl.ndarray((B, min(H, CHUNK)), dtype=f32, buffer=nl.sbuf)
    scalar = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    expert = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)

    n_reg = nisa.register_alloc()
    nisa.dma_copy(dst=scalar, src=n_used)
    nisa.register_load(n_reg, scalar)
    lo, hi = nisa.register_alloc(), nisa.register_alloc()
    for u in nl.dynamic_range(n_reg):
        # This expert's id (a runtime offset into the weights) and block range.
        nisa.dma_copy(dst=expert, src=used.ap([[1, 1], [1, 1]], scalar_offset=u))
        nisa.dma_copy(dst=scalar, src=start.ap([[1, 1], [1, 1]], scalar_offset=u))
        nisa.register_load(lo, scalar)
        nisa.dma_copy(dst=scalar, src=end.ap([[1, 1], [1, 1]], scalar_offset=u))
        nisa.register_load(hi, scalar)
        for t, (h0, hs) in enumerate(h_tiles):
            nisa.dma_copy(dst=w_gu[t], src=gate_up_t.ap([[H * I2, 1], [I2, hs], [1, I2]], offset=h0 * I2,
                                                         scalar_offset=expert, indirect_dim=0))
        for j, (i0, isz) in enumerate(i_tiles):
            nisa.dma_copy(dst=w_d[j], src=down_t.ap([[I * H, 1], [H, isz], [1, H]], offset=i0 * H,
                                                     scalar_offset=expert, indirect_dim=0))
        for b in nl.dynamic_range(lo, hi):
            for t, (h0, hs) in enumerate(h_tiles):
                nisa.dma_copy(dst=x_sb[t], src=x_t.ap([[H * B, 1], [B, hs], [1, B]], offset=h0 * B, scalar_offset=b,
                                                      indirect_dim=0))
            for j, (i0, isz) in enumerate(i_tiles):
                g_ps = nl.ndarray((isz, B), dtype=f32, buffer=nl.psum)
                u_ps = nl.ndarray((isz, B), dtype=f32, buffer=nl.psum)
                for t, (_, hs) in enumerate(h_tiles):
                    first = t == 0
                    nisa.nc_matmul(dst=g_ps, stationary=w_gu[t][:, i0 : i0 + isz], moving=x_sb[t], accumulate=not first)
                    nisa.nc_matmul(dst=u_ps, stationary=w_gu[t][:, I + i0 : I + i0 + isz], moving=x_sb[t],
                                   accumulate=not first)
                nisa.activation(dst=gate[0:isz, :], op=nl.silu, data=g_ps)
                nisa.tensor_tensor(dst=act[j], data1=gate[0:isz, :], data2=u_ps, op=nl.multiply)
            for c0, cs in h_chunks:
                o_ps = nl.ndarray((B, cs), dtype=f32, buffer=nl.psum)
                for j in range(len(i_tiles)):
                    nisa.nc_matmul(dst=o_ps, stationary=act[j], moving=w_d[j][:, c0 : c0 + cs], accumulate=j > 0)
                nisa.tensor_copy(dst=o_sb[:, 0:cs], src=o_ps)
                nisa.dma_copy(dst=out.ap([[B * H, 1], [H, B], [1, cs]], offset=c0, scalar_offset=b, indirect_dim=0),
                              src=o_sb[:, 0:cs])
    return out
