"""Differential scenario tests of the runtime's edges (issue 22): buckets, chunks, key buckets, slots, EOS.

Hypothesis draws whole scenarios: a model shape (batch size, max_length, context buckets), then a few operations on
its slots: prefills of fresh prompts and continuations (`starts`) whose ends fall on, just before or just after
every context bucket, chunked-prefill split, DeltaNet chunk (64) and decode key bucket, in batches where the rows
need different numbers of chunks; decode steps that cross key buckets; sequences leaving their slots and new ones
joining; a last decode step of every live slot. Every logits row the runtime returns (each position of an
`all_logits` prefill, a last-token prefill, each decode step) is held to the float64 oracle (tests/oracle.py) of
that slot's sequence at that position, so a wrong key length, a skipped or repeated block or a reset slot shows up
at the position where it happens, whatever the greedy tokens do. Tolerance: fp32 against float64, 1e-4 (the worst
of the CI examples: 5.9e-5).

A second test runs `generate` on drawn prompts (more than the batch: waves) with several EOS ids: each row's tokens
must be the run without EOS cut after the first token of the EOS set, and every token must be the oracle's argmax
of the sequence so far (within the fp32 tolerance, so that a near-tie may go either way).

CI runs a fixed seed and a bounded number of examples (`EXAMPLES`); `pytest --deep` runs `DEEP_EXAMPLES` on every
fixture layout (before a release). The optimum class runs the same kind of scenarios through its compiled graphs in
tests/optimum_neuron/test_scenarios_optimum.py.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from optimum_qwen35.runtime import Qwen35Runtime
from optimum_qwen35.runtime.buckets import default_buckets, default_key_buckets
from optimum_qwen35.runtime.eager import load_decoder  # noqa: E402

from . import oracle  # noqa: E402
from .conftest import FIXTURES  # noqa: E402

SEED = 22  # the CI examples: the same on every run
EXAMPLES, DEEP_EXAMPLES = 30, 600
GENERATE_EXAMPLES, DEEP_GENERATE_EXAMPLES = 10, 200
ATOL = 1e-4  # fp32 model against the float64 oracle, every position (worst measured over the CI examples: 5.9e-5)
DELTANET_CHUNK = 64  # the chunked delta rule's chunk (its edges matter inside a block)

# (batch size, max_length, context buckets or None for the defaults). The first splits prompts longer than 48
# tokens into chunks (blocks of 16 or 48); the second has the default buckets (64, 128, 200: no chunking), so its
# blocks hold one, two or more DeltaNet chunks; the third chunks at 64, the DeltaNet chunk. Key buckets are the
# defaults: 64, 96, 128, then 160 / 192, 200 / 136.
SHAPES = {
    "b3-L160-buckets16,48": (3, 160, [16, 48]),
    "b2-L200-default": (2, 200, None),
    "b3-L136-buckets64": (3, 136, [64]),
}
CI_LAYOUTS = ("tiny-nv3x",)  # GQA in both mixers, nv = 3 nk, dk != dv, untied lm_head
DEEP_LAYOUTS = ("tiny-2b", "tiny-nv2x", "tiny-nv3x")


def edges(shape: str) -> list[int]:
    """Every length where the runtime changes what it does: context buckets, chunked-prefill splits (multiples of the
    largest bucket), DeltaNet chunks, decode key buckets, and the conv width's small prompts."""
    _, max_length, buckets = SHAPES[shape]
    buckets = buckets or default_buckets(max_length)
    found = {1, 2, 3, 4} | set(buckets) | set(default_key_buckets(max_length))
    found |= set(range(buckets[-1], max_length + 1, buckets[-1])) | set(range(DELTANET_CHUNK, max_length + 1, DELTANET_CHUNK))
    return sorted(found)


@st.composite
def position_near_an_edge(draw, shape: str | list[int], low: int, high: int) -> int:
    """A position in [low, high]: mostly an edge (of a shape of SHAPES, or given) or one off it, sometimes anywhere."""
    near = sorted({e + d for e in (edges(shape) if isinstance(shape, str) else shape) for d in (-1, 0, 1)})
    near = [p for p in near if low <= p <= high] + [high]  # the limit (max_length, or what leaves room) is an edge too
    if near and draw(st.integers(0, 3)):
        return draw(st.sampled_from(near))
    return draw(st.integers(low, high))


@dataclass
class Scenario:
    layout: str
    shape: str
    ops: list = field(default_factory=list)  # ("prefill", [(slot, start, length)], all_logits) | ("decode", slots, steps) | ("leave", slot)
    token_seed: int = 0

    def __repr__(self):  # what hypothesis prints for a failing example
        lines = [f"Scenario(layout={self.layout!r}, shape={self.shape!r}, token_seed={self.token_seed},"]
        lines += [f"    {op}," for op in self.ops]
        return "\n".join(lines) + ")"


