"""Tensors: dtypes with true low-precision rounding, buffers in HBM/SBUF/PSUM, views and access patterns.

Semantics follow the ``NkiTensor`` reference of ``nki.language`` (NKI 0.3): every view (slice, ``permute``,
``reshape``, ``ap`` ...) shares its buffer's storage; on-chip tensors keep the partition axis at dim 0, and an integer
index on that axis keeps a size-1 partition axis, whereas an integer index on an HBM tensor removes the axis.
New buffers are filled with NaN (float dtypes) or a 0x5A byte pattern (integers) and remember which elements were
written, so that a read of uninitialized memory shows (see ``runtime.Context.uninitialized``).
"""

from __future__ import annotations

import enum
import math
import weakref

import ml_dtypes
import numpy as np

from . import runtime
from .rules import NkiRuleError

# ----------------------------------------------------------------------------------------------------------- dtypes
bool_ = np.dtype(np.bool_)
int8, int16, int32 = np.dtype(np.int8), np.dtype(np.int16), np.dtype(np.int32)
uint8, uint16, uint32 = np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32)
float16, float32 = np.dtype(np.float16), np.dtype(np.float32)
bfloat16 = np.dtype(ml_dtypes.bfloat16)
# Neuron's legacy fp8 e4m3 (max 240, IEEE-style specials) is ml_dtypes.float8_e4m3; OCP e4m3fn (max 448) is
# ml_dtypes.float8_e4m3fn.
float8_e4m3 = np.dtype(ml_dtypes.float8_e4m3)
float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)
float8_e5m2 = np.dtype(ml_dtypes.float8_e5m2)
float8_e8m0fnu = np.dtype(ml_dtypes.float8_e8m0fnu)


class _TF32:
    """tfloat32: stored as float32, rounded to a 10-bit mantissa (round to nearest even) on every write."""

    name = "tfloat32"
    itemsize = 4
    kind = "f"

    def __repr__(self):
        return "tfloat32"


tfloat32 = _TF32()


class _PackedX4:
    """x4-packed MX dtypes (four fp8/fp4 values in 32 bits, NeuronCore-v4): storage only; no arithmetic emulated."""

    itemsize = 4
    kind = "V"

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name


float8_e4m3fn_x4 = _PackedX4("float8_e4m3fn_x4")
float8_e5m2_x4 = _PackedX4("float8_e5m2_x4")
float4_e2m1fn_x4 = _PackedX4("float4_e2m1fn_x4")
FLOAT8 = (float8_e4m3, float8_e4m3fn, float8_e5m2)


def normalize_dtype(dtype):
    if dtype is None or dtype is tfloat32 or isinstance(dtype, _PackedX4):
        return dtype
    if isinstance(dtype, str) and dtype == "tfloat32":
        return tfloat32
    if hasattr(dtype, "dtype") and not isinstance(dtype, (type, np.dtype)):  # torch dtypes, arrays
        dtype = dtype.dtype
    try:
        return np.dtype(dtype)
    except TypeError:
        import torch  # torch dtypes only reach here from torch callers

        return np.dtype({torch.bfloat16: ml_dtypes.bfloat16}.get(dtype) or torch.empty(0, dtype=dtype).numpy().dtype)


def storage_dtype(dtype) -> np.dtype:
    if isinstance(dtype, _PackedX4):
        return uint32
    return float32 if dtype is tfloat32 else np.dtype(dtype)


def is_float(dtype) -> bool:
    if isinstance(dtype, _PackedX4):
        return False
    return dtype is tfloat32 or np.dtype(dtype).kind == "f" or np.dtype(dtype) in (bfloat16, *FLOAT8)


