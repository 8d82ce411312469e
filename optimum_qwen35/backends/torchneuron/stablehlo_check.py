"""A `torch.compile` backend that takes a graph the way TorchNeuron's `backend="neuron"` does, as far as the open parts
go, and stops at the StableHLO neuronx-cc would receive (docs/torchneuron.md says where it differs and why):

1. TorchDynamo (the caller's `torch.compile(..., backend=CheckBackend(), fullgraph=True, dynamic=False)`): one FX
   graph per call signature; every graph Dynamo hands over is counted (`dynamo_graphs`), so a graph break shows;
2. AOT Autograd (`aot_autograd(..., keep_inference_input_mutations=True)`) with a decomposition table: the graph
   functionalized to ATen, a mutated input written back by one trailing `aten.copy_(input, value)`;
3. the alias rewrite: each trailing `copy_` becomes an extra graph output, aliased to its input (`aliases`: input
   index -> output index, what HLO's input_output_alias would carry); no other mutation may remain;
4. torch-mlir's FX importer (`FxImporter.import_stateless_graph`, what `torch_mlir.fx.stateless_fx_import` calls) and
   its `torchdynamo-export-to-torch-backend-pipeline` (the torch backend contract), the `_c10d_functional`
   collectives kept as `torch.operator`s and rewritten into StableHLO collectives (`collectives.py`: upstream
   torch-mlir has no lowering for them), then `torch-backend-to-stablehlo-backend-pipeline`;
5. the dtype conversion: f64 scalar constants folded into the f32 (or bf16) values they are converted to, the one
   f64 the pipeline leaves (`fold_f64_constants`);
6. the index width: int32 indices that torch-mlir's `aten.index` / `aten.index_put` lowering widened to i64 on
   their way into a gather or scatter, given back their int32 (`narrow_widened_indices`).

The compiled callable runs the rewritten ATen graph on CPU (the very graph handed to torch-mlir) and then writes each
aliased output into its input, as a device would by updating the aliased buffer: tests compare it with eager.

Decompositions: torch-mlir's own table (`torch_mlir.extras.fx_decomp_util.get_decomposition_table`, what its
`export_and_import` applies), plus `EXTRA_DECOMPOSITIONS` (ops the table leaves that the StableHLO lowering refuses),
plus what the caller passes (`decompositions=`): the hook for this project's `torch.library` custom ops (the DeltaNet
kernel seams), which the check lowers through their reference implementation, as TorchNeuron cannot lower an opaque
op either (there, an NKI kernel enters as its own custom call)."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import time
from typing import Callable

import numpy as np
import torch
import torch.fx
from torch._dynamo.backends.common import aot_autograd

from optimum_qwen35.errors import MissingDependencyError

from .stablehlo_collectives import hide_collectives, lower_collectives


def require_torch_mlir() -> None:
    """A one-line error without torch-mlir (the optional `stablehlo` extra)."""
    if importlib.util.find_spec("torch_mlir") is None:
        raise MissingDependencyError(
            "the StableHLO check backend needs torch-mlir, not installed here: pip install 'optimum-qwen35[stablehlo]' "
            "(torch-mlir >= 20261001, from PyPI)"
        )

# Ops that torch-mlir's decomposition table leaves and its StableHLO lowering does not take, to be decomposed by
# torch's own decompositions (torch._decomp). None today: the first trial's two (aten.baddbmm, CPU SDPA) were needed
# without that table; with it (core ATen decompositions + SDPA and its CPU flash form) every graph here lowers.
EXTRA_DECOMPOSITIONS: list = []


def kernel_seam_decompositions() -> dict:
    """The DeltaNet kernel seams (`torch.library` custom ops, one node each in the Dynamo graph) lowered as the torch
    backend's implementation of the same seam, traced into ATen: what this check can lower. On TorchNeuron the NKI
    kernels would enter the graph as custom calls instead (`nki_op` / `wrap_nki`; docs/torchneuron.md)."""
    from optimum_qwen35.kernels import backends  # start-up time

    # The decode reference updates its own new state tensor in place (the rank-1 update: one state-sized tensor fewer
    # on CPU); a decomposition must be functional, so decode runs the reference seam over the same step written
    # out of place (the same operations). The prefill reference (the chunked rule) is functional as it is.
    from optimum_qwen35.kernels.gated_delta_rule import fused  # start-up time
    from optimum_qwen35.kernels.gated_delta_rule.reference import _compute_dtype, expand_key_heads  # start-up time

    def functional_step(q, k, v, g, beta, state):
        dtype = _compute_dtype(q, k, v, g, beta, state)
        nv = v.shape[1]
        S = state.to(dtype) * g.to(dtype).exp()[..., None]
        q, k = expand_key_heads(q, nv).to(dtype), expand_key_heads(k, nv).to(dtype)
        delta = (v.to(dtype) - k @ S) * beta.to(dtype)[..., None]  # [B, nv, 1, dv]
        S = S + k.transpose(-1, -2) @ delta  # S += k delta^T
        return (q @ S).to(v.dtype), S

    def softplus(backend):
        # The gate's softplus of the backend the op names: the Neuron form (exp / log) in the TorchNeuron layers'
        # graphs (`backends.FOR_NEURON`), the CPU one (float64, rounded once) otherwise.
        return fused.softplus if backend == backends.FOR_NEURON else fused.rounded_softplus

    def decode(mixed_qkv, a, b, A_log, dt_bias, conv_weight, initial_conv, initial_recurrent, backend, lnc):
        out = fused.deltanet_decode_reference(mixed_qkv, a, b, A_log, dt_bias, conv_weight, initial_conv,
                                              initial_recurrent, lnc=lnc, rule_step=functional_step,
                                              softplus=softplus(backend))
        return tuple(t.contiguous() for t in out)

    def verify(mixed_qkv, a, b, A_log, dt_bias, conv_weight, initial_conv, initial_recurrent, backend, lnc):
        step = functools.partial(fused.deltanet_decode_reference, rule_step=functional_step, softplus=softplus(backend))
        out = fused.deltanet_verify_reference(mixed_qkv, a, b, A_log, dt_bias, conv_weight, initial_conv,
                                              initial_recurrent, lnc=lnc, decode=step)
        return tuple(t.contiguous() for t in out)

    def prefill(q, k, v, a, b, A_log, dt_bias, initial_recurrent, lengths, backend, lnc):
        out = fused.deltanet_prefill_reference(q, k, v, a, b, A_log, dt_bias, initial_recurrent, lengths, lnc=lnc,
                                               softplus=softplus(backend))
        return tuple(t.contiguous() for t in out)

    ops = torch.ops.optimum_qwen35
    return {ops.deltanet_decode.default: decode, ops.deltanet_verify.default: verify,
            ops.deltanet_prefill.default: prefill}


def decomposition_table(extra: dict | None = None) -> dict:
    from torch._decomp import get_decompositions  # start-up time
    from torch_mlir.extras.fx_decomp_util import get_decomposition_table  # optional dependency (torch-mlir)

    table = dict(get_decomposition_table())
    table.update(get_decompositions(EXTRA_DECOMPOSITIONS))
    table.update(kernel_seam_decompositions())
    table.update(extra or {})
    return table


@dataclasses.dataclass
class LoweredGraph:
    """One graph as the check backend lowered it."""

    name: str
    aten: torch.fx.GraphModule  # the AOT graph after the alias rewrite (what torch-mlir imported, and what runs)
    aliases: dict[int, int]  # graph input index -> graph output index of the value written into it
    user_outputs: int  # outputs of the graph before the rewrite (the caller's outputs)
    input_shapes: list[tuple[tuple[int, ...], torch.dtype]]
    stablehlo: str  # the StableHLO module, as text
    seconds: dict[str, float]  # time per stage: aot (Dynamo's graph to the ATen graph), import, lower


def _is_mutating(node: torch.fx.Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return any(a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments)


def rewrite_input_mutations(gm: torch.fx.GraphModule) -> tuple[dict[int, int], int]:
    """Turn every `aten.copy_(placeholder, value)` that AOT Autograd appends for a mutated input (kept with
    keep_inference_input_mutations=True) into an extra output aliased to that input. Returns ({input index: output
    index}, the number of outputs before). Refuses any other mutation (it could not be aliased)."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    index = {n: i for i, n in enumerate(placeholders)}
    output = graph.output_node()
    outputs = list(output.args[0])
    aliases = {}
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch.ops.aten.copy_.default and node.args[0] in index:
            dst, value = node.args[0], node.args[1]
            if index[dst] in aliases:
                raise AssertionError(f"input {dst.name} is written twice")
            if node.users:  # the copy_'s result read by something else than the output
                if set(node.users) != {output}:
                    raise AssertionError(f"the write into {dst.name} is read inside the graph")
                outputs = [value if o is node else o for o in outputs]
            aliases[index[dst]] = None
            node.replace_all_uses_with(value)
            graph.erase_node(node)
            aliases[index[dst]] = value
        elif _is_mutating(node):
            raise AssertionError(f"a mutation that is not an input write-back remains: {node.format_node()}")
    n_user = len(outputs)
    extra = []
    for i, value in aliases.items():
        extra.append(value)
        aliases[i] = n_user + len(extra) - 1
    output.args = (tuple(outputs + extra),)
    graph.lint()
    gm.recompile()
    return aliases, n_user


