"""The trn2 / trn1 / inf2 graphs, built exactly as the export builds them, lowered and run on the XLA CPU device.

- Every held state (K/V of the attention layers, conv and recurrent states of the DeltaNet layers) is a parameter of
  the lowered HLO, so that its alias to the graph output that updates it resolves (`tensor_parameter_id` >= 0): at
  TP 1 and 2 (neuronx-distributed's ahead-of-time parallel state, as `ModelBuilder.trace` builds every rank's one
  SPMD graph), fp32 and bf16, for each target.
- Context encoding, then token generation with the returned state fed back, against transformers' logits (fp32
  within 1e-4 at every position) and greedy tokens, on the three fixture layouts (nv = nk; nv = 2 nk; nv = 3 nk with
  dk != dv); bf16 within 0.25 of transformers' fp32 logits with the recurrent state kept fp32.
- Batches padded the way optimum-neuron's token-generation wrapper pads them: a live sequence that a step leaves out
  keeps its state (with this project's wrapper; optimum-neuron's own, which fills the rows with spare slot ids,
  overwrites it: shown too).
Numbers run at TP 1 only: XLA's CPU client here is one device in one process, and running the TP 2 graph would need
its collectives executed across two; the TP 2 graph is lowered and its aliases checked, and the CPU runtime's
gloo TP (the same model definition) is checked against TP 1 in tests/test_tensor_parallel.py.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from optimum_qwen35.backends.nxd import adapter
from tests.kit.neuron_xla import (
    CONTEXT, LOGITS, TOKENS, TracedModel, XlaGraphs, build_graphs, lower, neuron_config, state_traffic,
    traced_parallel_state,
)

from ..conftest import FIXTURES, LAYOUTS, load_reference, reference_prompts

LOGIT_ATOL = 1e-4  # fp32, as tests/test_parity.py
BF16_ATOL = 0.25  # bf16 weights and activations against transformers' fp32, as tests/test_neuron_backend.py
TIE_MARGIN = 1e-5  # a greedy divergence is excused only where the reference's top-2 margin is below this
SEQUENCE_LENGTH = 128


# ---------------------------------------------------------------------------------------------- state aliases
ALIAS_CASES = [
    ("trn2", 1, torch.float32), ("trn2", 1, torch.bfloat16), ("trn2", 2, torch.float32), ("trn2", 2, torch.bfloat16),
    ("trn1", 1, torch.float32), ("trn1", 2, torch.bfloat16), ("inf2", 1, torch.bfloat16), ("inf2", 2, torch.float32),
]


@pytest.mark.parametrize(("target", "tp", "dtype"), ALIAS_CASES, ids=[f"{t}-tp{p}-{str(d)[6:]}" for t, p, d in ALIAS_CASES])
def test_every_state_input_resolves_to_its_aliased_output(target, tp, dtype):
    nc = neuron_config(FIXTURES / "tiny-nv3x", target, tp, dtype)
    assert nc.logical_nc_config == (2 if target == "trn2" else 1)
    with traced_parallel_state(tp, nc.logical_nc_config):
        graphs = build_graphs(FIXTURES / "tiny-nv3x", nc)
        assert sorted(graphs) == sorted([CONTEXT, TOKENS, LOGITS])
        for key, graph in graphs.items():
            held = graph.module.state_layout.held_specs
            lowered = lower(graph)
            if key == LOGITS:
                # forward()'s graph: logits only, no alias, and no held state among its inputs (it reads no slot).
                assert lowered.num_outputs == 1 and graph.alias_names == {}
                read = sorted(name for name, i in lowered.parameter_ids.items() if i >= 0)
                assert len(lowered.parameter_ids) == len(held) and not read, f"{key} reads held state {read}"
                continue
            assert lowered.num_outputs == 1 + len(held)
            assert sorted(graph.alias_names.values()) == list(range(1, 1 + len(held)))
            unresolved = sorted(name for name, i in lowered.parameter_ids.items() if i < 0)
            assert not unresolved, f"{key}: {len(unresolved)}/{len(held)} state aliases do not resolve: {unresolved}"
            assert len(set(lowered.parameter_ids.values())) == len(held)
            # The recurrent state stays fp32 in a bf16 graph (optimum-neuron's load cast undone before tracing).
            for spec in held:
                param = dict(graph.module.named_parameters())[f"past_key_values.{held.index(spec)}"]
                assert param.dtype == spec.dtype, spec.name
            if key == CONTEXT:
                # Context encoding (batch 1) writes one slot of each state: no whole-state rewrite in the graph.
                traffic = state_traffic(lowered, graph)
                for j, spec in enumerate(held):
                    per_slot = torch.Size(spec.shape[1:]).numel() * spec.dtype.itemsize
                    assert traffic[f"past_key_values.{j}"][1] == per_slot, spec.name
            print(f"\n{target} tp{tp} {dtype} {key}: {lowered.instruction_count} HLO instructions, {len(held)} aliases")


# ---------------------------------------------------------------------------------------------- numbers
def context_inputs(prompt: list[int], pad_token_id: int = 0):
    """One right-padded row, as optimum-neuron's context-encoding wrapper pads it (pad token, position 1)."""
    ids = torch.tensor([prompt], dtype=torch.int32)
    positions = torch.arange(len(prompt), dtype=torch.int32)[None]
    return adapter.pad_context_inputs(ids, positions, SEQUENCE_LENGTH, pad_token_id)


