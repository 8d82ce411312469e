"""Buffers, views, access patterns and dtype rounding of the NKI emulator."""

import ml_dtypes
import numpy as np
import pytest

from optimum_qwen35.kernels.emulator import NkiRuleError, nki, runtime, tensors

nl, nisa = nki.language, nki.isa


@pytest.fixture(autouse=True)
def fresh_context():
    with runtime.use(runtime.Context("trn2")) as ctx:
        yield ctx


def test_new_buffers_are_nan_filled_and_unwritten():
    t = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)
    assert np.isnan(t._np()).all()
    assert not t._written().any()
    b = nl.ndarray((4, 8), dtype=nl.bfloat16, buffer=nl.psum)
    assert np.isnan(b._np().astype(np.float32)).all()


def test_onchip_integer_index_keeps_partition_axis_hbm_drops_it():
    sb = nl.ndarray((128, 4, 8), dtype=nl.float32, buffer=nl.sbuf)
    assert sb[3].shape == (1, 4, 8)
    assert sb[:, 2].shape == (128, 8)
    hb = nl.ndarray((4, 128, 8), dtype=nl.float32, buffer=nl.shared_hbm)
    assert hb[1].shape == (128, 8)
    assert hb[1, 2:5, nl.ds(3, 4)].shape == (3, 4)


def test_views_share_storage():
    hb = tensors.from_array(np.arange(24, dtype=np.float32).reshape(4, 6))
    v = hb[1:3, ::2]
    np.testing.assert_array_equal(v.read(), np.arange(24).reshape(4, 6)[1:3, ::2])
    v.write(np.zeros((2, 3)))
    assert hb.read()[1, 0] == 0 and hb.read()[1, 1] == 7


def test_ap_access_pattern_matches_numpy_strides():
    hb = tensors.from_array(np.arange(64, dtype=np.float32).reshape(8, 8))
    view = hb.ap(pattern=[[8, 4], [2, 3]], offset=1)
    expected = np.arange(64).reshape(8, 8)[0:4, 1:7:2]
    np.testing.assert_array_equal(view.read(), expected)
    with pytest.raises(NkiRuleError, match=r"\[out-of-bounds\]"):
        hb.ap(pattern=[[8, 9], [1, 8]])


def test_reshape_permute_broadcast_view():
    hb = tensors.from_array(np.arange(24, dtype=np.float32).reshape(2, 12))
    np.testing.assert_array_equal(hb.reshape((2, 3, 4)).read(), np.arange(24).reshape(2, 3, 4))
    np.testing.assert_array_equal(hb.reshape_dim(1, (3, -1)).permute((0, 2, 1)).read(), np.arange(24).reshape(2, 3, 4).transpose(0, 2, 1))
    row = hb[0:1, 0:4]
    np.testing.assert_array_equal(row.broadcast_to((3, 4)).read(), np.tile(np.arange(4), (3, 1)))
    as_int = hb.view(nl.int32)
    assert as_int.read()[0, 1] == np.float32(1).view(np.int32)
    assert hb.view(nl.bfloat16).shape == (2, 24)


def test_bf16_and_fp8_rounding_is_exact():
    x = np.array([1.0 + 2**-8, 1.0 + 3 * 2**-8, 1e6, 500.0, -1e9], dtype=np.float32)
    bf = tensors.cast(x, nl.bfloat16)
    np.testing.assert_array_equal(bf, x.astype(ml_dtypes.bfloat16))
    assert float(bf[0]) == 1.0  # ties to even
    assert float(bf[1]) == 1.0 + 2**-6
    f8 = tensors.cast(x, nl.float8_e4m3fn)
    assert float(f8[3]) == 448.0  # saturates to the largest finite value
    assert float(f8[4]) == -448.0
    assert float(tensors.cast(np.float32(0.3), nl.float8_e5m2)) == float(np.float32(0.3).astype(ml_dtypes.float8_e5m2))


def test_tfloat32_rounds_mantissa_to_10_bits():
    x = np.array([1.0 + 2**-11, 1.0 + 3 * 2**-11, 1.0 + 2**-10], dtype=np.float32)
    np.testing.assert_array_equal(tensors.cast(x, nl.tfloat32), [1.0, 1.0 + 2**-9, 1.0 + 2**-10])


def test_float_to_int_rounds_and_saturates():
    np.testing.assert_array_equal(tensors.cast(np.array([1.5, 2.5, -3.7, 1e10]), nl.int16), [2, 2, -4, 32767])


def test_store_into_narrow_dtype_rounds():
    t = nl.ndarray((2, 2), dtype=nl.bfloat16, buffer=nl.sbuf)
    t.write(np.full((2, 2), 1.0 + 2**-9, np.float32))
    assert (t.read().astype(np.float32) == 1.0).all()
