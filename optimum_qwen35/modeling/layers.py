"""Building blocks shared by both mixers: norms, the SwiGLU MLP and partial rotary embeddings."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .precision import upcast  # noqa: F401  (fp32 for half-precision activations; the policy's, in precision.py)


class RMSNorm(nn.Module):
    """Qwen3.5's zero-centred RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), computed in fp32.

    Used for the layer norms, the final norm and the attention q/k norms.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = upcast(x)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + upcast(self.weight))).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """DeltaNet output norm, per value head: w * rmsnorm(x), then * silu(z). Plain w, not 1 + w."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Returns fp32 (or float64): the caller casts once, before out_proj."""
        xf = upcast(x)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        # All in fp32 (transformers rounds to the activation dtype before the weight; same result in fp32).
        return upcast(self.weight) * xf * F.silu(upcast(z))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); gate/up column-parallel, down row-parallel."""

    def __init__(self, hidden_size: int, intermediate_per_rank: int, layers):
        super().__init__()
        self.gate_proj = layers.column_linear(hidden_size, intermediate_per_rank)
        self.up_proj = layers.column_linear(hidden_size, intermediate_per_rank)
        self.down_proj = layers.row_linear(intermediate_per_rank, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RotaryEmbedding(nn.Module):
    """Partial rotary embedding: the first `rotary_dim` dims of each head, rotate-half pairs (i, i + dim/2).

    Qwen3.5's interleaved multimodal RoPE assigns frequency bands to the temporal, height and width
    position components; for text all three components equal the token position, so it reduces to
    plain 1-D RoPE, which is what `forward` computes. `multimodal` takes the three components (a prompt
    holding images) and picks each band's component, interleaved (`mrope_section`).
    """

    def __init__(self, rotary_dim: int, theta: float, mrope_section: tuple[int, ...] = (11, 11, 10)):
        super().__init__()
        self.rotary_dim, self.theta = rotary_dim, theta
        # Which position component (0 time, 1 row, 2 column) turns each frequency band: interleaved, band j takes
        # row for j % 3 == 1 and column for j % 3 == 2 within the first 3 * section bands of each, time otherwise.
        component = [0] * (rotary_dim // 2)
        for axis in (1, 2):
            for j in range(axis, min(3 * mrope_section[axis], rotary_dim // 2), 3):
                component[j] = axis
        self.register_buffer("component", torch.tensor(component, dtype=torch.int32, device="cpu"), persistent=False)
        # Built on the CPU even when the model is built on the meta device (weights are loaded later).
        self._set_frequencies(torch.device("cpu"))

    def _set_frequencies(self, device: torch.device) -> None:
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float64, device=device) / self.rotary_dim
        # fp32 frequencies computed in fp32, as transformers does; a float64 copy for float64 reference runs.
        self.register_buffer("inv_freq", 1.0 / (self.theta ** exponents.float()), persistent=False)
        self.register_buffer("inv_freq64", 1.0 / (self.theta**exponents), persistent=False)

    def _apply(self, fn, recurse=True):
        # A cast of the whole model (`decoder.to(torch.bfloat16)`, as a bf16 export does) must not round the
        # frequencies: in bf16 every odd position above 256 would rotate as an even one. Rebuild them exactly.
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32 or self.inv_freq64.dtype != torch.float64:
            self._set_frequencies(self.inv_freq.device)
        return self

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, T] -> cos, sin [B, 1, T, rotary_dim] (broadcast over heads), fp32 (float64 for
        float64 models): the rotation is applied in fp32 whatever the activation dtype."""
        inv_freq = self.inv_freq64 if dtype == torch.float64 else self.inv_freq
        freqs = position_ids.to(inv_freq.dtype)[..., None] * inv_freq  # [B, T, rotary_dim / 2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]
        return emb.cos(), emb.sin()

    def multimodal(self, rope_position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """rope_position_ids [B, 3, T] (time, row, column) -> cos, sin [B, 1, T, rotary_dim], as `forward`."""
        inv_freq = self.inv_freq64 if dtype == torch.float64 else self.inv_freq
        # Each frequency's position component picked before the product (the same values; a gather of the
        # [B, 3, T, half] products lowers with rank-5 index tensors).
        positions = rope_position_ids.transpose(1, 2).index_select(2, self.component)  # [B, T, rotary_dim / 2]
        freqs = (positions.to(inv_freq.dtype) * inv_freq)[:, None]  # [B, 1, T, rotary_dim / 2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of x [B, H, T, D]; the rest pass through."""
    r = cos.shape[-1]
    x_rot, x_pass = upcast(x[..., :r]), x[..., r:]
    x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    return torch.cat([(x_rot * cos + rotated * sin).to(x.dtype), x_pass], dim=-1)
