"""The NxD export's graphs outside an export: the configs and the parallel state `ModelBuilder.trace` builds them with.

`optimum-qwen35 export` builds the graphs through optimum-neuron's exporter and neuronx-distributed's `ModelBuilder`;
what the benchmarks (benchmarks/neuron_*.py) and the tests need to build the same graphs one by one is here, so that
they take the export's own code path:

- `neuron_config`: the NxDNeuronConfig the export makes (`get_neuron_config`, after aligning the compilation target as
  the exporter does);
- `export_config`: the text config the export hands the NxD class (with a vision tower's buckets, an MTP head's K);
- `traced_parallel_state`: the parallel state `ModelBuilder.trace` builds every graph in, with the `LOCAL_WORLD_SIZE`
  the export sets (`adapter.set_local_world_size`: neuronx-distributed 0.15 reads it on trn1 / inf2 at TP 4).

Needs the `neuron` extra's stack (optimum-neuron 0.4.5, neuronx-distributed 0.15, torch-xla).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch

from optimum_qwen35.backends.nxd import adapter

# The graphs' keys in the export (`create_graph_builders`).
CONTEXT, TOKENS, LOGITS = "context_encoding", "token_generation", "context_logits_model"
IMAGE_CONTEXT, IMAGE_TOKENS = "image_context_encoding", "image_token_generation"


def neuron_config(folder: str | os.PathLike, target: str, tp: int = 1, dtype=torch.float32, batch_size: int = 2,
                  sequence_length: int = 128):
    """The NxDNeuronConfig the export makes (`get_neuron_config`, the entry point optimum-neuron's exporter calls),
    after aligning the compilation target as the exporter does first (`align_compilation_target(override=True)`:
    `NEURON_PLATFORM_TARGET_OVERRIDE`, which neuronx-distributed's parallel state reads)."""
    from optimum.neuron.utils.instance import align_compilation_target  # the neuron extra: imported where used

    from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM  # the neuron extra: imported where used

    align_compilation_target(target, override=True)
    return Qwen35NeuronModelForCausalLM.get_neuron_config(
        Path(folder), batch_size=batch_size, sequence_length=sequence_length, tensor_parallel_size=tp,
        target=target, dtype=dtype, config=text_config(folder),
    )


def text_config(folder: str | os.PathLike):
    """The folder's text config as AutoConfig reads it (the package registers every Qwen3.5 type with transformers
    4.57, the MoE ones included)."""
    from transformers import AutoConfig  # start-up time: transformers' config machinery, imported where used

    return AutoConfig.from_pretrained(folder).get_text_config()


def vision_config(folder: str | os.PathLike):
    from optimum_qwen35.modeling.vision import VisionConfig  # start-up time: the vision tower, imported where used

    return VisionConfig.from_dict(json.loads((Path(folder) / "config.json").read_text()))


def model_class():
    from optimum_qwen35.backends.nxd.model import Qwen35NxDModelForCausalLM  # the neuron extra: imported where used

    return Qwen35NxDModelForCausalLM


def export_config(folder: str | os.PathLike, nc, image_buckets=None, max_speculative_tokens: int = 0,
                  fp8_weights: bool = False, fp8_lm_head: bool = False):
    """The text config `Qwen35NeuronModelForCausalLM._export` hands the NxD class (a vision export's with
    `image_buckets`; an export made with mtp=True with `max_speculative_tokens`; one with FP8 weights with
    `fp8_weights`, and `fp8_lm_head`)."""
    from optimum_qwen35.backends.nxd.fp8 import export_fp8_weight_names  # start-up time: imported where used
    from optimum_qwen35.export import cpu as cpu_export  # start-up time: the export module, imported where used

    vision = (vision_config(folder), image_buckets) if image_buckets else None
    names = export_fp8_weight_names(folder, fp8_lm_head) if fp8_weights else None
    return cpu_export.export_config(text_config(folder), str(folder), nc.torch_dtype, vision, max_speculative_tokens,
                                    names, fp8_lm_head)


@contextlib.contextmanager
def traced_parallel_state(tp_degree: int, lnc: int = 1):
    """The parallel state neuronx-distributed's `ModelBuilder.trace` builds every graph in (model_builder.py
    L1408-1418): a mocked world of `tp_degree` ranks, this process rank 0, the target's logical core size (the neuron
    config's `logical_nc_config`), collectives lowered ahead of time; `LOCAL_WORLD_SIZE` set first, as the export
    sets it (trn1 / inf2 at TP 4 read it)."""
    from neuronx_distributed.parallel_layers import parallel_state  # the neuron extra: imported where used
    from neuronx_distributed.trace.mock_torchdist import mock_distributed  # the neuron extra: imported where used

    adapter.set_local_world_size_to(tp_degree)
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
