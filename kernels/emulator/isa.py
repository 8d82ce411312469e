"""``nki.isa`` (``nisa``) for the emulator: NKI 0.3 instructions that write into an explicit destination.

Each instruction checks the hardware rules of its ``nki.isa`` reference page (``rules.py``), computes in float32 as the
engines do ("the engine automatically casts input data types to float32 and performs the computation in float32
math"), casts to ``dst.dtype`` with true round-to-nearest-even, and records its cost (``cost.py``).

The older functional forms of ``neuronxcc.nki.isa`` (no ``dst``, result returned) are accepted for the instructions
that public kernels use most; the result then goes to a new SBUF tile (PSUM for ``nc_matmul``/``nc_transpose``).
"""

from __future__ import annotations

import enum

import numpy as np

from . import cost, runtime
from .language import equal, float32, resolve_op
from .rules import NkiRuleError, NkiValidationError  # noqa: F401
from .tensors import (
    FLOAT8,
    NkiTensor,
    _IndirectView,
    _OutOfBoundsView,
    allocate,
    bfloat16,
    float16,
    is_float,
    psum,
    sbuf,
    storage_dtype,
    tfloat32,
)


# ----------------------------------------------------------------------------------------------------------- enums
class engine(enum.Enum):
    tensor = 1
    vector = 5
    scalar = 2
    gpsimd = 3
    dma = 4
    sync = 6
    unknown = 0


tensor_engine, vector_engine, scalar_engine, gpsimd_engine, unknown_engine = (
    engine.tensor, engine.vector, engine.scalar, engine.gpsimd, engine.unknown)


class reduce_cmd(enum.Enum):
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class dge_mode(enum.Enum):
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class oob_mode(enum.Enum):
    error = 0
    skip = 1


class matmul_perf_mode(enum.Enum):
    none = "none"
    double_row = "double_row"


class nc_version(enum.IntEnum):  # ordered: the NKI Library compares `get_nc_version() >= nc_version.gen3`
    gen2 = 2
    gen3 = 3
    gen4 = 4


def get_nc_version():
    return nc_version(runtime.current().target.nc_version)


def get_nc_sub_version():
    return 0


# --------------------------------------------------------------------------------------------------------- helpers
def _tensor(x, what):
    if not isinstance(x, (NkiTensor, _IndirectView, _OutOfBoundsView)):
        raise TypeError(f"{what} must be an NKI tensor, got {type(x).__name__}")
    return x


def _on_chip(t: NkiTensor, instr: str, what: str):
    if not t.on_chip:
        raise NkiRuleError("memory-type", f"{instr}: {what} must be in SBUF or PSUM, got {t.buffer.value}")
    if t.partitions > runtime.current().target.partitions:
        raise NkiRuleError("partition-dim", f"{instr}: {what} {t.shape} spans {t.partitions} partitions (max 128)")


def _no_psum(instr, eng, *tensors):
    for t in tensors:
        if isinstance(t, NkiTensor) and t.buffer is psum:
            rule = "dma-psum" if eng == "dma" else "gpsimd-psum"
            raise NkiRuleError(rule, f"{instr} on the {eng} engine cannot access PSUM tensor {t.name}")


def _not_both_psum(instr, a, b):
    if isinstance(a, NkiTensor) and isinstance(b, NkiTensor) and a.buffer is psum and b.buffer is psum:
        raise NkiRuleError(
            "two-psum-inputs", f"{instr}: the two tensor inputs cannot both be in PSUM ({a.name}, {b.name})"
        )


def _same_layout(instr, dst, src, what="src"):
    if dst.partitions != src.partitions or dst.free_size != src.free_size:
        raise NkiRuleError(
            "shape",
            f"{instr}: dst {dst.shape} and {what} {src.shape} need the same partitions and elements per partition",
        )


def _f32(t: NkiTensor, instr: str) -> np.ndarray:
    """Values as float32 (the engines' math precision) in the tile's (partition, free) layout."""
    v = t.read(what=instr)
    return v.astype(np.float32) if is_float(t.dtype) else v.astype(np.float64)


def _flat(v: np.ndarray, t: NkiTensor) -> np.ndarray:
    return v.reshape(t.partitions, t.free_size)


def _write(dst: NkiTensor, values) -> None:
    dst.write(np.asarray(values).reshape(dst.cshape))


def _operand(x, data: NkiTensor, instr: str, what: str):
    """A scalar or a per-partition vector ((P, 1) or (P,) tile), broadcast along the free axis."""
    if isinstance(x, NkiTensor):
        if x.partitions != data.partitions or x.free_size != 1:
            raise NkiRuleError(
                "shape", f"{instr}: {what} must be a scalar or a ({data.partitions}, 1) tile, got {x.shape}"
            )
        return _f32(x, instr).reshape(data.partitions, 1)
    if x is None:
        return None
    return np.float32(x)


def _apply(op, a, b, reverse=False):
    op = resolve_op(op)
    if op.arity == 1:
        return op.fn(a)
    return op.fn(b, a) if reverse else op.fn(a, b)


def _engine_name(e, default):
    if e is None or e is engine.unknown:
        return default
    return e.name if isinstance(e, engine) else str(e)


def _record_vector(name, eng, n_elems, n_inputs, tensors, reads, writes):
    ctx = runtime.current()
    if eng == "scalar":
        cycles = cost.scalar_cycles(n_elems)
    elif eng == "gpsimd":
        cycles = cost.gpsimd_cycles(n_elems)
    else:
        cycles = cost.vector_cycles(ctx.target, n_elems, n_inputs, [t.dtype for t in tensors])
    runtime.record(eng, name, cycles, reads=reads, writes=writes)


def _no_other_keywords(fn, kwargs):
    """NKI 0.3's instructions take exactly their documented keywords (nki/api/nki/isa/__init__.py of the Neuron SDK):
    one that NKI does not take is a TypeError there, so it is one here, not silently ignored (an ``engine=`` given
    to a VectorE-only instruction would otherwise cost its work on the wrong engine)."""
    if kwargs:
        why = "; scalar_tensor_tensor runs on VectorE only" if fn == "scalar_tensor_tensor" else ""
        raise TypeError(f"nisa.{fn}() got an unexpected keyword argument {next(iter(kwargs))!r} (NKI 0.3 has no such "
                        f"parameter{why})")


def _arg(args, kwargs, name, index):
    """An argument of a neuronxcc functional call, given by keyword or position."""
    if name in kwargs:
        return kwargs.pop(name)
    return args[index] if index < len(args) else None


def _is_dst_form(args, kwargs, n_new_api_tensors):
    """True when called in the NKI 0.3 form (``dst`` first): by keyword, or ``n`` leading tensor arguments."""
    if "dst" in kwargs:
        return True
    lead = 0
    for a in args:
        if isinstance(a, NkiTensor):
            lead += 1
        else:
            break
    return lead >= n_new_api_tensors


# ------------------------------------------------------------------------------------------------------------ DMA
def _chunks(t) -> int:
    """Number of contiguous runs (DMA buffers) a view is made of."""
    if isinstance(t, _IndirectView):
        return t.view.partitions
    run, n = 1, 1
    dims = list(zip(t.shape, t.strides))
    contiguous = True
    for size, stride in reversed(dims):
        if contiguous and (stride == run or size == 1):
            run *= size
        else:
            contiguous = False
            n *= size
    return n


