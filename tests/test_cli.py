"""The command line, run in-process exactly as `python -m optimum_qwen35 ...` runs it."""

import json

from optimum_qwen35.cli import main
from optimum_qwen35.runtime.cpu import Qwen35ForCausalLM


def test_demo_builds_a_checkpoint_and_chats(tmp_path, capsys):
    assert main(["demo", "--max-new-tokens", "5", "--out", str(tmp_path / "tiny")]) == 0
    out = capsys.readouterr().out
    assert "reply (" in out and "tok/s" in out
    assert json.loads((tmp_path / "tiny" / "config.json").read_text())["model_type"] == "qwen3_5"


def test_build_tiny_shard_then_generate_from_the_shards(tmp_path, capsys):
    assert main(["build-tiny", str(tmp_path / "ckpt"), "--layout", "tiny-nv2x"]) == 0
    assert main(["shard", "--model", str(tmp_path / "ckpt"), "--tensor-parallel-size", "1", str(tmp_path / "tp1")]) == 0
    assert (tmp_path / "tp1" / "rank_0.safetensors").is_file()
    prompt = [5, 6, 7, 8]
    whole = Qwen35ForCausalLM.from_pretrained(tmp_path / "ckpt", max_length=32).generate([prompt], 8)
    from_shards = Qwen35ForCausalLM.from_pretrained(tmp_path / "tp1", max_length=32).generate([prompt], 8)
    assert whole == from_shards
    assert main(["generate", "--model", str(tmp_path / "ckpt"), "--prompt", "hello", "--max-new-tokens", "3", "--dtype", "float32"]) == 0
    assert "reply (" in capsys.readouterr().out
