"""The prefix cache inside vLLM's worker: vLLM's own `enable_prefix_caching` stays off for these exports
(test_settings.py), and the worker's runtime keeps its own `PrefixCache` ("auto": on for an export with continuing
context programs, docs/prefix_caching.md). A second request sharing a 150-token prefix with the first resumes from
the first's cached blocks (block 64: two blocks, 128 tokens) inside vLLM's engine, and returns the greedy tokens of
the export's own `generate()` (which runs it cold). The engine runs in this test's own child interpreter, in process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), so that the worker's runtime can be read after the requests. Its budget is set
through vLLM's `additional_config` (`--additional-config` of `vllm serve`)."""

from __future__ import annotations

import json
import subprocess
import sys

from .conftest import EXPORT, environment, greedy, prompts

NEW_TOKENS = 6
BUDGET = 48 << 20  # bytes: room for this test's blocks, far below the 4 GiB default
ENGINE = """
import json, sys
from vllm import LLM, SamplingParams

llm = LLM(model=sys.argv[1], additional_config={"qwen35_prefix_cache_bytes": %d})
worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
runtime = worker.model_runner.model.model.runtime  # optimum-neuron's wrapper -> this package's model -> its host loop
out = []
for prompt in json.loads(sys.argv[2]):
    result = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=%d, temperature=0), use_tqdm=False)
    out.append({"tokens": list(result[0].outputs[0].token_ids), "hits": runtime.last_prefix_hits,
                "budget": runtime.prefix_cache.budget_bytes})
print("RESULT " + json.dumps(out))
""" % (BUDGET, NEW_TOKENS)


def test_a_shared_prefix_is_served_from_the_workers_cache_with_the_cold_tokens(work, reference):
    (shared,) = prompts([150], seed=7)
    requests = [shared + [5, 6, 7], shared + [9, 10]]
    result = subprocess.run([sys.executable, "-c", ENGINE, str(work / EXPORT), json.dumps(requests)], cwd=work,
                            env={**environment(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, capture_output=True,
                            text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    first, second = json.loads(line.removeprefix("RESULT "))
    assert first["hits"] == [0] and second["hits"] == [128]
    assert first["budget"] == second["budget"] == BUDGET
    assert [first["tokens"], second["tokens"]] == [greedy(reference, p, NEW_TOKENS) for p in requests]
