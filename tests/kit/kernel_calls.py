"""Which kernel implementation a model really ran: count the calls the dispatch hands to a backend's functions.

    with count_kernel_calls("torch", "nki") as calls:
        model.prefill(...)
    assert calls["torch", "deltanet_prefill"] == 4

Within the block, every entry point of the named backends is wrapped by a counting function in the registry
(`optimum_qwen35.kernels.backends`); on exit the backends' own functions are put back. The product keeps no counter.
"""

from __future__ import annotations

import contextlib
from collections import Counter

from optimum_qwen35.kernels import backends


def _counted(calls: Counter, key, function):
    def counted(*args, **kwargs):
        calls[key] += 1
        return function(*args, **kwargs)

    return counted


@contextlib.contextmanager
def count_kernel_calls(*names: str):
    calls: Counter = Counter()
    saved = {name: dict(backends._BACKENDS[name]) for name in names}
    try:
        for name, table in saved.items():
            backends._BACKENDS[name] = {entry: _counted(calls, (name, entry), fn) for entry, fn in table.items()}
        yield calls
    finally:
        backends._BACKENDS.update(saved)
