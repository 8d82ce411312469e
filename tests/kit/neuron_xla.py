"""The Neuron targets' graphs as the export builds them, lowered and run on torch-xla's CPU device (tests and
benchmarks of the nox `neuron` session: torch-xla 2.8, neuronx-distributed 0.15, the SDK import stand-ins).

What runs here is the real thing up to the compiler: optimum-neuron 0.4.5's `get_neuron_config`, this project's
`create_graph_builders`, builders and model instances (`load_module`, with optimum-neuron's load-time cast, then
`get`: the module and its input/output aliases), neuronx-distributed 0.15's layers and parallel state, and torch-xla
2.8. The Neuron SDK's closed modules are import stand-ins (tests/neuron_sdk_standin); the two steps of the closed
`torch_neuronx` that come next are done here with torch-xla's own API, and say so:

- `lower`: what `torch_neuronx.xla_impl.trace.generate_hlo` does first -- the module runs on XLA tensors, its outputs
  are lowered to one HLO module (torch-xla's `LoweringContext`), and each aliased input is found among the HLO's
  parameters by `tensor_parameter_id` (-1: the input is not a parameter of the graph, and its alias cannot be made);
- `XlaGraphs`: what the Neuron runtime does with the two compiled graphs -- here XLA's CPU compiler runs them, and
  every state output is written back to the state its alias names, which both graphs share by name (as the
  runtime's `INPUT_STATE`s are).

Nothing here compiles for Neuron or runs Neuron code (neuronx-cc, the Neuron runtime, a device).
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch_xla
from transformers import AutoConfig

from optimum_qwen35.backends.nxd import state_dict as weights
from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM
from optimum_qwen35.export import cpu as cpu_export

CONTEXT, TOKENS, LOGITS = "context_encoding", "token_generation", "context_logits_model"
IMAGE_CONTEXT, IMAGE_TOKENS = "image_context_encoding", "image_token_generation"


def neuron_config(folder: str | os.PathLike, target: str, tp: int = 1, dtype=torch.float32, batch_size: int = 2,
                  sequence_length: int = 128):
    """The NxDNeuronConfig the export makes (`get_neuron_config`, the entry point optimum-neuron's exporter calls),
    after aligning the compilation target as the exporter does first (`align_compilation_target(override=True)`:
    `NEURON_PLATFORM_TARGET_OVERRIDE`, which neuronx-distributed's parallel state reads)."""
    from optimum.neuron.utils.instance import align_compilation_target

    align_compilation_target(target, override=True)
    return Qwen35NeuronModelForCausalLM.get_neuron_config(
        Path(folder), batch_size=batch_size, sequence_length=sequence_length, tensor_parallel_size=tp,
        target=target, dtype=dtype, config=text_config(folder),
    )


def text_config(folder: str | os.PathLike):
    """The folder's text config as AutoConfig reads it (the package registers every Qwen3.5 type with transformers
    4.57, the MoE ones included)."""
    return AutoConfig.from_pretrained(folder).get_text_config()


def model_class():
    from optimum_qwen35.backends.nxd.model import Qwen35NxDModelForCausalLM

    return Qwen35NxDModelForCausalLM


def export_config(folder: str | os.PathLike, nc, image_buckets=None, max_speculative_tokens: int = 0):
    """The text config `Qwen35NeuronModelForCausalLM._export` hands the NxD class (a vision export's with
    `image_buckets`; an export made with mtp=True with `max_speculative_tokens`)."""
    vision = (vision_config(folder), image_buckets) if image_buckets else None
    return cpu_export.export_config(text_config(folder), str(folder), nc.torch_dtype, vision, max_speculative_tokens)


@contextlib.contextmanager
def traced_parallel_state(tp_degree: int, lnc: int = 1):
    """The parallel state neuronx-distributed's `ModelBuilder.trace` builds every graph in (model_builder.py
    L1408-1418): a mocked world of `tp_degree` ranks, this process rank 0, the target's logical core size (the neuron
    config's `logical_nc_config`), collectives lowered ahead of time."""
    from neuronx_distributed.parallel_layers import parallel_state
    from neuronx_distributed.trace.mock_torchdist import mock_distributed

    with mock_distributed(world_size=tp_degree):
        torch.distributed.init_process_group("xla", rank=0, world_size=tp_degree)
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp_degree, skip_collective_init=True, lnc_size=lnc
        )
        parallel_state.set_aot_mode(True)
        try:
            yield
        finally:
            parallel_state.set_aot_mode(False)
            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()


@dataclass
class Graph:
    key: str
    module: torch.nn.Module  # on the XLA device
    alias_names: dict[str, int]  # aliased parameter name -> graph output index
    example_inputs: tuple


def vision_config(folder: str | os.PathLike):
    from optimum_qwen35.modeling.vision import VisionConfig

    return VisionConfig.from_dict(json.loads((Path(folder) / "config.json").read_text()))


def build_graphs(folder: str | os.PathLike, nc, load_weights: bool = False, image_buckets=None,
                 max_speculative_tokens: int = 0) -> dict[str, Graph]:
    """Every graph's module as `ModelBuilder` gets them (builder -> model instance -> load_module -> get), moved to
    the XLA device. `load_weights`: rank 0's tensors (optimum-neuron's `get_state_dict` -> this project's per-rank
    split, a vision export's tower split by heads under `visual.`, an mtp export's head), as the runtime loads them;
    otherwise the modules keep their initial values (enough to lower them). `image_buckets`: a vision export's graphs
    too; `max_speculative_tokens`: those of an export made with mtp=True (K)."""
    cls = model_class()
    config = export_config(folder, nc, image_buckets, max_speculative_tokens)
    builders = cls.create_graph_builders(config, nc)
    rank0 = None
    if load_weights:
        whole = cls.get_state_dict(str(folder), config, nc)
        rank0 = weights.rank_state_dict(whole, nc.tp_degree, 0, nc.torch_dtype, config)
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
_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "S32": 4, "S64": 8, "U32": 4, "PRED": 1, "S8": 1, "U8": 1}
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


