"""The cost model: documented per-instruction costs, scheduling across engines, reports, calibration."""

import importlib.util
import pathlib
import sys

import ml_dtypes
import numpy as np
import pytest

from optimum_qwen35.kernels.emulator import cost, estimate, nki, rules

nl, nisa = nki.language, nki.isa
TRN2 = rules.TRN2


def matmul_once(dtype):
    @nki.jit
    def k(a, b):
        sa = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.sbuf)
        sb = nl.ndarray(b.shape, dtype=b.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=sa, src=a)
        nisa.dma_copy(dst=sb, src=b)
        ps = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
        for _ in range(4):
            nisa.nc_matmul(ps, sa, sb)
        out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=out, src=ps)
        return out

    a, b = np.ones((128, 128), dtype), np.ones((128, 512), dtype)
    _, report = estimate(k, a, b, target="trn2", compute=False)
    return report


def test_tf32_matmul_costs_as_bf16():
    """NeuronCore-v3 architecture page: "79 BF16/FP16/TF32 TFLOPS" (fp32 is the 4x case, not tf32)."""

    @nki.jit
    def k(a, b):
        sa = nl.ndarray(a.shape, dtype=nl.tfloat32, buffer=nl.sbuf)
        sb = nl.ndarray(b.shape, dtype=nl.tfloat32, buffer=nl.sbuf)
        nisa.dma_copy(dst=sa, src=a)
        nisa.dma_copy(dst=sb, src=b)
        ps = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
        for _ in range(4):
            nisa.nc_matmul(ps, sa, sb)
        out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=out, src=ps)
        return out

    _, tf32 = estimate(k, np.ones((128, 128), np.float32), np.ones((128, 512), np.float32), target="trn2",
                       compute=False)
    bf16 = matmul_once(ml_dtypes.bfloat16)
    assert tf32.busy_us["tensor"] == pytest.approx(bf16.busy_us["tensor"])


def test_lnc2_launch_runs_programs_on_two_physical_cores():
    """NKI LNC page: `kernel[2]` on trn2 runs on two physical NeuronCores (own engines); trn1 has LNC=1 only, so
    a 2-program grid there runs its programs on one core, in turn."""

    @nki.jit
    def halves(x):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        n = x.shape[0] // nl.num_programs(0)
        for i in range(n // 128):
            r0 = nl.program_id(0) * n + i * 128
            t = nl.ndarray((128, x.shape[1]), dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=x[r0:r0 + 128, :])
            for _ in range(20):  # compute-bound
                nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=1.0)
            nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
            nisa.dma_copy(dst=out[r0:r0 + 128, :], src=t)
        return out

    x = np.ones((256, 2048), np.float32)
    out, one = estimate(halves, x, target="trn2")
    out2, two = estimate(halves, x, target="trn2", grid=2)
    np.testing.assert_array_equal(out, 2 * x)
    np.testing.assert_array_equal(out2, 2 * x)
    assert one.cores == 1 and two.cores == 2
    assert two.busy_us["vector"] == pytest.approx(one.busy_us["vector"] / 2)
    assert two.total_us < 0.6 * one.total_us
    _, trn1_one = estimate(halves, x, target="trn1")
    _, trn1_two = estimate(halves, x, target="trn1", grid=2)
    assert trn1_two.cores == 1 and trn1_two.busy_us["vector"] == pytest.approx(trn1_one.busy_us["vector"])


def test_fp32_matmul_costs_four_times_bf16():
    fp32, bf16 = matmul_once(np.float32), matmul_once(ml_dtypes.bfloat16)
    assert fp32.busy_us["tensor"] == pytest.approx(4 * bf16.busy_us["tensor"])
    # one LoadStationary (the stationary is reused: 128 columns at load_stationary_factor cycles each, no 64-cycle
    # floor) + 4 MultiplyMoving of N=512, at 2.4 GHz
    assert bf16.instructions["tensor"] == 5
    factor = cost.DEFAULT_PARAMS.load_stationary_factor
    assert bf16.busy_us["tensor"] == pytest.approx((128 * factor + 4 * 512) / 2400)


