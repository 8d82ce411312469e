"""The Neuron targets' class (`Qwen35NxDModelForCausalLM`, what a trn1/trn2 export loads as) around the graphs built
as the export builds them, run on the XLA CPU device, driven by optimum-neuron's vLLM runner: its
`execute_model` (slots, the prompt step with vLLM's zero padding, decode steps), its model wrapper
(`OptimumNeuronModelForCausalLM`: rows sorted by slot, `[:, -1, :]` of the logits) and its sampler.

Where the whole vLLM path stops for a Neuron export here: `vllm serve <trn2 export>` loads the export's `model.pt`,
whose graphs neuronx-cc compiles (NEFFs) during `export`; neuronx-cc is closed and absent, so no Neuron export folder
can be made on this machine. The graphs it would compile are the ones run here; the scheduler's output is given
with the fields the runner reads (`scheduled_new_reqs`, `scheduled_cached_reqs.req_ids`, `finished_req_ids`).
"""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch

from ..conftest import FIXTURES, load_reference

if importlib.util.find_spec("neuron_sdk_standin") is None or importlib.util.find_spec("torch_xla") is None:
    pytest.skip("needs torch-xla and the SDK import stand-ins (the nox vllm session)", allow_module_level=True)

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")  # as tests/neuron_xla/conftest.py
import optimum.neuron  # noqa: E402,F401  (before neuronx-distributed, as optimum-neuron's entry points)

TIE_MARGIN = 1e-5  # a greedy divergence is excused only where the reference's top-2 margin is below this
NEW_TOKENS = 12


def scheduled(new=(), cached=(), finished=()):
    """The scheduler's output as optimum-neuron's runner reads it."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, prompt_token_ids=p, sampling_params=s) for r, p, s in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=list(cached)),
        finished_req_ids=set(finished),
    )


class OutsideInferenceMode:
    """The XLA run as the loaded `model.pt`: the runner steps under `torch.inference_mode()`, which a TorchScript module
    running NEFFs does not mind, but the XLA run swaps the held state into the graph's parameters (`.data`), which
    inference mode forbids; the run itself is left outside it."""

    def __init__(self, traced):
        self.traced = traced

    def __call__(self, *inputs):
        with torch.inference_mode(False):
            return self.traced(*(t.clone() for t in inputs))


def test_optimum_neurons_vllm_runner_drives_the_neuron_graphs():
    from optimum.neuron.vllm.model_loader import OptimumNeuronModelForCausalLM
    from optimum.neuron.vllm.runner import OptimumNeuronModelRunnerForCausalLM
    from optimum.neuron.vllm.sampler import NeuronSampler
    from vllm import SamplingParams

    from tests.kit.neuron_xla import (
        TracedModel, XlaGraphs, build_graphs, export_config, model_class, neuron_config, traced_parallel_state,
    )

    layout = "tiny-nv3x"
    ref = load_reference(layout)
    prompts = {"a": ref["gen_prompt_0"].tolist(), "b": ref["gen_prompt_1"].tolist()}
    assert len(prompts["a"]) != len(prompts["b"])  # the prompt step pads the shorter one
    nc = neuron_config(FIXTURES / layout, "trn2", batch_size=2)
    cls = model_class()
    config = export_config(FIXTURES / layout, nc)
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(task="generate"), cache_config=None, lora_config=None, load_config=None,
        parallel_config=None, scheduler_config=SimpleNamespace(max_num_seqs=nc.batch_size),
        device_config=SimpleNamespace(device=torch.device("cpu")),
    )
    runner = OptimumNeuronModelRunnerForCausalLM(vllm_config)
    tokens = {"a": [], "b": []}
    with traced_parallel_state(1, nc.logical_nc_config):
        run = XlaGraphs(build_graphs(FIXTURES / layout, nc, load_weights=True))
        model = cls(config, nc, OutsideInferenceMode(TracedModel(run)), cls.create_graph_builders(config, nc))
        runner.model = OptimumNeuronModelForCausalLM(model)
        runner.sampler = NeuronSampler(nc)  # what load_model sets without on-device sampling
        greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)

        def record(output):
            for req_id, (token,) in zip(output.req_ids, output.sampled_token_ids):
                tokens[req_id].append(token)

        # Both prompts in one prompt step (vLLM pads with 0), then decode steps of both slots.
        record(runner.execute_model(scheduled(new=[("b", prompts["b"], greedy), ("a", prompts["a"], greedy)])))
        assert [runner.batch.request(r).seq_id for r in ("b", "a")] == [0, 1]
        for _ in range(NEW_TOKENS - 1):
            record(runner.execute_model(scheduled(cached=["a", "b"])))
    for j, req_id in enumerate(("a", "b")):
        got, expected = tokens[req_id], ref[f"gen_tokens_{j}"][:NEW_TOKENS].tolist()
        assert len(got) == NEW_TOKENS
        if got != expected:
            step = next(i for i, (x, y) in enumerate(zip(got, expected)) if x != y)
            assert float(ref[f"gen_margin_{j}"][step]) < TIE_MARGIN, f"request {req_id}: greedy tokens part at step {step}"
