"""`model(input_ids, attention_mask)`: transformers' `CausalLMOutput` with the logits of every position, through the
export's per-position logits graphs, without disturbing the sequences that prefill()/decode() are running."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("optimum.neuron", reason="needs optimum-neuron (the nox `optimum` session)")

from transformers import AutoTokenizer, pipeline  # noqa: E402
from transformers.modeling_outputs import CausalLMOutput  # noqa: E402

from optimum_qwen35.errors import IncompatibleExportError, UsageError  # noqa: E402
from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM  # noqa: E402

from ..conftest import load_reference, reference_prompts  # noqa: E402
from .conftest import SEQUENCE_LENGTH  # noqa: E402

# fp32 logits against transformers' recorded fp32 logits, at every position (the parity tolerance of the project).
LOGIT_ATOL = 1e-4


def padded(prompts, side="right", pad=0):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        span = slice(0, len(p)) if side == "right" else slice(width - len(p), width)
        ids[row, span], mask[row, span] = torch.tensor(p), 1
    return ids, mask


def fitting_references(layout):
    return [(p, torch.from_numpy(l)) for p, l in reference_prompts(load_reference(layout)) if len(p) <= SEQUENCE_LENGTH]


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def model(request, export_dir):
    model = Qwen35NeuronModelForCausalLM.from_pretrained(export_dir("tiny-2b", request.param))
    yield model
    model.close()


@pytest.mark.parametrize("side", ["right", "left"])
def test_logits_at_every_position_match_transformers(model, side):
    """Six prompts (1 to 65 tokens) in one call: three waves of the compiled batch of 2, padded on either side."""
    refs = fitting_references("tiny-2b")
    assert len(refs) == 6
    ids, mask = padded([p for p, _ in refs], side, pad=7)
    out = model(input_ids=ids, attention_mask=mask)
    assert isinstance(out, CausalLMOutput) and out.loss is None
    assert out.logits.shape == (*ids.shape, 512) and out.logits.dtype == torch.float32
    worst = 0.0
    for row, (prompt, want) in enumerate(refs):
        got = out.logits[row, mask[row].bool()]
        worst = max(worst, (got - want).abs().max().item())
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        assert not out.logits[row, ~mask[row].bool()].any(), "padding positions hold zeros"
    print(f"forward() fp32, {side} padding, max |logit - transformers| = {worst:.2e}")
    assert worst <= LOGIT_ATOL


def test_perplexity_and_loss_match_transformers(model):
    """The usual perplexity computation from model(...).logits, and transformers' own `labels=` loss."""
    refs = fitting_references("tiny-2b")
    ids, mask = padded([p for p, _ in refs])
    labels = ids.masked_fill(mask == 0, -100)
    out = model(ids, attention_mask=mask, labels=labels)
    logits = out.logits
    nll = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
    )
    want_nll, count = 0.0, 0
    for prompt, want in refs:
        if len(prompt) > 1:
            want_nll += torch.nn.functional.cross_entropy(want[:-1].double(), torch.tensor(prompt[1:]), reduction="sum").item()
            count += len(prompt) - 1
    ppl, want_ppl = torch.exp(nll / count).item(), torch.exp(torch.tensor(want_nll / count)).item()
    assert abs(ppl - want_ppl) <= 1e-5 * want_ppl
    assert abs(out.loss.item() - want_nll / count) <= 1e-5
    # return_dict=False: transformers' tuple (loss, logits)
    loss, tuple_logits = model(ids, attention_mask=mask, labels=labels, return_dict=False)
    assert torch.equal(tuple_logits, logits) and loss.item() == out.loss.item()


def test_forward_leaves_running_sequences_alone(model):
    """Two sequences decode in slots 0 and 1; forward() borrows those slots between two steps; the sequences go on
    with transformers' greedy tokens, as if nothing had run."""
    ref = load_reference("tiny-2b")
    a, b = ref["gen_prompt_0"].tolist(), ref["gen_prompt_1"].tolist()
    tokens = model.prefill(*padded([a, b]), seq_ids=[0, 1]).argmax(-1).tolist()
    positions, out = [len(a), len(b)], [[tokens[0]], [tokens[1]]]
    for step in range(6):
        if step == 3:
            ids, mask = padded([b[:20], a])
            assert model(ids, attention_mask=mask).logits.shape == (2, 20, 512)
        logits = model.decode(torch.tensor([[t] for t in tokens]), torch.tensor([[p] for p in positions]), seq_ids=[0, 1])
        tokens = logits.argmax(-1).tolist()
        positions = [p + 1 for p in positions]
        for row in range(2):
            out[row].append(tokens[row])
    assert out[0] == ref["gen_tokens_0"].tolist()[:7]
    assert out[1] == ref["gen_tokens_1"].tolist()[:7]


