"""Cost-model estimates of the DeltaNet NKI kernels at the Qwen3.5-2B layer shape on one rank (trn2, bf16 activations).

    python benchmarks/deltanet_kernels.py            # decode at batch 1 and 8, prefill of 4096 tokens
    python benchmarks/deltanet_kernels.py --tokens 512

Both operand variants are estimated: fp32 TensorE operands (the default, what the `nki` backend runs: exact) and tf32
operands (`tf32_matmul=True`, bf16's TensorE rate). Runs the kernels on the NKI emulator with compute=False (rules
and costs, no arithmetic) and prints each engine's busy
time and utilization. Decode is compared with the time to read and write the slots' fp32 states at the NeuronCore's
HBM bandwidth (2.9 TB/s / 8 on trn2); the issue's targets: prefill of 4096 tokens <= 1.0 ms with TensorE the
busiest engine, decode within 1.5x of that state-traffic time.
"""

from __future__ import annotations

import argparse
import time

import ml_dtypes
import numpy as np

from optimum_qwen35.kernels.emulator import estimate
from optimum_qwen35.kernels.gated_delta_rule.cte import gated_delta_rule_cte, solve_masks
from optimum_qwen35.kernels.gated_delta_rule.tkg import gated_delta_rule_tkg

NK = NV = 16
DK = DV = 128
K = 4
BF16 = ml_dtypes.bfloat16
HBM_PER_CORE = 2900e9 / 8


def decode(batch: int, tf32: bool = False):
    C = 2 * NK * DK + NV * DV
    z = np.zeros
    args = (z((batch, C), BF16), z((batch, NV), BF16), z((batch, NV), BF16), z(NV, np.float32), z(NV, np.float32),
            z((C, K), BF16), z((batch, C, K - 1), BF16), z((batch, NV, DK, DV), np.float32),
            np.arange(batch, dtype=np.int32).reshape(1, batch), tf32)
    _, report = estimate(gated_delta_rule_tkg, *args, target="trn2", compute=False)
    ideal_us = 2 * batch * NV * DK * DV * 4 / HBM_PER_CORE * 1e6
    return report, ideal_us


def prefill(tokens: int, tf32: bool = False):
    z = np.zeros
    args = (z((1, NK, tokens, DK), BF16), z((1, NK, tokens, DK), BF16), z((1, NV, tokens, DV), BF16),
            z((1, tokens, NV), BF16), z((1, tokens, NV), BF16), z(NV, np.float32), z(NV, np.float32),
            z((1, NV, DK, DV), np.float32), np.zeros((1, 1), np.int32), np.full((1, 1), tokens, np.int32),
            solve_masks(), tf32)
    _, report = estimate(gated_delta_rule_cte, *args, target="trn2", compute=False)
    return report


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    for tf32 in (False, True):
        operands = "tf32 TensorE operands (tf32_matmul=True)" if tf32 else "fp32 TensorE operands (the default)"
        print(f"==================== {operands}\n")
        for batch in (1, 8):
            t = time.time()
            report, ideal = decode(batch, tf32)
            print(f"decode, batch {batch} (2B layer, 16 heads, dk = dv = 128, trn2, bf16 activations, {operands}):")
            print(report)
            print(f"  state read + write at HBM bandwidth: {ideal:.2f} us; estimate / that = "
                  f"{report.total_us / ideal:.2f} (target <= 1.5)  [{time.time() - t:.0f} s to estimate]\n")
        t = time.time()
        report = prefill(args.tokens, tf32)
        print(f"prefill of {args.tokens} tokens, batch 1 (2B layer, 16 heads, dk = dv = 128, trn2, bf16 activations, "
              f"{operands}):")
        print(report)
        print(f"  target: <= 1000 us with TensorE the busiest engine; estimate {report.total_us:.0f} us, busiest "
              f"{max(report.busy_us, key=report.busy_us.get)}  [{time.time() - t:.0f} s to estimate]\n")


if __name__ == "__main__":
    main()
