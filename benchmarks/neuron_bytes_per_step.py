"""HBM bytes of one decode step, counted from the lowered token-generation graph, against the floor; matmul FLOPs by
operand dtype of the context-encoding graph.

    .nox/neuron/bin/python benchmarks/neuron_bytes_per_step.py                 # every size at its recommended TP
    .nox/neuron/bin/python benchmarks/neuron_bytes_per_step.py --only 2B:4:1   # SIZE:TP:BATCH (repeatable)
    .nox/neuron/bin/python benchmarks/neuron_bytes_per_step.py --flops 2B:4:1024   # FLOPs by dtype, context encoding
    .nox/neuron/bin/python benchmarks/neuron_bytes_per_step.py --fp8 --only 27B:4:1   # and with FP8 weights, side by side
    .nox/neuron/bin/python benchmarks/neuron_bytes_per_step.py --fp8 --fp8-lm-head --only 2B:4:1   # lm_head in FP8 too

The graphs are the export's, built shape-only as `benchmarks/neuron_real_shapes.py` builds them (rank 0 of the SPMD
graph, bf16, trn2, 4096-token cache). Nothing is compiled for Neuron, nothing runs: these are counts over the HLO
torch-xla hands the compiler, under the rule below, not a device measurement.

**The counting rule** (`hbm_traffic`), over the entry computation of the HloModuleProto:
- *views* (reshape, bitcast, transpose, slice, broadcast, get-tuple-element, tuple) move nothing themselves; a use
  through a view is a use of what the view reads;
- *parameters* (weights, held state, inputs): read whole once if any use reads them whole; if every use is a gather
  or dynamic-slice, the bytes those take; a scatter / dynamic-update-slice into a parameter writes its updates in
  the parameter's own buffer (aliased state: in place) and later uses of its result read the parameter;
- *aliased outputs* (the held state): written as `optimum_qwen35.backends.nxd.lowering.state_traffic` counts (the updates of the
  scatters, or the whole state when made otherwise); other outputs (the logits) are written whole;
- *intermediates* (every other instruction's result, collectives included): on chip when at most `ON_CHIP` bytes
  (default 4 MiB: a sixth of one NeuronCore-v3's 24 MiB SBUF, leaving the rest to the weight tiles streaming
  through; `--on-chip` changes it), otherwise spilled: written once to HBM and read once per use;
- *the dequantization of float8 weights* (`--fp8`: an export with FP8 weights, backends/nxd/fp8.py): the converts and
  the scale multiply between a float8 weight (or the rows gathered of it) and its matmul are counted on chip
  whatever their size, as the weight's tiles stream through SBUF into the matmul; the float8 weight and its scale
  are read as parameters. Unlike the rest of the rule this one is an assumption about the compiler's fusion
  (a compiler that spilled the bf16 weight would read more than the bf16 export does), stated so that a device
  can check it.
A compiler may do better (fuse a large gather into the matmul that uses it) or worse (spill smaller ones): the rule
is stated so that its verdict can be checked against a device.

**The floor** (per rank): every weight parameter read once (the embedding: only the rows of the step's tokens), the
held state the step must touch (each row's K/V cache read, one K/V position written; each row's DeltaNet conv and
recurrent states read and written), the step's inputs. Outputs (the fp32 logits the host samples from) are shown
beside it, not in it.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("neuron_real_shapes", ROOT / "benchmarks" / "neuron_real_shapes.py")
shapes_bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = shapes_bench
_spec.loader.exec_module(shapes_bench)

import torch  # noqa: E402

from optimum_qwen35.backends.nxd.tracing import CONTEXT, TOKENS, neuron_config, traced_parallel_state  # noqa: E402

MIB, GIB = 2**20, 2**30
ON_CHIP = 4 * MIB
_BYTES = {"F64": 8, "S64": 8, "U64": 8, "F32": 4, "S32": 4, "U32": 4, "BF16": 2, "F16": 2, "S16": 2, "U16": 2,
          "S8": 1, "U8": 1, "PRED": 1, "F8E4M3FN": 1}
DEQUANTIZE = {"convert", "multiply"}  # what stands between a float8 weight and its matmul
VIEWS = {"reshape", "bitcast", "transpose", "slice", "broadcast", "get-tuple-element", "tuple"}
FREE = {"constant", "iota", "parameter", "after-all"}
PARTIAL_READS = {"gather", "dynamic-slice"}
UPDATES = {"scatter": 2, "dynamic-update-slice": 1}  # opcode -> operand index of the update

# Recommended TP degree on trn2.3xlarge per size (docs/neuron_backend.md, "Recommended degree": the fastest batch-1
# decode there is TP 4 for every dense size at both ends of the projection), and the 35B-A3B at TP 4 (its experts
# split inside every expert at TP 4: docs/moe.md), as the measured peers run it on trn2.3xlarge.
RECOMMENDED = {"0.8B": 4, "2B": 4, "4B": 4, "9B": 4, "27B": 4, "35B-A3B": 4}
MOE_CONFIG = ROOT / "tests" / "qwen3.5-35b-a3b.config.json"


def nbytes(shape: dict) -> int:
    if shape.get("elementType") == "TUPLE":
        return sum(nbytes(s) for s in shape.get("tupleShapes", []))
    if shape.get("elementType") not in _BYTES:
        return 0
    return math.prod(int(d) for d in shape.get("dimensions", [])) * _BYTES[shape["elementType"]]


def entry_of(hlo: dict) -> tuple[dict, dict]:
    comp = next(c for c in hlo["computations"] if c["id"] == hlo["entryComputationId"])
    return comp, {i["id"]: i for i in comp["instructions"]}


def hbm_traffic(hlo: dict, aliased_outputs: set[int], on_chip: int = ON_CHIP) -> dict:
    """Bytes one call moves under the module docstring's rule: {"params": {param number: bytes read},
    "state_writes": bytes, "outputs": bytes, "spills": Counter(description -> bytes)}."""
    comp, ids = entry_of(hlo)
    users: dict[str, list[dict]] = {}
    for inst in comp["instructions"]:
        for operand in inst.get("operandIds", []):
            users.setdefault(operand, []).append(inst)
    root = ids[comp["rootId"]]
    streamed = dequantization(comp, users)

    def base(inst_id: str) -> str:
        """The materialized value a view chain reads (a parameter, an in-place update of one, or an intermediate)."""
        inst = ids[inst_id]
        while inst["opcode"] in VIEWS - {"tuple"} and inst.get("operandIds"):
            inst = ids[inst["operandIds"][0]]
        return inst["id"]

    # In-place updates of parameters: a scatter / dynamic-update-slice whose operand 0 is (a view of) a parameter or
    # of such an update is that parameter's buffer.
    owner: dict[str, str] = {}  # instruction id -> parameter instruction id whose buffer it is
    for inst in comp["instructions"]:
        if inst["opcode"] == "parameter":
            owner[inst["id"]] = inst["id"]
        elif inst["opcode"] in UPDATES and base(inst["operandIds"][0]) in owner:
            owner[inst["id"]] = owner[base(inst["operandIds"][0])]

    def uses(inst_id: str) -> list[tuple[dict, str]]:
        """(user, the operand id it reads) for every non-view use, through views; the root tuple left out."""
        out = []
        for user in users.get(inst_id, []):
            if user is root:
                continue
            if user["opcode"] in VIEWS:
                out += uses(user["id"])
            else:
                out.append((user, inst_id))
        return out

    params, state_writes, outputs, spills = {}, 0, 0, Counter()
    for inst in comp["instructions"]:
        if inst["opcode"] == "parameter":
            whole, partial = False, 0
            pending = [inst["id"]]
            while pending:
                current = pending.pop()
                for user, operand in uses(current):
                    if user["opcode"] in PARTIAL_READS and base(user["operandIds"][0]) == current:
                        partial += nbytes(user["shape"])
                    elif user["opcode"] in UPDATES and base(user["operandIds"][0]) == current:
                        pending.append(user["id"])  # the same buffer, read by the update's own uses
                    else:
                        whole = True
            params[int(inst.get("parameterNumber", 0))] = nbytes(inst["shape"]) if whole else partial
        elif inst["id"] in owner or inst["opcode"] in VIEWS or inst["opcode"] in FREE or inst["id"] in streamed:
            continue
        else:
            size = nbytes(inst["shape"])
            if size > on_chip:
                reads = sum(min(size, nbytes(ids[operand]["shape"])) for _, operand in uses(inst["id"]))
                spills[describe(inst, ids)] += size + reads

    for index, operand in enumerate(root["operandIds"]):
        if index in aliased_outputs:
            state_writes += _writes(ids, operand, owner)
        else:
            outputs += nbytes(ids[operand]["shape"])
    return {"params": params, "state_writes": state_writes, "outputs": outputs, "spills": spills}


def dequantization(comp: dict, users: dict) -> set[str]:
    """The instructions that dequantize float8 weights (module docstring): converts and multiplies reached from an
    F8E4M3FN parameter through views, gathers of its rows and each other."""
    out, pending = set(), [i["id"] for i in comp["instructions"]
                           if i["opcode"] == "parameter" and i["shape"].get("elementType") == "F8E4M3FN"]
    while pending:
        for user in users.get(pending.pop(), []):
            if user["id"] in out:
                continue
            if user["opcode"] in DEQUANTIZE:
                out.add(user["id"])
                pending.append(user["id"])
            elif user["opcode"] in VIEWS - {"tuple"} or user["opcode"] in PARTIAL_READS:
                pending.append(user["id"])
    return out


def _writes(ids: dict, inst_id: str, owner: dict) -> int:
    inst = ids[inst_id]
    while inst["opcode"] in ("reshape", "bitcast") or (  # an identity transpose too (torch-xla emits one)
            inst["opcode"] == "transpose" and inst.get("dimensions") == [str(i) for i in range(len(inst["dimensions"]))]):
        inst = ids[inst["operandIds"][0]]
    if inst["opcode"] == "parameter":
        return 0
    if inst["opcode"] in UPDATES and inst["id"] in owner:
        update = ids[inst["operandIds"][UPDATES[inst["opcode"]]]]
        return nbytes(update["shape"]) + _writes(ids, inst["operandIds"][0], owner)
    return nbytes(inst["shape"])


def describe(inst: dict, ids: dict) -> str:
    shape = inst["shape"]
    dims = ",".join(shape.get("dimensions", []))
    operands = " ".join(
        f"{ids[o]['shape'].get('elementType', '?').lower()}[{','.join(ids[o]['shape'].get('dimensions', []))}]"
        for o in inst.get("operandIds", [])[:2])
    return f"{inst['opcode']} -> {shape.get('elementType', '?').lower()}[{dims}] ({operands})"


# ------------------------------------------------------------------------------------------------ matmul FLOPs
def dot_flops(hlo: dict) -> Counter:
    """2 x (result elements) x (contracted size) of every dot in the module, keyed by (lhs dtype, rhs dtype)."""
    flops = Counter()
    for comp in hlo["computations"]:
        ids = {i["id"]: i for i in comp["instructions"]}
        for inst in comp["instructions"]:
            if inst["opcode"] != "dot":
                continue
            lhs, rhs = (ids[o]["shape"] for o in inst["operandIds"][:2])
            contracted = math.prod(int(lhs["dimensions"][int(d)])
                                   for d in inst["dotDimensionNumbers"].get("lhsContractingDimensions", []))
            result = math.prod(int(d) for d in inst["shape"].get("dimensions", []))
            flops[(lhs["elementType"].lower(), rhs["elementType"].lower())] += 2 * result * contracted
    return flops


# ------------------------------------------------------------------------------------------------ building
def moe_folder(tmp: Path, layers: int | None = None) -> Path:
    import json

    config = json.loads(MOE_CONFIG.read_text())
    if layers:
        config["text_config"]["num_hidden_layers"] = layers
        config["text_config"]["layer_types"] = config["text_config"]["layer_types"][:layers]
    (tmp / "config.json").write_text(json.dumps(config))
    return tmp


def lowered(size: str, tp: int, batch: int, sequence: int, key: str, moe_layers: int | None = None,
            fp8_weights: bool = False, fp8_lm_head: bool = False):
    """(HloModuleProto as JSON, the graph's aliased output indices, {param number: name}, rank shapes or None)."""
    import torch_xla

    with tempfile.TemporaryDirectory() as tmp:
        folder = moe_folder(Path(tmp), moe_layers) if size == "35B-A3B" else shapes_bench.config_folder(size, Path(tmp))
        nc = neuron_config(folder, "trn2", tp, torch.bfloat16, batch, sequence)
        with traced_parallel_state(tp, nc.logical_nc_config):
            graphs = shapes_bench.build_modules(folder, nc, keys=(key,), fp8_weights=fp8_weights, fp8_lm_head=fp8_lm_head)
            graph = graphs[key]
            _, hlo = shapes_bench.lower_graph(graph, proto=True)
            # Parameter numbers of the module's tensors: lower once more with a lowering context to read them.
            device = torch_xla.device()
            outputs = list(graph.module(*(t.to(device) for t in graph.example_inputs)))
            context = torch_xla._XLAC.lowering.LoweringContext("qwen35")
            context.build(outputs)
            names = {}
            for name, p in [*graph.module.named_parameters(), *graph.module.named_buffers()]:  # (FP8 scales: buffers)
                number = context.tensor_parameter_id(p)
                if number >= 0:
                    names[number] = name
            torch_xla._XLAC._clear_pending_irs(str(device))
            aliased = set(graph.alias_names.values())
            held = {name: p for name, p in graph.module.named_parameters() if name.startswith("past_key_values.")}
            layout = graph.module.state_layout
            info = {"kv": {n for j, n in enumerate(held) if layout.is_kv(j)}, "state": set(held),
                    "batch": batch, "sequence": sequence, "hidden": graph.module.config.hidden_size,
                    "experts": getattr(graph.module.config, "num_experts", None),
                    "top_k": getattr(graph.module.config, "num_experts_per_tok", None)}
    return hlo, aliased, names, info


def floor_bytes(traffic: dict, names: dict, info: dict, hlo: dict) -> dict:
    """The floor, from the graph's parameter shapes, not from what the graph does with them: every weight read once
    (the embedding: the step's `batch` rows; a MoE layer's routed experts: top-k distinct experts per row, at most
    all), each row's K/V read whole and one position written, each row's DeltaNet states read and written, the
    inputs. (Token generation holds one slot per row: `batch` slots.)"""
    comp, _ = entry_of(hlo)
    param_bytes = {int(i.get("parameterNumber", 0)): nbytes(i["shape"]) for i in comp["instructions"]
                   if i["opcode"] == "parameter"}
    weights = state_read = state_write = other = 0
    for number, size in param_bytes.items():
        name = names.get(number)
        if name is None:
            other += size  # inputs and scalars torch-xla passes in
        elif name in info["kv"]:
            state_read += size
            state_write += size // info["sequence"]  # one position of every row
        elif name in info["state"]:
            state_read += size
            state_write += size
        elif name.startswith("embed_tokens.") and name.endswith("weight"):
            weights += info["batch"] * info["hidden"] * 2
        elif ".experts." in name and info.get("experts"):
            weights += size * min(info["experts"], info["batch"] * info["top_k"]) // info["experts"]
        elif name.startswith("embed_tokens.") or name.endswith("master_weight"):
            continue
        else:
            weights += size
    return {"weights": weights, "state_read": state_read, "state_write": state_write, "inputs": other}


def run(size: str, tp: int, batch: int, sequence: int, on_chip: int, top: int, moe_layers: int | None = None,
        fp8_weights: bool = False, fp8_lm_head: bool = False):
    start = time.perf_counter()
    hlo, aliased, names, info = lowered(size, tp, batch, sequence, TOKENS, moe_layers, fp8_weights, fp8_lm_head)
    traffic = hbm_traffic(hlo, aliased, on_chip)
    floor = floor_bytes(traffic, names, info, hlo)
    # What the graph reads of its parameters beyond the floor's "weights once": a weight read partly counts less.
    counted_params = sum(traffic["params"].values())
    floor_total = sum(floor.values())
    spilled = sum(traffic["spills"].values())
    counted = counted_params + traffic["state_writes"] + spilled
    row = {"size": size, "tp": tp, "batch": batch, "sequence": sequence, "floor": floor, "floor_total": floor_total,
           "params": counted_params, "state_writes": traffic["state_writes"], "spilled": spilled,
           "outputs": traffic["outputs"], "counted": counted, "ratio": counted / floor_total,
           "top_spills": traffic["spills"].most_common(top), "seconds": time.perf_counter() - start,
           "layers": moe_layers, "weights": ("fp8 + lm_head" if fp8_lm_head else "fp8") if fp8_weights else "bf16"}
    return row


def fmt(n: float) -> str:
    return f"{n / GIB:.3f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def table(rows: list[dict], on_chip: int) -> list[str]:
    lines = [f"Decode step HBM bytes per rank, counted from the lowered token-generation graph (bf16 activations, trn2, "
             f"{rows[0]['sequence'] if rows else 4096}-token cache; intermediates above {on_chip / MIB:g} MiB spilled):",
             "| size | TP | batch | floor: weights | floor: state read | floor: state written | floor | "
             "counted: parameters read | counted: state written | counted: spilled intermediates | counted | "
             "counted / floor | outputs (logits) |", "|" + "---|" * 13]
    for r in rows:
        f = r["floor"]
        size = r["size"] + (f" ({r['layers']} layers)" if r.get("layers") else "")
        size += {"bf16": "", "fp8": ", FP8", "fp8 + lm_head": ", FP8 with lm_head"}[r["weights"]]
        lines.append(f"| {size} | {r['tp']} | {r['batch']} | {fmt(f['weights'])} | {fmt(f['state_read'])} | "
                     f"{fmt(f['state_write'])} | {fmt(r['floor_total'])} | {fmt(r['params'])} | "
                     f"{fmt(r['state_writes'])} | {fmt(r['spilled'])} | {fmt(r['counted'])} | {r['ratio']:.3f} | "
                     f"{fmt(r['outputs'])} |")
    return lines


def fp8_table(groups: list[list[dict]]) -> list[str]:
    """The same exports with bf16 and FP8 weights side by side (module docstring: the dequantization on chip)."""
    lines = ["Decode step HBM bytes per rank, bf16 weights against FP8 weights (Qwen's rule: lm_head, router, "
             "shared-expert gate, in_proj_a / in_proj_b, embedding and norms stay bf16; `fp8_lm_head`: lm_head FP8 too):",
             "| size | TP | batch | weights | counted | against bf16 | floor: weights | against bf16 |", "|" + "---|" * 8]
    for bf16, *others in groups:
        size = bf16["size"] + (f" ({bf16['layers']} layers)" if bf16.get("layers") else "")
        for r in (bf16, *others):
            lines.append(f"| {size} | {bf16['tp']} | {bf16['batch']} | {r['weights']} | {fmt(r['counted'])} | "
                         f"{r['counted'] / bf16['counted']:.3f} | {fmt(r['floor']['weights'])} | "
                         f"{r['floor']['weights'] / bf16['floor']['weights']:.3f} |")
    return lines


def flops_table(spec: str) -> list[str]:
    size, tp, tokens = spec.split(":")
    tp, tokens = int(tp), int(tokens)
    hlo, *_ = lowered(size, tp, 1, tokens, CONTEXT, 4 if size == "35B-A3B" else None)
    flops = dot_flops(hlo)
    total = sum(flops.values())
    lines = [f"Matmul FLOPs by operand dtype, context encoding, {size} TP {tp}, one row of {tokens} tokens (rank 0, "
             "bf16 export):", "| lhs x rhs | GFLOP | share |", "|---|---|---|"]
    for (a, b), n in flops.most_common():
        lines.append(f"| {a} x {b} | {n / 1e9:.1f} | {n / total:.1%} |")
    lines.append(f"| total | {total / 1e9:.1f} | |")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", metavar="SIZE:TP:BATCH")
    parser.add_argument("--sequence", type=int, default=4096)
    parser.add_argument("--on-chip", type=float, default=ON_CHIP / MIB, help="MiB an intermediate may keep on chip")
    parser.add_argument("--top", type=int, default=4, help="largest spilled intermediates listed per configuration")
    parser.add_argument("--moe-layers", type=int, default=None,
                        help="the 35B-A3B with its first N layers (default all 40)")
    parser.add_argument("--fp8", action="store_true", help="each configuration also with FP8 weights, side by side")
    parser.add_argument("--fp8-lm-head", action="store_true", help="with --fp8: also with lm_head in FP8 (fp8_lm_head)")
    parser.add_argument("--flops", action="append", metavar="SIZE:TP:TOKENS",
                        help="matmul FLOPs by operand dtype of the context-encoding graph (repeatable)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.flops:
        for spec in args.flops:
            print("\n".join(flops_table(spec)), flush=True)
        return
    plan = ([(s, int(t), int(b)) for s, t, b in (o.split(":") for o in args.only)] if args.only else
            [(size, tp, batch) for size, tp in RECOMMENDED.items() for batch in (1, 8)])
    on_chip = int(args.on_chip * MIB)
    rows, groups = [], []
    forms = [(False, False), *([(True, False)] if args.fp8 else []), *([(True, True)] if args.fp8 and args.fp8_lm_head else [])]
    for size, tp, batch in plan:
        for fp8_weights, fp8_lm_head in forms:
            row = run(size, tp, batch, args.sequence, on_chip, args.top,
                      args.moe_layers if size == "35B-A3B" else None, fp8_weights, fp8_lm_head)
            rows.append(row)
            print(f"{size} TP {tp} batch {batch} ({row['weights']} weights): counted {fmt(row['counted'])} / floor "
                  f"{fmt(row['floor_total'])} = {row['ratio']:.3f} in {row['seconds']:.0f} s", flush=True)
            for what, n in row["top_spills"]:
                print(f"    spilled {fmt(n)}: {what}", flush=True)
        if args.fp8:
            groups.append(rows[-len(forms):])
    print("\n".join(table(rows, on_chip)))
    if groups:
        print("\n".join(fp8_table(groups)))


if __name__ == "__main__":
    main()
