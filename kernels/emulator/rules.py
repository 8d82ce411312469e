"""Hardware targets and the hardware rules the emulator enforces.

Every rule violation raises :class:`NkiRuleError`, whose message starts with the rule's name in brackets
(for instance ``[matmul-moving-fsize]``) so that a failing kernel says which rule it broke.

Sources (Neuron documentation, "NeuronDevice architecture guide" pages for Trainium/Inferentia2 and Trainium2,
and the ``nki.isa`` API reference):

* 128 SBUF/PSUM partitions; SBUF 24 MiB = 128 x 192 KiB on NeuronCore-v2 (trn1/inf2), 28 MiB = 128 x 224 KiB on
  NeuronCore-v3 (trn2); PSUM 2 MiB = 128 x 16 KiB, 8 banks of 2 KiB per partition, on both.
* ``nc_matmul``: contraction over the partition axis (<= 128), stationary free size <= 128, moving free size <= 512
  (one PSUM bank of fp32) on NeuronCore-v2/v3, inputs in SBUF, ``dst`` an fp32 PSUM tile; fp32/tf32 inputs may only be
  paired with fp32/tf32.
* DMA moves data between HBM and SBUF, not PSUM ("you cannot move data directly from PSUM to HBM",
  kernel-optimization tutorial); GpSimd cannot access PSUM (architecture guide, ``nki.isa.tensor_copy``);
  ``tensor_tensor`` / ``tensor_tensor_scan`` / ``scalar_tensor_tensor`` inputs cannot both be in PSUM.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class NkiValidationError(Exception):
    """Raised when hardware constraints are violated (the name the ``nki.isa`` reference uses)."""


class NkiRuleError(NkiValidationError):
    """A hardware rule is broken; ``rule`` is the rule's short name, also printed first in the message."""

    def __init__(self, rule: str, message: str):
        super().__init__(f"[{rule}] {message}")
        self.rule = rule


RULES = {
    "partition-dim": "an SBUF/PSUM tile spans at most 128 partitions",
    "matmul-contraction": (
        "nc_matmul contracts over the partition axis: stationary and moving have the same partition size <= 128"
    ),
    "matmul-stationary-fsize": "nc_matmul stationary free size <= 128",
    "matmul-moving-fsize": "nc_matmul moving free size <= 512 (one fp32 PSUM bank)",
    "matmul-psum-dst": "nc_matmul writes an fp32 tile in PSUM",
    "matmul-sbuf-inputs": "nc_matmul reads stationary and moving from SBUF",
    "matmul-dtype": "nc_matmul inputs are fp8/bf16/fp16/tf32/fp32, and fp32/tf32 pairs only with fp32/tf32",
    "sbuf-capacity": "live SBUF allocations fit the target's SBUF partition size",
    "psum-capacity": "live PSUM allocations fit 16 KiB per partition (8 banks of 2 KiB)",
    "dma-psum": "DMA cannot read or write PSUM",
    "gpsimd-psum": "the GpSimd engine cannot access PSUM",
    "two-psum-inputs": "the two tensor inputs of a Vector Engine instruction cannot both be in PSUM",
    "memory-type": "the instruction's operands live in the memories the instruction can access",
    "shape": "operand shapes agree as the instruction requires",
    "out-of-bounds": "an access stays inside its tensor",
    "uninitialized-read": "an instruction reads only memory that was written before",
    "transpose-size": "nc_transpose on TensorE handles at most 128x128 (32x32 on VectorE)",
    "dtype": "the operand dtypes are supported by the instruction",
    "register": "a VirtualRegister holds one 32-bit integer, moved from a constant, a register or a one-element tensor",
    "loop": "a dynamic loop's step is a compile-time positive int (its bounds may be registers)",
    "core-barrier": "every program of a launch passes the same number of core_barrier calls",
}


@dataclass(frozen=True)
class Target:
    """A NeuronCore generation, with the numbers the rules and the cost model use.

    Frequencies and data-path widths: "Compute Engine Specifications" tables of the architecture guides.
    HBM bandwidth per NeuronCore: chip bandwidth / NeuronCores per chip (trn1: 820 GB/s / 2; trn2: 2.9 TB/s / 8).
    """

    name: str
    nc_version: int
    sbuf_partition_bytes: int
    psum_partition_bytes: int = 16 * 1024
    psum_banks: int = 8
    partitions: int = 128
    stationary_fmax: int = 128
    moving_fmax: int = 512
    # engine clocks (GHz)
    tensor_ghz: float = 2.8
    vector_ghz: float = 1.12
    scalar_ghz: float = 1.4
    gpsimd_ghz: float = 1.4
    # Vector Engine elements per partition per cycle, bf16/fp16 and other dtypes
    vector_lane_width_16bit: int = 1
    vector_lane_width_other: int = 1
    # DMA
    dma_engines: int = 16
    dma_engine_gbps: float = 27 * 1.073741824  # 27 GiB/s per DMA engine, in GB/s
    hbm_gbps_per_core: float = 410.0
    # Largest LNC degree: physical NeuronCores a kernel launched as `kernel[n]` runs on ("The Neuron SDK currently
    # supports an LNC degree ... of either 1 or 2", NKI LNC page; trn1/inf2 support only LNC=1).
    max_lnc: int = 1
    extras: dict = field(default_factory=dict, compare=False)

    @property
    def vector_lane_width(self) -> tuple:
        return self.vector_lane_width_16bit, self.vector_lane_width_other

    @property
    def psum_bank_bytes(self) -> int:
        return self.psum_partition_bytes // self.psum_banks


