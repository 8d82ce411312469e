"""The Neuron targets' graphs as the export builds them, lowered and run on torch-xla's CPU device (tests and
benchmarks of the nox `neuron` session: torch-xla 2.8, neuronx-distributed 0.15, the SDK import stand-ins).

What runs here is the real thing up to the compiler: optimum-neuron 0.4.5's `get_neuron_config`, this project's
`create_graph_builders`, builders and model instances (`load_module`, with optimum-neuron's load-time cast, then
`get`: the module and its input/output aliases), neuronx-distributed 0.15's layers and parallel state, and torch-xla
2.8. Building and lowering the graphs is the product's (`optimum_qwen35.backends.nxd.tracing` and `.lowering`, which
the benchmarks use too); running them as the runtime would is this kit's. The Neuron SDK's closed modules are
import stand-ins (tests/neuron_sdk_standin); the two steps of the closed `torch_neuronx` that come next are done
with torch-xla's own API, and say so:

- `lower` (the product's `backends/nxd/lowering.py`): what `torch_neuronx.xla_impl.trace.generate_hlo` does first --
  the module runs on XLA tensors, its outputs are lowered to one HLO module (torch-xla's `LoweringContext`), and
  each aliased input is found among the HLO's parameters by `tensor_parameter_id` (-1: the input is not a parameter of the graph, and its alias cannot be made);
- `XlaGraphs`: what the Neuron runtime does with the two compiled graphs -- here XLA's CPU compiler runs them, and
  every state output is written back to the state its alias names, which both graphs share by name (as the
  runtime's `INPUT_STATE`s are).

Nothing here compiles for Neuron or runs Neuron code (neuronx-cc, the Neuron runtime, a device).
"""

from __future__ import annotations

import collections

import torch
import torch_xla

# The export's own graph building, lowering and parallel state (the product's, which the benchmarks use too),
# re-exported for the tests.
from optimum_qwen35.backends.nxd.lowering import Graph, Lowered, build_graphs, lower, state_traffic  # noqa: F401
from optimum_qwen35.backends.nxd.tracing import (  # noqa: F401
    CONTEXT,
    IMAGE_CONTEXT,
    IMAGE_TOKENS,
    LOGITS,
    TOKENS,
    export_config,
    model_class,
    neuron_config,
    text_config,
    traced_parallel_state,
    vision_config,
)


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
