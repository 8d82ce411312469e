"""The gated GQA attention mixer (every fourth Qwen3.5 layer).

q_proj emits, head by head, [query (head_dim) | gate (head_dim)]; q and k get a zero-centred RMSNorm
over head_dim, then partial RoPE; the attention output is multiplied by sigmoid(gate) before o_proj.
Its state is a KV cache per sequence slot: K and V of shape [slots, kv_heads, max_length, head_dim].
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import Qwen35Config
from .layers import RMSNorm, apply_rotary
from .parallel import ShardedDims

QUERY_BLOCK = 1024


class GatedAttention(nn.Module):
    def __init__(self, config: Qwen35Config, dims: ShardedDims, layers):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads = dims.num_heads
        self.num_kv_heads = dims.num_kv_heads
        self.scale = config.head_dim**-0.5
        hidden, hd = config.hidden_size, config.head_dim
        self.q_proj = layers.column_linear(hidden, 2 * self.num_heads * hd)
        self.k_proj = layers.column_linear(hidden, self.num_kv_heads * hd)
        self.v_proj = layers.column_linear(hidden, self.num_kv_heads * hd)
        self.o_proj = layers.row_linear(self.num_heads * hd, hidden)
        self.precision = layers.precision  # the backend's form of the attention core (modeling/precision.py)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        B, T, _ = x.shape
        q_gate = self.q_proj(x).view(B, T, self.num_heads, 2 * self.head_dim)
        q, gate = q_gate[..., : self.head_dim], q_gate[..., self.head_dim :]
        q = self.q_norm(q).transpose(1, 2)  # [B, H, T, hd]
        k = self.k_norm(self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return q, k, v, gate.reshape(B, T, self.num_heads * self.head_dim)

    def _attend(self, q, k, v, mask, gate):
        """q [B, H, Tq, hd], k/v [B, KV, Tk, hd], mask [B or 1, 1, Tq, Tk] (True = visible)."""
        # Matmul operands in the activation dtype, scores, softmax and accumulation in fp32, probabilities
        # rounded to the activation dtype before probs @ v: the precision policy, in the backend's form
        # (grouped-query attention without repeating K/V per query head).
        out = self.precision.attention(q, k, v, mask, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(gate.shape) * torch.sigmoid(gate))

    def context_encoding(self, x, cos, sin, position_ids, starts, lengths, key_length, slots, k_cache, v_cache):
        """x [B, T, hidden] right-padded at positions position_ids [B, T] (row b: starts[b] .. + lengths[b] - 1).

        Writes the block's K/V into each active row's slot (`slots.write_positions`), then attends over the slot's first
        `key_length` cached positions: the block itself for a fresh prompt (start 0), the cached prefix and the
        block for a continued one. Positions past a query's own are masked, stale cache rows included."""
        B, T, _ = x.shape
        q, k, v, gate = self._project(x, cos, sin)
        k_cache = slots.write_positions(k_cache, k, starts, lengths)
        v_cache = slots.write_positions(v_cache, v, starts, lengths)
        keys, values = slots.gather(k_cache[:, :, :key_length]), slots.gather(v_cache[:, :, :key_length])
        cached = torch.arange(key_length, device=x.device, dtype=position_ids.dtype)
        # Queries in blocks, so that long prompts never hold a [T, key_length] score matrix per head.
        outputs = []
        for start in range(0, T, QUERY_BLOCK):
            end = min(start + QUERY_BLOCK, T)
            visible = (cached[None, None, :] <= position_ids[:, start:end, None])[:, None]  # [B, 1, Tq, key_length]
            outputs.append(self._attend(q[:, :, start:end], keys, values, visible, gate[:, start:end]))
        out = torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]
        return out, k_cache, v_cache

    def token_generation(self, x, cos, sin, position_ids, key_length, slots, k_cache, v_cache):
        """x [B, 1, hidden] at positions position_ids [B, 1]: write K/V there, attend over the first
        `key_length` cached positions (a decode bucket covering every active position), those <= its own."""
        q, k, v, gate = self._project(x, cos, sin)
        one = torch.ones_like(position_ids[:, 0])
        k_cache = slots.write_positions(k_cache, k, position_ids[:, 0], one)
        v_cache = slots.write_positions(v_cache, v, position_ids[:, 0], one)
        keys, values = slots.gather(k_cache[:, :, :key_length]), slots.gather(v_cache[:, :, :key_length])
        cached = torch.arange(key_length, device=x.device, dtype=position_ids.dtype)
        visible = (cached[None, :] <= position_ids)[:, None, None, :]  # [B, 1, 1, L]
        out = self._attend(q, keys, values, visible, gate)
        return out, k_cache, v_cache

    def verify(self, x, cos, sin, position_ids, starts, lengths, key_length, slots, k_cache, v_cache):
        """Speculative verification: x [B, T, hidden] continuing each row's slot at positions position_ids [B, T]
        (`lengths` [B] of them real). Writes K/V as context encoding does, then attends one query position at a time,
        the way a decode step attends (the backend's one-query form): each verified position gets exactly the numbers
        a decode step at that position would (SDPA's multi-query kernel rounds differently in bf16), so greedy
        speculative decoding returns what greedy decoding returns."""
        T = x.shape[1]
        q, k, v, gate = self._project(x, cos, sin)
        k_cache = slots.write_positions(k_cache, k, starts, lengths)
        v_cache = slots.write_positions(v_cache, v, starts, lengths)
        keys, values = slots.gather(k_cache[:, :, :key_length]), slots.gather(v_cache[:, :, :key_length])
        cached = torch.arange(key_length, device=x.device, dtype=position_ids.dtype)
        outputs = []
        for t in range(T):
            visible = (cached[None, :] <= position_ids[:, t : t + 1])[:, None, None, :]  # [B, 1, 1, L]
            outputs.append(self._attend(q[:, :, t : t + 1], keys, values, visible, gate[:, t : t + 1]))
        return torch.cat(outputs, dim=1), k_cache, v_cache
