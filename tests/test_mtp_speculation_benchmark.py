"""benchmarks/mtp_speculation.py: it runs end to end (a short fit, one repeat: the numbers are not checked, the
tokens are, inside the benchmark), and its projection's byte model counts the decoder's own parameters and states."""

import sys
from pathlib import Path

import pytest
import torch

from optimum_qwen35.config import Qwen35Config
from optimum_qwen35.modeling.decoder import Qwen35Decoder
from optimum_qwen35.modeling.torch_layers import TorchLayers

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
try:
    import mtp_speculation as bench
finally:
    sys.path.pop(0)


def test_the_benchmark_runs(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["mtp_speculation.py", "--repeats", "1", "--new", "8", "--prompts", "1",
                                      "--fit-steps", "5"])
    threads = torch.get_num_threads()
    try:
        bench.main()
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    for kind in ("in-sample", "fresh"):
        assert sum(line.startswith(f"| {kind} |") for line in out.splitlines()) == 1 + len(bench.KS)
    assert "Projection (not a measurement)" in out
    assert sum(line.startswith("| 35B-A3B | 8 |") for line in out.splitlines()) == len(bench.KS)


@pytest.mark.parametrize("size", list(bench.SIZES))
def test_the_projection_counts_the_decoders_weights_and_states(size):
    """One token's weight bytes per layer kind and the head's, bf16 (the router fp32; norms, A_log and dt_bias left
    out: a few KiB), against the decoder built on meta; the state bytes against its state specs."""
    text = bench.text_config(size)
    config = Qwen35Config.from_dict(text)
    with torch.device("meta"):
        decoder = Qwen35Decoder(config, 1, TorchLayers(1), mtp=True)
    params = dict(decoder.named_parameters())
    share = config.num_experts_per_tok / config.num_experts if "num_experts" in text else 1.0

    def counted(prefix):
        total = 0.0
        for name, p in params.items():
            module = name.rpartition(".")[0]
            if not name.startswith(prefix) or "norm" in module.rpartition(".")[2] or name.endswith(("A_log", "dt_bias")):
                continue
            b = 4 if name.endswith("mlp.gate.weight") else 2
            total += p.numel() * b * (share if ".experts." in name else 1.0)
        return total

    for i in (0, 3):  # a DeltaNet layer, an attention layer
        assert bench.layer_bytes(text, text["layer_types"][i], 1) == pytest.approx(counted(f"layers.{i}."), rel=1e-12)
    H = text["hidden_size"]
    assert 2 * H * H * 2 + bench.layer_bytes(text, "full_attention", 1) == pytest.approx(counted("mtp."), rel=1e-12)

    kv_pos, deltanet = bench.state_bytes(text)
    specs = Qwen35Decoder.state_specs(decoder, 1, 16)
    want = sum(torch.Size(s.shape).numel() * (4 if "recurrent" in s.name else 2) for s in specs)
    assert 16 * kv_pos + deltanet == want


def test_the_draft_vocabulary_projection_reads_fewer_head_rows():
    """With a draft vocabulary the head reads V_d lm_head rows and writes V_d logits per call (k calls a round, 1 token
    each but the catch-up's a); the verify and the plain step are unchanged; and the table has its rows."""
    text = bench.text_config("2B")
    H, V, k, a, vd = text["hidden_size"], text["vocab_size"], 2, 2.5, 32768
    full, small = bench.round_bytes(text, 1, k, a), bench.round_bytes(text, 1, k, a, vd)
    assert full["head"] - small["head"] == pytest.approx(k * (V - vd) * H * 2 + (k - 1 + a) * (V - vd) * 4)
    assert all(full[p] == small[p] for p in ("plain", "verify", "commit"))
    lines = bench.draft_vocab_projection()
    assert sum(line.startswith("| 2B |") for line in lines) == 2 * len(bench.DRAFT_VOCABS)