def test_pipeline_reply_is_greedy_decoding_by_forward_logits(model, export_dir):
    """transformers.pipeline("text-generation") (greedy, through generate()) and forward() agree: the pipeline's reply
    is what greedy decoding by forward()'s last-position logits, one token at a time, produces."""
    tokenizer = AutoTokenizer.from_pretrained(export_dir("tiny-2b", 1))
    chat = pipeline("text-generation", model=model, tokenizer=tokenizer)
    text = "The capital of France is"
    reply = chat(text, max_new_tokens=12, do_sample=False, return_full_text=False)[0]["generated_text"]
    ids = tokenizer(text)["input_ids"]
    start = len(ids)
    for _ in range(12):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        if ids[-1] == tokenizer.eos_token_id:
            break
    assert tokenizer.decode(ids[start:], skip_special_tokens=True) == reply


def test_forward_refuses_what_it_cannot_do(model):
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(UsageError, match=r"does not take \['past_key_values'\]"):
        model(ids, past_key_values=[torch.zeros(1)])
    with pytest.raises(UsageError, match=r"does not take \['output_hidden_states'\]"):
        model(ids, output_hidden_states=True)
    with pytest.raises(UsageError, match=f"longer than the compiled sequence length \\({SEQUENCE_LENGTH}\\)"):
        model(torch.ones(1, SEQUENCE_LENGTH + 1, dtype=torch.long))
    with pytest.raises(UsageError, match="needs input_ids"):
        model()
    with pytest.raises(UsageError, match="labels must be a tensor shaped like input_ids"):
        model(ids, labels=torch.tensor([1, 2, 3]))
    with pytest.raises(UsageError, match="position_ids must count"):
        model(ids, position_ids=torch.tensor([[5, 6, 7]]))
    # What pipelines and harnesses pass along is accepted: use_cache, position_ids counting from 0.
    out = model(ids, use_cache=False, position_ids=torch.tensor([[0, 1, 2]]))
    assert out.logits.shape == (1, 3, 512)


def test_export_without_logits_graphs_says_to_export_again(export_dir, tmp_path):
    folder = tmp_path / "old"
    shutil.copytree(export_dir("tiny-2b", 1), folder)
    manifest = folder / "compiled" / "graphs.json"
    data = json.loads(manifest.read_text())
    del data["logits_buckets"]
    manifest.write_text(json.dumps(data))
    model = Qwen35NeuronModelForCausalLM.from_pretrained(folder)
    with pytest.raises(IncompatibleExportError, match="no per-position logits graphs .* export the model again"):
        model(torch.tensor([[1, 2, 3]]))


# ---------------------------------------------------------------------------------------------- the runner call
def test_optimum_neurons_runner_call_prefills_then_decodes(export_dir):
    """`model(input_ids, position_ids=, seq_ids=, sampling_params=)` as optimum-neuron's vLLM runner calls it: new
    prompts together, right-padded with 0 (token and position), rows in any slot order; then one token per row;
    a one-token prompt (a [rows, 1] call at position 0) starts its slot afresh. Logits [rows, 1, vocab] fp32, whose
    greedy tokens are generate()'s."""
    model = Qwen35NeuronModelForCausalLM.from_pretrained(export_dir("tiny-2b", 1))
    prompts = {0: [11, 12, 13, 14, 15, 16, 17, 18, 19], 1: [21, 22, 23]}
    expected = {s: model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False)[0, len(p):].tolist()
                for s, p in prompts.items()}
    order = [1, 0]  # slot 1's row first
    width = max(len(p) for p in prompts.values())
    ids = torch.tensor([prompts[s] + [0] * (width - len(prompts[s])) for s in order])
    positions = torch.tensor([list(range(len(prompts[s]))) + [0] * (width - len(prompts[s])) for s in order])
    sampling = torch.tensor([[1.0, 1.0, 1.0]] * 2)
    logits = model(ids, position_ids=positions, seq_ids=torch.tensor(order), sampling_params=sampling)
    assert logits.shape == (2, 1, model.config.vocab_size) and logits.dtype == torch.float32
    got = {s: [int(logits[i, -1].argmax())] for i, s in enumerate(order)}
    for _ in range(5):
        ids = torch.tensor([[got[s][-1]] for s in (0, 1)])
        positions = torch.tensor([[len(prompts[s]) + len(got[s]) - 1] for s in (0, 1)])
        logits = model(ids, position_ids=positions, seq_ids=torch.tensor([0, 1]), sampling_params=sampling)
        for i, s in enumerate((0, 1)):
            got[s].append(int(logits[i, -1].argmax()))
    assert got == expected
    one = model.generate(torch.tensor([[31]]), max_new_tokens=1, do_sample=False)[0, 1].item()
    logits = model(torch.tensor([[31]]), position_ids=torch.tensor([[0]]), seq_ids=torch.tensor([1]), sampling_params=sampling[:1])
    assert int(logits[0, -1].argmax()) == one


def test_a_tensor_keyword_forward_does_not_take_is_refused_in_one_line(export_dir):
    model = Qwen35NeuronModelForCausalLM.from_pretrained(export_dir("tiny-2b", 1))
    with pytest.raises(UsageError, match=r"forward\(\) does not take \['pixel_values'\]"):
        model(torch.tensor([[1, 2, 3]]), pixel_values=torch.zeros(2, 3))
