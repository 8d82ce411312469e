"""The prefix cache: a prompt's state at block boundaries, kept in host memory so that a later prompt starting with the
same tokens resumes context encoding there instead of at token 0.

A Qwen3.5 slot's state is the KV cache of the attention layers (one row per position) and, per DeltaNet layer, a conv
state and a recurrent state that summarise every position so far and cannot be cut back to an earlier one. So the
cache keeps, for each full block of `block_size` tokens a prompt has encoded (block k: positions
[k * block_size, (k + 1) * block_size)), a snapshot of the slot taken right after that block:

    attention layer  K and V of the block's positions     [kv_heads, block_size, head_dim] each, model dtype
    DeltaNet layer   the conv state and recurrent state    [conv_channels, kernel - 1] model dtype, [heads, dk, dv] fp32
                     at the block's end

A prompt whose first n blocks are cached gets the KV of blocks 0 .. n - 1 and the DeltaNet states of block n - 1,
and context encoding resumes at position n * block_size (runtime/cached_prefill.py). `snapshot_bytes` is what one block
holds (`block_bytes_per_layer` splits it by layer kind).

Keys are a hash chain over the blocks, as vLLM's block hashing: block k's key hashes block k - 1's key with block
k's tokens, so a key names the whole prefix. A key only finds an entry; the entry is returned only if its own copy of
the prefix's tokens equals the prompt's (`PrefixCache.lookup`): a hash collision misses, it never returns another
prefix's state. Entries are evicted least recently used first, under a byte budget; an insert or a lookup makes a
chain's earlier blocks more recently used than its later ones, so eviction takes the ends of chains first (a chain
with a missing block is useless past it; an orphan left behind is evicted in its turn). Every method takes one lock: runtimes in several threads may share one cache. Snapshots are never written
after they are stored; a caller copies out of them.

The cache belongs to one model (its weights and its state layout): `bind(owner)` ties it to the first runtime's model
and refuses another's.
"""

from __future__ import annotations

import bisect
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from optimum_qwen35 import validation
from optimum_qwen35.config import FULL_ATTENTION
from optimum_qwen35.errors import UsageError
from optimum_qwen35.modeling.parallel import ShardedDims

DEFAULT_BLOCK_SIZE = 256
DEFAULT_BUDGET_BYTES = 4 * 2**30
CHUNK_SIZE = 64  # the delta rule's chunk (kernels/gated_delta_rule CHUNK_SIZE): block boundaries are chunk boundaries

# The key of the empty prefix, where every chain starts.
ROOT_KEY = b"optimum-qwen35 prefix cache v1"


def block_hash(parent: bytes, tokens: bytes) -> bytes:
    """The key of a block: its parent's key and its own tokens (int32 bytes). A module-level function so that a test
    can force collisions; nothing trusts it to be collision-free."""
    return hashlib.blake2b(parent + tokens, digest_size=16).digest()


def token_bytes(tokens: Sequence[int]) -> bytes:
    return torch.as_tensor(list(tokens), dtype=torch.int32).numpy().tobytes()


@dataclass
class Entry:
    key: bytes
    prefix: bytes  # the int32 bytes of every token of the prefix up to this block's end: what a hit is checked on
    snapshot: list[torch.Tensor]  # one tensor per state tensor (see the module's docstring), never written
    nbytes: int


