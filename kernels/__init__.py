"""Kernels of the Qwen3.5 DeltaNet layers, installed as `optimum_qwen35.kernels`.

Each kernel sits beside its PyTorch reference, with the same signature. The model calls the four
entry points below; `set_backend` chooses which implementation answers them (the PyTorch reference
by default; NKI kernels register themselves as another backend).
"""

from __future__ import annotations

from typing import Callable

from . import causal_conv1d as _conv
from . import gated_delta_rule as _gdr

ENTRY_POINTS = ("chunk_gated_delta_rule", "recurrent_gated_delta_rule_step", "causal_conv1d", "causal_conv1d_step")

_BACKENDS: dict[str, dict[str, Callable]] = {
    "torch": {
        "chunk_gated_delta_rule": _gdr.chunk_gated_delta_rule,
        "recurrent_gated_delta_rule_step": _gdr.recurrent_gated_delta_rule_step,
        "causal_conv1d": _conv.causal_conv1d,
        "causal_conv1d_step": _conv.causal_conv1d_step,
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
