"""An optimum-neuron export opened with this package's checkpoint calls (issue 42, item 5): in the transformers 5
environment, where the README's first command leaves a user, `Qwen35Runtime.from_pretrained(export)` (and
every call reading a checkpoint folder through `validation.model_folder`) says in one line that the folder is an export and which call and
environment load it, and `optimum_qwen35.optimum_neuron` without optimum-neuron says where it lives. (transformers' own
`pipeline(model=export)` answers with transformers' error: docs/optimum_neuron.md, "Compatibility".)

The export folder is `testing.export_folder`'s stand-in (real config.json and neuron_config.json, placeholder
graphs): what these calls read of an export is those two files."""

import importlib.util

import pytest

from optimum_qwen35.errors import CheckpointError
from optimum_qwen35.runtime import Qwen35Runtime
from tests.kit.export_folder import build_fake_export

from .conftest import FIXTURES

SAYS = "is an optimum-neuron export (it has a neuron_config.json), not a checkpoint: load it with optimum.neuron's NeuronModelForCausalLM.from_pretrained"


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return build_fake_export(tmp_path_factory.mktemp("export") / "out", FIXTURES / "tiny-2b", None)


def test_from_pretrained_of_an_export_says_what_loads_it(export):
    with pytest.raises(CheckpointError) as error:
        Qwen35Runtime.from_pretrained(export)
    message = str(error.value)
    assert SAYS in message and 'pip install "optimum-qwen35[optimum]"' in message and "\n" not in message
    assert "copy or download" not in message


@pytest.mark.skipif(importlib.util.find_spec("optimum") is not None, reason="optimum is installed here")
def test_the_optimum_layer_without_optimum_neuron_says_where_it_lives():
    with pytest.raises(ModuleNotFoundError) as error:
        from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM  # noqa: F401
    message = str(error.value)
    assert message.startswith("optimum_qwen35.optimum_neuron (exports: Qwen35NeuronModelForCausalLM, NeuronModelForCausalLM) "
                              "needs optimum-neuron") and "\n" not in message
