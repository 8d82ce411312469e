"""The NKI emulator's cost model against the measurements the Neuron documentation publishes for its tutorials,
and the sensitivity of the DeltaNet kernels' headline figures to the model's parameters.

    python benchmarks/nki_cost_model.py                  # calibration: all workloads (about two minutes)
    python benchmarks/nki_cost_model.py --quick          # calibration: the small ones only
    python benchmarks/nki_cost_model.py --sensitivity    # headline figures over the parameter ranges (~1 minute)

Published measurements (Neuron documentation, aws-neuron-sdk repository, ``nki/guides/tutorials``):

* "Fused Mamba" tutorial (fused_mamba.rst): device latency and VectorE active time of ``mamba_v1``/``mamba_v2``
  for fp32 inputs [batch=1, seq_len=512, channels=256|4096, state_size=16]. The page does not name the instance;
  the emulator models it as trn1 (see docs/nki_emulator.md), and also prints the trn2 estimate.
  The same page's seq_len table gives ``mamba_v2`` at seq_len 1024 and 2048 (4.4 ms, 8.9 ms; longer ones spill).
* "Introduction to NKI kernel optimization" tutorial (kernel-optimization.rst): engine active percentages from
  neuron-profile for the four matmul versions, fp32 lhs [4096, 8192] x rhs [8192, 8192], on trn2
  (``NEURON_PLATFORM_TARGET_OVERRIDE=trn2`` in the tutorial).

The workloads are the doc-style kernels of ``benchmarks/_nki_workloads.py``, run with ``compute=False``
(rules and costs, no arithmetic) and ``capacity="spill"`` (the tutorial shapes exceed SBUF where the compiler
spills). The one calibrated parameter, the DMA efficiency, is fitted here on the matmul utilizations and printed
next to the value stored in ``cost.py``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace

import ml_dtypes
import numpy as np

from optimum_qwen35.kernels.emulator import cost, estimate, install_as_nki, rules

# The workloads are the sibling file benchmarks/_nki_workloads.py, loaded by its path (run from anywhere).
_spec = importlib.util.spec_from_file_location("_nki_workloads", pathlib.Path(__file__).resolve().parent / "_nki_workloads.py")
ex = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = ex
_spec.loader.exec_module(ex)

MAMBA_URL = "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/guides/tutorials/fused_mamba.html"
MATMUL_URL = "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/guides/tutorials/kernel-optimization.html"


@dataclass
class Workload:
    name: str
    kernel: object
    shapes: dict
    target: str
    quick: bool = False


@dataclass
class Measurement:
    workload: str
    metric: str  # "latency_us" or "<engine>_util"
    published: float
    source: str
    band: float  # the model's stated error band: |relative error| for latencies, |points| / 100 for utilizations


def mamba_args(channels, seq_len=512, state=16, batch=1):
    z = np.zeros
    f32 = np.float32
    return (z((batch, channels, seq_len), f32), z((batch, channels, seq_len), f32), z((channels, state), f32),
            z((batch, state, seq_len), f32), z((batch, state, seq_len), f32))


MATMUL_SHAPES = (np.zeros((8192, 4096), np.float32), np.zeros((8192, 8192), np.float32))  # lhsT [K, M], rhs [K, N]

WORKLOADS = [
    Workload("mamba_v1 c=256", ex.mamba_v1, {"channels": 256}, "trn1", quick=True),
    Workload("mamba_v1 c=4096", ex.mamba_v1, {"channels": 4096}, "trn1"),
    Workload("mamba_v2 c=4096", ex.mamba_v2, {"channels": 4096}, "trn1"),
    Workload("mamba_v2 c=4096 s=1024", ex.mamba_v2, {"channels": 4096, "seq_len": 1024}, "trn1"),
    Workload("mamba_v2 c=4096 s=2048", ex.mamba_v2, {"channels": 4096, "seq_len": 2048}, "trn1"),
    Workload("matmul tiled", ex.matmul_tiled, {}, "trn2"),
    Workload("matmul hoisted", ex.matmul_hoisted, {}, "trn2"),
    Workload("matmul block-free", ex.matmul_block_free, {}, "trn2"),
    Workload("matmul fully-blocked", ex.matmul_fully_blocked, {}, "trn2"),
]

MEASUREMENTS = [
    Measurement("mamba_v1 c=256", "latency_us", 172.93, f"{MAMBA_URL} ('takes 172.93 usec')", 0.1),
    Measurement("mamba_v1 c=256", "vector_util", 0.9871, f"{MAMBA_URL} ('VectorE is active over 98.71%')", 0.05),
    Measurement("mamba_v1 c=4096", "latency_us", 2340.0, f"{MAMBA_URL} ('now 2.34 ms')", 0.15),
    Measurement("mamba_v1 c=4096", "vector_util", 0.9216, f"{MAMBA_URL} ('dropped to 92.16%')", 0.1),
    Measurement("mamba_v2 c=4096", "latency_us", 1610.0, f"{MAMBA_URL} ('now 1.61 ms')", 0.7),
    Measurement("mamba_v2 c=4096", "vector_util", 0.9963, f"{MAMBA_URL} ('back up to 99.63%')", 0.06),
    Measurement("mamba_v2 c=4096 s=1024", "latency_us", 4400.0, f"{MAMBA_URL} (seq_len table: 4.4 ms)", 0.2),
    Measurement("mamba_v2 c=4096 s=2048", "latency_us", 8900.0, f"{MAMBA_URL} (seq_len table: 8.9 ms)", 0.15),
    Measurement("matmul tiled", "dma_util", 0.9993, f"{MATMUL_URL} ('DMA engines were active 99.93%')", 0.04),
    Measurement("matmul tiled", "tensor_util", 0.8728, f"{MATMUL_URL} ('TensorE was only active 87.28%')", 0.2),
    Measurement("matmul hoisted", "dma_util", 0.9973, f"{MATMUL_URL} ('DMA engines are now busy 99.73%')", 0.04),
    Measurement("matmul hoisted", "tensor_util", 0.9985, f"{MATMUL_URL} ('TensorE is busy 99.85%')", 0.1),
    Measurement("matmul block-free", "tensor_util", 0.9952, f"{MATMUL_URL} ('dropping to 99.52%')", 0.06),
    Measurement("matmul block-free", "dma_util", 0.9570, f"{MATMUL_URL} ('DMA engines hitting 95.70%')", 0.46),
    Measurement("matmul fully-blocked", "dma_util", 0.2154,
                f"{MATMUL_URL} ('DMA engines are now active only 21.54%')", 0.09),
    Measurement("matmul fully-blocked", "tensor_util", 0.9950, f"{MATMUL_URL} ('TensorE is now active 99.50%')", 0.05),
    Measurement("matmul fully-blocked", "vector_util", 0.1055, f"{MATMUL_URL} ('VectorE active 10.55%')", 0.06),
]

# Published, but outside the model: the compiler spills SBUF for this shape and spill traffic is not modeled.
NOT_MODELED = [
    ("mamba_v2 c=4096 seq=8192", "latency_us", 53330.0, f"{MAMBA_URL} ('now takes 53.33 ms', with SBUF spills)"),
]


def trace_workload(w: Workload):
    if w.kernel in (ex.mamba_v1, ex.mamba_v2):
        args = mamba_args(**w.shapes)
    else:
        args = MATMUL_SHAPES
    _, report = estimate(w.kernel, *args, target=w.target, compute=False, capacity="spill")
    return w.kernel.last_trace, report


def metric(report: cost.CostReport, name: str) -> float:
    return report.total_us if name == "latency_us" else report.utilization[name[: -len("_util")]]


def error(measurement: Measurement, estimate_value: float) -> float:
    """Relative error for latencies, absolute difference (fraction) for utilizations."""
    if measurement.metric == "latency_us":
        return (estimate_value - measurement.published) / measurement.published
    return estimate_value - measurement.published


def evaluate(traces: dict, params: cost.CostParams, measurements=MEASUREMENTS):
    rows, reports = [], {}
    for m in measurements:
        if m.workload not in traces:
            continue
        if m.workload not in reports:  # one schedule per workload
            reports[m.workload] = traces[m.workload].report(params)
        value = metric(reports[m.workload], m.metric)
        rows.append((m, value, error(m, value)))
    return rows


def summary(rows):
    lat = [abs(e) for m, _, e in rows if m.metric == "latency_us"]
    util = [abs(e) for m, _, e in rows if m.metric != "latency_us"]
    return (float(np.mean(lat)) if lat else float("nan"), float(np.mean(util)) if util else float("nan"))


def calibrate(traces: dict) -> float:
    """Fit the DMA efficiency on the DMA-sensitive measurements (the matmul tutorial's utilizations)."""
    matmul = [m for m in MEASUREMENTS if m.workload.startswith("matmul")]
    best = None
    for eff in np.arange(0.40, 1.0001, 0.05):
        rows = evaluate(traces, replace(cost.DEFAULT_PARAMS, dma_efficiency=float(eff)), matmul)
        if not rows:
            return None  # no matmul workload traced (--quick)
        score = summary(rows)[1]
        if best is None or score < best[0] - 1e-12:
            best = (score, float(eff))
    return best[1]


def run(quick: bool = False, verbose: bool = True):
    traces, reports = {}, {}
    for w in WORKLOADS:
        if quick and not w.quick:
            continue
        t0 = time.time()
        traces[w.name], reports[w.name] = trace_workload(w)
        if verbose:
            print(f"== {w.name} ({w.target}, traced in {time.time() - t0:.1f} s)\n{reports[w.name]}\n")
    fitted = calibrate(traces)
    rows = evaluate(traces, cost.DEFAULT_PARAMS)
    if verbose:
        fit = "not fitted (no matmul workload)" if fitted is None else f"fitted {fitted:.2f} on the matmul utilizations"
        print(f"DMA efficiency: {fit}; cost.py uses {cost.DEFAULT_PARAMS.dma_efficiency:.2f}\n")
        print(f"{'workload':24s} {'metric':12s} {'published':>11s} {'estimate':>11s} {'error':>9s} {'band':>7s}")
        for m, value, err in rows:
            flag = "" if abs(err) <= m.band else "  OUTSIDE THE BAND"
            if m.metric == "latency_us":
                print(f"{m.workload:24s} {m.metric:12s} {m.published:9.2f}us {value:9.2f}us {100 * err:+8.1f}% "
                      f"{100 * m.band:5.0f}%{flag}")
            else:
                print(f"{m.workload:24s} {m.metric:12s} {100 * m.published:10.2f}% {100 * value:10.2f}% "
                      f"{100 * err:+7.1f}pt {100 * m.band:4.0f}pt{flag}")
        lat, util = summary(rows)
        alt = summary(evaluate(traces, replace(cost.DEFAULT_PARAMS, memory_reuse=not cost.DEFAULT_PARAMS.memory_reuse)))
        print(f"\n(with memory_reuse={not cost.DEFAULT_PARAMS.memory_reuse}: mean |error| latency {100 * alt[0]:.1f}%, "
              f"utilization {100 * alt[1]:.1f} points)")
        n_lat = sum(m.metric == "latency_us" for m, _, _ in rows)
        print(f"mean |error|: latency {100 * lat:.1f}% ({n_lat} points), "
              f"utilization {100 * util:.1f} percentage points ({len(rows) - n_lat} points)")
        print("\nSources:")
        for src in sorted({m.source.split(" (")[0] for m, _, _ in rows}):
            print(f"  {src}")
        if not quick:
            print("\nFor information, the Mamba workloads modeled on trn2 instead of trn1:")
            for w in [w for w in WORKLOADS if w.kernel in (ex.mamba_v1, ex.mamba_v2)]:
                args = mamba_args(**w.shapes)
                _, r = estimate(w.kernel, *args, target="trn2", compute=False, capacity="spill")
                pub = next(m.published for m in MEASUREMENTS if m.workload == w.name and m.metric == "latency_us")
                print(f"  {w.name:22s} published {pub:9.2f}us  trn2 estimate {r.total_us:9.2f}us  "
                      f"({100 * (r.total_us - pub) / pub:+.1f}%)")
            print("\nPublished but not modeled:")
            for name, what, value, src in NOT_MODELED:
                print(f"  {name}: {what} {value} ({src}); the emulator rejects this shape with [sbuf-capacity] by "
                      "default, and spill traffic is not costed")
    return rows, fitted


# ------------------------------------------------------------------------------------------------ sensitivity
# The headline figures of docs/kernels.md, each computed from the trace of one launch, re-scheduled with other
# parameters (a trace records each instruction's work, which the scheduler prices: see cost.engine_cycles).
TOKENS = 4096
HEADS = 16  # the 2B layer's value heads on one rank
GDN_CTE_PATH = "src/nkilib_src/nkilib/experimental/gdn/gdn_cte.py"


def _deltanet_benchmark():
    """benchmarks/deltanet_kernels.py, whose functions build the kernels' arguments (so a kernel change there is
    picked up here)."""
    path = pathlib.Path(__file__).with_name("deltanet_kernels.py")
    spec = importlib.util.spec_from_file_location("deltanet_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_gdn_cte():
    """The NKI Library's ``gdn_cte`` (aws-neuron/nki-library, ``experimental/gdn/gdn_cte.py``), run unmodified with the
    emulator installed as ``nki``: the library from the local snapshot ``OPTIMUM_QWEN35_NKI_LIBRARY_REPO`` (a git
    directory), and ``gdn_cte.py`` from it or, where the snapshot predates the file, from the copy of the public file
    named by ``OPTIMUM_QWEN35_GDN_CTE``. Returns (kernel, where it came from), or (None, why not)."""
    repo = os.environ.get("OPTIMUM_QWEN35_NKI_LIBRARY_REPO", "/work/.mirror/aws-neuron+nki-library/repo")
    if not os.path.isdir(repo):
        return None, f"no NKI Library snapshot at {repo} (OPTIMUM_QWEN35_NKI_LIBRARY_REPO)"
    root = tempfile.mkdtemp(prefix="nkilib-")
    archive = subprocess.run(["git", "--git-dir", repo, "archive", "HEAD", "src/nkilib_src"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", root], input=archive, check=True)
    target = pathlib.Path(root) / GDN_CTE_PATH
    where = f"{repo} (HEAD)"
    if not target.exists():
        copy = os.environ.get("OPTIMUM_QWEN35_GDN_CTE", "")
        if not os.path.isfile(copy):
            return None, f"{GDN_CTE_PATH} is not in {repo}; set OPTIMUM_QWEN35_GDN_CTE to a copy of the public file"
        target.parent.mkdir(parents=True, exist_ok=True)
        (target.parent / "__init__.py").touch()
        shutil.copy(copy, target)
        where = f"{copy} (library: {repo})"
    install_as_nki(legacy=False)
    sys.path.insert(0, str(pathlib.Path(root) / "src" / "nkilib_src"))
    module = importlib.import_module("nkilib.experimental.gdn.gdn_cte")
    return module.gdn_cte, where


@dataclass
class Headlines:
    """The traces behind the headline figures, and the figures at a given parameter set."""

    prefill_lnc2: object
    prefill_lnc1: object
    prefill_fp32_lnc2: object
    decode: dict  # batch -> (trace, state bytes read and written)
    decode_ideal_us: dict  # batch -> state traffic at the HBM bandwidth (the benchmark's reference)
    gdn_cte: object = None  # one head, one core

    def figures(self, params: cost.CostParams) -> dict:
        target = rules.TRN2
        out = {
            "prefill LNC=2 (us)": self.prefill_lnc2.report(params).total_us,
            "prefill LNC=1 (us)": self.prefill_lnc1.report(params).total_us,
            "prefill fp32 LNC=2 (us)": self.prefill_fp32_lnc2.report(params).total_us,
        }
        bw = cost.dma_bandwidth(target, params)
        for batch, (trace, nbytes) in self.decode.items():
            total = trace.report(params).total_us
            out[f"decode b{batch} / traffic"] = total / self.decode_ideal_us[batch]
            out[f"decode b{batch} / model floor"] = total / (nbytes / bw * 1e6)
        if self.gdn_cte is not None:
            gdn_layer = HEADS * self.gdn_cte.report(params).total_us
            out["gdn_cte / ours, 1 core"] = gdn_layer / out["prefill LNC=1 (us)"]
            out["gdn_cte / ours, 2 cores"] = gdn_layer / 2 / out["prefill LNC=2 (us)"]
            out["gdn_cte / ours fp32, 2 cores"] = gdn_layer / 2 / out["prefill fp32 LNC=2 (us)"]
        return out


def trace_headlines(verbose: bool = True) -> Headlines:
    bench = _deltanet_benchmark()
    t0 = time.time()
    # bf16 activations throughout (a bf16 model): the default operands ("auto": bf16), and fp32 operands
    bench.prefill(TOKENS, "auto", 2)
    prefill2 = cost.last_trace()
    bench.prefill(TOKENS, "auto", 1)
    prefill1 = cost.last_trace()
    bench.prefill(TOKENS, "fp32", 2)
    prefill_fp32 = cost.last_trace()
    decode, ideal = {}, {}
    for batch in (1, 8):
        bench.decode(batch)
        _, ideal_us = bench.state_traffic_us(batch)
        decode[batch] = (cost.last_trace(), ideal_us * 1e-6 * bench.HBM_PER_CORE)
        ideal[batch] = ideal_us
    gdn, where = load_gdn_cte()
    gdn_trace = None
    if gdn is not None:
        z, bf16 = np.zeros, ml_dtypes.bfloat16
        qkv = [z((1, TOKENS, 128), bf16) for _ in range(3)]
        estimate(gdn, *qkv, z((1, TOKENS), np.float32), z((1, TOKENS), np.float32), 128 ** -0.5, target="trn2",
                 compute=False)
        gdn_trace = cost.last_trace()
    if verbose:
        print(f"traced the DeltaNet kernels (benchmarks/deltanet_kernels.py: prefill {TOKENS} tokens, bf16 operands at "
              f"LNC=2 and 1, fp32 at LNC=2; decode at its default operands, batch 1 and 8) and gdn_cte (one head, "
              f"x {HEADS}) in {time.time() - t0:.0f} s")
        print(f"gdn_cte: {where}" if gdn is not None else f"gdn_cte not run: {where}")
    return Headlines(prefill2, prefill1, prefill_fp32, decode, ideal, gdn_trace)


def sensitivity(headlines: Headlines | None = None, verbose: bool = True):
    """Every headline figure at the middle of every range, one parameter at a time at its low and high end, all
    parameters low, all high, and the envelope (each parameter at whichever end lowers, then raises, the figure).
    Returns (figures at mid, {field: (figures at low, figures at high)}, {"all low"|"all high"|"min"|"max": ...})."""
    headlines = headlines or trace_headlines(verbose)
    mid = headlines.figures(cost.DEFAULT_PARAMS)
    varied = [p for p in cost.PARAMETERS if p.low != p.high]
    one = {p.field: tuple(headlines.figures(cost.DEFAULT_PARAMS.with_value(p.field, v)) for v in (p.low, p.high))
           for p in varied}
    combos = {}
    for name, pick in (("all low", lambda p, f: p.low), ("all high", lambda p, f: p.high)):
        params = cost.DEFAULT_PARAMS
        for p in varied:
            params = params.with_value(p.field, pick(p, None))
        combos[name] = headlines.figures(params)
    for name, better in (("min", min), ("max", max)):
        combos[name] = {}
        for figure in mid:
            params = cost.DEFAULT_PARAMS
            for p in varied:
                low, high = one[p.field][0][figure], one[p.field][1][figure]
                params = params.with_value(p.field, p.low if better(low, high) == low else p.high)
            combos[name][figure] = headlines.figures(params)[figure]
    if verbose:
        print_sensitivity(mid, one, combos)
    return mid, one, combos


def movers(mid, one, figure, n=3):
    """The parameters that move `figure` most (largest high-low spread), with their low and high values."""
    spread = sorted(one, key=lambda f: -abs(one[f][1][figure] - one[f][0][figure]))
    return [(f, one[f][0][figure], one[f][1][figure]) for f in spread[:n]
            if abs(one[f][1][figure] - one[f][0][figure]) > 1e-9 * max(abs(mid[figure]), 1)]


def print_sensitivity(mid, one, combos):
    def fmt(v):
        return f"{v:.0f}" if v >= 100 else f"{v:.2f}"

    figures = list(mid)
    print("\nHeadline figures (trn2, the 2B layer on one rank) over the cost model's parameter ranges "
          "(kernels/emulator/cost.py PARAMETERS):")
    print("\n| figure | mid | range | all low | all high | moved most by (low -> high) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for f in figures:
        top = "; ".join(f"`{name}` {fmt(lo)} -> {fmt(hi)}" for name, lo, hi in movers(mid, one, f))
        # the envelope is built from one-at-a-time effects; parameters acting together (all low, all high) can
        # fall outside it, so the range is the hull of the three
        ends = [combos[name][f] for name in ("min", "max", "all low", "all high")]
        print(f"| {f} | {fmt(mid[f])} | {fmt(min(ends))} - {fmt(max(ends))} | "
              f"{fmt(combos['all low'][f])} | {fmt(combos['all high'][f])} | {top} |")
    print("\nOne parameter at a time (value at the parameter's low / high end; mid in the first row):\n")
    print("| parameter | " + " | ".join(figures) + " |")
    print("| --- |" + " --- |" * len(figures))
    print("| (all mid) | " + " | ".join(fmt(mid[f]) for f in figures) + " |")
    for field, (lo, hi) in one.items():
        print(f"| `{field}` | " + " | ".join(f"{fmt(lo[f])} / {fmt(hi[f])}" for f in figures) + " |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="only the small workloads")
    parser.add_argument("--sensitivity", action="store_true",
                        help="the DeltaNet kernels' headline figures over the parameter ranges")
    args = parser.parse_args()
    if args.sensitivity:
        sensitivity()
    else:
        run(quick=args.quick)


if __name__ == "__main__":
    main()
