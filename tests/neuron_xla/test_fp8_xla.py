"""The NxD export's graphs with FP8 weights (backends/nxd/fp8.py, docs/fp8.md), built as the export builds them,
lowered and run on the XLA CPU device.

- Each quantized weight is an F8E4M3FN parameter of the graph with its f32 scale, dequantized beside its matmul; the
  routed experts' float8 rows are gathered before they are dequantized (token generation reads the chosen experts
  only); every float8 weight a rank loads is within float8_e4m3's 240 (what trn1 / inf2 / trn2 compute with the
  compile flag the export adds).
- The graphs keep the compiler contract at TP 1 and 2, dense (96 / 192 dims: partial blocks, split blocks) and MoE.
- Run at TP 1 (fp32 activations): logits follow the eager FP8-weight model of the same checkpoint (its weights not
  fitted to 240: the fitting's own change is measured in tests/test_fp8.py), greedy tokens equal; and the same
  checkpoint exported without FP8 weights (way (a): dequantized at load by the NxD conversion) agrees.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from optimum_qwen35.backends.nxd import adapter, hlo_contract
from optimum_qwen35.tiny.fp8 import build_tiny_fp8_checkpoint
from tests.kit.neuron_xla import (
    CONTEXT, LOGITS, TOKENS, XlaGraphs, build_graphs, lower, neuron_config, traced_parallel_state,
)

from ..conftest import FIXTURES
from .test_neuron_graphs import column, context_inputs

FIXTURES_2B = FIXTURES / "tiny-2b"

# fp32 activations, as tests/test_parity.py (the graphs hold weights fitted to 240, the eager model not)
FP8_LOGIT_ATOL = 1e-4


@pytest.fixture(scope="module")
def fp8_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return {layout: build_tiny_fp8_checkpoint(root / layout, layout) for layout in ("tiny-2b", "tiny-moe", "tiny-nv3x")}


def _float8_inputs(hlo: dict) -> list[dict]:
    entry = next(c for c in hlo["computations"] if c["id"] == hlo["entryComputationId"])
    return [i for i in entry["instructions"] if i["opcode"] == "parameter" and i["shape"]["elementType"] == "F8E4M3FN"]


def _whole_expert_converts(hlo: dict) -> list[str]:
    """Converts of a whole rank-3 float8 parameter (every expert dequantized): none where rows are gathered first."""
    entry = next(c for c in hlo["computations"] if c["id"] == hlo["entryComputationId"])
    experts = {i["id"] for i in _float8_inputs(hlo) if len(i["shape"].get("dimensions", [])) == 3}
    return [i["name"] for i in entry["instructions"] if i["opcode"] == "convert" and set(i.get("operandIds", [])) & experts]


CONTRACT_CASES = [("tiny-moe", 1, torch.float32), ("tiny-moe", 2, torch.bfloat16), ("tiny-nv3x", 2, torch.bfloat16)]


@pytest.mark.parametrize(("layout", "tp", "dtype"), CONTRACT_CASES,
                         ids=[f"{l}-tp{t}-{str(d)[6:]}" for l, t, d in CONTRACT_CASES])
def test_fp8_weight_graphs_hold_float8_and_keep_the_contract(reference, fp8_folders, layout, tp, dtype):
    folder = fp8_folders[layout]
    nc = neuron_config(folder, "trn2", tp, dtype)
    with traced_parallel_state(tp, nc.logical_nc_config):
        # Rank 0's tensors loaded: each float8 shard and scale has its parameter's shape at this degree.
        graphs = build_graphs(folder, nc, load_weights=True, fp8_weights=True)
        failures = {}
        for key, graph in graphs.items():
            lowered = lower(graph)
            hlo = lowered.hlo
            float8 = _float8_inputs(hlo)
            assert float8, f"{key}: no float8 weight among the graph's inputs"
            if key != LOGITS:
                assert all(i >= 0 for i in lowered.parameter_ids.values())  # every held state still aliased
            if key == TOKENS and "moe" in layout and tp == 1:
                # (the gathered form: 2 rows x top-2 < 6 experts; at TP 2 a rank's 3 take the all-experts form)
                assert not _whole_expert_converts(hlo), "token generation dequantizes every expert"
            print(f"\n{layout} tp{tp} {str(dtype)[6:]} {key}: {len(float8)} float8 inputs, "
                  f"{hlo_contract.dtype_census(hlo)}")
            found = hlo_contract.violations(hlo, reference)
            if found:
                failures[key] = found[:20]
    assert not failures, json.dumps(failures, indent=1)


@pytest.mark.parametrize("layout", ["tiny-2b", "tiny-moe"])
def test_fp8_weight_graphs_on_xla_follow_the_eager_fp8_model(fp8_folders, layout):
    """A 40-token prompt, then 12 greedy steps beside a second sequence: logits within 1e-4 of the eager model holding
    the checkpoint's float8 weights (fp32 activations), greedy tokens equal; the same graphs without FP8 weights
    (the checkpoint dequantized by the NxD conversion: way (a)) within the same bound."""
    from optimum_qwen35.runtime import Qwen35Runtime
    from optimum_qwen35.runtime.eager import load_decoder

    folder = fp8_folders[layout]
    eager = Qwen35Runtime.from_decoder(load_decoder(folder, torch.float32, weights_dtype="fp8"), max_length=128)
    prompt, other = list(range(5, 45)), list(range(60, 70))
    expected = eager.generate([prompt], max_new_tokens=13)[0]
    expected_logits = eager.logits([prompt + expected[:-1]])[0][len(prompt) - 1 :]
    nc = neuron_config(folder, "trn2", 1, torch.float32)
    worst = {}
    for fp8_weights in (True, False):
        with traced_parallel_state(1, nc.logical_nc_config):
            graphs = build_graphs(folder, nc, load_weights=True, fp8_weights=fp8_weights)
            if fp8_weights:
                weights = [p for g in graphs.values() for p in g.module.parameters() if p.dtype == torch.float8_e4m3fn]
                assert weights and max(float(p.cpu().float().abs().max()) for p in weights) <= 240
            run = XlaGraphs(graphs)
            run(CONTEXT, *context_inputs(other), [1])
            got = [run(CONTEXT, *context_inputs(prompt), [0])[0]]
            tokens = [int(got[0].argmax())]
            for step in range(12):
                out = run(TOKENS, column([tokens[-1], other[-1]]), column([len(prompt) + step, len(other) + step]), [0, 1])
                got.append(out[0])
                tokens.append(int(out[0].argmax()))
        errors = (torch.stack(got).detach() - expected_logits).abs()
        worst[fp8_weights] = float(errors.max())
        assert tokens == expected, f"fp8_weights={fp8_weights}: {tokens} vs eager {expected}"
        assert worst[fp8_weights] <= FP8_LOGIT_ATOL
    print(f"\n{layout}: max |logit - eager FP8 model| {worst[True]:.2e} (float8 weights), {worst[False]:.2e} (dequantized)")


def test_fp8_lm_head_graphs_follow_the_eager_model(tmp_path, reference):
    """`fp8_lm_head` on a tied bf16 checkpoint (tiny-2b), quantized as the runtime reads it (`QuantizingReader`):
    at TP 2 the logits graph holds lm_head as a float8 parameter split by vocabulary, beside the bf16 embedding, and
    the graphs keep the contract; at TP 1 a prompt and 8 greedy steps follow the eager FP8-weight model of
    `quantize_checkpoint(..., lm_head=True)`'s folder within 1e-4 (fp32 activations), greedy tokens equal."""
    from optimum_qwen35.checkpoint.quantize import quantize_checkpoint
    from optimum_qwen35.runtime import Qwen35Runtime
    from optimum_qwen35.runtime.eager import load_decoder

    nc = neuron_config(FIXTURES_2B, "trn2", 2, torch.bfloat16)
    with traced_parallel_state(2, nc.logical_nc_config):
        graphs = build_graphs(FIXTURES_2B, nc, load_weights=True, fp8_weights=True, fp8_lm_head=True)
        head = graphs[LOGITS].module.get_submodule("lm_head")
        assert head.parametrizations.weight.original.dtype == torch.float8_e4m3fn
        assert head.parametrizations.weight.original.shape[0] == 256  # 512 ids over 2 ranks
        for key, graph in graphs.items():
            assert not hlo_contract.violations(lower(graph).hlo, reference), key
    eager = Qwen35Runtime.from_decoder(load_decoder(quantize_checkpoint(FIXTURES_2B, tmp_path / "q", lm_head=True),
                                                    torch.float32, weights_dtype="fp8"), max_length=128)
    prompt = list(range(5, 45))
    expected = eager.generate([prompt], max_new_tokens=9)[0]
    expected_logits = eager.logits([prompt + expected[:-1]])[0][len(prompt) - 1 :]
    nc = neuron_config(FIXTURES_2B, "trn2", 1, torch.float32)
    with traced_parallel_state(1, nc.logical_nc_config):
        run = XlaGraphs(build_graphs(FIXTURES_2B, nc, load_weights=True, fp8_weights=True, fp8_lm_head=True))
        got = [run(CONTEXT, *context_inputs(prompt), [0])[0]]
        tokens = [int(got[0].argmax())]
        for step in range(8):
            got.append(run(TOKENS, column([tokens[-1]]), column([len(prompt) + step]), [0])[0])
            tokens.append(int(got[-1].argmax()))
    worst = float((torch.stack(got).detach() - expected_logits).abs().max())
    print(f"\ntiny-2b, lm_head in FP8: max |logit - eager FP8 model| {worst:.2e}")
    assert tokens == expected and worst <= FP8_LOGIT_ATOL


