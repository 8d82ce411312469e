"""The dynamic-count blockwise MoE kernel (kernels/moe_blockwise, issue 51 item 1) on the NKI emulator: executed routed
work and cost-model time at 1,024 and 4,096 prompt tokens with the 35B-A3B's routing structure at TP 4 (experts split
inside: 256 local experts, top 8, I_r = 512 / 4 = 128), against the static bound the cpu target / NxD form runs.

    OMP_NUM_THREADS=1 python benchmarks/moe_blockwise_kernel.py [--hidden 512] [--tokens 1024 4096] [--blocks 128 64 32 16]

Hidden is scaled down from 2,048 to 512 by default (the emulator computes every matmul in NumPy; the weights of 256
experts at 2,048 are 0.8 GB in fp32 storage): block counts and row factors do not depend on it; weight and row bytes
both scale with it, so the time ratios move little (the 2,048 run is `--hidden 2048`).

- routing: uniform (softmax of seeded Gaussian router logits, top 8), the docs' assumption; and balanced (token t takes
  experts (8t + j) mod 256: every expert exactly N k / E pairs), where blocks of N k / E rows are all full: the top-k
  minimum's work with the kernel's own per-row and per-expert costs;
- executed blocks: read from the cost report (TensorE instructions / per-block instructions), equal to the layout's
  filled count (checked); rows factor = executed blocks x B / (N k);
- static: the blocked form's bound (layout.py `block_count`), every block computed (docs/neuron_backend.md "MoE
  prompts: the blocked routed form"); priced by running the same kernel with one table entry per block (each block
  loads its expert's weights, as `Experts.blocks` gathers them, and every block of the bound runs);
- time: the emulator's cost model (trn2, bf16 operands), one kernel call; "vs minimum" = time / the balanced routing's
  time at B = N k / E (rows factor 1).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from optimum_qwen35.kernels.emulator import estimate  # noqa: E402
from optimum_qwen35.kernels.moe_blockwise.kernel import moe_blocks_kernel  # noqa: E402
from optimum_qwen35.kernels.moe_blockwise.layout import block_layout  # noqa: E402

E, K, I = 256, 8, 128


def routing(kind: str, N: int) -> torch.Tensor:
    if kind == "balanced":
        return ((torch.arange(N)[:, None] * K + torch.arange(K)[None, :]) % E).to(torch.int32)
    logits = torch.randn(N, E, generator=torch.Generator().manual_seed(0))
    return torch.softmax(logits, -1).topk(K, -1).indices.to(torch.int32)


def run(N: int, H: int, B: int, kind: str, static: bool = False) -> dict:
    ids = routing(kind, N)
    layout = block_layout(ids, E, B)
    if static:  # the static blocked form's work: every block of the bound, each with its expert's weights loaded
        nb = layout.nb
        layout.used = layout.block_expert[:, None].contiguous()
        layout.start = torch.arange(nb, dtype=torch.int32)[:, None].contiguous()
        layout.end = layout.start + 1
        layout.n_used = torch.tensor([[nb]], dtype=torch.int32)
        layout.filled = torch.tensor(nb, dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N + 1, H, generator=g).to(torch.bfloat16)
    x_t = x.index_select(0, layout.token).view(layout.nb, B, H).transpose(1, 2).contiguous()
    gate_up_t = (torch.randn(E, H, 2 * I, generator=g) * 0.02).to(torch.bfloat16)
    down_t = (torch.randn(E, I, H, generator=g) * 0.02).to(torch.bfloat16)
    out = torch.zeros(layout.nb, B, H)
    _, report = estimate(moe_blocks_kernel, x_t, gate_up_t, down_t, layout.used, layout.start, layout.end,
                         layout.n_used, out, target="trn2")
    # TensorE records per block: gate and up over the H tiles (one I tile), down over the 512-column chunks; each
    # matmul a LoadStationary and a MultiplyMoving (the stationary changes every time).
    per_block = 2 * (2 * (-(-H // 128)) + (-(-H // 512)))
    executed = report.instructions["tensor"] / per_block
    return {"filled": int(layout.filled), "executed": executed, "nb": layout.nb, "us": report.total_us,
            "used": int(layout.n_used), "rows": executed * B / (N * K), "static": layout.nb * B / (N * K),
            "dma_mb": report.dma_bytes / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--blocks", type=int, nargs="+", default=[128, 64, 32, 16])
    parser.add_argument("--static", type=int, nargs="*", default=[128], help="block sizes to price the static form at")
    args = parser.parse_args()
    torch.set_num_threads(1)
    H = args.hidden
    print(f"35B-A3B routing at TP 4 (E_r = {E}, top {K}, I_r = {I}), hidden {H}; trn2 cost model, bf16 operands")
    print("| tokens | B | routing | used experts | static blocks (bound) | executed blocks | rows factor (executed) "
          "| rows factor (static) | DMA MB | kernel us | vs minimum |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for N in args.tokens:
        best = run(N, H, N * K // E, "balanced")
        assert best["rows"] == 1.0, best
        print(f"| {N} | {N * K // E} | balanced (the minimum) | {best['used']} | {best['nb']} | {best['executed']:.0f} | "
              f"1.00 | {best['static']:.2f} | {best['dma_mb']:.1f} | {best['us']:.0f} | 1.00 |")
        for B in args.blocks:
            r = run(N, H, B, "uniform")
            assert r["executed"] == r["filled"], r
            print(f"| {N} | {B} | uniform | {r['used']} | {r['nb']} | {r['filled']} | {r['rows']:.2f} | "
                  f"{r['static']:.2f} | {r['dma_mb']:.1f} | {r['us']:.0f} | {r['us'] / best['us']:.2f} |")
            if B in args.static:
                s = run(N, H, B, "uniform", static=True)
                print(f"| {N} | {B} | uniform, static form (every block, weights per block) | - | {s['nb']} | "
                      f"{s['executed']:.0f} | {s['rows']:.2f} | {s['static']:.2f} | {s['dma_mb']:.1f} | {s['us']:.0f} | "
                      f"{s['us'] / best['us']:.2f} |")


if __name__ == "__main__":
    main()
