"""The whole tiny model on CPU with the DeltaNet layers running the NKI kernels on the emulator (backend "nki")
gives the same greedy tokens as with the PyTorch references, on every fixture layout, in fp32 and bf16."""

import pytest
import torch

from optimum_qwen35 import kernels
from optimum_qwen35.runtime.cpu import Qwen35ForCausalLM

from ..conftest import FIXTURES, LAYOUTS, load_reference


@pytest.fixture
def nki_backend():
    yield
    kernels.set_backend("torch")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_tokens_nki_equal_torch(layout, dtype, nki_backend):
    ref = load_reference(layout)
    prompts = [ref["gen_prompt_0"].tolist()[:20], ref["gen_prompt_1"].tolist()[:7]]  # mixed lengths, padded
    model = Qwen35ForCausalLM.from_pretrained(FIXTURES / layout, batch_size=3, max_length=128, dtype=dtype)
    kernels.set_backend("torch")
    expected = model.generate(prompts, max_new_tokens=8)
    kernels.set_backend("nki")
    got = model.generate(prompts, max_new_tokens=8)
    assert got == expected
    if dtype != torch.float32:
        return
    # And the teacher-forced fp32 logits agree closely.
    kernels.set_backend("torch")
    ref_logits = model.logits(prompts)
    kernels.set_backend("nki")
    nki_logits = model.logits(prompts)
    tol = 1e-3
    for a, b in zip(nki_logits, ref_logits):
        assert (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())