def column(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)[:, None]


RUN_CASES = [(layout, "trn2") for layout in LAYOUTS] + [("tiny-nv3x", "trn1"), ("tiny-2b", "inf2")]


@pytest.mark.parametrize(("layout", "target"), RUN_CASES, ids=[f"{l}-{t}" for l, t in RUN_CASES])
def test_xla_run_matches_transformers(layout, target):
    """Two sequences prefilled into their slots (batch-1 context encoding, continuous batching), 23 teacher-forced
    token-generation steps of both, one of them leaving (an inactive row), then a new sequence joining its slot and
    16 greedy steps: logits at every position within 1e-4 of transformers', greedy tokens equal."""
    ref = load_reference(layout)
    cases = {len(p): (p, torch.from_numpy(l)) for p, l in reference_prompts(ref)}
    long, short = cases[130], cases[63]
    nc = neuron_config(FIXTURES / layout, target)
    with traced_parallel_state(1, nc.logical_nc_config):
        run = XlaGraphs(build_graphs(FIXTURES / layout, nc, load_weights=True))
        starts = {0: 80, 1: 40}
        for slot, (prompt, logits) in ((0, long), (1, short)):
            got = run(CONTEXT, *context_inputs(prompt[: starts[slot]]), [slot])
            torch.testing.assert_close(got[0], logits[starts[slot] - 1], rtol=0, atol=LOGIT_ATOL)
        worst = 0.0
        for step in range(23):
            positions = [starts[0] + step, starts[1] + step]
            got = run(TOKENS, column([long[0][positions[0]], short[0][positions[1]]]), column(positions), [0, 1])
            for row, (_, logits) in enumerate((long, short)):
                torch.testing.assert_close(got[row], logits[positions[row]], rtol=0, atol=LOGIT_ATOL)
                worst = max(worst, (got[row] - logits[positions[row]]).abs().max().item())
        # The short sequence leaves (row 1 inactive); the long one goes on.
        got = run(TOKENS, column([long[0][103], 7]), column([103, 5]), [0, -1])
        torch.testing.assert_close(got[0], long[1][103], rtol=0, atol=LOGIT_ATOL)
        # A new sequence joins slot 1 (context encoding at position 0 resets its states) and decodes greedily.
        prompt, expected = ref["gen_prompt_0"].tolist(), ref["gen_tokens_0"].tolist()
        tokens = [int(run(CONTEXT, *context_inputs(prompt), [1])[0].argmax())]
        position, long_position = len(prompt), 104  # the long one goes on to 119 (< 128)
        for _ in range(16):
            got = run(TOKENS, column([long[0][long_position], tokens[-1]]), column([long_position, position]), [0, 1])
            torch.testing.assert_close(got[0], long[1][long_position], rtol=0, atol=LOGIT_ATOL)
            tokens.append(int(got[1].argmax()))
            position, long_position = position + 1, long_position + 1
        for step, (a, b) in enumerate(zip(tokens, expected)):
            if a != b:
                assert float(ref["gen_margin_0"][step]) < TIE_MARGIN, f"greedy tokens part at step {step}: {a} vs {b}"
                break
    print(f"\n{layout} {target}: XLA CPU run, max |logit - transformers| {worst:.2e} over 46 token-generation rows")