class XlaGraphs:
    """The two graphs run on the XLA CPU device with one shared state, as the runtime runs them: a call's state
    outputs become the state every graph reads next (the aliases, by parameter name)."""

    def __init__(self, graphs: dict[str, Graph]):
        self.graphs = graphs
        self.device = torch_xla.device()
        held = graphs[CONTEXT].alias_names
        self.state = {name: dict(g.module.named_parameters())[name].data for g in graphs.values() for name in held
                      if name in g.alias_names}

    def __call__(self, key: str, input_ids, position_ids, seq_ids, *image_inputs) -> torch.Tensor:
        """A decoder graph: the text graphs' inputs, then the image graphs' (rotary positions, and for context
        encoding the image embeddings and their mask)."""
        graph = self.graphs[key]
        params = dict(graph.module.named_parameters())
        for name in graph.alias_names:
            params[name].data = self.state[name]
        batch = input_ids.shape[0]
        inputs = (input_ids, position_ids, seq_ids, torch.zeros(batch, 3), *image_inputs)
        outputs = graph.module(*(torch.as_tensor(t).to(self.device) for t in inputs))
        for name, output in graph.alias_names.items():
            self.state[name] = outputs[output]
        torch_xla.sync()  # one graph execution: the logits and every state output
        return outputs[0].cpu()[:, 0]  # [B, vocab] fp32

    def vision(self, bucket: int, *inputs) -> torch.Tensor:
        """The vision graph of an image bucket (no state): the merged tokens [bucket / 4, hidden]."""
        (merged,) = self.graphs[f"vision_{bucket}"].module(*(torch.as_tensor(t).to(self.device) for t in inputs))
        torch_xla.sync()
        return merged.cpu()

    def score(self, input_ids, position_ids) -> torch.Tensor:
        """The per-position logits graph (no state in or out): logits [B, T, vocab] fp32."""
        (logits,) = self.graphs[LOGITS].module(*(torch.as_tensor(t).to(self.device) for t in (input_ids, position_ids)))
        torch_xla.sync()
        return logits.cpu()



class TracedModel:
    """The loaded `model.pt` as optimum-neuron's model classes call it: one callable that routes each call to the
    graph whose inputs it has (as neuronx-distributed's runtime does by shapes, `spmd.py` L156), here the XLA run:
    2 inputs the per-position logits graph; 4 the text graphs; 5 with float patches first a vision graph (by its
    bucket's row count), else image token generation; 7 image context encoding."""

    def __init__(self, run: XlaGraphs):
        self.run = run

    def __call__(self, input_ids, position_ids, *rest):
        if not rest:
            return self.run.score(input_ids, position_ids)
        if input_ids.is_floating_point():  # patches [bucket, patch_dim]
            return self.run.vision(input_ids.shape[0], input_ids, position_ids, *rest)
        seq_ids, image_inputs = rest[0], rest[2:]
        text, image = (CONTEXT, IMAGE_CONTEXT) if input_ids.shape[-1] > 1 else (TOKENS, IMAGE_TOKENS)
        return self.run(image if image_inputs else text, input_ids, position_ids, seq_ids, *image_inputs)[:, None]



class ShapeRoutedModel:
    """The loaded `model.pt` as neuronx-distributed's runtime runs it (`NxDModel.router`, spmd.py): each call goes to
    the graph whose example inputs have the call's shapes, here run on the XLA CPU device with one shared held state
    (a call's aliased outputs become the state every graph reads next, by parameter name); the call returns the
    graph's outputs that are not aliased (`generate_hlo(..., output_aliased_tensor=False)`), on the host (one of them
as a tensor). `runs`
    counts the calls of each graph."""

    def __init__(self, graphs: dict[str, Graph]):
        self.graphs = graphs
        self.device = torch_xla.device()
        self.routes = {}
        for key, graph in graphs.items():
            route = str([t.shape for t in graph.example_inputs])
            assert route not in self.routes, f"{key} and {self.routes[route]} take inputs of the same shapes"
            self.routes[route] = key
        self.state = {}
        for graph in graphs.values():
            params = dict(graph.module.named_parameters())
            self.state.update({name: params[name].data for name in graph.alias_names})
        self.runs = collections.Counter()

    def __call__(self, *inputs):
        key = self.routes[str([torch.as_tensor(t).shape for t in inputs])]
        graph = self.graphs[key]
        params = dict(graph.module.named_parameters())
        for name in graph.alias_names:
            params[name].data = self.state[name]
        with torch.no_grad():
            outputs = graph.module(*(torch.as_tensor(t).to(self.device) for t in inputs))
        for name, output in graph.alias_names.items():
            self.state[name] = outputs[output]
        torch_xla.sync()  # one graph execution: its outputs and every state output
        self.runs[key] += 1
        aliased = set(graph.alias_names.values())
        out = [t.cpu() for i, t in enumerate(outputs) if i not in aliased]
        return out[0] if len(out) == 1 else out  # one output as a tensor (optimum-neuron's wrappers read it so)
