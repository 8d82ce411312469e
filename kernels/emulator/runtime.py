"""The emulator's execution state: target, SPMD program ids, live-memory tracker and cost trace.

One :class:`Context` is active at a time. ``nki.jit`` kernels open a fresh one per launch; tensors and ``nki.isa``
calls made outside a kernel (unit tests) use a default context.
"""

from __future__ import annotations

import contextlib
import os

from .rules import MemoryTracker, get_target


def default_target_name() -> str:
    """The target launches run on unless one is named: OPTIMUM_QWEN35_NKI_TARGET, else NEURON_PLATFORM_TARGET_OVERRIDE,
    else trn2."""
    # `NEURON_PLATFORM_TARGET_OVERRIDE` is how the `nki.jit` reference says the target is chosen.
    return os.environ.get("OPTIMUM_QWEN35_NKI_TARGET") or os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE") or "trn2"


class Context:
    def __init__(self, target=None, *, uninitialized: str = "error", compute: bool = True, capacity: str = "error"):
        self.target = get_target(target or default_target_name())
        self.memory = MemoryTracker(self.target, capacity)
        self.program_id: tuple[int, ...] = (0,)
        self.grid: tuple[int, ...] = (1,)
        # True for a kernel launch's context (Kernel.run); a kernel called while one is active is inlined into it.
        self.launch = False
        # "error": reading memory never written raises `[uninitialized-read]`; "nan": reads see the NaN fill only.
        self.uninitialized = uninitialized
        # False: skip the NumPy arithmetic and only check rules and record costs (for cost estimates of large shapes).
        self.compute = compute
        self.trace = None  # a cost.Trace when costs are recorded
        # SPMD: allocations in shared_hbm are the same tensor for every program of a grid.
        self.shared_hbm: list = []
        self.shared_hbm_cursor = 0
        # The running launch's programs (programs.Programs) when it has several: core_barrier switches between them.
        self.programs = None
        # Scalar Engine / Vector Engine accumulator registers (one per partition).
        self.act_reduce_regs = None
        self.vector_reduce_regs = None


_stack: list[Context] = [Context()]


def current() -> Context:
    return _stack[-1]


@contextlib.contextmanager
def use(context: Context):
    _stack.append(context)
    try:
        yield context
    finally:
        _stack.pop()


def record(engine: str, name: str, cycles=0.0, *, reads=(), writes=(), nbytes=0, chunks=0, transpose="",
           padded_nbytes=0):
    """Record one instruction in the active cost trace (no-op when the context does not trace)."""
    trace = current().trace
    if trace is not None:
        trace.add(engine, name, cycles=cycles, reads=reads, writes=writes, nbytes=nbytes, chunks=chunks,
                  transpose=transpose, padded_nbytes=padded_nbytes)