def draw_operations(draw, batch_size: int, max_length: int, kinds: list[str], draw_prefill) -> list:
    """Up to four operations on `batch_size` slots of `max_length` tokens, each of `kinds`: "decode" (some live slots,
    1-3 steps), "leave" (a live slot ends), else `draw_prefill(draw, lengths)` (it sets the lengths of the slots it
    fills and returns the prefill operation); then one decode of every live slot (a slot reset on the way shows
    there). `lengths[s]`: tokens encoded in slot s, None for a free slot."""
    lengths: list[int | None] = [None] * batch_size
    ops = []
    for _ in range(draw(st.integers(1, 4))):
        live = [s for s in range(batch_size) if lengths[s] is not None and lengths[s] < max_length]
        kind = draw(st.sampled_from(kinds))
        if kind == "decode" and live:
            slots = draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live), unique=True))
            steps = min([draw(st.integers(1, 3))] + [max_length - lengths[s] for s in slots])
            for s in slots:
                lengths[s] += steps
            ops.append(("decode", slots, steps))
        elif kind == "leave" and live:
            slot = draw(st.sampled_from(live))
            lengths[slot] = None
            ops.append(("leave", slot))
        else:
            ops.append(draw_prefill(draw, lengths))
    live = [s for s in range(batch_size) if lengths[s] is not None and lengths[s] < max_length]
    if live:
        ops.append(("decode", live, 1))
    return ops


@st.composite
def scenarios(draw, layouts) -> Scenario:
    layout = draw(st.sampled_from(layouts))
    shape = draw(st.sampled_from(sorted(SHAPES)))
    batch_size, max_length, _ = SHAPES[shape]

    def prefill(draw, lengths):
        rows = []
        for slot in draw(st.lists(st.integers(0, batch_size - 1), min_size=1, max_size=batch_size, unique=True)):
            can_continue = lengths[slot] is not None and lengths[slot] < max_length
            start = lengths[slot] if can_continue and draw(st.booleans()) else 0
            end = draw(position_near_an_edge(shape, start + 1, max_length))  # max_length: no room for a decode
            rows.append((slot, start, end - start))
            lengths[slot] = end
        return ("prefill", rows, draw(st.booleans()))

    ops = draw_operations(draw, batch_size, max_length, ["prefill", "prefill", "decode", "leave"], prefill)
    return Scenario(layout, shape, ops, draw(st.integers(0, 2**16)))


@pytest.fixture(scope="module")
def decoders():
    """fp32 decoders of the fixture layouts, loaded once and shared by every model built on them."""
    return {layout: load_decoder(FIXTURES / layout) for layout in DEEP_LAYOUTS}


@pytest.fixture(scope="module")
def weights():
    """The oracle's float64 weights of each layout."""
    return {layout: oracle.read_text_weights(FIXTURES / layout) for layout in DEEP_LAYOUTS}


def run_scenario(model: Qwen35Runtime, scenario: Scenario, vocab: int):
    """Run the operations; returns (the token sequence of each slot life, [(life, position, logits, what)])."""
    rng = random.Random(scenario.token_seed)
    lives: list[list[int]] = []
    current: dict[int, int] = {}  # slot -> its life
    seen = []
    for op in scenario.ops:
        if op[0] == "prefill":
            _, rows, all_logits = op
            prompts = [[rng.randrange(vocab) for _ in range(n)] for _, _, n in rows]
            slots, starts = [s for s, _, _ in rows], [start for _, start, _ in rows]
            out = model.prefill(prompts, slots, all_logits=all_logits, starts=starts)
            for row, ((slot, start, n), prompt) in enumerate(zip(rows, prompts)):
                if start == 0:
                    current[slot] = len(lives)
                    lives.append([])
                life = current[slot]
                assert len(lives[life]) == start
                lives[life] += prompt
                what = f"prefill {op} row {row} (slot {slot})"
                if all_logits:
                    seen += [(life, start + t, out[row, t], what) for t in range(n)]
                else:
                    seen.append((life, start + n - 1, out[row], what))
        elif op[0] == "decode":
            _, slots, steps = op
            for step in range(steps):
                tokens = [rng.randrange(vocab) for _ in slots]
                positions = [len(lives[current[s]]) for s in slots]
                out = model.decode(tokens, positions, slots)
                for row, (slot, token, position) in enumerate(zip(slots, tokens, positions)):
                    lives[current[slot]].append(token)
                    seen.append((current[slot], position, out[row], f"decode {op} step {step} (slot {slot}, position {position})"))
        else:
            current.pop(op[1])
    return lives, seen


def check_against_oracle(weights, lives, seen):
    want = [oracle.logits(weights, tokens) for tokens in lives]
    worst = max(seen, key=lambda s: (s[2].double() - want[s[0]][s[1]]).abs().max().item())
    life, position, got, what = worst
    diff = (got.double() - want[life][position]).abs().max().item()
    assert diff <= ATOL, f"{what}: |model - oracle| {diff:.3e} at position {position} of a {len(lives[life])}-token sequence"
    return diff


