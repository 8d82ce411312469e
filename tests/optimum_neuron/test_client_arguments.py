"""The arguments other tools pass (lm-eval, transformers' pipelines and harnesses, optimum-neuron's own callers):
`from_pretrained`'s loading keywords, `generate(stopping_criteria=..., token_type_ids=...)`, the processor's
`model_input_names` (issue 27, items 3)."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("optimum.neuron", reason="needs optimum-neuron (the nox `optimum` session)")

from transformers import StoppingCriteria, StoppingCriteriaList  # noqa: E402

from optimum_qwen35.errors import IncompatibleExportError, UsageError  # noqa: E402
from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM  # noqa: E402

from ..conftest import FIXTURES  # noqa: E402

LAYOUT = "tiny-2b"


@pytest.fixture(scope="module")
def folder(export_dir):
    return export_dir(LAYOUT, 1)  # batch 2, sequence 128, fp32


@pytest.fixture(scope="module")
def model(folder):
    return Qwen35NeuronModelForCausalLM.from_pretrained(folder)


def ignored_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "from_pretrained(): ignoring" in r.getMessage()]


def test_abstract_class_takes_transformers_loading_keywords_and_warns_once(folder, tmp_path, caplog):
    """lm-eval's and transformers' keywords through optimum-neuron's own abstract class (issue 27: a bare
    `KeyError: 'trust_remote_code'` before): the ones that locate the export are used, those that cannot apply to
    an export are named in one warning, and the model loads."""
    from optimum.neuron import NeuronModelForCausalLM

    with caplog.at_level(logging.WARNING):
        loaded = NeuronModelForCausalLM.from_pretrained(
            folder, trust_remote_code=True, low_cpu_mem_usage=True, device_map="auto", attn_implementation="eager",
            revision=None, token=None, cache_dir=tmp_path / "hf-cache", force_download=False, local_files_only=True,
            torch_dtype="auto", batch_size=2, sequence_length=128,
        )
    assert isinstance(loaded, Qwen35NeuronModelForCausalLM)
    assert ignored_warnings(caplog) == [
        "from_pretrained(): ignoring attn_implementation, device_map, low_cpu_mem_usage, trust_remote_code "
        "(they do not apply to a compiled export)"
    ]
    loaded.close()


def test_lm_eval_neuronx_keywords_and_export_true_load_an_export(folder, tmp_path, caplog):
    """What lm-eval's `neuronx` model passes (written for optimum-neuron 0.0.24: export=True, num_cores,
    auto_cast_type, revision="main") loads an export; num_cores / auto_cast_type / torch_dtype are checked as the
    tensor_parallel_size / dtype they stand for; `subfolder` finds an export inside a folder."""
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "model").symlink_to(folder, target_is_directory=True)
    with caplog.at_level(logging.WARNING):
        loaded = Qwen35NeuronModelForCausalLM.from_pretrained(
            tmp_path / "repo", subfolder="model", revision="main", trust_remote_code=False, low_cpu_mem_usage=True,
            export=True, batch_size=2, num_cores=1, auto_cast_type="f32", sequence_length=None, torch_dtype=None,
        )
    assert loaded.neuron_config.batch_size == 2 and loaded.folder == tmp_path / "repo" / "model"
    assert ignored_warnings(caplog) == [
        "from_pretrained(): ignoring low_cpu_mem_usage, trust_remote_code (they do not apply to a compiled export)"
    ]
    loaded.close()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch_size": 1}, r"exported for batch_size=2, not 1: pass batch_size=2 \(or leave batch_size= out\)"),
        ({"num_cores": 2}, r"exported for tensor_parallel_size=1, not 2: pass num_cores=1"),
        ({"auto_cast_type": "bf16"}, r"exported for dtype=float32, not bfloat16: pass auto_cast_type='float32'"),
        ({"torch_dtype": torch.bfloat16}, r"exported for dtype=float32, not bfloat16: pass torch_dtype='float32'"),
        ({"sequence_length": 4096}, r"exported for sequence_length=128, not 4096: pass sequence_length=128"),
    ],
)
def test_a_real_mismatch_is_one_line_saying_what_to_pass(folder, kwargs, message):
    with pytest.raises(IncompatibleExportError, match=message) as error:
        Qwen35NeuronModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **kwargs)
    assert "\n" not in str(error.value)


def test_conflicting_or_impossible_keywords_are_refused(folder):
    with pytest.raises(UsageError, match="got both dtype= and torch_dtype=: pass one of them"):
        Qwen35NeuronModelForCausalLM.from_pretrained(folder, dtype="float32", torch_dtype="float32")
    with pytest.raises(UsageError, match=r"is not an export, and from_pretrained\(export=True\) does not compile one"):
        Qwen35NeuronModelForCausalLM.from_pretrained(FIXTURES / LAYOUT, export=True)


class Recorder(StoppingCriteria):
    """Records every call; flags the rows `decide(ids)` says."""

    def __init__(self, decide):
        self.decide, self.calls = decide, []

    def __call__(self, input_ids, scores, **kwargs):
        self.calls.append((input_ids.clone(), scores.clone()))
        return self.decide(input_ids)


PROMPTS = torch.tensor([[11, 12, 13, 14, 15], [21, 22, 23, 24, 25]])


def test_stopping_criteria_see_every_step_and_stop_the_rows_they_flag(model):
    """transformers' semantics: called after every new token with the ids so far [batch, prompt + new] and the step's
    scores [batch, vocab]; a row flagged finishes there (its later positions are pad), the others go on unchanged."""
    free = model.generate(PROMPTS, max_new_tokens=6, do_sample=False, eos_token_id=None)
    width = PROMPTS.shape[1]
    stop_row1_after_2 = Recorder(lambda ids: torch.tensor([False, ids.shape[1] - width >= 2]))
    out = model.generate(PROMPTS, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0,
                         stopping_criteria=StoppingCriteriaList([stop_row1_after_2]),
                         token_type_ids=torch.zeros_like(PROMPTS))
    assert out[0].tolist() == free[0].tolist()
    assert out[1].tolist() == free[1, : width + 2].tolist() + [0] * 4
    ids = [c[0] for c in stop_row1_after_2.calls]
    assert [i.shape[1] for i in ids] == list(range(width + 1, width + 7))  # every step
    assert all(torch.equal(i[0], free[0, : i.shape[1]]) for i in ids)
    assert torch.equal(ids[-1][1], torch.cat([free[1, : width + 2], torch.zeros(4, dtype=free.dtype)]))  # padded
    scores = [c[1] for c in stop_row1_after_2.calls]
    assert all(s.shape == (2, model.config.vocab_size) and s.dtype == torch.float32 for s in scores)
    # the scores are the logits each token was chosen from (greedy: its argmax)
    assert [int(s[0].argmax()) for s in scores] == free[0, width:].tolist()


def test_one_bool_for_the_batch_and_waves(model):
    """A criterion answering one bool for the whole batch (lm-eval's MultiTokenEOSCriteria) stops every row; with
    more rows than the compiled batch (2), every call still shows the whole batch."""
    prompts = torch.cat([PROMPTS, PROMPTS[:1]])
    free = model.generate(prompts, max_new_tokens=5, do_sample=False, eos_token_id=None)
    width = prompts.shape[1]
    after_3 = Recorder(lambda ids: ids.shape[1] - width >= 3)
    out = model.generate(prompts, max_new_tokens=5, do_sample=False, eos_token_id=None, stopping_criteria=[after_3])
    assert out.tolist() == free[:, : width + 3].tolist()
    assert {c[0].shape[0] for c in after_3.calls} == {3}
    with pytest.raises(UsageError, match="returned 2 flags for a batch of 3 rows"):
        model.generate(prompts, max_new_tokens=2, stopping_criteria=lambda ids, scores: torch.tensor([True, False]))
    with pytest.raises(UsageError, match="stopping_criteria must be a transformers StoppingCriteriaList"):
        model.generate(prompts, max_new_tokens=2, stopping_criteria="eos")


def test_processor_model_input_names_are_what_it_returns():
    pytest.importorskip("PIL")
    from PIL import Image

    from optimum_qwen35.processing import Qwen35Processor

    processor = Qwen35Processor.from_pretrained(FIXTURES / LAYOUT)
    with_image = processor(text=["<|vision_start|><|image_pad|><|vision_end|>hi"], images=[Image.new("RGB", (64, 64))],
                           return_tensors="pt")
    assert list(with_image.keys()) == processor.model_input_names
    assert list(processor(text=["hi"]).keys()) == processor.model_input_names[:2]
