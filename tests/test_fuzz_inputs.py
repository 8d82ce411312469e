"""Fuzzing the Python entry points (issue 11): random prompts, ids, lengths, batch sizes, slots and counts.

Each call either returns what the single-prompt run returns, or raises this package's error; never another
exception, never a hang (each call runs under a timer). The test also keeps its own rule of which inputs
are valid, so a valid input that is refused fails too. fp64, so that batched and single runs agree to
rounding and greedy ties cannot flip. Derandomized: the same 50 examples on every run (10 to 20 s here).
`run_tensor_parallel` runs at TP = 1 (in process); TP = 2 applies the same checks before any process starts
(tests/test_bad_input.py), and a valid TP = 2 run equals TP = 1 (tests/test_tensor_parallel.py).
"""

from __future__ import annotations

import signal
from contextlib import contextmanager

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from optimum_qwen35.errors import Qwen35Error  # noqa: E402
from optimum_qwen35.runtime import Qwen35Runtime
from optimum_qwen35.runtime.eager import load_decoder  # noqa: E402
from tests.kit.tp import run_tensor_parallel  # noqa: E402
from tests.kit import build_tiny_checkpoint  # noqa: E402

VOCAB, MAX_LENGTH, BUCKETS, MAX_NEW = 512, 24, [4, 8, 16, 24], 4
CALL_TIMEOUT_S = 60  # generous: the machine is shared; a normal call takes well under a second


@pytest.fixture(scope="module")
def fuzz_models(tmp_path_factory):
    """Models of batch size 1, 2, 3 and a separate batch-1 reference, all on one fp64 decoder."""
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("fuzz") / "ckpt", "tiny-nv2x", seed=4)
    decoder = load_decoder(path, torch.float64)
    models = {b: Qwen35Runtime.from_decoder(decoder, batch_size=b, max_length=MAX_LENGTH, buckets=BUCKETS) for b in (1, 2, 3)}
    models["ref"] = Qwen35Runtime.from_decoder(decoder, batch_size=1, max_length=MAX_LENGTH, buckets=BUCKETS)
    models["cache"], models["path"] = {}, path
    return models


def reference(models, prompt):
    """The single-prompt run: fp64 logits at every position, and greedy tokens (no EOS) up to MAX_NEW or
    max_length."""
    cache, ref = models["cache"], models["ref"]
    key = tuple(prompt)
    if key not in cache:
        all_logits = ref.prefill([prompt], [0], all_logits=True)[0, : len(prompt)]
        n = min(MAX_NEW, MAX_LENGTH - len(prompt))
        cache[key] = (all_logits, ref.generate([prompt], n)[0] if n >= 1 else [])
    return cache[key]