# Elementwise ops that `fold_f64_constants` evaluates when every operand is a constant.
_FOLDABLE = {
    "stablehlo.convert": lambda x, dtype: x.astype(dtype),
    "stablehlo.divide": lambda a, b, dtype: (np.trunc(a / b) if np.issubdtype(dtype, np.integer) else a / b).astype(dtype),
    "stablehlo.multiply": lambda a, b, dtype: (a * b).astype(dtype),
    "stablehlo.add": lambda a, b, dtype: (a + b).astype(dtype),
    "stablehlo.subtract": lambda a, b, dtype: (a - b).astype(dtype),
    "stablehlo.ceil": lambda x, dtype: np.ceil(x).astype(dtype),
    "stablehlo.floor": lambda x, dtype: np.floor(x).astype(dtype),
    "stablehlo.negate": lambda x, dtype: (-x).astype(dtype),
    "stablehlo.reshape": lambda x, dtype: x.astype(dtype),
}
_CONSTANTS = ("stablehlo.constant", "arith.constant")


def _nested_ops(op):
    """Every op nested in `op`'s regions, depth first (a module's functions and their bodies)."""
    for region in op.regions:
        for block in region.blocks:
            for inner in list(block.operations):
                yield inner.operation
                yield from _nested_ops(inner.operation)


