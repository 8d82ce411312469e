"""The command line, run in-process exactly as `python -m optimum_qwen35 ...` runs it."""

import ast
import json
import re

from transformers import AutoTokenizer

from optimum_qwen35.cli import main
from optimum_qwen35.runtime import Qwen35Runtime


def printed_reply(out: str) -> tuple[int, str]:
    """(token count, text) of the `reply (N tokens): '...'` line the CLI prints."""
    n, text = re.search(r"^reply \((\d+) tokens\): (.*)$", out, re.M).groups()
    return int(n), ast.literal_eval(text)


def expected_reply(folder, prompt: str, max_new_tokens: int, raw: bool) -> tuple[int, str]:
    """What `generate` gives for the prompt the CLI builds (chat template unless raw), decoded as the CLI says."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if raw:
        ids = tokenizer(prompt)["input_ids"]
    else:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text)["input_ids"]
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    model = Qwen35Runtime.from_pretrained(folder, max_length=len(ids) + max_new_tokens)
    (tokens,) = model.generate([ids], max_new_tokens=max_new_tokens, eos_token_id=eos)
    return len(tokens), tokenizer.decode(tokens, skip_special_tokens=True)


def test_demo_builds_a_checkpoint_and_chats(tmp_path, capsys):
    assert main(["demo", "--max-new-tokens", "5", "--prompt", "Hello! Who are you?", "--out", str(tmp_path / "tiny")]) == 0
    out = capsys.readouterr().out
    assert "tok/s" in out
    # The prompt's token count includes the chat template's tokens, and says so.
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tiny")
    chat = [{"role": "user", "content": "Hello! Who are you?"}]
    n = len(tokenizer(tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))["input_ids"])
    assert n > len(tokenizer("Hello! Who are you?")["input_ids"])
    assert f"prompt ({n} tokens, chat template included): 'Hello! Who are you?'" in out, out
    assert json.loads((tmp_path / "tiny" / "config.json").read_text())["model_type"] == "qwen3_5"
    assert printed_reply(out) == expected_reply(tmp_path / "tiny", "Hello! Who are you?", 5, raw=False)


def test_build_tiny_shard_then_generate_from_the_shards(tmp_path, capsys):
    assert main(["build-tiny", str(tmp_path / "ckpt"), "--layout", "tiny-nv2x"]) == 0
    assert main(["shard", "--model", str(tmp_path / "ckpt"), "--tensor-parallel-size", "1", str(tmp_path / "tp1")]) == 0
    assert (tmp_path / "tp1" / "rank_0.safetensors").is_file()
    prompt = [5, 6, 7, 8]
    whole = Qwen35Runtime.from_pretrained(tmp_path / "ckpt", max_length=32).generate([prompt], 8)
    from_shards = Qwen35Runtime.from_pretrained(tmp_path / "tp1", max_length=32).generate([prompt], 8)
    assert whole == from_shards
    capsys.readouterr()
    replies = []
    for raw in (False, True):
        args = ["generate", "--model", str(tmp_path / "ckpt"), "--prompt", "hello there", "--max-new-tokens", "6"]
        assert main(args + ["--dtype", "float32"] + (["--raw"] if raw else [])) == 0
        replies.append(printed_reply(capsys.readouterr().out))
        assert replies[-1] == expected_reply(tmp_path / "ckpt", "hello there", 6, raw)
    assert replies[0] != replies[1]  # with and without the chat template: so --raw is seen to matter


def test_demo_and_generate_state_their_default_dtypes(capsys):
    import pytest

    for command, default, other in (
        ("demo", "float32", "`generate` defaults to bfloat16"),
        ("generate", "bfloat16", "`demo` defaults to float32"),
    ):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        help_text = " ".join(capsys.readouterr().out.split())
        assert f"(default {default}; {other})" in help_text, help_text
