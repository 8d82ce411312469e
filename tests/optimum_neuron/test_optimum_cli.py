"""`optimum-cli export neuron` without the Neuron SDK (optimum_qwen35/cli/optimum_cli.py), in process: optimum-neuron's
flags are translated, a Neuron instance type gets one line whose suggested cpu command passes the export's own
checks, and a command that would fail is refused with the export's own message instead of being suggested."""

from __future__ import annotations

import shlex

import pytest

pytest.importorskip("optimum.neuron", reason="needs optimum-neuron (the nox `optimum` session)")

from optimum_qwen35.cli import optimum_cli  # noqa: E402
from optimum_qwen35.cli import check_export, export_parser  # noqa: E402

from ..conftest import FIXTURES  # noqa: E402

TINY = str(FIXTURES / "tiny-2b")  # 8 attention heads, 2 KV heads, 4 DeltaNet key heads: TP 1, 2 or 4


def _refusal(capsys, arguments) -> str:
    assert optimum_cli.run(arguments) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_optimum_neuron_flags_become_the_cpu_export_flags():
    export, instance, kept = optimum_cli.translate(
        ["--model", TINY, "--task", "auto", "--batch_size", "2", "--sequence_length=256", "--num_cores", "2",
         "--auto_cast_type", "bf16", "-O1", "--torch_dtype", "bfloat16", "--instance_type", "trn2", "out/"])
    assert instance == "trn2"
    assert export == ["--model", TINY, "--task", "text-generation", "--batch_size", "2", "--sequence_length", "256",
                      "--tensor_parallel_size", "2", "--torch_dtype", "bfloat16", "out/"]
    assert "--auto_cast_type" not in kept and "-O1" not in kept and "--instance_type" not in kept


@pytest.mark.parametrize("arguments, says", [
    (["--model", TINY, "--subfolder", "x", "--instance_type", "cpu", "out/"], "--subfolder is not an option"),
    (["--model", TINY, "--torch_dtype", "float16", "--instance_type", "cpu", "out/"], "float16"),
    (["--model", TINY, "--instance_type", "inf1", "out/"], "--instance_type inf1: choose cpu or one of"),
    (["--model", TINY, "--instance_type", "cpu"], "required: output"),
])
def test_what_the_cpu_export_cannot_take_is_one_line(capsys, arguments, says):
    assert says in _refusal(capsys, arguments)


@pytest.mark.parametrize("instance", ["trn1", "inf2", None])
def test_a_neuron_instance_type_without_the_sdk_gives_a_cpu_command_that_passes_the_checks(capsys, tmp_path, instance):
    out = str(tmp_path / "out")
    arguments = ["--model", TINY, "--batch_size", "1", "--sequence_length", "128", "--tensor_parallel_size", "2",
                 "--auto_cast_type", "bf16", *(["--instance_type", instance] if instance else []), out]
    line = _refusal(capsys, arguments)
    assert line.startswith("optimum-cli export neuron: error: ") and "needs the Neuron SDK" in line
    command = shlex.split(line.split("export Qwen3.5 for the cpu target: ")[1])
    assert command[:3] == ["optimum-cli", "export", "neuron"] and command[-2:] == ["--instance_type", "cpu"]
    export, suggested, _ = optimum_cli.translate(command[3:])
    assert suggested == "cpu" and "--auto_cast_type" not in command
    check_export(export_parser().parse_args([*export, "--target", "cpu"]))  # what the export checks first


@pytest.mark.parametrize("arguments, says", [
    (["--tensor_parallel_size", "3"], "tensor_parallel_size=3 does not split this model"),
    (["--batch_size", "0"], "batch_size must be a positive integer"),
])
def test_a_command_that_would_fail_is_not_suggested(capsys, tmp_path, arguments, says):
    line = _refusal(capsys, ["--model", TINY, *arguments, "--instance_type", "trn1", str(tmp_path / "out")])
    assert says in line and "optimum-cli export neuron --model" not in line


def test_an_occupied_output_folder_is_not_suggested(capsys, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    line = _refusal(capsys, ["--model", TINY, "--instance_type", "trn1", str(tmp_path / "out")])
    assert "needs the Neuron SDK" not in line and "out" in line
