"""State updated in place, chunked prefill and decode buckets (issue 8, items 1-3).

Each test compares against a run that does not use the feature under test (one-shot prefill, the whole cache),
so a bug in the feature cannot hide behind itself.
"""

import pytest
import torch

from optimum_qwen35.modeling.decoder import TokenGenerationGraph
from optimum_qwen35.modeling.torch_layers import TorchLayers
from optimum_qwen35.runtime import Qwen35Runtime
from optimum_qwen35.runtime.eager import load_decoder

from .conftest import FIXTURES

ATOL = 1e-4  # fp32: chunked against one-shot prefill


def random_prompt(length, seed):
    return torch.randint(0, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def decoder():
    return load_decoder(FIXTURES / "tiny-nv3x")


def one_shot(decoder, prompt, max_length=512):
    model = Qwen35Runtime.from_decoder(decoder, batch_size=1, max_length=max_length, buckets=[max_length])
    return model.prefill([prompt], [0], all_logits=True)[0], model


@pytest.mark.parametrize("split", [1, 37, 64, 100, 128, 129])  # inside a 64-token chunk, on chunk and bucket edges
def test_prefill_continued_from_any_point_equals_one_shot(decoder, split):
    prompt = random_prompt(200, 0)
    whole, reference = one_shot(decoder, prompt)
    model = Qwen35Runtime.from_decoder(decoder, batch_size=2, max_length=512, buckets=[64, 128, 256])
    first = model.prefill([prompt[:split]], [1], all_logits=True)[0]
    second = model.prefill([prompt[split:]], [1], all_logits=True, starts=[split])[0]
    torch.testing.assert_close(torch.cat([first, second]), whole, rtol=0, atol=ATOL)
    # And the sequence goes on the same: greedy decode from the continued slot.
    tokens = [int(second[-1].argmax())]
    expected = [int(whole[-1].argmax())]
    for step in range(6):
        tokens.append(int(model.decode([tokens[-1]], [len(prompt) + step], [1])[0].argmax()))
        expected.append(int(reference.decode([expected[-1]], [len(prompt) + step], [0])[0].argmax()))
    assert tokens == expected


def test_prompt_of_four_largest_buckets_runs_in_chunks(decoder):
    prompt = random_prompt(4 * 64, 1)
    whole, _ = one_shot(decoder, prompt)
    model = Qwen35Runtime.from_decoder(decoder, batch_size=2, max_length=512, buckets=[32, 64])
    chunked = model.logits([prompt])[0]
    torch.testing.assert_close(chunked, whole, rtol=0, atol=ATOL)
    assert {key[1] for key in model.graphs._graphs if key[0] == "context"} == {64}, "no block larger than the largest bucket"
    fresh = Qwen35Runtime.from_decoder(decoder, batch_size=1, max_length=512, buckets=[256])
    assert model.generate([prompt], max_new_tokens=8) == fresh.generate([prompt], max_new_tokens=8)


def test_a_batch_mixing_fresh_and_continued_prompts(decoder):
    a, b = random_prompt(90, 2), random_prompt(50, 3)
    model = Qwen35Runtime.from_decoder(decoder, batch_size=2, max_length=512, buckets=[64, 128])
    model.prefill([a[:30]], [0])
    out = model.prefill([a[30:], b], [0, 1], all_logits=True, starts=[30, 0])
    torch.testing.assert_close(out[0, :60], one_shot(decoder, a)[0][30:], rtol=0, atol=ATOL)
    torch.testing.assert_close(out[1, :50], one_shot(decoder, b)[0], rtol=0, atol=ATOL)


@pytest.mark.parametrize("token_block", [3 * 64, 3 * 192])  # rows for 3 slots: 64 and 192 tokens (a shorter last block)
def test_token_blocks_change_nothing(token_block):
    """A block longer than the backend's token block runs through each layer in token blocks (DecoderLayer): the
    logits and every state as in one go, with a continued row, a fresh row ending mid-block and an idle slot."""
    a, b = random_prompt(300, 8), random_prompt(170, 9)
    runs = []
    for block in (None, token_block):
        decoder = load_decoder(FIXTURES / "tiny-nv3x")
        for layer in decoder.layers:
            layer.token_block = block
        model = Qwen35Runtime.from_decoder(decoder, batch_size=3, max_length=512, buckets=[64, 512])
        model.prefill([a[:37]], [2])
        out = model.prefill([a[37:], b], [2, 0], all_logits=True, starts=[37, 0])  # one 512-token block
        runs.append((out, model.state))
    (whole, whole_state), (blocked, blocked_state) = runs
    torch.testing.assert_close(blocked[0, :263], whole[0, :263], rtol=0, atol=ATOL)
    torch.testing.assert_close(blocked[1, :170], whole[1, :170], rtol=0, atol=ATOL)
    for x, y in zip(blocked_state, whole_state):
        torch.testing.assert_close(x, y, rtol=0, atol=ATOL)


def test_query_blocks_of_a_long_block_in_one_go():
    """Without token blocks (the Neuron layers trace a context block whole), attention runs a 1500-token block as two
    1024-query blocks: the logits equal those of the token-blocked CPU run."""
    from optimum_qwen35.modeling.torch_layers import TorchLayers

    class WholeBlocks(TorchLayers):
        token_block = None

    prompt = random_prompt(1500, 6)
    out = []
    for layers in (None, WholeBlocks()):
        model = Qwen35Runtime.from_decoder(load_decoder(FIXTURES / "tiny-nv3x", layers=layers), batch_size=1, max_length=1536,
                                  buckets=[1536])
        out.append(model.prefill([prompt], [0], all_logits=True)[0, :1500])
    torch.testing.assert_close(out[1], out[0], rtol=0, atol=ATOL)


def test_the_factorys_token_block_reaches_every_layer():
    """The layer factory's token block is what each layer uses: a 150-token prompt (padded to the 256-token bucket)
    over 64-token blocks runs the DeltaNet prefill four times per DeltaNet layer (counted in the kernel registry),
    a 64-token one once."""
    from optimum_qwen35.modeling.torch_layers import TorchLayers

    from .kit.kernel_calls import count_kernel_calls

    class SmallBlocks(TorchLayers):
        token_block = 64

    decoder = load_decoder(FIXTURES / "tiny-nv3x", layers=SmallBlocks())
    deltanet_layers = sum(not layer.is_attention for layer in decoder.layers)
    model = Qwen35Runtime.from_decoder(decoder, batch_size=1, max_length=256, buckets=[64, 256])
    for length, blocks in ((150, 4), (64, 1)):
        with count_kernel_calls("torch") as calls:
            model.prefill([random_prompt(length, 5)], [0])
        assert calls["torch", "deltanet_prefill"] == blocks * deltanet_layers


@pytest.mark.parametrize("batch, blocks", [(1, 1), (2, 2), (4, 4), (8, 4)])
def test_token_blocks_hold_a_number_of_rows(batch, blocks):
    """The factory's token block counts rows (batch x tokens): 256 rows run a 256-token bucket in one block at
    batch 1, two 128-token blocks at batch 2, four 64-token ones at batch 4, and never less than one delta-rule
    chunk (64 tokens) per block: four at batch 8 too (counted in the kernel registry)."""
    from optimum_qwen35.modeling.torch_layers import TorchLayers

    from .kit.kernel_calls import count_kernel_calls

    class Rows256(TorchLayers):
        token_block = 256

    decoder = load_decoder(FIXTURES / "tiny-nv3x", layers=Rows256())
    assert [decoder.layers[0].block_tokens(b) for b in (1, 2, 3, 4, 5, 8)] == [256, 128, 64, 64, 64, 64]
    deltanet_layers = sum(not layer.is_attention for layer in decoder.layers)
    model = Qwen35Runtime.from_decoder(decoder, batch_size=batch, max_length=256, buckets=[256])
    with count_kernel_calls("torch") as calls:
        model.prefill([random_prompt(200, 5)], [0])
    assert calls["torch", "deltanet_prefill"] == blocks * deltanet_layers


def test_decode_attends_only_to_its_cache_bucket(decoder):
    """A decode step through the smallest covering cache bucket equals one through the whole cache."""
    prompt = random_prompt(40, 4)
    model = Qwen35Runtime.from_decoder(decoder, batch_size=2, max_length=512)
    model.prefill([prompt, prompt[:20]], [0, 1])
    state = [t.clone() for t in model.state]
    got = model.decode([7, 9], [40, 20], [0, 1])
    assert ("token", 1, False, 64) in model.graphs._graphs, f"the 64-position bucket covers position 40: {list(model.graphs._graphs)}"
    ids, positions = torch.tensor([[7], [9]], dtype=torch.int32), torch.tensor([[40], [20]], dtype=torch.int32)
    with torch.no_grad():
        whole = TokenGenerationGraph(decoder)(ids, positions, torch.tensor([0, 1], dtype=torch.int32), *state)[0]
    torch.testing.assert_close(got, whole, rtol=0, atol=1e-5)
    for a, b in zip(model.state, state):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)  # both wrote the same state


