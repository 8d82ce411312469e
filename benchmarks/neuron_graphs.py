"""The Neuron graphs of a real Qwen3.5 shape, lowered on torch-xla's CPU device: size and state traffic per graph.

    nox -s neuron --install-only  # the environment (torch-xla 2.8, neuronx-distributed 0.15, the SDK stand-ins)
    .nox/neuron/bin/python benchmarks/neuron_graphs.py                     # 2B, TP 4, batch 4, 4096 tokens, bf16
    .nox/neuron/bin/python benchmarks/neuron_graphs.py --size 0.8B --tp 1

For each graph (context encoding, token generation) as the export builds it (`get_neuron_config` -> the project's
builders and model instances -> neuronx-distributed's layers, rank 0's SPMD graph), prints the HLO instruction count,
how many held states resolve to an HLO parameter (their aliases), and the bytes of held state the graph reads and
writes per call (`optimum_qwen35.backends.nxd.lowering.state_traffic`: what its ops take and give, with aliased scatters counted as
in-place writes of their updates; a lower bound from the HLO, not a device measurement). Then both forms of the
attention core at the shape's per-rank heads: the 4-D form with K/V repeated per query head, and the 3-D form
`NeuronPrecision.attention` uses. Nothing is compiled for Neuron: no neuronx-cc, no device here.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")

import optimum.neuron  # noqa: E402,F401  (sets the compilation target, which neuronx-distributed reads on import)
import torch  # noqa: E402
import torch_xla  # noqa: E402

from optimum_qwen35.backends.nxd.lowering import build_graphs, lower, state_traffic  # noqa: E402
from optimum_qwen35.backends.nxd.tracing import CONTEXT, TOKENS, neuron_config, traced_parallel_state  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# The text decoder's shape per size (ANCHORS: the 0.8B file is a real config; the others change these fields).
SIZES = {
    "0.8B": {},
    "2B": {"hidden_size": 2048, "intermediate_size": 6144},
    "4B": {"hidden_size": 2560, "intermediate_size": 9216, "num_hidden_layers": 32, "num_attention_heads": 16,
           "num_key_value_heads": 4, "linear_num_value_heads": 32},
}
MIB = 2**20


def config_folder(size: str, root: Path) -> Path:
    config = json.loads((ROOT / "tests" / "qwen3.5-0.8b.config.json").read_text())
    text = config["text_config"]
    text.update(SIZES[size])
    n = text["num_hidden_layers"]
    text["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    (root / "config.json").write_text(json.dumps(config))
    return root


def attention_forms(heads: int, kv_heads: int, head_dim: int, tq: int, tk: int, batch: int, dtype) -> None:
    """Lower the 4-D form (K/V repeated per query head) and the 3-D form of the attention core; print their dots."""
    from optimum_qwen35.modeling.precision import NeuronPrecision

    def four_d(q, k, v, mask, scale):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)).float() * scale
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        return torch.softmax(scores, dim=-1).to(v.dtype) @ v

    device = torch_xla.device()
    q = torch.zeros(batch, heads, tq, head_dim, dtype=dtype, device=device)
    k = torch.zeros(batch, kv_heads, tk, head_dim, dtype=dtype, device=device)
    mask = torch.ones(batch, 1, tq, tk, dtype=torch.bool, device=device)
    for name, form in (("4-D, K/V repeated", four_d), ("3-D (NeuronPrecision)", NeuronPrecision.attention)):
        out = form(q, k, k, mask, head_dim**-0.5)
        context = torch_xla._XLAC.lowering.LoweringContext("attention")
        context.build([out])
        hlo = json.loads(context.hlo_json())
        torch_xla._XLAC._clear_pending_irs(str(device))
        instructions = [i for c in hlo["computations"] for i in c["instructions"]]
        shapes = {i["id"]: [int(d) for d in i["shape"].get("dimensions", [])] for i in instructions}
        dots = [i for i in instructions if i["opcode"] == "dot"]
        ranks = [[len(shapes[o]) for o in d["operandIds"]] for d in dots]
        copies = sum(
            torch.tensor(shapes[i["id"]]).prod().item() * (2 if dtype == torch.bfloat16 else 4)
            for i in instructions if i["opcode"] in ("broadcast", "gather", "concatenate") and len(shapes[i["id"]]) >= 4
        )
        print(f"  {name:24s} Tq={tq:5d} Tk={tk:5d}: {len(dots)} dots, operand ranks {ranks}, "
              f"{len(instructions)} instructions, {copies / MIB:8.2f} MiB of rank-4+ broadcast/gather/concat results")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="2B", choices=sorted(SIZES))
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--sequence-length", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--target", default="trn2", choices=["trn2", "trn1", "inf2"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        folder = config_folder(args.size, Path(tmp))
        nc = neuron_config(folder, args.target, args.tp, dtype, args.batch_size, args.sequence_length)
        print(f"Qwen3.5-{args.size}, {args.target}, TP {args.tp}, batch {args.batch_size}, {args.sequence_length} "
              f"tokens, {args.dtype}: rank 0's graphs, lowered on the XLA CPU device (nothing compiled for Neuron)")
        with traced_parallel_state(args.tp, nc.logical_nc_config):
            start = time.perf_counter()
            graphs = build_graphs(folder, nc)
            print(f"built both graphs' modules in {time.perf_counter() - start:.1f} s")
            print("| graph | batch x tokens | HLO instructions | state aliases resolved | state read MiB | "
                  "state written MiB (KV / DeltaNet) |")
            print("|---|---|---|---|---|---|")
            for key in (CONTEXT, TOKENS):
                graph = graphs[key]
                start = time.perf_counter()
                lowered = lower(graph)
                traffic = state_traffic(lowered, graph)
                layout = graph.module.state_layout
                kv = [n for j, n in enumerate(graph.alias_names) if layout.is_kv(j)]
                read = sum(r for r, _ in traffic.values()) / MIB
                written_kv = sum(traffic[n][1] for n in kv) / MIB
                written_dn = sum(w for n, (_, w) in traffic.items() if n not in kv) / MIB
                resolved = sum(i >= 0 for i in lowered.parameter_ids.values())
                shape = "x".join(str(d) for d in graph.example_inputs[0].shape)
                print(f"| {key} | {shape} | {lowered.instruction_count} | {resolved}/{len(traffic)} | {read:.1f} | "
                      f"{written_kv + written_dn:.1f} ({written_kv:.1f} / {written_dn:.1f}) |"
                      f"  (lowered in {time.perf_counter() - start:.0f} s)")
        config = graphs[TOKENS].module.config
        dims = graphs[TOKENS].module.dims
        print(f"attention core per rank ({dims.num_heads} query heads, {dims.num_kv_heads} KV heads, head_dim "
              f"{config.head_dim}, batch 1):")
        for tq in (1, min(args.sequence_length, 1024)):
            attention_forms(dims.num_heads, dims.num_kv_heads, config.head_dim, tq, args.sequence_length, 1, dtype)


if __name__ == "__main__":
    main()
