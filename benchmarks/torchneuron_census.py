"""The instruction census of the TorchNeuron graphs (issue 48 item 5): per layout and TP degree, the context encoding
(bucket 16) and token generation graphs the product's layer factory builds (`TorchNeuronLayers`, compiled as the runner
compiles them: `StateInPlaceGraph`), and the vision tower (64 patch rows), lowered by the StableHLO check backend;
for each: StableHLO ops, ops with a rank >= 5 result, non-constant ops with an i64 or f64 result, states returned as
well as aliased, aliases, and the contract's findings (rules 1-3: rank, f64, int32 indices).

    OMP_NUM_THREADS=1 python benchmarks/torchneuron_census.py tiny-2b 1 [--graph context|decode|vision]

Layouts: a fixture of tests/fixtures (its config only: random weights, lowering needs shapes), or `odd-gqa` (tiny-nv3x
with one KV head: kv heads 1, nv = 3 nk). TP > 1 lowers rank 0 in a fake process group (one graph serves every rank).
Prints one JSON line. Needs torch-mlir (the `stablehlo` extra). Counts, not timings."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch._dynamo
import torch.distributed as dist

from optimum_qwen35.backends.torchneuron import stablehlo_contract as contract
from optimum_qwen35.backends.torchneuron.layers import TorchNeuronLayers
from optimum_qwen35.backends.torchneuron.runner import StateInPlaceGraph
from optimum_qwen35.backends.torchneuron.stablehlo_check import CheckBackend
from optimum_qwen35.config import Qwen35Config
from optimum_qwen35.modeling.decoder import ContextEncodingGraph, Qwen35Decoder, TokenGenerationGraph
from optimum_qwen35.modeling.precision import to_model_dtype
from optimum_qwen35.modeling.state import allocate_state
from optimum_qwen35.modeling.vision import VisionConfig, VisionEncoder, image_bucket_inputs

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
BATCH, MAX_LENGTH, BUCKET, PATCHES = 2, 96, 16, 64
torch._dynamo.config.recompile_limit = 256
torch._dynamo.config.accumulated_recompile_limit = 4096


def raw_config(layout: str) -> dict:
    raw = json.loads((FIXTURES / ("tiny-nv3x" if layout == "odd-gqa" else layout) / "config.json").read_text())
    if layout == "odd-gqa":
        raw.get("text_config", raw)["num_key_value_heads"] = 1
    return raw


def count(graph) -> dict:
    ops = contract.parse(graph.stablehlo)
    out = {"ops": len(ops), "rank5": 0, "i64": 0, "f64": 0}
    for op in ops:
        types = [t for text in op.results for t in contract.tensor_types(text)]
        constant = op.name in ("stablehlo.constant", "arith.constant")
        out["rank5"] += any(rank >= contract.RANK_LIMIT for rank, _ in types)
        out["i64"] += not constant and any(e == "i64" for _, e in types)
        out["f64"] += any(e == "f64" for _, e in types)
    outputs = list(graph.aten.graph.output_node().args[0])
    written = set(outputs[graph.user_outputs:])
    out["returned_states"] = sum(o in written for o in outputs[:graph.user_outputs])
    out["aliases"] = len(graph.aliases)
    out["findings"] = sorted({contract.finding(line) for line in contract.violations(ops, None)})
    return out


def graphs(layout: str, tp: int, which: list[str]):
    raw = raw_config(layout)
    ranks = {dist.group.WORLD.group_name: list(range(tp))} if tp > 1 else {}
    torch.manual_seed(0)
    layers = TorchNeuronLayers(tp, 0, None)
    if "vision" in which:
        config = VisionConfig.from_dict(raw)
        tower = VisionEncoder(config, tp, layers=layers).eval()
        inputs = image_bucket_inputs(config, torch.randn(8 * 6, config.patch_dim), (1, 8, 6), PATCHES)
        yield "vision", tower, inputs, ranks
    decoder = to_model_dtype(Qwen35Decoder(Qwen35Config.from_dict(raw), tp, layers), torch.float32).eval()
    state = allocate_state(decoder.state_specs(BATCH, MAX_LENGTH))
    ids = torch.arange(BATCH * BUCKET, dtype=torch.int32).reshape(BATCH, BUCKET) % 200
    seq = torch.arange(BATCH, dtype=torch.int32)
    if "context" in which:
        positions = torch.arange(BUCKET, dtype=torch.int32).expand(BATCH, BUCKET).contiguous()
        yield ("context", StateInPlaceGraph(ContextEncodingGraph(decoder), len(state)),
               (ids, torch.ones(BATCH, BUCKET, dtype=torch.int32), positions, seq, *state), ranks)
    if "decode" in which:
        yield ("decode", StateInPlaceGraph(TokenGenerationGraph(decoder), len(state)),
               (ids[:, :1], torch.full((BATCH, 1), 3, dtype=torch.int32), seq, *state), ranks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("layout")
    parser.add_argument("tp", type=int)
    parser.add_argument("--graph", action="append", choices=["context", "decode", "vision"])
    args = parser.parse_args()
    which = args.graph or ["context", "decode"]
    if args.tp > 1:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.tp)
    result = {}
    try:
        for name, module, inputs, ranks in graphs(args.layout, args.tp, which):
            backend = CheckBackend(group_ranks=ranks, name=name)
            with torch.no_grad():
                torch.compile(module, backend=backend, fullgraph=True, dynamic=False)(*inputs)
            result[name] = count(backend.graphs[0])
    finally:
        if args.tp > 1:
            dist.destroy_process_group()
    print(json.dumps({"layout": args.layout, "tp": args.tp, **result}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