def dma_copy(dst, src, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown, engine=engine.unknown,
             name=None, **kwargs):
    """``nisa.dma_copy``: ``dst = src`` between HBM and SBUF (either side may be either); casts through float32
    when dtypes differ ("first casting from src.dtype to float32, then from float32 to dst.dtype"). DMA cannot
    access PSUM. Element counts must match."""
    _no_other_keywords("dma_copy", kwargs)
    _tensor(dst, "dst")
    _tensor(src, "src")
    _no_psum("dma_copy", "dma", dst, src)
    for t in (dst, src):
        if isinstance(t, _OutOfBoundsView):
            if getattr(oob_mode, "name", oob_mode) == "skip":
                # "skip: Silently skip the runtime out-of-bounds access" (nki.isa.oob_mode); the whole transfer here.
                runtime.record("dma", "dma_copy (skipped)", reads=[], writes=[], nbytes=0, chunks=1)
                return dst
            raise NkiRuleError(
                "out-of-bounds",
                f"dma_copy: runtime scalar_offset {t.offset_value} puts the access outside {t.name} "
                f"(pass oob_mode=nisa.oob_mode.skip to skip it)",
            )
    if isinstance(src, _IndirectView) or isinstance(dst, _IndirectView):
        _dma_indirect(dst, src, getattr(oob_mode, "name", oob_mode) == "skip")
    else:
        if dst.size != src.size:
            raise NkiRuleError("shape", f"dma_copy: dst {dst.shape} and src {src.shape} hold different element counts")
        if runtime.current().compute:
            vals = src.read(what="dma_copy")
            if src.dtype != dst.dtype and is_float(src.dtype):
                vals = vals.astype(np.float32)
            dst.write(vals.reshape(dst.cshape))
        else:
            dst._mark_written()
    nbytes = dst.size * dst.itemsize
    chunks = max(_chunks(dst), _chunks(src))
    runtime.record("dma", "dma_copy", reads=[src, *_offset_sources(src, dst)], writes=[dst], nbytes=nbytes,
                   chunks=chunks)
    return dst


def dma_compute(dst, srcs, scales=None, reduce_op=None, unique_indices=True, oob_mode=oob_mode.error, name=None,
                **kwargs):
    """``nisa.dma_compute``: ``dst = reduce_op(srcs[0] * scales[0], srcs[1] * scales[1], ...)`` computed by the DMA
    engines in float32 and cast to dst's dtype. "Currently, only nl.add is supported for reduce_op, and all values in
    scales must be 1.0" (or None). Sources and destination in HBM or SBUF, not PSUM. The read-modify-write form with a
    ``vector_offset`` source is not emulated. Priced as one DMA moving every source's bytes."""
    _no_other_keywords("dma_compute", kwargs)
    _tensor(dst, "dst")
    srcs = list(srcs)
    if not srcs:
        raise NkiRuleError("shape", "dma_compute: needs at least one source")
    for i, src in enumerate(srcs):
        _tensor(src, f"srcs[{i}]")
        if isinstance(src, (_IndirectView, _OutOfBoundsView)):
            raise NotImplementedError("dma_compute with a vector_offset (read-modify-write) source is not emulated")
        if src.size != dst.size:
            raise NkiRuleError("shape", f"dma_compute: srcs[{i}] {src.shape} and dst {dst.shape} hold different "
                               "element counts")
    _no_psum("dma_compute", "dma", dst, *srcs)
    if reduce_op is not None and resolve_op(reduce_op).name != "add":
        raise NkiRuleError("dtype", "dma_compute: only nl.add is supported for reduce_op")
    if scales is not None and (len(scales) != len(srcs) or any(float(sc) != 1.0 for sc in scales)):
        raise NkiRuleError("shape", "dma_compute: scales must be one 1.0 per source (or None)")
    if runtime.current().compute:
        acc = np.zeros(dst.cshape, np.float32)
        for src in srcs:
            acc += src.read(what="dma_compute").astype(np.float32).reshape(dst.cshape)
        dst.write(acc)
    else:
        dst._mark_written()
    nbytes = sum(src.size * src.itemsize for src in srcs)
    chunks = max(_chunks(t) for t in [dst, *srcs])
    runtime.record("dma", "dma_compute", reads=srcs, writes=[dst], nbytes=nbytes, chunks=chunks)
    return dst


def _offset_sources(*views):
    """The on-chip tiles the transfer's runtime addresses come from (``scalar_offset``, ``vector_offset``): the DMA
    cannot start before they are written."""
    return [t for v in views for t in getattr(v, "offset_sources", ())]


def _dma_indirect(dst, src, skip=False):
    """Gather or scatter row by row. A row whose runtime index puts it outside the tensor raises, or, with
    ``oob_mode.skip``, is skipped ("silently skip the runtime out-of-bounds access", nki.isa.oob_mode)."""
    view = src if isinstance(src, _IndirectView) else dst

    def rows():
        for r, row in view.rows():
            if row._in_bounds():
                yield r, row
            elif not skip:
                raise NkiRuleError("out-of-bounds", f"dma_copy: row {r}'s runtime index puts it outside {view.name} "
                                   f"(pass oob_mode=nisa.oob_mode.skip to skip it)")

    if isinstance(src, _IndirectView):  # gather: row r of dst <- row index[r] of src
        for r, row in rows():
            key = [slice(None)] * dst.ndim
            key[0] = r
            d = dst[tuple(key)]
            d.write(row.read(what="dma_copy gather").reshape(d.shape))
    else:  # scatter
        for r, row in rows():
            key = [slice(None)] * src.ndim
            key[0] = r
            s = src[tuple(key)]
            row.write(s.read(what="dma_copy scatter").reshape(row.shape))


# The permutation of each source rank, and the only ones supported (``nki.isa.dma_transpose`` page: "For 2-d input tile,
# the permutation will be [1, 0]; for 3-d ... [2, 1, 0]; for 4-d ... [3, 1, 2, 0]"; "Supported axes are (1, 0),
# (2, 1, 0), and (3, 1, 2, 0)"; "the i-th axis of the transposed tile will correspond to the axes[i] of the source").
DMA_TRANSPOSE_AXES = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}


