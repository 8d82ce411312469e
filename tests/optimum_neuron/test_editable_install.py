"""`pip install -e .` registers Qwen3.5 as a regular install does (issue 42, item 4): its editable wheel carries the
`optimum_qwen35.pth` start-up file and optimum-cli's `register_optimum_qwen35.py` (setup.py).

The editable install goes into a fresh virtual environment that sees this session's packages without any file of this
package: a `.pth` line puts a copy of this session's site-packages on its path (a plain path entry: the `.pth` files
there are not run), the copy being symlinks with everything this package installs left out. So what registers in it
comes from the editable install alone (before setup.py added the two files, nothing did: optimum-cli answered
"unrecognized arguments: neuron" and optimum.neuron did not know Qwen3.5)."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytest.importorskip("optimum.neuron", reason="needs optimum-neuron (the nox `optimum` session)")

from .conftest import last_json_line  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
REGISTER_FILE = Path("optimum", "commands", "register", "register_optimum_qwen35.py")


def _ours(relative: Path) -> bool:
    """A file or folder of site-packages that this package installs (regular or editable) or the nox session adds."""
    name = relative.parts[0]
    return (relative == REGISTER_FILE or name == "optimum_qwen35.pth" or name.startswith("optimum_qwen35-")
            or (name.startswith("__editable__") and "optimum_qwen35" in name))


def _mirror(source: Path, target: Path, relative: Path = Path()) -> None:
    """Symlink every entry of source into target, except this package's; the folders on the way to one of its files
    (optimum/commands/register) are made, their other entries linked."""
    target.mkdir()
    for entry in sorted(source.iterdir()):
        path = relative / entry.name
        if _ours(path):
            continue
        if entry.is_dir() and not entry.is_symlink() and REGISTER_FILE.parts[: len(path.parts)] == path.parts:
            _mirror(entry, target / entry.name, path)
        else:
            (target / entry.name).symlink_to(entry)


REGISTERED = """
import json
from optimum.neuron import NeuronModelForCausalLM  # noqa: F401
from optimum.neuron.models.auto_model import _REGISTERED_NEURON_MODELS
from transformers import AutoConfig
cls = _REGISTERED_NEURON_MODELS.get(("qwen3_5_text", "text-generation", "inference"))
print(json.dumps([None if cls is None else f"{cls.__module__}.{cls.__qualname__}",
                  type(AutoConfig.for_model("qwen3_5_text")).__name__ if cls else None]))
"""
# optimum-cli as its console script runs it, in the venv's interpreter.
CLI = "import sys; from optimum.commands.optimum_cli import main; sys.argv[0] = 'optimum-cli'; main()"
CLI_ARGS = ["export", "neuron", "--model", str(ROOT / "tests" / "fixtures" / "tiny-2b"), "--batch_size", "1",
            "--sequence_length", "128", "--instance_type", "trn1"]


@pytest.fixture(scope="module")
def editable_venv(tmp_path_factory):
    """A fresh venv with this session's packages (none of this package's files) and `pip install -e` of the checkout;
    its python, its site-packages and what registered before the install. Every interpreter runs outside the
    checkout (`python -c` puts the working folder on the path)."""
    tmp = tmp_path_factory.mktemp("editable")
    _mirror(Path(sysconfig.get_paths()["purelib"]), tmp / "base")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp / "venv")], check=True, timeout=300)
    python = tmp / "venv" / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "zz_base_packages.pth").write_text(f"{tmp / 'base'}\n")  # a path line: base's .pth files are not run
    found = subprocess.run([python, "-c", "import importlib.util; print(importlib.util.find_spec('optimum_qwen35'))"],
                           capture_output=True, text=True, check=True, cwd=tmp)
    assert found.stdout.strip() == "None", "the fresh venv already sees this package"
    before = {"registered": last_json_line(subprocess.run([python, "-c", REGISTERED], capture_output=True, text=True,
                                                          check=True, timeout=600, cwd=tmp).stdout),
              "cli": subprocess.run([python, "-c", CLI, *CLI_ARGS, str(tmp / "out")], capture_output=True, text=True,
                                    timeout=600, cwd=tmp).stderr}
    installed = subprocess.run(
        [python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-e", str(ROOT)],
        capture_output=True, text=True, timeout=600,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    return python, site, before


def test_editable_install_registers_qwen35_in_a_fresh_interpreter(editable_venv):
    """No `import optimum_qwen35` in the program: the editable install's start-up file does it."""
    python, site, _ = editable_venv
    assert (site / "optimum_qwen35.pth").is_file() and (site / REGISTER_FILE).is_file()
    result = subprocess.run([python, "-c", REGISTERED], capture_output=True, text=True, timeout=600, cwd=site)
    assert result.returncode == 0, result.stderr[-3000:]
    assert last_json_line(result.stdout) == ["optimum_qwen35.optimum_neuron.modeling.Qwen35NeuronModelForCausalLM",
                                             "Qwen3_5TextConfig"]


def test_editable_install_has_optimum_cli_export_neuron(editable_venv, tmp_path):
    """`optimum-cli export neuron` exists (without the SDK: this package's command, which answers a Neuron instance
    type with the cpu command), where it used to be "unrecognized arguments: neuron"."""
    python, _, _ = editable_venv
    result = subprocess.run([python, "-c", CLI, *CLI_ARGS, str(tmp_path / "out")], capture_output=True, text=True,
                            timeout=600, cwd=tmp_path)
    assert "unrecognized arguments" not in result.stderr, result.stderr[-3000:]
    assert result.returncode == 2 and "needs the Neuron SDK" in result.stderr, result.stderr[-3000:]
    assert "--instance_type cpu" in result.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()


def test_without_the_editable_install_the_same_venv_registers_nothing(editable_venv):
    """The checks above would pass for nothing if the copied site-packages registered by itself: before the editable
    install, the same venv (optimum-neuron, transformers 4.57, no file of this package) did not."""
    _, _, before = editable_venv
    assert before["registered"] == [None, None]
    assert "unrecognized arguments: neuron" in before["cli"] or "invalid choice: 'neuron'" in before["cli"], before["cli"]
