"""Images through the optimum flow (cpu target): export(..., vision=True), save, from_pretrained, generate with
pixel_values / image_grid_thw, the export's processor (`Qwen35Processor`: chat messages with images) and
`pipeline("image-text-to-text")`. transformers 4.57 has no qwen3_5, so the numbers are checked against this project's
eager CPU model (`runtime.images.Qwen35ForImageTextToText`), itself checked against transformers 5 in
tests/test_vision.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("optimum.neuron", reason="needs optimum-neuron (the nox `optimum` session)")

from optimum_qwen35.errors import UsageError  # noqa: E402
from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM  # noqa: E402
from optimum_qwen35.runtime import Qwen35Runtime  # noqa: E402
from optimum_qwen35.tiny import PREPROCESSOR_CONFIG, special_token_id  # noqa: E402

from ..conftest import FIXTURES  # noqa: E402

IMAGE, START, END = (special_token_id(t) for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>"))
GRIDS = torch.tensor([[1, 4, 6], [1, 8, 10]])
IMAGE_BUCKETS = [32, 128]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """tiny-2b (with the processor file a real checkpoint ships: pixel bounds 4096 to 32768, 16 to 128 patches)."""
    folder = tmp_path_factory.mktemp("vision-source") / "tiny-2b"
    shutil.copytree(FIXTURES / "tiny-2b", folder)
    return folder


@pytest.fixture(scope="module")
def vision_export(source, tmp_path_factory):
    neuron_config = Qwen35NeuronModelForCausalLM.get_neuron_config(
        source, batch_size=1, sequence_length=64, tensor_parallel_size=1, dtype="float32", target="cpu"
    )
    model = Qwen35NeuronModelForCausalLM.export(source, neuron_config, vision=True, image_buckets=IMAGE_BUCKETS)
    folder = tmp_path_factory.mktemp("vision-export") / "out"
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model(vision_export):
    return Qwen35NeuronModelForCausalLM.from_pretrained(vision_export)


def _prompt():
    pixels = torch.randn(int(GRIDS.prod(-1).sum()), 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(0))
    ids = [5, 6, 7, START] + [IMAGE] * 6 + [END, 8, 9, START] + [IMAGE] * 20 + [END, 10, 11]
    return ids, pixels


def test_vision_export_holds_the_vision_graphs_weights_and_processor(vision_export):
    graphs = json.loads((vision_export / "compiled" / "graphs.json").read_text())
    assert graphs["vision"]["image_buckets"] == IMAGE_BUCKETS
    assert {"vision_32", "vision_128", "image_context_encoding_64", "image_token_generation_64"} <= set(graphs["graphs"])
    assert (vision_export / "checkpoint" / "vision.safetensors").is_file()
    assert json.loads((vision_export / "preprocessor_config.json").read_text()) == PREPROCESSOR_CONFIG


def test_generate_with_images_matches_the_eager_model(model, source):
    """greedy tokens of generate(input_ids, pixel_values=..., image_grid_thw=...) from the loaded export: those of
    the eager CPU model (parity with transformers 5: tests/test_vision.py)."""
    ids, pixels = _prompt()
    out = model.generate(torch.tensor([ids]), pixel_values=pixels, image_grid_thw=GRIDS, max_new_tokens=16,
                         do_sample=False, eos_token_id=None, mm_token_type_ids=(torch.tensor([ids]) == IMAGE).int())
    eager = Qwen35Runtime.from_pretrained(source, max_length=64, buckets=[64], image_buckets=IMAGE_BUCKETS, vision=True)
    expected = eager.generate([ids], 16, eos_token_id=[], pixel_values=pixels, image_grid_thw=GRIDS)[0]
    assert out[0, len(ids) :].tolist() == expected
    # Text-only prompts through the vision export: the text graphs, the text model's tokens.
    text = [1, 2, 3, 4, 5]
    got = model.generate(torch.tensor([text]), max_new_tokens=8, do_sample=False, eos_token_id=None)[0, 5:].tolist()
    assert got == Qwen35Runtime.from_pretrained(source, max_length=64, buckets=[64]).generate([text], 8, eos_token_id=[])[0]


def test_bad_image_inputs_are_one_line_errors(model, source):
    ids, pixels = _prompt()
    cases = [
        (dict(pixel_values=torch.zeros(64 * 64, pixels.shape[1]), image_grid_thw=torch.tensor([[1, 64, 64]])), "larger than the largest image bucket"),
        (dict(pixel_values=pixels, image_grid_thw=torch.tensor([[1, 4, 6], [1, 8, 8]])), "pixel_values has shape"),
        (dict(pixel_values=pixels[:24], image_grid_thw=GRIDS[:1]), "image tokens"),
    ]
    for kwargs, message in cases:
        with pytest.raises(UsageError, match=message) as error:
            model.generate(torch.tensor([ids]), max_new_tokens=4, **kwargs)
        assert "\n" not in str(error.value)


def test_images_without_a_vision_export_and_bad_vision_options_are_refused(export_dir, source):
    text_only = Qwen35NeuronModelForCausalLM.from_pretrained(export_dir("tiny-2b", 1))
    assert not (export_dir("tiny-2b", 1) / "checkpoint" / "vision.safetensors").exists()
    ids, pixels = _prompt()
    with pytest.raises(UsageError, match="text-only") as error:
        text_only.generate(torch.tensor([ids]), pixel_values=pixels, image_grid_thw=GRIDS, max_new_tokens=4)
    assert "\n" not in str(error.value)
    two = Qwen35NeuronModelForCausalLM.get_neuron_config(
        source, batch_size=1, sequence_length=64, tensor_parallel_size=2, dtype="float32", target="cpu"
    )
    with pytest.raises(UsageError, match="tensor_parallel_size=1"):
        Qwen35NeuronModelForCausalLM.export(source, two, vision=True)
    one = Qwen35NeuronModelForCausalLM.get_neuron_config(
        source, batch_size=1, sequence_length=64, tensor_parallel_size=1, dtype="float32", target="cpu"
    )
    with pytest.raises(UsageError, match="image_buckets"):
        Qwen35NeuronModelForCausalLM.export(source, one, vision=True, image_buckets=[30])


LOAD_BY_ID = """
import json, sys, torch
from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM as Model
model = Model.from_pretrained(sys.argv[1])
ids, pixels, grids = torch.load(sys.argv[2])
out = model.generate(torch.tensor([ids]), pixel_values=pixels, image_grid_thw=grids, max_new_tokens=8, do_sample=False,
                     eos_token_id=None)