def test_decode_writes_one_cache_row_per_active_slot(decoder):
    """Run a decode step with one inactive row: each active slot's cache changes at its position only."""
    model = Qwen35Runtime.from_decoder(decoder, batch_size=3, max_length=128)
    model.prefill([random_prompt(30, 5), random_prompt(12, 6), random_prompt(20, 7)], [0, 1, 2])
    before = [t.clone() for t in model.state]
    model.decode([5, 6], [20, 30], [2, 0])  # each slot's next position; slot 1 idle: its row of the static batch is inactive
    changed_somewhere = False
    for spec, old, new in zip(model.graphs.state_specs, before, model.state):
        if "cache" not in spec.name:
            assert torch.equal(old[1], new[1]), f"{spec.name}: the idle slot changed"
            continue
        diff = (old != new).any(-1)  # [slots, heads, positions]
        allowed = torch.zeros_like(diff)
        allowed[0, :, 30] = allowed[2, :, 20] = True
        assert not (diff & ~allowed).any(), f"{spec.name}: a decode step wrote outside its slots' positions"
        changed_somewhere |= bool(diff.any())
    assert changed_somewhere


VIEWS = {"aten.slice.Tensor", "aten.transpose.int", "aten.view.default", "aten.expand.default", "aten.alias.default",
         "aten.permute.default", "aten.unsqueeze.default", "aten.select.int", "aten.t.default"}


