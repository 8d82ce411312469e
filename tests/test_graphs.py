"""The graphs as Neuron would trace them: ranks, traced = eager, slots, padding, short prompts, errors."""

import pytest
import torch

from optimum_qwen35.modeling import attention
from optimum_qwen35.modeling.decoder import ContextEncodingGraph, TokenGenerationGraph
from optimum_qwen35.runtime import Qwen35Runtime
from optimum_qwen35.runtime.eager import load_decoder

from .conftest import FIXTURES

LAYOUT = FIXTURES / "tiny-nv2x"


def random_prompt(length, seed):
    return torch.randint(0, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def tensor_ranks(graph):
    ranks = []
    for node in graph.nodes():
        for value in node.outputs():
            t = value.type()
            if isinstance(t, torch._C.TensorType) and t.dim() is not None:
                ranks.append((t.dim(), node.kind()))
    return ranks


@pytest.mark.parametrize("layout", ["tiny-2b", "tiny-nv3x"])
def test_traced_graphs_have_no_tensor_above_rank_4(layout):
    # The graphs as Neuron traces them: plain linears (prepacked ones are the CPU runtime's form).
    model = Qwen35Runtime.from_pretrained(FIXTURES / layout, batch_size=2, max_length=256, buckets=[128, 256],
                                              pack_weights=False)
    for kind, length, module in [
        ("context", 128, ContextEncodingGraph(model.decoder)),
        ("context", 128, ContextEncodingGraph(model.decoder, all_logits=True)),
        ("token", 1, TokenGenerationGraph(model.decoder)),
    ]:
        example = model.graphs._example_inputs(kind, length)
        n = len(model.state)  # the graphs update the state in place: each run gets its own copy
        fresh = lambda: (*example[:-n], *(t.clone() for t in example[-n:]))  # noqa: E731
        with torch.no_grad():
            traced = torch.jit.trace(module, fresh(), check_trace=False)
            eager_out, traced_out = module(*fresh()), traced(*fresh())
        ranks = tensor_ranks(traced.inlined_graph)
        assert len(ranks) > 100, "the traced graph should record the shapes of its tensors"
        too_high = sorted({(r, k) for r, k in ranks if r > 4})
        assert not too_high, f"{kind} graph has tensors of rank > 4: {too_high}"
        for a, b in zip(eager_out, traced_out):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_query_blocks_change_nothing(monkeypatch):
    prompt = random_prompt(100, 0)
    whole = Qwen35Runtime.from_pretrained(LAYOUT, max_length=128).logits([prompt])[0]
    monkeypatch.setattr(attention, "QUERY_BLOCK", 16)
    blocked = Qwen35Runtime.from_pretrained(LAYOUT, max_length=128).logits([prompt])[0]
    torch.testing.assert_close(blocked, whole, rtol=0, atol=1e-5)


def greedy_alone(prompt, steps):
    model = Qwen35Runtime.from_pretrained(LAYOUT, batch_size=1, max_length=256)
    logits = [model.prefill([prompt], [0])[0]]
    tokens = [int(logits[-1].argmax())]
    for i in range(steps - 1):
        logits.append(model.decode([tokens[-1]], [len(prompt) + i], [0])[0])
        tokens.append(int(logits[-1].argmax()))
    return torch.stack(logits), tokens


def test_continuous_batching_sequences_join_and_leave():
    """Three slots; sequences start at different steps, one slot is reused: each matches its solo run.

    Through traced graphs of the static batch of 3: rows without a sequence are inactive (seq_id -1)."""
    prompts = {"a": random_prompt(40, 1), "b": random_prompt(7, 2), "c": random_prompt(90, 3), "d": random_prompt(2, 4)}
    solo = {name: greedy_alone(p, 12) for name, p in prompts.items()}
    model = Qwen35Runtime.from_pretrained(LAYOUT, batch_size=3, max_length=256, trace=True)

    running = {}  # slot -> [name, step, position, last token]

    def start(name, slot):
        logits = model.prefill([prompts[name]], [slot])[0]
        torch.testing.assert_close(logits, solo[name][0][0], rtol=0, atol=1e-5)
        running[slot] = [name, 1, len(prompts[name]), int(logits.argmax())]

    def step_all():
        slots = sorted(running)
        logits = model.decode([running[s][3] for s in slots], [running[s][2] for s in slots], slots)
        for row, s in enumerate(slots):
            name, step, pos, _ = running[s]
            torch.testing.assert_close(logits[row], solo[name][0][step], rtol=0, atol=1e-5)
            running[s] = [name, step + 1, pos + 1, int(logits[row].argmax())]
            assert running[s][3] == solo[name][1][step]

    start("a", 0)
    step_all()
    start("b", 2)  # joins while "a" is running
    step_all()
    step_all()
    start("c", 1)  # joins a third slot mid-flight
    for _ in range(4):
        step_all()
    del running[2]  # "b" leaves; its slot is reused by a new prompt
    start("d", 2)
    for _ in range(3):
        step_all()


def test_prefill_touches_only_its_slots_and_padding_changes_nothing():
    prompt = random_prompt(20, 5)
    model = Qwen35Runtime.from_pretrained(LAYOUT, batch_size=3, max_length=256, buckets=[32, 256])
    model.prefill([random_prompt(30, 6), random_prompt(9, 7)], [0, 2])
    before = [t.clone() for t in model.state]
    model.prefill([prompt], [1])  # bucket 32
    in_small_bucket = [t[1].clone() for t in model.state]
    for spec, old, new in zip(model.graphs.state_specs, before, model.state):
        assert torch.equal(old[0], new[0]) and torch.equal(old[2], new[2]), f"{spec.name}: another slot changed"

    # The same prompt in a longer bucket, padded with another token id, leaves the same state in its slot.
    T = 256
    ids = torch.full((3, T), 333, dtype=torch.int32)
    ids[0, : len(prompt)] = torch.tensor(prompt, dtype=torch.int32)
    mask = torch.zeros(3, T, dtype=torch.int32)
    mask[0, : len(prompt)] = 1
    positions = torch.arange(T, dtype=torch.int32).expand(3, T).contiguous()  # padding positions too: ignored
    seq_ids = torch.tensor([1, -1, -1], dtype=torch.int32)
    state = [t.clone() for t in model.state]
    with torch.no_grad():
        out = model.decoder.context_encoding(ids, mask, positions, seq_ids, *state)
    assert all(a is b for a, b in zip(out[1:], state)), "the graph returns the state it updated in place"
    for spec, small, big, old in zip(model.graphs.state_specs, in_small_bucket, out[1:], model.state):
        torch.testing.assert_close(big[1], small, rtol=0, atol=1e-6, msg=spec.name)
        assert torch.equal(big[0], old[0]) and torch.equal(big[2], old[2]), f"{spec.name}: an inactive row wrote"
        if "cache" in spec.name:  # nothing is written past the prompt
            assert not big[1][:, len(prompt) :].any(), spec.name


def test_slots_must_be_distinct_and_in_range():
    model = Qwen35Runtime.from_pretrained(LAYOUT, batch_size=2, max_length=64)
    for bad in ([0, 0], [2], [-1]):
        with pytest.raises(ValueError, match=r"slots must be distinct and in \[0, 2\)"):
            model.prefill([[1, 2]] * len(bad), bad)
        with pytest.raises(ValueError, match=r"slots must be distinct and in \[0, 2\)"):
            model.decode([1] * len(bad), [3] * len(bad), bad)


def test_graphs_export_without_data_dependent_control_flow():
    """torch.export fails on any Python branch on tensor values inside the graphs (a static-shape check
    stronger than tracing): both graphs must export, and the exported programs must match eager."""
    # The graphs as Neuron traces them: plain linears (prepacked ones are the CPU runtime's form).
    model = Qwen35Runtime.from_pretrained(FIXTURES / "tiny-nv3x", batch_size=2, max_length=128, buckets=[64, 128],
                                              pack_weights=False)
    for kind, length, module in [
        ("context", 64, ContextEncodingGraph(model.decoder)),
        ("token", 1, TokenGenerationGraph(model.decoder)),
    ]:
        example = list(model.graphs._example_inputs(kind, length))
        example[-len(model.state) - 1] = torch.tensor([1, -1], dtype=torch.int32)  # seq_ids: one inactive row
        example = tuple(example)
        n = len(model.state)  # the graphs update the state in place: each run gets its own copy
        fresh = lambda: (*example[:-n], *(t.clone() for t in example[-n:]))  # noqa: E731
        with torch.no_grad():
            exported = torch.export.export(module, fresh(), strict=False)
            for a, b in zip(module(*fresh()), exported.module()(*fresh())):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("length", [1, 2, 3, 4])
def test_short_prompts_then_decode_match_one_long_prefill(length):
    """Prompts shorter than the conv kernel: the decode steps that follow must see the right conv state."""
    sequence = random_prompt(12, 8)
    full = Qwen35Runtime.from_pretrained(LAYOUT, max_length=64).logits([sequence])[0]
    model = Qwen35Runtime.from_pretrained(LAYOUT, max_length=64)
    got = [model.prefill([sequence[:length]], [0])[0]]
    for pos in range(length, len(sequence)):
        got.append(model.decode([sequence[pos]], [pos], [0])[0])
    torch.testing.assert_close(torch.stack(got), full[length - 1 :], rtol=0, atol=1e-5)


def test_clear_errors():
    model = Qwen35Runtime.from_pretrained(LAYOUT, batch_size=2, max_length=64, buckets=[32, 64])
    with pytest.raises(ValueError, match="prompt of 65 tokens is longer than the model's max_length \\(64\\)"):
        model.generate([random_prompt(65, 0)], max_new_tokens=1)
    with pytest.raises(ValueError, match=r"exceeds max_length 64 \(room for 4 new tokens\); lower max_new_tokens"):
        model.generate([random_prompt(60, 0)], max_new_tokens=8)
    with pytest.raises(ValueError, match="empty prompt"):
        model.prefill([[]], [0])
    with pytest.raises(ValueError, match="past max_length"):
        model.decode([1], [64], [0])
    with pytest.raises(ValueError, match="bucket 128 is longer than max_length 64"):
        Qwen35Runtime.from_decoder(load_decoder(LAYOUT), max_length=64, buckets=[128])
