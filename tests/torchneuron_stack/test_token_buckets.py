"""A trn2 (TorchNeuron) export lists token-generation buckets finer than its context buckets (the midpoints too:
export/cpu.py `export_token_buckets`), and a decode step runs in the smallest one that holds its positions: a
140-token prompt decodes in the 192-position graph, not the 256-position one, with transformers 5's own tokens."""

from __future__ import annotations

import json

import torch
import transformers

from .conftest import ON_CPU, SOURCE


def test_a_decode_step_runs_in_the_smallest_token_bucket_that_holds_it(tmp_path):
    from optimum_qwen35 import NeuronModelForCausalLM

    neuron_config = NeuronModelForCausalLM.get_neuron_config(
        SOURCE, batch_size=1, sequence_length=512, tensor_parallel_size=1, dtype="float32", target="trn2")
    NeuronModelForCausalLM.export(SOURCE, neuron_config).save_pretrained(tmp_path / "export")
    manifest = json.loads((tmp_path / "export" / "compiled" / "graphs.json").read_text())
    assert manifest["buckets"] == [128, 256, 512]
    assert manifest["token_buckets"] == [128, 192, 256, 384, 512]
    assert all(f"token_generation_{b}" in manifest["graphs"] for b in manifest["token_buckets"])

    prompt = (torch.arange(140) * 7 + 3).remainder(500).unsqueeze(0)  # decode steps at positions 140-146
    reference = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(SOURCE, dtype=torch.float32)
    expected = reference.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, prompt.shape[1]:].tolist()
    model = NeuronModelForCausalLM.from_pretrained(tmp_path / "export", **ON_CPU)
    try:
        tokens = model.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None)
        assert tokens[0, prompt.shape[1]:].tolist() == expected
        compiled = sorted(name for name in model.runtime.graphs._compiled if name.startswith("token_generation"))
        assert compiled == ["token_generation_192"]
    finally:
        model.close()
