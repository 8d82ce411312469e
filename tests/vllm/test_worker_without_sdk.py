"""The worker a cpu export runs in (`optimum_qwen35/serving/vllm_worker.py`) where the Neuron SDK is not installed:
neuronx-cc, neuronx-distributed and torch-neuronx made unimportable in a child interpreter (`sys.modules[name] =
None`, as if absent). optimum-neuron's worker then imports (its sampler module is vLLM's sampler, the compiler version
None), and its runner, with this package's loader, serves the export: greedy tokens equal `generate()`, for two
prompts in one prompt step and the decode steps after it."""

from __future__ import annotations

import json
import subprocess
import sys

from .conftest import EXPORT, environment, greedy, prompts

CHILD = r"""
import json, sys
from types import SimpleNamespace
for name in ("neuronxcc", "neuronx_distributed", "torch_neuronx", "libneuronxla"):
    sys.modules[name] = None  # absent: importing it raises ModuleNotFoundError
import torch
from vllm import SamplingParams
from optimum_qwen35.serving import vllm_worker
from optimum.neuron.utils import version_utils
from optimum.neuron.vllm import runner

export, batch, new_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
config = SimpleNamespace(
    model_config=SimpleNamespace(task="generate", model=export), cache_config=None, lora_config=None,
    load_config=None, parallel_config=None, scheduler_config=SimpleNamespace(max_num_seqs=4),
    device_config=SimpleNamespace(device=torch.device("cpu")), additional_config={})  # VllmConfig's default
step = vllm_worker.Qwen35CpuExportRunner(config)
step.load_model()
greedy = SamplingParams(temperature=0, max_tokens=new_tokens)
names = [str(i) for i in range(len(batch))]

def scheduled(new=(), cached=()):
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=n, prompt_token_ids=p, sampling_params=greedy) for n, p in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=list(cached)), finished_req_ids=set())

tokens = {n: [] for n in names}
outputs = [step.execute_model(scheduled(new=zip(names, batch)))]
outputs += [step.execute_model(scheduled(cached=names)) for _ in range(new_tokens - 1)]
for output in outputs:
    for req_id, (token,) in zip(output.req_ids, output.sampled_token_ids):
        tokens[req_id].append(token)
print(json.dumps({
    "sampler": runner.NeuronSampler.__module__ + "." + runner.NeuronSampler.__qualname__,
    "compiler": version_utils.get_neuronxcc_version(),
    "tokens": [tokens[n] for n in names],
}))
"""


def test_a_cpu_export_is_served_by_the_worker_without_the_neuron_sdk(work, reference):
    batch, new_tokens = prompts([9, 130], seed=6), 5
    result = subprocess.run([sys.executable, "-c", CHILD, str(work / EXPORT), json.dumps(batch), str(new_tokens)],
                            env=environment(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["sampler"] == "optimum_qwen35.patches.vllm_worker_without_neuron_sdk.<locals>.HostSampler"
    assert out["compiler"] is None
    # generate() stops at EOS; the runner steps on (vLLM's scheduler would end the request there).
    for got, prompt in zip(out["tokens"], batch):
        expected = greedy(reference, prompt, new_tokens)
        assert got[: len(expected)] == expected
