"""A NumPy emulator of the NKI API (AWS Neuron Kernel Interface, NKI >= 0.3), for running NKI kernels on CPU.

Usable wherever ``nki`` is::

    from optimum_qwen35.kernels.emulator import nki   # or: import optimum_qwen35.kernels.emulator as nki
    nl, nisa = nki.language, nki.isa

    @nki.jit
    def kernel(a_hbm): ...

    out = kernel(a)                 # NumPy arrays (or torch tensors) in, same kind out
    out = kernel[4](a)              # SPMD grid launch: nl.program_id(0) in 0..3
    out, report = estimate(kernel, a, target="trn2")   # cost model (see cost.py)

See ``docs/nki_emulator.md`` for what is emulated, the rules and the cost model.
"""

from __future__ import annotations

import itertools
import sys
import types

import numpy as np

from . import cost, isa, language, language_isa, rules, runtime, tensors
from .cost import CostParams, CostReport, Trace  # noqa: F401
from .programs import Programs
from .rules import TARGETS, NkiRuleError, NkiValidationError, Target, get_target
from .tensors import NkiTensor


# ------------------------------------------------------------------------------- submodules: compiler, typing, ...
class _Allocator:
    """``nki.compiler.sbuf.mod_alloc(...)``-style direct allocation: accepted, placement ignored (see docs)."""

    def __init__(self, region, *args, **kwargs):
        self.region = region

    def __call__(self, *args, **kwargs):
        return self


def _identity_decorator(fn=None, **kwargs):
    return fn if fn is not None else (lambda f: f)


compiler = types.ModuleType("nki.compiler", "Direct-allocation and compiler-control APIs (accepted, not emulated).")
compiler.skip_middle_end_transformations = _identity_decorator
compiler.enable_stack_allocator = _identity_decorator
compiler.force_auto_alloc = _identity_decorator
compiler.no_reorder = lambda *a, **k: None
for _region in (tensors.sbuf, tensors.psum):
    _make = (lambda region: lambda *a, **k: _Allocator(region))(_region)
    setattr(compiler, _region.value, types.SimpleNamespace(mod_alloc=_make, alloc=_make, auto_alloc=_make))

typing = types.ModuleType("nki.typing", "Type annotations of NKI kernels (nki.typing).")
typing.tensor = NkiTensor
typing.NkiTensor = NkiTensor
typing.mutable_tensor = NkiTensor

# `nki.isa.constants`: the enums of nki.isa (oob_mode, dge_mode, ...), also importable from there.
isa_constants = types.ModuleType("nki.isa.constants", "Enums of nki.isa.")
for _name in ("engine", "reduce_cmd", "dge_mode", "oob_mode", "matmul_perf_mode", "nc_version"):
    setattr(isa_constants, _name, getattr(isa, _name))
isa.constants = isa_constants

# nki.language's functions that run nki.isa instructions live in language_isa.py (isa.py imports language.py).
for _name in language_isa.__all__:
    setattr(language, _name, getattr(language_isa, _name))

IS_EMULATOR = True
__version__ = "0.3.0+emulator"

_DEFAULTS = {"target": None, "uninitialized": "error", "capacity": "error"}


def configure(target=None, uninitialized=None, capacity=None):
    """Set defaults for later launches: ``target`` ("trn1", "inf2", "trn2"); ``uninitialized`` ("error" raises
    on reads of never-written memory, "nan" leaves the NaN fill to show); ``capacity`` ("error" raises when live
    SBUF/PSUM allocations exceed the target, "spill" records it in the cost report and goes on)."""
    if capacity is not None:
        if capacity not in ("error", "spill"):
            raise ValueError("capacity must be 'error' or 'spill'")
        _DEFAULTS["capacity"] = capacity
    if target is not None:
        _DEFAULTS["target"] = get_target(target).name
    if uninitialized is not None:
        if uninitialized not in ("error", "nan"):
            raise ValueError("uninitialized must be 'error' or 'nan'")
        _DEFAULTS["uninitialized"] = uninitialized
        runtime.current().uninitialized = uninitialized


