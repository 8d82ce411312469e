"""The compiler contract (`tests.kit.hlo_contract`) on every graph the export builds, and the check
itself on graphs made to break it.

- The reference census: optimum-neuron 0.4.5's own Qwen3 and Llama NxD graphs (context encoding, token generation),
  tiny configs, TP 1 and 2, fp32 and bf16, lowered on the same path as ours (their two closed SDK calls as the
  HLO they emit: `closed_ops_as_torch`), computed once per session.
- Every graph of a vision export of the nv = 3 nk layout (context encoding, token generation, the per-position
  logits graph, two vision buckets, image context encoding, image token generation) at TP 1 and 2, fp32 and bf16:
  no violation.
- The check fails on a rank-5 tensor, an f64 constant, an s64 outside the allowlist and an opcode outside the
  census, each in a tiny graph lowered by torch-xla, and passes a clean one.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch_xla

from tests.kit import hlo_contract
from tests.kit.neuron_xla import CONTEXT, build_graphs, lower, neuron_config, traced_parallel_state

from ..conftest import FIXTURES

CASES = [(1, torch.float32), (1, torch.bfloat16), (2, torch.float32), (2, torch.bfloat16)]
IDS = [f"tp{tp}-{str(d)[6:]}" for tp, d in CASES]


@pytest.mark.parametrize(("tp", "dtype"), CASES, ids=IDS)
def test_every_graph_of_the_export_keeps_the_contract(reference, tp, dtype):
    nc = neuron_config(FIXTURES / "tiny-nv3x", "trn2", tp, dtype)
    with traced_parallel_state(tp, nc.logical_nc_config):
        graphs = build_graphs(FIXTURES / "tiny-nv3x", nc, image_buckets=[32, 128])
        assert len(graphs) == 7
        failures = {}
        for key, graph in graphs.items():
            hlo = lower(graph).hlo
            print(f"\ntp{tp} {str(dtype)[6:]} {key}: {hlo_contract.dtype_census(hlo)}")
            found = hlo_contract.violations(hlo, reference)
            if found:
                failures[key] = found[:20]
    assert not failures, json.dumps(failures, indent=1)


MOE_CASES = [("tiny-moe", 1, torch.float32), ("tiny-moe", 2, torch.bfloat16), ("tiny-moe-top1", 1, torch.bfloat16),
             ("tiny-moe-top1", 2, torch.float32)]


@pytest.mark.parametrize(("layout", "tp", "dtype"), MOE_CASES, ids=[f"{l}-tp{t}-{str(d)[6:]}" for l, t, d in MOE_CASES])
def test_the_moe_graphs_keep_the_contract(reference, layout, tp, dtype):
    """The three text graphs of the MoE layouts (neuronx-distributed's Experts / SharedExperts; at TP 2 the experts
    split whole, 3 and 2 a rank): no violation. What the contract allows them beyond the dense graphs: the router's
    torch.topk (a sort, in the census of optimum-neuron's own Qwen3-MoE graphs) and its indices' s64 round trip."""
    nc = neuron_config(FIXTURES / layout, "trn2", tp, dtype)
    with traced_parallel_state(tp, nc.logical_nc_config):
        graphs = build_graphs(FIXTURES / layout, nc)
        failures = {}
        for key, graph in graphs.items():
            hlo = lower(graph).hlo
            print(f"\n{layout} tp{tp} {str(dtype)[6:]} {key}: {hlo_contract.dtype_census(hlo)}")
            assert "opcode sort" in hlo_contract.census(hlo)  # the router's top-k is in the graph
            found = hlo_contract.violations(hlo, reference)
            if found:
                failures[key] = found[:20]
    assert not failures, json.dumps(failures, indent=1)


BLOCKED_CASES = [("tiny-moe", 1, torch.float32), ("tiny-moe", 2, torch.bfloat16)]


@pytest.mark.parametrize(("layout", "tp", "dtype"), BLOCKED_CASES,
                         ids=[f"{l}-tp{t}-{str(d)[6:]}" for l, t, d in BLOCKED_CASES])
def test_the_blocked_moe_prompt_form_keeps_the_contract(reference, monkeypatch, layout, tp, dtype):
    """Context encoding in the blocked routed form (16-row blocks, so that the tiny experts take it; at TP 2 the
    experts split whole, the pairs of the other rank's experts left out): no violation. What it adds: a stable sort
    of the pairs' expert ids, int32 sums, point scatters that assign, row gathers of tokens and of expert weights."""
    from optimum_qwen35.backends.nxd.layers import RoutedExperts
    from optimum_qwen35.modeling import moe

    monkeypatch.setattr(moe, "ROUTED_BLOCK", 16)
    calls = []
    original = RoutedExperts.blocks
    monkeypatch.setattr(RoutedExperts, "blocks", lambda self, *a: calls.append(1) or original(self, *a))
    nc = neuron_config(FIXTURES / layout, "trn2", tp, dtype)
    with traced_parallel_state(tp, nc.logical_nc_config):
        graph = build_graphs(FIXTURES / layout, nc)[CONTEXT]
        hlo = lower(graph).hlo
    assert calls, "the blocked form was not traced"
    found = hlo_contract.violations(hlo, reference)
    print(f"\n{layout} tp{tp} blocked context encoding: {hlo_contract.dtype_census(hlo)}")
    assert not found, json.dumps(found[:20], indent=1)


def test_the_35b_a3b_graphs_keep_the_contract(reference):
    """Qwen3.5-35B-A3B's real widths (256 experts, top 8) with its first 4 layers, shape-only
    (benchmarks/neuron_real_shapes.py --moe), at TP 2: the experts split inside (256 of 512 rows a rank), the form
    the tiny layouts do not reach; both graphs keep the contract."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).parents[2] / "benchmarks" / "neuron_real_shapes.py"
    spec = importlib.util.spec_from_file_location("neuron_real_shapes", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses look their module up there
    spec.loader.exec_module(bench)
    config = json.loads(bench.MOE_CONFIG.read_text())["text_config"]
    from optimum_qwen35 import Qwen35Config

    assert Qwen35Config.from_pretrained(bench.MOE_CONFIG).expert_parallel_mode(2) == "tp"
    assert (config["num_experts"], config["num_experts_per_tok"]) == (256, 8)
    results = bench.lower_moe(4, 2, 1, 256, reference)
    assert [key for key, *_ in results] == ["context_encoding", "token_generation"]
    assert all(found == [] for *_, found in results), results


# ------------------------------------------------------------------------------------------- the check itself
def lowered(fn, *inputs) -> dict:
    """The HLO of fn(*inputs) on the XLA device (lowered, not run)."""
    device = torch_xla.device()
    outputs = fn(*(t.to(device) for t in inputs))
    context = torch_xla._XLAC.lowering.LoweringContext("contract")
    context.build(list(outputs) if isinstance(outputs, (tuple, list)) else [outputs])
    hlo = json.loads(context.hlo_json())
    torch_xla._XLAC._clear_pending_irs(str(device))
    return hlo


def clean(x, w):
    return torch.softmax(x @ w, dim=-1) * 2.0 + 1.0


X, W = torch.randn(4, 8), torch.randn(8, 8)


def test_a_clean_graph_passes(reference):
    assert hlo_contract.violations(lowered(clean, X, W), reference) == []


def test_a_rank_5_tensor_fails(reference):
    found = hlo_contract.violations(lowered(lambda x, w: clean(x, w).reshape(2, 2, 2, 2, 2) + 1.0, X, W), reference)
    assert found and all(f.startswith("rank 5") for f in found), found


def test_an_element_type_outside_the_list_fails(reference):
    """float8_e5m2 is on no list of what these graphs may hold (their float8 weights are F8E4M3FN)."""
    found = hlo_contract.violations(lowered(lambda x, w: clean(x, w).to(torch.float8_e5m2).float(), X, W), reference)
    assert found and all(f.startswith("element type F8E5M2") for f in found), found


def test_an_f64_constant_fails(reference):
    mask = torch.ones(4, 8, dtype=torch.bool)
    # masked_fill with a Python float: the hazard NeuronPrecision.attention had (an f64 value).
    found = hlo_contract.violations(lowered(lambda x, w, m: clean(x, w).masked_fill(m, -1e30), X, W, mask), reference)
    assert any(f.startswith("f64") for f in found), found


def test_an_s64_outside_the_allowlist_fails(reference):
    ids = torch.arange(4, dtype=torch.int32)
    found = hlo_contract.violations(lowered(lambda i: i.to(torch.int64) * 3, ids), reference)
    assert found and all(f.startswith("s64 not allowed") for f in found), found
    # The same in int32 passes; an s64 that only meets a compare is allowed (torch-xla's comparison with a
    # Python int).
    assert hlo_contract.violations(lowered(lambda i: i * 3, ids), reference) == []
    assert hlo_contract.violations(lowered(lambda i: (i >= 0).to(torch.int32), ids), reference) == []
    # torch.topk's indices (s32 made s64 by torch-xla) converted straight back to int32 pass; computed with, not.
    scores = torch.randn(4, 6)
    assert hlo_contract.violations(lowered(lambda x: torch.topk(x, 2).indices.to(torch.int32), scores), reference) == []
    found = hlo_contract.violations(lowered(lambda x: torch.topk(x, 2).indices + 1, scores), reference)
    assert found and all(f.startswith("s64 not allowed") for f in found), found


def test_an_opcode_outside_the_census_fails(reference):
    found = hlo_contract.violations(lowered(lambda x, w: torch.atan2(clean(x, w), x @ w), X, W), reference)
    assert found == ["outside the census: opcode atan2"], found


def test_a_form_outside_the_census_fails(reference):
    """opcode scatter is in the census; a scatter that adds (index_add) is not. A row gather along an inner axis
    (index_select on dim 1) is outside the census too, and passes only through its named exception."""
    x, rows = torch.randn(6, 5), torch.tensor([1, 3], dtype=torch.int32)
    found = hlo_contract.violations(lowered(lambda t, i: t.index_add(0, i, torch.ones(2, 5, device=t.device)), x, rows),
                                    reference)
    assert found == ["outside the census: scatter rows index_map=leading inserted=yes windows=whole combiner=add"]
    inner = lowered(lambda t, i: t.index_select(1, i), x, rows)
    assert hlo_contract.violations(inner, reference, exceptions={}) == [
        "outside the census: gather rows index_map=inner collapsed=yes windows=whole"]
    assert hlo_contract.violations(inner, reference) == []


def test_hand_made_modules():
    """Hand-written HloModuleProto JSON: each rule on its own."""

    def module(*instructions):
        return {"computations": [{"id": "1", "rootId": instructions[-1]["id"], "instructions": list(instructions)}]}

    def inst(i, opcode, etype, dims, operands=()):
        return {"id": str(i), "name": f"{opcode}.{i}", "opcode": opcode, "operandIds": [str(o) for o in operands],
                "shape": {"elementType": etype, "dimensions": [str(d) for d in dims]}}

    reference = {"opcode parameter", "opcode add", "opcode convert", "opcode compare", "opcode constant",
                 "opcode broadcast"}
    ok = module(inst(1, "parameter", "F32", [2, 3]), inst(2, "add", "F32", [2, 3], (1, 1)))
    assert hlo_contract.violations(ok, reference) == []
    rank5 = module(inst(1, "parameter", "F32", [1, 2, 3, 4, 5]))
    assert hlo_contract.violations(rank5, reference) == ["rank 5: parameter parameter.1 f32[1,2,3,4,5]"]
    f64 = module(inst(1, "constant", "F64", []), inst(2, "convert", "F32", [], (1,)))
    assert hlo_contract.violations(f64, reference) == ["f64: constant constant.1 f64[]"]
    s64 = module(inst(1, "parameter", "S32", [4]), inst(2, "convert", "S64", [4], (1,)),
                 inst(3, "add", "S64", [4], (2, 2)))
    assert hlo_contract.violations(s64, reference) == [
        "s64 not allowed: convert convert.2 s64[4]", "s64 not allowed: add add.3 s64[4]"]
    compared = module(inst(1, "parameter", "S32", [4]), inst(2, "convert", "S64", [4], (1,)),
                      inst(3, "constant", "S64", []), inst(4, "broadcast", "S64", [4], (3,)),
                      inst(5, "compare", "PRED", [4], (2, 4)))
    assert hlo_contract.violations(compared, reference) == []
    foreign = module(inst(1, "parameter", "F32", [4]), inst(2, "sort", "F32", [4], (1,)))
    foreign["computations"][0]["instructions"][1]["calledComputationIds"] = ["1"]
    assert "outside the census: opcode sort" in hlo_contract.violations(foreign, reference)


# ----------------------------------------------------------------- refused ops (issue 42, item 3), census or not
def test_softplus_and_any_as_torch_lowers_them_are_refused(reference):
    """F.softplus lowers to log-plus-one and any() to an or-reduce: refused even where the census or an exception
    would take them; the graphs' own softplus (log / exp / add with torch's threshold branch) and the slots' max
    reduce keep the contract."""
    from optimum_qwen35.kernels.gated_delta_rule.fused import softplus

    found = hlo_contract.violations(lowered(lambda x: torch.nn.functional.softplus(x), X), reference)
    assert [f.split(" (")[0] for f in found] == ["refused: opcode log-plus-one"], found
    everything = reference | {"opcode log-plus-one"}  # refused even inside the census
    assert [f.split(" (")[0] for f in hlo_contract.violations(lowered(torch.log1p, X.abs()), everything)] == [
        "refused: opcode log-plus-one"]
    active = torch.tensor([-1, 2, 0, -1], dtype=torch.int32) >= 0
    found = hlo_contract.violations(lowered(lambda a: a.any().to(torch.int32), active), reference)
    assert found and all(f.startswith("refused: ") for f in found), found
    assert hlo_contract.violations(lowered(softplus, X), reference) == []
    assert hlo_contract.violations(lowered(lambda a: (a.to(torch.int32).amax(0) > 0).to(torch.int32), active),
                                   reference) == []


def test_the_gate_softplus_keeps_torchs_numerics():
    """kernels' softplus against F.softplus in fp32: within 3 ulp (relative) wherever softplus > 1e-30, the same
    threshold branch (x itself above 20), finite at the extremes."""
    from optimum_qwen35.kernels.gated_delta_rule.fused import softplus

    x = torch.cat([torch.linspace(-80, 100, 400_001), torch.tensor([-1e30, -88.0, 0.0, 19.999, 20.0, 20.001, 89.0, 1e30])])
    ours, torchs = softplus(x), torch.nn.functional.softplus(x)
    assert ours.isfinite().all()
    big = x > 20
    assert torch.equal(ours[big], x[big])
    ok = torchs > 1e-30
    relative = ((ours - torchs).abs() / torchs)[ok]
    assert relative.max() <= 3 * torch.finfo(torch.float32).eps, relative.max()
