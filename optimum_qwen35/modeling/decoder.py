"""The Qwen3.5 text decoder: embeddings, the layer stack by `layer_types`, the final norm and lm_head.

It has two entry points, written the way Neuron traces them (static shapes, no data-dependent Python
control flow, no tensor of rank above 4). Both return the state tensors after the logits, in the order they came,
with only what they write changed (`state.py`): the same tensor objects written in place where the layer factory
says so (`state_in_place`: the CPU runtime), updated copies otherwise (the Neuron graphs, whose state outputs are
aliased to their inputs).

- `context_encoding(input_ids, attention_mask, position_ids, seq_ids, *state)`: right-padded prompt blocks
  [B, T] (T is the bucket length) for the slots `seq_ids` (-1: an inactive row that writes nothing). A row
  whose first position is 0 starts a fresh sequence; a row starting at position p > 0 continues its slot,
  whose first p positions are already encoded (chunked prefill: a long prompt runs through buckets no larger
  than the largest one). Attention reads the first `key_length` cached positions (static; the block length
  by default, which serves fresh prompts). Returns the logits of each block's last real token [B, vocab] (or
  of every position [B, T, vocab] with `all_logits=True`), then the state.
- `token_generation(input_ids, position_ids, seq_ids, *state)`: one token per sequence [B, 1] at position
  position_ids [B, 1] (a row at position 0 starts a new sequence from zero DeltaNet states: optimum-neuron
  serves a 1-token prompt this way); attention reads the first `key_length` cached positions (a decode bucket covering
  every active position; the whole cache by default). Returns the next-token logits [B, vocab], then the state.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import FULL_ATTENTION, Qwen35Config
from ..errors import UnsupportedModelError
from ..kernels.gated_delta_rule import CHUNK_SIZE
from .attention import GatedAttention
from .deltanet import GatedDeltaNet
from .layers import MLP, RMSNorm, RotaryEmbedding, upcast
from .moe import SparseMoeBlock
from .mtp import MTPHead, mtp_state_specs
from .parallel import ShardedDims
from .torch_layers import TorchLayers
from .state import Slots, StateSpec, state_specs


class DecoderLayer(nn.Module):
    def __init__(self, config: Qwen35Config, layer_type: str, dims: ShardedDims, layers):
        super().__init__()
        self.is_attention = layer_type == FULL_ATTENTION
        if self.is_attention:
            self.self_attn = GatedAttention(config, dims, layers)
        else:
            self.linear_attn = GatedDeltaNet(config, dims, layers)
        if config.is_moe:
            self.mlp = SparseMoeBlock(config, layers)
        else:
            self.mlp = MLP(config.hidden_size, dims.intermediate_size, layers)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.token_block = layers.token_block  # the backend's (modeling/parallel.py TorchLayers)

    def _norm(self, norm: RMSNorm, h: torch.Tensor) -> torch.Tensor:
        """The residual stream is fp32; what enters a linear layer is in the weights' dtype."""
        return norm(h).to(self.input_layernorm.weight.dtype)

    def _finish(self, residual, mixed):
        h = residual + mixed
        return h + self.mlp(self._norm(self.post_attention_layernorm, h))

    def block_tokens(self, batch: int) -> int | None:
        """Tokens per token block for `batch` rows: `token_block` rows (batch x tokens) in all, in whole delta-rule
        chunks, at least one. None: the whole block at once."""
        if self.token_block is None:
            return None
        return max(CHUNK_SIZE, self.token_block // batch // CHUNK_SIZE * CHUNK_SIZE)

    def context_encoding(self, h, cos, sin, position_ids, starts, lengths, key_length, slots, state_a, state_b):
        B, T = h.shape[:2]
        block = self.block_tokens(B)
        if block is None or T <= block:
            return self._context_block(h, cos, sin, position_ids, starts, lengths, key_length, slots, state_a, state_b)
        # A long block runs as consecutive token blocks, each continuing its slots from the previous one (chunked
        # prefill inside the layer: K/V written to the cache, conv and recurrent states carried in place), so that
        # the projections, the delta rule's intermediates and the MLP hold one token block at a time. Same math:
        # a token block is whole delta-rule chunks, attention still reads `key_length` cached positions.
        outputs = []
        for start in range(0, T, block):
            end = min(start + block, T)
            # Only the first token block can start a sequence; the next ones continue what it wrote.
            block_slots = slots if start == 0 else Slots(slots.seq_ids, torch.zeros_like(slots.fresh), slots.in_place,
                                                         slots.graph_form)
            out, state_a, state_b = self._context_block(
                h[:, start:end], cos[:, :, start:end], sin[:, :, start:end], position_ids[:, start:end],
                starts + start, (lengths - start).clamp(0, end - start), key_length, block_slots, state_a, state_b,
            )
            outputs.append(out)
        return torch.cat(outputs, dim=1), state_a, state_b

    def _context_block(self, h, cos, sin, position_ids, starts, lengths, key_length, slots, state_a, state_b):
        x = self._norm(self.input_layernorm, h)
        if self.is_attention:
            mixed, state_a, state_b = self.self_attn.context_encoding(
                x, cos, sin, position_ids, starts, lengths, key_length, slots, state_a, state_b
            )
        else:
            mixed, state_a, state_b = self.linear_attn.context_encoding(x, lengths, slots, state_a, state_b)
        return self._finish(h, mixed), state_a, state_b

    def verify(self, h, cos, sin, position_ids, starts, lengths, key_length, slots, state_a, state_b):
        """T consecutive tokens per row continuing its slot (speculative verification, `Qwen35Decoder.verify`).
        Attention writes K/V at the row's valid positions and attends as in context encoding; a DeltaNet layer
        leaves its slot states as they are and returns the states after each position instead. Returns
        (h, state_a, state_b, per-position states: () or (conv [B, T, C, K - 1], recurrent [B, T * nv, dk, dv]))."""
        x = self._norm(self.input_layernorm, h)
        if self.is_attention:
            mixed, state_a, state_b = self.self_attn.verify(
                x, cos, sin, position_ids, starts, lengths, key_length, slots, state_a, state_b
            )
            return self._finish(h, mixed), state_a, state_b, ()
        mixed, convs, recurrents = self.linear_attn.verify(x, slots, state_a, state_b)
        return self._finish(h, mixed), state_a, state_b, (convs, recurrents)

    def token_generation(self, h, cos, sin, position_ids, key_length, slots, state_a, state_b):
        x = self._norm(self.input_layernorm, h)
        if self.is_attention:
            mixed, state_a, state_b = self.self_attn.token_generation(
                x, cos, sin, position_ids, key_length, slots, state_a, state_b
            )
        else:
            mixed, state_a, state_b = self.linear_attn.token_generation(x, slots, state_a, state_b)
        return self._finish(h, mixed), state_a, state_b


class Qwen35Decoder(nn.Module):
    """One rank's share of the model (the whole model at tp_degree 1)."""

    def __init__(self, config: Qwen35Config, tp_degree: int = 1, layers=None, mtp: bool = False):
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
        if config.is_moe:  # expert parallelism reads the rank from the embedding's rank tensor
            for layer in self.layers:
                layer.mlp.bind_rank(self.embed_tokens)
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.mrope_section)
        # The multi-token-prediction head (modeling/mtp.py), opt-in: the plain model neither builds nor reads it.
        self.mtp = None
        if mtp:
            if config.mtp_num_hidden_layers < 1:
                raise UnsupportedModelError("this checkpoint's config has no multi-token-prediction head (mtp_num_hidden_layers)")
            head_layers = [DecoderLayer(config, FULL_ATTENTION, self.dims, layers) for _ in range(config.mtp_num_hidden_layers)]
            self.mtp = MTPHead(config, head_layers, layers)
            if config.is_moe:
                for layer in self.mtp.layers:
                    layer.mlp.bind_rank(self.embed_tokens)
        # In place on CPU (a decode step moves only what it writes), updated copies in the Neuron graphs.
        self.state_in_place = layers.state_in_place
        # The device graphs' index forms (int32, rank <= 4) with the state written in place: TorchNeuron.
        self.state_graph_form = getattr(layers, "state_graph_form", False)

    def state_specs(self, slots: int, max_length: int) -> list[StateSpec]:
        return state_specs(self.config, self.dims, slots, max_length, self.embed_tokens.weight.dtype)

    def mtp_state_specs(self, slots: int, max_length: int) -> list[StateSpec]:
        """The MTP head's KV cache (empty without the head), apart from the decoder's state."""
        if self.mtp is None:
            return []
        return mtp_state_specs(self.config, self.dims, slots, max_length, self.embed_tokens.weight.dtype)

    def context_encoding(
        self, input_ids, attention_mask, position_ids, seq_ids, *state, all_logits: bool = False, key_length=None,
        image=None, hidden: bool = False,
    ):
        """`hidden`: return the final-normed hidden states of every position [B, T, H] after the logits (what the MTP
        head reads; the logits are the same numbers). `image`: None for text, or (rope_position_ids [B, 3, T], image_embeds [B, T, hidden], image_mask [B, T])
        for prompts holding images: the masked tokens take the vision tower's embeddings instead of their own, and
        every token rotates by its 3-D position (`position_ids` still places tokens in the cache)."""
        slots = Slots(seq_ids, fresh=position_ids[:, 0] == 0, in_place=self.state_in_place,
                      graph_form=self.state_graph_form)
        lengths = attention_mask.sum(-1, dtype=slots.index_dtype)
        starts = position_ids[:, 0].to(slots.index_dtype)
        key_length = key_length or input_ids.shape[1]
        h = upcast(self.embed_tokens(input_ids))
        if image is None:
            cos, sin = self.rotary(position_ids, h.dtype)
        else:
            rope_position_ids, image_embeds, image_mask = image
            h = torch.where(image_mask.bool()[..., None], upcast(image_embeds).to(h.dtype), h)
            cos, sin = self.rotary.multimodal(rope_position_ids, h.dtype)
        new_state = []
        for i, layer in enumerate(self.layers):
            h, a, b = layer.context_encoding(
                h, cos, sin, position_ids, starts, lengths, key_length, slots, state[2 * i], state[2 * i + 1]
            )
            new_state += [a, b]
        normed = self.norm(h) if hidden else None  # per row: the same numbers as the rows normed below
        if not all_logits:
            # Only the last real token of each prompt feeds lm_head.
            # Rows of h [B * T, hidden] (an index_select: no gather with its per-element index tensor).
            h = _last_rows(h, lengths)
        logits = self.lm_head(self.norm(h))
        return (logits, normed, *new_state) if hidden else (logits, *new_state)

    # ------------------------------------------------------------------ speculative decoding (the MTP head)
    def verify(self, input_ids, position_ids, lengths, seq_ids, *state, key_length=None):
        """Speculative verification: T tokens per row [B, T] (the last accepted token, then the drafts) at
        consecutive positions position_ids [B, T], continuing each row's slot; `lengths` [B] of them are real (fewer at
        the end of the cache). Attention K/V are written at those positions (positions past what the host accepts are
        stale afterwards, and harmless: every later call writes a position before any query reads it); DeltaNet slot
        states are not changed. Returns (logits [B, T, vocab], final-normed hidden [B, T, H], the per-position
        DeltaNet states (conv [B, T, C, K - 1], recurrent [B, T * nv, dk, dv]) of each DeltaNet layer in layer order,
        then the state); `commit` writes
        the states after the accepted position."""
        slots = Slots(seq_ids, fresh=position_ids[:, 0] == 0, in_place=self.state_in_place,
                      graph_form=self.state_graph_form)
        starts = position_ids[:, 0].to(slots.index_dtype)
        lengths = lengths.to(slots.index_dtype)
        key_length = key_length or self._max_length(state)
        h = upcast(self.embed_tokens(input_ids))
        cos, sin = self.rotary(position_ids, h.dtype)
        new_state, per_position = [], []
        for i, layer in enumerate(self.layers):
            h, a, b, states = layer.verify(h, cos, sin, position_ids, starts, lengths, key_length, slots,
                                           state[2 * i], state[2 * i + 1])
            new_state += [a, b]
            per_position += list(states)
        normed = self.norm(h)
        return (self.lm_head(normed), normed, *per_position, *new_state)

    def commit(self, seq_ids, accepted, *tensors):
        """After `verify`: each active row's DeltaNet slot states become the states after its position accepted[b]
        (0 = the first verified token). `tensors`: verify's per-position states, then the state. Returns the state."""
        n = 2 * len(self.config.linear_layers)
        per_position, state = list(tensors[:n]), list(tensors[n:])
        slots = Slots(seq_ids, in_place=self.state_in_place,
                      graph_form=self.state_graph_form)
        B, T = per_position[0].shape[:2]  # conv [B, T, C, K - 1]
        # Row b's accepted position is row b * T + accepted[b] of the states viewed as [B * T, ...] (an index_select
        # of rank-4 rows: the recurrent states come as [B, T * nv, dk, dv], never rank 5).
        picks = torch.arange(B, device=accepted.device, dtype=slots.index_dtype) * T + accepted.to(slots.index_dtype)
        j = 0
        for i, layer in enumerate(self.layers):
            if layer.is_attention:
                continue
            for which in (0, 1):
                flat = per_position[j + which]
                flat = flat.reshape(B * T, -1, *flat.shape[2:]) if which else flat.reshape(B * T, *flat.shape[2:])
                state[2 * i + which] = slots.write(state[2 * i + which], flat.index_select(0, picks))
            j += 2
        return tuple(state)

    def mtp_forward(self, input_ids, hidden, position_ids, lengths, seq_ids, k_cache, v_cache, key_length=None):
        """The MTP head over T positions per row [B, T] continuing its KV cache (a fresh row starts at 0):
        input_ids the tokens after each position, hidden [B, T, H] the final-normed hidden states there
        (the main model's, or the head's own for a draft), `lengths` [B] real positions. Writes the head's K/V at
        those positions and returns (logits [B, vocab], out [B, H]) at each row's last real position, then the
        cache. With a draft vocabulary (`MTPHead.set_draft_vocab`) the logits are [B, V_d], over its token ids."""
        slots = Slots(seq_ids, fresh=position_ids[:, 0] == 0, in_place=self.state_in_place,
                      graph_form=self.state_graph_form)
        starts = position_ids[:, 0].to(slots.index_dtype)
        lengths = lengths.to(slots.index_dtype)
        key_length = key_length or k_cache.shape[2]
        embeds = upcast(self.embed_tokens(input_ids))
        h = self.mtp.fuse(embeds, upcast(hidden).to(embeds.dtype))
        cos, sin = self.rotary(position_ids, h.dtype)
        h, k_cache, v_cache = self.mtp.layers[0].context_encoding(
            h, cos, sin, position_ids, starts, lengths, key_length, slots, k_cache, v_cache
        )
        out = self.mtp.norm(_last_rows(h, lengths))
        head = self.lm_head if self.mtp.draft_head is None else self.mtp.draft_head
        return head(out), out, k_cache, v_cache

    def token_generation(self, input_ids, position_ids, seq_ids, *state, key_length=None, rope_position_ids=None):
        """`rope_position_ids` [B, 1]: the rotary position, when it is not the cache position (after a prompt
        holding images: the position plus the prompt's rope delta; all three components equal for text)."""
        slots = Slots(seq_ids, fresh=position_ids[:, 0] == 0, in_place=self.state_in_place,
                      graph_form=self.state_graph_form)
        key_length = key_length or self._max_length(state)
        h = upcast(self.embed_tokens(input_ids))
        cos, sin = self.rotary(position_ids if rope_position_ids is None else rope_position_ids, h.dtype)
        new_state = []
        for i, layer in enumerate(self.layers):
            h, a, b = layer.token_generation(h, cos, sin, position_ids, key_length, slots, state[2 * i], state[2 * i + 1])
            new_state += [a, b]
        logits = self.lm_head(self.norm(h))[:, 0]
        return (logits, *new_state)


    def _max_length(self, state) -> int:
        """The cache length (max_length), from the first attention layer's K cache; 1 without attention layers."""
        for i, layer in enumerate(self.layers):
            if layer.is_attention:
                return state[2 * i].shape[2]
        return 1


