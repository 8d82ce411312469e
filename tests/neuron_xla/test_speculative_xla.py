"""The Neuron forms of speculative verification (issue 39) and of the prefix cache's resumed prefill (issue 40):
the decoder over neuronx-distributed's layers (`NxDLayers`), its flat graph modules (verify, commit, the MTP head,
context encoding continuing from a slot's states with a static key length) run on torch-xla's CPU device
(`tests.kit.xla_runner`), against the eager model, and lowered to HLO and held to the compiler contract.

Numbers: every output of every call within 1e-5 of the eager modules' (fp32; relative to the largest magnitude
where that is above 1); greedy speculative decoding driven
through the XLA graphs equal to plain greedy decoding through them and to the eager model's, k = 1..3; a prefix-cache
hit on the XLA graphs equal to a cold run. What does not run here: neuronx-cc, a Neuron device, TP 2 numbers (the
CPU client has one device: TP 2 graphs are lowered, not run). The NxD export's own speculative graphs (its builders,
held and aliased state) are tests/neuron_xla/test_nxd_speculative.py's (docs/speculative_decoding.md, "The NxD
export"; docs/prefix_caching.md "Neuron graphs").
"""

from __future__ import annotations

import json

import pytest
import torch
import torch_xla

from optimum_qwen35.backends.nxd import adapter
from optimum_qwen35.backends.nxd.layers import NxDLayers
from optimum_qwen35.config import Qwen35Config
from optimum_qwen35.modeling.decoder import ContextEncodingGraph, Qwen35Decoder
from optimum_qwen35.modeling.speculative_graphs import CommitGraph, MTPGraph, VerifyGraph
from optimum_qwen35.modeling.state import allocate_state
from optimum_qwen35.runtime import Qwen35Runtime
from optimum_qwen35.runtime.eager import EagerGraphs, load_decoder
from optimum_qwen35.runtime.prefix_cache import PrefixCache, restore_blocks, take_block
from tests.kit import hlo_contract
from tests.kit.neuron_xla import CONTEXT, TOKENS, Graph, XlaGraphs, build_graphs, lower, neuron_config, traced_parallel_state
from tests.kit.xla_runner import XlaRunner, nxd_decoder

from ..conftest import FIXTURES, load_reference, reference_prompts

ATOL = 1e-5  # relative to the tensor's largest magnitude when that is above 1 (hidden states, states)
MAX_LENGTH, BUCKETS = 64, [16, 32]


def pair(folder, dtype=torch.float32, batch_size=2, max_length=MAX_LENGTH):
    """(eager runner, XLA runner) over the same weights (the MTP head included)."""
    eager = load_decoder(folder, dtype, mtp=True)
    return EagerGraphs(eager, batch_size, max_length), XlaRunner(nxd_decoder(eager, dtype), batch_size, max_length)


def close(a, b, what):
    """The largest difference, scaled by the eager tensor's largest magnitude when that is above 1."""
    a, b = a.detach().float(), b.detach().float()
    error = (a - b).abs().max().item() / max(1.0, b.abs().max().item())
    assert error <= ATOL, f"{what}: max |xla - eager| / max(1, max |eager|) = {error:.2e}"
    return error


def context_inputs(prompt, start, bucket):
    """One row continuing at `start` (0: fresh), right-padded to `bucket`."""
    n = len(prompt)
    ids = torch.tensor([prompt + [0] * (bucket - n)], dtype=torch.int32)
    mask = torch.tensor([[1] * n + [0] * (bucket - n)], dtype=torch.int32)
    positions = torch.tensor([list(range(start, start + n)) + [1] * (bucket - n)], dtype=torch.int32)
    return ids, mask, positions


