"""The graph runner of a cpu export: its `torch.export` programs, loaded without re-tracing, run in this process.

An export for the cpu target holds, beside its configs and tokenizer (export/layout.py; written by
export/compile.py):

    compiled/graphs.json                 what was compiled (sizes, buckets, dtype, weight and state order)
    compiled/context_encoding_<T>.pt2    one program per context-encoding bucket T
    compiled/context_logits_<T>.pt2      the same, returning the logits of every position (for `forward`)
    compiled/context_encoding_<T>_keys_<L>.pt2
                                         context encoding continuing a sequence, attending over L cache positions:
                                         the (T, L) pairs a prefix cache's resumed pieces run (graphs.json
                                         "prefix_cache": its block size and pairs; absent in older exports)
    compiled/token_generation_<L>.pt2    one token-generation program per cache bucket L (attends to L positions)
    checkpoint/rank_<r>.safetensors      each rank's weights (`checkpoint.sharded_files.save_sharded`)

and, in an export made with mtp=True (graphs.json "mtp"), speculative decoding with the
checkpoint's multi-token-prediction head (runtime/speculative.py; K the most drafts per round, "max_speculative_tokens"):

    compiled/context_hidden_<T>.pt2            context encoding returning every position's hidden state
    compiled/verify_<K+1>_keys_<L>.pt2         the main model over K + 1 positions per row, per cache bucket L
    compiled/commit_<K+1>.pt2                  each row's DeltaNet states after its accepted position
    compiled/mtp_<T>_keys_<L>.pt2              the head over T positions (a prompt's bucket, 1: a draft, K + 1: catch-up)
    checkpoint/mtp.safetensors                 the head's weights (mtp_rank_<r>.safetensors: rank r's share, at TP > 1)

and, in a vision export (tensor_parallel_size 1):

    compiled/vision_<N>.pt2                    the vision tower, one program per image bucket of N patch rows
    compiled/image_context_encoding_<T>.pt2    context encoding of prompts holding images
    compiled/image_token_generation_<L>.pt2    decode steps after them (rotary position = position + rope delta)
    checkpoint/vision.safetensors              the vision tower's weights (converted: modeling/vision.py)

`ExportedGraphs` runs one rank's programs in this process (with its weights and its state list);
runtime/worker_pool.py's `WorkerPool` runs t ranks in t worker processes, each an `ExportedGraphs`. Both answer the
host loop's calls (runtime/host_loop.py) through `ProgramRunner`, by program name.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from optimum_qwen35.checkpoint.sharded_files import load_mtp_weights, load_sharded
from optimum_qwen35.config import Qwen35Config
from optimum_qwen35.errors import IncompatibleExportError, UsageError
from optimum_qwen35.export.layout import (
    CHECKPOINT_DIR,
    COMPILED_DIR,
    GRAPHS_FILE,
    GRAPHS_FORMAT,
    GRAPHS_VERSION,
    commit_graph_name,
    context_graph_name,
    context_hidden_graph_name,
    continuing_context_graph_name,
    image_context_graph_name,
    image_token_graph_name,
    logits_graph_name,
    mtp_graph_name,
    token_graph_name,
    verify_graph_name,
    vision_graph_name,
)
from optimum_qwen35.modeling.mtp import DRAFT_HEAD_WEIGHT
from optimum_qwen35.modeling.state import StateSpec, allocate_state
from optimum_qwen35.patches import torch_export_files_faster
from optimum_qwen35.runtime.eager import rank_tensors
from optimum_qwen35.runtime.prefix_cache import StateInProcess


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


def manifest_state_specs(entries: list[dict]) -> list[StateSpec]:
    """The state a graphs.json lists (its "state", or "mtp"'s "state"): name, shape and dtype of each tensor."""
    return [StateSpec(s["name"], tuple(s["shape"]), _dtype(s["dtype"])) for s in entries]


def load_rank_weights(folder: str | os.PathLike, manifest: dict, rank: int) -> list[torch.Tensor]:
    """One rank's weight inputs, in program order, from the export's `checkpoint/` shards."""
    _, _, params = load_sharded(Path(folder) / CHECKPOINT_DIR, rank, manifest["tp_degree"], _dtype(manifest["dtype"]))
    params.update(rank_tensors(rank))
    missing = [n for n in manifest["weights"] if n not in params]
    if missing:
        raise IncompatibleExportError(
            f"{Path(folder) / CHECKPOINT_DIR} lacks weights the compiled graphs take: {missing[:5]}; export the model again"
        )
    return [params[n] for n in manifest["weights"]]


def load_vision_weights(folder: str | os.PathLike, manifest: dict) -> list[torch.Tensor]:
    """The vision programs' weight inputs, in program order."""
    file = Path(folder) / CHECKPOINT_DIR / manifest["vision"]["file"]
    if not file.is_file():
        raise IncompatibleExportError(f"{file} is missing: the export's vision graphs have no weights; export the model again")
    params = load_file(os.fspath(file))
    missing = [n for n in manifest["vision"]["weights"] if n not in params]
    if missing:
        raise IncompatibleExportError(f"{file} lacks weights the vision graphs take: {missing[:5]}; export the model again")
    return [params[n] for n in manifest["vision"]["weights"]]


@contextlib.contextmanager
def slots_restored(state: list[torch.Tensor], slots: list[int] | None):
    """The state of `slots` put back as it was once the block ends (a scoring pass borrows slots that sequences
    running through prefill / decode hold); nothing for no slots."""
    if not slots:
        yield
        return
    index = torch.as_tensor(slots, dtype=torch.int64, device=state[0].device)
    saved = [s.index_select(0, index) for s in state]
    try:
        yield
    finally:
        for tensor, before in zip(state, saved):
            tensor.index_copy_(0, index, before)


class ProgramRunner:
    """The host loop's calls (runtime/host_loop.py) answered by a cpu export's programs, by name: `run(name, *inputs,
    restore)` is the subclass's (this process, or its worker processes)."""

    manifest: dict

    def run(self, name: str, *inputs: torch.Tensor, restore: list[int] | None = None) -> torch.Tensor:
        raise NotImplementedError

    @property
    def has_mtp(self) -> bool:
        """Whether the export holds the speculative-decoding programs (made with mtp=True)."""
        return "mtp" in self.manifest

    @property
    def max_speculative_tokens(self) -> int:
        return self.manifest["mtp"]["max_speculative_tokens"] if self.has_mtp else 0

    @functools.cached_property
    def draft_ids(self) -> torch.Tensor | None:
        """The MTP head's draft vocabulary (an export made with draft_vocab_size): token ids [V_d]; None for the
        whole vocabulary (runtime/speculative.py `_widen`)."""
        ids = self.manifest.get("mtp", {}).get("draft_ids")
        return None if ids is None else torch.as_tensor(ids, dtype=torch.int64)

    @property
    def logits_buckets(self) -> list[int]:
        return self.manifest.get("logits_buckets", [])  # none in exports made before forward() existed

    @property
    def prefix_block_size(self) -> int | None:
        """The block size this export's continuing context programs were compiled for (None: it has none)."""
        return self.manifest.get("prefix_cache", {}).get("block_size")

    @property
    def prefix_cache_owner(self):
        """What a prefix cache's snapshots of this runner's state belong to (runtime/prefix_cache.py `bind`): the
        export (its folder and manifest: weights, state layout, TP degree); None for an export without continuing
        context programs, which cannot resume a sequence."""
        if self.prefix_block_size is None:
            return None
        digest = hashlib.sha256(json.dumps(self.manifest, sort_keys=True).encode()).hexdigest()
        return "cpu export", os.path.realpath(self.folder), digest

    def context(self, length: int, all_logits: bool, key_length: int | None, *inputs: torch.Tensor):
        if all_logits:
            raise IncompatibleExportError(
                "compiled context-encoding graphs return the last token's logits only; per-position logits "
                "need the eager runtime (optimum_qwen35.runtime.Qwen35Runtime.from_pretrained)"
            )
        if key_length is None or key_length == length:  # (a row continues its slot when its first position is > 0)
            return self.run(context_graph_name(length), *inputs)
        name = continuing_context_graph_name(length, key_length)
        if name not in self.manifest["graphs"]:
            raise IncompatibleExportError(
                f"this export has no context-encoding program of {length} tokens continuing a sequence over "
                f"{key_length} cache positions ({name}): its context programs "
                + ("start fresh sequences only; " if self.prefix_block_size is None else
                   f"continue prefix-cache blocks of {self.prefix_block_size} tokens only; ")
                + "continuing a sequence's prompt otherwise needs the eager runtime "
                "(optimum_qwen35.runtime.Qwen35Runtime.from_pretrained)"
            )
        return self.run(name, *inputs)

    def token(self, key_length: int, *inputs: torch.Tensor) -> torch.Tensor:
        return self.run(token_graph_name(key_length), *inputs)

    def image_context(self, length: int, all_logits: bool, key_length: int | None, *inputs: torch.Tensor):
        if key_length is not None or all_logits:
            raise IncompatibleExportError(
                "compiled image context-encoding graphs start fresh prompts and return the last token's logits only; "
                "longer prompts or per-position logits need the eager runtime (runtime/host_loop.py, vision=True)"
            )
        return self.run(image_context_graph_name(length), *inputs)

    def image_token(self, key_length: int, *inputs: torch.Tensor) -> torch.Tensor:
        return self.run(image_token_graph_name(key_length), *inputs)

    def scores(self, length: int, *inputs: torch.Tensor, restore: list[int]) -> torch.Tensor:
        """The per-position logits program of `length`; the slots in `restore` get their state back."""
        return self.run(logits_graph_name(length), *inputs, restore=restore)

    @staticmethod
    def config_of(folder: str | os.PathLike) -> Qwen35Config:
        return Qwen35Config.from_pretrained(Path(folder) / CHECKPOINT_DIR)


def load_mtp_program_weights(folder: str | os.PathLike, manifest: dict, weights: list[torch.Tensor],
                             rank: int) -> list[torch.Tensor]:
    """The speculative programs' weight inputs, in their order: the rank's weights (`weights`, in the manifest's
    order) and its share of the MTP head's (checkpoint/mtp.safetensors, or mtp_rank_<r> at TP > 1)."""
    params = dict(zip(manifest["weights"], weights))
    params.update(load_mtp_weights(Path(folder) / CHECKPOINT_DIR, _dtype(manifest["dtype"]), rank, manifest["tp_degree"]))
    if "draft_ids" in manifest["mtp"]:  # the draft vocabulary's rows of lm_head (tp_degree 1: lm_head is whole)
        lm_head = params.get("lm_head.weight", params.get("embed_tokens.weight"))  # (tied: the embedding's)
        params[DRAFT_HEAD_WEIGHT] = lm_head.index_select(0, torch.as_tensor(manifest["mtp"]["draft_ids"])).contiguous()
    missing = [n for n in manifest["mtp"]["weights"] if n not in params]
    if missing:
        raise IncompatibleExportError(f"{Path(folder) / CHECKPOINT_DIR} lacks weights the MTP graphs take: {missing[:5]}; export the model again")
    return [params[n] for n in manifest["mtp"]["weights"]]


def pad_positions(x: torch.Tensor, positions: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, T, ...] zero-padded to `width` positions, and positions [B, T] continued: the padding lies past each
    row's `lengths`, so a program writes none of it and the caller reads none of its outputs."""
    pad = width - x.shape[1]
    if pad <= 0:
        return x, positions
    x = torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], 1)
    steps = torch.arange(1, pad + 1, dtype=positions.dtype)
    return x, torch.cat([positions, positions[:, -1:] + steps], 1)


