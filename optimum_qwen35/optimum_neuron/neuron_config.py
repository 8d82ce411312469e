"""The export's `neuron_config.json`: a plain optimum-neuron `NxDNeuronConfig`, whatever the target.

optimum-neuron 0.4.5 can only read back its own registered config classes (a subclass fails its
serialized-key assertion), so an export records a plain `NxDNeuronConfig`; the compilation target is its
`target` field: "trn1" (also for inf2) or "trn2" for Neuron, "cpu" for this project's own graphs.

optimum-neuron serializes the config with the installed neuronx-cc version, which the cpu target does
not have: for it the same dict is written with `neuronxcc_version: null` (see `to_dict`), and read back
with the checks optimum-neuron makes (same optimum-neuron version, same compiler where there is one). A TorchNeuron
export (trn2, compiled on the device at first load) is written the same way, with `export_backend: "torchneuron"`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from optimum_qwen35.errors import IncompatibleExportError, UsageError
from optimum_qwen35.export.layout import BACKEND_KEY, NEURON_CONFIG_FILE, TORCHNEURON_BACKEND
from optimum_qwen35.validation import parse_dtype

CPU_TARGET = "cpu"
# optimum-neuron's instance types, and the compilation target each one means.
NEURON_TARGETS = {"trn1": "trn1", "trn1n": "trn1", "inf2": "trn1", "trn2": "trn2"}
TARGETS = (CPU_TARGET, *NEURON_TARGETS)
COMPILED_DTYPES = (torch.float32, torch.bfloat16)


def normalize_target(target: str) -> str:
    """"cpu", or optimum-neuron's compilation target ("trn1" for trn1/trn1n/inf2, "trn2")."""
    if target == CPU_TARGET:
        return target
    if target not in NEURON_TARGETS:
        raise UsageError(f"unknown target {target!r}: choose one of {', '.join(TARGETS)}")
    return NEURON_TARGETS[target]


def normalize_dtype(dtype) -> torch.dtype:
    """A torch dtype from a torch dtype or its usual name (`validation.parse_dtype`); only float32 and bfloat16
    are compiled."""
    try:
        parsed = parse_dtype(dtype)
    except UsageError:
        parsed = None
    if parsed not in COMPILED_DTYPES:
        raise UsageError(f"dtype {dtype!r} is not supported: use bfloat16 or float32")
    return parsed


