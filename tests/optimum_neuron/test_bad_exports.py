"""A folder that cannot serve the request fails with one line that says what to do; a failed export or
save leaves nothing that loads as complete; the command line prints that line and no traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("optimum.neuron", reason="needs optimum-neuron (the nox `optimum` session)")

from optimum_qwen35.errors import CheckpointError, ExportError, IncompatibleExportError, UsageError  # noqa: E402
from optimum_qwen35.optimum_neuron import Qwen35NeuronModelForCausalLM  # noqa: E402

from ..conftest import FIXTURES  # noqa: E402


@pytest.fixture()
def good(export_dir, tmp_path):
    """A private copy of a TP=2, batch-2 export (tests below damage it)."""
    folder = tmp_path / "export"
    shutil.copytree(export_dir("tiny-2b", 2), folder)
    return folder


def edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "expected, message",
    [
        ({"tensor_parallel_size": 4}, "exported for tensor_parallel_size=2, not 4"),
        ({"batch_size": 8}, "exported for batch_size=2, not 8"),
        ({"sequence_length": 4096}, "exported for sequence_length=128, not 4096"),
        ({"target": "trn2"}, "exported for target=cpu, not trn2"),
        ({"dtype": "bfloat16"}, "exported for dtype=float32, not bfloat16"),
    ],
)
def test_export_compiled_for_something_else(good, expected, message):
    with pytest.raises(IncompatibleExportError, match=message):
        Qwen35NeuronModelForCausalLM.from_pretrained(good, **expected)


def test_export_for_a_neuron_target_on_this_machine(good):
    edit_json(good / "neuron_config.json", target="trn1", neuronxcc_version="2.21.33363.0")
    with pytest.raises(IncompatibleExportError, match="compiled for trn1 by neuronx-cc 2.21.33363.0.*--target cpu"):
        Qwen35NeuronModelForCausalLM.from_pretrained(good)


def test_export_by_another_optimum_neuron_version(good):
    edit_json(good / "neuron_config.json", optimum_neuron_version="0.3.0")
    with pytest.raises(IncompatibleExportError, match=r"exported with optimum-neuron 0.3.0, but 0.4.5 is installed: install optimum-neuron==0.3.0"):
        Qwen35NeuronModelForCausalLM.from_pretrained(good)


def test_export_whose_weights_do_not_match(good, export_dir):
    other = export_dir("tiny-nv3x", 2)  # same TP degree, other shapes
    shutil.copy2(other / "checkpoint" / "rank_1.safetensors", good / "checkpoint" / "rank_1.safetensors")
    with pytest.raises(CheckpointError, match="rank_1.safetensors"):
        Qwen35NeuronModelForCausalLM.from_pretrained(good)


def test_export_mixing_two_exports(good, export_dir):
    shutil.rmtree(good / "compiled")
    shutil.copytree(export_dir("tiny-2b", 1) / "compiled", good / "compiled")
    with pytest.raises(IncompatibleExportError, match="compiled/ was built for tp_degree=1 .* export the model again"):
        Qwen35NeuronModelForCausalLM.from_pretrained(good)


def test_plain_checkpoint_is_not_an_export():
    with pytest.raises(IncompatibleExportError, match="is not an exported model .*optimum-qwen35 export"):
        Qwen35NeuronModelForCausalLM.from_pretrained(FIXTURES / "tiny-2b")


def test_interrupted_export_leaves_no_work_folder(monkeypatch, tmp_path):
    import tempfile

    import optimum_qwen35.export.cpu as cpu_export

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cpu_export, "compile_graphs", interrupted)
    neuron_config = Qwen35NeuronModelForCausalLM.get_neuron_config(FIXTURES / "tiny-2b", batch_size=1, sequence_length=128, dtype="float32")
    with pytest.raises(KeyboardInterrupt):
        Qwen35NeuronModelForCausalLM.export(FIXTURES / "tiny-2b", neuron_config)
    assert list(tmp_path.iterdir()) == []


def test_interrupted_save_leaves_nothing_that_loads(export_dir, tmp_path, monkeypatch):
    import optimum_qwen35.neuron_model.base as modeling

    model = Qwen35NeuronModelForCausalLM.from_pretrained(export_dir("tiny-2b", 1))
    real_copy = shutil.copy2
    copied = []

    def copy_then_die(src, dst, *a, **k):
        if len(copied) == 3:
            raise KeyboardInterrupt
        copied.append(src)
        return real_copy(src, dst, *a, **k)

    monkeypatch.setattr(modeling.os, "link", lambda *a: (_ for _ in ()).throw(OSError("no hard links")))
    monkeypatch.setattr(modeling.shutil, "copy2", copy_then_die)
    with pytest.raises(KeyboardInterrupt):
        model.save_pretrained(tmp_path / "out")
    assert list(tmp_path.iterdir()) == [], "a partial save was left behind"


def test_save_refuses_a_non_empty_folder_unless_overwrite(export_dir, tmp_path):
    model = Qwen35NeuronModelForCausalLM.from_pretrained(export_dir("tiny-2b", 1))
    target = tmp_path / "out"
    shutil.copytree(export_dir("tiny-2b", 2), target)  # another export, TP=2: rank_1 would go stale
    with pytest.raises(ExportError, match="already holds an exported model.*overwrite"):
        model.save_pretrained(target)
    model.save_pretrained(target, overwrite=True)
    assert sorted(p.name for p in (target / "checkpoint").glob("rank_*")) == ["rank_0.safetensors"], "stale rank files"
    assert json.loads((target / "neuron_config.json").read_text())["tp_degree"] == 1
    with pytest.raises(ExportError, match="holds a model checkpoint"):
        model.save_pretrained(shutil.copytree(FIXTURES / "tiny-2b", tmp_path / "ckpt"), overwrite=True)


def test_invalid_export_requests():
    with pytest.raises(UsageError, match=r"tensor_parallel_size=3 does not split .* Valid degrees: \[1, 2, 4\]"):
        Qwen35NeuronModelForCausalLM.get_neuron_config(FIXTURES / "tiny-2b", tensor_parallel_size=3)
    with pytest.raises(UsageError, match="batch_size must be a positive integer"):
        Qwen35NeuronModelForCausalLM.get_neuron_config(FIXTURES / "tiny-2b", batch_size=0)
    with pytest.raises(UsageError, match="unknown target 'gpu'"):
        Qwen35NeuronModelForCausalLM.get_neuron_config(FIXTURES / "tiny-2b", target="gpu")
    with pytest.raises(UsageError, match="dtype 'int8' is not supported"):
        Qwen35NeuronModelForCausalLM.get_neuron_config(FIXTURES / "tiny-2b", dtype="int8")
    # Without the Neuron SDK, an NxD export (trn1, or trn2 with neuron_backend="nxd") says so, what to install, and the
    # target that runs here; trn2 alone is a TorchNeuron export, which needs no SDK (test_torchneuron_export.py).
    for target, backend in (("trn1", None), ("trn2", "nxd")):
        neuron_config = Qwen35NeuronModelForCausalLM.get_neuron_config(FIXTURES / "tiny-2b", target=target, tensor_parallel_size=2)
        with pytest.raises(
            IncompatibleExportError,
            match=rf"target '{target}' needs the Neuron backend, but the Neuron SDK \(torch-neuronx, neuronx-distributed\) "
            r"is not installed here: .*optimum-qwen35\[neuronx\].*target='cpu'",
        ):
            Qwen35NeuronModelForCausalLM.export(FIXTURES / "tiny-2b", neuron_config, neuron_backend=backend)
    with pytest.raises(UsageError, match=r"neuron_backend='torchneuron' applies to a Neuron target"):
        Qwen35NeuronModelForCausalLM.export(FIXTURES / "tiny-2b", Qwen35NeuronModelForCausalLM.get_neuron_config(
            FIXTURES / "tiny-2b", target="cpu"), neuron_backend="torchneuron")


# Logical Neuron cores per instance (trn2 at LNC 2), as benchmarks/neuron_real_shapes.py's INSTANCES.
CORES = {"trn2.48xlarge": ("trn2", 64), "trn2.3xlarge": ("trn2", 4), "trn1.32xlarge": ("trn1", 32),
         "inf2.48xlarge": ("inf2", 24), "trn1.2xlarge": ("trn1", 2)}


@pytest.mark.parametrize("instance", CORES)
def test_default_degree_is_the_largest_valid_one_within_the_machines_cores(instance, tmp_path, monkeypatch, caplog):
    """optimum-neuron's default (all the cores) is no valid degree on the big instances; the export takes the largest
    valid degree <= the cores and says so. The core count is patched: no Neuron device here."""
    from optimum_qwen35.optimum_neuron import modeling

    target, cores = CORES[instance]
    monkeypatch.setattr(modeling, "_available_neuron_cores", lambda: cores)
    real = tmp_path / "0.8b"  # a real config: 8 attention heads, 2 KV heads, 16 DeltaNet key heads
    real.mkdir()
    shutil.copy(FIXTURES.parent / "qwen3.5-0.8b.config.json", real / "config.json")
    for folder, valid in ((real, [1, 2, 4, 8]), (FIXTURES / "tiny-2b", [1, 2, 4])):
        caplog.clear()
        with caplog.at_level("WARNING", logger=modeling.__name__):
            neuron_config = Qwen35NeuronModelForCausalLM.get_neuron_config(folder, target=target)
        expected = max(t for t in valid if t <= cores)
        assert neuron_config.tp_degree == expected, (instance, folder.name)
        assert [r.getMessage() for r in caplog.records] == [
            f"tensor_parallel_size not given: using {expected}, the largest degree <= this machine's {cores} Neuron "
            f"cores that splits the model by whole heads (valid degrees: {valid}); pass tensor_parallel_size to "
            "choose another"
        ]
    # A degree the user gives is kept (no log line), and refused in one line when the model does not split by it.
    caplog.clear()
    assert Qwen35NeuronModelForCausalLM.get_neuron_config(real, target=target, tensor_parallel_size=1).tp_degree == 1
    assert not caplog.records
    with pytest.raises(UsageError, match=r"tensor_parallel_size=3 does not split this model .* Valid degrees: \[1, 2, 4, 8\]"):
        Qwen35NeuronModelForCausalLM.get_neuron_config(real, target=target, tensor_parallel_size=3)


def test_default_degree_without_neuron_cores(monkeypatch):
    from optimum_qwen35.optimum_neuron import modeling

    monkeypatch.setattr(modeling, "_available_neuron_cores", lambda: 0)
    with pytest.raises(UsageError, match=r"no Neuron cores .*to size a trn2 export by: pass tensor_parallel_size"):
        Qwen35NeuronModelForCausalLM.get_neuron_config(FIXTURES / "tiny-2b", target="trn2")


def cli(*args):
    return subprocess.run([sys.executable, "-m", "optimum_qwen35", *map(str, args)], capture_output=True, text=True, timeout=600)


def error_lines(stderr: str) -> list[str]:
    """What the command printed, less optimum-neuron's own import-time notices on a machine without Neuron."""
    noise = ("No major for neuron device", "warnings.warn(", "UserWarning: It seems this is running on a CPU-only machine")
    return [line for line in stderr.splitlines() if line.strip() and not any(n in line for n in noise)]


