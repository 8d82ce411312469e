"""The SDK-only modules of the Neuron backend (`optimum_qwen35/backends/nxd/` model.py, builders.py, traced.py) against
optimum-neuron 0.4.5's installed source, read as text (importing it needs the Neuron SDK): every name imported from
optimum-neuron exists, every method overridden exists in the base classes with the same parameters, every keyword
passed to an optimum-neuron constructor is one it takes. This checks names and signatures only: nothing of it runs here.
"""

from __future__ import annotations

import ast
from importlib import metadata
from pathlib import Path

import pytest

from .conftest import NEEDS_OPTIMUM_NEURON

try:
    DIST = metadata.distribution("optimum-neuron")
except metadata.PackageNotFoundError:
    pytest.skip(NEEDS_OPTIMUM_NEURON, allow_module_level=True)

NXD = Path(__file__).parents[2] / "optimum_qwen35" / "backends" / "nxd"
OURS = [NXD / "model.py", NXD / "builders.py", NXD / "traced.py"]
BACKEND = "optimum/neuron/models/inference/backend/"
# Our class -> the optimum-neuron classes it derives from, nearest first, (file, class).
BASES = {
    "Qwen35NxDModelForCausalLM": [
        (BACKEND + "modules/decoder/modeling_decoder.py", "NxDModelForCausalLM"),
        (BACKEND + "pretrained_model.py", "NxDPreTrainedModel"),
        ("optimum/neuron/models/inference/modeling_utils.py", "NeuronModelForCausalLM"),
        ("optimum/neuron/models/inference/modeling_utils.py", "NeuronPreTrainedModel"),
    ],
    "Qwen35DecoderModelInstance": [(BACKEND + "modules/decoder/decoder_builders.py", "DecoderModelInstanceForCausalLM")],
    "Qwen35DecoderBuilder": [(BACKEND + "modules/decoder/decoder_builders.py", "NxDDecoderBuilderForCausalLM")],
}


def source(relative: str) -> ast.Module:
    assert DIST.version == "0.4.5"
    return ast.parse(Path(DIST.locate_file(relative)).read_text())


def top_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def methods(tree: ast.Module, cls: str) -> dict[str, list[str]]:
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return {f.name: [a.arg for a in f.args.args + f.args.kwonlyargs] for f in node.body if isinstance(f, ast.FunctionDef)}


# The three files read as one module (each class is defined once among them).
OUR_TREE = ast.Module(body=[node for path in OURS for node in ast.parse(path.read_text()).body], type_ignores=[])
# Methods of ours that override nothing, by design (the host loop over the graphs, the rank split of the weights).
OUR_HELPERS = {"_host_runtime", "_runtime_for_images", "_rows_logits", "_ranks", "_rank_state_dicts"}


def test_names_imported_from_optimum_neuron_exist():
    imports = [n for n in OUR_TREE.body if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module and n.module.startswith("optimum.neuron.")]
    assert imports
    for node in imports:
        defined = top_level_names(source(node.module.replace(".", "/") + ".py"))
        for alias in node.names:
            assert alias.name in defined, f"{node.module} has no {alias.name}"


@pytest.mark.parametrize("ours", sorted(BASES))
def test_overridden_methods_keep_the_base_signature(ours):
    mine = methods(OUR_TREE, ours)
    inherited = {}
    for file, cls in reversed(BASES[ours]):
        inherited.update(methods(source(file), cls))
    for name, params in mine.items():
        if name == "__init__" or name in OUR_HELPERS:
            continue
        assert name in inherited, f"{ours}.{name} overrides nothing in optimum-neuron 0.4.5"
        base = [p for p in inherited[name] if p not in ("self", "cls")]
        here = [p for p in params if p not in ("self", "cls")]
        assert here[: len(base)] == base, f"{ours}.{name}{here} vs {base}"


def test_constructor_keywords_exist():
    builder = methods(source(BACKEND + "modules/decoder/decoder_builders.py"), "NxDDecoderBuilderForCausalLM")["__init__"]
    instance = methods(source(BACKEND + "modules/decoder/decoder_builders.py"), "DecoderModelInstanceForCausalLM")["__init__"]
    for call in ast.walk(OUR_TREE):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name):
            target = {"Qwen35DecoderBuilder": builder, "Qwen35DecoderModelInstance": instance}.get(call.func.id)
            if target:
                assert {k.arg for k in call.keywords} <= set(target), (call.func.id, target)
    decoder = methods(source(BACKEND + "modules/decoder/modeling_decoder.py"), "NxDModelForCausalLM")
    assert {"_create_context_encoding_config", "_create_token_generation_config"} <= set(decoder)
