"""Speculative decoding with a draft vocabulary (runtime/draft_vocab.py; the MTP head scores V_d token ids, verification
the whole vocabulary) stays exact:

- greedy: token for token plain greedy decoding's, at V_d = 16, 66 and the whole 512 (tiny-2b's vocabulary; 8k and 32k
  of the real 248,320 scaled down alike), with the fitted head (optimum_qwen35/tiny/mtp_fit.py) and a corpus ranking (other
  prompts' continuations), a ranking counted over the text itself (drafts kept as with the whole vocabulary), and a
  ranking that leaves out the tokens greedy decoding picks (every draft rejected: still exact);
- sampled: the chi-square test of tests/test_speculative_sampling.py with a draft vocabulary that leaves out a token
  the target law gives high probability (q = 0 there: only the residual max(p - q, 0) reaches it), and a broken
  residual that ignores the tokens outside the subset as a control that must be detected;
- the head's draft logits are the full head's logits at those ids; both rankings are permutations of the vocabulary;
- an export made with `draft_vocab_size` (the cpu target, TP 1): graphs.json lists the first V_d ids of the checkpoint's
  draft_vocab.json, its head programs draft over them, greedy speculation on it equals plain greedy and keeps the
  eager runtime's drafts (the same acceptance); where it is not built (TP 2, without mtp), one line.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter

import pytest
import torch

from optimum_qwen35.errors import UsageError
from optimum_qwen35.export.layout import COMPILED_DIR, GRAPHS_FILE
from optimum_qwen35.neuron_model import neuron_model_class
from optimum_qwen35.runtime import Qwen35Runtime, speculative
from optimum_qwen35.runtime.draft_vocab import (
    draft_ids, load_ranking, rank_by_counts, rank_by_merges, save_ranking, use_draft_vocab,
)

from . import test_speculative_sampling as sampling
from .conftest import FIXTURES

VOCAB = 512
SIZES = (16, 66, None)  # 8k, 32k of 248,320 scaled to 512 (3.3%, 12.9%); None: the whole vocabulary
BUCKETS, MAX_LENGTH, NEW = [16, 32], 128, 32


@pytest.fixture(scope="module")
def fitted(fitted_tiny_2b):
    """(folder, in-sample prompts, corpus ranking): the ranking counts the main model's greedy continuations of other
    seeded random prompts than the head was fitted on (a corpus made here; tiny-2b has no text to count)."""
    folder = fitted_tiny_2b
    fit = json.loads((folder / "mtp_fit.json").read_text())["prompts"][:3]
    model = Qwen35Runtime.from_pretrained(folder, batch_size=8, max_length=MAX_LENGTH, buckets=BUCKETS)
    corpus = torch.randint(3, VOCAB, (8, 8), generator=torch.Generator().manual_seed(7)).tolist()
    ranking = rank_by_counts(model.generate(corpus, max_new_tokens=64), VOCAB)
    prompts = [p + c for p, c in zip(fit, model.generate(fit, max_new_tokens=8))]
    model.close()
    return folder, prompts, ranking


def test_rankings_are_permutations(tmp_path):
    merges = rank_by_merges(FIXTURES / "tiny-2b" / "tokenizer.json", VOCAB)
    counts = rank_by_counts([[5, 5, 9], [9, 9, 1]], VOCAB)
    assert sorted(merges) == sorted(counts) == list(range(VOCAB))
    assert counts[:3] == [9, 5, 1]
    assert save_ranking(tmp_path, counts, "test").is_file() and load_ranking(tmp_path) == counts
    assert draft_ids(counts, None, VOCAB) is None and draft_ids(counts, VOCAB, VOCAB) is None
    with pytest.raises(UsageError, match="permutation"):
        draft_ids(counts[:-1] + [0], 8, VOCAB)
    with pytest.raises(UsageError, match="outside the vocabulary"):
        rank_by_counts([[VOCAB]], VOCAB)


def test_a_model_without_the_head_says_what_to_do(fitted):
    folder, _, ranking = fitted
    model = Qwen35Runtime.from_pretrained(folder, batch_size=1, max_length=MAX_LENGTH, buckets=BUCKETS)
    with pytest.raises(UsageError, match="mtp=True"):
        use_draft_vocab(model, ranking, 16)
    model.close()


def test_draft_logits_are_the_full_heads_at_those_ids(fitted):
    folder, prompts, ranking = fitted
    model = Qwen35Runtime.from_pretrained(folder, batch_size=1, max_length=MAX_LENGTH, buckets=BUCKETS, mtp=True)
    decoder = model.graphs.decoder
    out = torch.randn(3, decoder.config.hidden_size, generator=torch.Generator().manual_seed(0))
    ids = draft_ids(ranking, 66, VOCAB)
    decoder.mtp.set_draft_vocab(decoder.lm_head, ids)
    torch.testing.assert_close(decoder.mtp.draft_head(out), decoder.lm_head(out)[:, ids], rtol=1e-6, atol=1e-6)


# bf16 is a matrix point: fp32 holds the same equalities and the acceptance lengths; bf16 speculation is held exact
# on an export in tests/test_speculative_export.py (TP 2).
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.matrix)], ids=["fp32", "bf16"])
def test_greedy_speculation_with_a_draft_vocabulary_equals_greedy(fitted, dtype):
    folder, prompts, ranking = fitted
    model = Qwen35Runtime.from_pretrained(folder, batch_size=3, max_length=MAX_LENGTH, buckets=BUCKETS, dtype=dtype,
                                          mtp=True)
    plain = model.generate(prompts, max_new_tokens=NEW)
    lengths = {}
    for size in SIZES:
        use_draft_vocab(model, ranking, size)
        for k in (1, 3):
            assert model.generate(prompts, max_new_tokens=NEW, num_speculative_tokens=k) == plain, (size, k)
            lengths[size, k] = model.speculation.acceptance_length
    # A ranking whose first ids are none of the tokens plain decoding emits: every draft is rejected, still exact.
    emitted = {t for row in plain for t in row}
    others = [t for t in range(VOCAB) if t not in emitted]
    use_draft_vocab(model, others + sorted(emitted), 16)
    assert model.generate(prompts, max_new_tokens=NEW, num_speculative_tokens=2) == plain
    assert model.speculation.accepted == 0
    # A ranking counted over the continuations themselves (the corpus the text comes from): V_d = 66 holds them.
    use_draft_vocab(model, rank_by_counts(plain, VOCAB), 66)
    assert model.generate(prompts, max_new_tokens=NEW, num_speculative_tokens=3) == plain
    lengths["in-corpus 66", 3] = model.speculation.acceptance_length
    print(f"acceptance length per (V_d, k) ({dtype}): {lengths}")
    if dtype == torch.float32:  # the fitted head keeps drafts through a draft vocabulary that holds the text's tokens
        assert lengths[None, 3] > 1.5 and lengths["in-corpus 66", 3] > 1.5, lengths


@pytest.fixture(scope="module")
def sampled(fitted):
    """The sampling test's model and prompt (a fitted prompt and its continuation), its exact law, and a draft
    vocabulary without the second most likely first token (q = 0 on a token of high target probability)."""
    folder, _, ranking = fitted
    fit = json.loads((folder / "mtp_fit.json").read_text())["prompts"][0]
    model = Qwen35Runtime.from_pretrained(folder, batch_size=sampling.BATCH, max_length=40, buckets=[32], mtp=True)
    prompt = fit + model.generate([fit], max_new_tokens=12)[0]
    law = sampling.exact_law(model, prompt)
    second = Counter()
    for cells, p in law.items():
        second[cells[1]] += p  # the law of the second token (the first verify round's first draft)
    dropped = [t for t, _ in second.most_common(2)]  # the two likeliest second tokens: one left out, one kept
    support = sorted({t for cells in law for t in cells} - {dropped[1]})  # every other token the law can emit
    kept = support + [t for t in ranking if t not in support and t != dropped[1]]
    use_draft_vocab(model, kept + [dropped[1]], 66)
    assert dropped[0] in model.graphs.draft_ids and dropped[1] not in model.graphs.draft_ids
    return model, prompt, law


def test_speculative_sampling_with_a_draft_vocabulary_follows_the_law(sampled):
    model, prompt, law = sampled
    kept = Counter()
    statistic, df, p_value, tv = sampling.chi_square(sampling.draws(model, prompt, sampling.K, seed=5, kept=kept), law)
    print(f"draft vocabulary: chi2 {statistic:.1f} df {df} p {p_value:.3f} TV {tv:.3f}; kept per round {dict(kept)}")
    assert kept[0] > 0 and kept[sampling.K] > 0, kept
    assert p_value > sampling.ALPHA


def test_a_residual_that_ignores_the_subset_is_detected(sampled, monkeypatch):
    """Control: a residual over the draft vocabulary only (max(p - q, 0) where q > 0) never emits the left-out
    token after a rejection; the chi-square test must see it."""
    model, prompt, law = sampled

    def subset_residual(p, q, draft, generator):
        if float(torch.rand((), generator=generator, dtype=torch.float64)) * q[draft] < p[draft]:
            return None
        residual = (p - q).clamp(min=0) * (q > 0)
        residual = residual if residual.sum() > 0 else q
        return speculative._sample(residual / residual.sum(), generator)

    monkeypatch.setattr(speculative, "reject", subset_residual)
    statistic, df, p_value, tv = sampling.chi_square(
        sampling.draws(model, prompt, sampling.K, seed=6, samples=sampling.CONTROL_SAMPLES), law)
    print(f"subset residual: chi2 {statistic:.1f} df {df} p {p_value:.2e} TV {tv:.3f}")
    assert p_value < sampling.ALPHA


def _export(source, out, tp: int = 1, **kwargs):
    cls = neuron_model_class()
    nc = cls.get_neuron_config(source, target="cpu", batch_size=3, sequence_length=MAX_LENGTH, tensor_parallel_size=tp,
                               dtype="float32")
    cls.export(source, neuron_config=nc, **kwargs).save_pretrained(out)
    return out


def test_an_export_drafts_over_its_draft_vocabulary_and_stays_exact(fitted, tmp_path):
    folder, prompts, ranking = fitted
    source = tmp_path / "checkpoint"
    shutil.copytree(folder, source)
    save_ranking(source, ranking, "counts")  # shipped beside the weights; the export takes its first V_d ids
    out = _export(source, tmp_path / "export", mtp=True, draft_vocab_size=66)
    assert json.loads((out / COMPILED_DIR / GRAPHS_FILE).read_text())["mtp"]["draft_ids"] == ranking[:66]
    model = Qwen35Runtime.from_export(out)
    eager = Qwen35Runtime.from_pretrained(folder, batch_size=3, max_length=MAX_LENGTH, buckets=BUCKETS, mtp=True)
    use_draft_vocab(eager, ranking, 66)
    try:
        assert model.graphs.draft_ids.tolist() == ranking[:66]
        plain = model.generate(prompts, max_new_tokens=NEW)
        assert plain == eager.generate(prompts, max_new_tokens=NEW)
        for k in (1, 3):
            assert model.generate(prompts, max_new_tokens=NEW, num_speculative_tokens=k) == plain, k
            exported = model.speculation.acceptance_length
            assert eager.generate(prompts, max_new_tokens=NEW, num_speculative_tokens=k) == plain, k
            assert exported == eager.speculation.acceptance_length and exported > 1.0, (k, exported)
        with pytest.raises(UsageError, match="chosen when it is exported"):
            use_draft_vocab(model, ranking, 16)
    finally:
        model.close()
        eager.close()


def test_a_draft_vocabulary_where_exports_do_not_build_one_says_so_in_one_line(fitted, tmp_path, capsys):
    folder, _, _ = fitted
    with pytest.raises(UsageError, match="tensor_parallel_size 1") as error:
        _export(folder, tmp_path / "tp2", tp=2, mtp=True, draft_vocab_size=66)
    assert "\n" not in str(error.value)
    with pytest.raises(UsageError, match="pass mtp=True"):
        _export(folder, tmp_path / "plain", draft_vocab_size=66)
    assert not (tmp_path / "tp2").exists() and not (tmp_path / "plain").exists()
    # The command line: the same line, no traceback.
    from optimum_qwen35.cli.main import main

    code = main(["export", "--model", str(folder), "--target", "cpu", "--sequence_length", str(MAX_LENGTH),
                 "--draft_vocab_size", "66", str(tmp_path / "cli")])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "pass mtp=True (--mtp)" in err and len(err.splitlines()) == 1, err