# ------------------------------------------------------------------------------------------------ argument conversion
def _to_device(x, name):
    if isinstance(x, NkiTensor):
        return x, None
    if type(x).__module__.startswith("torch"):
        import torch  # the emulator itself needs no torch: only a caller that hands it torch tensors

        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            arr = t.view(torch.int16).numpy().view(tensors.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()
            return tensors.from_array(arr, tensors.shared_hbm, name), "torch"
    if isinstance(x, np.ndarray):
        return tensors.from_array(x, tensors.shared_hbm, name), "numpy"
    return x, None


def _from_device(x, kind):
    if isinstance(x, NkiTensor):
        arr = x.read(what="the kernel's return value").copy()
        if kind == "torch":
            import torch  # (the same: torch tensors in, torch tensors out)

            if arr.dtype == tensors.bfloat16:
                return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
            return torch.from_numpy(arr)
        return arr
    if isinstance(x, (tuple, list)):
        return type(x)(_from_device(v, kind) for v in x)
    if isinstance(x, dict):
        return {k: _from_device(v, kind) for k, v in x.items()}
    return x


# ------------------------------------------------------------------------------------------------------------- jit
class Kernel:
    """``nki.jit`` result: call it, or launch an SPMD grid with ``kernel[grid](...)``."""

    def __init__(self, fn, grid=(1,), **options):
        self.fn = fn
        self.grid = grid
        self.options = options
        self.last_report: CostReport | None = None
        self.last_trace: Trace | None = None
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)
        self.__wrapped__ = fn

    def __getitem__(self, grid):
        grid = tuple(int(g) for g in (grid if isinstance(grid, (tuple, list)) else (grid,)))
        return Kernel(self.fn, grid, **self.options)

    def __call__(self, *args, **kwargs):
        if runtime.current().launch:
            return self._inline(*args, **kwargs)
        out, _ = self.run(*args, **kwargs)
        return out

    def _inline(self, *args, **kwargs):
        """A kernel called from inside a running kernel is a sub-kernel: it is inlined into the caller's launch
        (its program ids, memory and cost trace), taking and returning the caller's tensors. ("a nested @nki.jit
        sub-kernel ... inline[s] under this kernel's config", nki.compiler.SpecializationConfig page, Neuron SDK
        2.33.) A grid of its own would be a second launch inside the first, which NKI does not describe: refused."""
        if self.grid != (1,):
            raise rules.NkiValidationError(
                f"[nested-launch] {self.__name__}{list(self.grid)} is called inside a running kernel: a nested "
                f"@nki.jit sub-kernel is inlined into its caller's launch and takes no grid of its own")
        return self.fn(*args, **kwargs)

    def run(self, *args, target=None, trace=True, compute=True, uninitialized=None, capacity=None, **kwargs):
        """Execute every program of the grid in order; returns (outputs, cost report)."""
        ctx = runtime.Context(target or _DEFAULTS["target"], uninitialized=uninitialized or _DEFAULTS["uninitialized"],
                              compute=compute, capacity=capacity or _DEFAULTS["capacity"])
        ctx.grid = self.grid
        ctx.launch = True
        if trace:
            ctx.trace = Trace(ctx.target)
        kind = None
        with runtime.use(ctx):
            dev_args = []
            for i, a in enumerate(args):
                d, k = _to_device(a, f"arg{i}")
                kind = kind or k
                dev_args.append(d)
            dev_kwargs = {}
            for key, a in kwargs.items():
                d, k = _to_device(a, key)
                kind = kind or k
                dev_kwargs[key] = d
            result = None
            # An LNC launch (`kernel[n]`, 1 < n <= the target's LNC degree) runs each program on its own physical
            # NeuronCore (own engines and DMA queues in the cost model); other grids run on one core, in turn.
            lnc = len(self.grid) == 1 and 1 < self.grid[0] <= ctx.target.max_lnc
            pids = list(itertools.product(*[range(g) for g in self.grid]))
            if len(pids) == 1:
                ctx.program_id = pids[0]
                result = self.fn(*dev_args, **dev_kwargs)
            else:
                # one at a time, in order, switching at core_barrier calls (programs.py)
                starts = []
                for index, pid in enumerate(pids):
                    start = {"program_id": pid, "shared_hbm_cursor": 0}
                    if lnc:  # its own physical core: its own registers and stationary
                        start.update(act_reduce_regs=None, vector_reduce_regs=None)
                    if ctx.trace is not None:
                        start["trace.core"] = index if lnc else 0
                        if lnc:
                            start["trace.loaded_stationary"] = None
                    starts.append(start)
                result = Programs(ctx, starts).run(lambda: self.fn(*dev_args, **dev_kwargs))[0]
            outputs = _from_device(result, kind or "numpy") if compute else result
        self.last_trace = ctx.trace
        self.last_report = ctx.trace.report() if trace else None
        if self.last_report is not None:
            self.last_report.sbuf_peak_bytes = ctx.memory.peak["sbuf"]
            self.last_report.psum_peak_bytes = ctx.memory.peak["psum"]
            self.last_report.over_capacity_bytes = dict(ctx.memory.over_capacity)
        return outputs, self.last_report


