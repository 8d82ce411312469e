"""Speculative verification (issue 39) and the prefix cache's resumed prefill (issue 40) through the TorchNeuron check
backend: verify of k + 1 = 4 positions, commit, the MTP head and context encoding continuing a slot (key length
above its bucket), each compiled with `fullgraph=True`, lowered to StableHLO within the contract (known findings
only, every state write an aliased output), and run on CPU against the same modules in eager mode
(`EAGER_TOLERANCE`: every output and every state tensor). tiny-2b, batch 2, cache 96 positions, TP 1 (the MTP head is
not sharded)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torch_mlir", reason="torch-mlir is installed by the torchneuron nox session")

from optimum_qwen35.modeling.decoder import ContextEncodingGraph
from optimum_qwen35.modeling.speculative_graphs import CommitGraph, MTPGraph, VerifyGraph
from optimum_qwen35.modeling.state import allocate_state

from optimum_qwen35.backends.torchneuron import stablehlo_contract as contract
from optimum_qwen35.backends.torchneuron.runner import StateInPlaceGraph
from optimum_qwen35.backends.torchneuron.stablehlo_check import CheckBackend
from .conftest import check_lowered
from .models import EAGER_TOLERANCE, load_decoder, state
from .test_graphs import _close, _context_inputs

BATCH, MAX_LENGTH = 2, 96
SEQ_IDS = torch.tensor([0, 1], dtype=torch.int32)


def _compile(module, name, state_count):
    """`module` compiled as the product runner compiles it: its state written in place, not returned as well."""
    backend = CheckBackend(name=name)
    return torch.compile(StateInPlaceGraph(module, state_count), backend=backend, fullgraph=True, dynamic=False), backend


def _prefilled(decoder):
    """Two equal states holding a 20-token and a 9-token prompt (eager context encoding, bucket 32)."""
    out = []
    for _ in range(2):
        s = state(decoder, BATCH, MAX_LENGTH)
        ContextEncodingGraph(decoder)(*_context_inputs([list(range(3, 23)), list(range(40, 49))], 32, [0, 1]), *s)
        out.append(s)
    return out


# bf16 is a matrix point: the bf16 graphs' lowering is tests/torchneuron/test_graphs.py's.
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.matrix)], ids=["fp32", "bf16"])
def test_speculative_and_continuing_graphs_lower_and_equal_eager(dtype, reference_census):
    decoder = load_decoder("tiny-2b", dtype, mtp=True)
    n_state = len(decoder.state_specs(BATCH, MAX_LENGTH))
    n_attention = sum(2 for layer in decoder.layers if layer.is_attention)
    tol = EAGER_TOLERANCE if dtype == torch.float32 else 0.05
    worst = 0.0
    backends = {}

    def check(name, module, inputs, mine, theirs, n_out):
        """The compiled module on (inputs, *mine) against eager on (inputs, *theirs): the first n_out outputs and the
        state lists after the call."""
        nonlocal worst
        fn, backends[name] = _compile(module, name, len(mine))
        got, expected = fn(*inputs, *mine), module(*inputs, *theirs)
        for k in range(n_out):
            worst = max(worst, _close(got[k], expected[k], tol, f"{name} output {k}"))
        for k, (a, b) in enumerate(zip(mine, theirs)):
            worst = max(worst, _close(a, b, tol, f"{name} state {k}"))
        return got, expected

    with torch.no_grad():
        mine, theirs = _prefilled(decoder)
        # Resumed prefill: row 0 continues at position 20 with 12 tokens (bucket 16, key length 64); row 1 inactive.
        inputs = _context_inputs([list(range(60, 72))], 16, [0, -1], starts=[20])
        check("context_continuing", ContextEncodingGraph(decoder, key_length=64), inputs, mine, theirs, 1)
        # Verify 4 positions per row (rows at 32 and 9), then commit different accepted positions per row.
        ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]], dtype=torch.int32)
        positions = torch.tensor([[32, 33, 34, 35], [9, 10, 11, 12]], dtype=torch.int32)
        lengths = torch.tensor([4, 4], dtype=torch.int32)
        got, expected = check("verify", VerifyGraph(decoder), (ids, positions, lengths, SEQ_IDS), mine, theirs,
                              2 + 2 * len(decoder.config.linear_layers))
        per_position = 2 * len(decoder.config.linear_layers)
        accepted = torch.tensor([0, 2], dtype=torch.int32)
        fn, backends["commit"] = _compile(CommitGraph(decoder), "commit", len(mine))
        fn(SEQ_IDS, accepted, *got[2 : 2 + per_position], *mine)
        CommitGraph(decoder)(SEQ_IDS, accepted, *expected[2 : 2 + per_position], *theirs)
        for k, (a, b) in enumerate(zip(mine, theirs)):
            worst = max(worst, _close(a, b, tol, f"commit state {k}"))
        # The MTP head over the verified positions, its own KV cache.
        kv_mine, kv_theirs = (state_mtp(decoder) for _ in range(2))
        hidden = expected[1].to(decoder.embed_tokens.weight.dtype)
        check("mtp", MTPGraph(decoder), (ids, hidden, positions, lengths, SEQ_IDS), kv_mine, kv_theirs, 2)

    # What each graph writes, all through aliased inputs: continuing context every state tensor, verify the attention
    # K/V only (its DeltaNet states leave as outputs, the slots untouched), commit the DeltaNet states, the head its
    # own K/V cache.
    writes = {"context_continuing": n_state, "verify": n_attention, "commit": n_state - n_attention, "mtp": 2}
    for name, backend in backends.items():
        (graph,) = backend.graphs
        found = check_lowered(graph, reference_census, writes[name])
        ops = contract.parse(graph.stablehlo)
        print(f"\n{name} {str(dtype)[6:]}: {len(ops)} ops, {contract.dtype_census(ops)}, {len(graph.aliases)} aliases, "
              f"findings {sorted(found)}")
    print(f"\n{str(dtype)[6:]}: max |compiled - eager| {worst:.2e} (tolerance {tol} (1 + |eager|))")


def state_mtp(decoder):
    return allocate_state(decoder.mtp_state_specs(BATCH, MAX_LENGTH))
