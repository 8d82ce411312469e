"""`generate(..., num_speculative_tokens=k)` through optimum-neuron's entry points, on exports made with mtp=True
(`optimum-qwen35 export --mtp`, `Qwen35NeuronModelForCausalLM.export(..., mtp=True)`), loaded with
`NeuronModelForCausalLM.from_pretrained`: greedy, the tokens of plain greedy decoding for k = 1..4, fp32 and bf16, a
padded batch of two rows that accept different numbers of drafts (the head fitted to tiny-2b, optimum_qwen35/tiny/mtp_fit.py);
at tensor_parallel_size 2 and on a trn2 TorchNeuron export run on the CPU; with row limits, min_new_tokens, a streamer
and stopping criteria as plain decoding takes them; the one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("optimum.neuron", reason="needs optimum-neuron (the nox `optimum` session)")

from optimum.neuron import NeuronModelForCausalLM  # noqa: E402
from transformers import StoppingCriteria, StoppingCriteriaList  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

from optimum_qwen35.cli import main  # noqa: E402
from optimum_qwen35.errors import IncompatibleExportError, UsageError  # noqa: E402
from optimum_qwen35.export.layout import COMPILED_DIR, GRAPHS_FILE  # noqa: E402
from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM  # noqa: E402

from ..conftest import FIXTURES  # noqa: E402
from .conftest import BATCH_SIZE, SEQUENCE_LENGTH  # noqa: E402

NEW = 40


@pytest.fixture(scope="module")
def fitted(fitted_tiny_2b):
    return fitted_tiny_2b


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def export(request, fitted, tmp_path_factory):
    """fp32 through the command line (`optimum-qwen35 export --mtp`), bf16 through the Python export."""
    out = tmp_path_factory.mktemp("exports") / request.param
    if request.param == "float32":
        assert main(["export", "--model", str(fitted), "--batch_size", str(BATCH_SIZE), "--sequence_length",
                     str(SEQUENCE_LENGTH), "--torch_dtype", "float32", "--target", "cpu", "--mtp", str(out)]) == 0
    else:
        neuron_config = Qwen35NeuronModelForCausalLM.get_neuron_config(
            fitted, batch_size=BATCH_SIZE, sequence_length=SEQUENCE_LENGTH, dtype=request.param, target="cpu")
        Qwen35NeuronModelForCausalLM.export(fitted, neuron_config, mtp=True).save_pretrained(out)
    return out


def _batch(fitted, model):
    """Row 0: a prompt the head was fitted on and the start of its greedy continuation (in-sample: drafts accepted);
    row 1: not. Left-padded, as a tokenizer pads for generation."""
    prompt = json.loads((fitted / "mtp_fit.json").read_text())["prompts"][0]
    first = model.generate(torch.tensor([prompt]), max_new_tokens=9, do_sample=False, eos_token_id=None)[0].tolist()
    rows = [first, [7, 300, 2] * 5 + [11, 12]]
    width = max(map(len, rows))
    ids, mask = torch.zeros(2, width, dtype=torch.long), torch.zeros(2, width, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, width - len(row):], mask[r, width - len(row):] = torch.tensor(row), 1
    return ids, mask


def test_greedy_speculation_equals_greedy_decoding(fitted, export):
    assert json.loads((export / COMPILED_DIR / GRAPHS_FILE).read_text())["mtp"]["max_speculative_tokens"] == 4
    model = NeuronModelForCausalLM.from_pretrained(export)
    assert isinstance(model, Qwen35NeuronModelForCausalLM)
    ids, mask = _batch(fitted, model)
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                      num_speculative_tokens=0), plain)  # 0: off
    for k in (1, 2, 3, 4):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                             num_speculative_tokens=k)
        assert torch.equal(out, plain), k
        stats = model.runtime.speculation
        pairs = list(zip(stats.accepted_per_round[0::2], stats.accepted_per_round[1::2]))
        assert stats.accepted > 0 and any(a != b for a, b in pairs), (k, pairs)
    # Sampled, through the config's warpers: with top_k=1 the distribution is the argmax's, so the rejection rule must
    # give the greedy tokens (a residual or acceptance computed from anything else would not). fp32 only: bf16 logits
    # tie at the top (measured: row 0, new token 42), where top-k keeps both, and plain sampling leaves greedy too.
    if "float32" in export.name:
        sampled = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, top_k=1,
                                 eos_token_id=None, num_speculative_tokens=2)
        assert torch.equal(sampled, plain)
    # Without it, sampling (torch's global generator: reproducible under torch.manual_seed), not greedy decoding.
    draws = []
    for _ in range(2):
        torch.manual_seed(0)
        draws.append(model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, top_k=0, top_p=1.0,
                                    temperature=1.0, eos_token_id=None, num_speculative_tokens=2))
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], plain)
    model.close()


class _Recorder(BaseStreamer):
    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ended = True


# The options on the Python export's bf16 graphs; the command line's fp32 export is a matrix point here.
BF16_EXPORT = pytest.mark.parametrize("export", [pytest.param("float32", marks=pytest.mark.matrix), "bfloat16"], indirect=True)


@BF16_EXPORT
def test_speculation_takes_row_limits_min_new_tokens_and_a_streamer(fitted, export):
    """generate's other options, as plain decoding takes them: a row whose prompt leaves less room than max_new_tokens
    is refused, or, opted in (stop_at_sequence_length=True), stops at the compiled length while the other runs on; min_new_tokens keeps EOS out until then; a streamer gets
    the prompt and then each new token, one prompt on a batch-2 export (a wave with an unused row)."""
    model = NeuronModelForCausalLM.from_pretrained(export)
    ids, mask = _batch(fitted, model)
    fitted_row = ids[0][mask[0].bool()]
    long = torch.cat([torch.full((SEQUENCE_LENGTH - 10 - 17,), 3), torch.tensor([7, 300, 2] * 5 + [11, 12])])
    rows, rows_mask = torch.zeros(2, len(long), dtype=torch.long), torch.zeros(2, len(long), dtype=torch.long)
    rows[0, -len(fitted_row):], rows_mask[0, -len(fitted_row):] = fitted_row, 1
    rows[1], rows_mask[1] = long, 1  # room for 10 new tokens
    with pytest.raises(UsageError, match=r"^row 1 asks for \d+ new tokens but its prompt \(\d+ tokens\) leaves room for 10"):
        model.generate(rows, attention_mask=rows_mask, max_new_tokens=NEW, do_sample=False, num_speculative_tokens=3)
    # Opted in (stop_at_sequence_length=True), the long row stops at the compiled length, as in plain decoding
    plain = model.generate(rows, attention_mask=rows_mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                           stop_at_sequence_length=True)
    out = model.generate(rows, attention_mask=rows_mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                         num_speculative_tokens=3, stop_at_sequence_length=True)
    assert torch.equal(out, plain) and model.runtime.speculation.accepted > 0
    one, one_mask = ids[:1], mask[:1]
    plain = model.generate(one, attention_mask=one_mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    eos = int(plain[0, ids.shape[1] + 2])  # the third new token
    want = model.generate(one, attention_mask=one_mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                          min_new_tokens=9)
    assert want.shape[1] > ids.shape[1] + 3
    streamers = {}
    for k in (0, 2, 4):
        streamers[k] = _Recorder()
        got = model.generate(one, attention_mask=one_mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                             min_new_tokens=9, num_speculative_tokens=k, streamer=streamers[k])
        assert torch.equal(got, want), k
    assert streamers[2].puts == streamers[0].puts == streamers[4].puts and streamers[2].ended
    assert len(streamers[0].puts) == 1 + want.shape[1] - ids.shape[1]  # the prompt, then one put per new token
    model.close()


class _StopAfter(StoppingCriteria):
    """Flags a row once it has emitted `token` (a stop-token criterion, as a stop string is)."""

    def __init__(self, token, prompt_width):
        self.token, self.prompt_width = token, prompt_width

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, self.prompt_width:] == self.token).any(dim=1)


@BF16_EXPORT
def test_speculation_takes_stopping_criteria(fitted, export):
    """transformers stopping criteria with speculation: called per token as plain decoding calls them, so a row they
    stop ends where plain decoding ends it, though the row's accepted drafts ran past it."""
    model = NeuronModelForCausalLM.from_pretrained(export)
    ids, mask = _batch(fitted, model)
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    criteria = StoppingCriteriaList([_StopAfter(int(plain[0, ids.shape[1] + 6]), ids.shape[1])])
    want = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                          pad_token_id=0, stopping_criteria=criteria)
    assert not torch.equal(want, plain)
    for k in (2, 4):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=0, stopping_criteria=criteria, num_speculative_tokens=k)
        assert torch.equal(out, want), k
    model.close()