def test_an_fp8_export_compiles_with_the_e4m3_flag():
    flags = adapter.compiler_args("trn2", 2, fp8_weights=True).split()
    assert adapter.FP8_COMPILER_FLAG in flags and adapter.FP8_COMPILER_FLAG not in adapter.compiler_args("trn2", 2).split()
    from optimum_qwen35.backends.nxd.model import Qwen35NxDFp8ModelForCausalLM, Qwen35NxDModelForCausalLM

    nc = neuron_config(FIXTURES_2B, "trn1", 1, torch.bfloat16)
    assert adapter.FP8_COMPILER_FLAG in Qwen35NxDFp8ModelForCausalLM.get_compiler_args(nc)
    assert adapter.FP8_COMPILER_FLAG not in Qwen35NxDModelForCausalLM.get_compiler_args(nc)


def test_the_export_entry_point_hands_the_nxd_class_the_float8_weights(monkeypatch, fp8_folders):
    """`export(..., weights_dtype="fp8")` for trn2 (NxD): the config the NxD class builds its graphs from names the
    checkpoint's float8 weights, and the graphs compile with the E4M3 flag; it stops where the closed SDK starts."""
    import neuron_sdk_standin
    from optimum.neuron.models.inference.backend import pretrained_model
    from optimum.neuron.models.inference.backend.pretrained_model import NxDPreTrainedModel

    from optimum_qwen35.backends.nxd.fp8 import fp8_export, fp8_weight_names
    from optimum_qwen35.config import Qwen35Config
    from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM

    folder = fp8_folders["tiny-2b"]
    seen = {}

    def compile(neuron_config, graph_builders, compiler_args, debug=False):
        seen["config"] = next(iter(graph_builders.values())).config
        seen["compiler_args"] = compiler_args
        raise neuron_sdk_standin.NeuronSDKUnavailable("torch_neuronx.xla_impl.trace.generate_hlo (stopped by the test)")

    monkeypatch.setattr(NxDPreTrainedModel, "compile", staticmethod(compile))
    # (the compile cache is the SDK's first closed call, entered before the graphs are built: test_entry_points.py)
    monkeypatch.setattr(pretrained_model, "hub_neuronx_cache", lambda entry=None: contextlib.nullcontext())
    nc = neuron_config(folder, "trn2", 1, torch.bfloat16)
    with pytest.raises(neuron_sdk_standin.NeuronSDKUnavailable):
        Qwen35NeuronModelForCausalLM.export(str(folder), neuron_config=nc, weights_dtype="fp8")
    assert fp8_export(seen["config"]) == fp8_weight_names(folder, Qwen35Config.from_pretrained(folder))
    assert adapter.FP8_COMPILER_FLAG in seen["compiler_args"].split()