def cache_sized_ops(program, cache_numel):
    """(op, numel) of every node of an exported program yielding a tensor at least as large as a whole cache
    (views, which copy nothing, aside)."""
    found = []
    for node in program.graph.nodes:
        val = node.meta.get("val")
        if node.op != "call_function" or str(node.target) in VIEWS:
            continue
        if isinstance(val, torch.Tensor) and val.numel() >= cache_numel:
            found.append((str(node.target), val.numel()))
    return found


def test_token_graph_writes_caches_in_place_and_copies_none(decoder):
    """Inspect the exported token-generation graph: the only cache-sized op is the in-place update of the aliased
    cache input (one per K and V cache), the new rows themselves are [B, heads, 1, head_dim]."""
    model = Qwen35Runtime.from_decoder(decoder, batch_size=2, max_length=2048)  # caches far larger than any weight
    example = model.graphs._example_inputs("token", 1)
    cache_numel = min(s.shape[0] * s.shape[1] * s.shape[2] * s.shape[3] for s in model.graphs.state_specs if "cache" in s.name)
    with torch.no_grad():
        program = torch.export.export(TokenGenerationGraph(decoder, key_length=128), example, strict=False)
    ops = cache_sized_ops(program, cache_numel)
    n_caches = sum("cache" in s.name for s in model.graphs.state_specs)
    assert [op for op, _ in ops] == ["aten.index_put_.default"] * n_caches, ops
    # Every state output is its input, updated in place (what the Neuron backend aliases).
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"][-len(model.graphs.state_specs):]
    outputs = list(program.graph.output_node().args[0])[1:]
    for spec, placeholder, output in zip(model.graphs.state_specs, placeholders, outputs):
        node = output
        while node.op == "call_function" and node.target.overloadpacket.__name__.endswith("_"):  # in-place op: its first arg is the target
            node = node.args[0]
        assert node is placeholder, f"{spec.name} is not updated in place"


