"""Kernels of the Qwen3.5 DeltaNet layers: the entry points the model calls and the backends that answer them.

The kernels themselves live in the repository's top-level `kernels/` folder, each beside its PyTorch reference with
the same signature, installed as the subpackages of this package (setup.py): `kernels/gated_delta_rule` is
`optimum_qwen35.kernels.gated_delta_rule`, `kernels/conv1d` `optimum_qwen35.kernels.conv1d`, `kernels/emulator` the CPU
NKI emulator, `kernels/nki_import` where kernels get NKI from. This module is the dispatch.

Which implementation answers an entry point is a backend (backends.py): the one a model names (`backend=`, which the
DeltaNet mixer takes from its layer factory: per model, nothing leaks to other models), or else the process-wide one
`set_backend` chooses (the PyTorch reference by default). NKI kernels register themselves as the "nki" backend.

The fused seams (`deltanet_prefill`, `deltanet_decode`, `deltanet_verify`) take tensors and return tensors: each row's initial states in,
each row's final states out (gated_delta_rule/fused.py); the caller keeps the slots. They are also `torch.library`
custom ops (custom_ops.py), which a TorchDynamo capture records as one node each.
"""

from __future__ import annotations

import torch

from . import backends, custom_ops
from .backends import (  # noqa: F401  (the public API of the registry)
    ENTRY_POINTS,
    backend_names,
    get_backend,
    implementation,
    register_backend,
    set_backend,
    unregister_backend,
)


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, lengths=None, *, backend=None):
    return implementation("chunk_gated_delta_rule", backend)(q, k, v, g, beta, initial_state, lengths)


def recurrent_gated_delta_rule_step(q, k, v, g, beta, state, *, backend=None):
    return implementation("recurrent_gated_delta_rule_step", backend)(q, k, v, g, beta, state)


def causal_conv1d(x, weight, initial_state=None, lengths=None, *, backend=None):
    return implementation("causal_conv1d", backend)(x, weight, initial_state, lengths)


def causal_conv1d_step(x, weight, state, *, backend=None):
    return implementation("causal_conv1d_step", backend)(x, weight, state)


def deltanet_prefill(q, k, v, a, b, A_log, dt_bias, initial_recurrent, lengths=None, *, backend=None, lnc=None):
    """Normalise q/k, gates from the raw a/b, chunked rule from each row's initial state -> (o [B, nv, T, dv] fp32,
    final_recurrent [B, nv, dk, dv] fp32). `lnc`: the LNC degree of the compiled target (None: the emulator's)."""
    if torch.compiler.is_compiling():  # one node of the custom op in a TorchDynamo graph (custom_ops.py)
        return custom_ops.deltanet_prefill(q, k, v, a, b, A_log, dt_bias, initial_recurrent, lengths,
                                           backends.resolve(backend), lnc)
    return implementation("deltanet_prefill", backend)(q, k, v, a, b, A_log, dt_bias, initial_recurrent, lengths, lnc=lnc)


def deltanet_decode(mixed_qkv, a, b, A_log, dt_bias, conv_weight, initial_conv, initial_recurrent, *, backend=None,
                    lnc=None, donate_initial=False):
    """One token per row from raw projections and each row's initial states: conv step, norms, gates, delta-rule step
    -> (o [B, nv, dv] fp32, final_conv [B, C, K - 1], final_recurrent [B, nv, dk, dv] fp32). `donate_initial`: the
    caller gives up the initial-state tensors, which the implementation may reuse (gated_delta_rule/fused.py)."""
    if torch.compiler.is_compiling():  # one node of the custom op in a TorchDynamo graph (custom_ops.py)
        return custom_ops.deltanet_decode(mixed_qkv, a, b, A_log, dt_bias, conv_weight, initial_conv,
                                          initial_recurrent, backends.resolve(backend), lnc)
    return implementation("deltanet_decode", backend)(
        mixed_qkv, a, b, A_log, dt_bias, conv_weight, initial_conv, initial_recurrent, lnc=lnc,
        donate_initial=donate_initial,
    )


def deltanet_verify(mixed_qkv, a, b, A_log, dt_bias, conv_weight, initial_conv, initial_recurrent, *, backend=None,
                    lnc=None):
    """T = k + 1 decode steps per row (speculative verification), mixed_qkv [B, T, C], a, b [B, T, nv], from each
    row's initial states, every position's states kept -> (o [B, nv, T, dv] fp32, convs [B, T, C, K - 1],
    recurrents [B, T * nv, dk, dv] fp32: the states after each position, position-major within a row)."""
    if torch.compiler.is_compiling():  # one node of the custom op in a TorchDynamo graph (custom_ops.py)
        return custom_ops.deltanet_verify(mixed_qkv, a, b, A_log, dt_bias, conv_weight, initial_conv,
                                          initial_recurrent, backends.resolve(backend), lnc)
    return implementation("deltanet_verify", backend)(
        mixed_qkv, a, b, A_log, dt_bias, conv_weight, initial_conv, initial_recurrent, lnc=lnc
    )
