"""`vllm.LLM(model=<export>)` (vLLM's offline engine) on a cpu-target export, started by docs/serving.md's Python
block as written: greedy tokens equal the export's own `generate()`, solo and with more requests than the export
has slots, prompts on both sides of a context-bucket edge (128) and up to the sequence length; a seeded sampled
request is reproducible; the engine's settings follow the export."""

from __future__ import annotations

import pytest

from .conftest import BATCH_SIZE, EXPORT, SEQUENCE_LENGTH, doc_python, greedy, prompts

# 7 prompts into 4 slots: queued requests take the slots that finish. 127/128/129: both sides of the bucket edge.
LENGTHS = [1, 7, 127, 128, 129, 200, 250]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def doc_run(work, monkeypatch_module):
    """docs/serving.md's Python block, run in this process from the export's folder: its names (`llm`, `outputs`)."""
    monkeypatch_module.chdir(work)
    namespace = {"__name__": "__main__"}
    exec(compile(doc_python("LLM("), "docs/serving.md", "exec"), namespace)  # noqa: S102
    yield namespace
    namespace["llm"].llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_the_docs_block_returns_generates_tokens(doc_run, reference):
    tokenizer = doc_run["llm"].get_tokenizer()
    prompt = tokenizer("The capital of France is")["input_ids"]
    got = list(doc_run["outputs"][0].outputs[0].token_ids)
    assert list(doc_run["outputs"][0].prompt_token_ids) == prompt
    assert got == greedy(reference, prompt, 16)


def test_the_engine_takes_the_exports_length_and_slots(doc_run):
    config = doc_run["llm"].llm_engine.vllm_config
    assert config.model_config.max_model_len == SEQUENCE_LENGTH
    assert config.scheduler_config.max_num_seqs == BATCH_SIZE
    assert not config.scheduler_config.chunked_prefill_enabled
    assert config.scheduler_config.max_num_batched_tokens >= SEQUENCE_LENGTH + BATCH_SIZE
    assert config.parallel_config.worker_cls == "optimum_qwen35.serving.vllm_worker.Qwen35CpuExportWorker"


def test_greedy_tokens_equal_generate_solo_and_concurrent(doc_run, reference):
    from vllm import SamplingParams

    llm = doc_run["llm"]
    greedy_params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
    batch = prompts(LENGTHS)
    expected = [greedy(reference, p, NEW_TOKENS) for p in batch]
    solo = [list(llm.generate([{"prompt_token_ids": p}], greedy_params, use_tqdm=False)[0].outputs[0].token_ids)
            for p in (batch[0], batch[4])]
    assert solo == [expected[0], expected[4]]
    together = llm.generate([{"prompt_token_ids": p} for p in batch], greedy_params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in together] == expected
    assert all(len(t) >= 1 for t in expected)


def test_a_seeded_sampled_request_is_reproducible(doc_run):
    from vllm import SamplingParams

    llm = doc_run["llm"]
    (prompt,) = prompts([20], seed=1)

    def sample(seed):
        params = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, seed=seed)
        return list(llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids)

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first
