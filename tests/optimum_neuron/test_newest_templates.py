"""Qwen3.6 and Qwen3.8 chats through transformers' text-generation pipeline on an export: the template's options
(thinking, preserve_thinking, reasoning_effort) and tools reach the prompt, and the reply is the export's greedy
continuation of that prompt."""

from __future__ import annotations

import pytest

pytest.importorskip("optimum.neuron", reason="needs optimum-neuron (the nox `optimum` session)")

from transformers import AutoTokenizer, pipeline  # noqa: E402

from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM  # noqa: E402
from optimum_qwen35.tiny import build_tiny_checkpoint, build_tiny_tokenizer  # noqa: E402
from optimum_qwen35.tiny.chat_templates import CHAT_TEMPLATES, LOW_REASONING  # noqa: E402

TOOLS = [{
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather in a city.",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}]
CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "reasoning_content": "call the tool", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "sunny"},
]


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A Qwen3.8-27B-shaped tiny checkpoint (tiny-nv3x), exported for the cpu target: its chat_template.jinja goes
    with the export."""
    source = build_tiny_checkpoint(tmp_path_factory.mktemp("qwen3.8"), "tiny-nv3x", family="qwen3.8")
    neuron_config = Qwen35NeuronModelForCausalLM.get_neuron_config(
        source, batch_size=1, sequence_length=1024, tensor_parallel_size=1, dtype="float32", target="cpu")
    folder = tmp_path_factory.mktemp("export") / "qwen3.8-export"
    Qwen35NeuronModelForCausalLM.export(source, neuron_config).save_pretrained(folder)
    assert (folder / "chat_template.jinja").is_file()
    return folder


@pytest.fixture(scope="module")
def model(export):
    return Qwen35NeuronModelForCausalLM.from_pretrained(export)


@pytest.mark.parametrize(
    ("family", "options", "expected"),
    [
        ("qwen3.8", {}, "Reasoning effort is set to xhigh."),
        ("qwen3.8", {"reasoning_effort": "low"}, LOW_REASONING),
        ("qwen3.8", {"enable_thinking": False}, "<think>\n\n</think>\n\n"),
        ("qwen3.6", {"preserve_thinking": True}, "<think>\ncall the tool\n</think>"),
        ("qwen3.6", {"enable_thinking": False}, "<think>\n\n</think>\n\n"),
    ],
)
def test_pipeline_chat_with_tools_and_template_options(export, model, tmp_path, family, options, expected):
    tokenizer = (AutoTokenizer.from_pretrained(export) if family == "qwen3.8"
                 else AutoTokenizer.from_pretrained(build_tiny_tokenizer(tmp_path, CHAT_TEMPLATES[family])))
    # transformers 4.57's pipeline takes tools and template options through tokenizer_encode_kwargs (5.x also as
    # `tools=`).
    encode = {"tools": TOOLS, **options}
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False, **encode)
    assert expected in prompt and "<tools>" in prompt and "<tool_response>\nsunny\n</tool_response>" in prompt
    chat = pipeline("text-generation", model=model, tokenizer=tokenizer)
    out = chat(CHAT, max_new_tokens=8, do_sample=False, tokenizer_encode_kwargs=encode)
    reply = out[0]["generated_text"][-1]
    assert reply["role"] == "assistant"
    ids = tokenizer(prompt, return_tensors="pt")
    greedy = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert reply["content"] == tokenizer.decode(greedy[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