def vector_kernel(two_inputs, dependent):
    @nki.jit
    def k(x):
        a = nl.ndarray((128, 1024), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=a, src=x)
        b = nl.ndarray((128, 1024), dtype=nl.float32, buffer=nl.sbuf)
        c = nl.ndarray((128, 1024), dtype=nl.float32, buffer=nl.sbuf)
        if two_inputs:
            nisa.tensor_tensor(dst=b, data1=a, data2=a, op=nl.add)
            nisa.tensor_tensor(dst=c, data1=b if dependent else a, data2=a, op=nl.add)
        else:
            nisa.tensor_scalar(dst=b, data=a, op0=nl.add, operand0=1.0)
            nisa.tensor_scalar(dst=c, data=b if dependent else a, op0=nl.add, operand0=1.0)
        return c

    _, report = estimate(k, np.ones((128, 1024), np.float32), target="trn1", compute=False)
    return report.busy_us["vector"] * 1.12e3  # cycles at 1.12 GHz


def test_vector_engine_rules_of_thumb():
    assert vector_kernel(False, False) == pytest.approx(2 * 1024)  # N cycles each
    assert vector_kernel(True, False) == pytest.approx(2 * 2048)  # 2N cycles each
    assert vector_kernel(True, True) == pytest.approx(2 * 2048 + 100)  # + static overhead when dependent


def test_dma_time_is_bytes_over_bandwidth_plus_chunk_overhead():
    params = cost.DEFAULT_PARAMS
    trace = cost.Trace(TRN2)
    trace.add("dma", "dma_copy", nbytes=1 << 20, chunks=128)
    report = trace.report()
    bw = cost.dma_bandwidth(TRN2, params)
    assert report.busy_us["dma"] == pytest.approx(((1 << 20) + 128 * params.dma_chunk_overhead_bytes) / bw * 1e6)
    assert report.total_us == pytest.approx(report.busy_us["dma"] + params.dma_latency_us)


class _Buf:
    def __init__(self, uid):
        self._buf = type("B", (), {"uid": uid})()


def test_scheduler_overlaps_independent_engines_and_serializes_dependencies():
    x, y, z = _Buf(1), _Buf(2), _Buf(3)
    trace = cost.Trace(TRN2)
    trace.add("vector", "v", cycles=960, writes=[x])  # 1 us
    trace.add("scalar", "s", cycles=1200, writes=[y])  # 1 us, independent: overlaps
    assert trace.report().total_us == pytest.approx(1.0)
    trace.add("tensor", "t", cycles=2400, reads=[x, y], writes=[z])  # waits for both, then 1 us
    report = trace.report()
    assert report.total_us == pytest.approx(2.0)
    assert report.utilization["tensor"] == pytest.approx(0.5)
    assert report.critical_engine in ("vector", "scalar", "tensor")


def test_war_dependency_waits_for_readers():
    x, y = _Buf(1), _Buf(2)
    trace = cost.Trace(TRN2)
    trace.add("vector", "read x", cycles=960 * 3, reads=[x], writes=[y])  # 3 us reading x
    trace.add("scalar", "overwrite x", cycles=1200, writes=[x])  # must wait for the read
    assert trace.report().total_us == pytest.approx(4.0)


def test_compute_false_gives_the_same_report():
    from benchmarks import _nki_workloads as ex

    a, b = np.ones((256, 256), np.float32), np.ones((256, 1024), np.float32)
    _, r1 = estimate(ex.matmul_tiled, a, b, target="trn2")
    _, r2 = estimate(ex.matmul_tiled, a, b, target="trn2", compute=False)
    assert r1.total_us == pytest.approx(r2.total_us) and r1.busy_us == pytest.approx(r2.busy_us)
    text = str(r1)
    for engine in cost.ENGINES:
        assert engine in text


