"""Every field of a cpu export's compatibility check, one at a time (issue 22).

A good TP = 1, batch-2, 128-token fp32 export is copied and one recorded field is changed, as a folder that mixes two
exports (or comes from another install) would have it: `from_pretrained` must refuse it with the line that names that
field, before any graph runs. Without the check, most of these load and fail later (a batch-size mismatch in the
first prefill, a dtype or torch mismatch deep inside torch.export's loader) or silently run the wrong graphs.
The caller's expectations (`from_pretrained(batch_size=..., ...)`, `nc.check_expected`) and the optimum-neuron and
neuronx-cc versions of neuron_config.json are in tests/optimum_neuron/test_bad_exports.py.
"""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("optimum.neuron", reason="needs optimum-neuron (the nox `optimum` session)")

from optimum_qwen35.errors import IncompatibleExportError  # noqa: E402
from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM  # noqa: E402


def edit(path, **changes):
    data = json.loads(path.read_text())
    for key, value in changes.items():
        assert key in data, f"{path.name} has no {key}"
        data[key] = value
    path.write_text(json.dumps(data))


# (file in the export, field, value, the message)
FIELDS = [
    ("compiled/graphs.json", "batch_size", 1, "compiled/ was built for batch_size=1 but neuron_config.json says 2"),
    ("compiled/graphs.json", "max_length", 256, "compiled/ was built for max_length=256 but neuron_config.json says 128"),
    ("compiled/graphs.json", "tp_degree", 2, "compiled/ was built for tp_degree=2 but neuron_config.json says 1"),
    ("compiled/graphs.json", "dtype", "bfloat16", "compiled/ is bfloat16 but neuron_config.json says torch.float32"),
    ("compiled/graphs.json", "torch_version", "2.12.0", "was compiled with torch 2.12.0, but .* is installed: install torch==2.12.0"),
    ("compiled/graphs.json", "version", 1, "is not a optimum-qwen35-cpu-graphs v2 manifest"),
    ("compiled/graphs.json", "format", "something-else", "is not a optimum-qwen35-cpu-graphs v2 manifest"),
    ("checkpoint/tp_shards.json", "tp_degree", 2, "checkpoint/ holds weights for tensor_parallel_size=2, the graphs for 1"),
    ("neuron_config.json", "batch_size", 4, "compiled/ was built for batch_size=2 but neuron_config.json says 4"),
    ("neuron_config.json", "sequence_length", 64, "compiled/ was built for max_length=128 but neuron_config.json says 64"),
    ("neuron_config.json", "tp_degree", 2, "compiled/ was built for tp_degree=1 but neuron_config.json says 2"),
    ("neuron_config.json", "torch_dtype", "bfloat16", "compiled/ is float32 but neuron_config.json says torch.bfloat16"),
]


def test_the_unchanged_copy_loads(export_dir, tmp_path):
    """What the test below changes is what fails: the copy loads as it is."""
    folder = tmp_path / "export"
    shutil.copytree(export_dir("tiny-2b", 1), folder)
    Qwen35NeuronModelForCausalLM.from_pretrained(folder).close()


@pytest.mark.parametrize("file, field, value, message", FIELDS, ids=[f"{f}:{k}" for f, k, _, _ in FIELDS])
def test_one_field_changed_is_refused_at_load(export_dir, tmp_path, file, field, value, message):
    folder = tmp_path / "export"
    shutil.copytree(export_dir("tiny-2b", 1), folder)
    edit(folder / file, **{field: value})
    with pytest.raises(IncompatibleExportError, match=message):
        Qwen35NeuronModelForCausalLM.from_pretrained(folder)