class SpeculativePrograms:
    """Speculative decoding's calls (runtime/speculative.py, as runtime/eager.py `EagerGraphs` answers them) by an
    export's programs, where the export holds them (graphs.json "mtp"). The subclass runs a program with `call(name,
    *inputs, state=...)` (all its outputs; the state list updated in place) and holds `mtp_state`, the head's K/V
    cache. Verify and the head's catch-up run the export's K + 1 positions; a round of fewer drafts is padded."""

    manifest: dict
    state: list[torch.Tensor]
    mtp_state: list[torch.Tensor]
    _verified: list[torch.Tensor] | None = None  # verify's per-position DeltaNet states, held until commit

    def call(self, name: str, *inputs: torch.Tensor, state: list[torch.Tensor]) -> tuple:
        raise NotImplementedError

    def _speculative(self, name: str, *inputs: torch.Tensor, state: list[torch.Tensor]) -> tuple:
        if name not in self.manifest["graphs"]:
            raise IncompatibleExportError(
                f"this export has no speculative-decoding program {name!r} (prompts longer than the largest context "
                "bucket, or a cache bucket it was not built for): use the eager runtime, Qwen35Runtime.from_pretrained(path, mtp=True)"
            )
        return self.call(name, *inputs, state=state)

    def context_hidden(self, length: int, key_length: int | None, *inputs: torch.Tensor):
        """(logits of each row's last token [B, vocab], hidden [B, T, H]) of fresh prompts in bucket `length`."""
        if key_length not in (None, length):  # (a prompt longer than the largest bucket: the export's is max_length)
            raise IncompatibleExportError(
                "this export's speculative programs encode prompts of at most its largest context bucket in one piece: "
                "use the eager runtime, Qwen35Runtime.from_pretrained(path, mtp=True)"
            )
        out = self._speculative(context_hidden_graph_name(length), *inputs, state=self.state)
        return out[0].cpu(), out[1].cpu()

    def verify(self, key_length: int, ids, positions, lengths, seq_ids):
        """(logits [B, T, vocab], hidden [B, T, H]) of T verified tokens per row; the per-position DeltaNet states are
        held until `commit`."""
        T, width = ids.shape[1], self.max_speculative_tokens + 1
        padded, padded_positions = pad_positions(ids, positions, width)
        out = self._speculative(verify_graph_name(width, key_length), padded, padded_positions, lengths, seq_ids,
                                state=self.state)
        self._verified = list(out[2 : len(out) - len(self.state)])
        return out[0][:, :T].cpu(), out[1][:, :T].cpu()

    def commit(self, seq_ids, accepted) -> None:
        """Each active row's DeltaNet states become those after its verified position accepted[b]."""
        if self._verified is None:
            raise UsageError("commit without a verify before it")
        width = self.max_speculative_tokens + 1
        self._speculative(commit_graph_name(width), seq_ids, accepted, *self._verified, state=self.state)
        self._verified = None

    def mtp(self, key_length: int | None, ids, hidden, positions, lengths, seq_ids):
        """The MTP head over T positions per row: (logits [B, vocab], out [B, H]) at each row's last real one. A
        catch-up over fewer than K + 1 positions runs the K + 1 program, padded."""
        T = ids.shape[1]
        key_length = key_length or T
        if mtp_graph_name(T, key_length) not in self.manifest["graphs"] and T < self.max_speculative_tokens + 1:
            width = self.max_speculative_tokens + 1
            hidden, _ = pad_positions(hidden, positions, width)
            ids, positions = pad_positions(ids, positions, width)
            T = width
        out = self._speculative(mtp_graph_name(T, key_length), ids, hidden, positions, lengths, seq_ids,
                                state=self.mtp_state)
        return out[0].cpu(), out[1].cpu()


