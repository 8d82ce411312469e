"""Every emulated nki.isa / nki.language operation against its NumPy semantics (Neuron nki.isa reference)."""

import math

import ml_dtypes
import numpy as np
import pytest

from optimum_qwen35.kernels.emulator import NkiRuleError, NkiValidationError, nki, runtime, tensors

nl, nisa = nki.language, nki.isa
rng = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def fresh_context():
    with runtime.use(runtime.Context("trn2")) as ctx:
        yield ctx


def tile(values, dtype=nl.float32, buffer=nl.sbuf):
    values = np.asarray(values)
    t = nl.ndarray(values.shape, dtype=dtype, buffer=buffer)
    t.write(values)
    return t


def empty(shape, dtype=nl.float32, buffer=nl.sbuf):
    return nl.ndarray(shape, dtype=dtype, buffer=buffer)


def rand(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_dma_copy_hbm_sbuf_roundtrip_and_cast():
    x = rand(64, 96)
    src = tensors.from_array(x)
    sb = empty((64, 96), nl.bfloat16)
    nisa.dma_copy(dst=sb, src=src)
    np.testing.assert_array_equal(sb.read(), x.astype(ml_dtypes.bfloat16))
    out = nl.ndarray((64, 96), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=sb)
    np.testing.assert_array_equal(out.read(), x.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_dma_copy_gather_with_vector_offset():
    data = rand(10, 8)
    idx = tile(np.array([[7], [2], [2], [0]]), nl.uint32)
    dst = empty((4, 8))
    src = tensors.from_array(data)
    nisa.dma_copy(dst=dst, src=src.ap(pattern=[[8, 4], [1, 8]], vector_offset=idx, indirect_dim=0))
    np.testing.assert_array_equal(dst.read(), data[[7, 2, 2, 0]])


@pytest.mark.parametrize("dtype", [nl.float32, nl.bfloat16, nl.float8_e4m3])
def test_nc_matmul(dtype):
    a, b = rand(128, 96), rand(128, 512)
    ps = empty((96, 512), buffer=nl.psum)
    nisa.nc_matmul(ps, tile(a, dtype), tile(b, dtype))
    aq, bq = tensors.cast(a, dtype).astype(np.float32), tensors.cast(b, dtype).astype(np.float32)
    np.testing.assert_allclose(ps.read(), aq.T @ bq, rtol=1e-5, atol=1e-4)


def test_nc_matmul_accumulate_modes():
    a1, b1, a2, b2 = rand(32, 16), rand(32, 64), rand(32, 16), rand(32, 64)
    ps = empty((16, 64), buffer=nl.psum)
    nisa.nc_matmul(ps, tile(a1), tile(b1))  # first write overwrites (accumulate=None)
    nisa.nc_matmul(ps, tile(a2), tile(b2))  # then accumulates
    np.testing.assert_allclose(ps.read(), a1.T @ b1 + a2.T @ b2, rtol=1e-5, atol=1e-5)
    # reading the tile closed the accumulation group: the next matmul overwrites
    nisa.nc_matmul(ps, tile(a2), tile(b2))
    np.testing.assert_allclose(ps.read(), a2.T @ b2, rtol=1e-5, atol=1e-5)
    nisa.nc_matmul(ps, tile(a1), tile(b1), accumulate=True)
    np.testing.assert_allclose(ps.read(), a1.T @ b1 + a2.T @ b2, rtol=1e-5, atol=1e-5)
    nisa.nc_matmul(ps, tile(a1), tile(b1), accumulate=False)
    np.testing.assert_allclose(ps.read(), a1.T @ b1, rtol=1e-5, atol=1e-5)


def test_nc_matmul_accumulate_true_on_fresh_psum_is_an_uninitialized_read():
    ps = empty((16, 64), buffer=nl.psum)
    with pytest.raises(NkiRuleError, match=r"\[uninitialized-read\]"):
        nisa.nc_matmul(ps, tile(rand(32, 16)), tile(rand(32, 64)), accumulate=True)


@pytest.mark.parametrize("engine,shape", [("tensor", (128, 96)), ("vector", (32, 16))])
def test_nc_transpose(engine, shape):
    x = rand(*shape)
    buf = nl.psum if engine == "tensor" else nl.sbuf
    out = empty(shape[::-1], buffer=buf)
    nisa.nc_transpose(dst=out, data=tile(x), engine=getattr(nisa.engine, engine))
    np.testing.assert_array_equal(out.read(), x.T)


def test_tensor_copy_casts_and_copies_bits():
    x = rand(8, 40)
    out = empty((8, 40), nl.bfloat16)
    nisa.tensor_copy(dst=out, src=tile(x, buffer=nl.psum))
    np.testing.assert_array_equal(out.read(), x.astype(ml_dtypes.bfloat16))
    ints = tile(np.array([[2**31 - 1, -5]]), nl.int32)
    out_i = empty((1, 2), nl.int32)
    nisa.tensor_copy(dst=out_i, src=ints, engine=nisa.engine.gpsimd)
    np.testing.assert_array_equal(out_i.read(), [[2**31 - 1, -5]])


@pytest.mark.parametrize("op,ref", [(nl.add, np.add), (nl.subtract, np.subtract), (nl.multiply, np.multiply),
                                    (nl.maximum, np.maximum), (nl.minimum, np.minimum), (nl.divide, np.divide),
                                    (nl.greater, lambda a, b: (a > b).astype(np.float32)), (nl.power, np.power),
                                    (np.multiply, np.multiply)])
def test_tensor_tensor(op, ref):
    a, b = rand(16, 32), rand(16, 32)
    if op is nl.power:
        a = np.abs(a)
    out = empty((16, 32))
    nisa.tensor_tensor(dst=out, data1=tile(a), data2=tile(b), op=op)
    np.testing.assert_allclose(out.read(), ref(a, b), rtol=1e-6)


def test_tensor_tensor_bitvec_on_integers():
    a, b = tile(np.array([[12, 10]]), nl.int32), tile(np.array([[10, 6]]), nl.int32)
    out = empty((1, 2), nl.int32)
    nisa.tensor_tensor(dst=out, data1=a, data2=b, op=nl.bitwise_and)
    np.testing.assert_array_equal(out.read(), [[8, 2]])


def test_tensor_scalar_two_ops_reverse_and_vector_operand():
    x, v = rand(8, 20), rand(8, 1)
    out = empty((8, 20))
    nisa.tensor_scalar(dst=out, data=tile(x), op0=nl.subtract, operand0=tile(v), reverse0=True, op1=nl.multiply, operand1=3.0)
    np.testing.assert_allclose(out.read(), (v - x) * 3.0, rtol=1e-6)


def test_scalar_tensor_tensor():
    x, y, v = rand(8, 20), rand(8, 20), rand(8, 1)
    out = empty((8, 20))
    nisa.scalar_tensor_tensor(dst=out, data=tile(x), op0=nl.multiply, operand0=tile(v), op1=nl.subtract,
                              operand1=tile(y), reverse1=True)
    np.testing.assert_allclose(out.read(), y - x * v, rtol=1e-6)


def test_activation_scale_bias_and_accumulate():
    x, s, b = rand(16, 24), rand(16, 1), rand(16, 1)
    out, acc = empty((16, 24)), empty((16, 1))
    nisa.activation(dst=out, op=nl.exp, data=tile(x), scale=tile(s), bias=tile(b), reduce_op=nl.add,
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)
    ref = np.exp(x * s + b)
    np.testing.assert_allclose(out.read(), ref, rtol=1e-5)
    nisa.activation(dst=out, op=nl.tanh, data=tile(x), scale=2.0, reduce_op=nl.add, reduce_res=acc,
                    reduce_cmd=nisa.reduce_cmd.reduce)
    np.testing.assert_allclose(acc.read()[:, 0], ref.sum(1) + np.tanh(2 * x).sum(1), rtol=1e-5)


def test_activation_reduce():
    x = rand(16, 24)
    out, acc = empty((16, 24)), empty((16, 1))
    nisa.activation_reduce(dst=out, op=nl.silu, data=tile(x), reduce_op=nl.add, reduce_res=acc, bias=0.5)
    ref = (x + 0.5) / (1 + np.exp(-(x + 0.5)))
    np.testing.assert_allclose(out.read(), ref, rtol=1e-5)
    np.testing.assert_allclose(acc.read()[:, 0], ref.sum(1), rtol=1e-5)


@pytest.mark.parametrize("op,ref", [(nl.add, np.sum), (nl.maximum, np.max), (nl.minimum, np.min), (nl.multiply, np.prod)])
def test_tensor_reduce(op, ref):
    x = rand(8, 4, 6)
    out = empty((8, 1))
    nisa.tensor_reduce(dst=out, op=op, data=tile(x), axis=(1, 2), negate=True)
    np.testing.assert_allclose(out.read()[:, 0], -ref(x, axis=(1, 2)), rtol=1e-5)
    last = empty((8, 4, 1))
    nisa.tensor_reduce(dst=last, op=op, data=tile(x), axis=2, keepdims=True)
    np.testing.assert_allclose(last.read(), ref(x, axis=2, keepdims=True), rtol=1e-5)
    with pytest.raises(NkiRuleError, match=r"\[shape\]"):
        nisa.tensor_reduce(dst=empty((8, 6)), op=op, data=tile(x), axis=1)


def scan_ref(a, b, init, op0, op1, rev0=False, rev1=False):
    res = np.empty_like(a)
    prev = np.broadcast_to(init, a.shape[:1]).astype(np.float32)
    for i in range(a.shape[1]):
        t = op0(prev, a[:, i]) if rev0 else op0(a[:, i], prev)
        prev = op1(b[:, i], t) if rev1 else op1(t, b[:, i])
        res[:, i] = prev
    return res


def test_tensor_tensor_scan_matches_reference_recurrence():
    a, b = rand(16, 50), rand(16, 50)
    out = empty((16, 50))
    nisa.tensor_tensor_scan(dst=out, data0=tile(a), data1=tile(b), initial=0.0, op0=nl.multiply, op1=nl.add)
    np.testing.assert_allclose(out.read(), scan_ref(a, b, 0.0, np.multiply, np.add), rtol=1e-5)
    h0 = rand(16, 1)
    nisa.tensor_tensor_scan(dst=out, data0=tile(a), data1=tile(b), initial=tile(h0), op0=nl.subtract, op1=nl.subtract,
                            reverse0=True, reverse1=True)
    np.testing.assert_allclose(out.read(), scan_ref(a, b, h0[:, 0], np.subtract, np.subtract, True, True), rtol=1e-5)


def test_iota_and_affine_select():
    out = empty((4, 2, 3), nl.int32)
    nisa.iota(out, pattern=[[10, 2], [1, 3]], offset=5, channel_multiplier=100)
    c, w, x = np.meshgrid(np.arange(4), np.arange(2), np.arange(3), indexing="ij")
    np.testing.assert_array_equal(out.read(), 5 + 100 * c + 10 * w + x)
    x = rand(8, 8)
    sel = empty((8, 8))
    nisa.affine_select(dst=sel, pattern=[[-1, 8]], channel_multiplier=1, on_true_tile=tile(x), on_false_value=-9.0,
                       cmp_op=nl.greater_equal)
    np.testing.assert_array_equal(sel.read(), np.where(np.tril(np.ones((8, 8), bool)), x, -9.0))


def test_memset_and_reciprocal():
    t = empty((4, 6), nl.bfloat16)
    nisa.memset(dst=t, value=0.3)
    np.testing.assert_array_equal(t.read(), np.full((4, 6), 0.3, ml_dtypes.bfloat16))
    x = rand(4, 6)
    r = empty((4, 6))
    nisa.reciprocal(dst=r, data=tile(x))
    np.testing.assert_allclose(r.read(), 1 / x, rtol=1e-6)


def test_nc_stream_shuffle():
    x = rand(64, 5)
    mask = [(i + 1) % 32 for i in range(32)]
    mask[3] = 255
    out = tile(np.zeros((64, 5), np.float32))
    nisa.nc_stream_shuffle(dst=out, src=tile(x), shuffle_mask=mask)
    ref = np.zeros_like(x)
    for p in range(64):
        q, i = divmod(p, 32)
        if mask[i] != 255:
            ref[p] = x[q * 32 + mask[i]]
    np.testing.assert_array_equal(out.read(), ref)


def test_tensor_partition_reduce_and_max8():
    x = rand(16, 12)
    out = empty((1, 12))
    nisa.tensor_partition_reduce(dst=out, op=nl.add, data=tile(x))
    np.testing.assert_allclose(out.read()[0], x.sum(0), rtol=1e-5)
    top = empty((16, 8))
    nisa.max8(dst=top, src=tile(x))
    np.testing.assert_array_equal(top.read(), -np.sort(-x, 1)[:, :8])


def test_language_functional_ops_and_helpers():
    x, y = rand(16, 32), rand(16, 32)
    hx, hy = tensors.from_array(x), tensors.from_array(y)
    a, b = nl.load(hx), nl.load(hy)
    np.testing.assert_allclose(nl.add(a, b).read(), x + y)
    np.testing.assert_allclose((a * b - 1.0).read(), x * y - 1.0, rtol=1e-6)
    np.testing.assert_allclose(nl.exp(a).read(), np.exp(x), rtol=1e-6)
    np.testing.assert_allclose(nl.sum(a, axis=1).read()[:, 0] if nl.sum(a, axis=1).ndim == 2 else nl.sum(a, axis=1).read(), x.sum(1), rtol=1e-5)
    np.testing.assert_allclose(nl.max(a, axis=[1], keepdims=True).read(), x.max(1, keepdims=True))
    np.testing.assert_allclose(nl.softmax(a, axis=1).read(), np.exp(x) / np.exp(x).sum(1, keepdims=True), rtol=1e-5)
    np.testing.assert_allclose(nl.where(nl.greater(a, b), a, b).read(), np.maximum(x, y))
    np.testing.assert_allclose(nl.transpose(a).read(), x.T)
    np.testing.assert_allclose(nl.matmul(a, nl.transpose(b)).read(), x @ y.T, rtol=1e-4, atol=1e-4)
    out = nl.ndarray((16, 32), dtype=nl.float32, buffer=nl.shared_hbm)
    nl.store(out, a)
    np.testing.assert_array_equal(out.read(), x)
    z = nl.zeros((4, 4), dtype=nl.float32)
    z += nl.ones((4, 4), dtype=nl.float32)
    np.testing.assert_array_equal(z.read(), np.ones((4, 4)))
    assert list(nl.affine_range(2, 8, 3)) == [2, 5] and list(nl.sequential_range(3)) == [0, 1, 2]
    assert nl.tile_size.pmax == 128 and nl.tile_size.gemm_moving_fmax == 512 and nl.tile_size.gemm_stationary_fmax == 128


def test_grid_launch_program_ids_and_shared_output():
    @nki.jit
    def rows_plus_pid(x):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        i, j = nl.program_id(0), nl.program_id(1)
        assert nl.num_programs(0) == 2 and nl.num_programs(1) == 3 and nl.program_ndim() == 2
        t = nl.ndarray((1, 4), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[i * 3 + j:i * 3 + j + 1, :])
        r = nl.ndarray((1, 4), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=r, data=t, op0=nl.add, operand0=float(10 * i + j))
        nisa.dma_copy(dst=out[i * 3 + j:i * 3 + j + 1, :], src=r)
        return out

    x = rand(6, 4)
    out = rows_plus_pid[2, 3](x)
    np.testing.assert_allclose(out, x + np.array([0, 1, 2, 10, 11, 12], np.float32)[:, None], rtol=1e-6)


def test_kernel_accepts_torch_tensors_and_returns_torch():
    torch = pytest.importorskip("torch")

    @nki.jit
    def double(x):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
        nisa.dma_copy(dst=out, src=t)
        return out

    x = torch.randn(8, 16, dtype=torch.bfloat16)
    y = double(x)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16
    assert torch.equal(y, x * 2)
    assert math.isfinite(double.last_report.total_us)


def test_nc_find_index8_and_match_replace8():
    x = rand(4, 40)
    vals = np.stack([x[p, [3, 0, 7, 7, 39, 12, 5, 1]] for p in range(4)])
    vals[:, 5] = 1e9  # absent
    idx = empty((4, 8), nl.uint32)
    nisa.nc_find_index8(dst=idx, data=tile(x), vals=tile(vals))
    expected = np.tile(np.array([3, 0, 7, 7, 39, 0xFFFFFFFF, 5, 1], np.uint64), (4, 1))
    np.testing.assert_array_equal(idx.read(), expected)
    top = empty((4, 8))
    nisa.max8(dst=top, src=tile(x))
    replaced, where = empty((4, 40)), empty((4, 8), nl.uint32)
    nisa.nc_match_replace8(dst=replaced, data=tile(x), vals=top, imm=-1e4, dst_idx=where)
    ref = x.copy()
    order = np.argsort(-x, axis=1)[:, :8]
    np.put_along_axis(ref, order, -1e4, axis=1)
    np.testing.assert_array_equal(replaced.read(), ref)
    np.testing.assert_array_equal(where.read(), order)


def test_private_hbm_scratch_and_sbuf_access_pattern():
    x = rand(8, 12)

    @nki.jit
    def roundtrip(a):
        scratch = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.hbm)  # private HBM scratch
        t = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=a)
        nisa.dma_copy(dst=scratch, src=t)
        u = nl.ndarray((8, 6), dtype=a.dtype, buffer=nl.sbuf)
        # every other column of each partition, through an explicit [[partition stride, P], [2, 6]] pattern
        nisa.dma_copy(dst=u, src=scratch.ap(pattern=[[12, 8], [2, 6]], offset=1))
        evens = nl.ndarray((8, 6), dtype=a.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=evens, src=t.ap(pattern=[[12, 8], [2, 6]]))
        out = nl.ndarray((8, 12), dtype=a.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[:, 0:6], src=evens)
        nisa.dma_copy(dst=out[:, 6:12], src=u)
        return out

    np.testing.assert_array_equal(roundtrip(x), np.concatenate([x[:, 0::2], x[:, 1::2]], axis=1))


