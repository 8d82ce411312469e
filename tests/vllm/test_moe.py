"""`vllm.LLM(model=<export>)` on a MoE (`qwen3_5_moe`) cpu-target export at tensor-parallel degree 2 (the experts split
by whole experts across the export's two gloo ranks, inside vLLM's engine process): greedy tokens equal the export's
own `generate()` and transformers 5's recorded tokens, solo and with more requests than the export has slots."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import environment, greedy, prompts

LAYOUT = "tiny-moe"  # 6 experts, top-2, per-expert keys on disk
BATCH_SIZE, SEQUENCE_LENGTH = 2, 128
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def moe_export(tmp_path_factory):
    from tests.kit import build_tiny_checkpoint

    folder = tmp_path_factory.mktemp("serving-moe")
    checkpoint = build_tiny_checkpoint(folder / "checkpoint", LAYOUT)
    export = folder / "qwen35-moe-cpu"
    command = [sys.executable, "-m", "optimum_qwen35", "export", "--model", str(checkpoint), "--batch_size",
               str(BATCH_SIZE), "--sequence_length", str(SEQUENCE_LENGTH), "--tensor_parallel_size", "2",
               "--torch_dtype", "float32", "--target", "cpu", str(export)]
    result = subprocess.run(command, env=environment(), capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    return export


@pytest.fixture(scope="module")
def moe_reference(moe_export):
    from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM

    model = Qwen35NeuronModelForCausalLM.from_pretrained(moe_export)
    yield model
    model.close()


@pytest.fixture(scope="module")
def llm(moe_export):
    from vllm import LLM

    engine = LLM(model=str(moe_export))
    yield engine
    engine.llm_engine.engine_core.shutdown()


def test_a_moe_export_serves_the_packages_greedy_tokens(llm, moe_reference):
    from vllm import SamplingParams

    from ..conftest import load_reference

    config = llm.llm_engine.vllm_config
    assert config.model_config.hf_config.model_type == "qwen3_5_moe_text"
    assert (config.model_config.max_model_len, config.scheduler_config.max_num_seqs) == (SEQUENCE_LENGTH, BATCH_SIZE)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
    ref = load_reference(LAYOUT)
    recorded = ref["gen_prompt_0"].tolist()
    batch = [recorded, *prompts([1, 9, 100, 119], seed=3)]  # 5 requests into 2 slots; up to the sequence length
    expected = [greedy(moe_reference, p, NEW_TOKENS) for p in batch]
    assert expected[0] == ref["gen_tokens_0"].tolist()[:NEW_TOKENS]  # the tokens transformers 5 recorded
    solo = list(llm.generate([{"prompt_token_ids": recorded}], params, use_tqdm=False)[0].outputs[0].token_ids)
    assert solo == expected[0]
    together = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in together] == expected
