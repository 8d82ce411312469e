"""``nki.language`` (``nl``) for the emulator: dtypes, buffers, tile sizes, allocation, loops, SPMD ids and math.

Reference: "nki.language" API pages of the Neuron documentation (NKI 0.3, SDK 2.29+). The math functions double as
operator identifiers passed to ``nki.isa`` instructions (``op=nl.add``); called on tiles they compute a new SBUF tile
(the functional style that ``neuronxcc.nki`` kernels use: ``nl.load``, ``nl.store``, ``nl.matmul``...).
"""

from __future__ import annotations

import builtins
import math as _math

import numpy as np

from . import cost, runtime
from .rules import NkiRuleError
from .tensors import (  # noqa: F401  (re-exported names of nki.language)
    FLOAT8,
    DynSlice,
    MemoryRegion,
    NkiTensor,
    allocate,
    bfloat16,
    bool_,
    float8_e4m3,
    float8_e4m3fn,
    float8_e5m2,
    float4_e2m1fn_x4,
    float8_e4m3fn_x4,
    float8_e5m2_x4,
    float8_e8m0fnu,
    float16,
    float32,
    hbm,
    int8,
    int16,
    int32,
    is_float,
    normalize_buffer,
    normalize_dtype,
    private_hbm,
    psum,
    sbuf,
    shared_hbm,
    tfloat32,
    uint8,
    uint16,
    uint32,
)

bool = bool_  # noqa: A001  (nki.language exports `bool`)


class NKIObject:
    """``nl.NKIObject``: base class for kernel dataclasses and configuration objects.

    The NKI language guide ("Class Support"): every NKI class is like a Python data class, ``@dataclass`` is optional,
    and "the compiler will create the initializer functions __init__ and __post_init__, if they are not provided by
    the user", e.g. ``def __init__(self, x=None, y=False)`` for fields ``x: int`` and ``y: bool = False``. So a subclass
    without its own ``__init__`` gets one here: its fields, in order, are the annotated names, then the plain class
    attributes that are not methods, properties or dunders (classes whose fields carry no annotations); a field's
    default is its class value, else None; ``__post_init__`` runs last when defined.
    """

    def __init__(self, *args, **kwargs):
        fields = _nki_fields(type(self))
        if len(args) > len(fields):
            raise TypeError(f"{type(self).__name__}() takes {len(fields)} positional arguments, got {len(args)}")
        values = dict(zip(fields, args))
        for key, value in kwargs.items():
            if key in values:
                raise TypeError(f"{type(self).__name__}() got multiple values for argument {key!r}")
            values[key] = value
        for name, default in fields.items():
            setattr(self, name, values.pop(name, default))
        for key, value in values.items():  # keywords that name no field are kept too (as the object dictionary)
            setattr(self, key, value)
        post_init = getattr(self, "__post_init__", None)
        if callable(post_init):
            post_init()


def _nki_fields(cls) -> dict:
    """Field name -> default, base classes first, for NKIObject's generated ``__init__``."""
    fields: dict = {}
    for klass in reversed(cls.__mro__):
        if klass is object or klass is NKIObject:
            continue
        namespace = vars(klass)
        for name in namespace.get("__annotations__", {}):
            fields[name] = _field_default(namespace.get(name))
        for name, value in namespace.items():
            if name.startswith("__") or name in fields:
                continue
            if callable(value) or isinstance(value, (property, staticmethod, classmethod)):
                continue
            fields[name] = _field_default(value)
    return fields


def _field_default(value):
    import copy as _copy

    # Mutable class values (lists, dicts) are copied per instance, as a data class's default factory would.
    return _copy.copy(value) if isinstance(value, (list, dict, set)) else value


# --------------------------------------------------------------------------------------------------- tile sizes
class _TileSize:
    """``nl.tile_size``: hardware tile limits of the active target (NeuronCore-v2/v3 values)."""

    pmax = 128
    gemm_stationary_fmax = 128
    gemm_moving_fmax = 512
    psum_bank_fmax = 512
    psum_bank_fmax_bytes = 2048
    psum_fmax = 2048
    bn_stats_fmax = 512
    psum_min_align = 4
    sbuf_min_align = 1

    @property
    def psum_num_banks(self):
        return runtime.current().target.psum_banks

    @property
    def sbuf_fmax_bytes(self):
        return runtime.current().target.sbuf_partition_bytes

    @property
    def sbuf_fmax(self):
        return self.sbuf_fmax_bytes // 4

    @property
    def sbuf_size_bytes(self):
        return self.sbuf_fmax_bytes * self.pmax

    @property
    def total_available_sbuf_size(self):
        return self.sbuf_fmax_bytes