def check_shape(batch_size, sequence_length, tensor_parallel_size) -> None:
    """The three sizes of an export: positive integers (a bool, a float or a string is refused)."""
    for name, value in (("batch_size", batch_size), ("sequence_length", sequence_length), ("tensor_parallel_size", tensor_parallel_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{name} must be a positive integer, got {value!r}")


def nxd_neuron_config(checkpoint_id, checkpoint_revision, target, batch_size, sequence_length, tp_degree, dtype):
    """The `NxDNeuronConfig` of a Qwen3.5 export, for any target (the cpu one and the Neuron ones alike)."""
    from optimum.neuron.models.inference.backend.config import NxDNeuronConfig  # optional dependency: optimum-neuron (the `optimum` extra) or the Neuron SDK

    if tp_degree == 0 and normalize_target(target) != CPU_TARGET:
        # optimum-neuron's get_neuron_config counts the machine's Neuron cores when no degree is given.
        raise UsageError(
            f"no Neuron cores found on this machine to size target {target!r} (tensor_parallel_size=0): pass "
            "tensor_parallel_size, or export for this machine with instance_type='cpu'"
        )
    check_shape(batch_size, sequence_length, tp_degree)

    return NxDNeuronConfig(
        checkpoint_id=checkpoint_id,
        checkpoint_revision=checkpoint_revision,
        batch_size=batch_size,
        sequence_length=sequence_length,
        tp_degree=tp_degree,
        torch_dtype=dtype,
        target=normalize_target(target),
        continuous_batching=batch_size > 1,
        # Tokens are chosen on the host, from fp32 logits (greedy or transformers' warpers).
        on_device_sampling=False,
        speculation_length=0,
    )


def neuronxcc_version() -> str | None:
    """The installed neuronx-cc version, or None without the Neuron SDK."""
    try:
        import neuronxcc  # optional dependency: optimum-neuron (the `optimum` extra) or the Neuron SDK
    except ImportError:
        return None
    return getattr(neuronxcc, "__version__", None)


def optimum_neuron_version() -> str:
    from optimum.neuron.version import __version__  # optional dependency: optimum-neuron (the `optimum` extra) or the Neuron SDK

    return __version__


def _jsonable(value):
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return value


def to_dict(neuron_config, backend: str | None = None) -> dict:
    """The dict optimum-neuron writes for this config (`NeuronConfig.to_dict`); `neuronxcc_version` is null
    for the cpu target, which has no compiler, and for a TorchNeuron export (`backend="torchneuron"`), compiled on
    the device at first load, which also records its backend (`export_backend`)."""
    if neuron_config.target != CPU_TARGET and backend != TORCHNEURON_BACKEND:
        return neuron_config.to_dict()
    out = {k: _jsonable(v) for k, v in vars(neuron_config).items()}
    out["_serialized_key"] = type(neuron_config).__name__
    out["optimum_neuron_version"] = optimum_neuron_version()
    out["neuronxcc_version"] = None
    if backend == TORCHNEURON_BACKEND:
        out[BACKEND_KEY] = TORCHNEURON_BACKEND
    return out


def save(neuron_config, folder: str | os.PathLike, backend: str | None = None) -> None:
    path = Path(folder) / NEURON_CONFIG_FILE
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(to_dict(neuron_config, backend), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def load(folder: str | os.PathLike):
    """Read and check `neuron_config.json`: a plain NxDNeuronConfig written by this optimum-neuron version
    (and, for a Neuron target, by the installed neuronx-cc)."""
    from optimum.neuron.models.inference.backend.config import NxDNeuronConfig  # optional dependency: optimum-neuron (the `optimum` extra) or the Neuron SDK

    path = Path(folder) / NEURON_CONFIG_FILE
    if not path.is_file():
        raise IncompatibleExportError(
            f"{Path(folder)} has no {NEURON_CONFIG_FILE}: it is not an exported model (export it with "
            "`optimum-qwen35 export` or `optimum-cli export neuron`)"
        )
    try:
        data = json.loads(path.read_text())
    except ValueError as error:
        raise IncompatibleExportError(f"{path} is not valid JSON ({error}); export the model again") from error
    if not isinstance(data, dict):
        raise IncompatibleExportError(
            f"{path} holds a JSON {type(data).__name__}, not an object of neuron config fields; export the model again"
        )
    key = data.pop("_serialized_key", None)
    if key != "NxDNeuronConfig":
        raise IncompatibleExportError(f"{path} holds a {key!r} config, not an NxDNeuronConfig: it is not a decoder export")
    exported_with, installed = data.pop("optimum_neuron_version", None), optimum_neuron_version()
    if exported_with != installed:
        raise IncompatibleExportError(
            f"{Path(folder)} was exported with optimum-neuron {exported_with}, but {installed} is installed: "
            f"install optimum-neuron=={exported_with} or export the model again"
        )
    compiler = data.pop("neuronxcc_version", None)
    backend = data.pop(BACKEND_KEY, None)  # (not an NxDNeuronConfig field; export/layout.py `export_backend` reads it)
    if backend not in (None, TORCHNEURON_BACKEND):
        raise IncompatibleExportError(f"{path} names export_backend {backend!r}, which this version does not know: export the model again")
    _check_fields(data, path)
    target = data.get("target")
    if target != CPU_TARGET and backend is None and compiler != neuronxcc_version():
        raise IncompatibleExportError(
            f"{Path(folder)} was compiled for {target} by neuronx-cc {compiler}, but "
            f"{neuronxcc_version() or 'no neuronx-cc'} is installed: load it on a Neuron instance with "
            f"neuronx-cc {compiler}, or export the model again for this machine (`--target cpu` without Neuron)"
        )
    try:
        return NxDNeuronConfig(**data)
    except TypeError as error:
        raise IncompatibleExportError(f"{path} has fields this optimum-neuron does not know ({error}); export the model again") from error


def _check_fields(data: dict, path: Path) -> None:
    """The fields this package reads, with the types optimum-neuron writes: a hand-edited or foreign file is refused
    here with one line, not later with a message that cannot tell "2" from 2."""
    target = data.get("target")
    if target not in (CPU_TARGET, *sorted(set(NEURON_TARGETS.values()))):
        raise IncompatibleExportError(
            f"{path} names target {target!r}, which is not one of cpu, trn1, trn2: export the model again "
            "(`--target cpu`, or a Neuron target on a Neuron instance)"
        )
    for name in ("batch_size", "sequence_length", "tp_degree"):
        value = data.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise IncompatibleExportError(
                f"{path}: {name} is {value!r} ({type(value).__name__}), not a positive integer: export the model again"
            )
    dtype = data.get("torch_dtype")
    if dtype not in [str(d).removeprefix("torch.") for d in COMPILED_DTYPES]:
        raise IncompatibleExportError(
            f"{path}: torch_dtype is {dtype!r}, not one of float32, bfloat16: export the model again"
        )


def check_expected(neuron_config, folder, given_as: dict | None = None, **expected) -> None:
    """Fail with one line if the export was compiled for something other than what the caller expects.

    `given_as` maps a checked name to the keyword the caller used for it (e.g. dtype <- torch_dtype), for the message."""
    actual = {
        "target": neuron_config.target,
        "batch_size": neuron_config.batch_size,
        "sequence_length": neuron_config.sequence_length,
        "tensor_parallel_size": neuron_config.tp_degree,
        "dtype": neuron_config.torch_dtype,
    }
    for name, want in expected.items():
        if want is None:
            continue
        if name == "target":
            want = normalize_target(want)
        elif name == "dtype":
            want = parse_dtype(want, (given_as or {}).get(name, name))
        if actual[name] != want:
            keyword = (given_as or {}).get(name, name)
            raise IncompatibleExportError(
                f"{folder} was exported for {name}={_jsonable(actual[name])}, not {_jsonable(want)}: "
                f"pass {keyword}={_jsonable(actual[name])!r} (or leave {keyword}= out), or export the model again with "
                f"{name}={_jsonable(want)}"
            )
