"""Prefill through the prefix cache (runtime/prefix_cache.py `PrefixCache`): the host loop's path that resumes a fresh
text prompt from its longest cached run of blocks, and stores the slot's state after each full block it encodes.

`PrefixCacheMixin` is one of `Qwen35Runtime`'s bases (runtime/host_loop.py): it uses the runtime's graph runner,
buckets and slot bookkeeping (`graphs`, `buckets`, `key_buckets`, `batch_size`, `encoded`, `rope_deltas`,
`last_prefix_hits`); `prefill` hands it fresh text prompts when a cache is set.
"""

from __future__ import annotations

import torch

from optimum_qwen35.errors import IncompatibleExportError, UsageError
from optimum_qwen35.runtime.prefix_cache import PrefixCache, piece_graph


class PrefixCacheMixin:
    """`set_prefix_cache` and `prefill`'s prefix-cached path (`_prefill_cached`)."""

    prefix_cache: PrefixCache | None

    def set_prefix_cache(self, cache: PrefixCache | None) -> None:
        """Turn prefix caching on (a `PrefixCache`, which several runtimes of the same model may share) or off (None).

        With a cache, `prefill` of fresh text prompts (start 0, no images) runs context encoding in blocks of the
        cache's block size at block-aligned positions, stores the slot's state after each full block, and resumes a
        prompt whose first blocks are cached from the last of them: the same operations on the same inputs as a cold
        run with the cache on, so a hit gives the same logits, bit for bit. It needs a runner
        whose context graphs continue a sequence: `EagerGraphs` (any block size), or a cpu export compiled with
        continuing context programs (`ExportedGraphs`, `WorkerPool`: the export's block size; docs/prefix_caching.md)."""
        if cache is None:
            self.prefix_cache = None
            return
        if not isinstance(cache, PrefixCache):
            raise UsageError(f"prefix_cache must be a PrefixCache or None, got {type(cache).__name__}")
        owner = getattr(self.graphs, "prefix_cache_owner", None)
        if owner is None:
            raise IncompatibleExportError(
                f"prefix caching needs a runner whose context graphs continue a sequence (the eager runtime, "
                f"Qwen35Runtime.from_pretrained, or a cpu export made with continuing context programs); this "
                f"{type(self.graphs).__name__} has none: export the model again (docs/prefix_caching.md)"
            )
        block = getattr(self.graphs, "prefix_block_size", None)
        if block is not None and cache.block_size != block:
            raise UsageError(
                f"this export's continuing context programs were compiled for blocks of {block} tokens, the prefix "
                f"cache's are {cache.block_size}: use PrefixCache(block_size={block}, ...)"
            )
        if cache.block_size > self.buckets[-1]:
            raise UsageError(
                f"the prefix cache's block_size ({cache.block_size}) is longer than the largest context bucket "
                f"({self.buckets[-1]}): a block runs in one context-encoding call; choose a smaller block_size"
            )
        cache.bind(owner)
        self.prefix_cache = cache

    def _prefill_cached(self, prompts: list[list[int]], slots: list[int], all_logits: bool):
        """`prefill` of fresh text prompts through the prefix cache.

        Each prompt restores its longest cached run of blocks into its slot (at most up to its last token, which is
        always computed: its logits are the result) and encodes the rest in pieces that end at block boundaries:
        piece [s, e) runs in the context bucket of e - s tokens, attending over the cache bucket of e (none for the
        first, fresh piece), so a piece's graph depends on the prompt's length and the piece's place only, never on
        the other rows or on where the hit ended. A call runs every row whose next piece has the graph of the row
        furthest behind. After a full block the slot's state is stored (`take_block`), unless the cache has it."""
        cache, bs = self.prefix_cache, self.prefix_cache.block_size
        B, n = self.batch_size, len(prompts)
        keys = [cache.keys(p) for p in prompts]
        done = []
        for p, slot, chain in zip(prompts, slots, keys):
            entries = cache.lookup(p, chain)[: (len(p) - 1) // bs]
            if entries:
                self.graphs.restore_blocks(slot, [e.snapshot for e in entries], bs)
            done.append(len(entries) * bs)
        self.last_prefix_hits = list(done)
        results: list[list[torch.Tensor]] = [[] for _ in range(n)]

        def piece(i):
            return done[i], min(len(prompts[i]), (done[i] // bs + 1) * bs)

        def graph(i):
            return piece_graph(*piece(i), self.buckets, self.key_buckets)

        while any(d < len(p) for d, p in zip(done, prompts)):
            rows = [i for i in range(n) if done[i] < len(prompts[i])]
            T, key_length = graph(min(rows, key=lambda i: done[i]))
            rows = [i for i in rows if graph(i) == (T, key_length)]
            ids = torch.zeros(B, T, dtype=torch.int32)
            mask = torch.zeros(B, T, dtype=torch.int32)
            positions = torch.zeros(B, T, dtype=torch.int32)
            seq_ids = torch.full((B,), -1, dtype=torch.int32)
            for i in rows:
                start, end = piece(i)
                ids[i, : end - start] = torch.as_tensor(prompts[i][start:end], dtype=torch.int32)
                mask[i, : end - start] = 1
                positions[i, : end - start] = torch.arange(start, end, dtype=torch.int32)
                seq_ids[i] = slots[i]
            out = self.graphs.context(T, all_logits, key_length, ids, mask, positions, seq_ids)
            for i in rows:
                start, end = piece(i)
                results[i].append(out[i, : end - start] if all_logits else out[i])
                done[i] = end
                if end - start == bs:  # a full block (pieces start at block boundaries)
                    prefix, key = prompts[i][:end], keys[i][end // bs - 1]
                    if not cache.contains(prefix, key):
                        cache.insert(prefix, key, self.graphs.take_block(slots[i], start, end), keys[i][: end // bs - 1])
        for p, slot, chain in zip(prompts, slots, keys):
            cache.touch(chain)
            self.encoded[slot] = len(p)
            self.rope_deltas[slot] = 0
        if not all_logits:
            return torch.stack([r[-1] for r in results])
        width = max(len(p) for p in prompts)
        out = torch.full((n, width, results[0][0].shape[-1]), float("nan"), dtype=results[0][0].dtype)
        for i, (r, hit) in enumerate(zip(results, self.last_prefix_hits)):
            logits = torch.cat(r)
            out[i, hit : hit + logits.shape[0]] = logits
        return out