tile_size = _TileSize()


def is_hbm(buffer):
    return buffer in (private_hbm, shared_hbm)


def is_on_chip(buffer):
    return buffer in (sbuf, psum)


def is_psum(buffer):
    return buffer is psum


def is_sbuf(buffer):
    return buffer is sbuf


def par_dim(n):
    """``neuronxcc`` partition-axis marker in a shape, e.g. ``(n_tiles, nl.par_dim(128), 512)``."""
    from .tensors import ParDim

    return ParDim(n)


# ---------------------------------------------------------------------------------------------------- allocation
def ndarray(shape, dtype, buffer=sbuf, name="", address=None, **kwargs):
    """A new uninitialized tensor (filled with NaN in the emulator so that uninitialized reads show).

    ``address`` (SBUF/PSUM): ``(partition_offset, free_offset)`` in bytes, as the ``nki.language.ndarray`` page
    documents; the buffer is accounted at that place (two buffers placed on the same bytes share them). Storage is
    not aliased: each tensor keeps its own values."""
    on_chip = normalize_buffer(buffer).on_chip
    return allocate(shape, dtype, buffer, name, address=address if on_chip else None)


def empty_like(x, dtype=None, buffer=None, name=""):
    return allocate(x.shape, dtype or x.dtype, buffer or (x.buffer if isinstance(x, NkiTensor) else sbuf), name)


def full(shape, fill_value, dtype, buffer=sbuf, name="", **kwargs):
    from . import isa

    t = allocate(shape, dtype, buffer, name)
    isa.memset(t, fill_value)
    return t


def zeros(shape, dtype, buffer=sbuf, name="", **kwargs):
    return full(shape, 0, dtype, buffer, name)


def ones(shape, dtype, buffer=sbuf, name="", **kwargs):
    return full(shape, 1, dtype, buffer, name)


def zeros_like(x, dtype=None, buffer=None, name=""):
    return zeros(x.shape, dtype or x.dtype, buffer or sbuf, name)


def shared_identity_matrix(n, dtype=uint8, dst=None):
    from . import isa

    out = dst if dst is not None else allocate((n, n), dtype, sbuf)
    isa._write(out, np.eye(n, dtype=np.float32))
    return out


# ---------------------------------------------------------------------------------------------------- indexing, loops
def ds(start, size):
    """``nl.ds(start, size)``: the slice ``start:start+size``."""
    return DynSlice(start, size)


def _range(start, stop=None, step=1):
    if stop is None:
        start, stop = 0, start
    return range(int(start), int(stop), int(step))


def affine_range(start, stop=None, step=1, **kwargs):
    """Loop with no loop-carried dependency; unrolled in Python, executed in order."""
    return _range(start, stop, step)


def sequential_range(start, stop=None, step=1, **kwargs):
    return _range(start, stop, step)


def static_range(start, stop=None, step=1, **kwargs):
    return _range(start, stop, step)


def dynamic_range(start, stop=None, step=1, **kwargs):
    return _range(start, stop, step)


def fori_loop(lower, upper, body_fun, step=1):
    for i in range(int(lower), int(upper), int(step)):
        body_fun(i)


def no_reorder():
    import contextlib

    return contextlib.nullcontext()


def program_id(axis=0):
    """Index of this program along ``axis`` of the SPMD launch grid (``kernel[grid](...)``)."""
    pid = runtime.current().program_id
    return pid[axis] if axis < len(pid) else 0


def num_programs(axes=0):
    grid = runtime.current().grid
    if isinstance(axes, (tuple, list)):
        return _math.prod(grid[a] for a in axes)
    return grid[axes] if axes < len(grid) else 1


def program_ndim():
    return len(runtime.current().grid)