def test_verify_commit_and_mtp_graphs_equal_the_eager_modules():
    """Two rows prefilled (one of them in two pieces: the second continues its slot with key length 32), then one
    speculation round by hand: the MTP head over the prompts, verify of k + 1 = 4 positions per row, commit of
    different accepted positions per row (0 and 2), a decode step; every output and the final state within 1e-5."""
    prompts = [[(i * 37) % 500 + 3 for i in range(27)], [(i * 11) % 400 + 5 for i in range(12)]]
    worst = 0.0
    with traced_parallel_state(1):
        eager, xla = pair(FIXTURES / "tiny-2b")
        hidden = {}
        for run in (eager, xla):
            out = []
            out.append(run.context_hidden(16, None, *context_inputs(prompts[0][:16], 0, 16), torch.tensor([0], dtype=torch.int32)))
            out.append(run.context(16, False, 32, *context_inputs(prompts[0][16:], 16, 16), torch.tensor([0], dtype=torch.int32)))
            out.append(run.context_hidden(16, None, *context_inputs(prompts[1], 0, 16), torch.tensor([1], dtype=torch.int32)))
            seq_ids = torch.tensor([0, 1], dtype=torch.int32)
            drafts = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]], dtype=torch.int32)
            positions = torch.tensor([[27, 28, 29, 30], [12, 13, 14, 15]], dtype=torch.int32)
            lengths = torch.tensor([4, 4], dtype=torch.int32)
            h = torch.randn(2, 4, run.decoder.config.hidden_size, generator=torch.Generator().manual_seed(0))
            out.append(run.mtp(None, drafts, h, positions, lengths, seq_ids))
            out.append(run.verify(MAX_LENGTH, drafts, positions, lengths, seq_ids))
            run.commit(seq_ids, torch.tensor([0, 2], dtype=torch.int32))
            out.append(run.token(MAX_LENGTH, torch.tensor([[21], [22]], dtype=torch.int32),
                                 torch.tensor([[28], [15]], dtype=torch.int32), seq_ids))
            hidden[run is xla] = (out, [t.cpu() for t in run.state], [t.cpu() for t in run.mtp_state])
        (e_out, e_state, e_mtp), (x_out, x_state, x_mtp) = hidden[False], hidden[True]
        for i, (a, b) in enumerate(zip(x_out, e_out)):
            for j, (ta, tb) in enumerate(zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,))):
                worst = max(worst, close(ta, tb, f"call {i} output {j}"))
        for spec, a, b in zip(eager.state_specs + eager.decoder.mtp_state_specs(2, MAX_LENGTH), x_state + x_mtp, e_state + e_mtp):
            worst = max(worst, close(a, b, spec.name))
        assert xla.executions == {"context_hidden": 2, "context": 1, "mtp": 1, "verify": 1, "commit": 1, "token": 1}
    print(f"\nverify / commit / MTP / continuing context on XLA: max |xla - eager| {worst:.2e}")


