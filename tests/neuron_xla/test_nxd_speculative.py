"""The NxD export made with mtp=True (issue 39): its speculative-decoding graphs built exactly as the export builds
them (`create_graph_builders` -> builders -> model instances -> `get`: the decoder with the MTP head, the held state
and its aliases), lowered, and run on torch-xla's CPU device behind a stand-in of neuronx-distributed's runtime that
routes each call by its inputs' shapes (`tests.kit.neuron_xla.ShapeRoutedModel`), driven by the host loop
(`backends/nxd/runner.py` `NxDGraphs`) and by `Qwen35NxDModelForCausalLM.generate(num_speculative_tokens=k)`.

What does not run here: neuronx-cc, the Neuron runtime (its state allocation and aliasing are modelled, not run), a
device, TP 2 numbers (the XLA CPU client has one device: TP 2 graphs are lowered, not run).
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from tests.kit import hlo_contract
from tests.kit.neuron_xla import (
    CONTEXT, LOGITS, TOKENS, ShapeRoutedModel, build_graphs, export_config, lower, model_class, neuron_config,
    traced_parallel_state,
)

from ..conftest import FIXTURES

K = 4  # the export's most drafts per round (export/compile.py MTP_MAX_SPECULATIVE_TOKENS)
SPECULATIVE = ["context_hidden", "verify", "commit", "mtp_draft", "mtp_catch_up", "mtp_prompt"]
# Outputs before the held state (backends/nxd/model.py SPECULATIVE_OUTPUTS).
FIRST_STATE_OUTPUT = {CONTEXT: 1, TOKENS: 1, "context_hidden": 2, "verify": 2, "commit": 1, "mtp_draft": 2,
                      "mtp_catch_up": 2, "mtp_prompt": 2}
CASES = [(1, torch.float32), (1, torch.bfloat16), (2, torch.float32), (2, torch.bfloat16)]


@pytest.mark.parametrize(("tp", "dtype"), CASES, ids=[f"tp{tp}-{str(d)[6:]}" for tp, d in CASES])
def test_every_graph_of_an_mtp_export_aliases_all_its_held_state_and_keeps_the_contract(reference, tp, dtype):
    """Each graph of the export (tiny-nv3x, trn2, batch 2): every held state (the decoder's, verify's per-position
    DeltaNet states, the head's K/V cache) is an HLO parameter aliased to its own output, after the graph's own
    outputs; the held dtypes survive optimum-neuron's load-time cast; no violation of the compiler contract."""
    nc = neuron_config(FIXTURES / "tiny-nv3x", "trn2", tp, dtype)
    failures, counts = {}, {}
    with traced_parallel_state(tp, nc.logical_nc_config):
        graphs = build_graphs(FIXTURES / "tiny-nv3x", nc, max_speculative_tokens=K)
        assert sorted(graphs) == sorted([CONTEXT, TOKENS, LOGITS, *SPECULATIVE])
        for key, graph in graphs.items():
            module = graph.module
            held = module.held_specs
            lowered = lower(graph)
            counts[key] = lowered.instruction_count
            if key == LOGITS:
                assert graph.alias_names == {} and not [n for n, i in lowered.parameter_ids.items() if i >= 0]
            else:
                first = FIRST_STATE_OUTPUT[key]
                # decoder state, then the verified states (2 per DeltaNet layer), then the head's K and V
                assert len(held) == len(module.state_layout.specs) + 2 * len(module.config.linear_layers) + 2
                assert lowered.num_outputs == first + len(held)
                assert sorted(graph.alias_names.values()) == list(range(first, first + len(held)))
                unresolved = sorted(n for n, i in lowered.parameter_ids.items() if i < 0)
                assert not unresolved, f"{key}: aliases that do not resolve: {unresolved}"
                assert len(set(lowered.parameter_ids.values())) == len(held)
                params = dict(module.named_parameters())
                for j, spec in enumerate(held):
                    assert params[f"past_key_values.{j}"].dtype == spec.dtype, (key, spec.name)
            found = hlo_contract.violations(lowered.hlo, reference)
            if found:
                failures[key] = found[:20]
    print(f"\nmtp export tp{tp} {str(dtype)[6:]}: HLO instructions {counts}")
    assert not failures, json.dumps(failures, indent=1)


def test_without_mtp_the_export_has_no_speculative_graphs_or_state():
    nc = neuron_config(FIXTURES / "tiny-nv3x", "trn2")
    with traced_parallel_state(1, nc.logical_nc_config):
        graphs = build_graphs(FIXTURES / "tiny-nv3x", nc)
    assert sorted(graphs) == sorted([CONTEXT, TOKENS, LOGITS])
    module = graphs[CONTEXT].module
    assert module.mtp is None and module.held_specs == module.state_layout.held_specs


def test_each_rank_of_an_mtp_export_loads_its_share_of_the_head():
    """What the NxD class loads from a checkpoint folder (and `shard_checkpoint` writes), `_rank_state_dicts`, at
    TP 2: every rank holds exactly the tensors the traced module takes, the head's included, each of the module's
    shape; the head's layer split as the main layers (the ranks' query heads differ), its fc whole on both ranks."""
    folder = FIXTURES / "tiny-2b"
    nc = neuron_config(folder, "trn2", tp=2)
    config = export_config(folder, nc, max_speculative_tokens=K)
    cls = model_class()
    with traced_parallel_state(2, nc.logical_nc_config):
        builders = cls.create_graph_builders(config, nc)
        instance = builders[CONTEXT].get_model_instance()
        instance.load_module()
        expected = {n: tuple(t.shape) for n, t in instance.module.state_dict().items()
                    if not n.startswith("past_key_values.") and not n.endswith(".master_weight")}
        ranks = cls(config, nc, None, builders)._rank_state_dicts(str(folder))
    assert len(ranks) == 2 and any(n.startswith("mtp.") for n in expected)
    for tensors in ranks:
        assert {n: tuple(t.shape) for n, t in tensors.items()} == expected
    q = "mtp.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(ranks[0][q], ranks[1][q])
    assert torch.equal(ranks[0]["mtp.fc.weight"], ranks[1]["mtp.fc.weight"])


@pytest.fixture(scope="module")
def fitted(fitted_tiny_2b):
    """tiny-2b with an MTP head fitted to its own model (optimum_qwen35/tiny/mtp_fit.py) and two in-sample prompts (15 and 20
    tokens), as tests/neuron_xla/test_speculative_xla.py takes them."""
    folder = fitted_tiny_2b
    prompts = json.loads((folder / "mtp_fit.json").read_text())["prompts"][:2]
    return folder, [prompts[0][:15], (prompts[1] * 3)[:20]]


def test_greedy_speculation_through_the_nxd_export_graphs_equals_greedy_decoding(fitted):
    """The export's graphs (tiny-2b with the fitted head, trn2, TP 1, fp32, batch 2, sequence length 64) behind the
    shape-routing runtime stand-in: the host loop's greedy speculative decoding (`NxDGraphs`) equals plain greedy
    decoding through the same graphs for k = 1..4, with drafts accepted; `Qwen35NxDModelForCausalLM.generate(...,
    num_speculative_tokens=k)` equals optimum-neuron's own greedy `generate` on them."""
    from optimum_qwen35.backends.nxd.runner import nxd_runtime

    folder, prompts = fitted
    new = 14
    nc = neuron_config(folder, "trn2", sequence_length=64)
    config = export_config(folder, nc, max_speculative_tokens=K)
    started = time.monotonic()
    with traced_parallel_state(1, nc.logical_nc_config):
        traced = ShapeRoutedModel(build_graphs(folder, nc, load_weights=True, max_speculative_tokens=K))
        runtime = nxd_runtime(traced, config, nc)
        expected = runtime.generate(prompts, max_new_tokens=new)
        lengths = {}
        for k in (1, 2, 3, 4):
            assert runtime.generate(prompts, max_new_tokens=new, num_speculative_tokens=k) == expected, f"k={k}"
            lengths[k] = round(runtime.speculation.acceptance_length, 2)
            assert lengths[k] > 1.2, (k, runtime.speculation.accepted_per_round)  # drafts are accepted
        assert traced.runs["verify"] == traced.runs["commit"] > 0
        assert traced.runs["mtp_prompt"] == 2 * 4 and traced.runs["context_hidden"] == 2 * 4  # one row per call

        cls = model_class()
        model = cls(config, nc, traced, cls.create_graph_builders(config, nc))
        width = max(map(len, prompts))
        # Right padding: optimum-neuron's own loop refuses left padding.
        ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
        mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
        plain = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
        speculative = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, num_speculative_tokens=3)
        assert plain[:, width:].tolist() == expected  # (both loops append the new tokens after the padded batch)
        assert torch.equal(speculative, plain)
        assert model._host_runtime().speculation.acceptance_length > 1.2
    print(f"\nNxD export graphs, greedy speculative == greedy; acceptance length per k: {lengths}; "
          f"graph runs {dict(traced.runs)}; {time.monotonic() - started:.0f} s")


def test_speculative_generate_on_an_export_without_mtp_is_one_line():
    """`num_speculative_tokens=k` on an NxD export made without mtp=True: the host loop's one-line error (nothing
    runs: the graphs are never called)."""
    from optimum_qwen35.backends.nxd.runner import nxd_runtime
    from optimum_qwen35.errors import IncompatibleExportError

    nc = neuron_config(FIXTURES / "tiny-2b", "trn2", sequence_length=64)
    runtime = nxd_runtime(lambda *inputs: pytest.fail("a graph ran"), export_config(FIXTURES / "tiny-2b", nc), nc)
    with pytest.raises(IncompatibleExportError, match="mtp=True"):
        runtime.generate([[1, 2, 3]], max_new_tokens=4, num_speculative_tokens=2)