class PrefixCache:
    """Per-block state snapshots of encoded prompts, keyed by their token prefix (see the module's docstring).

    `block_size`: tokens per block, a multiple of the delta rule's chunk (64); `budget_bytes`: the most the snapshots
    (and their token copies) may hold; least recently used blocks go first."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, budget_bytes: int = DEFAULT_BUDGET_BYTES):
        block_size = validation.positive_int(block_size, "block_size")
        if block_size % CHUNK_SIZE:
            raise UsageError(f"block_size must be a multiple of the delta rule's chunk ({CHUNK_SIZE}), got {block_size}")
        self.block_size = block_size
        self.budget_bytes = validation.positive_int(budget_bytes, "budget_bytes")
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._lock = threading.Lock()
        self._owner = None
        self.hits = self.misses = self.evictions = 0  # blocks found, lookups that found no block, blocks evicted

    # ------------------------------------------------------------------ ownership
    def bind(self, owner) -> None:
        """Tie the cache to one model (`owner`: what names its weights and state layout); another model is refused."""
        with self._lock:
            if self._owner is None:
                self._owner = owner
            elif self._owner != owner:
                raise UsageError(
                    "this prefix cache holds another model's states: give each model (weights and state layout) its own "
                    "PrefixCache"
                )

    # ------------------------------------------------------------------ keys
    def keys(self, tokens: Sequence[int]) -> list[bytes]:
        """The key of each full block of `tokens`."""
        keys, parent = [], ROOT_KEY
        for k in range(len(tokens) // self.block_size):
            parent = block_hash(parent, token_bytes(tokens[k * self.block_size : (k + 1) * self.block_size]))
            keys.append(parent)
        return keys

    # ------------------------------------------------------------------ reads and writes
    def lookup(self, tokens: Sequence[int], keys: list[bytes] | None = None) -> list[Entry]:
        """The entries of the longest run of cached blocks starting at token 0 (block 0, 1, ...), each checked on
        its tokens: an entry whose prefix differs from `tokens` ends the run (a collision is a miss)."""
        keys = self.keys(tokens) if keys is None else keys
        found = []
        with self._lock:
            for k, key in enumerate(keys):
                entry = self._entries.get(key)
                end = (k + 1) * self.block_size
                if entry is None or entry.prefix != token_bytes(tokens[:end]):
                    break
                found.append(entry)
            for entry in reversed(found):  # the chain's first blocks end most recently used
                self._entries.move_to_end(entry.key)
            self.hits += len(found)
            self.misses += not found
        return found

    def contains(self, tokens: Sequence[int], key: bytes) -> bool:
        """Whether the block ending at len(tokens) (a multiple of the block size) is cached for exactly these tokens."""
        with self._lock:
            entry = self._entries.get(key)
            return entry is not None and entry.prefix == token_bytes(tokens)

    def insert(self, tokens: Sequence[int], key: bytes, snapshot: list[torch.Tensor], parents: Sequence[bytes] = ()) -> bool:
        """Store the snapshot taken after the block ending at len(tokens); returns whether it is held (a snapshot
        larger than the whole budget is not). `parents`: the keys of the blocks before it, made more recently used
        than it, so that the budget evicts this block before them. An entry under the same key is replaced (the same
        prefix: the same state; a colliding one: the newer prefix wins, the older then misses)."""
        if len(tokens) % self.block_size or not tokens:
            raise UsageError(f"a cached prefix is whole blocks of {self.block_size} tokens, got {len(tokens)}")
        prefix = token_bytes(tokens)
        nbytes = len(prefix) + sum(t.numel() * t.element_size() for t in snapshot)
        if nbytes > self.budget_bytes:
            return False
        entry = Entry(key, prefix, snapshot, nbytes)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._entries[key] = entry
            self._bytes += nbytes
            for parent in reversed(parents):
                if parent in self._entries:
                    self._entries.move_to_end(parent)
            while self._bytes > self.budget_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes
                self.evictions += 1
        return True

    def touch(self, keys: list[bytes]) -> None:
        """Make these blocks (a chain's, first to last) the most recently used, the first ones last evicted."""
        with self._lock:
            for key in reversed(keys):
                if key in self._entries:
                    self._entries.move_to_end(key)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes held now (snapshots and their token copies)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)


# ---------------------------------------------------------------------------- a slot's state, block by block
KV_NAMES = ("key_cache", "value_cache")
DELTANET_NAMES = ("conv_state", "recurrent_state")


def _kind(name: str) -> str:
    kind = name.rpartition(".")[2]
    if kind not in KV_NAMES + DELTANET_NAMES:
        raise UsageError(f"state tensor {name!r} is neither a KV cache nor a DeltaNet state: no prefix cache for it")
    return kind


def take_block(state: list[torch.Tensor], names: list[str], slot: int, start: int, end: int) -> list[torch.Tensor]:
    """The snapshot of `slot` after the block [start, end): the block's K/V rows, the DeltaNet states as they are
    (copies: the slot goes on changing)."""
    out = []
    for tensor, name in zip(state, names):
        if _kind(name) in KV_NAMES:
            out.append(tensor[slot, :, start:end].clone())
        else:
            out.append(tensor[slot].clone())
    return out


