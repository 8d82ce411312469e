"""The MTP head's draft vocabulary: a ranking of token ids, most frequent first, whose first V_d the head scores
(modeling/mtp.py `MTPHead.set_draft_vocab`), while verification keeps the whole vocabulary (runtime/speculative.py).

Two ways to rank, both written to one JSON file next to the checkpoint or export (`draft_vocab.json`: {"source": how
it was ranked, "vocab_size", "ranking": every token id, most frequent first}):

- `rank_by_counts`: token frequencies over a tokenized corpus (FR-Spec's way, Zhao et al. 2025). Ties (tokens the corpus
  never holds included) go to the lower id. Any corpus can be used; the better it matches what the model will be asked
  to write, the higher the acceptance at a given V_d.
- `rank_by_merges`: the tokenizer's BPE merge order as a proxy when no corpus is at hand: the 256 byte tokens first
  (by id), then each token in the order of the merge that makes it (BPE learns merges by pair frequency in its
  training corpus, so an early merge is a frequent token), then what no merge makes (added and special tokens) by id.

`use_draft_vocab(runtime, ranking, size)` makes a loaded runtime's head draft over the first `size` ranked ids.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import torch

from optimum_qwen35.errors import UsageError

DRAFT_VOCAB_FILE = "draft_vocab.json"


def rank_by_counts(sequences, vocab_size: int) -> list[int]:
    """Every id in [0, vocab_size), by descending count over `sequences` (lists of token ids), ties by id."""
    counts = Counter(t for s in sequences for t in s)
    if any(not 0 <= t < vocab_size for t in counts):
        raise UsageError(f"a corpus token id is outside the vocabulary [0, {vocab_size}): tokenize with the checkpoint's tokenizer")
    return sorted(range(vocab_size), key=lambda t: (-counts[t], t))


def rank_by_merges(tokenizer_file: str | os.PathLike, vocab_size: int) -> list[int]:
    """Every id in [0, vocab_size) by BPE merge order (tokenizer.json of a byte-level BPE tokenizer, as Qwen's)."""
    data = json.loads(Path(tokenizer_file).read_text())
    model = data.get("model", {})
    if model.get("type") != "BPE":
        raise UsageError(f"{tokenizer_file} is not a BPE tokenizer: rank the draft vocabulary from a corpus (rank_by_counts)")
    vocab = model["vocab"]
    rank = {}
    for i, merge in enumerate(model.get("merges", [])):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        token = vocab.get(left + right)
        if token is not None and token not in rank:
            rank[token] = i
    # Byte tokens (made by no merge, single characters of the byte-level alphabet) first, then merges, then the rest.
    def key(t: int):
        if t in rank:
            return (1, rank[t], t)
        return (0, 0, t) if t < 256 and t not in rank else (2, 0, t)

    return sorted(range(vocab_size), key=key)


def save_ranking(folder: str | os.PathLike, ranking: list[int], source: str) -> Path:
    """Write draft_vocab.json into `folder` (atomically) and return its path."""
    path = Path(folder) / DRAFT_VOCAB_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"source": source, "vocab_size": len(ranking), "ranking": ranking}))
    os.replace(tmp, path)
    return path


def load_ranking(folder: str | os.PathLike) -> list[int]:
    path = Path(folder) / DRAFT_VOCAB_FILE
    if not path.is_file():
        raise UsageError(f"{path} does not exist: write a draft vocabulary ranking first (runtime/draft_vocab.py save_ranking)")
    return json.loads(path.read_text())["ranking"]


def draft_ids(ranking: list[int], size: int | None, vocab_size: int) -> torch.Tensor | None:
    """The first `size` ranked ids (None or size >= vocab_size: the whole vocabulary, None)."""
    if size is None or size >= vocab_size:
        return None
    if size < 2:
        raise UsageError(f"draft vocabulary size {size}: pass at least 2 (or None for the whole vocabulary)")
    if sorted(ranking) != list(range(vocab_size)):
        raise UsageError(f"the draft vocabulary ranking is not a permutation of the {vocab_size} token ids: rebuild it for this checkpoint")
    return torch.tensor(ranking[:size], dtype=torch.int64)


def use_draft_vocab(runtime, ranking: list[int] | None, size: int | None) -> None:
    """Make `runtime`'s MTP head draft over the first `size` ids of `ranking` (None: the whole vocabulary)."""
    set_vocab = getattr(runtime.graphs, "set_draft_vocab", None)
    if set_vocab is None:
        raise UsageError("an export's draft vocabulary is chosen when it is exported (draft_vocab_size, tensor_parallel_size "
                         "1); on a checkpoint: Qwen35Runtime.from_pretrained(path, mtp=True)")
    vocab_size = runtime.config.vocab_size
    set_vocab(None if ranking is None else draft_ids(ranking, size, vocab_size))
