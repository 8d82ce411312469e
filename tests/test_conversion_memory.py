"""Conversion memory, in CI: a scaled-down run of benchmarks/convert_and_shard.py.

The benchmark (run by hand) converts the real 0.8B shapes. Here the same code converts a ~0.4 GB bf16
checkpoint (0.8B layer shapes, 8 layers, a 64k vocabulary) at TP = 4 in a fresh process and checks the
issue's bound, peak RSS < 1.5 x the largest file written + 0.5 GB; holding the whole model in memory
once more would break it.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).parents[1] / "benchmarks" / "convert_and_shard.py"


def load_benchmark():
    spec = importlib.util.spec_from_file_location("convert_and_shard", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_conversion_peak_rss_stays_within_the_bound(tmp_path):
    bench = load_benchmark()
    config = json.loads(bench.CONFIG.read_text())
    text = config["text_config"]
    text.update(vocab_size=65536, num_hidden_layers=8, layer_types=text["layer_types"][:8])
    (tmp_path / "config.json").write_text(json.dumps(config))
    nbytes = bench.build_checkpoint(tmp_path / "ckpt", tmp_path / "config.json")
    assert nbytes > 0.35e9
    proc = subprocess.run(
        [sys.executable, str(BENCHMARK), "--worker", str(tmp_path / "ckpt"), str(tmp_path / "tp4"), "4"],
        stdout=subprocess.PIPE, text=True, check=True,
    )
    run = json.loads(proc.stdout.strip().splitlines()[-1])
    bound = 1.5 * run["largest_file"] + 0.5e9
    print(f"\nconverted {nbytes / 1e9:.2f} GB at TP=4: peak RSS {run['peak_rss'] / 1e9:.2f} GB, bound {bound / 1e9:.2f} GB")
    assert run["files"] == 4
    assert run["peak_rss"] < bound