print(json.dumps(out[0, len(ids):].tolist()))
"""


def test_hub_push_carries_the_vision_export(hub_server, vision_export, model, tmp_path):
    """push_to_hub -> from_pretrained(repo id) in a fresh process with an empty cache -> the same greedy tokens."""
    from optimum_qwen35 import hub

    from .conftest import last_json_line, run_python

    hub.push_to_hub(vision_export, "alice/qwen35-tiny-vision", token="hf_alice_write", endpoint=hub_server.url)
    ids, pixels = _prompt()
    torch.save((ids, pixels, GRIDS), tmp_path / "inputs.pt")
    user = hub_server.client_env(tmp_path / "user-home")
    tokens = last_json_line(run_python(LOAD_BY_ID, "alice/qwen35-tiny-vision", str(tmp_path / "inputs.pt"), env=user).stdout)
    expected = model.generate(torch.tensor([ids]), pixel_values=pixels, image_grid_thw=GRIDS, max_new_tokens=8,
                              do_sample=False, eos_token_id=None)[0, len(ids) :].tolist()
    assert tokens == expected


def test_command_line_vision_export(source, tmp_path):
    """`optimum-qwen35 export --vision --image_buckets 32,128`; --image_buckets without --vision is one line, exit 2."""
    import subprocess
    import sys

    out = tmp_path / "cli-export"
    common = [sys.executable, "-m", "optimum_qwen35", "export", "--model", str(source), "--sequence_length", "64",
              "--torch_dtype", "float32", "--target", "cpu"]
    refused = subprocess.run([*common, "--image_buckets", "32,128", str(tmp_path / "refused")], capture_output=True, text=True)
    assert refused.returncode == 2 and "pass vision=True" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    done = subprocess.run([*common, "--vision", "--image_buckets", "32,128", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    graphs = json.loads((out / "compiled" / "graphs.json").read_text())
    assert graphs["vision"]["image_buckets"] == [32, 128] and "vision_32" in graphs["graphs"]


# The processor and the pipeline: chat messages holding images (tests need Pillow: the `vision` extra).


def _image(height, width, seed=0):
    from PIL import Image

    pixels = torch.randint(0, 256, (height, width, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def _messages(*images):
    content = [{"type": "image", "image": image} for image in images] + [{"type": "text", "text": "What is this?"}]
    return [{"role": "user", "content": content}]


def test_the_exports_processor_turns_chat_messages_with_images_into_generate_inputs(vision_export):
    """Two images: 70 x 100 pixels resize to 64 x 96 (4 x 6 patches, 6 tokens); 300 x 200 is above the 32768-pixel
    bound and resizes to 192 x 128 (12 x 8 patches, 24 tokens), as transformers' smart_resize does."""
    pytest.importorskip("PIL", reason="needs Pillow (the vision extra)")
    from optimum_qwen35.processing import Qwen35Processor

    processor = Qwen35Processor.from_pretrained(vision_export)
    inputs = processor.apply_chat_template(_messages(_image(70, 100), _image(300, 200, seed=1)), add_generation_prompt=True,
                                           tokenize=True, return_dict=True, return_tensors="pt")
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 6], [1, 12, 8]]
    assert inputs["pixel_values"].shape == (24 + 96, 3 * 2 * 16 * 16)
    assert -1.0 <= inputs["pixel_values"].min() and inputs["pixel_values"].max() <= 1.0  # mean and std 0.5
    ids = inputs["input_ids"][0].tolist()
    start = ids.index(START)
    assert ids[start : start + 8] == [START] + [IMAGE] * 6 + [END] and ids.count(IMAGE) == 6 + 24
    # Videos, and image tokens that do not match the images: one line each.
    for call, message in ((lambda: processor(text=["hi"], videos=[torch.zeros(2, 3, 32, 32)]), "videos are not supported"),
                          (lambda: processor(text=["<|image_pad|> <|image_pad|>"], images=[_image(64, 64)]), "2 <|image_pad|>"),
                          (lambda: processor(text=["<|image_pad|>"]), "no images were given")):
        with pytest.raises(UsageError, match=message) as error:
            call()
        assert "\n" not in str(error.value)


