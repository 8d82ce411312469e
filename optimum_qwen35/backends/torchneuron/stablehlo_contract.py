"""The compiler contract of the HLO check (`tests/kit/hlo_contract.py`), applied to the StableHLO the check
backend (`stablehlo_check.py`) gives (one module as text, `LoweredGraph.stablehlo`):

1. no tensor of rank >= 5 (neuronx-cc, NCC_INLA001);
2. no f64 value, after the conversion the check backend applies (`stablehlo_check.fold_f64_constants`);
3. integer indices int32: every index operand of a gather, scatter, dynamic-slice and dynamic-update-slice is i32
   (or a constant), and no other i64 value is computed with, except where `I64_ALLOWED` names the use with its reason;
4. every op and every form of the ops whose compiler support depends on more than the name (gather / scatter
   dimension numbers, reduce combiners, collectives) is in `reference`, the census of upstream transformers' Llama and
   Qwen3 (and Qwen3-MoE) tiny models lowered by the same check backend (`reference_census`), unless `FORM_EXCEPTIONS`
   names it with a sourced reason.

The module is read through torch-mlir's MLIR bindings (`parse`), not as text: every op, nested regions included."""

from __future__ import annotations

import collections
import dataclasses
import re

RANK_LIMIT = 5


@dataclasses.dataclass
class Op:
    name: str
    operands: list[str]  # operand types, as text
    results: list[str]  # result types, as text
    operand_owners: list[str]  # the op name that defines each operand ("arg" for a block argument)
    attributes: dict[str, str]
    location: str
    combiner: str | None  # the root op of the first region (reduce, scatter, all_reduce, sort...)


def parse(text: str) -> list[Op]:
    """Every op of a StableHLO module (nested ones too), in order."""
    from torch_mlir import ir  # optional dependency (torch-mlir)

    from .stablehlo_check import loaded_context  # start-up time: the check backend imports torch

    with loaded_context():
        module = ir.Module.parse(text)
        out = []

        def walk(operation):
            for region in operation.regions:
                for block in region.blocks:
                    for inner in block.operations:
                        inner = inner.operation
                        combiner = None
                        if inner.regions and len(inner.regions[0].blocks):
                            ops = list(inner.regions[0].blocks[0].operations)
                            if ops:
                                ret = ops[-1].operation
                                root = ret.operands[0].owner if len(ret.operands) else None
                                combiner = "parameter" if root is None or isinstance(root, ir.Block) else \
                                    root.operation.name
                        owners = []
                        for v in inner.operands:
                            owner = v.owner
                            owners.append("arg" if isinstance(owner, ir.Block) else owner.operation.name)
                        out.append(Op(
                            name=inner.name, operands=[str(v.type) for v in inner.operands],
                            results=[str(r.type) for r in inner.results], operand_owners=owners,
                            attributes={name: str(inner.attributes[name]) for name in inner.attributes},
                            location=str(inner.location), combiner=combiner,
                        ))
                        walk(inner)

        walk(module.operation)
    return out


_TENSOR = re.compile(r"tensor<((?:\d+x)*)([a-z]\w*)>")


def tensor_types(text: str) -> list[tuple[int, str]]:
    """(rank, element type) of every tensor type in a type's text."""
    return [(m.group(1).count("x"), m.group(2)) for m in _TENSOR.finditer(text)]


def _dims(attr: str, key: str) -> list[int]:
    m = re.search(rf"{key} = \[([0-9, ]*)\]", attr)
    return [int(x) for x in m.group(1).split(",") if x.strip()] if m else []


def _leading(dims: list[int]) -> str:
    return "leading" if dims == list(range(len(dims))) else "inner"


