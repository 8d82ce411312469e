"""The runtime's generation loop (Qwen35Runtime.generate): EOS, the streamer callback, waves, samplers.

Each check compares against transformers' recorded greedy tokens (tests/fixtures/<layout>/reference.npz),
so a loop that ignores EOS, streams the wrong tokens or mixes up rows across waves fails here.
"""

import pytest
import torch

from optimum_qwen35.runtime import Qwen35Runtime

from .conftest import FIXTURES, load_reference


@pytest.fixture(scope="module")
def model():
    return Qwen35Runtime.from_pretrained(FIXTURES / "tiny-2b", batch_size=2, max_length=96)


@pytest.fixture(scope="module")
def ref():
    return load_reference("tiny-2b")


def test_generation_stops_after_the_first_eos(model, ref):
    prompt, expected = ref["gen_prompt_0"].tolist(), ref["gen_tokens_0"].tolist()
    eos = expected[6]
    stop = expected.index(eos)
    (tokens,) = model.generate([prompt], max_new_tokens=40, eos_token_id=eos)
    assert tokens == expected[: stop + 1]
    (tokens,) = model.generate([prompt], max_new_tokens=40, eos_token_id=[10**6, eos])  # a list of eos ids
    assert tokens == expected[: stop + 1]


def test_one_row_stopping_does_not_stop_the_other(model, ref):
    a, b = ref["gen_prompt_0"].tolist(), ref["gen_prompt_1"].tolist()
    eos = ref["gen_tokens_0"].tolist()[2]
    out = model.generate([a, b], max_new_tokens=12, eos_token_id=eos)
    expected_b = ref["gen_tokens_1"].tolist()[:12]
    if eos in expected_b:
        expected_b = expected_b[: expected_b.index(eos) + 1]
    assert out[0] == ref["gen_tokens_0"].tolist()[: ref["gen_tokens_0"].tolist().index(eos) + 1]
    assert out[1] == expected_b


def test_streamer_sees_every_step_of_every_row(model, ref):
    a, b = ref["gen_prompt_0"].tolist(), ref["gen_prompt_1"].tolist()
    seen = []
    out = model.generate([a, b], max_new_tokens=9, streamer=lambda step, tokens: seen.append((step, list(tokens))))
    assert [step for step, _ in seen] == list(range(9))
    assert [tokens[0] for _, tokens in seen] == out[0] == ref["gen_tokens_0"].tolist()[:9]
    assert [tokens[1] for _, tokens in seen] == out[1] == ref["gen_tokens_1"].tolist()[:9]


def test_more_prompts_than_the_batch_run_in_waves(model, ref):
    prompts = [ref["gen_prompt_1"].tolist(), ref["gen_prompt_0"].tolist(), ref["gen_prompt_1"].tolist()[:7]]
    out = model.generate(prompts, max_new_tokens=10)
    assert out[0] == ref["gen_tokens_1"].tolist()[:10]
    assert out[1] == ref["gen_tokens_0"].tolist()[:10]
    assert out[2] == model.generate([prompts[2]], max_new_tokens=10)[0]


def test_sampler_chooses_the_tokens(model, ref):
    prompt = ref["gen_prompt_0"].tolist()
    lowest = model.generate([prompt], max_new_tokens=5, sampler=lambda logits: logits.argmin(-1))[0]
    logits = model.logits([prompt])[0][-1]
    assert lowest[0] == int(torch.argmin(logits))
    assert lowest != ref["gen_tokens_0"].tolist()[:5]