@pytest.fixture(scope="module")
def fitted(fitted_tiny_2b):
    """tiny-2b with an MTP head fitted to its own model (optimum_qwen35/tiny/mtp_fit.py: accepts most drafts) and two
    in-sample prompts of 15 and 20 tokens (either side of the 16-token bucket edge)."""
    folder = fitted_tiny_2b
    prompts = json.loads((folder / "mtp_fit.json").read_text())["prompts"][:2]
    return folder, [prompts[0][:15], (prompts[1] * 3)[:20]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_greedy_speculation_driven_through_the_xla_graphs_equals_greedy_decoding(fitted, dtype):
    """The host loop's speculative decoding (runtime/speculative.py) over the XLA graphs, a batch of two rows: the
    tokens of plain greedy decoding on the same graphs (fp32: and those of the eager model)."""
    folder, prompts = fitted
    new = 14
    with traced_parallel_state(1):
        eager, xla = pair(folder, dtype)
        assert xla.decoder.layers[0].mlp.gate_proj.weight.dtype == dtype
        model = Qwen35Runtime(xla, xla.decoder.config, 2, MAX_LENGTH, BUCKETS)
        expected = model.generate(prompts, max_new_tokens=new)
        if dtype == torch.float32:
            assert Qwen35Runtime(eager, eager.decoder.config, 2, MAX_LENGTH, BUCKETS).generate(prompts, max_new_tokens=new) == expected
        lengths = {}
        for k in (1, 2, 3):
            assert model.generate(prompts, max_new_tokens=new, num_speculative_tokens=k) == expected, f"k={k}"
            lengths[k] = model.speculation.acceptance_length
            # The head accepts (in bf16 less: it was fitted on the fp32 continuations, which bf16's leave).
            assert lengths[k] > (1.2 if dtype == torch.float32 else 1.0), (k, model.speculation.accepted_per_round)
        assert xla.executions["verify"] and xla.executions["commit"] == xla.executions["verify"]
    print(f"\nXLA graphs {str(dtype)[6:]}, greedy speculative == greedy; acceptance length per k: {lengths}; "
          f"executions {dict(xla.executions)}")


def test_a_prefix_cache_hit_on_the_xla_graphs_equals_a_cold_run():
    """Resumed prefill on the XLA graphs: a 136-token prompt cold (cache on: blocks of 64, the smallest the delta
    rule's chunk allows; continuing pieces with key lengths above their bucket), then a prompt sharing its first 128
    tokens (a hit of 2 blocks: the slot's states restored, context encoding continues at 128): the last-token
    logits within 1e-5 of the eager runtime's on the same calls, and greedy tokens equal."""
    shared = [(i * 37) % 500 + 3 for i in range(128)]
    first, second = shared + [7, 8, 9, 10, 11, 12, 13, 14], shared + [40, 41, 42, 43, 44]
    outputs = {}
    with traced_parallel_state(1):
        eager, xla = pair(FIXTURES / "tiny-2b", batch_size=1, max_length=256)
        for run in (eager, xla):
            model = Qwen35Runtime(run, run.decoder.config, 1, 256, [64], prefix_cache=PrefixCache(64))
            cold = model.generate([first], max_new_tokens=6)
            logits = model.prefill([second], [0])
            hits = list(model.last_prefix_hits)
            warm = model.generate([second], max_new_tokens=6)
            outputs[run is xla] = cold, logits, hits, warm
        assert outputs[True][2] == [128], outputs[True][2]
        error = close(outputs[True][1], outputs[False][1], "logits after the resumed prefill")
        assert outputs[True][0] == outputs[False][0] and outputs[True][3] == outputs[False][3]
        assert any(k[0] == "context" and k[3] not in (None, k[1]) for k in xla._graphs), "no continuing graph ran"
    print(f"\nprefix cache on XLA graphs: hit of {outputs[True][2]} tokens, logits max |xla - eager| {error:.2e}, "
          f"executions {dict(xla.executions)}")


# ---------------------------------------------------------------------------------------------- the contract
CASES = [(1, torch.float32), (1, torch.bfloat16), (2, torch.float32), (2, torch.bfloat16)]


def speculative_graphs(decoder, batch: int, k: int, max_length: int) -> dict[str, Graph]:
    """The graphs to lower, with example inputs: verify of k + 1 positions (key length: the cache), commit, the MTP
    head (when the decoder has it), and context encoding of a 16-token bucket continuing a slot (key length 32)."""
    T = k + 1
    state = allocate_state(decoder.state_specs(batch, max_length))
    seq_ids = torch.arange(batch, dtype=torch.int32)
    positions = torch.arange(T, dtype=torch.int32).expand(batch, T) + 8
    lengths = torch.full((batch,), T, dtype=torch.int32)
    ids = torch.zeros(batch, T, dtype=torch.int32)
    # verify's per-position DeltaNet states, as commit takes them: conv [B, T, C, K - 1], recurrent [B, T * nv, dk, dv]
    per_position = []
    for spec in decoder.state_specs(batch, max_length):
        if spec.name.endswith("conv_state"):
            per_position.append(torch.zeros(batch, T, *spec.shape[1:], dtype=spec.dtype))
        elif spec.name.endswith("recurrent_state"):
            nv, dk, dv = spec.shape[1:]
            per_position.append(torch.zeros(batch, T * nv, dk, dv, dtype=spec.dtype))
    decoder = decoder.to(torch_xla.device())
    graphs = {
        "verify": Graph("verify", VerifyGraph(decoder), {}, (ids, positions, lengths, seq_ids, *state)),
        "commit": Graph("commit", CommitGraph(decoder), {}, (seq_ids, torch.ones(batch, dtype=torch.int32),
                                                              *per_position, *state)),
    }
    # A cached prefill's resumed piece: a 64-token bucket (a block) at positions 64..127 reading 128 cached positions.
    ctx_ids = torch.zeros(1, 64, dtype=torch.int32)
    graphs["context_continuing"] = Graph(
        "context_continuing", ContextEncodingGraph(decoder, key_length=128), {},
        (ctx_ids, torch.ones_like(ctx_ids), torch.arange(64, 128, dtype=torch.int32)[None], seq_ids[:1], *state),
    )
    if decoder.mtp is not None:
        kv = allocate_state(decoder.mtp_state_specs(batch, max_length))
        hidden = torch.zeros(batch, T, decoder.config.hidden_size, dtype=decoder.embed_tokens.weight.dtype)
        graphs["mtp"] = Graph("mtp", MTPGraph(decoder), {}, (ids, hidden, positions, lengths, seq_ids, *kv))
    return graphs


@pytest.mark.parametrize(("tp", "dtype"), CASES, ids=[f"tp{tp}-{str(d)[6:]}" for tp, d in CASES])
def test_the_speculative_and_resumed_prefill_graphs_keep_the_contract(reference, tp, dtype):
    """Verify (k = 3), commit, continuing context encoding and the MTP head (at TP 2 sharded as the main layers, its fc
    replicated: `replicated_linear`), built
    over NxDLayers at the tensor-parallel degree, lowered: no violation (rank <= 4 included: the per-position
    recurrent states are [B, T * nv, dk, dv])."""
    config = Qwen35Config.from_pretrained(FIXTURES / "tiny-nv3x")
    failures = {}
    with traced_parallel_state(tp):
        decoder = Qwen35Decoder(config, tp, NxDLayers(tp, dtype), mtp=True).eval()
        graphs = speculative_graphs(decoder, batch=2, k=3, max_length=128)
        assert sorted(graphs) == sorted(["verify", "commit", "context_continuing", "mtp"])
        for key, graph in graphs.items():
            lowered = lower(graph)
            print(f"\ntp{tp} {str(dtype)[6:]} {key}: {lowered.instruction_count} HLO instructions, "
                  f"{hlo_contract.dtype_census(lowered.hlo)}")
            found = hlo_contract.violations(lowered.hlo, reference)
            if found:
                failures[key] = found[:20]
    assert not failures, json.dumps(failures, indent=1)


# ---------------------------------------------------------------------------------------------- the NxD export's graph
def test_the_exports_context_graph_resumes_a_restored_slot():
    """The NxD export's own context-encoding graph (its builders, held and aliased state: `build_graphs`, run by
    `XlaGraphs`) is a resumed-prefill graph when, as optimum-neuron's config has it by default, its width is the
    sequence length: a row starting at p > 0 reads every cached position <= its own. A 64-token block of the 130-token
    reference prompt prefilled into slot 0, its snapshot taken from the held state (the prefix cache's `take_block`),
    slot 1 filled with another prompt, then restored from the snapshot (`restore_blocks`), then tokens 64..99
    resumed in slot 1: the logits within 1e-5 of the eager decoder's same two calls and 1e-4 of transformers'; then
    10 token-generation steps from slot 1 within 1e-4 of transformers'."""
    layout, sequence = "tiny-2b", 128
    ref = load_reference(layout)
    prompt, logits = next((p, torch.from_numpy(l)) for p, l in reference_prompts(ref) if len(p) == 130)
    nc = neuron_config(FIXTURES / layout, "trn2", sequence_length=sequence)
    assert nc.max_context_length == sequence

    def inputs(tokens, start):
        ids, positions = torch.tensor([tokens], dtype=torch.int32), torch.arange(start, start + len(tokens), dtype=torch.int32)[None]
        return adapter.pad_context_inputs(ids, positions, sequence, 0)

    with traced_parallel_state(1, nc.logical_nc_config):
        graphs = build_graphs(FIXTURES / layout, nc, load_weights=True)
        run = XlaGraphs(graphs)
        names = [s.name for s in graphs[CONTEXT].module.state_layout.held_specs]
        keys = [f"past_key_values.{j}" for j in range(len(names))]

        def host():
            return [run.state[k].cpu() for k in keys]

        run(CONTEXT, *inputs(prompt[:64], 0), [0])
        snapshot = take_block(host(), names, 0, 0, 64)
        run(CONTEXT, *inputs(list(range(7, 57)), 0), [1])  # slot 1 holds another sequence
        state = host()
        restore_blocks(state, names, 1, [snapshot], 64)
        for k, t in zip(keys, state):
            run.state[k] = t.to(torch_xla.device())
        got = run(CONTEXT, *inputs(prompt[64:100], 64), [1])[0]
        # The eager decoder's same two calls (the export's width, key length = width).
        decoder = load_decoder(FIXTURES / layout)
        eager_state = allocate_state(decoder.state_specs(2, sequence))
        graph = ContextEncodingGraph(decoder)
        with torch.no_grad():
            for tokens, start in ((prompt[:64], 0), (prompt[64:100], 64)):
                ids, positions = inputs(tokens, start)
                mask = adapter.context_attention_mask(positions)
                expected = graph(ids, mask, positions, torch.tensor([1], dtype=torch.int32), *eager_state)[0][0]
        error = close(got, expected, "resumed context logits")
        torch.testing.assert_close(got, logits[99], rtol=0, atol=1e-4)
        worst = 0.0
        for position in range(100, 110):
            out = run(TOKENS, torch.tensor([[0], [prompt[position]]], dtype=torch.int32),
                      torch.tensor([[0], [position]], dtype=torch.int32), [-1, 1])[1]
            torch.testing.assert_close(out, logits[position], rtol=0, atol=1e-4)
            worst = max(worst, (out - logits[position]).abs().max().item())
    print(f"\nexport context graph resumed at 64 in a restored slot: |xla - eager| {error:.2e}, "
          f"decode after it max |xla - transformers| {worst:.2e}")
