"""Benchmark: convert + shard + save a random checkpoint with the real Qwen3.5-0.8B text shapes.

    python benchmarks/convert_and_shard.py [--degrees 1 4] [--workdir DIR] [--keep] [--no-shard]

Builds a random bf16 checkpoint (~1.5 GB) with the exact text tensor names and shapes of Qwen3.5-0.8B
(from tests/qwen3.5-0.8b.config.json, the published config), two safetensors shards + an index, plus small
vision (`model.visual.*`) and MTP (`mtp.*`) stand-ins that must be skipped. It is written tensor by tensor.
Then, for each degree, a fresh subprocess runs `save_sharded` (with its progress bar) and reports its peak
RSS; the bound is 1.5 x the largest file it wrote + 0.5 GB. Exits non-zero if any run breaks the bound.
Last, the cost of the NaN/Inf weight check at load: `load_decoder(checkpoint, bfloat16)` with and without
the check, in fresh subprocesses taken in turns (fastest of 3 each), and the check alone on the loaded weights.
Run by hand; not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = Path(__file__).parents[1] / "tests" / "qwen3.5-0.8b.config.json"  # the published Qwen3.5-0.8B config
GB = 1024**3


def build_checkpoint(folder: Path, config_file: Path = CONFIG, seed: int = 0) -> int:
    """Write the random checkpoint; returns its data bytes."""
    import torch
    from tqdm.auto import tqdm

    from optimum_qwen35.checkpoint.convert import expected_shapes
    from optimum_qwen35.checkpoint.sharded_files import StreamingSafetensorsWriter
    from optimum_qwen35.config import Qwen35Config

    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(config_file, folder / "config.json")
    config = Qwen35Config.from_pretrained(folder)
    text = {
        ("lm_head.weight" if n == "lm_head.weight" else "model.language_model." + n): s
        for n, s in expected_shapes(config).items()
    }
    extras = {  # stand-ins: read by nobody, must be skipped
        "model.visual.patch_embed.proj.weight": (1024, 3, 2, 16, 16),
        "model.visual.blocks.0.attn.qkv.weight": (3072, 1024),
        "mtp.fc.weight": (1024, 2048),
        "mtp.layers.0.mlp.up_proj.weight": (3584, 1024),
    }
    tensors = {**text, **extras}
    names = sorted(tensors)
    sizes = {n: torch.Size(tensors[n]).numel() * 2 for n in names}
    half, acc, files = sum(sizes.values()) / 2, 0, {}
    for n in names:
        files[n] = "model-00001-of-00002.safetensors" if acc < half else "model-00002-of-00002.safetensors"
        acc += sizes[n]
    g = torch.Generator().manual_seed(seed)
    with tqdm(total=sum(sizes.values()), unit="B", unit_scale=True, unit_divisor=1024, desc="build 0.8B-shaped checkpoint") as bar:
        for file in sorted(set(files.values())):
            group = [n for n in names if files[n] == file]
            writer = StreamingSafetensorsWriter(folder / file, [(n, torch.bfloat16, tensors[n]) for n in group], {"format": "pt"})
            for n in group:
                writer.write(n, (torch.randn(tensors[n], generator=g) * 0.02).to(torch.bfloat16))
                bar.update(sizes[n])
            writer.commit()
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": files}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return sum(sizes.values())


def peak_rss() -> int:
    """This process's peak resident set size in bytes.

    VmHWM (Linux) is the high-water mark of this address space. getrusage's ru_maxrss is not used when
    VmHWM is available: Linux folds the RSS peak of the forked copy of the parent into it at exec, so a
    subprocess of a large parent would report the parent's peak.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def worker(src: str, out: str, tp_degree: int) -> None:
    """One conversion, in a fresh process: prints a JSON line with its peak RSS."""
    from optimum_qwen35.checkpoint.sharded_files import save_sharded

    start = time.perf_counter()
    save_sharded(src, None, tp_degree, out, progress=True)
    seconds = time.perf_counter() - start
    peak = peak_rss()
    files = sorted(Path(out).glob("rank_*.safetensors"))
    print(json.dumps({"tp": tp_degree, "seconds": seconds, "peak_rss": peak, "largest_file": max(f.stat().st_size for f in files),
                      "files": len(files), "total": sum(f.stat().st_size for f in files)}))


