"""A tiny checkpoint whose multi-token-prediction head is fitted to its own main model, so that it accepts drafts.

    from optimum_qwen35.tiny.mtp_fit import fitted_checkpoint
    fitted_checkpoint("tiny-2b", "tiny-2b-fitted")   # seeded; about 20 s on one CPU thread

The tiny checkpoints ship random `mtp.*` tensors, which accept almost nothing: speculative decoding over them is exact
trivially (every round emits the main model's own token). `fitted_checkpoint` trains the head (seeded) to predict the
main model's greedy continuations, token i + 2 from the main model's final-normed hidden state at i and token i + 1,
and writes the checkpoint again with the fitted head (and `mtp_fit.json`: the prompts it was fitted on, the loss).
The speculation benchmark (benchmarks/mtp_speculation.py) and the speculation tests use it. The training forward is
written here from the head's equations (batched, fp32, differentiable; the tests' float64 oracle, tests/oracle.py
`mtp`, is the same maths); the main model's continuations and hidden states come from the package
(`Qwen35Runtime`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def _read(folder: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors under `prefix` (without it), fp32, from every safetensors file of the folder."""
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                if key.startswith(prefix):
                    out[key[len(prefix):]] = f.get_tensor(key).float()
    return out


def _text_weights(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(text config, the embeddings and the LM head in fp32) of a checkpoint folder."""
    config = json.loads((folder / "config.json").read_text())
    config = config.get("text_config", config)
    W = {"embed_tokens.weight": _read(folder, "model.language_model.")["embed_tokens.weight"]}
    W["lm_head.weight"] = _read(folder, "lm_head.").get("weight", W["embed_tokens.weight"])
    return config, W


def _rms_norm(x, w, eps):
    """Zero-centred: x / rms(x) * (1 + w)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def _rope(x, positions, c):
    """Rotate the first rotary_dim dims of x [..., T, heads, hd] by position (rotate-half pairs i, i + r/2)."""
    rope_parameters = c.get("rope_parameters") or {}
    theta = rope_parameters.get("rope_theta", c.get("rope_theta"))
    r = int(c["head_dim"] * rope_parameters.get("partial_rotary_factor", 0.25))
    inv_freq = 1.0 / theta ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
    angles = positions.to(torch.float64)[:, None] * inv_freq  # [T, r/2]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    x1, x2, rest = x[..., : r // 2], x[..., r // 2 : r], x[..., r:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def _attention(x, M, c):
    """The head's full-attention layer's mixer over x [N, T, hidden] from position 0."""
    N, T, _ = x.shape
    H, KV, hd, eps = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rms_norm_eps"]
    p = "layers.0.self_attn."
    qg = (x @ M[p + "q_proj.weight"].T).reshape(N, T, H, 2 * hd)
    q = _rms_norm(qg[..., :hd], M[p + "q_norm.weight"], eps)
    k = _rms_norm((x @ M[p + "k_proj.weight"].T).reshape(N, T, KV, hd), M[p + "k_norm.weight"], eps)
    v = (x @ M[p + "v_proj.weight"].T).reshape(N, T, KV, hd)
    positions = torch.arange(T)
    q, k = _rope(q, positions, c).to(x.dtype), _rope(k, positions, c).to(x.dtype)
    k, v = k.repeat_interleave(H // KV, dim=2), v.repeat_interleave(H // KV, dim=2)
    scores = torch.einsum("nqhd,nkhd->nhqk", q, k) * hd**-0.5
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    out = torch.einsum("nhqk,nkhd->nqhd", torch.softmax(scores.masked_fill(~causal, float("-inf")), -1), v)
    return (out * torch.sigmoid(qg[..., hd:])).reshape(N, T, H * hd) @ M[p + "o_proj.weight"].T


def head_logits(c, W, M, next_tokens, hidden):
    """The head's logits [N, T, vocab] from next_tokens [N, T] and final-normed hidden states [N, T, hidden]."""
    eps = c["rms_norm_eps"]
    e = W["embed_tokens.weight"][next_tokens]
    x = torch.cat([_rms_norm(e, M["pre_fc_norm_embedding.weight"], eps),
                   _rms_norm(hidden, M["pre_fc_norm_hidden.weight"], eps)], -1) @ M["fc.weight"].T
    p = "layers.0."
    h = x + _attention(_rms_norm(x, M[p + "input_layernorm.weight"], eps), M, c)
    y = _rms_norm(h, M[p + "post_attention_layernorm.weight"], eps)
    h = h + (F.silu(y @ M[p + "mlp.gate_proj.weight"].T) * (y @ M[p + "mlp.up_proj.weight"].T)) @ M[p + "mlp.down_proj.weight"].T
    return _rms_norm(h, M["norm.weight"], eps) @ W["lm_head.weight"].T


def fitted_checkpoint(source: str | Path, out: str | Path, sequences: int = 16, prompt: int = 8, length: int = 96,
                      steps: int = 100, seed: int = 0) -> Path:
    """Copy the (dense) checkpoint `source` to `out` with its MTP head fitted to the main model's greedy
    continuations of `sequences` seeded random prompts. Returns `out`."""
    from optimum_qwen35.runtime import Qwen35Runtime  # start-up time: the runtime, imported where used

    source, out = Path(source), Path(out)
    generator = torch.Generator().manual_seed(seed)
    c, W = _text_weights(source)
    model = Qwen35Runtime.from_pretrained(source, batch_size=sequences, max_length=length + 8, buckets=[length])
    prompts = torch.randint(3, c["vocab_size"], (sequences, prompt), generator=generator).tolist()
    tokens = [p + g for p, g in zip(prompts, model.generate(prompts, max_new_tokens=length - prompt))]
    _, hiddens = model.prefill(tokens, list(range(sequences)), hidden=True)
    model.close()
    tokens = torch.tensor(tokens)
    hidden = torch.stack(hiddens)[:, :-2].float()  # position i: hidden i and token i + 1 -> token i + 2
    next_tokens, targets = tokens[:, 1:-1], tokens[:, 2:]
    M = {k: v.requires_grad_() for k, v in _read(source, "mtp.").items()}
    optimizer = torch.optim.Adam(M.values(), lr=3e-3)
    for _ in range(steps):
        optimizer.zero_grad()
        logits = head_logits(c, W, M, next_tokens, hidden)
        # The continuations only (the random prompts are not predictable).
        loss = F.cross_entropy(logits[:, prompt:].reshape(-1, logits.shape[-1]), targets[:, prompt:].reshape(-1))
        loss.backward()
        optimizer.step()
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for file in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(file))
    dtype = next(iter(tensors.values())).dtype
    tensors.update({"mtp." + k: v.detach().to(dtype).contiguous() for k, v in M.items()})
    save_file(tensors, out / "model.safetensors")
    for f in source.iterdir():
        if f.is_file() and not f.name.startswith("model.safetensors") and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    # The prompts the head was fitted on (its continuations are in-sample: acceptance there is high by design).
    (out / "mtp_fit.json").write_text(json.dumps({"source": source.name, "loss": float(loss.detach()), "steps": steps,
                                                  "seed": seed, "prompts": prompts}))
    return out
