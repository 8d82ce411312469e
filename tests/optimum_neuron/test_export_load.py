"""Export (cpu target) -> save -> from_pretrained in a fresh process -> transformers' greedy tokens.

The reference tokens are transformers' own (tests/fixtures/<layout>/reference.npz, recorded with
transformers >= 5). Exports use a 128-token sequence length, so each generation is the first tokens of
the recorded 128-token greedy run.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("optimum.neuron", reason="needs optimum-neuron (the nox `optimum` session)")

from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM  # noqa: E402

from ..conftest import LAYOUTS, load_reference, reference_prompts  # noqa: E402
from ..test_parity import TIE_MARGIN  # noqa: E402
from .conftest import SEQUENCE_LENGTH, last_json_line, run_python  # noqa: E402

NEW_TOKENS = 48

LOAD_AND_GENERATE = """
import json, sys, torch
from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM
out = {}
for folder, prompts in json.loads(sys.argv[1]).items():
    model = Qwen35NeuronModelForCausalLM.from_pretrained(folder)
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, : len(p)] = torch.tensor(p)
        mask[row, : len(p)] = 1
    seqs = model.generate(ids, attention_mask=mask, max_new_tokens=int(sys.argv[2]), do_sample=False, eos_token_id=None)
    out[folder] = [row[width:].tolist() for row in seqs]
    model.close()
print(json.dumps(out))
"""


def assert_greedy_matches(layout: str, j: int, tokens: list[int], ref) -> None:
    expected = ref[f"gen_tokens_{j}"].tolist()[: len(tokens)]
    if tokens != expected:
        step = next(i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b)
        margin = float(ref[f"gen_margin_{j}"][step])
        assert margin < TIE_MARGIN, (
            f"{layout} prompt {j}: greedy tokens part at step {step} ({tokens[step]} vs {expected[step]}) where the "
            f"reference's top-2 margin is {margin:.2e}"
        )


def test_export_save_load_in_fresh_process_gives_transformers_greedy_tokens(export_dir):
    """Every fixture layout, fp32, TP = 1 and TP = 2 (gloo workers), loaded in one fresh interpreter."""
    jobs, refs = {}, {}
    for layout in LAYOUTS:
        ref = load_reference(layout)
        prompts = [ref[f"gen_prompt_{j}"].tolist() for j in range(2)]
        for tp in (1, 2):
            folder = str(export_dir(layout, tp))
            jobs[folder], refs[folder] = prompts, (layout, ref)
    result = run_python(LOAD_AND_GENERATE, json.dumps(jobs), str(NEW_TOKENS))
    generated = last_json_line(result.stdout)
    assert set(generated) == set(jobs)
    for folder, rows in generated.items():
        layout, ref = refs[folder]
        for j, tokens in enumerate(rows):
            assert len(tokens) == NEW_TOKENS
            assert_greedy_matches(layout, j, tokens, ref)


def test_export_folder_layout(export_dir):
    folder = export_dir("tiny-2b", 2)
    names = sorted(p.name for p in folder.iterdir())
    assert names == [
        "checkpoint", "compiled", "config.json", "generation_config.json", "neuron_config.json", "tokenizer.json", "tokenizer_config.json",
    ]
    neuron_config = json.loads((folder / "neuron_config.json").read_text())
    assert neuron_config["_serialized_key"] == "NxDNeuronConfig"
    assert neuron_config["target"] == "cpu" and neuron_config["neuronxcc_version"] is None
    assert (neuron_config["batch_size"], neuron_config["sequence_length"], neuron_config["tp_degree"]) == (2, SEQUENCE_LENGTH, 2)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text"
    # Exported from a local folder: no checkpoint id (optimum-neuron 0.4.5 would then save no weights and
    # the folder would not load); a cpu export always carries its weights.
    assert neuron_config["checkpoint_id"] is None
    assert sorted(p.name for p in (folder / "checkpoint").glob("rank_*.safetensors")) == ["rank_0.safetensors", "rank_1.safetensors"]
    assert not list(folder.parent.glob(".*partial*")), "a staging folder was left behind"
    from optimum_qwen35.export import layout

    assert all((folder / name).is_file() for name in layout.CPU_MANIFESTS)  # what the Hub side checks for


def test_neuron_config_dict_is_optimum_neurons_own(export_dir, monkeypatch):
    """The cpu target writes the dict NeuronConfig.to_dict writes, with neuronxcc_version null (no compiler here).

    neuronx-cc is absent here, so its version getter is given one for the comparison only."""
    import optimum.neuron.configuration_utils as configuration_utils

    from optimum_qwen35.optimum_neuron import neuron_config as nc

    saved = json.loads((export_dir("tiny-2b", 2) / "neuron_config.json").read_text())
    loaded = nc.load(export_dir("tiny-2b", 2))
    monkeypatch.setattr(configuration_utils, "get_neuronxcc_version", lambda: "2.21.33363.0")
    theirs = loaded.to_dict()
    assert theirs.pop("neuronxcc_version") == "2.21.33363.0"
    assert saved.pop("neuronxcc_version") is None
    assert json.loads(json.dumps(theirs)) == saved


def test_bf16_export_stays_within_the_bf16_budget(export_dir):
    """Teacher-forced logits through the compiled graphs (prefill one token, then one decode step per token)
    against transformers' fp32 logits: the mean error is no worse than transformers' own bf16 run."""
    ref = load_reference("tiny-2b")
    cases = [(p, e) for p, e in reference_prompts(ref) if len(p) <= 65]
    hf_mae = sum(float(ref[f"hf_bf16_mae_{i}"]) * len(p) for i, (p, _) in enumerate(reference_prompts(ref)) if len(p) <= 65)
    hf_mae /= sum(len(p) for p, _ in cases)
    model = Qwen35NeuronModelForCausalLM.from_pretrained(export_dir("tiny-2b", 1, "bfloat16"), dtype="bfloat16")
    errors, agree = [], []
    for prompt, expected in cases:
        logits = [model.prefill(torch.tensor([prompt[:1]]), None, seq_ids=[0])[0]]
        for pos in range(1, len(prompt)):
            logits.append(model.decode(torch.tensor([[prompt[pos]]]), torch.tensor([[pos]]), seq_ids=[0])[0])
        got = torch.stack(logits).float().numpy()
        errors.append(np.abs(got - expected).ravel())
        agree.append(got.argmax(-1) == expected.argmax(-1))
    our_mae, our_top1 = float(np.concatenate(errors).mean()), float(np.concatenate(agree).mean())
    print(f"\nbf16 export: mean |dlogit| {our_mae:.4f} (transformers bf16 on the same prompts {hf_mae:.4f}), top-1 {our_top1:.3f}")
    assert our_mae <= hf_mae
    assert our_top1 >= float(ref["hf_bf16_top1_agreement"]) - 0.02


@pytest.mark.parametrize("layout", LAYOUTS)
def test_more_prompts_than_the_batch_run_in_waves(export_dir, layout):
    """Three prompts through a batch-2 export: each equals its single-prompt run (and transformers)."""
    ref = load_reference(layout)
    model = Qwen35NeuronModelForCausalLM.from_pretrained(export_dir(layout, 1))
    prompts = [ref["gen_prompt_0"].tolist(), ref["gen_prompt_1"].tolist(), ref["gen_prompt_0"].tolist()[:3]]
    waves = model.runtime.generate(prompts, 12)
    assert waves == [model.runtime.generate([p], 12)[0] for p in prompts]
    assert_greedy_matches(layout, 0, waves[0], ref)
    assert_greedy_matches(layout, 1, waves[1], ref)
