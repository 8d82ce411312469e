"""The Python API on the TorchNeuron stack (no optimum-neuron): `from optimum_qwen35 import NeuronModelForCausalLM`
is this package's own class; a trn2 export is a TorchNeuron export whose neuron_config.json keeps optimum-neuron's
NxDNeuronConfig format; it loads through the class, transformers 5's AutoModelForCausalLM and the text-generation
pipeline, and gives transformers 5's own greedy tokens."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM, pipeline

from optimum_qwen35 import NeuronModelForCausalLM
from optimum_qwen35.neuron_model.modeling import Qwen35ModelForCausalLM

from ..kit.export_folder import neuron_config_dict
from .conftest import ON_CPU, SOURCE


def test_the_class_is_this_packages_own_and_the_import_stays_light():
    assert NeuronModelForCausalLM is Qwen35ModelForCausalLM
    code = "import sys, optimum_qwen35; print(sorted(m for m in ('torch', 'transformers', 'optimum') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_trn2_export_records_optimum_neurons_format_and_its_backend(tp1_export, tp2_mtp_export):
    for folder, tp in ((tp1_export, 1), (tp2_mtp_export, 2)):
        written = json.loads((folder / "neuron_config.json").read_text())
        expected = neuron_config_dict(None, None, "trn2", 2, 128, tp, "float32", optimum_neuron_version=None)
        assert written == {**expected, "neuronxcc_version": None, "export_backend": "torchneuron"}
    assert "mtp" in json.loads((tp2_mtp_export / "compiled" / "graphs.json").read_text())


def test_greedy_tokens_are_transformers_5s_own(tp1_model, tp2_mtp_export, transformers_greedy):
    prompt, expected = transformers_greedy
    tokens = tp1_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=len(expected),
                                do_sample=False, eos_token_id=None)
    assert tokens[0, prompt.shape[1]:].tolist() == expected
    model = NeuronModelForCausalLM.from_pretrained(tp2_mtp_export, **ON_CPU)
    try:
        tokens = model.generate(prompt, max_new_tokens=len(expected), do_sample=False, eos_token_id=None)
        assert tokens[0, prompt.shape[1]:].tolist() == expected
        # MTP drafts, checked by the main model: exactly plain greedy decoding's tokens.
        speculative = model.generate(prompt, max_new_tokens=len(expected), do_sample=False, eos_token_id=None,
                                     num_speculative_tokens=2)
        assert speculative[0, prompt.shape[1]:].tolist() == expected
    finally:
        model.close()


def test_forward_logits_match_transformers(tp1_model, transformers_greedy):
    prompt, _ = transformers_greedy
    reference = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(SOURCE, dtype=torch.float32)
    with torch.no_grad():
        expected = reference(prompt).logits
    logits = tp1_model(prompt).logits
    assert logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, atol=2e-4, rtol=1e-4)


def test_auto_model_loads_an_export_with_this_class_and_a_checkpoint_with_transformers(tp1_export, transformers_greedy):
    prompt, expected = transformers_greedy
    model = AutoModelForCausalLM.from_pretrained(tp1_export, **ON_CPU)
    try:
        assert type(model) is Qwen35ModelForCausalLM
        tokens = model.generate(prompt, max_new_tokens=len(expected), do_sample=False, eos_token_id=None)
        assert tokens[0, prompt.shape[1]:].tolist() == expected
    finally:
        model.close()
    checkpoint = AutoModelForCausalLM.from_pretrained(SOURCE)
    assert type(checkpoint).__module__.startswith("transformers.models.qwen3_5")


def test_the_text_generation_pipeline_takes_run_options_as_model_kwargs(tp1_export, caplog):
    generator = pipeline("text-generation", model=str(tp1_export), model_kwargs=ON_CPU)
    try:
        assert type(generator.model) is Qwen35ModelForCausalLM
        text = generator("hello world", max_new_tokens=6, do_sample=False, return_full_text=False)[0]["generated_text"]
        ids = generator.tokenizer("hello world", return_tensors="pt").input_ids
        tokens = generator.model.generate(ids, max_new_tokens=6, do_sample=False)
        assert text == generator.tokenizer.decode(tokens[0, ids.shape[1]:], skip_special_tokens=True)
    finally:
        generator.model.close()
    assert not [r for r in caplog.records if "is not supported for text-generation" in r.getMessage()]
