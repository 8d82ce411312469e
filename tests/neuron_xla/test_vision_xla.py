"""The vision path on the Neuron targets, as far as the XLA CPU device takes it.

- The vision tower over neuronx-distributed's layers (`NxDLayers`), in the traced parallel state at TP 1, against the
  eager CPU tower (itself checked against transformers 5 in tests/test_vision.py).
- The vision export's NxD graphs (`vision_graph_builders`: a vision graph per image bucket, the image context
  encoding and image token generation graphs), built through their builders and model instances and lowered to HLO
  (TP 1 and 2, fp32 and bf16, trn2 and trn1), then run at TP 1 in fp32 with the cpu runtime's host code for images
  (`XlaImageHost`) against the eager CPU model.
Not done: these graphs in a Neuron export and a Neuron runtime that runs them; neuronx-cc.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch_xla

from optimum_qwen35.modeling.vision import VisionConfig, VisionEncoder, image_bucket_inputs
from optimum_qwen35.backends.nxd.layers import NxDLayers
from optimum_qwen35.runtime.images import load_vision_encoder
from tests.kit.neuron_xla import (
    CONTEXT, IMAGE_CONTEXT, IMAGE_TOKENS, LOGITS, TOKENS, TracedModel, XlaGraphs, build_graphs, export_config, lower,
    model_class, neuron_config, traced_parallel_state, vision_config,
)

from ..conftest import FIXTURES

FEATURE_ATOL = 1e-5  # fp32, the same definition on two devices


@pytest.mark.parametrize("grid, bucket", [((1, 8, 10), 128), ((1, 4, 6), 32)])
def test_nxd_vision_tower_on_the_xla_device_matches_the_cpu_tower(grid, bucket):
    folder = FIXTURES / "tiny-2b"
    vision = VisionConfig.from_dict(json.loads((folder / "config.json").read_text()))
    eager = load_vision_encoder(folder, vision)
    patches = torch.randn(grid[1] * grid[2], vision.patch_dim, generator=torch.Generator().manual_seed(0))
    inputs = image_bucket_inputs(vision, patches, grid, bucket)
    expected = eager(*inputs)
    with traced_parallel_state(1):
        nxd = VisionEncoder(vision, 1, NxDLayers(1, torch.float32))
        missing, unexpected = nxd.load_state_dict(eager.state_dict(), strict=False)
        # neuronx-distributed's layers keep unsharded `master_weight` copies the forward never reads.
        assert not [m for m in missing if not m.endswith(".master_weight")] and not unexpected
        device = torch_xla.device()
        got = nxd.to(device)(*(t.to(device) for t in inputs)).cpu()
    assert got.shape == expected.shape == (bucket // vision.merge_unit, vision.out_hidden_size)
    assert (got - expected).abs().max().item() <= FEATURE_ATOL


# ------------------------------------------------------------------------------- the vision export's Neuron graphs
IMAGE_BUCKETS = [32, 128]
GRAPH_CASES = [("trn2", 1, torch.float32), ("trn2", 2, torch.bfloat16), ("trn1", 1, torch.bfloat16)]


@pytest.mark.parametrize(("target", "tp", "dtype"), GRAPH_CASES, ids=[f"{t}-tp{p}-{str(d)[6:]}" for t, p, d in GRAPH_CASES])
def test_vision_export_graphs_build_and_lower_with_the_state_aliased(target, tp, dtype):
    """`vision_graph_builders`: one vision graph per image bucket (no state in or out), the image context
    encoding and image token generation graphs (every held state an HLO parameter aliased to its output, as in the
    text graphs); input counts that differ from the text graphs' (neuronx-distributed routes calls by them)."""
    nc = neuron_config(FIXTURES / "tiny-2b", target, tp, dtype)
    with traced_parallel_state(tp, nc.logical_nc_config):
        graphs = build_graphs(FIXTURES / "tiny-2b", nc, image_buckets=IMAGE_BUCKETS)
        assert sorted(graphs) == sorted([CONTEXT, TOKENS, LOGITS, IMAGE_CONTEXT, IMAGE_TOKENS, "vision_32", "vision_128"])
        arity = {key: len(graph.example_inputs) for key, graph in graphs.items()}
        assert arity[IMAGE_CONTEXT] == 7 and arity[IMAGE_TOKENS] == 5 and arity["vision_32"] == 5
        assert arity[CONTEXT] == arity[TOKENS] == 4 and arity[LOGITS] == 2
        vision = vision_config(FIXTURES / "tiny-2b")
        for bucket in IMAGE_BUCKETS:
            graph = graphs[f"vision_{bucket}"]
            lowered = lower(graph)
            assert lowered.num_outputs == 1 and graph.alias_names == {} and lowered.parameter_ids == {}
            assert graph.example_inputs[0].shape == (bucket, vision.patch_dim)
        for key in (IMAGE_CONTEXT, IMAGE_TOKENS):
            graph = graphs[key]
            held = graph.module.state_layout.held_specs
            lowered = lower(graph)
            assert lowered.num_outputs == 1 + len(held)
            assert sorted(graph.alias_names.values()) == list(range(1, 1 + len(held)))
            unresolved = sorted(name for name, i in lowered.parameter_ids.items() if i < 0)
            assert not unresolved, f"{key}: state aliases that do not resolve: {unresolved}"
            print(f"\n{target} tp{tp} {dtype} {key}: {lowered.instruction_count} HLO instructions, {len(held)} aliases")


