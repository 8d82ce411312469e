"""Every graph of the text and MoE forms at TP 1, fp32 and bf16, through the TorchNeuron check backend: lowered to
StableHLO with no graph break, one graph per bucket and no recompilation across buckets after warm-up, every state
write an aliased output, static shapes, the compiler contract; and run on CPU: equal to the eager model and to
transformers' recorded outputs.

Per layout (tiny-2b, tiny-nv3x, tiny-moe), batch 2, cache 96 positions: context encoding at buckets 16 and 64, the
per-position logits graph at 64, token generation at decode buckets 64 and 96 (fp32); context encoding 16 and token
generation 96 (bf16). Each is compiled once per test module (`COMPILED`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

pytest.importorskip("torch_mlir", reason="torch-mlir is installed by the torchneuron nox session")

from optimum_qwen35.modeling.decoder import ContextEncodingGraph, TokenGenerationGraph

from ..conftest import load_reference
from optimum_qwen35.backends.torchneuron import stablehlo_contract as contract
from optimum_qwen35.backends.torchneuron.runner import StateInPlaceGraph
from optimum_qwen35.backends.torchneuron.stablehlo_check import CheckBackend
from .conftest import check_lowered
from .models import EAGER_TOLERANCE, load_decoder, state

LAYOUTS = ("tiny-2b", "tiny-nv3x", "tiny-moe")
BATCH, MAX_LENGTH = 2, 96
CONTEXT_BUCKETS = {torch.float32: (16, 64), torch.bfloat16: (16,)}
DECODE_BUCKETS = {torch.float32: (64, None), torch.bfloat16: (None,)}  # None: the whole cache
ALL_LOGITS_BUCKET = 64


@dataclasses.dataclass
class Compiled:
    decoder: torch.nn.Module
    context: object  # the compiled context-encoding graph (one Dynamo graph per bucket)
    context_backend: CheckBackend
    decode: dict  # key length -> (compiled token-generation graph, its backend)
    logits: object | None  # the per-position logits graph (fp32)
    logits_backend: CheckBackend | None
    eager_context: torch.nn.Module
    eager_decode: dict
    eager_logits: torch.nn.Module | None

    def backends(self):
        out = [self.context_backend, *(b for _, b in self.decode.values())]
        return out + ([self.logits_backend] if self.logits_backend else [])


COMPILED: dict = {}
FINDINGS: dict = {}


def _compile(module, name, state_count):
    """`module` compiled as the product runner compiles it: its state written in place, not returned as well."""
    backend = CheckBackend(name=name)
    return torch.compile(StateInPlaceGraph(module, state_count), backend=backend, fullgraph=True, dynamic=False), backend


def _context_inputs(prompts, bucket, seq_ids, starts=None):
    ids = torch.zeros(BATCH, bucket, dtype=torch.int32)
    mask = torch.zeros(BATCH, bucket, dtype=torch.int32)
    positions = torch.ones(BATCH, bucket, dtype=torch.int32)  # padding at position 1, as the export pads
    for row, prompt in enumerate(prompts):
        start = 0 if starts is None else starts[row]
        ids[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.int32)
        mask[row, : len(prompt)] = 1
        positions[row, : len(prompt)] = torch.arange(start, start + len(prompt), dtype=torch.int32)
    return ids, mask, positions, torch.tensor(seq_ids, dtype=torch.int32)


def compiled(layout: str, dtype: torch.dtype) -> Compiled:
    """The graphs of one layout and dtype, compiled and warmed up (every bucket once) the first time they are asked."""
    key = (layout, dtype)
    if key in COMPILED:
        return COMPILED[key]
    decoder = load_decoder(layout, dtype)
    n = len(decoder.state_specs(BATCH, MAX_LENGTH))
    context, context_backend = _compile(ContextEncodingGraph(decoder), f"{layout}-context", n)
    decode = {k: _compile(TokenGenerationGraph(decoder, key_length=k), f"{layout}-decode-{k or MAX_LENGTH}", n)
              for k in DECODE_BUCKETS[dtype]}
    logits = logits_backend = eager_logits = None
    if dtype == torch.float32:
        eager_logits = ContextEncodingGraph(decoder, all_logits=True)
        logits, logits_backend = _compile(eager_logits, f"{layout}-logits", n)
    with torch.no_grad():  # warm-up: every bucket of every graph compiled once, on a scratch state
        scratch = state(decoder, BATCH, MAX_LENGTH)
        for bucket in CONTEXT_BUCKETS[dtype]:
            context(*_context_inputs([[1, 2, 3]], bucket, [0, -1]), *scratch)
        if logits is not None:
            logits(*_context_inputs([[1, 2, 3]], ALL_LOGITS_BUCKET, [0, -1]), *scratch)
        for fn, _ in decode.values():
            fn(torch.tensor([[4], [5]], dtype=torch.int32), torch.tensor([[3], [0]], dtype=torch.int32),
               torch.tensor([0, -1], dtype=torch.int32), *scratch)
    COMPILED[key] = Compiled(
        decoder, context, context_backend, decode, logits, logits_backend, ContextEncodingGraph(decoder),
        {k: TokenGenerationGraph(decoder, key_length=k) for k in decode}, eager_logits,
    )
    return COMPILED[key]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_graphs_lower_to_stablehlo_within_the_contract(layout, dtype, reference_census):
    c = compiled(layout, dtype)
    states = len(c.decoder.state_specs(BATCH, MAX_LENGTH))
    expected = len(CONTEXT_BUCKETS[dtype]) + len(DECODE_BUCKETS[dtype]) + (dtype == torch.float32)
    graphs = [g for b in c.backends() for g in b.graphs]
    # fullgraph=True raises on a graph break; this also says Dynamo handed over one graph per bucket, no more.
    assert sum(b.dynamo_graphs for b in c.backends()) == len(graphs) == expected
    for graph in graphs:
        FINDINGS.setdefault((layout, dtype), set()).update(check_lowered(graph, reference_census, states))
        ops = contract.parse(graph.stablehlo)
        entries = contract.census(ops)
        print(f"\n{graph.name} {str(dtype).split('.')[-1]}: {len(ops)} ops, {len(entries)} census entries "
              f"({len(set(entries) - reference_census)} outside the reference's {len(reference_census)}), "
              f"{contract.dtype_census(ops)}, {len(graph.aliases)} aliases, "
              + ", ".join(f"{k} {v:.1f} s" for k, v in graph.seconds.items()))
    # One graph per context bucket, of that bucket's shape.
    assert [g.input_shapes[0][0] for g in c.context_backend.graphs] == [(BATCH, b) for b in CONTEXT_BUCKETS[dtype]]


def test_no_graph_has_a_finding():
    """The contract holds with no allowance: the findings table is empty, and no graph lowered here had one."""
    assert contract.KNOWN_FINDINGS == {}
    if len(FINDINGS) < len(LAYOUTS) * 2:
        pytest.skip("needs every layout's lowering test in this run")
    assert set().union(*FINDINGS.values()) == set()


def _close(actual, expected, tol, what):
    """|actual - expected| <= tol * (1 + |expected|) elementwise (torch.testing.assert_close with atol = rtol = tol);
    returns the largest absolute difference."""
    actual, expected = actual.float(), expected.float()
    diff = (actual - expected).abs()
    worst = (diff - tol * expected.abs()).max().item()
    assert worst <= tol, f"{what}: max |diff| {diff.max().item():.3g} beyond {tol} (1 + |expected|)"
    return diff.max().item()


ERRORS: dict = {}


def test_the_kernel_dispatch_recompiles_nothing():
    """Context encoding and token generation warmed up once each, then context encoding called again under
    `fail_on_recompile`, with the package's own kernel dispatch. Before issue 37 the dispatch counted every call in a
    module-level Counter, a traced side effect Dynamo guarded each graph on (a recompilation per bf16 decode step,
    each a neuronx-cc compile on TorchNeuron); the seams are now torch.library custom ops, one node each."""
    decoder = load_decoder("tiny-2b")
    context = torch.compile(ContextEncodingGraph(decoder), backend=CheckBackend(), fullgraph=True, dynamic=False)
    decode = torch.compile(TokenGenerationGraph(decoder), backend=CheckBackend(), fullgraph=True, dynamic=False)
    with torch.no_grad():
        scratch = state(decoder, BATCH, MAX_LENGTH)
        context(*_context_inputs([[1, 2, 3]], 16, [0, -1]), *scratch)
        decode(torch.tensor([[4], [5]], dtype=torch.int32), torch.tensor([[3], [0]], dtype=torch.int32),
               torch.tensor([0, -1], dtype=torch.int32), *scratch)
        with torch.compiler.set_stance("fail_on_recompile"):
            context(*_context_inputs([[7, 8], [9]], 16, [1, 0]), *scratch)


def test_no_recompilation_across_buckets_after_warm_up():
    """Every bucket of every graph warmed up once, then every one called again with other values under
    `torch.compiler.set_stance("fail_on_recompile")`, as vLLM Neuron runs after its warm-up."""
    c = compiled("tiny-2b", torch.float32)
    with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile"):
        scratch = state(c.decoder, BATCH, MAX_LENGTH)
        for bucket in CONTEXT_BUCKETS[torch.float32]:
            c.context(*_context_inputs([[7, 8], [9]], bucket, [1, 0]), *scratch)
        c.logits(*_context_inputs([[7, 8, 9, 10]], ALL_LOGITS_BUCKET, [1, -1]), *scratch)
        for fn, _ in c.decode.values():
            fn(torch.tensor([[6], [7]], dtype=torch.int32), torch.tensor([[5], [2]], dtype=torch.int32),
               torch.tensor([1, 0], dtype=torch.int32), *scratch)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp32_graphs_equal_eager_and_transformers(layout):
    """The per-position logits graph, context encoding at both buckets (slots given out of order) and token
    generation alternating between both decode buckets, against the eager graphs (`EAGER_TOLERANCE`: logits and every state
    tensor) and transformers' fp32 logits (1e-4), greedy tokens equal; under `fail_on_recompile`, eager calls in
    between."""
    c = compiled(layout, torch.float32)
    ref = load_reference(layout)
    errors = {"eager": 0.0, "transformers": 0.0}

    def both(compiled_fn, eager_fn, inputs, compiled_state, eager_state, what):
        out = compiled_fn(*inputs, *compiled_state)
        expected = eager_fn(*inputs, *eager_state)
        errors["eager"] = max(errors["eager"], _close(out[0], expected[0], EAGER_TOLERANCE, f"{what} logits"))
        for k, (a, b) in enumerate(zip(compiled_state, eager_state)):
            errors["eager"] = max(errors["eager"], _close(a, b, EAGER_TOLERANCE, f"{what} state {k}"))
        return out[0]

    with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile"):
        # The per-position logits graph: prompts of 64 and 63 tokens, every real position against transformers.
        mine, theirs = state(c.decoder, BATCH, MAX_LENGTH), state(c.decoder, BATCH, MAX_LENGTH)
        p64, p63 = ref["prompt_4"].tolist(), ref["prompt_3"].tolist()
        logits = both(c.logits, c.eager_logits, _context_inputs([p64, p63], 64, [0, 1]), mine, theirs, "logits graph")
        errors["transformers"] = max(
            _close(logits[0], torch.from_numpy(ref["logits_4"]), 1e-4, "logits graph row 0 vs transformers"),
            _close(logits[1, :63], torch.from_numpy(ref["logits_3"]), 1e-4, "logits graph row 1 vs transformers"))

        # Context encoding at 64: the 63- and 3-token prompts into slots 1 and 0.
        mine, theirs = state(c.decoder, BATCH, MAX_LENGTH), state(c.decoder, BATCH, MAX_LENGTH)
        p3 = ref["prompt_2"].tolist()
        last = both(c.context, c.eager_context, _context_inputs([p63, p3], 64, [1, 0]), mine, theirs, "context 64")
        errors["transformers"] = max(errors["transformers"],
                                     _close(last[0], torch.from_numpy(ref["logits_3"][-1]), 1e-4, "context 64 row 0"),
                                     _close(last[1], torch.from_numpy(ref["logits_2"][-1]), 1e-4, "context 64 row 1"))

        # Context encoding at 16, then token generation alternating between the two decode buckets: row 0 greedy
        # from gen_prompt_0, row 1 teacher-forced through prompt_4 (positions 16 .. 63).
        mine, theirs = state(c.decoder, BATCH, MAX_LENGTH), state(c.decoder, BATCH, MAX_LENGTH)
        gen = ref["gen_prompt_0"].tolist()
        last = both(c.context, c.eager_context, _context_inputs([gen, p64[:16]], 16, [0, 1]), mine, theirs,
                    "context 16")
        tokens = [int(last[0].argmax())]
        buckets = list(c.decode)
        for step, position in enumerate(range(16, 64)):
            fn, _ = c.decode[buckets[step % len(buckets)]]
            eager = c.eager_decode[buckets[step % len(buckets)]]
            inputs = (torch.tensor([[tokens[-1]], [p64[position]]], dtype=torch.int32),
                      torch.tensor([[len(gen) + step], [position]], dtype=torch.int32),
                      torch.tensor([0, 1], dtype=torch.int32))
            logits = both(fn, eager, inputs, mine, theirs, f"decode step {step}")
            errors["transformers"] = max(errors["transformers"], _close(
                logits[1], torch.from_numpy(ref["logits_4"][position]), 1e-4, f"decode position {position}"))
            tokens.append(int(logits[0].argmax()))
        assert tokens == ref["gen_tokens_0"][: len(tokens)].tolist()
    ERRORS[layout] = errors
    print(f"\n{layout} fp32: max |compiled - eager| {errors['eager']:.2e}, "
          f"max |compiled - transformers| {errors['transformers']:.2e}, {len(tokens)} greedy tokens equal")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_graphs_follow_eager(layout):
    """bf16: context encoding and 24 greedy decode steps, compiled against eager bf16 (the same ops: greedy tokens
    equal, logits within bf16 rounding of each other), and transformers' greedy tokens while its bf16 margin allows."""
    c = compiled(layout, torch.bfloat16)
    ref = load_reference(layout)
    gen = ref["gen_prompt_0"].tolist()
    (length,) = c.decode
    with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile"):
        mine, theirs = state(c.decoder, BATCH, MAX_LENGTH), state(c.decoder, BATCH, MAX_LENGTH)
        inputs = _context_inputs([gen, gen], 16, [0, 1])
        a, b = c.context(*inputs, *mine)[0], c.eager_context(*inputs, *theirs)[0]
        worst = _close(a, b, 0.05, "bf16 context")
        tokens, eager_tokens = [int(a[0].argmax())], [int(b[0].argmax())]
        fn, _ = c.decode[length]
        for step in range(23):
            ids = torch.tensor([[tokens[-1]]] * 2, dtype=torch.int32)  # the compiled graph's tokens, in both
            pos = torch.tensor([[len(gen) + step]] * 2, dtype=torch.int32)
            seq = torch.tensor([0, 1], dtype=torch.int32)
            a = fn(ids, pos, seq, *mine)[0]
            b = c.eager_decode[length](ids, pos, seq, *theirs)[0]
            worst = max(worst, _close(a, b, 0.05, f"bf16 decode step {step}"))
            tokens.append(int(a[0].argmax()))
            eager_tokens.append(int(b[0].argmax()))
    assert tokens == eager_tokens
    print(f"\n{layout} bf16: max |compiled - eager| {worst:.3g}, 24 greedy tokens equal to eager bf16; "
          f"{int(np.sum(np.array(tokens) == ref['gen_tokens_0'][:24]))}/24 equal to transformers' fp32 greedy")
