"""The kernel backends: which implementation answers each entry point of `optimum_qwen35.kernels`.

A backend maps entry point names to functions. "torch" holds the PyTorch references; the NKI kernels register as
"nki". A backend registered with only some entry points takes the references for the others; where it replaces an
unfused entry point (the conv step, the delta-rule step, the chunked rule) but not the fused seam that composes it,
its seam is the reference seam over its own unfused functions, so that the replacement takes effect in the model;
likewise, a backend with its own decode seam but no verify seam verifies by its decode seam, position by position.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

from .conv1d import reference as _conv
from .gated_delta_rule import fused as _fused, reference as _rule

ENTRY_POINTS = (
    "chunk_gated_delta_rule",
    "recurrent_gated_delta_rule_step",
    "causal_conv1d",
    "causal_conv1d_step",
    "deltanet_prefill",
    "deltanet_decode",
    "deltanet_verify",
)

_REFERENCES: dict[str, Callable] = {
    "chunk_gated_delta_rule": _rule.chunk_gated_delta_rule,
    "recurrent_gated_delta_rule_step": _rule.recurrent_gated_delta_rule_step,
    "causal_conv1d": _conv.causal_conv1d,
    "causal_conv1d_step": _conv.causal_conv1d_step,
    # The fused seams (raw projections and per-row initial states in; output and per-row final states out):
    # gated_delta_rule/fused.py.
    "deltanet_prefill": _fused.deltanet_prefill_reference,
    "deltanet_decode": _fused.deltanet_decode_reference,
    "deltanet_verify": _fused.deltanet_verify_reference,
}
_BACKENDS: dict[str, dict[str, Callable]] = {}
_active = "torch"


def register_backend(name: str, implementations: dict[str, Callable]) -> None:
    """Add (or replace) a backend; entry points it does not implement fall back to the PyTorch reference, the fused
    seams to the reference seams over the backend's own unfused entry points (verify: over its decode seam)."""
    unknown = set(implementations) - set(ENTRY_POINTS)
    if unknown:
        raise ValueError(f"unknown kernel entry points {sorted(unknown)}; expected a subset of {ENTRY_POINTS}")
    table = {**_REFERENCES, **implementations}
    if "deltanet_prefill" not in implementations and table["chunk_gated_delta_rule"] is not _rule.chunk_gated_delta_rule:
        table["deltanet_prefill"] = partial(_fused.deltanet_prefill_reference, chunk_rule=table["chunk_gated_delta_rule"])
    if "deltanet_decode" not in implementations and (
        table["causal_conv1d_step"] is not _conv.causal_conv1d_step
        or table["recurrent_gated_delta_rule_step"] is not _rule.recurrent_gated_delta_rule_step
    ):
        table["deltanet_decode"] = partial(
            _fused.deltanet_decode_reference, conv_step=table["causal_conv1d_step"],
            rule_step=table["recurrent_gated_delta_rule_step"],
        )
    if "deltanet_verify" not in implementations and table["deltanet_decode"] is not _fused.deltanet_decode_reference:
        # verify is decode steps: a backend's own decode (or the seam over its unfused steps) answers it
        table["deltanet_verify"] = partial(_fused.deltanet_verify_reference, decode=table["deltanet_decode"])
    _BACKENDS[name] = table


def unregister_backend(name: str) -> None:
    """Remove a backend (not "torch"); the process-wide choice goes back to "torch" if it was this one."""
    global _active
    if name == "torch":
        raise ValueError("the 'torch' backend (the references) cannot be removed")
    _BACKENDS.pop(name, None)
    if _active == name:
        _active = "torch"


def set_backend(name: str) -> None:
    """The process-wide backend: what models whose layer factory names none call."""
    global _active
    if name not in _BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; registered: {sorted(_BACKENDS)}")
    _active = name


def get_backend() -> str:
    return _active


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def resolve(backend: str | None) -> str:
    """The backend a call runs on: the one named, or (None) the process-wide one."""
    name = _active if backend is None else backend
    if name not in _BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; registered: {sorted(_BACKENDS)}")
    return name


def implementation(entry: str, backend: str | None) -> Callable:
    """The function answering `entry` in `backend` (None: the process-wide one)."""
    return _BACKENDS[resolve(backend)][entry]


register_backend("torch", {})
# The PyTorch references in the form the Neuron compilers take, which the Neuron layer factories name (NxD:
# `adapter.kernel_backend`; TorchNeuron: `TorchNeuronLayers`): the same seams with the DeltaNet gate's softplus written
# from exp / log (`fused.softplus`; torch-xla lowers F.softplus to log-plus-one, outside neuronx-cc's operator list).
# Everywhere else the gates take F.softplus, whose fp32 error against float64 is half as large on a fast-decaying head
# (issue 50).
FOR_NEURON = "torch_for_neuron"
_neuron_decode = partial(_fused.deltanet_decode_reference, softplus=_fused.softplus)
register_backend(FOR_NEURON, {
    "deltanet_prefill": partial(_fused.deltanet_prefill_reference, softplus=_fused.softplus),
    "deltanet_decode": _neuron_decode,
    "deltanet_verify": partial(_fused.deltanet_verify_reference, decode=_neuron_decode),
})
# The NKI kernels behind the fused seams (the unfused entry points stay the references'). Where the real `nki`
# package is importable (NKI >= 0.3, Neuron SDK 2.29+; see nki_import) they are `nki.jit` launches on the tensors as
# given: inside the Neuron graphs, torch-xla tensors, where the Neuron model builder selects this backend on request
# on trn2 and later (`neuron.glue.kernel_backend`). Elsewhere they run on the CPU NKI emulator (`set_backend("nki")`,
# or `TorchLayers(kernel_backend="nki")`).
register_backend("nki", {"deltanet_prefill": _fused.deltanet_prefill_nki, "deltanet_decode": _fused.deltanet_decode_nki,
                         "deltanet_verify": _fused.deltanet_verify_nki})
