"""The TorchNeuron backend through the optimum API, where no Neuron SDK is installed: `get_neuron_config(target=
"trn2")` + `export` (and `optimum-cli export neuron --instance_type trn2`) write a TorchNeuron export, with one log
line naming the backend; `from_pretrained` loads it, runs its graphs with `torch.compile` on the CPU when told
(`compile_backend="eager", device="cpu"`; TorchNeuron's "neuron" by default, refused here in one line) and gives
transformers' greedy tokens, also pushed to and loaded from the stand-in Hub in a fresh process."""

from __future__ import annotations

import json
import logging

import pytest
import torch

pytest.importorskip("optimum.neuron", reason="needs optimum-neuron (the nox `optimum` session)")

from optimum_qwen35.errors import IncompatibleExportError, MissingDependencyError  # noqa: E402
from optimum_qwen35.hub.card import model_card  # noqa: E402
from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM as Model  # noqa: E402
from optimum_qwen35.cli import optimum_cli  # noqa: E402

from ..conftest import FIXTURES, load_reference  # noqa: E402
from .conftest import last_json_line, run_python  # noqa: E402

ON_CPU = {"compile_backend": "eager", "device": "cpu"}
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def trn2_export(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trn2") / "export"
    neuron_config = Model.get_neuron_config(FIXTURES / "tiny-2b", batch_size=2, sequence_length=128,
                                            tensor_parallel_size=2, dtype="float32", target="trn2")
    Model.export(FIXTURES / "tiny-2b", neuron_config).save_pretrained(folder)
    return folder


def test_a_trn2_export_without_the_sdk_is_a_torchneuron_export(tmp_path, caplog):
    neuron_config = Model.get_neuron_config(FIXTURES / "tiny-2b", batch_size=1, sequence_length=128,
                                            tensor_parallel_size=1, dtype="float32", target="trn2")
    with caplog.at_level(logging.WARNING):
        model = Model.export(FIXTURES / "tiny-2b", neuron_config)
    (line,) = [r.getMessage() for r in caplog.records if "backend" in r.getMessage()]
    assert line.startswith("trn2 export: torchneuron backend (no Neuron SDK here")
    assert model.backend == "torchneuron"
    saved = json.loads((model.folder / "neuron_config.json").read_text())
    assert saved["export_backend"] == "torchneuron" and saved["target"] == "trn2" and saved["neuronxcc_version"] is None
    assert "| backend | `torchneuron` |" in model_card(model.folder, "alice/x")


def test_it_loads_and_gives_the_cpu_exports_tokens(trn2_export, export_dir):
    ids = torch.tensor([[5, 17, 42, 7, 99, 3], [8, 1, 300, 64, 2, 2]])
    mask = torch.tensor([[1] * 6, [1] * 5 + [0]])
    model = Model.from_pretrained(trn2_export, **ON_CPU)
    cpu = Model.from_pretrained(export_dir("tiny-2b", 2))
    try:
        assert model.neuron_config.target == "trn2" and model.neuron_config.tp_degree == 2
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False),
                           cpu.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False))
    finally:
        model.close()
        cpu.close()


def test_without_torchneuron_the_default_device_is_refused_in_one_line(trn2_export):
    with pytest.raises(MissingDependencyError) as error:
        Model.from_pretrained(trn2_export)
    assert "\n" not in str(error.value) and 'compile_backend="eager", device="cpu"' in str(error.value)


def test_run_options_on_a_cpu_export_are_ignored_with_one_warning(export_dir, caplog):
    with caplog.at_level(logging.WARNING):
        model = Model.from_pretrained(export_dir("tiny-2b", 1), **ON_CPU)
    model.close()
    assert any("ignoring compile_backend, device (they apply to a TorchNeuron export" in r.getMessage() for r in caplog.records)


def test_optimum_cli_instance_type_trn2_exports_for_torchneuron(tmp_path, capsys):
    out = tmp_path / "out"
    arguments = ["--model", str(FIXTURES / "tiny-2b"), "--batch_size", "1", "--sequence_length", "128",
                 "--tensor_parallel_size", "1", "--auto_cast_type", "fp32", "--instance_type", "trn2", str(out)]
    assert optimum_cli.run(arguments) == 0
    assert "for trn2 (torchneuron backend)" in capsys.readouterr().out
    model = Model.from_pretrained(out, **ON_CPU)
    ref = load_reference("tiny-2b")
    prompt = torch.tensor([ref["gen_prompt_0"].tolist()])
    tokens = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
    assert tokens[0, prompt.shape[1]:].tolist() == ref["gen_tokens_0"].tolist()[:NEW_TOKENS]  # transformers' greedy


PUSH = """
import sys
from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM as Model
source, repo = sys.argv[1], sys.argv[2]
neuron_config = Model.get_neuron_config(source, batch_size=1, sequence_length=128, tensor_parallel_size=1, dtype="float32", target="trn2")
Model.export(source, neuron_config).push_to_hub(repo)
"""

LOAD = """
import json, sys, torch
from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM as Model
repo, prompt = sys.argv[1], json.loads(sys.argv[2])
model = Model.from_pretrained(repo, compile_backend="eager", device="cpu")
out = model.generate(torch.tensor([prompt]), max_new_tokens=%d, do_sample=False, eos_token_id=None)
print(json.dumps({"tokens": out[0, len(prompt):].tolist(), "backend": model.backend}))
""" % NEW_TOKENS


def test_pushed_to_the_hub_and_loaded_by_id_in_a_fresh_process(hub_server, tmp_path):
    ref = load_reference("tiny-2b")
    exporter = hub_server.client_env(tmp_path / "exporter-home", token="hf_alice_write")
    run_python(PUSH, str(FIXTURES / "tiny-2b"), "alice/qwen35-tiny-trn2", env=exporter)
    user = hub_server.client_env(tmp_path / "user-home")
    result = last_json_line(run_python(LOAD, "alice/qwen35-tiny-trn2", json.dumps(ref["gen_prompt_0"].tolist()),
                                       env=user).stdout)
    assert result == {"tokens": ref["gen_tokens_0"].tolist()[:NEW_TOKENS], "backend": "torchneuron"}


def test_the_command_line_names_the_backend_and_refuses_nxd_without_the_sdk(tmp_path, capsys):
    from optimum_qwen35.cli import main

    common = ["export", "--model", str(FIXTURES / "tiny-2b"), "--sequence_length", "128", "--tensor_parallel_size", "1",
              "--target", "trn2"]
    assert main([*common, "--neuron_backend", "nxd", str(tmp_path / "nxd")]) == IncompatibleExportError.exit_status
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs the Neuron backend, but the Neuron SDK" in err
    assert not (tmp_path / "nxd").exists()
    assert main([*common, str(tmp_path / "tn")]) == 0
    assert "for trn2 (torchneuron backend)" in capsys.readouterr().out
