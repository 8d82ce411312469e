"""The runtime's generate per row (issue 42, items 1 and 8): each prompt its own limit of new tokens (a row stops at
its own, the others run on), transformers' min_new_tokens (no EOS before it), and waves logged once."""

import logging

import pytest
import torch

from optimum_qwen35.errors import UsageError
from optimum_qwen35.runtime import Qwen35Runtime

from .conftest import FIXTURES

LAYOUT = FIXTURES / "tiny-nv2x"
MAX_LENGTH = 64


def random_prompt(length, seed):
    return torch.randint(0, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model():
    return Qwen35Runtime.from_pretrained(LAYOUT, batch_size=2, max_length=MAX_LENGTH, buckets=[32, 64])


def test_each_row_gets_its_own_limit_and_its_solo_tokens(model):
    short, long = random_prompt(20, 1), random_prompt(60, 2)
    solo_short = model.generate([short], max_new_tokens=10)[0]
    solo_long = model.generate([long], max_new_tokens=4)[0]
    assert len(solo_short) == 10 and len(solo_long) == 4
    both = model.generate([short, long], max_new_tokens=[10, 4])
    assert both == [solo_short, solo_long]
    # the long row stops at max_length (60 + 4 = 64) while the short one runs on: a finished row never runs past it
    assert model.generate([long, short], max_new_tokens=[4, 10]) == [solo_long, solo_short]


def test_per_row_limits_are_checked_before_any_graph_runs(model):
    with pytest.raises(UsageError, match=r"prompt \(60 tokens\) \+ max_new_tokens \(5\) exceeds max_length 64"):
        model.generate([random_prompt(20, 1), random_prompt(60, 2)], max_new_tokens=[10, 5])
    with pytest.raises(UsageError, match="max_new_tokens has 1 limits for 2 prompts"):
        model.generate([random_prompt(20, 1), random_prompt(30, 2)], max_new_tokens=[10])


def test_min_new_tokens_keeps_eos_out_until_then(model):
    prompt = random_prompt(20, 3)
    greedy = model.generate([prompt], max_new_tokens=12)[0]
    eos = greedy[1]  # the second greedy token stands in for EOS
    assert model.generate([prompt], max_new_tokens=12, eos_token_id=eos)[0] == greedy[:2]
    held = model.generate([prompt], max_new_tokens=12, eos_token_id=eos, min_new_tokens=6)[0]
    assert len(held) >= 6 and eos not in held[:6]
    assert held[0] == greedy[0]


def test_waves_are_logged_once(caplog):
    model = Qwen35Runtime.from_pretrained(LAYOUT, batch_size=1, max_length=MAX_LENGTH, buckets=[32, 64])
    prompts = [random_prompt(8, seed) for seed in range(3)]
    with caplog.at_level(logging.WARNING, logger="optimum_qwen35"):
        model.generate(prompts, max_new_tokens=2)
        model.generate(prompts, max_new_tokens=2)
        model.generate(prompts[:1], max_new_tokens=2)
    waves = [r.getMessage() for r in caplog.records if "waves" in r.getMessage()]
    assert waves == [
        "generate: 3 prompts on a model of batch size 1 run in 3 successive waves of at most 1 rows (logged once); "
        "build or export the model with a larger batch size to run them together"
    ]


def test_every_wave_takes_its_own_rows_limits():
    """More prompts than slots (waves): each wave's rows keep their own max_new_tokens, not the first wave's (issue 50:
    `limits[: len(group)]` in place of `limits[start : start + batch_size]` gave [2, 2] here, with no error)."""
    model = Qwen35Runtime.from_pretrained(LAYOUT, batch_size=1, max_length=MAX_LENGTH, buckets=[32, 64])
    prompts = [random_prompt(10, 4), random_prompt(12, 5), random_prompt(9, 6)]
    rows = model.generate(prompts, max_new_tokens=[2, 6, 3])
    assert [len(r) for r in rows] == [2, 6, 3]
    assert rows == [model.generate([p], max_new_tokens=n)[0] for p, n in zip(prompts, (2, 6, 3))]
