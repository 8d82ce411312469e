"""Cost model: per-engine busy time and an estimated kernel time, from the Neuron documentation's throughputs.

Instructions are recorded as they execute (:class:`Trace`), then scheduled (:func:`schedule`). Every number is an
assumption written down, with its source, in ``docs/nki_emulator.md``; in short:

* Engines run their own instruction streams in program order and synchronize on data dependencies (architecture
  guide: engines are independent and wait on semaphores). An instruction starts when its engine is free and the
  buffers it reads are written (RAW), and the buffers it writes are no longer read or written by earlier
  instructions (WAR, WAW). Dependencies are tracked per allocation (buffer), not per byte.
* TensorE (``nc_matmul``): a MultiplyMoving costs ``max(N, 64)`` cycles for bf16/fp16/tf32/fp8 inputs and 4x that for
  fp32 (architecture guide, Tensor Engine "Cost Model": initiation interval ``max(N, MM_INIT_LATENCY)``,
  ``MM_INIT_LATENCY`` = 64 cycles; fp32 about 4x). A LoadStationary comes first unless the same stationary is still
  loaded; it is costed like a MultiplyMoving of the stationary's free size (assumption).
* VectorE: ``N`` cycles for one input tile, ``2N`` for two (``N`` = elements per partition), at least 64 cycles, plus
  100 cycles when the instruction reads what the previous VectorE instruction wrote (architecture guide, Vector
  Engine "Cost Model"). Trainium2 moves 4 bf16/fp16 or 2 other elements per lane per cycle (Trainium2 guide table).
* ScalarE: ``max(N, 64)`` cycles (``MIN_II`` ~ 64 cycles, ``nki.isa.activation_reduce`` reference), plus 64 cycles to
  read out the accumulator registers (architecture guide, ``ActReadAccumulator``).
* GpSimd: no documented rule of thumb; ``max(N, 64)`` cycles (assumption).
* DMA: a ``dma_copy`` is spread over the NeuronCore's 16 DMA engines (Trainium2 guide), so the DMA queues act as one
  resource of ``DMA_EFFICIENCY x min(16 x 27 GiB/s, HBM bandwidth per NeuronCore)`` bytes/s (the efficiency is the
  one calibrated parameter); each contiguous chunk (DMA buffer) adds ``DMA_CHUNK_OVERHEAD_BYTES``; data lands
  ``DMA_LATENCY_US`` after the transfer ends.
* Logical NeuronCores: the programs of an LNC launch (``kernel[2]`` on trn2) run on separate physical NeuronCores,
  each with its own engines and DMA queues ("your kernel will be run on two physical cores ... that have shared HBM
  memory", NKI "Using Logical Neuron Cores (LNC)" page); other SPMD grids run their programs on one core, in turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

ENGINES = ("tensor", "vector", "scalar", "gpsimd", "dma")

MM_INIT_CYCLES = 64  # architecture guide: MM_INIT_LATENCY
MIN_II_CYCLES = 64  # nki.isa.activation_reduce reference (SDK 2.21): MIN_II ~ 64 cycles
ACT_READ_ACC_CYCLES = 64  # architecture guide: ActReadAccumulator ~64 ScalarE cycles
FP32_MATMUL_FACTOR = 4  # architecture guide: fp32 matmul ~4x the bf16 cost


@dataclass(frozen=True)
class CostParams:
    vector_dep_overhead_cycles: float = 100.0  # architecture guide
    dma_efficiency: float = 0.70  # calibrated on the kernel-optimization tutorial (benchmarks/nki_cost_model.py)
    dma_chunk_overhead_bytes: float = 64.0  # assumption (the guide: "some performance overhead" per DMA buffer)
    # fixed latency per transfer: "descriptor setup, synchronization, and semaphore-to-start latency (~1300 ns
    # cross-engine)", NKI DMA bandwidth guide (nki/deep-dives/nki-dma-bandwidth-guide.rst); was 2.0 (an assumption)
    dma_latency_us: float = 1.3
    # True: a new on-chip buffer waits for the memory it reuses (from buffers the kernel dropped) to be done with,
    # which bounds prefetching by SBUF/PSUM capacity. False: unbounded buffering (every allocation is fresh memory).
    memory_reuse: bool = False  # calibrated choice: False fits the published numbers better


DEFAULT_PARAMS = CostParams()


@dataclass
class Record:
    engine: str
    name: str
    cycles: float
    reads: tuple
    writes: tuple
    nbytes: int = 0
    chunks: int = 0
    core: int = 0  # physical NeuronCore (LNC launches)


class Trace:
    """The instructions of one kernel launch, in program order."""

    def __init__(self, target):
        self.target = target
        self.records: list[Record] = []
        self.loaded_stationary = None
        self.core = 0  # the physical NeuronCore the current program runs on

    def add(self, engine, name, *, cycles=0.0, reads=(), writes=(), nbytes=0, chunks=0):
        reads = tuple(u for u in (_dep_key(r) for r in reads) if u is not None)
        writes = tuple(u for u in (_dep_key(w) for w in writes) if u is not None)
        self.records.append(Record(engine, name, float(cycles), reads, writes, int(nbytes), int(chunks), self.core))

    def alloc(self, buf, region: str, nbytes: int):
        self.records.append(Record("alloc", region, 0.0, (), (buf.uid,), int(nbytes)))

    def free(self, uid: int, region: str, nbytes: int):
        self.records.append(Record("free", region, 0.0, (uid,), (), int(nbytes)))

    def report(self, params: CostParams = DEFAULT_PARAMS) -> "CostReport":
        return schedule(self.records, self.target, params)


def _ghz(target, engine):
    return {"tensor": target.tensor_ghz, "vector": target.vector_ghz, "scalar": target.scalar_ghz,
            "gpsimd": target.gpsimd_ghz}[engine]


def dma_bandwidth(target, params: CostParams = DEFAULT_PARAMS) -> float:
    """Bytes per second the DMA queues of one NeuronCore move, in the model."""
    return params.dma_efficiency * min(target.dma_engines * target.dma_engine_gbps, target.hbm_gbps_per_core) * 1e9


def schedule(records, target, params: CostParams = DEFAULT_PARAMS) -> "CostReport":
    """List-schedule the records: in order per engine, after their buffer dependencies.

    With several physical cores (an LNC launch), each core has its own engines; busy times and instruction counts
    are those of the busiest core (per engine), utilization is busy / total."""
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
            duration = (r.nbytes + r.chunks * params.dma_chunk_overhead_bytes) / bw * 1e6
            latency = params.dma_latency_us
        else:
            cycles = r.cycles
            if r.engine == "vector" and any(u in last_written.get((r.core, "vector"), ()) for u in r.reads):
                cycles += params.vector_dep_overhead_cycles
            duration = cycles / (_ghz(target, r.engine) * 1e3)
            latency = 0.0
        ready = 0.0
        for u in r.reads:
            ready = max(ready, _dep_time(write_end, u))
        for u in r.writes:
            ready = max(ready, _dep_time(write_end, u), _dep_time(read_end, u))
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


def _dep_time(table, key) -> float:
    """When the accesses recorded in `table` that `key` depends on end. On-chip buffers are one unit (an int key);
    an HBM view is (buffer, first element, last element) and depends only on recorded accesses that overlap it."""
    if not isinstance(key, tuple):
        return table.get(key, 0.0)
    uid, lo, hi = key
    return max((end for (l, h), end in table.get(uid, {}).items() if l <= hi and lo <= h), default=0.0)


def _dep_set(table, key, end, keep_max):
    if not isinstance(key, tuple):
        table[key] = max(table.get(key, 0.0), end) if keep_max else end
        return
    uid, lo, hi = key
    spans = table.setdefault(uid, {})
    spans[(lo, hi)] = max(spans.get((lo, hi), 0.0), end) if keep_max else end


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
    """The dependency unit of an operand: its buffer when on chip; for an HBM view, its buffer and the span of
    elements it touches (the whole buffer when the span is not static, as for gathers), so that transfers to
    disjoint parts of one HBM tensor (other heads, other chunks, the other core's half of an LNC launch) do not wait
    for each other."""
    uid = _uid(t)
    region = getattr(t, "buffer", None)
    if uid is None or region is None or getattr(region, "on_chip", True):
        return uid
    try:
        lo = t.offset + sum(min(0, (n - 1) * st) for n, st in zip(t.shape, t.strides))
        hi = t.offset + sum(max(0, (n - 1) * st) for n, st in zip(t.shape, t.strides))
    except (AttributeError, TypeError):
        lo, hi = -(1 << 62), 1 << 62
    return (uid, int(lo), int(hi))


def _uid(t):
    buf = getattr(t, "_buf", None)
    if buf is None and hasattr(t, "view"):  # indirect views
        buf = getattr(t.view, "_buf", None)
    return None if buf is None else buf.uid


# ---------------------------------------------------------------- per-instruction costs (cycles of the engine)
def lane_width(target, *dtypes) -> int:
    from .tensors import bfloat16, float16

    fast, other = target.vector_lane_width
    return fast if all(d in (bfloat16, float16) for d in dtypes) else other


def vector_cycles(target, n_elems: int, n_inputs: int, dtypes) -> float:
    width = lane_width(target, *dtypes)
    return max(n_inputs * n_elems / width, MIN_II_CYCLES)


def scalar_cycles(n_elems: int, readout: bool = False) -> float:
    return max(n_elems, MIN_II_CYCLES) + (ACT_READ_ACC_CYCLES if readout else 0)


def matmul_cycles(n_moving: int, fp32: bool) -> float:
    return max(n_moving, MM_INIT_CYCLES) * (FP32_MATMUL_FACTOR if fp32 else 1)


__all__ = ["CostParams", "DEFAULT_PARAMS", "Trace", "CostReport", "schedule", "dma_bandwidth", "replace"]
