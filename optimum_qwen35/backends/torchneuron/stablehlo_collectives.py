"""The `_c10d_functional` collectives of a graph, carried through upstream torch-mlir into StableHLO collectives.

Upstream torch-mlir (20261001) has no lowering for them: the FX importer emits each as a generic
`torch.operator "torch._c10d_functional.<op>"`, and the torch backend pipeline's first pass (ReduceOpVariants)
refuses any `torch.operator` it does not know (checked: `backend-legal-ops` does not help there). TorchNeuron's
torch-mlir fork lowers them itself (closed). So the check backend, between import and lowering:

1. `hide_collectives`: replaces each collective by a call of a private function declared for it
   (`@c10d.<op>.<n>`, value-semantic tensors in and out, the group and reduction recorded on the declaration), and
   each `wait_tensor` by its operand (a functional collective's result is complete once waited on; on a device the
   runtime orders them). A call passes the torch backend pipeline and the type conversion untouched;
2. `lower_collectives` (after the torch backend pipeline, before `torch-backend-to-stablehlo-backend-pipeline`, whose
   verifier accepts StableHLO ops among the torch ones, not calls): replaces each call by the StableHLO op between
   `torch_c.to_builtin_tensor` / `torch_c.from_builtin_tensor` (which the type conversion then folds away),
   `stablehlo.all_reduce` with an add combiner (`all_reduce(x, "sum", group)`), `stablehlo.all_gather` along
   dimension 0 (`all_gather_into_tensor(x, group_size, group)`, whose result stacks the ranks along dimension 0),
   over the replica group of the process group's ranks, and removes the declarations.

Only the forms this model uses are taken (sum all-reduce, all-gather); any other collective is refused by name."""

from __future__ import annotations

PREFIX = "torch._c10d_functional."
TAKEN = ("all_reduce", "all_gather_into_tensor")


def _walk(op):
    for region in op.regions:
        for block in region.blocks:
            for inner in list(block.operations):
                yield inner.operation
                yield from _walk(inner)


def _string_operand(value) -> str:
    owner = value.owner
    if owner.operation.name != "torch.constant.str":
        raise AssertionError(f"a collective's argument is not a constant string: {owner}")
    from torch_mlir import ir  # optional dependency (torch-mlir)

    return ir.StringAttr(owner.attributes["value"]).value


def _int_operand(value) -> int:
    owner = value.owner
    if owner.operation.name != "torch.constant.int":
        raise AssertionError(f"a collective's argument is not a constant int: {owner}")
    from torch_mlir import ir  # optional dependency (torch-mlir)

    return ir.IntegerAttr(owner.attributes["value"]).value


def hide_collectives(module) -> int:
    """Step 1 on the imported (torch dialect) module; returns how many collectives it found."""
    from torch_mlir import ir  # optional dependency (torch-mlir)

    count = 0
    with module.context, ir.Location.unknown():
        body = module.body
        for op in list(_walk(module.operation)):
            if op.operation.name != "torch.operator":
                continue
            name = ir.StringAttr(op.attributes["name"]).value
            if not name.startswith(PREFIX):
                continue
            kind = name[len(PREFIX):]
            if kind == "wait_tensor":
                op.results[0].replace_all_uses_with(op.operands[0])
                op.erase()
                continue
            if kind not in TAKEN:
                raise AssertionError(f"a collective the check backend does not lower: {name}")
            if kind == "all_reduce":
                reduce_op, group = _string_operand(op.operands[1]), _string_operand(op.operands[2])
                if reduce_op != "sum":
                    raise AssertionError(f"all_reduce with {reduce_op!r}: only sum is lowered")
                attrs = {"c10d.kind": "all_reduce", "c10d.group": group}
            else:
                size, group = _int_operand(op.operands[1]), _string_operand(op.operands[2])
                attrs = {"c10d.kind": "all_gather", "c10d.group": group, "c10d.size": str(size)}
            source = op.operands[0]
            result_type = op.results[0].type
            callee = f"c10d.{kind}.{count}"
            with ir.InsertionPoint.at_block_begin(body):
                declaration = ir.Operation.create(
                    "func.func", attributes={
                        "sym_name": ir.StringAttr.get(callee),
                        "function_type": ir.TypeAttr.get(ir.FunctionType.get([source.type], [result_type])),
                        "sym_visibility": ir.StringAttr.get("private"),
                        **{k: ir.StringAttr.get(v) for k, v in attrs.items()},
                    }, regions=1,
                )
            with ir.InsertionPoint(op), op.location:
                call = ir.Operation.create("func.call", results=[result_type], operands=[source],
                                           attributes={"callee": ir.FlatSymbolRefAttr.get(callee)})
            op.results[0].replace_all_uses_with(call.results[0])
            op.erase()
            del declaration
            count += 1
    return count


