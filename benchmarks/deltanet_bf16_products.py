"""Which products of the chunked gated delta rule could take bf16 operands: each one rounded alone, against float64.

    python benchmarks/deltanet_bf16_products.py            # 2B layer head sizes (dk = dv = 128), 1024 tokens, chunk 64

A separate, written-out chunked rule (ANCHORS section 1's form: cumsum of g in the chunk, A = (beta K K^T) *
exp(gi - gj) strictly lower, T = (I + A)^-1 by forward substitution, u = T (beta V), w = T (beta K e^g), per chunk
v' = u - w S, o = (Q e^g) S + (Q K^T * decay * causal) v', S = e^{g_C} S + (K e^{g_C - g})^T v'), NOT the project's
kernels/gated_delta_rule/reference.py (being changed elsewhere): the point is the numbers, for a later change there.
Every value fp32 (the kernels' policy); one named product at a time takes bf16 operands (rounded to bf16, then an
fp32 matmul: TensorE's bf16 x bf16 -> fp32 PSUM), or all the candidates together. Errors of the output o and the
final state S against the recurrent rule in float64 on the same inputs, relative to the largest |o| and |S|;
the fp32 row is the floor every variant is measured from. Inputs are synthetic (seeded): q, k l2-normalised with
q scaled by dk^-0.5, v ~ N(0, 1), beta = sigmoid(N(0, 1)), g = -exp(A_log) softplus(a + dt_bias) with
A_log = log U(1, 16), dt_bias = 0, a ~ N(0, 1): a decay per token of about exp(-0.1) .. exp(-20).
"""

from __future__ import annotations

import argparse

import torch

PRODUCTS = ("KKt", "solve", "u_w", "wS", "QS", "QKt", "attn_v", "state_update")


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def mm(a, b, name, low):
    if name in low:
        a, b = bf16(a), bf16(b)
    return a @ b


def chunked(q, k, v, beta, g, chunk: int, low: set[str]):
    """q, k [T, dk], v [T, dv], beta, g [T], fp32 -> (o [T, dv], S [dk, dv])."""
    T, dk = k.shape
    dv = v.shape[1]
    S = torch.zeros(dk, dv)
    out = []
    for start in range(0, T, chunk):
        sl = slice(start, start + chunk)
        qc, kc, vc, bc, gc = q[sl], k[sl], v[sl], beta[sl], g[sl]
        C = kc.shape[0]
        gcum = torch.cumsum(gc, 0)
        decay = torch.exp((gcum[:, None] - gcum[None, :]).masked_fill(~torch.ones(C, C, dtype=torch.bool).tril(), -1e30))
        A = (mm(bc[:, None] * kc, kc.T, "KKt", low) * decay).tril(-1)
        # T = (I + A)^-1 by forward substitution, row by row (products in the solve: named "solve").
        Tm = torch.eye(C)
        for i in range(1, C):
            Tm[i, :i] = Tm[i, :i] - mm(A[i, :i][None], Tm[:i, :i], "solve", low)[0]
        u = mm(Tm, bc[:, None] * vc, "u_w", low)
        w = mm(Tm, bc[:, None] * kc * torch.exp(gcum)[:, None], "u_w", low)
        vp = u - mm(w, S, "wS", low)
        inter = mm(qc * torch.exp(gcum)[:, None], S, "QS", low)
        scores = mm(qc, kc.T, "QKt", low) * decay
        out.append(inter + mm(scores, vp, "attn_v", low))
        gl = gcum[-1]
        S = torch.exp(gl) * S + mm((kc * torch.exp(gl - gcum)[:, None]).T, vp, "state_update", low)
    return torch.cat(out), S


def recurrent64(q, k, v, beta, g):
    q, k, v, beta, g = (t.double() for t in (q, k, v, beta, g))
    S = torch.zeros(k.shape[1], v.shape[1], dtype=torch.float64)
    out = []
    for t in range(k.shape[0]):
        S = torch.exp(g[t]) * S
        S = S + torch.outer(k[t], beta[t] * (v[t] - S.T @ k[t]))
        out.append(S.T @ q[t])
    return torch.stack(out), S


def inputs(T: int, dk: int, dv: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, dk, generator=gen)
    k = torch.randn(T, dk, generator=gen)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dk**-0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    v = torch.randn(T, dv, generator=gen)
    beta = torch.sigmoid(torch.randn(T, generator=gen))
    A_log = torch.log(torch.empty(()).uniform_(1, 16, generator=gen))
    g = -torch.exp(A_log) * torch.nn.functional.softplus(torch.randn(T, generator=gen))
    return q, k, v, beta, g


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    variants = [("fp32 everywhere", set())] + [(f"{p} in bf16", {p}) for p in PRODUCTS] + [
        ("KKt, QKt, u_w, attn_v, state_update in bf16", {"KKt", "QKt", "u_w", "attn_v", "state_update"}),
        ("all products in bf16", set(PRODUCTS))]
    rows = {name: [0.0, 0.0] for name, _ in variants}
    for seed in range(args.seeds):
        q, k, v, beta, g = inputs(args.tokens, 128, 128, seed)
        o64, S64 = recurrent64(q, k, v, beta, g)
        for name, low in variants:
            o, S = chunked(q, k, v, beta, g, args.chunk, low)
            eo = ((o.double() - o64).abs().max() / o64.abs().max()).item()
            es = ((S.double() - S64).abs().max() / S64.abs().max()).item()
            rows[name] = [max(rows[name][0], eo), max(rows[name][1], es)]
    print(f"chunked rule vs float64 recurrent, {args.tokens} tokens, chunk {args.chunk}, dk = dv = 128, "
          f"worst of {args.seeds} seeds (max abs error / max abs value)")
    print("| products with bf16 operands | output o | final state S |\n|---|---|---|")
    for name, (eo, es) in rows.items():
        print(f"| {name} | {eo:.2e} | {es:.2e} |")
    print(f"(for scale: bf16's unit roundoff is {2**-9:.2e})")


if __name__ == "__main__":
    main()
