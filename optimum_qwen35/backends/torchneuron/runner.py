"""The graph runner of a TorchNeuron export: the decoder's graph modules compiled with `torch.compile`, one per entry
of the export's graphs.json, with the weights and the state on the device.

TorchNeuron's documented use (docs/torchneuron.md): `import torch_neuronx` registers the `neuron` device, the
"neuron" `torch.compile` backend and the "neuron" process-group backend; a module moved to the device and compiled
with `backend="neuron", fullgraph=True, dynamic=False` is traced by Dynamo once per input signature, lowered through
torch-mlir to StableHLO and compiled by neuronx-cc into a NEFF, cached on disk (TORCH_NEURONX_NEFF_CACHE_DIR). Every
graph here has static shapes (one module per bucket), so each compiles once, on its first call.

`compile_backend` and `device` are the caller's: "neuron" on a device; on a machine without TorchNeuron "eager" (or
any `torch.compile` backend, e.g. the StableHLO check of tests/torchneuron) with device "cpu" runs the very same
graph modules through Dynamo on the CPU. Nothing of TorchNeuron is imported here: `load_runtime` imports it only when
the device or the backend is "neuron".
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch._dynamo
from safetensors.torch import load_file

from optimum_qwen35.checkpoint.fp8 import E4M3FN_AS_E4M3_FLAG
from optimum_qwen35.config import Qwen35Config
from optimum_qwen35.errors import IncompatibleExportError, UsageError
from optimum_qwen35.export.layout import CHECKPOINT_DIR, TORCHNEURON_BACKEND, vision_graph_name
from optimum_qwen35.modeling.decoder import (
    ContextEncodingGraph,
    ImageContextEncodingGraph,
    ImageTokenGenerationGraph,
    TokenGenerationGraph,
)
from optimum_qwen35.modeling.speculative_graphs import CommitGraph, ContextHiddenGraph, MTPGraph, VerifyGraph
from optimum_qwen35.modeling.state import allocate_state
from optimum_qwen35.modeling.vision import VisionConfig, VisionEncoder
from optimum_qwen35.backends.torchneuron.device import import_torchneuron
from optimum_qwen35.backends.torchneuron.layers import TorchNeuronLayers
from optimum_qwen35.runtime.eager import load_decoder
from optimum_qwen35.runtime.exported import (
    ProgramRunner,
    SpeculativePrograms,
    manifest_state_specs,
    read_graphs_manifest,
    slots_restored,
)
from optimum_qwen35.runtime.host_loop import Qwen35Runtime
from optimum_qwen35.runtime.prefix_cache import StateInProcess
from optimum_qwen35.runtime.worker_pool import WorkerPool

# How a worker process of the tensor-parallel pool builds this runner (runtime/worker_pool.py `rank_runner`).
RUNNER = "optimum_qwen35.backends.torchneuron.runner:TorchNeuronGraphs"


def _allow_one_entry_per_graph(count: int) -> None:
    """Every bucket of a graph kind is another compiled entry of the same code object (`ContextEncodingGraph.forward`,
    ...). Above Dynamo's recompile limit (8 per code object) Dynamo stops compiling and runs the module eagerly: on a
    device that is every op dispatched alone, silently. Raise the limits to the export's graph count, and fail rather
    than fall back if they are still hit."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, count)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * count)
    config.fail_on_recompile_limit_hit = True


class StateInPlaceGraph(torch.nn.Module):
    """A graph module whose last `state_count` inputs are its state, written in place, and whose last `state_count`
    outputs are those same tensors: returns the other outputs only. Compiled, each state is an input mutation (an
    alias of the input, updated in its buffer) and not also a graph output (a second copy of every cache out of the
    graph). The caller keeps its state tensors."""

    def __init__(self, graph: torch.nn.Module, state_count: int):
        super().__init__()
        self.graph, self.state_count = graph, state_count

    def forward(self, *args):
        out = self.graph(*args)
        return tuple(out[: len(out) - self.state_count])


def check_manifest(manifest: dict, folder) -> None:
    if manifest.get("backend") != TORCHNEURON_BACKEND:
        raise IncompatibleExportError(
            f"{folder} is not a TorchNeuron export (its graphs.json names backend {manifest.get('backend', 'cpu')!r}): "
            "load it with from_pretrained, which picks its runner"
        )