def shared_constant(constant, dtype=None, **kwargs):
    """``nl.shared_constant``: a constant array as an HBM tensor visible to every program."""
    from .tensors import from_array

    arr = np.asarray(constant if not hasattr(constant, "numpy") else constant.numpy())
    return from_array(arr.astype(normalize_dtype(dtype)) if dtype is not None else arr, shared_hbm)


def device_print(print_prefix, tensor):
    print(print_prefix, tensor.read(check=False) if isinstance(tensor, NkiTensor) else tensor)


# ---------------------------------------------------------------------------------------------------- operators
class Op:
    """A math operator: callable on tiles (functional ``nl`` API) and usable as ``op=`` of ``nki.isa``."""

    def __init__(self, name, fn, arity, engine="vector", bitvec=False, reduce=None):
        self.__name__ = self.name = name
        self.fn, self.arity, self.engine, self.bitvec, self.reduce = fn, arity, engine, bitvec, reduce

    def __repr__(self):
        return f"nl.{self.name}"

    def __call__(self, *args, dtype=None, **kwargs):
        if self.reduce is not None and "axis" in kwargs:
            return _reduce(self, args[0], kwargs["axis"], dtype, kwargs.get("keepdims", False))
        operands = args[: self.arity]
        return _elementwise(self, operands, dtype)


def _gelu(x):
    from math import sqrt

    erf = np.vectorize(_math.erf, otypes=[np.float64])
    return 0.5 * x * (1.0 + erf(x / sqrt(2.0)))


def _erf(x):
    return np.vectorize(_math.erf, otypes=[np.float64])(x)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


_OPS = {}


def _op(name, fn, arity, engine="vector", **kw):
    op = Op(name, fn, arity, engine, **kw)
    _OPS[name] = op
    return op


add = _op("add", np.add, 2, reduce=np.sum)
subtract = _op("subtract", np.subtract, 2)
multiply = _op("multiply", np.multiply, 2, reduce=np.prod)
divide = _op("divide", np.divide, 2)
maximum = _op("maximum", np.maximum, 2, reduce=np.max)
minimum = _op("minimum", np.minimum, 2, reduce=np.min)
abs_max = _op("abs_max", lambda x, y: np.maximum(np.abs(x), np.abs(y)), 2)
abs_min = _op("abs_min", lambda x, y: np.minimum(np.abs(x), np.abs(y)), 2)
power = _op("power", np.power, 2, engine="gpsimd")
fmod = _op("fmod", np.fmod, 2)
mod = _op("mod", np.mod, 2)
equal = _op("equal", lambda x, y: (x == y).astype(np.float32), 2)
not_equal = _op("not_equal", lambda x, y: (x != y).astype(np.float32), 2)
less = _op("less", lambda x, y: (x < y).astype(np.float32), 2)
less_equal = _op("less_equal", lambda x, y: (x <= y).astype(np.float32), 2)
greater = _op("greater", lambda x, y: (x > y).astype(np.float32), 2)
greater_equal = _op("greater_equal", lambda x, y: (x >= y).astype(np.float32), 2)
logical_and = _op("logical_and", lambda x, y: np.logical_and(x, y).astype(np.float32), 2)
logical_or = _op("logical_or", lambda x, y: np.logical_or(x, y).astype(np.float32), 2)
logical_xor = _op("logical_xor", lambda x, y: np.logical_xor(x, y).astype(np.float32), 2)
logical_not = _op("logical_not", lambda x: np.logical_not(x).astype(np.float32), 1)
bitwise_and = _op("bitwise_and", np.bitwise_and, 2, bitvec=True)
bitwise_or = _op("bitwise_or", np.bitwise_or, 2, bitvec=True)
bitwise_xor = _op("bitwise_xor", np.bitwise_xor, 2, bitvec=True)
invert = _op("invert", np.invert, 1, bitvec=True)
left_shift = _op("left_shift", np.left_shift, 2, bitvec=True)
right_shift = _op("right_shift", np.right_shift, 2, bitvec=True)
# activation functions (Scalar Engine)
exp = _op("exp", np.exp, 1, "scalar")
log = _op("log", np.log, 1, "scalar")
sqrt = _op("sqrt", np.sqrt, 1, "scalar")
rsqrt = _op("rsqrt", lambda x: 1.0 / np.sqrt(x), 1, "scalar")
tanh = _op("tanh", np.tanh, 1, "scalar")
sigmoid = _op("sigmoid", _sigmoid, 1, "scalar")
relu = _op("relu", lambda x: np.maximum(x, 0), 1, "scalar")
gelu = _op("gelu", _gelu, 1, "scalar")
gelu_apprx_tanh = _op(
    "gelu_apprx_tanh", lambda x: 0.5 * x * (1 + np.tanh(0.7978845608028654 * (x + 0.044715 * x**3))), 1, "scalar"
)
gelu_apprx_sigmoid = _op("gelu_apprx_sigmoid", lambda x: x * _sigmoid(1.702 * x), 1, "scalar")
silu = _op("silu", lambda x: x * _sigmoid(x), 1, "scalar")
softplus = _op("softplus", lambda x: np.logaddexp(0, x), 1, "scalar")
mish = _op("mish", lambda x: x * np.tanh(np.logaddexp(0, x)), 1, "scalar")
erf = _op("erf", _erf, 1, "scalar")
square = _op("square", np.square, 1, "scalar")
abs = _op("abs", np.abs, 1, "scalar")  # noqa: A001
sin = _op("sin", np.sin, 1, "scalar")
cos = _op("cos", np.cos, 1, "scalar")
tan = _op("tan", np.tan, 1, "scalar")
arctan = _op("arctan", np.arctan, 1, "scalar")
sign = _op("sign", np.sign, 1, "scalar")
negative = _op("negative", np.negative, 1)
reciprocal = _op("reciprocal", lambda x: 1.0 / x, 1)
copy = _op("copy", lambda x: x, 1, "scalar")
identity = copy
bypass = _op("bypass", lambda x, y=None: x, 1)
ceil = _op("ceil", np.ceil, 1)
floor = _op("floor", np.floor, 1)
trunc = _op("trunc", np.trunc, 1)
average = _op("average", lambda x, y: (x + y) / 2, 2, reduce=np.mean)


