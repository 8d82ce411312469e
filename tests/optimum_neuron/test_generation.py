"""Generation as optimum-neuron users know it: generate() options, sampling, streamers, pipelines, slots."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("optimum.neuron", reason="needs optimum-neuron (the nox `optimum` session)")

from transformers import AutoTokenizer, TextStreamer, pipeline  # noqa: E402

from optimum_qwen35.errors import UsageError  # noqa: E402
from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM  # noqa: E402
from optimum_qwen35.tiny import CHAT_MESSAGES  # noqa: E402

from ..conftest import load_reference  # noqa: E402


@pytest.fixture(scope="module")
def model(export_dir):
    return Qwen35NeuronModelForCausalLM.from_pretrained(export_dir("tiny-2b", 1))


@pytest.fixture(scope="module")
def tokenizer(export_dir):
    return AutoTokenizer.from_pretrained(export_dir("tiny-2b", 1))


def test_padded_batch_gives_each_prompt_its_solo_tokens(model):
    ref = load_reference("tiny-2b")
    a, b = ref["gen_prompt_0"].tolist(), ref["gen_prompt_1"].tolist()
    for side in ("right", "left"):
        ids = torch.zeros(2, len(b), dtype=torch.long)
        mask = torch.zeros_like(ids)
        rows = ((0, a), (1, b))
        for row, p in rows:
            span = slice(0, len(p)) if side == "right" else slice(len(b) - len(p), len(b))
            ids[row, span], mask[row, span] = torch.tensor(p), 1
        out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None)
        assert out.shape == (2, len(b) + 10)
        assert out[0, len(b) :].tolist() == ref["gen_tokens_0"].tolist()[:10], side
        assert out[1, len(b) :].tolist() == ref["gen_tokens_1"].tolist()[:10], side


def test_eos_stops_a_row_and_pads_it(model):
    ref = load_reference("tiny-2b")
    prompt, expected = ref["gen_prompt_0"].tolist(), ref["gen_tokens_0"].tolist()
    eos = expected[4]  # the fifth greedy token stands in for EOS
    out = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=eos, pad_token_id=0)
    new = out[0, len(prompt) :].tolist()
    stop = expected.index(eos)
    assert new == expected[: stop + 1], "generation must stop right after the first EOS token"


def test_sampling_is_reproducible_and_top_k_1_is_greedy(model):
    ref = load_reference("tiny-2b")
    ids = torch.tensor([ref["gen_prompt_1"].tolist()])
    runs = []
    for _ in range(2):
        torch.manual_seed(1234)
        runs.append(model.generate(ids, max_new_tokens=24, do_sample=True, temperature=0.9, top_k=50, top_p=0.95, eos_token_id=None))
    assert torch.equal(runs[0], runs[1])
    torch.manual_seed(99)
    other = model.generate(ids, max_new_tokens=24, do_sample=True, temperature=0.9, top_k=50, top_p=0.95, eos_token_id=None)
    assert not torch.equal(runs[0], other), "another seed gave the very same 24 sampled tokens"
    greedy = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None)
    assert not torch.equal(runs[0], greedy), "sampling at temperature 0.9 gave the greedy tokens"
    top1 = model.generate(ids, max_new_tokens=24, do_sample=True, top_k=1, eos_token_id=None)
    assert torch.equal(top1, greedy)


def test_generation_config_defaults_apply_and_kwargs_win(model):
    # The fixture's generation_config.json samples (do_sample true, as Qwen3.5's does); the caller's kwargs win.
    assert model.generation_config.do_sample
    ref = load_reference("tiny-2b")
    ids = torch.tensor([ref["gen_prompt_0"].tolist()])
    out = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert out[0, ids.shape[1] :].tolist() == ref["gen_tokens_0"].tolist()[:8]


def test_bad_generate_arguments_raise_usage_errors(model):
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(UsageError, match="max_new_tokens"):
        model.generate(ids, max_new_tokens=0)
    with pytest.raises(UsageError, match="does not take"):
        model.generate(ids, max_new_tokens=2, not_an_option=3)
    with pytest.raises(UsageError, match="beam"):
        model.generate(ids, max_new_tokens=2, num_beams=2)
    with pytest.raises(UsageError, match="integer tensor"):
        model.generate(ids.float(), max_new_tokens=2)
    with pytest.raises(UsageError, match="fills the compiled sequence length"):
        model.generate(torch.ones(1, model.neuron_config.sequence_length, dtype=torch.long), max_new_tokens=2)


class CollectingStreamer(TextStreamer):
    def __init__(self, tokenizer):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.text = ""

    def on_finalized_text(self, text: str, stream_end: bool = False):
        self.text += text


def test_chat_pipeline_and_streamer_give_transformers_reply(model, tokenizer):
    """transformers.pipeline("text-generation") with chat messages: transformers' greedy reply, streamed too."""
    ref = load_reference("tiny-2b")
    expected = tokenizer.decode(ref["chat_tokens"].tolist(), skip_special_tokens=True)
    text = tokenizer.apply_chat_template(CHAT_MESSAGES, tokenize=False, add_generation_prompt=True)
    assert tokenizer(text)["input_ids"] == ref["chat_prompt"].tolist()
    chat = pipeline("text-generation", model=model, tokenizer=tokenizer)
    streamer = CollectingStreamer(tokenizer)
    out = chat(CHAT_MESSAGES, max_new_tokens=len(ref["chat_tokens"]), do_sample=False, streamer=streamer)
    reply = out[0]["generated_text"][-1]
    assert reply["role"] == "assistant"
    assert reply["content"] == expected
    assert streamer.text == expected


