"""The cpu target's compiled graphs: `torch.export` programs, saved once and loaded without re-tracing.

An export for the cpu target holds, beside its configs and tokenizer:

    compiled/graphs.json                 what was compiled (sizes, buckets, dtype, weight and state order)
    compiled/context_encoding_<T>.pt2    one program per context-encoding bucket T
    compiled/context_logits_<T>.pt2      the same, returning the logits of every position (for `forward`)
    compiled/token_generation_<L>.pt2    one token-generation program per cache bucket L (attends to L positions)
    checkpoint/rank_<r>.safetensors      each rank's weights (`checkpoint.shard.save_sharded`)

and, in a vision export (`compile_graphs(..., vision=...)`, tensor_parallel_size 1):

    compiled/vision_<N>.pt2                    the vision tower, one program per image bucket of N patch rows
    compiled/image_context_encoding_<T>.pt2    context encoding of prompts holding images (runtime/vision.py)
    compiled/image_token_generation_<L>.pt2    decode steps after them (rotary position = position + rope delta)
    checkpoint/vision.safetensors              the vision tower's weights (converted: modeling/vision.py)

Each program is exported once, on the meta device, and serves every rank (SPMD, as one Neuron graph
serves every core): the weights and the state are program inputs, not constants, so a program holds no
weights (one copy of them, in `checkpoint/`, shared by every graph) and the rank is a weight tensor
(`embed_tokens.rank`). The programs update the state inputs in place (`torch.export` keeps the
`index_put_` / `index_copy_` on the inputs), so a decode step writes one K/V row per slot, not whole caches. Collectives are `_c10d_functional` ops named by process group, which
`torch.export` records as graph ops.

Why `torch.export` rather than TorchScript: TorchScript tracing cannot record a torch.distributed
collective (the process group is not traceable), so a tensor-parallel graph could not be saved;
`torch.export` records the functional collectives, refuses data-dependent Python control flow (the
graphs are proven static, as neuronx-cc needs them) and is the format PyTorch maintains.

`CompiledGraphs` runs one rank's programs in this process (with its weights and its state list);
`TensorParallelGraphs` runs t ranks in t worker processes (gloo), the state staying in the workers as it
stays on the device on Neuron.
"""

from __future__ import annotations

import bisect
import json
import os
import pickle
import threading
import traceback
from pathlib import Path

import torch
from torch import nn

from optimum_qwen35.config import Qwen35Config
from optimum_qwen35 import validation
from optimum_qwen35.errors import IncompatibleExportError, Qwen35Error, UsageError
from optimum_qwen35.modeling.decoder import (
    ContextEncodingGraph,
    ImageContextEncodingGraph,
    ImageTokenGenerationGraph,
    Qwen35Decoder,
    TokenGenerationGraph,
)
from optimum_qwen35.modeling.parallel import TorchLayers
from optimum_qwen35.modeling.precision import to_model_dtype
from optimum_qwen35.modeling.state import StateSpec, allocate_state
from optimum_qwen35.runtime.cpu import Qwen35ForCausalLM, rank_tensors
from optimum_qwen35.runtime.vision import ImageInputs

COMPILED_DIR = "compiled"
CHECKPOINT_DIR = "checkpoint"
GRAPHS_FILE = "graphs.json"
GRAPHS_FORMAT = "optimum-qwen35-cpu-graphs"
GRAPHS_VERSION = 2  # 2: state updated in place, token-generation buckets
# The process group the programs' collectives name: the default (world) group of the worker processes.
GROUP_NAME = "0"


def context_graph_name(length: int) -> str:
    return f"context_encoding_{length}"


def logits_graph_name(length: int) -> str:
    return f"context_logits_{length}"


def token_graph_name(key_length: int) -> str:
    return f"token_generation_{key_length}"


def vision_graph_name(bucket: int) -> str:
    return f"vision_{bucket}"


def image_context_graph_name(length: int) -> str:
    return f"image_context_encoding_{length}"


