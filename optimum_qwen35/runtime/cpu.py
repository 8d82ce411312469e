"""The CPU target: the decoder's context-encoding and token-generation graphs, run the way Neuron runs them.

Static shapes throughout: a fixed number of sequence slots (the batch size), prompts right-padded to a
context-encoding bucket, one token per slot per generation step. The state list lives here, between
graph calls; the graphs update it in place.

Prompts longer than the largest context bucket run in chunks of at most that bucket, each continuing its slot
(chunked prefill); decode steps attend over the smallest cache bucket (`key_buckets`) that covers every
active position, not over the whole `max_length`.

    model = Qwen35ForCausalLM.from_pretrained("path/to/Qwen3.5-checkpoint", batch_size=2, max_length=1024)
    logits = model.logits([[1, 2, 3], [4, 5]])               # per-position logits, one [len, vocab] each
    tokens = model.generate([[1, 2, 3], [4, 5]], max_new_tokens=32)   # greedy
"""

from __future__ import annotations

import dataclasses

import bisect
import logging
import os
from collections.abc import Sequence

import torch

from .. import validation
from ..checkpoint import CheckpointReader, convert_checkpoint
from ..checkpoint.convert import check_finite
from ..config import Qwen35Config
from ..errors import CheckpointError, UsageError
from ..modeling.decoder import (
    ContextEncodingGraph,
    ImageContextEncodingGraph,
    ImageTokenGenerationGraph,
    Qwen35Decoder,
    TokenGenerationGraph,
)
from ..modeling.parallel import TorchLayers, pack_linears
from ..modeling.state import allocate_state

DEFAULT_BUCKET_MIN = 64
logger = logging.getLogger(__name__)


def load_decoder(
    path: str | os.PathLike,
    dtype: torch.dtype | str = torch.float32,
    tp_degree: int = 1,
    rank: int = 0,
    layers=None,
    config: Qwen35Config | None = None,
    check_weights: bool = True,
) -> Qwen35Decoder:
    """Build the decoder (this rank's share of it) and load its weights.

    `path` is a checkpoint folder (converted, and sharded when tp_degree > 1, on the fly) or a folder
    written by `optimum_qwen35.checkpoint.shard.save_sharded` (its tp_degree must match). `dtype` is a
    torch dtype or its name ("bfloat16", "bf16", ...). Weights holding NaN or Inf are refused, naming
    the tensor (`check_weights=False` skips that check; it exists to measure its cost).
    """
    from ..checkpoint.shard import is_sharded_export, load_sharded  # noqa: PLC0415

    dtype = validation.parse_dtype(dtype)
    path = validation.model_folder(path, "load_decoder")
    config = config or Qwen35Config.from_pretrained(path)
    config.check_tp_degree(tp_degree)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tp_degree:
        raise UsageError(f"rank must be an integer in [0, {tp_degree}), got {rank!r}")
    sharded_export = is_sharded_export(path)
    if sharded_export:
        saved, _, params = load_sharded(path, rank, tp_degree, dtype, check_weights)
        if config.is_moe:  # the experts as the export split them
            config = dataclasses.replace(config, moe_parallel=saved.moe_parallel)
    if layers is None:
        layers = TorchLayers(tp_degree, rank)  # this rank's vocabulary block; needs torch.distributed when t > 1
    with torch.device("meta"):
        decoder = Qwen35Decoder(config, tp_degree, layers)
    if sharded_export:
        pass
    elif tp_degree == 1:
        params = dict(convert_checkpoint(CheckpointReader(path), config, dtype))
    else:
        from ..checkpoint.shard import convert_and_shard  # noqa: PLC0415

        params = dict(convert_and_shard(CheckpointReader(path), config, tp_degree, rank, dtype))
    if check_weights and not sharded_export:  # load_sharded checked an export's weights
        check_finite(params, f"{path} (rank {rank} of {tp_degree})" if tp_degree > 1 else str(path))
    if config.tie_word_embeddings:
        params["lm_head.weight"] = params["embed_tokens.weight"]
    params.update(rank_tensors(rank))
    result = decoder.load_state_dict(params, strict=False, assign=True)
    if result.missing_keys or result.unexpected_keys:
        raise CheckpointError(
            f"{path}: decoder weights do not match: missing {result.missing_keys}, unexpected {result.unexpected_keys}"
        )
    if config.tie_word_embeddings:
        decoder.lm_head.weight = decoder.embed_tokens.weight
    return decoder.eval()


