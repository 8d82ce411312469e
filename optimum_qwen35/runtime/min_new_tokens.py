"""transformers' `min_new_tokens` rule (its MinNewTokensLengthLogitsProcessor), one place for plain and speculative
decoding (runtime/generation.py, runtime/speculative.py): before that many new tokens, no EOS token can be chosen."""

from __future__ import annotations

import torch


def suppress_eos(logits: torch.Tensor, eos: list[int], index: int, min_new_tokens: int) -> torch.Tensor:
    """`logits` [..., vocab] choosing new token `index` (0: the first): a copy with the EOS columns at -inf while
    index < min_new_tokens, else `logits` itself."""
    if index >= min_new_tokens or not eos:
        return logits
    logits = logits.clone()
    logits[..., [t for t in eos if t < logits.shape[-1]]] = float("-inf")
    return logits