def restore_blocks(state: list[torch.Tensor], names: list[str], slot: int, snapshots: list[list[torch.Tensor]],
                   block_size: int) -> None:
    """Write a run of cached blocks' snapshots (block 0 .. len(snapshots) - 1) into `slot`: every block's K/V at its
    positions, the last block's DeltaNet states."""
    for i, (tensor, name) in enumerate(zip(state, names)):
        if _kind(name) in KV_NAMES:
            for k, snapshot in enumerate(snapshots):
                tensor[slot, :, k * block_size : (k + 1) * block_size].copy_(snapshot[i])
        else:
            tensor[slot].copy_(snapshots[-1][i])


class StateInProcess:
    """A runner's snapshot and restore of one slot when its state list (`state`, named by `state_specs`) lives in
    this process: the eager runner and one rank of a cpu export. A runner whose state lives elsewhere (the
    tensor-parallel `WorkerPool`: in its worker processes) answers the same two calls its own way."""

    state: list[torch.Tensor]
    state_specs: list

    def take_block(self, slot: int, start: int, end: int) -> list[torch.Tensor]:
        return take_block(self.state, [s.name for s in self.state_specs], slot, start, end)

    def restore_blocks(self, slot: int, snapshots: list[list[torch.Tensor]], block_size: int) -> None:
        restore_blocks(self.state, [s.name for s in self.state_specs], slot, snapshots, block_size)


# ---------------------------------------------------------------------------- the graphs of a cached prefill
def piece_graph(start: int, end: int, buckets: Sequence[int], key_buckets: Sequence[int]) -> tuple[int, int | None]:
    """The graph a piece [start, end) of a cached prefill runs in: the context bucket of its length and, when it
    continues its slot (start > 0), its key length, the cache bucket of its end (at least the context bucket); None
    for a prompt's first, fresh piece. It depends on the piece alone: a cold and a warm run pick the same graphs."""
    length = buckets[bisect.bisect_left(buckets, min(end - start, buckets[-1]))]
    if not start:
        return length, None
    return length, max(length, key_buckets[bisect.bisect_left(key_buckets, end)])


def continuing_graphs(buckets: Sequence[int], key_buckets: Sequence[int], max_length: int,
                      block_size: int) -> list[tuple[int, int]]:
    """Every (context bucket, key length) the continuing pieces of a cached prefill can run in, with blocks of
    `block_size` tokens up to `max_length`; pairs whose key length is the context bucket are left out (the
    fresh-prompt context graph of that bucket is the same computation: fresh or continuing is decided per row
    from its positions)."""
    pairs = set()
    for start in range(block_size, max_length, block_size):
        for end in range(start + 1, min(start + block_size, max_length) + 1):
            length, key_length = piece_graph(start, end, buckets, key_buckets)
            if key_length > length:
                pairs.add((length, key_length))
    return sorted(pairs)


def export_block_size(max_length: int) -> int | None:
    """The block size an export's continuing context programs are compiled for: 256 tokens (`DEFAULT_BLOCK_SIZE`),
    or a quarter of a shorter max_length rounded down to the delta rule's chunk (at least one chunk); None when no
    block would leave a token after it (max_length of one chunk)."""
    block = min(DEFAULT_BLOCK_SIZE, max(CHUNK_SIZE, max_length // 4 // CHUNK_SIZE * CHUNK_SIZE))
    return block if block < max_length else None


def block_bytes_per_layer(config, block_size: int, dtype_bytes: int, tp_degree: int = 1) -> dict[str, int]:
    """Bytes one cached block holds per layer of each kind (per rank at `tp_degree`): an attention layer's K and V of
    the block's positions, a DeltaNet layer's conv state (model dtype) and recurrent state (fp32)."""
    dims = ShardedDims.from_config(config, tp_degree)
    attention = 2 * dims.num_kv_heads * block_size * config.head_dim * dtype_bytes
    conv = dims.linear_conv_dim * (config.linear_conv_kernel_dim - 1) * dtype_bytes
    recurrent = dims.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
    return {"attention": attention, "deltanet": conv + recurrent, "deltanet_conv": conv, "deltanet_recurrent": recurrent}


def snapshot_bytes(config, block_size: int, dtype_bytes: int, tp_degree: int = 1) -> int:
    """Bytes one cached block holds for the whole model (per rank at `tp_degree`), tokens aside."""
    per = block_bytes_per_layer(config, block_size, dtype_bytes, tp_degree)
    n_attention = sum(t == FULL_ATTENTION for t in config.layer_types)
    return n_attention * per["attention"] + (len(config.layer_types) - n_attention) * per["deltanet"]
