"""The scenario tests of tests/test_scenarios.py through the optimum class and its compiled (cpu target) graphs.

An export of tiny-nv3x for batch size 2 and sequence length 256 has context buckets 128 and 256 and decode key
buckets 128 and 256. Hypothesis draws:
- slot scenarios through `prefill(input_ids, attention_mask, seq_ids)` / `decode(input_ids, position_ids, seq_ids)`:
  prompts ending on, before and after the bucket edges (and the DeltaNet chunk's, 64), decode steps crossing 128,
  sequences leaving their slot and new ones joining it, a last decode of every live slot; every logits row within
  1e-4 of the float64 oracle of that slot's sequence;
- `generate` on left- or right-padded batches (three rows: two waves) with several EOS ids (by keyword or in a
  GenerationConfig): each row's new tokens are the oracle's argmax at every step (within the fp32 tolerance) and
  stop right after the first token of the EOS set, padded with the config's pad id.
Fixed seed, bounded examples in CI; `pytest --deep` runs many more.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("optimum.neuron", reason="needs optimum-neuron (the nox `optimum` session)")
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM  # noqa: E402

from .. import oracle  # noqa: E402
from ..conftest import FIXTURES  # noqa: E402
from ..test_scenarios import (  # noqa: E402
    ATOL, SEED, Scenario, check_against_oracle, draw_operations, position_near_an_edge,
)

LAYOUT, BATCH_SIZE, SEQUENCE_LENGTH = "tiny-nv3x", 2, 256
EDGES = [1, 2, 3, 4, 64, 128, 192, 256]  # conv width, DeltaNet chunks (64, 192), context and key buckets (128, 256)
EXAMPLES, DEEP_EXAMPLES = 12, 300
GENERATE_EXAMPLES, DEEP_GENERATE_EXAMPLES = 6, 150


@pytest.fixture(scope="module")
def model(export_dir):
    return Qwen35NeuronModelForCausalLM.from_pretrained(
        export_dir(LAYOUT, 1, batch_size=BATCH_SIZE, sequence_length=SEQUENCE_LENGTH)
    )


@pytest.fixture(scope="module")
def weights():
    return oracle.read_text_weights(FIXTURES / LAYOUT)


def hypothesis_settings(examples: int):
    return settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck), print_blob=True)


@st.composite
def slot_scenarios(draw) -> Scenario:
    def prefill(draw, lengths):  # the compiled context graphs start fresh sequences only
        rows = []
        for slot in draw(st.lists(st.integers(0, BATCH_SIZE - 1), min_size=1, max_size=BATCH_SIZE, unique=True)):
            lengths[slot] = draw(position_near_an_edge(EDGES, 1, SEQUENCE_LENGTH))  # 256: the whole export
            rows.append((slot, 0, lengths[slot]))
        return ("prefill", rows, False)

    ops = draw_operations(draw, BATCH_SIZE, SEQUENCE_LENGTH, ["prefill", "decode", "decode", "leave"], prefill)
    return Scenario(LAYOUT, f"export b{BATCH_SIZE} s{SEQUENCE_LENGTH}", ops, draw(st.integers(0, 2**16)))


def run_through_the_class(model, scenario: Scenario, vocab: int):
    """`run_scenario` of tests/test_scenarios.py, through the optimum class's prefill / decode (torch inputs)."""
    rng = random.Random(scenario.token_seed)
    lives, current, seen = [], {}, []
    for op in scenario.ops:
        if op[0] == "prefill":
            rows = op[1]
            prompts = [[rng.randrange(vocab) for _ in range(n)] for _, _, n in rows]
            width = max(len(p) for p in prompts)
            ids = torch.zeros(len(prompts), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, p in enumerate(prompts):
                ids[row, : len(p)], mask[row, : len(p)] = torch.tensor(p), 1
            out = model.prefill(ids, mask, torch.tensor([s for s, _, _ in rows]))
            for row, ((slot, _, n), prompt) in enumerate(zip(rows, prompts)):
                current[slot] = len(lives)
                lives.append(list(prompt))
                seen.append((current[slot], n - 1, out[row], f"prefill {op} row {row} (slot {slot})"))
        elif op[0] == "decode":
            _, slots, steps = op
            for step in range(steps):
                tokens = [rng.randrange(vocab) for _ in slots]
                positions = [len(lives[current[s]]) for s in slots]
                out = model.decode(torch.tensor(tokens)[:, None], torch.tensor(positions)[:, None], torch.tensor(slots))
                for row, (slot, token, position) in enumerate(zip(slots, tokens, positions)):
                    lives[current[slot]].append(token)
                    seen.append((current[slot], position, out[row], f"decode {op} step {step} (slot {slot}, position {position})"))
        else:
            current.pop(op[1])
    return lives, seen


def test_slot_scenarios_through_prefill_and_decode(model, weights, deep):
    worst = []

    @hypothesis_settings(DEEP_EXAMPLES if deep else EXAMPLES)
    @seed(SEED)
    @given(slot_scenarios())
    def check(scenario):
        lives, seen = run_through_the_class(model, scenario, model.config.vocab_size)
        worst.append(check_against_oracle(weights, lives, seen))

    check()
    print(f"optimum slot scenarios: {len(worst)} examples, worst |model - oracle| {max(worst):.2e}")


@st.composite
def generate_cases(draw):
    max_new = draw(st.integers(1, 6))
    lengths = draw(st.lists(position_near_an_edge(EDGES, 1, SEQUENCE_LENGTH - max_new), min_size=1, max_size=BATCH_SIZE + 1))
    picks = draw(st.lists(st.integers(0, 10**6), min_size=1, max_size=3))
    return lengths, max_new, picks, draw(st.sampled_from(["left", "right"])), draw(st.booleans()), draw(st.integers(0, 2**16))


def padded(prompts, side):
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        span = slice(0, len(p)) if side == "right" else slice(width - len(p), width)
        ids[row, span], mask[row, span] = torch.tensor(p), 1
    return ids, mask


def test_generate_with_several_eos_ids(model, weights, deep):
    @hypothesis_settings(DEEP_GENERATE_EXAMPLES if deep else GENERATE_EXAMPLES)
    @seed(SEED)
    @given(generate_cases())
    def check(case):
        lengths, max_new, picks, side, as_config, token_seed = case
        vocab = model.config.vocab_size
        rng = random.Random(token_seed)
        prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
        ids, mask = padded(prompts, side)
        width = ids.shape[1]
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, eos_token_id=None)
        free = out[:, width:].tolist()
        for prompt, tokens in zip(prompts, free):
            want = oracle.logits(weights, prompt + tokens[:-1])[len(prompt) - 1 :]
            chosen = want.gather(1, torch.tensor(tokens)[:, None])[:, 0]
            gap = (want.max(-1).values - chosen).max().item()
            assert gap <= 2 * ATOL, f"prompt of {len(prompt)}: a generated token is {gap:.2e} below the oracle's argmax"
        generated = [t for tokens in free for t in tokens]
        absent = next(t for t in range(vocab) if t not in generated)
        eos = list(dict.fromkeys(([generated[p % len(generated)] for p in picks] + [absent])[::-1]))
        pad = model.generation_config.pad_token_id
        if as_config:  # a GenerationConfig holding the EOS list, as the fixtures' generation_config.json does
            config = GenerationConfig(do_sample=False, eos_token_id=eos, pad_token_id=pad, max_new_tokens=max_new)
            stopped = model.generate(ids, attention_mask=mask, generation_config=config)
        else:
            stopped = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, eos_token_id=eos)
        for row, tokens in enumerate(free):
            cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens) - 1)
            got = stopped[row, width:].tolist()
            want = tokens[: cut + 1] + [pad] * (len(got) - cut - 1)
            assert got == want, f"eos {eos}, row {row}: got {got}, want {want}"

    check()
