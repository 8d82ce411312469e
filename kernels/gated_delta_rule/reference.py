"""The gated delta rule, PyTorch reference: chunked (prefill) and one recurrent step (decode).

Per value head h, with its key head h // (nv / nk), a state S of shape [dk, dv] evolves token by token:

    S = exp(g_t) * S
    S = S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = S^T q_t

Layout, shared by every implementation behind `optimum_qwen35.kernels` (all tensors of rank <= 4,
because neuronx-cc fails on rank-5 tensors):
    q, k    [B, nk, T, dk]  already l2-normalized, q already scaled by dk^-0.5
    v       [B, nv, T, dv]
    g       [B, nv, T]      log decay, <= 0
    beta    [B, nv, T]      in [0, 1]
    state   [B, nv, dk, dv] fp32
    lengths [B]             tokens >= lengths[b] are padding: they neither decay nor update the state

Math runs in fp32 (float64 when given float64, for references); outputs come back in v's dtype and
states in fp32 (or float64).
"""

from __future__ import annotations

import torch

CHUNK_SIZE = 64


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def expand_key_heads(x: torch.Tensor, num_value_heads: int) -> torch.Tensor:
    """[B, nk, ...] -> [B, nv, ...]: value head h reads key head h // (nv / nk)."""
    groups = num_value_heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def mask_padding(
    g: torch.Tensor, beta: torch.Tensor, lengths: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Padding tokens get g = 0 (no decay) and beta = 0 (no write), so they leave the state unchanged."""
    if lengths is None:
        return g, beta
    positions = torch.arange(g.shape[-1], device=g.device)
    valid = (positions[None, :] < lengths[:, None].to(positions.dtype))[:, None, :]  # [B, 1, T]
    return g * valid, beta * valid


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule (WY / UT form). Returns (o [B, nv, T, dv], final_state [B, nv, dk, dv]).

    Within a chunk of C tokens (gc = cumulative g inside the chunk; every exponent below is <= 0):
        A = strictly_lower(beta_i k_i.k_j exp(gc_i - gc_j))
        u = (I + A)^-1 (beta v),  w = (I + A)^-1 (beta k exp(gc))   (forward substitution)
    then chunk by chunk from the carried state S:
        v' = u - w S
        o  = (q exp(gc)) S + lower(q_i.k_j exp(gc_i - gc_j)) v'
        S  = exp(gc_C) S + (k exp(gc_C - gc))^T v'
    """
    out_dtype = v.dtype
    dtype = _compute_dtype(q, k, v, g, beta, *([initial_state] if initial_state is not None else []))
    B, nv, T, dv = v.shape
    dk = q.shape[-1]
    q, k = expand_key_heads(q, nv), expand_key_heads(k, nv)
    g, beta = mask_padding(g.to(dtype), beta.to(dtype), lengths)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)

    # Pad T to whole chunks with inert tokens (g = 0, beta = 0, k = v = 0).
    C = chunk_size
    pad = (-T) % C
    if pad:
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
    n_chunks = (T + pad) // C

    # Fold batch and heads into one dim so that chunked tensors stay rank 4: [B*nv, n_chunks, C, d].
    q, k, v = (x.reshape(B * nv, n_chunks, C, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(B * nv, n_chunks, C) for x in (g, beta))

    gc = g.cumsum(-1)  # [BH, N, C]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    # exp(gc_i - gc_j) for j <= i; the upper triangle is masked before exp so it cannot overflow.
    log_decay = gc[..., :, None] - gc[..., None, :]
    decay = torch.where(causal, log_decay, torch.full_like(log_decay, float("-inf"))).exp()

    k_beta = k * beta[..., None]
    A = torch.where(strict, (k_beta @ k.transpose(-1, -2)) * decay, torch.zeros((), dtype=dtype))
    # u = (I + A)^-1 (beta v) and w = (I + A)^-1 (beta k exp(gc)), solved together.
    uw = solve_unit_lower(A, torch.cat([v * beta[..., None], k_beta * gc.exp()[..., None]], dim=-1))
    u, w = uw[..., :dv], uw[..., dv:]

    q_decayed = q * gc.exp()[..., None]
    k_to_end = k * (gc[..., -1:] - gc).exp()[..., None]
    chunk_decay = gc[..., -1].exp()[..., None, None]  # [BH, N, 1, 1]
    intra = torch.where(causal, (q @ k.transpose(-1, -2)) * decay, torch.zeros((), dtype=dtype))

    if initial_state is None:
        S = torch.zeros(B * nv, dk, dv, dtype=dtype, device=q.device)
    else:
        S = initial_state.to(dtype).reshape(B * nv, dk, dv)
    outputs = []
    for n in range(n_chunks):
        v_new = u[:, n] - w[:, n] @ S
        outputs.append(q_decayed[:, n] @ S + intra[:, n] @ v_new)
        S = chunk_decay[:, n] * S + k_to_end[:, n].transpose(-1, -2) @ v_new

    o = torch.stack(outputs, dim=1).reshape(B, nv, n_chunks * C, dv)[:, :, :T]
    return o.to(out_dtype), S.reshape(B, nv, dk, dv)


def solve_unit_lower(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """X with (I + A) X = B, for strictly lower-triangular A [..., C, C], by forward substitution.

    Row by row, X[i] = B[i] - A[i, :i] X[:i]: what a triangular solver does, and as accurate. Forming
    (I + A)^-1 first and multiplying loses accuracy when I + A is ill-conditioned (slowly decaying
    heads with large beta), and a truncated Neumann series blows up on near-identical keys.
    """
    X = B.clone()
    for i in range(1, A.shape[-1]):
        X[..., i : i + 1, :] = B[..., i : i + 1, :] - A[..., i : i + 1, :i] @ X[..., :i, :]
    return X


def recurrent_gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step (T = 1). Shapes as in the module docstring with T = 1. Returns (o, new_state)."""
    out_dtype = v.dtype
    dtype = _compute_dtype(q, k, v, g, beta, state)
    nv = v.shape[1]
    q = expand_key_heads(q, nv)[:, :, 0].to(dtype)  # [B, nv, dk]
    k = expand_key_heads(k, nv)[:, :, 0].to(dtype)
    v = v[:, :, 0].to(dtype)  # [B, nv, dv]
    S = state.to(dtype) * g.to(dtype).exp()[..., None]  # g [B, nv, 1] -> [B, nv, 1, 1]
    memory = (S * k[..., None]).sum(-2)  # S^T k: [B, nv, dv]
    delta = (v - memory) * beta.to(dtype)
    S = S + k[..., None] * delta[:, :, None, :]
    o = (S * q[..., None]).sum(-2)
    return o[:, :, None].to(out_dtype), S


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token reference (a loop of steps): the ground truth for the chunked form and kernels."""
    B, nv, T, dv = v.shape
    g, beta = mask_padding(g, beta, lengths)
    S = initial_state
    if S is None:
        S = torch.zeros(B, nv, q.shape[-1], dv, dtype=_compute_dtype(q, v), device=v.device)
    outputs = []
    for t in range(T):
        sl = slice(t, t + 1)
        o, S = recurrent_gated_delta_rule_step(
            q[:, :, sl], k[:, :, sl], v[:, :, sl], g[:, :, sl], beta[:, :, sl], S
        )
        outputs.append(o)
    return torch.cat(outputs, dim=2), S