def prelu(x, alpha=0.0):
    return np.where(x >= 0, x, alpha * x)


_NUMPY_ALIASES = {
    np.add: add, np.subtract: subtract, np.multiply: multiply, np.divide: divide, np.true_divide: divide,
    np.maximum: maximum, np.minimum: minimum, np.power: power, np.exp: exp, np.log: log, np.sqrt: sqrt,
    np.tanh: tanh, np.abs: abs, np.square: square, np.negative: negative, np.equal: equal,
    np.not_equal: not_equal, np.less: less, np.less_equal: less_equal, np.greater: greater,
    np.greater_equal: greater_equal, np.bitwise_and: bitwise_and, np.bitwise_or: bitwise_or,
    np.bitwise_xor: bitwise_xor, np.sin: sin, np.cos: cos, np.sign: sign, np.reciprocal: reciprocal,
    np.mod: mod, np.fmod: fmod, np.sum: add, np.max: maximum, np.min: minimum, np.mean: average, np.prod: multiply,
    np.left_shift: left_shift, np.right_shift: right_shift, np.invert: invert, np.logical_and: logical_and,
    np.logical_or: logical_or, np.logical_xor: logical_xor, np.logical_not: logical_not,
}


def resolve_op(op) -> Op:
    """The emulator's Op for ``nl.*`` operators and the NumPy functions public kernels pass (``np.add``...)."""
    if isinstance(op, Op):
        return op
    if op in _NUMPY_ALIASES:
        return _NUMPY_ALIASES[op]
    if op in _REDUCTION_ALIASES:
        return _REDUCTION_ALIASES[op]
    name = getattr(op, "__name__", None)
    if name in _OPS:
        return _OPS[name]
    raise NkiRuleError("dtype", f"unsupported operator {op!r}")


# ---------------------------------------------------------------------------------------------------- functional math
def _values(x):
    if isinstance(x, NkiTensor):
        return x.read(what="nki.language op").astype(np.float32) if is_float(x.dtype) else x.read()
    return np.asarray(x, dtype=np.float32) if not isinstance(x, np.ndarray) else x


def _result_dtype(operands, dtype):
    if dtype is not None:
        return normalize_dtype(dtype)
    for x in operands:
        if isinstance(x, NkiTensor):
            return x.dtype
    return float32