_TORCH_ELEMENT = {"f32": "f32", "bf16": "bf16", "f16": "f16"}


def _builtin_type(vtensor_type):
    """!torch.vtensor<[2,16,128],f32> -> tensor<2x16x128xf32>."""
    import re  # start-up time

    from torch_mlir import ir  # optional dependency (torch-mlir)

    match = re.fullmatch(r"!torch\.vtensor<\[([0-9,]*)\],(\w+)>", str(vtensor_type))
    if not match or match.group(2) not in _TORCH_ELEMENT:
        raise AssertionError(f"a collective on {vtensor_type}: only static float tensors are lowered")
    dims = [int(d) for d in match.group(1).split(",") if d]
    return ir.Type.parse(f"tensor<{'x'.join(str(d) for d in dims)}{'x' if dims else ''}{_TORCH_ELEMENT[match.group(2)]}>")


def lower_collectives(module, group_ranks: dict[str, list[int]]) -> int:
    """Step 2 on the torch backend module: every `@c10d.*` call becomes its StableHLO collective. `group_ranks`: the
    ranks of each process group by name. Returns how many were lowered."""
    from torch_mlir import ir  # optional dependency (torch-mlir)

    declarations = {}
    for op in list(module.body.operations):
        if op.operation.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value.startswith("c10d."):
            declarations[ir.StringAttr(op.attributes["sym_name"]).value] = op
    count = 0
    with module.context:
        for op in list(_walk(module.operation)):
            if op.operation.name != "func.call":
                continue
            callee = ir.FlatSymbolRefAttr(op.attributes["callee"]).value
            if callee not in declarations:
                continue
            declaration = declarations[callee]
            kind = ir.StringAttr(declaration.attributes["c10d.kind"]).value
            group = ir.StringAttr(declaration.attributes["c10d.group"]).value
            if group not in group_ranks:
                raise AssertionError(f"process group {group!r} has no ranks given (group_ranks: {sorted(group_ranks)})")
            ranks = group_ranks[group]
            replica_groups = ir.Attribute.parse(
                f"dense<[[{', '.join(str(r) for r in ranks)}]]> : tensor<1x{len(ranks)}xi64>")
            result_type = _builtin_type(op.results[0].type)
            with ir.InsertionPoint(op), op.location:
                source = ir.Operation.create("torch_c.to_builtin_tensor", results=[_builtin_type(op.operands[0].type)],
                                             operands=[op.operands[0]]).results[0]
                if kind == "all_reduce":
                    new = ir.Operation.create(
                        "stablehlo.all_reduce", results=[result_type], operands=[source],
                        attributes={"replica_groups": replica_groups}, regions=1,
                    )
                    element = ir.RankedTensorType(result_type).element_type
                    scalar = ir.RankedTensorType.get([], element)
                    block = new.regions[0].blocks.append(scalar, scalar)
                    with ir.InsertionPoint(block):
                        add = ir.Operation.create("stablehlo.add", results=[scalar],
                                                  operands=[block.arguments[0], block.arguments[1]])
                        ir.Operation.create("stablehlo.return", operands=[add.results[0]])
                else:
                    size = int(ir.StringAttr(declaration.attributes["c10d.size"]).value)
                    if size != len(ranks):
                        raise AssertionError(f"all_gather of {size} ranks over a group of {len(ranks)}")
                    new = ir.Operation.create(
                        "stablehlo.all_gather", results=[result_type], operands=[source],
                        attributes={"replica_groups": replica_groups,
                                    "all_gather_dim": ir.IntegerAttr.get(ir.IntegerType.get_signless(64), 0)},
                    )
                back = ir.Operation.create("torch_c.from_builtin_tensor", results=[op.results[0].type],
                                           operands=[new.results[0]])
            op.results[0].replace_all_uses_with(back.results[0])
            op.erase()
            count += 1
    for declaration in declarations.values():
        declaration.erase()
    return count
