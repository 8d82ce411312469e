"""Kernels of the Qwen3.5 DeltaNet layers, installed as `optimum_qwen35.kernels`.

Each kernel sits beside its PyTorch reference, with the same signature. The model calls the
entry points below; `set_backend` chooses which implementation answers them (the PyTorch reference
by default; NKI kernels register themselves as another backend).
"""

from __future__ import annotations

from typing import Callable

from . import causal_conv1d as _conv
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
        # The fused seams (raw projections in, slot states updated in place); see gated_delta_rule/fused.py.
        "deltanet_prefill": _fused.deltanet_prefill_reference,
        "deltanet_decode": _fused.deltanet_decode_reference,
    }
}
_active = "torch"


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


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, lengths=None):
    return _BACKENDS[_active]["chunk_gated_delta_rule"](q, k, v, g, beta, initial_state, lengths)


def recurrent_gated_delta_rule_step(q, k, v, g, beta, state):
    return _BACKENDS[_active]["recurrent_gated_delta_rule_step"](q, k, v, g, beta, state)


def causal_conv1d(x, weight, initial_state=None, lengths=None):
    return _BACKENDS[_active]["causal_conv1d"](x, weight, initial_state, lengths)


def causal_conv1d_step(x, weight, state):
    return _BACKENDS[_active]["causal_conv1d_step"](x, weight, state)


def deltanet_prefill(q, k, v, a, b, A_log, dt_bias, recurrent_state, seq_ids, lengths):
    """Normalise q/k, gates from the raw a/b, chunked rule from each slot's state; the final state in place."""
    return _BACKENDS[_active]["deltanet_prefill"](q, k, v, a, b, A_log, dt_bias, recurrent_state, seq_ids, lengths)


def deltanet_decode(mixed_qkv, a, b, A_log, dt_bias, conv_weight, conv_state, recurrent_state, seq_ids):
    """One token per row from raw projections: conv step, norms, gates, delta-rule step; slot states in place."""
    return _BACKENDS[_active]["deltanet_decode"](
        mixed_qkv, a, b, A_log, dt_bias, conv_weight, conv_state, recurrent_state, seq_ids
    )


# The NKI kernels behind the fused seams. On CPU they run on the NKI emulator (`set_backend("nki")`); on a Neuron
# device they are to be called from the traced graphs (not wired yet: the Neuron backend's in-place state contract).
register_backend("nki", {"deltanet_prefill": _fused.deltanet_prefill_nki, "deltanet_decode": _fused.deltanet_decode_nki})