def _elementwise(op: Op, operands, dtype):
    vals = [_values(x) for x in operands]
    tiles = [x for x in operands if isinstance(x, NkiTensor)]
    shape = np.broadcast_shapes(*[v.shape for v in vals])
    out = allocate(shape, _result_dtype(operands, dtype), sbuf)
    out.write(op.fn(*vals))
    ctx = runtime.current()
    n = out.free_size
    if op.engine == "scalar" and len(tiles) <= 1:
        runtime.record("scalar", f"nl.{op.name}", cost.scalar_cycles(n), reads=tiles, writes=[out])
    else:
        engine = "gpsimd" if op.engine == "gpsimd" else "vector"
        cycles = cost.vector_cycles(ctx.target, n, builtins.max(len(tiles), 1), [t.dtype for t in tiles] + [out.dtype])
        runtime.record(engine, f"nl.{op.name}", cycles, reads=tiles, writes=[out])
    return out


def _inplace(target: NkiTensor, other, op):
    if target.buffer is psum and op is add and not target._written().all():
        # `psum_tile += matmul(...)` (neuronxcc): accumulation onto a fresh PSUM location starts from zero, as
        # nc_matmul's default accumulate does ("first write overwrites").
        a = np.where(target._c(target._written()), target._c(target._np()).astype(np.float32), 0.0)
        b = _values(other)
        target.write(op.fn(a, b))
        cycles = cost.vector_cycles(runtime.current().target, target.free_size, 1, [target.dtype])
        runtime.record("vector", "psum accumulate", cycles, reads=[other] if isinstance(other, NkiTensor) else [],
                       writes=[target])
        return
    a, b = _values(target), _values(other)
    target.write(op.fn(a, b))
    ctx = runtime.current()
    reads = [target] + ([other] if isinstance(other, NkiTensor) else [])
    cycles = cost.vector_cycles(ctx.target, target.free_size, len(reads), [t.dtype for t in reads])
    runtime.record("vector", f"{op.name} (in place)", cycles, reads=reads, writes=[target])


def _axes(x, axis):
    axes = axis if isinstance(axis, (tuple, list)) else (axis,)
    return tuple(a % x.ndim for a in axes)


def _reduce(op: Op, x, axis, dtype, keepdims):
    vals = _values(x)
    axes = _axes(x, axis)
    if x.on_chip and 0 in axes:
        raise NkiRuleError("partition-dim", f"nl.{op.name} reduces over free axes only (axis 0 is the partition axis)")
    res = op.reduce(vals, axis=axes, keepdims=True)
    if not keepdims:
        kept = [n for i, n in enumerate(vals.shape) if i not in axes]
        if x.on_chip:  # a tile keeps its partition axis: (P, 1) when every free axis is reduced
            kept = kept if len(kept) > 1 else kept + [1]
        res = res.reshape(kept or [1])
    out = allocate(res.shape if res.ndim else (1,), _result_dtype([x], dtype), sbuf)
    out.write(res.reshape(out.shape))
    cycles = cost.vector_cycles(runtime.current().target, x.free_size, 1, [x.dtype])
    runtime.record("vector", f"nl.{op.name}-reduce", cycles, reads=[x], writes=[out])
    return out


def sum(x, axis, dtype=None, keepdims=False):  # noqa: A001
    return _reduce(add, x, axis, dtype, keepdims)


def max(x, axis, dtype=None, keepdims=False):  # noqa: A001
    return _reduce(maximum, x, axis, dtype, keepdims)


def min(x, axis, dtype=None, keepdims=False):  # noqa: A001
    return _reduce(minimum, x, axis, dtype, keepdims)


def prod(x, axis, dtype=None, keepdims=False):
    return _reduce(multiply, x, axis, dtype, keepdims)


def mean(x, axis, dtype=None, keepdims=False):
    return _reduce(average, x, axis, dtype, keepdims)


_REDUCTION_ALIASES = {sum: add, max: maximum, min: minimum, prod: multiply, mean: average}


def var(x, axis, dtype=None, keepdims=False):
    vals = _values(x)
    res = vals.var(axis=_axes(x, axis), keepdims=keepdims)
    out = allocate(res.shape, _result_dtype([x], dtype), sbuf)
    out.write(res)
    return out