@BF16_EXPORT
def test_speculation_errors_are_one_line(fitted, export, export_dir):
    model = NeuronModelForCausalLM.from_pretrained(export)
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(UsageError, match="at most 4 drafts per round"):
        model.generate(ids, max_new_tokens=4, num_speculative_tokens=5)
    model.close()
    plain = NeuronModelForCausalLM.from_pretrained(export_dir("tiny-2b", 1))
    with pytest.raises(IncompatibleExportError, match="export the model with mtp=True") as error:
        plain.generate(ids, max_new_tokens=4, num_speculative_tokens=2)
    assert "\n" not in str(error.value)


@pytest.mark.matrix  # TP 2 speculation on the same runtime is tests/test_speculative_export.py's
def test_a_tensor_parallel_export_made_with_mtp_speculates(fitted, tmp_path):
    """tensor_parallel_size 2 (the head sharded per rank, two worker processes): greedy k = 2 and sampled with
    top_k=1 give the plain greedy tokens, drafts accepted."""
    neuron_config = Qwen35NeuronModelForCausalLM.get_neuron_config(
        fitted, batch_size=BATCH_SIZE, sequence_length=SEQUENCE_LENGTH, tensor_parallel_size=2, dtype="float32",
        target="cpu")
    Qwen35NeuronModelForCausalLM.export(fitted, neuron_config, mtp=True).save_pretrained(tmp_path / "export")
    model = NeuronModelForCausalLM.from_pretrained(tmp_path / "export")
    try:
        ids, mask = _batch(fitted, model)
        plain = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                             num_speculative_tokens=2)
        assert torch.equal(out, plain) and model.runtime.speculation.accepted > 0
        sampled = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, top_k=1,
                                 eos_token_id=None, num_speculative_tokens=2)
        assert torch.equal(sampled, plain)
    finally:
        model.close()


