"""A projection (not a measurement) of TTFT, per-token latency and throughput on trn2.3xlarge, read from the graphs.

    .nox/neuron/bin/python benchmarks/neuron_projection.py            # 2B, 27B, 35B-A3B at TP 4 (issue 41 item 6)
    .nox/neuron/bin/python benchmarks/neuron_projection.py --quick    # 0.8B at TP 2, 256 tokens (the test's case)

Nothing here ran on Neuron. For each size the export's graphs are built shape-only and lowered by torch-xla on CPU
(`benchmarks/neuron_bytes_per_step.py`'s `lowered`), and three things are read from the HLO: the HBM bytes one call
moves (`hbm_traffic`, that script's counting rule), the matmul FLOPs by operand dtype (`dot_flops`), and the
collectives with their bytes. Hardware figures turn them into milliseconds; every figure is a range, its optimistic
end taking every figure at its best, its pessimistic end at its worst:

    time of a call = max(HBM bytes / (HBM bandwidth x DMA efficiency),
                         (bf16 FLOPs + fp32 FLOPs x fp32 factor) / (TensorE peak x TensorE utilization))
                     + per collective: latency + 2 (t - 1) / t x bytes / bus bandwidth

(the collectives not overlapped with compute; the same formula as `neuron_real_shapes.decode_ms`). TTFT: the
context-encoding graph, one row of `--prompt` tokens. Per token: the token-generation graph at batch 1; throughput:
batch 8 x 1000 / its step time; both with a `--cache`-token KV cache (the bytes-per-step table's 4096). Left out:
host time, launches, sampling, the compiler's schedule, VectorE / ScalarE time of the elementwise work.

The figures and their sources (each a (low, high) range):
- HBM bandwidth per logical core, TensorE bf16 peak per logical core, latency of one small all-reduce, all-reduce
  bus bandwidth: `neuron_real_shapes.TRN2`, `ALLREDUCE_US`, `BUS_GBS` (sources beside them there and in
  docs/neuron_backend.md, "Projection: the 2B on trn2.3xlarge").
- DMA efficiency 0.70 - 1.0 and the fp32 matmul factor 3.95 - 4.0: the emulator cost model's `dma_efficiency` and
  `fp32_matmul_factor` (kernels/emulator/cost.py `PARAMETERS`, with their sources).
- TensorE utilization 0.70 - 1.0: 1.0 is peak; 0.70 is what the cost model gives this project's own DeltaNet prefill
  kernel (TensorE 70% busy, docs/kernels.md "Cost"), taken for every matmul as an assumption.
- The physical floor of a decode step: the floor bytes of `neuron_bytes_per_step.floor_bytes` (weights once, the
  state) at the whole HBM bandwidth (DMA efficiency 1).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("neuron_bytes_per_step", ROOT / "benchmarks" / "neuron_bytes_per_step.py")
bytes_bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bytes_bench
_spec.loader.exec_module(bytes_bench)
shapes_bench = bytes_bench.shapes_bench  # neuron_real_shapes, loaded by it

import torch  # noqa: E402

from optimum_qwen35.backends.nxd.tracing import CONTEXT, TOKENS  # noqa: E402

TRN2, ALLREDUCE_US, BUS_GBS = shapes_bench.TRN2, shapes_bench.ALLREDUCE_US, shapes_bench.BUS_GBS
DMA_EFFICIENCY = (1.0, 0.70)  # (optimistic, pessimistic): kernels/emulator/cost.py `dma_efficiency`
FP32_FACTOR = (3.95, 4.0)  # fp32 matmul cost / bf16: kernels/emulator/cost.py `fp32_matmul_factor`
TENSOR_UTILIZATION = (1.0, 0.70)  # peak .. the cost model's DeltaNet prefill kernel (docs/kernels.md)
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

# Measured by others (ANCHORS.md section 6; trn2.3xlarge TP 4 unless said), not by this project.
PEERS = {
    "2B": "community vLLM port: 145 ms TTFT (1024 tokens), 3.88 ms/token, 465 tok/s b8; NxDI: 4.75 ms/token",
    "27B": "community vLLM port: 48.5 ms/token",
    "35B-A3B": "community vLLM port: 36 ms/token (NxDI, TP 8 on trn2.48xlarge: 7.7 ms/token, TTFT 480-667 ms)",
}
PLAN = (("2B", 4), ("27B", 4), ("35B-A3B", 4))
QUICK = (("0.8B", 2),)


def collectives(hlo: dict) -> list[tuple[str, int]]:
    """(opcode, result bytes) of every collective in the entry computation (a tuple result: its first array)."""
    comp, _ = bytes_bench.entry_of(hlo)
    out = []
    for inst in comp["instructions"]:
        opcode = inst["opcode"].removesuffix("-start")
        if opcode in COLLECTIVES:
            shape = inst["shape"]
            if shape.get("elementType") == "TUPLE":
                shape = shape["tupleShapes"][0]
            out.append((opcode, bytes_bench.nbytes(shape)))
    return out


def read_graph(size: str, tp: int, batch: int, sequence: int, key: str) -> dict:
    """What one graph's HLO says: HBM bytes under the counting rule, matmul FLOPs by operand dtype, collectives; and
    for token generation the floor bytes."""
    start = time.perf_counter()
    hlo, aliased, names, info = bytes_bench.lowered(size, tp, batch, sequence, key)
    traffic = bytes_bench.hbm_traffic(hlo, aliased)
    flops = bytes_bench.dot_flops(hlo)
    out = {
        "bytes": sum(traffic["params"].values()) + traffic["state_writes"] + sum(traffic["spills"].values()),
        "bf16_flops": sum(n for (a, b), n in flops.items() if a == b == "bf16"),
        "other_flops": sum(n for (a, b), n in flops.items() if not a == b == "bf16"),  # fp32 (f32 x f32) here
        "collectives": collectives(hlo),
        "floor": sum(bytes_bench.floor_bytes(traffic, names, info, hlo).values()) if key == TOKENS else None,
    }
    out["seconds"] = time.perf_counter() - start
    return out


def parts_ms(graph: dict, tp: int, bound: int) -> tuple[float, float, float]:
    """(HBM, TensorE, collectives) ms of one call of a graph; bound 0: optimistic end, 1: pessimistic."""
    hbm = graph["bytes"] / (TRN2["hbm_gbs_per_core"][1 - bound] * 1e9 * DMA_EFFICIENCY[bound])
    tensor = (graph["bf16_flops"] + graph["other_flops"] * FP32_FACTOR[bound]) / (
        TRN2["bf16_tflops_per_core"][1 - bound] * 1e12 * TENSOR_UTILIZATION[bound])
    comm = sum(ALLREDUCE_US[bound] * 1e-6 + 2 * (tp - 1) / tp * b / (BUS_GBS[1 - bound] * 1e9)
               for _, b in graph["collectives"])
    return 1e3 * hbm, 1e3 * tensor, 1e3 * comm


def call_ms(graph: dict, tp: int, bound: int) -> float:
    """Projected ms of one call of a graph (module docstring): HBM and TensorE overlap, the collectives do not."""
    hbm, tensor, comm = parts_ms(graph, tp, bound)
    return max(hbm, tensor) + comm


def project(size: str, tp: int, prompt: int, cache: int) -> dict:
    context = read_graph(size, tp, 1, prompt, CONTEXT)
    b1 = read_graph(size, tp, 1, cache, TOKENS)
    b8 = read_graph(size, tp, 8, cache, TOKENS)
    floor = tuple(1e3 * b1["floor"] / (TRN2["hbm_gbs_per_core"][1 - bound] * 1e9) for bound in (0, 1))
    return {
        "size": size, "tp": tp, "prompt": prompt, "cache": cache,
        "ttft": tuple(call_ms(context, tp, bound) for bound in (0, 1)),
        "b1": tuple(call_ms(b1, tp, bound) for bound in (0, 1)),
        "b8": tuple(call_ms(b8, tp, bound) for bound in (0, 1)),
        "floor": floor, "graphs": {"context": context, "b1": b1, "b8": b8},
    }


def table(rows: list[dict]) -> list[str]:
    lines = ["PROJECTION, not a measurement: trn2.3xlarge (one trn2 chip, LNC 2), bf16 export, read from the lowered "
             "graphs; each cell optimistic - pessimistic.",
             f"| size | TP | TTFT, {rows[0]['prompt']} tokens, b1 | ms/token, b1 | physical floor, b1 | b1 / floor | "
             "ms/step, b8 | tok/s, b8 | measured peers (not this project) |", "|" + "---|" * 9]
    for r in rows:
        (t0, t1), (d0, d1), (s0, s1), (f0, f1) = r["ttft"], r["b1"], r["b8"], r["floor"]
        lines.append(f"| {r['size']} | {r['tp']} | {t0:.1f} - {t1:.1f} ms | {d0:.2f} - {d1:.2f} | {f0:.2f} - "
                     f"{f1:.2f} ms | {d0 / f0:.2f} - {d1 / f1:.2f}x | {s0:.2f} - {s1:.2f} | {8e3 / s1:,.0f} - "
                     f"{8e3 / s0:,.0f} | {PEERS.get(r['size'], '-')} |")
    return lines


def inputs_table(rows: list[dict]) -> list[str]:
    """What the projection read from each graph (per rank)."""
    lines = ["| size | graph | HBM bytes (counted) | bf16 GFLOP | fp32 GFLOP | collectives (bytes) | HBM ms | TensorE ms | "
             "collectives ms | lowered in |", "|" + "---|" * 10]
    for r in rows:
        for name, g in r["graphs"].items():
            colls = g["collectives"]
            low, high = parts_ms(g, r["tp"], 0), parts_ms(g, r["tp"], 1)
            ms = " | ".join(f"{a:.2f} - {b:.2f}" for a, b in zip(low, high))
            lines.append(f"| {r['size']} | {name} | {bytes_bench.fmt(g['bytes'])} | {g['bf16_flops'] / 1e9:.1f} | "
                         f"{g['other_flops'] / 1e9:.1f} | {len(colls)} ({bytes_bench.fmt(sum(b for _, b in colls))}) "
                         f"| {ms} | {g['seconds']:.0f} s |")
    return lines


def goal(rows: list[dict]) -> list[str]:
    """Issue 41's goal: the 2B's per-token latency at TP 4, batch 1, within 1.5x of the physical floor."""
    row = next((r for r in rows if r["size"] == "2B" and r["tp"] == 4), None)
    if row is None:
        return []
    (d0, d1), (f0, f1) = row["b1"], row["floor"]
    comm = [parts_ms(row["graphs"]["b1"], row["tp"], bound)[2] for bound in (0, 1)]
    met = "met at both ends" if d1 <= 1.5 * f1 else ("met only at the optimistic end" if d0 <= 1.5 * f0 else "not met")
    return [f"Goal (2B, TP 4, batch 1, within 1.5x of the floor: {1.5 * f0:.2f} - {1.5 * f1:.2f} ms): projected "
            f"{d0:.2f} - {d1:.2f} ms, {met}; of it the step's {len(row['graphs']['b1']['collectives'])} collectives "
            f"take {comm[0]:.2f} - {comm[1]:.2f} ms."]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="0.8B at TP 2, 256-token prompt and cache")
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens of the TTFT (context bucket)")
    parser.add_argument("--cache", type=int, default=4096, help="KV cache length of the decode graphs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    plan, prompt, cache = (QUICK, 256, 256) if args.quick else (PLAN, args.prompt, args.cache)
    rows = []
    for size, tp in plan:
        row = project(size, tp, prompt, cache)
        rows.append(row)
        print(f"{size} TP {tp}: graphs lowered and read in "
              f"{sum(g['seconds'] for g in row['graphs'].values()):.0f} s", flush=True)
    print("\n".join(inputs_table(rows)))
    print("\n".join(table(rows)))
    print("\n".join(goal(rows)))


if __name__ == "__main__":
    main()
