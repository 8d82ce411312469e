"""The static shapes a model is compiled for when none are given: context-encoding and decode-cache buckets."""

from __future__ import annotations

DEFAULT_BUCKET_MIN = 64


def default_buckets(max_length: int, smallest: int = DEFAULT_BUCKET_MIN) -> list[int]:
    """Context-encoding lengths: powers of two from `smallest`, and max_length itself."""
    buckets, b = [], smallest
    while b < max_length:
        buckets.append(b)
        b *= 2
    return buckets + [max_length]


def default_key_buckets(max_length: int, smallest: int = DEFAULT_BUCKET_MIN) -> list[int]:
    """Decode cache lengths: powers of two from `smallest`, the midpoints between them, and max_length. A step then
    attends over at most 1.5x the positions it needs (2x with powers of two alone: at position 4096 of an 8192
    cache, the whole cache); each bucket is one more token graph, which costs nothing on CPU."""
    buckets = []
    for b in default_buckets(max_length, smallest)[:-1]:
        buckets += [b, b + b // 2]
    return sorted(b for b in buckets if b < max_length) + [max_length]
