"""The tiny checkpoints' weights: deterministic random tensors under the real checkpoints' names and shapes (text
decoder, vision tower, multi-token-prediction head), and the safetensors writer."""

from __future__ import annotations

import os
import zlib
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from optimum_qwen35.tiny.configs import MOE_EXPERT_FORMS, _is_moe, _layout, tiny_vision_config

# Target standard deviation of the final logits across the vocabulary. 1.0 keeps the logits far from
# flat (greedy margins ~0.1-1) while fp32 rounding, which random deep models amplify layer after layer,
# stays well inside the 1e-4 parity tolerance (at std 3, fp32 transformers is itself ~1e-3 from float64).
_LOGIT_STD = 1.0


class _Init:
    """Deterministic per-tensor random draws: each tensor has its own PCG64 stream keyed by (seed, name)."""

    def __init__(self, seed: int):
        self.seed = int(seed)

    def rng(self, name: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(name.encode("utf-8"))])

    def normal(self, name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> np.ndarray:
        x = self.rng(name).standard_normal(shape, dtype=np.float64) * std + mean
        return x.astype(np.float32)

    def linear(self, name: str, out_features: int, in_features: int) -> np.ndarray:
        return self.normal(name, (out_features, in_features), 1.0 / np.sqrt(in_features))

    def uniform(self, name: str, shape: tuple[int, ...], low: float, high: float) -> np.ndarray:
        return self.rng(name).uniform(low, high, size=shape).astype(np.float32)


def _norm_weight(init: _Init, name: str, dim: int) -> np.ndarray:
    # Qwen3.5 RMSNorm scales by (1 + w): small random values around 0.
    return init.normal(name, (dim,), 0.1)


def _mlp(init: _Init, p: str, hidden: int, inter: int, sd: dict[str, np.ndarray]) -> None:
    sd[p + "mlp.gate_proj.weight"] = init.linear(p + "mlp.gate_proj.weight", inter, hidden)
    sd[p + "mlp.up_proj.weight"] = init.linear(p + "mlp.up_proj.weight", inter, hidden)
    sd[p + "mlp.down_proj.weight"] = init.linear(p + "mlp.down_proj.weight", hidden, inter)


def _attention(init: _Init, p: str, t: dict[str, Any], sd: dict[str, np.ndarray]) -> None:
    h, hd = t["hidden_size"], t["head_dim"]
    nq, nkv = t["num_attention_heads"], t["num_key_value_heads"]
    a = p + "self_attn."
    # q_proj rows: per head [query (head_dim) | output gate (head_dim)], head after head.
    sd[a + "q_proj.weight"] = init.linear(a + "q_proj.weight", 2 * nq * hd, h)
    sd[a + "k_proj.weight"] = init.linear(a + "k_proj.weight", nkv * hd, h)
    sd[a + "v_proj.weight"] = init.linear(a + "v_proj.weight", nkv * hd, h)
    sd[a + "o_proj.weight"] = init.linear(a + "o_proj.weight", h, nq * hd)
    sd[a + "q_norm.weight"] = _norm_weight(init, a + "q_norm.weight", hd)
    sd[a + "k_norm.weight"] = _norm_weight(init, a + "k_norm.weight", hd)


def _deltanet(init: _Init, p: str, t: dict[str, Any], sd: dict[str, np.ndarray]) -> None:
    h = t["hidden_size"]
    nk, nv = t["linear_num_key_heads"], t["linear_num_value_heads"]
    dk, dv = t["linear_key_head_dim"], t["linear_value_head_dim"]
    conv_dim = 2 * nk * dk + nv * dv
    a = p + "linear_attn."
    # in_proj_qkv rows: [q (nk*dk) | k (nk*dk) | v (nv*dv)].
    qkv = init.linear(a + "in_proj_qkv.weight", conv_dim, h)
    conv = init.normal(a + "conv1d.weight", (conv_dim, 1, t["linear_conv_kernel_dim"]), 0.5)
    # Queries correlated with keys (as trained models' are), so that q.k, and with it the DeltaNet output,
    # stays away from zero: the gated RMSNorm scales a near-zero output by up to 1/sqrt(eps) = 1000, which
    # turns fp32 rounding into logit errors that no implementation can hold to 1e-4.
    kd = nk * dk
    qkv[:kd] = 0.8 * qkv[kd : 2 * kd] + 0.6 * qkv[:kd]
    conv[:kd] = 0.8 * conv[kd : 2 * kd] + 0.6 * conv[:kd]
    sd[a + "in_proj_qkv.weight"] = qkv
    sd[a + "in_proj_z.weight"] = init.linear(a + "in_proj_z.weight", nv * dv, h)
    sd[a + "in_proj_b.weight"] = init.linear(a + "in_proj_b.weight", nv, h)
    sd[a + "in_proj_a.weight"] = init.linear(a + "in_proj_a.weight", nv, h)
    sd[a + "conv1d.weight"] = conv
    # Decay rates A log-uniform in [0.01, 2]: per-token decays exp(-A softplus(.)) from ~0.99 down to ~0.07, so
    # that some heads remember across many chunks (a recurrence bug at a chunk boundary cannot hide) and random
    # near-orthogonal q.k products do not make the model chaotic (fast-decaying heads amplify fp32 rounding).
    sd[a + "A_log"] = init.uniform(a + "A_log", (nv,), np.log(0.01), np.log(2.0))
    sd[a + "dt_bias"] = init.normal(a + "dt_bias", (nv,), 0.1, mean=1.0)
    # The gated RMSNorm multiplies by w itself (not 1 + w): around 1.
    sd[a + "norm.weight"] = init.normal(a + "norm.weight", (dv,), 0.1, mean=1.0)
    sd[a + "out_proj.weight"] = init.linear(a + "out_proj.weight", h, nv * dv)


def _sparse_moe(init: _Init, p: str, t: dict[str, Any], sd: dict[str, np.ndarray], form: str) -> None:
    h, e, inter = t["hidden_size"], t["num_experts"], t["moe_intermediate_size"]
    m = p + "mlp."
    # Router rows ~ 1/sqrt(h): logits of std ~1, so the routing is neither flat nor one-hot.
    sd[m + "gate.weight"] = init.linear(m + "gate.weight", e, h)
    # Both on-disk forms come from the same draws: a layout gives the same model in either form.
    gate_up = init.normal(m + "experts.gate_up_proj", (e, 2 * inter, h), 1.0 / np.sqrt(h))
    down = init.normal(m + "experts.down_proj", (e, h, inter), 1.0 / np.sqrt(inter))
    if form == "fused":
        sd[m + "experts.gate_up_proj"] = gate_up
        sd[m + "experts.down_proj"] = down
    else:
        for i in range(e):
            sd[f"{m}experts.{i}.gate_proj.weight"] = np.ascontiguousarray(gate_up[i, :inter])
            sd[f"{m}experts.{i}.up_proj.weight"] = np.ascontiguousarray(gate_up[i, inter:])
            sd[f"{m}experts.{i}.down_proj.weight"] = np.ascontiguousarray(down[i])
    shared = t["shared_expert_intermediate_size"]
    sd[m + "shared_expert.gate_proj.weight"] = init.linear(m + "shared_expert.gate_proj.weight", shared, h)
    sd[m + "shared_expert.up_proj.weight"] = init.linear(m + "shared_expert.up_proj.weight", shared, h)
    sd[m + "shared_expert.down_proj.weight"] = init.linear(m + "shared_expert.down_proj.weight", h, shared)
    sd[m + "shared_expert_gate.weight"] = init.linear(m + "shared_expert_gate.weight", 1, h)


def _decoder_layer(init: _Init, p: str, t: dict[str, Any], layer_type: str, sd: dict[str, np.ndarray],
                   expert_form: str = "fused") -> None:
    h = t["hidden_size"]
    if layer_type == "linear_attention":
        _deltanet(init, p, t, sd)
    else:
        _attention(init, p, t, sd)
    if _is_moe(t):
        _sparse_moe(init, p, t, sd, expert_form)
    else:
        _mlp(init, p, h, t["intermediate_size"], sd)
    sd[p + "input_layernorm.weight"] = _norm_weight(init, p + "input_layernorm.weight", h)
    sd[p + "post_attention_layernorm.weight"] = _norm_weight(init, p + "post_attention_layernorm.weight", h)


def _vision(init: _Init, v: dict[str, Any], sd: dict[str, np.ndarray]) -> None:
    p = "model.visual."
    e, inter, out = v["hidden_size"], v["intermediate_size"], v["out_hidden_size"]
    ps, tps, cin = v["patch_size"], v["temporal_patch_size"], v["in_channels"]
    merged = e * v["spatial_merge_size"] ** 2
    fan_in = cin * tps * ps * ps

    def lin(name: str, o: int, i: int) -> None:
        sd[name + ".weight"] = init.linear(name + ".weight", o, i)
        sd[name + ".bias"] = init.normal(name + ".bias", (o,), 0.02)

    def layer_norm(name: str, dim: int) -> None:
        sd[name + ".weight"] = init.normal(name + ".weight", (dim,), 0.1, mean=1.0)
        sd[name + ".bias"] = init.normal(name + ".bias", (dim,), 0.02)

    sd[p + "patch_embed.proj.weight"] = init.normal(p + "patch_embed.proj.weight", (e, cin, tps, ps, ps), 1 / np.sqrt(fan_in))
    sd[p + "patch_embed.proj.bias"] = init.normal(p + "patch_embed.proj.bias", (e,), 0.02)
    sd[p + "pos_embed.weight"] = init.normal(p + "pos_embed.weight", (v["num_position_embeddings"], e), 0.02)
    for i in range(v["depth"]):
        b = f"{p}blocks.{i}."
        layer_norm(b + "norm1", e)
        layer_norm(b + "norm2", e)
        lin(b + "attn.qkv", 3 * e, e)
        lin(b + "attn.proj", e, e)
        lin(b + "mlp.linear_fc1", inter, e)
        lin(b + "mlp.linear_fc2", e, inter)
    layer_norm(p + "merger.norm", e)
    lin(p + "merger.linear_fc1", merged, merged)
    lin(p + "merger.linear_fc2", out, merged)


def _mtp(init: _Init, t: dict[str, Any], sd: dict[str, np.ndarray], expert_form: str = "fused") -> None:
    # Multi-token-prediction head as the real checkpoints ship it (transformers ignores `mtp.*`): the
    # normalized embedding and hidden state are concatenated, projected by `fc`, then one full-attention
    # decoder layer and a final norm.
    h = t["hidden_size"]
    sd["mtp.fc.weight"] = init.linear("mtp.fc.weight", h, 2 * h)
    sd["mtp.pre_fc_norm_embedding.weight"] = _norm_weight(init, "mtp.pre_fc_norm_embedding.weight", h)
    sd["mtp.pre_fc_norm_hidden.weight"] = _norm_weight(init, "mtp.pre_fc_norm_hidden.weight", h)
    for i in range(t["mtp_num_hidden_layers"]):
        _decoder_layer(init, f"mtp.layers.{i}.", t, "full_attention", sd, expert_form)
    sd["mtp.norm.weight"] = _norm_weight(init, "mtp.norm.weight", h)


def tiny_state_dict(layout: str = "tiny-2b", seed: int = 0, expert_form: str | None = None) -> dict[str, np.ndarray]:
    """All tensors of a tiny checkpoint (float32 numpy arrays), keyed by their real on-disk names.

    `expert_form` (MoE layouts): "fused" or "per_expert" (default: the layout's, MOE_EXPERT_FORMS)."""
    t = _layout(layout)
    expert_form = expert_form or MOE_EXPERT_FORMS.get(layout, "fused")
    if expert_form not in ("fused", "per_expert"):
        raise ValueError(f"expert_form {expert_form!r}: choose 'fused' or 'per_expert'")
    init = _Init(seed)
    h, vocab = t["hidden_size"], t["vocab_size"]
    sd: dict[str, np.ndarray] = {}
    # With a (1 + w) ~ 1 final norm the normalized hidden state has rms ~1, so logits have std ~ sqrt(h) * std(W).
    out_std = _LOGIT_STD / np.sqrt(h)
    lm = "model.language_model."
    sd[lm + "embed_tokens.weight"] = init.normal(lm + "embed_tokens.weight", (vocab, h), out_std)
    for i, layer_type in enumerate(t["layer_types"]):
        _decoder_layer(init, f"{lm}layers.{i}.", t, layer_type, sd, expert_form)
    sd[lm + "norm.weight"] = _norm_weight(init, lm + "norm.weight", h)
    if not t["tie_word_embeddings"]:
        sd["lm_head.weight"] = init.normal("lm_head.weight", (vocab, h), out_std)
    _vision(init, tiny_vision_config(layout), sd)
    _mtp(init, t, sd, expert_form)
    return sd



_DTYPES = ("float32", "float16", "bfloat16")


def write_safetensors(file: str | os.PathLike, tensors: dict[str, np.ndarray], dtype: str = "float32") -> int:
    """Write `tensors` cast to `dtype` with the safetensors library, metadata {"format": "pt"} as transformers
    writes it. The library lays tensors out deterministically, so equal inputs give equal files.
    Returns the number of data bytes."""
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {list(_DTYPES)}")
    cast = {n: torch.from_numpy(np.ascontiguousarray(t, dtype=np.float32)).to(getattr(torch, dtype)) for n, t in tensors.items()}
    save_file(cast, os.fspath(file), metadata={"format": "pt"})
    return sum(t.numel() * t.element_size() for t in cast.values())
