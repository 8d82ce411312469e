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

bf16 products (issue 41): `chunk_gated_delta_rule(matmul_dtype=torch.bfloat16)`, which the prefill seam passes for a
bf16 model, gives the products named in `BF16_PRODUCTS` bf16 operands with fp32 accumulation and an fp32 result, as
TensorE does (bf16 x bf16 -> fp32 PSUM; on XLA one `dot` with bf16 operands and an f32 result). Only w S: of the 31
non-empty subsets of the five cheap products (K K^T, the solve, w S, (Q e^g) S, Q K^T), it is the one that kept
every bf16 accuracy test passing (tiny-nv3x's image prompts are the tightest: top-1 no worse than transformers'
bf16); see docs/neuron_backend.md. Everything else stays in the compute dtype: the other products, the state
update, the gates and their cumulative sums, the decay factors and the carried state. An fp32 model rounds nothing.
"""

from __future__ import annotations

import torch

CHUNK_SIZE = 64

# The chunked rule's products that take bf16 operands (fp32 accumulation) in a bf16 model, read on every call. The
# names of all five switchable products: K K^T ("KKt"), the triangular solve's products ("solve"), w S ("wS"),
# (Q e^g) S ("QS"), Q K^T ("QKt"). Only w S by default: the subset that keeps the bf16 accuracy tests passing.
PRODUCTS = frozenset({"KKt", "solve", "wS", "QS", "QKt"})
BF16_PRODUCTS = frozenset({"wS"})


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def low_matmul(a: torch.Tensor, b: torch.Tensor, low: torch.dtype | None) -> torch.Tensor:
    """a @ b over the trailing matrix dims (equal leading batch dims). With `low` (bf16) the operands are rounded to it
    and the products accumulated and returned in a's dtype: TensorE's bf16 x bf16 -> fp32 PSUM. On CPU the rounded
    operands go through an fp32 matmul (a product of two bf16 values is exact in fp32, so this is that accumulation);
    on XLA one dot with bf16 operands and an f32 result (`preferred_element_type`), which the lowered graph shows as a
    bf16 matmul. `low` None or a's own dtype: the plain matmul, bit for bit."""
    # bmm for the 3-D products: torch.matmul adds views around it (more ops in a traced graph), the same numbers
    mm = torch.bmm if a.dim() == 3 else torch.matmul
    if low is None or low == a.dtype:
        return mm(a, b)
    if a.device.type == "xla":
        import torch_xla  # only the XLA graphs (the neuron session) reach this line

        batch = list(range(a.dim() - 2))
        dims = (([a.dim() - 1], [b.dim() - 2]), (batch, batch))
        return torch_xla._XLAC._xla_dot_general(a.to(low), b.to(low), dims, preferred_element_type=a.dtype)
    return mm(a.to(low).to(a.dtype), b.to(low).to(a.dtype))


def expand_key_heads(x: torch.Tensor, num_value_heads: int) -> torch.Tensor:
    """[B, nk, ...] -> [B, nv, ...]: value head h reads key head h // (nv / nk)."""
    groups = num_value_heads // x.shape[1]
    if groups == 1:
        return x
    if x.device.type != "xla" and not torch.compiler.is_compiling():
        return x.repeat_interleave(groups, dim=1)
    # In a graph (XLA's Neuron graphs, a torch.compile graph such as TorchNeuron's), repeat_interleave on
    # [B, nk, T, d] lowers to rank-5 broadcasts: the same copy with the trailing dims merged, so that the broadcast
    # stays rank 4 (eager on CPU this form costs a copy more). The same values either way.
    B, nk = x.shape[:2]
    rest = x.shape[2:]
    return x.reshape(B, nk, 1, -1).expand(B, nk, groups, rest.numel()).reshape(B, nk * groups, *rest)


def lower_triangle(n: int, diagonal: int, device) -> torch.Tensor:
    """[n, n] bool, True on and below `diagonal` (as `ones(n, n).tril(diagonal)`). In a traced graph compared from
    int32 positions: `tril`'s decomposition counts in int64 (torch-mlir's StableHLO: an i64 iota and arithmetic)."""
    if not torch.compiler.is_compiling():
        return torch.ones(n, n, dtype=torch.bool, device=device).tril(diagonal)
    i = torch.arange(n, dtype=torch.int32, device=device)
    return i[:, None] + diagonal >= i[None, :]


