"""The cpu target's compiler: each graph of the model exported once with `torch.export`, saved beside its manifest.

Each program is exported once, on the meta device, and serves every rank (SPMD, as one Neuron graph serves every
core): the weights and the state are program inputs, not constants, so a program holds no weights (one copy of them,
in `checkpoint/`, shared by every graph) and the rank is a weight tensor (`embed_tokens.rank`). The programs update
the state inputs in place (`torch.export` keeps the `index_put_` / `index_copy_` on the inputs), so a decode step
writes one K/V row per slot, not whole caches. Collectives are `_c10d_functional` ops named by process group, which
`torch.export` records as graph ops.

Why `torch.export` rather than TorchScript: TorchScript tracing cannot record a torch.distributed collective (the
process group is not traceable), so a tensor-parallel graph could not be saved; `torch.export` records the
functional collectives, refuses data-dependent Python control flow (the graphs are proven static, as neuronx-cc
needs them) and is the format PyTorch maintains. The folder's format is export/layout.py's; runtime/exported.py
runs the programs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.fx import config as fx_config
from tqdm.auto import tqdm

from optimum_qwen35.checkpoint.fp8_shard import SCALE_SUFFIX
from optimum_qwen35.config import Qwen35Config
from optimum_qwen35.errors import UsageError
from optimum_qwen35.export.layout import (
    CPU_BACKEND,
    GRAPHS_FILE,
    GRAPHS_FORMAT,
    GRAPHS_VERSION,
    TORCHNEURON_BACKEND,
    VISION_WEIGHTS_FILE,
    commit_graph_name,
    context_graph_name,
    context_hidden_graph_name,
    continuing_context_graph_name,
    image_context_graph_name,
    image_token_graph_name,
    logits_graph_name,
    mtp_graph_name,
    mtp_weights_file,
    token_graph_name,
    verify_graph_name,
    vision_graph_name,
)
from optimum_qwen35.modeling.decoder import (
    ContextEncodingGraph,
    ImageContextEncodingGraph,
    ImageTokenGenerationGraph,
    Qwen35Decoder,
    TokenGenerationGraph,
)
from optimum_qwen35.modeling.fp8 import hold_meta_fp8_weights, stored_weight_name
from optimum_qwen35.modeling.precision import accumulation_dtype, to_model_dtype
from optimum_qwen35.modeling.speculative_graphs import CommitGraph, ContextHiddenGraph, MTPGraph, VerifyGraph
from optimum_qwen35.modeling.state import StateSpec
from optimum_qwen35.modeling.torch_layers import TorchLayers
from optimum_qwen35.modeling.vision import VisionEncoder, image_bucket_inputs
from optimum_qwen35.patches import torch_export_files_faster
from optimum_qwen35.runtime.images import load_vision_encoder
from optimum_qwen35.runtime.prefix_cache import continuing_graphs

# The process group the programs' collectives name: the default (world) group of the worker processes.
GROUP_NAME = "0"
# The most draft tokens per round an export made with mtp=True verifies: its verify, commit and catch-up programs take
# this many + 1 positions, and a round of fewer drafts runs them padded (the padding is past each row's `lengths`).
MTP_MAX_SPECULATIVE_TOKENS = 4


def fp8_weight_shapes(rank_file: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """{weight name: (float8 shape, scale shape)} of an export's rank file with FP8 weights (read from its header)."""
    with safe_open(os.fspath(rank_file), "pt") as f:
        names = set(f.keys())
        return {n: (tuple(f.get_slice(n).get_shape()), tuple(f.get_slice(n + SCALE_SUFFIX).get_shape()))
                for n in sorted(names) if n + SCALE_SUFFIX in names and f.get_slice(n).get_dtype() == "F8_E4M3"}


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


def _export(module: nn.Module, args: tuple) -> torch.export.ExportedProgram:
    """`torch.export.export` of one graph, without the Python stack trace torch.fx records for every node where torch
    can leave it out (`torch.fx.config.do_not_emit_stack_traces`, torch >= 2.13): a fifth of a trace's time and of
    the file's size, and an export pushed to the Hub carries no paths of the machine that made it."""
    previous = getattr(fx_config, "do_not_emit_stack_traces", None)
    if previous is not None:
        fx_config.do_not_emit_stack_traces = True
    try:
        with torch.no_grad():
            return torch.export.export(module, args)
    finally:
        if previous is not None:
            fx_config.do_not_emit_stack_traces = previous


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