def image_token_graph_name(key_length: int) -> str:
    return f"image_token_generation_{key_length}"


VISION_WEIGHTS_FILE = "vision.safetensors"


def weight_names(decoder: nn.Module) -> list[str]:
    """The decoder's weight inputs, in program order: parameters (tied ones once), then persistent buffers."""
    persistent = decoder.state_dict(keep_vars=True)
    names = [n for n, _ in decoder.named_parameters()]
    return names + [n for n, _ in decoder.named_buffers() if n in persistent]


class WeightsAsInputs(nn.Module):
    """Runs a graph module with its weights given as the first input, so that the program holds none."""

    def __init__(self, graph: nn.Module, names: list[str], prefix: str = "decoder."):
        super().__init__()
        self._graph = [graph]  # a list, not a submodule: its weights must not become program constants
        self.names, self.prefix = names, prefix

    def forward(self, weights: list[torch.Tensor], *inputs):
        params = {f"{self.prefix}{n}": w for n, w in zip(self.names, weights)}
        return torch.func.functional_call(self._graph[0], params, inputs)


def _shape_only(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor with the shape and dtype of `tensor` and no memory (stride 0): an export example."""
    return torch.zeros((), dtype=tensor.dtype).expand(tensor.shape)


def example_inputs(kind: str, batch_size: int, length: int, specs: list[StateSpec], image_embeds=None) -> tuple[torch.Tensor, ...]:
    """The graphs' inputs after the weights: token ids, (mask,) positions, seq_ids, (the image inputs,) then the state
    (`image_embeds`: (hidden size, dtype) of the image graphs' embeddings)."""
    # Real, contiguous state (the programs write it in place), but never touched: `torch.empty` costs no memory.
    state = [torch.empty(s.shape, dtype=s.dtype) for s in specs]
    seq_ids = torch.arange(batch_size, dtype=torch.int32)
    if kind in ("context", "image_context"):
        ids = torch.zeros(batch_size, length, dtype=torch.int32)
        positions = torch.arange(length, dtype=torch.int32).expand(batch_size, length)
        if kind == "image_context":
            hidden, dtype = image_embeds
            rope = positions[:, None].expand(batch_size, 3, length)
            embeds = torch.zeros(batch_size, length, hidden, dtype=dtype)
            return (ids, torch.ones_like(ids), positions, seq_ids, rope, embeds, torch.zeros_like(ids), *state)
        return (ids, torch.ones_like(ids), positions, seq_ids, *state)
    ids = torch.zeros(batch_size, 1, dtype=torch.int32)
    if kind == "image_token":
        return (ids, torch.zeros_like(ids), seq_ids, torch.zeros_like(ids), *state)
    return (ids, torch.zeros_like(ids), seq_ids, *state)


def compile_graphs(
    config: Qwen35Config,
    tp_degree: int,
    batch_size: int,
    max_length: int,
    buckets: list[int],
    dtype: torch.dtype,
    out_dir: str | os.PathLike,
    progress: bool = True,
    token_buckets: list[int] | None = None,
    logits_buckets: list[int] | None = None,
    vision=None,
    image_buckets: list[int] | None = None,
) -> dict:
    """Export the context-encoding programs (one per bucket), the token-generation programs (one per cache
    bucket; by default the context buckets) and the per-position logits programs (one per bucket of
    `logits_buckets`, by default the context buckets: what `forward()` runs) to `out_dir`. With `vision` (a
    `modeling.vision.VisionConfig`; tp_degree 1), also the vision tower's programs (one per image bucket of
    `image_buckets` patch rows) and the image context-encoding and token-generation programs (same buckets).

    Returns the content of `graphs.json`, written last.
    """
    from tqdm.auto import tqdm  # noqa: PLC0415

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        # Model dtype, except the parameters the precision policy holds in fp32 (as load_sharded returns them).
        decoder = to_model_dtype(Qwen35Decoder(config, tp_degree, TorchLayers(tp_degree, 0, group=GROUP_NAME)), dtype)
    names = weight_names(decoder)
    tensors = {**dict(decoder.named_parameters()), **dict(decoder.named_buffers())}
    weights = [_shape_only(tensors[n]) for n in names]
    specs = decoder.state_specs(batch_size, max_length)
    token_buckets = sorted(set(token_buckets or buckets) | {max_length})
    plan = [(context_graph_name(T), "context", T) for T in buckets]
    plan += [(token_graph_name(L), "token", L) for L in token_buckets]
    logits_buckets = sorted(set(buckets if logits_buckets is None else logits_buckets))
    plan += [(logits_graph_name(T), "logits", T) for T in logits_buckets]
    vision_manifest = None
    if vision is not None:
        from optimum_qwen35.modeling.vision import VisionEncoder, image_bucket_inputs  # noqa: PLC0415

        if tp_degree != 1:
            raise UsageError(f"a vision export needs tensor_parallel_size=1 (got {tp_degree}): the vision graphs are not sharded yet")
        with torch.device("meta"):
            encoder = VisionEncoder(vision).to(dtype)
        vision_names = weight_names(encoder)
        vision_tensors = {**dict(encoder.named_parameters()), **dict(encoder.named_buffers())}
        vision_weights = [_shape_only(vision_tensors[n]) for n in vision_names]
        image_buckets = sorted(set(image_buckets))
        plan += [(vision_graph_name(N), "vision", N) for N in image_buckets]
        plan += [(image_context_graph_name(T), "image_context", T) for T in buckets]
        plan += [(image_token_graph_name(L), "image_token", L) for L in token_buckets]
        vision_manifest = {"image_buckets": image_buckets, "weights": vision_names, "file": VISION_WEIGHTS_FILE}
    graphs = {}
    bar = tqdm(plan, desc="compile (cpu: torch.export)", unit="graph", disable=not progress)
    for name, kind, length in bar:
        bar.set_postfix_str(name)  # the graph being compiled now
        image_embeds = (config.hidden_size, dtype)
        if kind == "vision":
            # Any grid of the bucket's size: the program's shapes are the bucket's, the grid is in the inputs' values.
            grid = (1, vision.spatial_merge_size, length // vision.spatial_merge_size)
            example = image_bucket_inputs(vision, torch.zeros(length, vision.patch_dim), grid, length)
            with torch.no_grad():
                program = torch.export.export(WeightsAsInputs(encoder, vision_names, prefix=""), (vision_weights, *example))
        else:
            if kind in ("context", "logits"):
                graph = ContextEncodingGraph(decoder, all_logits=kind == "logits")
                inputs = example_inputs("context", batch_size, length, specs)
            elif kind == "image_context":
                graph = ImageContextEncodingGraph(decoder)
                inputs = example_inputs(kind, batch_size, length, specs, image_embeds)
            elif kind == "image_token":
                graph, inputs = ImageTokenGenerationGraph(decoder, length), example_inputs(kind, batch_size, 1, specs)
            else:
                graph, inputs = TokenGenerationGraph(decoder, length), example_inputs(kind, batch_size, 1, specs)
            with torch.no_grad():
                program = torch.export.export(WeightsAsInputs(graph, names), (weights, *inputs))
        file = out / f"{name}.pt2"
        tmp = file.with_name(f".{name}.tmp-{os.getpid()}.pt2")  # torch.export wants the .pt2 suffix
        torch.export.save(program, tmp)
        os.replace(tmp, file)
        graphs[name] = {"kind": kind, "length": length, "file": file.name}
    manifest = {
        "format": GRAPHS_FORMAT,
        "version": GRAPHS_VERSION,
        "torch_version": torch.__version__.split("+")[0],
        "tp_degree": tp_degree,
        "batch_size": batch_size,
        "max_length": max_length,
        "buckets": list(buckets),
        "token_buckets": token_buckets,
        "logits_buckets": logits_buckets,
        "dtype": str(dtype).removeprefix("torch."),
        "group_name": GROUP_NAME,
        "weights": names,
        "state": [{"name": s.name, "shape": list(s.shape), "dtype": str(s.dtype).removeprefix("torch.")} for s in specs],
        "graphs": graphs,
    }
    if vision_manifest is not None:
        manifest["vision"] = vision_manifest
    tmp = out / f".{GRAPHS_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, out / GRAPHS_FILE)
    return manifest


def read_graphs_manifest(folder: str | os.PathLike) -> dict:
    """`compiled/graphs.json` of an export folder; a clear error when it is missing or foreign."""
    file = Path(folder) / COMPILED_DIR / GRAPHS_FILE
    if not file.is_file():
        raise IncompatibleExportError(
            f"{Path(folder)} has no {COMPILED_DIR}/{GRAPHS_FILE}: it is not a complete cpu-target export; export it again"
        )
    manifest = json.loads(file.read_text())
    if manifest.get("format") != GRAPHS_FORMAT or manifest.get("version") != GRAPHS_VERSION:
        raise IncompatibleExportError(
            f"{file} is not a {GRAPHS_FORMAT} v{GRAPHS_VERSION} manifest: export the model again with this version"
        )
    return manifest


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def load_rank_weights(folder: str | os.PathLike, manifest: dict, rank: int) -> list[torch.Tensor]:
    """One rank's weight inputs, in program order, from the export's `checkpoint/` shards."""
    from optimum_qwen35.checkpoint.shard import load_sharded  # noqa: PLC0415

    _, _, params = load_sharded(Path(folder) / CHECKPOINT_DIR, rank, manifest["tp_degree"], _dtype(manifest["dtype"]))
    params.update(rank_tensors(rank))
    missing = [n for n in manifest["weights"] if n not in params]
    if missing:
        raise IncompatibleExportError(
            f"{Path(folder) / CHECKPOINT_DIR} lacks weights the compiled graphs take: {missing[:5]}; export the model again"
        )
    return [params[n] for n in manifest["weights"]]


def save_vision_weights(source: str | os.PathLike, vision, dtype: torch.dtype, checkpoint_dir: str | os.PathLike) -> None:
    """The vision tower's converted weights (modeling/vision.py) into `checkpoint/vision.safetensors`."""
    from safetensors.torch import save_file  # noqa: PLC0415

    from optimum_qwen35.runtime.vision import load_vision_encoder  # noqa: PLC0415

    encoder = load_vision_encoder(source, vision, dtype)
    tensors = {n: t.contiguous() for n, t in encoder.state_dict().items()}
    file = Path(checkpoint_dir) / VISION_WEIGHTS_FILE
    tmp = file.with_name(f".{file.name}.tmp-{os.getpid()}")
    save_file(tensors, os.fspath(tmp), metadata={"format": "pt"})
    os.replace(tmp, file)


def load_vision_weights(folder: str | os.PathLike, manifest: dict) -> list[torch.Tensor]:
    """The vision programs' weight inputs, in program order."""
    from safetensors.torch import load_file  # noqa: PLC0415

    file = Path(folder) / CHECKPOINT_DIR / manifest["vision"]["file"]
    if not file.is_file():
        raise IncompatibleExportError(f"{file} is missing: the export's vision graphs have no weights; export the model again")
    params = load_file(os.fspath(file))
    missing = [n for n in manifest["vision"]["weights"] if n not in params]
    if missing:
        raise IncompatibleExportError(f"{file} lacks weights the vision graphs take: {missing[:5]}; export the model again")
    return [params[n] for n in manifest["vision"]["weights"]]


class CompiledGraphs:
    """One rank's compiled programs, its weights and its state; programs are loaded on first use."""

    def __init__(self, folder: str | os.PathLike, rank: int = 0, manifest: dict | None = None):
        self.folder = Path(folder)
        self.manifest = manifest or read_graphs_manifest(folder)
        self.rank = rank
        self.weights = load_rank_weights(folder, self.manifest, rank)
        self.state_specs = [StateSpec(s["name"], tuple(s["shape"]), _dtype(s["dtype"])) for s in self.manifest["state"]]
        self.state = allocate_state(self.state_specs)
        self._programs: dict[str, nn.Module] = {}
        self.vision_weights = None
        if "vision" in self.manifest:
            self.vision_weights = load_vision_weights(folder, self.manifest)

    def program(self, name: str) -> nn.Module:
        if name not in self._programs:
            entry = self.manifest["graphs"].get(name)
            if entry is None:
                raise IncompatibleExportError(f"this export has no graph {name!r}; it has {sorted(self.manifest['graphs'])}")
            self._programs[name] = torch.export.load(self.folder / COMPILED_DIR / entry["file"]).module()
        return self._programs[name]

    @torch.no_grad()
    def run(self, name: str, *inputs: torch.Tensor, restore: list[int] | None = None) -> torch.Tensor:
        """Run graph `name` on `inputs` (token ids, ..., seq_ids), updating this rank's state; returns the logits.

        `restore`: slots whose state is put back as it was before the call (a scoring pass borrows them)."""
        saved = None
        if restore:
            index = torch.as_tensor(restore, dtype=torch.int64)
            saved = [s.index_select(0, index) for s in self.state]
        try:
            return self.program(name)(self.weights, *inputs, *self.state)[0]
        finally:
            if saved is not None:
                for state, before in zip(self.state, saved):
                    state.index_copy_(0, index, before)

    @torch.no_grad()
    def run_vision(self, bucket: int, *inputs: torch.Tensor) -> torch.Tensor:
        """The vision tower's program of image bucket `bucket` (no state)."""
        return self.program(vision_graph_name(bucket))(self.vision_weights, *inputs)

    def close(self) -> None:
        self._programs.clear()


def _send(conn, obj) -> None:
    """Plain pickle over the socket: multiprocessing's own pickler would pass torch tensors as shared-memory
    handles, which only processes of one multiprocessing family may open."""
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn):
    return pickle.loads(conn.recv_bytes())


def _portable(error: BaseException):
    """What a worker reports: this package's errors as themselves (the parent re-raises them), others as text."""
    if isinstance(error, Qwen35Error):
        try:
            pickle.dumps(error)
            return error
        except Exception:  # noqa: BLE001
            pass
    return traceback.format_exc()


def serve_rank(rank: int, tp_degree: int, store_file: str, folder: str, conn) -> None:
    """A tensor-parallel rank: load, say ready, then run what the parent sends until it sends None."""
    import torch.distributed as dist  # noqa: PLC0415

    try:
        dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=tp_degree)
        graphs = CompiledGraphs(folder, rank)
        if dist.group.WORLD.group_name != graphs.manifest["group_name"]:
            raise RuntimeError(f"process group {dist.group.WORLD.group_name!r} is not the graphs' {graphs.manifest['group_name']!r}")
        _send(conn, ("ready", None))
    except BaseException as error:  # noqa: BLE001 (reported to the parent, which raises it)
        _send(conn, ("error", _portable(error)))
        return
    try:
        while True:
            try:
                message = _recv(conn)
            except EOFError:  # the parent exited without close() (e.g. vLLM's engine shut down): stop quietly
                break
            if message is None:
                break
            name, inputs, restore = message
            try:
                logits = graphs.run(name, *inputs, restore=restore)
                _send(conn, ("ok", logits if rank == 0 else None))
            except BaseException as error:  # noqa: BLE001
                _send(conn, ("error", _portable(error)))
    finally:
        dist.destroy_process_group()


class TensorParallelGraphs:
    """t ranks in t worker processes (gloo over a file store); `run` sends every rank the same inputs.

    The workers are fresh interpreters (`python -m optimum_qwen35.runtime.tp_worker`), each talking to this
    process over its own socket pair: unlike multiprocessing's spawn, they never re-import the caller's
    main module, so a script needs no `if __name__ == "__main__":` guard.
    """

    def __init__(self, folder: str | os.PathLike, tp_degree: int):
        import socket  # noqa: PLC0415
        import subprocess  # noqa: PLC0415
        import sys  # noqa: PLC0415
        import tempfile  # noqa: PLC0415
        from multiprocessing.connection import Connection  # noqa: PLC0415

        self.tp_degree = tp_degree
        self._tmp = tempfile.TemporaryDirectory(prefix="qwen35-tp-")
        threads = max(1, (os.cpu_count() or 1) // tp_degree)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        store = os.path.join(self._tmp.name, "store")
        self._conns, self._procs = [], []
        self._lock = threading.Lock()
        for rank in range(tp_degree):
            ours, theirs = socket.socketpair()
            command = [sys.executable, "-m", "optimum_qwen35.runtime.tp_worker", os.fspath(folder), str(rank), str(tp_degree), store, str(theirs.fileno()), str(threads)]
            self._procs.append(subprocess.Popen(command, pass_fds=[theirs.fileno()], env=env))
            theirs.close()
            self._conns.append(Connection(ours.detach()))
        try:
            self._collect()
        except BaseException:
            self.close()
            raise

    def _collect(self) -> list:
        results, errors, package_errors = [], [], []
        for rank, conn in enumerate(self._conns):
            try:
                status, value = _recv(conn)
            except EOFError:
                status, value = "error", f"exited with code {self._procs[rank].wait()}"
            if status == "error":
                if isinstance(value, Qwen35Error):
                    package_errors.append(value)  # user-fixable (e.g. weights that do not match): raised as is
                else:
                    errors.append(f"rank {rank}: {value}")
            results.append(value)
        if package_errors:
            raise package_errors[0]
        if errors:
            raise RuntimeError("tensor-parallel worker failed:\n" + "\n".join(errors))
        return results

    def run(self, name: str, *inputs: torch.Tensor, restore: list[int] | None = None) -> torch.Tensor:
        with self._lock:
            for conn in self._conns:
                _send(conn, (name, inputs, restore))
            return self._collect()[0]

    def close(self) -> None:
        for conn in self._conns:
            try:
                _send(conn, None)
            except OSError:
                pass
        for proc in self._procs:
            try:
                proc.wait(timeout=30)
            except Exception:  # noqa: BLE001
                proc.kill()
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
        self._tmp.cleanup()

    def __del__(self):
        if getattr(self, "_procs", None):
            self.close()


class CompiledQwen35ForCausalLM(Qwen35ForCausalLM):
    """`Qwen35ForCausalLM` over the compiled programs of an export (one rank in process, or t workers)."""

    def __init__(self, folder: str | os.PathLike):
        manifest = read_graphs_manifest(folder)
        config = Qwen35Config.from_pretrained(Path(folder) / CHECKPOINT_DIR)
        self._set_shapes(config, manifest["batch_size"], manifest["max_length"], manifest["buckets"])
        self.key_buckets = manifest["token_buckets"]
        self.logits_buckets = manifest.get("logits_buckets", [])  # none in exports made before forward() existed
        self.tp_degree = manifest["tp_degree"]
        if self.tp_degree == 1:
            self.graphs = CompiledGraphs(folder, 0, manifest)
        else:
            self.graphs = TensorParallelGraphs(folder, self.tp_degree)

    def _run_context(self, length: int, all_logits: bool, key_length: int | None, *inputs: torch.Tensor):
        if key_length is not None:
            raise IncompatibleExportError(
                "compiled context-encoding graphs start fresh sequences only (their buckets reach max_length); "
                "continuing a sequence's prompt needs the eager runtime (optimum_qwen35.runtime.cpu.Qwen35ForCausalLM)"
            )
        if all_logits:
            raise IncompatibleExportError(
                "compiled context-encoding graphs return the last token's logits only; per-position logits "
                "need the eager runtime (optimum_qwen35.runtime.cpu.Qwen35ForCausalLM)"
            )
        return self.graphs.run(context_graph_name(length), *inputs)

    def _run_token(self, key_length: int, *inputs: torch.Tensor) -> torch.Tensor:
        return self.graphs.run(token_graph_name(key_length), *inputs)

    @torch.no_grad()
    def logits(self, prompts) -> list[torch.Tensor]:
        """Teacher-forced logits at every position, one [len(prompt), vocab] fp32 tensor per prompt, through the
        per-position logits programs. The slots they borrow get their state back: running sequences go on as if
        nothing had run. More prompts than the batch size run in waves."""
        prompts = validation.token_ids(prompts, self.config.vocab_size, allow_no_prompt=True)
        if not self.logits_buckets:
            raise IncompatibleExportError(
                "this export has no per-position logits graphs (it was exported before forward() existed): "
                "export the model again"
            )
        largest = self.logits_buckets[-1]
        for p in prompts:
            if len(p) > largest:
                raise UsageError(
                    f"an input of {len(p)} tokens is longer than the compiled sequence length ({largest}): "
                    "shorten it, or score it in windows of at most that many tokens"
                )
        results = []
        for first in range(0, len(prompts), self.batch_size):
            group = prompts[first : first + self.batch_size]
            T = self.logits_buckets[bisect.bisect_left(self.logits_buckets, max(len(p) for p in group))]
            ids = torch.zeros(self.batch_size, T, dtype=torch.int32)
            mask = torch.zeros(self.batch_size, T, dtype=torch.int32)
            positions = torch.zeros(self.batch_size, T, dtype=torch.int32)
            for row, prompt in enumerate(group):
                ids[row, : len(prompt)] = torch.as_tensor(prompt, dtype=torch.int32)
                mask[row, : len(prompt)] = 1
                positions[row, : len(prompt)] = torch.arange(len(prompt), dtype=torch.int32)
            slots = list(range(len(group)))
            out = self.graphs.run(logits_graph_name(T), ids, mask, positions, self._seq_ids(slots), restore=slots)
            results += [out[row, : len(prompt)].float() for row, prompt in enumerate(group)]
        return results

    def close(self) -> None:
        self.graphs.close()


class CompiledQwen35ForImageTextToText(ImageInputs, CompiledQwen35ForCausalLM):
    """`CompiledQwen35ForCausalLM` of a vision export: `generate` takes images (runtime/vision.py `ImageInputs`)."""

    def __init__(self, folder: str | os.PathLike):
        from optimum_qwen35.modeling.vision import VisionConfig  # noqa: PLC0415

        super().__init__(folder)
        manifest = self.graphs.manifest
        if "vision" not in manifest:
            raise IncompatibleExportError(f"{folder} is a text-only export (no vision graphs): export it with vision=True")
        self.vision_config = VisionConfig.from_dict(self.config.raw)
        self._set_image_buckets(manifest["vision"]["image_buckets"])

    def _run_vision(self, bucket: int, *inputs: torch.Tensor) -> torch.Tensor:
        return self.graphs.run_vision(bucket, *inputs)

    def _run_image_context(self, length: int, all_logits: bool, key_length: int | None, *inputs: torch.Tensor):
        if key_length is not None or all_logits:
            raise IncompatibleExportError(
                "compiled image context-encoding graphs start fresh prompts and return the last token's logits only; "
                "longer prompts or per-position logits need the eager runtime (runtime/vision.py)"
            )
        return self.graphs.run(image_context_graph_name(length), *inputs)

    def _run_image_token(self, key_length: int, *inputs: torch.Tensor) -> torch.Tensor:
        return self.graphs.run(image_token_graph_name(key_length), *inputs)

    def logits(self, prompts, pixel_values=None, image_grid_thw=None) -> list[torch.Tensor]:
        if pixel_values is not None or image_grid_thw is not None:
            raise IncompatibleExportError(
                "per-position logits of prompts holding images need the eager runtime (runtime/vision.py "
                "Qwen35ForImageTextToText); a compiled export generates from them"
            )
        return CompiledQwen35ForCausalLM.logits(self, prompts)
