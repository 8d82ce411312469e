"""The decode kernel's on-chip layout (tkg.py's docstring): how a head's fp32 state is spread over partitions and
pieces, how the q/k conv data is blocked for its loads, and the stride-0 views that repeat a tile along other dims."""

from __future__ import annotations


def spread(t, shape, dims):
    """A view of t with its dims at positions `dims` of `shape`, repeated (stride 0) along the others (NKI 0.3's
    `expand_dim` and `broadcast` views: no copy)."""
    for axis in range(len(shape)):
        if axis not in dims:
            t = t.expand_dim(axis)
    for axis in range(len(shape)):
        if axis not in dims and shape[axis] != 1:
            t = t.broadcast(axis, shape[axis])
    return t


def state_layout(nv, dk, dv, heads_per_piece=None, group=1):
    """The on-chip state layout: R rows of a head's [dk, dv] state per partition (R dv fp32 contiguous in HBM: at least
    4 KiB where dk allows), nb = dk / R partitions per head, and pieces of hp heads (hp divides nv, hp nb <= 128
    partitions: by default as many as fit; a piece's instructions cost the same on fewer partitions)."""
    R = min(dk, max(1, -(-1024 // dv)))  # R dv 4 bytes >= 4 KiB
    while dk % R:
        R += 1
    nb = dk // R
    limit = 128 // nb if heads_per_piece is None else min(heads_per_piece, 128 // nb)
    hp = max(d for d in range(1, min(nv, limit) + 1) if nv % d == 0 and (d % group == 0 or group % d == 0))
    return R, nb, hp


def load_blocks(nk, nb):
    """Blocks of R q/k channels per partition in the conv's load layout: the fewest that fit 2 nk nb blocks on 128
    partitions, dividing nb (so that a piece's key heads start on a partition)."""
    return min(d for d in range(1, nb + 1) if nb % d == 0 and 2 * nk * nb // d <= 128)