class TorchNeuronGraphs(StateInProcess, SpeculativePrograms, ProgramRunner):
    """One rank's decoder, its graph modules compiled on first use, its weights and its state on `device`.

    Answers the host loop's calls by program name, as a cpu export's runner does (`ProgramRunner`): the graphs.json
    entries name each graph's kind, bucket and key length; the modules are the decoder's own graphs
    (modeling/decoder.py), and in an export made with mtp=True the speculative-decoding graphs over the decoder with
    its multi-token-prediction head (modeling/speculative_graphs.py; `SpeculativePrograms` drives them). Inputs move
    to the device, logits come back to the host."""

    def __init__(self, folder: str | os.PathLike, rank: int = 0, manifest: dict | None = None,
                 compile_backend="neuron", device: str | torch.device = "neuron"):
        self.folder = Path(folder)
        self.manifest = manifest or read_graphs_manifest(folder)
        check_manifest(self.manifest, folder)
        self.rank, self.device, self.compile_backend = rank, torch.device(device), compile_backend
        tp_degree = self.manifest["tp_degree"]
        dtype = getattr(torch, self.manifest["dtype"])
        # The collectives name the process group the export was built for (the world group of the ranks).
        layers = TorchNeuronLayers(tp_degree, rank, group=self.manifest["group_name"] if tp_degree > 1 else None)
        self.decoder = load_decoder(self.folder / CHECKPOINT_DIR, dtype, tp_degree, rank, layers=layers,
                                    mtp=self.has_mtp).to(self.device)
        self.state_specs = manifest_state_specs(self.manifest["state"])
        self.state = allocate_state(self.state_specs, self.device)
        self.mtp_state = []  # the MTP head's K/V cache (an export made with mtp=True)
        if self.has_mtp:
            self.mtp_state = allocate_state(manifest_state_specs(self.manifest["mtp"]["state"]), self.device)
        self.vision_encoder = None
        if "vision" in self.manifest:
            self.vision_encoder = self._load_vision_encoder(dtype)
        self._compiled: dict[str, torch.nn.Module] = {}
        _allow_one_entry_per_graph(len(self.manifest["graphs"]))

    def _load_vision_encoder(self, dtype: torch.dtype) -> VisionEncoder:
        vision = VisionConfig.from_dict(self.config_of(self.folder).raw)
        file = self.folder / CHECKPOINT_DIR / self.manifest["vision"]["file"]
        if vision is None or not file.is_file():
            raise IncompatibleExportError(f"{self.folder}: a vision export without its tower's config or {file.name}: export it again")
        with torch.device("meta"):
            encoder = VisionEncoder(vision, layers=TorchNeuronLayers(1))
        result = encoder.load_state_dict(load_file(os.fspath(file)), strict=False, assign=True)
        if result.missing_keys or result.unexpected_keys:
            raise IncompatibleExportError(f"{file} does not match the vision tower: export the model again")
        return encoder.to(dtype).eval().to(self.device)

    def _module(self, name: str) -> torch.nn.Module:
        entry = self.manifest["graphs"].get(name)
        if entry is None:
            raise IncompatibleExportError(f"this export has no graph {name!r}; it has {sorted(self.manifest['graphs'])}")
        kind, length = entry["kind"], entry["length"]
        if kind in ("context", "logits"):
            return ContextEncodingGraph(self.decoder, all_logits=kind == "logits", key_length=entry.get("key_length"))
        if kind == "token":
            return TokenGenerationGraph(self.decoder, length)
        if kind == "image_context":
            return ImageContextEncodingGraph(self.decoder)
        if kind == "image_token":
            return ImageTokenGenerationGraph(self.decoder, length)
        if kind == "vision":
            return self.vision_encoder
        if kind == "context_hidden":
            return ContextHiddenGraph(self.decoder)
        if kind == "verify":
            return VerifyGraph(self.decoder, entry["key_length"])
        if kind == "commit":
            return CommitGraph(self.decoder)
        if kind == "mtp":
            return MTPGraph(self.decoder, entry["key_length"])
        raise IncompatibleExportError(f"graph {name!r} is of kind {kind!r}, which this version cannot run: export again")

    def program(self, name: str) -> torch.nn.Module:
        """Graph `name`, compiled on its first call (TorchNeuron: traced, lowered, compiled to a NEFF or taken
        from the compile cache)."""
        if name not in self._compiled:
            kind = self.manifest["graphs"].get(name, {}).get("kind")
            module = self._module(name)
            if kind != "vision":  # the state outputs left to the in-place writes (the vision tower has no state)
                module = StateInPlaceGraph(module, len(self.mtp_state if kind == "mtp" else self.state))
            self._compiled[name] = torch.compile(module, backend=self.compile_backend, fullgraph=True, dynamic=False)
        return self._compiled[name]

    def _to_device(self, inputs) -> list[torch.Tensor]:
        return [t.to(self.device) for t in inputs]

    @torch.no_grad()
    def run(self, name: str, *inputs: torch.Tensor, restore: list[int] | None = None) -> torch.Tensor:
        """Run graph `name` on `inputs`, updating this rank's state in place; returns the logits on the host.
        `restore`: slots whose state is put back as it was before the call (a scoring pass borrows them)."""
        with slots_restored(self.state, restore):
            return self.program(name)(*self._to_device(inputs), *self.state)[0].to("cpu")

    @torch.no_grad()
    def call(self, name: str, *inputs: torch.Tensor, state: list[torch.Tensor]) -> tuple:
        """A speculative-decoding graph (graphs.json "mtp"): all its outputs, on the device; `state` updated in place
        (and given back after the graph's own outputs, as the other runners' graphs return it)."""
        return (*self.program(name)(*self._to_device(inputs), *state), *state)

    @torch.no_grad()
    def vision(self, bucket: int, *inputs: torch.Tensor) -> torch.Tensor:
        return self.program(vision_graph_name(bucket))(*self._to_device(inputs)).to("cpu")

    def take_block(self, slot: int, start: int, end: int) -> list[torch.Tensor]:
        """A prefix cache's snapshot of one slot, brought to the host (the cache holds host memory)."""
        return [t.to("cpu") for t in super().take_block(slot, start, end)]

    def restore_blocks(self, slot: int, snapshots: list[list[torch.Tensor]], block_size: int) -> None:
        super().restore_blocks(slot, [[t.to(self.device) for t in snapshot] for snapshot in snapshots], block_size)

    def close(self) -> None:
        self._compiled.clear()