def test_each_rank_of_an_fp8_export_loads_the_traced_modules_tensors(fp8_folders, tmp_path):
    """What the NxD class loads from an FP8 checkpoint folder (and `shard_checkpoint` writes), at TP 2, with the MTP
    head: every rank holds exactly the tensors the traced module takes, each of its shape and dtype (float8 weights,
    float32 scales, the head dequantized to the model dtype); an export's folder naming its float8 weights is loaded
    by the class that compiles with the E4M3 flag."""
    from optimum_qwen35.backends.nxd.model import Qwen35NxDFp8ModelForCausalLM
    from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM
    from tests.kit.neuron_xla import export_config, model_class

    folder = fp8_folders["tiny-2b"]
    nc = neuron_config(folder, "trn2", tp=2, dtype=torch.bfloat16)
    config = export_config(folder, nc, max_speculative_tokens=2, fp8_weights=True)
    cls = model_class()
    with traced_parallel_state(2, nc.logical_nc_config):
        builders = cls.create_graph_builders(config, nc)
        instance = builders[CONTEXT].get_model_instance()
        instance.load_module()
        expected = {n: (tuple(t.shape), t.dtype) for n, t in instance.module.state_dict().items()
                    if not n.startswith("past_key_values.") and not n.endswith(".master_weight")}
        ranks = cls(config, nc, None, builders)._rank_state_dicts(str(folder))
    assert len(ranks) == 2 and any(d == torch.float8_e4m3fn for _, d in expected.values())
    for tensors in ranks:
        assert {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()} == expected
    assert any(n.startswith("mtp.") for n in expected) and all(
        d == torch.bfloat16 for n, (_, d) in expected.items() if n.startswith("mtp.") and n.endswith("proj.weight"))
    config.save_pretrained(tmp_path)
    assert Qwen35NeuronModelForCausalLM._nxd_model_class(tmp_path, nc) is Qwen35NxDFp8ModelForCausalLM
