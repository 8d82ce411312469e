"""lm-eval (EleutherAI's harness) over this package's export, as users run it: `HFLM(pretrained=<loaded model>,
tokenizer=..., max_length=<the export's>)` through `lm_eval.simple_evaluate` on local task files (no download), one
task per request type; every answer against transformers 5's on the same checkpoint (tests/fixtures/lm_eval,
recorded by its record.py). Needs the `eval` extra (the optimum session installs it)."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("optimum.neuron", reason="needs optimum-neuron (the nox `optimum` session)")
pytest.importorskip("lm_eval", reason='needs lm-eval (pip install ".[optimum,eval]": the nox `optimum` session)')

from transformers import AutoTokenizer  # noqa: E402

from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM  # noqa: E402

from ..conftest import FIXTURES  # noqa: E402
from ..fixtures.lm_eval.tasks import evaluate  # noqa: E402

REFERENCE = json.loads((FIXTURES / "lm_eval" / "reference.json").read_text())
# fp32 on both sides: one loglikelihood (a few tokens) within 1e-4 (the bound; measured 1.2e-5); a rolling sum
# over ~200 tokens within 5e-4 (measured 0 to 6e-5).
LOGLIKELIHOOD_TOL, ROLLING_TOL = 1e-4, 5e-4


@pytest.fixture(scope="module")
def answers(export_dir, tmp_path_factory):
    from lm_eval.models.huggingface import HFLM

    folder = export_dir("tiny-2b", 1)  # batch 2, sequence 128, fp32
    model = Qwen35NeuronModelForCausalLM.from_pretrained(folder)
    lm = HFLM(pretrained=model, tokenizer=AutoTokenizer.from_pretrained(folder),
              max_length=model.neuron_config.sequence_length, batch_size=model.neuron_config.batch_size)
    with pytest.MonkeyPatch.context() as patch:  # local files only: nothing may reach the Hub
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        patch.setenv("HF_HUB_OFFLINE", "1")
        return evaluate(lm, tmp_path_factory.mktemp("lm-eval-tasks"))


def test_loglikelihood_answers_match_transformers(answers):
    ours, ref = answers["samples"]["tiny_choice"], REFERENCE["samples"]["tiny_choice"]
    assert [len(doc) for doc in ours] == [len(doc) for doc in ref]
    for doc, ref_doc in zip(ours, ref):
        for (ll, greedy), (ref_ll, ref_greedy) in zip(doc, ref_doc):
            assert abs(ll - ref_ll) <= LOGLIKELIHOOD_TOL and greedy == ref_greedy
    assert answers["results"]["tiny_choice"]["acc,none"] == REFERENCE["results"]["tiny_choice"]["acc,none"]


def test_rolling_loglikelihood_matches_transformers(answers):
    ours, ref = answers["samples"]["tiny_text"], REFERENCE["samples"]["tiny_text"]
    assert len(ours) == len(ref)
    for (total,), (ref_total,) in zip(ours, ref):
        assert abs(total - ref_total) <= ROLLING_TOL
    for metric, value in REFERENCE["results"]["tiny_text"].items():
        assert math.isclose(answers["results"]["tiny_text"][metric], value, rel_tol=1e-5)


def test_generate_until_gives_transformers_text(answers):
    """Greedy, stopped by lm-eval's stop-sequence criteria (generate(stopping_criteria=...)) and max_gen_toks."""
    assert answers["samples"]["tiny_gen"] == REFERENCE["samples"]["tiny_gen"]
    assert answers["results"]["tiny_gen"] == REFERENCE["results"]["tiny_gen"]
