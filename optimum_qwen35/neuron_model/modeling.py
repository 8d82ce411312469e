"""`Qwen35ModelForCausalLM`: the Qwen3.5 export model of the TorchNeuron stack (Python 3.12+, transformers 5, no
optimum-neuron), the same API as optimum-neuron's subclass on the NxD stack (`optimum_neuron/modeling.py`):

    from optimum_qwen35 import NeuronModelForCausalLM      # this class here, optimum-neuron's subclass there

    neuron_config = NeuronModelForCausalLM.get_neuron_config("tiny/", batch_size=2, sequence_length=256,
                                                             tensor_parallel_size=2, target="trn2")
    model = NeuronModelForCausalLM.export("tiny/", neuron_config, mtp=True)
    model.save_pretrained("out/")
    model = NeuronModelForCausalLM.from_pretrained("out/", device="cpu", compile_backend="eager")
    model.generate(input_ids, attention_mask=mask, max_new_tokens=32)

What it adds to the stack-neutral base (`neuron_model/base.py`): optimum-neuron's `export` entry point, and what a
transformers pipeline reads from a model (`device`, `dtype`, `to`, `__call__`).
"""

from __future__ import annotations

import torch
from transformers import AutoConfig

from optimum_qwen35.neuron_model.base import Qwen35ExportedModel


class Qwen35ModelForCausalLM(Qwen35ExportedModel):
    """Qwen3.5 (dense or MoE, text and vision) as an export, without optimum-neuron (see the module docstring)."""

    input_modalities = "text"
    output_modalities = "text"

    @classmethod
    def export(cls, model_id, neuron_config, config=None, token=None, revision=None, load_weights: bool = False,
               **kwargs):
        """Export `model_id` (a folder or a Hub id) as `neuron_config` describes (`get_neuron_config`): optimum-neuron's
        `NeuronModelForCausalLM.export`, with this package's options (`vision`, `image_buckets`, `mtp`,
        `neuron_backend`; `_export`)."""
        if config is None:
            config = AutoConfig.from_pretrained(model_id, token=token, revision=revision).get_text_config()
        return cls._export(model_id, config, neuron_config, token=token, revision=revision, load_weights=load_weights,
                           **kwargs)

    # What transformers' pipelines read from a model. The export's graphs run where `from_pretrained(device=)` put
    # them; the tensors they take and return are host (CPU) tensors, so that is the model's device for a pipeline.
    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return self.neuron_config.torch_dtype

    def to(self, *args, **kwargs):
        """No move: an export runs where it was loaded (`from_pretrained(device=...)`); a pipeline's `to(cpu)` is a no-op."""
        return self

    def eval(self):
        return self

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)