def _last_rows(h: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """h [B, T, H] -> [B, H]: each row's last real position (an index_select of the [B * T, H] rows: no gather with
    its per-element index tensor)."""
    B, T = h.shape[:2]
    last = torch.arange(B, device=h.device, dtype=lengths.dtype) * T + (lengths - 1).clamp(min=0)
    return h.reshape(B * T, -1).index_select(0, last)


class ContextEncodingGraph(nn.Module):
    """Flat-argument wrapper of `context_encoding`, the module that is traced (key_length: None = the block)."""

    def __init__(self, decoder: Qwen35Decoder, all_logits: bool = False, key_length: int | None = None):
        super().__init__()
        self.decoder, self.all_logits, self.key_length = decoder, all_logits, key_length

    def forward(self, input_ids, attention_mask, position_ids, seq_ids, *state):
        return self.decoder.context_encoding(
            input_ids, attention_mask, position_ids, seq_ids, *state, all_logits=self.all_logits,
            key_length=self.key_length,
        )


class TokenGenerationGraph(nn.Module):
    """Flat-argument wrapper of `token_generation`, the module that is traced (key_length: None = whole cache)."""

    def __init__(self, decoder: Qwen35Decoder, key_length: int | None = None):
        super().__init__()
        self.decoder, self.key_length = decoder, key_length

    def forward(self, input_ids, position_ids, seq_ids, *state):
        return self.decoder.token_generation(input_ids, position_ids, seq_ids, *state, key_length=self.key_length)


class ImageContextEncodingGraph(ContextEncodingGraph):
    """`context_encoding` of prompts holding images: the text graph's inputs, then the 3-D rotary positions
    [B, 3, T], the image embeddings [B, T, hidden] and their mask [B, T], then the state."""

    def forward(self, input_ids, attention_mask, position_ids, seq_ids, rope_position_ids, image_embeds, image_mask,
                *state):
        return self.decoder.context_encoding(
            input_ids, attention_mask, position_ids, seq_ids, *state, all_logits=self.all_logits,
            key_length=self.key_length, image=(rope_position_ids, image_embeds, image_mask),
        )


class ImageTokenGenerationGraph(TokenGenerationGraph):
    """`token_generation` after a prompt holding images: the text graph's inputs, then the rotary positions [B, 1]
    (cache position + rope delta), then the state."""

    def forward(self, input_ids, position_ids, seq_ids, rope_position_ids, *state):
        return self.decoder.token_generation(
            input_ids, position_ids, seq_ids, *state, key_length=self.key_length, rope_position_ids=rope_position_ids
        )
