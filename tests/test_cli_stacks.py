"""`optimum-qwen35 export` on both stacks (issue 48 item 2, issue 50 item 3): optimum-cli's spellings (`--instance_type`,
`--auto_cast_type`, `-m`, every long flag as `--a_b` and `--a-b`) listed by `--help` and parsed to the same arguments;
where optimum-neuron is absent (the TorchNeuron stack: the `reference` and `torchneuron` sessions), what needs the NxD
stack is refused in one line naming the stack, its Python and its extra, before anything is written, and nothing
says "a bug"; and optimum-cli's `export neuron` from this package's register file is there unless optimum-neuron's
own command is (keyed on optimum-neuron, not on torch-neuronx, whose name TorchNeuron's package carries)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from optimum_qwen35.cli import export_parser, main
from optimum_qwen35.cli import export as cli_export
from optimum_qwen35.cli import optimum_cli

from .conftest import FIXTURES

TINY = str(FIXTURES / "tiny-2b")
NO_OPTIMUM_NEURON = importlib.util.find_spec("optimum.neuron") is None if importlib.util.find_spec("optimum") else True
without_optimum_neuron = pytest.mark.skipif(not NO_OPTIMUM_NEURON, reason="the TorchNeuron stack's behaviour: "
                                            "optimum-neuron must be absent (the reference and torchneuron sessions)")


def _one_line(capsys, argv, status: int) -> str:
    assert main(argv) == status
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_export_help_lists_both_spellings_of_every_flag(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["export", "--help"])
    assert exit.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for flag in ("-m", "--model", "--instance_type", "--instance-type", "--target", "--auto_cast_type",
                 "--auto-cast-type", "--batch_size", "--batch-size", "--sequence_length", "--sequence-length",
                 "--tensor_parallel_size", "--tensor-parallel-size", "--num_cores", "--torch_dtype", "--torch-dtype",
                 "--neuron_backend", "--neuron-backend", "--image_buckets", "--image-buckets"):
        assert f" {flag} " in f" {text} " or f" {flag}," in text, flag


@pytest.mark.parametrize("spelling", [
    ["-m", TINY, "--instance_type", "trn2", "--auto_cast_type", "bf16", "--batch_size", "2", "--num_cores", "2"],
    ["--model", TINY, "--instance-type", "trn2", "--auto-cast-type", "bf16", "--batch-size", "2", "--num-cores", "2"],
    ["--model", TINY, "--target", "trn2", "--torch_dtype", "bfloat16", "--batch_size=2", "--tensor-parallel-size=2"],
])
def test_optimum_cli_spellings_parse_to_the_same_export(spelling):
    args = export_parser().parse_args([*spelling, "out/"])
    assert (args.model, args.target, args.batch_size, args.tensor_parallel_size, cli_export.export_dtype(args)) == (
        TINY, "trn2", 2, 2, "bfloat16")


def test_auto_cast_type_and_torch_dtype_that_disagree_are_refused_in_one_line(capsys, tmp_path):
    line = _one_line(capsys, ["export", "-m", TINY, "--auto_cast_type", "fp32", "--torch_dtype", "bfloat16",
                              str(tmp_path / "out")], 2)
    assert line == ("optimum-qwen35: error: --auto_cast_type fp32 (float32) and --torch_dtype bfloat16 disagree: "
                    "give one")
    assert not (tmp_path / "out").exists()


def test_an_auto_cast_type_qwen35_does_not_export_in_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["export", "-m", TINY, "--auto_cast_type", "fp16", "out/"])
    assert exit.value.code == 2
    assert "--auto_cast_type" in capsys.readouterr().err


@without_optimum_neuron
@pytest.mark.parametrize("flags, what", [
    (["--instance_type", "trn1"], "--instance_type trn1"),
    (["--instance-type", "inf2"], "--instance_type inf2"),
    (["--target", "trn1n"], "--instance_type trn1n"),
    (["--instance_type", "trn2", "--neuron_backend", "nxd"], "--neuron_backend nxd"),
])
def test_nxd_stack_exports_name_the_stack_python_and_extra_without_optimum_neuron(capsys, tmp_path, flags, what):
    line = _one_line(capsys, ["export", "-m", TINY, *flags, str(tmp_path / "out")], 2)
    assert line.startswith(f"optimum-qwen35: error: {what} needs the NxD stack: Python 3.10 or 3.11 with "
                           "optimum-neuron 0.4.5 (pip install \"optimum-qwen35[optimum]\"")
    assert "TorchNeuron stack" in line and "trn2" in line and "a bug" not in line
    assert not (tmp_path / "out").exists()


@without_optimum_neuron
def test_optimum_neuron_commands_name_the_stack_they_need_without_optimum_neuron(capsys):
    line = _one_line(capsys, ["cache", "lookup", "Qwen/Qwen3.5-2B"], 1)
    assert "optimum-neuron" in line and "a bug" not in line


@without_optimum_neuron
def test_optimum_cli_export_neuron_is_provided_whatever_torch_neuronx_says(monkeypatch):
    """TorchNeuron's package is named torch-neuronx: its presence must not hand `export neuron` to an optimum-neuron
    that is not installed. find_spec answers for a real `torch_neuronx` package put on sys.path."""
    pytest.importorskip("optimum.commands.base", reason="optimum's CLI (the torchneuron session installs optimum 2.x)")
    assert not optimum_cli.optimum_neuron_command_registered()
    assert [command.COMMAND.name for command, _ in optimum_cli._commands()] == ["neuron"]


@without_optimum_neuron
def test_optimum_cli_export_neuron_for_trn1_names_the_nxd_stack(tmp_path):
    """Through optimum-cli itself (its register file, as installed), with a `torch_neuronx` package importable as on a
    TorchNeuron instance: one line, exit 2, the NxD stack named and a command that runs here suggested."""
    optimum_cli_path = shutil.which("optimum-cli", path=str(Path(sys.executable).parent))
    if optimum_cli_path is None:
        pytest.skip("optimum-cli is not installed in this environment (the torchneuron session installs optimum 2.x)")
    fake_sdk = tmp_path / "site"
    (fake_sdk / "torch_neuronx").mkdir(parents=True)
    (fake_sdk / "torch_neuronx" / "__init__.py").write_text("# stands for TorchNeuron's torch-neuronx: only its name\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake_sdk), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([optimum_cli_path, "export", "neuron", "--model", TINY, "--instance_type", "trn1",
                             str(tmp_path / "out")], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("optimum-cli export neuron: error: --instance_type trn1 needs the "
                                                   "NxD stack: Python 3.10 or 3.11"), lines
    assert "--instance_type cpu" in lines[0] and not (tmp_path / "out").exists()
    help_text = subprocess.run([optimum_cli_path, "export", "neuron", "--help"], capture_output=True, text=True,
                               timeout=300, env=env)
    assert help_text.returncode == 0 and "--instance_type" in help_text.stdout
