"""The fused DeltaNet seams as `torch.library` custom ops: `torch.ops.optimum_qwen35.deltanet_prefill`,
`torch.ops.optimum_qwen35.deltanet_decode` and `torch.ops.optimum_qwen35.deltanet_verify`.

A graph capture (TorchDynamo: `torch.compile`, `torch.export`) records each seam as one node of the op, with the
shapes and dtypes of its fake (meta) implementation, instead of tracing through the reference's few dozen ops or
breaking the graph at an NKI launch. What runs when the op runs is the backend the call names (`backend`: "torch", the
PyTorch reference; "nki", the NKI kernels; any registered one), with the LNC degree it passes: the backend is an
implementation choice behind the op, not part of the graph. TorchNeuron's compile path (TorchDynamo -> AOT Autograd
-> its lowering) takes custom ops of this kind; how an NKI kernel enters such a graph there is docs/kernels.md's
"Custom ops" section.

The entry points of `optimum_qwen35.kernels` route a call through the op only while TorchDynamo traces
(`torch.compiler.is_compiling()`): eager calls, and the Neuron graphs traced by torch-xla's lazy tensors, call the
implementation directly (no dispatcher on the decode path, and torch-xla traces the implementation's own ops or its
NKI custom call). The ops never donate their inputs: the outputs are new tensors, as a custom op's must be.

No `from __future__ import annotations` here: `torch.library.custom_op` reads the schema from the annotations.
"""

from typing import Optional

import torch

from . import backends

NAMESPACE = "optimum_qwen35"


def _dtypes(activation: torch.dtype, state: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """The dtypes of o and of the final recurrent state, as the references give them (gated_delta_rule/reference.py):
    o in the activations' dtype upcast to fp32 at least, the state fp32 unless the activations or the state are
    float64 (a float64 reference model)."""
    state_dtype = torch.float64 if torch.float64 in (activation, state) else torch.float32
    return torch.promote_types(activation, torch.float32), state_dtype


@torch.library.custom_op(f"{NAMESPACE}::deltanet_decode", mutates_args=())
def deltanet_decode(
    mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    conv_weight: torch.Tensor, initial_conv: torch.Tensor, initial_recurrent: torch.Tensor, backend: str,
    lnc: Optional[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    results = backends.implementation("deltanet_decode", backend)(
        mixed_qkv, a, b, A_log, dt_bias, conv_weight, initial_conv, initial_recurrent, lnc=lnc, donate_initial=False
    )
    # Contiguous, as the fake results are (the reference's conv state is a view into its conv window).
    return tuple(t.contiguous() for t in results)


@deltanet_decode.register_fake
def _(mixed_qkv, a, b, A_log, dt_bias, conv_weight, initial_conv, initial_recurrent, backend, lnc):
    B = mixed_qkv.shape[0]
    _, nv, dk, dv = initial_recurrent.shape
    o_dtype, state_dtype = _dtypes(mixed_qkv.dtype, initial_recurrent.dtype)
    return (
        mixed_qkv.new_empty((B, nv, dv), dtype=o_dtype),
        initial_conv.new_empty(initial_conv.shape),
        initial_recurrent.new_empty((B, nv, dk, dv), dtype=state_dtype),
    )


@torch.library.custom_op(f"{NAMESPACE}::deltanet_verify", mutates_args=())
def deltanet_verify(
    mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    conv_weight: torch.Tensor, initial_conv: torch.Tensor, initial_recurrent: torch.Tensor, backend: str,
    lnc: Optional[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    results = backends.implementation("deltanet_verify", backend)(
        mixed_qkv, a, b, A_log, dt_bias, conv_weight, initial_conv, initial_recurrent, lnc=lnc
    )
    return tuple(t.contiguous() for t in results)  # contiguous, as the fake results are


@deltanet_verify.register_fake
def _(mixed_qkv, a, b, A_log, dt_bias, conv_weight, initial_conv, initial_recurrent, backend, lnc):
    B, T, _ = mixed_qkv.shape
    _, nv, dk, dv = initial_recurrent.shape
    o_dtype, state_dtype = _dtypes(mixed_qkv.dtype, initial_recurrent.dtype)
    return (
        mixed_qkv.new_empty((B, nv, T, dv), dtype=o_dtype),
        initial_conv.new_empty((B, T, *initial_conv.shape[1:])),
        initial_recurrent.new_empty((B, T * nv, dk, dv), dtype=state_dtype),
    )


@torch.library.custom_op(f"{NAMESPACE}::deltanet_prefill", mutates_args=())
def deltanet_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor, initial_recurrent: torch.Tensor, lengths: Optional[torch.Tensor], backend: str,
    lnc: Optional[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    results = backends.implementation("deltanet_prefill", backend)(
        q, k, v, a, b, A_log, dt_bias, initial_recurrent, lengths, lnc=lnc
    )
    return tuple(t.contiguous() for t in results)  # contiguous, as the fake results are


@deltanet_prefill.register_fake
def _(q, k, v, a, b, A_log, dt_bias, initial_recurrent, lengths, backend, lnc):
    B, nv, T, dv = v.shape
    dk = q.shape[-1]
    o_dtype, state_dtype = _dtypes(v.dtype, initial_recurrent.dtype)
    return v.new_empty((B, nv, T, dv), dtype=o_dtype), initial_recurrent.new_empty((B, nv, dk, dv), dtype=state_dtype)
