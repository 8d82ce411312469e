"""An export's `neuron_config.json`, read and written without optimum-neuron, in the format optimum-neuron writes.

The file is a plain optimum-neuron `NxDNeuronConfig` (`to_dict`: its fields, `_serialized_key`, the versions), whatever
the target: optimum-neuron 0.4.5 can read back only its own registered config classes, so this package keeps to that
class's fields. The compilation target is its `target` field: "trn1" (also for inf2) or "trn2" for Neuron, "cpu" for
this project's own graphs; a TorchNeuron export (trn2, compiled on the device at first load) also records
`export_backend: "torchneuron"`.

Two stacks write it (docs/torchneuron_stack.md):
- the NxD stack (optimum-neuron installed): `optimum_neuron/neuron_config.py` builds optimum-neuron's own
  `NxDNeuronConfig`, and an NxD export is written by optimum-neuron itself;
- the TorchNeuron stack (no optimum-neuron): `ExportNeuronConfig` here, with NxDNeuronConfig's fields and defaults,
  and `optimum_neuron_version: null` (no optimum-neuron made it).

`neuronxcc_version` is null for the cpu target and for TorchNeuron exports (no neuronx-cc compiled them at export).
Reading (`read_fields`) checks what optimum-neuron checks where it matters: an NxD export (model.pt) needs the
optimum-neuron and neuronx-cc that compiled it; a cpu or TorchNeuron export does not depend on optimum-neuron's
runtime, so one written without optimum-neuron (version null) loads on both stacks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from optimum_qwen35.errors import IncompatibleExportError, UsageError
from optimum_qwen35.export.layout import BACKEND_KEY, NEURON_CONFIG_FILE, TORCHNEURON_BACKEND, export_backend
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


# On the TorchNeuron stack, the exact module that writes the cpu/TorchNeuron metadata (see the module docstring).
NEEDS_NXD_STACK = (
    "{folder} is an NxD export (optimum-neuron's model.pt, compiled by neuronx-cc {compiler}), which loads only on "
    "the NxD stack: Python 3.10-3.11 with optimum-neuron 0.4.5 and the Neuron SDK (`pip install \"optimum-qwen35[optimum]\"` "
    "and `[neuronx]`); on this stack export the model again for trn2 (TorchNeuron) or cpu"
)


class ExportNeuronConfig:
    """The fields of optimum-neuron 0.4.5's `NxDNeuronConfig` that a Qwen3.5 export sets, with that class's defaults for
    the rest: what `neuron_config.json` holds and what this package reads from it, on a stack without optimum-neuron."""

    def __init__(self, checkpoint_id=None, checkpoint_revision=None, batch_size=1, max_batch_size=None,
                 continuous_batching=False, speculation_length=0, sequence_length=128, max_context_length=None,
                 n_active_tokens=None, tp_degree=1, ep_degree=1, pp_degree=1, torch_dtype=torch.bfloat16,
                 output_logits=False, fused_qkv=False, target=None, on_device_sampling=False, max_topk=256,
                 start_rank_id=0, local_ranks_size=None, capacity_factor=None, glu_mlp=True):
        self.checkpoint_id = checkpoint_id
        self.checkpoint_revision = checkpoint_revision
        self.batch_size = batch_size
        self.max_batch_size = batch_size if max_batch_size is None else max_batch_size
        self.continuous_batching = continuous_batching
        self.speculation_length = speculation_length
        self.sequence_length = sequence_length
        self.max_context_length = sequence_length if max_context_length is None else max_context_length
        self.n_active_tokens = self.max_context_length if n_active_tokens is None else n_active_tokens
        self.tp_degree = tp_degree
        self.ep_degree = ep_degree
        self.pp_degree = pp_degree
        self.torch_dtype = normalize_dtype(torch_dtype)
        self.output_logits = output_logits
        self.fused_qkv = fused_qkv
        self.target = target
        self.on_device_sampling = on_device_sampling
        self.max_topk = max_topk
        self.start_rank_id = start_rank_id
        self.local_ranks_size = tp_degree if local_ranks_size is None else local_ranks_size
        self.capacity_factor = capacity_factor
        self.glu_mlp = glu_mlp

    def __repr__(self) -> str:
        return f"ExportNeuronConfig({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


def neuron_config_fields(checkpoint_id, checkpoint_revision, target, batch_size, sequence_length, tp_degree, dtype) -> dict:
    """The fields a Qwen3.5 export sets, checked, for any target (the cpu one and the Neuron ones alike)."""
    if tp_degree == 0 and normalize_target(target) != CPU_TARGET:
        # optimum-neuron's get_neuron_config counts the machine's Neuron cores when no degree is given.
        raise UsageError(
            f"no Neuron cores found on this machine to size target {target!r} (tensor_parallel_size=0): pass "
            "tensor_parallel_size, or export for this machine with instance_type='cpu'"
        )
    check_shape(batch_size, sequence_length, tp_degree)
    return dict(
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


def export_neuron_config(*args) -> ExportNeuronConfig:
    """`neuron_config_fields` as this package's own config object (the stack without optimum-neuron)."""
    return ExportNeuronConfig(**neuron_config_fields(*args))


