"""Cost model: per-engine busy time and an estimated kernel time, from the Neuron documentation's throughputs.

Instructions are recorded as they execute (:class:`Trace`): each with its engine, its *work* (a :class:`Work`, or a
transfer's bytes and contiguous runs) and the buffers it reads and writes. :func:`schedule` prices the work with a
:class:`CostParams` and list-schedules the records, so one trace serves any parameter set (the sensitivity study of
``benchmarks/nki_cost_model.py``). Every number is a row of :data:`PARAMETERS`, with its source or marked as an
assumption, and the range it could take; docs/nki_emulator.md shows that table and the structural assumptions:

* Engines run their own instruction streams in program order and synchronize on data dependencies (architecture
  guide: engines are independent and wait on semaphores). An instruction starts when its engine is free and the
  buffers it reads are written (RAW), and the buffers it writes are no longer read or written by earlier
  instructions (WAR, WAW). On chip, dependencies are per allocation (buffer); in HBM per element, from the access
  patterns (disjoint strided accesses to one tensor are independent).
* DMA: each NeuronCore's transfers share one queue (its 16 DMA engines as one resource), in program order; a copy
  costs its bytes plus an overhead per contiguous run, a transpose its destination tiles at a share of a copy's
  bandwidth; data lands a fixed latency after the transfer.
* Logical NeuronCores: the programs of an LNC launch (``kernel[2]`` on trn2) run on separate physical NeuronCores,
  each with its own engines and DMA queue ("your kernel will be run on two physical cores ... that have shared HBM
  memory", NKI "Using Logical Neuron Cores (LNC)" page); other SPMD grids run their programs on one core, in turn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from .tensors import bfloat16, float16

ENGINES = ("tensor", "vector", "scalar", "gpsimd", "dma")

# Where the documents cited below live: the aws-neuron/aws-neuron-sdk repository, published at
# https://awsdocs-neuron.readthedocs-hosted.com/en/latest/ (same paths, .html).
TRN2_GUIDE = "nki/guides/architecture/trainium2_arch.rst"
TRN1_GUIDE = "nki/guides/architecture/trainium_inferentia2_arch.rst"
DMA_GUIDE = "nki/deep-dives/nki-dma-bandwidth-guide.rst"
DMA_OVERVIEW = "nki/get-started/about/nki-dma-overview.rst"


@dataclass(frozen=True)
class Parameter:
    """One number of the cost model: its middle value (what the model uses by default), the range it could take,
    and where it comes from. ``status`` is "source" (a published number; low == high unless sources disagree),
    "assumption" (no published number; the range is this project's judgement, said why in ``source``) or
    "calibrated" (fitted on published measurements, ``benchmarks/nki_cost_model.py``). ``field`` names the
    attribute it sets: a ``CostParams`` field, or ``target.<attr>`` for a number of the trn2 ``Target``
    (``rules.TRN2``; the trn1/inf2 values are given in ``source``)."""

    field: str
    unit: str
    low: float
    mid: float
    high: float
    status: str
    source: str


PARAMETERS = (
    # ---- engine clocks and widths (trn2; sourced, fixed)
    Parameter("target.tensor_ghz", "GHz", 2.4, 2.4, 2.4, "source",
              f"{TRN2_GUIDE}, Compute Engine Specifications (trn1/inf2: 2.8, {TRN1_GUIDE})"),
    Parameter("target.vector_ghz", "GHz", 0.96, 0.96, 0.96, "source", f"{TRN2_GUIDE} (trn1/inf2: 1.12)"),
    Parameter("target.scalar_ghz", "GHz", 1.2, 1.2, 1.2, "source", f"{TRN2_GUIDE} (trn1/inf2: 1.4)"),
    Parameter("target.gpsimd_ghz", "GHz", 1.2, 1.2, 1.2, "source", f"{TRN2_GUIDE} (trn1/inf2: 1.4)"),
    Parameter("target.vector_lane_width_16bit", "elements/partition/cycle", 4, 4, 4, "source",
              f"{TRN2_GUIDE}: VectorE '512 BF16/FP16 input/output' = 4 x 128 partitions (trn1/inf2: 1)"),
    Parameter("target.vector_lane_width_other", "elements/partition/cycle", 2, 2, 2, "source",
              f"{TRN2_GUIDE}: '256 input/output for other data types' = 2 x 128 (trn1/inf2: 1)"),
    Parameter("target.sbuf_partition_bytes", "bytes", 229376, 229376, 229376, "source",
              f"{TRN2_GUIDE}: '128 partitions of 224KiB' (trn1/inf2: 192 KiB)"),
    Parameter("target.psum_partition_bytes", "bytes", 16384, 16384, 16384, "source",
              f"{TRN2_GUIDE}: PSUM 2 MiB = 128 partitions x 16 KiB (8 banks of 2 KiB; {TRN1_GUIDE})"),
    # ---- TensorE
    Parameter("mm_init_cycles", "cycles", 32, 64, 128, "assumption",
              f"{TRN1_GUIDE}, Tensor Engine cost model: II = max(N, MM_INIT_LATENCY), 64 cycles on NeuronCore-v2; "
              "no NeuronCore-v3 number, so the range is a guess around the v2 value"),
    Parameter("fp32_matmul_factor", "x the bf16 cost", 3.95, 4.0, 4.0, "source",
              f"sources disagree slightly: {TRN1_GUIDE}: fp32 'roughly 4x higher'; {TRN2_GUIDE}: 79 "
              "BF16/FP16/TF32 vs 20 FP32 TFLOPS (3.95x); tf32 costs 1x"),
    Parameter("load_stationary_factor", "cycles per stationary column", 0.25, 0.5, 1.0, "assumption",
              "NKI performance guide (nki/deep-dives/nki_perf_guide.rst, Opt #7): with Fast LoadStationary "
              "'TensorE can perform LoadStationary up to 4x faster than a MultiplyMoving with the same free axis "
              "size' ('LS_II ~= 128/4 = 32 cycles', no 64-cycle floor): 0.25 at best, 1.0 without it; the middle "
              "is a guess"),
    # ---- VectorE, ScalarE, GpSimd
    Parameter("vector_dep_overhead_cycles", "cycles", 100, 100, 100, "source",
              f"{TRN1_GUIDE}, Vector Engine cost model: 'static instruction overhead of 100 engine cycles'"),
    Parameter("vector_min_cycles", "cycles", 32, 64, 128, "assumption",
              "minimum cost of a VectorE/GpSimd instruction; ScalarE's documented MIN_II (64) reused, no "
              "VectorE/GpSimd number published"),
    Parameter("scalar_min_cycles", "cycles", 64, 64, 64, "source",
              "nki.isa.activation_reduce reference (SDK 2.21): 'MIN_II ... roughly 64 engine cycles'"),
    Parameter("act_read_acc_cycles", "cycles", 64, 64, 64, "source",
              f"{TRN1_GUIDE}: ActReadAccumulator 'roughly 64 ScalarE cycles on NeuronCore-v2'"),
    Parameter("gpsimd_cycles_per_element", "cycles per element per partition", 0.5, 1.0, 2.0, "assumption",
              f"{TRN1_GUIDE}: 'there is no rule-of-thumb to estimate execution cost of a GpSimdE instruction'"),
    # ---- DMA
    Parameter("target.dma_engines", "engines per NeuronCore", 16, 16, 16, "source",
              f"{DMA_GUIDE} table; {DMA_OVERVIEW}: 'Each NeuronCore (v2-v4) is paired with 16 DMA engines'"),
    Parameter("target.dma_engine_gbps", "GB/s per engine", 23.0, 27 * 1.073741824, 27 * 1.073741824, "source",
              f"sources disagree: 27 GiB/s ({TRN1_GUIDE}), 27.2 GB/s ({DMA_OVERVIEW}), 23 B/ns on trn2 "
              f"({DMA_GUIDE}); 16 engines exceed the HBM share at any of them"),
    Parameter("target.hbm_gbps_per_core", "GB/s", 2900 / 8, 2900 / 8, 3000 / 8, "source",
              "HBM per chip / 8 NeuronCores; sources disagree: 2.9 TB/s (trn2 product page, ANCHORS.md section 4), "
              f"3 TB/s ({TRN2_GUIDE}); the DMA guide's aggregate 368 GB/s per NeuronCore lies between"),
    Parameter("dma_efficiency", "fraction of the DMA bandwidth", 0.70, 0.85, 1.0, "calibrated",
              "fitted on the kernel-optimization tutorial's profiler activity percentages "
              "(benchmarks/nki_cost_model.py): 0.85 with the middle values of the other parameters, 0.70 with "
              "the low run overhead and LoadStationary at 1x (the fit cannot separate them); 'close 70% DMA "
              "throughput utilization' with large transfers (NKI performance guide, "
              "nki/deep-dives/nki_perf_guide.rst, Opt #9); up to 1.0: '>= 4 KiB per partition ... saturates the "
              f"DMA engines' ({DMA_GUIDE})"),
    Parameter("dma_chunk_overhead_bytes", "bytes per contiguous run", 64, 256, 512, "assumption",
              f"{DMA_GUIDE} gives the curve, not the number: '< 256 B per partition: severely overhead-bound' "
              "(a 256 B run at 80% / 50% / 33% of the bandwidth with 64 / 256 / 512 B), '>= 4 KiB ... fully "
              "amortizes' (98% / 94% / 89%)"),
    Parameter("dma_latency_us", "us per transfer", 1.0, 1.3, 2.0, "source",
              f"{DMA_GUIDE}: 'descriptor setup, synchronization, and semaphore-to-start latency (~1300 ns "
              "cross-engine)'; the range (and charging it from the end of the transfer to the data's first "
              "reader) is an assumption"),
    Parameter("dma_transpose_hbm_efficiency", "x a copy's bandwidth", 0.45, 0.9, 0.9, "source",
              f"{TRN2_GUIDE}: HBM to SBUF 'DMA transpose ... can achieve up to 90% DMA throughput utilization "
              "given hardware-friendly tensor access patterns'; the low end (half) is an assumption"),
    Parameter("dma_transpose_sbuf_efficiency", "x a copy's bandwidth", 0.25, 0.5, 0.5, "source",
              f"{TRN2_GUIDE}: 'SBUF2SBUF transpose can achieve up to 50% of DMA throughput'; the low end (half) "
              "is an assumption"),
    Parameter("dma_transpose_padding", "fraction", 0.0, 1.0, 1.0, "assumption",
              f"{TRN2_GUIDE}: the 16 DMA engines write one [128 partitions, 16 elements] tile at a time; other "
              "sizes work 'at the cost of DMA performance'. 1: a transpose is charged whole [128, 16] tiles of "
              "its destination; 0: only its bytes"),
    Parameter("memory_reuse", "0/1", 0, 0, 1, "calibrated",
              "1: a new on-chip buffer waits for the memory it reuses (prefetch bounded by SBUF/PSUM); 0 fits "
              "the published measurements better (benchmarks/nki_cost_model.py)"),
)

_COST_FIELDS = {p.field: p.mid for p in PARAMETERS if not p.field.startswith("target.")}


@dataclass(frozen=True)
class CostParams:
    """The numbers the scheduler prices instructions with; defaults are the ``PARAMETERS`` middle values.
    ``target_overrides`` replaces numbers of the target (``{"hbm_gbps_per_core": 375.0}``), for the
    sensitivity study."""

    mm_init_cycles: float = _COST_FIELDS["mm_init_cycles"]
    fp32_matmul_factor: float = _COST_FIELDS["fp32_matmul_factor"]
    load_stationary_factor: float = _COST_FIELDS["load_stationary_factor"]
    vector_dep_overhead_cycles: float = _COST_FIELDS["vector_dep_overhead_cycles"]
    vector_min_cycles: float = _COST_FIELDS["vector_min_cycles"]
    scalar_min_cycles: float = _COST_FIELDS["scalar_min_cycles"]
    act_read_acc_cycles: float = _COST_FIELDS["act_read_acc_cycles"]
    gpsimd_cycles_per_element: float = _COST_FIELDS["gpsimd_cycles_per_element"]
    dma_efficiency: float = _COST_FIELDS["dma_efficiency"]
    dma_chunk_overhead_bytes: float = _COST_FIELDS["dma_chunk_overhead_bytes"]
    dma_latency_us: float = _COST_FIELDS["dma_latency_us"]
    dma_transpose_hbm_efficiency: float = _COST_FIELDS["dma_transpose_hbm_efficiency"]
    dma_transpose_sbuf_efficiency: float = _COST_FIELDS["dma_transpose_sbuf_efficiency"]
    dma_transpose_padding: float = _COST_FIELDS["dma_transpose_padding"]
    memory_reuse: bool = bool(_COST_FIELDS["memory_reuse"])
    target_overrides: tuple = ()  # ((target attribute, value), ...)

    def with_value(self, field: str, value) -> "CostParams":
        """These params with one ``PARAMETERS`` field set (``target.<attr>`` fields become target overrides)."""
        if field.startswith("target."):
            overrides = dict(self.target_overrides)
            overrides[field[len("target."):]] = value
            return replace(self, target_overrides=tuple(sorted(overrides.items())))
        return replace(self, **{field: bool(value) if field == "memory_reuse" else value})

    def target(self, target):
        """The target with this study's overrides applied."""
        return replace(target, **dict(self.target_overrides)) if self.target_overrides else target


DEFAULT_PARAMS = CostParams()

# Kept for readers of the per-instruction constants (the middle values).
MM_INIT_CYCLES = DEFAULT_PARAMS.mm_init_cycles
MIN_II_CYCLES = DEFAULT_PARAMS.scalar_min_cycles
ACT_READ_ACC_CYCLES = DEFAULT_PARAMS.act_read_acc_cycles
FP32_MATMUL_FACTOR = DEFAULT_PARAMS.fp32_matmul_factor


class Work(NamedTuple):
    """An instruction's engine work, priced when the trace is scheduled (so one trace serves every parameter set):
    ``kind`` "matmul" (n = moving free size), "stationary" (n = stationary free size), "vector" (n = elements
    per partition x inputs), "scalar" (n = elements per partition; flag = reads out the accumulators), "gpsimd"
    (n = elements per partition); ``flag`` is fp32 for matmuls, 16-bit dtypes for VectorE."""

    kind: str
    n: float
    flag: bool = False


def engine_cycles(work, target, params: CostParams = DEFAULT_PARAMS) -> float:
    """Cycles of one instruction: a plain number is taken as is, a :class:`Work` is priced with ``params``."""
    if not isinstance(work, Work):
        return float(work)
    kind, n, flag = work
    fp32 = params.fp32_matmul_factor if flag else 1.0
    if kind == "matmul":
        return max(n, params.mm_init_cycles) * fp32
    if kind == "stationary":
        return n * params.load_stationary_factor * fp32
    if kind == "vector":
        width = target.vector_lane_width[0] if flag else target.vector_lane_width[1]
        return max(n / width, params.vector_min_cycles)
    if kind == "scalar":
        return max(n, params.scalar_min_cycles) + (params.act_read_acc_cycles if flag else 0.0)
    if kind == "gpsimd":
        return max(n * params.gpsimd_cycles_per_element, params.vector_min_cycles)
    raise ValueError(f"unknown engine work {kind!r}")


@dataclass
class Record:
    engine: str
    name: str
    cycles: object  # a number of cycles, or the Work priced at schedule time
    reads: tuple
    writes: tuple
    nbytes: int = 0
    chunks: int = 0
    core: int = 0  # physical NeuronCore (LNC launches)
    transpose: str = ""  # DMA transposes: "hbm" or "sbuf" (where the source is)
    padded_nbytes: int = 0  # DMA transposes: the bytes of the whole [128, 16] tiles the destination covers


class Trace:
    """The instructions of one kernel launch, in program order."""

    def __init__(self, target):
        self.target = target
        self.records: list[Record] = []
        self.loaded_stationary = None
        self.core = 0  # the physical NeuronCore the current program runs on
        self._alloc_core: dict = {}
        _LAST_TRACE[0] = self

    def add(self, engine, name, *, cycles=0.0, reads=(), writes=(), nbytes=0, chunks=0, transpose="",
            padded_nbytes=0):
        reads = tuple(u for u in (_dep_key(r) for r in reads) if u is not None)
        writes = tuple(u for u in (_dep_key(w) for w in writes) if u is not None)
        self.records.append(Record(engine, name, cycles, reads, writes, int(nbytes), int(chunks), self.core,
                                   transpose, int(padded_nbytes)))

    def alloc(self, buf, region: str, nbytes: int):
        self._alloc_core[buf.uid] = self.core
        self.records.append(Record("alloc", region, 0.0, (), (buf.uid,), int(nbytes), core=self.core))

    def free(self, uid: int, region: str, nbytes: int):
        # the memory goes back to the core that allocated it (Python may drop a buffer while another program runs)
        core = self._alloc_core.pop(uid, self.core)
        self.records.append(Record("free", region, 0.0, (uid,), (), int(nbytes), core=core))

    def report(self, params: CostParams = DEFAULT_PARAMS) -> "CostReport":
        return schedule(self.records, self.target, params)


_LAST_TRACE = [None]


def last_trace() -> "Trace | None":
    """The trace of the most recent launch (any kernel, any grid): benchmarks re-schedule it with other params."""
    return _LAST_TRACE[0]


def _ghz(target, engine):
    return {"tensor": target.tensor_ghz, "vector": target.vector_ghz, "scalar": target.scalar_ghz,
            "gpsimd": target.gpsimd_ghz}[engine]


def dma_bandwidth(target, params: CostParams = DEFAULT_PARAMS) -> float:
    """Bytes per second the DMA queues of one NeuronCore move, in the model."""
    target = params.target(target)
    return params.dma_efficiency * min(target.dma_engines * target.dma_engine_gbps, target.hbm_gbps_per_core) * 1e9


def dma_seconds(r: Record, bandwidth: float, params: CostParams = DEFAULT_PARAMS) -> float:
    """Queue time of one transfer. A copy: its bytes plus a fixed overhead per contiguous run, at the bandwidth.
    A transpose: its bytes, or the whole [128, 16] destination tiles (``dma_transpose_padding``), at the
    transpose's share of a copy's bandwidth (HBM or SBUF source)."""
    if r.transpose:
        charged = r.nbytes + params.dma_transpose_padding * max(r.padded_nbytes - r.nbytes, 0)
        share = params.dma_transpose_sbuf_efficiency if r.transpose == "sbuf" else params.dma_transpose_hbm_efficiency
        return charged / (bandwidth * share)
    return (r.nbytes + r.chunks * params.dma_chunk_overhead_bytes) / bandwidth


def schedule(records, target, params: CostParams = DEFAULT_PARAMS) -> "CostReport":
    """List-schedule the records: in order per engine, after their buffer dependencies.

    With several physical cores (an LNC launch), each core has its own engines; busy times and instruction counts
    are those of the busiest core (per engine), utilization is busy / total."""
    target = params.target(target)
    cores = sorted({r.core for r in records}) or [0]
    engine_free = {(c, e): 0.0 for c in cores for e in ENGINES}
    core_busy = {(c, e): 0.0 for c in cores for e in ENGINES}
    core_counts = {(c, e): 0 for c in cores for e in ENGINES}
    write_end: dict = {}
    read_end: dict = {}
    last_written: dict = {}
    total = 0.0
    dma_bytes = 0
    dma_spans = {c: [] for c in cores}
    bw = dma_bandwidth(target, params)
    pools = {(c, "sbuf"): _Pool(target.sbuf_partition_bytes) for c in cores}
    pools.update({(c, "psum"): _Pool(target.psum_partition_bytes) for c in cores})
    for r in records:
        if r.engine in ("alloc", "free") and not params.memory_reuse:
            continue
        if r.engine == "alloc":
            # The buffer reuses on-chip memory freed earlier: its first write waits until that memory's last user.
            uid = r.writes[0]
            read_end[uid] = max(read_end.get(uid, 0.0), pools[(r.core, r.name)].take(r.nbytes))
            continue
        if r.engine == "free":
            uid = r.reads[0]
            pools[(r.core, r.name)].give(r.nbytes, max(read_end.get(uid, 0.0), write_end.get(uid, 0.0)))
            continue
        if r.engine == "dma":
            duration = dma_seconds(r, bw, params) * 1e6
            latency = params.dma_latency_us
        else:
            cycles = engine_cycles(r.cycles, target, params)
            if r.engine == "vector" and any(u in last_written.get((r.core, "vector"), ()) for u in r.reads):
                cycles += params.vector_dep_overhead_cycles
            duration = cycles / (_ghz(target, r.engine) * 1e3)
            latency = 0.0
        ready = 0.0
        for u in r.reads:
            ready = max(ready, _dep_time(write_end, u, ready))
        for u in r.writes:
            ready = max(ready, _dep_time(write_end, u, ready), _dep_time(read_end, u, ready))
        key = (r.core, r.engine)
        start = max(ready, engine_free[key])
        engine_free[key] = start + duration
        end = start + duration + latency
        for u in r.reads:
            _dep_set(read_end, u, end, keep_max=True)
        for u in r.writes:
            _dep_set(write_end, u, end, keep_max=False)
        last_written[key] = r.writes
        if r.engine == "dma":
            dma_spans[r.core].append((start, end))
        core_busy[key] += duration
        core_counts[key] += 1
        dma_bytes += r.nbytes
        total = max(total, end)
    busiest = {e: max(cores, key=lambda c: core_busy[(c, e)]) for e in ENGINES}
    busy = {e: core_busy[(busiest[e], e)] for e in ENGINES}
    counts = {e: core_counts[(busiest[e], e)] for e in ENGINES}
    util = {e: (busy[e] / total if total else 0.0) for e in ENGINES}
    # DMA activity as neuron-profile shows it: time with at least one transfer in flight (queue busy or landing).
    util["dma"] = max(_union_length(dma_spans[c]) for c in cores) / total if total else 0.0
    critical = max(ENGINES, key=lambda e: busy[e])
    return CostReport(target.name, total, busy, util, counts, critical, dma_bytes, cores=len(cores))


class _Pool:
    """On-chip memory (bytes per partition) as chunks that become reusable at a time: the allocator of the model.

    Allocations and frees come in program order from the kernel's Python (a buffer dies when Python drops it), so
    a kernel gets exactly the reuse, and the prefetch depth, its live tensors allow."""

    def __init__(self, capacity: int):
        self.chunks = [(0.0, capacity)]  # (ready time, bytes)

    def take(self, nbytes: int) -> float:
        self.chunks.sort()
        ready, need = 0.0, nbytes
        while need > 0 and self.chunks:
            t, n = self.chunks.pop(0)
            ready = max(ready, t)
            if n > need:
                self.chunks.insert(0, (t, n - need))
            need -= n
        return ready  # over capacity (spill mode): the rest is not waited for

    def give(self, nbytes: int, ready: float):
        self.chunks.append((ready, nbytes))


def _dep_time(table, key, at_least=0.0) -> float:
    """When the accesses recorded in `table` that `key` depends on end (only times above `at_least` matter).

    On-chip buffers are one unit (an int key). An HBM access is (buffer, first element, last element, pattern):
    it depends on a recorded access only when their element spans overlap and their access patterns share an
    element (so disjoint strided accesses, e.g. interleaved columns, do not wait for each other)."""
    if not isinstance(key, tuple):
        return table.get(key, 0.0)
    uid, lo, hi, pattern = key
    best = at_least
    for (l, h, other), end in table.get(uid, {}).items():
        if end > best and l <= hi and lo <= h and _patterns_overlap(pattern, other):
            best = end
    return best


def _dep_set(table, key, end, keep_max):
    if not isinstance(key, tuple):
        table[key] = max(table.get(key, 0.0), end) if keep_max else end
        return
    uid, lo, hi, pattern = key
    spans = table.setdefault(uid, {})
    spans[(lo, hi, pattern)] = max(spans.get((lo, hi, pattern), 0.0), end) if keep_max else end


def _canonical_pattern(offset, shape, strides):
    """(offset, ((size, stride), ...)) with positive strides, largest first, size-1 axes dropped and axes that
    continue each other merged: two views touch the same elements iff their canonical patterns do."""
    dims = []
    for n, st in zip(shape, strides):
        n, st = int(n), int(st)
        if n == 1 or st == 0:
            continue
        if st < 0:
            offset += (n - 1) * st
            st = -st
        dims.append((n, st))
    dims.sort(key=lambda d: -d[1])
    merged = []
    for n, st in reversed(dims):  # innermost first
        if merged and merged[-1][1] * merged[-1][0] == st:
            m, mst = merged.pop()
            merged.append((m * n, mst))
        else:
            merged.append((n, st))
    return int(offset), tuple(reversed(merged))


def _patterns_overlap(a, b, budget: int = 4096) -> bool:
    """Whether two canonical access patterns share an element: is there an index i of `a` and j of `b` with
    a.offset + sum(i_k a.stride_k) == b.offset + sum(j_k b.stride_k)? The axes of both with one stride s add up to
    c * s for every integer c in a range, so this asks for coefficients c_s in their ranges with
    sum(c_s * s) == b.offset - a.offset. Solved exactly by a search over the strides, largest first, keeping only
    the coefficients the smaller strides can still complete (and none when their gcd does not divide the rest);
    past `budget` steps, or when a pattern is unknown (None), the answer is "overlap" (the safe one)."""
    if a is None or b is None:
        return True
    ranges: dict = {}
    for dims, sign in ((a[1], 1), (b[1], -1)):
        for n, st in dims:
            lo, hi = ranges.get(st, (0, 0))
            ranges[st] = (lo + min(0, sign * (n - 1)), hi + max(0, sign * (n - 1)))
    terms = sorted(((st, lo, hi) for st, (lo, hi) in ranges.items()), reverse=True)
    count = len(terms)
    reach_lo, reach_hi, divisor = [0] * (count + 1), [0] * (count + 1), [0] * (count + 1)
    for k in range(count - 1, -1, -1):
        st, lo, hi = terms[k]
        reach_lo[k], reach_hi[k] = reach_lo[k + 1] + lo * st, reach_hi[k + 1] + hi * st
        divisor[k] = math.gcd(divisor[k + 1], st)
    steps = [0]

    def search(k, rest):
        steps[0] += 1
        if steps[0] > budget:
            return True
        if not reach_lo[k] <= rest <= reach_hi[k]:
            return False
        if k == count:
            return rest == 0
        if rest % divisor[k]:
            return False
        st, lo, hi = terms[k]
        first = max(lo, -(-(rest - reach_hi[k + 1]) // st))
        last = min(hi, (rest - reach_lo[k + 1]) // st)
        return any(search(k + 1, rest - c * st) for c in range(first, last + 1))

    return search(0, b[0] - a[0])


def _union_length(spans) -> float:
    length, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(spans):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                length += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        length += cur_end - cur_start
    return length


@dataclass
class CostReport:
    """Per-kernel estimate: total time, per-engine busy time and utilization, instruction counts.

    Utilization is busy / total for compute engines; for DMA it is the fraction of time a transfer is in flight
    (what neuron-profile's DMA queue rows show), while ``busy_us["dma"]`` is the bandwidth-occupied time."""

    target: str
    total_us: float
    busy_us: dict
    utilization: dict
    instructions: dict
    critical_engine: str
    dma_bytes: int
    sbuf_peak_bytes: int = 0  # per partition
    psum_peak_bytes: int = 0
    over_capacity_bytes: dict = field(default_factory=dict)  # per partition, in "spill" capacity mode
    cores: int = 1  # physical NeuronCores (LNC launch); busy times are the busiest core's

    def __str__(self) -> str:
        lines = [
            f"estimated kernel time on {self.target}: {self.total_us:.2f} us "
            f"(critical engine: {self.critical_engine})"
            + (f"; {self.cores} physical NeuronCores (LNC={self.cores}), busy times of the busiest core"
               if self.cores > 1 else "")
        ]
        for e in ENGINES:
            lines.append(
                f"  {e:7s} busy {self.busy_us[e]:10.2f} us  ({100 * self.utilization[e]:5.1f}%)  "
                f"{self.instructions[e]:7d} instr"
            )
        lines.append(
            f"  DMA traffic {self.dma_bytes / 1e6:.2f} MB; peak SBUF {self.sbuf_peak_bytes / 1024:.1f} KiB and "
            f"PSUM {self.psum_peak_bytes / 1024:.1f} KiB per partition"
        )
        over = {k: v for k, v in (self.over_capacity_bytes or {}).items() if v}
        if over:
            lines.append(f"  OVER CAPACITY (the compiler would spill; not costed): {over} B per partition")
        return "\n".join(lines)


def _dep_key(t):
    """The dependency unit of an operand: its buffer when on chip; for an HBM view, its buffer, the span of
    elements it touches and its access pattern (None, i.e. the whole tensor, when not static, as for gathers),
    so that transfers to disjoint parts of one HBM tensor (other heads, other chunks, interleaved columns, the other
    core's half of an LNC launch) do not wait for each other."""
    uid = _uid(t)
    region = getattr(t, "buffer", None)
    if uid is None or region is None or getattr(region, "on_chip", True):
        return uid
    try:
        pattern = _canonical_pattern(t.offset, t.shape, t.strides)
        lo = pattern[0]
        hi = lo + sum((n - 1) * st for n, st in pattern[1])
    except (AttributeError, TypeError):
        return (uid, -(1 << 62), 1 << 62, None)
    return (uid, lo, hi, pattern)


def _uid(t):
    buf = getattr(t, "_buf", None)
    if buf is None and hasattr(t, "view"):  # indirect views
        buf = getattr(t.view, "_buf", None)
    return None if buf is None else buf.uid


# ------------------------------------------- per-instruction work (priced at schedule time, see engine_cycles)
def is_16bit(*dtypes) -> bool:
    return all(d in (bfloat16, float16) for d in dtypes)


def lane_width(target, *dtypes) -> int:
    fast, other = target.vector_lane_width
    return fast if is_16bit(*dtypes) else other


def vector_cycles(target, n_elems: int, n_inputs: int, dtypes) -> Work:
    return Work("vector", n_inputs * n_elems, is_16bit(*dtypes))


def scalar_cycles(n_elems: int, readout: bool = False) -> Work:
    return Work("scalar", n_elems, readout)


def gpsimd_cycles(n_elems: float) -> Work:
    return Work("gpsimd", n_elems)


def matmul_cycles(n_moving: int, fp32: bool) -> Work:
    return Work("matmul", n_moving, fp32)


def load_stationary_cycles(n_stationary: int, fp32: bool) -> Work:
    return Work("stationary", n_stationary, fp32)


def parameter_table() -> str:
    """``PARAMETERS`` as the Markdown table docs/nki_emulator.md shows (a test keeps the two equal)."""
    lines = ["| parameter | unit | low | mid | high | status | source |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for p in PARAMETERS:
        lines.append(f"| `{p.field}` | {p.unit} | {p.low:g} | {p.mid:g} | {p.high:g} | {p.status} | {p.source} |")
    return "\n".join(lines)


__all__ = ["PARAMETERS", "Parameter", "CostParams", "DEFAULT_PARAMS", "Trace", "CostReport", "schedule",
           "dma_bandwidth", "last_trace", "parameter_table", "replace"]
