"""The `nki.language` functions that run `nki.isa` instructions (nl.full / zeros / ones, the identity matrix, and the
neuronxcc-style nl.matmul / load / store): here rather than in language.py, which isa.py imports (for its operators
and dtypes), so that neither imports the other both ways. The package's __init__ puts them into `language`
(`nki.language.zeros` is this `zeros`).
"""

from __future__ import annotations

import numpy as np

from . import isa
from .language import transpose
from .tensors import NkiTensor, allocate, float32, psum, sbuf, uint8

__all__ = ["full", "zeros", "ones", "zeros_like", "shared_identity_matrix", "matmul", "load", "store",
           "load_transpose2d"]


def full(shape, fill_value, dtype, buffer=sbuf, name="", **kwargs):
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
    out = dst if dst is not None else allocate((n, n), dtype, sbuf)
    isa._write(out, np.eye(n, dtype=np.float32))
    return out


def matmul(x, y, transpose_x=False):
    """``nl.matmul``: ``x @ y`` (``x.T @ y`` with ``transpose_x``) into a new fp32 PSUM tile, via ``nc_matmul``."""
    stationary = x if transpose_x else transpose(x)
    out = allocate((stationary.shape[1], y.shape[1]), float32, psum)
    isa.nc_matmul(out, stationary, y)
    return out


def load(src, dtype=None, mask=None, **kwargs):
    """``nl.load`` (neuronxcc style): DMA an HBM tensor into a new SBUF tile."""
    shape = src.shape if len(src.shape) else (1,)
    if not src.on_chip and len(shape) == 1:
        shape = (shape[0], 1)
    out = allocate(shape, dtype or src.dtype, sbuf)
    isa.dma_copy(out, src)
    return out


def store(dst, value, mask=None, **kwargs):
    """``nl.store`` (neuronxcc style): DMA a tile into an HBM tensor."""
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
