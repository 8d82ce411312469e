"""Decoding on the TorchNeuron stack's class: sampling (seeded, transformers' warpers), a prefix-cache hit (on by
default) with the same tokens as a cold run, transformers' stopping criteria and streamer, per-row limits."""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from optimum_qwen35.errors import UsageError
from optimum_qwen35.runtime.prefix_cache import PrefixCache


def test_sampling_is_seeded_and_takes_generation_config(tp1_model):
    from transformers import GenerationConfig

    prompt = torch.tensor([[3, 17, 42, 99, 7], [5, 6, 7, 8, 9]])
    config = GenerationConfig(do_sample=True, top_k=20, top_p=0.9, temperature=0.8, max_new_tokens=10)
    torch.manual_seed(0)
    first = tp1_model.generate(prompt, generation_config=config, eos_token_id=None)
    torch.manual_seed(0)
    again = tp1_model.generate(prompt, generation_config=config, eos_token_id=None)
    assert first.shape == (2, 15) and torch.equal(first, again)
    greedy = tp1_model.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None)
    assert not torch.equal(first, greedy)


def test_a_prefix_cache_hit_gives_the_cold_tokens(tp1_model):
    assert isinstance(tp1_model.runtime.prefix_cache, PrefixCache)  # on by default
    block = tp1_model.runtime.prefix_cache.block_size
    shared = torch.arange(3, 3 + block + 8).remainder(500).unsqueeze(0)
    tp1_model.generate(shared, max_new_tokens=2, do_sample=False, eos_token_id=None)
    longer = torch.cat([shared, torch.tensor([[11, 12, 13]])], dim=1)
    hits = tp1_model.runtime.prefix_cache.hits
    warm = tp1_model.generate(longer, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert tp1_model.runtime.prefix_cache.hits > hits
    tp1_model.set_prefix_cache(None)
    try:
        cold = tp1_model.generate(longer, max_new_tokens=8, do_sample=False, eos_token_id=None)
    finally:
        tp1_model.set_prefix_cache("auto")
    assert torch.equal(warm, cold)


class _StopAfter(StoppingCriteria):
    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_stopping_criteria_and_per_row_limits(tp1_model):
    prompt = torch.tensor([[3, 17, 42, 99, 7]])
    full = tp1_model.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None)
    stopped = tp1_model.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None,
                                 stopping_criteria=StoppingCriteriaList([_StopAfter(8)]))
    assert stopped.shape[1] == 8 and torch.equal(stopped, full[:, :8])


class _Collect:
    """A transformers streamer (put / end): the prompt first, then each new token."""

    def __init__(self):
        self.calls, self.ended = [], False

    def put(self, value):
        self.calls.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_a_streamer_sees_the_prompt_then_every_new_token(tp1_model):
    prompt = torch.tensor([[3, 17, 42, 99, 7]])
    streamer = _Collect()
    tokens = tp1_model.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=None, streamer=streamer)
    assert streamer.calls[0] == prompt[0].tolist() and streamer.ended
    assert sum(streamer.calls[1:], []) == tokens[0, prompt.shape[1]:].tolist()


def test_a_row_that_reaches_the_compiled_length_stops_there_and_the_other_runs_on(tp1_model):
    long_prompt = torch.arange(3, 3 + 124).remainder(500)  # 124 of the 128 compiled positions: room for 4
    short_prompt = torch.tensor([3, 17, 42, 99, 7])
    mask = torch.zeros(2, 124, dtype=torch.long)
    mask[0] = 1
    mask[1, -5:] = 1  # left padding
    ids = torch.zeros(2, 124, dtype=torch.long)
    ids[0], ids[1, -5:] = long_prompt, short_prompt
    with pytest.raises(UsageError, match="row 0 asks for 10 new tokens but its prompt"):
        tp1_model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None)
    # Opted in (stop_at_sequence_length=True): the long row stops at the compiled length, the other runs on.
    out = tp1_model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None,
                             stop_at_sequence_length=True)
    alone = tp1_model.generate(short_prompt[None], max_new_tokens=10, do_sample=False, eos_token_id=None)
    assert out[1, 124:].tolist() == alone[0, 5:].tolist()
    assert len(out[0, 124:].tolist()) == 10 and out[0, 128:].eq(out[0, 128]).all()  # stopped at 4, then padded
