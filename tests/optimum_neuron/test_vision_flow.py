"""Images through the optimum flow (cpu target): export(..., vision=True), save, from_pretrained, generate with
pixel_values / image_grid_thw. transformers 4.57 has no qwen3_5, so the numbers are checked against this project's
eager CPU model (`runtime.vision.Qwen35ForImageTextToText`), itself checked against transformers 5 in
tests/test_vision.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("optimum.neuron", reason="needs optimum-neuron (the nox `optimum` session)")

from optimum_qwen35.errors import UsageError  # noqa: E402
from optimum_qwen35.optimum import Qwen35NeuronModelForCausalLM  # noqa: E402
from optimum_qwen35.runtime.cpu import Qwen35ForCausalLM  # noqa: E402
from optimum_qwen35.runtime.vision import Qwen35ForImageTextToText  # noqa: E402
from optimum_qwen35.testing.tiny import special_token_id  # noqa: E402

from ..conftest import FIXTURES  # noqa: E402

IMAGE, START, END = (special_token_id(t) for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>"))
GRIDS = torch.tensor([[1, 4, 6], [1, 8, 10]])
IMAGE_BUCKETS = [32, 128]
# The processor config of the real Qwen3.5 checkpoints (patch 16, merge 2, temporal 2), smaller pixel bounds.
PREPROCESSOR = {
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "image_processor_type": "Qwen2VLImageProcessorFast",
    "merge_size": 2, "patch_size": 16, "processor_class": "Qwen3VLProcessor", "temporal_patch_size": 2,
    "size": {"longest_edge": 32768, "shortest_edge": 4096},
}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """tiny-2b with the processor file a real checkpoint ships."""
    folder = tmp_path_factory.mktemp("vision-source") / "tiny-2b"
    shutil.copytree(FIXTURES / "tiny-2b", folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
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
    assert json.loads((vision_export / "preprocessor_config.json").read_text()) == PREPROCESSOR


def test_generate_with_images_matches_the_eager_model(model, source):
    """greedy tokens of generate(input_ids, pixel_values=..., image_grid_thw=...) from the loaded export: those of
    the eager CPU model (parity with transformers 5: tests/test_vision.py)."""
    ids, pixels = _prompt()
    out = model.generate(torch.tensor([ids]), pixel_values=pixels, image_grid_thw=GRIDS, max_new_tokens=16,
                         do_sample=False, eos_token_id=None, mm_token_type_ids=(torch.tensor([ids]) == IMAGE).int())
    eager = Qwen35ForImageTextToText.from_pretrained(source, max_length=64, buckets=[64], image_buckets=IMAGE_BUCKETS)
    expected = eager.generate([ids], 16, eos_token_id=[], pixel_values=pixels, image_grid_thw=GRIDS)[0]
    assert out[0, len(ids) :].tolist() == expected
    # Text-only prompts through the vision export: the text graphs, the text model's tokens.
    text = [1, 2, 3, 4, 5]
    got = model.generate(torch.tensor([text]), max_new_tokens=8, do_sample=False, eos_token_id=None)[0, 5:].tolist()
    assert got == Qwen35ForCausalLM.from_pretrained(source, max_length=64, buckets=[64]).generate([text], 8, eos_token_id=[])[0]


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
from optimum_qwen35.optimum import Qwen35NeuronModelForCausalLM as Model
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
