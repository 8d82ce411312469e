"""The host loop: what runs around the compiled graphs, the same for every way of running them.

Static shapes throughout, as on Neuron: a fixed number of sequence slots (the batch size), prompts right-padded to a
context-encoding bucket, one token per slot per generation step. `Qwen35Runtime` keeps each slot's encoded length and
rope delta, chooses the buckets, splits prompts longer than the largest context bucket into chunks that continue their
slot (chunked prefill), lets decode steps attend over the smallest cache bucket (`key_buckets`) that covers every
active position, runs waves of more prompts than slots, and places images (runtime/images.py `ImageInputs`).

This file holds the slots, the buckets and the two steps (`prefill`, `decode`) with teacher-forced `logits`; the
paths built on them are mixins in their own files, as transformers' `GenerationMixin`:

    GenerationMixin   runtime/generation.py      `generate`: plain decoding, and speculative decoding's waves
                                                 (runtime/speculative.py)
    PrefixCacheMixin  runtime/cached_prefill.py  `set_prefix_cache`, and `prefill` through the prefix cache
                                                 (runtime/prefix_cache.py)

The graphs themselves, their weights and the state they update in place belong to a graph runner:

    EagerGraphs      runtime/eager.py       the decoder's modules in this process (optionally traced)
    ExportedGraphs   runtime/exported.py    a cpu export's `torch.export` programs, one rank in this process
    WorkerPool       runtime/worker_pool.py the same programs, one worker process per tensor-parallel rank
    NxDGraphs        backends/nxd/runner.py a Neuron export's traced model (prompts holding images)
    TorchNeuronGraphs backends/torchneuron/runner.py a TorchNeuron export's graphs, `torch.compile`d on first use

A runner answers `context(length, all_logits, key_length, ids, mask, positions, seq_ids)`,
`token(key_length, ids, positions, seq_ids)`, their image forms `image_context(..., rope, embeds, image_mask)` and
`image_token(..., rope)`, `vision(bucket, *inputs)` when it has the vision tower, and `close()`. A runner with
per-position logits programs names their buckets (`logits_buckets`) and answers `scores(length, ids, mask,
positions, seq_ids, restore)`; `max_context_length` (or None) bounds what one context-encoding call takes.

    model = Qwen35Runtime.from_pretrained("path/to/Qwen3.5-checkpoint", batch_size=2, max_length=1024)
    logits = model.logits([[1, 2, 3], [4, 5]])               # per-position logits, one [len, vocab] each
    tokens = model.generate([[1, 2, 3], [4, 5]], max_new_tokens=32)   # greedy
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence

import torch

from optimum_qwen35 import validation
from optimum_qwen35.config import Qwen35Config
from optimum_qwen35.errors import IncompatibleExportError, UnsupportedModelError, UsageError
from optimum_qwen35.modeling.vision import VisionConfig
from optimum_qwen35.runtime.buckets import default_buckets, default_key_buckets
from optimum_qwen35.runtime.cached_prefill import PrefixCacheMixin
from optimum_qwen35.runtime.eager import EagerGraphs, load_decoder
from optimum_qwen35.runtime.exported import ExportedGraphs, read_graphs_manifest
from optimum_qwen35.runtime.generation import GenerationMixin
from optimum_qwen35.runtime.images import DEFAULT_IMAGE_BUCKETS, ImageInputs, load_vision_encoder
from optimum_qwen35.runtime.prefix_cache import PrefixCache
from optimum_qwen35.runtime.worker_pool import WorkerPool


class Qwen35Runtime(GenerationMixin, PrefixCacheMixin):
    """Greedy or sampled generation and teacher-forced logits through a graph runner's static-shape graphs."""

    def __init__(
        self,
        graphs,
        config: Qwen35Config,
        batch_size: int = 1,
        max_length: int = 1024,
        buckets: Sequence[int] | None = None,
        key_buckets: Sequence[int] | None = None,
        vision_config: VisionConfig | None = None,
        image_buckets: Sequence[int] | None = None,
        prefix_cache: PrefixCache | None = None,
    ):
        self.graphs, self.config = graphs, config
        self.batch_size = validation.positive_int(batch_size, "batch_size")
        self.max_length = validation.positive_int(max_length, "max_length")
        if buckets is not None and not isinstance(buckets, Sequence):
            raise UsageError(f"buckets must be a list of context lengths, got {type(buckets).__name__}")
        buckets = [validation.positive_int(b, "each bucket") for b in buckets or ()]
        self.buckets = sorted(set(buckets)) if buckets else default_buckets(max_length)
        if self.buckets[-1] > max_length:
            raise UsageError(
                f"bucket {self.buckets[-1]} is longer than max_length {max_length}; drop that bucket or raise max_length"
            )
        self.key_buckets = list(key_buckets) if key_buckets else default_key_buckets(self.max_length)
        # How many positions of each slot are encoded (prefill sets it, decode extends it): a step that would
        # leave a gap in the cache is refused.
        self.encoded = [0] * self.batch_size
        # Each slot's rope delta (modeling/vision.py `rope_index`): 0 after a text prompt, and decode steps run the
        # text graphs; after a prompt holding images, a token at position p rotates as p + delta.
        self.rope_deltas = [0] * self.batch_size
        self.images = None
        self._waves_logged = False  # `generate` says once per model that prompts run in waves
        if vision_config is not None:
            self.images = ImageInputs(vision_config, image_buckets or DEFAULT_IMAGE_BUCKETS, graphs.vision, config.hidden_size)
        self.prefix_cache = None
        # Tokens of each prompt of the last prefill that the prefix cache served (0: none, or no cache).
        self.last_prefix_hits: list[int] = []
        self.set_prefix_cache(prefix_cache)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_decoder(
        cls,
        decoder,
        batch_size: int = 1,
        max_length: int = 1024,
        buckets: Sequence[int] | None = None,
        trace: bool = False,
        pack_weights: bool = False,
        vision_encoder=None,
        image_buckets: Sequence[int] = DEFAULT_IMAGE_BUCKETS,
        prefix_cache: PrefixCache | None = None,
    ) -> "Qwen35Runtime":
        """The host loop over a loaded decoder's modules in this process (runtime/eager.py `EagerGraphs`; with
        `vision_encoder`, prompts may hold images). `pack_weights` prepacks the decoder's linears for oneDNN's CPU GEMM
        at this batch size (`modeling.torch_layers.pack_linears`; the decoder is changed in place, its `state_dict`
        is not; not with `trace`). `prefix_cache`: a `PrefixCache` (runtime/prefix_cache.py), or None (off: see
        `set_prefix_cache`)."""
        graphs = EagerGraphs(decoder, batch_size, max_length, trace, pack_weights, vision_encoder)
        vision = None if vision_encoder is None else vision_encoder.config
        return cls(graphs, decoder.config, batch_size, max_length, buckets, None, vision, image_buckets, prefix_cache)

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
        vision: bool = False,
        image_buckets: Sequence[int] = DEFAULT_IMAGE_BUCKETS,
        prefix_cache: PrefixCache | None = None,
        mtp: bool = False,
    ) -> "Qwen35Runtime":
        """Load a checkpoint folder (or a TP = 1 sharded export) and run it eagerly; sizes are checked before any
        weight is read. The decoder's linears are prepacked for the CPU GEMM unless `pack_weights=False`. `vision`:
        load the vision tower too (the checkpoint must have one), so that `logits` and `generate` take images.
        `prefix_cache`: a `PrefixCache` to reuse shared prompt prefixes (`set_prefix_cache`), None (off) by default.
        `mtp`: load the multi-token-prediction head too (a checkpoint folder), for `generate(...,
        num_speculative_tokens=k)`."""
        validation.positive_int(batch_size, "batch_size")
        validation.positive_int(max_length, "max_length")
        if vision is not True and vision is not False:
            raise UsageError(f"vision must be True or False, got {vision!r}")
        encoder = None
        if vision:
            path = validation.model_folder(path, "Qwen35Runtime.from_pretrained")
            config = Qwen35Config.from_pretrained(path)
            vision_config = VisionConfig.from_dict(config.raw)
            if vision_config is None:
                raise UnsupportedModelError(f"{path} has no vision tower (a text-only config); load it without vision=True")
            decoder = load_decoder(path, dtype, config=config, mtp=mtp)
            encoder = load_vision_encoder(path, vision_config, dtype)
        else:
            decoder = load_decoder(path, dtype, mtp=mtp)
        return cls.from_decoder(decoder, batch_size, max_length, buckets, trace, pack_weights, encoder, image_buckets,
                                prefix_cache)

    @classmethod
    def from_export(cls, folder: str | os.PathLike, graphs=None) -> "Qwen35Runtime":
        """The host loop over a cpu export's compiled programs: one rank in this process (`ExportedGraphs`), or one
        worker process per rank (`WorkerPool`); a vision export's programs take images. `graphs`: the runner of
        another backend over the same folder layout (a TorchNeuron export's, backends/torchneuron/runner.py)."""
        manifest = read_graphs_manifest(folder)
        config = ExportedGraphs.config_of(folder)
        tp_degree = manifest["tp_degree"]
        if graphs is None:
            if manifest.get("backend", "cpu") != "cpu":
                raise IncompatibleExportError(
                    f"{folder} is a {manifest['backend']} export, not a cpu one: load it with "
                    "Qwen35NeuronModelForCausalLM.from_pretrained, which picks its runner"
                )
            graphs = ExportedGraphs(folder, 0, manifest) if tp_degree == 1 else WorkerPool(folder, tp_degree, manifest)
        vision = manifest.get("vision")
        vision_config = VisionConfig.from_dict(config.raw) if vision else None
        return cls(graphs, config, manifest["batch_size"], manifest["max_length"], manifest["buckets"],
                   manifest["token_buckets"], vision_config, vision["image_buckets"] if vision else None)

    # ------------------------------------------------------------------ what the runner holds
    @property
    def decoder(self):
        """The eager runner's decoder (runtime/eager.py)."""
        return self.graphs.decoder

    @property
    def state(self) -> list[torch.Tensor]:
        """The state the graphs update in place, where it lives in this process (the eager and exported runners)."""
        return self.graphs.state

    @property
    def vision_config(self) -> VisionConfig | None:
        return None if self.images is None else self.images.vision_config

    def close(self) -> None:
        """Stop the runner's worker processes (if any) and drop its programs."""
        self.graphs.close()

    # ------------------------------------------------------------------ buckets and checks
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
        limit = getattr(self.graphs, "max_context_length", None)
        if limit is not None and length > limit:
            raise UsageError(
                f"a prompt of {length} tokens is longer than the compiled context length ({limit}): "
                "a prompt holding images runs in one context-encoding call; shorten it or export with a longer one"
            )

    def _forget_lost_state(self) -> None:
        """After a runner lost its state (a tensor-parallel worker died, or a call to the workers was interrupted:
        runtime/worker_pool.py `state_epoch`), every slot is empty: a step continuing one is refused."""
        epoch = getattr(self.graphs, "state_epoch", 0)
        if epoch != getattr(self, "_state_epoch", 0):
            self._state_epoch = epoch
            self.encoded = [0] * self.batch_size
            self.rope_deltas = [0] * self.batch_size

    def _check_slots(self, slots: Sequence[int]) -> list[int]:
        self._forget_lost_state()
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

    def _gap_message(self, step: str, position: int, slot: int) -> str:
        held = self.encoded[slot]
        what = "holds no sequence (prefill it first)" if held == 0 else f"holds positions 0..{held - 1}"
        return (
            f"{step} at position {position} in slot {slot} would leave a gap in the cache: the slot {what}; "
            f"the next position is {held}"
        )

    def _image_prompts(self, prompts, pixel_values, image_grid_thw):
        """The `ImagePrompt` of each prompt holding images (None for the others), or None without images."""
        if pixel_values is None and image_grid_thw is None:
            return None
        if self.images is None:
            raise UsageError("this model has no vision tower: pass text prompts only (no pixel_values / image_grid_thw)")
        return self.images.image_prompts(prompts, pixel_values, image_grid_thw)

    # ------------------------------------------------------------------ the two steps
    @torch.no_grad()
    def prefill(
        self,
        prompts: Sequence[Sequence[int]],
        slots: Sequence[int],
        all_logits: bool = False,
        starts: Sequence[int] | None = None,
        images: Sequence | None = None,
        prefix_cache: bool = True,
        hidden: bool = False,
    ):
        """Encode `prompts` in `slots` (one prompt per slot). Returns the logits of each prompt's last token
        [n, vocab] (or of every token, [n, len, vocab] padded to the longest prompt, with `all_logits`).

        A prompt starts a fresh sequence, or with `starts[i] > 0` continues slot i's sequence, whose first
        starts[i] tokens are already encoded. Prompts longer than the largest context bucket run in chunks.
        `images`: one entry per prompt, None for a text prompt or the `ImagePrompt` of a fresh prompt holding images
        (runtime/images.py: its 3-D rotary positions, image embeddings and rope delta); prompts holding images run
        the image context graphs, text-only calls the text graphs.

        With the runtime's prefix cache on (`set_prefix_cache`) and `prefix_cache` True, fresh text prompts go through
        it (`_prefill_cached`; `last_prefix_hits` says how many tokens of each it served); with `all_logits`, the
        positions it served have no logits (NaN there); `hidden` bypasses it.
        `hidden` (text prompts, a runner with the MTP head:
        runtime/speculative.py) returns (last-token logits, each prompt's final-normed hidden states [len, H])."""
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
        self.last_prefix_hits = [0] * len(prompts)
        if hidden and (with_images or all_logits):
            raise UsageError("prefill(hidden=True) takes text prompts and returns the last token's logits only")
        hiddens: list[list[torch.Tensor]] = [[] for _ in prompts]
        if prefix_cache and not hidden and self.prefix_cache is not None and not with_images and not any(starts):
            return self._prefill_cached(prompts, slots, all_logits)
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
                out = self.graphs.image_context(T, all_logits, key_length, ids, mask, positions, seq_ids, *extra)
            elif hidden:
                out, block_hidden = self.graphs.context_hidden(T, key_length, ids, mask, positions, seq_ids)
                for i, chunk in chunks.items():
                    hiddens[i].append(block_hidden[i, : len(chunk)])
            else:
                out = self.graphs.context(T, all_logits, key_length, ids, mask, positions, seq_ids)
            for i, chunk in chunks.items():
                results[i].append(out[i, : len(chunk)] if all_logits else out[i])
                done[i] += len(chunk)
        for p, s, slot, im in zip(prompts, starts, slots, images):
            self.encoded[slot] = s + len(p)
            if s == 0:
                self.rope_deltas[slot] = im.rope_delta if im is not None else 0
        if hidden:
            return torch.stack([r[-1] for r in results]), [torch.cat(h) for h in hiddens]
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
            logits = self.graphs.image_token(key_length, ids, pos, self._seq_ids(slots), rope)[: len(tokens)]
        else:
            logits = self.graphs.token(key_length, ids, pos, self._seq_ids(slots))[: len(tokens)]
        for position, slot in zip(positions, slots):
            self.encoded[slot] = position + 1
        return logits

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
    def logits(self, prompts: Sequence[Sequence[int]], pixel_values=None, image_grid_thw=None) -> list[torch.Tensor]:
        """Teacher-forced logits at every position: one [len(prompt), vocab] fp32 tensor per prompt (its images, if
        any, given in prompt order as the processor returns them). With per-position logits programs (an export),
        the slots they borrow get their state back: running sequences go on as if nothing had run. More prompts than
        the batch size run in waves."""
        prompts = validation.token_ids(prompts, self.config.vocab_size, allow_no_prompt=True)
        if getattr(self.graphs, "logits_buckets", None) is None:
            for p in prompts:
                self._check_length(len(p))  # every prompt is checked before the first graph runs
        else:  # the per-position logits programs check against their own largest bucket (`_scores`)
            if pixel_values is not None or image_grid_thw is not None:
                raise IncompatibleExportError(
                    "per-position logits of prompts holding images need the eager runtime (Qwen35Runtime.from_pretrained"
                    "(..., vision=True)); a compiled export generates from them"
                )
            return self._scores(prompts)
        images = self._image_prompts(prompts, pixel_values, image_grid_thw)
        results = []
        for start in range(0, len(prompts), self.batch_size):
            group = prompts[start : start + self.batch_size]
            group_images = None if images is None else images[start : start + self.batch_size]
            # Every position's logits: nothing served from the prefix cache.
            out = self.prefill(group, list(range(len(group))), all_logits=True, images=group_images, prefix_cache=False)
            results += [out[i, : len(p)].float() for i, p in enumerate(group)]
        return results

    @torch.no_grad()
    def _scores(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """`logits` through the runner's per-position logits programs (each row fresh from position 0)."""
        buckets = self.graphs.logits_buckets
        if not buckets:
            raise IncompatibleExportError(
                "this export has no per-position logits graphs (it was exported before forward() existed): "
                "export the model again"
            )
        for p in prompts:
            if len(p) > buckets[-1]:
                raise UsageError(
                    f"an input of {len(p)} tokens is longer than the compiled sequence length ({buckets[-1]}): "
                    "shorten it, or score it in windows of at most that many tokens"
                )
        results = []
        for first in range(0, len(prompts), self.batch_size):
            group = prompts[first : first + self.batch_size]
            T = buckets[bisect.bisect_left(buckets, max(len(p) for p in group))]
            ids = torch.zeros(self.batch_size, T, dtype=torch.int32)
            mask = torch.zeros(self.batch_size, T, dtype=torch.int32)
            positions = torch.zeros(self.batch_size, T, dtype=torch.int32)
            for row, prompt in enumerate(group):
                ids[row, : len(prompt)] = torch.as_tensor(prompt, dtype=torch.int32)
                mask[row, : len(prompt)] = 1
                positions[row, : len(prompt)] = torch.arange(len(prompt), dtype=torch.int32)
            slots = list(range(len(group)))
            out = self.graphs.scores(T, ids, mask, positions, self._seq_ids(slots), restore=slots)
            results += [out[row, : len(prompt)].float() for row, prompt in enumerate(group)]
        return results