def rank_tensors(rank: int) -> dict[str, torch.Tensor]:
    """The per-rank tensors that are not checkpoint weights (loaded beside them, one graph for every rank)."""
    return {"embed_tokens.rank": torch.tensor([rank], dtype=torch.int64)}


def default_buckets(max_length: int, smallest: int = DEFAULT_BUCKET_MIN) -> list[int]:
    """Context-encoding lengths: powers of two from `smallest`, and max_length itself."""
    buckets, b = [], smallest
    while b < max_length:
        buckets.append(b)
        b *= 2
    return buckets + [max_length]


def default_key_buckets(max_length: int, smallest: int = DEFAULT_BUCKET_MIN) -> list[int]:
    """Decode cache lengths: powers of two from `smallest`, the midpoints between them, and max_length. A step then
    attends over at most 1.5x the positions it needs (2x with powers of two alone: at position 4096 of an 8192
    cache, the whole cache); each bucket is one more token graph, which costs nothing on CPU."""
    buckets = []
    for b in default_buckets(max_length, smallest)[:-1]:
        buckets += [b, b + b // 2]
    return sorted(b for b in buckets if b < max_length) + [max_length]


class Qwen35ForCausalLM:
    """Greedy generation and teacher-forced logits on CPU through the static-shape graphs."""

    def __init__(
        self,
        decoder: Qwen35Decoder,
        batch_size: int = 1,
        max_length: int = 1024,
        buckets: Sequence[int] | None = None,
        trace: bool = False,
        pack_weights: bool = False,
    ):
        """`pack_weights` prepacks the decoder's linears for oneDNN's CPU GEMM at this batch size
        (`modeling.parallel.Linear.pack`; the decoder is changed in place, its `state_dict` is not; not with `trace`)."""
        if not isinstance(decoder, Qwen35Decoder):
            raise UsageError(
                f"Qwen35ForCausalLM takes a loaded decoder, got {type(decoder).__name__}; to load a folder use "
                "Qwen35ForCausalLM.from_pretrained(path, ...)"
            )
        self._set_shapes(decoder.config, batch_size, max_length, buckets)
        self.key_buckets = default_key_buckets(self.max_length)
        self.decoder, self.trace = decoder, trace
        if pack_weights and not trace:  # a traced graph would hold the packed weights as constants
            pack_linears(decoder, batch_size)
        self.state_specs = decoder.state_specs(batch_size, max_length)
        self.state = allocate_state(self.state_specs)
        self._graphs: dict[tuple, torch.nn.Module] = {}

    def _set_shapes(self, config: Qwen35Config, batch_size: int, max_length: int, buckets: Sequence[int] | None) -> None:
        self.config = config
        self.batch_size = validation.positive_int(batch_size, "batch_size")
        self.max_length = validation.positive_int(max_length, "max_length")
        if buckets is not None and not isinstance(buckets, Sequence):
            raise UsageError(f"buckets must be a list of context lengths, got {type(buckets).__name__}")
        buckets = [validation.positive_int(b, "each bucket") for b in buckets or ()]
        self.buckets = sorted(set(buckets)) if buckets else default_buckets(max_length)
        # How many positions of each slot are encoded (prefill sets it, decode extends it): a step that would
        # leave a gap in the cache is refused.
        self.encoded = [0] * self.batch_size
        # Each slot's rope delta (modeling/vision.py `rope_index`): 0 after a text prompt, and decode steps run the
        # text graphs; after a prompt holding images, a token at position p rotates as p + delta.
        self.rope_deltas = [0] * self.batch_size
        if self.buckets[-1] > max_length:
            raise UsageError(
                f"bucket {self.buckets[-1]} is longer than max_length {max_length}; "
                "drop that bucket or raise max_length"
            )

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        batch_size: int = 1,
        max_length: int = 1024,
        dtype: torch.dtype | str = torch.float32,
        buckets: Sequence[int] | None = None,
        trace: bool = False,
        pack_weights: bool = True,
    ) -> "Qwen35ForCausalLM":
        """Load a checkpoint folder (or a TP = 1 export); sizes are checked before any weight is read. The decoder's
        linears are prepacked for the CPU GEMM unless `pack_weights=False` (see `__init__`)."""
        validation.positive_int(batch_size, "batch_size")
        validation.positive_int(max_length, "max_length")
        return cls(load_decoder(path, dtype), batch_size, max_length, buckets, trace, pack_weights)

    # ------------------------------------------------------------------ graphs
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
                embeds = torch.zeros(B, length, self.config.hidden_size, dtype=self.decoder.embed_tokens.weight.dtype)
                return (ids, mask, positions, seq_ids, rope, embeds, torch.zeros(B, length, dtype=torch.int32), *state)
            return (ids, mask, positions, seq_ids, *state)
        pos = torch.zeros(B, 1, dtype=torch.int32)
        if kind == "image_token":
            return (ids[:, :1], pos, seq_ids, pos, *state)
        return (ids[:, :1], pos, seq_ids, *state)

    def bucket_for(self, length: int) -> int:
        """The context bucket a block of `length` tokens runs in (longer blocks are split by `prefill`)."""
        return self.buckets[bisect.bisect_left(self.buckets, min(length, self.buckets[-1]))]

    def key_bucket_for(self, length: int) -> int:
        """The smallest cache bucket holding positions 0 .. length - 1."""
        return self.key_buckets[bisect.bisect_left(self.key_buckets, length)]

    def _check_length(self, length: int) -> None:
        if length > self.max_length:
            raise UsageError(
                f"prompt of {length} tokens is longer than the model's max_length ({self.max_length}); "
                "shorten the prompt or build the model with a larger max_length"
            )

    # ------------------------------------------------------------------ the two steps
    def _check_slots(self, slots: Sequence[int]) -> list[int]:
        if isinstance(slots, (str, bytes)) or not isinstance(slots, Sequence):
            raise UsageError(f"slots must be a list of slot numbers, got {type(slots).__name__}")
        slots = list(slots)
        if (
            any(not validation.is_int(s) for s in slots)
            or len(set(slots)) != len(slots)
            or any(not 0 <= s < self.batch_size for s in slots)
        ):
            raise UsageError(
                f"slots must be distinct and in [0, {self.batch_size}) (integers below the model's batch_size), got {slots}"
            )
        return [int(s) for s in slots]

    def _seq_ids(self, slots: Sequence[int]) -> torch.Tensor:
        """The graphs' static batch: one row per slot given, -1 (inactive, results dropped) for the rest."""
        seq_ids = torch.full((self.batch_size,), -1, dtype=torch.int32)
        seq_ids[: len(slots)] = torch.as_tensor(list(slots), dtype=torch.int32)
        return seq_ids

    @torch.no_grad()
    def prefill(
        self,
        prompts: Sequence[Sequence[int]],
        slots: Sequence[int],
        all_logits: bool = False,
        starts: Sequence[int] | None = None,
        images: Sequence | None = None,
    ):
        """Encode `prompts` in `slots` (one prompt per slot). Returns the logits of each prompt's last token
        [n, vocab] (or of every token, [n, len, vocab] padded to the longest prompt, with `all_logits`).

        A prompt starts a fresh sequence, or with `starts[i] > 0` continues slot i's sequence, whose first
        starts[i] tokens are already encoded. Prompts longer than the largest context bucket run in chunks.
        `images`: one entry per prompt, None for a text prompt or the `ImagePrompt` of a fresh prompt holding images
        (runtime/vision.py: its 3-D rotary positions, image embeddings and rope delta); prompts holding images run
        the image context graphs, text-only calls the text graphs."""
        prompts = validation.token_ids(prompts, self.config.vocab_size)
        slots = self._check_slots(slots)
        if len(prompts) != len(slots):
            raise UsageError(f"prefill needs one slot per prompt: got {len(prompts)} prompts and {len(slots)} slots")
        if starts is None:
            starts = [0] * len(prompts)
        starts = validation.int_list(starts, "starts", self.max_length, f"past max_length {self.max_length}")
        if len(starts) != len(prompts):
            raise UsageError(f"prefill needs one start per prompt: got {len(prompts)} prompts and {len(starts)} starts")
        for p, s, slot in zip(prompts, starts, slots):
            self._check_length(s + len(p))
            if s > self.encoded[slot]:
                raise UsageError(self._gap_message("prefill", s, slot))
        images = list(images) if images is not None else [None] * len(prompts)
        if len(images) != len(prompts) or any(im is not None and (s or len(im.mask) != len(p)) for im, p, s in zip(images, prompts, starts)):
            raise UsageError("prefill needs one image entry per prompt, each a fresh prompt (start 0) of its own length")
        with_images = any(im is not None for im in images)
        B, n, largest = self.batch_size, len(prompts), self.buckets[-1]
        done = [0] * n  # tokens of each prompt encoded so far
        results: list[list[torch.Tensor]] = [[] for _ in range(n)]
        while any(d < len(p) for d, p in zip(done, prompts)):
            rows = [i for i in range(n) if done[i] < len(prompts[i])]
            chunks = {i: prompts[i][done[i] : done[i] + largest] for i in rows}
            T = self.bucket_for(max(len(c) for c in chunks.values()))
            ids = torch.zeros(B, T, dtype=torch.int32)
            mask = torch.zeros(B, T, dtype=torch.int32)
            positions = torch.zeros(B, T, dtype=torch.int32)
            seq_ids = torch.full((B,), -1, dtype=torch.int32)
            for i, chunk in chunks.items():
                first = starts[i] + done[i]
                ids[i, : len(chunk)] = torch.as_tensor(list(chunk), dtype=torch.int32)
                mask[i, : len(chunk)] = 1
                positions[i, : len(chunk)] = torch.arange(first, first + len(chunk), dtype=torch.int32)
                seq_ids[i] = slots[i]
            # A block continuing a sequence reads the cached prefix: the graph's key length covers every row's end.
            end = max(starts[i] + done[i] + len(c) for i, c in chunks.items())
            continuing = any(starts[i] + done[i] > 0 for i in rows)
            key_length = max(T, self.key_bucket_for(end)) if continuing else None
            if with_images:
                extra = self._image_block(images, chunks, done, positions, T)
                out = self._run_image_context(T, all_logits, key_length, ids, mask, positions, seq_ids, *extra)
            else:
                out = self._run_context(T, all_logits, key_length, ids, mask, positions, seq_ids)
            for i, chunk in chunks.items():
                results[i].append(out[i, : len(chunk)] if all_logits else out[i])
                done[i] += len(chunk)
        for p, s, slot, im in zip(prompts, starts, slots, images):
            self.encoded[slot] = s + len(p)
            if s == 0:
                self.rope_deltas[slot] = im.rope_delta if im is not None else 0
        if not all_logits:
            return torch.stack([r[-1] for r in results])
        per_prompt = [torch.cat(r) for r in results]
        width = max(len(p) for p in prompts)
        return torch.stack([torch.nn.functional.pad(x, (0, 0, 0, width - x.shape[0])) for x in per_prompt])

    @torch.no_grad()
    def decode(self, tokens: Sequence[int], positions: Sequence[int], slots: Sequence[int]) -> torch.Tensor:
        """One token per slot at the given positions. Returns next-token logits [n, vocab]."""
        tokens = validation.token_id_list(tokens, self.config.vocab_size, "tokens")
        positions = validation.int_list(positions, "positions", self.max_length, f"past max_length {self.max_length}")
        slots = self._check_slots(slots)
        if not len(tokens) == len(positions) == len(slots):
            raise UsageError(
                f"decode needs one token and one position per slot: got {len(tokens)} tokens, "
                f"{len(positions)} positions, {len(slots)} slots"
            )
        for position, slot in zip(positions, slots):
            if position > self.encoded[slot]:
                raise UsageError(self._gap_message("decode", position, slot))
        ids = torch.zeros(self.batch_size, 1, dtype=torch.int32)
        pos = torch.zeros(self.batch_size, 1, dtype=torch.int32)
        ids[: len(tokens), 0] = torch.as_tensor(list(tokens), dtype=torch.int32)
        pos[: len(positions), 0] = torch.as_tensor(list(positions), dtype=torch.int32)
        key_length = self.key_bucket_for(max(positions) + 1)
        deltas = [self.rope_deltas[slot] for slot in slots]
        if any(deltas):  # a slot holding an image prompt: rotary positions are the cache positions + its delta
            rope = pos.clone()
            rope[: len(deltas), 0] += torch.as_tensor(deltas, dtype=torch.int32)
            logits = self._run_image_token(key_length, ids, pos, self._seq_ids(slots), rope)[: len(tokens)]
        else:
            logits = self._run_token(key_length, ids, pos, self._seq_ids(slots))[: len(tokens)]
        for position, slot in zip(positions, slots):
            self.encoded[slot] = position + 1
        return logits

    def _gap_message(self, step: str, position: int, slot: int) -> str:
        held = self.encoded[slot]
        what = "holds no sequence (prefill it first)" if held == 0 else f"holds positions 0..{held - 1}"
        return (
            f"{step} at position {position} in slot {slot} would leave a gap in the cache: the slot {what}; "
            f"the next position is {held}"
        )

    # The graph calls: the graphs update the state list in place (a compiled runtime keeps it elsewhere).
    def _run_context(self, length: int, all_logits: bool, key_length: int | None, *inputs: torch.Tensor):
        return self._graph("context", length, all_logits, key_length)(*inputs, *self.state)[0]

    def _run_token(self, key_length: int, *inputs: torch.Tensor) -> torch.Tensor:
        return self._graph("token", 1, False, key_length)(*inputs, *self.state)[0]

    def _run_image_context(self, length: int, all_logits: bool, key_length: int | None, *inputs: torch.Tensor):
        return self._graph("image_context", length, all_logits, key_length)(*inputs, *self.state)[0]

    def _run_image_token(self, key_length: int, *inputs: torch.Tensor) -> torch.Tensor:
        return self._graph("image_token", 1, False, key_length)(*inputs, *self.state)[0]

    def _image_block(self, images, chunks, done, positions, T):
        """The image context graph's extra inputs for one block: 3-D rotary positions [B, 3, T] (a text row's
        three components are its positions), image embeddings [B, T, hidden] and their mask [B, T]."""
        B = self.batch_size
        rope = positions[:, None].expand(B, 3, T).clone()
        dtype = next(im.embeds.dtype for im in images if im is not None)  # the vision tower's output: the model dtype
        embeds = torch.zeros(B, T, self.config.hidden_size, dtype=dtype)
        image_mask = torch.zeros(B, T, dtype=torch.int32)
        for i, chunk in chunks.items():
            if images[i] is not None:
                part = slice(done[i], done[i] + len(chunk))
                rope[i, :, : len(chunk)] = images[i].rope_positions[:, part]
                embeds[i, : len(chunk)] = images[i].embeds[part]
                image_mask[i, : len(chunk)] = images[i].mask[part]
        return rope, embeds, image_mask

    # ------------------------------------------------------------------ user-level calls
    def logits(self, prompts: Sequence[Sequence[int]], images: Sequence | None = None) -> list[torch.Tensor]:
        """Teacher-forced logits at every position: one [len(prompt), vocab] fp32 tensor per prompt (`images`: as
        `prefill`'s)."""
        prompts = validation.token_ids(prompts, self.config.vocab_size, allow_no_prompt=True)
        for p in prompts:
            self._check_length(len(p))  # every prompt is checked before the first graph runs
        results = []
        for start in range(0, len(prompts), self.batch_size):
            group = prompts[start : start + self.batch_size]
            group_images = None if images is None else images[start : start + self.batch_size]
            out = self.prefill(group, list(range(len(group))), all_logits=True, images=group_images)
            results += [out[i, : len(p)].float() for i, p in enumerate(group)]
        return results

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 32,
        eos_token_id: int | Sequence[int] | None = None,
        streamer=None,
        sampler=None,
        images: Sequence | None = None,
        stop=None,
        min_new_tokens: int = 0,
    ) -> list[list[int]]:
        """Greedy decoding (or `sampler(logits [n, vocab]) -> tokens [n]`); returns up to `max_new_tokens`
        (>= 1) new tokens of each prompt, stopping after an EOS token; `max_new_tokens` may also be one limit per
        prompt (each row stops at its own, the others run on). `min_new_tokens` (default 0): no EOS token is chosen
        before that many new tokens (transformers' `min_new_tokens`). Prompts beyond `batch_size` run in
        successive waves (logged once per model). `streamer(step, tokens)` is called once per step with the tokens of the wave's
        rows; `stop(first_row, new_tokens, logits) -> one bool per wave row` (optional) after each step, with the
        index of the wave's first prompt, each wave row's new tokens so far and the logits the step's tokens were
        chosen from: a row it flags finishes there, as after an EOS. Every argument is checked before the first
        graph runs."""
        prompts = validation.token_ids(prompts, self.config.vocab_size, allow_no_prompt=True)
        limits = self._new_token_limits(prompts, max_new_tokens)
        min_new_tokens = validation.positive_int(min_new_tokens, "min_new_tokens", minimum=0)
        eos = validation.eos_ids(eos_token_id)
        for name, fn in (("streamer", streamer), ("sampler", sampler), ("stop", stop)):
            if fn is not None and not callable(fn):
                raise UsageError(f"{name} must be a callable or None, got {type(fn).__name__}")
        choose = sampler or (lambda logits: logits.argmax(-1))

        def pick(logits: torch.Tensor, step: int) -> torch.Tensor:
            if step < min_new_tokens and eos:  # no EOS before min_new_tokens (transformers' MinNewTokensLogitsProcessor)
                logits = logits.clone()
                logits[:, [t for t in eos if t < logits.shape[-1]]] = float("-inf")
            return choose(logits)
        if len(prompts) > self.batch_size and not getattr(self, "_waves_logged", False):
            self._waves_logged = True
            logger.warning(
                "generate: %d prompts on a model of batch size %d run in %d successive waves of at most %d rows "
                "(logged once); build or export the model with a larger batch size to run them together",
                len(prompts), self.batch_size, -(-len(prompts) // self.batch_size), self.batch_size,
            )
        results: list[list[int]] = []
        for start in range(0, len(prompts), self.batch_size):
            group = prompts[start : start + self.batch_size]
            group_limits = limits[start : start + self.batch_size]
            slots = list(range(len(group)))
            group_images = None if images is None else images[start : start + self.batch_size]
            logits = self.prefill(group, slots, images=group_images)
            next_tokens = pick(logits, 0).tolist()
            positions = [len(p) for p in group]
            outputs = [[] for _ in group]
            done = [False] * len(group)
            steps = max(group_limits)
            for step in range(steps):
                for i in range(len(group)):
                    if not done[i]:
                        outputs[i].append(next_tokens[i])
                        done[i] = next_tokens[i] in eos or len(outputs[i]) >= group_limits[i]
                if streamer is not None:
                    streamer(step, next_tokens[: len(group)])
                if stop is not None:
                    done = [d or bool(f) for d, f in zip(done, stop(start, outputs, logits[: len(group)]))]
                if all(done) or step == steps - 1:
                    break
                # A row past its own limit is finished: it still rides along (its slot, its garbage tokens), held at
                # the last cache position so that it never runs past max_length.
                logits = self.decode(next_tokens, [min(p, self.max_length - 1) for p in positions], slots)
                next_tokens = pick(logits, step + 1).tolist()
                positions = [p + 1 for p in positions]
            results += outputs
        return results

    def _new_token_limits(self, prompts: Sequence[Sequence[int]], max_new_tokens) -> list[int]:
        """`max_new_tokens` (one int, or one per prompt) checked against each prompt: one limit per prompt."""
        if isinstance(max_new_tokens, Sequence) and not isinstance(max_new_tokens, (str, bytes)):
            if len(max_new_tokens) != len(prompts):
                raise UsageError(
                    f"max_new_tokens has {len(max_new_tokens)} limits for {len(prompts)} prompts: give one int or one per prompt"
                )
            limits = [validation.positive_int(n, "max_new_tokens") for n in max_new_tokens]
        else:
            limits = [validation.positive_int(max_new_tokens, "max_new_tokens")] * len(prompts)
        for p, limit in zip(prompts, limits):
            self._check_length(len(p))  # a prompt longer than max_length gets that error first
            if len(p) + limit > self.max_length:
                raise UsageError(
                    f"prompt ({len(p)} tokens) + max_new_tokens ({limit}) exceeds max_length "
                    f"{self.max_length}; lower max_new_tokens or build the model with a larger max_length"
                )
        return limits