@contextmanager
def time_limit(seconds):
    def expired(signum, frame):
        raise TimeoutError(f"call did not return within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ------------------------------------------------------------------------------------------ inputs
BAD_IDS = [-5, -1, VOCAB, 10**6, 1.9, 2.0, True, None, "7", torch.tensor(1.0)]
BAD_COUNTS = [0, -1, 2.0, None, True, "3"]


def weighted(*pairs):
    """Draw from each strategy with the given weight (st.one_of would pick each alike)."""
    return st.sampled_from([strategy for weight, strategy in pairs for _ in range(weight)]).flatmap(lambda s: s)


good_id = st.integers(0, VOCAB - 1)
good_prompt = st.lists(good_id, min_size=1, max_size=MAX_LENGTH - MAX_NEW)
# A valid prompt with exactly one bad id: catches a check that is off by one or lets one kind through.
EDGE_IDS = [-1, VOCAB, 1.9, True]  # the values a boundary check gets wrong first
near_miss = st.tuples(good_prompt, st.integers(0, MAX_LENGTH), st.sampled_from(EDGE_IDS)).map(
    lambda t: t[0][: t[1] % len(t[0])] + [t[2]] + t[0][t[1] % len(t[0]) + 1 :]
)
any_prompt = weighted(
    (10, good_prompt),
    (3, near_miss),
    (1, st.lists(weighted((3, good_id), (1, st.sampled_from(BAD_IDS))), min_size=0, max_size=MAX_LENGTH + 3)),
    (1, good_prompt.map(tuple)),
    (1, good_prompt.map(lambda p: torch.tensor(p))),
)
prompts_st = st.lists(any_prompt, min_size=0, max_size=4)
count = weighted((4, st.integers(1, MAX_NEW)), (1, st.sampled_from(BAD_COUNTS)))
eos_st = st.one_of(st.none(), good_id, st.lists(good_id, max_size=2), st.sampled_from([1.5, "x"]))


def is_id(t) -> bool:
    return type(t) is int and 0 <= t < VOCAB


def as_list(p):
    return p.tolist() if isinstance(p, torch.Tensor) else list(p) if isinstance(p, (list, tuple)) else p


def valid_prompt(p) -> bool:
    p = as_list(p)
    return isinstance(p, list) and 1 <= len(p) <= BUCKETS[-1] and all(is_id(t) for t in p)


def valid_count(n) -> bool:
    return type(n) is int and n >= 1


def valid_eos(eos) -> bool:
    return eos is None or is_id(eos) or (isinstance(eos, list) and all(is_id(t) for t in eos))


def call(fn):
    """(result, None) or (None, the package error); any other exception or a timeout fails the test."""
    with time_limit(CALL_TIMEOUT_S):
        try:
            result = fn()
        except Qwen35Error as error:
            event(f"refused: {type(error).__name__}")
            return None, error
    event("returned")
    return result, None


# ------------------------------------------------------------------------------------------ the test
@settings(max_examples=50, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(
    op=st.sampled_from(["generate", "logits", "prefill+decode", "run_tensor_parallel"]),
    batch_size=st.sampled_from([1, 2, 3]),
    prompts=prompts_st,
    n=count,
    eos=eos_st,
    slots=st.one_of(st.permutations([0, 1, 2]), st.lists(st.one_of(st.integers(-1, 3), st.just(0.0)), max_size=4)),
)
def test_entry_points_return_the_single_prompt_result_or_a_package_error(fuzz_models, op, batch_size, prompts, n, eos, slots):
    model = fuzz_models[batch_size]
    prompt_ok = all(valid_prompt(p) for p in prompts)
    lists = [as_list(p) for p in prompts] if prompt_ok else None

    if op == "generate":
        ok = prompt_ok and valid_count(n) and valid_eos(eos) and all(len(p) + n <= MAX_LENGTH for p in lists)
        result, error = call(lambda: model.generate(prompts, max_new_tokens=n, eos_token_id=eos))
        assert (error is None) == ok, f"valid={ok} but got {error!r}"
        if ok:
            stop = {eos} if isinstance(eos, int) else set(eos or ())
            for got, p in zip(result, lists, strict=True):
                expected = reference(fuzz_models, p)[1][:n]
                cut = next((i + 1 for i, t in enumerate(expected) if t in stop), len(expected))
                assert got == expected[:cut], (p, n, eos)

    elif op == "run_tensor_parallel":  # TP = 1 (in process); TP = 2 checks the same way before spawning
        ok = prompt_ok and len(prompts) >= 1 and valid_count(n) and all(len(p) + n <= MAX_LENGTH for p in lists)
        result, error = call(lambda: run_tensor_parallel(fuzz_models["path"], 1, prompts, n, torch.float64, MAX_LENGTH))
        assert (error is None) == ok, f"valid={ok} but got {error!r}"
        if ok:
            assert result.tokens.tolist() == [reference(fuzz_models, p)[1][:n] for p in lists]
            for got, p in zip(result.prefill_logits, lists, strict=True):
                torch.testing.assert_close(got, reference(fuzz_models, p)[0], atol=1e-9, rtol=0)

    elif op == "logits":
        result, error = call(lambda: model.logits(prompts))
        assert (error is None) == prompt_ok, f"valid={prompt_ok} but got {error!r}"
        if prompt_ok:
            assert len(result) == len(lists)
            for got, p in zip(result, lists):
                # logits() returns fp32: the fp64 reference rounded to fp32.
                torch.testing.assert_close(got, reference(fuzz_models, p)[0].float(), atol=1e-5, rtol=0)

    else:
        slots = list(slots)[: len(prompts)] if all(type(s) is int for s in slots) and len(slots) == 3 else slots
        slots_ok = (
            all(type(s) is int for s in slots)
            and len(set(slots)) == len(slots)
            and all(0 <= s < batch_size for s in slots)
        )
        ok = prompt_ok and slots_ok and len(prompts) == len(slots) >= 1
        result, error = call(lambda: model.prefill(prompts, slots))
        assert (error is None) == ok, f"valid={ok} but got {error!r}"
        if ok:
            last = torch.stack([reference(fuzz_models, p)[0][-1] for p in lists])
            torch.testing.assert_close(result, last, atol=1e-9, rtol=0)
            # One decode step per slot, fed its own greedy token, matches the single-prompt run's next logits.
            tokens, positions = last.argmax(-1).tolist(), [len(p) for p in lists]
            fits = [pos < MAX_LENGTH for pos in positions]
            result, error = call(lambda: model.decode(tokens, positions, slots))
            assert (error is None) == all(fits), error
            if error is None:
                ref = fuzz_models["ref"]
                for i, p in enumerate(lists):
                    ref.prefill([p], [0])
                    torch.testing.assert_close(
                        result[i], ref.decode([tokens[i]], [positions[i]], [0])[0], atol=1e-9, rtol=0
                    )
