"""An independent Qwen3.5 text decoder in float64, written from the model's equations (shared/ANCHORS.md §1), for tests.

It shares no code with `optimum_qwen35`: the tensors are read with the safetensors library, the DeltaNet layers run
the gated delta rule token by token (no chunking, no conv state, no slots), attention is a full causal softmax, and
every shape is spelt out. It is slow and simple on purpose. `tests/test_oracle.py` checks it against transformers'
recorded logits first, then uses it as the reference that every entry point of the model must match to ~1e-10 in
float64, so a planted bug anywhere in the maths fails there and not only in `tests/test_parity.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

F64 = torch.float64


def read_text_weights(folder: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(text config, {name without `model.language_model.`: float64 tensor}) of a checkpoint folder, any file split."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    config = config.get("text_config", config)
    weights = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                if key.startswith("model.language_model."):
                    weights[key[len("model.language_model.") :]] = f.get_tensor(key).to(F64)
                elif key == "lm_head.weight":
                    weights[key] = f.get_tensor(key).to(F64)
    if "lm_head.weight" not in weights:
        assert config["tie_word_embeddings"], "untied checkpoint without lm_head.weight"
        weights["lm_head.weight"] = weights["embed_tokens.weight"]
    return config, weights


def rms_norm(x, w, eps):
    """Zero-centred: x / rms(x) * (1 + w)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def l2norm(x):
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def deltanet(x, W, p, c):
    """x [T, hidden] of one fresh sequence -> [T, hidden]."""
    T = x.shape[0]
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    qkv = x @ W[p + "in_proj_qkv.weight"].T  # [T, 2 nk dk + nv dv]
    w = W[p + "conv1d.weight"][:, 0, :]  # [C, K]
    K = w.shape[1]
    past = torch.cat([torch.zeros(K - 1, qkv.shape[1], dtype=F64), qkv])  # K - 1 zeros before the first token
    mixed = F.silu(torch.stack([(past[t : t + K].T * w).sum(-1) for t in range(T)]))
    q, k, v = mixed.split([nk * dk, nk * dk, nv * dv], dim=-1)
    q = l2norm(q.reshape(T, nk, dk)) * dk**-0.5
    k = l2norm(k.reshape(T, nk, dk))
    v = v.reshape(T, nv, dv)
    beta = torch.sigmoid(x @ W[p + "in_proj_b.weight"].T)  # [T, nv]
    g = -W[p + "A_log"].exp() * F.softplus(x @ W[p + "in_proj_a.weight"].T + W[p + "dt_bias"])  # [T, nv]
    reads = torch.tensor([h // (nv // nk) for h in range(nv)])  # the key head each value head reads
    q, k = q[:, reads], k[:, reads]  # [T, nv, dk]
    S = torch.zeros(nv, dk, dv, dtype=F64)  # one state per value head
    o = torch.zeros(T, nv, dv, dtype=F64)
    for t in range(T):  # S = e^g S;  S += k (beta (v - S^T k))^T;  o = S^T q
        S = g[t, :, None, None].exp() * S
        memory = torch.einsum("hkv,hk->hv", S, k[t])
        S = S + torch.einsum("hk,hv->hkv", k[t], beta[t, :, None] * (v[t] - memory))
        o[t] = torch.einsum("hkv,hk->hv", S, q[t])
    z = (x @ W[p + "in_proj_z.weight"].T).reshape(T, nv, dv)
    normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + c["rms_norm_eps"]) * W[p + "norm.weight"] * F.silu(z)
    return normed.reshape(T, nv * dv) @ W[p + "out_proj.weight"].T


def rope(x, positions, c):
    """Rotate the first rotary_dim dims of x [T, heads, hd] by position (rotate-half pairs i, i + r/2)."""
    rope_parameters = c.get("rope_parameters") or {}
    theta = rope_parameters.get("rope_theta", c.get("rope_theta"))
    r = int(c["head_dim"] * rope_parameters.get("partial_rotary_factor", 0.25))
    inv_freq = 1.0 / theta ** (torch.arange(0, r, 2, dtype=F64) / r)
    angles = positions.to(F64)[:, None] * inv_freq  # [T, r/2]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    x1, x2, rest = x[..., : r // 2], x[..., r // 2 : r], x[..., r:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def attention(x, W, p, c):
    T = x.shape[0]
    H, KV, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    eps = c["rms_norm_eps"]
    qg = (x @ W[p + "q_proj.weight"].T).reshape(T, H, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:]
    q = rms_norm(q, W[p + "q_norm.weight"], eps)
    k = rms_norm((x @ W[p + "k_proj.weight"].T).reshape(T, KV, hd), W[p + "k_norm.weight"], eps)
    v = (x @ W[p + "v_proj.weight"].T).reshape(T, KV, hd)
    positions = torch.arange(T)
    q, k = rope(q, positions, c), rope(k, positions, c)
    reads = torch.tensor([h // (H // KV) for h in range(H)])  # the KV head each query head reads
    k, v = k[:, reads], v[:, reads]  # [T, H, hd]
    scores = torch.einsum("qhd,khd->hqk", q, k) * hd**-0.5
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
    out = torch.einsum("hqk,khd->qhd", probs, v)
    return (out * torch.sigmoid(gate)).reshape(T, H * hd) @ W[p + "o_proj.weight"].T


def _dense_layer(h, W, p, kind, c):
    """One pre-norm decoder layer (dense MLP) over h [T, hidden] of one sequence from position 0."""
    eps = c["rms_norm_eps"]
    x = rms_norm(h, W[p + "input_layernorm.weight"], eps)
    h = h + (deltanet(x, W, p + "linear_attn.", c) if kind == "linear_attention" else attention(x, W, p + "self_attn.", c))
    x = rms_norm(h, W[p + "post_attention_layernorm.weight"], eps)
    return h + (F.silu(x @ W[p + "mlp.gate_proj.weight"].T) * (x @ W[p + "mlp.up_proj.weight"].T)) @ W[p + "mlp.down_proj.weight"].T


def hidden_states(folder_or_weights, tokens: list[int]) -> torch.Tensor:
    """The final-normed hidden states [len(tokens), hidden] in float64 of one sequence from position 0."""
    c, W = folder_or_weights if isinstance(folder_or_weights, tuple) else read_text_weights(folder_or_weights)
    h = W["embed_tokens.weight"][torch.tensor(tokens)]
    for i, kind in enumerate(c["layer_types"]):
        h = _dense_layer(h, W, f"layers.{i}.", kind, c)
    return rms_norm(h, W["norm.weight"], c["rms_norm_eps"])


def logits(folder_or_weights, tokens: list[int]) -> torch.Tensor:
    """Teacher-forced logits [len(tokens), vocab] in float64 of one sequence from position 0."""
    c, W = folder_or_weights if isinstance(folder_or_weights, tuple) else read_text_weights(folder_or_weights)
    return hidden_states((c, W), tokens) @ W["lm_head.weight"].T


def read_mtp_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """The multi-token-prediction head's tensors {name under `mtp.`: float64} (dense checkpoints)."""
    weights = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                if key.startswith("mtp."):
                    weights[key[len("mtp.") :]] = f.get_tensor(key).to(F64)
    return weights


def mtp(text, M: dict[str, torch.Tensor], next_tokens: list[int], hidden: torch.Tensor):
    """The MTP head over positions 0 .. T - 1 of one sequence: position i reads hidden[i] (a final-normed hidden
    state) and the embedding of next_tokens[i]; x = fc([norm_e(embed) | norm_h(hidden)]), one full-attention layer
    (causal over the head's own positions), norm. Returns (logits [T, vocab], out [T, hidden])."""
    c, W = text
    eps = c["rms_norm_eps"]
    e = W["embed_tokens.weight"][torch.tensor(next_tokens)]
    x = torch.cat([rms_norm(e, M["pre_fc_norm_embedding.weight"], eps), rms_norm(hidden, M["pre_fc_norm_hidden.weight"], eps)], -1)
    h = _dense_layer(x @ M["fc.weight"].T, M, "layers.0.", "full_attention", c)
    out = rms_norm(h, M["norm.weight"], eps)
    return out @ W["lm_head.weight"].T, out


def cached_logits(folder: str | Path, tokens: list[int]) -> torch.Tensor:
    """`logits(folder, tokens)`, kept on disk when OPTIMUM_QWEN35_ORACLE_CACHE names a folder (the mutation-testing
    session sets it: every mutant's test run would otherwise recompute the same oracle outputs)."""
    import hashlib
    import os

    cache = os.environ.get("OPTIMUM_QWEN35_ORACLE_CACHE")
    if not cache:
        return logits(folder, tokens)
    folder = Path(folder).resolve()
    stamp = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(folder.glob("*.safetensors"))]
    key = hashlib.sha256(json.dumps([str(folder), stamp, list(tokens)]).encode()).hexdigest()
    file = Path(cache) / f"{key}.pt"
    if file.is_file():
        return torch.load(file)
    result = logits(folder, tokens)
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(f".tmp{os.getpid()}")
    torch.save(result, tmp)
    os.replace(tmp, file)
    return result
