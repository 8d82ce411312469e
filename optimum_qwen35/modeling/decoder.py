"""The Qwen3.5 text decoder: embeddings, the layer stack by `layer_types`, the final norm and lm_head.

It has two entry points, written the way Neuron traces them (static shapes, no data-dependent Python
control flow, no tensor of rank above 4):

- `context_encoding(input_ids, attention_mask, position_ids, seq_ids, *state)`: right-padded prompts
  [B, T] (T is the bucket length) start fresh sequences in the slots `seq_ids` (-1: an inactive row
  whose results are dropped); returns the logits of
  each prompt's last real token [B, vocab] (or of every position [B, T, vocab] when built with
  `all_logits=True`), then the updated state list.
- `token_generation(input_ids, position_ids, seq_ids, *state)`: one token per sequence [B, 1] at
  position position_ids [B, 1]; returns the next-token logits [B, vocab], then the updated state.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import FULL_ATTENTION, Qwen35Config
from .attention import GatedAttention
from .deltanet import GatedDeltaNet
from .layers import MLP, RMSNorm, RotaryEmbedding, upcast
from .parallel import ShardedDims, TorchLayers
from .state import Slots, StateSpec, state_specs


class DecoderLayer(nn.Module):
    def __init__(self, config: Qwen35Config, layer_type: str, dims: ShardedDims, layers):
        super().__init__()
        self.is_attention = layer_type == FULL_ATTENTION
        if self.is_attention:
            self.self_attn = GatedAttention(config, dims, layers)
        else:
            self.linear_attn = GatedDeltaNet(config, dims, layers)
        self.mlp = MLP(config.hidden_size, dims.intermediate_size, layers)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def _norm(self, norm: RMSNorm, h: torch.Tensor) -> torch.Tensor:
        """The residual stream is fp32; what enters a linear layer is in the weights' dtype."""
        return norm(h).to(self.input_layernorm.weight.dtype)

    def _finish(self, residual, mixed):
        h = residual + mixed
        return h + self.mlp(self._norm(self.post_attention_layernorm, h))

    def context_encoding(self, h, cos, sin, valid, lengths, slots, state_a, state_b):
        x = self._norm(self.input_layernorm, h)
        if self.is_attention:
            mixed, state_a, state_b = self.self_attn.context_encoding(x, cos, sin, valid, slots, state_a, state_b)
        else:
            mixed, state_a, state_b = self.linear_attn.context_encoding(x, lengths, slots, state_a, state_b)
        return self._finish(h, mixed), state_a, state_b

    def token_generation(self, h, cos, sin, position_ids, slots, state_a, state_b):
        x = self._norm(self.input_layernorm, h)
        if self.is_attention:
            mixed, state_a, state_b = self.self_attn.token_generation(x, cos, sin, position_ids, slots, state_a, state_b)
        else:
            mixed, state_a, state_b = self.linear_attn.token_generation(x, slots, state_a, state_b)
        return self._finish(h, mixed), state_a, state_b


class Qwen35Decoder(nn.Module):
    """One rank's share of the model (the whole model at tp_degree 1)."""

    def __init__(self, config: Qwen35Config, tp_degree: int = 1, layers=None):
        super().__init__()
        self.config = config
        self.dims = ShardedDims.from_config(config, tp_degree)
        layers = layers if layers is not None else TorchLayers(tp_degree)
        self.embed_tokens = layers.embedding(self.dims.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, t, self.dims, layers) for t in config.layer_types)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = layers.lm_head(config.hidden_size, self.dims.vocab_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta)

    def state_specs(self, slots: int, max_length: int) -> list[StateSpec]:
        return state_specs(self.config, self.dims, slots, max_length, self.embed_tokens.weight.dtype)

    def context_encoding(self, input_ids, attention_mask, position_ids, seq_ids, *state, all_logits: bool = False):
        slots = Slots(seq_ids, state[0].shape[0])
        valid = attention_mask.to(torch.bool)
        lengths = attention_mask.to(torch.int64).sum(-1)
        h = upcast(self.embed_tokens(input_ids))
        cos, sin = self.rotary(position_ids, h.dtype)
        new_state = []
        for i, layer in enumerate(self.layers):
            h, a, b = layer.context_encoding(h, cos, sin, valid, lengths, slots, state[2 * i], state[2 * i + 1])
            new_state += [a, b]
        if not all_logits:
            # Only the last real token of each prompt feeds lm_head.
            last = (lengths - 1).clamp(min=0)[:, None, None].expand(-1, 1, h.shape[-1])
            h = torch.gather(h, 1, last)[:, 0]
        logits = self.lm_head(self.norm(h))
        return (logits, *new_state)

    def token_generation(self, input_ids, position_ids, seq_ids, *state):
        slots = Slots(seq_ids, state[0].shape[0])
        h = upcast(self.embed_tokens(input_ids))
        cos, sin = self.rotary(position_ids, h.dtype)
        new_state = []
        for i, layer in enumerate(self.layers):
            h, a, b = layer.token_generation(h, cos, sin, position_ids, slots, state[2 * i], state[2 * i + 1])
            new_state += [a, b]
        logits = self.lm_head(self.norm(h))[:, 0]
        return (logits, *new_state)


class ContextEncodingGraph(nn.Module):
    """Flat-argument wrapper of `context_encoding`, the module that is traced."""

    def __init__(self, decoder: Qwen35Decoder, all_logits: bool = False):
        super().__init__()
        self.decoder, self.all_logits = decoder, all_logits

    def forward(self, input_ids, attention_mask, position_ids, seq_ids, *state):
        return self.decoder.context_encoding(
            input_ids, attention_mask, position_ids, seq_ids, *state, all_logits=self.all_logits
        )


class TokenGenerationGraph(nn.Module):
    """Flat-argument wrapper of `token_generation`, the module that is traced."""

    def __init__(self, decoder: Qwen35Decoder):
        super().__init__()
        self.decoder = decoder

    def forward(self, input_ids, position_ids, seq_ids, *state):
        return self.decoder.token_generation(input_ids, position_ids, seq_ids, *state)