def test_cli_export_writes_the_same_folder_and_errors_are_one_line(export_dir, tmp_path):
    out = tmp_path / "cli-export"
    result = cli("export", "--model", FIXTURES / "tiny-2b", "--task", "text-generation", "--batch_size", 2,
                 "--sequence_length", 128, "--tensor_parallel_size", 1, "--torch_dtype", "float32", "--target", "cpu", out)
    assert result.returncode == 0, result.stderr[-3000:]
    reference = export_dir("tiny-2b", 1)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == sorted(p.relative_to(reference).as_posix() for p in reference.rglob("*"))
    assert json.loads((out / "neuron_config.json").read_text()) == json.loads((reference / "neuron_config.json").read_text())

    again = cli("export", "--model", FIXTURES / "tiny-2b", "--sequence_length", 128, out)
    assert again.returncode == 2  # a usage error, as for `shard`
    assert error_lines(again.stderr) == [
        f"optimum-qwen35: error: {out.absolute()} already holds an exported model: choose an empty folder, or pass --overwrite to replace it"
    ]
    bad_tp = cli("export", "--model", FIXTURES / "tiny-2b", "--tensor_parallel_size", 3, tmp_path / "x")
    assert bad_tp.returncode == 2 and "Traceback" not in bad_tp.stderr
    assert len(error_lines(bad_tp.stderr)) == 1 and "Valid degrees: [1, 2, 4]" in bad_tp.stderr
    assert not (tmp_path / "x").exists()


def test_cli_help_lists_each_command_once_and_every_option_has_help():
    top = cli("--help").stdout
    for command in ("demo", "export", "generate", "shard", "build-tiny"):
        assert sum(line.split()[0] == command for line in top.splitlines() if line.strip()) == 1, command
    export_help = cli("export", "--help").stdout
    for option in ("--model", "--batch_size", "--sequence_length", "--tensor_parallel_size", "--torch_dtype", "--target", "--overwrite"):
        assert option in export_help


def test_every_option_of_every_command_has_help():
    import argparse

    from optimum_qwen35 import cli

    parsers = []
    real = argparse.ArgumentParser.parse_args

    def capture(self, *args, **kwargs):
        parsers.append(self)
        raise SystemExit(0)

    argparse.ArgumentParser.parse_args = capture
    try:
        with pytest.raises(SystemExit):
            cli.main([])
    finally:
        argparse.ArgumentParser.parse_args = real

    def undocumented(parser, prefix=""):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from undocumented(sub, f"{prefix}{name} ")
            elif not action.help and not isinstance(action, argparse._HelpAction):
                yield f"{prefix}{action.option_strings or action.dest}"

    assert list(undocumented(parsers[0])) == []
