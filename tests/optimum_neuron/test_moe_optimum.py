"""The Qwen3.5 MoE checkpoints (`qwen3_5_moe`) through the optimum-neuron flow on the cpu target, as the dense ones:
`optimum-cli export neuron --instance_type cpu` (TP 2: the experts split by whole experts, recorded in the export and
reloaded so), `NeuronModelForCausalLM` (optimum-neuron's abstract class) get_neuron_config / export / from_pretrained,
save_pretrained, generate and `model(input_ids).logits` against transformers 5's recorded outputs
(tests/fixtures/<layout>/reference.npz, `Qwen3_5MoeForConditionalGeneration`), the text-generation pipeline with the
chat template, the image-text-to-text pipeline, and Hub push / load by id through the stand-in Hub.

The two tiny MoE layouts: `tiny-moe` (6 experts top-2, per-expert keys on disk, 2 files) exported by optimum-cli at
TP 2, `tiny-moe-top1` (4 experts top-1, fused keys) exported from Python at TP 1. About 2 to 3 minutes on 2 busy
cores (four cpu exports of 3 graphs each, one with the vision graphs, and two fresh interpreters).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("optimum.neuron", reason="needs optimum-neuron (the nox `optimum` session)")

from optimum.neuron import NeuronModelForCausalLM  # noqa: E402
from transformers import AutoTokenizer, pipeline  # noqa: E402

from optimum_qwen35.errors import UsageError  # noqa: E402
from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM  # noqa: E402
from optimum_qwen35.tiny import CHAT_MESSAGES  # noqa: E402

from ..conftest import FIXTURES, load_reference  # noqa: E402
from .conftest import BATCH_SIZE, SEQUENCE_LENGTH, last_json_line, run_python  # noqa: E402
from .test_export_load import assert_greedy_matches  # noqa: E402
from .test_forward import LOGIT_ATOL, fitting_references, padded  # noqa: E402

NEW_TOKENS = 48
MOE_LAYOUTS = ("tiny-moe", "tiny-moe-top1")
TP = {"tiny-moe": 2, "tiny-moe-top1": 1}


def _optimum_cli() -> str:
    cli = Path(sys.executable).with_name("optimum-cli")
    site = Path(__import__("sysconfig").get_paths()["purelib"])
    missing = [p for p in ("optimum_qwen35.pth", "optimum/commands/register/register_optimum_qwen35.py") if not (site / p).is_file()]
    assert not missing, f"{missing} not in {site}: install the start-up files as the nox optimum session does (noxfile.py)"
    return str(cli)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """layout -> a saved export: tiny-moe through `optimum-cli export neuron --instance_type cpu` at TP 2, tiny-moe-top1
    through optimum-neuron's abstract class at TP 1 (both fp32, batch 2, 128 tokens)."""
    root = tmp_path_factory.mktemp("moe-exports")
    cli = root / "tiny-moe-cli"
    done = subprocess.run(
        [_optimum_cli(), "export", "neuron", "--model", str(FIXTURES / "tiny-moe"), "--task", "text-generation",
         "--batch_size", str(BATCH_SIZE), "--sequence_length", str(SEQUENCE_LENGTH), "--tensor_parallel_size", "2",
         "--torch_dtype", "float32", "--instance_type", "cpu", str(cli)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    neuron_config = NeuronModelForCausalLM.get_neuron_config(
        str(FIXTURES / "tiny-moe-top1"), batch_size=BATCH_SIZE, sequence_length=SEQUENCE_LENGTH,
        tensor_parallel_size=1, instance_type="cpu",
    )  # fmt: skip
    model = NeuronModelForCausalLM.export(str(FIXTURES / "tiny-moe-top1"), neuron_config)
    assert isinstance(model, Qwen35NeuronModelForCausalLM)
    python = root / "tiny-moe-top1-python"
    model.save_pretrained(python)
    return {"tiny-moe": cli, "tiny-moe-top1": python}


@pytest.fixture(scope="module")
def loaded(exports):
    """layout -> the export loaded through optimum-neuron's abstract class."""
    models = {layout: NeuronModelForCausalLM.from_pretrained(str(folder)) for layout, folder in exports.items()}
    yield models
    for model in models.values():
        model.close()


def test_exports_name_the_moe_text_model_and_record_the_expert_split(exports):
    for layout, folder in exports.items():
        config = json.loads((folder / "config.json").read_text())
        assert config["model_type"] == "qwen3_5_moe_text" and config["architectures"] == ["Qwen3_5MoeForCausalLM"]
        assert "intermediate_size" not in config  # transformers 5's Qwen3_5MoeTextConfig has none
        want = json.loads((FIXTURES / layout / "config.json").read_text())["text_config"]
        for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
            assert config[key] == want[key], key
        neuron_config = json.loads((folder / "neuron_config.json").read_text())
        assert (neuron_config["target"], neuron_config["tp_degree"]) == ("cpu", TP[layout])
    shards = json.loads((exports["tiny-moe"] / "checkpoint" / "tp_shards.json").read_text())
    # 32-row experts: the "auto" rule gives ranks whole experts at TP 2 (3 of the 6 each).
    assert (shards["tp_degree"], shards["moe_parallel"]) == (2, "ep")
    assert sorted(p.name for p in (exports["tiny-moe"] / "checkpoint").glob("rank_*.safetensors")) == [
        "rank_0.safetensors", "rank_1.safetensors"]
    assert (exports["tiny-moe"] / "tokenizer.json").is_file()  # the CLI copies the tokenizer


@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_generate_gives_transformers_greedy_tokens(loaded, layout):
    """Two prompts in one batch, 48 greedy tokens each: transformers 5's recorded tokens (a difference only where its
    top-2 margin is a tie)."""
    ref = load_reference(layout)
    model = loaded[layout]
    assert isinstance(model, Qwen35NeuronModelForCausalLM)
    prompts = [ref[f"gen_prompt_{j}"].tolist() for j in range(2)]
    ids, mask = padded(prompts, side="left")
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
    for j in range(2):
        tokens = out[j, ids.shape[1] :].tolist()
        assert len(tokens) == NEW_TOKENS
        assert_greedy_matches(layout, j, tokens, ref)


@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_forward_logits_match_transformers_at_every_position(loaded, layout):
    refs = fitting_references(layout)
    ids, mask = padded([p for p, _ in refs], "right", pad=7)
    logits = loaded[layout](input_ids=ids, attention_mask=mask).logits
    worst = 0.0
    for row, (_, want) in enumerate(refs):
        got = logits[row, mask[row].bool()]
        worst = max(worst, (got - want).abs().max().item())
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    print(f"\n{layout} TP {TP[layout]}: {len(refs)} prompts, max |logit - transformers| = {worst:.2e}")
    assert worst <= LOGIT_ATOL


def test_save_pretrained_round_trip_and_export_true(loaded, exports, tmp_path):
    """A loaded export saved again loads with the same logits (bit for bit); from_pretrained(export=True) loads an
    export and refuses a checkpoint in one line, as for the dense models."""
    model = loaded["tiny-moe"]
    again = tmp_path / "again"
    model.save_pretrained(again)
    assert json.loads((again / "checkpoint" / "tp_shards.json").read_text())["moe_parallel"] == "ep"
    ids = torch.tensor([load_reference("tiny-moe")["gen_prompt_0"].tolist()])
    reloaded = Qwen35NeuronModelForCausalLM.from_pretrained(again, export=True)
    try:
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
    finally:
        reloaded.close()
    with pytest.raises(UsageError, match=r"is not an export, and from_pretrained\(export=True\) does not compile one") as error:
        NeuronModelForCausalLM.from_pretrained(str(FIXTURES / "tiny-moe-top1"), export=True)
    assert "\n" not in str(error.value)


def test_text_generation_pipeline_with_the_chat_template(loaded, exports):
    """pipeline("text-generation") with chat messages gives transformers' greedy reply; also built from the export's
    path, which transformers 4.57 resolves through this package's loader for the MoE text config."""
    ref = load_reference("tiny-moe")
    tokenizer = AutoTokenizer.from_pretrained(exports["tiny-moe"])
    expected = tokenizer.decode(ref["chat_tokens"].tolist(), skip_special_tokens=True)
    assert tokenizer.apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True) == ref["chat_prompt"].tolist()
    chat = pipeline("text-generation", model=loaded["tiny-moe"], tokenizer=tokenizer)
    reply = chat(CHAT_MESSAGES, max_new_tokens=len(ref["chat_tokens"]), do_sample=False)[0]["generated_text"][-1]
    assert reply == {"role": "assistant", "content": expected}
    by_path = pipeline("text-generation", model=str(exports["tiny-moe-top1"]))
    assert type(by_path.model).__name__ == "Qwen35NeuronModelForCausalLM"
    text = "The capital of France is"
    answer = by_path(text, max_new_tokens=8, do_sample=False, return_full_text=False)[0]["generated_text"]
    inputs = by_path.tokenizer(text, return_tensors="pt")
    tokens = loaded["tiny-moe-top1"].generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1] :]
    assert answer == by_path.tokenizer.decode(tokens, skip_special_tokens=True)
    by_path.model.close()