def mask_padding(
    g: torch.Tensor, beta: torch.Tensor, lengths: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Padding tokens get g = 0 (no decay) and beta = 0 (no write), so they leave the state unchanged."""
    if lengths is None:
        return g, beta
    positions = torch.arange(g.shape[-1], device=g.device, dtype=lengths.dtype)
    valid = (positions[None, :] < lengths[:, None])[:, None, :]  # [B, 1, T]
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
    matmul_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule (WY / UT form). Returns (o [B, nv, T, dv], final_state [B, nv, dk, dv]).

    `matmul_dtype` (bf16 for a bf16 model, from the prefill seam): the operand dtype of the products named in
    `BF16_PRODUCTS` (fp32 accumulation, `low_matmul`); None: every product in the compute dtype.

    Within a chunk of C tokens (gc = cumulative g inside the chunk; every exponent below is <= 0):
        A = strictly_lower(beta_i k_i.k_j exp(gc_i - gc_j))
        u = (I + A)^-1 (beta v),  w = (I + A)^-1 (beta k exp(gc))   (blocked inverse, one matmul)
    then chunk by chunk from the carried state S:
        v' = u - w S
        o  = (q exp(gc)) S + lower(q_i.k_j exp(gc_i - gc_j)) v'
        S  = exp(gc_C) S + (k exp(gc_C - gc))^T v'

    Everything that does not depend on S is computed for all chunks at once; the chunk loop holds only
    four batched matmuls and a scale per chunk (`v'` and `q S` are collected, the intra-chunk term is one
    matmul after the loop), so that the traced graph stays small (a few hundred ops for 4096 tokens).
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
    N = (T + pad) // C
    BH, M = B * nv, B * nv * N

    # One row of the batch per (sequence, head, chunk): [M, C, d] (rank <= 4 throughout).
    q, k, v = (x.reshape(M, C, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(M, C) for x in (g, beta))

    gc = g.cumsum(-1)  # [M, C]
    causal = lower_triangle(C, 0, q.device)
    # exp(gc_i - gc_j) for j <= i; the upper triangle is masked before exp so it cannot overflow.
    log_decay = gc[:, :, None] - gc[:, None, :]
    decay = torch.where(causal, log_decay, torch.full((), float("-inf"), dtype=dtype, device=q.device)).exp()

    unknown = BF16_PRODUCTS - PRODUCTS
    if unknown:
        raise ValueError(f"BF16_PRODUCTS names unknown products {sorted(unknown)}; expected a subset of {sorted(PRODUCTS)}")

    def low(name):  # the operand dtype of product `name` (None: the compute dtype)
        return matmul_dtype if matmul_dtype not in (None, dtype) and name in BF16_PRODUCTS else None

    k_beta = k * beta[:, :, None]
    # lower triangle with diagonal; invert_unit_lower reads below it
    A = low_matmul(k_beta, k.transpose(1, 2), low("KKt")) * decay
    # u = (I + A)^-1 (beta v) and w = (I + A)^-1 (beta k exp(gc)), in one matmul with the inverse (always the compute
    # dtype: their error reaches the carried state).
    T_inv = invert_unit_lower(A, matmul_dtype=low("solve"))
    uw = torch.bmm(T_inv, torch.cat([v * beta[:, :, None], k_beta * gc.exp()[:, :, None]], dim=-1))
    u, w = uw[:, :, :dv], uw[:, :, dv:]

    q_decayed = q * gc.exp()[:, :, None]
    k_to_end = (k * (gc[:, -1:] - gc).exp()[:, :, None]).transpose(1, 2)  # [M, dk, C]
    chunk_decay = gc[:, -1].exp()[:, None, None]  # [M, 1, 1]
    intra = low_matmul(q, k.transpose(1, 2), low("QKt")) * decay  # causal (decay is 0 above the diagonal)

    if initial_state is None:
        S = torch.zeros(BH, dk, dv, dtype=dtype, device=q.device)
    else:
        S = initial_state.to(dtype).reshape(BH, dk, dv)
    # Chunk n of every (sequence, head): [BH, ...] views, one unbind per tensor.
    chunks = zip(*(x.reshape(BH, N, *x.shape[1:]).unbind(1) for x in (u, w, q_decayed, k_to_end, chunk_decay)))
    v_new, q_state = [], []
    for u_n, w_n, q_n, k_n, decay_n in chunks:
        if low("wS") is None:
            v_n = torch.baddbmm(u_n, w_n, S, alpha=-1)  # u - w S
        else:
            v_n = u_n - low_matmul(w_n, S, low("wS"))
        q_state.append(low_matmul(q_n, S, low("QS")))
        S = torch.baddbmm(S * decay_n, k_n, v_n)  # the state update: always the compute dtype
        v_new.append(v_n)
    v_new = torch.cat(v_new, dim=1).reshape(M, C, dv)  # [BH, N * C, dv] -> [M, C, dv]
    o = torch.cat(q_state, dim=1) + torch.bmm(intra, v_new).reshape(BH, N * C, dv)
    return o.reshape(B, nv, N * C, dv)[:, :, :T].to(out_dtype), S.reshape(B, nv, dk, dv)


SOLVE_BLOCK = 16


def invert_unit_lower(A: torch.Tensor, block: int = SOLVE_BLOCK, matmul_dtype: torch.dtype | None = None) -> torch.Tensor:
    """(I + L)^-1 for L the strictly lower triangle of A [M, C, C] (the diagonal and above are ignored).

    Blocked: forward substitution inside the diagonal `block` x `block` blocks (all of them at once,
    `block - 1` steps), then merges of neighbouring blocks, doubling their size each time:

        [[L11, 0], [L21, L22]]^-1 = [[T11, 0], [-T22 L21 T11, T22]]

    so that the whole solve is about 2 * block + 8 * log2(C / block) batched ops, instead of one
    row at a time over C. Never a Neumann series (which blows up on near-identical keys); as accurate
    as row-by-row substitution on the adversarial inputs (identical keys, beta ~ 1, no decay; tested).
    `matmul_dtype`: the operand dtype of its products (fp32 accumulation, `low_matmul`); None: A's dtype.
    """
    M, C, _ = A.shape
    b = min(block, C)
    if C % b or (C // b) & (C // b - 1):
        raise ValueError(f"chunk size {C} must be {b} times a power of two")
    nb = C // b
    strict = lower_triangle(b, -1, A.device)
    # The diagonal blocks, [M * nb, b, b]: each chunk's rows i * b .. (i + 1) * b, same columns.
    diag = torch.cat([A[:, i * b : (i + 1) * b, i * b : (i + 1) * b] for i in range(nb)], dim=1)
    diag = torch.where(strict, diag.reshape(M * nb, b, b), torch.zeros((), dtype=A.dtype, device=A.device))
    # Forward substitution, one row of every block per step: X[i] = e_i - L[i] X. Rows other than i
    # get X[j] - 0 * X (exactly unchanged); row i reads rows < i, already final.
    eye = torch.eye(b, dtype=A.dtype, device=A.device)
    X = eye.expand(M * nb, b, b)
    for i in range(1, b):
        if matmul_dtype is None:
            X = torch.baddbmm(X, diag * eye[:, i : i + 1], X, alpha=-1)
        else:
            X = X - low_matmul(diag * eye[:, i : i + 1], X, matmul_dtype)
    X = X.reshape(M, nb, b, b)
    size = b
    while size < C:  # merge blocks pairwise: [M, n, size, size] -> [M, n / 2, 2 size, 2 size]
        n = C // (2 * size)
        T11, T22 = X[:, 0::2], X[:, 1::2]
        L21 = torch.cat(
            [A[:, (2 * p + 1) * size : (2 * p + 2) * size, 2 * p * size : (2 * p + 1) * size][:, None] for p in range(n)],
            dim=1,
        )
        T21 = -low_matmul(low_matmul(T22, L21, matmul_dtype), T11, matmul_dtype)
        X = torch.cat([torch.cat([T11, torch.zeros_like(T11)], dim=-1), torch.cat([T21, T22], dim=-1)], dim=-2)
        size *= 2
    return X.reshape(M, C, C)


def recurrent_gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step (T = 1). Shapes as in the module docstring with T = 1. Returns (o, new_state).

    Written so that the [dk, dv] states are read and written as few times as possible (a decode step is bound by
    them at batch > 1): the decayed state is the one new [B, nv, dk, dv] tensor, S^T k and S^T q are batched
    vector-matrix products over it, and the rank-1 update is accumulated into it in place."""
    dtype = _compute_dtype(q, k, v, g, beta, state)
    # g [B, nv, 1] -> [B, nv, 1, 1]; a new tensor, contiguous for the in-place update through a view below
    S = (state.to(dtype) * g.to(dtype).exp()[..., None]).contiguous()
    return _step_update(q, k, v, beta, S, v.dtype)


def recurrent_gated_delta_rule_step_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`recurrent_gated_delta_rule_step` computed in `state` itself (same operations, same numbers), for a caller
    that owns `state` (a contiguous [B, nv, dk, dv] tensor of the compute dtype, e.g. rows it just gathered from
    the slots): no new state-sized tensor. Returns (o, state); a state of another dtype than the compute dtype (an
    fp32 state of a float64 model) or not contiguous takes the out-of-place step, `state` left as it was."""
    dtype = _compute_dtype(q, k, v, g, beta, state)
    if state.dtype != dtype or not state.is_contiguous():
        return recurrent_gated_delta_rule_step(q, k, v, g, beta, state)
    return _step_update(q, k, v, beta, state.mul_(g.to(dtype).exp()[..., None]), v.dtype)


def _step_update(q, k, v, beta, S, out_dtype):
    """The step after the decay: S (decayed, contiguous, owned) += k delta^T in place; o = S^T q."""
    dtype = S.dtype
    B, nv, _, dv = v.shape
    dk = q.shape[-1]
    q = expand_key_heads(q, nv).to(dtype)  # [B, nv, 1, dk]
    k = expand_key_heads(k, nv).to(dtype)
    memory = k @ S  # S^T k: [B, nv, 1, dv]
    delta = (v.to(dtype) - memory) * beta.to(dtype)[..., None]
    S.view(B * nv, dk, dv).baddbmm_(k.reshape(B * nv, dk, 1), delta.view(B * nv, 1, dv))  # S += k delta^T
    o = q @ S  # S^T q: [B, nv, 1, dv]
    return o.to(out_dtype), S


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