def test_a_trn2_torchneuron_export_made_with_mtp_speculates_on_the_cpu(fitted, tmp_path):
    """`export(..., mtp=True)` for trn2 without the SDK (the torchneuron backend), loaded with its graphs run through
    torch.compile on the CPU: greedy k = 2 gives the plain greedy tokens."""
    neuron_config = Qwen35NeuronModelForCausalLM.get_neuron_config(
        fitted, batch_size=BATCH_SIZE, sequence_length=SEQUENCE_LENGTH, tensor_parallel_size=1, dtype="float32",
        target="trn2")
    Qwen35NeuronModelForCausalLM.export(fitted, neuron_config, mtp=True).save_pretrained(tmp_path / "export")
    model = NeuronModelForCausalLM.from_pretrained(tmp_path / "export", compile_backend="eager", device="cpu")
    assert model.backend == "torchneuron"
    ids, mask = _batch(fitted, model)
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                         num_speculative_tokens=2)
    assert torch.equal(out, plain) and model.runtime.speculation.accepted > 0
    model.close()


def test_an_nxd_export_made_with_mtp_tells_the_nxd_class(monkeypatch):
    """`export(..., mtp=True)` on the NxD backend (trn1, TP 2: the NxD export shards the head) is no longer refused:
    the config handed to the NxD class says how many drafts its speculative graphs verify (backends/nxd/model.py
    builds them from it), and says nothing without mtp=True. The NxD class is a stand-in here (no Neuron SDK: its
    graphs are tested in tests/neuron_xla/test_nxd_speculative.py)."""
    from optimum_qwen35.backends.nxd.state_dict import mtp_export
    from optimum_qwen35.optimum_neuron import modeling

    handed = []

    class NxDClass:
        @classmethod
        def _export(cls, model_id, config, neuron_config, **kwargs):
            handed.append(config)
            return config

    monkeypatch.setattr(modeling, "_neuron_model_class", lambda target, fp8_weights=False: NxDClass)
    neuron_config = Qwen35NeuronModelForCausalLM.get_neuron_config(FIXTURES / "tiny-2b", target="trn1", tensor_parallel_size=2)
    Qwen35NeuronModelForCausalLM.export(FIXTURES / "tiny-2b", neuron_config, mtp=True)
    Qwen35NeuronModelForCausalLM.export(FIXTURES / "tiny-2b", neuron_config)
    assert [mtp_export(config) for config in handed] == [4, 0]
    assert handed[0].to_dict()["qwen35_mtp_export"] == {"max_speculative_tokens": 4}  # saved in config.json