def form(op: Op) -> str | None:
    """The form of an op whose compiler support depends on more than its name (rank-independent), as
    `hlo_contract.form` names the same HLO forms; None for the others."""
    short = op.name.removeprefix("stablehlo.")
    if short == "gather":
        d = op.attributes.get("dimension_numbers", "")
        index_map = _dims(d, "start_index_map")
        collapsed = _dims(d, "collapsed_slice_dims")
        operand = [int(x) for x in re.match(r"tensor<((?:\d+x)*)", op.operands[0]).group(1).split("x") if x]
        sizes = [int(x) for x in re.search(r"array<i64: ([0-9, ]*)>", op.attributes["slice_sizes"]).group(1).split(",")]
        whole = all(s == o for k, (s, o) in enumerate(zip(sizes, operand)) if k not in index_map)
        kind = "rows" if len(index_map) == 1 else "points"
        return (f"gather {kind} index_map={_leading(index_map)} collapsed={'yes' if sorted(collapsed) == sorted(index_map) else 'no'} "
                f"windows={'whole' if whole else 'partial'}")
    if short == "scatter":
        d = op.attributes.get("scatter_dimension_numbers", "")
        index_map = _dims(d, "scatter_dims_to_operand_dims")
        inserted = _dims(d, "inserted_window_dims")
        window = _dims(d, "update_window_dims")
        operand_rank = tensor_types(op.operands[0])[0][0]
        kind = "rows" if len(index_map) == 1 else "points"
        whole = len(window) == operand_rank - len(index_map)
        return (f"scatter {kind} index_map={_leading(index_map)} inserted={'yes' if sorted(inserted) == sorted(index_map) else 'no'} "
                f"windows={'whole' if whole else 'partial'} combiner={(op.combiner or '').removeprefix('stablehlo.')}")
    if short in ("dynamic_slice", "dynamic_update_slice"):
        first = 1 if short == "dynamic_slice" else 2
        constant = all(o in ("stablehlo.constant", "arith.constant") for o in op.operand_owners[first:])
        return f"{short} indices={'constant' if constant else 'computed'}"
    if short in ("reduce", "reduce_window", "all_reduce", "reduce_scatter", "select_and_scatter", "sort"):
        n = len(op.operands)
        inits = op.operand_owners[n // 2:] if short in ("reduce", "reduce_window") else []
        init = "" if not inits else " init=" + ("constant" if all(o in ("stablehlo.constant", "arith.constant")
                                                                   for o in inits) else "computed")
        return f"{short} combiner={(op.combiner or '').removeprefix('stablehlo.')}{init}"
    if short == "custom_call":
        return f"custom_call {op.attributes.get('call_target_name')}"
    return None


def census(ops: list[Op]) -> dict[str, int]:
    """{"op <name>": count, "<form>": count} of one module."""
    out = collections.Counter()
    for op in ops:
        out[f"op {op.name.removeprefix('stablehlo.')}"] += 1
        f = form(op)
        if f is not None:
            out[f] += 1
    return dict(out)


def dtype_census(ops: list[Op]) -> dict[str, int]:
    """Max rank, and the number of f64 and i64 values (op results) of one module."""
    max_rank = f64 = i64 = 0
    for op in ops:
        for t in op.results + op.operands:
            for rank, element in tensor_types(t):
                max_rank = max(max_rank, rank)
        for t in op.results:
            for _, element in tensor_types(t):
                f64 += element == "f64"
                i64 += element == "i64"
    return {"max_rank": max_rank, "f64": f64, "i64": i64}


# Index operands: (op, first index operand, how many).
_INDEX_OPERANDS = {
    "stablehlo.gather": (1, 1),
    "stablehlo.scatter": (1, 1),
    "stablehlo.dynamic_slice": (1, None),
    "stablehlo.dynamic_update_slice": (2, None),
}

# Sources of the reasons below: the neuron-cc operator list for XLA ("neuron-cc list-operators --framework XLA", Neuron
# docs, release-notes/archive/neuron-cc/neuron-cc-ops/neuron-cc-ops-xla; the older compiler's list, the one published:
# it names Clamp, LogicalAnd, LogicalNot, Min, Pad, Scatter, Gather "only disjoint start_index_map and
# remapped_offset_dims", Reduce "Min, Max, Add and Mul are the only supported computations. Init_values must be
# constant"), and the HLO check's census of optimum-neuron's own NxD graphs (`hlo_contract.FORM_EXCEPTIONS`, the
# same ops met there).
# Ops and forms outside the reference census, each with why it is accepted (a pattern matches a whole entry).
FORM_EXCEPTIONS: dict[str, str] = {
    r"op all_reduce|all_reduce combiner=add": (
        "the sum over ranks of the row-parallel layers, the vocabulary-parallel embedding and the MoE block "
        "(`_c10d_functional.all_reduce`, lowered by collectives.py): Allreduce is in the neuron-cc XLA list, and "
        "TorchNeuron documents `_c10d_functional` collectives for TP; the reference census is TP 1 (transformers' "
        "models build no TP graph)"
    ),
    r"op all_gather": (
        "the lm_head's vocabulary blocks gathered (`_c10d_functional.all_gather_into_tensor`, dimension 0): Allgather "
        "is in the neuron-cc XLA list (the reference census is TP 1, as above)"
    ),
    r"op clamp": "index and length clamps (`seq_ids.clamp(min=0)`, lengths): Clamp is in the neuron-cc XLA list",
    r"op minimum": "elementwise min of indices and lengths: Min is in the neuron-cc XLA list",
    r"op not": "`~mask` of the attention and write masks: LogicalNot is in the neuron-cc XLA list",
    r"op or": (
        "elementwise predicate logic on masks (valid | fresh): LogicalAnd / LogicalNot are in the neuron-cc XLA list, "
        "Or is the same elementwise class (a reduce with Or, outside the list's Min/Max/Add/Mul, is not accepted: "
        "`any()` is written as a max reduce)"
    ),
    r"reduce combiner=minimum init=constant": (
        "the first active row of the state writes (`Slots`, graph form: `amin` over the rows, in place of an argmax's "
        "select-combiner reduce): Reduce with Min and a constant init is in the neuron-cc XLA list"
    ),
    r"op tanh": "the vision tower's GELU (tanh form, `gelu_pytorch_tanh`): Tanh is in the neuron-cc XLA list",
    r"op sqrt": "the vision tower's LayerNorm (decomposed: the standard deviation): Sqrt is in the neuron-cc XLA list",
    r"op pad": "the causal conv1d's left padding of the DeltaNet mixer (kernels/conv1d/reference.py): Pad is "
               "in the neuron-cc XLA list",
    r"op log": (
        "softplus of the DeltaNet gate as log(1 + exp(x)) with torch's threshold branch (kernels/gated_delta_rule/"
        "fused.py `softplus`, issue 42): Log is in the neuron-cc XLA list"
    ),
    r"op reduce_window|reduce_window combiner=add init=constant": (
        "torch.cumsum of the gates inside a 64-token chunk (the chunked delta rule's PyTorch form): not in the census "
        "nor the neuron-cc XLA list (the HLO check has the same, open until a neuronx-cc run; nki-library's gdn_cte "
        "computes it as a matmul with a triangular ones matrix)"
    ),
    r"gather rows index_map=inner collapsed=yes windows=whole": (
        "index_select along an inner axis (one indexed dimension, collapsed, whole rows; the MoE block at TP 4, where "
        "experts are gathered per rank): the census's row gathers on another axis; start_index_map and offset dims "
        "disjoint, as the neuron-cc note requires (the HLO check accepts the same form)"
    ),
    r"gather points index_map=leading collapsed=yes windows=whole": (
        "advanced indexing cache[slot, head, position] (the K/V window read before its write): a point gather with "
        "disjoint start_index_map and offset dims, as the neuron-cc note requires"
    ),
    r"scatter rows index_map=leading inserted=yes windows=whole combiner=parameter": (
        "index_copy_ of whole slot rows (the DeltaNet states): Scatter is in the neuron-cc XLA list; the census's "
        "scatters (StaticCache's index_copy_) are point scatters with the same whole trailing window"
    ),
}

# What the contract finds in this model's graphs: nothing is allowed. The table the first check filled (int64 slot
# and position indices of the in-place writes, rank-5 K/V window writes and key-head repeats, an int64 rank tensor at
# TP > 1, the vision LayerNorm's f64 variance and int64 vision inputs) was emptied by issue 48 item 5; each cause and
# its fix: docs/torchneuron.md, "What the check finds". A graph with any finding fails the tests.
KNOWN_FINDINGS: dict[str, str] = {}


def finding(line: str) -> str:
    """The finding a violation line belongs to: "<rule> @ <file of the innermost frame>"."""
    rule = line.split(":", 1)[0]
    where = line.rsplit(" at ", 1)[-1].split(" <- ", 1)[0]
    return f"{rule} @ {where.split(':', 1)[0]}"


def index_violations(ops: list[Op], allowed: dict | None = None) -> list[str]:
    """Rule 3: an i64 index operand of a gather / scatter / dynamic slice that is not a constant."""
    out = []
    for op in ops:
        if op.name not in _INDEX_OPERANDS:
            continue
        first, count = _INDEX_OPERANDS[op.name]
        stop = len(op.operands) if count is None else first + count
        for k in range(first, stop):
            if op.operand_owners[k] in ("stablehlo.constant", "arith.constant"):
                continue
            if any(element == "i64" for _, element in tensor_types(op.operands[k])):
                out.append(f"i64 index: {op.name.removeprefix('stablehlo.')} operand {k} {op.operands[k]} "
                           f"(from {op.operand_owners[k]}) at {_where(op.location)}")
    return out


def _where(location: str) -> str:
    files = re.findall(r'"([^"]+\.py)":(\d+)', location)
    return " <- ".join(f"{f.rsplit('/', 1)[-1]}:{line}" for f, line in files[:3]) or location[:80]


def violations(ops: list[Op], reference: set[str] | None, exceptions: dict[str, str] | None = None,
               index_rule: bool = True) -> list[str]:
    """One line per breach of the contract in one module; [] when it holds. `reference` None: rules 1-3 only (no
    op census to compare with; tests/torchneuron/reference_models.py builds one from transformers' models)."""
    exceptions = FORM_EXCEPTIONS if exceptions is None else exceptions
    out = []
    for op in ops:
        for t in op.results:
            for rank, element in tensor_types(t):
                if rank >= RANK_LIMIT:
                    out.append(f"rank {rank}: {op.name} {t} at {_where(op.location)}")
                if element == "f64":
                    out.append(f"f64: {op.name} {t} at {_where(op.location)}")
    if index_rule:
        out += index_violations(ops)
    for entry in sorted(census(ops) if reference is not None else ()):
        if entry not in reference and not any(re.fullmatch(p, entry) for p in exceptions):
            out.append(f"outside the census: {entry}")
    return out