def dma_transpose(dst, src, axes=None, priority=None, dge_mode=None, oob_mode=None, name=None, **kwargs):
    """``nisa.dma_transpose(dst, src, axes)``: permute the axes of ``src`` while moving it (DMA engines): dst axis i is
    src axis ``axes[i]``; by default (1, 0), (2, 1, 0) or (3, 1, 2, 0) for a 2-D, 3-D or 4-D source. ``dst`` has the
    permuted shape (or, with another rank, the same element count). SBUF or HBM, not PSUM."""
    _no_other_keywords("dma_transpose", kwargs)
    _tensor(dst, "dst")
    _tensor(src, "src")
    _no_psum("dma_transpose", "dma", dst, src)
    default = DMA_TRANSPOSE_AXES.get(src.ndim)
    if default is None:
        raise NkiRuleError("shape", f"dma_transpose takes a 2-D, 3-D or 4-D source, got {src.shape}")
    axes = default if axes is None else tuple(int(a) for a in axes)
    if axes != default:
        raise NkiRuleError("shape", f"dma_transpose of a {src.ndim}-D source supports axes {default} only, got {axes}")
    permuted = tuple(src.shape[a] for a in axes)
    if dst.size != src.size or (dst.ndim == src.ndim and tuple(dst.shape) != permuted):
        raise NkiRuleError("shape", f"dma_transpose: dst {dst.shape} must have the permuted shape {permuted}")
    if getattr(src, "pa", 0) or getattr(dst, "pa", 0):
        raise NotImplementedError("dma_transpose of neuronxcc block-dim tensors is not emulated")
    if runtime.current().compute:
        vals = np.transpose(src.read(what="dma_transpose"), axes)
        if src.dtype != dst.dtype and is_float(src.dtype):
            vals = vals.astype(np.float32)
        dst.write(np.ascontiguousarray(vals).reshape(dst.shape))
    else:
        dst._mark_written()
    nbytes = dst.size * dst.itemsize
    # Trainium2 guide: the 16 DMA engines write one [128 partitions, 16 contiguous elements] destination tile at a
    # time; the cost model may charge whole tiles (CostParams.dma_transpose_padding).
    rows = dst.shape[0] if dst.ndim > 1 else 1
    tiles = -(-rows // 128) * -(-(dst.size // rows) // 16)
    runtime.record("dma", "dma_transpose", reads=[src, *_offset_sources(src, dst)], writes=[dst], nbytes=nbytes,
                   transpose="sbuf" if src.on_chip else "hbm", padded_nbytes=tiles * 128 * 16 * dst.itemsize)
    return dst


# ------------------------------------------------------------------------------------------------------- copies, fill
def tensor_copy(*args, **kwargs):
    """``nisa.tensor_copy(dst, src, engine)``: copy within SBUF/PSUM on VectorE, ScalarE or GpSimd; bit-exact when
    dtypes match, through float32 otherwise. GpSimd cannot access PSUM."""
    if not _is_dst_form(args, kwargs, 2):
        src = _arg(args, kwargs, "src", 0)
        out = allocate(src.shape, kwargs.pop("dtype", None) or src.dtype, sbuf)
        return tensor_copy(out, src, engine=kwargs.get("engine", engine.unknown))
    return _tensor_copy(*args, **kwargs)


def _tensor_copy(dst, src, engine=engine.unknown, name=None, dtype=None, **kwargs):
    _no_other_keywords("tensor_copy", kwargs)
    _on_chip(dst, "tensor_copy", "dst")
    _on_chip(src, "tensor_copy", "src")
    eng = _engine_name(engine, "vector")
    if eng == "gpsimd":
        _no_psum("tensor_copy", "gpsimd", dst, src)
    _same_layout("tensor_copy", dst, src)
    vals = src.read(what="tensor_copy")
    if src.dtype != dst.dtype and is_float(src.dtype):
        vals = vals.astype(np.float32)
    _write(dst, _flat(vals, src))
    _record_vector("tensor_copy", eng, src.free_size, 1, [src, dst], [src], [dst])
    return dst


def tensor_copy_predicated(dst, src, predicate, reverse_pred=False, name=None, **kwargs):
    """``nisa.tensor_copy_predicated``: on VectorE, where ``predicate`` (uint8/16/32) is nonzero (zero with
    ``reverse_pred``) the element of ``src`` (a tile, or a scalar copied as dst's dtype) is copied to ``dst``;
    elsewhere ``dst`` keeps its value. ``src`` and ``predicate`` not both in PSUM; a tile ``src`` has dst's dtype and
    layout; ``reverse_pred`` only with a scalar ``src`` (SDK 2.33 page)."""
    _no_other_keywords("tensor_copy_predicated", kwargs)
    _on_chip(dst, "tensor_copy_predicated", "dst")
    _on_chip(predicate, "tensor_copy_predicated", "predicate")
    if np.dtype(predicate.dtype) not in (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32)):
        raise NkiRuleError("dtype", f"tensor_copy_predicated: predicate must be uint8/16/32, got {predicate.dtype}")
    _same_layout("tensor_copy_predicated", dst, predicate)
    scalar = not isinstance(src, NkiTensor)
    if scalar:
        vals = np.full(dst.cshape, src, dtype=np.float32 if is_float(dst.dtype) else np.float64)
    else:
        _on_chip(src, "tensor_copy_predicated", "src")
        _not_both_psum("tensor_copy_predicated", src, predicate)
        _same_layout("tensor_copy_predicated", dst, src)
        if src.dtype != dst.dtype:
            raise NkiRuleError("dtype", f"tensor_copy_predicated: src {src.dtype} and dst {dst.dtype} differ")
        if reverse_pred:
            raise NkiRuleError("dtype", "tensor_copy_predicated: reverse_pred only with a scalar src")
        vals = _flat(src.read(what="tensor_copy_predicated"), src)
    keep = _flat(predicate.read(what="tensor_copy_predicated"), predicate) != 0
    if reverse_pred:
        keep = ~keep
    old = _flat(dst.read(what="tensor_copy_predicated", check=False), dst)
    _write(dst, np.where(keep, _flat(vals, dst) if scalar else vals, old))
    reads = [predicate, dst] + ([] if scalar else [src])
    _record_vector("tensor_copy_predicated", "vector", dst.free_size, 1 if scalar else 2, [dst, predicate], reads,
                   [dst])
    return dst


def memset(dst, value, engine=engine.unknown, name=None, **kwargs):
    """``nisa.memset``: fill ``dst`` with a constant (VectorE or GpSimd)."""
    _no_other_keywords("memset", kwargs)
    _tensor(dst, "dst")
    eng = _engine_name(engine, "vector")
    if eng == "gpsimd":
        _no_psum("memset", "gpsimd", dst)
    dst.write(np.full(dst.shape, value, dtype=np.float64 if not is_float(dst.dtype) else np.float32))
    _record_vector("memset", eng, dst.free_size if dst.on_chip else dst.size, 1, [dst], [], [dst])
    return dst


# -------------------------------------------------------------------------------------------------------- TensorE
_MATMUL_DTYPES = (np.dtype(np.float32), bfloat16, float16, *FLOAT8)


def nc_matmul(*args, **kwargs):
    """``nisa.nc_matmul(dst, stationary, moving, ..., accumulate=None)``: ``dst = stationary.T @ moving`` on TensorE.

    Rules (``nki.isa.nc_matmul`` reference, NeuronCore-v2/v3): stationary and moving in SBUF with the same partition
    size <= 128 (the contraction); stationary free size <= 128; moving free size <= 512; ``dst`` an fp32 PSUM tile of
    shape (stationary free, moving free); inputs fp8/bf16/fp16/tf32/fp32, and fp32/tf32 only with fp32/tf32.

    ``accumulate``: True adds to ``dst``; False overwrites; None ("first write overwrites, subsequent writes
    accumulate") is emulated per PSUM element: a matmul accumulates onto elements whose last write was a matmul and
    that nothing has read since; otherwise it overwrites. Accumulating onto memory never written raises
    ``[uninitialized-read]`` (undefined behaviour on hardware).
    """
    if not _is_dst_form(args, kwargs, 3):
        stationary, moving = _arg(args, kwargs, "stationary", 0), _arg(args, kwargs, "moving", 1)
        out = allocate((stationary.free_size, moving.free_size), float32, psum)
        return _nc_matmul(out, stationary, moving, **kwargs)
    return _nc_matmul(*args, **kwargs)


def _check_matmul(dst, stationary, moving, instr="nc_matmul"):
    ctx = runtime.current()
    for what, t in (("stationary", stationary), ("moving", moving)):
        if t.buffer is not sbuf:
            raise NkiRuleError("matmul-sbuf-inputs", f"{instr}: {what} must be in SBUF, got {t.buffer.value}")
    if dst.buffer is not psum:
        raise NkiRuleError("matmul-psum-dst", f"{instr}: dst must be in PSUM, got {dst.buffer.value}")
    if stationary.partitions != moving.partitions or stationary.partitions > ctx.target.partitions:
        raise NkiRuleError(
            "matmul-contraction",
            f"{instr}: stationary {stationary.shape} and moving {moving.shape} must have the same partition "
            f"(contraction) size <= {ctx.target.partitions}",
        )
    if stationary.free_size > ctx.target.stationary_fmax:
        raise NkiRuleError(
            "matmul-stationary-fsize",
            f"{instr}: stationary free size {stationary.free_size} > {ctx.target.stationary_fmax}",
        )
    if moving.free_size > ctx.target.moving_fmax:
        raise NkiRuleError(
            "matmul-moving-fsize", f"{instr}: moving free size {moving.free_size} > {ctx.target.moving_fmax}"
        )
    if dst.partitions != stationary.free_size or dst.free_size != moving.free_size:
        raise NkiRuleError(
            "shape",
            f"{instr}: dst {dst.shape} must be (stationary free {stationary.free_size}, "
            f"moving free {moving.free_size})",
        )