def all(x, axis, dtype=None):  # noqa: A001
    vals = _values(x)
    res = np.all(vals != 0, axis=_axes(x, axis), keepdims=True).astype(np.float32)
    out = allocate(res.shape, _result_dtype([x], dtype), sbuf)
    out.write(res)
    return out


def softmax(x, axis=-1, dtype=None):
    vals = _values(x)
    e = np.exp(vals - vals.max(axis=axis, keepdims=True))
    out = allocate(x.shape, _result_dtype([x], dtype), sbuf)
    out.write(e / e.sum(axis=axis, keepdims=True))
    return out


def rms_norm(x, w, axis, n, epsilon=1e-6, dtype=None, compute_dtype=None):
    vals, wv = _values(x), _values(w)
    ms = (vals**2).sum(axis=axis, keepdims=True) / n
    out = allocate(x.shape, _result_dtype([x], dtype), sbuf)
    out.write(vals / np.sqrt(ms + epsilon) * wv)
    return out


def where(condition, x, y, dtype=None):
    c, a, b = _values(condition), _values(x), _values(y)
    res = np.where(c != 0, a, b)
    out = allocate(res.shape, _result_dtype([x, y], dtype), sbuf)
    out.write(res)
    return out


def expand_dims(x, axis):
    return x.expand_dim(axis)


def broadcast_to(x, shape, dtype=None):
    """A broadcast view (stride 0 on the broadcast axes, including a size-1 partition axis)."""
    return x.broadcast_to(shape)


def transpose(x, dtype=None):
    """Functional 2D transpose of a tile (partition <-> free) into a new SBUF tile."""
    vals = _values(x)
    out = allocate((x.free_size, x.partitions), _result_dtype([x], dtype), sbuf)
    out.write(vals.reshape(x.partitions, x.free_size).T)
    runtime.record("tensor", "nl.transpose", cost.matmul_cycles(x.partitions, False), reads=[x], writes=[out])
    return out


def matmul(x, y, transpose_x=False):
    """``nl.matmul``: ``x @ y`` (``x.T @ y`` with ``transpose_x``) into a new fp32 PSUM tile, via ``nc_matmul``."""
    from . import isa

    stationary = x if transpose_x else transpose(x)
    out = allocate((stationary.shape[1], y.shape[1]), float32, psum)
    isa.nc_matmul(out, stationary, y)
    return out


def load(src, dtype=None, mask=None, **kwargs):
    """``nl.load`` (neuronxcc style): DMA an HBM tensor into a new SBUF tile."""
    from . import isa

    shape = src.shape if len(src.shape) else (1,)
    if not src.on_chip and len(shape) == 1:
        shape = (shape[0], 1)
    out = allocate(shape, dtype or src.dtype, sbuf)
    isa.dma_copy(out, src)
    return out


def store(dst, value, mask=None, **kwargs):
    """``nl.store`` (neuronxcc style): DMA a tile into an HBM tensor."""
    from . import isa

    if not isinstance(value, NkiTensor):
        tile = allocate(dst.shape, dst.dtype, sbuf)
        tile.write(np.broadcast_to(np.asarray(value, np.float32), dst.shape))
        value = tile
    elif value.buffer is psum:  # the compiler routes PSUM through SBUF for nl.store (DMA cannot read PSUM)
        tile = allocate(value.cshape, value.dtype, sbuf)
        isa.tensor_copy(tile, value)
        value = tile
    isa.dma_copy(dst, value)


def load_transpose2d(src, dtype=None):
    t = load(src, dtype)
    return transpose(t)


def _binary_dunder(op, reverse=False):
    def method(self, other):
        return op(other, self) if reverse else op(self, other)

    return method


for _name, _op_ in [("add", add), ("sub", subtract), ("mul", multiply), ("truediv", divide), ("pow", power),
                    ("lt", less), ("le", less_equal), ("gt", greater), ("ge", greater_equal),
                    ("and", bitwise_and), ("or", bitwise_or), ("xor", bitwise_xor)]:
    setattr(NkiTensor, f"__{_name}__", _binary_dunder(_op_))
    setattr(NkiTensor, f"__r{_name}__", _binary_dunder(_op_, reverse=True))
NkiTensor.__neg__ = lambda self: negative(self)
del _name, _op_
