"""The Hub within the TorchNeuron stack (push an export, load it by id in a fresh process, against the stand-in Hub
with the real huggingface_hub client), and the cross-stack rules: an export written on the NxD stack (optimum-neuron
0.4.5 named in its neuron_config.json) loads here when it is a cpu or TorchNeuron one; an NxD export (model.pt) and
the NxD backend are refused in one line naming the stack they need."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from optimum_qwen35 import NeuronModelForCausalLM
from optimum_qwen35.errors import IncompatibleExportError

from ..optimum_neuron.conftest import last_json_line, run_python
from .conftest import ON_CPU, SOURCE

PUSH = """
import sys
from optimum_qwen35 import NeuronModelForCausalLM as Model
source, repo = sys.argv[1], sys.argv[2]
neuron_config = Model.get_neuron_config(source, batch_size=1, sequence_length=128, tensor_parallel_size=1, dtype="float32", target="trn2")
Model.export(source, neuron_config).push_to_hub(repo)
"""

LOAD = """
import json, os, sys, torch
from transformers import AutoModelForCausalLM
repo, prompt = sys.argv[1], json.loads(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(repo, compile_backend="eager", device="cpu")
out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
cache = os.environ["TORCH_NEURONX_NEFF_CACHE_DIR"]
files = {os.path.relpath(os.path.join(d, f), cache): open(os.path.join(d, f), "rb").read().hex()
         for d, _, names in os.walk(cache) for f in names}
print(json.dumps({"tokens": out[0, len(prompt):].tolist(), "class": type(model).__name__, "backend": model.backend,
                  "cache": files}))
"""


def test_pushed_to_the_hub_with_its_compile_cache_and_loaded_by_id_through_the_auto_class(hub_server, tmp_path, tp1_model):
    """The NEFF cache folder's files (TorchNeuron's; opaque bytes to this package, so any bytes show the transport)
    go up in the export's commit and land in the loading machine's cache folder before the first compile."""
    prompt = [3, 17, 42, 99, 7, 250]
    expected = tp1_model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    neffs = tmp_path / "neff-cache-exporter"
    (neffs / "neuronxcc-2.22" / "MODULE_1").mkdir(parents=True)
    (neffs / "neuronxcc-2.22" / "MODULE_1" / "model.neff").write_bytes(b"\x00NEFF" * 100)
    (neffs / "neuronxcc-2.22" / "MODULE_1" / "model.neff.tmp").write_bytes(b"half")  # never pushed
    exporter = {**hub_server.client_env(tmp_path / "exporter-home", token="hf_alice_write"),
                "TORCH_NEURONX_NEFF_CACHE_DIR": str(neffs)}
    run_python(PUSH, str(SOURCE), "alice/qwen35-tiny-trn2", env=exporter)
    user = {**hub_server.client_env(tmp_path / "user-home"), "TORCH_NEURONX_NEFF_CACHE_DIR": str(tmp_path / "user-neffs")}
    result = last_json_line(run_python(LOAD, "alice/qwen35-tiny-trn2", json.dumps(prompt), env=user).stdout)
    assert result == {"tokens": expected[0, len(prompt):].tolist(), "class": "Qwen35ModelForCausalLM",
                      "backend": "torchneuron", "cache": {"neuronxcc-2.22/MODULE_1/model.neff": (b"\x00NEFF" * 100).hex()}}


def test_an_export_made_on_the_nxd_stack_loads_here(tp1_export, tmp_path):
    folder = tmp_path / "from-nxd-stack"
    shutil.copytree(tp1_export, folder)
    file = folder / "neuron_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "optimum_neuron_version": "0.4.5"}))
    model = NeuronModelForCausalLM.from_pretrained(folder, **ON_CPU)
    assert model.backend == "torchneuron" and model.neuron_config.tp_degree == 1
    model.close()


def test_an_nxd_export_is_refused_in_one_line_naming_its_stack(tp1_export, tmp_path):
    folder = tmp_path / "nxd"
    shutil.copytree(tp1_export, folder)
    file = folder / "neuron_config.json"
    data = json.loads(file.read_text())
    data.pop("export_backend")
    file.write_text(json.dumps({**data, "optimum_neuron_version": "0.4.5", "neuronxcc_version": "2.21.33363.0"}))
    with pytest.raises(IncompatibleExportError) as error:
        NeuronModelForCausalLM.from_pretrained(folder)
    message = str(error.value)
    assert "\n" not in message and "NxD stack: Python 3.10-3.11 with optimum-neuron 0.4.5" in message
    assert 'pip install "optimum-qwen35[optimum]"' in message


def test_the_nxd_backend_is_refused_in_one_line():
    neuron_config = NeuronModelForCausalLM.get_neuron_config(SOURCE, batch_size=1, sequence_length=128,
                                                             tensor_parallel_size=1, dtype="float32", target="trn1")
    with pytest.raises(IncompatibleExportError) as error:
        NeuronModelForCausalLM.export(SOURCE, neuron_config)
    assert "\n" not in str(error.value) and "runs on the NxD stack only: Python 3.10-3.11" in str(error.value)