def test_scenarios_match_the_oracle_at_every_position(decoders, weights, deep):
    """Drawn scenarios (module docstring): every logits row within 1e-4 of the float64 oracle."""
    worst = []

    @settings(
        max_examples=DEEP_EXAMPLES if deep else EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )
    @seed(SEED)
    @given(scenarios(DEEP_LAYOUTS if deep else CI_LAYOUTS))
    def check(scenario):
        batch_size, max_length, buckets = SHAPES[scenario.shape]
        decoder = decoders[scenario.layout]
        model = Qwen35Runtime.from_decoder(decoder, batch_size, max_length, buckets)  # fresh state; shares the weights
        lives, seen = run_scenario(model, scenario, decoder.config.vocab_size)
        worst.append(check_against_oracle(weights[scenario.layout], lives, seen))

    check()
    print(f"scenarios: {len(worst)} examples, worst |model - oracle| {max(worst):.2e}")


@st.composite
def generate_cases(draw, layouts):
    layout = draw(st.sampled_from(layouts))
    shape = draw(st.sampled_from(sorted(SHAPES)))
    batch_size, max_length, _ = SHAPES[shape]
    max_new = draw(st.integers(1, 6))
    # The prompts end near an edge, so that the new tokens' positions cross it.
    lengths = draw(
        st.lists(position_near_an_edge(shape, 1, max_length - max_new), min_size=1, max_size=batch_size + 1)
    )
    picks = draw(st.lists(st.integers(0, 10**6), min_size=1, max_size=3))  # which generated tokens become EOS ids
    return layout, shape, lengths, max_new, picks, draw(st.integers(0, 2**16))


def test_generate_with_several_eos_ids_follows_the_oracle(decoders, weights, deep):
    """Greedy `generate` of drawn prompts (waves when there are more than the batch): the run without EOS is the
    oracle's argmax at every step; with a set of several EOS ids (some generated, one never), each row stops right
    after its first token of the set, whichever id of the set it is."""

    @settings(
        max_examples=DEEP_GENERATE_EXAMPLES if deep else GENERATE_EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )
    @seed(SEED)
    @given(generate_cases(DEEP_LAYOUTS if deep else CI_LAYOUTS))
    def check(case):
        layout, shape, lengths, max_new, picks, token_seed = case
        batch_size, max_length, buckets = SHAPES[shape]
        decoder = decoders[layout]
        vocab = decoder.config.vocab_size
        rng = random.Random(token_seed)
        prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
        model = Qwen35Runtime.from_decoder(decoder, batch_size, max_length, buckets)
        free = model.generate(prompts, max_new_tokens=max_new)
        for prompt, tokens in zip(prompts, free):
            assert len(tokens) == max_new
            want = oracle.logits(weights[layout], prompt + tokens[:-1])[len(prompt) - 1 :]
            chosen = want.gather(1, torch.tensor(tokens)[:, None])[:, 0]
            gap = (want.max(-1).values - chosen).max().item()
            assert gap <= 2 * ATOL, f"prompt of {len(prompt)}: a generated token is {gap:.2e} below the oracle's argmax"
        generated = [t for tokens in free for t in tokens]
        absent = next(t for t in range(vocab) if t not in generated)
        eos = [generated[p % len(generated)] for p in picks] + [absent]
        eos = list(dict.fromkeys(eos[::-1]))  # the never-generated id first: a loop reading only eos[0] fails
        stopped = model.generate(prompts, max_new_tokens=max_new, eos_token_id=eos)
        for tokens, got in zip(free, stopped):
            cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens) - 1)
            assert got == tokens[: cut + 1], f"eos {eos}: got {got}, want {tokens[: cut + 1]}"

    check()


@pytest.mark.parametrize("shape", sorted(SHAPES) + ["consecutive buckets"])
def test_each_block_runs_in_the_smallest_bucket_that_holds_it(decoders, shape):
    """The bucket choices themselves: the smallest context bucket holding a block (a longer block: the largest, which
    prefill splits it to), the smallest key bucket holding positions 0 .. n - 1. The scenario tests see a wrong
    choice that loses tokens; this sees one that only wastes work (a 64-token block run in the 128 bucket)."""
    batch_size, max_length, buckets = SHAPES.get(shape, (1, 64, [16, 17, 47, 48]))
    model = Qwen35Runtime.from_decoder(decoders["tiny-nv3x"], batch_size, max_length, buckets)
    for length in range(1, max_length + 40):
        want = min([b for b in model.buckets if b >= length] or [model.buckets[-1]])
        assert model.bucket_for(length) == want, (length, model.buckets)
    for length in range(1, max_length + 1):
        assert model.key_bucket_for(length) == min(b for b in model.key_buckets if b >= length), (length, model.key_buckets)


def test_default_buckets():
    """The default sizes docs/model.md gives: context buckets are powers of two from 64 and max_length; key buckets add
    the midpoints (at most 1.5x the positions a decode step needs); none repeated, none past max_length."""
    assert default_buckets(1000) == [64, 128, 256, 512, 1000]
    assert default_buckets(1024) == [64, 128, 256, 512, 1024]
    assert default_buckets(64) == [64] and default_buckets(40) == [40]
    assert default_key_buckets(1000) == [64, 96, 128, 192, 256, 384, 512, 768, 1000]
    assert default_key_buckets(768) == [64, 96, 128, 192, 256, 384, 512, 768]
    assert default_key_buckets(96) == [64, 96]