def load_worker(src: str, check: bool) -> None:
    """One load, in a fresh process: prints a JSON line with its time (and, without the check, the check's own time)."""
    import torch

    from optimum_qwen35.checkpoint.convert import check_finite
    from optimum_qwen35.runtime.eager import load_decoder

    start = time.perf_counter()
    decoder = load_decoder(src, torch.bfloat16, check_weights=check)
    seconds = time.perf_counter() - start
    result = {"check": check, "seconds": seconds}
    if not check:
        params = {n: p for n, p in decoder.named_parameters()}  # tied lm_head listed once, as at load
        alone = []
        for _ in range(3):
            start = time.perf_counter()
            check_finite(params, src)
            alone.append(time.perf_counter() - start)
        result["check_alone"] = min(alone)
        result["elements"] = sum(p.numel() for p in params.values())
    print(json.dumps(result))


def measure_nan_check(src: Path, repeats: int = 3) -> None:
    """Fastest of `repeats` loads each way (the least disturbed by other work on the machine)."""
    runs = {True: [], False: []}
    alone, elements = [], 0
    for _ in range(repeats):
        for check in (False, True):
            proc = subprocess.run(
                [sys.executable, __file__, "--load-worker", str(src), str(int(check))], stdout=subprocess.PIPE, text=True, check=True
            )
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            runs[check].append(r["seconds"])
            if not check:
                alone.append(r["check_alone"])
                elements = r["elements"]

    off, on, check = min(runs[False]), min(runs[True]), min(alone)
    print(
        f"load_decoder(bf16, 0.8B-shaped, {elements / 1e6:.0f}M parameters), fastest of {repeats}: "
        f"{off:.2f} s without the NaN/Inf check, {on:.2f} s with it ({on - off:+.2f} s); "
        f"the check alone (fastest of 3): {check * 1000:.0f} ms ({check / off:.1%} of the load without it)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--degrees", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint and exports")
    parser.add_argument("--no-shard", action="store_true", help="only build the checkpoint and measure the load")
    parser.add_argument("--worker", nargs=3, metavar=("SRC", "OUT", "TP"), help=argparse.SUPPRESS)
    parser.add_argument("--load-worker", nargs=2, metavar=("SRC", "CHECK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], int(args.worker[2]))
        return 0
    if args.load_worker:
        load_worker(args.load_worker[0], bool(int(args.load_worker[1])))
        return 0

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="qwen35-shard-bench-"))
    src = workdir / "checkpoint"
    start = time.perf_counter()
    nbytes = build_checkpoint(src)
    print(f"checkpoint: {nbytes / GB:.2f} GiB (incl. vision/mtp stand-ins) built in {time.perf_counter() - start:.0f} s at {src}")
    failed = False
    try:
        for t in [] if args.no_shard else args.degrees:
            out = workdir / f"tp{t}"
            proc = subprocess.run(
                [sys.executable, __file__, "--worker", str(src), str(out), str(t)], stdout=subprocess.PIPE, text=True, check=True
            )
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            bound = 1.5 * r["largest_file"] + 0.5e9  # the bound: 1.5 x the largest file + 0.5 GB
            ok = r["peak_rss"] < bound
            failed |= not ok
            print(
                f"TP={t}: {r['files']} file(s), {r['total'] / GB:.2f} GiB written in {r['seconds']:.1f} s; "
                f"peak RSS {r['peak_rss'] / GB:.2f} GiB, bound 1.5 x {r['largest_file'] / GB:.2f} GiB + 0.5 GB = "
                f"{bound / GB:.2f} GiB -> {'OK' if ok else 'BROKEN'}"
            )
            if not args.keep:
                shutil.rmtree(out)
        measure_nan_check(src)
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(workdir)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
