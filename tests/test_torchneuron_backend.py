"""The TorchNeuron backend (backends/torchneuron/) as far as a machine without TorchNeuron runs it.

A TorchNeuron export is made here with the export code itself (tests/kit/torchneuron_export.py) and loaded by the
product's runner with `torch.compile(backend="eager")` on the CPU: Dynamo captures the same graph modules TorchNeuron
would (fullgraph, static shapes), and torch runs them. Greedy tokens equal the eager runtime's for text (dense and
MoE, fp32 and bf16, TP 1 and 2), image prompts and prefix-cache hits; fp32 logits within 1e-5 at every position; no
recompilation once every graph has run; the backend choice by target and installed SDK. The same runner with the
StableHLO check backend: tests/torchneuron/test_product_backend.py. Nothing here runs TorchNeuron or a device.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from optimum_qwen35.backends import selection
from optimum_qwen35.backends.torchneuron import device as torchneuron_device
from optimum_qwen35.backends.torchneuron.runner import load_runtime
from optimum_qwen35.errors import IncompatibleExportError, MissingDependencyError, UsageError
from optimum_qwen35.export.layout import COMPILED_DIR, GRAPHS_FILE
from optimum_qwen35.runtime import Qwen35Runtime
from optimum_qwen35.runtime.prefix_cache import PrefixCache

from .conftest import FIXTURES
from .kit.torchneuron_export import torchneuron_export

MAX_LENGTH, BUCKETS = 128, [64, 128]
PROMPTS = [[5, 17, 42, 7, 99, 3, 250, 11], [8, 1, 300, 64, 2]]


def _eager(layout: str, dtype=torch.float32, **kwargs) -> Qwen35Runtime:
    return Qwen35Runtime.from_pretrained(FIXTURES / layout, batch_size=2, max_length=MAX_LENGTH, buckets=BUCKETS,
                                         dtype=dtype, pack_weights=False, **kwargs)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root, made = tmp_path_factory.mktemp("torchneuron"), {}

    def get(layout: str, tp_degree: int = 1, dtype=torch.float32, **kwargs):
        key = (layout, tp_degree, dtype, tuple(sorted(kwargs.items())))
        if key not in made:
            made[key] = torchneuron_export(FIXTURES / layout, root / f"{len(made)}-{layout}", tp_degree,
                                           max_length=MAX_LENGTH, dtype=dtype, buckets=BUCKETS, **kwargs)
        return made[key]

    return get


def test_the_export_lists_its_graphs_and_holds_no_program(exports):
    folder = exports("tiny-2b")
    manifest = json.loads((folder / COMPILED_DIR / GRAPHS_FILE).read_text())
    assert manifest["backend"] == "torchneuron"
    assert sorted(manifest["graphs"]) == ["context_encoding_128", "context_encoding_64", "context_logits_128",
                                          "context_logits_64", "token_generation_128", "token_generation_64"]
    assert all("file" not in entry for entry in manifest["graphs"].values())
    assert [p.name for p in (folder / COMPILED_DIR).iterdir()] == [GRAPHS_FILE]


@pytest.mark.parametrize("layout, dtype", [("tiny-2b", torch.float32), ("tiny-nv3x", torch.bfloat16),
                                           ("tiny-moe", torch.float32)])
def test_greedy_tokens_and_logits_equal_the_eager_runtime(exports, layout, dtype):
    eager = _eager(layout, dtype)
    runtime = load_runtime(exports(layout, dtype=dtype), compile_backend="eager", device="cpu")
    try:
        assert runtime.generate(PROMPTS, 12) == eager.generate(PROMPTS, 12)
        if dtype == torch.float32:
            for ours, theirs in zip(runtime.logits(PROMPTS), eager.logits(PROMPTS)):
                assert (ours - theirs).abs().max().item() <= 1e-5
    finally:
        runtime.close()


def test_tensor_parallel_workers_give_the_same_tokens(exports):
    runtime = load_runtime(exports("tiny-nv3x", tp_degree=2), compile_backend="eager", device="cpu")
    try:
        assert runtime.generate(PROMPTS, 10) == _eager("tiny-nv3x").generate(PROMPTS, 10)
    finally:
        runtime.close()


def test_a_prefix_cache_hit_gives_the_cold_logits(exports):
    runtime = load_runtime(exports("tiny-2b", prefix_block_size=64), compile_backend="eager", device="cpu")
    try:
        shared = torch.randint(0, 400, (70,), generator=torch.Generator().manual_seed(3)).tolist()
        prompts = [shared + [9, 8, 7], shared + [1, 2]]
        cold = [runtime.prefill([p], [0])[0].clone() for p in prompts]
        runtime.set_prefix_cache(PrefixCache(block_size=64))
        runtime.prefill([prompts[0]], [0])
        warm = runtime.prefill([prompts[1]], [1])[0]
        assert runtime.last_prefix_hits == [64]
        assert (warm - cold[1]).abs().max().item() <= 1e-5
    finally:
        runtime.close()


def test_image_prompts_give_the_eager_tokens(exports):
    from .test_vision import IMAGE_BUCKETS, _case

    eager = Qwen35Runtime.from_pretrained(FIXTURES / "tiny-nv3x", batch_size=2, max_length=MAX_LENGTH, buckets=BUCKETS,
                                          image_buckets=IMAGE_BUCKETS, pack_weights=False, vision=True)
    runtime = load_runtime(exports("tiny-nv3x", vision=True, image_buckets=tuple(IMAGE_BUCKETS)),
                           compile_backend="eager", device="cpu")
    try:
        prompt, pixels, grids = _case("two_images_of_different_sizes")
        kwargs = dict(eos_token_id=[], pixel_values=pixels, image_grid_thw=grids)
        assert runtime.generate([prompt], 8, **kwargs) == eager.generate([prompt], 8, **kwargs)
    finally:
        runtime.close()


def test_no_graph_recompiles_once_every_bucket_has_run(exports):
    runtime = load_runtime(exports("tiny-2b"), compile_backend="eager", device="cpu")
    long_prompt = list(range(1, 90))  # the 128 bucket, and decode steps over both cache buckets
    try:
        first = runtime.generate([PROMPTS[0], long_prompt], 6)
        torch.compiler.set_stance("fail_on_recompile")
        try:
            assert runtime.generate([PROMPTS[0], long_prompt], 6) == first
        finally:
            torch.compiler.set_stance("default")
    finally:
        runtime.close()


def test_each_runner_refuses_the_other_backends_export(exports, tmp_path):
    with pytest.raises(IncompatibleExportError, match=r"is a torchneuron export, not a cpu one: load it with"):
        Qwen35Runtime.from_export(exports("tiny-2b"))
    cpu = tmp_path / "cpu"
    manifest = json.loads((exports("tiny-2b") / COMPILED_DIR / GRAPHS_FILE).read_text())
    (cpu / COMPILED_DIR).mkdir(parents=True)
    (cpu / COMPILED_DIR / GRAPHS_FILE).write_text(json.dumps({**manifest, "backend": "cpu"}))
    with pytest.raises(IncompatibleExportError, match=r"is not a TorchNeuron export"):
        load_runtime(cpu, compile_backend="eager", device="cpu")


def test_the_neuron_device_without_torchneuron_is_one_line(exports):
    with pytest.raises(MissingDependencyError) as error:
        load_runtime(exports("tiny-2b"))
    text = str(error.value)
    assert "\n" not in text and 'compile_backend="eager", device="cpu"' in text
    with pytest.raises(MissingDependencyError):  # the device alone, before torch knows its name
        load_runtime(exports("tiny-2b"), compile_backend="eager", device="neuron")


@pytest.mark.parametrize("target, torchneuron, nxd, requested, chosen", [
    ("trn1", False, False, None, "nxd"),
    ("trn1", True, True, None, "nxd"),
    ("trn2", True, False, None, "torchneuron"),
    ("trn2", True, True, None, "torchneuron"),
    ("trn2", False, True, None, "nxd"),
    ("trn2", False, False, None, "torchneuron"),
    ("trn2", True, True, "nxd", "nxd"),
    ("trn2", False, True, "torchneuron", "torchneuron"),
])
def test_the_backend_by_target_and_installed_sdk(monkeypatch, caplog, target, torchneuron, nxd, requested, chosen):
    monkeypatch.delenv(selection.BACKEND_ENV, raising=False)
    monkeypatch.setattr(selection, "torchneuron_installed", lambda: torchneuron)
    monkeypatch.setattr(selection, "nxd_installed", lambda: nxd)
    with caplog.at_level(logging.WARNING, logger=selection.__name__):
        assert selection.choose_neuron_backend(target, requested) == chosen
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == (target == "trn2") and all("\n" not in line and chosen in line for line in lines)


def test_the_backend_override_by_environment_and_its_errors(monkeypatch):
    monkeypatch.setattr(selection, "torchneuron_installed", lambda: True)
    monkeypatch.setenv(selection.BACKEND_ENV, "nxd")
    assert selection.choose_neuron_backend("trn2") == "nxd"
    monkeypatch.setenv(selection.BACKEND_ENV, "xla")
    with pytest.raises(UsageError, match=r"neuron_backend must be one of nxd, torchneuron, got 'xla'"):
        selection.choose_neuron_backend("trn2")
    with pytest.raises(UsageError, match=r"'torchneuron' runs on trn2 / trn3 only"):
        selection.choose_neuron_backend("trn1", "torchneuron")


def test_torchneuron_is_the_torch_213_package_not_the_xla_one(monkeypatch):
    monkeypatch.setattr(torchneuron_device.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(torchneuron_device.torch, "__version__", "2.8.0+cpu")
    assert not torchneuron_device.torchneuron_installed()
    monkeypatch.setattr(torchneuron_device.torch, "__version__", "2.13.0+cpu")
    assert torchneuron_device.torchneuron_installed()
