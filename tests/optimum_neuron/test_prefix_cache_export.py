"""Prefix caching on a cpu export (issue 40): the continuing context programs the export holds, the slots' state
snapshot and restored in this process (TP 1, `ExportedGraphs`) or in the worker processes (TP 2, `WorkerPool`).

A tiny export: batch 2, sequence 256, so blocks of 64 (runtime/prefix_cache.py `export_block_size`), context buckets
[128, 256], cache buckets [128, 256]: a resumed piece in block 1 runs the 128-token program (key length 128 = its
bucket), one in blocks 2 and 3 the continuing program `context_encoding_128_keys_256`.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("optimum.neuron", reason="needs optimum-neuron (the nox `optimum` session)")

from optimum_qwen35.errors import UsageError  # noqa: E402
from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM  # noqa: E402
from optimum_qwen35.runtime.prefix_cache import PrefixCache  # noqa: E402

SEQUENCE = 256
BLOCK = 64
VOCAB_TOP = 200  # token ids below the tiny vocabulary


def _prompt(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB_TOP, (length,), generator=g).tolist()


SHARED = _prompt(0, 150)  # two full blocks (128 tokens) and 22 more
FIRST = SHARED + _prompt(1, 30)  # 180 tokens: stores blocks 0 and 1
SECOND = SHARED + _prompt(2, 40)  # 190 tokens: a hit of 128 tokens, then [128, 190) in the continuing program


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def model(request, export_dir):
    folder = export_dir("tiny-2b", request.param, sequence_length=SEQUENCE)
    model = Qwen35NeuronModelForCausalLM.from_pretrained(folder)
    yield model
    model.runtime.close()


def test_the_export_holds_the_continuing_programs_and_auto_turns_the_cache_on(model):
    manifest = json.loads((model.folder / "compiled" / "graphs.json").read_text())
    assert manifest["prefix_cache"] == {"block_size": BLOCK, "graphs": [[128, 256]]}
    assert manifest["graphs"]["context_encoding_128_keys_256"]["key_length"] == 256
    cache = model.runtime.prefix_cache
    assert isinstance(cache, PrefixCache) and cache.block_size == BLOCK
    with pytest.raises(UsageError, match="blocks of 64 tokens"):
        model.set_prefix_cache(PrefixCache(block_size=128))
    model.set_prefix_cache("auto")


def test_a_hit_equals_a_cold_cache_on_run_bit_for_bit(model):
    runtime = model.runtime
    model.set_prefix_cache(PrefixCache(block_size=BLOCK))
    cold = runtime.prefill([SECOND], [0])
    assert runtime.last_prefix_hits == [0]
    model.set_prefix_cache(PrefixCache(block_size=BLOCK))  # an empty cache: the same prompt cold, then warm
    runtime.prefill([FIRST], [1])
    assert runtime.last_prefix_hits == [0] and len(runtime.prefix_cache) == 2
    warm = runtime.prefill([SECOND], [0])
    assert runtime.last_prefix_hits == [128]
    assert torch.equal(warm, cold)
    model.set_prefix_cache(None)
    uncached = runtime.prefill([SECOND], [0])  # one 256-token context call
    torch.testing.assert_close(warm, uncached, rtol=0, atol=1e-5)
    # The slot holds what a cold run leaves: the next decode step agrees with the uncached one's.
    token = int(uncached[0].argmax())
    after_uncached = runtime.decode([token], [len(SECOND)], [0])
    model.set_prefix_cache(runtime_cache := PrefixCache(block_size=BLOCK))
    runtime.prefill([FIRST], [1])
    runtime.prefill([SECOND], [0])
    assert runtime.last_prefix_hits == [128] and runtime_cache.hits >= 2
    torch.testing.assert_close(runtime.decode([token], [len(SECOND)], [0]), after_uncached, rtol=0, atol=1e-5)
    model.set_prefix_cache("auto")


def test_greedy_tokens_with_a_hit_equal_a_run_without_the_cache(model):
    ids = torch.tensor([SECOND, SHARED + _prompt(3, 40)])  # both share the 150-token prefix
    model.set_prefix_cache(None)
    plain = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)
    model.set_prefix_cache(PrefixCache(block_size=BLOCK))
    first = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)  # cold: both rows miss
    assert model.runtime.last_prefix_hits == [0, 0]
    again = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)  # both rows hit
    assert model.runtime.last_prefix_hits == [128, 128]
    assert torch.equal(first, plain) and torch.equal(again, plain)
    model.set_prefix_cache("auto")


def test_a_changed_token_inside_the_prefix_misses(model):
    runtime = model.runtime
    model.set_prefix_cache(PrefixCache(block_size=BLOCK))
    runtime.prefill([FIRST], [0])
    changed = list(SECOND)
    changed[100] = (changed[100] % (VOCAB_TOP - 1)) + 1  # inside block 1: block 0 still hits
    runtime.prefill([changed], [1])
    assert runtime.last_prefix_hits == [64]
    model.set_prefix_cache("auto")
