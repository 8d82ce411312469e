"""TorchNeuron (trn2) exports with FP8 weights (docs/fp8.md "Exports"): the rank files hold the float8 weights and
their block scales, graphs.json says so, and the graphs TorchNeuron builds from the export (run here with
compile_backend="eager" on the CPU) generate the tokens of the same weights run eagerly through
`load_decoder(weights_dtype="fp8")`, at TP 1 and TP 2 (gloo ranks); at TP 2 with lm_head in FP8 too (`fp8_lm_head`:
tiny-nv3x's 96-wide head, split by vocabulary)."""

from __future__ import annotations

import json
import os

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
        float8 = [f.get_tensor(k) for k in f.keys() if f.get_slice(k).get_dtype() == "F8_E4M3"]
        assert max(float(t.float().abs().max()) for t in float8) <= 240  # trn2's float8_e4m3 (docs/fp8.md)
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
    assert got == want  # (the export's weights fitted to 240, the eager model's not: the same tokens)


def test_an_fp8_export_on_the_device_hands_neuronx_cc_the_e4m3_flag(tmp_path, monkeypatch):
    """Loading a trn2 FP8 export on the neuron device puts neuronx-cc's F8E4M3FN-as-F8E4M3 flag in NEURON_CC_FLAGS
    (beside the user's flags, once) before torch-neuronx is imported; a bf16 export leaves the variable alone."""
    from optimum_qwen35 import NeuronModelForCausalLM
    from optimum_qwen35.backends.torchneuron import runner
    from optimum_qwen35.checkpoint.fp8 import E4M3FN_AS_E4M3_FLAG

    q = build_tiny_fp8_checkpoint(tmp_path / "q", "tiny-2b")
    seen = []

    def stand_in():  # torch-neuronx is not installed here: stop where it would be imported
        seen.append(os.environ.get("NEURON_CC_FLAGS"))
        raise RuntimeError("torch-neuronx would be imported here")

    monkeypatch.setattr(runner, "import_torchneuron", stand_in)
    monkeypatch.setenv("NEURON_CC_FLAGS", "-O1")
    nc = NeuronModelForCausalLM.get_neuron_config(q, batch_size=1, sequence_length=128, tensor_parallel_size=1,
                                                  dtype="bfloat16", target="trn2")
    for weights_dtype in ("fp8", None):
        folder = tmp_path / f"export-{weights_dtype}"
        NeuronModelForCausalLM.export(q, nc, weights_dtype=weights_dtype).save_pretrained(folder)
        for _ in range(2):
            with pytest.raises(RuntimeError, match="would be imported"):
                runner.load_runtime(folder)
        monkeypatch.setenv("NEURON_CC_FLAGS", "-O1")
    assert seen == [f"-O1 {E4M3FN_AS_E4M3_FLAG}", f"-O1 {E4M3FN_AS_E4M3_FLAG}", "-O1", "-O1"]