def _nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False, is_transpose=False,
               accumulate=None, tile_position=(), tile_size=(), perf_mode=None, name=None, **kwargs):
    _no_other_keywords("nc_matmul", kwargs)
    _check_matmul(dst, stationary, moving)
    # A transposing matmul (is_transpose=True: moving is the identity) is TensorE's transpose path, whose output keeps
    # the input's dtype as nc_transpose's does; on NeuronCore-v3 the NKI Library writes it so (bwmm_shard_on_I.py:
    # `psum_dtype = ... dtype if get_nc_version() >= gen3 else nl.float32`). Inferred from that code, not a doc page.
    transpose_dtype = is_transpose and runtime.current().target.nc_version >= 3 and dst.dtype == stationary.dtype
    if dst.dtype != float32 and not transpose_dtype:
        raise NkiRuleError("matmul-psum-dst", f"nc_matmul: dst must be float32 on NeuronCore-v2/v3, got {dst.dtype}")
    for t in (stationary, moving):
        if t.dtype is not tfloat32 and np.dtype(t.dtype) not in _MATMUL_DTYPES:
            raise NkiRuleError("matmul-dtype", f"nc_matmul: unsupported input dtype {t.dtype}")
    wide = [t.dtype is tfloat32 or t.dtype == float32 for t in (stationary, moving)]
    if any(wide) and not all(wide):
        raise NkiRuleError(
            "matmul-dtype", f"nc_matmul: fp32/tf32 pairs only with fp32/tf32, got {stationary.dtype} x {moving.dtype}"
        )
    ctx = runtime.current()
    if ctx.compute:
        s = _flat(_f32(stationary, "nc_matmul"), stationary)
        m = _flat(_f32(moving, "nc_matmul"), moving)
        product = (s.T.astype(np.float32) @ m.astype(np.float32)).reshape(dst.cshape)
        _accumulate_psum(dst, product, accumulate)
    else:
        dst._mark_written()
        dst._view_of(dst._buf.acc_open, bool)[...] = True
    # The 4x rate is fp32's; tf32 runs at the bf16 rate ("79 BF16/FP16/TF32 TFLOPS", NeuronCore-v3 architecture page;
    # the cost-model docs list tf32 with bf16), so a tf32 operand (with an fp32 or tf32 partner) costs 1x.
    fp32 = all(t.dtype == float32 and t.dtype is not tfloat32 for t in (stationary, moving))
    trace = ctx.trace
    if trace is not None:
        key = (stationary._buf.uid, stationary.offset, stationary.shape)
        if trace.loaded_stationary != key:
            cycles = cost.load_stationary_cycles(stationary.free_size, fp32)
            runtime.record("tensor", "LoadStationary", cycles, reads=[stationary])
            trace.loaded_stationary = key
        cycles = cost.matmul_cycles(moving.free_size, fp32)
        runtime.record("tensor", "MultiplyMoving", cycles, reads=[moving], writes=[dst])
    return dst


def _accumulate_psum(dst: NkiTensor, product: np.ndarray, accumulate):
    acc_view = dst._c(dst._view_of(dst._buf.acc_open, bool))
    if accumulate is None:
        add_mask = acc_view.copy()
    else:
        add_mask = np.full(dst.cshape, bool(accumulate))
    if add_mask.any():
        written = dst._c(dst._written())
        if runtime.current().uninitialized == "error" and not written[add_mask].all():
            raise NkiRuleError(
                "uninitialized-read", f"nc_matmul accumulates onto PSUM {dst.name} that was never written"
            )
        current = dst._c(dst._np()).astype(np.float32)
        product = np.where(add_mask, current + product, product)
    dst.write(product)
    acc_view[...] = True


def nc_transpose(*args, **kwargs):
    """``nisa.nc_transpose(dst, data, engine)``: 2D partition <-> free transpose, on TensorE (<= 128x128, SBUF ->
    PSUM, same dtype out) or VectorE (<= 32x32)."""
    if not _is_dst_form(args, kwargs, 2):
        data = _arg(args, kwargs, "data", 0)
        eng = _engine_name(kwargs.get("engine"), "tensor" if max(data.partitions, data.free_size) > 32 else "vector")
        out = allocate((data.free_size, data.partitions), data.dtype, psum if eng == "tensor" else sbuf)
        return _nc_transpose(out, data, **kwargs)
    return _nc_transpose(*args, **kwargs)


def _nc_transpose(dst, data, engine=engine.unknown, name=None, **kwargs):
    _no_other_keywords("nc_transpose", kwargs)
    eng = _engine_name(engine, "tensor" if max(data.partitions, data.free_size) > 32 else "vector")
    limit = 128 if eng == "tensor" else 32
    if data.partitions > limit or data.free_size > limit:
        raise NkiRuleError(
            "transpose-size", f"nc_transpose on {eng} engine handles at most {limit}x{limit}, got {data.shape}"
        )
    if eng == "tensor":
        if data.buffer is not sbuf:
            raise NkiRuleError("memory-type", f"nc_transpose on TensorE reads SBUF, got {data.buffer.value}")
        if dst.buffer is not psum:
            raise NkiRuleError("memory-type", f"nc_transpose on TensorE writes PSUM, got {dst.buffer.value}")
    if dst.dtype != data.dtype:
        raise NkiRuleError("dtype", f"nc_transpose: dst dtype {dst.dtype} must equal input dtype {data.dtype}")
    if dst.partitions != data.free_size or dst.free_size != data.partitions:
        raise NkiRuleError("shape", f"nc_transpose: dst {dst.shape} must be the transpose of {data.shape}")
    vals = data.read(what="nc_transpose")
    _write(dst, _flat(vals, data).T)
    if eng == "tensor":
        runtime.record("tensor", "LoadStationary", cost.load_stationary_cycles(data.free_size, False), reads=[data])
        runtime.record("tensor", "Transpose", cost.matmul_cycles(data.partitions, False), writes=[dst])
        trace = runtime.current().trace
        if trace is not None:
            trace.loaded_stationary = None
    else:
        _record_vector("nc_transpose", "vector", data.free_size, 1, [data], [data], [dst])
    return dst


# ------------------------------------------------------------------------------------------------------ VectorE/GpSimd
def tensor_tensor(*args, **kwargs):
    """``nisa.tensor_tensor(dst, data1, data2, op, engine)``: element-wise ``op(data1, data2)`` in float32 on VectorE
    (``nl.power`` on GpSimd, which cannot access PSUM); the two inputs cannot both be in PSUM."""
    if not _is_dst_form(args, kwargs, 3):
        data1, data2 = _arg(args, kwargs, "data1", 0), _arg(args, kwargs, "data2", 1)
        op = _arg(args, kwargs, "op", 2)
        out = allocate(data1.shape, kwargs.pop("dtype", None) or data1.dtype, sbuf)
        kwargs.pop("mask", None)
        return _tensor_tensor(out, data1, data2, op, **kwargs)
    return _tensor_tensor(*args, **kwargs)


def _tensor_tensor(dst, data1, data2, op, engine=engine.unknown, name=None, **kwargs):
    _no_other_keywords("tensor_tensor", kwargs)
    op = resolve_op(op)
    eng = "gpsimd" if op.engine == "gpsimd" else _engine_name(engine, "vector")
    if eng == "gpsimd":
        _no_psum("tensor_tensor", "gpsimd", dst, data1, data2)
    _not_both_psum("tensor_tensor", data1, data2)
    for t, what in ((dst, "dst"), (data1, "data1"), (data2, "data2")):
        _on_chip(t, "tensor_tensor", what)
    _same_layout("tensor_tensor", dst, data1, "data1")
    _same_layout("tensor_tensor", dst, data2, "data2")
    a, b = _flat(_f32(data1, "tensor_tensor"), data1), _flat(_f32(data2, "tensor_tensor"), data2)
    if op.bitvec:
        a, b = a.astype(np.int64), b.astype(np.int64)
    _write(dst, op.fn(a, b))
    _record_vector(f"tensor_tensor[{op.name}]", eng, data1.free_size, 2, [data1, data2, dst], [data1, data2], [dst])
    return dst


