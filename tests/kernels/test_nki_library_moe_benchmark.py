"""benchmarks/nki_library_moe_cte.py: the NKI Library's `bwmm_shard_on_block`, unmodified, on the emulator against the
all-experts form, when a local snapshot of aws-neuron/nki-library is there (OPTIMUM_QWEN35_NKI_LIBRARY_REPO, a git
directory; skipped otherwise: the library is not in this repository and no test fetches it); and the benchmark's own
reference and layout checked on our kernel, without the library."""

import importlib.util
import pathlib
import sys

import pytest
import torch

from tests.kit.nki_library import unpack_nki_library

SMALL = dict(tokens=256, hidden=512, block=128, experts=16, top_k=4, inter=128)  # 23 blocks of 128 rows


@pytest.fixture(scope="module")
def bench():
    path = pathlib.Path(__file__).parents[2] / "benchmarks" / "nki_library_moe_cte.py"
    spec = importlib.util.spec_from_file_location("nki_library_moe_cte", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def kernel(bench, tmp_path):
    source = unpack_nki_library(tmp_path)
    if not (source / "nkilib/core/moe/moe_cte/bwmm_shard_on_block.py").is_file():
        pytest.skip("the snapshot has no nkilib/core/moe/moe_cte/bwmm_shard_on_block.py")
    path = list(sys.path)
    yield bench.load_library(str(tmp_path))
    sys.path[:] = path
    for name in list(sys.modules):
        if name == "nkilib" or name.startswith("nkilib.") or name == "nki" or name.startswith("nki."):
            sys.modules.pop(name, None)


def relative_error(got, want):
    return float((got - want).abs().max() / want.abs().max())


def test_our_kernel_is_the_benchmarks_all_experts_form(bench):
    """The benchmark's reference, layout and weight layouts, checked on our kernel: if any were wrong, our kernel
    (tested against its own all-experts form in tests/kernels/test_moe_blockwise.py) would not match it."""
    inp = bench.inputs(**SMALL)
    got, _, executed = bench.ours(inp)
    assert relative_error(got, bench.all_experts(inp)) < 4e-3  # bf16 operands, fp32 accumulation
    assert executed == int(inp["layout"].filled) < inp["layout"].nb


def test_library_kernel_unmodified_is_the_all_experts_form(bench, kernel):
    """Their kernel at LNC=2, top-k accumulation on: within bf16 error of the all-experts form (its output and the
    running sum over a token's experts are bf16); and its loop is static: every block of the bound runs, the same
    TensorE work for a uniform routing as for one that fills the fewest blocks."""
    inp = bench.inputs(**SMALL)
    got, report, blocks = bench.theirs(kernel, inp)
    assert relative_error(got, bench.all_experts(inp)) < 2e-2
    assert blocks == inp["layout"].nb
    skewed = bench.inputs(**SMALL, kind="skewed")
    got_skewed, report_skewed, _ = bench.theirs(kernel, skewed)  # reads its never-written padding row (see there)
    assert relative_error(got_skewed, bench.all_experts(skewed)) < 2e-2
    assert int(skewed["layout"].filled) < int(inp["layout"].filled)
    assert report_skewed.instructions["tensor"] == report.instructions["tensor"]
    _, ours_skewed, executed = bench.ours(skewed)
    assert executed == int(skewed["layout"].filled)
    # its skip_weight mode: the same output, fewer weight bytes where a core's blocks repeat an expert (the padding)
    got_skip, report_skip, _ = bench.theirs(kernel, skewed, skip_weight=True)
    torch.testing.assert_close(got_skip, got_skewed, rtol=0, atol=0)
    assert report_skip.dma_bytes < report_skewed.dma_bytes


def test_library_dynamic_kernel_unmodified_runs_the_filled_blocks(bench, kernel):
    """Their shard_on_i_hybrid (a static loop over N - E blocks, then `nl.dynamic_range` up to the filled count; I
    split between the two cores, each block's partial down projections exchanged with `sendrecv`) at I = 256, B =
    256: within bf16 error of the all-experts form, and less TensorE work for a routing that fills fewer blocks."""
    small = dict(SMALL, block=256, inter=256)
    inp, skewed = bench.inputs(**small), bench.inputs(**small, kind="skewed")
    got, report, filled = bench.theirs_hybrid(inp)
    assert relative_error(got, bench.all_experts(inp)) < 2e-2
    got_skewed, report_skewed, filled_skewed = bench.theirs_hybrid(skewed)
    assert relative_error(got_skewed, bench.all_experts(skewed)) < 2e-2
    assert filled_skewed < filled < inp["layout"].nb
    assert report_skewed.instructions["tensor"] < report.instructions["tensor"]
