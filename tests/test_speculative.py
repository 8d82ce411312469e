"""Speculative decoding with the MTP head (runtime/speculative.py) is exact: greedy, it returns token for token what
plain greedy decoding returns, for k = 1..4, in fp32 and bf16 (bf16 against plain bf16 decoding), with prompts across
context-bucket and cache-bucket edges, rows of different acceptance in one batch, EOS inside accepted drafts and the end
of the cache. The tiny checkpoints' random heads accept almost nothing (exactness would be easy there), so the same
tests run with a head fitted to its own main model (optimum_qwen35/tiny/mtp_fit.py), which accepts most drafts."""

import json

import pytest
import torch

from optimum_qwen35.errors import UsageError
from optimum_qwen35.runtime import Qwen35Runtime

from .conftest import FIXTURES

MAX_LENGTH = 128  # cache buckets 64, 96, 128
BUCKETS = [16, 32]  # prompts longer than 32 run in chunks
# 15 and 17 tokens: either side of the 16-token bucket edge; 40: two chunks; generation crosses the 64 cache bucket.
PROMPTS = [list(range(5, 20)), [7, 300, 2] * 5 + [11, 12], [(i * 37) % 500 + 3 for i in range(40)]]
NEW = 40


def runtime(folder, dtype, batch_size=3):
    return Qwen35Runtime.from_pretrained(folder, batch_size=batch_size, max_length=MAX_LENGTH, dtype=dtype,
                                         buckets=BUCKETS, mtp=True)