def _isa(cls, obj) -> bool:
    """isinstance over the MLIR bindings' auto-downcast types and attributes."""
    return isinstance(obj, cls)


def _numpy_dtype(element):
    from torch_mlir import ir  # optional dependency (torch-mlir)

    if _isa(ir.F64Type, element):
        return np.float64
    if _isa(ir.F32Type, element):
        return np.float32
    if _isa(ir.BF16Type, element):
        return None  # no numpy bf16 here: folded through fp32 below
    if _isa(ir.IntegerType, element):
        width = ir.IntegerType(element).width
        return {1: np.bool_, 8: np.int8, 16: np.int16, 32: np.int32, 64: np.int64}[width]
    return None


def _constant_value(op):
    from torch_mlir import ir  # optional dependency (torch-mlir)

    attr = op.attributes["value"]
    element = ir.RankedTensorType(attr.type).element_type
    dtype = _numpy_dtype(element)
    if dtype is None:
        return None
    dense = ir.DenseElementsAttr(attr)
    shape = ir.RankedTensorType(attr.type).shape
    if dense.is_splat:
        splat = dense.get_splat_value()
        scalar = ir.FloatAttr(splat).value if _isa(ir.FloatAttr, splat) else ir.IntegerAttr(splat).value
        return np.full(shape, scalar, dtype=dtype)
    return np.array(dense).astype(dtype).reshape(shape)


def _dense_attr(value: np.ndarray, tensor_type):
    from torch_mlir import ir  # optional dependency (torch-mlir)

    element = ir.RankedTensorType(tensor_type).element_type
    if _isa(ir.BF16Type, element):  # exactly representable: the folded values are rounded once, here
        flat = value.reshape(-1)
        if value.size and np.all(flat == flat[0]):
            return ir.DenseElementsAttr.get_splat(tensor_type, ir.FloatAttr.get(element, float(flat[0])))
        raise AssertionError("a non-splat bf16 constant to fold")
    if value.size and np.all(value == value.reshape(-1)[0]):
        scalar = value.reshape(-1)[0]
        attr = (ir.FloatAttr.get(element, float(scalar)) if _isa(ir.FloatType, element)
                else ir.IntegerAttr.get(element, int(scalar)))
        return ir.DenseElementsAttr.get_splat(tensor_type, attr)
    return ir.DenseElementsAttr.get(np.ascontiguousarray(value), type=element, shape=list(value.shape))


