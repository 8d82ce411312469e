"""The eager graph runner: the decoder's own modules run in this process, the way Neuron runs its graphs.

`load_decoder` builds a rank's decoder and loads its weights (a checkpoint folder, converted and sharded on the
fly, or a sharded export); `EagerGraphs` runs its context-encoding and token-generation graphs, one module per
bucket, over the state it holds. The host loop around them is runtime/host_loop.py's `Qwen35Runtime`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from optimum_qwen35 import validation
from optimum_qwen35.checkpoint import CheckpointReader, convert_checkpoint
from optimum_qwen35.checkpoint.convert import check_finite, convert_mtp
from optimum_qwen35.checkpoint.fp8_shard import convert_and_shard_fp8
from optimum_qwen35.checkpoint.shard import convert_and_shard, convert_and_shard_mtp
from optimum_qwen35.checkpoint.sharded_files import is_sharded_export, load_mtp_weights, load_sharded
from optimum_qwen35.config import Qwen35Config
from optimum_qwen35.errors import CheckpointError, UnsupportedModelError, UsageError
from optimum_qwen35.export.layout import mtp_weights_file
from optimum_qwen35.modeling.decoder import (
    ContextEncodingGraph,
    ImageContextEncodingGraph,
    ImageTokenGenerationGraph,
    Qwen35Decoder,
    TokenGenerationGraph,
)
from optimum_qwen35.modeling.fp8 import hold_fp8_weights, split_fp8
from optimum_qwen35.modeling.state import allocate_state
from optimum_qwen35.modeling.torch_layers import TorchLayers, pack_linears
from optimum_qwen35.runtime.prefix_cache import StateInProcess

DEFAULT_BUCKET_MIN = 64


def load_decoder(
    path: str | os.PathLike,
    dtype: torch.dtype | str = torch.float32,
    tp_degree: int = 1,
    rank: int = 0,
    layers=None,
    config: Qwen35Config | None = None,
    check_weights: bool = True,
    mtp: bool = False,
    weights_dtype: str | None = None,
) -> Qwen35Decoder:
    """Build the decoder (this rank's share of it) and load its weights.

    `path` is a checkpoint folder (converted, and sharded when tp_degree > 1, on the fly) or a folder
    written by `optimum_qwen35.checkpoint.sharded_files.save_sharded` (its tp_degree must match). `dtype` is a
    torch dtype or its name ("bfloat16", "bf16", ...). Weights holding NaN or Inf are refused, naming
    the tensor (`check_weights=False` skips that check; it exists to measure its cost). `mtp`: build and load the
    multi-token-prediction head too (modeling/mtp.py; from a checkpoint folder, sharded as the main layers at
    tp_degree > 1, or from an export made with mtp=True, which holds each rank's share), for speculative decoding.
    `weights_dtype="fp8"` (a block-FP8 checkpoint folder): keep its float8 weights as float8, dequantized next to
    each matmul (modeling/fp8.py); by default they are dequantized to `dtype` at load (docs/fp8.md).
    """
    dtype = validation.parse_dtype(dtype)
    path = validation.model_folder(path, "load_decoder")
    config = config or Qwen35Config.from_pretrained(path)
    config.check_tp_degree(tp_degree)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tp_degree:
        raise UsageError(f"rank must be an integer in [0, {tp_degree}), got {rank!r}")
    sharded_export = is_sharded_export(path)
    if mtp and sharded_export and not (Path(path) / mtp_weights_file(rank, tp_degree)).is_file():
        raise UnsupportedModelError(
            "the multi-token-prediction head loads from a checkpoint folder (a sharded export does not hold it unless "
            "exported with mtp=True): pass the checkpoint the export was written from"
        )
    if sharded_export:
        saved, _, params = load_sharded(path, rank, tp_degree, dtype, check_weights)
        if mtp:
            params.update(load_mtp_weights(path, dtype, rank, tp_degree))
        if config.is_moe:  # the experts as the export split them
            config = dataclasses.replace(config, moe_parallel=saved.moe_parallel)
    if layers is None:
        layers = TorchLayers(tp_degree, rank)  # this rank's vocabulary block; needs torch.distributed when t > 1
    with torch.device("meta"):
        decoder = Qwen35Decoder(config, tp_degree, layers, mtp=mtp)
    if sharded_export:
        pass
    elif weights_dtype is not None:
        reader = fp8_reader(path, weights_dtype, dtype, mtp)
        params = dict(convert_and_shard_fp8(reader, config, tp_degree, rank, dtype))
        if mtp:
            params.update(convert_and_shard_mtp(reader, config, tp_degree, rank, dtype))
    elif tp_degree == 1:
        reader = CheckpointReader(path, mtp=mtp, dequantize_dtype=dtype)
        params = dict(convert_checkpoint(reader, config, dtype))
        if mtp:
            params.update(convert_mtp(reader, config, dtype))
    else:
        reader = CheckpointReader(path, mtp=mtp, dequantize_dtype=dtype)
        params = dict(convert_and_shard(reader, config, tp_degree, rank, dtype))
        if mtp:
            params.update(convert_and_shard_mtp(reader, config, tp_degree, rank, dtype))
    if check_weights and not sharded_export:  # load_sharded checked an export's weights
        check_finite(params, f"{path} (rank {rank} of {tp_degree})" if tp_degree > 1 else str(path))
    if config.tie_word_embeddings:
        params["lm_head.weight"] = params["embed_tokens.weight"]
    params.update(rank_tensors(rank))
    fp8_params = split_fp8(params)
    result = decoder.load_state_dict(params, strict=False, assign=True)
    missing = [k for k in result.missing_keys if k not in fp8_params]
    if missing or result.unexpected_keys:
        raise CheckpointError(
            f"{path}: decoder weights do not match: missing {missing}, unexpected {result.unexpected_keys}"
        )
    hold_fp8_weights(decoder, fp8_params, dtype)
    if config.tie_word_embeddings:
        decoder.lm_head.weight = decoder.embed_tokens.weight
    return decoder.eval()


def fp8_reader(path, weights_dtype: str, dtype: torch.dtype, mtp: bool = False) -> CheckpointReader:
    """The reader of a checkpoint whose FP8 weights are to be kept as float8; refuses, in one line, any other
    weights_dtype and a checkpoint without FP8 weights."""
    if weights_dtype != "fp8":
        raise UsageError(f"weights_dtype {weights_dtype!r} is not supported: 'fp8' (keep FP8 weights) or None (the model dtype)")
    reader = CheckpointReader(path, mtp=mtp, dequantize_dtype=dtype)
    if reader.fp8_block is None:
        raise UnsupportedModelError(
            f"{path} holds no FP8 weights (no quantization_config): quantize it first "
            "(optimum_qwen35.checkpoint.quantize.quantize_checkpoint) or load it without weights_dtype"
        )
    return reader


def rank_tensors(rank: int) -> dict[str, torch.Tensor]:
    """The per-rank tensors that are not checkpoint weights (loaded beside them, one graph for every rank)."""
    return {"embed_tokens.rank": torch.tensor([rank], dtype=torch.int32)}


class EagerGraphs(StateInProcess):
    """The graph runner of the decoder's own modules in this process: context encoding, token generation and their
    image forms (modeling/decoder.py), built per bucket on first use (traced with `torch.jit.trace` when `trace`),
    over the state list this runner holds and the graphs update in place; the vision tower's module when given.
    Any context graph continues a sequence (a key length per call), so a prefix cache of any block size fits it."""

    prefix_block_size = None  # (a compiled runner names the block size its continuing programs were built for)
    draft_ids = None  # the MTP head's draft vocabulary (`set_draft_vocab`): token ids [V_d], None for the whole one

    def __init__(self, decoder: Qwen35Decoder, batch_size: int, max_length: int, trace: bool = False,
                 pack_weights: bool = False, vision_encoder=None):
        if not isinstance(decoder, Qwen35Decoder):
            raise UsageError(
                f"the eager runtime takes a loaded decoder, got {type(decoder).__name__}; to load a folder use "
                "Qwen35Runtime.from_pretrained(path, ...)"
            )
        self.decoder, self.batch_size, self.trace, self.vision_encoder = decoder, batch_size, trace, vision_encoder
        if pack_weights and not trace:  # a traced graph would hold the packed weights as constants
            pack_linears(decoder, batch_size)
        self.state_specs = decoder.state_specs(batch_size, max_length)
        self.state = allocate_state(self.state_specs)
        # The MTP head's KV cache (empty without the head), and the per-position DeltaNet states of the last `verify`
        # until `commit` (speculative decoding).
        self.mtp_state = allocate_state(decoder.mtp_state_specs(batch_size, max_length))
        self._verified: list[torch.Tensor] | None = None
        self._graphs: dict[tuple, torch.nn.Module] = {}

    def _graph(self, kind: str, length: int, all_logits: bool = False, key_length: int | None = None):
        key = (kind, length, all_logits, key_length)
        if key not in self._graphs:
            if kind == "context":
                module = ContextEncodingGraph(self.decoder, all_logits, key_length)
            elif kind == "image_context":
                module = ImageContextEncodingGraph(self.decoder, all_logits, key_length)
            elif kind == "image_token":
                module = ImageTokenGenerationGraph(self.decoder, key_length)
            else:
                module = TokenGenerationGraph(self.decoder, key_length)
            if self.trace:
                example = self._example_inputs(kind, length)
                with torch.no_grad():
                    module = torch.jit.trace(module, example, check_trace=False)
            self._graphs[key] = module
        return self._graphs[key]

    def _example_inputs(self, kind: str, length: int):
        """Inputs to trace a graph with; the state is a scratch copy, since tracing runs the graph (in place)."""
        B = self.batch_size
        state = [torch.zeros_like(t) for t in self.state]
        ids = torch.zeros(B, length, dtype=torch.int32)
        seq_ids = torch.arange(B, dtype=torch.int32)
        if kind in ("context", "image_context"):
            mask = torch.ones(B, length, dtype=torch.int32)
            positions = torch.arange(length, dtype=torch.int32).expand(B, length)
            if kind == "image_context":
                rope = positions[:, None].expand(B, 3, length)
                hidden = self.decoder.config.hidden_size
                embeds = torch.zeros(B, length, hidden, dtype=self.decoder.embed_tokens.weight.dtype)
                return (ids, mask, positions, seq_ids, rope, embeds, torch.zeros(B, length, dtype=torch.int32), *state)
            return (ids, mask, positions, seq_ids, *state)
        pos = torch.zeros(B, 1, dtype=torch.int32)
        if kind == "image_token":
            return (ids[:, :1], pos, seq_ids, pos, *state)
        return (ids[:, :1], pos, seq_ids, *state)

    @property
    def prefix_cache_owner(self) -> tuple:
        """What a prefix cache's snapshots of this runner's state belong to (runtime/prefix_cache.py `bind`): this
        decoder's weights, and the state's layout."""
        return id(self.decoder), tuple((s.name, s.dtype) for s in self.state_specs)

    # The runner's calls (runtime/host_loop.py): the graphs update the state list in place.
    def context(self, length: int, all_logits: bool, key_length: int | None, *inputs: torch.Tensor):
        return self._graph("context", length, all_logits, key_length)(*inputs, *self.state)[0]

    def token(self, key_length: int, *inputs: torch.Tensor) -> torch.Tensor:
        return self._graph("token", 1, False, key_length)(*inputs, *self.state)[0]

    def image_context(self, length: int, all_logits: bool, key_length: int | None, *inputs: torch.Tensor):
        return self._graph("image_context", length, all_logits, key_length)(*inputs, *self.state)[0]

    def image_token(self, key_length: int, *inputs: torch.Tensor) -> torch.Tensor:
        return self._graph("image_token", 1, False, key_length)(*inputs, *self.state)[0]

    # Speculative decoding with the MTP head (runtime/speculative.py); eager modules, not traced.
    @property
    def has_mtp(self) -> bool:
        return self.decoder.mtp is not None

    def context_hidden(self, length: int, key_length: int | None, *inputs: torch.Tensor):
        """Context encoding that also returns the final-normed hidden states of every position: (logits of each
        row's last token [B, vocab], hidden [B, T, H])."""
        out = self.decoder.context_encoding(*inputs, *self.state, key_length=key_length, hidden=True)
        return out[0], out[1]

    def verify(self, key_length: int, ids, positions, lengths, seq_ids):
        """(logits [B, T, vocab], hidden [B, T, H]) of T verified tokens per row; the per-position DeltaNet states
        are held until `commit`."""
        out = self.decoder.verify(ids, positions, lengths, seq_ids, *self.state, key_length=key_length)
        n = len(self.state)
        self._verified, self.state[:] = list(out[2 : len(out) - n]), out[len(out) - n :]
        return out[0], out[1]

    def commit(self, seq_ids, accepted) -> None:
        """Each active row's DeltaNet states become those after its verified position accepted[b]."""
        if self._verified is None:
            raise UsageError("commit without a verify before it")
        self.state[:] = self.decoder.commit(seq_ids, accepted, *self._verified, *self.state)
        self._verified = None

    def set_draft_vocab(self, ids: torch.Tensor | None) -> None:
        """The head drafts over the token ids `ids` [V_d] only (runtime/draft_vocab.py); None: the whole vocabulary."""
        if not self.has_mtp:
            raise UsageError("a draft vocabulary needs the multi-token-prediction head: load the model with mtp=True")
        self.decoder.mtp.set_draft_vocab(self.decoder.lm_head, ids)
        self.draft_ids = None if ids is None else torch.as_tensor(ids, dtype=torch.int64)

    def mtp(self, key_length: int | None, ids, hidden, positions, lengths, seq_ids):
        """The MTP head over T positions per row: (logits [B, vocab], out [B, H]) at each row's last real one
        ([B, V_d] over `draft_ids` with a draft vocabulary)."""
        logits, out, *self.mtp_state[:] = self.decoder.mtp_forward(ids, hidden, positions, lengths, seq_ids,
                                                                   *self.mtp_state, key_length=key_length)
        return logits, out

    def vision(self, bucket: int, *inputs: torch.Tensor) -> torch.Tensor:
        return self.vision_encoder(*inputs)

    def close(self) -> None:
        self._graphs.clear()