def read_float8_as_trn2_e4m3() -> None:
    """Hand neuronx-cc the flag that reads the export's float8_e4m3fn weights as trn2's float8_e4m3 (exact: they are
    fitted to its range at export), which trn2 otherwise refuses (NCC_EVRF051). Through NEURON_CC_FLAGS, torch-neuronx's
    documented variable for compiler flags (documented for its XLA path: the native backend's reference names no
    compiler-flag variable, so whether it reads this one is not known here; docs/fp8.md). Set before torch-neuronx is
    imported and the workers start, which inherit it."""
    flags = os.environ.get("NEURON_CC_FLAGS", "")
    if E4M3FN_AS_E4M3_FLAG not in flags.split():
        os.environ["NEURON_CC_FLAGS"] = f"{flags} {E4M3FN_AS_E4M3_FLAG}".strip()


def load_runtime(folder: str | os.PathLike, compile_backend="neuron", device: str | torch.device = "neuron") -> Qwen35Runtime:
    """The host loop over a TorchNeuron export: one rank in this process, or one worker process per rank (the "neuron"
    process-group backend on the device, gloo on the CPU). `compile_backend`: "neuron" (TorchNeuron) or another
    `torch.compile` backend ("eager" runs the graphs on the CPU); a backend object runs at tensor_parallel_size 1
    only (the workers take its name)."""
    manifest = read_graphs_manifest(folder)
    check_manifest(manifest, folder)
    # By name: torch.device("neuron") itself fails until torch-neuronx has registered the device.
    on_device = compile_backend == "neuron" or str(device).partition(":")[0] == "neuron"
    if on_device:
        if manifest.get("weights_dtype") == "fp8":
            read_float8_as_trn2_e4m3()
        import_torchneuron()  # registers the device and the backends; a one-line error without TorchNeuron
    tp_degree = manifest["tp_degree"]
    if tp_degree == 1:
        graphs = TorchNeuronGraphs(folder, 0, manifest, compile_backend, device)
    else:
        if not isinstance(compile_backend, str):
            raise UsageError(
                f"tensor_parallel_size {tp_degree}: compile_backend must be a backend's name (the worker processes "
                f"look it up), got {type(compile_backend).__name__}"
            )
        graphs = WorkerPool(folder, tp_degree, manifest, runner=RUNNER, dist_backend="neuron" if on_device else "gloo",
                            options={"compile_backend": compile_backend, "device": str(device)})
    return Qwen35Runtime.from_export(folder, graphs)
