"""The user's own commands on a Neuron target, run as far as they go without the Neuron SDK, with the boundary where
they stop asserted: the first closed SDK function they call (tests/neuron_sdk_standin raises naming it).

- `optimum-cli export neuron ... --instance_type trn2`: optimum-cli's `python3 -m optimum.exporters.neuron` child
  registers Qwen3.5 through the start-up file (`optimum_qwen35.pth`, as a regular install places it), resolves
  this project's class, builds the neuron config and both graph builders, and stops entering optimum-neuron's
  compile cache (`hub_neuronx_cache` -> libneuronxla's `CacheUrl.get_cache_url`), before any graph is built. Its
  output folder is not created.
- inside that cache context, the compile step itself (`NxDPreTrainedModel.compile` -> neuronx-distributed's
  `ModelBuilder.trace`) builds each graph's module through this project's model instance and stops at
  `torch_neuronx.xla_impl.trace.generate_hlo`, which `graphs.lower` stands for in the other tests.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kit.neuron_xla import export_config, model_class, neuron_config

from ..conftest import FIXTURES


@pytest.mark.parametrize("fixture", ["tiny-2b", "tiny-moe"], ids=["dense", "moe"])
def test_optimum_cli_export_neuron_runs_until_the_compile_cache(tmp_path, fixture):
    cli = shutil.which("optimum-cli", path=str(Path(sys.executable).parent))
    assert cli, "optimum-cli is not installed in this environment"
    site = Path(subprocess.check_output([sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    assert (site / "optimum_qwen35.pth").is_file(), "the start-up file is not in site-packages (see noxfile.py)"
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(
        [cli, "export", "neuron", "--model", str(FIXTURES / fixture), "--task", "text-generation", "--batch_size", "2",
         "--sequence_length", "128", "--tensor_parallel_size", "1", "--instance_type", "trn2", str(out)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert result.returncode != 0
    # This project's class was found and ran: its Neuron branch handed the export to the NxD class ...
    assert "optimum_qwen35/optimum_neuron/modeling.py" in result.stderr and "pretrained_model.py" in result.stderr
    # ... which stopped at the first closed SDK call: the compile cache, entered before the graphs are built.
    last = [line for line in result.stderr.splitlines() if line.startswith("neuron_sdk_standin.NeuronSDKUnavailable")]
    assert last and "libneuronxla.neuron_cc_cache.CacheUrl.get_cache_url" in last[0], result.stderr[-3000:]
    assert "in hub_neuronx_cache" in result.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    "fixture, image_buckets", [("tiny-2b", None), ("tiny-2b", [32, 128]), ("tiny-moe", None)], ids=["text", "vision", "moe"]
)
def test_the_compile_step_builds_each_graph_and_stops_at_hlo_generation(monkeypatch, tmp_path, fixture, image_buckets):
    """The text export's three graphs; a vision export's seven (a vision graph per image bucket, image context
    encoding and image token generation besides); a MoE checkpoint's three, through the same class."""
    import neuron_sdk_standin
    from optimum.neuron.models.inference.backend.pretrained_model import NxDPreTrainedModel

    monkeypatch.setenv("BASE_COMPILE_WORK_DIR", str(tmp_path / "nxd"))
    nc = neuron_config(FIXTURES / fixture, "trn2")
    cls = model_class()
    builders = cls.create_graph_builders(export_config(FIXTURES / fixture, nc, image_buckets), nc)
    built = []
    for builder in builders.values():
        original = builder.get_model_instance

        def instance(original=original):
            made = original()
            built.append(made)
            return made

        builder.get_model_instance = instance
    with pytest.raises(neuron_sdk_standin.NeuronSDKUnavailable, match=r"torch_neuronx\.xla_impl\.trace\.generate_hlo"):
        NxDPreTrainedModel.compile(neuron_config=nc, graph_builders=builders, compiler_args=cls.get_compiler_args(nc))
    # ModelBuilder took every graph; the first (context encoding) was built by this project's model instance,
    # with the held state restored to its dtypes, and its aliases made, before the closed HLO generation.
    assert len(built) == (3 if image_buckets is None else 7)
    # neuronx-distributed routes a call to the graph whose example inputs have its shapes (`model_builder.py`
    # L1879-1887, a map keyed by the shapes): the graphs must differ there, or one would hide another.
    keys = [str([list(t.shape) for t in builder.input_generator()[0]]) for builder in builders.values()]
    assert len(set(keys)) == len(keys), keys
    first = built[0]
    assert first.module is not None and len(first.input_output_aliases) == len(first.module.state_layout.held_specs)


def test_a_vision_export_to_a_neuron_target_builds_the_vision_graphs_until_the_compile_cache(monkeypatch, tmp_path):
    """`Qwen35NeuronModelForCausalLM.export(..., vision=True)` for trn2: the NxD class gets the config marked as a
    vision export (tower config and image buckets, saved in the export's config.json) and builds the seven graphs,
    then stops at the first closed SDK call, as the text export does."""
    import neuron_sdk_standin

    from optimum_qwen35.backends.nxd.state_dict import vision_export
    from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM

    cls = model_class()
    seen = {}
    original = cls.create_graph_builders.__func__

    def create_graph_builders(klass, config, neuron_config):
        builders = original(klass, config, neuron_config)
        seen.update(vision=vision_export(config), keys=sorted(builders))
        return builders

    monkeypatch.setattr(cls, "create_graph_builders", classmethod(create_graph_builders))
    nc = neuron_config(FIXTURES / "tiny-2b", "trn2")
    with pytest.raises(neuron_sdk_standin.NeuronSDKUnavailable, match=r"CacheUrl\.get_cache_url"):
        Qwen35NeuronModelForCausalLM.export(FIXTURES / "tiny-2b", nc, vision=True, image_buckets=[32, 128])
    tower, buckets = seen["vision"]
    assert buckets == [32, 128] and tower.depth == 2 and tower.image_token_id == 498
    # What the loaded export's class reads back: the saved config.json keeps the mark (from_pretrained -> generate).
    from transformers import AutoConfig

    config = export_config(FIXTURES / "tiny-2b", nc, [32, 128])
    config.save_pretrained(tmp_path)
    assert vision_export(AutoConfig.from_pretrained(tmp_path)) == (tower, buckets)
    assert seen["keys"] == sorted(["context_encoding", "token_generation", "context_logits_model",
                                   "image_context_encoding", "image_token_generation", "vision_32", "vision_128"])
