"""Cost-model estimates of the DeltaNet NKI kernels at the Qwen3.5-2B layer shape on one rank (trn2).

    python benchmarks/deltanet_kernels.py            # decode at batch 1 and 8, prefill of 4096 tokens
    python benchmarks/deltanet_kernels.py --tokens 512

Runs the kernels on the NKI emulator with compute=False (rules and costs, no arithmetic) and prints, for each
kernel and operand mode, each engine's busy time and utilization, and the issue's target with whether it is met.
The first rows are the default operand policy (kernels/gated_delta_rule/operands.py) of a bf16 model: bf16 TensorE
operands, fp32 accumulation and state; the fp32 rows are what an fp32 model runs (fp32 activations and operands)
and the explicit `operands="fp32"` / `"tf32"` options of a bf16 model.

* prefill of 4096 tokens in at most 1.0 ms with TensorE the busiest engine. The kernel is launched as on trn2, where
  neuronx-cc compiles for LNC=2: `kernel[2]`, the heads split over the two physical NeuronCores of the logical core
  (busy times are those of the busier core); LNC=1 (one physical core) is printed for reference.
* decode within 1.15x of the cost model's floor: the slots' fp32 states read and written once at the model's DMA
  rate (`emulator.cost.dma_bandwidth`: efficiency x the NeuronCore's HBM bandwidth). The ratio to the same traffic at
  the raw HBM bandwidth (2.9 TB/s / 8 on trn2, the metric of earlier rounds) is printed beside it.
"""

from __future__ import annotations

import argparse
import time

import ml_dtypes
import numpy as np

from optimum_qwen35.kernels.emulator import estimate
from optimum_qwen35.kernels.emulator.cost import ENGINES, dma_bandwidth
from optimum_qwen35.kernels.emulator.rules import get_target
from optimum_qwen35.kernels.gated_delta_rule.cte import gated_delta_rule_cte, solve_masks
from optimum_qwen35.kernels.gated_delta_rule.tkg import gated_delta_rule_tkg

NK = NV = 16
DK = DV = 128
K = 4
BF16 = ml_dtypes.bfloat16
HBM_PER_CORE = 2900e9 / 8
PREFILL_TARGET_US = 1000.0
DECODE_TARGET_RATIO = 1.15
ACTIVATIONS = {"bf16": BF16, "fp32": np.float32}


def state_traffic_us(batch: int) -> tuple[float, float]:
    """The rows' fp32 states read and written once: (at the cost model's DMA rate, at the raw HBM bandwidth)."""
    nbytes = 2 * batch * NV * DK * DV * 4
    return nbytes / dma_bandwidth(get_target("trn2")) * 1e6, nbytes / HBM_PER_CORE * 1e6


def decode(batch: int, operands: str = "auto", activations: str = "bf16"):
    C = 2 * NK * DK + NV * DV
    z, act = np.zeros, ACTIVATIONS[activations]
    args = (z((batch, C), act), z((batch, NV), act), z((batch, NV), act), z(NV, np.float32), z(NV, np.float32),
            z((C, K), act), z((batch, C, K - 1), act), z((batch, NV, DK, DV), np.float32), operands)
    _, report = estimate(gated_delta_rule_tkg, *args, target="trn2", compute=False)
    return report


def prefill(tokens: int, operands: str = "auto", lnc: int = 2, activations: str = "bf16"):
    z, act = np.zeros, ACTIVATIONS[activations]
    args = (z((1, NK, tokens, DK), act), z((1, NK, tokens, DK), act), z((1, NV, tokens, DV), act),
            z((1, tokens, NV), act), z((1, tokens, NV), act), z(NV, np.float32), z(NV, np.float32),
            z((1, NV, DK, DV), np.float32), np.full((1, 1), tokens, np.int32),
            solve_masks(), operands)
    _, report = estimate(gated_delta_rule_cte, *args, target="trn2", compute=False, grid=lnc)
    return report


def engine_table(report) -> str:
    return "  ".join(f"{e} {report.busy_us[e]:.1f} us ({100 * report.utilization[e]:.0f}%)" for e in ENGINES)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    summary = []
    # (operands, activations): the bf16 model's default first
    modes = (("auto", "bf16"), ("fp32", "fp32"), ("fp32", "bf16"), ("tf32", "bf16"))
    for operands, activations in modes:
        for batch in (1, 8):
            t = time.time()
            report = decode(batch, operands, activations)
            floor, raw = state_traffic_us(batch)
            ratio = report.total_us / floor
            met = ratio <= DECODE_TARGET_RATIO
            name = f"{operands} operands, {activations} activations" + (" (default)" if operands == "auto" else "")
            print(f"decode, batch {batch}, {name} (2B layer, 16 heads, dk = dv = 128, trn2):")
            print(report)
            print(f"  state read + write at the model's DMA rate: {floor:.2f} us; estimate / that = {ratio:.2f} "
                  f"(target <= {DECODE_TARGET_RATIO}: {'MET' if met else 'NOT met'}); at the raw HBM bandwidth "
                  f"{raw:.2f} us: {report.total_us / raw:.2f}x  [{time.time() - t:.0f} s]\n")
            summary.append((f"decode b{batch}, {operands}/{activations}", report,
                            f"{ratio:.2f}x of {floor:.2f} us (<= {DECODE_TARGET_RATIO}x: {'met' if met else 'not met'}; "
                            f"{report.total_us / raw:.2f}x of {raw:.2f} us at raw HBM bandwidth)"))
    for operands, activations, lnc in (("auto", "bf16", 2), ("fp32", "fp32", 2), ("fp32", "bf16", 2),
                                       ("tf32", "bf16", 2), ("auto", "bf16", 1)):
        t = time.time()
        report = prefill(args.tokens, operands, lnc, activations)
        busiest = max(report.busy_us, key=report.busy_us.get)
        met = report.total_us <= PREFILL_TARGET_US and busiest == "tensor"
        name = f"{operands} operands, {activations} activations" + (" (default)" if operands == "auto" else "")
        print(f"prefill of {args.tokens} tokens, batch 1, {name}, LNC={lnc} (2B layer, 16 heads, dk = dv = 128, "
              f"trn2):")
        print(report)
        print(f"  target: <= {PREFILL_TARGET_US:.0f} us with TensorE the busiest engine; estimate "
              f"{report.total_us:.0f} us, busiest {busiest}: {'MET' if met else 'NOT met'}  [{time.time() - t:.0f} s]\n")
        summary.append((f"prefill {args.tokens}, {operands}/{activations}, LNC={lnc}", report,
                        f"{report.total_us:.0f} us, busiest {busiest} (<= {PREFILL_TARGET_US:.0f} us, TensorE "
                        f"busiest: {'met' if met else 'not met'})"))
    print("summary (busy time per engine, utilization; for LNC=2 the busier physical core):")
    for name, report, verdict in summary:
        print(f"  {name:34s} {report.total_us:8.1f} us  {verdict}")
        print(f"      {engine_table(report)}")


if __name__ == "__main__":
    main()