def fold_f64_constants(module) -> int:
    """Evaluate, at compile time, every elementwise op (`_FOLDABLE`) that has an f64 operand or result and only
    constant operands, until none is left; returns how many were folded. These are the f64 values the pipeline leaves:
    Python floats of the model (`x * 0.5`, `x + eps`, `-inf`) materialised by torch-mlir as f64 constants and converted
    at once, and torch-mlir's static length arithmetic (`ceil((end - start) / step)` of an arange, in f64). Exact:
    each folded constant is the value the op would compute, in the op's result type. An f64 value that depends on
    a graph input is not touched (and fails the contract)."""
    from torch_mlir import ir  # optional dependency (torch-mlir)

    def is_f64(value):
        return _isa(ir.RankedTensorType, value.type) and _isa(ir.F64Type, 
            ir.RankedTensorType(value.type).element_type)

    folded = 0
    with module.context:
        changed = True
        while changed:
            changed = False
            for op in list(_nested_ops(module.operation)):
                if op.name not in _FOLDABLE:
                    continue
                if not (any(is_f64(v) for v in op.operands) or is_f64(op.results[0])):
                    continue
                owners = [v.owner.operation if isinstance(v.owner, ir.OpView) else v.owner for v in op.operands]
                if not all(isinstance(o, ir.Operation) and o.name in _CONSTANTS for o in owners):
                    continue
                values = [_constant_value(o) for o in owners]
                result_type = op.results[0].type
                element = ir.RankedTensorType(result_type).element_type
                dtype = _numpy_dtype(element) or np.float32  # bf16: computed in fp32, rounded once by the attribute
                if any(v is None for v in values):
                    continue
                shape = ir.RankedTensorType(result_type).shape
                value = np.asarray(_FOLDABLE[op.name](*values, dtype))
                value = value.reshape(shape) if value.size == int(np.prod(shape)) else np.broadcast_to(value, shape)
                with ir.InsertionPoint(op), op.location:
                    new = ir.Operation.create("stablehlo.constant", results=[result_type],
                                              attributes={"value": _dense_attr(np.asarray(value), result_type)})
                op.results[0].replace_all_uses_with(new.results[0])
                op.erase()
                for owner in set(owners):
                    if not list(owner.results[0].uses):
                        owner.erase()
                folded += 1
                changed = True
                break  # the walk's list is stale after an erase
    return folded


# What torch-mlir's lowering of aten.index.Tensor / aten.index_put widens an int32 index through on its way to a
# gather's or scatter's index operand: the widening `convert` (i32 -> i64), then data movement only.
_INDEX_CHAIN = ("stablehlo.convert", "stablehlo.reshape", "stablehlo.broadcast_in_dim", "stablehlo.concatenate")
_INDEXED = ("stablehlo.gather", "stablehlo.scatter")


def narrow_widened_indices(module) -> int:
    """Give back their int32 to the indices torch-mlir widened: its lowering of `aten.index.Tensor` and
    `aten.index_put` converts every index tensor to i64 (int32 indices included; `index_select` keeps them i32), then
    reshapes / broadcasts / concatenates them into the gather's or scatter's index operand. Where such a chain starts at
    i32 values (the model's int32 indices) and ends only in index operands, it is rebuilt in i32 (the same ops, element
    type i32). Exact: every value of the chain is one of the i32 values it started from. Returns how many ops were
    rebuilt. An i64 index computed with (int64 arithmetic, an int64 input) is not touched (and fails the contract)."""
    from torch_mlir import ir  # optional dependency (torch-mlir)

    def element(value):
        return ir.RankedTensorType(value.type).element_type if _isa(ir.RankedTensorType, value.type) else None

    def owner(value):
        o = value.owner
        return None if isinstance(o, ir.Block) else o.operation

    def is_int(value, width):
        e = element(value)
        return e is not None and _isa(ir.IntegerType, e) and ir.IntegerType(e).width == width

    with module.context:
        ops = list(_nested_ops(module.operation))
        chain = []  # program order
        for op in ops:
            if op.name not in _INDEX_CHAIN or len(op.results) != 1 or not is_int(op.results[0], 64):
                continue
            if op.name == "stablehlo.convert":
                if is_int(op.operands[0], 32):
                    chain.append(op)
            elif all(owner(v) in chain for v in op.operands):
                chain.append(op)
        changed = True
        while changed:  # keep only chains every use of which is an index operand (or the chain's next op)
            changed = False
            for op in list(chain):
                for use in op.results[0].uses:
                    user = use.owner.operation if not isinstance(use.owner, ir.Operation) else use.owner
                    if user in chain or (user.name in _INDEXED and use.operand_number == 1):
                        continue
                    chain.remove(op)
                    changed = True
                    break
            chain = [op for op in chain if op.name == "stablehlo.convert" or all(owner(v) in chain for v in op.operands)]
        for op in chain:
            old = op.results[0]
            if op.name == "stablehlo.convert":
                old.replace_all_uses_with(op.operands[0])
                continue
            with ir.InsertionPoint(op), op.location:
                i32 = ir.RankedTensorType.get(ir.RankedTensorType(old.type).shape, ir.IntegerType.get_signless(32))
                new = ir.Operation.create(op.name, results=[i32], operands=list(op.operands),
                                          attributes={name: op.attributes[name] for name in op.attributes})
            old.replace_all_uses_with(new.results[0])
        for op in reversed(chain):
            op.erase()
        if chain and not module.operation.verify():
            raise AssertionError("the narrowed indices left an invalid module")
    return len(chain)


