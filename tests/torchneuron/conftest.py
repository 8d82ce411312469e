"""The reference census (upstream transformers' Llama, Qwen3 and Qwen3-MoE through the check backend), once per session,
and the checks every lowered graph must pass."""

from __future__ import annotations

import re

import pytest

from optimum_qwen35.backends.torchneuron import stablehlo_contract as contract  # noqa: E402  (torch_mlir is imported lazily: other sessions collect this)
from optimum_qwen35.backends.torchneuron.stablehlo_check import LoweredGraph  # noqa: E402

# Every bucket of a graph is a Dynamo entry of the same code object (`ContextEncodingGraph.forward`, ...), and this
# session compiles 3 layouts x 2 dtypes x the buckets: above Dynamo's default of 8 entries per code object it would
# stop compiling and run eager (a TorchNeuron backend with more buckets than 8 per graph must raise it as well).
import torch._dynamo  # noqa: E402

torch._dynamo.config.recompile_limit = 256
torch._dynamo.config.accumulated_recompile_limit = 4096
torch._dynamo.config.fail_on_recompile_limit_hit = True

REFERENCE: dict = {}


@pytest.fixture(scope="session")
def reference_census() -> set[str]:
    """The op census of the reference models' prefill and decode graphs (fp32), with their dtype census."""
    if not REFERENCE:
        from .reference_models import REFERENCE_MODELS, reference_graphs

        census = set()
        for kind in REFERENCE_MODELS:
            for graph in reference_graphs(kind):
                ops = contract.parse(graph.stablehlo)
                census |= set(contract.census(ops))
                REFERENCE[f"{kind} {graph.name}"] = contract.dtype_census(ops)
        REFERENCE["census"] = census
    return REFERENCE["census"]


def check_lowered(graph: LoweredGraph, reference: set[str], state_count: int) -> set[str]:
    """The checks of one lowered graph; returns its findings (`contract.finding` of each breach), which must be none.

    - every state input written, and written through an alias (`state_count` aliases, each input a state tensor's
      shape; the numerics tests prove they are the right ones), and no state also a graph output;
    - static shapes: no dynamic dimension in the StableHLO;
    - the contract: no f64, no rank >= 5, int32 indices, the census (`contract.violations`), each breach a known
      finding: none is allowed (`contract.KNOWN_FINDINGS` is empty)."""
    assert len(graph.aliases) == state_count, f"{graph.name}: {len(graph.aliases)} aliased inputs, {state_count} states"
    assert len(set(graph.aliases.values())) == state_count
    outputs = list(graph.aten.graph.output_node().args[0])
    written = set(outputs[graph.user_outputs:])
    returned = [o for o in outputs[:graph.user_outputs] if o in written]
    assert not returned, f"{graph.name}: {len(returned)} states written in place are graph outputs as well"
    assert not re.search(r"tensor<[^>]*\?", graph.stablehlo), f"{graph.name}: a dynamic dimension in the StableHLO"
    ops = contract.parse(graph.stablehlo)
    lines = contract.violations(ops, reference)
    outside = [line for line in lines if line.startswith("outside the census")]
    assert not outside, f"{graph.name}: ops outside the reference census with no reason: {outside}"
    found = {contract.finding(line) for line in lines}
    unknown = found - set(contract.KNOWN_FINDINGS)
    assert not unknown, f"{graph.name}: findings {sorted(unknown)}: " + "; ".join(
        line for line in lines if contract.finding(line) in unknown)[:3000]
    return found
