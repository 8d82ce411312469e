"""Cost-model estimates of the DeltaNet NKI kernels at the Qwen3.5-2B layer shape on one rank (trn2, bf16 activations).

    python benchmarks/deltanet_kernels.py            # decode at batch 1 and 8, prefill of 4096 tokens
    python benchmarks/deltanet_kernels.py --tokens 512

Runs the kernels on the NKI emulator with compute=False (rules and costs, no arithmetic) and prints, for each
kernel and TensorE operand mode, each engine's busy time and utilization, and the issue's target with whether it is
met:

* prefill of 4096 tokens in at most 1.0 ms with TensorE the busiest engine. The kernel is launched as on trn2, where
  neuronx-cc compiles for LNC=2: `kernel[2]`, the heads split over the two physical NeuronCores of the logical core
  (busy times are those of the busier core); LNC=1 (one physical core) is printed for reference. Operand modes: fp32
  (exact, the `nki` backend's default), tf32 and bf16 (`bf16_matmul=True`, the mode the target is measured in).
* decode within 1.5x of the time to read and write the slots' fp32 states at the NeuronCore's HBM bandwidth
  (2.9 TB/s / 8 on trn2). Operand modes: fp32 (default) and tf32.
"""

from __future__ import annotations

import argparse
import time

import ml_dtypes
import numpy as np

from optimum_qwen35.kernels.emulator import estimate
from optimum_qwen35.kernels.emulator.cost import ENGINES
from optimum_qwen35.kernels.gated_delta_rule.cte import gated_delta_rule_cte, solve_masks
from optimum_qwen35.kernels.gated_delta_rule.tkg import gated_delta_rule_tkg

NK = NV = 16
DK = DV = 128
K = 4
BF16 = ml_dtypes.bfloat16
HBM_PER_CORE = 2900e9 / 8
PREFILL_TARGET_US = 1000.0
DECODE_TARGET_RATIO = 1.5


def decode(batch: int, tf32: bool = False):
    C = 2 * NK * DK + NV * DV
    z = np.zeros
    args = (z((batch, C), BF16), z((batch, NV), BF16), z((batch, NV), BF16), z(NV, np.float32), z(NV, np.float32),
            z((C, K), BF16), z((batch, C, K - 1), BF16), z((batch, NV, DK, DV), np.float32),
            np.arange(batch, dtype=np.int32).reshape(1, batch), tf32)
    _, report = estimate(gated_delta_rule_tkg, *args, target="trn2", compute=False)
    ideal_us = 2 * batch * NV * DK * DV * 4 / HBM_PER_CORE * 1e6
    return report, ideal_us


def prefill(tokens: int, operands: str = "fp32", lnc: int = 2):
    z = np.zeros
    args = (z((1, NK, tokens, DK), BF16), z((1, NK, tokens, DK), BF16), z((1, NV, tokens, DV), BF16),
            z((1, tokens, NV), BF16), z((1, tokens, NV), BF16), z(NV, np.float32), z(NV, np.float32),
            z((1, NV, DK, DV), np.float32), np.zeros((1, 1), np.int32), np.full((1, 1), tokens, np.int32),
            solve_masks(), operands == "tf32", operands == "bf16")
    _, report = estimate(gated_delta_rule_cte, *args, target="trn2", compute=False, grid=lnc)
    return report


def engine_table(report) -> str:
    return "  ".join(f"{e} {report.busy_us[e]:.1f} us ({100 * report.utilization[e]:.0f}%)" for e in ENGINES)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    summary = []
    for operands in ("fp32", "tf32"):
        for batch in (1, 8):
            t = time.time()
            report, ideal = decode(batch, operands == "tf32")
            ratio = report.total_us / ideal
            met = ratio <= DECODE_TARGET_RATIO
            print(f"decode, batch {batch}, {operands} TensorE operands (2B layer, 16 heads, dk = dv = 128, trn2, "
                  f"bf16 activations):")
            print(report)
            print(f"  state read + write at HBM bandwidth: {ideal:.2f} us; estimate / that = {ratio:.2f} "
                  f"(target <= {DECODE_TARGET_RATIO}: {'MET' if met else 'NOT met'})  [{time.time() - t:.0f} s]\n")
            summary.append((f"decode b{batch}, {operands}", report, f"{ratio:.2f}x of {ideal:.2f} us "
                            f"(<= {DECODE_TARGET_RATIO}x: {'met' if met else 'not met'})"))
    for operands, lnc in (("fp32", 2), ("tf32", 2), ("bf16", 2), ("bf16", 1)):
        t = time.time()
        report = prefill(args.tokens, operands, lnc)
        busiest = max(report.busy_us, key=report.busy_us.get)
        met = report.total_us <= PREFILL_TARGET_US and busiest == "tensor"
        print(f"prefill of {args.tokens} tokens, batch 1, {operands} TensorE operands, LNC={lnc} (2B layer, 16 heads, "
              f"dk = dv = 128, trn2, bf16 activations):")
        print(report)
        print(f"  target: <= {PREFILL_TARGET_US:.0f} us with TensorE the busiest engine; estimate "
              f"{report.total_us:.0f} us, busiest {busiest}: {'MET' if met else 'NOT met'}  [{time.time() - t:.0f} s]\n")
        summary.append((f"prefill {args.tokens}, {operands}, LNC={lnc}", report,
                        f"{report.total_us:.0f} us, busiest {busiest} (<= {PREFILL_TARGET_US:.0f} us, TensorE "
                        f"busiest: {'met' if met else 'not met'})"))
    print("summary (busy time per engine, utilization; for LNC=2 the busier physical core):")
    for name, report, verdict in summary:
        print(f"  {name:28s} {report.total_us:8.1f} us  {verdict}")
        print(f"      {engine_table(report)}")


if __name__ == "__main__":
    main()