def tensor_scalar(*args, **kwargs):
    """``nisa.tensor_scalar(dst, data, op0, operand0, reverse0, op1, operand1, reverse1, engine)``:
    ``(data op0 operand0) op1 operand1`` with scalar or (P, 1) operands broadcast along the free axis."""
    if not _is_dst_form(args, kwargs, 2):
        data = _arg(args, kwargs, "data", 0)
        out = allocate(data.shape, kwargs.pop("dtype", None) or data.dtype, sbuf)
        kwargs.pop("mask", None)
        return _tensor_scalar(out, data, *args[1:], **kwargs)
    return _tensor_scalar(*args, **kwargs)


def _tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                   engine=engine.unknown, name=None, **kwargs):
    _no_other_keywords("tensor_scalar", kwargs)
    eng = _engine_name(engine, "vector")
    if eng == "gpsimd":
        _no_psum("tensor_scalar", "gpsimd", dst, data, operand0, operand1)
    _on_chip(data, "tensor_scalar", "data")
    _on_chip(dst, "tensor_scalar", "dst")
    _same_layout("tensor_scalar", dst, data, "data")
    x = _flat(_f32(data, "tensor_scalar"), data)
    o0 = _operand(operand0, data, "tensor_scalar", "operand0")
    res = _apply(op0, x, o0, reverse0)
    if op1 is not None:
        res = _apply(op1, res, _operand(operand1, data, "tensor_scalar", "operand1"), reverse1)
    _write(dst, res)
    reads = [t for t in (data, operand0, operand1) if isinstance(t, NkiTensor)]
    _record_vector("tensor_scalar", eng, data.free_size, 1, [data, dst], reads, [dst])
    return dst


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, name=None, **kwargs):
    """``nisa.scalar_tensor_tensor``: ``(data op0 operand0) op1 operand1`` on VectorE; ``operand0`` scalar or
    (P, 1); ``operand1`` same shape as ``data``; ``data`` and ``operand1`` not both in PSUM."""
    _no_other_keywords("scalar_tensor_tensor", kwargs)
    _not_both_psum("scalar_tensor_tensor", data, operand1)
    _same_layout("scalar_tensor_tensor", dst, data, "data")
    _same_layout("scalar_tensor_tensor", dst, operand1, "operand1")
    x = _flat(_f32(data, "scalar_tensor_tensor"), data)
    tmp = _apply(op0, x, _operand(operand0, data, "scalar_tensor_tensor", "operand0"), reverse0)
    res = _apply(op1, tmp, _flat(_f32(operand1, "scalar_tensor_tensor"), operand1), reverse1)
    _write(dst, res)
    reads = [t for t in (data, operand0, operand1) if isinstance(t, NkiTensor)]
    _record_vector("scalar_tensor_tensor", "vector", data.free_size, 2, [data, operand1, dst], reads, [dst])
    return dst


def _normalize_axes(data, axis):
    axes = axis if isinstance(axis, (tuple, list)) else (axis,)
    axes = tuple(sorted(a % data.ndim for a in axes))
    if 0 in axes and data.on_chip:
        raise NkiRuleError("partition-dim", "tensor_reduce cannot reduce the partition axis (axis 0)")
    if axes != tuple(range(data.ndim - len(axes), data.ndim)):
        raise NkiRuleError("shape", f"tensor_reduce axes {axes} must be the last contiguous free dims of {data.shape}")
    return axes


def tensor_reduce(*args, **kwargs):
    """``nisa.tensor_reduce(dst, op, data, axis, negate, keepdims)``: reduce the last free axes on VectorE."""
    if not _is_dst_form(args, kwargs, 1):
        op, data, axis = _arg(args, kwargs, "op", 0), _arg(args, kwargs, "data", 1), _arg(args, kwargs, "axis", 2)
        axes = _normalize_axes(data, axis)
        keep = kwargs.get("keepdims", False)
        if keep:
            shape = [1 if i in axes else n for i, n in enumerate(data.shape)]
        else:
            shape = [n for i, n in enumerate(data.shape) if i not in axes]
        out = allocate(shape if len(shape) > 1 else (data.partitions, 1), kwargs.pop("dtype", None) or data.dtype, sbuf)
        kwargs.pop("mask", None)
        return _tensor_reduce(out, op, data, axis, **kwargs)
    return _tensor_reduce(*args, **kwargs)


def _tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None, **kwargs):
    _no_other_keywords("tensor_reduce", kwargs)
    op = resolve_op(op)
    axes = _normalize_axes(data, axis)
    x = _f32(data, "tensor_reduce")
    if op.reduce is None:
        res = x
        for ax in axes:
            res = _fold_axis(op, res, ax)
    else:
        res = op.reduce(x, axis=axes, keepdims=True)
    if negate:
        res = -res
    if res.size != dst.size:
        raise NkiRuleError(
            "shape", f"tensor_reduce: dst {dst.shape} does not hold the reduction of {data.shape} over {axes}"
        )
    _write(dst, res)
    _record_vector(f"tensor_reduce[{op.name}]", "vector", data.free_size, 1, [data, dst], [data], [dst])
    return dst


def _fold_axis(op, v, ax):
    out = np.take(v, [0], axis=ax)
    for i in range(1, v.shape[ax]):
        out = op.fn(out, np.take(v, [i], axis=ax))
    return out


def tensor_partition_reduce(dst, op, data, name=None, **kwargs):
    """``nisa.tensor_partition_reduce``: reduce across partitions on GpSimd (no PSUM)."""
    _no_other_keywords("tensor_partition_reduce", kwargs)
    op = resolve_op(op)
    _no_psum("tensor_partition_reduce", "gpsimd", dst, data)
    x = _flat(_f32(data, "tensor_partition_reduce"), data)
    res = op.reduce(x, axis=0, keepdims=True) if op.reduce is not None else _fold_axis(op, x, 0)
    _write(dst, res)
    cycles = cost.gpsimd_cycles(data.free_size * data.partitions / 16)  # 8 cores x 16 partitions (assumption)
    runtime.record("gpsimd", "tensor_partition_reduce", cycles, reads=[data], writes=[dst])
    return dst


def tensor_tensor_scan(*args, **kwargs):
    """``nisa.tensor_tensor_scan(dst, data0, data1, initial, op0, op1, reverse0, reverse1)``: per partition,
    ``res[:, 0] = op1(op0(data0[:, 0], initial), data1[:, 0])`` and
    ``res[:, i] = op1(op0(data0[:, i], res[:, i-1]), data1[:, i])`` (VectorE, float32 math)."""
    if "dst" not in kwargs and len(args) <= 5:
        rest = args if "data0" in kwargs else args[1:]
        data0 = _arg(args, kwargs, "data0", 0)
        out = allocate(data0.shape, kwargs.pop("dtype", None) or data0.dtype, sbuf)
        kwargs.pop("mask", None)
        return _tensor_tensor_scan(out, data0, *rest, **kwargs)
    return _tensor_tensor_scan(*args, **kwargs)


