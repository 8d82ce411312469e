"""The TorchNeuron stack's environment: Python >= 3.12, transformers 5, and no optimum-neuron (asserted, not skipped:
these tests exist to show the package works without it). Two trn2 (TorchNeuron) exports of the tiny checkpoint are
shared by the whole folder: TP 1 without the MTP head, TP 2 with it."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from ..conftest import FIXTURES

if sys.version_info < (3, 12) or importlib.util.find_spec("transformers") is None:
    pytest.skip("the TorchNeuron stack's tests run on Python >= 3.12 with transformers 5", allow_module_level=True)

import transformers  # noqa: E402

if transformers.__version__.startswith("4."):
    pytest.skip("the TorchNeuron stack's tests run with transformers 5", allow_module_level=True)

SOURCE = FIXTURES / "tiny-2b"
ON_CPU = {"compile_backend": "eager", "device": "cpu"}


def pytest_collection_modifyitems(config, items):
    assert importlib.util.find_spec("optimum.neuron") is None, "the TorchNeuron stack has no optimum-neuron"


def _export(tmp_path_factory, name, tensor_parallel_size, mtp):
    from optimum_qwen35 import NeuronModelForCausalLM

    folder = tmp_path_factory.mktemp(name) / "export"
    neuron_config = NeuronModelForCausalLM.get_neuron_config(
        SOURCE, batch_size=2, sequence_length=128, tensor_parallel_size=tensor_parallel_size, dtype="float32",
        target="trn2")
    NeuronModelForCausalLM.export(SOURCE, neuron_config, mtp=mtp).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tp1_export(tmp_path_factory):
    return _export(tmp_path_factory, "tp1", 1, mtp=False)


@pytest.fixture(scope="session")
def tp2_mtp_export(tmp_path_factory):
    return _export(tmp_path_factory, "tp2-mtp", 2, mtp=True)


@pytest.fixture(scope="session")
def tp1_model(tp1_export):
    from optimum_qwen35 import NeuronModelForCausalLM

    model = NeuronModelForCausalLM.from_pretrained(tp1_export, **ON_CPU)
    yield model
    model.close()


@pytest.fixture(scope="session")
def transformers_greedy():
    """transformers 5's own Qwen3.5 on the same checkpoint: (prompt, its greedy tokens after the prompt)."""
    import torch

    model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(SOURCE, dtype=torch.float32)
    prompt = torch.tensor([[3, 17, 42, 99, 7, 250, 11, 64, 5, 301, 12, 77]])
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return prompt, out[0, prompt.shape[1]:].tolist()