def _round_tf32(x: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    lsb = (bits >> 13) & 1
    rounded = ((bits + 0x0FFF + lsb) & 0xFFFFE000).astype(np.uint32)
    finite = np.isfinite(x)
    return np.where(finite, rounded.view(np.float32), x).astype(np.float32)


def cast(values, dtype) -> np.ndarray:
    """Cast to an NKI dtype as the engines do: round to nearest even for floats (ml_dtypes gives true bf16/fp8
    rounding), saturation to the largest finite value for fp8, round-and-saturate for float -> integer."""
    dtype = normalize_dtype(dtype)
    v = np.asarray(values)
    if isinstance(dtype, _PackedX4):
        return v.astype(np.uint32)
    if dtype is tfloat32:
        return _round_tf32(v.astype(np.float32))
    if dtype.kind in "iub":
        if v.dtype.kind == "f" or v.dtype in (bfloat16, *FLOAT8):
            v = v.astype(np.float64)
            if dtype.kind == "b":
                return v != 0
            info = np.iinfo(dtype)
            v = np.clip(np.nan_to_num(np.rint(v), nan=0.0), info.min, info.max)
        return v.astype(dtype)
    if dtype in FLOAT8:
        finfo = ml_dtypes.finfo(dtype)
        v = v.astype(np.float32)
        v = np.where(np.isfinite(v), np.clip(v, -float(finfo.max), float(finfo.max)), v)
    return v.astype(dtype)


# --------------------------------------------------------------------------------------------------------- memories
class MemoryRegion(enum.Enum):
    sbuf = "sbuf"
    psum = "psum"
    private_hbm = "private_hbm"
    shared_hbm = "shared_hbm"

    @property
    def on_chip(self) -> bool:
        return self in (MemoryRegion.sbuf, MemoryRegion.psum)

    def __repr__(self):
        return f"nl.{self.value}"


sbuf, psum = MemoryRegion.sbuf, MemoryRegion.psum
private_hbm, shared_hbm = MemoryRegion.private_hbm, MemoryRegion.shared_hbm
hbm = private_hbm


def normalize_buffer(buffer) -> MemoryRegion:
    if isinstance(buffer, MemoryRegion):
        return buffer
    if isinstance(getattr(buffer, "region", None), MemoryRegion):  # nki.compiler allocators
        return buffer.region
    if isinstance(buffer, str):
        return {"hbm": private_hbm}.get(buffer) or MemoryRegion(buffer)
    raise TypeError(f"unknown buffer {buffer!r}; expected nl.sbuf, nl.psum, nl.hbm or nl.shared_hbm")


class Buffer:
    """Flat storage for one allocation, plus a per-element 'written' flag."""

    _counter = 0

    def __init__(self, nelem: int, dtype, region: MemoryRegion, name: str = "", data: np.ndarray | None = None):
        Buffer._counter += 1
        self.uid = Buffer._counter
        self.dtype = dtype
        self.region = region
        self.name = name or f"{region.value}_{self.uid}"
        sd = storage_dtype(dtype)
        if data is not None:
            self.data = data.reshape(-1)
            self.written = np.ones(self.data.shape, dtype=bool)
        else:
            self.data = np.empty(nelem, dtype=sd)
            if is_float(dtype):
                self.data.fill(np.nan)
            else:
                self.data.view(np.uint8).fill(0x5A)
            self.written = np.zeros(nelem, dtype=bool)
        # PSUM accumulation groups: True where the last write was an nc_matmul not yet read (see isa.nc_matmul).
        self.acc_open = np.zeros(nelem, dtype=bool) if region is psum else None


def _release(tracker, region, nbytes, trace, uid, address=None):
    tracker.release(region, nbytes, address)
    if trace is not None:
        trace.free(uid, region, nbytes)


def _prod(shape) -> int:
    return int(math.prod(shape)) if shape else 1


class ParDim(int):
    """``nl.par_dim(n)``: marks the partition axis of a shape (``neuronxcc`` style, after leading block dims)."""


class DynSlice:
    """``nl.ds(start, size)``: a slice of ``size`` elements from ``start``."""

    def __init__(self, start, size, step=1):
        self.start, self.size, self.step = int(start), int(size), int(step)

    def __repr__(self):
        return f"ds({self.start}, {self.size})"


# What this emulator's NkiTensor offers beyond NKI 0.3's (nki/api/nki/language/__init__.py of the Neuron SDK): the
# emulator's own bookkeeping and the `neuronxcc.nki` tile API of published kernels. An NKI 0.3 kernel that uses one of
# them runs here and fails on a device (tests/kernels/test_nki03_api.py keeps the project's kernels off them).
NOT_IN_NKI_03 = frozenset({"T", "broadcast_to", "cshape", "free_size", "itemsize", "on_chip", "partitions", "read",
                           "reinterpret_cast", "transpose", "write"})


class NkiTensor:
    """A view (shape, element strides, element offset) on a :class:`Buffer`."""

    __array_priority__ = 100  # so that `ndarray * tile` defers to the tile's operators

    def __init__(self, buf: Buffer, shape, strides, offset: int, dtype=None, partition_axis: int = 0):
        self._buf = buf
        self.shape = tuple(int(s) for s in shape)
        self.strides = tuple(int(s) for s in strides)
        self.offset = int(offset)
        self.dtype = buf.dtype if dtype is None else dtype
        # The partition axis: 0 in NKI 0.3. `neuronxcc` tensors may have leading block dims before an
        # `nl.par_dim` axis, e.g. (n_tiles, par_dim(128), 512); indexing the block dims away brings it to 0.
        self.pa = int(partition_axis) if buf.region.on_chip else 0
        # On-chip tiles a DMA reads its address from (``.ap(scalar_offset=tile)``): read dependencies of the transfer.
        self.offset_sources = ()

    # ------------------------------------------------------------------ properties
    @property
    def buffer(self) -> MemoryRegion:
        return self._buf.region

    @property
    def name(self) -> str:
        return self._buf.name

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return _prod(self.shape)

    @property
    def itemsize(self) -> int:
        return storage_dtype(self.dtype).itemsize

    @property
    def on_chip(self) -> bool:
        return self._buf.region.on_chip

    @property
    def partitions(self) -> int:
        """Partition count for on-chip tensors (the partition axis, dim 0 in NKI 0.3); dim 0 for HBM tensors."""
        return self.shape[self.pa] if self.shape else 1

    @property
    def free_size(self) -> int:
        """Elements per partition."""
        return self.size // self.partitions if self.partitions else 0

    @property
    def cshape(self) -> tuple:
        """The shape with the partition axis first: the layout `read()` returns and `write()` takes."""
        if not self.pa:
            return self.shape
        return (self.shape[self.pa],) + self.shape[: self.pa] + self.shape[self.pa + 1:]

    def _c(self, arr: np.ndarray) -> np.ndarray:
        return np.moveaxis(arr, self.pa, 0) if self.pa else arr

    def __repr__(self):
        return f"NkiTensor(shape={self.shape}, dtype={self.dtype}, buffer={self.buffer!r}, name={self.name!r})"

    def __len__(self):
        return self.shape[0]

    # ------------------------------------------------------------------ storage access
    def _view_of(self, flat: np.ndarray, dtype) -> np.ndarray:
        isz = flat.dtype.itemsize
        if self.size == 0:
            return np.empty(self.shape, dtype=flat.dtype)
        return np.ndarray(self.shape, dtype=flat.dtype, buffer=flat, offset=self.offset * isz,
                          strides=tuple(s * isz for s in self.strides))

    def _np(self) -> np.ndarray:
        """The view as a NumPy array sharing storage (writable unless broadcast)."""
        data = self._buf.data
        sd = storage_dtype(self.dtype)
        if sd != data.dtype:
            data = data.view(sd)
        return self._view_of(data, sd)

    def _written(self) -> np.ndarray:
        return self._view_of(self._buf.written, bool)

    def read(self, *, check: bool = True, what: str = "") -> np.ndarray:
        """A copy of the viewed values (storage dtype); raises `[uninitialized-read]` on never-written memory."""
        if check and runtime.current().uninitialized == "error" and not self._written().all():
            n = int((~self._written()).sum())
            raise NkiRuleError(
                "uninitialized-read",
                f"{what or 'an instruction'} reads {n} element(s) of {self.name} {self.shape} that were never written",
            )
        if self._buf.acc_open is not None:  # reading a PSUM tile closes its matmul accumulation group
            self._view_of(self._buf.acc_open, bool)[...] = False
        return np.array(self._c(self._np()))

    def write(self, values) -> None:
        """Store values (cast to this tensor's dtype) into the view and mark them written."""
        if any(st == 0 and n > 1 for st, n in zip(self.strides, self.shape)):
            raise NkiRuleError("memory-type", f"cannot write through a broadcast view of {self.name}")
        values = np.broadcast_to(cast(values, self.dtype), self.cshape)
        self._c(self._np())[...] = values
        self._written()[...] = True
        if self._buf.acc_open is not None:
            self._view_of(self._buf.acc_open, bool)[...] = False

    def _mark_written(self):
        """Mark the view written without storing values (``compute=False`` runs)."""
        self._written()[...] = True

    # ------------------------------------------------------------------ indexing
    def _normalize_key(self, key):
        if not isinstance(key, tuple):
            key = (key,)
        if any(k is Ellipsis for k in key):
            i = next(i for i, k in enumerate(key) if k is Ellipsis)
            fill = self.ndim - (len(key) - 1)
            key = key[:i] + (slice(None),) * fill + key[i + 1:]
        if len(key) > self.ndim:
            raise NkiRuleError("out-of-bounds", f"too many indices ({len(key)}) for {self.name} of shape {self.shape}")
        return key + (slice(None),) * (self.ndim - len(key))

    def __getitem__(self, key) -> "NkiTensor":
        key = self._normalize_key(key)
        shape, strides, offset, pa = [], [], self.offset, self.pa
        for dim, (k, n, st) in enumerate(zip(key, self.shape, self.strides)):
            if isinstance(k, NkiTensor):
                raise NotImplementedError("dynamic (tensor) indices are not emulated; use .ap(scalar_offset=...)")
            if isinstance(k, (int, np.integer)):
                k = int(k)
                if k < 0:
                    k += n
                if not 0 <= k < n:
                    raise NkiRuleError(
                        "out-of-bounds", f"index {k} out of range for dim {dim} of size {n} in {self.name}"
                    )
                offset += k * st
                if dim == self.pa and self.on_chip:  # the partition axis stays, with size 1
                    shape.append(1)
                    strides.append(st)
                elif dim < self.pa:
                    pa -= 1
                continue
            if isinstance(k, DynSlice):
                start, stop, step = k.start, k.start + k.size * k.step, k.step
            elif isinstance(k, slice):
                start, stop, step = k.start, k.stop, k.step
                step = 1 if step is None else int(step)
                if step < 1:
                    raise NkiRuleError("out-of-bounds", f"slice step must be >= 1, got {step}")
                start = 0 if start is None else int(start)
                stop = n if stop is None else int(stop)
                if start < 0:
                    start += n
                if stop < 0:
                    stop += n
            else:
                raise TypeError(f"unsupported index {k!r}")
            if start < 0 or stop > n or start > stop:
                raise NkiRuleError(
                    "out-of-bounds",
                    f"slice [{start}:{stop}] out of range for dim {dim} of size {n} in {self.name} {self.shape}",
                )
            count = max(0, -(-(stop - start) // step))
            offset += start * st
            shape.append(count)
            strides.append(st * step)
        return NkiTensor(self._buf, shape, strides, offset, self.dtype, pa)

    def __setitem__(self, key, value):
        view = self[key]
        if isinstance(value, NkiTensor):
            if value._buf is view._buf and value.offset == view.offset and value.shape == view.shape:
                return  # `t[...] += x` writes back the view it already updated in place
            value = value.read(what=f"assignment to {self.name}")
        view.write(_fit(np.asarray(value), view.cshape))

    # ------------------------------------------------------------------ view operations (nki.language.NkiTensor)
    def _new(self, shape, strides, offset=None, dtype=None):
        return NkiTensor(self._buf, shape, strides, self.offset if offset is None else offset, dtype or self.dtype)

    def slice(self, dim, start, end, step=1):
        key = [slice(None)] * self.ndim
        key[dim] = slice(start, end, step)
        return self[tuple(key)]

    def select(self, dim, index):
        """Static selection along ``dim`` (the dimension is removed, except an on-chip partition axis)."""
        if isinstance(index, NkiTensor):
            raise NotImplementedError("dynamic select is not emulated")
        key = [slice(None)] * self.ndim
        key[dim] = int(index)
        return self[tuple(key)]

    def permute(self, dims):
        dims = tuple(dims)
        if sorted(dims) != list(range(self.ndim)):
            raise ValueError(f"permute dims {dims} is not a permutation of {self.ndim} dims")
        if self.on_chip and dims[0] != 0:
            raise NkiRuleError("partition-dim", "permute cannot move the partition axis (dim 0) of an on-chip tensor")
        return self._new([self.shape[d] for d in dims], [self.strides[d] for d in dims])

    def transpose(self, *dims):
        dims = dims[0] if len(dims) == 1 and isinstance(dims[0], (tuple, list)) else dims
        return self.permute(dims or tuple(reversed(range(self.ndim))))

    def broadcast(self, dim, size):
        if self.shape[dim] != 1:
            raise ValueError(f"broadcast needs size 1 at dim {dim}, got {self.shape}")
        shape, strides = list(self.shape), list(self.strides)
        shape[dim], strides[dim] = int(size), 0
        return self._new(shape, strides)

    def broadcast_to(self, shape):
        shape = tuple(int(s) for s in shape)
        src_shape, src_strides = list(self.shape), list(self.strides)
        if len(src_shape) < len(shape):
            pad = len(shape) - len(src_shape)
            src_shape, src_strides = [1] * pad + src_shape, [0] * pad + src_strides
        strides = []
        for n_src, st, n in zip(src_shape, src_strides, shape):
            if n_src == n:
                strides.append(st)
            elif n_src == 1:
                strides.append(0)
            else:
                raise ValueError(f"cannot broadcast {self.shape} to {shape}")
        return self._new(shape, strides)

    def expand_dim(self, dim):
        shape, strides = list(self.shape), list(self.strides)
        shape.insert(dim, 1)
        strides.insert(dim, 0)
        return self._new(shape, strides)

    def squeeze_dim(self, dim):
        if self.shape[dim] != 1:
            raise ValueError(f"squeeze_dim needs size 1 at dim {dim}, got {self.shape}")
        return self._new(self.shape[:dim] + self.shape[dim + 1:], self.strides[:dim] + self.strides[dim + 1:])

    def reshape_dim(self, dim, shape):
        shape = list(shape)
        if -1 in shape:
            known = _prod([s for s in shape if s != -1])
            shape[shape.index(-1)] = self.shape[dim] // known
        if _prod(shape) != self.shape[dim]:
            raise ValueError(f"reshape_dim {shape} does not match size {self.shape[dim]}")
        st = self.strides[dim]
        new_strides = [st * _prod(shape[i + 1:]) for i in range(len(shape))]
        return self._new(self.shape[:dim] + tuple(shape) + self.shape[dim + 1:],
                         self.strides[:dim] + tuple(new_strides) + self.strides[dim + 1:])

    def flatten_dims(self, start_dim, end_dim):
        for d in range(start_dim, end_dim):
            merged_stride = self.strides[d + 1] * self.shape[d + 1]
            if self.shape[d + 1] != 1 and self.shape[d] != 1 and self.strides[d] != merged_stride:
                raise ValueError(f"flatten_dims({start_dim}, {end_dim}): dims are not contiguous in {self.shape}")
        n = _prod(self.shape[start_dim:end_dim + 1])
        return self._new(self.shape[:start_dim] + (n,) + self.shape[end_dim + 1:],
                         self.strides[:start_dim] + (self.strides[end_dim],) + self.strides[end_dim + 1:])

    def reshape(self, *shape):
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)
        shape = list(shape)
        if -1 in shape:
            shape[shape.index(-1)] = self.size // _prod([s for s in shape if s != -1])
        if _prod(shape) != self.size:
            raise ValueError(f"cannot reshape {self.shape} into {tuple(shape)}")
        if self.on_chip and shape[0] != self.shape[0]:
            raise NkiRuleError("partition-dim", f"reshape must keep the partition axis: {self.shape} -> {tuple(shape)}")
        # Use NumPy's view logic to find strides; it refuses (copy needed) when the layout does not allow it.
        probe = np.lib.stride_tricks.as_strided(np.zeros(1, np.int8), self.shape, self.strides)
        try:
            reshaped = probe.view()
            reshaped.shape = tuple(shape)
        except AttributeError:
            raise ValueError(f"reshape {self.shape} -> {tuple(shape)} is incompatible with the view's layout") from None
        return self._new(shape, reshaped.strides)

    def is_contiguous(self) -> bool:
        dims = range(1, self.ndim) if self.on_chip else range(self.ndim)
        expected = 1
        for d in reversed(list(dims)):
            if self.shape[d] != 1 and self.strides[d] != expected:
                return False
            expected *= self.shape[d]
        return True

    def get_pattern(self):
        return [[st, n] for st, n in zip(self.strides, self.shape)]

    def is_indirect(self) -> bool:
        return False

    def ap(self, pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim=0, dtype=None):
        """Explicit ``[[stride, count], ...]`` access pattern on the underlying storage (``NkiTensor.ap``).

        ``offset`` adds to the view's storage offset; ``scalar_offset`` (a 1x1 tensor or int) adds
        ``value * stride[indirect_dim]``; ``vector_offset`` (a (P, 1) SBUF tensor) gives each index along
        ``indirect_dim`` its own row (gather/scatter on HBM, as in the ``nisa.dma_copy`` reference)."""
        pattern = [[int(st), int(n)] for st, n in pattern]
        base = self.offset + (0 if offset is None else int(offset))
        new_dtype = dtype or self.dtype
        if new_dtype is not self.dtype and storage_dtype(new_dtype).itemsize != self.itemsize:
            ratio = self.itemsize / storage_dtype(new_dtype).itemsize
            base = int(base * ratio)
        if scalar_offset is not None:
            if isinstance(scalar_offset, NkiTensor) and not runtime.current().compute:
                value = 0  # cost-only runs (compute=False) hold no values: take the first row, in bounds
            else:
                raw = scalar_offset.read() if isinstance(scalar_offset, NkiTensor) else scalar_offset
                value = int(np.asarray(raw).reshape(-1)[0])
            # the offset steps along the tensor's own dimension `indirect_dim` (its stride, not the pattern's): the
            # NKI Library's kernels rely on it (attention_block_tkg: indirect_dim=2 with a two-entry pattern on a
            # (B, d_head, S) cache; bwmm_shard_on_block: "scalar_offset: block_expert (compiler multiplies by
            # H*2*I_TP)" for a pattern whose first stride is 2*I_TP)
            if not 0 <= indirect_dim < self.ndim:
                raise NkiRuleError("shape", f"ap: indirect_dim {indirect_dim} is not a dimension of {self.name} "
                                   f"{tuple(self.shape)}")
            base += value * self.strides[indirect_dim]
        view = NkiTensor(self._buf, [n for _, n in pattern], [st for st, _ in pattern], base, new_dtype)
        if isinstance(scalar_offset, NkiTensor):
            # the DMA reads its address from this tile: the transfer waits for the tile's writer (cost model)
            view.offset_sources = (scalar_offset,)
        if isinstance(scalar_offset, NkiTensor) and not view._in_bounds():
            # A dynamic (runtime) offset that leaves the tensor: the DMA checks it when it runs ("in both of these
            # dynamic modes, out-of-bound address checking is turned on automatically during execution", dma_copy
            # page) and raises, or skips the access with oob_mode.skip.
            return _OutOfBoundsView(view, value)
        if vector_offset is not None:
            # the pattern's count along `indirect_dim` is the number of rows gathered (one per index of the vector),
            # not a span of the tensor: each row's address is checked when the DMA runs (`_dma_indirect`)
            first = NkiTensor(self._buf, [1 if d == indirect_dim else n for d, (_, n) in enumerate(pattern)],
                              view.strides, base, new_dtype)
            first._check_in_bounds()
            return _IndirectView(view, vector_offset, indirect_dim)
        view._check_in_bounds()
        return view

    def view(self, dtype):
        dtype = normalize_dtype(dtype)
        old, new = self.itemsize, storage_dtype(dtype).itemsize
        if self.strides and self.strides[-1] != 1 and self.shape[-1] != 1:
            raise ValueError("view(dtype) needs a contiguous last dimension")
        if new == old:
            return NkiTensor(self._buf, self.shape, self.strides, self.offset, dtype)
        ratio = old / new
        shape = list(self.shape)
        shape[-1] = int(shape[-1] * ratio)
        strides = [int(s * ratio) for s in self.strides[:-1]] + [1]
        return NkiTensor(self._buf, shape, strides, int(self.offset * ratio), dtype)

    reinterpret_cast = view

    def _in_bounds(self) -> bool:
        lo = self.offset + sum(min(0, (n - 1) * s) for n, s in zip(self.shape, self.strides))
        hi = self.offset + sum(max(0, (n - 1) * s) for n, s in zip(self.shape, self.strides))
        total = self._buf.data.size * self._buf.data.dtype.itemsize // self.itemsize
        return not self.size or (lo >= 0 and hi < total)

    def _check_in_bounds(self):
        lo = self.offset + sum(min(0, (n - 1) * s) for n, s in zip(self.shape, self.strides))
        hi = self.offset + sum(max(0, (n - 1) * s) for n, s in zip(self.shape, self.strides))
        total = self._buf.data.size * self._buf.data.dtype.itemsize // self.itemsize
        if self.size and (lo < 0 or hi >= total):
            raise NkiRuleError(
                "out-of-bounds", f"access pattern reaches element {hi} (or {lo}) of {self.name} holding {total}"
            )


def _fit(values: np.ndarray, shape) -> np.ndarray:
    """Values for a store into `shape`: broadcast, or reshape when only the element count matches."""
    try:
        return np.broadcast_to(values, shape)
    except ValueError:
        if values.size == _prod(shape):
            return values.reshape(shape)
        raise NkiRuleError(
            "shape", f"cannot store values of shape {values.shape} into a tile of shape {tuple(shape)}"
        ) from None


class _OutOfBoundsView:
    """An access pattern whose runtime ``scalar_offset`` puts it (wholly or partly) outside its tensor."""

    def __init__(self, view: NkiTensor, offset_value: int):
        self.view, self.offset_value = view, offset_value
        self.shape, self.dtype, self.buffer, self.name = view.shape, view.dtype, view.buffer, view.name
        self.on_chip = False
        self.size = view.size
        self.itemsize = view.itemsize


class _IndirectView:
    """An HBM view whose ``indirect_dim`` index comes per row from an SBUF vector (``.ap(vector_offset=...)``)."""

    def __init__(self, view: NkiTensor, index: NkiTensor, dim: int):
        self.view, self.index, self.dim = view, index, dim
        self.offset_sources = view.offset_sources + (index,)  # the rows' addresses come from this SBUF vector
        self.shape, self.dtype, self.buffer, self.name = view.shape, view.dtype, view.buffer, view.name
        self.on_chip = False
        self.size = view.size
        self.itemsize = view.itemsize

    def rows(self):
        idx = np.asarray(self.index.read()).reshape(-1).astype(np.int64)
        st = self.view.strides[self.dim]
        for r, i in enumerate(idx):
            key = [slice(None)] * self.view.ndim
            key[self.dim] = r
            row = self.view[tuple(key)]
            yield r, NkiTensor(row._buf, row.shape, row.strides, row.offset + (int(i) - r) * st, row.dtype)


# ------------------------------------------------------------------------------------------------------ allocation
def allocate(shape, dtype, buffer=sbuf, name: str = "", address=None) -> NkiTensor:
    """``nl.ndarray``: a new, uninitialized tensor (NaN-filled), checked against the partition and capacity rules."""
    region = normalize_buffer(buffer)
    dtype = normalize_dtype(dtype)
    raw_shape = tuple(shape if isinstance(shape, (tuple, list)) else (shape,))
    shape = tuple(int(s) for s in raw_shape)
    ctx = runtime.current()
    if region is shared_hbm and ctx.grid != (1,):
        # SPMD: every program sees the same shared_hbm tensor for the same allocation site (in program order).
        i = ctx.shared_hbm_cursor
        ctx.shared_hbm_cursor += 1
        if i < len(ctx.shared_hbm):
            t = ctx.shared_hbm[i]
            if t.shape != shape or t.dtype != dtype:
                raise NkiRuleError(
                    "shape", f"program {ctx.program_id} allocates shared_hbm {shape} where program 0 had {t.shape}"
                )
            return t
    pa = next((i for i, n in enumerate(raw_shape) if isinstance(n, ParDim)), 0) if region.on_chip else 0
    buf = Buffer(_prod(shape), dtype, region, name)
    if region.on_chip:
        if not shape:
            shape = (1,)
        if shape[pa] > ctx.target.partitions:
            raise NkiRuleError(
                "partition-dim",
                f"{region.value} tensor {buf.name} of shape {shape} spans {shape[pa]} partitions "
                f"(max {ctx.target.partitions})",
            )
        # neuronxcc block dims (before the par_dim axis): the compiler allocates each block by its own liveness
        # ("modulo allocation"), so one block is counted; NKI 0.3 tensors (partition axis 0) count whole.
        nbytes = _prod(shape[pa + 1:]) * storage_dtype(dtype).itemsize
        # `address=(partition_offset, free_offset)` (nl.ndarray): the buffer sits at that byte offset of each
        # partition, and is accounted there (buffers placed on the same bytes share them).
        free_offset = None
        if address is not None:
            address = tuple(address) if isinstance(address, (tuple, list)) else (0, address)
            part_offset, free_offset = int(address[0]), int(address[-1])
            if part_offset + shape[pa] > ctx.target.partitions:
                raise NkiRuleError(
                    "partition-dim",
                    f"{region.value} tensor {buf.name} of {shape[pa]} partitions placed at partition {part_offset}",
                )
        ctx.memory.allocate(region.value, nbytes, f"{buf.name} {shape} {dtype}", free_offset)
        if ctx.trace is not None:
            ctx.trace.alloc(buf, region.value, nbytes)
        weakref.finalize(buf, _release, ctx.memory, region.value, nbytes, ctx.trace, buf.uid, free_offset)
    # storage is partition-major: (P, other dims in order), whatever the position of the partition axis
    order = [pa] + [i for i in range(len(shape)) if i != pa]
    strides = [0] * len(shape)
    for pos, dim in enumerate(order):
        strides[dim] = _prod([shape[d] for d in order[pos + 1:]])
    t = NkiTensor(buf, shape, strides, 0, dtype, pa)
    if region is shared_hbm and ctx.grid != (1,):
        ctx.shared_hbm.append(t)
    return t


def from_array(array: np.ndarray, buffer=shared_hbm, name: str = "") -> NkiTensor:
    """Wrap a host array as an HBM tensor sharing its memory (kernel arguments)."""
    a = np.ascontiguousarray(array)
    buf = Buffer(a.size, a.dtype, normalize_buffer(buffer), name, data=a)
    strides = [_prod(a.shape[i + 1:]) for i in range(a.ndim)]
    return NkiTensor(buf, a.shape, strides, 0, a.dtype)
