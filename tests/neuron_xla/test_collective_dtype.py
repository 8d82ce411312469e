"""Collectives in the activation dtype: every all-reduce of a bf16 export's graphs is bf16 (the row-parallel
layers', the MoE block's, the embedding's), read from the HLO lowered at TP 2; an fp32 export's stay fp32; the
logits' all-gather stays fp32 (the host samples from fp32 logits). The accuracy side is the bf16 tests
(test_neuron_graphs.py, test_moe_xla.py, tests/test_tensor_parallel.py)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.kit.neuron_xla import build_graphs, lower, neuron_config, traced_parallel_state

from ..conftest import FIXTURES


def collective_dtypes(hlo: dict) -> Counter:
    """(opcode, element type) of every collective in the module (the first array of a tuple-shaped result)."""
    found = Counter()
    for computation in hlo["computations"]:
        for inst in computation["instructions"]:
            opcode = inst["opcode"].removesuffix("-start")
            if opcode in ("all-reduce", "all-gather", "reduce-scatter"):
                shape = inst["shape"]
                while shape.get("elementType") == "TUPLE":
                    shape = shape["tupleShapes"][0]
                found[(opcode, shape["elementType"])] += 1
    return found


CASES = [("tiny-nv3x", torch.bfloat16), ("tiny-nv3x", torch.float32), ("tiny-moe", torch.bfloat16)]


@pytest.mark.parametrize(("layout", "dtype"), CASES, ids=[f"{l}-{str(d)[6:]}" for l, d in CASES])
def test_all_reduces_are_in_the_model_dtype_at_tp2(layout, dtype):
    expected = "BF16" if dtype == torch.bfloat16 else "F32"
    nc = neuron_config(FIXTURES / layout, "trn2", 2, dtype)
    with traced_parallel_state(2, nc.logical_nc_config):
        graphs = build_graphs(FIXTURES / layout, nc)
        for key, graph in graphs.items():
            found = collective_dtypes(lower(graph).hlo)
            print(f"\n{layout} {str(dtype)[6:]} {key}: {dict(found)}")
            reduces = {dt for (op, dt) in found if op == "all-reduce"}
            assert reduces == {expected}, (key, found)
            # One all-reduce per row-parallel call and MoE block at least (not a graph without collectives).
            assert sum(n for (op, _), n in found.items() if op == "all-reduce") >= 4, (key, found)
            assert {dt for (op, dt) in found if op == "all-gather"} == {"F32"}, (key, found)