@pytest.mark.parametrize("fn,ref", [
    (nl.exp, np.exp), (nl.tanh, np.tanh), (nl.sigmoid, lambda x: 1 / (1 + np.exp(-x))),
    (nl.relu, lambda x: np.maximum(x, 0)), (nl.silu, lambda x: x / (1 + np.exp(-x))),
    (nl.softplus, lambda x: np.log1p(np.exp(x))), (nl.square, np.square), (nl.abs, np.abs), (nl.sin, np.sin),
    (nl.gelu, lambda x: 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))),
    (nl.gelu_apprx_tanh, lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))),
    (nl.copy, lambda x: x), (nl.sign, np.sign), (nl.arctan, np.arctan),
])
def test_activation_functions_match_numpy(fn, ref):
    x = rand(4, 33)
    out = empty((4, 33))
    nisa.activation(dst=out, op=fn, data=tile(x))
    np.testing.assert_allclose(out.read(), ref(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fn(tile(x)).read(), ref(x), rtol=1e-5, atol=1e-6)  # the nl function form


def test_log_sqrt_rsqrt_on_positive_inputs():
    x = np.abs(rand(4, 16)) + 0.1
    for fn, ref in ((nl.log, np.log), (nl.sqrt, np.sqrt), (nl.rsqrt, lambda v: 1 / np.sqrt(v))):
        out = empty((4, 16))
        nisa.activation(dst=out, op=fn, data=tile(x))
        np.testing.assert_allclose(out.read(), ref(x), rtol=1e-5)


def test_exponential_tensor_scalar_reduce_and_dma_transpose():
    x, m = rand(8, 20), rand(8, 1)
    e, s = empty((8, 20)), empty((8, 1))
    nisa.exponential(dst=e, src=tile(x), max_value=tile(m), reduce_res=s)
    np.testing.assert_allclose(e.read(), np.exp(x - m), rtol=1e-5)
    np.testing.assert_allclose(s.read()[:, 0], np.exp(x - m).sum(1), rtol=1e-5)
    y, r = empty((8, 20)), empty((8, 1))
    nisa.tensor_scalar_reduce(dst=y, data=tile(x), op0=nl.multiply, operand0=2.0, reduce_op=nl.maximum, reduce_res=r)
    np.testing.assert_allclose(y.read(), 2 * x, rtol=1e-6)
    np.testing.assert_allclose(r.read()[:, 0], (2 * x).max(1), rtol=1e-6)
    t = empty((20, 8))
    nisa.dma_transpose(dst=t, src=tensors.from_array(x))
    np.testing.assert_array_equal(t.read(), x.T)


def test_a_keyword_nki_does_not_take_is_an_error():
    """NKI 0.3's instructions take only their documented keywords; `engine=` on scalar_tensor_tensor (VectorE only)
    is a TypeError in NKI, so it is one here rather than a request the emulator would quietly cost on VectorE."""
    x, y = tile(rand(8, 4)), tile(rand(8, 4))
    with pytest.raises(TypeError, match="engine"):
        nisa.scalar_tensor_tensor(dst=empty((8, 4)), data=x, op0=nl.multiply, operand0=2.0, op1=nl.add, operand1=y,
                                  engine=nisa.engine.gpsimd)
    with pytest.raises(TypeError, match="engin"):
        nisa.tensor_tensor(dst=empty((8, 4)), data1=x, data2=y, op=nl.add, engin=nisa.engine.gpsimd)
    with pytest.raises(TypeError, match="engine"):
        nisa.tensor_reduce(dst=empty((8, 1)), op=nl.add, data=x, axis=1, engine=nisa.engine.gpsimd)
    nisa.tensor_tensor(dst=empty((8, 4)), data1=x, data2=y, op=nl.add, engine=nisa.engine.gpsimd)  # NKI takes this one



def test_tensor_scalar_cumulative_follows_the_pages_pseudocode():
    """reg = op1(op0(src[i], imm0), reg), dst[i] = reg, per partition along the free axis (nki.isa page)."""
    x = rand(8, 20)
    out = empty((8, 20))
    nisa.tensor_scalar_cumulative(dst=out, src=tile(x), op0=nl.multiply, imm0=1.0, op1=nl.add)  # reset: from 0
    np.testing.assert_allclose(out.read(), np.cumsum(x, axis=1), rtol=1e-5, atol=1e-5)
    scale = rand(8, 1)
    nisa.tensor_scalar_cumulative(dst=out, src=tile(x), op0=nl.multiply, imm0=tile(scale), op1=nl.maximum)
    np.testing.assert_allclose(out.read(), np.maximum.accumulate(x * scale, axis=1), rtol=1e-6)
    # load_reduce starts from imm1; reduce continues from where the last cumulative instruction left the registers
    nisa.tensor_scalar_cumulative(dst=out, src=tile(x), op0=nl.add, imm0=0.5, op1=nl.add, imm1=tile(scale),
                                  reduce_cmd=nisa.reduce_cmd.load_reduce)
    first = scale + np.cumsum(x + 0.5, axis=1)
    np.testing.assert_allclose(out.read(), first, rtol=1e-5, atol=1e-5)
    nisa.tensor_scalar_cumulative(dst=out, src=tile(x), op0=nl.add, imm0=0.0, op1=nl.add,
                                  reduce_cmd=nisa.reduce_cmd.reduce)
    np.testing.assert_allclose(out.read(), first[:, -1:] + np.cumsum(x, axis=1), rtol=1e-5, atol=1e-5)
    y = rand(4, 6) * 0.5 + 1.0
    prod = empty((4, 6))
    nisa.tensor_scalar_cumulative(prod, tile(y), nl.multiply, nl.multiply, 2.0)  # positional form
    np.testing.assert_allclose(prod.read(), np.cumprod(2.0 * y, axis=1), rtol=1e-5)
    with pytest.raises(NkiRuleError, match="op1"):
        nisa.tensor_scalar_cumulative(dst=out, src=tile(x), op0=nl.multiply, imm0=1.0, op1=nl.divide)
    with pytest.raises(TypeError):
        nisa.tensor_scalar_cumulative(dst=out, src=tile(x), op0=nl.multiply, imm0=1.0, op1=nl.add, engine=None)


def test_a_kernel_called_inside_a_kernel_is_inlined_into_the_launch():
    """A nested @nki.jit call is a sub-kernel inlined into the caller's launch (SpecializationConfig page): it takes
    the caller's tensors, returns its own as tensors of the launch, and its instructions go to the caller's trace."""

    @nki.jit
    def double(x):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
        nisa.dma_copy(dst=out, src=t)
        return out

    @nki.jit
    def quadruple(x):
        assert nl.num_programs(0) == 1
        return double(double(x))

    x = rand(8, 16)
    np.testing.assert_allclose(quadruple(x), 4 * x, rtol=1e-6)
    np.testing.assert_allclose(double(x), 2 * x, rtol=1e-6)  # still a launch of its own outside a kernel
    assert len([r for r in quadruple.last_trace.records if r.engine == "dma"]) == 4

    @nki.jit
    def with_a_grid(x):
        return double[2](x)

    with pytest.raises(NkiValidationError, match="nested-launch"):
        with_a_grid(x)


# ------------------------------------------------------------- what the NKI Library's MoE CTE kernels need (issue 51)
def test_core_barrier_lets_each_program_read_what_the_other_wrote():
    """`nisa.core_barrier`: "all specified NeuronCores must reach [it] before any can proceed": each program writes
    its half of a shared HBM tensor, passes the barrier, then reads the other's half (the use the reference page
    names). Run one after the other without the barrier, program 0 would read a half never written."""

    @nki.jit
    def swap_halves(x):
        pid = nl.program_id(0)
        shared = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray((4, 8), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[pid * 4:pid * 4 + 4, :])
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
        nisa.dma_copy(dst=shared[pid * 4:pid * 4 + 4, :], src=t)
        nisa.core_barrier(shared, (0, 1))
        other = 1 - pid
        nisa.dma_copy(dst=t, src=shared[other * 4:other * 4 + 4, :])
        nisa.dma_copy(dst=out[pid * 4:pid * 4 + 4, :], src=t)
        return out

    x = rand(8, 8)
    out = swap_halves[2](x)
    np.testing.assert_array_equal(out, np.concatenate([x[4:], x[:4]]) * 2)


def test_core_barrier_count_mismatch_is_refused():
    @nki.jit
    def one_sided(x):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        if nl.program_id(0) == 0:
            nisa.core_barrier(out, (0, 1))
        t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.dma_copy(dst=out, src=t)
        return out

    with pytest.raises(NkiRuleError, match=r"\[core-barrier\]"):
        one_sided[2](rand(4, 4))
    # alone, a barrier waits for nobody
    np.testing.assert_array_equal(one_sided(x := rand(4, 4)), x)


def test_program_failure_stops_the_launch():
    @nki.jit
    def fails_in_program_1(x):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        if nl.program_id(0) == 1:
            nisa.dma_copy(dst=t, src=out)  # never written
        nisa.core_barrier(out, (0, 1))
        return out

    with pytest.raises(NkiRuleError, match=r"\[uninitialized-read\]"):
        fails_in_program_1[2](rand(4, 4))


def test_dma_compute_adds_sources_in_fp32():
    a, b = rand(16, 32), rand(16, 32)
    dst = empty((16, 32), nl.bfloat16)
    nisa.dma_compute(dst=dst, srcs=[tensors.from_array(a), tile(b)], scales=[1.0, 1.0], reduce_op=nl.add)
    np.testing.assert_array_equal(dst.read(), (a + b).astype(ml_dtypes.bfloat16))
    with pytest.raises(NkiRuleError, match="scales"):
        nisa.dma_compute(dst=dst, srcs=[tile(a), tile(b)], scales=[1.0, 2.0], reduce_op=nl.add)
    with pytest.raises(NkiRuleError, match="nl.add"):
        nisa.dma_compute(dst=dst, srcs=[tile(a), tile(b)], scales=None, reduce_op=nl.maximum)
    with pytest.raises(NkiRuleError, match=r"\[dma-psum\]"):
        nisa.dma_compute(dst=empty((16, 32), buffer=nl.psum), srcs=[tile(a)], reduce_op=nl.add)


def test_scalar_offset_steps_along_the_tensors_dimension():
    """`.ap(scalar_offset=v, indirect_dim=d)` moves the access by v steps of the tensor's dimension d, whatever the
    pattern's strides (the NKI Library's kernels: an expert's [H, 2, I] slab read with a pattern whose first stride
    is 2 I; a (B, d, S) cache written at a runtime position with indirect_dim=2 and a two-entry pattern)."""
    w = rand(3, 4, 2, 5)  # [E, H, 2, I]
    expert = tile(np.array([[2]]), nl.int32)
    dst = empty((4, 2, 5))
    nisa.dma_copy(dst=dst, src=tensors.from_array(w).ap([[10, 4], [5, 2], [1, 5]], scalar_offset=expert))
    np.testing.assert_array_equal(dst.read(), w[2])
    cache = rand(2, 3, 16)  # [B, d, S]
    pos = tile(np.array([[5]]), nl.int32)
    col = empty((3, 2))
    nisa.dma_copy(dst=col, src=tensors.from_array(cache).ap([[16, 3], [1, 2]], offset=1 * 3 * 16, scalar_offset=pos,
                                                            indirect_dim=2))
    np.testing.assert_array_equal(col.read(), cache[1, :, 5:7])
    with pytest.raises(NkiRuleError, match="indirect_dim"):
        tensors.from_array(cache).ap([[16, 3], [1, 2]], scalar_offset=pos, indirect_dim=3)


def test_vector_offset_gather_of_more_rows_than_the_tensor_has_and_oob_rows():
    """The pattern's count along the indirect dimension is the number of rows gathered (one per index), not a span:
    128 rows of a 5-row tensor. A row whose index leaves the tensor raises, or is skipped with oob_mode.skip."""
    data = rand(5, 8)
    index = np.arange(128) % 5
    dst = empty((128, 8))
    nisa.dma_copy(dst=dst, src=tensors.from_array(data).ap([[8, 128], [1, 8]], vector_offset=tile(index[:, None],
                                                                                                 nl.int32)))
    np.testing.assert_array_equal(dst.read(), data[index])
    bad = index.copy()
    bad[3] = 5
    view = tensors.from_array(data).ap([[8, 128], [1, 8]], vector_offset=tile(bad[:, None], nl.int32))
    with pytest.raises(NkiRuleError, match=r"\[out-of-bounds\].*row 3"):
        nisa.dma_copy(dst=dst, src=view)
    before = dst.read().copy()
    nisa.dma_copy(dst=dst, src=view, oob_mode=nisa.oob_mode.skip)
    expected = data[index]
    expected[3] = before[3]
    np.testing.assert_array_equal(dst.read(), expected)


def test_tensor_copy_predicated():
    """Where the predicate is nonzero src's element is copied (a scalar as dst's dtype), elsewhere dst keeps its
    value; reverse_pred with a scalar; predicate uint8/16/32 only (nki.isa.tensor_copy_predicated, SDK 2.33)."""
    dst_vals, src_vals = rand(4, 6), rand(4, 6)
    pred_vals = (rng.random((4, 6)) > 0.5).astype(np.uint8)
    dst = tile(dst_vals)
    nisa.tensor_copy_predicated(dst=dst, src=tile(src_vals), predicate=tile(pred_vals, nl.uint8))
    np.testing.assert_array_equal(dst.read(), np.where(pred_vals != 0, src_vals, dst_vals))
    experts = tile(np.array([[3, 1, 4, 1, 5]]), nl.int32)
    skip = tile(np.array([[0, 1, 0, 1, 1]]), nl.uint8)
    nisa.tensor_copy_predicated(dst=experts, src=8, predicate=skip)
    np.testing.assert_array_equal(experts.read(), [[3, 8, 4, 8, 8]])
    nisa.tensor_copy_predicated(dst=experts, src=0, predicate=skip, reverse_pred=True)
    np.testing.assert_array_equal(experts.read(), [[0, 8, 0, 8, 8]])
    with pytest.raises(NkiRuleError, match="uint8"):
        nisa.tensor_copy_predicated(dst=dst, src=tile(src_vals), predicate=tile(pred_vals.astype(np.float32)))
    with pytest.raises(NkiRuleError, match="reverse_pred"):
        nisa.tensor_copy_predicated(dst=dst, src=tile(src_vals), predicate=tile(pred_vals, nl.uint8), reverse_pred=True)


def test_sendrecv_pairs_the_nth_calls_of_the_two_programs():
    """`nisa.sendrecv` in an LNC=2 launch: each program sends its tile to the other's dst and receives the other's
    ("the Nth sendrecv on one rank rendezvous with the Nth sendrecv on the peer rank", nki.lnc.sendrecv); alone it
    has no peer."""

    @nki.jit
    def exchange_twice(x):
        pid = nl.program_id(0)
        out = nl.ndarray((2, 2, 8), dtype=x.dtype, buffer=nl.shared_hbm)
        mine = nl.ndarray((1, 8), dtype=x.dtype, buffer=nl.sbuf)
        got = nl.ndarray((1, 8), dtype=x.dtype, buffer=nl.sbuf)
        for n in range(2):
            nisa.dma_copy(dst=mine, src=x[pid:pid + 1, :])
            nisa.tensor_scalar(dst=mine, data=mine, op0=nl.add, operand0=float(10 * n))
            nisa.sendrecv(src=mine, dst=got, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=0)
            nisa.dma_copy(dst=out[pid, n:n + 1, :], src=got)
        return out

    x = rand(2, 8)
    out = exchange_twice[2](x)
    for pid in (0, 1):
        for n in (0, 1):
            np.testing.assert_allclose(out[pid, n], x[1 - pid] + 10 * n, rtol=1e-6)
    with pytest.raises(NkiRuleError, match="sendrecv"):
        exchange_twice(x)


def test_nc_version_is_ordered_and_a_transposing_matmul_may_keep_the_dtype_on_v3():
    """The NKI Library compares `get_nc_version() >= nc_version.gen3` and, on NeuronCore-v3, writes a transposing
    matmul (moving = identity, is_transpose=True) to a PSUM tile of the input's dtype; a plain matmul still needs
    fp32."""
    assert nisa.get_nc_version() >= nisa.nc_version.gen3 > nisa.nc_version.gen2
    x = rand(128, 64).astype(ml_dtypes.bfloat16)
    eye = tile(np.eye(128), nl.bfloat16)
    dst = empty((64, 128), nl.bfloat16, buffer=nl.psum)
    nisa.nc_matmul(dst=dst, stationary=tile(x, nl.bfloat16), moving=eye, is_transpose=True)
    np.testing.assert_array_equal(dst.read(), x.T)
    with pytest.raises(NkiRuleError, match=r"\[matmul-psum-dst\]"):
        nisa.nc_matmul(dst=empty((64, 128), nl.bfloat16, buffer=nl.psum), stationary=tile(x, nl.bfloat16),
                       moving=eye)
