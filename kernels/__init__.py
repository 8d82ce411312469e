"""Kernels of the Qwen3.5 DeltaNet layers, installed as `optimum_qwen35.kernels`.

Each kernel sits beside its PyTorch reference, with the same signature. The model calls the
entry points below; which implementation answers them is a backend: the one a model names (`backend=`,
which the DeltaNet mixer takes from its layer factory: per model, nothing leaks to other models), or else
the process-wide one `set_backend` chooses (the PyTorch reference by default). NKI kernels register
themselves as the "nki" backend.

`calls` counts the dispatched calls per (backend, entry point): what tests read to know which
implementation a model really ran.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

from . import causal_conv1d_reference as _conv
from . import gated_delta_rule as _gdr
from .gated_delta_rule import fused as _fused

ENTRY_POINTS = (
    "chunk_gated_delta_rule",
    "recurrent_gated_delta_rule_step",
    "causal_conv1d",
    "causal_conv1d_step",
    "deltanet_prefill",
    "deltanet_decode",
)

_BACKENDS: dict[str, dict[str, Callable]] = {
    "torch": {
        "chunk_gated_delta_rule": _gdr.chunk_gated_delta_rule,
        "recurrent_gated_delta_rule_step": _gdr.recurrent_gated_delta_rule_step,
        "causal_conv1d": _conv.causal_conv1d,
        "causal_conv1d_step": _conv.causal_conv1d_step,
        # The fused seams (raw projections in; output and updated slot states out); see gated_delta_rule/fused.py.
        "deltanet_prefill": _fused.deltanet_prefill_reference,
        "deltanet_decode": _fused.deltanet_decode_reference,
    }
}
_active = "torch"
calls: Counter = Counter()


def register_backend(name: str, implementations: dict[str, Callable]) -> None:
    """Add a backend; entry points it does not implement fall back to the PyTorch reference."""
    unknown = set(implementations) - set(ENTRY_POINTS)
    if unknown:
        raise ValueError(f"unknown kernel entry points {sorted(unknown)}; expected a subset of {ENTRY_POINTS}")
    _BACKENDS[name] = {**_BACKENDS["torch"], **implementations}


def set_backend(name: str) -> None:
    global _active
    if name not in _BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; registered: {sorted(_BACKENDS)}")
    _active = name


def get_backend() -> str:
    return _active


def _implementation(entry: str, backend: str | None) -> Callable:
    """The implementation of `entry` in `backend` (None: the process-wide one), counted in `calls`."""
    name = _active if backend is None else backend
    if name not in _BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; registered: {sorted(_BACKENDS)}")
    calls[(name, entry)] += 1
    return _BACKENDS[name][entry]


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, lengths=None, *, backend=None):
    return _implementation("chunk_gated_delta_rule", backend)(q, k, v, g, beta, initial_state, lengths)


def recurrent_gated_delta_rule_step(q, k, v, g, beta, state, *, backend=None):
    return _implementation("recurrent_gated_delta_rule_step", backend)(q, k, v, g, beta, state)


def causal_conv1d(x, weight, initial_state=None, lengths=None, *, backend=None):
    return _implementation("causal_conv1d", backend)(x, weight, initial_state, lengths)


def causal_conv1d_step(x, weight, state, *, backend=None):
    return _implementation("causal_conv1d_step", backend)(x, weight, state)


def deltanet_prefill(q, k, v, a, b, A_log, dt_bias, recurrent_state, slots, lengths, *, backend=None):
    """Normalise q/k, gates from the raw a/b, chunked rule from each slot's state -> (o, recurrent_state)."""
    return _implementation("deltanet_prefill", backend)(
        q, k, v, a, b, A_log, dt_bias, recurrent_state, slots, lengths
    )


def deltanet_decode(mixed_qkv, a, b, A_log, dt_bias, conv_weight, conv_state, recurrent_state, slots, *,
                    backend=None):
    """One token per row from raw projections: conv step, norms, gates, delta-rule step -> (o, conv, recurrent)."""
    return _implementation("deltanet_decode", backend)(
        mixed_qkv, a, b, A_log, dt_bias, conv_weight, conv_state, recurrent_state, slots
    )


# The NKI kernels behind the fused seams: they return o and the new states, which the seams write into the slots as
# the references do. Where the real `nki` package is importable (NKI >= 0.3, Neuron SDK 2.29+; see nki_import.py) they
# are `nki.jit` launches on the tensors as given: inside the Neuron graphs, torch-xla tensors, where the Neuron model
# builder selects this backend on request on trn2 and later (`neuron.glue.kernel_backend`). Elsewhere they run on the
# CPU NKI emulator (`set_backend("nki")`, or `TorchLayers(kernel_backend="nki")`).
register_backend("nki", {"deltanet_prefill": _fused.deltanet_prefill_nki, "deltanet_decode": _fused.deltanet_decode_nki})
