"""The TensorE operand policy of the DeltaNet kernels: one rule for both, chosen by the model's (activation) dtype.

    operands="auto" (default): bf16 activations -> bf16 operands; fp32 activations -> fp32 operands
    operands="bf16" | "tf32": bf16 activations only (bf16's TensorE rate; tf32 keeps 10 mantissa bits)
    operands="fp32": exact, 4x the bf16 TensorE cost, any activation dtype

Whatever the operands, matmuls accumulate in fp32 (PSUM), and the gates, their cumulative sums, the decay factors and
the carried recurrent state stay fp32: only the values fed to TensorE are rounded.
"""

from __future__ import annotations

from ..nki_import import nl

OPERANDS = ("auto", "bf16", "tf32", "fp32")


def matmul_dtype(operands: str, activation_dtype):
    """The NKI dtype of the kernels' TensorE operands for `operands` (see above) and the activation dtype."""
    if operands not in OPERANDS:
        raise ValueError(f"operands={operands!r}: expected one of {OPERANDS}")
    bf16_activations = activation_dtype != nl.float32
    if operands == "fp32" or (operands == "auto" and not bf16_activations):
        return nl.float32
    if not bf16_activations:
        raise ValueError(f"operands={operands!r} needs bf16 activations; fp32 models take 'fp32' (or 'auto')")
    return nl.bfloat16 if operands in ("auto", "bf16") else nl.tfloat32
