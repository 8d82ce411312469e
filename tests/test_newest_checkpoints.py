"""The newest checkpoints of this architecture: Qwen3.6 and Qwen3.8 (the same model, new chat templates), the
DeltaNet state dtype their configs name, and the same family's other architecture (Qwen3.8-Flash-Next).

The templates are checked through transformers' own `apply_chat_template` on a tiny tokenizer carrying each
family's template (tiny/chat_templates.py); the pipeline's chat through an export is in
tests/optimum_neuron/test_newest_templates.py.
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from optimum_qwen35.config import Qwen35Config
from optimum_qwen35.errors import UnsupportedModelError
from optimum_qwen35.tiny import FAMILIES, build_tiny_checkpoint, build_tiny_tokenizer
from optimum_qwen35.tiny.chat_templates import CHAT_TEMPLATES, LOW_REASONING, XHIGH_REASONING

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]
# Two rounds: the first assistant turn's reasoning is history once the second user query comes.
TWO_ROUNDS = [
    {"role": "user", "content": "First"},
    {"role": "assistant", "reasoning_content": "old trace", "content": "Old answer"},
    {"role": "user", "content": "Second"},
    {"role": "assistant", "reasoning_content": "new trace", "content": "New answer"},
]
TOOL_ROUND = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "reasoning_content": "call the tool", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
    {"role": "tool", "content": "sunny"},
    {"role": "tool", "content": "18 C"},
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    out = {}
    for family, template in CHAT_TEMPLATES.items():
        folder = build_tiny_tokenizer(tmp_path_factory.mktemp(family), template)
        out[family] = AutoTokenizer.from_pretrained(folder)
    return out


def render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


@pytest.mark.parametrize("family", sorted(CHAT_TEMPLATES))
def test_thinking_on_and_off_in_the_generation_prompt(tokenizers, family):
    chat = [{"role": "user", "content": "Hi!"}]
    on = render(tokenizers[family], chat, add_generation_prompt=True)
    off = render(tokenizers[family], chat, add_generation_prompt=True, enable_thinking=False)
    assert on.endswith("<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert off.endswith("<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize(("family", "default"), [("qwen3.6", False), ("qwen3.8", True)])
def test_preserve_thinking_keeps_or_drops_the_reasoning_before_the_last_query(tokenizers, family, default):
    tokenizer = tokenizers[family]
    kept = "<|im_start|>assistant\n<think>\nold trace\n</think>\n\nOld answer<|im_end|>\n"
    dropped = "<|im_start|>assistant\nOld answer<|im_end|>\n"
    newest = "<|im_start|>assistant\n<think>\nnew trace\n</think>\n\nNew answer<|im_end|>\n"
    for preserve, expected in ((None, kept if default else dropped), (True, kept), (False, dropped)):
        kwargs = {} if preserve is None else {"preserve_thinking": preserve}
        text = render(tokenizer, TWO_ROUNDS, **kwargs)
        assert expected in text, (family, preserve, text)
        assert text.endswith(newest)  # the turn after the last query always keeps its reasoning


def test_reasoning_effort_of_qwen38(tokenizers):
    tokenizer, chat = tokenizers["qwen3.8"], [{"role": "user", "content": "Question"}]
    assert render(tokenizer, chat).startswith(f"<|im_start|>system\n{XHIGH_REASONING}<|im_end|>\n")
    assert render(tokenizer, chat, reasoning_effort="low").startswith(f"<|im_start|>system\n{LOW_REASONING}<|im_end|>\n")
    assert render(tokenizer, chat, reasoning_effort="medium").startswith("<|im_start|>user\nQuestion")
    # No thinking, no effort instruction; a system prompt follows the instruction.
    assert render(tokenizer, chat, enable_thinking=False).startswith("<|im_start|>user\nQuestion")
    system = [{"role": "system", "content": "Be brief."}, *chat]
    assert render(tokenizer, system, reasoning_effort="low").startswith(
        f"<|im_start|>system\n{LOW_REASONING}\n\nBe brief.<|im_end|>\n")
    with pytest.raises(Exception, match="reasoning_effort must be xhigh, medium or low"):
        render(tokenizer, chat, reasoning_effort="max")
    # Qwen3.6 has no such option.
    assert "Reasoning effort" not in render(tokenizers["qwen3.6"], chat, reasoning_effort="low")


@pytest.mark.parametrize("family", sorted(CHAT_TEMPLATES))
def test_tool_calls_and_results(tokenizers, family):
    text = render(tokenizers[family], TOOL_ROUND, tools=TOOLS, add_generation_prompt=True, reasoning_effort="medium")
    system = text[: text.index("<|im_end|>")]
    assert system.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n")
    assert json.dumps(TOOLS[0], ensure_ascii=False) in system
    assert system.endswith("</tool_call>\n\nBe brief.")
    assert ("<|im_start|>assistant\n<think>\ncall the tool\n</think>\n\n<tool_call>\n<function=get_weather>\n"
            "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
            "<|im_end|>\n") in text
    # Consecutive tool results share one user turn.
    assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n18 C\n</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\n<think>\n") in text
    # Tool results are not a query: the assistant turn before them keeps its reasoning even without preserving.
    assert "call the tool" in render(tokenizers[family], TOOL_ROUND, tools=TOOLS, preserve_thinking=False)


@pytest.mark.parametrize("family", sorted(CHAT_TEMPLATES))
def test_a_system_message_after_the_first_is_refused(tokenizers, family):
    chat = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "late"}]
    with pytest.raises(Exception, match="System message must be at the beginning"):
        render(tokenizers[family], chat)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tiny_checkpoint_of_each_family(tmp_path, family):
    """Qwen3.6-27B and Qwen3.8-27B are tiny-nv3x's shape (48 value heads over 16 key heads); the template ships as
    chat_template.jinja, as their snapshots do (Qwen3.5's in tokenizer_config.json, as its snapshot does)."""
    folder = build_tiny_checkpoint(tmp_path, "tiny-nv3x", family=family)
    config = Qwen35Config.from_pretrained(folder)
    assert config.linear_value_heads_per_key_head == 3
    assert (folder / "chat_template.jinja").exists() == (family != "qwen3.5")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = render(tokenizer, [{"role": "user", "content": "Hi!"}], add_generation_prompt=True)
    assert text.startswith("<|im_start|>") and "Hi!" in text


def test_mamba_ssm_dtype_is_read(tmp_path):
    folder = build_tiny_checkpoint(tmp_path, "tiny-nv3x", family="qwen3.8")
    config = json.loads((folder / "config.json").read_text())
    assert config["text_config"]["mamba_ssm_dtype"] == "float32"
    config["text_config"]["mamba_ssm_dtype"] = "bfloat16"
    with pytest.raises(UnsupportedModelError, match="keeps the DeltaNet recurrent state in float32") as error:
        Qwen35Config.from_dict(config)
    assert "\n" not in str(error.value)


def test_qwen38_flash_next_is_another_architecture():
    with pytest.raises(UnsupportedModelError, match=r"Qwen3.8-Flash-Next \(`qwen4_exp`\) is a different architecture"):
        Qwen35Config.from_dict({"model_type": "qwen4_exp", "hidden_size": 8})