_DUMMY = """func.func @main(%arg0: !torch.vtensor<[1],f32>) -> !torch.vtensor<[1],f32> {
  %0 = torch.aten.neg %arg0 : !torch.vtensor<[1],f32> -> !torch.vtensor<[1],f32>
  return %0 : !torch.vtensor<[1],f32>
}"""


def loaded_context():
    """An MLIR context with the torch, torch_c and StableHLO dialects loaded (the last two are loaded by the passes
    that create their ops: a one-op function is lowered through the pipeline once), so that their ops can be built
    before those passes run, and StableHLO text parsed (`stablehlo_contract.parse`)."""
    from torch_mlir import ir  # optional dependency (torch-mlir)
    from torch_mlir.compiler_utils import run_pipeline_with_repro_report  # optional dependency (torch-mlir)
    from torch_mlir.dialects import torch as torch_d  # optional dependency (torch-mlir)

    context = ir.Context()
    torch_d.register_dialect(context)
    with context:
        dummy = ir.Module.parse(_DUMMY)
        run_pipeline_with_repro_report(dummy, "builtin.module(torch-backend-to-stablehlo-backend-pipeline)", "load")
    return context


class CheckBackend:
    """The backend object: `torch.compile(module, backend=CheckBackend(), fullgraph=True, dynamic=False)`.

    `decompositions`: extra {op: implementation}, e.g. a custom op mapped to its reference; `group_sizes`: {process
    group name: its ranks}, for the collectives' replica groups (the default group of the test's world).
    `graphs` lists every lowered graph in order; `dynamo_graphs` counts the graphs Dynamo handed over."""

    def __init__(self, decompositions: dict | None = None, group_ranks: dict[str, list[int]] | None = None,
                 name: str = "graph"):
        require_torch_mlir()
        self.decompositions = decomposition_table(decompositions)
        self.group_ranks = group_ranks or {}
        self.name = name
        self.graphs: list[LoweredGraph] = []
        self.dynamo_graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.dynamo_graphs += 1
        start = time.perf_counter()
        return aot_autograd(
            fw_compiler=lambda g, inputs: self._lower(g, inputs, start),
            decompositions=self.decompositions,
            keep_inference_input_mutations=True,
        )(gm, example_inputs)

    def _lower(self, gm: torch.fx.GraphModule, example_inputs, start: float) -> Callable:
        from torch_mlir import ir  # optional dependency (torch-mlir)
        from torch_mlir.compiler_utils import run_pipeline_with_repro_report  # optional dependency (torch-mlir)
        from torch_mlir.extras.fx_importer import FxImporter  # optional dependency (torch-mlir)

        aliases, n_user = rewrite_input_mutations(gm)
        seconds = {"aot": time.perf_counter() - start}
        t = time.perf_counter()
        context = loaded_context()
        importer = FxImporter(context=context)
        importer.import_stateless_graph(gm.graph, func_name="main")
        module = importer.module
        seconds["import"] = time.perf_counter() - t
        t = time.perf_counter()
        collectives = hide_collectives(module)
        run_pipeline_with_repro_report(
            module,
            "builtin.module(func.func(torch-match-quantized-custom-ops), "
            "torchdynamo-export-to-torch-backend-pipeline{ extra-library=})",
            "Lowering TorchFX IR -> Torch Backend IR",
        )
        if lower_collectives(module, self.group_ranks) != collectives:
            raise AssertionError("a collective was lost in the torch backend pipeline")
        run_pipeline_with_repro_report(
            module, "builtin.module(torch-backend-to-stablehlo-backend-pipeline)",
            "Lowering Torch Backend IR -> StableHLO Backend IR",
        )
        fold_f64_constants(module)
        narrow_widened_indices(module)
        seconds["lower"] = time.perf_counter() - t
        graph = LoweredGraph(
            name=f"{self.name}_{len(self.graphs)}", aten=gm, aliases=aliases, user_outputs=n_user,
            input_shapes=[(tuple(x.shape), x.dtype) for x in example_inputs],
            stablehlo=module.operation.get_asm(large_elements_limit=16, enable_debug_info=True), seconds=seconds,
        )
        self.graphs.append(graph)

        def run(*args):
            outputs = gm(*args)
            for i, j in aliases.items():
                args[i].copy_(outputs[j])
            return tuple(outputs[:n_user])

        run._boxed_call = False
        return run
