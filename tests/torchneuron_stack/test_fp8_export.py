"""TorchNeuron (trn2) exports with FP8 weights (docs/fp8.md "Exports"): the rank files hold the float8 weights and
their block scales, graphs.json says so, and the graphs TorchNeuron builds from the export (run here with
compile_backend="eager" on the CPU) generate the tokens of the same weights run eagerly through
`load_decoder(weights_dtype="fp8")`, at TP 1 and TP 2 (gloo ranks); at TP 2 with lm_head in FP8 too (`fp8_lm_head`:
tiny-nv3x's 96-wide head, split by vocabulary)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from optimum_qwen35.export.layout import CHECKPOINT_DIR, COMPILED_DIR, GRAPHS_FILE, TP_SHARDS_FILE, rank_file
from optimum_qwen35.tiny.fp8 import build_tiny_fp8_checkpoint

from .conftest import ON_CPU

PROMPT = [3, 17, 42, 99, 7, 250, 11, 64, 5, 301, 12, 77]
NEW = 10


@pytest.mark.parametrize("layout,form,tp,lm_head", [("tiny-moe", "per_expert", 1, False), ("tiny-nv3x", None, 2, True)])
def test_trn2_fp8_export_generates_what_the_eager_fp8_model_generates(tmp_path, layout, form, tp, lm_head):
    from optimum_qwen35.checkpoint.quantize import quantize_checkpoint
    from optimum_qwen35 import NeuronModelForCausalLM
    from optimum_qwen35.runtime import Qwen35Runtime
    from optimum_qwen35.runtime.eager import load_decoder

    q = build_tiny_fp8_checkpoint(tmp_path / "q", layout, expert_form=form)
    nc = NeuronModelForCausalLM.get_neuron_config(q, batch_size=1, sequence_length=128, tensor_parallel_size=tp,
                                                  dtype="bfloat16", target="trn2")
    folder = tmp_path / "export"
    NeuronModelForCausalLM.export(q, nc, weights_dtype="fp8", fp8_lm_head=lm_head).save_pretrained(folder)
    assert json.loads((folder / COMPILED_DIR / GRAPHS_FILE).read_text())["weights_dtype"] == "fp8"
    assert json.loads((folder / CHECKPOINT_DIR / TP_SHARDS_FILE).read_text())["weights_dtype"] == "fp8"
    with safe_open(folder / CHECKPOINT_DIR / rank_file(tp - 1), "pt") as f:
        assert "F8_E4M3" in {f.get_slice(k).get_dtype() for k in f.keys()}
        assert ("lm_head.weight" in f.keys() and f.get_slice("lm_head.weight").get_dtype() == "F8_E4M3") == lm_head
    if lm_head:  # the eager model of the same weights: the checkpoint with its lm_head quantized
        q = quantize_checkpoint(q, tmp_path / "q-lm_head", lm_head=True)
    model = NeuronModelForCausalLM.from_pretrained(folder, **ON_CPU)
    try:
        got = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False)[0, len(PROMPT):].tolist()
    finally:
        model.close()
    if tp == 1:
        want = Qwen35Runtime.from_decoder(load_decoder(q, torch.bfloat16, weights_dtype="fp8"), 1, 128).generate([PROMPT], NEW)[0]
    else:
        from tests.kit.tp import run_tensor_parallel

        want = run_tensor_parallel(q, tp, [PROMPT], max_new_tokens=NEW, dtype=torch.bfloat16, weights_dtype="fp8").tokens[0].tolist()
    assert got == want