def test_a_pipeline_of_this_model_does_not_say_device_set_to_use_cpu(model, tokenizer, caplog):
    """transformers 4.57 logs "Device set to use cpu" for every pipeline: dropped for this package's model only."""
    import logging

    from transformers import GPT2Config, GPT2LMHeadModel

    caplog.set_level(logging.INFO)
    pipeline("text-generation", model=model, tokenizer=tokenizer)
    assert not [r for r in caplog.records if "Device set to use" in r.getMessage()]
    other = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=len(tokenizer)))
    pipeline("text-generation", model=other, tokenizer=tokenizer)  # any other model: transformers as it is
    assert [r.levelname for r in caplog.records if "Device set to use cpu" in r.getMessage()] == ["WARNING"]


def test_continuous_batching_slots(model):
    """prefill writes only the slots in seq_ids; decode steps every slot; each sequence equals its solo run."""
    ref = load_reference("tiny-2b")
    a, b = ref["gen_prompt_0"].tolist(), ref["gen_prompt_1"].tolist()
    first_a = model.prefill(torch.tensor([a]), None, seq_ids=[1]).argmax(-1).tolist()  # a joins in slot 1
    tokens, positions = {1: first_a[0]}, {1: len(a)}
    out = {1: [first_a[0]], 0: []}
    for step in range(6):
        if step == 2:  # b joins in slot 0 while a runs
            tokens[0] = model.prefill(torch.tensor([b]), None, seq_ids=[0]).argmax(-1).item()
            positions[0], out[0] = len(b), [tokens[0]]
        slots = sorted(tokens)
        logits = model.decode(
            torch.tensor([[tokens[s]] for s in slots]), torch.tensor([[positions[s]] for s in slots]), seq_ids=slots
        )
        for s, t in zip(slots, logits.argmax(-1).tolist()):
            tokens[s], positions[s] = t, positions[s] + 1
            out[s].append(t)
    assert out[1] == ref["gen_tokens_0"].tolist()[:7]
    assert out[0] == ref["gen_tokens_1"].tolist()[:5]


def test_temperature_and_top_k_reach_the_sampler(model):
    """generate()'s options reach the sampler (tests/test_sampling.py checks the sampler's distributions): under one
    seed, temperatures 0.3, 1 and 3 draw three different sequences, and top_k=1 draws the greedy one whatever the
    temperature."""
    ids = torch.tensor([load_reference("tiny-2b")["gen_prompt_0"].tolist()])
    runs = {}
    for temperature in (0.3, 1.0, 3.0):
        torch.manual_seed(7)
        runs[temperature] = model.generate(
            ids, max_new_tokens=24, do_sample=True, temperature=temperature, top_k=0, top_p=1.0, eos_token_id=None
        )[0].tolist()
    assert len({tuple(r) for r in runs.values()}) == 3, "the temperature did not change the draws"
    greedy = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None)
    torch.manual_seed(7)
    top1 = model.generate(ids, max_new_tokens=24, do_sample=True, temperature=3.0, top_k=1, eos_token_id=None)
    assert torch.equal(top1, greedy)