def _tensor_tensor_scan(dst, data0, data1, initial, op0, op1, reverse0=False, reverse1=False, name=None, **kwargs):
    _no_other_keywords("tensor_tensor_scan", kwargs)
    _not_both_psum("tensor_tensor_scan", data0, data1)
    _same_layout("tensor_tensor_scan", dst, data0, "data0")
    _same_layout("tensor_tensor_scan", dst, data1, "data1")
    a = _flat(_f32(data0, "tensor_tensor_scan"), data0)
    b = _flat(_f32(data1, "tensor_tensor_scan"), data1)
    init = _operand(initial, data0, "tensor_tensor_scan", "initial")
    prev = np.broadcast_to(np.asarray(init, np.float32).reshape(-1), (a.shape[0],)).astype(np.float32)
    res = np.empty_like(a)
    op0, op1 = resolve_op(op0), resolve_op(op1)
    for i in range(a.shape[1]):
        t = op0.fn(prev, a[:, i]) if reverse0 else op0.fn(a[:, i], prev)
        prev = (op1.fn(b[:, i], t) if reverse1 else op1.fn(t, b[:, i])).astype(np.float32)
        res[:, i] = prev
    _write(dst, res)
    reads = [t for t in (data0, data1, initial) if isinstance(t, NkiTensor)]
    _record_vector("tensor_tensor_scan", "vector", data0.free_size, 2, [data0, data1, dst], reads, [dst])
    return dst


_CUMULATIVE_START = {"add": 0.0, "subtract": 0.0, "multiply": 1.0, "maximum": -np.inf, "minimum": np.inf}


def tensor_scalar_cumulative(dst, src, op0, op1, imm0, imm1=None, reduce_cmd=reduce_cmd.reset_reduce, name=None):
    """``nisa.tensor_scalar_cumulative``: per partition, along the free axes in order,
    ``reg = op1(op0(src[i], imm0), reg); dst[i] = reg`` (VectorE, float32 math), the ``nki.isa`` page's pseudo-code.
    ``reduce_cmd``: ``reset_reduce`` starts ``reg`` at ``op1``'s identity (0 for add / subtract, 1 for multiply,
    -inf for max, +inf for min), ``load_reduce`` at ``imm1`` (a scalar or a (P, 1) tile), ``reduce`` at the VectorE
    accumulator registers left by the previous cumulative instruction; the final ``reg`` is left in them.
    ``imm0`` is a scalar or a (P, 1) tile. The default is ``reset_reduce`` (the SDK 2.27 / 2.29 and latest pages; the
    2.31 page shows ``idle``, which its pseudo-code does not cover: treated as ``reset_reduce``)."""
    _on_chip(src, "tensor_scalar_cumulative", "src")
    _on_chip(dst, "tensor_scalar_cumulative", "dst")
    _same_layout("tensor_scalar_cumulative", dst, src, "src")
    r1 = resolve_op(op1)
    if r1.name not in _CUMULATIVE_START:
        raise NkiRuleError("dtype", f"tensor_scalar_cumulative: op1 must be add, subtract, multiply, max or min, "
                                    f"got {op1!r}")
    ctx = runtime.current()
    x = _flat(_f32(src, "tensor_scalar_cumulative"), src)
    pre = _apply(op0, x, _operand(imm0, src, "tensor_scalar_cumulative", "imm0"))
    p = src.partitions
    if reduce_cmd is reduce_cmd.load_reduce:
        if imm1 is None:
            raise NkiRuleError("shape", "tensor_scalar_cumulative: reduce_cmd=load_reduce needs imm1")
        init = _operand(imm1, src, "tensor_scalar_cumulative", "imm1")
        reg = np.broadcast_to(np.asarray(init, np.float32).reshape(-1), (p,)).astype(np.float32)
    elif reduce_cmd is reduce_cmd.reduce:
        if ctx.vector_reduce_regs is None:
            raise NkiRuleError("uninitialized-read", "tensor_scalar_cumulative: reduce_cmd=reduce before any "
                                                     "instruction set the VectorE accumulator registers")
        reg = ctx.vector_reduce_regs[:p].copy()
    else:
        reg = np.full((p,), _CUMULATIVE_START[r1.name], np.float32)
    res = np.empty_like(pre)
    for i in range(pre.shape[1]):
        reg = np.asarray(r1.fn(pre[:, i], reg), np.float32)
        res[:, i] = reg
    if ctx.vector_reduce_regs is None:
        ctx.vector_reduce_regs = np.zeros((128,), np.float32)
    ctx.vector_reduce_regs[:p] = reg
    _write(dst, res)
    reads = [t for t in (src, imm0, imm1) if isinstance(t, NkiTensor)]
    _record_vector("tensor_scalar_cumulative", "vector", src.free_size, 1, [src, dst], reads, [dst])
    return dst


def reciprocal(dst=None, data=None, name=None, **kwargs):
    """``nisa.reciprocal``: ``1 / data`` on VectorE."""
    if data is None:
        dst, data = None, dst
    if dst is None:
        dst = allocate(data.shape, kwargs.pop("dtype", None) or data.dtype, sbuf)
    _no_other_keywords("reciprocal", kwargs)
    _same_layout("reciprocal", dst, data, "data")
    _write(dst, 1.0 / _flat(_f32(data, "reciprocal"), data))
    _record_vector("reciprocal", "vector", data.free_size, 1, [data, dst], [data], [dst])
    return dst


def nc_stream_shuffle(dst, src, shuffle_mask, name=None, **kwargs):
    """``nisa.nc_stream_shuffle``: within each quadrant of 32 partitions, output partition ``i`` copies input
    partition ``shuffle_mask[i]`` (255: leave unmodified); same mask for every quadrant (VectorE)."""
    _no_other_keywords("nc_stream_shuffle", kwargs)
    if len(shuffle_mask) != 32:
        raise NkiRuleError("shape", f"nc_stream_shuffle: shuffle_mask must have 32 entries, got {len(shuffle_mask)}")
    if dst.dtype != src.dtype or dst.free_size != src.free_size:
        raise NkiRuleError("shape", "nc_stream_shuffle: dst needs src's dtype and elements per partition")
    vals = _flat(src.read(what="nc_stream_shuffle"), src)
    out = _flat(dst._np().copy(), dst)
    written = _flat(dst._written().copy(), dst)
    for p in range(dst.partitions):
        q, i = divmod(p, 32)
        m = int(shuffle_mask[i])
        if m == 255:
            continue
        s = q * 32 + m
        if s >= src.partitions:
            raise NkiRuleError(
                "out-of-bounds", f"nc_stream_shuffle: partition {p} reads source partition {s} of {src.partitions}"
            )
        out[p] = vals[s]
        written[p] = True
    dst._np()[...] = out.reshape(dst.shape)
    dst._written()[...] = written.reshape(dst.shape)
    _record_vector("nc_stream_shuffle", "vector", src.free_size, 1, [src, dst], [src], [dst])
    return dst


# ----------------------------------------------------------------------------------------------------------- GpSimd
def _pattern_values(dst, pattern, offset, channel_multiplier):
    pattern = [list(p) for p in pattern]
    counts = [int(n) for _, n in pattern]
    if int(np.prod(counts)) != dst.free_size:
        raise NkiRuleError(
            "shape",
            f"pattern {pattern} generates {int(np.prod(counts))} elements per partition, dst holds {dst.free_size}",
        )
    grids = np.meshgrid(*[np.arange(n) for n in counts], indexing="ij") if counts else []
    free = sum((int(st) * g for (st, _), g in zip(pattern, grids)), np.zeros(counts, dtype=np.int64)).reshape(-1)
    chan = np.arange(dst.partitions, dtype=np.int64)[:, None] * int(channel_multiplier)
    return (int(offset) + chan + free[None, :]).astype(np.int64)


def iota(dst, pattern=None, offset=0, channel_multiplier=0, name=None, **kwargs):
    """``nisa.iota(dst, pattern, offset, channel_multiplier)``: ``dst[c, ...] = offset + c * channel_multiplier +
    sum(step_k * i_k)`` over the ``[[step, num], ...]`` pattern, int32 math, cast to ``dst.dtype`` (GpSimd, SBUF)."""
    _no_other_keywords("iota", kwargs)
    if not isinstance(dst, NkiTensor):
        raise NotImplementedError(
            "the neuronxcc index-expression form of iota is not emulated; use iota(dst, pattern, ...)"
        )
    if dst.buffer is not sbuf:
        rule = "gpsimd-psum" if dst.buffer is psum else "memory-type"
        raise NkiRuleError(rule, f"iota writes SBUF, got {dst.buffer.value}")
    _write(dst, _pattern_values(dst, pattern, offset, channel_multiplier))
    runtime.record("gpsimd", "iota", cost.gpsimd_cycles(dst.free_size), writes=[dst])
    return dst