@pytest.fixture(scope="module", params=["random", "fitted"])
def case(request):
    """(checkpoint, prompts): the random head with PROMPTS; the fitted head with prompts of the same lengths made of
    a fitted prompt and the start of its greedy continuation (so that what follows is in-sample)."""
    if request.param == "random":
        return FIXTURES / "tiny-2b", PROMPTS
    folder = request.getfixturevalue("fitted_tiny_2b")  # built once per run (tests/conftest.py): only for these parameters
    fitted = json.loads((folder / "mtp_fit.json").read_text())["prompts"][:3]
    model = Qwen35Runtime.from_pretrained(folder, batch_size=3, max_length=MAX_LENGTH, buckets=BUCKETS)
    continued = model.generate(fitted, max_new_tokens=32)
    return folder, [p + c[: len(want) - len(p)] for p, c, want in zip(fitted, continued, PROMPTS)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_greedy_speculation_equals_greedy_decoding(case, dtype):
    head, prompts = case
    model = runtime(head, dtype)
    plain = model.generate(prompts, max_new_tokens=NEW)
    lengths = {}
    for k in (1, 2, 3, 4):
        assert model.generate(prompts, max_new_tokens=NEW, num_speculative_tokens=k) == plain, f"k={k}"
        lengths[k] = model.speculation.acceptance_length
        if head.name != "tiny-2b":  # the fitted head accepts (in bf16 less: its greedy continuation leaves fp32's, which
            # the head was fitted on, after a few tokens)
            floor = 1.5 if dtype == torch.float32 else 1.05
            assert model.speculation.acceptance_length > floor, (k, model.speculation.accepted_per_round)
    if head.name != "tiny-2b":  # and at k = 4 the rows of one batch accept different numbers of drafts
        assert len(set(model.speculation.accepted_per_round)) > 1, model.speculation.accepted_per_round
    print(f"acceptance length per k ({head.name}, {dtype}): {lengths}")


def test_eos_inside_accepted_drafts_and_end_of_cache(case):
    head, prompts = case
    model = runtime(head, torch.float32, batch_size=2)
    plain = model.generate(prompts[:2], max_new_tokens=NEW)
    # An EOS the greedy continuation reaches mid-way: every row stops right after it, as plain decoding does.
    eos = plain[0][NEW // 2]
    want = model.generate(prompts[:2], max_new_tokens=NEW, eos_token_id=eos)
    assert len(want[0]) == NEW // 2 + 1 or eos in want[0][: NEW // 2]
    for k in (2, 4):
        assert model.generate(prompts[:2], max_new_tokens=NEW, eos_token_id=eos, num_speculative_tokens=k) == want
    # Up to the last position of the cache: verification past it is cut to what fits.
    last = [prompts[2][:30], prompts[0]]
    longest = MAX_LENGTH - 30
    want = model.generate(last, max_new_tokens=longest)
    assert model.generate(last, max_new_tokens=longest, num_speculative_tokens=4) == want


def test_row_limits_min_new_tokens_and_streamer_as_plain_decoding(case):
    """What plain generate takes, speculation takes alike: one max_new_tokens per row (each row stops at its own,
    the others run on), min_new_tokens (no EOS before it: masked at every draft and verified position, so greedy
    speculation still returns plain greedy's tokens) and a streamer (one prompt: every new token once, in order)."""
    head, prompts = case
    model = runtime(head, torch.float32, batch_size=2)
    limits = [NEW, 7]
    want = model.generate(prompts[:2], max_new_tokens=limits)
    assert [len(t) for t in want] == limits
    for k in (1, 3):
        assert model.generate(prompts[:2], max_new_tokens=limits, num_speculative_tokens=k) == want, k
    # An EOS plain greedy reaches at new token 3, suppressed until new token 12: the rows decode on past it.
    plain = model.generate(prompts[:2], max_new_tokens=NEW)
    eos = plain[0][3]
    want = model.generate(prompts[:2], max_new_tokens=NEW, eos_token_id=eos, min_new_tokens=12)
    assert len(want[0]) > 4 and eos not in want[0][:12], want[0]
    for k in (1, 2, 4):
        got = model.generate(prompts[:2], max_new_tokens=NEW, eos_token_id=eos, min_new_tokens=12,
                             num_speculative_tokens=k)
        assert got == want, k
    streamed = []
    tokens = model.generate(prompts[:1], max_new_tokens=NEW, num_speculative_tokens=3,
                            streamer=lambda index, new: streamed.append((index, list(new))))
    assert streamed == [(i, [t]) for i, t in enumerate(tokens[0])] and tokens[0] == plain[0]
    with pytest.raises(UsageError, match="a streamer with speculative decoding takes one prompt"):
        model.generate(prompts[:2], max_new_tokens=4, num_speculative_tokens=3, streamer=lambda index, new: None)


def test_stop_hook_sees_the_steps_of_plain_decoding(case):
    """`stop` (what transformers' stopping criteria become) is called once per step as plain decoding calls it: the
    same calls (wave's first row, each row's tokens so far) in the same order, each running row's logits those its
    newest token was chosen from, and a row it flags cut there, though speculation ran that row ahead. Three prompts
    on a batch-2 model: two waves, the second's first row is prompt 2."""
    head, prompts = case
    model = runtime(head, torch.float32, batch_size=2)
    plain = model.generate(prompts, max_new_tokens=NEW)
    cut = plain[0][5]  # row 0 stops at its sixth new token; row 2 after 9; row 1 runs on (unless it meets `cut`)

    def recorder(calls):
        def stop(first, outputs, logits):
            step = max(len(o) for o in outputs)
            calls.append((first, [list(o) for o in outputs],
                          [int(row.argmax()) if len(o) == step else None for o, row in zip(outputs, logits)]))
            return [o[-1] == cut or (first + i == 2 and len(o) == 9) for i, o in enumerate(outputs)]
        return stop

    want_calls = []
    want = model.generate(prompts, max_new_tokens=NEW, stop=recorder(want_calls))
    assert len(want[0]) == 6 and len(want[2]) == 9 and len(want[1]) > 9, [len(t) for t in want]
    for first, outputs, chosen in want_calls:  # greedy: a running row's newest token is its logits' argmax
        assert all(c is None or c == o[-1] for o, c in zip(outputs, chosen))
    for k in (1, 2, 4):
        calls = []
        assert model.generate(prompts, max_new_tokens=NEW, stop=recorder(calls), num_speculative_tokens=k) == want, k
        assert calls == want_calls, k
    with pytest.raises(UsageError, match="no sampler or images"):
        model.generate(prompts[:1], max_new_tokens=4, sampler=lambda logits: logits.argmax(-1), num_speculative_tokens=2)


def test_speculation_runs_without_autograd():
    """The speculative loop calls the graphs directly (not through prefill / decode, which run under no_grad): without
    no_grad around it every head, verify and commit call recorded an autograd graph over the parameters."""
    model = runtime(FIXTURES / "tiny-2b", torch.float32, batch_size=1)
    seen, verify = [], model.graphs.verify

    def spy(*args):
        seen.append(torch.is_grad_enabled())
        return verify(*args)

    model.graphs.verify = spy
    model.generate([[5, 6, 7]], max_new_tokens=6, num_speculative_tokens=2)
    assert seen and not any(seen)
