"""benchmarks/nki_library_gdn.py's comparison logic, without the NKI Library (which is not in this repository and
is never fetched by a test): its references and input layouts checked on our own kernels, its cost comparison and
parameter sweep on our own traces."""

import importlib.util
import pathlib
import sys

import numpy as np
import pytest
import torch

from optimum_qwen35.kernels.emulator import cost
from optimum_qwen35.kernels.gated_delta_rule.reference import expand_key_heads
from optimum_qwen35.modeling.layers import GatedRMSNorm


@pytest.fixture(scope="module")
def bench():
    path = pathlib.Path(__file__).parents[2] / "benchmarks" / "nki_library_gdn.py"
    spec = importlib.util.spec_from_file_location("nki_library_gdn", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    return module


def test_decode_reference_matches_our_kernel(bench):
    """The benchmark's decode reference (their conv window of KW tokens, ours of KW - 1) against our decode kernel:
    if the reference or the input layouts were wrong, our kernel would not match it either."""
    x = bench.decode_inputs(2)
    o_ref, normed_ref, state_ref, _ = bench.decode_reference(x)
    (o, conv_state, state), trace = bench.ours_decode(x)
    for got, want in ((o, o_ref), (state, state_ref)):
        err, scale = bench.max_error(got, want)
        assert err <= 2e-2 * scale
    np.testing.assert_array_equal(conv_state.astype(np.float32),
                                  np.concatenate([x["conv_state"][:, :, 2:], x["mixed"][:, :, None]], -1)
                                  .astype(np.float32))
    assert trace.report().total_us > 0


def test_prefill_reference_matches_our_kernel(bench):
    x = bench.prefill_inputs(128)
    *_, o_ref, state_ref = bench.prefill_reference(x)
    (o, state), _ = bench.ours_prefill(x, lnc=2)
    for got, want in ((o, o_ref), (state, state_ref)):
        err, scale = bench.max_error(got, want)
        assert err <= 2e-2 * scale


def test_gated_norm_is_the_models(bench):
    o, z, w = torch.randn(3, 16, 128, dtype=torch.float64), torch.randn(3, 16, 128, dtype=torch.float64), \
        torch.rand(128, dtype=torch.float64)
    norm = GatedRMSNorm(128, bench.EPS).double()
    with torch.no_grad():
        norm.weight.copy_(w)
        torch.testing.assert_close(bench.gated_norm(o, z, w), norm(o, z))


def test_their_head_layout_is_gqa_expanded_value_head_fastest(bench):
    batch, nk, nv, d = 2, 2, 4, 3
    x = np.arange(batch * nk * d, dtype=np.float32).reshape(batch, nk * d)
    old = bench.NK, bench.NV
    bench.NK, bench.NV = nk, nv
    try:
        flat = bench._expand(x, batch)
    finally:
        bench.NK, bench.NV = old
    want = expand_key_heads(torch.from_numpy(x.reshape(batch, nk, d)), nv).reshape(batch * nv, d).numpy()
    np.testing.assert_array_equal(flat, want)


def test_comparison_and_sweep_on_our_own_traces(bench):
    x = bench.decode_inputs(1)
    _, trace = bench.ours_decode(x, compute=False)
    same = bench.Comparison("ours / ours", [trace], [trace])
    r = bench.sweep(same.ratio)
    assert (r.mid, r.low, r.high) == pytest.approx((1.0, 1.0, 1.0))
    assert r.movers == []
    twice = bench.Comparison("ours twice / ours + floor", [trace, trace], [trace], bench.projection_floor_us)
    theirs, ours = twice.times()
    mid_us = trace.report().total_us
    assert theirs == pytest.approx(2 * mid_us) and ours == pytest.approx(mid_us + bench.projection_floor_us())
    r = bench.sweep(twice.ratio)
    assert r.low <= r.mid <= r.high and r.low < r.high
    assert r.movers and r.movers[0][0] == "dma_efficiency"  # the floor is the weights at the model's DMA rate
    # the floor: 2B in_proj weights (2048 x (6144 + 2048 + 32) bf16) at efficiency x 362.5 GB/s
    assert bench.projection_floor_us() == pytest.approx(2048 * 8224 * 2 / (0.85 * 362.5e9) * 1e6)
    rows = bench.table([same], ranges=False)
    assert rows[-1].startswith("| ours / ours | ") and " 1.00 |" in rows[-1]


def test_load_library_needs_the_gdn_package(bench, tmp_path):
    (tmp_path / "nkilib" / "core").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="experimental/gdn"):
        bench.load_library(str(tmp_path))
    assert "nki" not in sys.modules or getattr(sys.modules["nki"], "IS_EMULATOR", True)