def affine_select(dst, pattern, channel_multiplier, on_true_tile, on_false_value, cmp_op=None, offset=0, name=None,
                  **kwargs):
    """``nisa.affine_select``: ``dst = on_true_tile`` where ``cmp_op(affine_value, 0)`` else ``on_false_value``, with
    the affine value of ``iota`` (GpSimd; dst and on_true_tile in SBUF)."""
    _no_other_keywords("affine_select", kwargs)
    for t in (dst, on_true_tile):
        if t.buffer is not sbuf:
            rule = "gpsimd-psum" if t.buffer is psum else "memory-type"
            raise NkiRuleError(rule, f"affine_select operands must be in SBUF, got {t.buffer.value}")
    _same_layout("affine_select", dst, on_true_tile, "on_true_tile")
    affine = _pattern_values(dst, pattern, offset, channel_multiplier).astype(np.float64)
    pred = resolve_op(cmp_op or equal).fn(affine, 0.0) != 0
    vals = _flat(_f32(on_true_tile, "affine_select"), on_true_tile)
    _write(dst, np.where(pred, vals, np.float32(on_false_value)))
    cycles = cost.gpsimd_cycles(dst.free_size)
    runtime.record("gpsimd", "affine_select", cycles, reads=[on_true_tile], writes=[dst])
    return dst


# ----------------------------------------------------------------------------------------------------------- ScalarE
def activation(*args, **kwargs):
    """``nisa.activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=idle)``:
    ``dst = op(data * scale + bias)`` on ScalarE (float32 math); ``scale``/``bias`` scalars or (P, 1) vectors; an
    optional ``nl.add`` reduction along the free axes into the per-partition accumulator registers (``reduce_cmd``),
    read out into ``reduce_res``."""
    if not _is_dst_form(args, kwargs, 1):
        op, data = _arg(args, kwargs, "op", 0), _arg(args, kwargs, "data", 1)
        out = allocate(data.shape, kwargs.pop("dtype", None) or data.dtype, sbuf)
        kwargs.pop("mask", None)
        if kwargs.get("reduce_res") is not None and "reduce_cmd" not in kwargs:
            kwargs["reduce_cmd"] = reduce_cmd.reset_reduce
            kwargs.setdefault("reduce_op", kwargs.get("reduce_op") or resolve_op(np.add))
        return _activation(out, op, data, *args[2:], **kwargs)
    return _activation(*args, **kwargs)


def _activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=reduce_cmd.idle,
                name=None, **kwargs):
    _no_other_keywords("activation", kwargs)
    ctx = runtime.current()
    _on_chip(data, "activation", "data")
    _on_chip(dst, "activation", "dst")
    _same_layout("activation", dst, data, "data")
    x = _flat(_f32(data, "activation"), data)
    s = _operand(scale, data, "activation", "scale")
    b = _operand(bias, data, "activation", "bias")
    pre = x * s if s is not None else x
    if b is not None:
        pre = pre + b
    out = np.asarray(resolve_op(op).fn(pre), dtype=np.float32)
    _write(dst, out)
    if reduce_cmd in (reduce_cmd.reset, reduce_cmd.reset_reduce) or ctx.act_reduce_regs is None:
        ctx.act_reduce_regs = np.zeros((128,), np.float32)
    if reduce_cmd in (reduce_cmd.reduce, reduce_cmd.reset_reduce):
        if reduce_op is not None and resolve_op(reduce_op).name != "add":
            raise NkiRuleError("dtype", f"activation: reduce_op must be nl.add, got {reduce_op!r}")
        ctx.act_reduce_regs[: data.partitions] += out.sum(axis=1)
    if reduce_res is not None:
        if reduce_res.partitions != data.partitions or reduce_res.free_size != 1:
            raise NkiRuleError(
                "shape", f"activation: reduce_res must be ({data.partitions}, 1), got {reduce_res.shape}"
            )
        _write(reduce_res, ctx.act_reduce_regs[: data.partitions].reshape(-1, 1))
    reads = [t for t in (data, scale, bias) if isinstance(t, NkiTensor)]
    writes = [dst] + ([reduce_res] if reduce_res is not None else [])
    cycles = cost.scalar_cycles(data.free_size, reduce_res is not None)
    runtime.record("scalar", f"activation[{resolve_op(op).name}]", cycles, reads=reads, writes=writes)
    return dst


def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None, **kwargs):
    """``nisa.activation_reduce``: ``activation`` with ``reduce_cmd=reset_reduce`` and ``reduce_res``."""
    _no_other_keywords("activation_reduce", kwargs)
    return _activation(dst, op, data, bias=bias, scale=scale, reduce_op=reduce_op, reduce_res=reduce_res,
                       reduce_cmd=reduce_cmd.reset_reduce)


def tensor_scalar_reduce(dst=None, data=None, op0=None, operand0=None, reduce_op=None, reduce_res=None, reverse0=False,
                         reduce_cmd=reduce_cmd.reset_reduce, reduce_init=None, reduce_res_negate=False, name=None,
                         **kwargs):
    """``nisa.tensor_scalar_reduce``: ``tensor_scalar`` with one operator plus a free-axis reduction into
    ``reduce_res`` (VectorE)."""
    if dst is None:  # neuronxcc functional form
        dst = allocate(data.shape, kwargs.pop("dtype", None) or data.dtype, sbuf)
    _no_other_keywords("tensor_scalar_reduce", kwargs)
    _tensor_scalar(dst, data, op0, operand0, reverse0)
    if reduce_res is not None:
        x = _flat(_f32(dst, "tensor_scalar_reduce"), dst)
        rop = resolve_op(reduce_op)
        r = rop.reduce(x, axis=1, keepdims=True) if rop.reduce else _fold_axis(rop, x, 1)
        _write(reduce_res, -r if reduce_res_negate else r)
    return dst


def exponential(dst, src, max_value=0.0, reduce_res=None, reduce_cmd=reduce_cmd.idle, reduce_init=0.0, name=None):
    """``nisa.exponential``: ``exp(src - max_value)`` with an optional sum into ``reduce_res`` (VectorE)."""
    x = _flat(_f32(src, "exponential"), src)
    out = np.exp(x - _operand(max_value, src, "exponential", "max_value"))
    _write(dst, out)
    if reduce_res is not None:
        init = _operand(reduce_init, src, "exponential", "reduce_init")
        _write(reduce_res, out.sum(axis=1, keepdims=True) + init)
    _record_vector("exponential", "vector", src.free_size, 1, [src, dst], [src], [dst])
    return dst


def max8(dst, src, name=None):
    """``nisa.max8``: the 8 largest values of each partition, descending."""
    x = _flat(_f32(src, "max8"), src)
    _write(dst, -np.sort(-x, axis=1)[:, :8])
    _record_vector("max8", "vector", src.free_size, 1, [src, dst], [src], [dst])
    return dst


