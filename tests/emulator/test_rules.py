"""Every hardware rule of the emulator: a kernel that breaks it, and the error naming the rule."""

import numpy as np
import pytest

from optimum_qwen35.kernels.emulator import NkiRuleError, nki, rules

nl, nisa = nki.language, nki.isa


def sb(shape, dtype=nl.float32, fill=0.0, buffer=nl.sbuf):
    t = nl.ndarray(shape, dtype=dtype, buffer=buffer)
    nisa.memset(dst=t, value=fill) if buffer is not nl.psum else t.write(np.full(shape, fill, np.float32))
    return t


def k_partition_dim(x):
    nl.ndarray((129, 8), dtype=nl.float32, buffer=nl.sbuf)


def k_matmul_contraction(x):
    ps = nl.ndarray((64, 128), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(ps, sb((128, 64)), sb((96, 128)))


def k_matmul_stationary_fsize(x):
    ps = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(ps, sb((128, 129)), sb((128, 128)))


def k_matmul_moving_fsize(x):
    ps = nl.ndarray((128, 1024), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(ps, sb((128, 128)), sb((128, 1024)))


def k_matmul_psum_dst(x):
    out = nl.ndarray((128, 128), dtype=nl.bfloat16, buffer=nl.psum)  # PSUM, but not fp32
    nisa.nc_matmul(out, sb((128, 128)), sb((128, 128)))


def k_matmul_sbuf_inputs(x):
    ps = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.psum)
    stationary = sb((128, 128), buffer=nl.psum)
    nisa.nc_matmul(ps, stationary, sb((128, 128)))


def k_matmul_dtype(x):
    ps = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(ps, sb((128, 128), nl.float32), sb((128, 128), nl.bfloat16))


def k_sbuf_capacity(x):
    # 200 KiB per partition: fits trn2 (224 KiB) but not trn1 (192 KiB); two of them fit neither.
    a = nl.ndarray((128, 50 * 1024), dtype=nl.float32, buffer=nl.sbuf)
    b = nl.ndarray((128, 4 * 1024), dtype=nl.float32, buffer=nl.sbuf)
    c = nl.ndarray((128, 4 * 1024), dtype=nl.float32, buffer=nl.sbuf)
    return a, b, c


def k_psum_capacity(x):
    banks = [nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum) for _ in range(8)]  # 8 x 2 KiB = all of PSUM
    nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.psum)
    return banks


def k_dma_psum(x):
    ps = sb((128, 64), buffer=nl.psum)
    out = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=ps)


def k_gpsimd_psum(x):
    ps = sb((128, 64), buffer=nl.psum)
    dst = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=dst, src=ps, engine=nisa.engine.gpsimd)


def k_two_psum_inputs(x):
    a, b = sb((128, 64), buffer=nl.psum), sb((128, 64), buffer=nl.psum)
    dst = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=dst, data1=a, data2=b, op=nl.add)


def k_memory_type(x):
    dst = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=dst, data1=x, data2=x, op=nl.add)  # x is in HBM


def k_shape(x):
    dst = nl.ndarray((128, 32), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=dst, src=sb((128, 64)))


def k_out_of_bounds(x):
    t = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x[0:128, 32:96])


def k_uninitialized_read(x):
    t = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t[:, 0:32], src=x[:, 0:32])  # half the tile only
    out = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


def k_transpose_size(x):
    out = nl.ndarray((64, 64), dtype=nl.float32, buffer=nl.sbuf)
    nisa.nc_transpose(dst=out, data=sb((64, 64)), engine=nisa.engine.vector)


def k_dtype(x):
    out = nl.ndarray((64, 64), dtype=nl.bfloat16, buffer=nl.psum)
    nisa.nc_transpose(dst=out, data=sb((64, 64)), engine=nisa.engine.tensor)


def k_register(x):  # a register loads one element, not a [128, 64] tile
    t = nl.ndarray((128, 64), dtype=nl.int32, buffer=nl.sbuf)
    nisa.memset(dst=t, value=1)
    nisa.register_load(nisa.register_alloc(), t)


def k_loop(x):  # a dynamic loop's step is a constant, not a register
    for _ in nl.dynamic_range(0, 4, nisa.register_alloc(2)):
        pass


def k_core_barrier(x):  # launched as two programs, of which only program 0 reaches the barrier
    if nl.program_id(0) == 0:
        nisa.core_barrier(x, (0, 1))


