"""A test checkpoint whose multi-token-prediction head is fitted to its own main model, so that it accepts drafts.

The tiny checkpoints ship random `mtp.*` tensors, which accept almost nothing: speculative decoding over them is exact
trivially (every round emits the main model's own token). `fitted_checkpoint` trains the head (seeded, a few seconds
on one CPU thread) to predict the main model's greedy continuations, token i + 2 from the main model's final-normed
hidden state at i and token i + 1, and writes the checkpoint again with the fitted head. The training forward is
written here from the head's equations (as tests/oracle.py's `mtp`, batched, fp32, differentiable); the main model's
continuations and hidden states come from the package (`Qwen35Runtime`), which the exactness tests check anyway.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests import oracle


def _attention(x, M, c):
    """The head's full-attention layer's mixer over x [N, T, hidden] from position 0 (batched oracle.attention)."""
    N, T, _ = x.shape
    H, KV, hd, eps = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rms_norm_eps"]
    p = "layers.0.self_attn."
    qg = (x @ M[p + "q_proj.weight"].T).reshape(N, T, H, 2 * hd)
    q = oracle.rms_norm(qg[..., :hd], M[p + "q_norm.weight"], eps)
    k = oracle.rms_norm((x @ M[p + "k_proj.weight"].T).reshape(N, T, KV, hd), M[p + "k_norm.weight"], eps)
    v = (x @ M[p + "v_proj.weight"].T).reshape(N, T, KV, hd)
    positions = torch.arange(T)
    q, k = oracle.rope(q, positions, c).to(x.dtype), oracle.rope(k, positions, c).to(x.dtype)
    k, v = k.repeat_interleave(H // KV, dim=2), v.repeat_interleave(H // KV, dim=2)
    scores = torch.einsum("nqhd,nkhd->nhqk", q, k) * hd**-0.5
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    out = torch.einsum("nhqk,nkhd->nqhd", torch.softmax(scores.masked_fill(~causal, float("-inf")), -1), v)
    return (out * torch.sigmoid(qg[..., hd:])).reshape(N, T, H * hd) @ M[p + "o_proj.weight"].T


def head_logits(c, W, M, next_tokens, hidden):
    """The head's logits [N, T, vocab] from next_tokens [N, T] and final-normed hidden states [N, T, hidden]."""
    eps = c["rms_norm_eps"]
    e = W["embed_tokens.weight"][next_tokens]
    x = torch.cat([oracle.rms_norm(e, M["pre_fc_norm_embedding.weight"], eps),
                   oracle.rms_norm(hidden, M["pre_fc_norm_hidden.weight"], eps)], -1) @ M["fc.weight"].T
    p = "layers.0."
    h = x + _attention(oracle.rms_norm(x, M[p + "input_layernorm.weight"], eps), M, c)
    y = oracle.rms_norm(h, M[p + "post_attention_layernorm.weight"], eps)
    h = h + (F.silu(y @ M[p + "mlp.gate_proj.weight"].T) * (y @ M[p + "mlp.up_proj.weight"].T)) @ M[p + "mlp.down_proj.weight"].T
    return oracle.rms_norm(h, M["norm.weight"], eps) @ W["lm_head.weight"].T


def fitted_checkpoint(source: str | Path, out: str | Path, sequences: int = 16, prompt: int = 8, length: int = 96,
                      steps: int = 100, seed: int = 0) -> Path:
    """Copy the (dense) checkpoint `source` to `out` with its MTP head fitted to the main model's greedy
    continuations of `sequences` seeded random prompts. Returns `out`."""
    from optimum_qwen35.runtime import Qwen35Runtime

    source, out = Path(source), Path(out)
    generator = torch.Generator().manual_seed(seed)
    c, W = oracle.read_text_weights(source)
    W = {k: v.float() for k, v in W.items()}
    model = Qwen35Runtime.from_pretrained(source, batch_size=sequences, max_length=length + 8, buckets=[length])
    prompts = torch.randint(3, c["vocab_size"], (sequences, prompt), generator=generator).tolist()
    tokens = [p + g for p, g in zip(prompts, model.generate(prompts, max_new_tokens=length - prompt))]
    _, hiddens = model.prefill(tokens, list(range(sequences)), hidden=True)
    model.close()
    tokens = torch.tensor(tokens)
    hidden = torch.stack(hiddens)[:, :-2].float()  # position i: hidden i and token i + 1 -> token i + 2
    next_tokens, targets = tokens[:, 1:-1], tokens[:, 2:]
    M = {k: v.float().requires_grad_() for k, v in oracle.read_mtp_weights(source).items()}
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