def jit(fn=None, **kwargs):
    """``nki.jit``: wrap a kernel function; it runs on the emulator when called."""
    if fn is None:
        return lambda f: Kernel(f, **kwargs)
    if isinstance(fn, Kernel):
        return fn
    return Kernel(fn, **kwargs)


def simulate(kernel):
    """``nki.simulate(kernel)``: the emulator is a simulator, so this returns the kernel as a callable."""
    return kernel if isinstance(kernel, Kernel) else Kernel(kernel)


def simulate_kernel(kernel, *args, **kwargs):
    """``neuronxcc.nki.simulate_kernel(kernel, *args)``."""
    return simulate(kernel)(*args, **kwargs)


baremetal = jit
benchmark = jit
trace = jit
profile = jit


def estimate(kernel, *args, target=None, grid=None, compute=True, **kwargs):
    """Run ``kernel`` and return ``(outputs, CostReport)``. ``compute=False`` skips the NumPy arithmetic (rules and
    costs only) for shapes too large to emulate quickly; outputs are then not meaningful."""
    k = kernel if isinstance(kernel, Kernel) else Kernel(kernel)
    if grid is not None:
        k = k[grid]
    return k.run(*args, target=target, compute=compute, **kwargs)


# ------------------------------------------------------------------------------------------ module objects `nki`, ...
def _make_nki_module() -> types.ModuleType:
    """A module object shaped like the real ``nki`` package (``nki.jit``, ``nki.language``, ``nki.isa``...)."""
    mod = types.ModuleType("nki", "NKI emulator (optimum_qwen35.kernels.emulator)")
    for name in ("jit", "simulate", "simulate_kernel", "baremetal", "benchmark", "trace", "profile", "estimate",
                 "configure", "Kernel", "NkiTensor", "NkiValidationError", "NkiRuleError", "IS_EMULATOR",
                 "__version__"):
        setattr(mod, name, globals()[name])
    mod.language, mod.isa, mod.cost, mod.rules, mod.typing, mod.compiler = language, isa, cost, rules, typing, compiler
    mod.dtype = np.dtype  # `nki.dtype`: the type of NKI dtypes (annotations)
    mod.__path__ = []  # a package, so `import nki.language` resolves once installed in sys.modules
    return mod


nki = _make_nki_module()


def install_as_nki(legacy: bool = True) -> types.ModuleType:
    """Register the emulator as ``nki`` (and, with ``legacy``, ``neuronxcc.nki``) in ``sys.modules`` so that kernel
    files doing ``import nki.language as nl`` run unmodified. Returns the ``nki`` module object."""
    sys.modules["nki"] = nki
    sys.modules["nki.language"] = language
    sys.modules["nki.isa"] = isa
    sys.modules["nki.isa.constants"] = isa_constants
    sys.modules["nki.typing"] = typing
    sys.modules["nki.compiler"] = compiler
    if legacy:
        neuronxcc = types.ModuleType("neuronxcc")
        neuronxcc.__path__ = []
        neuronxcc.nki = nki
        sys.modules.setdefault("neuronxcc", neuronxcc)
        sys.modules["neuronxcc.nki"] = nki
        sys.modules["neuronxcc.nki.language"] = language
        sys.modules["neuronxcc.nki.isa"] = isa
        sys.modules["neuronxcc.nki.typing"] = typing
        sys.modules["neuronxcc.nki.compiler"] = compiler
    return nki


# `import optimum_qwen35.kernels.emulator as nki` works too.
language = language
isa = isa

__all__ = ["nki", "language", "isa", "jit", "simulate", "estimate", "configure", "install_as_nki", "Kernel",
           "NkiTensor", "NkiRuleError", "NkiValidationError", "CostReport", "Target", "TARGETS"]
