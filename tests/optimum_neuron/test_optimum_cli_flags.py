"""optimum-neuron's own flags on `optimum-cli export neuron` without the Neuron SDK (issue 42, item 7):
`--auto_cast_type bf16` (optimum-neuron's README, most Neuron model cards) gives a bfloat16 export and says so, a
type Qwen3.5 cannot export in is refused in one line; `--overwrite`, which the export's own error names, is taken;
`--help` / `-h` print the help and exit 0; every error starts with the command the user typed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("optimum.neuron", reason="needs optimum-neuron (the nox `optimum` session)")

from optimum_qwen35.cli import optimum_cli  # noqa: E402

from ..conftest import FIXTURES  # noqa: E402

TINY = str(FIXTURES / "tiny-2b")
PREFIX = "optimum-cli export neuron: error: "


def _one_error_line(capsys, arguments) -> str:
    try:
        status = optimum_cli.run(arguments)
    except SystemExit as exit:  # argparse's usage errors (optimum-cli exits with the same status)
        status = exit.code
    assert status == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(PREFIX), lines
    return lines[0]


@pytest.mark.parametrize("given, dtype", [("bf16", "bfloat16"), ("fp32", "float32")])
def test_auto_cast_type_becomes_the_dtype(given, dtype):
    export, _, kept = optimum_cli.translate(["--model", TINY, "--auto_cast_type", given, "--instance_type", "cpu", "out/"])
    assert export == ["--model", TINY, "--torch_dtype", dtype, "out/"]
    assert kept == ["--model", TINY, "--torch_dtype", dtype, "out/"]  # what a suggested cpu command carries
    # agreeing with --torch_dtype: one dtype
    export, _, _ = optimum_cli.translate(["--model", TINY, f"--auto_cast_type={given}", "--torch_dtype", dtype, "out/"])
    assert export.count("--torch_dtype") == 1 and export[export.index("--torch_dtype") + 1] == dtype


@pytest.mark.parametrize("arguments, says", [
    (["--auto_cast_type", "fp16"], "--auto_cast_type fp16: Qwen3.5 exports in bfloat16 or float32"),
    (["--auto_cast_type", "tf32"], "--auto_cast_type tf32: Qwen3.5 exports in bfloat16 or float32"),
    (["--auto_cast_type", "bf16", "--torch_dtype", "float32"], "--auto_cast_type bf16 (bfloat16) and --torch_dtype float32"),
])
def test_an_auto_cast_type_the_export_cannot_honour_is_one_line(capsys, arguments, says):
    line = _one_error_line(capsys, ["--model", TINY, *arguments, "--instance_type", "cpu", "out/"])
    assert says in line, line


def test_a_cpu_export_with_auto_cast_type_bf16_is_bfloat16(capsys, tmp_path):
    out = tmp_path / "out"
    assert optimum_cli.run(["--model", TINY, "--batch_size", "1", "--sequence_length", "64", "--auto_cast_type", "bf16",
                            "--instance_type", "cpu", str(out)]) == 0
    err = capsys.readouterr().err
    assert "--auto_cast_type bf16: exporting in bfloat16 (--torch_dtype bfloat16)" in err
    assert json.loads((out / "neuron_config.json").read_text())["torch_dtype"] in ("bfloat16", "bf16")


def test_the_overwrite_the_error_names_is_accepted(capsys, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    line = _one_error_line(capsys, ["--model", TINY, "--instance_type", "cpu", str(out)])
    assert "--overwrite" in line
    export, _, kept = optimum_cli.translate(["--model", TINY, "--overwrite", "--instance_type", "cpu", str(out)])
    assert "--overwrite" in export and "--overwrite" in kept


def test_export_errors_name_the_command_typed(capsys, tmp_path):
    line = _one_error_line(capsys, ["--model", TINY, "--batch_size", "two", "--instance_type", "cpu", str(tmp_path / "o")])
    assert "--batch_size" in line and "optimum-qwen35" not in line, line
    line = _one_error_line(capsys, ["--model", TINY, "--tensor_parallel_size", "3", "--instance_type", "cpu",
                                    str(tmp_path / "o")])
    assert "does not split this model" in line and "optimum-qwen35" not in line, line


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_and_exits_0(capsys, flag):
    assert optimum_cli.run([flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: optimum-cli export neuron ")
    for name in ("--model", "--instance_type", "--auto_cast_type", "--overwrite", "--torch_dtype"):
        assert name in out


def test_help_through_optimum_cli_itself():
    """The installed command (the optimum session installs the register file a regular install places)."""
    optimum_cli_path = __import__("shutil").which("optimum-cli", path=str(__import__("pathlib").Path(sys.executable).parent))
    if optimum_cli_path is None:
        pytest.skip("no optimum-cli beside this interpreter")
    for flag in ("--help", "-h"):
        result = subprocess.run([optimum_cli_path, "export", "neuron", flag], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.startswith("usage: optimum-cli export neuron ")