def test_the_processor_resizes_images_to_the_exports_largest_bucket(vision_export, tmp_path):
    """An export whose largest image bucket is 32 patches: a 300 x 200 image is resized to at most 32 patches (the
    checkpoint's own bound would give 96), so that generate() runs it instead of refusing it."""
    pytest.importorskip("PIL", reason="needs Pillow (the vision extra)")
    from optimum_qwen35.processing import Qwen35Processor

    folder = tmp_path / "small-bucket-export"
    (folder / "compiled").mkdir(parents=True)
    for name in ("preprocessor_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(vision_export / name, folder / name)
    graphs = json.loads((vision_export / "compiled" / "graphs.json").read_text())
    graphs["vision"]["image_buckets"] = [32]
    (folder / "compiled" / "graphs.json").write_text(json.dumps(graphs))
    grid = Qwen35Processor.from_pretrained(folder)(text=["<|image_pad|>"], images=[_image(300, 200)])["image_grid_thw"]
    assert int(torch.as_tensor(grid).prod()) <= 32
    assert torch.as_tensor(grid).tolist() == [[1, 6, 4]]
    # A Neuron export names its buckets in its config.json (neuron.state_dict.VISION_EXPORT_KEY): the same cap.
    from optimum_qwen35.backends.nxd.state_dict import VISION_EXPORT_KEY

    shutil.rmtree(folder / "compiled")
    (folder / "config.json").write_text(json.dumps({VISION_EXPORT_KEY: {"config": {}, "image_buckets": [32]}}))
    grid = Qwen35Processor.from_pretrained(folder)(text=["<|image_pad|>"], images=[_image(300, 200)])["image_grid_thw"]
    assert torch.as_tensor(grid).tolist() == [[1, 6, 4]]
    with pytest.raises(UsageError, match="no preprocessor_config.json"):
        Qwen35Processor.from_pretrained(tmp_path)


def test_pipeline_image_text_to_text_answers_chat_messages_with_images(model, vision_export, source, tmp_path, capfd):
    """pipeline("image-text-to-text", model=<the loaded export>, processor=<its processor>) on chat messages holding
    an image file: the same tokens as the eager model fed the processor's inputs; quiet (no "model not supported"
    error from the pipeline's class-name check); a corrupt image file is one line before anything runs."""
    pytest.importorskip("PIL", reason="needs Pillow (the vision extra)")
    from transformers import pipeline

    from optimum_qwen35.processing import Qwen35Processor

    processor = Qwen35Processor.from_pretrained(vision_export)
    _image(70, 100).save(tmp_path / "photo.png")
    messages = [{"role": "user", "content": [{"type": "image", "url": str(tmp_path / "photo.png")},
                                             {"type": "text", "text": "Describe the photo."}]}]
    pipe = pipeline("image-text-to-text", model=model, processor=processor)
    result = pipe(text=messages, max_new_tokens=12, generate_kwargs={"do_sample": False}, return_tensors=True)
    tokens = result[0]["generated_token_ids"].tolist()
    assert "not supported for image-text-to-text" not in capfd.readouterr().err

    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    prompt = inputs["input_ids"][0].tolist()
    assert tokens[: len(prompt)] == prompt and len(tokens) > len(prompt)
    eager = Qwen35Runtime.from_pretrained(source, max_length=64, buckets=[64], image_buckets=IMAGE_BUCKETS, vision=True)
    expected = eager.generate([prompt], 12, pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"])[0]
    assert tokens[len(prompt) :] == expected
    # The pipeline's text answer is the decoded tokens.
    answer = pipe(text=messages, max_new_tokens=12, generate_kwargs={"do_sample": False}, return_full_text=False)
    assert answer[0]["generated_text"] == processor.decode(expected, skip_special_tokens=True)
    # Given text and images (not chat messages), the pipeline passes the keywords it does not know to the
    # processor: a generation option there is refused, not dropped (the saved config samples: a dropped
    # do_sample=False would sample). With chat messages the pipeline itself drops them (transformers 4.57).
    with pytest.raises(UsageError, match="generate_kwargs") as error:
        pipe(images=str(tmp_path / "photo.png"), text="<|vision_start|><|image_pad|><|vision_end|>Describe it.",
             max_new_tokens=4, do_sample=False)
    assert "\n" not in str(error.value)

    (tmp_path / "broken.png").write_bytes(b"not a png")
    broken = [{"role": "user", "content": [{"type": "image", "url": str(tmp_path / "broken.png")}]}]
    with pytest.raises(UsageError, match="broken.png.*not an image Pillow can read") as error:
        pipe(text=broken, max_new_tokens=4)
    assert "\n" not in str(error.value)