BREAKERS = {
    "partition-dim": (k_partition_dim, "trn2"),
    "matmul-contraction": (k_matmul_contraction, "trn2"),
    "matmul-stationary-fsize": (k_matmul_stationary_fsize, "trn2"),
    "matmul-moving-fsize": (k_matmul_moving_fsize, "trn2"),
    "matmul-psum-dst": (k_matmul_psum_dst, "trn2"),
    "matmul-sbuf-inputs": (k_matmul_sbuf_inputs, "trn2"),
    "matmul-dtype": (k_matmul_dtype, "trn2"),
    "sbuf-capacity": (k_sbuf_capacity, "trn2"),
    "psum-capacity": (k_psum_capacity, "trn2"),
    "dma-psum": (k_dma_psum, "trn2"),
    "gpsimd-psum": (k_gpsimd_psum, "trn2"),
    "two-psum-inputs": (k_two_psum_inputs, "trn2"),
    "memory-type": (k_memory_type, "trn2"),
    "shape": (k_shape, "trn2"),
    "out-of-bounds": (k_out_of_bounds, "trn2"),
    "uninitialized-read": (k_uninitialized_read, "trn2"),
    "transpose-size": (k_transpose_size, "trn2"),
    "dtype": (k_dtype, "trn2"),
    "register": (k_register, "trn2"),
    "loop": (k_loop, "trn2"),
    "core-barrier": (k_core_barrier, "trn2", 2),
}


def test_every_rule_has_a_breaking_kernel():
    assert set(BREAKERS) == set(rules.RULES)


@pytest.mark.parametrize("rule", sorted(BREAKERS))
def test_breaking_kernel_raises_the_named_rule(rule):
    fn, target, *grid = BREAKERS[rule]
    x = np.ones((128, 64), np.float32)
    with pytest.raises(NkiRuleError, match=rf"^\[{rule}\]") as err:
        nki.jit(fn)[grid or 1].run(x, target=target)
    assert err.value.rule == rule


def test_sbuf_capacity_depends_on_target():
    def one_200k(x):
        nl.ndarray((128, 50 * 1024), dtype=nl.float32, buffer=nl.sbuf)

    nki.jit(one_200k).run(np.ones(1, np.float32), target="trn2")
    with pytest.raises(NkiRuleError, match=r"^\[sbuf-capacity\]"):
        nki.jit(one_200k).run(np.ones(1, np.float32), target="trn1")
    with pytest.raises(NkiRuleError, match=r"^\[sbuf-capacity\]"):
        nki.jit(one_200k).run(np.ones(1, np.float32), target="inf2")


def test_dead_buffers_are_released():
    def loop(x):
        for _ in range(20):  # 20 x 100 KiB, one live at a time
            t = nl.ndarray((128, 25 * 1024), dtype=nl.float32, buffer=nl.sbuf)
            del t

    nki.jit(loop).run(np.ones(1, np.float32), target="trn1")


def test_uninitialized_read_shows_as_nan_when_not_raising():
    x = np.ones((128, 64), np.float32)
    out, _ = nki.jit(k_uninitialized_read).run(x, target="trn2", uninitialized="nan")
    assert np.isnan(out[:, 32:]).all() and (out[:, :32] == 1).all()


@pytest.mark.parametrize("breaker", [
    lambda: nisa.iota(sb((4, 8), buffer=nl.psum), pattern=[[1, 8]]),
    lambda: nisa.tensor_tensor(dst=sb((4, 8)), data1=sb((4, 8), buffer=nl.psum), data2=sb((4, 8), fill=2.0), op=nl.power),
    lambda: nisa.memset(dst=sb((4, 8), buffer=nl.psum), value=0.0, engine=nisa.engine.gpsimd),
])
def test_gpsimd_never_touches_psum(breaker):
    with pytest.raises(NkiRuleError, match=r"^\[gpsimd-psum\]"):
        nki.jit(lambda x: breaker()).run(np.ones(1, np.float32))


def test_scan_inputs_not_both_in_psum():
    def k(x):
        a, b = sb((8, 16), buffer=nl.psum), sb((8, 16), buffer=nl.psum)
        nisa.tensor_tensor_scan(dst=sb((8, 16)), data0=a, data1=b, initial=0.0, op0=nl.multiply, op1=nl.add)

    with pytest.raises(NkiRuleError, match=r"^\[two-psum-inputs\]"):
        nki.jit(k).run(np.ones(1, np.float32))


def test_dma_cannot_write_psum():
    def k(x):
        nisa.dma_copy(dst=nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.psum), src=x)

    with pytest.raises(NkiRuleError, match=r"^\[dma-psum\]"):
        nki.jit(k).run(np.ones((128, 64), np.float32))


def test_long_sequence_mamba_exceeds_sbuf_and_spill_mode_reports_it():
    """The fused Mamba tutorial's seq_len=8192 profile shows SBUF spills; the emulator refuses by default."""
    from optimum_qwen35.kernels.emulator import estimate
    from benchmarks import _nki_workloads as ex

    z = np.zeros
    args = (z((1, 128, 8192), np.float32), z((1, 128, 8192), np.float32), z((128, 2), np.float32),
            z((1, 2, 8192), np.float32), z((1, 2, 8192), np.float32))
    with pytest.raises(NkiRuleError, match=r"^\[sbuf-capacity\]"):
        estimate(ex.mamba_v2, *args, target="trn1", compute=False)
    _, report = estimate(ex.mamba_v2, *args, target="trn1", compute=False, capacity="spill")
    assert report.over_capacity_bytes["sbuf"] > 0 and report.sbuf_peak_bytes > rules.TRN1.sbuf_partition_bytes
    assert "OVER CAPACITY" in str(report)
