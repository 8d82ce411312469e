"""The MoE models' Neuron graphs (neuronx-distributed's `Experts` and `SharedExperts` in the block, neuron/layers.py),
built as the export builds them for trn2 at TP 1, lowered and run on the XLA CPU device against the CPU model
(`runtime/cpu.py`, the same checkpoint) and transformers' recorded logits.

Context encoding routes 40 to 80 tokens (N k >= the experts): the dense form, every token through every expert (NxD's
all-experts path); token generation routes 2 rows (2 k < the experts): the gathered form, the chosen experts' weights
gathered (NxD's selective loading, `expert_indices`). fp32 against the CPU model and transformers at 1e-4; bf16
against transformers' own bf16 error; optimum-neuron's `generate` through the NxD class. The compiler contract of the same graphs at TP 1 and 2 is
checked in test_hlo_contract.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.kit import TINY_MOE_LAYOUTS
from tests.kit.neuron_xla import CONTEXT, TOKENS, XlaGraphs, build_graphs, neuron_config, traced_parallel_state

from ..conftest import FIXTURES, load_reference, reference_prompts
from .test_neuron_graphs import BF16_ATOL, LOGIT_ATOL, SEQUENCE_LENGTH, TIE_MARGIN, column, context_inputs


def assert_nxd_moe_modules(graphs) -> None:
    """Every MoE layer of every graph holds neuronx-distributed's modules (not the CPU block's)."""
    from neuronx_distributed.modules.moe.experts import Experts
    from neuronx_distributed.modules.moe.shared_experts import SharedExperts

    for graph in graphs.values():
        for layer in graph.module.layers:
            assert isinstance(layer.mlp.experts, Experts) and isinstance(layer.mlp.shared_expert, SharedExperts)


@pytest.mark.parametrize("layout", TINY_MOE_LAYOUTS)
def test_moe_graphs_on_xla_match_the_cpu_model(layout):
    """Two sequences prefilled into their slots, 20 teacher-forced token-generation steps of both, then a new
    sequence in slot 1 decoding 16 greedy steps beside the first: logits within 1e-4 of the CPU model's and of
    transformers' at every position, greedy tokens equal to the CPU model's and transformers'."""
    from optimum_qwen35.runtime import Qwen35Runtime

    ref = load_reference(layout)
    cases = {len(p): (p, torch.from_numpy(l)) for p, l in reference_prompts(ref)}
    (long, long_hf), (short, short_hf) = cases[130], cases[63]
    cpu = Qwen35Runtime.from_pretrained(FIXTURES / layout, max_length=SEQUENCE_LENGTH)
    long_cpu, short_cpu = cpu.logits([long[:SEQUENCE_LENGTH], short])
    prompt = ref["gen_prompt_0"].tolist()
    cpu_tokens = cpu.generate([prompt], max_new_tokens=17)[0]
    nc = neuron_config(FIXTURES / layout, "trn2")
    worst_cpu = worst_hf = 0.0

    def check(got, cpu_logits, hf_logits):
        nonlocal worst_cpu, worst_hf
        torch.testing.assert_close(got, cpu_logits, rtol=0, atol=LOGIT_ATOL)
        torch.testing.assert_close(got, hf_logits, rtol=0, atol=LOGIT_ATOL)
        worst_cpu = max(worst_cpu, (got - cpu_logits).abs().max().item())
        worst_hf = max(worst_hf, (got - hf_logits).abs().max().item())

    with traced_parallel_state(1, nc.logical_nc_config):
        graphs = build_graphs(FIXTURES / layout, nc, load_weights=True)
        assert_nxd_moe_modules(graphs)
        run = XlaGraphs(graphs)
        starts = {0: 80, 1: 40}
        for slot, (seq, cpu_logits, hf_logits) in ((0, (long, long_cpu, long_hf)), (1, (short, short_cpu, short_hf))):
            got = run(CONTEXT, *context_inputs(seq[: starts[slot]]), [slot])
            check(got[0], cpu_logits[starts[slot] - 1], hf_logits[starts[slot] - 1])
        for step in range(20):
            positions = [starts[0] + step, starts[1] + step]
            got = run(TOKENS, column([long[positions[0]], short[positions[1]]]), column(positions), [0, 1])
            check(got[0], long_cpu[positions[0]], long_hf[positions[0]])
            check(got[1], short_cpu[positions[1]], short_hf[positions[1]])
        # A new sequence in slot 1 (context encoding at position 0 resets its states), greedy beside the long one.
        tokens = [int(run(CONTEXT, *context_inputs(prompt), [1])[0].argmax())]
        position, long_position = len(prompt), 100
        for _ in range(16):
            got = run(TOKENS, column([long[long_position], tokens[-1]]), column([long_position, position]), [0, 1])
            check(got[0], long_cpu[long_position], long_hf[long_position])
            tokens.append(int(got[1].argmax()))
            position, long_position = position + 1, long_position + 1
    assert tokens == cpu_tokens, f"XLA {tokens} vs CPU model {cpu_tokens}"
    for step, (a, b) in enumerate(zip(tokens, ref["gen_tokens_0"].tolist())):
        if a != b:
            assert float(ref["gen_margin_0"][step]) < TIE_MARGIN, f"greedy tokens part from transformers' at step {step}"
            break
    print(f"\n{layout}: XLA CPU run, max |logit - CPU model| {worst_cpu:.2e}, max |logit - transformers| {worst_hf:.2e}")