def cost_model_benchmark():
    path = pathlib.Path(__file__).parents[2] / "benchmarks" / "nki_cost_model.py"
    spec = importlib.util.spec_from_file_location("nki_cost_model", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up
    try:
        spec.loader.exec_module(bench)
    finally:
        sys.modules.pop(spec.name, None)
    return bench


def test_benchmark_quick_calibration_error_is_small():
    rows, _ = cost_model_benchmark().run(quick=True, verbose=False)
    latency = {m.workload: err for m, _, err in rows if m.metric == "latency_us"}
    assert abs(latency["mamba_v1 c=256"]) < 0.10  # published 172.93 us (fused Mamba tutorial)
    assert rows and all(abs(err) <= m.band for m, _, err in rows)


@pytest.mark.slow
def test_calibration_errors_stay_in_their_stated_bands():
    """Every published measurement (docs/nki_emulator.md, "Calibration") re-estimated: each error within the band the
    docs state for it, and the DMA efficiency fitted on the matmul tutorial equal to the one cost.py uses (about
    2 minutes)."""
    rows, fitted = cost_model_benchmark().run(verbose=False)
    assert len(rows) == 17
    outside = [(m.workload, m.metric, round(err, 3), m.band) for m, _, err in rows if abs(err) > m.band]
    assert not outside
    assert fitted == pytest.approx(cost.DEFAULT_PARAMS.dma_efficiency)


def test_disjoint_strided_stores_to_one_hbm_tensor_do_not_wait_for_each_other():
    """Interleaved column groups of one HBM tensor (bounding spans all overlap, elements disjoint): each store
    waits only for the DMA queue, not for the previous store to land (no false write-after-write dependency)."""

    @nki.jit
    def interleave(x):
        out = nl.ndarray((128, 8 * 64), dtype=x.dtype, buffer=nl.shared_hbm)
        columns = out.reshape((128, 64, 8))  # column group j = every 8th column from j
        t = nl.ndarray((128, 64), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        for j in range(8):
            nisa.dma_copy(dst=columns[:, :, j], src=t)
        return out

    x = np.arange(128 * 64, dtype=np.float32).reshape(128, 64)
    out, report = estimate(interleave, x, target="trn2")
    np.testing.assert_array_equal(out.reshape(128, 64, 8), np.repeat(x[:, :, None], 8, axis=2))
    params = cost.DEFAULT_PARAMS
    latency = params.dma_latency_us
    queue = report.busy_us["dma"]  # the load and the 8 stores back to back
    # the load lands, then the stores run back to back and the last one lands: 2 latencies; the per-store wait
    # of a false dependency would add 7 more.
    assert report.total_us == pytest.approx(queue + 2 * latency, rel=1e-6)
    # a store over the same elements as an earlier one does wait (write after write)
    load, first_store = [r for r in interleave.last_trace.records if r.engine == "dma"][:2]
    same = cost.Trace(TRN2)
    same.records = [load] + [first_store] * 8  # eight stores to column group 0
    assert same.report().total_us == pytest.approx(queue + 9 * latency, rel=1e-6)


@pytest.mark.parametrize("seed", range(40))
def test_access_pattern_overlap_is_exact(seed):
    """The HBM dependency test agrees with explicit element sets on random strided views."""
    rng = np.random.default_rng(seed)

    def random_view():
        ndim = int(rng.integers(1, 4))
        shape = tuple(int(n) for n in rng.integers(1, 6, ndim))
        strides = tuple(int(s) for s in rng.choice([-7, -3, -1, 1, 2, 3, 4, 8, 12, 16, 40], ndim))
        offset = int(rng.integers(0, 200))
        return offset, shape, strides

    def elements(offset, shape, strides):
        idx = np.full((), offset)
        for n, st in zip(shape, strides):
            idx = idx[..., None] + st * np.arange(n)
        return set(idx.reshape(-1).tolist())

    for _ in range(25):
        a, b = random_view(), random_view()
        expected = bool(elements(*a) & elements(*b))
        got = cost._patterns_overlap(cost._canonical_pattern(*a), cost._canonical_pattern(*b))
        assert got == expected, (a, b)


def test_parameter_table_is_the_code_and_the_docs():
    """One table: CostParams' defaults and the trn2 target are the PARAMETERS middle values, every priced number of
    CostParams is in it, ranges are ordered, and docs/nki_emulator.md shows exactly `cost.parameter_table()`."""
    fields = {p.field: p for p in cost.PARAMETERS}
    for p in cost.PARAMETERS:
        assert p.low <= p.mid <= p.high, p.field
        assert p.status in ("source", "assumption", "calibrated") and p.source, p.field
        if p.field.startswith("target."):
            assert getattr(TRN2, p.field[len("target."):]) == pytest.approx(p.mid), p.field
        else:
            assert getattr(cost.DEFAULT_PARAMS, p.field) == p.mid, p.field
        assert p.status != "source" or p.low == p.high or "disagree" in p.source or "assumption" in p.source, p.field
    params = {f for f in cost.CostParams.__dataclass_fields__ if f != "target_overrides"}
    assert params <= set(fields)
    docs = (pathlib.Path(__file__).parents[2] / "docs" / "nki_emulator.md").read_text()
    begin, end = "<!-- parameters: begin (cost.parameter_table()) -->\n", "\n<!-- parameters: end -->"
    assert begin in docs and end in docs
    assert docs.split(begin)[1].split(end)[0] == cost.parameter_table()


def test_one_trace_is_priced_with_any_parameters():
    """Instructions record their work, the scheduler prices it: re-scheduling a trace with other parameters gives
    what tracing with them would."""
    report = matmul_once(ml_dtypes.bfloat16)
    trace = cost.last_trace()
    for factor in (0.25, 1.0):
        again = trace.report(cost.DEFAULT_PARAMS.with_value("load_stationary_factor", factor))
        assert again.busy_us["tensor"] == pytest.approx((128 * factor + 4 * 512) / 2400)
    faster = trace.report(cost.DEFAULT_PARAMS.with_value("target.hbm_gbps_per_core", 375.0))
    assert faster.busy_us["dma"] == pytest.approx(report.busy_us["dma"] * (2900 / 8) / 375)


def test_dma_transpose_is_priced_per_destination_tile():
    """Trainium2 guide: DMA transposes write [128 partitions, 16 elements] tiles, at up to 90% (from HBM) or 50% (SBUF
    to SBUF) of a copy's throughput. A [1, 64] destination covers 4 tiles; a [128, 64] one exactly 4."""

    def transpose_cost(src_shape, from_hbm):
        @nki.jit
        def k(x):
            s = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=s, src=x)
            t = nl.ndarray(tuple(reversed(x.shape)), dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_transpose(dst=t, src=x if from_hbm else s)
            return t

        x = np.arange(np.prod(src_shape), dtype=np.float32).reshape(src_shape)
        out, _ = estimate(k, x, target="trn2")
        np.testing.assert_array_equal(out, x.T)
        return [r for r in k.last_trace.records if r.name == "dma_transpose"][0]

    bw = cost.dma_bandwidth(TRN2)
    params = cost.DEFAULT_PARAMS
    small = transpose_cost((64, 1), from_hbm=False)
    assert small.nbytes == 256 and small.padded_nbytes == 4 * 128 * 16 * 4
    assert cost.dma_seconds(small, bw) == pytest.approx(4 * 128 * 16 * 4 / (bw * params.dma_transpose_sbuf_efficiency))
    bytes_only = params.with_value("dma_transpose_padding", 0.0)
    assert cost.dma_seconds(small, bw, bytes_only) == pytest.approx(256 / (bw * params.dma_transpose_sbuf_efficiency))
    full = transpose_cost((64, 128), from_hbm=True)
    assert full.padded_nbytes == full.nbytes == 128 * 64 * 4
    assert cost.dma_seconds(full, bw) == pytest.approx(full.nbytes / (bw * params.dma_transpose_hbm_efficiency))


def test_sensitivity_study_brackets_every_figure():
    """The sensitivity study's mechanics on a small trace standing in for every headline kernel: each varied parameter
    is priced at both ends, the envelope brackets the middle value, and the movers are ranked by their spread."""
    bench = cost_model_benchmark()
    trace = cost.Trace(TRN2)
    trace.add("dma", "dma_copy", nbytes=1 << 16, chunks=2)
    for _ in range(100):  # TensorE-bound: 100 x (LoadStationary of 128 columns + MultiplyMoving of 512)
        trace.add("tensor", "LoadStationary", cycles=cost.load_stationary_cycles(128, False))
        trace.add("tensor", "MultiplyMoving", cycles=cost.matmul_cycles(512, False))
    headlines = bench.Headlines(trace, trace, trace, {1: (trace, 1 << 20)}, {1: 5.0}, trace)
    mid, one, combos = bench.sensitivity(headlines, verbose=False)
    assert set(one) == {p.field for p in cost.PARAMETERS if p.low != p.high}
    for figure, value in mid.items():
        assert combos["min"][figure] <= value * (1 + 1e-9) and value <= combos["max"][figure] * (1 + 1e-9)
    # the LoadStationary cost moves the TensorE-bound time
    low, high = one["load_stationary_factor"]
    assert low["prefill LNC=2 (us)"] < mid["prefill LNC=2 (us)"] < high["prefill LNC=2 (us)"]
    spread = [abs(hi - lo) for _, lo, hi in bench.movers(mid, one, "prefill LNC=2 (us)")]
    assert spread == sorted(spread, reverse=True) and spread[0] > 0


@pytest.mark.slow
def test_sensitivity_traces_the_benchmarks_kernels(monkeypatch):
    """The sensitivity command traces the DeltaNet kernels through benchmarks/deltanet_kernels.py's own functions
    (so a change of their signatures breaks this test, not only the command), and its mid figures are the
    benchmark's: decode over the state traffic at the model's DMA rate and at the raw HBM bandwidth (about 30 s)."""
    bench = cost_model_benchmark()
    monkeypatch.setattr(bench, "load_gdn_cte", lambda: (None, "not needed here"))
    headlines = bench.trace_headlines(verbose=False)
    figures = headlines.figures(cost.DEFAULT_PARAMS)
    kernels = bench._deltanet_benchmark()
    for batch in (1, 8):
        total = headlines.decode[batch][0].report(cost.DEFAULT_PARAMS).total_us
        floor, raw = kernels.state_traffic_us(batch)
        assert figures[f"decode b{batch} / model floor"] == pytest.approx(total / floor)
        assert figures[f"decode b{batch} / traffic"] == pytest.approx(total / raw)
    assert figures["prefill LNC=1 (us)"] > figures["prefill LNC=2 (us)"] > 0
    assert figures["prefill fp32 LNC=2 (us)"] > figures["prefill LNC=2 (us)"]
    assert not any(name.startswith("gdn_cte") for name in figures)


def test_a_transfer_waits_for_the_tile_its_runtime_offset_comes_from():
    """`.ap(scalar_offset=tile)` / `vector_offset=tile`: the DMA reads its address from the tile, so it starts only
    after the tile is written (here: the index loaded from HBM, landing one DMA latency later), not at time 0."""

    @nki.jit
    def gather(table, index):
        idx = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=idx, src=index)
        row = nl.ndarray((1, 512), dtype=table.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=row, src=table.ap(pattern=[[512, 1], [1, 512]], offset=0, scalar_offset=idx,
                                            indirect_dim=0))
        rows = nl.ndarray((4, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=rows, src=index.ap(pattern=[[0, 4], [1, 1]], offset=0))
        picked = nl.ndarray((4, 512), dtype=table.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=picked, src=table.ap(pattern=[[512, 4], [1, 512]], offset=0, vector_offset=rows,
                                               indirect_dim=0))
        out = nl.ndarray((5, 512), dtype=table.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[0:1], src=row)
        nisa.dma_copy(dst=out[1:5], src=picked)
        return out

    table = np.arange(8 * 512, dtype=np.float32).reshape(8, 512)
    out, report = estimate(gather, table, np.array([[3]], np.int32), target="trn2")
    np.testing.assert_array_equal(out, table[[3, 3, 3, 3, 3]])
    records = [r for r in gather.last_trace.records if r.engine == "dma"]
    idx_uid = records[0].writes[0]
    assert idx_uid in records[1].reads and records[2].writes[0] in records[3].reads
    latency = cost.DEFAULT_PARAMS.dma_latency_us
    # index load, its latency, then the gather (and the store after it, each landing a latency later): at least
    # three latencies in a row; without the dependency the gather would overlap the index load (two)
    assert report.total_us >= 3 * latency