def test_image_text_to_text_pipeline(tmp_path):
    """A vision export of tiny-moe-top1 (its checkpoint carries the tower under model.visual.*, as the real MoE ones):
    pipeline("image-text-to-text") on chat messages holding an image file gives the eager CPU model's greedy tokens
    (that model's MoE image prompts against transformers 5: tests/test_vision.py)."""
    pytest.importorskip("PIL", reason="needs Pillow (the vision extra)")
    from optimum_qwen35.processing import Qwen35Processor
    from optimum_qwen35.runtime import Qwen35Runtime

    from .test_vision_flow import IMAGE_BUCKETS, _image

    source = FIXTURES / "tiny-moe-top1"
    neuron_config = Qwen35NeuronModelForCausalLM.get_neuron_config(
        source, batch_size=1, sequence_length=64, tensor_parallel_size=1, dtype="float32", target="cpu"
    )
    Qwen35NeuronModelForCausalLM.export(source, neuron_config, vision=True, image_buckets=IMAGE_BUCKETS).save_pretrained(
        tmp_path / "vision-export"
    )
    model = Qwen35NeuronModelForCausalLM.from_pretrained(tmp_path / "vision-export")
    processor = Qwen35Processor.from_pretrained(tmp_path / "vision-export")
    _image(70, 100).save(tmp_path / "photo.png")
    messages = [{"role": "user", "content": [{"type": "image", "url": str(tmp_path / "photo.png")},
                                             {"type": "text", "text": "Describe the photo."}]}]
    pipe = pipeline("image-text-to-text", model=model, processor=processor)
    tokens = pipe(text=messages, max_new_tokens=12, generate_kwargs={"do_sample": False}, return_tensors=True)[0][
        "generated_token_ids"].tolist()
    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    prompt = inputs["input_ids"][0].tolist()
    assert tokens[: len(prompt)] == prompt and len(tokens) > len(prompt)
    eager = Qwen35Runtime.from_pretrained(source, max_length=64, buckets=[64], image_buckets=IMAGE_BUCKETS, vision=True)
    expected = eager.generate([prompt], 12, pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"])[0]
    assert tokens[len(prompt) :] == expected
    model.close()


LOAD_BY_ID = """
import json, sys, torch
from optimum.neuron import NeuronModelForCausalLM
model = NeuronModelForCausalLM.from_pretrained(sys.argv[1])
prompt = json.loads(sys.argv[2])
out = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None)
print(json.dumps({"class": type(model).__name__, "tokens": out[0, len(prompt):].tolist(),
                  "moe_parallel": json.load(open(model.folder / "checkpoint" / "tp_shards.json"))["moe_parallel"]}))
model.close()
"""


def test_hub_push_and_load_by_id(hub_server, loaded, tmp_path):
    """push_to_hub of the TP 2 export -> NeuronModelForCausalLM.from_pretrained(repo id) in a fresh interpreter with an
    empty Hugging Face cache -> transformers' greedy tokens; the model card tags the MoE."""
    from optimum_qwen35 import hub

    loaded["tiny-moe"].push_to_hub("alice/qwen35-moe-tiny", token="hf_alice_write", endpoint=hub_server.url)
    ref = load_reference("tiny-moe")
    user = hub_server.client_env(tmp_path / "user-home")
    result = last_json_line(run_python(LOAD_BY_ID, "alice/qwen35-moe-tiny", json.dumps(ref["gen_prompt_0"].tolist()), env=user).stdout)
    assert result == {"class": "Qwen35NeuronModelForCausalLM", "tokens": ref["gen_tokens_0"].tolist()[:16], "moe_parallel": "ep"}
    card = hub.model_card(loaded["tiny-moe"].folder, "alice/qwen35-moe-tiny")
    assert "- qwen3_5_moe\n" in card and "`qwen3_5_moe_text`" in card


def test_the_compile_cache_entry_digest_is_the_one_a_lookup_of_the_source_computes(exports):
    """A synced MoE export is found by a lookup of its source: the entry's architecture digest (the export's
    config.json without the architecture it names for vLLM) equals optimum-neuron's from the source checkpoint."""
    from optimum.neuron.cache.entries.cache_entry import ModelCacheEntry

    from optimum_qwen35 import hub

    entry = hub.registry_entry(exports["tiny-moe"], model_id="Qwen/Qwen3.5-moe-tiny")
    assert entry.arch_digest() == ModelCacheEntry.create(str(FIXTURES / "tiny-moe"), "text-generation").arch_digest()