@pytest.mark.parametrize("seq_ids", [[-1, -1, -1], [-1, 2, -1], [0, -1, 3], [3, 1, 0], [2, -1, 1]])
def test_slot_write_touches_only_the_active_rows_slots(seq_ids):
    """`Slots.write` on its own: each active row's slot gets that row, every other slot (slot 0 included, which an
    idle batch writes and restores) keeps its value exactly."""
    from optimum_qwen35.modeling.state import Slots

    g = torch.Generator().manual_seed(0)
    state = torch.randn(4, 3, 5, generator=g)
    rows = torch.randn(len(seq_ids), 3, 5, generator=g, dtype=torch.float64)
    expected = state.clone()
    for row, slot in enumerate(seq_ids):
        if slot >= 0:
            expected[slot] = rows[row].float()
    out = Slots(torch.tensor(seq_ids, dtype=torch.int32)).write(state, rows)
    assert out is state and torch.equal(state, expected)


def test_decode_seams_fast_path_equals_the_functional_one(monkeypatch):
    """The CPU decode seam, given initial states it may keep (`donate_initial`: the mixer's own copies of the slots'
    rows, on CPU), updates the recurrent state in them (issue 31): the same numbers, bit for bit, as the functional
    path the Neuron graphs take, with a zero (fresh) row among them; the in-place step really ran, and only then."""
    from optimum_qwen35 import kernels
    from optimum_qwen35.kernels.gated_delta_rule import fused, reference

    ran = []
    real = fused.recurrent_gated_delta_rule_step_
    monkeypatch.setattr(fused, "recurrent_gated_delta_rule_step_", lambda *a: ran.append(1) or real(*a))
    g = torch.Generator().manual_seed(3)
    B, nk, nv, dk, dv, K = 3, 2, 4, 8, 16, 4
    C = 2 * nk * dk + nv * dv
    mixed, a, b = torch.randn(B, C, generator=g), torch.randn(B, nv, generator=g), torch.randn(B, nv, generator=g)
    A_log, dt_bias, weight = torch.randn(nv, generator=g), torch.randn(nv, generator=g), torch.randn(C, K, generator=g)
    conv, rec = torch.randn(B, C, K - 1, generator=g), torch.randn(B, nv, dk, dv, generator=g)
    conv[1], rec[1] = 0, 0  # a fresh row
    results = {}
    for donate in (True, False):
        initial = (conv.clone(), rec.clone())
        out = fused.deltanet_decode_reference(mixed, a, b, A_log, dt_bias, weight, *initial, donate_initial=donate)
        assert (out[2].data_ptr() == initial[1].data_ptr()) == donate
        if not donate:
            assert torch.equal(initial[1], rec), "a state not donated changed"
        results[donate] = out
    assert ran == [1], "the in-place step did not run on the donated path alone"
    for fast, functional in zip(results[True], results[False]):
        assert torch.equal(fast, functional)
    # A backend with its own step keeps getting it, donated or not: its decode seam is the reference over its step.
    own_step = lambda *args: ran.append(2) or reference.recurrent_gated_delta_rule_step(*args)  # noqa: E731
    kernels.register_backend("own-step", {"recurrent_gated_delta_rule_step": own_step})
    try:
        out = kernels.deltanet_decode(mixed, a, b, A_log, dt_bias, weight, conv.clone(), rec.clone(),
                                      backend="own-step", donate_initial=True)
    finally:
        kernels.unregister_backend("own-step")
    assert ran == [1, 2]
    assert all(torch.equal(x, y) for x, y in zip(out, results[False]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_in_place_step_equals_the_step(dtype):
    """`recurrent_gated_delta_rule_step_` gives the step's numbers in the state it is given; a state of another dtype
    than the compute dtype (a float64 model's fp32 state) takes the out-of-place step and is left as it was."""
    from optimum_qwen35.kernels.gated_delta_rule import reference

    g = torch.Generator().manual_seed(4)
    B, nk, nv, dk, dv = 2, 2, 4, 8, 16
    q, k = torch.randn(B, nk, 1, dk, generator=g, dtype=dtype), torch.randn(B, nk, 1, dk, generator=g, dtype=dtype)
    v, state = torch.randn(B, nv, 1, dv, generator=g, dtype=dtype), torch.randn(B, nv, dk, dv, generator=g)
    gate, beta = -torch.rand(B, nv, 1, generator=g, dtype=dtype), torch.rand(B, nv, 1, generator=g, dtype=dtype)
    o, S = reference.recurrent_gated_delta_rule_step(q, k, v, gate, beta, state)
    given = state.clone()
    o_, S_ = reference.recurrent_gated_delta_rule_step_(q, k, v, gate, beta, state)
    assert torch.equal(o, o_) and torch.equal(S, S_)
    assert (S_ is state) == (dtype == torch.float32)
    if dtype != torch.float32:
        assert torch.equal(state, given)


class _FunctionalLayers(TorchLayers):
    state_in_place = False  # the Neuron graphs' state updates, with the CPU precision policy


def test_decoder_in_place_equals_functional():
    """Prefill and decode steps of the whole decoder: the CPU runtime's in-place state updates (with the decode
    seam's fast path) give the functional path's logits and states bit for bit: fresh, continued and idle rows."""
    in_place = load_decoder(FIXTURES / "tiny-nv3x")
    functional = load_decoder(FIXTURES / "tiny-nv3x", layers=_FunctionalLayers())
    specs = in_place.state_specs(3, 64)
    held = {d: [torch.zeros(s.shape, dtype=s.dtype) for s in specs] for d in ("in_place", "functional")}
    ids = torch.tensor([random_prompt(16, 1), random_prompt(16, 2), random_prompt(16, 3)], dtype=torch.int32)
    mask = torch.ones(3, 16, dtype=torch.int32)
    mask[1, 9:] = 0
    positions = torch.arange(16, dtype=torch.int32).expand(3, 16)
    steps = [("context", (ids, mask, positions, torch.tensor([0, 2, -1], dtype=torch.int32)))]
    for i, (pos, seq) in enumerate([([16, 9, 0], [0, 2, 1]), ([17, 10, 1], [0, 2, -1]), ([0, 11, 2], [0, 2, 1])]):
        steps.append(("token", (torch.tensor([[5 + i], [6], [7]], dtype=torch.int32),
                                torch.tensor(pos, dtype=torch.int32)[:, None], torch.tensor(seq, dtype=torch.int32))))
    with torch.no_grad():
        for kind, inputs in steps:
            outs = {}
            for name, decoder in (("in_place", in_place), ("functional", functional)):
                run = decoder.context_encoding if kind == "context" else decoder.token_generation
                out = run(*inputs, *held[name])
                held[name] = list(out[1:])
                outs[name] = out
            for x, y in zip(outs["in_place"], outs["functional"]):
                assert torch.equal(x, y), kind