def neuronxcc_version() -> str | None:
    """The installed neuronx-cc version, or None without the Neuron SDK."""
    try:
        import neuronxcc  # optional dependency: optimum-neuron (the `optimum` extra) or the Neuron SDK
    except ImportError:
        return None
    return getattr(neuronxcc, "__version__", None)


def optimum_neuron_version() -> str | None:
    """The installed optimum-neuron's version, or None (the TorchNeuron stack). Read from the package metadata:
    importing optimum.neuron is slow and probes for a device."""
    from importlib.metadata import PackageNotFoundError, version  # start-up time: read on use

    try:
        return version("optimum-neuron")
    except PackageNotFoundError:
        return None


def _jsonable(value):
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return value


def to_dict(neuron_config, backend: str | None = None) -> dict:
    """The dict optimum-neuron writes for this config (`NeuronConfig.to_dict`); `neuronxcc_version` is null
    for the cpu target, which has no compiler, and for a TorchNeuron export (`backend="torchneuron"`), compiled on
    the device at first load, which also records its backend (`export_backend`). An NxD export's is optimum-neuron's
    own (its config object's `to_dict`)."""
    if neuron_config.target != CPU_TARGET and backend != TORCHNEURON_BACKEND:
        if isinstance(neuron_config, ExportNeuronConfig):
            raise UsageError(f"a {neuron_config.target} export without optimum-neuron is a TorchNeuron one: pass backend='torchneuron'")
        return neuron_config.to_dict()
    out = {k: _jsonable(v) for k, v in vars(neuron_config).items()}
    out["_serialized_key"] = "NxDNeuronConfig"
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


def read_fields(folder: str | os.PathLike) -> dict:
    """Read and check `neuron_config.json`: the NxDNeuronConfig fields (without the versions, `_serialized_key` and
    `export_backend`), for an export this stack can load: an NxD export needs the optimum-neuron and neuronx-cc that
    compiled it; a cpu or TorchNeuron export needs the optimum-neuron version that wrote it only where both are
    known (one written without optimum-neuron loads on both stacks)."""
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
    backend = data.get(BACKEND_KEY)
    if backend not in (None, TORCHNEURON_BACKEND):
        raise IncompatibleExportError(f"{path} names export_backend {backend!r}, which this version does not know: export the model again")
    kind = export_backend(data)
    data.pop(BACKEND_KEY, None)  # (not an NxDNeuronConfig field; export/layout.py `export_backend` reads it)
    exported_with, installed = data.pop("optimum_neuron_version", None), optimum_neuron_version()
    compiler = data.pop("neuronxcc_version", None)
    _check_fields(data, path)
    if kind == "nxd" and installed is None:
        raise IncompatibleExportError(NEEDS_NXD_STACK.format(folder=Path(folder), compiler=compiler))
    if exported_with is not None and installed is not None and exported_with != installed:
        raise IncompatibleExportError(
            f"{Path(folder)} was exported with optimum-neuron {exported_with}, but {installed} is installed: "
            f"install optimum-neuron=={exported_with} or export the model again"
        )
    if kind == "nxd" and compiler != neuronxcc_version():
        raise IncompatibleExportError(
            f"{Path(folder)} was compiled for {data.get('target')} by neuronx-cc {compiler}, but "
            f"{neuronxcc_version() or 'no neuronx-cc'} is installed: load it on a Neuron instance with "
            f"neuronx-cc {compiler}, or export the model again for this machine (`--target cpu` without Neuron)"
        )
    return data


def load(folder: str | os.PathLike, config_class=ExportNeuronConfig):
    """`read_fields` as a config object: this package's own, or optimum-neuron's NxDNeuronConfig
    (optimum_neuron/neuron_config.py `load`)."""
    data = read_fields(folder)
    try:
        return config_class(**data)
    except TypeError as error:
        path = Path(folder) / NEURON_CONFIG_FILE
        raise IncompatibleExportError(f"{path} has fields this version does not know ({error}); export the model again") from error


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