class ExportedGraphs(StateInProcess, SpeculativePrograms, ProgramRunner):
    """One rank's compiled programs, its weights and its state; programs are loaded on first use."""

    def __init__(self, folder: str | os.PathLike, rank: int = 0, manifest: dict | None = None):
        self.folder = Path(folder)
        self.manifest = manifest or read_graphs_manifest(folder)
        self.rank = rank
        self.weights = load_rank_weights(folder, self.manifest, rank)
        self.state_specs = manifest_state_specs(self.manifest["state"])
        self.state = allocate_state(self.state_specs)
        self._programs: dict[str, nn.Module] = {}
        self.vision_weights = None
        if "vision" in self.manifest:
            self.vision_weights = load_vision_weights(folder, self.manifest)
        # Speculative decoding (an export made with mtp=True): the head's weights and its own K/V cache.
        self.mtp_weights, self.mtp_state = None, []
        if self.has_mtp:
            self.mtp_weights = load_mtp_program_weights(folder, self.manifest, self.weights, rank)
            self.mtp_state = allocate_state(manifest_state_specs(self.manifest["mtp"]["state"]))

    def program(self, name: str) -> nn.Module:
        if name not in self._programs:
            entry = self.manifest["graphs"].get(name)
            if entry is None:
                raise IncompatibleExportError(f"this export has no graph {name!r}; it has {sorted(self.manifest['graphs'])}")
            torch_export_files_faster()  # the same programs in about half the time (patches/torch_export.py)
            self._programs[name] = torch.export.load(self.folder / COMPILED_DIR / entry["file"]).module()
        return self._programs[name]

    @torch.no_grad()
    def run(self, name: str, *inputs: torch.Tensor, restore: list[int] | None = None) -> torch.Tensor:
        """Run graph `name` on `inputs` (token ids, ..., seq_ids), updating this rank's state; returns the logits.

        `restore`: slots whose state is put back as it was before the call (a scoring pass borrows them)."""
        with slots_restored(self.state, restore):
            return self.program(name)(self.weights, *inputs, *self.state)[0]

    @torch.no_grad()
    def call(self, name: str, *inputs: torch.Tensor, state: list[torch.Tensor]) -> tuple:
        """A speculative-decoding program (graphs.json "mtp"): all its outputs; `state` updated in place."""
        return self.program(name)(self.mtp_weights, *inputs, *state)

    @torch.no_grad()
    def vision(self, bucket: int, *inputs: torch.Tensor) -> torch.Tensor:
        """The vision tower's program of image bucket `bucket` (no state)."""
        return self.program(vision_graph_name(bucket))(self.vision_weights, *inputs)

    def close(self) -> None:
        self._programs.clear()