def test_image_prompts_through_the_neuron_class_on_xla_match_the_cpu_model():
    """`Qwen35NxDModelForCausalLM` (what `from_pretrained` returns for a Neuron export) of a vision export, around its
    graphs run on the XLA CPU device (TP 1, fp32): a prompt with two images of different sizes (buckets 32 and 128)
    and text between them goes through the vision graphs, the image context graph and token generation at position +
    rope delta (`NxDImageRuntime`), against the eager CPU model (itself within 1e-4 of transformers 5:
    tests/test_vision.py): the prompt's last logits and 7 decode steps' within 1e-4, the same tokens; a text row
    decodes beside it, unchanged; `generate(input_ids, pixel_values=, image_grid_thw=)` gives the same tokens."""
    from optimum_qwen35.runtime import Qwen35Runtime
    from optimum_qwen35.tiny import special_token_id

    folder = FIXTURES / "tiny-2b"
    image, start, end = (special_token_id(t) for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>"))
    grids = torch.tensor([[1, 4, 6], [1, 8, 10]])
    pixels = torch.randn(24 + 80, vision_config(folder).patch_dim, generator=torch.Generator().manual_seed(0))
    prompt, text = [5, 6, start] + [image] * 6 + [end, 8, 9, start] + [image] * 20 + [end, 10, 11], [1, 2, 3]
    eager = Qwen35Runtime.from_pretrained(folder, max_length=128, image_buckets=IMAGE_BUCKETS, vision=True)
    expected_tokens = eager.generate([prompt], 8, eos_token_id=[], pixel_values=pixels, image_grid_thw=grids)[0]
    expected = eager.logits([prompt + expected_tokens[:-1]], pixels, grids)[0]  # teacher-forced, every position

    nc = neuron_config(folder, "trn2")
    cls = model_class()
    config = export_config(folder, nc, IMAGE_BUCKETS)
    with traced_parallel_state(1, nc.logical_nc_config):
        run = XlaGraphs(build_graphs(folder, nc, load_weights=True, image_buckets=IMAGE_BUCKETS))
        model = cls(config, nc, TracedModel(run), cls.create_graph_builders(config, nc))
        runtime = model._runtime_for_images()
        images = runtime.images.image_prompts([prompt, text], pixels, grids)
        logits = runtime.prefill([prompt, text], [0, 1], images=images)
        worst = (logits[0] - expected[len(prompt) - 1]).abs().max().item()
        tokens, text_tokens = [int(logits[0].argmax())], [int(logits[1].argmax())]
        for step in range(7):
            got = runtime.decode([tokens[-1], text_tokens[-1]], [len(prompt) + step, len(text) + step], [0, 1])
            worst = max(worst, (got[0] - expected[len(prompt) + step]).abs().max().item())
            tokens.append(int(got[0].argmax()))
            text_tokens.append(int(got[1].argmax()))
        generated = model.generate(torch.tensor([prompt]), pixel_values=pixels, image_grid_thw=grids, max_new_tokens=8,
                                   do_sample=False, eos_token_id=None)
    assert worst <= 1e-4, worst
    assert tokens == expected_tokens and generated[0, len(prompt) :].tolist() == expected_tokens
    assert text_tokens == eager.generate([text], 8, eos_token_id=[])[0]
    print(f"\nimage prompt through the Neuron graphs on XLA CPU: max |logit - eager| {worst:.2e} over 8 positions")