def nc_find_index8(dst, data, vals, name=None, **kwargs):
    """``nisa.nc_find_index8``: per partition, the index of the first occurrence in ``data`` of each of the 8
    ``vals``; all-ones when absent (VectorE)."""
    _no_other_keywords("nc_find_index8", kwargs)
    x = _flat(_f32(data, "nc_find_index8"), data)
    v = _flat(_f32(vals, "nc_find_index8"), vals)
    if v.shape[1] != 8 or dst.free_size != 8:
        raise NkiRuleError(
            "shape", f"nc_find_index8: vals and dst hold 8 elements per partition, got {vals.shape}, {dst.shape}"
        )
    sentinel = np.iinfo(storage_dtype(dst.dtype)).max if np.dtype(storage_dtype(dst.dtype)).kind == "u" else -1
    out = np.full((x.shape[0], 8), sentinel, dtype=np.int64)
    for p in range(x.shape[0]):
        for j in range(8):
            hits = np.flatnonzero(x[p] == v[p, j])
            if hits.size:
                out[p, j] = hits[0]
    _write(dst, out)
    _record_vector("nc_find_index8", "vector", data.free_size, 1, [data, dst], [data, vals], [dst])
    return dst


def nc_match_replace8(dst, data, vals, imm, dst_idx=None, name=None, **kwargs):
    """``nisa.nc_match_replace8``: copy ``data`` with the first occurrence of each of the 8 ``vals`` replaced by
    ``imm``; optionally their indices into ``dst_idx`` (VectorE)."""
    _no_other_keywords("nc_match_replace8", kwargs)
    x = _flat(_f32(data, "nc_match_replace8"), data).copy()
    v = _flat(_f32(vals, "nc_match_replace8"), vals)
    idx = np.zeros((x.shape[0], 8), dtype=np.int64)
    for p in range(x.shape[0]):
        for j in range(8):
            hits = np.flatnonzero(x[p] == v[p, j])
            if hits.size:
                idx[p, j] = hits[0]
                x[p, hits[0]] = imm
    _write(dst, x)
    if dst_idx is not None:
        _write(dst_idx, idx)
    _record_vector("nc_match_replace8", "vector", data.free_size, 1, [data, dst], [data, vals], [dst])
    return dst


# -------------------------------------------------------------------------------------------- virtual registers
class VirtualRegister:
    """``nki.isa.VirtualRegister``: a 32-bit value held by the engines' sequencers (nki.isa.register_alloc page: "64x
    32-bit registers per engine sequencer"), set by ``register_move`` / ``register_load`` and read back by
    ``register_store``; it bounds ``nl.dynamic_range`` / ``nl.fori_loop`` loops and ``while reg:`` loops (the
    nki.isa.VirtualRegister page), and gives ``.ap(scalar_offset=...)`` runtime offsets. On the emulator its value
    is known while the kernel runs (the kernel is executed, not traced): a loop bounded by a register runs the
    number of times the value says, and only those iterations are costed, as a hardware loop runs on the device.
    Reading a register nothing was written to is an error (an uninitialised register has no defined value)."""

    def __init__(self, value=None):
        self._value = None if value is None else _register_value(value)

    @property
    def value(self) -> int:
        if self._value is None:
            raise NkiRuleError("uninitialized-read", "a VirtualRegister is read before register_move / register_load set it")
        return self._value

    def __int__(self):
        return self.value

    __index__ = __int__

    def __bool__(self):  # `while reg:` (the parser frontend's dynamic while loop)
        return self.value != 0

    def __repr__(self):
        return f"VirtualRegister({self._value})"


def _register_value(x) -> int:
    if isinstance(x, VirtualRegister):
        return x.value
    if isinstance(x, (bool, float)) or not isinstance(x, (int, np.integer)):
        raise NkiRuleError("register", f"a register holds a 32-bit integer, got {x!r}")
    v = int(x)
    if not -(2**31) <= v < 2**32:
        raise NkiRuleError("register", f"a register holds 32 bits; {v} does not fit")
    return v


def register_alloc(x=None):
    """``nisa.register_alloc(x=None)``: a new register, set to ``x`` (an int or another register) when given."""
    return VirtualRegister(x)


def register_move(dst, src):
    """``nisa.register_move(dst, src)``: dst = a constant int or another register's value (no memory access)."""
    if not isinstance(dst, VirtualRegister):
        raise NkiRuleError("register", "register_move: dst must be a register from nisa.register_alloc()")
    dst._value = _register_value(src)  # (sequencer work only: nothing costed)
    return dst


def _one_element(t, what):
    _tensor(t, what)
    if t.size != 1:
        raise NkiRuleError("register", f"{what} holds {t.size} elements: a register moves exactly one ([1] or [1, 1])")


def register_load(dst, src):
    """``nisa.register_load(dst, src)``: dst = the one element of ``src`` (SBUF or HBM, a 32-bit value)."""
    if not isinstance(dst, VirtualRegister):
        raise NkiRuleError("register", "register_load: dst must be a register from nisa.register_alloc()")
    _one_element(src, "register_load src")
    _no_psum("register_load", "dma", src)
    if runtime.current().compute:
        dst._value = _register_value(int(np.asarray(src.read(what="register_load")).reshape(-1)[0]))
    else:
        raise NkiRuleError("register", "register_load needs the computed value (estimate(..., compute=True)): the "
                           "loops it bounds run as many times as it says")
    runtime.record("dma", "register_load", reads=[src], writes=[], nbytes=4, chunks=1)
    return dst


def register_store(dst, src):
    """``nisa.register_store(dst, src)``: the one element of ``dst`` (SBUF or HBM) = the register's value."""
    _one_element(dst, "register_store dst")
    _no_psum("register_store", "dma", dst)
    value = _register_value(src)
    if runtime.current().compute:
        dst.write(np.full(dst.cshape, value))
    else:
        dst._mark_written()
    runtime.record("dma", "register_store", reads=[], writes=[dst], nbytes=4, chunks=1)
    return dst


def core_barrier(data=None, cores=(0, 1), engine=None, name=None, **kwargs):
    """``nisa.core_barrier``: "a synchronization point where all specified NeuronCores must reach before any can
    proceed", so that each reads what the other wrote to the shared HBM tensor ``data`` before it. In a launch of
    several programs the others run up to their own barrier first (programs.py); alone it does nothing."""
    ctx = runtime.current()
    cores = tuple(cores) if isinstance(cores, (tuple, list)) else (cores,)
    if ctx.programs is not None and len(cores) > 1:
        ctx.programs.barrier(ctx.programs.current())
    return None


def sendrecv(src, dst, send_to_rank, recv_from_rank, pipe_id=None, dma_engine=None, name=None, **kwargs):
    """``nisa.sendrecv``: between the two programs of an LNC=2 launch, each sends its ``src`` tile to the other's
    ``dst`` and receives the other's into its own; the Nth call of one program pairs with the Nth of the other (the
    ``nki.lnc.sendrecv`` page). The programs switch there as at a ``core_barrier`` (programs.py). Priced as one DMA
    of the tile on each side; the time the peer's tile becomes ready is not carried across the cores."""
    _no_other_keywords("sendrecv", kwargs)
    _on_chip(src, "sendrecv", "src")
    _on_chip(dst, "sendrecv", "dst")
    _same_layout("sendrecv", dst, src)
    ctx = runtime.current()
    if ctx.programs is None:
        raise NkiRuleError("core-barrier", "sendrecv needs a launch of two programs (kernel[2]): alone it has no peer")
    me = ctx.program_id[0]
    if send_to_rank not in (0, 1) or recv_from_rank not in (0, 1) or send_to_rank != recv_from_rank or \
            send_to_rank == me:
        raise NkiRuleError("shape", f"sendrecv: program {me} exchanges with the other rank of the pair (0 or 1), got "
                           f"send_to_rank={send_to_rank}, recv_from_rank={recv_from_rank}")
    values = _flat(src.read(what="sendrecv"), src).copy()
    received = ctx.programs.sendrecv(ctx.programs.current(), recv_from_rank, values)
    if np.dtype(src.dtype) != np.dtype(dst.dtype):
        received = received.astype(np.float32)
    _write(dst, received)
    runtime.record("dma", "sendrecv", reads=[src], writes=[dst], nbytes=src.size * src.itemsize, chunks=1)
    return dst
