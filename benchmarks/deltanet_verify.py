"""Cost-model estimate of the NKI verify kernel (k + 1 decode steps per row, every position's states stored) against
the plain one-token decode kernel, at the Qwen3.5-2B DeltaNet layer on one rank (trn2: 16 heads, dk = dv = 128).

    python benchmarks/deltanet_verify.py            # bf16 model (default operands), batch 1 and 8, k = 1..4
    python benchmarks/deltanet_verify.py --fp32     # and an fp32 model (fp32 operands)

Both kernels run on the NKI emulator with compute=False (rules and costs, no arithmetic), as
benchmarks/deltanet_kernels.py runs them. "ratio" is verify / plain step at the middle of every cost-model parameter
range; the range beside it is the hull of the same ratio with each parameter (kernels/emulator/cost.py `PARAMETERS`)
at its low and high end, one at a time, with all of them low and all high, both kernels re-priced with the same
parameters. "traffic" is the state bytes of verify over those of a plain step: one state read and k + 1 written
against one read and one written, (k + 2) / 2, the floor of this design. Issue 39's target: verify of k + 1 tokens
<= 1.3x a plain step at batch 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import time

import numpy as np

from optimum_qwen35.kernels.emulator import cost, estimate
from optimum_qwen35.kernels.gated_delta_rule.tkg import gated_delta_rule_verify

TARGET_RATIO = 1.3


def _deltanet_kernels():
    """benchmarks/deltanet_kernels.py: the 2B layer's shapes and the plain decode kernel's launch."""
    path = pathlib.Path(__file__).with_name("deltanet_kernels.py")
    spec = importlib.util.spec_from_file_location("deltanet_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _deltanet_kernels()


def verify(batch: int, positions: int, operands: str = "auto", activations: str = "bf16"):
    """The verify kernel over `positions` = k + 1 tokens per row at the 2B layer shape: its cost report."""
    NK, NV, DK, DV, K = bench.NK, bench.NV, bench.DK, bench.DV, bench.K
    C = 2 * NK * DK + NV * DV
    z, act = np.zeros, bench.ACTIVATIONS[activations]
    args = (z((batch, positions, C), act), z((batch, positions, NV), act), z((batch, positions, NV), act),
            z(NV, np.float32), z(NV, np.float32), z((C, K), act), z((batch, C, K - 1), act),
            z((batch, NV, DK, DV), np.float32), operands)
    _, report = estimate(gated_delta_rule_verify, *args, target="trn2", compute=False)
    return report


def parameter_sets():
    """The mid parameters, each varied parameter at its low and its high end, all low, all high."""
    varied = [p for p in cost.PARAMETERS if p.low != p.high]
    sets = [cost.DEFAULT_PARAMS]
    for p in varied:
        sets += [cost.DEFAULT_PARAMS.with_value(p.field, p.low), cost.DEFAULT_PARAMS.with_value(p.field, p.high)]
    for pick in (lambda p: p.low, lambda p: p.high):
        params = cost.DEFAULT_PARAMS
        for p in varied:
            params = params.with_value(p.field, pick(p))
        sets.append(params)
    return sets


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fp32", action="store_true", help="also an fp32 model (fp32 activations and operands)")
    args = parser.parse_args()
    modes = [("auto", "bf16")] + ([("auto", "fp32")] if args.fp32 else [])
    sets = parameter_sets()
    rows = []
    for operands, activations in modes:
        for batch in (1, 8):
            t = time.time()
            bench.decode(batch, operands, activations)
            plain = cost.last_trace()
            plain_us = [plain.report(p).total_us for p in sets]
            for k in (1, 2, 3, 4):
                verify(batch, k + 1, operands, activations)
                trace = cost.last_trace()
                verify_us = [trace.report(p).total_us for p in sets]
                ratios = [v / p for v, p in zip(verify_us, plain_us)]
                rows.append((activations, batch, k, plain_us[0], verify_us[0], ratios[0], min(ratios), max(ratios),
                             (k + 2) / 2))
            print(f"traced {activations} model, batch {batch}: plain step and k = 1..4, re-priced at {len(sets)} "
                  f"parameter sets [{time.time() - t:.0f} s]")
    print()
    print("| model | batch | k | plain step (us) | verify k + 1 (us) | ratio | range | traffic (k + 2) / 2 | "
          f"<= {TARGET_RATIO}x |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for activations, batch, k, plain_us, verify_us, ratio, low, high, traffic in rows:
        met = "yes" if high <= TARGET_RATIO else ("at mid" if ratio <= TARGET_RATIO else "no")
        print(f"| {activations} | {batch} | {k} | {plain_us:.1f} | {verify_us:.1f} | **{ratio:.2f}x** | "
              f"{low:.2f} - {high:.2f} | {traffic:.2f} | {met} |")


if __name__ == "__main__":
    main()
