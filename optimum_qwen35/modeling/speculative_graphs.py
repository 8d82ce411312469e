"""The speculative-decoding steps as flat-argument modules, the form a graph is traced in (as `ContextEncodingGraph`
and `TokenGenerationGraph` in modeling/decoder.py): tensors in, a tuple of tensors out, every static choice (the
key length) fixed at construction. Every tensor stays rank <= 4 (the per-position DeltaNet states included), so
that the Neuron compiler can take them.

- `VerifyGraph`: (input_ids [B, T], position_ids [B, T], lengths [B], seq_ids [B], *state) -> (logits [B, T, vocab],
  hidden [B, T, H], the per-position DeltaNet states, then the state);
- `CommitGraph`: (seq_ids [B], accepted [B], *per-position states, *state) -> the state;
- `ContextHiddenGraph`: context encoding with the hidden states of every position;
- `MTPGraph`: (input_ids [B, T], hidden [B, T, H], position_ids [B, T], lengths [B], seq_ids [B], k_cache, v_cache)
  -> (logits [B, vocab], out [B, H], k_cache, v_cache).
"""

from __future__ import annotations

from torch import nn

from .decoder import Qwen35Decoder


class VerifyGraph(nn.Module):
    def __init__(self, decoder: Qwen35Decoder, key_length: int | None = None):
        super().__init__()
        self.decoder, self.key_length = decoder, key_length

    def forward(self, input_ids, position_ids, lengths, seq_ids, *state):
        return self.decoder.verify(input_ids, position_ids, lengths, seq_ids, *state, key_length=self.key_length)


class CommitGraph(nn.Module):
    def __init__(self, decoder: Qwen35Decoder):
        super().__init__()
        self.decoder = decoder

    def forward(self, seq_ids, accepted, *tensors):
        return self.decoder.commit(seq_ids, accepted, *tensors)


class MTPGraph(nn.Module):
    def __init__(self, decoder: Qwen35Decoder, key_length: int | None = None):
        super().__init__()
        self.decoder, self.key_length = decoder, key_length

    def forward(self, input_ids, hidden, position_ids, lengths, seq_ids, k_cache, v_cache):
        return self.decoder.mtp_forward(input_ids, hidden, position_ids, lengths, seq_ids, k_cache, v_cache,
                                        key_length=self.key_length)


class ContextHiddenGraph(nn.Module):
    """Context encoding that also returns the final-normed hidden states of every position (what the MTP head reads
    after a prompt): (logits [B, vocab], hidden [B, T, H], then the state)."""

    def __init__(self, decoder: Qwen35Decoder, key_length: int | None = None):
        super().__init__()
        self.decoder, self.key_length = decoder, key_length

    def forward(self, input_ids, attention_mask, position_ids, seq_ids, *state):
        return self.decoder.context_encoding(input_ids, attention_mask, position_ids, seq_ids, *state,
                                             key_length=self.key_length, hidden=True)