def test_xla_run_in_bf16_keeps_the_recurrent_state_fp32():
    ref = load_reference("tiny-2b")
    prompt, logits = next((p, torch.from_numpy(l)) for p, l in reference_prompts(ref) if len(p) == 63)
    nc = neuron_config(FIXTURES / "tiny-2b", "trn2", dtype=torch.bfloat16)
    with traced_parallel_state(1, nc.logical_nc_config):
        graphs = build_graphs(FIXTURES / "tiny-2b", nc, load_weights=True)
        run = XlaGraphs(graphs)
        got = [run(CONTEXT, *context_inputs(prompt[:40]), [0])[0]]
        for position in range(40, 63):
            got.append(run(TOKENS, column([prompt[position], 0]), column([position, 0]), [0, -1])[0])
        layout = graphs[TOKENS].module.state_layout
        for spec, name in zip(layout.held_specs, run.state):
            assert run.state[name].dtype == spec.dtype == (torch.float32 if "recurrent" in spec.name else torch.bfloat16)
    errors = (torch.stack(got) - logits[39:63]).abs()
    print(f"\nbf16 XLA run: max |logit - transformers fp32| {errors.max():.3f}, mean {errors.mean():.4f}")
    assert errors.max() <= BF16_ATOL
    assert float(errors.mean()) <= float(ref["hf_bf16_mae_3"]), "mean bf16 error above transformers' own bf16 on this prompt"


# ---------------------------------------------------------------------------------------------- padded batches
class TracedGraph:
    """What a wrapper calls: the traced model's forward for one graph (here the XLA run), logits [B, 1, vocab]."""

    def __init__(self, run: XlaGraphs, key: str):
        self.run, self.key = run, key

    def __call__(self, input_ids, position_ids, seq_ids, sampling_params):
        return self.run(self.key, input_ids, position_ids, seq_ids)[:, None]


@pytest.mark.parametrize("wrapper", ["qwen35", "optimum-neuron"])
def test_a_sequence_left_out_of_a_step_keeps_its_state(wrapper):
    """Sequence A decodes in slot 0; B joins slot 1 and decodes beside it; one step runs A alone (B left out: the
    wrapper pads the batch to its compiled size); then B goes on, then A leaves and B runs alone. B's logits must
    stay transformers' at every position. optimum-neuron's own wrapper fills the padding row with slot 1, so the
    step rewrites B's DeltaNet and conv states with A's token: shown to break B, which is why this project's
    wrapper pads with seq_id -1."""
    from optimum.neuron.models.inference.backend.modules.decoder.decoder_wrappers import (
        TOKEN_GENERATION_MODEL_TAG,
        NxDDecoderWrapperForCausalLM,
    )
    from optimum.neuron.models.inference.backend.modules.decoder.modeling_decoder import NxDModelForCausalLM

    from optimum_qwen35.backends.nxd.model import Qwen35DecoderWrapper

    from tests.kit.neuron_xla import export_config

    layout = "tiny-nv2x"
    ref = load_reference(layout)
    cases = {len(p): (p, torch.from_numpy(l)) for p, l in reference_prompts(ref)}
    (a, a_logits), (b, b_logits) = cases[130], cases[63]
    nc = neuron_config(FIXTURES / layout, "trn2")
    cls = Qwen35DecoderWrapper if wrapper == "qwen35" else NxDDecoderWrapperForCausalLM
    with traced_parallel_state(1, nc.logical_nc_config):
        run = XlaGraphs(build_graphs(FIXTURES / layout, nc, load_weights=True))
        tkg = cls(export_config(FIXTURES / layout, nc), NxDModelForCausalLM._create_token_generation_config(nc),
                  TracedGraph(run, TOKENS), TOKEN_GENERATION_MODEL_TAG)

        def step(rows):  # rows: [(slot, token, position)] -> logits [len(rows), vocab]
            slots, ids, positions = zip(*rows)
            return tkg(column(ids), column(positions), torch.tensor(slots, dtype=torch.int32), torch.zeros(len(rows), 3))[:, 0]

        run(CONTEXT, *context_inputs(a[:50]), [0])
        run(CONTEXT, *context_inputs(b[:20]), [1])
        got = step([(0, a[50], 50), (1, b[20], 20)])
        torch.testing.assert_close(got[1], b_logits[20], rtol=0, atol=LOGIT_ATOL)
        got = step([(0, a[51], 51)])  # B left out: the wrapper pads the batch
        torch.testing.assert_close(got[0], a_logits[51], rtol=0, atol=LOGIT_ATOL)
        errors = []
        for i in range(4):  # B goes on beside A, then alone (A has left)
            rows = [(1, b[21 + i], 21 + i)] + ([(0, a[52 + i], 52 + i)] if i < 2 else [])
            errors.append((step(rows)[0] - b_logits[21 + i]).abs().max().item())
    print(f"\n{wrapper} wrapper: B's logits after it was left out of a step, max |error| {max(errors):.2e}")
    if wrapper == "qwen35":
        assert max(errors) <= LOGIT_ATOL
    else:
        assert max(errors) > 100 * LOGIT_ATOL  # its padding row rewrote B's states


