"""optimum-neuron's vLLM worker for a cpu-target export (chosen by `registration` for such exports only).

optimum-neuron's worker assumes a Neuron device at three places, none of which a cpu export needs:
- `model_loader.create` counts the machine's Neuron cores (0 here) against the tensor-parallel degree, and reads the
  export through `NeuronConfig.from_pretrained`, which refuses a config whose `neuronxcc_version` differs from the
  installed compiler's (a cpu export records null: it has no compiler). The runner below loads the export with
  this package's class instead; everything else (slots, the prompt and decode steps, sampling) is optimum-neuron's.
- `model_loader` asks for the neuronx-cc version when it is imported, and `sampler` imports neuronx-distributed's
  sampling (with torch-neuronx and neuronx-cc) when it is imported. Where the Neuron SDK is installed they import
  and are used unchanged. Where it is not, in this process only (vLLM's engine process for a cpu export):
  the compiler version reads as None, and the sampler is vLLM's own (same top-k / top-p / temperature, its own
  random draws).
"""

from __future__ import annotations

import hashlib

import torch

from optimum_qwen35 import patches

patches.vllm_worker_without_neuron_sdk()  # before optimum-neuron's worker modules are imported

from optimum.neuron.vllm import runner as _runner  # noqa: E402
from optimum.neuron.vllm.model_loader import OptimumNeuronModelForCausalLM  # noqa: E402
from optimum.neuron.vllm.worker import OptimumNeuronWorker  # noqa: E402

from optimum_qwen35.optimum_neuron.modeling import Qwen35NeuronModelForCausalLM  # noqa: E402


# The worker's prefix-cache budget in bytes, from vLLM's `--additional-config` JSON (`additional_config=` in
# `vllm.LLM`); 0 turns the cache off. Unset: "auto"'s default, 4 GiB (docs/prefix_caching.md).
PREFIX_CACHE_BYTES = "qwen35_prefix_cache_bytes"


class Qwen35CpuExportRunner(_runner.OptimumNeuronModelRunnerForCausalLM):
    """optimum-neuron's runner; the export is loaded by this package's class (no Neuron core or compiler check)."""

    def load_model(self) -> None:
        model = Qwen35NeuronModelForCausalLM.from_pretrained(self.model_config.model)
        extra = self.vllm_config.additional_config
        budget = extra.get(PREFIX_CACHE_BYTES) if isinstance(extra, dict) else None
        if budget == 0:
            model.set_prefix_cache(None)
        elif budget is not None:
            model.set_prefix_cache("auto", budget_bytes=budget)
        self.model = OptimumNeuronModelForCausalLM(model)
        if not model.neuron_config.on_device_sampling:
            self.sampler = _runner.NeuronSampler(model.neuron_config)


    def execute_model(self, scheduler_output):
        """optimum-neuron's step. A request with a `seed`: optimum-neuron's runner passes no per-request generator
        to its sampler, which draws from torch's global generator; that generator is seeded here, before a step
        holding seeded requests, from their seeds and token counts. A seeded request is then reproducible whenever
        it runs with the same companions in its steps (alone, or the same batch), as vLLM's own seeds are."""
        keys = [(new.sampling_params.seed, 0) for new in scheduler_output.scheduled_new_reqs
                if new.sampling_params is not None and new.sampling_params.seed is not None]
        for req_id in scheduler_output.scheduled_cached_reqs.req_ids:
            request = self.batch.request(req_id)
            if request.sampling_params.seed is not None:
                keys.append((request.sampling_params.seed, len(request.output_token_ids)))
        if keys:
            torch.manual_seed(int(hashlib.sha256(repr(sorted(keys)).encode()).hexdigest()[:15], 16))
        return super().execute_model(scheduler_output)


class Qwen35CpuExportWorker(OptimumNeuronWorker):
    """optimum-neuron's worker with the runner above."""

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        self.model_runner = Qwen35CpuExportRunner(vllm_config)
