"""The compiler contract: what every graph the Neuron export builds may hand to neuronx-cc, checked on its HLO.

`violations(hlo, reference)` takes one lowered HLO module (the HloModuleProto as JSON, as `lowering.lower` gives
it) and returns one line per breach of these rules:

1. no tensor of rank >= 5 (the seed's port died on 5-D tensors in neuronx-cc, NCC_INLA001);
2. no f64 value (the device has no fp64);
3. no s64 value, except the uses `S64_ALLOWED` names with their reason (NxD's own models index in int32);
4. every opcode and every form of the ops the compiler restricts (gather and scatter dimension numbers,
   dynamic-slice / dynamic-update-slice indices, the combiner of reduce and friends) must be in `reference`, the
   census of optimum-neuron 0.4.5's own Qwen3, Llama and Qwen3-MoE NxD graphs lowered on the same path
   (`reference_census` of `lowering.reference_hlos`),
   unless `FORM_EXCEPTIONS` names it with a sourced reason;
5. no form `REFUSED` names, census or not: ops neuronx-cc is not documented to accept that the graphs once had and
   now express otherwise (softplus's log-plus-one, `any()`'s or-reduce);
6. only the element types of `ELEMENT_TYPES`, each with its source (float8 weights: F8E4M3FN, which trn1, inf2 and
   trn2 take only with the flag an export with FP8 weights compiles with).

Sources of the reasons: the neuron-cc operator notes for XLA ("neuron-cc list-operators --framework XLA", Neuron
docs, release-notes/archive/neuron-cc/neuron-cc-ops/neuron-cc-ops-xla): Gather "supports only disjoint
start_index_map and remapped_offset_dims", DynamicUpdateSlice "only for constant index", Reduce "Min, Max, Add and
Mul are the only supported computations. Init_values must be constant". That list is the older neuron-cc's; the
census of what optimum-neuron's decoders hand to neuronx-cc is the stronger evidence, and both are used.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Iterator

RANK_LIMIT = 5  # a tensor of this rank or more is a violation

# Forms of ours outside the reference census, each with why it is accepted. A pattern matches a whole form string.
FORM_EXCEPTIONS: dict[str, str] = {
    r"opcode (and|not)": (
        "predicate logic on masks (valid & active, ~mask): the neuron-cc XLA operator list has LogicalAnd and "
        "LogicalNot"
    ),
    r"opcode log": (
        "softplus of the DeltaNet gate as log(1 + exp(x)) (kernels/gated_delta_rule/fused.py `softplus`): Log is in "
        "the neuron-cc XLA operator list"
    ),
    r"opcode (erf|tanh)": "the vision tower's GELU: Tanh is in the neuron-cc XLA operator list; erf elementwise",
    r"opcode batch-norm-training": (
        "torch-xla lowers the vision tower's LayerNorm to BatchNormTraining: Batchnorm is in the neuron-cc XLA "
        "operator list"
    ),
    r"opcode reduce-window|reduce-window combiner=add init=constant": (
        "torch.cumsum of the gates inside a 64-token chunk (the chunked delta rule's PyTorch form): not in the "
        "census and not in the neuron-cc XLA list; open until a neuronx-cc run (nki-library's gdn_cte computes it "
        "as a matmul with a triangular ones matrix)"
    ),
    r"reduce combiner=minimum init=constant": (
        "amin over int32 row numbers (the first active row): Min is one of the neuron-cc note's reduce computations"
    ),
    r"gather rows index_map=(leading|inner) collapsed=yes windows=whole": (
        "index_select (one indexed dimension, collapsed; whole rows): the census's embedding gather on other "
        "operand ranks or another axis; start_index_map and offset dims disjoint, as the neuron-cc note requires"
    ),
    r"gather points index_map=leading collapsed=yes windows=whole": (
        "advanced indexing cache[slot, head, position] (the K/V window read before its write): the census's "
        "point gather with a whole trailing window; disjoint dims, as the neuron-cc note requires"
    ),
    r"scatter (rows|points) index_map=leading inserted=yes windows=whole combiner=parameter": (
        "index_put of rows (state slots) or points (K/V positions), assigning: the census's scatters with a whole "
        "trailing window"
    ),
}


# Forms refused even where the census or an exception would take them: ops in no Neuron operator list that the
# graphs once had, expressed since with listed ones. A pattern matches a whole form string.
REFUSED: dict[str, str] = {
    r"opcode log-plus-one": (
        "torch-xla's lowering of F.softplus (log1p): on no Neuron operator list; the gate's softplus is "
        "log(1 + exp(x)) with torch's threshold branch (kernels/gated_delta_rule/fused.py `softplus`)"
    ),
    r"opcode or|reduce combiner=(or|select)( .*)?": (
        "torch-xla's lowering of any() (an `or` reduce whose combiner selects): LogicalOr is on no Neuron operator "
        "list and Reduce takes Min, Max, Add and Mul only; the active-row test is an int32 max reduce "
        "(modeling/state.py `Slots`)"
    ),
}


def _only_reaches(users, inst, ends, passes_through) -> bool:
    """True when every path of uses from inst stops at a user `ends(user, value_id)` accepts, going on through
    users `passes_through(user)` accepts, and one such end is reached (a value without users is a graph output)."""
    seen, todo, reached = set(), [inst["id"]], False
    while todo:
        i = todo.pop()
        if i in seen:
            continue
        seen.add(i)
        if not users.get(i):
            return False
        for user in users[i]:
            if ends(user, i):
                reached = True
            elif passes_through(user):
                todo.append(user["id"])
            else:
                return False
    return reached


def _comparisons_only(users, inst) -> bool:
    """s64 that only feeds compares, through s64 broadcasts / reshapes / converts."""
    return _only_reaches(
        users, inst,
        ends=lambda user, _: user["opcode"] == "compare",
        passes_through=lambda user: user["opcode"] in ("broadcast", "reshape", "convert")
        and user["shape"]["elementType"] == "S64",
    )


def _gather_indices_only(users, inst) -> bool:
    """s64 used only to make the indices of gathers (operand 1), through s64 values and converts."""
    return _only_reaches(
        users, inst,
        ends=lambda user, i: user["opcode"] == "gather" and user["operandIds"][1] == i,
        passes_through=lambda user: user["opcode"] in ("convert", "reshape") or user["shape"]["elementType"] == "S64",
    )


# s64 values that may remain, each with the test that recognises it and why it stays.
S64_ALLOWED: dict[str, tuple] = {
    "compared": (
        lambda ids, users, inst: _comparisons_only(users, inst),
        "s64 only as an operand of a compare: torch-xla compares an int32 tensor with a Python int (`seq_ids >= 0`) "
        "and wraps negative indices in its index / index_put lowering (index < 0) in s64; the result is a "
        "predicate, no s64 value is stored or computed with (the census's token-generation graphs have the same)",
    ),
    "embedding ids": (
        lambda ids, users, inst: _gather_indices_only(users, inst),
        "token ids made s64 on their way to the embedding's gather: neuronx-distributed's ParallelEmbedding "
        "casts them (`masked_input.long()`) and at TP > 1 multiplies them by its vocabulary-range mask in s64 "
        "(`input_mask.long()`, parallel_layers/layers.py L323-333); torch-xla converts them to u32 for the gather. "
        "The census's graphs have the same",
    ),
    "top-k indices": (
        lambda ids, users, inst: inst["opcode"] == "convert"
        and ids[inst["operandIds"][0]]["shape"]["elementType"] == "S32"
        and users.get(inst["id"]) and all(u["opcode"] == "convert" and u["shape"]["elementType"] == "S32"
                                          for u in users[inst["id"]]),
        "torch.topk's indices (the MoE router): torch-xla sorts an s32 iota beside the values and converts the "
        "indices to s64, which the block converts straight back to s32; no s64 value is computed with",
    ),
    "scalar constant": (
        lambda ids, users, inst: inst["opcode"] == "constant" and not inst["shape"].get("dimensions")
        and users.get(inst["id"]) and all(u["opcode"] in ("convert", "broadcast") for u in users[inst["id"]]),
        "a compile-time Python int (addcmul's value=1, LayerNorm's element count) that torch-xla materialises as "
        "an s64 scalar constant and converts",
    ),
}


# The element types a graph may hold (S64 and F64 have rules 2 and 3). Source: Neuron's "Data Types" page (NeuronCore
# v2 / v3: FP32, TF32, BF16, FP16, FP8, the integer types) and the compiler's error codes for FP8 E4M3.
ELEMENT_TYPES: dict[str, str] = {
    "F32": "fp32", "BF16": "bf16", "F16": "fp16", "S32": "int32 indices and counters", "U32": "torch-xla's gather "
    "indices", "S8": "int8", "U8": "uint8", "PRED": "masks", "S64": "rule 3", "F64": "rule 2",
    "F8E4M3FN": (
        "float8 weights (an export with FP8 weights, backends/nxd/fp8.py): trn1 / inf2 / trn2 compute FP8 E4M3 as "
        "float8_e4m3 and take F8E4M3FN with --experimental-unsafe-fp8e4m3fn-as-fp8e4m3 (NCC_EVRF051), exact for the "
        "export's weights, fitted to float8_e4m3's range; trn3 natively"
    ),
}


def leaf_shapes(shape: dict) -> Iterator[dict]:
    if shape.get("elementType") == "TUPLE":
        for s in shape.get("tupleShapes", []):
            yield from leaf_shapes(s)
    else:
        yield shape


def _root_opcode(computations: dict, computation_id: str) -> str:
    c = computations[computation_id]
    return next(i for i in c["instructions"] if i["id"] == c["rootId"])["opcode"]


def _rank(ids: dict, inst_id: str) -> int:
    return len(ids[inst_id]["shape"].get("dimensions", []))


def _leading(dims: list[str]) -> str:
    return "leading" if [int(d) for d in dims] == list(range(len(dims))) else "inner"


def form(inst: dict, ids: dict, computations: dict) -> str | None:
    """The form of an op whose compiler support depends on more than its opcode, rank-independent (rank is rule 1);
    None for the others."""
    op = inst["opcode"]
    if op == "gather":
        d = inst["gatherDimensionNumbers"]
        index_map = d.get("startIndexMap", [])
        operand = ids[inst["operandIds"][0]]["shape"].get("dimensions", [])
        sizes = inst.get("gatherSliceSizes", [])
        whole = all(s == o for k, (s, o) in enumerate(zip(sizes, operand)) if str(k) not in index_map)
        kind = "rows" if len(index_map) == 1 else "points"
        collapsed = sorted(d.get("collapsedSliceDims", [])) == sorted(index_map)
        return (f"gather {kind} index_map={_leading(index_map)} collapsed={'yes' if collapsed else 'no'} "
                f"windows={'whole' if whole else 'partial'}")
    if op == "scatter":
        d = inst["scatterDimensionNumbers"]
        index_map = d.get("scatterDimsToOperandDims", [])
        operand_rank = _rank(ids, inst["operandIds"][0])
        inserted = sorted(d.get("insertedWindowDims", [])) == sorted(index_map)
        whole = len(d.get("updateWindowDims", [])) == operand_rank - len(index_map)
        kind = "rows" if len(index_map) == 1 else "points"
        combiner = _root_opcode(computations, inst["calledComputationIds"][0])
        return (f"scatter {kind} index_map={_leading(index_map)} inserted={'yes' if inserted else 'no'} "
                f"windows={'whole' if whole else 'partial'} combiner={combiner}")
    if op in ("dynamic-slice", "dynamic-update-slice"):
        first = 1 if op == "dynamic-slice" else 2
        constant = all(ids[i]["opcode"] == "constant" for i in inst["operandIds"][first:])
        return f"{op} indices={'constant' if constant else 'computed'}"
    if op in ("reduce", "reduce-window", "all-reduce", "reduce-scatter", "select-and-scatter", "sort", "map"):
        combiner = _root_opcode(computations, inst["calledComputationIds"][0])
        n = len(inst["operandIds"])
        inits = [ids[i]["opcode"] for i in inst["operandIds"][n // 2:]] if op in ("reduce", "reduce-window") else []
        init = "" if not inits else " init=" + ("constant" if all(k == "constant" for k in inits) else "computed")
        return f"{op} combiner={combiner}{init}"
    if op == "custom-call":
        return f"custom-call {inst.get('customCallTarget')}"
    return None


def census(hlo: dict) -> dict[str, int]:
    """{"opcode <op>": count, "<form>": count} of one HLO module (every computation)."""
    out = collections.Counter()
    computations = {c["id"]: c for c in hlo["computations"]}
    for c in hlo["computations"]:
        ids = {i["id"]: i for i in c["instructions"]}
        for inst in c["instructions"]:
            out[f"opcode {inst['opcode']}"] += 1
            f = form(inst, ids, computations)
            if f is not None:
                out[f] += 1
    return dict(out)


def dtype_census(hlo: dict) -> dict[str, int]:
    """Max rank, and the number of f64 and s64 values (array shapes, tuple elements counted) of one HLO module."""
    max_rank = f64 = s64 = 0
    for c in hlo["computations"]:
        for inst in c["instructions"]:
            for shape in leaf_shapes(inst["shape"]):
                max_rank = max(max_rank, len(shape.get("dimensions", [])))
                f64 += shape["elementType"] == "F64"
                s64 += shape["elementType"] == "S64"
    return {"max_rank": max_rank, "f64": f64, "s64": s64}


def _describe(inst: dict) -> str:
    shape = inst["shape"]
    dims = ",".join(shape.get("dimensions", []))
    where = inst.get("metadata", {})
    source = f" ({where['sourceFile'].rsplit('/', 1)[-1]}:{where.get('sourceLine')})" if "sourceFile" in where else ""
    return f"{inst['opcode']} {inst['name']} {shape['elementType'].lower()}[{dims}]{source}"


def violations(hlo: dict, reference: set[str] | dict, exceptions: dict[str, str] | None = None,
               s64_allowed: dict[str, tuple] | None = None) -> list[str]:
    """One line per breach of the contract (module docstring) in one HLO module; [] when it holds.

    reference: the census (`census` keys) of the reference graphs; exceptions: form patterns accepted outside it
    (default `FORM_EXCEPTIONS`); s64_allowed: the s64 uses that may remain (default `S64_ALLOWED`)."""
    exceptions = FORM_EXCEPTIONS if exceptions is None else exceptions
    s64_allowed = S64_ALLOWED if s64_allowed is None else s64_allowed
    out = []
    for c in hlo["computations"]:
        ids = {i["id"]: i for i in c["instructions"]}
        users = collections.defaultdict(list)
        for inst in c["instructions"]:
            for operand in inst.get("operandIds", []):
                users[operand].append(inst)
        for inst in c["instructions"]:
            for shape in leaf_shapes(inst["shape"]):
                if len(shape.get("dimensions", [])) >= RANK_LIMIT:
                    out.append(f"rank {len(shape['dimensions'])}: {_describe(inst)}")
                if shape["elementType"] == "F64":
                    out.append(f"f64: {_describe(inst)}")
                elif shape["elementType"] not in ELEMENT_TYPES and shape["elementType"] != "TOKEN":
                    out.append(f"element type {shape['elementType']}: {_describe(inst)}")
                if shape["elementType"] == "S64" and not any(
                    test(ids, users, inst) for test, _ in s64_allowed.values()
                ):
                    out.append(f"s64 not allowed: {_describe(inst)}")
    for entry in sorted(census(hlo)):
        refused = next((reason for p, reason in REFUSED.items() if re.fullmatch(p, entry)), None)
        if refused is not None:
            out.append(f"refused: {entry} ({refused})")
        elif entry not in reference and not any(re.fullmatch(p, entry) for p in exceptions):
            out.append(f"outside the census: {entry}")
    return out


def reference_census(hlos: list[dict]) -> set[str]:
    """The opcodes and forms of the reference graphs (`lowering.reference_hlos`), together."""
    return set().union(*(census(h) for h in hlos))