# ---------------------------------------------------------------------------------------------- optimum-neuron's loop
@contextlib.contextmanager
def model_on_xla(layout: str, target: str = "trn2"):
    """`Qwen35NxDModelForCausalLM` (the class `from_pretrained` returns for a Neuron target) around the XLA graphs,
    with the graphs' run."""
    from tests.kit.neuron_xla import export_config, model_class

    nc = neuron_config(FIXTURES / layout, target)
    cls = model_class()
    config = export_config(FIXTURES / layout, nc)
    with traced_parallel_state(1, nc.logical_nc_config):
        run = XlaGraphs(build_graphs(FIXTURES / layout, nc, load_weights=True))
        yield cls(config, nc, TracedModel(run), cls.create_graph_builders(config, nc)), run


def test_optimum_neurons_generate_drives_the_graphs():
    """`Qwen35NxDModelForCausalLM` (the class `from_pretrained` returns for a Neuron target) built around the two
    graphs, and optimum-neuron's own `generate` (NxDGenerationMixin: right padding, context encoding row by row
    into the slots, token generation of the batch): greedy tokens of two prompts of different lengths equal
    transformers'."""
    from optimum_qwen35.backends.nxd.model import Qwen35DecoderWrapper

    layout = "tiny-nv3x"
    ref = load_reference(layout)
    prompts = [ref["gen_prompt_0"].tolist(), ref["gen_prompt_1"].tolist()]
    width = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
    with model_on_xla(layout) as (model, _):
        assert isinstance(model.token_generation_model, Qwen35DecoderWrapper)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    for j, prompt in enumerate(prompts):
        tokens, expected = out[j, width:].tolist(), ref[f"gen_tokens_{j}"][:16].tolist()
        if tokens != expected:
            step = next(i for i, (x, y) in enumerate(zip(tokens, expected)) if x != y)
            assert float(ref[f"gen_margin_{j}"][step]) < TIE_MARGIN, f"prompt {j}: greedy tokens part at step {step}"


def test_forward_gives_every_positions_logits_and_leaves_running_sequences_alone():
    """`model(input_ids, attention_mask, labels)` on the class a Neuron export loads as: logits of every position of
    four prompts (lengths 65, 2, 1, 64; left padding) within 1e-4 of transformers' through the per-position logits
    graph, the loss as transformers computes it, and a sequence prefilled before the call decodes on as if nothing
    had run in between."""
    from optimum_qwen35.errors import UsageError

    layout = "tiny-nv3x"
    ref = load_reference(layout)
    cases = {len(p): (p, torch.from_numpy(l)) for p, l in reference_prompts(ref)}
    prompts = [cases[n] for n in (65, 2, 1, 64)]
    width = max(len(p) for p, _ in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p, _ in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in prompts])
    with model_on_xla(layout) as (model, run):
        running, running_logits = cases[63]
        run(CONTEXT, *context_inputs(running[:40]), [0])  # a sequence in slot 0, mid-way
        labels = ids.masked_fill(mask == 0, -100)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        worst = 0.0
        for row, (prompt, logits) in enumerate(prompts):
            got = out.logits[row, width - len(prompt):]
            torch.testing.assert_close(got, logits, rtol=0, atol=LOGIT_ATOL)
            assert not out.logits[row, : width - len(prompt)].any()
            worst = max(worst, (got - logits).abs().max().item())
        expected = torch.nn.functional.cross_entropy(
            out.logits[:, :-1].reshape(-1, out.logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        torch.testing.assert_close(out.loss, expected)
        for position in range(40, 63):  # slot 0 goes on undisturbed
            got = run(TOKENS, column([running[position], 0]), column([position, 0]), [0, -1])[0]
            torch.testing.assert_close(got, running_logits[position], rtol=0, atol=LOGIT_ATOL)
        with pytest.raises(UsageError, match="longer than the compiled context length"):
            model(input_ids=torch.zeros(1, SEQUENCE_LENGTH + 1, dtype=torch.long))
    print(f"\nforward() on the logits graph: max |logit - transformers| {worst:.2e} over {sum(len(p) for p, _ in prompts)} positions")