def speculative_example_inputs(kind: str, config: Qwen35Config, batch_size: int, length: int, specs: list[StateSpec],
                               mtp_specs: list[StateSpec], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The speculative graphs' inputs after the weights (modeling/speculative_graphs.py): verify (ids, positions,
    lengths, seq_ids, state), commit (seq_ids, accepted, the per-position DeltaNet states verify returns, state), the
    MTP head (ids, hidden, positions, lengths, seq_ids, its K/V cache)."""
    state = [torch.empty(s.shape, dtype=s.dtype) for s in specs]
    seq_ids = torch.arange(batch_size, dtype=torch.int32)
    ids = torch.zeros(batch_size, length, dtype=torch.int32)
    positions = torch.arange(length, dtype=torch.int32).expand(batch_size, length)
    lengths = torch.full((batch_size,), length, dtype=torch.int32)
    if kind == "verify":
        return (ids, positions, lengths, seq_ids, *state)
    if kind == "commit":
        # Per DeltaNet layer, from its slot state (conv [slots, C, K - 1], recurrent [slots, nv, dk, dv]): conv
        # [B, T, C, K - 1], recurrent [B, T * nv, dk, dv] (rank 4: modeling/decoder.py `verify`).
        per_position = []
        for i in config.linear_layers:
            conv, recurrent = specs[2 * i], specs[2 * i + 1]
            per_position.append(torch.empty(batch_size, length, *conv.shape[1:], dtype=conv.dtype))
            nv, dk, dv = recurrent.shape[1:]
            per_position.append(torch.empty(batch_size, length * nv, dk, dv, dtype=recurrent.dtype))
        return (seq_ids, torch.zeros(batch_size, dtype=torch.int64), *per_position, *state)
    # the MTP head reads the main model's final-normed hidden states, in the accumulation dtype
    hidden = torch.zeros(batch_size, length, config.hidden_size, dtype=accumulation_dtype(dtype))
    return (ids, hidden, positions, lengths, seq_ids, *[torch.empty(s.shape, dtype=s.dtype) for s in mtp_specs])


def speculative_plan(buckets: list[int], token_buckets: list[int]) -> list[tuple[str, str, int | tuple[int, int]]]:
    """The programs speculative decoding runs (runtime/speculative.py), as (name, kind, length or (length, key
    length)): context encoding with hidden states per context bucket; verify of K + 1 positions and the head's
    draft step (1) and catch-up (K + 1) per cache bucket; one commit; the head over a prompt per context bucket."""
    T = MTP_MAX_SPECULATIVE_TOKENS + 1
    plan = [(context_hidden_graph_name(B), "context_hidden", B) for B in buckets]
    plan += [(verify_graph_name(T, L), "verify", (T, L)) for L in token_buckets]
    plan += [(commit_graph_name(T), "commit", T)]
    pairs = sorted({(B, B) for B in buckets} | {(t, L) for t in (1, T) for L in token_buckets})
    plan += [(mtp_graph_name(t, L), "mtp", (t, L)) for t, L in pairs]
    return plan


def check_draft_vocab(tp_degree: int, backend: str, fp8: bool) -> None:
    """Where an export's draft vocabulary is built: one line elsewhere."""
    if tp_degree != 1 or backend != CPU_BACKEND or fp8:
        raise UsageError(
            "a draft vocabulary is exported for the cpu target at tensor_parallel_size 1 with bf16 / fp32 weights for "
            f"now (here: {backend}, tensor_parallel_size {tp_degree}{', fp8 weights' if fp8 else ''}; lm_head is split "
            "by vocabulary across ranks): export without draft_vocab_size"
        )


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
    prefix_block_size: int | None = None,
    backend: str = CPU_BACKEND,
    mtp: bool = False,
    fp8_shapes: dict | None = None,
    draft_ids: list[int] | None = None,
) -> dict:
    """Export the context-encoding programs (one per bucket), the token-generation programs (one per cache
    bucket; by default the context buckets) and the per-position logits programs (one per bucket of
    `logits_buckets`, by default the context buckets: what `forward()` runs) to `out_dir`. With `vision` (a
    `modeling.vision.VisionConfig`; tp_degree 1), also the vision tower's programs (one per image bucket of
    `image_buckets` patch rows) and the image context-encoding and token-generation programs (same buckets).
    With `prefix_block_size` (a multiple of 64, below max_length), also the context-encoding programs that continue a
    sequence which a prefix cache of that block size runs (runtime/prefix_cache.py `continuing_graphs`: one per
    context bucket and key length of a resumed piece, where the key length is longer than the bucket).

    With `mtp`, also the programs of speculative decoding with the checkpoint's multi-token-prediction
    head (`speculative_plan`), over the decoder with the head: their weights are the head's too (graphs.json "mtp":
    their weight order, each rank's weights file, the head's K/V cache, the most drafts per round).

    `backend`: "cpu" exports each graph with `torch.export`; "torchneuron" writes the same manifest with no program
    files, since TorchNeuron compiles each graph on the device on first use (backends/torchneuron/runner.py builds
    the graph modules from these entries).

    `draft_ids` (with `mtp`, tp_degree 1, the cpu backend): the head drafts over these token ids only
    (runtime/draft_vocab.py); its programs take those rows of lm_head as one more weight (`mtp.draft_head.weight`, cut
    from lm_head's at load) and return [B, V_d] logits; graphs.json "mtp" "draft_ids" lists them.

    `fp8_shapes` ({weight name: (float8 shard shape, scale shape)}, `fp8_weight_shapes` of the export's rank file):
    the graphs take those weights as float8 with their scales and dequantize each beside its matmul (modeling/fp8.py);
    graphs.json says `"weights_dtype": "fp8"` and lists the weights by their rank-file names.

    Returns the content of `graphs.json`, written last.
    """
    if backend not in (CPU_BACKEND, TORCHNEURON_BACKEND):
        raise UsageError(f"compile_graphs builds the cpu and torchneuron backends' graphs, not {backend!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        # Model dtype, except the parameters the precision policy holds in fp32 (as load_sharded returns them).
        decoder = to_model_dtype(Qwen35Decoder(config, tp_degree, TorchLayers(tp_degree, 0, group=GROUP_NAME)), dtype)
    if fp8_shapes:
        hold_meta_fp8_weights(decoder, fp8_shapes, dtype)
    names = weight_names(decoder)
    tensors = {**dict(decoder.named_parameters()), **dict(decoder.named_buffers())}
    weights = [_shape_only(tensors[n]) for n in names]
    specs = decoder.state_specs(batch_size, max_length)
    token_buckets = sorted(set(token_buckets or buckets) | {max_length})
    plan = [(context_graph_name(T), "context", T) for T in buckets]
    plan += [(token_graph_name(L), "token", L) for L in token_buckets]
    logits_buckets = sorted(set(buckets if logits_buckets is None else logits_buckets))
    plan += [(logits_graph_name(T), "logits", T) for T in logits_buckets]
    continuing = []
    if prefix_block_size is not None:
        if prefix_block_size % 64 or not 0 < prefix_block_size < max_length or prefix_block_size > buckets[-1]:
            raise UsageError(
                f"prefix_block_size must be a multiple of 64 below max_length ({max_length}) and at most the largest "
                f"context bucket ({buckets[-1]}), got {prefix_block_size}"
            )
        continuing = continuing_graphs(sorted(buckets), token_buckets, max_length, prefix_block_size)
        plan += [(continuing_context_graph_name(T, L), "context", (T, L)) for T, L in continuing]
    mtp_manifest = None
    if mtp:
        with torch.device("meta"):  # (the head sharded as the main layers: one rank's programs serve every rank)
            mtp_decoder = to_model_dtype(
                Qwen35Decoder(config, tp_degree, TorchLayers(tp_degree, 0, group=GROUP_NAME), mtp=True), dtype
            )
        if fp8_shapes:  # (the head itself is dequantized: only the main layers' weights are float8)
            hold_meta_fp8_weights(mtp_decoder, fp8_shapes, dtype)
        if draft_ids is not None:
            check_draft_vocab(tp_degree, backend, bool(fp8_shapes))
            mtp_decoder.mtp.set_draft_vocab(mtp_decoder.lm_head, torch.as_tensor(draft_ids, dtype=torch.int64))
        mtp_names = weight_names(mtp_decoder)
        mtp_tensors = {**dict(mtp_decoder.named_parameters()), **dict(mtp_decoder.named_buffers())}
        mtp_weights = [_shape_only(mtp_tensors[n]) for n in mtp_names]
        mtp_specs = mtp_decoder.mtp_state_specs(batch_size, max_length)
        plan += speculative_plan(sorted(buckets), token_buckets)
        mtp_manifest = {
            "max_speculative_tokens": MTP_MAX_SPECULATIVE_TOKENS,
            "weights": [stored_weight_name(n) for n in mtp_names],
            "files": [mtp_weights_file(rank, tp_degree) for rank in range(tp_degree)],  # each rank's share
            "state": [{"name": s.name, "shape": list(s.shape), "dtype": str(s.dtype).removeprefix("torch.")} for s in mtp_specs],
        }
        if draft_ids is not None:
            mtp_manifest["draft_ids"] = [int(t) for t in draft_ids]
    vision_manifest = None
    if vision is not None:
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
    for name, kind, length in plan if backend == TORCHNEURON_BACKEND else ():  # (compiled on the device, on first use)
        length, key_length = length if isinstance(length, tuple) else (length, None)
        graphs[name] = {"kind": kind, "length": length, **({} if key_length is None else {"key_length": key_length})}
    torch_export_files_faster()  # the same files, about a fifth less time saving them (patches/torch_export.py)
    bar = tqdm(plan if backend == CPU_BACKEND else [], desc="compile (cpu: torch.export)", unit="graph",
               disable=not progress or backend != CPU_BACKEND)
    for name, kind, length in bar:
        bar.set_postfix_str(name)  # the graph being compiled now
        length, key_length = length if isinstance(length, tuple) else (length, None)
        image_embeds = (config.hidden_size, dtype)
        if kind == "vision":
            # Any grid of the bucket's size: the program's shapes are the bucket's, the grid is in the inputs' values.
            grid = (1, vision.spatial_merge_size, length // vision.spatial_merge_size)
            example = image_bucket_inputs(vision, torch.zeros(length, vision.patch_dim), grid, length)
            program = _export(WeightsAsInputs(encoder, vision_names, prefix=""), (vision_weights, *example))
        elif kind in ("context_hidden", "verify", "commit", "mtp"):
            if kind == "context_hidden":
                graph, inputs = ContextHiddenGraph(mtp_decoder), example_inputs("context", batch_size, length, specs)
            else:
                if kind == "verify":
                    graph = VerifyGraph(mtp_decoder, key_length)
                elif kind == "mtp":
                    graph = MTPGraph(mtp_decoder, key_length)
                else:
                    graph = CommitGraph(mtp_decoder)
                inputs = speculative_example_inputs(kind, config, batch_size, length, specs, mtp_specs, dtype)
            program = _export(WeightsAsInputs(graph, mtp_names), (mtp_weights, *inputs))
        else:
            if kind in ("context", "logits"):
                graph = ContextEncodingGraph(decoder, all_logits=kind == "logits", key_length=key_length)
                inputs = example_inputs("context", batch_size, length, specs)
            elif kind == "image_context":
                graph = ImageContextEncodingGraph(decoder)
                inputs = example_inputs(kind, batch_size, length, specs, image_embeds)
            elif kind == "image_token":
                graph, inputs = ImageTokenGenerationGraph(decoder, length), example_inputs(kind, batch_size, 1, specs)
            else:
                graph, inputs = TokenGenerationGraph(decoder, length), example_inputs(kind, batch_size, 1, specs)
            program = _export(WeightsAsInputs(graph, names), (weights, *inputs))
        file = out / f"{name}.pt2"
        tmp = file.with_name(f".{name}.tmp-{os.getpid()}.pt2")  # torch.export wants the .pt2 suffix
        torch.export.save(program, tmp)
        os.replace(tmp, file)
        graphs[name] = {"kind": kind, "length": length, "file": file.name}
        if key_length is not None:
            graphs[name]["key_length"] = key_length
    manifest = {
        "format": GRAPHS_FORMAT,
        "version": GRAPHS_VERSION,
        "backend": backend,
        "torch_version": torch.__version__.split("+")[0],
        "tp_degree": tp_degree,
        "batch_size": batch_size,
        "max_length": max_length,
        "buckets": list(buckets),
        "token_buckets": token_buckets,
        "logits_buckets": logits_buckets,
        "dtype": str(dtype).removeprefix("torch."),
        "group_name": GROUP_NAME,
        "weights": [stored_weight_name(n) for n in names],
        **({"weights_dtype": "fp8"} if fp8_shapes else {}),
        "state": [{"name": s.name, "shape": list(s.shape), "dtype": str(s.dtype).removeprefix("torch.")} for s in specs],
        "graphs": graphs,
    }
    if prefix_block_size is not None:
        # What a prefix cache of this export uses (runtime/exported.py `prefix_cache_owner`); absent in older exports.
        manifest["prefix_cache"] = {"block_size": prefix_block_size, "graphs": [list(pair) for pair in continuing]}
    if vision_manifest is not None:
        manifest["vision"] = vision_manifest
    if mtp_manifest is not None:
        # What speculative decoding on this export runs (runtime/exported.py `SpeculativePrograms.has_mtp`).
        manifest["mtp"] = mtp_manifest
    tmp = out / f".{GRAPHS_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, out / GRAPHS_FILE)
    return manifest


def save_vision_weights(source: str | os.PathLike, vision, dtype: torch.dtype, checkpoint_dir: str | os.PathLike) -> None:
    """The vision tower's converted weights (modeling/vision.py) into `checkpoint/vision.safetensors`."""
    encoder = load_vision_encoder(source, vision, dtype)
    tensors = {n: t.contiguous() for n, t in encoder.state_dict().items()}
    file = Path(checkpoint_dir) / VISION_WEIGHTS_FILE
    tmp = file.with_name(f".{file.name}.tmp-{os.getpid()}")
    save_file(tensors, os.fspath(tmp), metadata={"format": "pt"})
    os.replace(tmp, file)
