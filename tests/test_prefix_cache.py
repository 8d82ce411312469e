"""The prefix cache (runtime/prefix_cache.py, `Qwen35Runtime.set_prefix_cache`): a prompt resumed from cached block
states gives what a cold run gives.

With the cache on, context encoding runs in block-aligned pieces whose graphs depend on the prompt alone, so a hit
is compared bit for bit with a cold run that has the cache on (`torch.equal`), and within 1e-5 (fp32) with a run
that has no cache (one-shot context encoding, other shapes: rounding may differ). The tiny-2b fixture (8 layers, 6
DeltaNet + 2 attention), block size 64 (the delta rule's chunk), random prompts over its 512-token vocabulary.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from optimum_qwen35.errors import IncompatibleExportError, UsageError
from optimum_qwen35.runtime import Qwen35Runtime, prefix_cache
from optimum_qwen35.runtime.eager import load_decoder
from optimum_qwen35.runtime.prefix_cache import PrefixCache, snapshot_bytes
from tests.conftest import FIXTURES

BLOCK = 64
MAX_LENGTH = 512


@pytest.fixture(scope="module")
def decoder():
    return load_decoder(FIXTURES / "tiny-2b")


def runtime(decoder, cache=None, batch_size=2):
    return Qwen35Runtime.from_decoder(decoder, batch_size=batch_size, max_length=MAX_LENGTH, prefix_cache=cache)


def tokens(n, seed):
    g = random.Random(seed)
    return [g.randrange(512) for _ in range(n)]


def fresh_cache(budget=2**30):
    return PrefixCache(block_size=BLOCK, budget_bytes=budget)


def cold(decoder, prompts, cache=True):
    """All-position logits of `prompts` (rows in this order) from a runtime with an empty cache (or none)."""
    model = runtime(decoder, fresh_cache() if cache else None)
    out = model.prefill(prompts, list(range(len(prompts))), all_logits=True)
    assert model.last_prefix_hits == [0] * len(prompts)
    return out


PREFIX = tokens(200, 0)  # 3 full blocks and 8 tokens
A = PREFIX + tokens(37, 1)
B = PREFIX + tokens(50, 2)


def test_a_hit_gives_the_cold_runs_logits_bit_for_bit(decoder):
    model = runtime(decoder, fresh_cache())
    model.prefill([A], [0])
    warm = model.prefill([B], [1], all_logits=True)
    assert model.last_prefix_hits == [192]  # the prefix's 3 full blocks; its last 8 tokens end mid-block
    assert warm[0, :192].isnan().all()  # served by the cache: no logits there
    assert torch.equal(warm[0, 192:], cold(decoder, [B])[0, 192:])
    torch.testing.assert_close(warm[0, 192:], cold(decoder, [B], cache=False)[0, 192:], rtol=0, atol=1e-5)


def test_greedy_tokens_and_decode_logits_after_a_hit(decoder):
    model = runtime(decoder, fresh_cache())
    model.generate([A], max_new_tokens=2)
    steps = []
    warm = model.generate([B], max_new_tokens=8, stop=lambda first, out, logits: steps.append(logits.clone()) or [False])
    assert model.last_prefix_hits == [192]
    reference_steps = []
    plain = runtime(decoder)
    expected = plain.generate([B], max_new_tokens=8, stop=lambda f, o, logits: reference_steps.append(logits.clone()) or [False])
    assert warm == expected
    for got, want in zip(steps, reference_steps):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_bf16_greedy_after_a_hit_equals_a_cold_bf16_run():
    bf16 = load_decoder(FIXTURES / "tiny-2b", torch.bfloat16)
    model = runtime(bf16, fresh_cache())
    model.generate([A], max_new_tokens=2)
    warm = model.generate([B], max_new_tokens=12)
    assert model.last_prefix_hits == [192]
    assert warm == runtime(bf16, fresh_cache()).generate([B], max_new_tokens=12)  # cold, cache on: the same graphs
    assert warm == runtime(bf16).generate([B], max_new_tokens=12)  # cold, no cache


def test_a_prefix_ending_mid_block(decoder):
    shared = tokens(100, 3)  # one full block, 36 tokens into the second
    model = runtime(decoder, fresh_cache())
    model.prefill([shared + tokens(20, 4)], [0])
    prompt = shared + tokens(70, 5)
    warm = model.prefill([prompt], [0], all_logits=True)
    assert model.last_prefix_hits == [64]
    assert torch.equal(warm[0, 64:], cold(decoder, [prompt])[0, 64:])


def test_a_prompt_that_is_exactly_a_cached_prefix(decoder):
    model = runtime(decoder, fresh_cache())
    long = tokens(300, 6)
    model.prefill([long], [0])
    for n in (128, 192):  # whole blocks, cached: the last one is computed again (its last token's logits are the result)
        warm = model.prefill([long[:n]], [1], all_logits=True)
        assert model.last_prefix_hits == [n - BLOCK]
        assert torch.equal(warm[0, n - BLOCK :], cold(decoder, [long[:n]])[0, n - BLOCK :])
    first = model.prefill([long[:1]], [0])  # shorter than a block: nothing to serve
    assert model.last_prefix_hits == [0]
    assert torch.equal(first, runtime(decoder, fresh_cache()).prefill([long[:1]], [0]))


def test_rows_with_different_hits_in_one_call(decoder):
    other = tokens(150, 7)
    model = runtime(decoder, fresh_cache())
    model.prefill([A], [0])
    warm = model.prefill([B, other], [0, 1], all_logits=True)
    assert model.last_prefix_hits == [192, 0]
    reference = cold(decoder, [B, other])
    assert torch.equal(warm[0, 192 : len(B)], reference[0, 192 : len(B)])
    assert torch.equal(warm[1, : len(other)], reference[1, : len(other)])


def test_a_changed_token_inside_the_prefix_misses(decoder):
    model = runtime(decoder, fresh_cache())
    model.prefill([A], [0])
    for position, hit in ((10, 0), (130, 128)):
        changed = list(B)
        changed[position] = (changed[position] + 1) % 512
        warm = model.prefill([changed], [0], all_logits=True)
        assert model.last_prefix_hits == [hit]
        assert torch.equal(warm[0, hit:], cold(decoder, [changed])[0, hit:])


def test_a_hash_collision_misses(decoder, monkeypatch):
    monkeypatch.setattr(prefix_cache, "block_hash", lambda parent, block: b"\0" * 16)  # every block: the same key
    model = runtime(decoder, fresh_cache())
    model.prefill([A], [0])
    assert len(model.prefix_cache) == 1  # one key: each block replaced the one before
    other = tokens(250, 8)
    for prompt in (other, A):  # the one key's entry holds another prefix's block each time
        warm = model.prefill([prompt], [0], all_logits=True)
        assert model.last_prefix_hits == [0]
        assert torch.equal(warm[0], cold(decoder, [prompt])[0, : len(prompt)])


def test_eviction_under_a_small_budget(decoder):
    per_block = snapshot_bytes(decoder.config, BLOCK, 4) + 4 * 4 * BLOCK  # states + the longest prefix's tokens
    cache = PrefixCache(block_size=BLOCK, budget_bytes=2 * per_block)
    model = runtime(decoder, cache)
    long = tokens(4 * BLOCK + 10, 9)
    model.prefill([long], [0])
    assert len(cache) == 2 and cache.nbytes <= cache.budget_bytes and cache.evictions == 2
    prompt = long[: 4 * BLOCK] + tokens(30, 10)
    warm = model.prefill([prompt], [1], all_logits=True)
    assert model.last_prefix_hits == [2 * BLOCK]  # the chain's first blocks were kept, its last ones evicted
    assert torch.equal(warm[0, 2 * BLOCK :], cold(decoder, [prompt])[0, 2 * BLOCK :])
    assert cache.nbytes <= cache.budget_bytes


def test_two_concurrent_requests_sharing_a_prefix(decoder):
    cache = fresh_cache()
    prompts = [PREFIX + tokens(40, 11), PREFIX + tokens(60, 12)]
    expected = [runtime(decoder, batch_size=1).generate([p], max_new_tokens=6)[0] for p in prompts]
    models = [runtime(decoder, cache, batch_size=1) for _ in prompts]
    start, results, errors = threading.Barrier(2), [None, None], []

    def request(i):
        try:
            start.wait()
            results[i] = models[i].generate([prompts[i]], max_new_tokens=6)[0]
            results[i] = (results[i], models[i].generate([prompts[i]], max_new_tokens=6)[0], models[i].last_prefix_hits)
        except Exception as error:  # noqa: BLE001 (reported below, in the test's thread)
            errors.append(error)

    threads = [threading.Thread(target=request, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for (first, second, hits), want, hit in zip(results, expected, (192, 256)):
        assert first == want and second == want
        assert hits == [hit]  # the second request of each thread finds the shared prefix (and its own full blocks)
    assert len(cache) == 3 + 1  # the prefix's 3 blocks once, and the 4th block of the longer prompt


def test_the_cache_serves_one_model():
    cache = fresh_cache()
    Qwen35Runtime.from_pretrained(FIXTURES / "tiny-2b", max_length=MAX_LENGTH, prefix_cache=cache)
    with pytest.raises(UsageError, match="another model"):
        Qwen35Runtime.from_pretrained(FIXTURES / "tiny-2b", max_length=MAX_LENGTH, prefix_cache=cache)


def test_bad_settings_are_refused(decoder):
    with pytest.raises(UsageError, match="multiple of"):
        PrefixCache(block_size=100)
    with pytest.raises(UsageError, match="largest context bucket"):
        Qwen35Runtime.from_decoder(decoder, max_length=MAX_LENGTH, buckets=[64], prefix_cache=PrefixCache(128))
    with pytest.raises(UsageError, match="PrefixCache or None"):
        runtime(decoder, cache=True)


def test_a_runner_without_continuing_context_graphs_is_refused(decoder):
    class Programs:  # a runner with no prefix_cache_owner, as a cpu export's ExportedGraphs
        pass

    model = Qwen35Runtime(Programs(), decoder.config, max_length=MAX_LENGTH)
    with pytest.raises(IncompatibleExportError, match="continue a sequence"):
        model.set_prefix_cache(fresh_cache())


def test_the_continuing_programs_an_export_compiles_for_its_block_size():
    """What a cpu export adds for its prefix cache (export/compile.py): one program per (context bucket, key length)
    of a resumed piece whose key length exceeds its bucket; the export's buckets (from 128) and block sizes."""
    from optimum_qwen35.runtime.buckets import default_buckets

    def programs(max_length):
        buckets = default_buckets(max_length, smallest=128)
        block = prefix_cache.export_block_size(max_length)
        return block, prefix_cache.continuing_graphs(buckets, buckets, max_length, block)

    assert programs(128) == (64, [])  # [64, 128) runs the 128-token program over 128 positions: the fresh one
    assert programs(256) == (64, [(128, 256)])
    block, pairs = programs(4096)
    assert block == 256 and len(pairs) == 8 and {T for T, _ in pairs} == {128, 256}
    assert prefix_cache.export_block_size(64) is None
    # A piece's graph depends on the piece alone: the first piece is fresh, a continuing one reads its end's bucket.
    assert prefix_cache.piece_graph(0, 64, [128, 256], [128, 256]) == (128, None)
    assert prefix_cache.piece_graph(128, 150, [128, 256], [128, 256]) == (128, 256)
    assert prefix_cache.piece_graph(64, 128, [128, 256], [128, 256]) == (128, 128)
