"""Images as users hand them to `Qwen35Processor`: transparency converted as transformers 5 converts it (composited
onto white; tests/fixtures/transparent_images.json holds transformers 5.24's output, recorded by
tests/fixtures/make_transparent_images.py), and a truncated or unreadable file named in one `UsageError`."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch

pytest.importorskip("optimum.neuron", reason="needs optimum-neuron (the nox `optimum` session)")
pytest.importorskip("PIL", reason="needs Pillow (the vision extra)")

from PIL import Image  # noqa: E402

from optimum_qwen35.errors import UsageError  # noqa: E402
from optimum_qwen35.processing import Qwen35Processor, to_rgb  # noqa: E402

from ..conftest import FIXTURES  # noqa: E402

RECORDED = json.loads((FIXTURES / "transparent_images.json").read_text())["images"]


def _image(name: str):
    return Image.open(io.BytesIO(base64.b64decode(RECORDED[name]["png"])))


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_transparency_is_composited_onto_white_as_transformers_5_does(name):
    image = _image(name)
    assert image.mode == RECORDED[name]["mode"]
    expected = np.array(RECORDED[name]["rgb"], dtype=np.uint8)
    assert np.array_equal(np.asarray(to_rgb(image)), expected)
    if name != "RGB (no alpha)":  # transformers 4.57's conversion (alpha dropped) differs: the check can fail
        assert not np.array_equal(np.asarray(_image(name).convert("RGB")), expected)


@pytest.fixture(scope="module")
def processor():
    return Qwen35Processor.from_pretrained(FIXTURES / "tiny-2b")


def _messages(image):
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What is this?"}]}]


def _chat(processor, image):
    return processor.apply_chat_template(_messages(image), add_generation_prompt=True, tokenize=True, return_dict=True,
                                         return_tensors="pt")


def test_the_processor_sees_the_composited_image_from_a_file_a_pil_image_and_images(processor, tmp_path):
    path = tmp_path / "transparent.png"
    path.write_bytes(base64.b64decode(RECORDED["RGBA"]["png"]))
    composited = Image.fromarray(np.array(RECORDED["RGBA"]["rgb"], dtype=np.uint8))
    want = processor(text=["<|image_pad|>"], images=[composited], return_tensors="pt")["pixel_values"]
    dropped = processor(text=["<|image_pad|>"], images=[_image("RGBA").convert("RGB")], return_tensors="pt")["pixel_values"]
    assert not torch.equal(want, dropped)
    for given in (str(path), path, _image("RGBA")):
        assert torch.equal(_chat(processor, given)["pixel_values"], want), given
    for given in ([_image("RGBA")], [str(path)]):
        assert torch.equal(processor(text=["<|image_pad|>"], images=given, return_tensors="pt")["pixel_values"], want)


def test_a_truncated_or_unreadable_image_is_named_in_one_line(processor, tmp_path):
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buffer, format="PNG")
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    not_an_image = tmp_path / "notes.png"
    not_an_image.write_text("not an image")
    calls = [
        (truncated, lambda: _chat(processor, str(truncated))),
        (truncated, lambda: processor(text=["<|image_pad|>"], images=[str(truncated)])),
        (truncated, lambda: processor(text=["<|image_pad|>"], images=[Image.open(truncated)])),
        (not_an_image, lambda: _chat(processor, str(not_an_image))),
        (not_an_image, lambda: processor(text=["<|image_pad|>"], images=[str(not_an_image)])),
    ]
    for path, call in calls:
        with pytest.raises(UsageError) as error:
            call()
        assert str(path) in str(error.value) and "\n" not in str(error.value)