TRN1 = Target(name="trn1", nc_version=2, sbuf_partition_bytes=192 * 1024)
INF2 = Target(name="inf2", nc_version=2, sbuf_partition_bytes=192 * 1024)
TRN2 = Target(
    name="trn2",
    nc_version=3,
    sbuf_partition_bytes=224 * 1024,
    tensor_ghz=2.4,
    vector_ghz=0.96,
    scalar_ghz=1.2,
    gpsimd_ghz=1.2,
    vector_lane_width_16bit=4,
    vector_lane_width_other=2,
    hbm_gbps_per_core=2900.0 / 8,
    max_lnc=2,
)
TARGETS = {"trn1": TRN1, "inf2": INF2, "gen2": TRN1, "trn2": TRN2, "gen3": TRN2}


def get_target(name_or_target) -> Target:
    if isinstance(name_or_target, Target):
        return name_or_target
    try:
        return TARGETS[str(name_or_target).lower()]
    except KeyError:
        raise ValueError(f"unknown target {name_or_target!r}; expected one of {sorted(TARGETS)}") from None


class MemoryTracker:
    """Live on-chip allocations, in bytes per partition, checked against the target's capacity.

    A buffer is live while the kernel's Python code can still reach it (a tensor or any view of it); the emulator
    releases it when Python frees it. This is how the NKI 0.3 tracer sees allocations too: an ``nl.ndarray`` made
    inside a loop body is a new buffer each iteration, and the previous one dies when its name is rebound.
    """

    def __init__(self, target: Target, mode: str = "error"):
        if mode not in ("error", "spill"):
            raise ValueError("capacity mode must be 'error' or 'spill'")
        self.target = target
        # "error": going over capacity raises. "spill": it is recorded (`over_capacity`) and execution goes on, as the
        # Neuron compiler spills SBUF to HBM (fused Mamba tutorial, long sequences); spill traffic is not costed.
        self.mode = mode
        # Bytes per partition of buffers the allocator places (no `address=`).
        self.live = {"sbuf": 0, "psum": 0}
        # Buffers placed at an explicit `address=` (`nl.ndarray(..., address=(partition, free_offset))`): intervals
        # [start, end) of bytes per partition, one entry per live buffer. Two buffers placed at overlapping addresses
        # share that memory (a kernel reusing PSUM banks on purpose), so placed memory counts as the union.
        self.placed = {"sbuf": [], "psum": []}
        self.peak = {"sbuf": 0, "psum": 0}
        self.over_capacity = {"sbuf": 0, "psum": 0}

    def capacity(self, region: str) -> int:
        return self.target.sbuf_partition_bytes if region == "sbuf" else self.target.psum_partition_bytes

    def used(self, region: str) -> int:
        """Bytes per partition in use: allocator-placed buffers plus the union of explicitly placed ones."""
        return self.live[region] + _union_bytes(self.placed[region])

    def allocate(self, region: str, nbytes: int, what: str, address: int | None = None) -> None:
        """Account a new buffer; ``address`` is its byte offset in each partition when placed explicitly."""
        if address is not None:
            end = int(address) + nbytes
            if address < 0 or end > self.capacity(region):
                raise NkiRuleError(
                    "out-of-bounds",
                    f"{what} placed at byte {address} needs {nbytes} B per partition, past the "
                    f"{self.capacity(region)} B of {region.upper()} on {self.target.name}",
                )
            self.placed[region].append((int(address), end))
        else:
            self.live[region] += nbytes
        new = self.used(region)
        if new > self.capacity(region):
            if self.mode == "spill":
                self.over_capacity[region] = max(self.over_capacity[region], new - self.capacity(region))
            else:
                self._undo(region, nbytes, address)
                rule = "sbuf-capacity" if region == "sbuf" else "psum-capacity"
                raise NkiRuleError(
                    rule,
                    f"allocating {what} needs {nbytes} B per partition, but {new - nbytes} B of "
                    f"{self.capacity(region)} B per partition of {region.upper()} are live on {self.target.name}",
                )
        self.peak[region] = max(self.peak[region], new)

    def _undo(self, region, nbytes, address):
        if address is None:
            self.live[region] -= nbytes
        else:
            self.placed[region].remove((int(address), int(address) + nbytes))

    def release(self, region: str, nbytes: int, address: int | None = None) -> None:
        self._undo(region, nbytes, address)


def _union_bytes(intervals) -> int:
    total, cur_start, cur_end = 0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total
