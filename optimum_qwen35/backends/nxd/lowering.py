"""The NxD export's graphs lowered to HLO on torch-xla's CPU device, as `torch_neuronx`'s `generate_hlo` lowers them
first, and what their HLO says (no Neuron SDK, no compiler: what the graphs hand to neuronx-cc).

- `build_graphs`: every graph's module as neuronx-distributed's `ModelBuilder` gets them (builder -> model instance ->
  `load_module` -> `get`), on the XLA device, optionally with rank 0's weights;
- `lower`: the module run on XLA tensors, its outputs lowered to one HLO module (torch-xla's `LoweringContext`), and
  each held state input found among the HLO's parameters (`tensor_parameter_id`);
- `state_traffic`: the bytes of each held state a graph reads and writes per call, from its HLO;
- `reference_hlos`: optimum-neuron 0.4.5's own Qwen3, Llama and Qwen3-MoE graphs lowered the same way (the reference
  of the compiler contract, `hlo_contract`).

Build them inside `tracing.traced_parallel_state`. Needs the `neuron` extra's stack (torch-xla 2.8,
neuronx-distributed 0.15, optimum-neuron 0.4.5); the Neuron SDK's closed modules are not called (`reference_hlos`
replaces the two that optimum-neuron's decoders call while tracing: `patches.closed_neuron_ops_as_torch`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
import torch_xla

from optimum_qwen35 import patches
from optimum_qwen35.backends.nxd import fp8
from optimum_qwen35.backends.nxd import state_dict as weights
from optimum_qwen35.backends.nxd.tracing import export_config, model_class, traced_parallel_state, vision_config


@dataclass
class Graph:
    key: str
    module: torch.nn.Module  # on the XLA device
    alias_names: dict[str, int]  # aliased parameter name -> graph output index
    example_inputs: tuple


def build_graphs(folder: str | os.PathLike, nc, load_weights: bool = False, image_buckets=None,
                 max_speculative_tokens: int = 0, fp8_weights: bool = False, fp8_lm_head: bool = False) -> dict[str, Graph]:
    """Every graph's module as `ModelBuilder` gets them (builder -> model instance -> load_module -> get), moved to
    the XLA device. `load_weights`: rank 0's tensors (optimum-neuron's `get_state_dict` -> this project's per-rank
    split, a vision export's tower split by heads under `visual.`, an mtp export's head), as the runtime loads them;
    otherwise the modules keep their initial values (enough to lower them). `image_buckets`: a vision export's graphs
    too; `max_speculative_tokens`: those of an export made with mtp=True (K); `fp8_weights`: those of an export
    with FP8 weights (backends/nxd/fp8.py), `fp8_lm_head` its lm_head too."""
    cls = model_class()
    config = export_config(folder, nc, image_buckets, max_speculative_tokens, fp8_weights, fp8_lm_head)
    builders = cls.create_graph_builders(config, nc)
    rank0 = None
    if load_weights and fp8_weights:
        rank0 = fp8.fp8_rank_state_dict(folder, config, nc.tp_degree, 0, nc.torch_dtype)
    elif load_weights:
        whole = cls.get_state_dict(str(folder), config, nc)
        rank0 = weights.rank_state_dict(whole, nc.tp_degree, 0, nc.torch_dtype, config)
    if rank0 is not None:
        if image_buckets:
            rank0.update(weights.vision_rank_state_dict(folder, vision_config(folder), nc.tp_degree, 0, nc.torch_dtype))
        if max_speculative_tokens:
            rank0.update(weights.mtp_rank_state_dict(folder, config, nc.tp_degree, 0, nc.torch_dtype))
    graphs, used = {}, set()
    for key, builder in builders.items():
        instance = builder.get_model_instance()
        instance.load_module()
        module, aliases = instance.get(0)
        names = {id(p): n for n, p in module.named_parameters()}
        alias_names = {names[id(p)]: output for p, output in aliases.items()}
        if rank0 is not None:
            module_names = set(module.state_dict())
            own = {n: t for n, t in rank0.items() if n in module_names}
            used |= set(own)
            missing, _ = module.load_state_dict(own, strict=False)
            # Not loaded: the held state (zeros, as the runtime initialises it) and neuronx-distributed's unsharded
            # `master_weight` copies, which its parallel layers keep on CPU and the forward never reads.
            left = [n for n in missing if not n.startswith("past_key_values.") and not n.endswith(".master_weight")]
            assert not left, (key, left)
        # Parameters move to the device as new Parameter objects (CPU and XLA tensors cannot share one), hence the
        # aliases by name.
        graphs[key] = Graph(key, module.to(torch_xla.device()), alias_names, builder.input_generator()[0])
    if rank0 is not None:
        assert used == set(rank0), f"tensors no graph takes: {sorted(set(rank0) - used)[:10]}"
    return graphs


@dataclass
class Lowered:
    parameter_ids: dict[str, int]  # held state parameter name -> HLO parameter number (-1: not a graph input)
    num_outputs: int
    hlo: dict  # the HloModuleProto as JSON (torch-xla's `LoweringContext.hlo_json`)

    @property
    def entry(self) -> list[dict]:
        return next(c for c in self.hlo["computations"] if c["id"] == self.hlo["entryComputationId"])["instructions"]

    @property
    def instruction_count(self) -> int:
        """Instructions of the whole module (entry and called computations)."""
        return sum(len(c["instructions"]) for c in self.hlo["computations"])


def lower(graph: Graph) -> Lowered:
    """Run the module on its example inputs (XLA tensors) and lower its outputs to one HLO module."""
    device = torch_xla.device()
    outputs = graph.module(*(t.to(device) for t in graph.example_inputs))
    context = torch_xla._XLAC.lowering.LoweringContext("qwen35")
    context.build(list(outputs))
    params = dict(graph.module.named_parameters())
    # Every held state tensor (the aliased ones, and those a graph without aliases must not read): -1 where the
    # tensor is not an input of the graph.
    held = [name for name in params if name.startswith("past_key_values.")]
    ids = {name: context.tensor_parameter_id(params[name]) for name in held}
    lowered = Lowered(ids, len(outputs), json.loads(context.hlo_json()))
    # Lowered, not run (as `generate_hlo`): drop the pending computation, which a later sync would otherwise execute
    # (a TP 2 graph's collectives cannot run on this one-device CPU client).
    torch_xla._XLAC._clear_pending_irs(str(device))
    return lowered


# ------------------------------------------------------------------------------------------ state traffic of a graph
_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "S32": 4, "S64": 8, "U32": 4, "PRED": 1, "S8": 1, "U8": 1, "F8E4M3FN": 1}
_VIEWS = ("reshape", "bitcast", "slice", "transpose")  # what reads no data of its own
_UPDATES = ("scatter", "dynamic-update-slice")  # what writes into its operand 0 (in its buffer, when aliased)


def _nbytes(shape: dict) -> int:
    return math.prod(int(d) for d in shape.get("dimensions", [])) * _BYTES[shape["elementType"]]


def state_traffic(lowered: Lowered, graph: Graph) -> dict[str, tuple[int, int]]:
    """Bytes of each held state the graph reads and writes per call, from its HLO.

    Reads: what the ops consuming the state (through views) take of it: a gather or dynamic-slice its result, any
    other op the whole (view of the) state; the state an update writes into is not read. Writes: an aliased
    output made by scatters / dynamic-update-slices into the state writes their updates (in place: the input's
    buffer is the output's); an output made any other way rewrites the whole state. A lower bound of what a
    compiler moves for these ops (it may move more, never less), not a measurement of a device."""
    entry = {i["id"]: i for i in lowered.entry}
    users: dict[str, list[dict]] = {}
    for inst in lowered.entry:
        for operand in inst.get("operandIds", []):
            users.setdefault(operand, []).append(inst)
    params = {int(i.get("parameterNumber", 0)): i for i in lowered.entry if i["opcode"] == "parameter"}
    root = entry[next(c for c in lowered.hlo["computations"] if c["id"] == lowered.hlo["entryComputationId"])["rootId"]]

    def reads(inst_id: str) -> int:
        total = 0
        for user in users.get(inst_id, []):
            if user["opcode"] == "tuple":  # the graph's outputs: handed back, not read
                continue
            if user["opcode"] in _VIEWS:
                total += reads(user["id"])
            elif user["opcode"] in ("gather", "dynamic-slice"):
                total += _nbytes(user["shape"])
            elif user["opcode"] in _UPDATES and user["operandIds"][0] == inst_id:
                total += reads(user["id"])  # the updated state (the same buffer, when aliased) read afterwards
            else:
                total += _nbytes(entry[inst_id]["shape"])
        return total

    def writes(inst: dict, param_id: str) -> int:
        if inst["id"] == param_id:
            return 0
        if inst["opcode"] in _UPDATES:
            update = entry[inst["operandIds"][2 if inst["opcode"] == "scatter" else 1]]
            return _nbytes(update["shape"]) + writes(entry[inst["operandIds"][0]], param_id)
        identity = inst["opcode"] == "transpose" and inst.get("dimensions") == [str(i) for i in range(len(inst["dimensions"]))]
        if inst["opcode"] in ("reshape", "bitcast") or identity:
            return writes(entry[inst["operandIds"][0]], param_id)
        return _nbytes(entry[param_id]["shape"])

    traffic = {}
    for name, output in graph.alias_names.items():
        param = params[lowered.parameter_ids[name]]
        traffic[name] = (reads(param["id"]), writes(entry[root["operandIds"][output]], param["id"]))
    return traffic


# ------------------------------------------------------------------------------- the reference graphs' census
# qwen3_moe: optimum-neuron's MoE decoder (neuronx-distributed's RouterTopK + ExpertMLPs), whose router's torch.topk
# brings the sort the MoE graphs here have too.
REFERENCE_MODELS = ("qwen3", "llama", "qwen3_moe")


def tiny_reference_config(kind: str):
    """A tiny transformers config of optimum-neuron 0.4.5's Qwen3, Llama or Qwen3-MoE NxD model: 2 layers, GQA 4/2
    (MoE: 6 experts, top 2)."""
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig  # the reference only: imported where used

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, torch_dtype="float32")
    if kind == "qwen3_moe":
        return Qwen3MoeConfig(head_dim=16, moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2,
                              norm_topk_prob=True, **common)
    return Qwen3Config(head_dim=16, **common) if kind == "qwen3" else LlamaConfig(**common)


def reference_hlos(kind: str, target: str, tp: int, dtype, batch_size: int = 2, sequence_length: int = 128) -> dict:
    """The HLO of each graph optimum-neuron 0.4.5's `kind` NxD model builds (its own `_get_neuron_config` and
    `create_graph_builders`, model instances as `ModelBuilder` uses them), lowered as `lower` lowers ours.
    On-device sampling is off (its sampler calls a closed NKI cumsum; this project samples on the host)."""
    from optimum.neuron.models.inference.llama.modeling_llama import LlamaNxDModelForCausalLM  # the reference only
    from optimum.neuron.models.inference.qwen3.modeling_qwen3 import Qwen3NxDModelForCausalLM  # the reference only
    from optimum.neuron.models.inference.qwen3_moe.modeling_qwen3_moe import (  # the reference only
        Qwen3MoeNxDModelForCausalLM,
    )
    from optimum.neuron.utils.instance import align_compilation_target  # the reference only

    cls = {"qwen3": Qwen3NxDModelForCausalLM, "llama": LlamaNxDModelForCausalLM,
           "qwen3_moe": Qwen3MoeNxDModelForCausalLM}[kind]
    align_compilation_target(target, override=True)
    nc = cls._get_neuron_config(None, None, target, batch_size, sequence_length, tp, dtype)
    nc.on_device_sampling = False
    out = {}
    with traced_parallel_state(tp, nc.logical_nc_config), patches.closed_neuron_ops_as_torch():
        for key, builder in cls.create_graph_builders(tiny_reference_config(kind), nc).items():
            instance = builder.get_model_instance()
            instance.load_module()
            module, _ = instance.get(0)
            out[key] = lower(Graph(key, module.to(torch_xla.device()), {}, builder.input_generator()[0])).hlo
    return out
