"""Batched generate() on an export gives each row its own room (issue 42, item 1): a short prompt batched with one
near the compiled sequence length gets all its new tokens (its solo tokens); a row asking for more new tokens than
its room is refused in one line (issue 50), or, where the caller opts in (`stop_at_sequence_length=True`), stops at
the compiled length; a request no row can serve (a prompt filling the compiled length, a min_new_tokens without room)
raises one line; lm-eval's generate_until gives each request its own answer in a batch with a long one, and an HFLM
whose max_length is above the export's fails loudly instead of scoring a cut answer."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("optimum.neuron", reason="needs optimum-neuron (the nox `optimum` session)")

from optimum_qwen35.errors import UsageError  # noqa: E402
from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM  # noqa: E402


@pytest.fixture(scope="module")
def model(export_dir):
    return Qwen35NeuronModelForCausalLM.from_pretrained(export_dir("tiny-2b", 1))  # batch 2, sequence 128


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 400, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def left_padded(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :], mask[row, width - len(p) :] = torch.tensor(p), 1
    return ids, mask


def new_tokens(model, prompts, **kwargs) -> list[list[int]]:
    ids, mask = left_padded(prompts)
    out = model.generate(ids, attention_mask=mask, do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs)
    return out[:, ids.shape[1] :].tolist()


def test_a_short_row_beside_a_long_one_gets_all_its_tokens(model, caplog):
    short, long = prompt(50, 1), prompt(124, 2)  # the case: 50 + 124 tokens on a 128-token export
    (solo_short,) = new_tokens(model, [short], max_new_tokens=10)
    (solo_long,) = new_tokens(model, [long], max_new_tokens=4)
    assert len(solo_short) == 10 and len(solo_long) == 4
    # Within every row's room: each row's solo tokens, no warning
    with caplog.at_level(logging.WARNING):
        rows = new_tokens(model, [short, long], max_new_tokens=4)
    assert rows == [solo_short[:4], solo_long]
    assert not [r for r in caplog.records if "compiled sequence length" in r.getMessage()]
    # Opted in, the long row stops at the compiled length and a warning says so; the short one runs on
    with caplog.at_level(logging.WARNING):
        rows = new_tokens(model, [short, long], max_new_tokens=10, stop_at_sequence_length=True)
    assert rows[0] == solo_short
    assert rows[1] == solo_long + [0] * 6  # stopped at the compiled length, padded
    (warning,) = [r.getMessage() for r in caplog.records if "compiled sequence length" in r.getMessage()]
    assert warning.startswith("rows [1] stop before max_new_tokens (10) at the compiled sequence length 128")
    # max_length (transformers' total length) is each row's limit too
    ids, mask = left_padded([short, long])
    out = model.generate(ids, attention_mask=mask, do_sample=False, eos_token_id=None, pad_token_id=0,
                         max_length=ids.shape[1] + 10, stop_at_sequence_length=True)
    assert out[:, ids.shape[1] :].tolist() == rows


def test_more_new_tokens_than_a_rows_room_is_refused_in_one_line(model):
    """Issue 50: no silent short answer. By max_new_tokens or by max_length, the row, its room, the export's length
    and the fixes, before any graph runs."""
    short, long = prompt(50, 1), prompt(124, 2)
    want = (r"^row 1 asks for 10 new tokens but its prompt \(124 tokens\) leaves room for 4 in the export's sequence "
            r"length \(128\): export the model with a larger sequence_length, ask for at most 4 new tokens")
    with pytest.raises(UsageError, match=want) as error:
        new_tokens(model, [short, long], max_new_tokens=10)
    assert "\n" not in str(error.value) and "stop_at_sequence_length=True" in str(error.value)
    ids, mask = left_padded([short, long])
    with pytest.raises(UsageError, match=want):
        model.generate(ids, attention_mask=mask, do_sample=False, eos_token_id=None, pad_token_id=0,
                       max_length=ids.shape[1] + 10)
    with pytest.raises(UsageError, match="stop_at_sequence_length must be True or False"):
        new_tokens(model, [short], max_new_tokens=4, stop_at_sequence_length="yes")


def test_a_request_no_row_can_serve_says_so_in_one_line(model):
    length = model.neuron_config.sequence_length
    with pytest.raises(UsageError, match=r"^the prompt of row 1 \(128 tokens\) fills the compiled sequence length "
                                         r"\(128\): no new token fits; shorten it") as error:
        new_tokens(model, [prompt(20, 1), prompt(length, 2)], max_new_tokens=4)
    assert "\n" not in str(error.value)
    with pytest.raises(UsageError, match=r"^min_new_tokens \(8\) cannot be met: the prompt of row 1 \(124 tokens\) "
                                         r"leaves room for 4 new tokens") as error:
        new_tokens(model, [prompt(50, 1), prompt(124, 2)], max_new_tokens=10, min_new_tokens=8)
    assert "\n" not in str(error.value)


def test_min_new_tokens_holds_eos_back(model):
    p = prompt(30, 5)
    (greedy,) = new_tokens(model, [p], max_new_tokens=12)
    eos = greedy[1]
    ids = torch.tensor([p])
    stopped = model.generate(ids, do_sample=False, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    assert stopped[0, len(p) :].tolist() == greedy[:2]
    held = model.generate(ids, do_sample=False, max_new_tokens=12, min_new_tokens=6, eos_token_id=eos, pad_token_id=0)
    assert held.shape[1] >= len(p) + 6 and eos not in held[0, len(p) : len(p) + 6].tolist()


def test_lm_eval_generate_until_answers_each_request_on_its_own(model, export_dir):
    """HFLM with the export's length: a request batched with a long one gets the answer it gets alone."""
    pytest.importorskip("lm_eval", reason="needs lm-eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(export_dir("tiny-2b", 1))
    lm = HFLM(pretrained=model, tokenizer=tokenizer, max_length=model.neuron_config.sequence_length,
              batch_size=model.neuron_config.batch_size)
    short = tokenizer.decode(prompt(20, 7))
    long = tokenizer.decode(prompt(100, 8))
    gen = {"until": ["\n\n\n\n"], "max_gen_toks": 24, "do_sample": False}

    def ask(*contexts):
        return lm.generate_until([Instance("generate_until", {}, (c, dict(gen)), i) for i, c in enumerate(contexts)],
                                 disable_tqdm=True)

    (alone,) = ask(short)
    assert ask(short, long)[0] == alone


def test_lm_eval_with_a_longer_max_length_than_the_export_fails_loudly(model, export_dir):
    """Issue 50's evaluation case: HFLM(max_length=256) on a 128-token export keeps a 124-token prompt whole (its
    budget is 256 - 10) and asks for 10 new tokens, for which the export has room for 4. It must fail in one line,
    never score a 4-token answer as the model's 10."""
    pytest.importorskip("lm_eval", reason="needs lm-eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(export_dir("tiny-2b", 1))
    lm = HFLM(pretrained=model, tokenizer=tokenizer, max_length=256, batch_size=1)
    context = tokenizer.decode(lm.tok_encode(tokenizer.decode(prompt(124, 9)))[:124])  # ~124 tokens once re-encoded
    length = len(lm.tok_encode(context))
    assert 118 < length < 128  # room for fewer than the 10 tokens asked
    gen = {"until": ["\n\n\n\n"], "max_gen_toks": 10, "do_sample": False}
    with pytest.raises(UsageError, match=rf"^row 0 asks for 10 new tokens but its prompt \({length} tokens\) leaves "
                                         rf"room for {128 - length} in the export's sequence length \(128\)"):
        lm.generate_until([Instance("generate_until", {}, (context, gen), 0)], disable_tqdm=True)