@pytest.mark.parametrize("layout", TINY_MOE_LAYOUTS)
def test_moe_graphs_in_bf16_on_xla(layout):
    """bf16 weights (router fp32): 40 prompt tokens, then 23 decode steps, against transformers' fp32 logits: within
    0.25 everywhere, mean error no worse than transformers' own bf16 model on the same prompt."""
    ref = load_reference(layout)
    index, (prompt, logits) = next((i, (p, torch.from_numpy(l))) for i, (p, l) in enumerate(reference_prompts(ref))
                                   if len(p) == 63)
    nc = neuron_config(FIXTURES / layout, "trn2", dtype=torch.bfloat16)
    with traced_parallel_state(1, nc.logical_nc_config):
        graphs = build_graphs(FIXTURES / layout, nc, load_weights=True)
        router = graphs[TOKENS].module.layers[0].mlp.gate.weight
        assert router.dtype == torch.float32  # the routing decision is made on fp32 logits
        run = XlaGraphs(graphs)
        got = [run(CONTEXT, *context_inputs(prompt[:40]), [0])[0]]
        for position in range(40, 63):
            got.append(run(TOKENS, column([prompt[position], 0]), column([position, 0]), [0, -1])[0])
    errors = (torch.stack(got) - logits[39:63]).abs()
    print(f"\n{layout} bf16 XLA run: max |logit - transformers fp32| {errors.max():.3f}, mean {errors.mean():.4f} "
          f"(transformers' bf16 over the prompt: {float(ref[f'hf_bf16_mae_{index}']):.4f})")
    assert errors.max() <= BF16_ATOL
    assert float(errors.mean()) <= float(ref[f"hf_bf16_mae_{index}"])


def test_optimum_neurons_generate_drives_the_moe_graphs():
    """`Qwen35NxDModelForCausalLM` (the class `from_pretrained` returns for a Neuron target) around the MoE graphs,
    optimum-neuron's own `generate` (right padding, context encoding row by row, token generation of the batch):
    16 greedy tokens of two prompts of different lengths equal the CPU model's."""
    from optimum_qwen35.runtime import Qwen35Runtime
    from tests.kit.neuron_xla import TracedModel, export_config, model_class

    layout = "tiny-moe"
    ref = load_reference(layout)
    prompts = [ref["gen_prompt_0"].tolist(), ref["gen_prompt_1"].tolist()]
    expected = Qwen35Runtime.from_pretrained(FIXTURES / layout, max_length=SEQUENCE_LENGTH).generate(prompts, 16)
    width = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
    nc = neuron_config(FIXTURES / layout, "trn2")
    cls, config = model_class(), export_config(FIXTURES / layout, nc)
    with traced_parallel_state(1, nc.logical_nc_config):
        run = XlaGraphs(build_graphs(FIXTURES / layout, nc, load_weights=True))
        model = cls(config, nc, TracedModel(run), cls.create_graph_builders(config, nc))
        out = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    assert out[:, width:].tolist() == expected


def test_blocked_prompt_form_on_xla_matches_transformers(monkeypatch):
    """Context encoding in the blocked form (the routed work only: `modeling.moe.routed_blocks`, 16-row blocks so
    that the tiny experts take it: 160 pairs -> 15 blocks, 240 rows < 480 dense rows), fp32 at TP 1 on the XLA CPU
    device: the prompt's logits within 1e-4 of transformers' (the dense form's tolerance), for two prompt lengths
    and in two slots; the graph calls neuronx-distributed's Experts once per block set."""
    from optimum_qwen35.backends.nxd.layers import RoutedExperts
    from optimum_qwen35.modeling import moe

    monkeypatch.setattr(moe, "ROUTED_BLOCK", 16)
    calls = []
    original = RoutedExperts.blocks
    monkeypatch.setattr(RoutedExperts, "blocks", lambda self, *a: calls.append(a[0].shape) or original(self, *a))
    layout = "tiny-moe"
    ref = load_reference(layout)
    cases = {len(p): (p, torch.from_numpy(l)) for p, l in reference_prompts(ref)}
    nc = neuron_config(FIXTURES / layout, "trn2")
    worst = 0.0
    with traced_parallel_state(1, nc.logical_nc_config):
        graphs = build_graphs(FIXTURES / layout, nc, load_weights=True)
        assert all(layer.mlp.block_size == 16 for layer in graphs[CONTEXT].module.layers)
        run = XlaGraphs(graphs)
        for slot, (length, prompt_length) in enumerate(((130, 80), (63, 40))):
            seq, hf = cases[length]
            got = run(CONTEXT, *context_inputs(seq[:prompt_length]), [slot])[0]
            torch.testing.assert_close(got, hf[prompt_length - 1], rtol=0, atol=LOGIT_ATOL)
            worst = max(worst, (got - hf[prompt_length - 1]).abs().max().item())
    assert calls and all(shape[1] == 16 for shape in calls), calls
    print(f"\n{layout} blocked prompt form on XLA: {calls[0][0]} blocks of 16 rows, max |logit - transformers| {worst:.2e}")
